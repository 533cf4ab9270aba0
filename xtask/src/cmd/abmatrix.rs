//! `ab --model A,B --prompt-len 16,512`: a matrix of A/B comparisons in one command. Each
//! scenario (model x prompt length) is a whole `ab` run of its own, a child process with its own
//! interleaved restart groups and its own report in `scenario-NN-MODEL-pPROMPT/`; the matrix
//! report puts one row per scenario in a table first (as published A/B tables do: the arms'
//! decode and prefill speeds, B's change with its 95% CI, the verdict, pairs, outputs), then the
//! machine. Exit: 2 when a scenario could not run, else 1 when any is slower, else 3 when any
//! is inconclusive, else 0.

use super::ab::AbArgs;
use crate::Exit;
use reports::{Case, Provenance, Report, Tolerance, Verdict};
use std::path::Path;

/// `ab`: a matrix when `--model` or `--prompt-len` lists more than one, else one comparison.
pub fn main(a: AbArgs) -> Result<u8, Exit> {
    super::check_report_dir(a.report_dir.as_deref())?;
    match scenarios(&a) {
        Some(s) => run(&a, &s),
        None => super::ab::main(a),
    }
}

/// The scenarios (model, prompt length) when `--model` or `--prompt-len` lists more than one;
/// None for a single comparison. A `--model` that names an existing path is taken whole.
pub fn scenarios(a: &AbArgs) -> Option<Vec<(String, usize)>> {
    let models: Vec<String> = if Path::new(&a.model).exists() { vec![a.model.clone()] } else { a.model.split(',').map(|m| m.trim().to_string()).filter(|m| !m.is_empty()).collect() };
    if models.len() <= 1 && a.prompt_len.len() <= 1 {
        return None;
    }
    Some(models.iter().flat_map(|m| a.prompt_len.iter().map(move |p| (m.clone(), *p))).collect())
}

/// The child `ab` arguments for one scenario: everything as given but the model, the prompt
/// length and the report folder.
fn child_args(a: &AbArgs, model: &str, prompt_len: usize, dir: &Path) -> Vec<String> {
    use clap::ValueEnum;
    let mut v: Vec<String> = vec!["ab".into(), "--a".into(), a.a.clone(), "--b".into(), a.b.clone(), "--model".into(), model.into(), "--prompt-len".into(), prompt_len.to_string()];
    for (flag, value) in [
        ("--pairs", a.pairs.to_string()),
        ("--max-pairs", a.max_pairs.to_string()),
        ("--threshold", a.threshold.to_string()),
        ("--gen-len", a.gen_len.to_string()),
        ("--respawn-every", a.respawn_every.to_string()),
        ("--timeout", a.timeout.to_string()),
        ("--metric", a.metric.to_possible_value().map(|p| p.get_name().to_string()).unwrap_or_default()),
        ("--report-dir", dir.display().to_string()),
    ] {
        v.push(flag.into());
        v.push(value);
    }
    for (flag, value) in [("--a-name", &a.a_name), ("--b-name", &a.b_name)] {
        if let Some(n) = value {
            v.push(flag.into());
            v.push(n.clone());
        }
    }
    if a.allow_different_outputs {
        v.push("--allow-different-outputs".into());
    }
    v
}

/// A cell of a scenario's `ab_summary` table (row 0: A, 1: B, 2: B's change).
fn cell(r: &serde_json::Value, row: usize, col: usize) -> String {
    r["ab_summary"]["rows"][row][col].as_str().unwrap_or("-").to_string()
}

