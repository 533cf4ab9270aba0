//! The GPU devices: `cuda[:N]` (feature `cuda`), `rocm[:N]` (feature `rocm`) and `gpu-emu`, which
//! runs the very same kernel source on the host.
//!
//! One kernel codebase (`devices/kernels/touchstone.cu`) serves every platform through a small
//! prelude (`prelude_gpu.h` + `prelude_{cuda,hip}.h`, or `prelude_host.h`), as ggml's HIP build
//! reuses its CUDA sources. A
//! [`Backend`] is the little a platform must provide: memory, copies, compiled kernels and a
//! launch by name. Everything above it — the op launches ([`Gpu`]), the kernel-suite device
//! ([`GpuDevice`]) and whole-model runs with a device-resident KV cache ([`model::GpuModel`]) — is
//! shared, so what the emulator verifies on a CPU-only machine is the code a GPU runs, less the
//! platform's compiler and hardware.

pub mod emu;
mod cache;
mod mla;
pub mod model;
mod recurrent;
mod serve;
mod ssm;
mod device;
pub use device::GpuDevice;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "rocm")]
pub mod hip;

use crate::{Device, DeviceError};
use oracle::quant::GgmlType;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The kernel source shared by every platform, as built into the binary: the core kernels, then
/// the recurrent layers' (`recurrent.cu`) and latent attention's (`latent.cu`), which use the
/// core's helpers.
pub const KERNEL_SOURCE: &str = concat!(include_str!("../../kernels/touchstone.cu"), include_str!("../../kernels/recurrent.cu"), include_str!("../../kernels/latent.cu"));
/// The prelude CUDA and ROCm share, then each platform's own.
pub const PRELUDE_GPU: &str = include_str!("../../kernels/prelude_gpu.h");
pub const PRELUDE_CUDA: &str = include_str!("../../kernels/prelude_cuda.h");
pub const PRELUDE_HIP: &str = include_str!("../../kernels/prelude_hip.h");

/// The kernel source the backends compile: the built-in one, or the file named by
/// `TOUCHSTONE_KERNEL_SOURCE` (iterate on a kernel without rebuilding Touchstone, or check that
/// the gates catch a deliberately broken one).
pub fn kernel_source() -> Result<String, String> {
    match std::env::var_os("TOUCHSTONE_KERNEL_SOURCE") {
        Some(path) => std::fs::read_to_string(&path).map_err(|e| format!("TOUCHSTONE_KERNEL_SOURCE={}: {e}", std::path::Path::new(&path).display())),
        None => Ok(KERNEL_SOURCE.to_string()),
    }
}

/// The names of the kernels in `source` (every `__global__` function).
pub fn kernel_names_in(source: &str) -> Vec<String> {
    source.split("__global__ void ").skip(1).filter_map(|rest| rest.split('(').next()).map(|n| n.trim().to_string()).collect()
}

/// The names of the built-in kernels.
pub fn kernel_names() -> Vec<String> {
    kernel_names_in(KERNEL_SOURCE)
}

/// The most tokens one matmul launch multiplies (the kernel's register tile).
pub const MAX_TOKENS_PER_LAUNCH: usize = 8;

/// Which matmul kernel a weight matrix takes and how many threads share one of its rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MatmulPlan {
    pub kernel: &'static str,
    /// Threads per weight row: a power of two, at most the block size.
    pub lanes: u32,
    /// Threads per block.
    pub block: u32,
}

impl MatmulPlan {
    /// Weight rows one block holds.
    pub fn rows_per_block(&self) -> u32 {
        self.block / self.lanes
    }

    /// The plan as launched for `m` tokens: one token takes the kernel's one-token variant (one
    /// sum per thread instead of eight; for float weights also the next batch of loads in flight
    /// while the current one is multiplied), which gives the same bits.
    pub fn for_tokens(self, m: usize) -> MatmulPlan {
        let kernel = match (self.kernel, m) {
            ("ts_matmul_v", 1) => "ts_matmul_v1",
            ("ts_matmul_q", 1) => "ts_matmul_q1",
            (k, _) => k,
        };
        MatmulPlan { kernel, ..self }
    }
}

impl std::fmt::Display for MatmulPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rows = self.rows_per_block();
        write!(f, "{}: {} threads per row, {rows} row{} per {}-thread block", self.kernel, self.lanes, if rows == 1 { "" } else { "s" }, self.block)
    }
}

/// The plan for a `[_, cols]` matrix of `ty` whose packed rows are `row_bytes` long (a float
/// row holds exactly its values, so for float types `row_bytes % 16 == 0` is a row of whole
/// 16-byte units); `aligned`: the weights and `x` start 16-byte aligned and x's rows are a
/// multiple of 16 bytes apart. Packed types take 32-element chunks (`ts_matmul_q`); float types
/// 16-byte units (`ts_matmul_v`) when the rows allow aligned 16-byte loads, else single elements
/// (`ts_matmul`). Each row gets as many lanes as it has units, rounded up to a power of two and
/// capped at the block: a long row keeps the whole block (each thread then loads several units
/// at once), a short one shares it with other rows.
pub fn matmul_plan(ty: GgmlType, cols: usize, row_bytes: usize, aligned: bool, block: u32) -> MatmulPlan {
    let (kernel, units) = if !crate::shared::qdot::is_float(ty) {
        ("ts_matmul_q", cols / 32)
    } else if aligned && row_bytes.is_multiple_of(16) {
        ("ts_matmul_v", row_bytes / 16)
    } else {
        ("ts_matmul", cols)
    };
    let cap = match kernel {
        "ts_matmul_q" => MAX_LANES_Q,
        "ts_matmul_v" => MAX_LANES_V,
        _ => block,
    };
    MatmulPlan { kernel, lanes: (units.max(1).next_power_of_two() as u32).min(cap).min(block), block }
}

