//! `cargo xtask ab-calibrate --arm DEVICE --model M`: how often `ab` is wrong on a real engine.
//!
//! Runs `--decisions` real comparisons of the arm against itself (A/A: any "faster" or "slower"
//! is a false alarm) and as many against the same arm made really slower (`DEVICE+slow=PCT`,
//! busy-waiting PCT percent of each forward pass's own time: any verdict but "slower" is a miss),
//! alternating the two so the machine's drift touches both alike. Each decision is a whole
//! `ab` run, a child process with `ab`'s own defaults (or the arguments after `--`). With
//! `--exec` the arm is the same device behind the `exec:` arm protocol, a fresh process per run,
//! as a user's engine would be. The report gives the false-alarm rate and the power with their
//! Clopper-Pearson 95% intervals, the pairs and seconds a decision took, and the smallest change
//! the runs could detect. A/A passes when at most 5% of decisions alarmed and the interval's
//! upper end is at most 10%; the slowdown passes when at least 90% were called slower. Exit 0
//! when both pass, 1 when either fails, 2 when a decision could not run.

use crate::Exit;
use reports::{Case, Provenance, Report, Tolerance, Verdict};
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;
use suites::ab::clopper_pearson;

#[derive(clap::Args)]
pub struct AbCalibrateArgs {
    /// The engine compared with itself: a device of this build (cpu, cpu:kv-f16, fixed, cuda:0, ...).
    #[arg(long, default_value = "cpu")]
    arm: String,
    #[arg(long, default_value = "tiny-llama", help = concat!("Model: ", fixtures::model_names!(), ", or a path (as `ab --model`)."))]
    model: String,
    /// Real decisions per scenario (A/A and slowdown): 40 gives a false-alarm interval of
    /// 0-8.8% when none alarm.
    #[arg(long, default_value_t = 40)]
    decisions: usize,
    /// The injected slowdown of the second scenario, in percent of each forward pass.
    #[arg(long, default_value_t = 2.0)]
    slowdown: f64,
    /// Run the arm behind the `exec:` protocol (a fresh process per run) instead of as a server.
    #[arg(long)]
    exec: bool,
    /// Where report.json, report.md and every decision's own report go (default target/touchstone/ab-calibrate-YYYYMMDD-HHMMSS/).
    #[arg(long)]
    report_dir: Option<PathBuf>,
    /// Arguments for every `ab` run, after `--` (e.g. `-- --threshold 2 --max-pairs 160`).
    #[arg(last = true)]
    ab_args: Vec<String>,
}

/// One decision's outcome, read back from its `ab` report.
struct Decision {
    verdict: String,
    pairs: u64,
    change: f64,
    min_detectable: Option<f64>,
    seconds: f64,
}

#[derive(Clone, Copy, PartialEq)]
enum Scenario {
    AA,
    Slowed,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::AA => "A/A (the same engine twice)",
            Scenario::Slowed => "B really slower",
        }
    }
}

