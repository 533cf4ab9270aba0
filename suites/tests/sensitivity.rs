//! Gate sensitivity: each bug class real engines ship, injected into a test-only faulty device,
//! must turn its cases red under the derived tolerances, while the correct cpu device passes the
//! very same cases. This is what shows the tolerances are tight enough to matter. And a change
//! of numerics inside a whole model's worst-case layer-diff budgets must fail the gate that holds
//! it to its declared arithmetic, emulated.

use devices::cpu::CpuDevice;
use devices::faulty::{Fault, FaultyDevice};
use oracle::registry::{Input, OpCase};
use reports::Verdict;
use suites::kernels::{run_case, select_cases, KernelOptions};

/// The cases a fault can show up in (a GQA mapping bug is invisible with MHA or MQA; a min bug
/// only exists in formats with a min; a row-stride bug needs at least two distinct rows).
fn affected(fault: Fault, c: &OpCase) -> bool {
    let p = |n: &str| c.pu(n).unwrap_or(0);
    let wty = c.inputs.iter().find_map(|(n, i)| if *n == "w" { if let Input::Quant { ty, .. } = i { Some(*ty) } else { None } } else { None });
    use oracle::quant::GgmlType::*;
    match fault {
        Fault::GqaMappingWrong => p("n_head_kv") > 1 && p("n_head_kv") < p("n_head"),
        Fault::QuantMinIgnored => matches!(wty, Some(Q4_1 | Q5_1 | Q4_K | Q5_K)),
        Fault::QuantScaleWrong => matches!(wty, Some(Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q4_K | Q5_K | Q6_K)),
        // Position 0 with a single key cannot show an off-by-one.
        Fault::CausalOffByOne | Fault::KvWrongPosition => true,
        Fault::ViewStrideIgnored => c.id.contains("view="),
        _ => true,
    }
}

#[test]
fn every_injected_bug_class_is_caught_and_the_correct_device_passes() {
    let all = select_cases(&KernelOptions::default());
    let mut summary = Vec::new();
    for fault in Fault::ALL {
        let cases: Vec<&OpCase> = all.iter().filter(|c| fault.ops().contains(&c.op) && affected(fault, c)).collect();
        assert!(!cases.is_empty(), "{fault:?}: no cases");
        let faulty = FaultyDevice(fault);
        let (mut red, mut total) = (0, 0);
        for c in &cases {
            let good = run_case(&CpuDevice::default(), c, false);
            assert_eq!(good.verdict, Verdict::Pass, "correct cpu fails {}: {:?}", c.id, good.message);
            let bad = run_case(&faulty, c, false);
            total += 1;
            if bad.verdict == Verdict::Fail {
                red += 1;
            }
        }
        summary.push(format!("{fault:?}: {red}/{total} cases red"));
        // Every bug must be caught in the large majority of the cases it can appear in.
        assert!(red as f64 >= 0.9 * total as f64, "{fault:?}: only {red} of {total} affected cases failed");
    }
    eprintln!("{}", summary.join("\n"));
}