/// The kernel a matmul kernel is a variant of: `ts_matmul_v1` and `ts_matmul_q1` are the
/// one-token forms of `ts_matmul_v` and `ts_matmul_q`, `ts_matmul_v1b2` the one-token float form
/// with half the loads per batch (the roofline times it); each gives the same sums, and each
/// multiplies one token only.
pub fn variant_of(kernel: &str) -> &str {
    match kernel {
        "ts_matmul_v1" | "ts_matmul_v1b2" => "ts_matmul_v",
        "ts_matmul_q1" => "ts_matmul_q",
        k => k,
    }
}

/// Floats of x `ts_matmul_q` stages in shared memory at a time (`TS_XTILE` in the kernel source).
pub const XTILE_FLOATS: u32 = 8192;

/// Most threads per row for packed weights: every block stages all of x, so a block should hold
/// several rows to share that read. On an H200 (docs/BENCHMARKS.md) 16 lanes, 16 rows per block,
/// read fastest for every packed type timed (Q4_0 8192 wide: 972 GB/s; 8 lanes 795, 32 lanes 946).
const MAX_LANES_Q: u32 = 16;

/// Most threads per row for float weights: on an H200 an F16 row 8192 wide read at 91% of the
/// copy bandwidth with 32 lanes and 71% with a whole 256-thread block (whose reduction waits on
/// every load of the row); F32 differed by a few percent.
const MAX_LANES_V: u32 = 32;

/// Shared memory a launch may ask for (the portable 48 KiB).
const MAX_SHARED_BYTES: usize = 48 * 1024;

/// A kernel argument, passed by value as cuLaunchKernel / hipModuleLaunchKernel take them.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// A device address (0 = null).
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl Arg {
    /// Each argument's value in its own 8-byte slot, as a launch's parameter array points to
    /// them (every parameter type the kernels use fits in 8 bytes; each is written at its size).
    pub fn pack(args: &[Arg]) -> Vec<[u8; 8]> {
        args.iter()
            .map(|a| {
                let mut v = [0u8; 8];
                match *a {
                    Arg::Ptr(p) => v.copy_from_slice(&p.to_ne_bytes()),
                    Arg::I64(x) => v.copy_from_slice(&x.to_ne_bytes()),
                    Arg::I32(x) => v[..4].copy_from_slice(&x.to_ne_bytes()),
                    Arg::F32(x) => v[..4].copy_from_slice(&x.to_ne_bytes()),
                }
                v
            })
            .collect()
    }
}

/// What a GPU platform provides. Addresses are plain integers (a CUdeviceptr, a HIP pointer, a
/// host address in the emulator); [`DevBuf`] owns them.
pub trait Backend: Send + Sync {
    /// `cuda:0`, `rocm:0`, `gpu-emu`.
    fn name(&self) -> String;
    /// The hardware and driver, for reports (`NVIDIA H200, sm_90, driver 12.8`).
    fn describe(&self) -> String;
    /// Threads per block for the kernels (a power of two).
    fn block_size(&self) -> u32;
    fn alloc(&self, bytes: usize) -> Result<u64, GpuError>;
    fn free(&self, ptr: u64);
    fn upload(&self, ptr: u64, data: &[u8]) -> Result<(), GpuError>;
    fn download(&self, ptr: u64, out: &mut [u8]) -> Result<(), GpuError>;
    fn launch(&self, kernel: &str, grid: [u32; 3], block: [u32; 3], shared_bytes: u32, args: &[Arg]) -> Result<(), GpuError>;
    fn synchronize(&self) -> Result<(), GpuError>;
    /// Device seconds taken by the work `f` queues: CUDA/HIP events around it on GPUs, the wall
    /// clock in the emulator.
    fn time(&self, f: &mut dyn FnMut() -> Result<(), GpuError>) -> Result<f64, GpuError>;
    /// Why this backend's timings say nothing about a GPU's speed (the emulator); None on GPUs.
    fn timings_not_of_hardware(&self) -> Option<String> {
        None
    }
}

/// A backend with memory accounting and a cache of freed buffers. Device allocation and release
/// are slow (and a release synchronizes the device on CUDA), while a model's forward pass frees
/// and allocates the same activation sizes every token; dropped buffers up to `POOL_MAX_BUF`
/// bytes are kept by size and handed out again.
pub struct Gpu {
    pub backend: Box<dyn Backend>,
    /// Device bytes allocated from the backend and not yet released (live + cached).
    held: AtomicU64,
    peak: AtomicU64,
    /// Kernel launches so far (every launch goes through [`Gpu::launch`]).
    launches: AtomicU64,
    /// While a profile runs: per kernel, launches and seconds (each launch timed alone).
    profiling: std::sync::atomic::AtomicBool,
    profile: std::sync::Mutex<std::collections::BTreeMap<String, (u64, f64)>>,
    pool: std::sync::Mutex<std::collections::HashMap<usize, Vec<u64>>>,
}

