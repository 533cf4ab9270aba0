//! `rocm[:N]` (feature `rocm`): the shared kernels on an AMD GPU through the HIP runtime and
//! hiprtc, with the HIP prelude in front of the same source CUDA compiles (as ggml's HIP build
//! reuses its CUDA sources).
//!
//! Why dlopen rather than a -sys crate: `hip-sys` needs a ROCm install to build, and
//! `cubecl-hip-sys` aborts the process on any call without the runtime. Loading libamdhip64 at
//! run time builds everywhere, and every entry point checks that the library and its symbols are
//! there first, so a machine without ROCm reports `rocm` unavailable and never aborts. hiprtc
//! lives in libhiprtc (ROCm 6) or libamdhip64 itself (ROCm 5, e.g. Debian's libamdhip64-5),
//! which is enough to compile the kernels without a GPU (see `compile_code_object`).

use super::{Arg, Backend, GpuError};
use std::ffi::{c_char, c_int, c_void, CStr, CString};

type Ptr = *mut c_void;

/// The HIP runtime and hiprtc entry points Touchstone uses, resolved with dlsym.
#[allow(non_snake_case)]
struct Hip {
    hipInit: unsafe extern "C" fn(u32) -> c_int,
    hipGetDeviceCount: unsafe extern "C" fn(*mut c_int) -> c_int,
    hipSetDevice: unsafe extern "C" fn(c_int) -> c_int,
    hipDeviceGetName: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int,
    hipDriverGetVersion: unsafe extern "C" fn(*mut c_int) -> c_int,
    hipGetErrorString: unsafe extern "C" fn(c_int) -> *const c_char,
    hipMalloc: unsafe extern "C" fn(*mut Ptr, usize) -> c_int,
    hipFree: unsafe extern "C" fn(Ptr) -> c_int,
    hipMemcpy: unsafe extern "C" fn(Ptr, *const c_void, usize, c_int) -> c_int,
    hipModuleLoadData: unsafe extern "C" fn(*mut Ptr, *const c_void) -> c_int,
    hipModuleGetFunction: unsafe extern "C" fn(*mut Ptr, Ptr, *const c_char) -> c_int,
    hipModuleLaunchKernel: unsafe extern "C" fn(Ptr, u32, u32, u32, u32, u32, u32, u32, Ptr, *mut Ptr, *mut Ptr) -> c_int,
    hipDeviceSynchronize: unsafe extern "C" fn() -> c_int,
    hipEventCreate: unsafe extern "C" fn(*mut Ptr) -> c_int,
    hipEventRecord: unsafe extern "C" fn(Ptr, Ptr) -> c_int,
    hipEventSynchronize: unsafe extern "C" fn(Ptr) -> c_int,
    hipEventElapsedTime: unsafe extern "C" fn(*mut f32, Ptr, Ptr) -> c_int,
    hipEventDestroy: unsafe extern "C" fn(Ptr) -> c_int,
    hiprtcCreateProgram: unsafe extern "C" fn(*mut Ptr, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> c_int,
    hiprtcCompileProgram: unsafe extern "C" fn(Ptr, c_int, *const *const c_char) -> c_int,
    hiprtcGetProgramLogSize: unsafe extern "C" fn(Ptr, *mut usize) -> c_int,
    hiprtcGetProgramLog: unsafe extern "C" fn(Ptr, *mut c_char) -> c_int,
    hiprtcGetCodeSize: unsafe extern "C" fn(Ptr, *mut usize) -> c_int,
    hiprtcGetCode: unsafe extern "C" fn(Ptr, *mut c_char) -> c_int,
    hiprtcDestroyProgram: unsafe extern "C" fn(*mut Ptr) -> c_int,
}

const HIP_MEMCPY_HOST_TO_DEVICE: c_int = 1;
const HIP_MEMCPY_DEVICE_TO_HOST: c_int = 2;

fn dlopen_first(names: &[&str]) -> Option<Ptr> {
    names.iter().find_map(|n| {
        let c = CString::new(*n).ok()?;
        // SAFETY: dlopen by name; the handle is kept for the life of the process.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        (!h.is_null()).then_some(h)
    })
}

// Each transmute's target is the `Hip` field it initialises, whose type spells the C signature.
#[allow(clippy::missing_transmute_annotations)]
fn load() -> Result<Hip, String> {
    let runtime = dlopen_first(&["libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"]).ok_or("no HIP runtime on this machine (libamdhip64.so not found)")?;
    let rtc = dlopen_first(&["libhiprtc.so", "libhiprtc.so.6"]);
    let sym = |name: &str| -> Result<usize, String> {
        let c = CString::new(name).map_err(|e| e.to_string())?;
        for h in rtc.iter().chain(std::iter::once(&runtime)) {
            // SAFETY: dlsym on a live handle.
            let p = unsafe { libc::dlsym(*h, c.as_ptr()) };
            if !p.is_null() {
                return Ok(p as usize);
            }
        }
        Err(format!("the HIP runtime has no `{name}`"))
    };
    macro_rules! f {
        ($name:ident) => {
            // SAFETY: the symbol is the HIP/hiprtc function of this name, whose C signature the
            // field's type spells out (hip_runtime_api.h, hiprtc.h).
            unsafe { std::mem::transmute::<usize, _>(sym(stringify!($name))?) }
        };
    }
    Ok(Hip {
        hipInit: f!(hipInit),
        hipGetDeviceCount: f!(hipGetDeviceCount),
        hipSetDevice: f!(hipSetDevice),
        hipDeviceGetName: f!(hipDeviceGetName),
        hipDriverGetVersion: f!(hipDriverGetVersion),
        hipGetErrorString: f!(hipGetErrorString),
        hipMalloc: f!(hipMalloc),
        hipFree: f!(hipFree),
        hipMemcpy: f!(hipMemcpy),
        hipModuleLoadData: f!(hipModuleLoadData),
        hipModuleGetFunction: f!(hipModuleGetFunction),
        hipModuleLaunchKernel: f!(hipModuleLaunchKernel),
        hipDeviceSynchronize: f!(hipDeviceSynchronize),
        hipEventCreate: f!(hipEventCreate),
        hipEventRecord: f!(hipEventRecord),
        hipEventSynchronize: f!(hipEventSynchronize),
        hipEventElapsedTime: f!(hipEventElapsedTime),
        hipEventDestroy: f!(hipEventDestroy),
        hiprtcCreateProgram: f!(hiprtcCreateProgram),
        hiprtcCompileProgram: f!(hiprtcCompileProgram),
        hiprtcGetProgramLogSize: f!(hiprtcGetProgramLogSize),
        hiprtcGetProgramLog: f!(hiprtcGetProgramLog),
        hiprtcGetCodeSize: f!(hiprtcGetCodeSize),
        hiprtcGetCode: f!(hiprtcGetCode),
        hiprtcDestroyProgram: f!(hiprtcDestroyProgram),
    })
}

fn hip() -> Result<&'static Hip, String> {
    static HIP: std::sync::OnceLock<Result<Hip, String>> = std::sync::OnceLock::new();
    HIP.get_or_init(load).as_ref().map_err(|e| e.clone())
}

