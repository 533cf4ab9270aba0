//! Compile check of the ROCm path without a GPU: the kernel source, behind the HIP prelude, must
//! compile with hiprtc to a code object for the AMD architectures the GPU runners have. hiprtc
//! comes from Debian's `libamdhip64-dev` (with `libamd-comgr2`); where it is missing the test says
//! it was skipped, and fails instead when `TOUCHSTONE_REQUIRE_HIPRTC=1`.
#![cfg(feature = "rocm")]

use devices::gpu::{hip, KERNEL_SOURCE};

#[test]
fn every_kernel_compiles_with_hiprtc() {
    if !hip::hiprtc_present() {
        let why = "hiprtc compile check SKIPPED: libamdhip64 not found (apt-get install libamdhip64-dev)";
        assert!(std::env::var("TOUCHSTONE_REQUIRE_HIPRTC").as_deref() != Ok("1"), "{why}, and TOUCHSTONE_REQUIRE_HIPRTC=1");
        println!("{why}");
        return;
    }
    // MI100 (gfx908), MI210/MI250 (gfx90a). Not gfx942 (MI300): Debian's ROCm 5.2 comgr predates
    // it and crashes on the name instead of refusing it.
    for arch in ["gfx908", "gfx90a"] {
        let code = hip::compile_code_object(KERNEL_SOURCE, Some(arch)).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert!(code.starts_with(b"\x7fELF"), "{arch}: hiprtc returned no ELF code object");
        println!("hiprtc compile check RAN: {} bytes of code object for {arch}", code.len());
    }
}