/// An engine of the `cpu` device's declared arithmetic (Q8_0 inputs to the products with
/// quantized matrices), emulated exactly, except that the input of one matrix (`coarser`: its
/// name and a number of levels) is rounded to 32-value blocks on a coarser grid than declared
/// (scale max|x|/levels instead of /127): a change of numerics inside one product, as a kernel
/// revision could make. None: the honest engine.
struct Regressed {
    emu: suites::emulate::EmulatedArithmetic,
    coarser: Option<(&'static str, f32)>,
}

impl oracle::Tap for Regressed {
    fn record(&mut self, name: &str, start_pos: usize, n_tokens: usize, width: usize, data: &[f32]) {
        self.emu.record(name, start_pos, n_tokens, width, data);
    }
    fn substitute(&mut self, name: &str, start_pos: usize, n_tokens: usize, width: usize) -> Option<Vec<f32>> {
        self.emu.substitute(name, start_pos, n_tokens, width)
    }
    fn product_input(&mut self, weight: &str, width: usize, data: &[f32]) -> Option<Vec<f32>> {
        let Some(levels) = self.coarser.filter(|(m, _)| *m == weight).map(|(_, l)| l) else {
            return self.emu.product_input(weight, width, data);
        };
        let mut v = data.to_vec();
        for row in v.chunks_mut(width) {
            for b in row.chunks_mut(32) {
                let d = b.iter().fold(0f32, |m, x| m.max(x.abs())) / levels;
                for x in b.iter_mut() {
                    *x = if d > 0.0 { (*x / d).round() * d } else { 0.0 };
                }
            }
        }
        Some(v)
    }
}

/// A change of numerics inside the worst-case budgets: an engine that rounds one product's
/// input (blk.0.attn_v's) on a grid 6.35x coarser than it declares (max|x|/20 for /127) passes
/// every tap's budget in both modes; the `emulated_departure` gate fails it at its default factor,
/// at that tap (6.1x when written). One 2.5x coarser (/50, 2.55x) passes the default factor and
/// fails 1.5, a factor suited to an engine the emulation models exactly: the honest engine
/// measures 1.00x.
#[test]
fn the_emulated_departure_gate_catches_a_coarser_rounding_the_budgets_let_through() {
    use suites::layerdiff::{self, Mode};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-llama.gguf");
    std::fs::write(&path, fixtures::synthetic::build("tiny-llama").unwrap()).unwrap();
    let (oracle_model, _) = oracle::generate::AnyModel::load(&path, oracle::Precision::F32).unwrap();
    let arith = devices::open("cpu").unwrap().load_model(&path, &devices::ModelOptions::default()).unwrap().arithmetic();
    let ids = [17, 101, 44, 3, 250, 99, 7, 61, 200, 11, 5];
    // The departure case of each mode, after checking that every tap is within its budget.
    let judge = |levels: Option<f32>, factor: f64| -> Vec<reports::Case> {
        let emu = suites::emulate::EmulatedArithmetic::new(&arith, &path).unwrap().recording();
        let mut engine = Regressed { emu, coarser: levels.map(|l| ("blk.0.attn_v.weight", l)) };
        oracle_model.prefill_logits(&ids, &mut engine).unwrap();
        let taps = engine.emu.recorded.unwrap();
        [Mode::Isolated, Mode::Propagated]
            .map(|mode| {
                let out = layerdiff::run(&oracle_model, &path, &ids, &taps, &arith, mode, factor, "tiny-llama", "regressed").unwrap();
                let (gate, budgets): (Vec<_>, Vec<_>) = out.report.cases.into_iter().partition(|c| c.id.ends_with(",gate=emulated_departure)"));
                assert!(budgets.len() > 30, "{mode:?}: {} taps", budgets.len());
                for c in &budgets {
                    assert_eq!(c.verdict, Verdict::Pass, "{levels:?} {mode:?}: {} {:?}", c.id, c.message);
                }
                assert_eq!(gate.len(), 1, "{mode:?}");
                gate.into_iter().next().unwrap()
            })
            .to_vec()
    };
    let ratio = |c: &reports::Case| c.metrics["largest_ratio"].as_f64().unwrap();
    for c in judge(None, 1.5) {
        assert_eq!(c.verdict, Verdict::Pass, "{c:?}");
        assert!((0.99..1.01).contains(&ratio(&c)), "{c:?}");
    }
    for c in judge(Some(20.0), suites::emulate::EMULATION_FACTOR) {
        assert_eq!(c.verdict, Verdict::Fail, "{c:?}");
        assert_eq!(c.metrics["first_departure_tap"], "blk.0.attn_v", "{c:?}");
        assert!(ratio(&c) > 5.0, "{c:?}");
    }
    for (factor, verdict) in [(suites::emulate::EMULATION_FACTOR, Verdict::Pass), (1.5, Verdict::Fail)] {
        for c in judge(Some(50.0), factor) {
            assert_eq!(c.verdict, verdict, "factor {factor}: {c:?}");
            assert!((2.0..3.0).contains(&ratio(&c)), "{c:?}");
        }
    }
}

/// Gemma 3's wiring bugs — the windowed layers rotated with the global RoPE base, the norms of
/// the attention and FFN outputs skipped, the embeddings left unscaled — each turn layer-diff red
/// on `tiny-gemma3` at the tap where they live, in both modes, while the correct `cpu` device
/// passes the same prompt.
#[test]
fn gemma_wiring_bugs_fail_layer_diff_at_their_tap() {
    wiring_bugs_fail_layer_diff_at_their_tap("tiny-gemma3", &devices::faulty::ModelFault::GEMMA);
}

/// GPT-OSS's — the sinks dropped, a plain SwiGLU for the clamped one, YaRN's correction range
/// rounded out (llama.cpp's rule) — likewise on `tiny-gpt-oss`.
#[test]
fn gpt_oss_wiring_bugs_fail_layer_diff_at_their_tap() {
    wiring_bugs_fail_layer_diff_at_their_tap("tiny-gpt-oss", &devices::faulty::ModelFault::GPT_OSS);
}

/// Gemma 2's soft-capping left out is red at `attn_kqv`, in both modes, on a random Gemma 2
/// checkpoint written by transformers (skipped where transformers is not installed), where the
/// correct `cpu` and `fixed` pass (its query scale is not 1/sqrt(head_dim): a device that
/// assumes it fails).
#[test]
fn gemma2_softcap_dropped_fails_layer_diff() {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/reference/make_checkpoint.py");
    let has_transformers = std::process::Command::new("python3").args(["-c", "import transformers"]).status().is_ok_and(|s| s.success());
    if !has_transformers {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("gemma2");
    assert!(std::process::Command::new("python3").arg(&script).arg("gemma2").arg(&ck).status().unwrap().success(), "make_checkpoint.py gemma2 failed");
    wiring_bugs_fail_at(&ck, "gemma2", &["cpu", "fixed"], &[devices::faulty::ModelFault::SoftcapDropped]);
}

/// Mamba-2's — the recurrent state kept in bf16, the convolution's window one position off, the
/// decay gate's sign flipped — each red at its tap (`ssm_state`, `ssm_conv`), in both modes, on a
/// random Mamba-2 checkpoint written by transformers, on a Granite 4.0-H-shaped hybrid with
/// its residual branches added unscaled besides (`ffn_inp`), and on a Qwen3-Next-shaped hybrid
/// (the same three in its gated DeltaNet layers) with its attention output gate dropped
/// (`attn_out`) and RoPE over whole heads instead of a quarter (`attn_q_rope`) besides; and
/// latent attention's on a DeepSeek-V3-structured checkpoint — the absorbed form's score scale
/// taken from the cached row's width (`attn_kqv`), RoPE on the unrotated slice of each query
/// head (`attn_q_rope`) — where the correct `cpu` (the absorbed form, judged against the
/// oracle's materialized one) passes (skipped where transformers is not installed).
#[test]
fn hybrid_and_latent_bugs_fail_layer_diff_at_their_tap() {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/reference/make_checkpoint.py");
    let has_transformers = std::process::Command::new("python3").args(["-c", "import transformers"]).status().is_ok_and(|s| s.success());
    if !has_transformers {
        assert!(std::env::var_os("TOUCHSTONE_REQUIRE_TRANSFORMERS").is_none(), "TOUCHSTONE_REQUIRE_TRANSFORMERS is set but Python cannot import transformers");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("mamba2");
    assert!(std::process::Command::new("python3").arg(&script).arg("mamba2").arg(&ck).status().unwrap().success(), "make_checkpoint.py mamba2 failed");
    wiring_bugs_fail_at(&ck, "mamba2", &["cpu"], &devices::faulty::ModelFault::MAMBA2);
    let ck = dir.path().join("granite-hybrid");
    assert!(std::process::Command::new("python3").arg(&script).arg("granite-hybrid").arg(&ck).status().unwrap().success(), "make_checkpoint.py granite-hybrid failed");
    let mut faults = devices::faulty::ModelFault::MAMBA2.to_vec();
    faults.push(devices::faulty::ModelFault::ResidualScaleDropped);
    wiring_bugs_fail_at(&ck, "granite-hybrid", &["cpu"], &faults);
    let ck = dir.path().join("qwen3-next");
    assert!(std::process::Command::new("python3").arg(&script).arg("qwen3-next").arg(&ck).status().unwrap().success(), "make_checkpoint.py qwen3-next failed");
    let faults: Vec<_> = devices::faulty::ModelFault::MAMBA2.into_iter().chain(devices::faulty::ModelFault::QWEN3_NEXT).collect();
    wiring_bugs_fail_at(&ck, "qwen3-next", &["cpu"], &faults);
    let ck = dir.path().join("deepseek-v3");
    assert!(std::process::Command::new("python3").arg(&script).arg("deepseek-v3").arg(&ck).status().unwrap().success(), "make_checkpoint.py deepseek-v3 failed");
    wiring_bugs_fail_at(&ck, "deepseek-v3", &["cpu"], &devices::faulty::ModelFault::MLA);
}


fn wiring_bugs_fail_layer_diff_at_their_tap(fixture: &str, faults: &[devices::faulty::ModelFault]) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{fixture}.gguf"));
    std::fs::write(&path, fixtures::synthetic::build(fixture).unwrap()).unwrap();
    wiring_bugs_fail_at(&path, fixture, &["cpu"], faults);
}

/// Each of `faults` in the `cpu` device's model of `path` fails layer-diff in both modes, first
/// at its tap in isolated mode, while each correct device of `good` passes.
fn wiring_bugs_fail_at(path: &std::path::Path, fixture: &str, good: &[&str], faults: &[devices::faulty::ModelFault]) {
    use suites::layerdiff::{self, Mode};
    let path = path.to_path_buf();
    let (oracle_model, _) = oracle::generate::AnyModel::load(&path, oracle::Precision::F32).unwrap();
    // Longer than the window of 4, so the windowed layers and the global one see different keys.
    let ids = [17, 101, 44, 3, 250, 99, 7, 61, 200, 11, 5, 130];
    let judge = |model: &mut dyn devices::DeviceModel, mode: Mode| {
        let mut taps = oracle::RecordingTap::default();
        model.forward(&ids, &mut taps).unwrap();
        let out = layerdiff::run(&oracle_model, &path, &ids, &taps, &model.arithmetic(), mode, suites::emulate::EMULATION_FACTOR, fixture, "faulty").unwrap();
        (out.report.exit_code(), layerdiff::first_divergence_finding(&out.taps))
    };
    for mode in [Mode::Isolated, Mode::Propagated] {
        for name in good {
            let mut model = devices::open(name).unwrap().load_model(&path, &devices::ModelOptions::default()).unwrap();
            let (code, first) = judge(model.as_mut(), mode);
            assert_eq!(code, 0, "{name} {mode:?}: {first:?}");
        }
        for &fault in faults {
            let mut bad = fault.load(&path).unwrap();
            let (code, first) = judge(bad.as_mut(), mode);
            assert_ne!(code, 0, "{fault:?} {mode:?} passed");
            if mode == Mode::Isolated {
                assert_eq!(first.as_ref().map(|f| f.kind.as_str()), Some(fault.first_tap()), "{fault:?}: first divergence {first:?}");
                if fault == devices::faulty::ModelFault::SsmStateBf16 {
                    // Named with the step its error crossed the state's bound at.
                    let at = first.as_ref().and_then(|f| f.first_over_position);
                    assert!(at.is_some_and(|p| p < ids.len()), "{fault:?}: no crossing step in {first:?}");
                    eprintln!("{fixture}: {}", first.as_ref().unwrap().describe());
                }
            }
        }
    }
}
