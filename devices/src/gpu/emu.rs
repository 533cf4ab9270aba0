//! `gpu-emu`: the GPU kernels compiled for the host by the system C++ compiler and run by a tiny
//! emulator (`kernels/emu_runtime.cpp`: blocks in sequence, a block's threads as fibers that
//! switch at `__syncthreads()`). It makes the kernels' logic testable on any machine: the kernel
//! suite, layer-diff and fixed-token judge `gpu-emu` exactly as they judge `cuda:0`. What it
//! cannot show is a platform compiler's code generation or a real GPU's memory model; the NVRTC
//! compile test and the GPU runners cover those.
//!
//! It also checks what a GPU punishes and a host forgives. Every allocation ends at an
//! inaccessible page, so a kernel that reads or writes past the end of a buffer (or touches a
//! freed one) ends its launch with an error naming the kernel, block, thread, address and the
//! allocation it ran past — a GPU's "illegal address"; a misaligned 16-byte access is an error
//! too. And the order in which a block's threads run between two barriers (and a grid's blocks)
//! is a choice, `gpu-emu` (forward), `gpu-emu:reverse` or `gpu-emu:shuffle`: a GPU promises no
//! order, so a kernel whose results change with it has a race. `gpu-emu:racecheck` also fails a
//! launch in which two threads write the same shared-memory word between two barriers (the
//! races no order shows, such as an unsynchronised `+=`). Blocks have 32 threads unless asked
//! otherwise (`gpu-emu:256` runs the block size the GPUs use).
//!
//! Its arithmetic is exact IEEE f32 unless asked to be the GPU's: `gpu-emu:fma` contracts
//! `a * b + c` into fused multiply-adds, as NVRTC does by default (`--fmad=true`: the PTX of
//! these kernels holds hundreds of `fma.rn.f32`), and `gpu-emu:ulp2` makes `expf` and `tanhf`
//! return results 2 ulp off, CUDA's documented worst case for both (the direction varies with the
//! input, the same every run; `ulpN` puts them N ulp off, to see how much error the budgets let
//! through). A kernel whose results only hold up with the host's correctly
//! rounded libm and uncontracted products fails there, not first on a GPU.
//!
//! The shared library is built once per kernel-source hash under the system temp directory
//! (`CXX` overrides the compiler, default `c++`).

use super::{Arg, Backend, GpuError};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

const PRELUDE_HOST: &str = include_str!("../../kernels/prelude_host.h");
const RUNTIME: &str = include_str!("../../kernels/emu_runtime.cpp");

type LaunchFn = unsafe extern "C" fn(*const c_char, *const u32, *const u32, u32, *mut *mut c_void, c_int, c_int, *mut c_char, c_int, *mut u64) -> c_int;

/// The order in which the emulator runs a block's threads between barriers, and a grid's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    Forward = 0,
    Reverse = 1,
    /// A fixed pseudo-random permutation per interval (the same every run).
    Shuffle = 2,
}

impl Schedule {
    /// The option's spelling in a device name (`gpu-emu:reverse`).
    pub fn word(self) -> &'static str {
        match self {
            Schedule::Forward => "forward",
            Schedule::Reverse => "reverse",
            Schedule::Shuffle => "shuffle",
        }
    }

    pub fn parse(s: &str) -> Option<Schedule> {
        [Schedule::Forward, Schedule::Reverse, Schedule::Shuffle].into_iter().find(|o| o.word() == s)
    }
}

/// How the kernels' f32 arithmetic is compiled for the host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Arith {
    /// Contract `a * b + c` into fused multiply-adds (NVRTC's default `--fmad=true`).
    pub fma: bool,
    /// `expf` and `tanhf` off by this many ulp (2 is CUDA's documented maximum error for both;
    /// 0 leaves the host's libm).
    pub ulps: u32,
}

impl Arith {
    /// The compiler flags beyond the fixed ones (`-ffp-contract=off` unless `fma`).
    fn flags(self) -> Result<Vec<String>, String> {
        let mut f = Vec::new();
        if self.fma {
            f.push("-ffp-contract=fast".into());
            #[cfg(target_arch = "x86_64")]
            {
                if !std::arch::is_x86_feature_detected!("fma") {
                    return Err("gpu-emu:fma needs a host CPU with fused multiply-add (x86-64 FMA3), which this one lacks".into());
                }
                f.push("-mfma".into());
            }
        } else {
            f.push("-ffp-contract=off".into());
        }
        if self.ulps > 0 {
            f.push(format!("-DTS_EMU_ULPS={}", self.ulps));
        }
        Ok(f)
    }
}

