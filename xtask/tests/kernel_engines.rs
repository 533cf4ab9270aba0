//! The two engines no ordinary harness reaches, judged for real: the eBPF forward pass
//! (examples/ebpf_engine, integer programs run in the kernel through BPF_PROG_TEST_RUN) and the
//! bare-metal kernel (examples/baremetal, booted under QEMU, read from its serial ports). Each
//! passes the gates it speaks, and each with its seeded bug fails them at the right tap or token.
//!
//! They need root and clang + libbpf-dev (eBPF), clang + ld + qemu-system-x86 (bare metal); where
//! one is missing the test says SKIPPED with the reason, and `TOUCHSTONE_REQUIRE_EBPF=1` /
//! `TOUCHSTONE_REQUIRE_BAREMETAL=1` (CI sets both) turn a skip into a failure.

mod common;

use common::*;
use std::path::Path;

/// Whether `program --version` runs.
fn runs(program: &str) -> bool {
    std::process::Command::new(program).arg("--version").output().is_ok_and(|o| o.status.success())
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| s.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0")))
}

/// None when the engine can run here, else why not; a reason with `require` set is a failure.
fn skip_reason(require: &str, missing: Option<String>) -> Option<String> {
    let reason = missing?;
    assert!(std::env::var(require).as_deref() != Ok("1"), "{reason}, but {require}=1 says this machine runs it");
    eprintln!("SKIPPED: {reason}");
    Some(reason)
}

/// The environment an engine's run.sh needs: its build directory, and this xtask for the export
/// of a GGUF model to the flat file the engine reads.
fn engine_env(build: &Path) -> Vec<(&'static str, String)> {
    vec![("TOUCHSTONE_ENGINE_BUILD", build.display().to_string()), ("TOUCHSTONE_XTASK", env!("CARGO_BIN_EXE_xtask").to_string())]
}

fn run(args: &[&str], env: &[(&'static str, String)], extra: &[(&'static str, &str)]) -> std::process::Output {
    let mut all: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    all.extend_from_slice(extra);
    xtask(args, &all)
}

#[test]
fn the_ebpf_engine_passes_layer_diff_and_fixed_token_and_its_seeded_bug_fails() {
    let missing = if !is_root() {
        Some("examples/ebpf_engine: not root (bpf() needs root or CAP_BPF)".to_string())
    } else if !runs("clang") || !runs("cc") {
        Some("examples/ebpf_engine: no clang or cc".to_string())
    } else if !Path::new("/usr/include/bpf/libbpf.h").exists() {
        Some("examples/ebpf_engine: no libbpf (Debian libbpf-dev)".to_string())
    } else {
        None
    };
    if skip_reason("TOUCHSTONE_REQUIRE_EBPF", missing).is_some() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let env = engine_env(&tmp.path().join("build"));
    let engine = "exec:examples/ebpf_engine/run.sh";
    let dir = |name: &str| tmp.path().join(name).display().to_string();

    let o = run(&["layer-diff", "--device", engine, "--model", "tiny-llama", "--report-dir", &dir("ld")], &env, &[]);
    if o.status.code() == Some(2) && text(&o).contains("bpf(): refused here") && skip_reason("TOUCHSTONE_REQUIRE_EBPF", Some("examples/ebpf_engine: bpf() is refused on this machine".into())).is_some() {
        return;
    }
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report(&tmp.path().join("ld"));
    assert_eq!(r["summary"]["failed"].as_u64(), Some(0), "{}", r["summary"]);
    assert_eq!(r["summary"]["passed"].as_u64(), Some(35), "33 taps (every one of the 2 layers' 16, the embedding, the final norm and the logits), tap coverage and emulated departure: {}", r["summary"]);
    assert!(text(&o).contains("emulated_departure gate (4x): Pass"), "{}", text(&o));

    let o = run(&["fixed-token", "--device", engine, "--model", "tiny-llama", "--report-dir", &dir("ft")], &env, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("5 passed, 0 failed"), "kld_mean, top1, golden, greedy, kld_vs_emulation: {}", text(&o));

    // Qwen3's QK-norm, rotate-half RoPE and tied output.
    let o = run(&["layer-diff", "--device", engine, "--model", "tiny-qwen3", "--report-dir", &dir("ld-qwen3")], &env, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("first divergence: none"), "{}", text(&o));

    // One wrong shift in the FFN's Q16 product: red at that tap, in both gates.
    let bug = [("TOUCHSTONE_EBPF_SEEDED_BUG", "1")];
    let o = run(&["layer-diff", "--device", engine, "--model", "tiny-llama", "--report-dir", &dir("ld-bug")], &env, &bug);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("first divergence: blk.0.ffn_act (isolated)"), "{}", text(&o));
    let o = run(&["fixed-token", "--device", engine, "--model", "tiny-llama", "--report-dir", &dir("ft-bug")], &env, &bug);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).lines().any(|l| l.contains("Fail") && l.contains("gate=kld_vs_emulation")), "{}", text(&o));

    // SmolLM2: 135M weights (and the tied table twice) in 256 MiB chunks of the weight map.
    let o = run(&["layer-diff", "--device", engine, "--model", "smollm2", "--prompt-ids", "504,3575,282,4649,314", "--report-dir", &dir("ld-smollm2")], &env, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report(&tmp.path().join("ld-smollm2"));
    assert_eq!((r["summary"]["failed"].as_u64(), r["summary"]["passed"].as_u64()), (Some(0), Some(455)), "{}", r["summary"]);
}

