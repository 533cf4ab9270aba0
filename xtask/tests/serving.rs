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