/// Buffers larger than this go straight back to the backend (weights, big probes).
const POOL_MAX_BUF: usize = 64 << 20;

/// Device memory owned by one value; freed on drop.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
    gpu: Arc<Gpu>,
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.bytes <= POOL_MAX_BUF {
            self.gpu.pool.lock().unwrap_or_else(|e| e.into_inner()).entry(self.bytes).or_default().push(self.ptr);
        } else {
            self.gpu.backend.free(self.ptr);
            self.gpu.held.fetch_sub(self.bytes as u64, Ordering::Relaxed);
        }
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        for ptr in self.pool.get_mut().unwrap_or_else(|e| e.into_inner()).drain().flat_map(|(_, v)| v) {
            self.backend.free(ptr);
        }
    }
}

impl DevBuf {
    /// The address `floats` f32 values into the buffer.
    pub fn at_f32(&self, floats: usize) -> u64 {
        self.ptr + 4 * floats as u64
    }
    pub fn download_f32(&self, floats: usize) -> Result<Vec<f32>, GpuError> {
        self.download_f32_at(0, floats)
    }
    pub fn download_f32_at(&self, offset: usize, floats: usize) -> Result<Vec<f32>, GpuError> {
        if 4 * (offset + floats) > self.bytes {
            return Err(format!("download of {floats} floats at {offset} from a {}-byte buffer", self.bytes).into());
        }
        let mut raw = vec![0u8; 4 * floats];
        self.gpu.backend.download(self.at_f32(offset), &mut raw)?;
        Ok(raw.chunks_exact(4).map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]])).collect())
    }
    pub fn download_u32(&self, n: usize) -> Result<Vec<u32>, GpuError> {
        Ok(self.download_f32(n)?.into_iter().map(f32::to_bits).collect())
    }
}

/// Bytes of guard zone on each side of a kernel case's output.
const GUARD_BYTES: usize = 256;
const GUARD_BYTE: u8 = 0xA5;

/// What a GPU call failed with: the kernel's own doing (an out-of-bounds or misaligned access,
/// a shared-memory race found by gpu-emu:racecheck, threads that skip a barrier, a launch that
/// faulted and left the context unusable), or anything else (the call could not be made). A
/// kernel case ending in a [`GpuError::KernelFault`] fails as a wrong result instead of counting
/// as "could not run".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuError {
    KernelFault(String),
    Failed(String),
}

impl std::fmt::Display for GpuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuError::KernelFault(m) => write!(f, "kernel fault: {m}"),
            GpuError::Failed(m) => f.write_str(m),
        }
    }
}

impl From<String> for GpuError {
    fn from(s: String) -> Self {
        GpuError::Failed(s)
    }
}

impl From<&str> for GpuError {
    fn from(s: &str) -> Self {
        GpuError::Failed(s.to_string())
    }
}

/// Where a GPU error meets code that reports errors as text (a model's forward pass).
impl From<GpuError> for String {
    fn from(e: GpuError) -> Self {
        e.to_string()
    }
}

/// Why a kernel case did not produce a result: it could not run, or the kernel is at fault — it
/// wrote outside its output, or a launch ended in a [`GpuError::KernelFault`] (a wrong result,
/// judged as a failure rather than an error).
#[derive(Debug)]
pub enum CaseError {
    Failed(String),
    Wrong(String),
}

impl From<GpuError> for CaseError {
    fn from(e: GpuError) -> Self {
        match e {
            GpuError::KernelFault(_) => CaseError::Wrong(e.to_string()),
            GpuError::Failed(m) => CaseError::Failed(m),
        }
    }
}

impl From<String> for CaseError {
    fn from(s: String) -> Self {
        CaseError::Failed(s)
    }
}

impl From<&str> for CaseError {
    fn from(s: &str) -> Self {
        s.to_string().into()
    }
}

/// A kernel case's output buffer between two guard zones of a known pattern (and NaN inside
/// until written): a kernel that writes outside its output is caught when the result is read.
pub struct Guarded {
    buf: DevBuf,
    pub ptr: u64,
    bytes: usize,
}

impl Guarded {
    /// The first `n` floats, after checking that both guard zones are intact.
    pub fn download_f32(&self, n: usize) -> Result<Vec<f32>, CaseError> {
        for (side, offset) in [("before", 0), ("after", GUARD_BYTES + self.bytes)] {
            let mut zone = vec![0u8; GUARD_BYTES];
            self.buf.gpu.backend.download(self.buf.ptr + offset as u64, &mut zone)?;
            let touched = zone.iter().position(|b| *b != GUARD_BYTE).zip(zone.iter().rposition(|b| *b != GUARD_BYTE));
            if let Some((first, last)) = touched {
                let reach = if side == "before" { GUARD_BYTES - first } else { last + 1 };
                return Err(CaseError::Wrong(format!("a kernel wrote outside its {}-byte output: {side} it, up to {reach} bytes away", self.bytes)));
            }
        }
        Ok(self.buf.download_f32_at(GUARD_BYTES / 4, n)?)
    }
    pub fn download_u32(&self, n: usize) -> Result<Vec<u32>, CaseError> {
        Ok(self.download_f32(n)?.into_iter().map(f32::to_bits).collect())
    }
}

