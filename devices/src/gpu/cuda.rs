//! `cuda[:N]` (feature `cuda`): the shared kernels on an NVIDIA GPU through cudarc's driver and
//! NVRTC bindings, loaded at run time (`dynamic-loading`), so the build needs no CUDA toolkit and
//! a machine without a driver reports the device unavailable instead of aborting: every entry
//! point first asks `is_culib_present()` (constructing a context without libcuda panics).
//!
//! Kernels are compiled by NVRTC for the device's architecture (`sm_XY`) when the device opens,
//! with default precision options (no fast-math, no flush-to-zero, IEEE sqrt and division); the
//! PTX is cached per architecture and kernel-source hash under the system temp directory.
//! Work goes to the legacy default stream; copies are synchronous; timing uses CUDA events.

use super::{Arg, Backend, GpuError};
use cudarc::driver::{result, sys};
use std::collections::HashMap;
use std::ffi::{c_void, CString};

pub struct CudaBackend {
    ordinal: usize,
    /// Set at the first kernel fault (the context is unusable from then on).
    faulted: std::sync::atomic::AtomicBool,
    ctx: sys::CUcontext,
    functions: HashMap<String, sys::CUfunction>,
    describe: String,
}

// SAFETY: the driver API's handles may be used from any thread once the context is current on
// it; every method below makes `ctx` current before its first driver call.
unsafe impl Send for CudaBackend {}
unsafe impl Sync for CudaBackend {}

