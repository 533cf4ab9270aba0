//! `cargo xtask export` and the flat model format end to end: an exported model is a model for
//! every command (judged on a device, refused with a reason where it cannot serve), a damaged
//! file exits 2 naming what is wrong, and the example C engine (examples/flat_engine), which reads
//! the format with its C header and no GGUF parser, is gated through `exec:` on the synthetic
//! models and on SmolLM2.

mod common;

use common::*;
use std::path::Path;

fn export(model: &str, ty: &str, out: &Path) -> serde_json::Value {
    let o = xtask(&["export", "--model", model, "--type", ty, "--out", out.to_str().unwrap(), "--json"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    serde_json::from_str(String::from_utf8_lossy(&o.stdout).trim()).unwrap()
}

#[test]
fn an_exported_model_is_judged_like_its_source() {
    let tmp = tempfile::tempdir().unwrap();
    let flat = tmp.path().join("tiny.flat");
    let summary = export("tiny-llama", "q4_0", &flat);
    let tensors = summary["tensors"].as_array().unwrap();
    assert_eq!(summary["bytes"].as_u64(), Some(std::fs::metadata(&flat).unwrap().len()));
    assert!(tensors.iter().filter(|t| t["type"] == "q4_0").count() >= 15, "{summary}");
    assert!(tensors.iter().filter(|t| t["dims"].as_array().unwrap().len() == 1).all(|t| t["type"] == "f32"), "norms stay f32");
    let path = flat.to_str().unwrap();
    let o = xtask(&["layer-diff", "--device", "cpu", "--model", path, "--prompt-ids", "1,2,3,4,5", "--report-dir", tmp.path().join("ld").to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("0 failed"), "{}", text(&o));

    // No tokenizer in a flat file: text is refused saying so, ids run.
    let o = xtask(&["run", "--model", path, "--prompt", "hello"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("a flat model file carries no tokenizer"), "{}", text(&o));
    let o = xtask(&["run", "--model", path, "--prompt-ids", "1,2", "--max-new-tokens", "3", "--json"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));

    // Bad arguments and a damaged file exit 2 with the reason.
    let o = xtask(&["export", "--model", "tiny-llama", "--type", "q9_9", "--out", path], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        stderr(&o).contains("expected keep or one of f32"),
        "{}",
        text(&o)
    );
    // Per-layer head counts and a window pattern do not fit the header: refused, saying so.
    let o = xtask(
        &[
            "export",
            "--model",
            "tiny-mixed",
            "--out",
            tmp.path().join("mixed.flat").to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        stderr(&o).contains("per-layer head counts or window pattern")
            && stderr(&o).contains("does not fit the flat format"),
        "{}",
        text(&o)
    );
    let o = xtask(
        &[
            "export",
            "--model",
            "tiny-llama",
            "--out",
            tmp.path().to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("is a directory"), "{}", text(&o));
    let mut bytes = std::fs::read(&flat).unwrap();
    let last = bytes.len() - 7;
    bytes[last] ^= 0x10;
    std::fs::write(&flat, &bytes).unwrap();
    let o = xtask(&["layer-diff", "--device", "cpu", "--model", path, "--prompt-ids", "1,2,3"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("tensor `output.weight`") && stderr(&o).contains("the file is corrupt"), "{}", text(&o));
    bytes[100] ^= 1;
    std::fs::write(&flat, &bytes).unwrap();
    let o = xtask(&["run", "--model", path, "--prompt-ids", "1,2,3"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("flat model field `meta_checksum` at byte offset 504"), "{}", text(&o));
}

fn have_cc() -> bool {
    let ok = std::process::Command::new("cc").arg("--version").output().is_ok_and(|o| o.status.success());
    if !ok {
        assert!(std::env::var("TOUCHSTONE_REQUIRE_GPU_EMU").as_deref() != Ok("1"), "no C compiler (`cc`), but TOUCHSTONE_REQUIRE_GPU_EMU=1 says this machine has one");
        eprintln!("SKIPPED: no C compiler (`cc`) for examples/flat_engine");
    }
    ok
}

#[test]
fn the_c_flat_engine_is_gated_through_exec() {
    if !have_cc() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let engine = "exec:sh examples/flat_engine/run.sh";
    let build = tmp.path().join("build");
    let env = [("TOUCHSTONE_ENGINE_BUILD", build.to_str().unwrap())];
    // SmolLM2 with ~4.5-bit Q4_0 matrices: what a bare-metal engine loads.
    for (model, ty, ids) in [("tiny-llama", "f32", "5,200,17,3,99,250,1,42"), ("tiny-qwen3", "q8_0", "7,1,30,12,9"), ("smollm2", "q4_0", "504,3575,282,4649,314,260,1345,28,1116")] {
        let flat = tmp.path().join(format!("{model}.flat"));
        export(model, ty, &flat);
        let path = flat.to_str().unwrap();
        let report = tmp.path().join(format!("{model}-ld"));
        let o = xtask(&["layer-diff", "--device", engine, "--model", path, "--prompt-ids", ids, "--report-dir", report.to_str().unwrap()], &env);
        assert_eq!(o.status.code(), Some(0), "{model}: {}", text(&o));
        let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(report.join("report.json")).unwrap()).unwrap();
        let layers = if model == "smollm2" { 30 } else { 2 };
        assert_eq!(r["summary"]["passed"].as_u64(), Some(layers + 3), "{model}: every layer output, the final norm, the logits and the tap_coverage gate: {}", r["summary"]);
        if model != "smollm2" {
            let o = xtask(&["fixed-token", "--device", engine, "--model", path, "--report-dir", tmp.path().join(format!("{model}-ft")).to_str().unwrap()], &env);
            assert_eq!(o.status.code(), Some(0), "{model}: {}", text(&o));
            assert!(text(&o).contains("4 passed, 0 failed"), "{model}: {}", text(&o));
        }
    }
    // The same engine as a console-only one: its printed ids, judged by the greedy gate.
    let flat = tmp.path().join("smollm2.flat");
    let o = xtask(&["fixed-token", "--device", "ids:sh examples/flat_engine/run.sh", "--model", flat.to_str().unwrap(), "--report-dir", tmp.path().join("ids").to_str().unwrap()], &env);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).lines().any(|l| l.contains("Pass") && l.contains("gate=greedy")), "{}", text(&o));
    // Weights it cannot read are refused by the engine, and that is a could-not-run (exit 2).
    let q = tmp.path().join("q.flat");
    export("tiny-llama", "keep", &q);
    let o = xtask(&["layer-diff", "--device", engine, "--model", q.to_str().unwrap(), "--prompt-ids", "1,2"], &env);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("not f32, q8_0 or q4_0: the types this engine reads"), "{}", text(&o));
}