/// A packed weight matrix on the device: `rows` rows of `cols` values, `row_bytes` apart.
pub struct GpuMat {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    pub buf: DevBuf,
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

impl Gpu {
    pub fn new(backend: Box<dyn Backend>) -> Arc<Gpu> {
        Arc::new(Gpu {
            backend,
            held: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            launches: AtomicU64::new(0),
            profiling: Default::default(),
            profile: Default::default(),
            pool: Default::default(),
        })
    }

    /// Kernel launches so far.
    pub fn launches(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }

    /// Launches `kernel` on the backend, counted (and timed while a profile runs).
    fn launch(&self, kernel: &str, grid: [u32; 3], block: [u32; 3], shared_bytes: u32, args: &[Arg]) -> Result<(), GpuError> {
        self.launches.fetch_add(1, Ordering::Relaxed);
        if !self.profiling.load(Ordering::Relaxed) {
            return self.backend.launch(kernel, grid, block, shared_bytes, args);
        }
        let t = self.backend.time(&mut || self.backend.launch(kernel, grid, block, shared_bytes, args))?;
        let mut p = self.profile.lock().unwrap_or_else(|e| e.into_inner());
        let e = p.entry(kernel.to_string()).or_default();
        e.0 += 1;
        e.1 += t;
        Ok(())
    }

    /// Starts timing each launch alone with the backend's timer (device events on GPUs; each
    /// launch then waits for its kernel), dropping any earlier profile.
    pub fn start_profile(&self) {
        self.profile.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.profiling.store(true, Ordering::Relaxed);
    }

    /// Stops the profile and returns it.
    pub fn take_profile(&self) -> crate::KernelProfile {
        self.profiling.store(false, Ordering::Relaxed);
        let p = std::mem::take(&mut *self.profile.lock().unwrap_or_else(|e| e.into_inner()));
        crate::KernelProfile {
            kernels: p.into_iter().map(|(kernel, (launches, seconds))| crate::KernelTime { kernel, launches, seconds }).collect(),
            not_hardware: self.backend.timings_not_of_hardware(),
        }
    }

    /// Device bytes held at most so far (live buffers and the cache of freed ones).
    pub fn peak_bytes(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<DevBuf, GpuError> {
        if let Some(ptr) = self.pool.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&bytes).and_then(Vec::pop) {
            return Ok(DevBuf { ptr, bytes, gpu: self.clone() });
        }
        let ptr = self.backend.alloc(bytes.max(4))?;
        let now = self.held.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        self.peak.fetch_max(now, Ordering::Relaxed);
        Ok(DevBuf { ptr, bytes, gpu: self.clone() })
    }

    pub fn upload(self: &Arc<Self>, data: &[u8]) -> Result<DevBuf, GpuError> {
        let b = self.alloc(data.len())?;
        self.backend.upload(b.ptr, data)?;
        Ok(b)
    }

    /// An output buffer of `bytes` between guard zones (see [`Guarded`]).
    pub fn alloc_guarded(self: &Arc<Self>, bytes: usize) -> Result<Guarded, GpuError> {
        let mut init = vec![GUARD_BYTE; bytes + 2 * GUARD_BYTES];
        init[GUARD_BYTES..GUARD_BYTES + bytes].fill(0xFF);
        self.upload_guarded_bytes(&init, bytes)
    }

    /// `v` in a guarded buffer (an input the kernel updates in place).
    pub fn upload_guarded(self: &Arc<Self>, v: &[f32]) -> Result<Guarded, GpuError> {
        let mut init = vec![GUARD_BYTE; 4 * v.len() + 2 * GUARD_BYTES];
        init[GUARD_BYTES..GUARD_BYTES + 4 * v.len()].copy_from_slice(&f32_bytes(v));
        self.upload_guarded_bytes(&init, 4 * v.len())
    }

    fn upload_guarded_bytes(self: &Arc<Self>, init: &[u8], bytes: usize) -> Result<Guarded, GpuError> {
        let buf = self.upload(init)?;
        Ok(Guarded { ptr: buf.ptr + GUARD_BYTES as u64, buf, bytes })
    }

    pub fn upload_f32(self: &Arc<Self>, v: &[f32]) -> Result<DevBuf, GpuError> {
        self.upload(&f32_bytes(v))
    }

    pub fn upload_u32(self: &Arc<Self>, v: &[u32]) -> Result<DevBuf, GpuError> {
        self.upload(&v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>())
    }