/// Threads per block unless chosen: small, so the emulator is quick.
const DEFAULT_THREADS: u32 = 32;

/// One mapping: `bytes` usable at `ptr`, ending where an inaccessible page begins.
struct Mapping {
    base: *mut c_void,
    span: usize,
    bytes: usize,
}

impl Mapping {
    /// Whether `addr` lies in the mapping: its usable bytes or the guard page after them.
    fn holds(&self, addr: u64) -> bool {
        addr >= self.base as u64 && addr < self.base as u64 + self.span as u64
    }
}

pub struct EmuBackend {
    launch: LaunchFn,
    schedule: Schedule,
    /// Threads per block the device asks for (32 unless chosen; GPUs use 256).
    threads: u32,
    /// Check shared memory for write-write races between barriers (emu_runtime.cpp).
    racecheck: bool,
    /// How the kernels' arithmetic was compiled.
    arith: Arith,
    /// Live allocations by their address.
    allocs: Mutex<HashMap<u64, Mapping>>,
    /// The most recently freed allocations (address, mapping), kept mapped but inaccessible so
    /// that a kernel using a freed buffer faults rather than reading whatever took its place.
    freed: Mutex<std::collections::VecDeque<(u64, Mapping)>>,
}

/// How many freed allocations stay inaccessible before their address range is returned (each
/// costs the kernel two memory mappings, of which a process may hold about 65,000).
const QUARANTINE: usize = 1024;

// SAFETY: the raw pointers in `allocs` are owned mappings, used only under the mutex.
unsafe impl Send for EmuBackend {}
unsafe impl Sync for EmuBackend {}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// The translation unit the emulator compiles from a kernel source: prelude, kernels, kernel
/// list, launcher (the prelude's `gpu-emu:ulpN` math macros end before it).
pub fn translation_unit(source: &str) -> String {
    let list: String = super::kernel_names_in(source).iter().map(|n| format!("X({n}) ")).collect();
    format!("{PRELUDE_HOST}\n#line 1 \"touchstone.cu\"\n{source}\n#undef expf\n#undef tanhf\n#define TS_KERNEL_LIST(X) {list}\n#line 1 \"emu_runtime.cpp\"\n{RUNTIME}")
}

/// Builds (or finds built) the emulator library for `source` with the arithmetic `arith`.
fn build(source: &str, arith: Arith) -> Result<PathBuf, String> {
    use std::hash::{Hash, Hasher};
    let tu = translation_unit(source);
    let flags = arith.flags()?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    tu.hash(&mut h);
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    cxx.hash(&mut h);
    flags.hash(&mut h);
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
        .args(["-std=c++17", "-O2", "-fPIC", "-shared", "-fno-fast-math"])
        .args(&flags)
        .arg("-o")
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
    /// `gpu-emu[:ORDER][:THREADS][:racecheck][:fma][:ulpN]`: ORDER is forward (the default),
    /// reverse or shuffle; THREADS the threads per block, a power of two from 32 to 1024 (default
    /// 32; GPUs use 256); racecheck looks for two threads writing the same shared word between
    /// barriers; fma and ulp2 give the kernels the GPU's arithmetic (see [`Arith`]; ulpN, N from
    /// 1 to 64, puts expf/tanhf N ulp off).
    pub fn open(options: &str) -> Result<EmuBackend, String> {
        let (mut schedule, mut threads, mut racecheck, mut arith) = (Schedule::Forward, DEFAULT_THREADS, false, Arith::default());
        for part in options.split(':').filter(|p| !p.is_empty()) {
            if part == "racecheck" {
                racecheck = true;
            } else if part == "fma" {
                arith.fma = true;
            } else if let Some(n) = part.strip_prefix("ulp").and_then(|n| n.parse::<u32>().ok()).filter(|n| (1..=64).contains(n)) {
                arith.ulps = n;
            } else if let Some(s) = Schedule::parse(part) {
                schedule = s;
            } else if let Some(n) = part.parse::<u32>().ok().filter(|n| n.is_power_of_two() && (32..=1024).contains(n)) {
                threads = n;
            } else {
                return Err(format!(concat!("unknown option `{}`: ", gpu_emu_syntax!(), ", THREADS a power of two from 32 to 1024, ulpN with N from 1 to 64"), part));
            }
        }
        let mut b = Self::with_source(&super::kernel_source()?, schedule, arith)?;
        b.threads = threads;
        b.racecheck = racecheck;
        Ok(b)
    }

    /// An emulator running the kernels of `source` (the built-in source, an override, or a test's).
    pub fn with_source(source: &str, schedule: Schedule, arith: Arith) -> Result<EmuBackend, String> {
        let lib = build(source, arith)?;
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
        Ok(EmuBackend { launch, schedule, threads: DEFAULT_THREADS, racecheck: false, arith, allocs: Mutex::new(HashMap::new()), freed: Mutex::new(Default::default()) })
    }
}