#[test]
fn the_baremetal_kernel_boots_under_qemu_and_is_judged_by_its_ids_and_logits() {
    let missing = if !runs("clang") || !runs("ld") {
        Some("examples/baremetal: no clang or ld (binutils)".to_string())
    } else if !runs("qemu-system-x86_64") {
        Some("examples/baremetal: no qemu-system-x86_64 (Debian qemu-system-x86)".to_string())
    } else if !runs("python3") {
        Some("examples/baremetal: no python3 for its serial reader".to_string())
    } else {
        None
    };
    if skip_reason("TOUCHSTONE_REQUIRE_BAREMETAL", missing).is_some() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let env = engine_env(&tmp.path().join("build"));
    let dir = |name: &str| tmp.path().join(name).display().to_string();
    let gate_line = |o: &std::process::Output, verdict: &str, gate: &str| text(o).lines().any(|l| l.contains(verdict) && l.contains(&format!("gate={gate})")));

    // The ids it prints on its serial console, judged by the greedy gate.
    let o = run(&["fixed-token", "--device", "ids:examples/baremetal/run.sh", "--model", "tiny-llama", "--report-dir", &dir("ids")], &env, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(gate_line(&o, "Pass", "greedy"), "{}", text(&o));
    // Its logits, framed over the second serial port, judged by the logit gates.
    let o = run(&["fixed-token", "--device", "exec:examples/baremetal/run.sh", "--model", "tiny-llama", "--report-dir", &dir("exec")], &env, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("4 passed, 0 failed"), "kld_mean, top1, golden, greedy: {}", text(&o));

    // An off-by-one RoPE position in the queries: the greedy ids and the logits both go red.
    let bug = [("TOUCHSTONE_BAREMETAL_SEEDED_BUG", "1")];
    let o = run(&["fixed-token", "--device", "ids:examples/baremetal/run.sh", "--model", "tiny-llama", "--report-dir", &dir("ids-bug")], &env, &bug);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(gate_line(&o, "Fail", "greedy"), "{}", text(&o));
    let o = run(&["fixed-token", "--device", "exec:examples/baremetal/run.sh", "--model", "tiny-llama", "--report-dir", &dir("exec-bug")], &env, &bug);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(gate_line(&o, "Fail", "kld_mean") && gate_line(&o, "Fail", "top1"), "{}", text(&o));

    // A model it cannot read: the kernel says why on its console, and the run cannot go on (exit 2).
    let q8 = tmp.path().join("q8.flat");
    let o = xtask(&["export", "--model", "tiny-llama", "--type", "q8_0", "--out", q8.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let o = run(&["fixed-token", "--device", "ids:examples/baremetal/run.sh", "--model", q8.to_str().unwrap(), "--report-dir", &dir("q8")], &env, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("not f32: this kernel reads f32 flat files"), "{}", text(&o));
}