    /// A packed matrix (checked: the bytes must be exactly `rows` rows of `cols` `ty` values).
    pub fn upload_mat(self: &Arc<Self>, ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Result<GpuMat, GpuError> {
        if ty.bytes_for((rows * cols) as u64) != Some(bytes.len() as u64) || rows == 0 || !cols.is_multiple_of(ty.block_size()) {
            return Err(format!("{} bytes are not a [{rows}, {cols}] {} matrix", bytes.len(), ty.name()).into());
        }
        Ok(GpuMat { ty, rows, cols, row_bytes: bytes.len() / rows, buf: self.upload(bytes)? })
    }

    fn bs(&self) -> u32 {
        self.backend.block_size()
    }

    /// One block per row over `rows` rows.
    fn launch_rows(&self, kernel: &str, rows: usize, args: &[Arg]) -> Result<(), GpuError> {
        self.launch(kernel, [rows as u32, 1, 1], [self.bs(), 1, 1], 0, args)
    }

    /// One thread per element over `n` elements.
    fn launch_flat(&self, kernel: &str, n: usize, args: &[Arg]) -> Result<(), GpuError> {
        let bs = self.bs() as usize;
        let blocks = n.div_ceil(bs).max(1);
        self.launch(kernel, [blocks as u32, 1, 1], [bs as u32, 1, 1], 0, args)
    }

    /// The kernel and launch shape `matmul` uses for `w` and an `x` at device address `x`.
    pub fn matmul_plan(&self, w: &GpuMat, x: u64, x_stride: usize) -> MatmulPlan {
        let aligned = w.buf.ptr.is_multiple_of(16) && x.is_multiple_of(16) && x_stride.is_multiple_of(4);
        matmul_plan(w.ty, w.cols, w.row_bytes, aligned, self.bs())
    }

    /// `y[t, :] = x[t, :] W^T` for `m` rows of `x` (`x_stride` floats apart) into `y: [m, rows]`.
    pub fn matmul(&self, w: &GpuMat, x: u64, x_stride: usize, m: usize, y: u64) -> Result<(), GpuError> {
        self.matmul_group(&[(w, y)], x, x_stride, m)
    }

    /// [`Gpu::matmul`] of the same `x` by up to three matrices (Q, K, V; gate, up), each into its
    /// own `y`, in one launch per 8 tokens when their plans share a kernel; otherwise one launch
    /// per matrix. Each output holds the same bits either way.
    pub fn matmul_group(&self, group: &[(&GpuMat, u64)], x: u64, x_stride: usize, m: usize) -> Result<(), GpuError> {
        let plans: Vec<MatmulPlan> = group.iter().map(|(w, _)| self.matmul_plan(w, x, x_stride)).collect();
        self.matmul_planned(group, &plans, x, x_stride, m)
    }

    /// [`Gpu::matmul_group`] with the launch shapes given, one per matrix (the roofline times
    /// shapes other than [`Gpu::matmul_plan`]'s). Each plan's kernel must be the matrix's own
    /// plan's kernel, its block this backend's block and its lanes a power of two within it.
    pub fn matmul_planned(&self, group: &[(&GpuMat, u64)], plans: &[MatmulPlan], x: u64, x_stride: usize, m: usize) -> Result<(), GpuError> {
        let Some(first) = plans.first() else { return Ok(()) };
        if group.len() > 3 || plans.len() != group.len() || group.iter().any(|(w, _)| w.cols != group[0].0.cols) {
            return Err(format!("matmul_group: {} matrices with {:?} columns (at most 3, all as wide as x, one plan each)", group.len(), group.iter().map(|(w, _)| w.cols).collect::<Vec<_>>()).into());
        }
        for ((w, _), p) in group.iter().zip(plans) {
            let own = self.matmul_plan(w, x, x_stride);
            if variant_of(p.kernel) != variant_of(own.kernel) || p.block != own.block || !p.lanes.is_power_of_two() || p.lanes > p.block {
                return Err(format!("matmul plan `{p}` does not fit a {} matrix here (its own plan is `{own}`)", w.ty.name()).into());
            }
        }
        if plans.iter().any(|p| p.kernel != first.kernel) {
            for ((w, y), p) in group.iter().zip(plans) {
                self.matmul_planned(&[(w, *y)], &[*p], x, x_stride, m)?;
            }
            return Ok(());
        }
        let blocks: Vec<usize> = group.iter().zip(plans).map(|((w, _), p)| w.rows.div_ceil(p.rows_per_block() as usize)).collect();
        let grid: usize = blocks.iter().sum();
        for t0 in (0..m).step_by(MAX_TOKENS_PER_LAUNCH) {
            let mt = (m - t0).min(MAX_TOKENS_PER_LAUNCH);
            let mut args = vec![Arg::I32(group[0].0.cols as i32), Arg::Ptr(x + 4 * (t0 * x_stride) as u64), Arg::I32(x_stride as i32), Arg::I32(mt as i32)];
            let mut start = 0;
            for i in 0..3 {
                if i > 0 {
                    // The first block of segment i: the blocks before it (the grid when there is none).
                    args.push(Arg::I32(start as i32));
                }
                match group.get(i) {
                    Some((w, y)) => {
                        args.extend([
                            Arg::Ptr(w.buf.ptr),
                            Arg::I32(w.ty.id() as i32),
                            Arg::I64(w.row_bytes as i64),
                            Arg::I32(w.rows as i32),
                            Arg::I32(plans[i].lanes as i32),
                            Arg::Ptr(y + 4 * (t0 * w.rows) as u64),
                        ]);
                        start += blocks[i];
                    }
                    None => args.extend([Arg::Ptr(0), Arg::I32(0), Arg::I64(0), Arg::I32(0), Arg::I32(1), Arg::Ptr(0)]),
                }
            }
            let kernel = first.for_tokens(mt).kernel;
            // Every variant (variant_of) is a one-token kernel.
            if variant_of(kernel) != kernel && mt != 1 {
                return Err(format!("{kernel} multiplies one token, not {mt}").into());
            }
            let staged = if variant_of(kernel) == "ts_matmul_q" { XTILE_FLOATS } else { 0 };
            self.launch(kernel, [grid as u32, 1, 1], [first.block, 1, 1], 4 * (first.block * mt as u32 + staged), &args)?;
        }
        Ok(())
    }

    /// Rows `ids` (device u32s, each checked by the caller to be < rows) of `w` into `out: [n, cols]`.
    pub fn get_rows(&self, w: &GpuMat, ids: u64, n: usize, out: u64) -> Result<(), GpuError> {
        self.launch_rows(
            "ts_get_rows",
            n,
            &[Arg::Ptr(w.buf.ptr), Arg::I32(w.ty.id() as i32), Arg::I64(w.row_bytes as i64), Arg::I32(w.cols as i32), Arg::Ptr(ids), Arg::Ptr(out)],
        )
    }

    /// RMSNorm of `rows` rows of `n` (QK-norm: rows = tokens x heads, n = head_dim).
    pub fn rms_norm(&self, x: u64, w: u64, y: u64, rows: usize, n: usize, eps: f32) -> Result<(), GpuError> {
        self.add_rms_norm(x, 0, w, y, rows, n, eps)
    }

    /// `x += r` (r = 0: nothing added), then `y = RMSNorm(x) * w`: a residual add and the norm
    /// after it in one launch, with the bits of [`Gpu::add`] then [`Gpu::rms_norm`].
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm(&self, x: u64, r: u64, w: u64, y: u64, rows: usize, n: usize, eps: f32) -> Result<(), GpuError> {
        self.rms_norm_launch((x, w, y, rows), r, (0, 0, 0, 0), n, eps)
    }

    /// [`Gpu::rms_norm`] of two tensors whose rows are `n` long (each `(x, w, y, rows)`: Q's and
    /// K's heads with their QK-norm weights) in one launch.
    pub fn rms_norm_pair(&self, first: (u64, u64, u64, usize), second: (u64, u64, u64, usize), n: usize, eps: f32) -> Result<(), GpuError> {
        self.rms_norm_launch(first, 0, second, n, eps)
    }

    /// The one `ts_rms_norm` launch: `first` with residual `r` (0: none), then `second` (0 rows: none).
    fn rms_norm_launch(&self, (x, w, y, rows): (u64, u64, u64, usize), r: u64, (x2, w2, y2, rows2): (u64, u64, u64, usize), n: usize, eps: f32) -> Result<(), GpuError> {
        self.launch_rows(
            "ts_rms_norm",
            rows + rows2,
            &[Arg::Ptr(x), Arg::Ptr(r), Arg::Ptr(w), Arg::Ptr(y), Arg::I32(n as i32), Arg::F32(eps), Arg::I32(rows as i32), Arg::Ptr(x2), Arg::Ptr(w2), Arg::Ptr(y2)],
        )
    }

    pub fn layer_norm(&self, x: u64, w: u64, b: u64, y: u64, rows: usize, n: usize, eps: f32) -> Result<(), GpuError> {
        self.launch_rows("ts_layer_norm", rows, &[Arg::Ptr(x), Arg::Ptr(w), Arg::Ptr(b), Arg::Ptr(y), Arg::I32(n as i32), Arg::F32(eps)])
    }

    /// `y = a + b` with `b` (of `bn` values) repeated over `a`'s `n` values.
    pub fn add(&self, a: u64, b: u64, y: u64, n: usize, bn: usize) -> Result<(), GpuError> {
        self.launch_flat("ts_add", n, &[Arg::Ptr(a), Arg::Ptr(b), Arg::Ptr(y), Arg::I64(n as i64), Arg::I64(bn as i64)])
    }

    /// `x *= s` in place over `n` values.
    /// `x = c * tanh(x / c)` in place over `n` values (Gemma 2's soft-capping).
    pub fn softcap(&self, x: u64, c: f32, n: usize) -> Result<(), GpuError> {
        self.launch_flat("ts_softcap", n, &[Arg::Ptr(x), Arg::F32(c), Arg::I64(n as i64)])
    }

    pub fn scale(&self, x: u64, s: f32, n: usize) -> Result<(), GpuError> {
        self.launch_flat("ts_scale", n, &[Arg::Ptr(x), Arg::F32(s), Arg::I64(n as i64)])
    }

    /// `y = act(gate) * up` (up = 0: no product). act: 0 SiLU, 1 GELU-tanh, 2 sigmoid.
    pub fn glu(&self, gate: u64, up: u64, y: u64, n: usize, act: i32) -> Result<(), GpuError> {
        self.launch_flat("ts_glu", n, &[Arg::Ptr(gate), Arg::Ptr(up), Arg::Ptr(y), Arg::I64(n as i64), Arg::I32(act)])
    }

    /// RoPE in place over `x: [tokens, n_head * hd]` with a host-computed table uploaded to
    /// `table` (see [`rope_table`]; `tokens * n_rot` floats).
    #[allow(clippy::too_many_arguments)]
    pub fn rope(&self, x: u64, table: &DevBuf, tokens: usize, n_head: usize, hd: usize, n_rot: usize, neox: bool) -> Result<(), GpuError> {
        self.rope_pair((x, n_head), (0, 0), table, tokens, hd, n_rot, neox)
    }

    /// [`Gpu::rope`] of Q and K (each `(pointer, heads per token)`; K's heads may be 0) in one launch.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_pair(&self, (x, n_head): (u64, usize), (x2, n_head2): (u64, usize), table: &DevBuf, tokens: usize, hd: usize, n_rot: usize, neox: bool) -> Result<(), GpuError> {
        if n_rot > hd || !n_rot.is_multiple_of(2) || table.bytes != 4 * tokens * n_rot {
            return Err(format!("rope: n_rot {n_rot} does not fit head_dim {hd} (table of {} bytes for {tokens} tokens)", table.bytes).into());
        }
        self.launch_flat(
            "ts_rope",
            tokens * (n_head + n_head2) * (n_rot / 2),
            &[
                Arg::Ptr(x),
                Arg::I32(n_head as i32),
                Arg::Ptr(x2),
                Arg::I32(n_head2 as i32),
                Arg::Ptr(table.ptr),
                Arg::I32(tokens as i32),
                Arg::I32(hd as i32),
                Arg::I32(n_rot as i32),
                Arg::I32(neox as i32),
            ],
        )
    }