pub fn main(a: AbCalibrateArgs) -> Result<u8, Exit> {
    super::check_report_dir(a.report_dir.as_deref())?;
    if a.decisions == 0 || !(a.slowdown > 0.0 && a.slowdown <= 1000.0) {
        return Err(Exit::new(2, "need --decisions >= 1 and --slowdown a percentage in (0, 1000]"));
    }
    super::check_device(&super::device_arg(&a.arm).map_err(|e| Exit::new(2, format!("--arm: {e}")))?)?;
    if a.arm.starts_with("exec:") || a.arm.starts_with("external:") || a.arm.starts_with("ids:") {
        return Err(Exit::new(2, format!("--arm {}: give a device of this build; --exec runs it behind the exec: protocol", a.arm)));
    }
    super::resolve_model(&a.model)?;
    let exe = std::env::current_exe().map_err(|e| Exit::from(e))?;
    let slowed = format!("{}+slow={}", a.arm, a.slowdown);
    let spec = |device: &str| -> String {
        if a.exec {
            format!("exec:'{}' ab-run --device '{device}' --model '{}' --prompt-ids \"$TOUCHSTONE_PROMPT_IDS\" --gen-len \"$TOUCHSTONE_N_GENERATE\"", exe.display(), a.model)
        } else {
            device.to_string()
        }
    };
    let (arm_a, arm_slow) = (spec(&a.arm), spec(&slowed));
    let dir = match &a.report_dir {
        Some(d) => d.clone(),
        None => super::new_report_dir("ab-calibrate", None)?,
    };
    std::fs::create_dir_all(&dir).map_err(|e| super::io_exit(&dir, e))?;
    let mut done: Vec<(Scenario, Decision)> = Vec::new();
    let started = Instant::now();
    let mut failure = None;
    'runs: for i in 0..a.decisions {
        // Alternate which scenario goes first, as ab alternates its arms.
        let order = if i % 2 == 0 { [Scenario::AA, Scenario::Slowed] } else { [Scenario::Slowed, Scenario::AA] };
        for sc in order {
            let b = if sc == Scenario::AA { &arm_a } else { &arm_slow };
            let sub = dir.join(format!("decision-{:03}-{}", i + 1, if sc == Scenario::AA { "aa" } else { "slow" }));
            let t = Instant::now();
            let out = Command::new(&exe)
                .args(["ab", "--a", &arm_a, "--b", b, "--model", &a.model, "--report-dir", sub.to_str().unwrap_or_default()])
                .args(&a.ab_args)
                .stdin(std::process::Stdio::null())
                .output()
                .map_err(|e| Exit::new(2, format!("cannot run ab: {e}")))?;
            let seconds = t.elapsed().as_secs_f64();
            match read_decision(&sub, seconds) {
                Ok(d) if out.status.code() != Some(2) => {
                    eprintln!("ab-calibrate: {}/{} {}: {} ({:+.2}%, {} pairs, {seconds:.1} s; {:.0} s so far)", i + 1, a.decisions, sc.name(), d.verdict, 100.0 * d.change, d.pairs, started.elapsed().as_secs_f64());
                    done.push((sc, d));
                }
                other => {
                    let why = other.err().unwrap_or_else(|| String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("").to_string());
                    failure = Some(format!("decision {} ({}) could not run (exit {:?}): {why}; its report: {}", i + 1, sc.name(), out.status.code(), sub.display()));
                    break 'runs;
                }
            }
        }
        // Keep what is done so far, whatever happens next.
        write(&a, &dir, &done, failure.as_deref())?;
    }
    let report = write(&a, &dir, &done, failure.as_deref())?;
    print_table(&report);
    outln!("report: {}", dir.join("report.json").display());
    if let Some(f) = failure {
        return Err(Exit::new(2, f));
    }
    Ok(if report.cases.iter().any(|c| c.verdict == Verdict::Fail) { 1 } else { 0 })
}