impl Hip {
    fn check(&self, what: &str, rc: c_int) -> Result<(), GpuError> {
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: hipGetErrorString returns a static NUL-terminated string for any code.
        let msg = unsafe { CStr::from_ptr((self.hipGetErrorString)(rc)) }.to_string_lossy().into_owned();
        // hipErrorIllegalAddress and hipErrorLaunchFailure (an exception in a kernel) are the
        // kernel's own doing: its case fails rather than "could not run".
        let m = format!("{what}: HIP error {rc} ({msg})");
        Err(if rc == 700 || rc == 719 { GpuError::KernelFault(m) } else { GpuError::Failed(m) })
    }
}

/// The translation unit hiprtc compiles: the HIP prelude and the kernel source.
pub fn source(kernels: &str) -> String {
    format!("{}\n{}\n#line 1 \"touchstone.cu\"\n{kernels}", super::PRELUDE_GPU, super::PRELUDE_HIP)
}

/// Whether the HIP runtime (with hiprtc) can be loaded.
pub fn hiprtc_present() -> bool {
    hip().is_ok()
}

/// Compiles `kernels` with hiprtc into a code object for `arch` (`gfx90a`, `gfx942`; None = the
/// current device's). Needs no GPU when `arch` is given. The error carries hiprtc's log.
pub fn compile_code_object(kernels: &str, arch: Option<&str>) -> Result<Vec<u8>, String> {
    let h = hip()?;
    let src = CString::new(source(kernels)).map_err(|e| e.to_string())?;
    let mut prog: Ptr = std::ptr::null_mut();
    // SAFETY: hiprtc API calls with valid, NUL-terminated strings; the program is destroyed
    // before returning.
    unsafe {
        let rc = (h.hiprtcCreateProgram)(&mut prog, src.as_ptr(), c"touchstone.cu".as_ptr(), 0, std::ptr::null(), std::ptr::null());
        if rc != 0 {
            return Err(format!("hiprtcCreateProgram failed ({rc})"));
        }
        let opts: Vec<CString> = ["-std=c++17".to_string()].into_iter().chain(arch.map(|a| format!("--offload-arch={a}"))).map(|o| CString::new(o).unwrap()).collect();
        let ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let rc = (h.hiprtcCompileProgram)(prog, ptrs.len() as c_int, ptrs.as_ptr());
        let result = if rc != 0 {
            let mut n = 0usize;
            (h.hiprtcGetProgramLogSize)(prog, &mut n);
            let mut log = vec![0u8; n.max(1)];
            (h.hiprtcGetProgramLog)(prog, log.as_mut_ptr() as *mut c_char);
            Err(format!("hiprtc failed ({rc}):\n{}", String::from_utf8_lossy(&log).trim_end_matches('\0')))
        } else {
            let mut n = 0usize;
            (h.hiprtcGetCodeSize)(prog, &mut n);
            let mut code = vec![0u8; n];
            (h.hiprtcGetCode)(prog, code.as_mut_ptr() as *mut c_char);
            Ok(code)
        };
        (h.hiprtcDestroyProgram)(&mut prog);
        result
    }
}