    /// Causal attention of `m` queries at positions `pos` (device u32s) over a cache of
    /// `kv_len` positions.
    #[allow(clippy::too_many_arguments)]
    /// `sinks`: a device buffer of one sink logit per query head, or 0 for none.
    pub fn attention(&self, q: u64, pos: u64, k: u64, v: u64, out: u64, m: usize, kv_len: usize, cfg: &crate::shared::AttnCfg, sinks: u64) -> Result<(), GpuError> {
        let bs = self.bs() as usize;
        let shared = 4 * (kv_len + bs);
        if shared > MAX_SHARED_BYTES {
            return Err(format!("attention over {kv_len} cached positions needs {shared} bytes of shared memory (at most {MAX_SHARED_BYTES})").into());
        }
        if cfg.n_head_kv == 0 || !cfg.n_head.is_multiple_of(cfg.n_head_kv) {
            return Err(format!("attention: {} heads over {} kv heads", cfg.n_head, cfg.n_head_kv).into());
        }
        let scale = cfg.scale;
        self.launch(
            "ts_attention",
            [cfg.n_head as u32, m as u32, 1],
            [bs as u32, 1, 1],
            shared as u32,
            &[
                Arg::Ptr(q),
                Arg::Ptr(pos),
                Arg::Ptr(k),
                Arg::Ptr(v),
                Arg::Ptr(out),
                Arg::I32(cfg.n_head as i32),
                Arg::I32(cfg.n_head_kv as i32),
                Arg::I32(cfg.head_dim as i32),
                Arg::I32(cfg.window as i32),
                Arg::F32(scale),
                Arg::Ptr(sinks),
                Arg::F32(cfg.softcap),
            ],
        )
    }

