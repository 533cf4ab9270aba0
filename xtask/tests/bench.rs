//! `bench` beyond the built-in devices: an `exec:` engine timed through `ab`'s arm protocol (its
//! own timings and peak RSS; a broken one named, exit 2), and `gate --suite bench` measuring each
//! case in a process of its own, so a case's peak RSS does not depend on what ran before it.

mod common;

use common::*;

const ENGINE: &str = "exec:python3 xtask/tests/engines/busy_engine.py";

fn case(report: &std::path::Path, prefix: &str) -> serde_json::Value {
    let r = common::report(report);
    r["cases"].as_array().unwrap().iter().find(|c| c["id"].as_str().unwrap().starts_with(prefix)).unwrap_or_else(|| panic!("no case {prefix}: {r}")).clone()
}

#[test]
fn bench_times_an_exec_engine_through_the_arm_protocol() {
    if std::process::Command::new("python3").arg("--version").output().is_err() {
        eprintln!("SKIPPED: python3 is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let o = xtask(&["bench", "--device", ENGINE, "--model", "tiny-llama", "--reps", "2", "--report-dir", dir.path().to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    // The engine takes 4 ms per token: about 250 tok/s by its own clock, the same default lengths as `ab`.
    let c = case(dir.path(), &format!("bench(device={ENGINE},model=tiny-llama,prompt=16,gen=32)"));
    let tok_s = c["metrics"]["decode_tok_per_s"].as_f64().unwrap();
    assert!((150.0..=260.0).contains(&tok_s), "{c}");
    let rss = c["metrics"]["peak_rss_kb"].as_u64().unwrap();
    assert!((1_000..2_000_000).contains(&rss), "the engine's own peak (a Python process), not this one's: {c}");
    assert!(c["metrics"]["output_hash"].is_string() && c["verdict"] == "pass", "{c}");
    let o = xtask(&["bench", "--device", "exec:echo no json here", "--model", "tiny-llama", "--reps", "1", "--report-dir", dir.path().join("broken").to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("exec:echo no json here") && text(&o).contains("JSON"), "{}", text(&o));
}

/// What the gate ran before a bench case (here the kernel suite, whose cases it holds) is not in
/// the case's peak RSS: measured in the gate's own process it was 499 MiB against 15 MiB.
#[test]
fn gate_bench_measures_each_case_in_its_own_process() {
    let dir = tempfile::tempdir().unwrap();
    let mut rss = Vec::new();
    for suites in ["bench", "kernels,bench"] {
        let report = dir.path().join(suites.replace(',', "-"));
        let o = xtask(&["gate", "--suite", suites, "--device", "cpu", "--model", "tiny-llama", "--report-dir", report.to_str().unwrap()], &[]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        rss.push(case(&report, "bench(device=cpu,")["metrics"]["peak_rss_kb"].as_f64().unwrap());
    }
    let (alone, after) = (rss[0], rss[1]);
    assert!((alone - after).abs() <= 0.2 * alone, "the bench case's peak RSS: {alone} kB alone, {after} kB after the kernel suite");
}