fn read_decision(dir: &std::path::Path, seconds: f64) -> Result<Decision, String> {
    let path = dir.join("report.json");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let r: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let s = &r["ab"]["stats"];
    Ok(Decision {
        verdict: r["ab"]["verdict"].as_str().ok_or_else(|| format!("{}: no verdict", path.display()))?.to_string(),
        pairs: s["pairs"].as_u64().unwrap_or(0),
        change: s["median_change"].as_f64().unwrap_or(f64::NAN),
        min_detectable: s["min_detectable"].as_f64(),
        seconds,
    })
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// Builds and writes the report from the decisions so far.
fn write(a: &AbCalibrateArgs, dir: &std::path::Path, done: &[(Scenario, Decision)], failure: Option<&str>) -> Result<Report, Exit> {
    let med = |v: Vec<f64>| if v.is_empty() { f64::NAN } else { suites::throughput::median(&v) };
    let mut rows = Vec::new();
    let mut cases = Vec::new();
    for sc in [Scenario::AA, Scenario::Slowed] {
        let ds: Vec<&Decision> = done.iter().filter(|(s, _)| *s == sc).map(|(_, d)| d).collect();
        let count = |v: &str| ds.iter().filter(|d| d.verdict == v).count();
        let n = ds.len();
        let (faster, no_change, slower, inconclusive) = (count("faster"), count("no change"), count("slower"), count("inconclusive"));
        let k = if sc == Scenario::AA { faster + slower } else { slower };
        let (lo, hi) = clopper_pearson(k, n);
        let rate = if n == 0 { f64::NAN } else { k as f64 / n as f64 };
        let mde = med(ds.iter().filter_map(|d| d.min_detectable).collect());
        rows.push(vec![
            sc.name().to_string(),
            n.to_string(),
            format!("{faster} / {no_change} / {slower} / {inconclusive}"),
            format!("{} ({} .. {})", pct(rate), pct(lo), pct(hi)),
            format!("{:.0}", med(ds.iter().map(|d| d.pairs as f64).collect())),
            format!("{:+.2}%", 100.0 * med(ds.iter().map(|d| d.change).collect())),
            if mde.is_finite() { pct(mde) } else { "-".into() },
            format!("{:.1}", med(ds.iter().map(|d| d.seconds).collect())),
        ]);
        let (verdict, rule, message) = match sc {
            Scenario::AA => (
                if n == 0 {
                    Verdict::Error
                } else if rate <= 0.05 && hi <= 0.10 {
                    Verdict::Pass
                } else if lo > 0.05 {
                    Verdict::Fail
                } else {
                    Verdict::Inconclusive
                },
                "false alarms (faster or slower) in at most 5% of A/A decisions, the 95% interval's upper end at most 10%".to_string(),
                format!("{k} of {n} A/A decisions said faster or slower: {} (95% CI {} .. {})", pct(rate), pct(lo), pct(hi)),
            ),
            Scenario::Slowed => (
                if n == 0 {
                    Verdict::Error
                } else if rate >= 0.9 {
                    Verdict::Pass
                } else {
                    Verdict::Fail
                },
                format!("a real {}% slowdown called slower in at least 90% of decisions", a.slowdown),
                format!("{k} of {n} decisions called the {}% slowdown slower: {} (95% CI {} .. {}); the runs' smallest detectable change (median) {}", a.slowdown, pct(rate), pct(lo), pct(hi), if mde.is_finite() { pct(mde) } else { "unknown".into() }),
            ),
        };
        let mut metrics = reports::Metrics::new();
        metrics.set("decisions", n);
        metrics.set("events", k);
        metrics.set("rate", rate);
        metrics.set("ci95", [lo, hi]);
        let bound = if sc == Scenario::AA { 0.05 } else { 0.9 };
        cases.push(Case {
            id: format!("ab_calibration(scenario={},arm={},model={},exec={})", if sc == Scenario::AA { "a_a" } else { "slowdown" }, a.arm, a.model, a.exec),
            device: a.arm.clone(),
            verdict: if failure.is_some() { Verdict::Error } else { verdict },
            metrics,
            tolerance: Tolerance { rule, bound },
            margin: if sc == Scenario::AA { bound - rate } else { rate - bound },
            message: Some(failure.map(String::from).unwrap_or(message)),
        });
    }
    let mut r = Report::new("ab-calibrate", Provenance::collect(rayon::current_num_threads()), cases);
    let how = if a.exec { format!("`{}` behind the exec: protocol (a fresh process per run)", a.arm) } else { format!("`{}` as ab server arms", a.arm) };
    let extra = if a.ab_args.is_empty() { "ab's defaults".to_string() } else { format!("`ab {}`", a.ab_args.join(" ")) };
    r.add_lead_table(
        "ab_calibration",
        &format!("Calibration: {how} on {}, {extra}, B really slower by {}%", a.model, a.slowdown),
        &["scenario", "decisions", "faster / no change / slower / inconclusive", "false alarms (A/A) or power (95% CI)", "median pairs", "median change of B", "smallest detectable change (median)", "median s per decision"],
        rows,
        &["False alarms: an A/A decision saying faster or slower. Power: the slowdown called slower. Intervals: Clopper-Pearson 95%. Each decision's own report is in its `decision-NNN-*` folder.".to_string()],
    );
    super::write_report(&mut r, Some(dir.to_path_buf()))?;
    Ok(r)
}

fn print_table(r: &Report) {
    if let Some(t) = r.sections.get("ab_calibration") {
        outln!("{}", t["title"].as_str().unwrap_or(""));
        for row in t["rows"].as_array().into_iter().flatten() {
            let cells: Vec<&str> = row.as_array().into_iter().flatten().filter_map(|c| c.as_str()).collect();
            outln!("  {}: {} decisions, faster/no change/slower/inconclusive {}, rate {}, median {} pairs, change {}, detectable {}, {} s each", cells[0], cells[1], cells[2], cells[3], cells[4], cells[5], cells[6], cells[7]);
        }
    }
    for c in &r.cases {
        outln!("{:?}: {}", c.verdict, c.message.as_deref().unwrap_or(""));
    }
}
