//! `gpu-emu`: the GPU kernels compiled for the host by the system C++ compiler and run by a tiny
//! emulator (`kernels/emu_runtime.cpp`: blocks in sequence, a block's threads as fibers that
//! switch at `__syncthreads()`). It makes the kernels' logic testable on any machine: the kernel
//! suite, layer-diff and fixed-token judge `gpu-emu` exactly as they judge `cuda:0`. What it
//! cannot show is a platform compiler's code generation or a real GPU's memory model; the NVRTC
//! compile test and the GPU runners cover those.
//!
//! The shared library is built once per kernel-source hash under the system temp directory
//! (`CXX` overrides the compiler, default `c++`).

use super::{Arg, Backend};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

const PRELUDE_HOST: &str = include_str!("../../kernels/prelude_host.h");
const RUNTIME: &str = include_str!("../../kernels/emu_runtime.cpp");

type LaunchFn = unsafe extern "C" fn(*const c_char, *const u32, *const u32, u32, *mut *mut c_void, *mut c_char, c_int) -> c_int;

pub struct EmuBackend {
    launch: LaunchFn,
    /// Live allocations: address -> layout.
    allocs: Mutex<HashMap<u64, std::alloc::Layout>>,
}

/// The translation unit the emulator compiles from a kernel source: prelude, kernels, kernel
/// list, launcher.
pub fn translation_unit(source: &str) -> String {
    let list: String = super::kernel_names_in(source).iter().map(|n| format!("X({n}) ")).collect();
    format!("{PRELUDE_HOST}\n#line 1 \"touchstone.cu\"\n{source}\n#define TS_KERNEL_LIST(X) {list}\n#line 1 \"emu_runtime.cpp\"\n{RUNTIME}")
}

