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
    let o = std::process::Command::new(&ptxas).arg("-v").arg(format!("-arch={arch}")).arg(&src).arg("-o").arg(&out).output().unwrap();
    assert!(o.status.success(), "ptxas {arch}: {}", String::from_utf8_lossy(&o.stderr));
    println!("ptxas check RAN: {} bytes of {arch} machine code", std::fs::metadata(&out).unwrap().len());
    let usage = resource_usage(&String::from_utf8_lossy(&o.stderr));
    for (name, u) in &usage {
        println!("  {arch} {name:<16} {:>3} registers, {:>4} bytes stack, {} bytes spilled", u.registers, u.stack, u.spill);
    }
    for (name, u) in &usage {
        assert_eq!(u.spill, 0, "{arch}: {name} spills registers to local memory");
    }
    // The float matmuls, the one-token form (ts_matmul_v1) being the GEMV the roofline gates:
    // their batches of 16-byte loads must stay in registers (an array indexed in a loop the
    // compiler did not unroll goes to the stack, i.e. to memory), and 64 registers let four
    // 256-thread blocks share an SM. ts_matmul_v1 holds two batches of four (the one it
    // multiplies and the one in flight): 128 B of weight loads per thread, 128 KiB per SM.
    for name in ["ts_matmul_v", "ts_matmul_v1", "ts_matmul_v1b2"] {
        let u = usage.get(name).unwrap_or_else(|| panic!("{arch}: no {name} in ptxas -v output"));
        assert_eq!(u.stack, 0, "{arch}: {name} keeps its load batch on the stack");
        assert!(u.registers <= 64, "{arch}: {name} uses {} registers (> 64: fewer blocks per SM)", u.registers);
    }
}

#[derive(Default, Debug)]
struct Usage {
    registers: u32,
    stack: u32,
    spill: u32,
}

/// Per-kernel registers, stack frame and spill-store bytes from `ptxas -v`'s report
/// ("Function properties for NAME" / "N bytes stack frame, N bytes spill stores" / "Used N registers").
fn resource_usage(log: &str) -> std::collections::BTreeMap<String, Usage> {
    let mut map = std::collections::BTreeMap::<String, Usage>::new();
    let mut current = None;
    let number_before = |line: &str, word: &str| -> Option<u32> {
        let i = line.find(word)?;
        line[..i].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(name) = line.split("Function properties for ").nth(1) {
            current = Some(name.trim().to_string());
            continue;
        }
        let Some(name) = &current else { continue };
        let u = map.entry(name.clone()).or_default();
        if let Some(n) = number_before(line, "bytes stack frame") {
            u.stack = n;
        }
        if let Some(n) = number_before(line, "bytes spill stores") {
            u.spill = n;
        }
        if let Some(n) = number_before(line, "registers") {
            u.registers = n;
        }
    }
    map
}
