//! The serving rung (suites::serving) on the `cpu` device's schedule executor: green on every
//! synthetic model with the cache formats it offers, and red on each seeded serving bug
//! (`devices::faulty::ServeFault`), naming the axis that shows it, the request and a position.

use devices::faulty::ServeFault;
use devices::DeviceModel;
use reports::{Case, Verdict};
use std::collections::BTreeMap;
use std::sync::Arc;
use suites::layerdiff::{propagated_budget, Dims};
use suites::serving::{self, OracleRun};

/// The fixture written to a temporary file.
fn fixture(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{name}.gguf"));
    std::fs::write(&path, fixtures::synthetic::build(name).unwrap()).unwrap();
    (dir, path)
}

/// A random checkpoint of a recurrent family written by transformers
/// (tools/reference/make_checkpoint.py), or None (saying so) where transformers is not installed.
fn checkpoint(arch: &str) -> Option<(tempfile::TempDir, std::path::PathBuf)> {
    let ok = std::process::Command::new("python3").args(["-c", "import transformers"]).status().is_ok_and(|s| s.success());
    if !ok {
        assert!(std::env::var_os("TOUCHSTONE_REQUIRE_TRANSFORMERS").is_none(), "TOUCHSTONE_REQUIRE_TRANSFORMERS is set but Python cannot import transformers");
        eprintln!("SKIPPED: {arch}: transformers is not installed");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(arch);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/reference/make_checkpoint.py");
    assert!(std::process::Command::new("python3").arg(script).arg(arch).arg(&path).status().unwrap().success(), "make_checkpoint.py {arch} failed");
    Some((dir, path))
}

/// The serving suite's cases on `model` (a device model of the fixture at `path`).
fn judge(path: &std::path::Path, name: &str, model: &mut dyn DeviceModel) -> (Vec<Case>, Vec<serving::ServingCase>) {
    let (oracle, _) = oracle::generate::AnyModel::load(path, oracle::Precision::F32).unwrap();
    let spec = oracle.spec().clone();
    let seq: Vec<u32> = (0..30).map(|i| (i * 7919 + 13) as u32 % spec.n_vocab as u32).collect();
    let window = spec.layers.iter().find_map(|l| match l.block {
        oracle::spec::BlockKind::Attention(a) => a.window,
        oracle::spec::BlockKind::Ssm(_) | oracle::spec::BlockKind::Mla(_) => None,
    });
    let mut cases = serving::cases(&seq, 20, spec.n_vocab, window, 3);
    let mut shared = seq[..20].to_vec();
    shared.extend([5, 6, 7]);
    cases.extend(serving::random_cases(&[seq.clone(), shared, seq[10..].to_vec()], 20, 5));
    let mut runs: BTreeMap<Vec<u32>, OracleRun> = BTreeMap::new();
    for c in &cases {
        let other = match &c.counterpart {
            serving::Counterpart::Other { schedule, .. } => schedule.requests.clone(),
            serving::Counterpart::Alone => Vec::new(),
        };
        for r in c.schedule.requests.iter().chain(&other) {
            if !runs.contains_key(&r.tokens) {
                let logits = oracle.prefill_logits(&r.tokens, &mut oracle::NoTap).unwrap();
                runs.insert(r.tokens.clone(), OracleRun { logits: Arc::new(logits), routing_differs: vec![false; r.tokens.len()] });
            }
        }
    }
    let longest = runs.keys().map(Vec::len).max().unwrap();
    let budget = propagated_budget(oracle::taps::TapKind::ResultOutput, None, &model.arithmetic(), &Dims::of(&spec, longest)).unwrap();
    let invariant = model.batch_invariant();
    let mut serve = |s: &oracle::schedule::Schedule| model.serve(s).map(|r| r.map_err(|e| e.to_string()));
    let answers = serving::serve_all(&cases, &mut serve, spec.n_vocab).expect("cpu serves schedules");
    (serving::judge(&cases, &answers, &|ids: &[u32]| runs.get(ids).cloned(), spec.n_vocab, &budget, invariant, name, "cpu"), cases)
}

#[test]
fn the_cpu_executor_serves_every_synthetic_model_green() {
    for name in ["tiny-llama", "tiny-qwen3", "tiny-gemma3", "tiny-mixed"] {
        let (_dir, path) = fixture(name);
        for device in ["cpu", "cpu:kv-f16", "cpu:kv-q8_0"] {
            let mut m = devices::open(device).unwrap().load_model(&path, &devices::ModelOptions::default()).unwrap();
            let (cases, _) = judge(&path, name, m.as_mut());
            assert!(cases.len() >= 68, "{name} {device}: {} cases", cases.len());
            let bad: Vec<String> = cases.iter().filter(|c| c.verdict != Verdict::Pass).map(|c| format!("{}: {:?}", c.id, c.message)).collect();
            assert!(bad.is_empty(), "{name} on {device}:\n{}", bad.join("\n"));
            // cpu declares itself batch-invariant: every axis bit-identical, every request passes.
            for row in serving::axis_rows(&cases) {
                assert!(row[2].ends_with(" bit-identical, 0 within the bound, 0 outside") && !row[2].starts_with("0 ") && row[4].starts_with(&format!("{} of {} pass", row[1], row[1])), "{name} {device}: {row:?}");
            }
        }
    }
}

/// Recurrent and latent-attention models served: each request's state carried across its chunks
/// and decode steps, a reused prefix's state restored as of its last position, in batches beside
/// other requests: every axis green on Mamba-2 (recurrent layers only), the Qwen3-Next-shaped
/// hybrid (a gated DeltaNet's state and attention's keys and values in one cache) and the
/// DeepSeek-V3-shaped model (latents and shared rotated keys cached, absorbed attention).
#[test]
fn the_cpu_executor_serves_recurrent_models_green() {
    for arch in ["mamba2", "qwen3-next", "deepseek-v3"] {
        let Some((_dir, path)) = checkpoint(arch) else { return };
        let mut m = devices::open("cpu").unwrap().load_model(&path, &devices::ModelOptions::default()).unwrap();
        let (cases, _) = judge(&path, arch, m.as_mut());
        assert!(cases.len() >= 68, "{arch}: {} cases", cases.len());
        let bad: Vec<String> = cases.iter().filter(|c| c.verdict != Verdict::Pass).map(|c| format!("{}: {:?}", c.id, c.message)).collect();
        assert!(bad.is_empty(), "{arch}:\n{}", bad.join("\n"));
    }
}

#[test]
fn every_seeded_serving_bug_is_red_on_its_axis_naming_request_and_position() {
    // The axis that must show each bug (others may too), and the model it shows on.
    // ... and the first tap at which the served request departs from its counterpart's run (None:
    // every tap agrees, the bug is in how the logits are delivered).
    let expected = [
        (ServeFault::MaskLeak, "neighbours", "tiny-llama", Some("blk.0.attn_kqv")),
        (ServeFault::SlotNotCleared, "slot_reuse", "tiny-llama", Some("blk.0.attn_q_rope")),
        (ServeFault::PrefixOffByOne, "prefix_cache", "tiny-llama", Some("blk.0.attn_q_rope")),
        (ServeFault::RopeRestartsAtChunk, "chunks", "tiny-llama", Some("blk.0.attn_q_rope")),
        (ServeFault::NoCausalMaskInChunk, "chunks", "tiny-llama", Some("blk.0.attn_kqv")),
        (ServeFault::WindowEdgeAtChunk, "chunks", "tiny-mixed", Some("blk.0.attn_kqv")),
        (ServeFault::LogitsSwapped, "batch", "tiny-llama", None),
        (ServeFault::BatchPathRounds, "batch", "tiny-llama", Some("blk.0.attn_kqv")),
        (ServeFault::SsmStateNotRestored, "prefix_cache", "mamba2", Some("blk.0.ssm_conv")),
    ];
    assert_eq!(expected.len(), ServeFault::ALL.len());
    for (fault, axis, name, tap) in expected {
        let (_dir, path) = if name == "mamba2" {
            match checkpoint(name) {
                Some(c) => c,
                None => continue,
            }
        } else {
            fixture(name)
        };
        let mut m = devices::faulty::serving_model(fault, &path).unwrap();
        let (cases, schedules) = judge(&path, name, m.as_mut());
        let red: Vec<&Case> = cases.iter().filter(|c| c.verdict == Verdict::Fail).collect();
        let on_axis = red.iter().find(|c| c.id.contains(&format!("axis={axis},")));
        let Some(c) = on_axis else { panic!("{fault:?} not red on axis {axis}; red: {:?}", red.iter().map(|c| &c.id).collect::<Vec<_>>()) };
        let msg = c.message.as_deref().unwrap_or("");
        assert!(msg.contains(&format!("axis {axis}")) && msg.contains("request `") && msg.contains("position"), "{fault:?}: {msg}");
        // It carries the schedule that shows it, to rerun.
        let schedule: oracle::schedule::Schedule = serde_json::from_value(c.metrics.get("schedule").cloned().expect("a red case holds its schedule")).unwrap();
        assert!(schedule.validate().is_ok() && schedule.requests.iter().any(|r| msg.contains(&format!("request `{}`", r.id))), "{fault:?}");
        // Where the served request departs from its counterpart's run: the first tap that differs.
        let case = schedules.iter().find(|k| k.id(name) == c.id.trim_end_matches(":vs_oracle")).expect("the red case's schedule");
        let mut served = oracle::RecordingTap::default();
        m.serve_tapped(&case.schedule, &case.target, &mut served).expect("cpu records taps while it serves").unwrap();
        let mut reference = oracle::RecordingTap::default();
        match &case.counterpart {
            serving::Counterpart::Alone => {
                m.reset();
                m.forward(&case.schedule.request(&case.target).unwrap().tokens, &mut reference).unwrap();
            }
            serving::Counterpart::Other { schedule, id } => {
                m.serve_tapped(schedule, id, &mut reference).unwrap().unwrap();
            }
        }
        let first = case.schedule.request(&case.target).unwrap().first_computed();
        let found = serving::first_differing_tap(&served, &reference, first);
        eprintln!("{fault:?}: {} -> {found:?}", c.id);
        assert_eq!(found.map(|(t, _)| t), tap.map(String::from), "{fault:?}: the first tap that differs");
        // The per-axis table counts it: a schedule outside its bound, or a request failing the oracle.
        let row = serving::axis_rows(&cases).into_iter().find(|r| r[0] == axis).unwrap();
        assert!(!row[2].ends_with(" 0 outside") || !row[4].starts_with(&format!("{} of", row[1])), "{fault:?}: {row:?}");
    }
}
