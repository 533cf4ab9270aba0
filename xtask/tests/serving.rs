//! `cargo xtask serving`: green on `cpu`, every axis present in report.json; a device that serves
//! no schedules is unsupported and the run is not green; a bad request is refused naming it.

mod common;

use common::*;

#[test]
fn serving_judges_every_axis_on_cpu_and_is_unsupported_where_no_schedule_is_served() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cpu");
    let o = xtask(&["serving", "--device", "cpu", "--model", "tiny-mixed", "--report-dir", dir.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report(&dir);
    let cases = r["cases"].as_array().unwrap();
    for axis in ["batch", "neighbours", "prefix_cache", "chunks", "decode", "slot_reuse", "mixed_lengths"] {
        let of_axis: Vec<_> = cases.iter().filter(|c| c["id"].as_str().unwrap().contains(&format!("axis={axis},"))).collect();
        assert!(of_axis.len() >= 2 && of_axis.iter().all(|c| c["verdict"] == "pass"), "{axis}: {of_axis:?}");
    }
    assert_eq!(r["batch_invariant"], true);
    // The window of tiny-mixed puts a chunk boundary on its edge.
    assert!(cases.iter().any(|c| c["id"].as_str().unwrap().contains("axis=chunks,chunk=4)")), "{cases:?}");

    let dir = tmp.path().join("gpu-emu");
    let o = xtask(&["serving", "--device", "gpu-emu", "--model", "tiny-llama", "--report-dir", dir.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(1), "unsupported is never green: {}", text(&o));
    let r = report(&dir);
    assert_eq!((r["summary"]["unsupported"].as_u64(), r["summary"]["executed"].as_u64()), (Some(1), Some(1)), "{r}");

    let o = xtask(&["serving", "--device", "cpu", "--model", "tiny-llama", "--prompt-ids", "1,2,3", "--prompt-len", "3"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("a request of 3 tokens with a prompt of 3"), "{}", stderr(&o));
}

/// The example engine serves schedules through touchstone_serving.py and passes every axis; a
/// copy whose reused prefix holds a wrong token at its last position is red on `prefix_cache`,
/// naming the request and a position.
#[test]
fn the_example_engine_serves_schedules_and_a_seeded_prefix_bug_is_red() {
    if !python_with_reference_peers() {
        eprintln!("skipped: python3 with numpy and gguf is not installed");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = workspace().join("examples/external_engine");
    let ids = "1,15,27,3,9,44,8,2,19,33,5,12,40,7,21,30";
    let run = |engine_dir: &std::path::Path, report: &str| {
        let device = format!("exec:python3 {}", engine_dir.join("engine.py").display());
        let dir = tmp.path().join(report);
        let o = xtask(&["serving", "--device", &device, "--model", "tiny-llama", "--prompt-ids", ids, "--prompt-len", "10", "--report-dir", dir.to_str().unwrap()], &[]);
        (o, dir)
    };
    let (o, dir) = run(&src, "example");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(report(&dir)["batch_invariant"], true);

    let copy = tmp.path().join("engine-copy");
    std::fs::create_dir(&copy).unwrap();
    for f in ["engine.py", "touchstone_dump.py", "touchstone_serving.py"] {
        std::fs::copy(src.join(f), copy.join(f)).unwrap();
    }
    let engine = std::fs::read_to_string(copy.join("engine.py")).unwrap();
    let seeded = engine.replace("prefix=lambda cache, n: list(cache[:n])", "prefix=lambda cache, n: list(cache[:n - 1]) + [0]");
    assert_ne!(engine, seeded, "the seeded line is in engine.py");
    std::fs::write(copy.join("engine.py"), seeded).unwrap();
    let (o, dir) = run(&copy, "seeded");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let r = report(&dir);
    let red: Vec<&serde_json::Value> = r["cases"].as_array().unwrap().iter().filter(|c| c["verdict"] == "fail").collect();
    assert!(!red.is_empty() && red.iter().all(|c| c["id"].as_str().unwrap().contains("axis=prefix_cache,")), "{red:?}");
    let msg = red[0]["message"].as_str().unwrap();
    assert!(msg.contains("axis prefix_cache") && msg.contains("request `target`") && msg.contains("position"), "{msg}");
}