pub struct HipBackend {
    ordinal: usize,
    functions: std::collections::HashMap<String, Ptr>,
    describe: String,
}

// SAFETY: HIP handles may be used from any thread once the device is selected on it; every
// method selects `ordinal` first.
unsafe impl Send for HipBackend {}
unsafe impl Sync for HipBackend {}

impl HipBackend {
    pub fn open(ordinal: usize) -> Result<HipBackend, String> {
        let h = hip()?;
        // SAFETY: plain HIP runtime calls with valid out-pointers.
        unsafe {
            h.check("hipInit", (h.hipInit)(0))?;
            let mut count = 0;
            h.check("hipGetDeviceCount", (h.hipGetDeviceCount)(&mut count))?;
            if ordinal >= count as usize {
                return Err(format!("no ROCm device {ordinal} ({count} present)"));
            }
            h.check("hipSetDevice", (h.hipSetDevice)(ordinal as c_int))?;
            let mut name = vec![0 as c_char; 256];
            h.check("hipDeviceGetName", (h.hipDeviceGetName)(name.as_mut_ptr(), 256, ordinal as c_int))?;
            let mut version = 0;
            (h.hipDriverGetVersion)(&mut version);
            let arch = std::env::var("TOUCHSTONE_HIP_ARCH").ok();
            let kernels = super::kernel_source()?;
            let code = compile_code_object(&kernels, arch.as_deref())?;
            let mut module: Ptr = std::ptr::null_mut();
            h.check("hipModuleLoadData", (h.hipModuleLoadData)(&mut module, code.as_ptr() as *const c_void))?;
            let mut functions = std::collections::HashMap::new();
            for k in super::kernel_names_in(&kernels) {
                let c = CString::new(k.as_str()).map_err(|e| e.to_string())?;
                let mut f: Ptr = std::ptr::null_mut();
                h.check(&format!("hipModuleGetFunction({k})"), (h.hipModuleGetFunction)(&mut f, module, c.as_ptr()))?;
                functions.insert(k, f);
            }
            let name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            Ok(HipBackend { ordinal, functions, describe: format!("{name}, HIP driver {version}") })
        }
    }