    pub fn softmax(&self, x: u64, y: u64, rows: usize, n: usize) -> Result<(), GpuError> {
        self.launch_rows("ts_softmax", rows, &[Arg::Ptr(x), Arg::Ptr(y), Arg::I32(n as i32)])
    }

    /// The `k` (<= 64) best indices of each of `rows` rows of `n`.
    pub fn top_k(&self, x: u64, ids: u64, rows: usize, n: usize, k: usize) -> Result<(), GpuError> {
        if k == 0 || k > 64 {
            return Err(format!("top_k: k = {k} (the kernel ranks 1..=64)").into());
        }
        self.launch_rows("ts_top_k", rows, &[Arg::Ptr(x), Arg::Ptr(ids), Arg::I32(n as i32), Arg::I32(k as i32)])
    }

    /// Each row's `k` experts and their weights; `limit`: DeepSeek V3's choice bias (a device
    /// buffer of one value per expert, 0 for none), expert groups `[groups, kept]` and weight scale.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_route(&self, logits: u64, ids: u64, weights: u64, rows: usize, n_expert: usize, k: usize, sigmoid: bool, normalize: bool, limit: RouteLimit) -> Result<(), GpuError> {
        if n_expert > 256 || k == 0 || k > n_expert {
            return Err(format!("moe_route: {k} of {n_expert} experts (the kernel routes up to 256)").into());
        }
        let [groups, kept] = limit.groups.unwrap_or([0, 0]);
        if limit.groups.is_some() && (groups == 0 || !n_expert.is_multiple_of(groups) || kept == 0 || kept > groups) {
            return Err(format!("moe_route: {n_expert} experts in {groups} groups, {kept} kept").into());
        }
        self.launch_flat(
            "ts_moe_route",
            rows,
            &[
                Arg::Ptr(logits),
                Arg::Ptr(ids),
                Arg::Ptr(weights),
                Arg::I32(rows as i32),
                Arg::I32(n_expert as i32),
                Arg::I32(k as i32),
                Arg::I32(sigmoid as i32),
                Arg::I32(normalize as i32),
                Arg::Ptr(limit.bias),
                Arg::I32(groups as i32),
                Arg::I32(kept as i32),
                Arg::F32(limit.scale),
            ],
        )
    }

