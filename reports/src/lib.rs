//! # reports — the Report schema and its writers
//!
//! One `Report` per suite run: schema version, provenance, summary and cases. `report.json` is the
//! source of truth; `report.md` is rendered from it. Writes are atomic (temp file + rename).
//! (JUnit, CSV, Parquet and plots arrive with the kernel gate; see docs/ARCHITECTURE.md.)

use serde::{Deserialize, Serialize};
use std::path::Path;

pub const SCHEMA_VERSION: u32 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Pass,
    Fail,
    Unsupported,
    Error,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Tolerance {
    /// The rule in words, e.g. "exact (bit-identical)".
    pub rule: String,
    pub bound: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Case {
    pub id: String,
    pub device: String,
    pub verdict: Verdict,
    pub metrics: serde_json::Map<String, serde_json::Value>,
    pub tolerance: Tolerance,
    /// bound - measured error (negative = over budget).
    pub margin: f64,
    pub message: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Summary {
    pub executed: usize,
    pub passed: usize,
    pub failed: usize,
    pub unsupported: usize,
    pub errors: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Provenance {
    pub git_rev: Option<String>,
    pub dirty: Option<bool>,
    pub host: String,
    pub cpu: String,
    pub threads: usize,
    pub touchstone_version: String,
}

impl Provenance {
    /// Collects what the machine says about itself; missing facts are None, never invented.
    pub fn collect(threads: usize) -> Provenance {
        let git = |args: &[&str]| {
            std::process::Command::new("git").args(args).output().ok().filter(|o| o.status.success()).map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        };
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| s.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_string()))
            .unwrap_or_else(|| std::env::consts::ARCH.to_string());
        Provenance {
            git_rev: git(&["rev-parse", "HEAD"]),
            dirty: git(&["status", "--porcelain"]).map(|s| !s.is_empty()),
            host: std::fs::read_to_string("/etc/hostname").map(|s| s.trim().to_string()).unwrap_or_default(),
            cpu,
            threads,
            touchstone_version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    pub schema_version: u32,
    pub suite: String,
    pub provenance: Provenance,
    pub summary: Summary,
    pub cases: Vec<Case>,
}

impl Report {
    pub fn new(suite: &str, provenance: Provenance, cases: Vec<Case>) -> Report {
        let mut s = Summary { executed: cases.len(), ..Default::default() };
        for c in &cases {
            match c.verdict {
                Verdict::Pass => s.passed += 1,
                Verdict::Fail => s.failed += 1,
                Verdict::Unsupported => s.unsupported += 1,
                Verdict::Error => s.errors += 1,
            }
        }
        Report { schema_version: SCHEMA_VERSION, suite: suite.into(), provenance, summary: s, cases }
    }

    /// Gate outcome per the exit-code contract: 0 all passed, 1 a case failed or nothing ran,
    /// 2 a case could not run.
    pub fn exit_code(&self) -> u8 {
        if self.summary.errors > 0 {
            2
        } else if self.summary.failed > 0 || self.summary.passed == 0 {
            1
        } else {
            0
        }
    }

    pub fn to_markdown(&self) -> String {
        let s = &self.summary;
        let mut out = format!(
            "# Touchstone `{}` report\n\n{} executed, {} passed, {} failed, {} unsupported, {} errors\n\n| case | device | verdict | measured | bound | margin |\n|---|---|---|---|---|---|\n",
            self.suite, s.executed, s.passed, s.failed, s.unsupported, s.errors
        );
        for c in &self.cases {
            let measured = c.metrics.get("max_abs").and_then(|v| v.as_f64()).unwrap_or(f64::NAN);
            out += &format!("| `{}` | {} | {:?} | {:.3e} | {:.3e} | {:.3e} |\n", c.id, c.device, c.verdict, measured, c.tolerance.bound, c.margin);
        }
        out
    }

    /// Writes report.json and report.md into `dir` atomically.
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        write_atomic(&dir.join("report.json"), (serde_json::to_string_pretty(self).expect("report serializes") + "\n").as_bytes())?;
        write_atomic(&dir.join("report.md"), self.to_markdown().as_bytes())?;
        if let Some(summary) = std::env::var_os("GITHUB_STEP_SUMMARY") {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new().create(true).append(true).open(summary)?;
            f.write_all(self.to_markdown().as_bytes())?;
        }
        Ok(())
    }
}

pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}
