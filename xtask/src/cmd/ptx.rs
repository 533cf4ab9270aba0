//! `cargo xtask ptx` (feature `cuda`): compiles the GPU kernels to PTX with NVRTC into the PTX
//! cache, so a GPU machine that has a driver but no NVRTC (or no network to install it) can run
//! `cuda` with PTX compiled here: copy the directory and set `TOUCHSTONE_PTX_CACHE` there.

use crate::Exit;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct PtxArgs {
    /// Target architectures, e.g. sm_80 (A100), sm_90 (H100/H200).
    #[arg(long, default_values_t = ["sm_80".to_string(), "sm_90".to_string()])]
    arch: Vec<String>,
    /// The cache directory to fill (default `TOUCHSTONE_PTX_CACHE`, else the system temp directory).
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn main(a: PtxArgs) -> Result<u8, Exit> {
    if let Some(out) = &a.out {
        std::fs::create_dir_all(out).map_err(|e| super::io_exit(out, e))?;
        // The process is single-threaded here (no device opened, no rayon work yet).
        std::env::set_var("TOUCHSTONE_PTX_CACHE", out);
    }
    let kernels = devices::gpu::kernel_source().map_err(|e| Exit::new(2, e))?;
    for arch in &a.arch {
        let ptx = devices::gpu::cuda::cached_ptx(&kernels, arch).map_err(|e| Exit::new(2, format!("{arch}: {e}")))?;
        outln!("{arch}: {} bytes of PTX in {}", ptx.len(), devices::gpu::cuda::ptx_cache_path(&kernels, arch).display());
    }
    Ok(0)
}
