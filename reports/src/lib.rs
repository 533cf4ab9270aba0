//! # reports — the Report schema and its writers
//!
//! One `Report` per suite run: schema version, provenance, summary and cases. `report.json` is the
//! source of truth; `report.md`, `junit.xml` and `cases.csv` are rendered from it. Writes are
//! atomic (temp file + rename). Reports from shards merge into one (`Report::merge`).

pub mod compare;
pub mod findings;
pub use findings::Metrics;
mod markdown;
pub use markdown::{verdict_word, MARKDOWN_LIMIT};
#[cfg(feature = "parquet")]
pub mod parquet;
pub mod plot;
pub mod settings;

use serde::{Deserialize, Serialize};
use std::path::Path;

pub const SCHEMA_VERSION: u32 = 1;

/// Whether a report of `schema_version` can be read as this build's [`Report`]: only its own
/// version (another one's fields may mean other things), or why not.
pub fn check_schema_version(schema_version: u64) -> Result<(), String> {
    if schema_version == SCHEMA_VERSION as u64 {
        Ok(())
    } else {
        Err(format!("report schema version {schema_version}; this build reads version {SCHEMA_VERSION} only (docs/REPORT_SCHEMA.md)"))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Pass,
    Fail,
    Unsupported,
    Error,
    /// A statistical comparison that needs more samples to decide (A/B): exit code 3.
    Inconclusive,
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
    pub metrics: Metrics,
    pub tolerance: Tolerance,
    /// bound - measured error (negative = over budget).
    pub margin: f64,
    pub message: Option<String>,
}

impl Case {
    /// The measured error over its bound: the case's `worst_error_over_bound` (kernel cases,
    /// element by element), else, for a case whose rule is an upper bound (`x <= bound`, with
    /// `margin` = bound - x), x / bound. None for exact or discrete rules.
    pub fn error_over_bound(&self) -> Option<f64> {
        if let Some(r) = self.metrics.get("worst_error_over_bound").and_then(|v| v.as_f64()) {
            return Some(r);
        }
        let b = self.tolerance.bound;
        (b > 0.0 && b.is_finite() && self.margin.is_finite() && self.tolerance.rule.contains("<=")).then(|| (b - self.margin) / b)
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Summary {
    pub executed: usize,
    pub passed: usize,
    pub failed: usize,
    pub unsupported: usize,
    pub errors: usize,
    #[serde(default)]
    pub inconclusive: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Provenance {
    pub git_rev: Option<String>,
    pub dirty: Option<bool>,
    pub host: String,
    pub cpu: String,
    pub threads: usize,
    pub touchstone_version: String,
    /// The revision of Touchstone that made the report (`abc123def456`, `-dirty` with
    /// uncommitted changes; "unknown" from a source archive), recorded when the binary was built;
    /// absent from reports made by a library caller that did not set it. `git_rev` is the
    /// revision of the directory it ran in (the engine's repository, for an installed binary).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub touchstone_revision: Option<String>,
    /// Devices the run opened: name -> hardware and driver (`cuda:0` -> `NVIDIA H200, sm_90,
    /// CUDA driver 12.8`).
    #[serde(default)]
    pub devices: std::collections::BTreeMap<String, String>,
    /// Cargo features the binary was built with (`cuda`, `rocm`, `parquet`).
    #[serde(default)]
    pub features: Vec<String>,
    /// Kernel and CPU settings that change how a timing behaves (see `settings`), as the OS
    /// states them; absent keys the OS did not state.
    #[serde(default)]
    pub machine_settings: std::collections::BTreeMap<String, String>,
    /// The context the models were configured for (`--context N` / `TOUCHSTONE_CONTEXT`: a
    /// LongRoPE model's long factors when longer than its original context); absent: the default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<String>,
    /// When the command that made the report started and when it collected its results, UTC,
    /// RFC 3339 to the second (`2026-12-03T16:50:31Z`); absent in reports from before these fields.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    /// The machine and the build, as a reader of a published figure needs them: `cores`,
    /// `memory_gib`, `kernel`, `os`, `governor` (cpu0's cpufreq scaling governor, or `not
    /// exposed`: virtual machines usually hide it), `rustc`, `build_profile` (keys the OS or build
    /// did not state are absent).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub machine: std::collections::BTreeMap<String, String>,
}

/// The machine and build facts of [`Provenance::machine`].
fn machine() -> std::collections::BTreeMap<String, String> {
    let mut m = std::collections::BTreeMap::new();
    let read = |p: &str| std::fs::read_to_string(p).ok();
    if let Ok(n) = std::thread::available_parallelism() {
        m.insert("cores".into(), n.to_string());
    }
    if let Some(kb) = read("/proc/meminfo").and_then(|s| s.lines().find(|l| l.starts_with("MemTotal:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())) {
        m.insert("memory_gib".into(), format!("{:.1}", kb / (1024.0 * 1024.0)));
    }
    if let Some(k) = read("/proc/sys/kernel/osrelease") {
        m.insert("kernel".into(), k.trim().to_string());
    }
    if let Some(os) = read("/etc/os-release").and_then(|s| s.lines().find_map(|l| l.strip_prefix("PRETTY_NAME=").map(|v| v.trim_matches('"').to_string()))) {
        m.insert("os".into(), os);
    }
    let governor = read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor").map(|g| g.trim().to_string());
    m.insert("governor".into(), governor.unwrap_or_else(|| "not exposed".into()));
    for (k, v) in [("rustc", env!("TOUCHSTONE_RUSTC")), ("build_profile", env!("TOUCHSTONE_PROFILE"))] {
        if !v.is_empty() {
            m.insert(k.into(), v.to_string());
        }
    }
    m
}

static BUILD_REVISION: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

/// The revision of Touchstone the running binary was built from, for [`Provenance::collect`]
/// (the binary's build script knows it; this crate is built before it).
pub fn set_build_revision(revision: &'static str) {
    let _ = BUILD_REVISION.set(revision);
}

static START: std::sync::OnceLock<std::time::SystemTime> = std::sync::OnceLock::new();

/// Marks now as the start of this run (the first call counts); [`Provenance::collect`] records it
/// as `started_at` (the time of its own call when nothing marked one).
pub fn mark_start() {
    START.get_or_init(std::time::SystemTime::now);
}

/// A time as RFC 3339 UTC to the second.
fn rfc3339(t: std::time::SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
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
            touchstone_revision: BUILD_REVISION.get().map(|r| r.to_string()),
            devices: Default::default(),
            features: Vec::new(),
            machine_settings: settings::collect(),
            context: std::env::var("TOUCHSTONE_CONTEXT").ok(),
            started_at: Some(rfc3339(*START.get_or_init(std::time::SystemTime::now))),
            finished_at: Some(rfc3339(std::time::SystemTime::now())),
            machine: machine(),
        }
    }
}

/// The kernel suite's op names (`oracle::registry::Op::name`, which this crate does not depend
/// on; a test in `suites` holds the two lists equal): a case id that starts with one is on the
/// `ops` rung.
pub const KERNEL_OPS: [&str; 25] = ["embed", "rms_norm", "layer_norm", "matmul", "add_bias", "add", "rope", "qk_norm", "attention", "attention_sinks", "attention_softcap", "softmax", "softcap", "silu", "gelu_tanh", "swiglu", "geglu", "swiglu_oai", "moe_route", "argmax", "top_k", "sample", "delta_rule", "ssm_scan", "mla_attention"];

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    pub schema_version: u32,
    pub suite: String,
    pub provenance: Provenance,
    pub summary: Summary,
    pub cases: Vec<Case>,
    /// Suite-specific sections at the top level of report.json (`first_divergence`,
    /// `token_stats`, `ab`, ...), documented in docs/REPORT_SCHEMA.md.
    #[serde(flatten)]
    pub sections: serde_json::Map<String, serde_json::Value>,
}

impl Report {
    pub fn new(suite: &str, provenance: Provenance, cases: Vec<Case>) -> Report {
        let mut report = Report { schema_version: SCHEMA_VERSION, suite: suite.into(), provenance, summary: Summary::default(), cases: Vec::new(), sections: Default::default() };
        for c in cases {
            report.push_case(c);
        }
        report
    }

    /// Sets the section `key` of report.json to `value`, turned into JSON here (a value with no
    /// JSON form is recorded as null).
    pub fn set_section(&mut self, key: &str, value: &impl Serialize) {
        self.sections.insert(key.to_string(), serde_json::to_value(value).unwrap_or(serde_json::Value::Null));
    }

    /// The section `key` read as `T`: None where the report has none (or null), Err naming the
    /// section where it does not read as one.
    pub fn section<T: serde::de::DeserializeOwned>(&self, key: &str) -> Option<Result<T, String>> {
        let v = self.sections.get(key).filter(|v| !v.is_null())?;
        Some(T::deserialize(v).map_err(|e| format!("report section `{key}`: {e}")))
    }

    /// Adds a case, counting it in the summary.
    pub fn push_case(&mut self, c: Case) {
        let s = &mut self.summary;
        s.executed += 1;
        match c.verdict {
            Verdict::Pass => s.passed += 1,
            Verdict::Fail => s.failed += 1,
            Verdict::Unsupported => s.unsupported += 1,
            Verdict::Error => s.errors += 1,
            Verdict::Inconclusive => s.inconclusive += 1,
        }
        self.cases.push(c);
    }

    /// Gate outcome per the exit-code contract: 0 all passed, 1 a case failed or nothing ran,
    /// 2 a case could not run, 3 a statistical case is inconclusive.
    pub fn exit_code(&self) -> u8 {
        if self.summary.errors > 0 {
            2
        } else if self.summary.failed > 0 {
            1
        } else if self.summary.inconclusive > 0 {
            3
        } else if self.summary.passed == 0 {
            1
        } else {
            0
        }
    }

    /// Op name and dtype of a case id such as `matmul(w=q4_1,k=576,...)` -> ("matmul", "q4_1").
    pub fn op_and_dtype(id: &str) -> (String, String) {
        let op = id.split('(').next().unwrap_or(id).to_string();
        let params = id.split_once('(').map(|(_, p)| p.trim_end_matches(')')).unwrap_or("");
        let dtype = params
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == "w" || *k == "dtype")
            .map(|(_, v)| v.to_string())
            .unwrap_or_else(|| "-".into());
        (op, dtype)
    }

    /// Coverage matrix: (op, dtype) -> device -> [pass, fail, unsupported, error].
    pub fn coverage(&self) -> std::collections::BTreeMap<(String, String), std::collections::BTreeMap<String, [usize; 4]>> {
        let mut m: std::collections::BTreeMap<(String, String), std::collections::BTreeMap<String, [usize; 4]>> = Default::default();
        for c in &self.cases {
            let cell = m.entry(Self::op_and_dtype(&c.id)).or_default().entry(c.device.clone()).or_default();
            cell[match c.verdict {
                Verdict::Pass => 0,
                Verdict::Fail => 1,
                Verdict::Unsupported => 2,
                Verdict::Error | Verdict::Inconclusive => 3,
            }] += 1;
        }
        m
    }

    pub fn to_markdown(&self) -> String {
        self.markdown(true)
    }

    /// The same without the folded table of every case and the coverage by op (for CI step
    /// summaries).
    pub fn to_markdown_summary(&self) -> String {
        self.markdown(false)
    }

    /// The rung of the ladder a case belongs to, for JUnit class names: `ops` (kernel cases),
    /// `layers`, `tokens`, `oracle` (the self-check), `bench`, else the case's own op.
    pub fn rung(id: &str) -> String {
        let (op, _) = Self::op_and_dtype(id);
        let is_op = KERNEL_OPS.contains(&op.as_str());
        match op.as_str() {
            _ if is_op => "ops".into(),
            "layer_diff" | "layers" => "layers".into(),
            "fixed_token" | "tokens" => "tokens".into(),
            "cache_consistency" | "thread_determinism" | "f64_shadow" | "weight_store" | "oracle" => "oracle".into(),
            _ => op,
        }
    }

    /// JUnit XML: one testcase per case id (classname `touchstone.RUNG.DEVICE`, the device's
    /// name or `--name` label with characters other than letters, digits, `_`, `-` and `:` as
    /// `_`; time the case's `seconds` or `wall_seconds`), failures and errors with their message,
    /// unsupported cases as skipped.
    pub fn to_junit(&self) -> String {
        let esc = |s: &str| s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;");
        let s = &self.summary;
        let mut out = format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites>\n<testsuite name=\"touchstone.{}\" tests=\"{}\" failures=\"{}\" errors=\"{}\" skipped=\"{}\">\n",
            esc(&self.suite),
            s.executed,
            s.failed,
            s.errors,
            s.unsupported
        );
        for c in &self.cases {
            let secs = c.metrics.get("seconds").or_else(|| c.metrics.get("wall_seconds")).and_then(|v| v.as_f64()).unwrap_or(0.0);
            let device: String = c.device.chars().map(|ch| if ch.is_ascii_alphanumeric() || "_-:".contains(ch) { ch } else { '_' }).collect();
            out += &format!("  <testcase classname=\"touchstone.{}.{}\" name=\"{}\" time=\"{secs:.6}\">", esc(&Self::rung(&c.id)), esc(&device), esc(&c.id));
            let msg = esc(c.message.as_deref().unwrap_or(""));
            match c.verdict {
                Verdict::Pass => {}
                Verdict::Fail => out += &format!("<failure message=\"{msg}\">rule: {} bound: {:e} margin: {:e}</failure>", esc(&c.tolerance.rule), c.tolerance.bound, c.margin),
                Verdict::Error => out += &format!("<error message=\"{msg}\"/>"),
                Verdict::Unsupported => out += &format!("<skipped message=\"unsupported: {msg}\"/>"),
                Verdict::Inconclusive => out += &format!("<skipped message=\"inconclusive: {msg}\"/>"),
            }
            out += "</testcase>\n";
        }
        out + "</testsuite>\n</testsuites>\n"
    }

    /// CSV: one row per case.
    pub fn to_csv(&self) -> String {
        let mut out = String::from("id,device,op,dtype,verdict,max_abs,max_rel,max_ulp,nmse,cosine,bound,margin,gbps,gflops,rule\n");
        let q = |s: &str| format!("\"{}\"", s.replace('"', "\"\""));
        let f = |c: &Case, k: &str| c.metrics.get(k).map(|v| v.to_string()).unwrap_or_default();
        for c in &self.cases {
            let (op, dt) = Self::op_and_dtype(&c.id);
            out += &format!(
                "{},{},{},{},{:?},{},{},{},{},{},{:e},{:e},{},{},{}\n",
                q(&c.id),
                q(&c.device),
                op,
                dt,
                c.verdict,
                f(c, "max_abs"),
                f(c, "max_rel"),
                f(c, "max_ulp"),
                f(c, "nmse"),
                f(c, "cosine"),
                c.tolerance.bound,
                c.margin,
                f(c, "gbps"),
                f(c, "gflops"),
                q(&c.tolerance.rule)
            );
        }
        out
    }

    /// Merges shard reports of one suite: cases concatenated (sorted by id, device), summary
    /// recomputed, provenance of the first, but running from the earliest start to the latest
    /// finish.
    pub fn merge(parts: Vec<Report>) -> Option<Report> {
        let mut first = parts.first()?.clone();
        first.provenance.started_at = parts.iter().filter_map(|r| r.provenance.started_at.clone()).min();
        first.provenance.finished_at = parts.iter().filter_map(|r| r.provenance.finished_at.clone()).max();
        let mut cases: Vec<Case> = parts.into_iter().flat_map(|r| r.cases).collect();
        cases.sort_by(|a, b| (&a.id, &a.device).cmp(&(&b.id, &b.device)));
        Some(Report::new(&first.suite, first.provenance, cases))
    }

    /// Charts a suite stored in its `charts` section (`[{stem, chart}]`): drawn from report.json
    /// so `report render` reproduces them.
    pub fn charts(&self) -> std::io::Result<Vec<(String, plot::Chart)>> {
        let Some(v) = self.sections.get("charts") else { return Ok(Vec::new()) };
        let list: Vec<NamedChart> = serde_json::from_value(v.clone()).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("report.json `charts`: {e}")))?;
        Ok(list.into_iter().map(|c| (c.stem, c.chart)).collect())
    }

    /// Adds a chart (drawn as `<stem>.png` / `<stem>.svg` when the report is written).
    pub fn add_chart(&mut self, stem: &str, mut chart: plot::Chart) {
        // JSON has no NaN/Inf: non-finite points are dropped (they could not be drawn either).
        for s in &mut chart.series {
            s.points.retain(|(x, y)| x.is_finite() && y.is_finite());
        }
        chart.band = chart.band.filter(|(lo, hi)| lo.is_finite() && hi.is_finite());
        let entry = self.sections.entry("charts").or_insert_with(|| serde_json::Value::Array(Vec::new()));
        if let serde_json::Value::Array(a) = entry {
            a.push(serde_json::to_value(NamedChart { stem: stem.into(), chart }).expect("chart serializes"));
        }
    }

    /// Adds a Markdown table section: rendered in report.md under `title`.
    pub fn add_table(&mut self, key: &str, title: &str, columns: &[&str], rows: Vec<Vec<String>>) {
        self.sections.insert(key.into(), serde_json::json!({ "title": title, "columns": columns, "rows": rows }));
    }

    /// A table report.md folds under the summary (`"detail": true`): per-pair or per-layer
    /// detail a reader opens when the summary asks for it.
    pub fn add_detail_table(&mut self, key: &str, title: &str, columns: &[&str], rows: Vec<Vec<String>>) {
        self.sections.insert(key.into(), serde_json::json!({ "title": title, "columns": columns, "rows": rows, "detail": true }));
    }

    /// A table report.md shows first, under the report's title and before its counts and
    /// provenance (`"lead": true`): the summary a reader pastes, with `notes` as paragraphs under
    /// it.
    pub fn add_lead_table(&mut self, key: &str, title: &str, columns: &[&str], rows: Vec<Vec<String>>, notes: &[String]) {
        self.sections.insert(key.into(), serde_json::json!({ "title": title, "columns": columns, "rows": rows, "lead": true, "notes": notes }));
    }

    pub fn read(dir: &Path) -> std::io::Result<Report> {
        let path = dir.join("report.json");
        let text = std::fs::read_to_string(&path).map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        let report: Report = serde_json::from_str(&text).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {e}", path.display())))?;
        check_schema_version(report.schema_version as u64).map_err(|why| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {why}", path.display())))?;
        Ok(report)
    }

    /// Writes report.json, report.md, junit.xml and cases.csv into `dir` atomically.
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        write_atomic(&dir.join("report.json"), (serde_json::to_string_pretty(self).expect("report serializes") + "\n").as_bytes())?;
        self.render(dir)
    }

    /// Re-renders every derived file from this report (used by `report render`).
    pub fn render(&self, dir: &Path) -> std::io::Result<()> {
        write_atomic(&dir.join("report.md"), self.to_markdown().as_bytes())?;
        write_atomic(&dir.join("junit.xml"), self.to_junit().as_bytes())?;
        write_atomic(&dir.join("cases.csv"), self.to_csv().as_bytes())?;
        for (stem, chart) in self.charts()? {
            plot::write_chart(dir, &stem, &chart)?;
        }
        #[cfg(feature = "parquet")]
        parquet::write_all(self, dir)?;
        if let Some(summary) = std::env::var_os("GITHUB_STEP_SUMMARY") {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new().create(true).append(true).open(summary)?;
            f.write_all(self.to_markdown_summary().as_bytes())?;
        }
        Ok(())
    }
}

#[derive(Serialize, Deserialize)]
struct NamedChart {
    stem: String,
    chart: plot::Chart,
}

pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}
