//! The A/B command end to end: a real 3% per-token slowdown of an `exec:` arm is `slower` (exit 1)
//! and its identical twin `no change` (exit 0), server arms are judged by restart group, an arm
//! that fails or prints no JSON is exit 2 naming the arm and the pair, and outputs that
//! differ between arms are an error unless allowed.

mod common;

use common::*;

use std::process::Command;

fn python() -> bool {
    let ok = Command::new("python3").arg("--version").output().is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("SKIPPED: python3 is not installed");
    }
    ok
}

const ENGINE: &str = "python3 xtask/tests/engines/busy_engine.py";

#[test]
fn an_exec_arm_sleeping_3_percent_per_token_is_slower() {
    if !python() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let a = format!("exec:{ENGINE}");
    let b = format!("exec:EXTRA_SLEEP_PCT=3 {ENGINE}");
    let o = xtask(&["ab", "--a", &a, "--b", &b, "--model", "tiny-llama", "--pairs", "12", "--max-pairs", "40", "--threshold", "1", "--gen-len", "40", "--report-dir", dir.path().to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("SLOWER"), "{}", text(&o));
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json")).unwrap()).unwrap();
    let m = r["ab"]["stats"]["median_change"].as_f64().unwrap();
    assert!((0.015..0.06).contains(&m), "median change {m}");
    assert!(r["ab"]["pairs"].as_array().unwrap().len() >= 12, "every raw sample is kept");
    for f in ["report.md", "ab_changes.png", "ab_changes.svg", "ab_decode_latency.png", "cases.csv"] {
        assert!(dir.path().join(f).exists(), "{f}");
    }
    let md = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    assert!(md.contains("**summary**"));
    // The summary table comes first: an arm per row, then B's change with the verdict marked.
    let summary = md.find("## Summary: tiny-llama with a 16-token prompt and 40 generated tokens").expect("summary table");
    assert!(md.find("<details><summary>Per pair").is_some_and(|p| p > summary), "{md}");
    assert_eq!(r["ab_summary"]["rows"][0][0], format!("A: {a}"));
    assert!(r["ab_summary"]["rows"][2][2].as_str().unwrap().contains("**slower**"), "{}", r["ab_summary"]);
    // An exec: arm runs a fresh process per run: no restart groups to report.
    assert!(r["ab_groups"].is_null() && !text(&o).contains("per restart group"), "{}", text(&o));
    assert!(text(&o).contains("every pair counts once (each run a fresh process)"), "{}", text(&o));

    // Its identical twin: no change (exit 0), with the smallest detectable change stated.
    let o = xtask(&["ab", "--a", &a, "--b", &a, "--model", "tiny-llama", "--gen-len", "40", "--report-dir", dir.path().join("twin").to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("NO CHANGE") && text(&o).contains("with 80% power"), "{}", text(&o));
}

#[test]
fn failing_arms_and_different_outputs_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let o = xtask(&["ab", "--a", "exec:echo '{\"prefill_ms\":1,\"decode_ms\":5,\"n_prompt\":16,\"n_gen\":2,\"tokens\":[1,2]}'", "--b", "exec:exit 4", "--model", "tiny-llama", "--report-dir", dir.path().to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("arm B") && text(&o).contains("pair 1"), "{}", text(&o));
    assert!(text(&o).contains("no pair completed, nothing to compare") && !text(&o).contains("NaN"), "{}", text(&o));
    assert!(dir.path().join("report.json").exists(), "the report is written with what was gathered");

    // A line that does not add up: more tokens than listed, or than were asked for.
    for (n_gen, toks, gen_len) in [(32, "1,2", "32"), (3, "1,2,3", "2")] {
        let arm = format!("exec:echo '{{\"prefill_ms\":1,\"decode_ms\":5,\"n_prompt\":16,\"n_gen\":{n_gen},\"tokens\":[{toks}]}}'");
        let o = xtask(&["ab", "--a", &arm, "--b", &arm, "--model", "tiny-llama", "--gen-len", gen_len], &[]);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(text(&o).contains(&format!("says n_gen {n_gen} with ")) && text(&o).contains(&format!("for a request of {gen_len}")), "{}", text(&o));
    }

    let t0 = std::time::Instant::now();
    let o = xtask(&["ab", "--a", "exec:sleep 30", "--b", "exec:true", "--model", "tiny-llama", "--timeout", "1"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("arm A") && text(&o).contains("did not finish within 1 s"), "{}", text(&o));
    assert!(t0.elapsed().as_secs() < 20, "a hung arm is killed");

    // An arm flooding its stderr is stopped at the output limit, not read whole at the timeout.
    let o = xtask(&["ab", "--a", "exec:yes flood >&2", "--b", "exec:true", "--model", "tiny-llama", "--timeout", "120"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("arm A") && text(&o).contains("wrote more than 256 MiB to its stderr"), "{}", text(&o));

    let o = xtask(&["ab", "--a", "exec:echo not json", "--b", "exec:true", "--model", "tiny-llama"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("arm A") && text(&o).contains("no JSON"), "{}", text(&o));

    let line = |toks: &str| format!("exec:echo '{{\"prefill_ms\":1,\"decode_ms\":5,\"n_prompt\":16,\"n_gen\":3,\"tokens\":[{toks}]}}'");
    // Different outputs end the run at the first pair (of the ten asked for).
    let differ = dir.path().join("differ");
    let o = xtask(&["ab", "--a", &line("1,2,3"), "--b", &line("1,2,4"), "--model", "tiny-llama", "--pairs", "10", "--max-pairs", "10", "--report-dir", differ.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("outputs differ from generated token 2"), "{}", text(&o));
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(differ.join("report.json")).unwrap()).unwrap();
    assert_eq!(r["ab"]["pairs"].as_array().map(|p| p.len()), Some(1), "{}", r["ab"]);
    let o = xtask(&["ab", "--a", &line("1,2,3"), "--b", &line("1,2,4"), "--model", "tiny-llama", "--pairs", "2", "--max-pairs", "2", "--allow-different-outputs"], &[]);
    assert_ne!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("outputs differ from generated token 2"), "{}", text(&o));
}

/// `--metric` picks what is compared: an arm whose fastest decode step equals A's but whose
/// other steps stall (mean 2x) is "no change" by the fastest step, "slower" by the mean; an arm
/// with A's steps and a 10x prefill is slower only by the whole request. (Fixed JSON lines, so
/// every pair has the same ratio.)
#[test]
fn the_metric_option_chooses_what_is_compared() {
    let line = |prefill: u32, steps: &[f64]| {
        let step_ms = steps.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",");
        let decode: f64 = steps.iter().sum();
        format!("exec:echo '{{\"prefill_ms\":{prefill},\"decode_ms\":{decode},\"n_prompt\":16,\"n_gen\":5,\"tokens\":[1,2,3,4,5],\"step_ms\":[{step_ms}]}}'")
    };
    let a = line(10, &[1.0, 1.0, 1.0, 1.0]);
    let stalls = line(10, &[1.0, 2.0, 2.0, 3.0]);
    let slow_prefill = line(100, &[1.0, 1.0, 1.0, 1.0]);
    let dir = tempfile::tempdir().unwrap();
    for (b, metric, code, median, out) in [
        (&stalls, "fastest-step", 0, 0.0),
        (&stalls, "mean", 1, 1.0),
        (&stalls, "request", 1, 18.0 / 14.0 - 1.0),
        (&slow_prefill, "mean", 0, 0.0),
        (&slow_prefill, "request", 1, 104.0 / 14.0 - 1.0),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (b, metric, code, median))| (b, metric, code, median, dir.path().join(format!("{i}-{metric}"))))
    {
        let o = xtask(&["ab", "--a", &a, "--b", b, "--model", "tiny-llama", "--pairs", "10", "--max-pairs", "10", "--metric", metric, "--report-dir", out.to_str().unwrap()], &[]);
        assert_eq!(o.status.code(), Some(code), "{metric}: {}", text(&o));
        let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
        let m = r["ab"]["stats"]["median_change"].as_f64().unwrap();
        assert!((m - median).abs() < 1e-9, "{metric}: median change {m}, expected {median}");
        assert!(r["cases"][0]["id"].as_str().unwrap().starts_with("ab(metric="), "{}", r["cases"][0]["id"]);
    }
}

/// Server arms (devices) are restarted every `--respawn-every` pairs and judged by restart
/// group: the report has a row per group, the statistics count groups, and fewer than six groups
/// give no verdict however the pairs look (exit 3).
#[test]
fn server_arms_are_judged_by_restart_group() {
    let dir = tempfile::tempdir().unwrap();
    let o = xtask(&["ab", "--a", "cpu", "--b", "cpu", "--a-name", "base", "--b-name", "head", "--model", "tiny-llama", "--pairs", "8", "--max-pairs", "8", "--respawn-every", "4", "--report-dir", dir.path().to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json")).unwrap()).unwrap();
    let groups = r["ab_groups"]["rows"].as_array().unwrap();
    assert_eq!(groups.len(), 2, "{groups:?}");
    assert_eq!(groups[0][1], "1-4");
    assert_eq!(r["ab"]["stats"]["groups"], 2);
    assert!(text(&o).contains("per restart group of 4 pairs") && text(&o).contains("B (head) vs A (base)") && text(&o).contains("over 2 restart groups of 8 pairs"), "{}", text(&o));
    assert_eq!(r["ab_summary"]["rows"][1][0], "B: head");
    // The pasted table comes first in report.md, its verdict and rule under it, before the counts.
    let md = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    let (summary, counts) = (md.find("## Summary: tiny-llama").unwrap(), md.find(" executed, ").unwrap());
    assert!(summary < counts && md[summary..counts].contains("rule: a restart group (4 pairs"), "{md}");
}

/// A device made really slower by 30% (`cpu+slow=30`, busy-waiting 30% of each step's own time)
/// is called slower against its twin (exit 1), with every restart group agreeing.
#[test]
fn a_really_slower_device_arm_is_slower() {
    let dir = tempfile::tempdir().unwrap();
    let o = xtask(&["ab", "--a", "cpu", "--b", "cpu+slow=30", "--model", "tiny-llama", "--gen-len", "64", "--report-dir", dir.path().to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json")).unwrap()).unwrap();
    let m = r["ab"]["stats"]["median_change"].as_f64().unwrap();
    assert!((0.15..0.5).contains(&m), "median change {m}");
}

/// `ab-calibrate` runs whole `ab` decisions of an arm against itself and against the arm made
/// really slower, and reports the rates with their intervals: a 50% slowdown is found in every
/// decision; two A/A decisions cannot show a false-alarm rate under 10% (inconclusive, never a
/// pass); a non-device arm is refused.
#[test]
fn ab_calibrate_reports_false_alarms_and_power() {
    let dir = tempfile::tempdir().unwrap();
    let o = xtask(&["ab-calibrate", "--arm", "cpu", "--model", "tiny-llama", "--decisions", "2", "--slowdown", "50", "--report-dir", dir.path().to_str().unwrap(), "--", "--gen-len", "48"], &[]);
    assert!(matches!(o.status.code(), Some(0 | 1)), "{}", text(&o));
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json")).unwrap()).unwrap();
    let cases = r["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 2);
    assert_eq!(cases[0]["metrics"]["decisions"], 2);
    assert_eq!(cases[0]["verdict"], "inconclusive", "{}", cases[0]);
    assert_eq!((cases[1]["metrics"]["events"].as_u64(), cases[1]["verdict"].as_str()), (Some(2), Some("pass")), "{}", cases[1]);
    assert!(dir.path().join("decision-001-aa/report.json").exists() && dir.path().join("decision-002-slow/report.json").exists());
    let md = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    assert!(md.starts_with("# Touchstone `ab-calibrate` report\n\n## Calibration: `cpu` as ab server arms on tiny-llama, `ab --gen-len 48`, B really slower by 50%"), "{md}");

    let o = xtask(&["ab-calibrate", "--arm", "exec:true", "--decisions", "1"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

/// A matrix in one command: two models by two prompt lengths are four comparisons, each its
/// own `ab` run and report, one table with a row per scenario first in report.md; the exit code
/// is the worst scenario's (a slower B in every scenario: 1).
#[test]
fn a_matrix_of_models_and_prompt_lengths_is_one_table() {
    let line = |step: f64| format!("exec:echo '{{\"prefill_ms\":10,\"decode_ms\":{},\"n_prompt\":16,\"n_gen\":5,\"tokens\":[1,2,3,4,5],\"step_ms\":[{step},{step},{step},{step}]}}'", 4.0 * step);
    let dir = tempfile::tempdir().unwrap();
    let o = xtask(&["ab", "--a", &line(1.0), "--b", &line(1.1), "--a-name", "base", "--b-name", "head", "--model", "tiny-llama,tiny-qwen3", "--prompt-len", "8,16", "--pairs", "10", "--max-pairs", "10", "--gen-len", "5", "--report-dir", dir.path().to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json")).unwrap()).unwrap();
    let rows = r["ab_matrix"]["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "{rows:?}");
    assert_eq!((rows[0][0].as_str(), rows[0][1].as_str(), rows[3][0].as_str(), rows[3][1].as_str()), (Some("tiny-llama"), Some("8"), Some("tiny-qwen3"), Some("16")));
    assert!(rows.iter().all(|row| row[7] == "**slower**" && row[6].as_str().unwrap().starts_with("+10.00%")), "{rows:?}");
    assert!(dir.path().join("scenario-04-tiny-qwen3-p16/report.json").exists());
    let md = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    assert!(md.starts_with("# Touchstone `ab` report\n\n## A/B matrix: A = base, B = head"), "{md}");
}

/// `ab` on two built-in devices writes a report.md to paste: the summary table, the verdict with
/// its CI and the smallest change the run could detect, one chart as PNG, all in under 80 lines
/// before the folded detail; a debug build's timings are marked as such.
#[test]
fn ab_report_md_is_short_and_pasteable() {
    let dir = tempfile::tempdir().unwrap();
    let o = xtask(&["ab", "--a", "cpu", "--b", "cpu:kv-f16", "--model", "tiny-llama", "--pairs", "8", "--max-pairs", "8", "--gen-len", "16", "--report-dir", dir.path().to_str().unwrap()], &[]);
    assert!(matches!(o.status.code(), Some(0 | 1 | 3)), "{}", text(&o));
    let md = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    let summary = md.split("<details>").next().unwrap();
    assert!(summary.lines().count() < 80, "{} lines before the folded detail:\n{summary}", summary.lines().count());
    for want in ["## Summary: tiny-llama", "95% CI", "80% power", "![B vs A per pair", "ab_changes.png)", "Warning: measured with a debug build"] {
        assert!(summary.contains(want), "no `{want}` in the summary:\n{summary}");
    }
    assert!(!md.contains(".svg)"), "charts are linked as PNG: {md}");
    assert!(md.contains("<details><summary>Per pair"), "{md}");
    assert!(text(&o).contains("WARNING: this is a debug build"), "{}", text(&o));
}

/// Arms whose outputs differ stop the comparison at once, and every message says so: none claims
/// that `--max-pairs` ran out.
#[test]
fn ab_stopped_by_different_outputs_says_so() {
    let line = |tokens: &str| format!("exec:echo '{{\"prefill_ms\":10,\"decode_ms\":4,\"n_prompt\":16,\"n_gen\":5,\"tokens\":[{tokens}],\"step_ms\":[1,1,1,1]}}'");
    let dir = tempfile::tempdir().unwrap();
    let o = xtask(&["ab", "--a", &line("1,2,3,4,5"), "--b", &line("1,2,9,4,5"), "--model", "tiny-llama", "--pairs", "6", "--max-pairs", "100", "--gen-len", "5", "--report-dir", dir.path().to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let md = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    for t in [text(&o), md] {
        assert!(!t.contains("--max-pairs 100 reached"), "{t}");
        assert!(t.contains("outputs differ from generated token 2"), "{t}");
    }
}