impl Backend for EmuBackend {
    fn timings_not_of_hardware(&self) -> Option<String> {
        Some(format!("{} runs the kernels on the host CPU: its timings say nothing about a GPU", self.name()))
    }
    fn name(&self) -> String {
        let mut name = String::from("gpu-emu");
        if self.schedule != Schedule::Forward {
            name.push_str(&format!(":{}", self.schedule.word()));
        }
        if self.threads != DEFAULT_THREADS {
            name.push_str(&format!(":{}", self.threads));
        }
        if self.racecheck {
            name.push_str(":racecheck");
        }
        if self.arith.fma {
            name.push_str(":fma");
        }
        if self.arith.ulps > 0 {
            name.push_str(&format!(":ulp{}", self.arith.ulps));
        }
        name
    }
    fn describe(&self) -> String {
        let races = if self.racecheck { ", shared-memory write races checked" } else { "" };
        let contraction = if self.arith.fma { "IEEE f32 with a*b+c contracted to fma" } else { "IEEE f32, no contraction" };
        let libm = match self.arith.ulps {
            0 => "host libm".to_string(),
            n => format!("expf/tanhf {n} ulp off"),
        };
        let arith = format!("{contraction}, {libm}");
        format!(
            "host emulation of the GPU kernels (blocks of {} fibers, thread order {}, {arith}, memory faults and misaligned accesses caught{races})",
            self.threads,
            self.schedule.word()
        )
    }
    fn block_size(&self) -> u32 {
        self.threads
    }
    fn alloc(&self, bytes: usize) -> Result<u64, GpuError> {
        // [ usable bytes, rounded up to 16, ending at a page boundary | one PROT_NONE page ]:
        // a read or write past the end faults, and the launch reports it. 16-byte alignment is
        // what the kernels' widest access needs (a GPU allocation is 256-byte aligned).
        let page = page_size();
        let usable = bytes.max(16).div_ceil(16) * 16;
        let span = usable.div_ceil(page) * page + page;
        // SAFETY: a fresh private anonymous mapping; checked for failure below.
        let base = unsafe { libc::mmap(std::ptr::null_mut(), span, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
        if base == libc::MAP_FAILED {
            return Err(format!("out of host memory for {bytes} bytes").into());
        }
        // SAFETY: the last page of the mapping just made; `p` and the `usable` bytes after it lie
        // inside the mapping's accessible part.
        let p = unsafe {
            libc::mprotect((base as *mut u8).add(span - page) as *mut c_void, page, libc::PROT_NONE);
            let p = (base as *mut u8).add(span - page - usable);
            // Poison new memory (NaN floats) so a kernel that reads what nobody wrote shows it.
            std::ptr::write_bytes(p, 0xFF, usable);
            p
        };
        self.allocs.lock().unwrap().insert(p as u64, Mapping { base, span, bytes });
        Ok(p as u64)
    }
    fn free(&self, ptr: u64) {
        let Some(m) = self.allocs.lock().unwrap().remove(&ptr) else { return };
        // SAFETY: a mapping made by `alloc`, removed from the table once: made inaccessible and
        // its pages released, the address range kept until it leaves the quarantine.
        unsafe {
            libc::mprotect(m.base, m.span, libc::PROT_NONE);
            libc::madvise(m.base, m.span, libc::MADV_DONTNEED);
        }
        let mut freed = self.freed.lock().unwrap();
        freed.push_back((ptr, m));
        if freed.len() > QUARANTINE {
            let (_, old) = freed.pop_front().expect("non-empty");
            // SAFETY: a mapping made by `alloc`, leaving the quarantine once.
            unsafe { libc::munmap(old.base, old.span) };
        }
    }
    fn upload(&self, ptr: u64, data: &[u8]) -> Result<(), GpuError> {
        self.check(ptr, data.len())?;
        // SAFETY: `check` proved [ptr, ptr + len) lies inside one live allocation.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr as *mut u8, data.len()) };
        Ok(())
    }
    fn download(&self, ptr: u64, out: &mut [u8]) -> Result<(), GpuError> {
        self.check(ptr, out.len())?;
        // SAFETY: as in `upload`.
        unsafe { std::ptr::copy_nonoverlapping(ptr as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }
    fn launch(&self, kernel: &str, grid: [u32; 3], block: [u32; 3], shared_bytes: u32, args: &[Arg]) -> Result<(), GpuError> {
        let name = CString::new(kernel).map_err(|e| e.to_string())?;
        let mut values = Arg::pack(args);
        let mut ptrs: Vec<*mut c_void> = values.iter_mut().map(|v| v.as_mut_ptr() as *mut c_void).collect();
        let mut err = vec![0 as c_char; 512];
        let mut fault = 0u64;
        // SAFETY: the launcher reads one value per kernel parameter from `ptrs` (each points to 8
        // bytes, enough for any parameter type the kernels use), writes at most err.len() bytes
        // to `err` and one u64 to `fault`.
        let rc = unsafe {
            (self.launch)(
                name.as_ptr(),
                grid.as_ptr(),
                block.as_ptr(),
                shared_bytes,
                ptrs.as_mut_ptr(),
                self.schedule as c_int,
                self.racecheck as c_int,
                err.as_mut_ptr(),
                err.len() as c_int,
                &mut fault,
            )
        };
        if rc != 0 {
            // SAFETY: snprintf wrote a NUL-terminated string into `err`.
            let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
            return Err(match (rc, fault) {
                (-2, 0) => GpuError::KernelFault(msg),
                (-2, addr) => GpuError::KernelFault(format!("{msg} ({})", self.whose(addr))),
                _ => GpuError::Failed(msg),
            });
        }
        Ok(())
    }
    fn synchronize(&self) -> Result<(), GpuError> {
        Ok(())
    }
    fn time(&self, f: &mut dyn FnMut() -> Result<(), GpuError>) -> Result<f64, GpuError> {
        let t = std::time::Instant::now();
        f()?;
        Ok(t.elapsed().as_secs_f64())
    }
}

impl Drop for EmuBackend {
    fn drop(&mut self) {
        let live = self.allocs.get_mut().unwrap().drain().map(|(_, m)| m);
        let freed = self.freed.get_mut().unwrap().drain(..).map(|(_, m)| m);
        for m in live.chain(freed) {
            // SAFETY: mappings made by `alloc`, each unmapped once, none used after the backend.
            unsafe { libc::munmap(m.base, m.span) };
        }
    }
}

impl EmuBackend {
    /// Where a faulting address lies relative to the live allocations.
    fn whose(&self, addr: u64) -> String {
        let allocs = self.allocs.lock().unwrap();
        // The allocation whose usable bytes or trailing guard page hold `addr` (below the usable
        // bytes lies only the unused head of the mapping's first page).
        let hit = allocs.iter().find(|(&p, m)| addr >= p && m.holds(addr));
        match hit {
            Some((&p, m)) if addr < p + m.bytes as u64 => format!("inside the {}-byte allocation at {p:#x}, {} bytes in", m.bytes, addr - p),
            Some((&p, m)) => format!("{} bytes past the end of the {}-byte allocation at {p:#x}", addr - p - m.bytes as u64, m.bytes),
            None => {
                let freed = self.freed.lock().unwrap();
                match freed.iter().find(|(_, m)| m.holds(addr)) {
                    Some((p, m)) => format!("in the freed {}-byte allocation at {p:#x}", m.bytes),
                    None => "outside every allocation".into(),
                }
            }
        }
    }

    /// Copies must stay inside one live allocation (the emulator's memory is the host's).
    fn check(&self, ptr: u64, len: usize) -> Result<(), String> {
        let allocs = self.allocs.lock().unwrap();
        let ok = allocs.iter().any(|(&base, m)| ptr >= base && ptr + len as u64 <= base + m.bytes as u64);
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
    SHARED(float, red, 64);
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
// Copies n floats with one thread per element but reads `over` elements further.
extern "C" __global__ void read_past(const float* x, float* y, int n, int over) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i + over];
}
extern "C" __global__ void load16_at(const u8* p, int offset, float* y) {
    uint4 v = ts_load16(p + offset);
    y[threadIdx.x] = (float)v.x;
}
// A race no thread order shows: every thread adds to one shared word with no atomics.
extern "C" __global__ void racy_sum(const float* x, float* y) {
    SHARED(float, total, 1);
    if (threadIdx.x == 0) total[0] = 0.0f;
    __syncthreads();
    total[0] += x[threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) y[0] = total[0];
}
// A race: thread 0 publishes a value that the others read without a barrier between.
extern "C" __global__ void racy_broadcast(float* y) {
    __shared__ float v;
    if (threadIdx.x == 0) v = 7.0f;
    y[threadIdx.x] = v;
}
extern "C" __global__ void arith(const float* x, float* y) {
    y[0] = x[0] * x[1] + x[2];
    y[1] = expf(x[3]);
    y[2] = tanhf(x[3]);
}
"#;

    fn floats(b: &EmuBackend, ptr: u64, n: usize) -> Vec<f32> {
        let mut raw = vec![0u8; 4 * n];
        b.download(ptr, &mut raw).unwrap();
        raw.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    fn emulator() -> Option<EmuBackend> {
        emulator_with(Schedule::Forward, Arith::default())
    }

    /// The test kernels' emulator, or None (saying SKIPPED) without a C++ compiler, or for `fma`
    /// on a host CPU without fused multiply-add.
    fn emulator_with(schedule: Schedule, arith: Arith) -> Option<EmuBackend> {
        match EmuBackend::with_source(SOURCE, schedule, arith) {
            Ok(b) => Some(b),
            Err(e) if e.contains("lacks") => {
                eprintln!("SKIPPED: {e}");
                None
            }
            Err(e) => {
                assert!(std::env::var("TOUCHSTONE_REQUIRE_GPU_EMU").as_deref() != Ok("1"), "{e}");
                eprintln!("SKIPPED: gpu-emu unavailable: {e}");
                None
            }
        }
    }

    /// Steps between two finite f32 of one sign (how many ulp apart).
    fn ulps_apart(a: f32, b: f32) -> u32 {
        a.to_bits().abs_diff(b.to_bits())
    }

    #[test]
    fn fma_contracts_products_and_ulp_n_moves_expf_and_tanhf_by_n_ulp() {
        // (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24: rounded to f32 the 2^-24 is lost, so a*b - (1 + 2^-11)
        // is 0 uncontracted and 2^-24 as one fused multiply-add.
        let a = 1.0 + 2f32.powi(-12);
        let x = [a, a, -(1.0 + 2f32.powi(-11)), 0.37];
        let mut seen = Vec::new();
        for (fma, ulps) in [(false, 0), (true, 0), (false, 2), (true, 2), (false, 7)] {
            let Some(b) = emulator_with(Schedule::Forward, Arith { fma, ulps }) else { return };
            let (xp, yp) = (b.alloc(16).unwrap(), b.alloc(12).unwrap());
            b.upload(xp, &super::super::f32_bytes(&x)).unwrap();
            b.launch("arith", [1, 1, 1], [1, 1, 1], 0, &[Arg::Ptr(xp), Arg::Ptr(yp)]).unwrap();
            let y = floats(&b, yp, 3);
            assert_eq!(y[0], if fma { 2f32.powi(-24) } else { 0.0 }, "fma={fma}");
            assert_eq!(ulps_apart(y[1], x[3].exp()), ulps, "expf: {} vs {}", y[1], x[3].exp());
            assert_eq!(ulps_apart(y[2], x[3].tanh()), ulps, "tanhf: {} vs {}", y[2], x[3].tanh());
            seen.push(b.name());
        }
        assert_eq!(seen, ["gpu-emu", "gpu-emu:fma", "gpu-emu:ulp2", "gpu-emu:fma:ulp2", "gpu-emu:ulp7"]);
    }

    #[test]
    fn barriers_order_a_blocks_threads_and_blocks_are_independent() {
        let Some(b) = emulator() else { return };
        let x: Vec<f32> = (0..3 * 16).map(|i| i as f32).collect();
        let (xp, sp) = (b.alloc(4 * x.len()).unwrap(), b.alloc(12).unwrap());
        b.upload(xp, &super::super::f32_bytes(&x)).unwrap();
        b.launch("block_sums", [3, 1, 1], [16, 1, 1], 0, &[Arg::Ptr(xp), Arg::Ptr(sp)]).unwrap();
        let expect: Vec<f32> = x.chunks(16).map(|c| c.iter().sum()).collect();
        assert_eq!(floats(&b, sp, 3), expect);
    }

    #[test]
    fn a_thread_that_skips_a_barrier_is_reported() {
        let Some(b) = emulator() else { return };
        let xp = b.alloc(64).unwrap();
        let e = b.launch("early_return", [1, 1, 1], [8, 1, 1], 0, &[Arg::Ptr(xp)]).unwrap_err().to_string();
        assert!(e.contains("1 of 8 threads returned") && e.contains("__syncthreads"), "{e}");
        assert!(b.launch("no_such_kernel", [1, 1, 1], [8, 1, 1], 0, &[]).unwrap_err().to_string().contains("no kernel named"));
    }

    #[test]
    fn launches_a_gpu_would_refuse_are_refused() {
        let Some(b) = emulator() else { return };
        let (xp, sp) = (b.alloc(64).unwrap(), b.alloc(12).unwrap());
        let args = [Arg::Ptr(xp), Arg::Ptr(sp)];
        for (grid, block, shared, what) in [
            ([0, 1, 1], [16, 1, 1], 0, "grid (0,1,1)"),
            ([1, 70000, 1], [16, 1, 1], 0, "grid (1,70000,1)"),
            ([70000, 65535, 1], [16, 1, 1], 0, "more blocks than the emulator runs"),
            ([1, 1, 1], [2048, 1, 1], 0, "block of 2048 threads"),
            ([1, 1, 1], [16, 1, 1], 48 * 1024 + 4, "49156 bytes of dynamic shared memory"),
        ] {
            let e = b.launch("block_sums", grid, block, shared, &args).unwrap_err();
            assert!(matches!(&e, GpuError::Failed(m) if m.contains(what)), "{e}");
        }
        b.launch("block_sums", [1, 1, 1], [16, 1, 1], 48 * 1024, &args).unwrap();
    }

    #[test]
    fn every_schedule_keeps_barriers_and_a_race_shows_under_another_order() {
        let x: Vec<f32> = (0..3 * 16).map(|i| (i * i % 7) as f32).collect();
        let expect: Vec<f32> = x.chunks(16).map(|c| c.iter().sum()).collect();
        let mut racy = Vec::new();
        for schedule in [Schedule::Forward, Schedule::Reverse, Schedule::Shuffle] {
            let Some(b) = emulator_with(schedule, Arith::default()) else { return };
            let (xp, sp) = (b.alloc(4 * x.len()).unwrap(), b.alloc(12).unwrap());
            b.upload(xp, &super::super::f32_bytes(&x)).unwrap();
            b.launch("block_sums", [3, 1, 1], [16, 1, 1], 0, &[Arg::Ptr(xp), Arg::Ptr(sp)]).unwrap();
            assert_eq!(floats(&b, sp, 3), expect, "{schedule:?}");
            let yp = b.alloc(4 * 8).unwrap();
            b.launch("racy_broadcast", [1, 1, 1], [8, 1, 1], 0, &[Arg::Ptr(yp)]).unwrap();
            racy.push(floats(&b, yp, 8).iter().filter(|v| **v == 7.0).count());
        }
        // Forward order hides the race (thread 0 runs first); reverse and shuffled orders do not.
        assert_eq!(racy[0], 8);
        assert!(racy[1] < 8 && racy[2] < 8, "{racy:?}");
    }

    #[test]
    fn a_read_past_the_end_of_a_buffer_ends_the_launch_with_an_error() {
        let Some(b) = emulator() else { return };
        let n = 37usize;
        let (xp, yp) = (b.alloc(4 * n).unwrap(), b.alloc(4 * n).unwrap());
        b.upload(xp, &vec![0u8; 4 * n]).unwrap();
        // In bounds: fine.
        b.launch("read_past", [2, 1, 1], [32, 1, 1], 0, &[Arg::Ptr(xp), Arg::Ptr(yp), Arg::I32(n as i32), Arg::I32(0)]).unwrap();
        // Past the 16-byte rounding of the last row: faults, is reported, and the process lives on.
        let e = b.launch("read_past", [2, 1, 1], [32, 1, 1], 0, &[Arg::Ptr(xp), Arg::Ptr(yp), Arg::I32(n as i32), Arg::I32(4)]).unwrap_err();
        assert!(matches!(e, GpuError::KernelFault(_)), "{e}");
        let e = e.to_string();
        assert!(e.contains("read_past") && e.contains("memory fault") && e.contains("past the end of the 148-byte allocation"), "{e}");
        // A freed buffer is outside every allocation.
        b.free(xp);
        let e = b.launch("read_past", [2, 1, 1], [32, 1, 1], 0, &[Arg::Ptr(xp), Arg::Ptr(yp), Arg::I32(n as i32), Arg::I32(0)]).unwrap_err().to_string();
        assert!(e.contains("in the freed 148-byte allocation"), "{e}");
        // And the emulator still runs kernels afterwards.
        let xp = b.alloc(4 * n).unwrap();
        b.upload(xp, &vec![0u8; 4 * n]).unwrap();
        b.launch("read_past", [2, 1, 1], [32, 1, 1], 0, &[Arg::Ptr(xp), Arg::Ptr(yp), Arg::I32(n as i32), Arg::I32(0)]).unwrap();
        assert_eq!(floats(&b, yp, n), vec![0.0; n]);
    }

    #[test]
    fn racecheck_finds_two_threads_writing_one_shared_word() {
        let Some(mut b) = emulator_with(Schedule::Shuffle, Arith::default()) else { return };
        let x: Vec<f32> = (1..=8).map(|i| i as f32).collect();
        let (xp, yp) = (b.alloc(32).unwrap(), b.alloc(4).unwrap());
        b.upload(xp, &super::super::f32_bytes(&x)).unwrap();
        // Without the check the sum even comes out right: each thread's turn runs whole.
        b.launch("racy_sum", [1, 1, 1], [8, 1, 1], 0, &[Arg::Ptr(xp), Arg::Ptr(yp)]).unwrap();
        assert_eq!(floats(&b, yp, 1), vec![36.0]);
        b.racecheck = true;
        let e = b.launch("racy_sum", [1, 1, 1], [8, 1, 1], 0, &[Arg::Ptr(xp), Arg::Ptr(yp)]).unwrap_err();
        assert!(matches!(&e, GpuError::KernelFault(m) if m.contains("both wrote the word at byte") && m.contains("a static array in shared memory")), "{e}");
        // A correct tree reduction passes the check.
        let sp = b.alloc(4).unwrap();
        b.launch("block_sums", [1, 1, 1], [8, 1, 1], 0, &[Arg::Ptr(xp), Arg::Ptr(sp)]).unwrap();
        assert_eq!(floats(&b, sp, 1), vec![36.0]);
    }

    #[test]
    fn a_misaligned_16_byte_load_is_an_error() {
        let Some(b) = emulator() else { return };
        let (p, y) = (b.alloc(64).unwrap(), b.alloc(4).unwrap());
        b.upload(p, &[1u8; 64]).unwrap();
        b.launch("load16_at", [1, 1, 1], [1, 1, 1], 0, &[Arg::Ptr(p), Arg::I32(16), Arg::Ptr(y)]).unwrap();
        let e = b.launch("load16_at", [1, 1, 1], [1, 1, 1], 0, &[Arg::Ptr(p), Arg::I32(8), Arg::Ptr(y)]).unwrap_err().to_string();
        assert!(e.contains("misaligned 16-byte load") && e.contains("inside the 64-byte allocation") && e.contains("8 bytes in"), "{e}");
    }

    #[test]
    fn copies_outside_an_allocation_are_refused() {
        let Some(b) = emulator() else { return };
        let p = b.alloc(16).unwrap();
        assert!(b.upload(p + 8, &[0u8; 16]).unwrap_err().to_string().contains("outside any allocation"));
        b.free(p);
        assert!(b.download(p, &mut [0u8; 4]).is_err());
    }
}
