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