    /// `out[t, :] += alpha[t * alpha_stride] * y[t, :]` over `tokens` rows of `d`.
    pub fn axpy_rows(&self, out: u64, y: u64, alpha: u64, alpha_stride: usize, tokens: usize, d: usize) -> Result<(), GpuError> {
        self.launch_flat("ts_axpy_rows", tokens * d, &[Arg::Ptr(out), Arg::Ptr(y), Arg::Ptr(alpha), Arg::I32(alpha_stride as i32), Arg::I64((tokens * d) as i64), Arg::I32(d as i32)])
    }

    pub fn sigmoid_dot(&self, x: u64, w: u64, s: u64, tokens: usize, d: usize) -> Result<(), GpuError> {
        self.launch_rows("ts_sigmoid_dot", tokens, &[Arg::Ptr(x), Arg::Ptr(w), Arg::Ptr(s), Arg::I32(d as i32)])
    }

    /// Copies `n` floats from `src` to `dst` (16 bytes per thread when aligned).
    pub fn copy(&self, src: u64, dst: u64, n: usize) -> Result<(), GpuError> {
        let vec4 = n.is_multiple_of(4) && src.is_multiple_of(16) && dst.is_multiple_of(16);
        let threads = if vec4 { n / 4 } else { n };
        self.launch_flat("ts_copy", threads, &[Arg::Ptr(src), Arg::Ptr(dst), Arg::I64(n as i64), Arg::I32(vec4 as i32)])
    }
}

/// DeepSeek V3's additions to an MoE routing ([`Gpu::moe_route`]).
#[derive(Clone, Copy, Debug)]
pub struct RouteLimit {
    /// A device buffer of one choice-only bias per expert; 0 for none.
    pub bias: u64,
    /// `[groups, kept]`: the choice limited to the best `kept` of `groups` expert groups.
    pub groups: Option<[usize; 2]>,
    /// What the chosen weights are multiplied by, last.
    pub scale: f32,
}

impl Default for RouteLimit {
    fn default() -> Self {
        RouteLimit { bias: 0, groups: None, scale: 1.0 }
    }
}

/// RoPE cos/sin for `positions`, flattened `[t][i] = (cos, sin)`: computed on the host in f64
/// and rounded to f32, as engines that precompute tables do (the cpu device does the same).
pub fn rope_table(spec: &oracle::spec::RopeSpec, positions: impl Iterator<Item = usize>) -> Vec<f32> {
    positions.flat_map(|p| crate::shared::rope_table(spec, p)).flat_map(|(c, s)| [c, s]).collect()
}

/// Opens `cuda[:N]`, `rocm[:N]` or `gpu-emu` with its options ([`crate::gpu_emu_syntax`]), or
/// says why it is unavailable.
pub fn open(name: &str) -> Result<Box<dyn Device>, DeviceError> {
    let unavailable = |why: String| DeviceError::Unavailable(name.to_string(), why);
    let index = |prefix: &str| -> Result<usize, DeviceError> {
        match name.strip_prefix(prefix) {
            Some("") => Ok(0),
            Some(rest) => rest.strip_prefix(':').and_then(|n| n.parse().ok()).ok_or_else(|| unavailable(format!("expected {prefix} or {prefix}:N"))),
            None => Err(unavailable("unknown device".into())),
        }
    };
    let backend: Box<dyn Backend> = if let Some(rest) = name.strip_prefix("gpu-emu") {
        if !(rest.is_empty() || rest.starts_with(':')) {
            return Err(unavailable("unknown device".into()));
        }
        Box::new(emu::EmuBackend::open(rest).map_err(unavailable)?)
    } else if name.starts_with("cuda") {
        let _ordinal = index("cuda")?;
        #[cfg(feature = "cuda")]
        {
            Box::new(cuda::CudaBackend::open(_ordinal).map_err(unavailable)?)
        }
        #[cfg(not(feature = "cuda"))]
        return Err(unavailable("not compiled with feature cuda (cargo build --features cuda)".into()));
    } else {
        let _ordinal = index("rocm")?;
        #[cfg(feature = "rocm")]
        {
            Box::new(hip::HipBackend::open(_ordinal).map_err(unavailable)?)
        }
        #[cfg(not(feature = "rocm"))]
        return Err(unavailable("not compiled with feature rocm (cargo build --features rocm)".into()));
    };
    Ok(Box::new(GpuDevice::new(Gpu::new(backend))))
}

#[cfg(test)]
mod tests;