/// Builds (or finds built) the emulator library for `source`.
fn build(source: &str) -> Result<PathBuf, String> {
    use std::hash::{Hash, Hasher};
    let tu = translation_unit(source);
    let mut h = std::collections::hash_map::DefaultHasher::new();
    tu.hash(&mut h);
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    cxx.hash(&mut h);
    let dir = std::env::temp_dir().join(format!("touchstone-gpu-emu-{:016x}", h.finish()));
    let lib = dir.join("libtouchstone_emu.so");
    if lib.exists() {
        return Ok(lib);
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // Build under a private name and rename, so concurrent processes never load a partial file.
    let tmp = tempfile::Builder::new().prefix("build").tempdir_in(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let src = tmp.path().join("emu.cpp");
    std::fs::write(&src, &tu).map_err(|e| format!("{}: {e}", src.display()))?;
    let out = tmp.path().join("lib.so");
    let result = std::process::Command::new(&cxx)
        .args(["-std=c++17", "-O2", "-fPIC", "-shared", "-fno-fast-math", "-ffp-contract=off", "-o"])
        .arg(&out)
        .arg(&src)
        .output()
        .map_err(|e| format!("no C++ compiler to build the emulator (`{cxx}`: {e}); install g++ or set CXX"))?;
    if !result.status.success() {
        return Err(format!("{cxx} could not compile the kernels for the host:\n{}", String::from_utf8_lossy(&result.stderr)));
    }
    std::fs::rename(&out, &lib).map_err(|e| format!("{}: {e}", lib.display()))?;
    Ok(lib)
}

/// Loaded emulator libraries by path (one per kernel source), kept for the life of the process.
static LIBRARIES: OnceLock<Mutex<HashMap<PathBuf, usize>>> = OnceLock::new();

impl EmuBackend {
    pub fn open() -> Result<EmuBackend, String> {
        Self::with_source(&super::kernel_source()?)
    }

    /// An emulator running the kernels of `source` (the built-in source, an override, or a test's).
    pub fn with_source(source: &str) -> Result<EmuBackend, String> {
        let lib = build(source)?;
        let mut loaded = LIBRARIES.get_or_init(Default::default).lock().unwrap();
        let addr = match loaded.get(&lib) {
            Some(a) => *a,
            None => {
                let path = CString::new(lib.to_string_lossy().as_bytes()).map_err(|e| e.to_string())?;
                // SAFETY: dlopen/dlsym on a library this process built; the handle is never
                // dlclose'd, so the symbol stays valid for the life of the process.
                let sym = unsafe {
                    let handle = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
                    if handle.is_null() {
                        return Err(format!("dlopen {}: {}", lib.display(), std::ffi::CStr::from_ptr(libc::dlerror()).to_string_lossy()));
                    }
                    libc::dlsym(handle, c"ts_emu_launch".as_ptr())
                };
                if sym.is_null() {
                    return Err(format!("{}: no symbol ts_emu_launch", lib.display()));
                }
                loaded.insert(lib, sym as usize);
                sym as usize
            }
        };
        // SAFETY: the symbol has the signature emu_runtime.cpp declares for ts_emu_launch.
        let launch = unsafe { std::mem::transmute::<usize, LaunchFn>(addr) };
        Ok(EmuBackend { launch, allocs: Mutex::new(HashMap::new()) })
    }
}

impl Backend for EmuBackend {
    fn name(&self) -> String {
        "gpu-emu".into()
    }
    fn describe(&self) -> String {
        "host emulation of the GPU kernels (blocks of 32 fibers)".into()
    }
    fn block_size(&self) -> u32 {
        32
    }
    fn alloc(&self, bytes: usize) -> Result<u64, String> {
        let layout = std::alloc::Layout::from_size_align(bytes.max(16), 256).map_err(|e| e.to_string())?;
        // SAFETY: a non-zero-sized layout; freed in `free` with the same layout.
        let p = unsafe { std::alloc::alloc(layout) };
        if p.is_null() {
            return Err(format!("out of host memory for {bytes} bytes"));
        }
        // Poison new memory (NaN floats) so a kernel that reads what nobody wrote shows it.
        // SAFETY: `p` points to `layout.size()` writable bytes.
        unsafe { std::ptr::write_bytes(p, 0xFF, layout.size()) };
        self.allocs.lock().unwrap().insert(p as u64, layout);
        Ok(p as u64)
    }
    fn free(&self, ptr: u64) {
        if let Some(layout) = self.allocs.lock().unwrap().remove(&ptr) {
            // SAFETY: allocated by `alloc` with this layout, removed from the table once.
            unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
        }
    }
    fn upload(&self, ptr: u64, data: &[u8]) -> Result<(), String> {
        self.check(ptr, data.len())?;
        // SAFETY: `check` proved [ptr, ptr + len) lies inside one live allocation.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr as *mut u8, data.len()) };
        Ok(())
    }
    fn download(&self, ptr: u64, out: &mut [u8]) -> Result<(), String> {
        self.check(ptr, out.len())?;
        // SAFETY: as in `upload`.
        unsafe { std::ptr::copy_nonoverlapping(ptr as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }
    fn launch(&self, kernel: &str, grid: [u32; 3], block: [u32; 3], shared_bytes: u32, args: &[Arg]) -> Result<(), String> {
        let name = CString::new(kernel).map_err(|e| e.to_string())?;
        let mut values = Arg::pack(args);
        let mut ptrs: Vec<*mut c_void> = values.iter_mut().map(|v| v.as_mut_ptr() as *mut c_void).collect();
        let mut err = vec![0 as c_char; 512];
        // SAFETY: the launcher reads one value per kernel parameter from `ptrs` (each points to 8
        // bytes, enough for any parameter type the kernels use) and writes at most err.len() bytes.
        let rc = unsafe { (self.launch)(name.as_ptr(), grid.as_ptr(), block.as_ptr(), shared_bytes, ptrs.as_mut_ptr(), err.as_mut_ptr(), err.len() as c_int) };
        if rc != 0 {
            // SAFETY: snprintf wrote a NUL-terminated string into `err`.
            return Err(unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned());
        }
        Ok(())
    }
    fn synchronize(&self) -> Result<(), String> {
        Ok(())
    }
    fn time(&self, f: &mut dyn FnMut() -> Result<(), String>) -> Result<f64, String> {
        let t = std::time::Instant::now();
        f()?;
        Ok(t.elapsed().as_secs_f64())
    }
}

impl EmuBackend {
    /// Copies must stay inside one live allocation (the emulator's memory is the host's).
    fn check(&self, ptr: u64, len: usize) -> Result<(), String> {
        let allocs = self.allocs.lock().unwrap();
        let ok = allocs.iter().any(|(&base, l)| ptr >= base && ptr + len as u64 <= base + l.size() as u64);
        if ok {
            Ok(())
        } else {
            Err(format!("copy of {len} bytes at {ptr:#x} outside any allocation"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = r#"
extern "C" __global__ void block_sums(const float* x, float* sums) {
    __shared__ float red[64];
    int tid = threadIdx.x;
    red[tid] = x[blockIdx.x * blockDim.x + tid];
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) red[tid] += red[tid + s];
        __syncthreads();
    }
    if (tid == 0) sums[blockIdx.x] = red[0];
}
extern "C" __global__ void early_return(float* x) {
    if (threadIdx.x == 3) return;
    __syncthreads();
    x[threadIdx.x] = 1.0f;
}
"#;

    fn floats(b: &EmuBackend, ptr: u64, n: usize) -> Vec<f32> {
        let mut raw = vec![0u8; 4 * n];
        b.download(ptr, &mut raw).unwrap();
        raw.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    fn emulator() -> Option<EmuBackend> {
        match EmuBackend::with_source(SOURCE) {
            Ok(b) => Some(b),
            Err(e) => {
                assert!(std::env::var("TOUCHSTONE_REQUIRE_GPU_EMU").as_deref() != Ok("1"), "{e}");
                eprintln!("SKIPPED: gpu-emu unavailable: {e}");
                None
            }
        }
    }

    #[test]
    fn barriers_order_a_blocks_threads_and_blocks_are_independent() {
        let Some(b) = emulator() else { return };
        let x: Vec<f32> = (0..3 * 16).map(|i| i as f32).collect();
        let (xp, sp) = (b.alloc(4 * x.len()).unwrap(), b.alloc(12).unwrap());
        b.upload(xp, &x.iter().flat_map(|v| v.to_ne_bytes()).collect::<Vec<u8>>()).unwrap();
        b.launch("block_sums", [3, 1, 1], [16, 1, 1], 0, &[Arg::Ptr(xp), Arg::Ptr(sp)]).unwrap();
        let expect: Vec<f32> = x.chunks(16).map(|c| c.iter().sum()).collect();
        assert_eq!(floats(&b, sp, 3), expect);
    }

    #[test]
    fn a_thread_that_skips_a_barrier_is_reported() {
        let Some(b) = emulator() else { return };
        let xp = b.alloc(64).unwrap();
        let e = b.launch("early_return", [1, 1, 1], [8, 1, 1], 0, &[Arg::Ptr(xp)]).unwrap_err();
        assert!(e.contains("1 of 8 threads returned") && e.contains("__syncthreads"), "{e}");
        assert!(b.launch("no_such_kernel", [1, 1, 1], [8, 1, 1], 0, &[]).unwrap_err().contains("no kernel named"));
    }

    #[test]
    fn copies_outside_an_allocation_are_refused() {
        let Some(b) = emulator() else { return };
        let p = b.alloc(16).unwrap();
        assert!(b.upload(p + 8, &[0u8; 16]).unwrap_err().contains("outside any allocation"));
        b.free(p);
        assert!(b.download(p, &mut [0u8; 4]).is_err());
    }
}