pub fn run(a: &AbArgs, scenarios: &[(String, usize)]) -> Result<u8, Exit> {
    let exe = std::env::current_exe().map_err(|e| Exit::from(e))?;
    let dir = match &a.report_dir {
        Some(d) => d.clone(),
        None => super::new_report_dir("ab", None)?,
    };
    std::fs::create_dir_all(&dir).map_err(|e| super::io_exit(&dir, e))?;
    let (name_a, name_b) = (a.a_name.clone().unwrap_or_else(|| a.a.clone()), a.b_name.clone().unwrap_or_else(|| a.b.clone()));
    let mut rows = Vec::new();
    let mut cases = Vec::new();
    let mut codes = Vec::new();
    for (k, (model, prompt_len)) in scenarios.iter().enumerate() {
        let stem: String = model.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
        let sub = dir.join(format!("scenario-{:02}-{stem}-p{prompt_len}", k + 1));
        eprintln!("ab: scenario {}/{}: {model}, {prompt_len}-token prompt", k + 1, scenarios.len());
        let out = std::process::Command::new(&exe).args(child_args(a, model, *prompt_len, &sub)).stdin(std::process::Stdio::null()).output().map_err(|e| Exit::new(2, format!("cannot run ab: {e}")))?;
        let code = out.status.code().unwrap_or(2);
        codes.push(code);
        let report: Option<serde_json::Value> = std::fs::read_to_string(sub.join("report.json")).ok().and_then(|t| serde_json::from_str(&t).ok());
        let why = String::from_utf8_lossy(&out.stderr).lines().rev().find(|l| l.starts_with("error")).unwrap_or("").to_string();
        let Some(r) = report.filter(|_| code != 2) else {
            rows.push(vec![model.clone(), prompt_len.to_string(), a.gen_len.to_string(), "-".into(), "-".into(), "-".into(), "-".into(), format!("could not run: {why}"), "-".into(), "-".into()]);
            cases.push(scenario_case(a, model, *prompt_len, Verdict::Error, format!("could not run (exit {code}): {why}; its report: {}", sub.display())));
            continue;
        };
        let s = &r["ab"]["stats"];
        let verdict = r["ab"]["verdict"].as_str().unwrap_or("?").to_string();
        rows.push(vec![
            model.clone(),
            prompt_len.to_string(),
            a.gen_len.to_string(),
            format!("{} / {}", cell(&r, 0, 1), cell(&r, 1, 1)),
            format!("{} / {}", cell(&r, 0, 2), cell(&r, 1, 2)),
            format!("{} / {}", cell(&r, 0, 3), cell(&r, 1, 3)),
            cell(&r, 2, 2),
            format!("**{verdict}**"),
            format!("{} ({} groups)", s["pairs"], s["groups"]),
            cell(&r, 2, 7),
        ]);
        let v = match verdict.as_str() {
            "slower" => Verdict::Fail,
            "inconclusive" => Verdict::Inconclusive,
            _ => Verdict::Pass,
        };
        cases.push(scenario_case(a, model, *prompt_len, v, r["cases"][0]["message"].as_str().unwrap_or("").to_string()));
    }
    let mut report = Report::new("ab", Provenance::collect(rayon::current_num_threads()), cases);
    report.add_lead_table(
        "ab_matrix",
        &format!("A/B matrix: A = {name_a}, B = {name_b}; {} per run, medians over runs", a.metric.words()),
        &["model", "prompt tokens", "generated", "decode tok/s A / B (mean, stalls in)", "fastest step ms/token A / B", "prefill tok/s A / B", "B's change (95% CI)", "verdict", "pairs", "outputs"],
        rows,
        &[format!("Each scenario is its own interleaved comparison (restart groups, ±{}% threshold); its full report is in its `scenario-NN-*` folder.", a.threshold)],
    );
    let dir = super::write_report(&mut report, Some(dir))?;
    if let Some(t) = report.sections.get("ab_matrix") {
        outln!("{}", t["title"].as_str().unwrap_or(""));
        for row in t["rows"].as_array().into_iter().flatten() {
            let cells: Vec<&str> = row.as_array().into_iter().flatten().filter_map(|c| c.as_str()).collect();
            outln!("  {}", cells.join(" | "));
        }
    }
    outln!("report: {}", dir.join("report.json").display());
    Ok(if codes.contains(&2) {
        2
    } else if codes.contains(&1) {
        1
    } else if codes.contains(&3) {
        3
    } else {
        0
    })
}

fn scenario_case(a: &AbArgs, model: &str, prompt_len: usize, verdict: Verdict, message: String) -> Case {
    Case {
        id: format!("ab(a={},b={},model={model},prompt_len={prompt_len})", a.a, a.b),
        device: format!("{} vs {}", a.b, a.a),
        verdict,
        metrics: reports::Metrics::new().with("prompt_len", prompt_len),
        tolerance: Tolerance { rule: format!("no change if the 95% CI of the change lies inside ±{}%", a.threshold), bound: a.threshold / 100.0 },
        margin: 0.0,
        message: Some(message),
    }
}