    fn select(&self) -> Result<&'static Hip, GpuError> {
        let h = hip()?;
        // SAFETY: selects a device index that existed at open.
        h.check("hipSetDevice", unsafe { (h.hipSetDevice)(self.ordinal as c_int) })?;
        Ok(h)
    }
}

impl Backend for HipBackend {
    fn name(&self) -> String {
        format!("rocm:{}", self.ordinal)
    }
    fn describe(&self) -> String {
        self.describe.clone()
    }
    fn block_size(&self) -> u32 {
        256
    }
    fn alloc(&self, bytes: usize) -> Result<u64, GpuError> {
        let h = self.select()?;
        let mut p: Ptr = std::ptr::null_mut();
        // SAFETY: a plain device allocation, freed in `free`.
        h.check(&format!("hipMalloc({bytes} bytes)"), unsafe { (h.hipMalloc)(&mut p, bytes) })?;
        Ok(p as u64)
    }
    fn free(&self, ptr: u64) {
        if let Ok(h) = self.select() {
            // SAFETY: `ptr` came from `alloc` and is freed once (DevBuf's Drop).
            unsafe { (h.hipFree)(ptr as Ptr) };
        }
    }
    fn upload(&self, ptr: u64, data: &[u8]) -> Result<(), GpuError> {
        let h = self.select()?;
        // SAFETY: DevBuf sizes every copy to its allocation.
        h.check("hipMemcpy(HtoD)", unsafe { (h.hipMemcpy)(ptr as Ptr, data.as_ptr() as *const c_void, data.len(), HIP_MEMCPY_HOST_TO_DEVICE) })
    }
    fn download(&self, ptr: u64, out: &mut [u8]) -> Result<(), GpuError> {
        let h = self.select()?;
        // SAFETY: as in `upload`.
        h.check("hipMemcpy(DtoH)", unsafe { (h.hipMemcpy)(out.as_mut_ptr() as Ptr, ptr as *const c_void, out.len(), HIP_MEMCPY_DEVICE_TO_HOST) })
    }
    fn launch(&self, kernel: &str, grid: [u32; 3], block: [u32; 3], shared_bytes: u32, args: &[Arg]) -> Result<(), GpuError> {
        let h = self.select()?;
        let f = *self.functions.get(kernel).ok_or_else(|| format!("no kernel named `{kernel}`"))?;
        let mut values = Arg::pack(args);
        let mut params: Vec<Ptr> = values.iter_mut().map(|v| v.as_mut_ptr() as Ptr).collect();
        // SAFETY: one pointer per kernel parameter, each to 8 bytes holding its value.
        let rc = unsafe {
            (h.hipModuleLaunchKernel)(f, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared_bytes, std::ptr::null_mut(), params.as_mut_ptr(), std::ptr::null_mut())
        };
        // The message is formatted only on failure: a decode step launches hundreds of kernels.
        if rc == 0 { Ok(()) } else { h.check(&format!("launch {kernel}"), rc) }
    }
    fn synchronize(&self) -> Result<(), GpuError> {
        let h = self.select()?;
        // SAFETY: no arguments.
        h.check("hipDeviceSynchronize", unsafe { (h.hipDeviceSynchronize)() })
    }
    fn time(&self, f: &mut dyn FnMut() -> Result<(), GpuError>) -> Result<f64, GpuError> {
        let h = self.select()?;
        let (mut start, mut end): (Ptr, Ptr) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: events created, recorded on the null stream and destroyed here.
        unsafe {
            h.check("hipEventCreate", (h.hipEventCreate)(&mut start))?;
            h.check("hipEventCreate", (h.hipEventCreate)(&mut end))?;
            let r = h.check("hipEventRecord", (h.hipEventRecord)(start, std::ptr::null_mut())).and_then(|_| {
                f()?;
                h.check("hipEventRecord", (h.hipEventRecord)(end, std::ptr::null_mut()))?;
                h.check("hipEventSynchronize", (h.hipEventSynchronize)(end))?;
                let mut ms = 0f32;
                h.check("hipEventElapsedTime", (h.hipEventElapsedTime)(&mut ms, start, end))?;
                Ok(ms as f64 / 1e3)
            });
            (h.hipEventDestroy)(start);
            (h.hipEventDestroy)(end);
            r
        }
    }
}
