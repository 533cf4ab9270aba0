//! Unit tests of the parent module.

use super::*;
use oracle::Tap;
use serde_json::json;

/// The kind named `name`, for tables written as names.
fn kind(name: &str) -> TapKind {
    TapKind::parse(name).unwrap_or_else(|| panic!("no tap kind {name}"))
}

/// Matrices by GGUF name, for [`term_scales`].
struct Matrices(Vec<(&'static str, Vec<usize>, Vec<f32>)>);
impl oracle::loader::TensorSource for Matrices {
    fn load(&self, name: &str) -> oracle::Result<Option<oracle::loader::LoadedTensor>> {
        self.raw(name)?.map(|r| r.decode()).transpose()
    }
    fn label(&self) -> String {
        "test matrices".into()
    }
    fn n_elements(&self) -> oracle::Result<u64> {
        Ok(0)
    }
    fn n_bytes(&self) -> oracle::Result<u64> {
        Ok(0)
    }
    fn raw(&self, name: &str) -> oracle::Result<Option<oracle::loader::RawTensor<'_>>> {
        Ok(self.0.iter().find(|(n, _, _)| *n == name).map(|(_, dims, data)| oracle::loader::RawTensor {
            dims: dims.clone(),
            ty: oracle::quant::GgmlType::F32,
            bytes: data.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>().into(),
        }))
    }
}

/// A MoE layer's ratio by hand: the token routed to experts [1, 0] sends (1, 1) to expert 1's
/// products and (2, 0) to expert 0's. Expert 1's gate rows (1, -1) cancel on (1, 1) (terms
/// squared 2 per row, outputs 0); expert 0's gate rows (1, 1) on (2, 0) do not (4 and 4):
/// pooled, terms 12 against outputs 8, excess sqrt(1.5) - 1. Rows (1, 1) elsewhere do not
/// cancel (excess 0), so the block's ratio is sqrt(1.5). Rows sent to the wrong expert
/// would give other sums.
#[test]
fn moe_term_ratios_by_hand() {
    let mut rows = ProductRows::default();
    rows.routed("blk.0.ffn_moe_topk", &[1, 0]);
    for a in [[1.0, 1.0], [2.0, 0.0]] {
        for p in ["gate", "up", "down"] {
            rows.add(&format!("blk.0.ffn_{p}_exps.weight"), 2, &a);
        }
    }
    // Stacked [expert][row][col]: expert 0's rows, then expert 1's.
    let same = vec![1.0; 8];
    let src = Matrices(vec![
        ("blk.0.ffn_gate_exps.weight", vec![2, 2, 2], vec![1.0, 1.0, 1.0, 1.0, 1.0, -1.0, 1.0, -1.0]),
        ("blk.0.ffn_up_exps.weight", vec![2, 2, 2], same.clone()),
        ("blk.0.ffn_down_exps.weight", vec![2, 2, 2], same),
    ]);
    let r = moe_term_ratios(&rows, &src).unwrap();
    assert_eq!(r.keys().collect::<Vec<_>>(), ["blk.0.ffn_out"]);
    assert!((r["blk.0.ffn_out"] - 1.5f64.sqrt()).abs() < 1e-12, "{r:?}");
    // Expert products of a token with no routing seen are not sampled; past
    // TERM_SAMPLE_ROWS, every other row is dropped and the stride doubles.
    let mut many = ProductRows::default();
    many.add("blk.2.ffn_down_exps.weight", 1, &[5.0]);
    assert!(many.experts.is_empty());
    for i in 0..100 {
        many.routed("blk.2.ffn_moe_topk", &[i % 3]);
        many.add("blk.2.ffn_down_exps.weight", 1, &[i as f32]);
    }
    let kept = &many.experts["blk.2.ffn_down_exps.weight"].rows;
    assert!(kept.len() <= TERM_SAMPLE_ROWS);
    assert_eq!(kept.iter().map(|(e, v)| (*e, v[0])).collect::<Vec<_>>(), (0..100).step_by(4).map(|i| (i % 3, i as f32)).collect::<Vec<_>>());
    assert_eq!(expert_product("blk.12.ffn_up_exps.weight"), Some((12, 1)));
    assert_eq!(expert_product("blk.12.ffn_up_shexp.weight"), None);
}

/// The terms' and the outputs' RMS by hand: rows (1, -1) and (1, 1) against inputs (1, 1)
/// and (2, 0) give terms of sqrt(2), sqrt(2), 2, 2 and outputs 0, 2, 2, 2 (plus the bias
/// where there is one); a MoE's expert matrices and the router have no tap of their own.
#[test]
fn term_scales_by_hand() {
    let mut rows = ProductRows::default();
    for name in ["blk.0.attn_q.weight", "blk.0.attn_output.weight", "blk.0.ffn_gate_exps.weight"] {
        rows.add(name, 2, &[1.0, 1.0]);
        rows.add(name, 2, &[2.0, 0.0]);
    }
    let w = vec![1.0, -1.0, 1.0, 1.0];
    let src = Matrices(vec![
        ("blk.0.attn_q.weight", vec![2, 2], w.clone()),
        ("blk.0.attn_q.bias", vec![2], vec![1.0, 0.0]),
        ("blk.0.attn_output.weight", vec![2, 2], w.clone()),
        ("blk.0.ffn_gate_exps.weight", vec![2, 2], w),
    ]);
    let s = term_scales(&rows, &src).unwrap();
    assert_eq!(s.keys().collect::<Vec<_>>(), ["blk.0.attn_out", "blk.0.attn_q"]);
    let terms = ((2.0 + 2.0 + 4.0 + 4.0) / 4.0f64).sqrt();
    assert_eq!(s["blk.0.attn_out"], TermScale { term_rms: terms, output_rms: ((0.0 + 4.0 + 4.0 + 4.0) / 4.0f64).sqrt() });
    assert_eq!(s["blk.0.attn_q"], TermScale { term_rms: terms, output_rms: ((1.0 + 4.0 + 9.0 + 4.0) / 4.0f64).sqrt() });
    // A matrix of more rows than one decoded block (64): each row meets its own bias.
    let mut tall = ProductRows::default();
    tall.add("blk.1.attn_v.weight", 2, &[1.0, 1.0]);
    let src = Matrices(vec![("blk.1.attn_v.weight", vec![2, 130], vec![1.0; 260]), ("blk.1.attn_v.bias", vec![130], (0..130).map(|j| j as f32).collect())]);
    let want = ((0..130).map(|j| (2.0 + j as f64).powi(2)).sum::<f64>() / 130.0).sqrt();
    assert_eq!(term_scales(&tall, &src).unwrap()["blk.1.attn_v"], TermScale { term_rms: 2f64.sqrt(), output_rms: want });
    // Past TERM_SAMPLE_ROWS rows, rows are sampled evenly, never more.
    let mut many = ProductRows::default();
    many.add("output.weight", 1, &(0..100).map(|i| i as f32).collect::<Vec<_>>());
    many.add("output.weight", 1, &[7.0]);
    assert_eq!(many.rows["output.weight"].1.len(), TERM_SAMPLE_ROWS);
    assert_eq!(many.rows["output.weight"].1[..4], [0.0, 3.0, 6.0, 9.0]);
    assert_eq!(product_tap("token_embd.weight").map(|t| t.to_string()).as_deref(), Some("result_output"));
    assert_eq!(product_tap("blk.3.ffn_down.weight").map(|t| t.to_string()).as_deref(), Some("blk.3.ffn_out"));
    assert_eq!(product_tap("blk.3.ffn_gate_inp.weight"), None);
}

fn dims() -> Dims {
    Dims { d: 64, head_dim: 16, q_dim: 64, n_ff: 128, n_pos: 5, n_layer: 4, rope_angle_rms: 2.0, embd_scale: 1.0, gelu: false, ssm_inner: 0, ssm_state: 0, ssm_conv: 0, ssm_delta: false, mla_rank: 0 }
}

#[test]
fn budgets_grow_with_depth_and_q8_activations() {
    let d = dims();
    let a = Arithmetic::F32;
    let early = propagated_budget(kind("l_out"), Some(0), &a, &d).unwrap();
    let late = propagated_budget(kind("l_out"), Some(3), &a, &d).unwrap();
    assert!(late.rel > early.rel);
    let q8 = Arithmetic { activation_q8_block: Some(32), ..a };
    assert!(local_budget(kind("attn_q"), &q8, &d).unwrap().rel > 10.0 * local_budget(kind("attn_q"), &a, &d).unwrap().rel);
    assert_eq!(local_budget(kind("attn_norm"), &q8, &d), local_budget(kind("attn_norm"), &a, &d), "Q8 applies to products only");
    // The widest rounding declared: K-quants' blocks of 256 over 32, half-precision inputs
    // (below a block of 32's, so they add nothing beside it).
    let kquant = Arithmetic { activation_q8_block_kquant: Some(256), ..q8 };
    assert!(local_budget(kind("attn_q"), &kquant, &d).unwrap().rel > 2.0 * local_budget(kind("attn_q"), &q8, &d).unwrap().rel);
    let half = Arithmetic { activation_half_rounding: true, ..a };
    assert!(local_budget(kind("attn_q"), &half, &d).unwrap().rel > 10.0 * local_budget(kind("attn_q"), &a, &d).unwrap().rel);
    assert_eq!(local_budget(kind("attn_q"), &Arithmetic { activation_half_rounding: true, ..q8 }, &d), local_budget(kind("attn_q"), &q8, &d));
    assert_eq!(local_budget(kind("attn_norm"), &half, &d), local_budget(kind("attn_norm"), &a, &d));
    assert!(oracle::taps::TapKind::parse("no_such_tap").is_none(), "a kind without a budget rule does not compile");
}

/// An engine that forms RoPE angles in f32 as ggml does (theta_scale = base^(-2/n_rot) in
/// f32, the angle starting at the position and multiplied by theta_scale pair after pair)
/// rotates by angles off by about u times the angle, which grows with the position: the
/// isolated budget now allows it at 2,000 positions of SmolLM2's RoPE. Without the angle's
/// term it did not (llama.cpp over 165 or more positions of SmolLM2 failed `attn_q_rope`).
#[test]
fn rope_budgets_allow_angles_held_in_f32_at_long_positions() {
    use oracle::spec::{RopeScaling, RopeSpec, RopeStyle};
    let rope = RopeSpec { style: RopeStyle::Normal, theta: 100_000.0, n_rot: 64, scaling: RopeScaling::None, freq_factors: None, longrope_factors: None };
    let (n_pos, pairs) = (2000usize, 32usize);
    let (mut err2, mut ref2) = (0.0f64, 0.0f64);
    let theta_scale = (rope.theta as f32).powf(-2.0 / 64.0);
    for p in 0..n_pos {
        let mut angle = p as f32;
        for i in 0..pairs {
            // A pair of values of unit size, varied per pair and position.
            let (x0, x1) = (((p * 7 + i * 13) % 17) as f64 / 8.0 - 1.0, ((p * 5 + i * 3) % 11) as f64 / 5.0 - 1.0);
            let exact = p as f64 * rope.theta.powf(-2.0 * i as f64 / 64.0);
            let (c, s) = (angle.cos() as f64, angle.sin() as f64);
            let (y0, y1) = (x0 * exact.cos() - x1 * exact.sin(), x0 * exact.sin() + x1 * exact.cos());
            let (g0, g1) = (x0 * c - x1 * s, x0 * s + x1 * c);
            err2 += (g0 - y0).powi(2) + (g1 - y1).powi(2);
            ref2 += y0 * y0 + y1 * y1;
            angle *= theta_scale;
        }
    }
    let measured = (err2 / ref2).sqrt();
    let d = Dims { head_dim: 64, n_pos, rope_angle_rms: rope_angle_rms(&rope, n_pos), ..dims() };
    let budget = local_budget(kind("attn_q_rope"), &Arithmetic::F32, &d).unwrap().rel;
    assert!(measured < budget, "measured {measured:e}, budget {budget:e}");
    let without = local_budget(kind("attn_q_rope"), &Arithmetic::F32, &Dims { rope_angle_rms: 0.0, ..d }).unwrap().rel;
    assert!(measured > 3.0 * without, "the angle's error is most of it: measured {measured:e}, budget without the angle {without:e}");
    assert!(budget < 20.0 * measured, "and the budget stays near it: {budget:e}");
    // A short prompt's angles are small: the term vanishes with the positions.
    assert!(rope_angle_rms(&rope, 1) == 0.0 && rope_angle_rms(&rope, 10) < rope_angle_rms(&rope, 100));
    assert_eq!(rope_angle_rms(&RopeSpec { theta: f64::NAN, ..rope.clone() }, 100), 0.0);
}

#[test]
fn an_f16_kv_cache_grows_only_attention_and_what_follows_it() {
    let d = dims();
    let a = Arithmetic::F32;
    let f16 = Arithmetic { kv_cache: devices::KvFormat::parse("f16"), ..a };
    let (plain, cached) = (local_budget(kind("attn_kqv"), &a, &d).unwrap(), local_budget(kind("attn_kqv"), &f16, &d).unwrap());
    // One f16 rounding per cached value: u = 2^-11, times (1 + sqrt(head_dim)) = 5 for head_dim 16.
    assert_eq!(cached.rel - plain.rel, C_STAT * (-11f64).exp2() * 5.0);
    for k in [TapKind::AttnQ, TapKind::AttnKRope, TapKind::AttnOut, TapKind::FfnOut, TapKind::ResultNorm] {
        assert_eq!(local_budget(k, &f16, &d), local_budget(k, &a, &d), "{k} does not read the cache");
    }
    assert!(propagated_budget(kind("l_out"), Some(2), &f16, &d).unwrap().rel > propagated_budget(kind("l_out"), Some(2), &a, &d).unwrap().rel);
    // An f16 GELU table widens the activation's budget on a GELU model only.
    let table = Arithmetic { gelu_half_table: true, ..a };
    let gelu = Dims { gelu: true, ..d };
    assert!(local_budget(kind("ffn_act"), &table, &gelu).unwrap().rel > 50.0 * local_budget(kind("ffn_act"), &a, &gelu).unwrap().rel);
    assert_eq!(local_budget(kind("ffn_act"), &table, &d), local_budget(kind("ffn_act"), &a, &d));
    assert_eq!(local_budget(kind("ffn_out"), &table, &gelu), local_budget(kind("ffn_out"), &a, &gelu));
    // A cache no coarser than storage adds nothing; a bf16 one more than an f16 one.
    let same = Arithmetic { kv_cache: devices::KvFormat::parse("f32"), ..a };
    assert_eq!(local_budget(kind("attn_kqv"), &same, &d), Some(plain));
    let bf16 = Arithmetic { kv_cache: devices::KvFormat::parse("bf16"), ..a };
    assert!(local_budget(kind("attn_kqv"), &bf16, &d).unwrap().rel > cached.rel);
    // Keys and values apart: the keys' rounding counts sqrt(head_dim) times (with the
    // query's Q8_0 blocks before block keys), the values' once.
    let rel = |k: &str, v: &str| local_budget(kind("attn_kqv"), &a.with_kv(devices::KvTypes::parse(&format!("{k}-{v}")).unwrap()), &d).unwrap().rel - plain.rel;
    let (u16, u8) = ((-11f64).exp2(), devices::KvFormat::Q8_0.rel_rounding());
    for (k, v, want) in [("f16", "f32", u16 * 4.0), ("f32", "f16", u16), ("q8_0", "f16", 2.0 * u8 * 4.0 + u16), ("f16", "q8_0", u16 * 4.0 + u8)] {
        let got = rel(k, v);
        assert!((got / (C_STAT * want) - 1.0).abs() < 1e-9, "{k}-{v}: {got:e}, want {:e}", C_STAT * want);
    }
}

#[test]
fn routing_follows_the_device_only_at_a_near_tie_its_own_scores_explain() {
    let probs = vec![0.30, 0.29, 0.10, 0.31];
    let r = |choice: &[f64], shortfall: &[f64], experts: &[usize]| oracle::ops::Routing { probs: probs.clone(), choice: choice.to_vec(), shortfall: shortfall.to_vec(), surplus: shortfall.iter().map(|s| if *s > 0.0 { 0.0 } else { 1.0 }).collect(), experts: experts.to_vec(), weights: vec![0.5; experts.len()], scale: 1.0 };
    let plain = r(&probs, &[], &[3, 0]);
    let b = Some(Budget { rel: 0.01, abs: 0.0 });
    // Same experts (any order): nothing to follow.
    assert_eq!(follow_at_near_tie(&plain, &[0, 3], None, b), None);
    // The device took 1 for 0 (0.01 apart) with its scores of the two off by 0.006 each.
    let dev = [0.294f32, 0.296, 0.10, 0.31];
    let (margin, tol) = follow_at_near_tie(&plain, &[3, 1], Some(&dev), b).unwrap();
    assert!((margin - 0.01).abs() < 1e-12 && (0.012..0.0121).contains(&tol), "{margin} {tol}");
    // The same swap with scores that do not explain it (a top-k bug): not followed.
    assert_eq!(follow_at_near_tie(&plain, &[3, 1], Some(&[0.30f32, 0.29, 0.10, 0.31]), b), None);
    // Taking the worst expert is no near tie, whatever the scores' budget.
    let dev = [0.30f32, 0.29, 0.10, 0.31];
    assert_eq!(follow_at_near_tie(&plain, &[3, 2], Some(&dev), b), None);
    // Without recorded scores the budget decides: sqrt(2 * 4) * 0.01 * rms(probs) ~ 0.007.
    assert_eq!(follow_at_near_tie(&plain, &[3, 1], None, b), None);
    assert!(follow_at_near_tie(&plain, &[3, 1], None, Some(Budget { rel: 0.02, abs: 0.0 })).is_some());
    assert_eq!(follow_at_near_tie(&plain, &[3, 1], None, None), None);
    // With a choice bias the margin is the biased ranks': expert 2 (0.10 + 0.3) is then a near
    // tie with 3 (0.31 + 0.1), though their scores are 0.21 apart.
    let biased = [0.30, 0.29, 0.40, 0.41];
    let dev = [0.30f32, 0.29, 0.106, 0.304];
    let (margin, tol) = follow_at_near_tie(&r(&biased, &[], &[3, 0]), &[2, 0], Some(&dev), b).unwrap();
    assert!((margin - 0.01).abs() < 1e-12 && (0.012..0.0121).contains(&tol), "{margin} {tol}");
    assert_eq!(follow_at_near_tie(&r(&biased, &[], &[3, 0]), &[3, 1], Some(&dev), b), None);
    // An expert of a dropped group ranked above the oracle's choice: the margin is its group's
    // shortfall, so a device that ignores the groups is not followed where the groups are far
    // apart, and is where its own scores' error closes the gap.
    let grouped = |short: f64| r(&probs, &[short, short, 0.0, 0.0], &[3, 2]);
    // A group's score moves by up to twice its largest error: 4 x 0.003 + 0.006 here.
    let dev = [0.303f32, 0.29, 0.097, 0.31];
    assert_eq!(follow_at_near_tie(&grouped(0.2), &[3, 0], Some(&dev), b), None);
    let (margin, tol) = follow_at_near_tie(&grouped(0.015), &[3, 0], Some(&dev), b).unwrap();
    assert!((margin - 0.015).abs() < 1e-12 && (0.018..0.0181).contains(&tol), "{margin} {tol}");
    assert_eq!(follow_at_near_tie(&grouped(0.019), &[3, 0], Some(&dev), b), None);
    // Scores without error: any shortfall is a group bug.
    assert_eq!(follow_at_near_tie(&grouped(0.001), &[3, 0], Some(&[0.30f32, 0.29, 0.10, 0.31]), b), None);
    // The device left out the oracle's kept group of 2 and 3 (0.004 above the best left out) and
    // took 0 for 2: followed by that margin, whatever 0's rank.
    let mut left_out = grouped(0.2);
    left_out.surplus = vec![0.0, 0.0, 0.004, 0.004];
    let (margin, _) = follow_at_near_tie(&left_out, &[3, 0], Some(&dev), b).unwrap();
    assert!((margin - 0.004).abs() < 1e-12, "{margin}");
}

#[test]
fn substitution_feeds_the_other_runs_values() {
    let mut from = RecordingTap::default();
    from.record("blk.0.l_out", 0, 2, 3, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let mut s = Rerun { routing: RoutingFollower::new(&from, Box::new(|_| None), "isolated"), substitute_values: true, recorded: RecordingTap::default(), products: None };
    assert_eq!(s.substitute("blk.0.l_out", 1, 1, 3), Some(vec![4.0, 5.0, 6.0]));
    assert_eq!(s.substitute("blk.0.l_out", 0, 1, 4), None, "a width mismatch substitutes nothing");
    assert_eq!(s.substitute("blk.1.l_out", 0, 1, 3), None);
}

#[test]
fn a_perturbed_tap_is_the_first_divergence_and_missing_taps_are_not_passes() {
    let d = dims();
    let mut r = RecordingTap::default();
    let vals: Vec<f32> = (0..5 * 64).map(|i| (i as f32 * 0.37).sin()).collect();
    for name in ["blk.0.attn_norm", "blk.0.l_out", "blk.1.l_out", "result_norm"] {
        r.record(name, 0, 5, 64, &vals);
    }
    let mut dev = r.clone();
    dev.tensors.get_mut("blk.1.l_out").unwrap().1[70] += 0.5;
    dev.tensors.remove("result_norm");
    let taps = diff(&r, Some(&r), &dev, &Arithmetic::F32, &d).unwrap();
    assert_eq!(first_divergence(&taps).unwrap().name, "blk.1.l_out");
    let cases = cases(&taps, "dev", "m", Mode::Isolated);
    let verdicts: Vec<Verdict> = cases.iter().map(|c| c.verdict).collect();
    assert_eq!(verdicts, [Verdict::Pass, Verdict::Pass, Verdict::Fail, Verdict::Unsupported]);
    let mut bad = r.clone();
    bad.tensors.get_mut("blk.0.l_out").unwrap().0 = 32;
    assert!(diff(&r, None, &bad, &Arithmetic::F32, &d).is_err(), "a wrong width is an error");
}

/// The departure gate holds each tap's propagated error to `factor` times the emulated
/// arithmetic's where that is material, names the first tap past it, ignores taps under
/// the floor, and does not apply where no tap reaches it.
#[test]
fn emulated_departure_names_the_first_tap_past_the_factor() {
    let d = dims();
    let mut r = RecordingTap::default();
    let vals: Vec<f32> = (0..5 * 64).map(|i| (i as f32 * 0.37).sin() + 0.1).collect();
    let names = ["blk.0.attn_norm", "blk.0.l_out", "blk.1.attn_q", "blk.1.l_out", "result_norm"];
    for name in names {
        r.record(name, 0, 5, 64, &vals);
    }
    // Each tap of the device off by `rel` of its RMS (every value scaled by 1 +- rel).
    let mut dev = r.clone();
    for (name, rel) in [("blk.0.attn_norm", 1e-5), ("blk.0.l_out", 1e-3), ("blk.1.attn_q", 2e-3), ("blk.1.l_out", 5e-3), ("result_norm", 6e-3)] {
        for (i, v) in dev.tensors.get_mut(name).unwrap().1.iter_mut().enumerate() {
            *v *= 1.0 + if i % 2 == 0 { rel } else { -rel } as f32;
        }
    }
    let mut taps = diff(&r, None, &dev, &Arithmetic::F32, &d).unwrap();
    // The emulated errors: under the floor at attn_norm (its 100x is not held against it).
    let bulk = |t: &TapDiff, e: f64, spread: f64| Some(BulkErrors { device_rel: t.propagated.unwrap().rel(), emulated_rel: e, massive: 0, spread });
    for (t, e) in taps.iter_mut().zip([1e-7, 1e-3, 1e-3, 1e-3, 1e-3]) {
        (t.emulated, t.emulated_bulk) = (Some(e), bulk(t, e, 320.0));
    }
    let c = emulated_departure(&taps, 4.0, "m", "dev").unwrap();
    assert_eq!(c.verdict, Verdict::Fail, "{c:?}");
    assert_eq!(c.metrics["taps_compared"], 4);
    assert_eq!(c.metrics["first_departure_tap"], "blk.1.l_out");
    assert_eq!(c.metrics["largest_tap"], "result_norm");
    assert!((c.metrics["largest_ratio"].as_f64().unwrap() - 6.0).abs() < 1e-3, "{c:?}");
    assert!(c.message.as_deref().unwrap().starts_with("blk.1.l_out: propagated error 5.00x"), "{c:?}");
    let c = emulated_departure(&taps, 6.5, "m", "dev").unwrap();
    assert_eq!(c.verdict, Verdict::Pass, "{c:?}");
    assert!((c.margin - 0.5).abs() < 1e-3, "{c:?}");
    // Bulk errors that still sit in a few elements are named, not held: result_norm's 6x.
    taps[4].emulated_bulk = bulk(&taps[4], 1e-3, 1.2);
    let c = emulated_departure(&taps, 5.5, "m", "dev").unwrap();
    assert_eq!((c.verdict, &c.metrics["taps_compared"], &c.metrics["taps_concentrated"]), (Verdict::Pass, &json!(3), &json!(["result_norm"])), "{c:?}");
    assert!(c.message.as_deref().unwrap().contains("1 taps not held, their errors in under 16 elements (first result_norm)"), "{c:?}");
    taps[4].emulated_bulk = bulk(&taps[4], 1e-3, 320.0);
    // Values non-finite on the device's side only: past any factor.
    taps[2].propagated.as_mut().unwrap().nonfinite = 1;
    let c = emulated_departure(&taps, 1e6, "m", "dev").unwrap();
    assert_eq!((c.verdict, &c.metrics["first_departure_tap"]), (Verdict::Fail, &json!("blk.1.attn_q")), "{c:?}");
    for t in &mut taps {
        t.emulated_bulk = bulk(t, 5e-5, 320.0);
    }
    assert!(emulated_departure(&taps, 4.0, "m", "dev").is_none(), "no tap reaches the floor");
}

/// The bulk leaves a massive value out: an honest engine whose rounding of it happened to
/// differ from the emulation's by 30x still measures 1x over the rest, while an engine 30%
/// off everywhere (the massive value too) measures ~300x; without massive values the bulk
/// is the whole tap.
#[test]
fn the_bulk_leaves_massive_values_out() {
    let n = 4096;
    let reference: Vec<f32> = (0..n).map(|i| if i == 7 { 22_500.0 } else { ((i as f32) * 0.61).sin() }).collect();
    let noise = |i: usize, salt: u32| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(salt) % 2001) as f32 / 1000.0 - 1.0;
    let emulated: Vec<f32> = reference.iter().enumerate().map(|(i, r)| r + 1e-3 * noise(i, 1) * if i == 7 { 0.1 } else { 1.0 }).collect();
    let honest: Vec<f32> = reference.iter().enumerate().map(|(i, r)| r + 1e-3 * noise(i, 2) * if i == 7 { 3.0 } else { 1.0 }).collect();
    let b = bulk_errors(&honest, &emulated, &reference);
    assert_eq!(b.massive, 1);
    assert!((b.device_rel / b.emulated_rel - 1.0).abs() < 0.1 && b.spread > 1000.0, "{b:?}");
    // One element's error alone: spread 1; none: 0.
    let mut one = reference.clone();
    one[100] += 0.5;
    assert_eq!(bulk_errors(&one, &reference, &reference).spread, 1.0);
    assert_eq!(bulk_errors(&reference, &reference, &reference).spread, 0.0);
    let off: Vec<f32> = emulated.iter().map(|x| x * 1.3).collect();
    let b = bulk_errors(&off, &emulated, &reference);
    assert!(b.device_rel / b.emulated_rel > 100.0, "{b:?}");
    let plain: Vec<f32> = reference.iter().map(|r| r.min(1.0)).collect();
    let b = bulk_errors(&honest, &emulated, &plain);
    let full = err_stats(&emulated, &plain, 64).rel();
    assert_eq!(b.massive, 0);
    assert!(full > 1e-4 && (b.emulated_rel / full - 1.0).abs() < 1e-9, "{b:?} vs {full}");
}

/// An op that magnifies its inputs' error (the oracle's own re-run on the device's inputs
/// moves 5x as far as they are off) is granted what it added; an error that grows where no
/// op magnifies it is granted nothing and still fails.
#[test]
fn magnified_error_is_granted_and_unexplained_growth_is_not() {
    let d = Dims { n_layer: 1, ..dims() };
    let q8 = Arithmetic { activation_q8_block: Some(32), ..Arithmetic::F32 };
    let vals = |seed: f32| -> Vec<f32> { (0..5 * 64).map(|i| (i as f32 * seed).sin() + 0.5).collect() };
    // `v` moved by `rel` of its RMS along a fixed pattern.
    let off = |v: &[f32], rel: f64, seed: f32| -> Vec<f32> {
        let rms = (v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
        let n: Vec<f64> = (0..v.len()).map(|i| (i as f32 * seed).cos() as f64).collect();
        let nrms = (n.iter().map(|x| x * x).sum::<f64>() / n.len() as f64).sqrt();
        v.iter().zip(&n).map(|(x, e)| (*x as f64 + rel * rms * e / nrms) as f32).collect()
    };
    let names = ["blk.0.ffn_gate", "blk.0.ffn_up", "blk.0.ffn_act", "blk.0.ffn_out"];
    let mut r = RecordingTap::default();
    for (i, n) in names.iter().enumerate() {
        r.record(n, 0, 5, 64, &vals(0.3 + i as f32 * 0.11));
    }
    let at = |t: &RecordingTap, n: &str| t.tensors[n].1.clone();
    // Device: gate 1% off, up exact; act 5% off and out 12% off.
    let mut dev = r.clone();
    dev.record("blk.0.ffn_gate", 0, 5, 64, &off(&at(&r, "blk.0.ffn_gate"), 0.01, 0.7));
    dev.record("blk.0.ffn_act", 0, 5, 64, &off(&at(&r, "blk.0.ffn_act"), 0.05, 0.9));
    dev.record("blk.0.ffn_out", 0, 5, 64, &off(&at(&r, "blk.0.ffn_out"), 0.12, 1.3));
    // The oracle on the device's inputs: act moves all of its 5% (amplification 5), out 5%.
    let mut iso = r.clone();
    iso.record("blk.0.ffn_act", 0, 5, 64, &at(&dev, "blk.0.ffn_act"));
    iso.record("blk.0.ffn_out", 0, 5, 64, &off(&at(&r, "blk.0.ffn_out"), 0.05, 1.3));
    let taps = diff(&r, Some(&iso), &dev, &q8, &d).unwrap();
    let get = |n: &str| taps.iter().find(|t| t.name == n).unwrap();
    let act = get("blk.0.ffn_act");
    let depth = propagated_budget(kind("ffn_act"), Some(0), &q8, &d).unwrap().rel;
    assert!(act.propagated.unwrap().rel() > depth, "the depth model alone would fail this tap");
    assert!((act.amplification.unwrap() - 5.0).abs() < 1e-3 && (act.magnified - 0.04).abs() < 1e-4, "{:?} {}", act.amplification, act.magnified);
    assert_eq!(act.exceeds(Mode::Propagated), Some(false));
    // out: the 4% grant carried through (amplification 1), but 12% is far beyond it.
    let out = get("blk.0.ffn_out");
    assert!((out.magnified - 0.04).abs() < 1e-3, "{}", out.magnified);
    assert_eq!(out.exceeds(Mode::Propagated), Some(true));
    // The same act error with the oracle not moving (the device's own error): no grant, fails.
    let taps = diff(&r, Some(&r), &dev, &q8, &d).unwrap();
    let act = taps.iter().find(|t| t.name == "blk.0.ffn_act").unwrap();
    assert_eq!((act.amplification, act.magnified), (Some(0.0), 0.0));
    assert_eq!(act.exceeds(Mode::Propagated), Some(true));
}

#[test]
fn nan_on_one_side_fails_even_within_budget() {
    let r = [1.0f32, 2.0, 3.0, 4.0];
    let mut dv = r;
    dv[2] = f32::NAN;
    let s = err_stats(&dv, &r, 2);
    assert_eq!(s.nonfinite, 1);
}
