//! Compile check without a GPU: every kernel in `devices/kernels/touchstone.cu` must compile to
//! PTX with NVRTC for the architectures the GPU runners have, so a syntax or type error in a
//! kernel turns CI red on a CPU-only machine. libnvrtc comes from the PyPI wheel
//! `nvidia-cuda-nvrtc-cu12` (found through python3) or `TOUCHSTONE_NVRTC`; where neither exists
//! the test says it was skipped, and fails instead when `TOUCHSTONE_REQUIRE_NVRTC=1` (CI sets it).
#![cfg(feature = "cuda")]

use devices::gpu::{cuda, kernel_names, KERNEL_SOURCE};

/// A file inside an installed `nvidia.<package>` wheel, located through python3 (None when
/// python3 or the wheel is absent).
fn wheel_file(package: &str, relative: &str) -> Option<std::path::PathBuf> {
    let script = format!("import nvidia.{package} as m, os; print(os.path.join(list(m.__path__)[0], '{relative}'))");
    let out = std::process::Command::new("python3").args(["-c", &script]).output().ok()?;
    let path = std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    (out.status.success() && path.is_file()).then_some(path)
}

#[test]
fn every_kernel_compiles_to_ptx_with_nvrtc() {
    if let Some(lib) = wheel_file("cuda_nvrtc", "lib/libnvrtc.so.12") {
        cuda::preload(&lib).unwrap();
    }
    if !cuda::nvrtc_present() {
        let why = "NVRTC compile check SKIPPED: libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12, or set TOUCHSTONE_NVRTC)";
        assert!(std::env::var("TOUCHSTONE_REQUIRE_NVRTC").as_deref() != Ok("1"), "{why}, and TOUCHSTONE_REQUIRE_NVRTC=1");
        println!("{why}");
        return;
    }
    let names = kernel_names();
    assert!(names.len() >= 10, "kernel list looks wrong: {names:?}");
    // A100 (sm_80), H100/H200 (sm_90).
    for arch in ["sm_80", "sm_90"] {
        let ptx = cuda::compile_ptx(KERNEL_SOURCE, arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        for name in &names {
            assert!(ptx.contains(&format!(".entry {name}(")), "{arch}: kernel {name} missing from the PTX");
        }
        println!("NVRTC compile check RAN: {} kernels -> {} bytes of PTX for {arch}", names.len(), ptx.len());
        assemble(&ptx, arch);
    }
}

/// Assembles the PTX to machine code with ptxas (PyPI `nvidia-cuda-nvcc-cu12`), which checks
/// what NVRTC passes through unchecked (inline assembly, register and shared-memory limits).
fn assemble(ptx: &str, arch: &str) {
    let Some(ptxas) = wheel_file("cuda_nvcc", "bin/ptxas") else {
        let why = "ptxas check SKIPPED: pip install nvidia-cuda-nvcc-cu12";
        assert!(std::env::var("TOUCHSTONE_REQUIRE_NVRTC").as_deref() != Ok("1"), "{why}, and TOUCHSTONE_REQUIRE_NVRTC=1");
        println!("{why}");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (src, out) = (dir.path().join("k.ptx"), dir.path().join("k.cubin"));
    std::fs::write(&src, ptx).unwrap();
    let o = std::process::Command::new(&ptxas).arg(format!("-arch={arch}")).arg(&src).arg("-o").arg(&out).output().unwrap();
    assert!(o.status.success(), "ptxas {arch}: {}", String::from_utf8_lossy(&o.stderr));
    println!("ptxas check RAN: {} bytes of {arch} machine code", std::fs::metadata(&out).unwrap().len());
}