/// Whether libnvrtc can be loaded (a compile-only check needs nothing else). `TOUCHSTONE_NVRTC`
/// may name the library file (e.g. the PyPI wheel's `nvidia/cuda_nvrtc/lib/libnvrtc.so.12`) when
/// it is not on the loader's path.
pub fn nvrtc_present() -> bool {
    if let Some(path) = std::env::var_os("TOUCHSTONE_NVRTC") {
        let _ = preload(std::path::Path::new(&path));
    }
    // SAFETY: only tries to dlopen the library by its candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Loads a library by path with RTLD_GLOBAL, so a later dlopen by its soname (what cudarc does)
/// finds it already loaded.
pub fn preload(path: &std::path::Path) -> Result<(), String> {
    let c = CString::new(path.to_string_lossy().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: dlopen of a path; the handle is deliberately kept for the life of the process.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a NUL-terminated message after a failed dlopen.
        return Err(format!("dlopen {}: {}", path.display(), unsafe { std::ffi::CStr::from_ptr(libc::dlerror()) }.to_string_lossy()));
    }
    Ok(())
}

/// The translation unit NVRTC compiles: the CUDA prelude and the kernel source.
pub fn source(kernels: &str) -> String {
    format!("{}\n{}\n#line 1 \"touchstone.cu\"\n{kernels}", super::PRELUDE_GPU, super::PRELUDE_CUDA)
}

/// Compiles every kernel of `kernels` for `arch` (e.g. `sm_90`) to PTX with NVRTC. The error
/// carries NVRTC's log (file, line, message).
pub fn compile_ptx(kernels: &str, arch: &str) -> Result<String, String> {
    if !nvrtc_present() {
        return Err("libnvrtc is not loadable (install the CUDA toolkit, or `pip install nvidia-cuda-nvrtc-cu12` and set TOUCHSTONE_NVRTC to its lib/libnvrtc.so.12; or run PTX compiled elsewhere with `cargo xtask ptx` and TOUCHSTONE_PTX_CACHE)".into());
    }
    let opts = cudarc::nvrtc::CompileOptions {
        name: Some("touchstone.cu".into()),
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        ..Default::default()
    };
    match cudarc::nvrtc::compile_ptx_with_opts(source(kernels), opts) {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(cudarc::nvrtc::CompileError::CompileError { log, .. }) => Err(format!("NVRTC failed:\n{}", log.to_string_lossy())),
        Err(e) => Err(format!("NVRTC failed: {e:?}")),
    }
}

/// Where compiled PTX is kept: `TOUCHSTONE_PTX_CACHE`, else the system temp directory.
pub fn ptx_cache_dir() -> std::path::PathBuf {
    std::env::var_os("TOUCHSTONE_PTX_CACHE").map(Into::into).unwrap_or_else(std::env::temp_dir)
}

/// The cache file of `kernels` compiled for `arch` (named by the source's hash).
pub fn ptx_cache_path(kernels: &str, arch: &str) -> std::path::PathBuf {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    source(kernels).hash(&mut h);
    ptx_cache_dir().join(format!("touchstone-ptx-{:016x}-{arch}.ptx", h.finish()))
}

/// PTX for `arch`, from the cache when this kernel source was compiled for it before (so a GPU
/// machine with a driver but no NVRTC can run PTX compiled elsewhere: `cargo xtask ptx`).
pub fn cached_ptx(kernels: &str, arch: &str) -> Result<String, String> {
    let path = ptx_cache_path(kernels, arch);
    if let Ok(ptx) = std::fs::read_to_string(&path) {
        return Ok(ptx);
    }
    let ptx = compile_ptx(kernels, arch)?;
    // A private temporary file (readable by all, as fs::write made it), then a rename: another
    // thread or process compiling the same kernels never reads a half-written file. Failing to
    // cache only costs a compile next time.
    use std::os::unix::fs::PermissionsExt;
    if std::fs::create_dir_all(ptx_cache_dir()).is_ok() {
        if let Ok(mut tmp) = tempfile::Builder::new().permissions(std::fs::Permissions::from_mode(0o644)).tempfile_in(ptx_cache_dir()) {
            if std::io::Write::write_all(&mut tmp, ptx.as_bytes()).is_ok() {
                let _ = tmp.persist(&path);
            }
        }
    }
    Ok(ptx)
}

fn driver<T>(what: &str, r: Result<T, result::DriverError>) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

/// Errors a kernel causes (illegal or misaligned address, illegal instruction, a trap): they
/// leave the context unusable, so the first is reported as the kernel's fault and later calls
/// say why they cannot run.
fn is_kernel_fault(e: &result::DriverError) -> bool {
    use sys::CUresult::*;
    matches!(
        e.0,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_LAUNCH_FAILED
    )
}

impl CudaBackend {
    pub fn open(ordinal: usize) -> Result<CudaBackend, String> {
        // SAFETY: only tries to dlopen libcuda by its candidate names.
        if !unsafe { sys::is_culib_present() } {
            return Err("no CUDA driver on this machine (libcuda.so not found)".into());
        }
        driver("cuInit", result::init())?;
        let count = driver("cuDeviceGetCount", result::device::get_count())? as usize;
        if ordinal >= count {
            return Err(format!("no CUDA device {ordinal} ({count} present)"));
        }
        let dev = driver("cuDeviceGet", result::device::get(ordinal as i32))?;
        let attr = |a| driver("cuDeviceGetAttribute", unsafe { result::device::get_attribute(dev, a) });
        let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let name = driver("cuDeviceGetName", result::device::get_name(dev))?;
        let mut version = 0i32;
        // SAFETY: writes one int.
        unsafe { sys::cuDriverGetVersion(&mut version) };
        let cuda_version = format!("{}.{}", version / 1000, (version % 1000) / 10);
        // SAFETY: retains the device's primary context (held for the life of the process).
        let ctx = driver("cuDevicePrimaryCtxRetain", unsafe { result::primary_ctx::retain(dev) })?;
        // SAFETY: a context just retained.
        driver("cuCtxSetCurrent", unsafe { result::ctx::set_current(ctx) })?;
        let arch = format!("sm_{major}{minor}");
        let kernels = super::kernel_source()?;
        let ptx = cached_ptx(&kernels, &arch)?;
        let image = CString::new(ptx).map_err(|e| e.to_string())?;
        // SAFETY: a NUL-terminated PTX image; the module lives as long as the primary context.
        let module = unsafe { result::module::load_data(image.as_ptr() as *const c_void) }.map_err(|e| {
            let hint = if e.0 == sys::CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION {
                format!(" (the PTX was made by an NVRTC newer than CUDA driver {cuda_version}: compile it with an NVRTC no newer than the driver's CUDA version)")
            } else {
                String::new()
            };
            format!("cuModuleLoadData({}): {e}{hint}", ptx_cache_path(&kernels, &arch).display())
        })?;
        let mut functions = HashMap::new();
        for k in super::kernel_names_in(&kernels) {
            let cname = CString::new(k.as_str()).map_err(|e| e.to_string())?;
            // SAFETY: a loaded module and a NUL-terminated name.
            let f = driver(&format!("cuModuleGetFunction({k})"), unsafe { result::module::get_function(module, cname) })?;
            functions.insert(k, f);
        }
        let describe = format!("{name}, {arch}, CUDA driver {cuda_version}");
        Ok(CudaBackend { ordinal, faulted: Default::default(), ctx, functions, describe })
    }

    fn current(&self) -> Result<(), GpuError> {
        // SAFETY: `ctx` is the retained primary context.
        self.check("cuCtxSetCurrent", unsafe { result::ctx::set_current(self.ctx) })
    }

    /// `driver`, marking the first kernel fault as the kernel's ([`GpuError::KernelFault`]).
    fn check<T>(&self, what: &str, r: Result<T, result::DriverError>) -> Result<T, GpuError> {
        r.map_err(|e| {
            if !is_kernel_fault(&e) {
                GpuError::Failed(format!("{what}: {e}"))
            } else if self.faulted.swap(true, std::sync::atomic::Ordering::SeqCst) {
                GpuError::Failed(format!("{what}: {e} (the CUDA context is unusable after an earlier kernel fault)"))
            } else {
                GpuError::KernelFault(format!("{what}: {e} (an earlier launch faulted; the CUDA context is now unusable)"))
            }
        })
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }
    fn describe(&self) -> String {
        self.describe.clone()
    }
    fn block_size(&self) -> u32 {
        256
    }
    fn alloc(&self, bytes: usize) -> Result<u64, GpuError> {
        self.current()?;
        // SAFETY: a plain device allocation, freed in `free`.
        self.check(&format!("cuMemAlloc({bytes} bytes)"), unsafe { result::malloc_sync(bytes) })
    }
    fn free(&self, ptr: u64) {
        if self.current().is_ok() {
            // SAFETY: `ptr` came from `alloc` and is freed once (DevBuf's Drop).
            let _ = unsafe { result::free_sync(ptr) };
        }
    }
    fn upload(&self, ptr: u64, data: &[u8]) -> Result<(), GpuError> {
        self.current()?;
        // SAFETY: DevBuf sizes every copy to its allocation.
        self.check("cuMemcpyHtoD", unsafe { result::memcpy_htod_sync(ptr, data) })
    }
    fn download(&self, ptr: u64, out: &mut [u8]) -> Result<(), GpuError> {
        self.current()?;
        // SAFETY: as in `upload`.
        self.check("cuMemcpyDtoH", unsafe { result::memcpy_dtoh_sync(out, ptr) })
    }
    fn launch(&self, kernel: &str, grid: [u32; 3], block: [u32; 3], shared_bytes: u32, args: &[Arg]) -> Result<(), GpuError> {
        self.current()?;
        let f = *self.functions.get(kernel).ok_or_else(|| format!("no kernel named `{kernel}`"))?;
        let mut values = Arg::pack(args);
        let mut params: Vec<*mut c_void> = values.iter_mut().map(|v| v.as_mut_ptr() as *mut c_void).collect();
        // SAFETY: one pointer per kernel parameter, each to 8 bytes holding the value at the
        // parameter's size; the launch copies them before returning.
        let r = unsafe { result::launch_kernel(f, (grid[0], grid[1], grid[2]), (block[0], block[1], block[2]), shared_bytes, std::ptr::null_mut(), &mut params) };
        // The message is formatted only on failure: a decode step launches hundreds of kernels.
        r.or_else(|e| self.check(&format!("launch {kernel}"), Err(e)))
    }
    fn synchronize(&self) -> Result<(), GpuError> {
        self.current()?;
        self.check("cuCtxSynchronize", result::ctx::synchronize())
    }
    fn time(&self, f: &mut dyn FnMut() -> Result<(), GpuError>) -> Result<f64, GpuError> {
        self.current()?;
        let start = self.check("cuEventCreate", result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = self.check("cuEventCreate", result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        // SAFETY: events just created, recorded on the default stream, destroyed below.
        let r = unsafe {
            self.check("cuEventRecord", result::event::record(start, std::ptr::null_mut())).and_then(|_| {
                f()?;
                self.check("cuEventRecord", result::event::record(end, std::ptr::null_mut()))?;
                self.check("cuEventSynchronize", result::event::synchronize(end))?;
                self.check("cuEventElapsedTime", result::event::elapsed(start, end))
            })
        };
        // SAFETY: destroyed once.
        unsafe {
            let _ = result::event::destroy(start);
            let _ = result::event::destroy(end);
        }
        Ok(r? as f64 / 1e3)
    }
}
