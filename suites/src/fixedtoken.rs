//! The fixed-token gate: teacher-forced logits over a fixed token sequence (prompt + golden
//! continuation), so the oracle and the device see identical inputs at every position.
//!
//! Per position: KL divergence oracle -> device, top-1 agreement, top-5 overlap, Δp of the
//! oracle's top token, logit max-abs. Gates, each one report case:
//! - `kld_mean`: mean KLD within the bound the device's logit error budget implies;
//! - `top1`: the device's top-1 equals the oracle's at every position that is not a near tie
//!   (a position whose oracle top-1/top-2 margin is below twice the logit error budget: the
//!   device's permitted error could flip it, so it is flagged, not failed);
//! - `greedy`: the device's greedy generation equals the golden continuation; a first mismatch at
//!   a near tie is reported and not failed (after it the sequences differ, so it ends the check);
//! - `golden`: the oracle itself still produces the golden continuation (a stale golden or an
//!   oracle regression fails here, never silently);
//! - `cache_consistency`: logits reached by one prefill, by prefill + decode steps and by prefill
//!   + append agree within the budget (unsupported for one-shot external engines).
//! - `kld_vs_baseline` (when given a baseline: the report of an earlier run on the same model and
//!   golden, e.g. the last good commit): mean KLD at most `factor` times the baseline's. The
//!   worst-case bound of `kld_mean` is loose for devices with quantized activations; this one
//!   is as sharp as the engine is repeatable, and catches a change of numerics the bound lets
//!   through.
//! - `kld_vs_emulation` (devices whose declared arithmetic rounds beyond f32: Q8 activations, a
//!   16-bit cache or storage, fixed point): mean KLD at most `factor` (by default
//!   [`EMULATION_FACTOR`]) times that of the oracle
//!   re-run with the declared roundings emulated ([`crate::emulate::EmulatedArithmetic`]), i.e. what an honest
//!   engine of that arithmetic gets; sharp with no earlier run.
//!
//! The logit budget is the layer-diff propagated budget of `result_output` (suites::layerdiff),
//! so one model of the device's arithmetic feeds both gates.

pub use crate::emulate::EMULATION_FACTOR;
use crate::layerdiff::Budget;
use crate::throughput::percentile;
use reports::{Case, Tolerance, Verdict};
use serde::{Deserialize, Serialize};
use reports::findings::{KldSummary, PositionFigures, Quantiles, SameTop1, TokenFindings, TokenStats};
use reports::{Metrics, Report};

/// A golden sequence for one model (`fixtures/golden/<model>.json`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Golden {
    pub model: String,
    /// sha256 of the model file (or of a safetensors directory's files) the golden was made with.
    pub sha256: String,
    pub prompt_ids: Vec<u32>,
    /// The oracle's greedy continuation of `prompt_ids`.
    pub continuation_ids: Vec<u32>,
    /// The command that regenerates this file.
    pub regenerate: String,
}

impl Golden {
    pub fn sequence(&self) -> Vec<u32> {
        self.prompt_ids.iter().chain(&self.continuation_ids).copied().collect()
    }
}

/// Statistics of one position.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct PositionStats {
    pub pos: usize,
    pub kld: f64,
    pub top1_oracle: u32,
    pub top1_device: u32,
    pub top5_overlap: f64,
    /// p_device(oracle's top token) - p_oracle(oracle's top token).
    pub dp: f64,
    pub max_abs: f64,
    /// Mean |device - oracle| logit over the vocabulary (the "full-vocabulary mean absolute logit
    /// error" engine authors report).
    pub mean_abs: f64,
    /// Whether the two top-5 lists hold the same ids (in any order).
    pub top5_equal: bool,
    /// Oracle's top-1 minus top-2 logit.
    pub margin: f64,
    /// The logit error budget at this position (RMS), and whether the margin is within twice it.
    pub delta: f64,
    pub near_tie: bool,
    /// KLD bound at this position: 0.5 * delta^2 (KLD ~ half the variance of the logit error
    /// under the oracle's distribution, which is at most its mean square).
    pub kld_bound: f64,
}

fn log_softmax(x: &[f64]) -> Vec<f64> {
    let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + x.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
    x.iter().map(|v| v - lse).collect()
}

/// Not `oracle::ops::top_k`, which never picks NaN: a device logit that is NaN must show up here
/// as the device's top token (a flip), not be skipped.
fn top_k(x: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    // Ties resolve to the lower index, as the oracle's argmax does.
    idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Per-position statistics of device logits against the oracle's (`[n, n_vocab]` each).
pub fn position_stats(oracle: &[f64], device: &[f32], n_vocab: usize, budget: &Budget) -> Vec<PositionStats> {
    oracle
        .chunks(n_vocab)
        .zip(device.chunks(n_vocab))
        .enumerate()
        .map(|(pos, (o, d))| {
            let d: Vec<f64> = d.iter().map(|v| *v as f64).collect();
            let (lo, ld) = (log_softmax(o), log_softmax(&d));
            let kld: f64 = lo.iter().zip(&ld).map(|(a, b)| if a.is_finite() { a.exp() * (a - b) } else { 0.0 }).sum();
            let (to, td) = (top_k(o, 5), top_k(&d, 5));
            let common = to.iter().filter(|i| td.contains(i)).count();
            // Largest and summed |error| in one pass; infinite when the device gave a non-finite logit.
            let finite = d.iter().all(|v| v.is_finite());
            let (max_abs, sum_abs) = o.iter().zip(&d).fold((0.0f64, 0.0f64), |(m, s), (a, b)| {
                let e = (a - b).abs();
                (m.max(e), s + e)
            });
            let rms = (o.iter().map(|v| v * v).sum::<f64>() / n_vocab as f64).sqrt();
            let delta = budget.bound(rms);
            // A one-token vocabulary has no runner-up: nothing can flip.
            let margin = to.get(1).map_or(f64::INFINITY, |&second| o[to[0]] - o[second]);
            PositionStats {
                pos,
                kld: if kld.is_nan() { f64::INFINITY } else { kld.max(0.0) },
                top1_oracle: to[0] as u32,
                top1_device: td[0] as u32,
                top5_overlap: common as f64 / 5.0,
                dp: ld[to[0]].exp() - lo[to[0]].exp(),
                max_abs: if finite { max_abs } else { f64::INFINITY },
                mean_abs: if finite { sum_abs / n_vocab as f64 } else { f64::INFINITY },
                top5_equal: common == to.len(),
                margin,
                delta,
                near_tie: margin < 2.0 * delta,
                kld_bound: 0.5 * delta * delta,
            }
        })
        .collect()
}

/// Wilson score interval (95%) of a binomial proportion.
pub fn wilson95(successes: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let (z, nf) = (1.959_963_984_540_054, n as f64);
    let p = successes as f64 / nf;
    let den = 1.0 + z * z / nf;
    let centre = (p + z * z / (2.0 * nf)) / den;
    let half = z * (p * (1.0 - p) / nf + z * z / (4.0 * nf * nf)).sqrt() / den;
    ((centre - half).max(0.0), (centre + half).min(1.0))
}


/// The `token_stats` section: the statistics llama.cpp's `--kl-divergence` prints.
pub fn token_stats(stats: &[PositionStats]) -> TokenStats {
    let mut kld: Vec<f64> = stats.iter().map(|s| s.kld).collect();
    kld.sort_by(f64::total_cmp);
    let mut dp: Vec<f64> = stats.iter().map(|s| s.dp).collect();
    dp.sort_by(f64::total_cmp);
    let same = stats.iter().filter(|s| s.top1_oracle == s.top1_device).count();
    let (lo, hi) = wilson95(same, stats.len());
    let n = stats.len().max(1) as f64;
    TokenStats {
        positions: stats.len(),
        kld: KldSummary { mean: kld.iter().sum::<f64>() / n, median: percentile(&kld, 0.5), p99: percentile(&kld, 0.99), max: kld.last().copied() },
        kld_bound_mean: stats.iter().map(|s| s.kld_bound).sum::<f64>() / n,
        same_top1: SameTop1 { count: same, rate: same as f64 / n, ci95: [lo, hi] },
        top5_overlap_mean: stats.iter().map(|s| s.top5_overlap).sum::<f64>() / n,
        dp: Quantiles { p1: percentile(&dp, 0.01), p5: percentile(&dp, 0.05), median: percentile(&dp, 0.5), p95: percentile(&dp, 0.95), p99: percentile(&dp, 0.99) },
        near_ties: stats.iter().filter(|s| s.near_tie).count(),
        max_abs_logit: stats.iter().map(|s| s.max_abs).fold(0.0, f64::max),
        mean_abs_logit: stats.iter().map(|s| s.mean_abs).sum::<f64>() / n,
        same_top5: stats.iter().filter(|s| s.top5_equal).count(),
        per_position: stats.iter().map(|s| PositionFigures { pos: s.pos, kld: s.kld, kld_bound: s.kld_bound, top1_oracle: s.top1_oracle, top1_device: s.top1_device, margin: s.margin, near_tie: s.near_tie, dp: s.dp }).collect(),
        routing_flips: 0,
        routing_followed: 0,
    }
}

fn case(id: String, device: &str, pass: bool, rule: &str, bound: f64, measured: f64, metrics: Metrics, message: Option<String>) -> Case {
    Case { id, device: device.to_string(), verdict: if pass { Verdict::Pass } else { Verdict::Fail }, metrics, tolerance: Tolerance { rule: rule.into(), bound }, margin: bound - measured, message }
}

/// What the device produced, besides its teacher-forced logits.
pub struct DeviceRuns {
    /// Greedy ids after the prompt (None: derived from the teacher-forced logits, which give
    /// the same decisions up to the first mismatch).
    pub greedy: Option<Vec<u32>>,
    /// Logits of the same positions reached another way: (how, first position, `[.., n_vocab]`).
    /// None: the engine cannot be stepped (one-shot external engine).
    pub cache_paths: Option<Vec<(String, usize, Vec<f32>)>>,
    /// MoE models: positions where the device's teacher-forced run chose other experts than the
    /// oracle's in some layer (`routing_flips`). Its inputs differ from the oracle's by its
    /// permitted error, so a router near tie can flip; a top-1 difference there is flagged, not
    /// failed. The router itself is gated by layer-diff (isolated expert ids, identical except
    /// where the device's own recorded scores explain a near tie).
    pub routing_differs: Vec<bool>,
    /// MoE models whose device run routed some token otherwise than the oracle: the oracle's
    /// logits re-run routing as the device did wherever the two differ only at a near tie
    /// ([`FollowRouting`]). The device's logits are compared with these (else a correct device
    /// is charged a whole other expert's output at every such token); the golden gate still
    /// judges the oracle's own logits.
    pub followed_oracle: Option<Vec<f64>>,
}

/// Records only the MoE routing taps: expert ids (`blk.*.ffn_moe_topk`) and scores
/// (`blk.*.ffn_moe_probs`).
#[derive(Default)]
pub struct RoutingTap(pub oracle::RecordingTap);

impl oracle::Tap for RoutingTap {
    fn record(&mut self, name: &str, start_pos: usize, n_tokens: usize, width: usize, data: &[f32]) {
        let kind = oracle::taps::TapName::parse(name).map(|t| t.kind);
        if matches!(kind, Some(oracle::taps::TapKind::FfnMoeTopk | oracle::taps::TapKind::FfnMoeProbs)) {
            self.0.record(name, start_pos, n_tokens, width, data);
        }
    }
}

/// The oracle's teacher-forced run: the routing taps, and a sample of the output head's inputs,
/// for the scale of the logits' terms ([`crate::layerdiff::term_scales`]).
#[derive(Default)]
pub struct OracleTap {
    pub routing: RoutingTap,
    pub head: crate::layerdiff::ProductRows,
}

impl oracle::Tap for OracleTap {
    fn record(&mut self, name: &str, start_pos: usize, n_tokens: usize, width: usize, data: &[f32]) {
        self.routing.record(name, start_pos, n_tokens, width, data);
    }
    fn product_input(&mut self, weight: &str, width: usize, data: &[f32]) -> Option<Vec<f32>> {
        if crate::layerdiff::product_tap(weight).map(|t| t.kind) == Some(oracle::taps::TapKind::ResultOutput) {
            self.head.add(weight, width, data);
        }
        None
    }
}

/// The oracle's tap for its re-run on a MoE model: records the routing taps and follows the
/// device's routing at near ties (`routing`).
pub struct FollowRouting<'a> {
    pub routing: crate::layerdiff::RoutingFollower<'a>,
    pub recorded: RoutingTap,
}

impl oracle::Tap for FollowRouting<'_> {
    fn record(&mut self, name: &str, start_pos: usize, n_tokens: usize, width: usize, data: &[f32]) {
        self.recorded.record(name, start_pos, n_tokens, width, data);
    }
    fn route(&mut self, name: &str, pos: usize, routing: &oracle::ops::Routing) -> Option<Vec<usize>> {
        self.routing.route(name, pos, routing)
    }
}

/// Positions (of `n`) where two runs' expert sets differ in any layer.
pub fn routing_differs(a: &RoutingTap, b: &RoutingTap, n: usize) -> Vec<bool> {
    let mut out = vec![false; n];
    for (name, (w, av)) in a.0.tensors.iter().filter(|(name, _)| oracle::taps::TapName::parse(name).is_some_and(|t| t.kind == oracle::taps::TapKind::FfnMoeTopk)) {
        let Some((_, bv)) = b.0.tensors.get(name) else { continue };
        for (p, (x, y)) in av.chunks(*w).zip(bv.chunks(*w)).enumerate().take(n) {
            let (mut x, mut y) = (x.to_vec(), y.to_vec());
            x.sort_by(f32::total_cmp);
            y.sort_by(f32::total_cmp);
            out[p] |= x != y;
        }
    }
    out
}

/// The `kld_vs_emulation` gate: this run's mean KLD (`stats`) at most `factor` times
/// the mean KLD of the oracle re-run with the device's declared arithmetic (`emulated`, the
/// `token_stats` of those logits against the oracle's). Where the worst-case bound of `kld_mean`
/// is loose (quantized activations), this is what an engine of that arithmetic gets, on this
/// model and sequence, with no earlier run needed.
pub fn against_emulation(golden: &Golden, stats: &TokenFindings, emulated: &TokenStats, factor: f64, device: &str) -> Case {
    let id = format!("fixed_token(model={},gate=kld_vs_emulation)", golden.model);
    let extra = Metrics::new().with("emulated_kld_mean", emulated.kld.mean).with("emulated_same_top1", emulated.same_top1.count);
    let (mut case, ratio) = kld_ratio_case(id, device, stats.stats(), emulated, factor, "that of the oracle run with the declared arithmetic emulated", extra);
    // An engine well under its emulation is not wrong, but its declaration rounds more than it
    // does, and the gate allows that much more than the engine's own error (llama.cpp declaring
    // Q8_K blocks for every product of a file of mostly Q5_0 matrices measured 0.32x).
    if let (Verdict::Pass, Some((ratio, Some((lo, hi))))) = (case.verdict, ratio) {
        let overstated = hi < OVERSTATED_RATIO;
        case.metrics.set("declaration_overstates", overstated);
        if overstated {
            case.message = Some(format!(
                "mean KLD {ratio:.3}x the emulated arithmetic's, 95% CI {lo:.3}-{hi:.3}x: the declared arithmetic rounds more than this engine does, so this gate allows over {:.0}x its own KLD; declare what it computes (docs/DUMP_FORMAT.md, `arithmetic`)",
                factor / hi
            ));
        }
    }
    case
}

/// Below this upper end of the 95% CI of an engine's mean KLD over its emulation's, its
/// declaration is reported as rounding more than the engine does (honest engines with what they
/// do declared measure 0.85-1.4x: docs/ACCURACY.md).
pub const OVERSTATED_RATIO: f64 = 0.5;

/// A gate holding this run's mean KLD (`stats`, a `token_stats` section) to `factor` times the
/// mean KLD of another run over the same positions (`reference_stats`, `what`, with `extra`
/// metrics about it); unsupported for a token-only run. Where both sections list per-position
/// KLDs, `ratio_ci95` is the paired bootstrap 95% CI of the ratio (how much of it a short
/// sequence's luck can move).
/// The case, and the ratio of the two mean KLDs with its CI where there are both.
fn kld_ratio_case(id: String, device: &str, stats: Option<&TokenStats>, reference_stats: &TokenStats, factor: f64, what: &str, extra: Metrics) -> (Case, Option<(f64, Option<(f64, f64)>)>) {
    let unsupported = |rule: &str, message: String| Case { id: id.clone(), device: device.into(), verdict: Verdict::Unsupported, metrics: Metrics::new(), tolerance: Tolerance { rule: rule.into(), bound: 0.0 }, margin: 0.0, message: Some(message) };
    let Some(stats) = stats else { return (unsupported("no logits", format!("token-only engine: no KLD to compare with {what}")), None) };
    let reference = reference_stats.kld.mean;
    if !reference.is_finite() {
        return (unsupported("no reference", format!("{what} mean KLD is not finite: nothing to compare with")), None);
    }
    let now = stats.kld.mean;
    let bound = (reference * factor).max(BASELINE_KLD_FLOOR);
    let mut metrics = Metrics::new().with("kld_mean", now).with("ratio", now / reference).with("same_top1", stats.same_top1.count);
    let per_position = |s: &TokenStats| -> Vec<f64> { s.per_position.iter().map(|p| p.kld).collect() };
    let ci = Some((per_position(stats), per_position(reference_stats))).filter(|(a, b)| !a.is_empty() && !b.is_empty()).and_then(|(a, b)| crate::ab::bootstrap_ratio_ci(&a, &b, 2000, 0x6b6c_6472));
    if let Some((lo, hi)) = ci {
        metrics.set("ratio_ci95", [lo, hi]);
    }
    metrics.extend(extra);
    let pass = now <= bound;
    let ci_text = ci.map_or(String::new(), |(lo, hi)| format!(", 95% CI {lo:.2}-{hi:.2}x"));
    let message = (!pass).then(|| format!("mean KLD {now:.3e} is {:.2}x {what} ({reference:.3e}; allowed {factor}x{ci_text})", now / reference));
    (case(id, device, pass, &format!("mean KLD <= {factor} x {what} (floor {BASELINE_KLD_FLOOR:e})"), bound, now, metrics, message), Some((now / reference, ci)))
}

/// KLD below which two runs are taken as equal (a deterministic f32 engine measures ~1e-12).
pub const BASELINE_KLD_FLOOR: f64 = 1e-12;

/// The golden sequence a fixed-token report was run over (its `golden` section).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GoldenUsed {
    /// Where the golden came from: its file, or the oracle in that run.
    pub source: String,
    pub model: String,
    pub sha256: String,
    pub prompt_ids: Vec<u32>,
    pub continuation_ids: Vec<u32>,
}

/// An earlier fixed-token run, as the `kld_vs_baseline` gate reads it.
pub struct Baseline {
    pub stats: TokenStats,
    /// The device of its first case.
    pub device: Option<String>,
}

/// The earlier run `baseline` (a fixed-token report.json), checked to be a run over `golden`
/// (the same model and token sequence) with logits; Err says why not (checked before a run, so
/// a wrong baseline costs none).
pub fn baseline(golden: &Golden, baseline: &Report) -> Result<Baseline, String> {
    if baseline.suite != "fixed-token" {
        return Err(format!("the baseline is a {} report, not a fixed-token one", baseline.suite));
    }
    let bg: GoldenUsed = baseline.section("golden").ok_or("the baseline has no `golden` section")??;
    if bg.sha256 != golden.sha256 {
        return Err(format!("the baseline was run on a model with sha256 {}, this one has {}", bg.sha256, golden.sha256));
    }
    if bg.prompt_ids != golden.prompt_ids || bg.continuation_ids != golden.continuation_ids {
        return Err("the baseline was run over another token sequence (its golden prompt or continuation differs): the two mean KLDs would not measure the same thing".into());
    }
    let no_kld = || "the baseline holds no mean KLD (a token-only run?)".to_string();
    let stats = match baseline.section::<TokenFindings>("token_stats").ok_or_else(no_kld)?? {
        TokenFindings::Logits(s) if s.kld.mean.is_finite() => s,
        _ => return Err(no_kld()),
    };
    Ok(Baseline { stats, device: baseline.cases.first().map(|c| c.device.clone()) })
}

/// The `kld_vs_baseline` gate: this run's mean KLD (`stats`, a `token_stats` section) against
/// `factor` times the baseline's (from [`baseline`]); a token-only run (no KLD) is unsupported.
pub fn against_baseline(golden: &Golden, stats: &TokenFindings, baseline: &Baseline, factor: f64, device: &str) -> Case {
    let id = format!("fixed_token(model={},gate=kld_vs_baseline)", golden.model);
    let extra = Metrics::new().with("baseline_kld_mean", baseline.stats.kld.mean).with("baseline_device", &baseline.device).with("baseline_same_top1", baseline.stats.same_top1.count);
    kld_ratio_case(id, device, stats.stats(), &baseline.stats, factor, "the baseline's", extra).0
}

/// Judges one device run: the gate cases (see the module header) and the `token_stats` section.
pub fn evaluate(golden: &Golden, oracle: &[f64], device_logits: &[f32], n_vocab: usize, budget: &Budget, runs: &DeviceRuns, device: &str) -> (Vec<Case>, TokenFindings) {
    let mut stats = position_stats(runs.followed_oracle.as_deref().unwrap_or(oracle), device_logits, n_vocab, budget);
    for (s, &flip) in stats.iter_mut().zip(&runs.routing_differs) {
        s.near_tie |= flip;
    }
    let mut ts = token_stats(&stats);
    ts.routing_flips = runs.routing_differs.iter().filter(|f| **f).count();
    let model = &golden.model;
    let id = |g: &str| format!("fixed_token(model={model},gate={g})");
    let mut cases = Vec::new();

    let mean_kld = if ts.kld.mean.is_nan() { f64::INFINITY } else { ts.kld.mean };
    let kld_bound = if ts.kld_bound_mean.is_nan() { 0.0 } else { ts.kld_bound_mean };
    cases.push(case(
        id("kld_mean"),
        device,
        mean_kld <= kld_bound,
        "mean KLD <= mean over positions of 0.5*delta^2 (delta: logit RMS error budget)",
        kld_bound,
        mean_kld,
        Metrics::new().with("kld_mean", mean_kld).with("max_abs", ts.max_abs_logit),
        (!(mean_kld <= kld_bound)).then(|| format!("mean KLD {mean_kld:.3e} > {kld_bound:.3e}")),
    ));

    let flips: Vec<&PositionStats> = stats.iter().filter(|s| s.top1_oracle != s.top1_device && !s.near_tie).collect();
    let near = stats.iter().filter(|s| s.top1_oracle != s.top1_device && s.near_tie).count();
    cases.push(case(
        id("top1"),
        device,
        flips.is_empty(),
        "top-1 equal at every position whose oracle margin >= 2*delta",
        0.0,
        flips.len() as f64,
        Metrics::new().with("flips", flips.len()).with("near_tie_flips", near).with("positions", stats.len()),
        flips.first().map(|s| format!("position {}: oracle top-1 {} (margin {:.3}), device {}; {} such positions", s.pos, s.top1_oracle, s.margin, s.top1_device, flips.len())),
    ));

    // The golden continuation as predicted by teacher forcing: position p predicts token p+1.
    let p0 = golden.prompt_ids.len();
    let seq = golden.sequence();
    // The oracle's own logits (not a re-run that followed the device's routing).
    let own_top1 = |p: usize| top_k(&oracle[p * n_vocab..(p + 1) * n_vocab], 1)[0] as u32;
    let oracle_mismatch = (p0..seq.len()).find(|&t| own_top1(t - 1) != seq[t]);
    cases.push(case(
        id("golden"),
        "oracle",
        oracle_mismatch.is_none(),
        "the oracle's greedy argmax reproduces the golden continuation",
        0.0,
        oracle_mismatch.map_or(0.0, |_| 1.0),
        Metrics::new().with("golden_tokens", golden.continuation_ids.len()),
        oracle_mismatch.map(|t| format!("the oracle predicts {} at position {t}, the golden has {} — the golden is stale or the oracle changed; regenerate with `{}`", own_top1(t - 1), seq[t], golden.regenerate)),
    ));

    let device_greedy: Vec<u32> = match &runs.greedy {
        Some(g) => g.clone(),
        None => (p0..seq.len()).map(|t| stats[t - 1].top1_device).collect(),
    };
    let first = golden.continuation_ids.iter().zip(&device_greedy).position(|(a, b)| a != b);
    let too_short = first.is_none() && device_greedy.len() < golden.continuation_ids.len();
    let (pass, message) = match first {
        None if too_short => (false, Some(format!("the device generated {} tokens, the golden has {}", device_greedy.len(), golden.continuation_ids.len()))),
        None => (true, None),
        Some(i) => {
            let s = &stats[p0 + i - 1];
            if s.near_tie {
                let why = if runs.routing_differs.get(p0 + i - 1) == Some(&true) { "the device's run chose other experts there (router near tie)".to_string() } else { format!("oracle margin {:.3} < 2*delta = {:.3}", s.margin, 2.0 * s.delta) };
                (true, Some(format!("first mismatch at generated token {i} (position {}) is a near tie: {why}; not counted", p0 + i)))
            } else {
                (false, Some(format!("first mismatch at generated token {i} (position {}): golden {}, device {} (oracle margin {:.3} >= 2*delta = {:.3})", p0 + i, golden.continuation_ids[i], device_greedy[i], s.margin, 2.0 * s.delta)))
            }
        }
    };
    cases.push(case(
        id("greedy"),
        device,
        pass,
        "greedy ids equal the golden continuation (a first mismatch at a near tie is not counted)",
        0.0,
        if pass { 0.0 } else { 1.0 },
        Metrics::new().with("first_mismatch", first).with("generated", &device_greedy).with("golden", &golden.continuation_ids),
        message,
    ));

    match &runs.cache_paths {
        None => cases.push(Case {
            id: id("cache_consistency"),
            device: device.to_string(),
            verdict: Verdict::Unsupported,
            metrics: Metrics::new(),
            tolerance: Tolerance { rule: "one-shot engine".into(), bound: 0.0 },
            margin: 0.0,
            message: Some("this engine runs one prefill per request; prefill/decode/append consistency cannot be checked".into()),
        }),
        Some(paths) => {
            for (how, start, logits) in paths {
                let agreed = agreement(logits, &device_logits[start * n_vocab..], &stats[*start..], n_vocab);
                let (worst, worst_ratio, argmax_diff) = (agreed.max_abs, agreed.worst_ratio, agreed.argmax_differences.len());
                let pass = worst_ratio <= 1.0 && argmax_diff == 0;
                cases.push(case(
                    id(&format!("cache_consistency:{how}")),
                    device,
                    pass,
                    "RMS difference to the one-prefill logits <= 2*delta per position, same argmax off near ties",
                    1.0,
                    worst_ratio,
                    Metrics::new().with("max_abs", worst).with("worst_rms_over_bound", worst_ratio).with("argmax_differences", argmax_diff).with("from_position", start),
                    (!pass).then(|| format!("{how}: RMS difference up to {worst_ratio:.2}x its bound, {argmax_diff} argmax differences off near ties")),
                ));
            }
        }
    }
    (cases, TokenFindings::Logits(ts))
}

/// How closely two runs' logits over the same positions agree (`a` and `b`, `[positions,
/// n_vocab]`; `stats`: those positions' budgets and near ties, in order).
pub struct Agreement {
    /// The largest RMS difference of a position over twice its logit budget (delta), and the
    /// index of that position.
    pub worst_ratio: f64,
    pub worst_at: usize,
    /// The largest absolute difference of one logit.
    pub max_abs: f64,
    /// The positions (indices) whose top-1 differs off a near tie.
    pub argmax_differences: Vec<usize>,
}

/// [`Agreement`] of `a` and `b`: what cache consistency and the serving rung hold a run to
/// against another run of the same positions.
pub fn agreement(a: &[f32], b: &[f32], stats: &[PositionStats], n_vocab: usize) -> Agreement {
    let mut out = Agreement { worst_ratio: 0.0, worst_at: 0, max_abs: 0.0, argmax_differences: Vec::new() };
    let top1 = |v: &[f32]| v.iter().enumerate().fold(0, |best, (i, x)| if *x > v[best] { i } else { best });
    for (k, (x, y)) in a.chunks(n_vocab).zip(b.chunks(n_vocab)).enumerate() {
        let s = &stats[k];
        let rms = (x.iter().zip(y).map(|(p, q)| ((p - q) as f64).powi(2)).sum::<f64>() / n_vocab as f64).sqrt();
        let ratio = if rms.is_finite() { rms / (2.0 * s.delta) } else { f64::INFINITY };
        if ratio > out.worst_ratio {
            (out.worst_ratio, out.worst_at) = (ratio, k);
        }
        out.max_abs = out.max_abs.max(x.iter().zip(y).map(|(p, q)| ((p - q) as f64).abs()).fold(0.0, f64::max));
        if top1(x) != top1(y) && !s.near_tie {
            out.argmax_differences.push(k);
        }
    }
    out
}

/// A token-only engine (it printed generated ids, no logits): only the greedy gate can run; the
/// logit gates are reported as unsupported. Near ties come from the oracle's margins.
pub fn evaluate_tokens_only(golden: &Golden, oracle: &[f64], n_vocab: usize, budget: &Budget, generated: &[u32], device: &str) -> (Vec<Case>, TokenFindings) {
    // The oracle against itself gives its margins and top-1s with zero error.
    let own: Vec<f32> = oracle.iter().map(|v| *v as f32).collect();
    let runs = DeviceRuns { greedy: Some(generated.to_vec()), cache_paths: None, routing_differs: Vec::new(), followed_oracle: None };
    let (cases, _) = evaluate(golden, oracle, &own, n_vocab, budget, &runs, device);
    let cases = cases
        .into_iter()
        .map(|mut c| {
            if c.id.contains("gate=kld_mean") || c.id.contains("gate=top1") {
                c.verdict = Verdict::Unsupported;
                c.metrics.clear();
                c.message = Some("token-only engine: no logits to compare".into());
            }
            c
        })
        .collect();
    (cases, TokenFindings::TokenOnly { token_only: true, generated: generated.to_vec() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn golden() -> Golden {
        Golden { model: "m".into(), sha256: "x".into(), prompt_ids: vec![0, 1], continuation_ids: vec![2, 3], regenerate: "r".into() }
    }

    /// Logits favouring `next` by `gap` at each of `seq` positions.
    fn logits(next: &[usize], v: usize, gap: f64) -> Vec<f64> {
        next.iter().flat_map(|&t| (0..v).map(move |i| if i == t { gap } else { (i as f64 * 0.1).sin() * 0.1 })).collect()
    }

    #[test]
    fn identical_logits_pass_every_gate_and_a_flip_fails() {
        let g = golden();
        let v = 8;
        // Positions 0..4 predict 1, 2, 3, 4.
        let o = logits(&[1, 2, 3, 4], v, 5.0);
        let d: Vec<f32> = o.iter().map(|x| *x as f32).collect();
        let b = Budget { rel: 1e-3, abs: 1e-6 };
        let runs = DeviceRuns { greedy: None, cache_paths: Some(vec![("decode".into(), 2, d[2 * v..].to_vec())]), routing_differs: Vec::new(), followed_oracle: None };
        let (cases, ts) = evaluate(&g, &o, &d, v, &b, &runs, "dev");
        assert!(cases.iter().all(|c| c.verdict == Verdict::Pass), "{cases:?}");
        assert_eq!(ts.stats().unwrap().same_top1.count, 4);
        // The device prefers token 5 at position 2 by a wide margin: top-1 and greedy fail.
        let mut bad = d.clone();
        bad[2 * v + 5] = 9.0;
        let (cases, _) = evaluate(&g, &o, &bad, v, &b, &runs, "dev");
        let failed: Vec<&str> = cases.iter().filter(|c| c.verdict == Verdict::Fail).map(|c| c.id.as_str()).collect();
        assert!(failed.iter().any(|c| c.contains("gate=top1")) && failed.iter().any(|c| c.contains("gate=greedy")) && failed.iter().any(|c| c.contains("cache_consistency")), "{failed:?}");
    }

    #[test]
    fn a_flip_at_a_near_tie_is_flagged_not_failed() {
        let g = golden();
        let v = 8;
        let mut o = logits(&[1, 2, 3, 4], v, 5.0);
        o[2 * v + 6] = 5.0 - 1e-4; // position 2: token 3 leads token 6 by 1e-4
        let mut d: Vec<f32> = o.iter().map(|x| *x as f32).collect();
        d[2 * v + 6] = 5.0 + 1e-4;
        let b = Budget { rel: 1e-3, abs: 1e-6 };
        let (cases, ts) = evaluate(&g, &o, &d, v, &b, &DeviceRuns { greedy: None, cache_paths: None, routing_differs: Vec::new(), followed_oracle: None }, "dev");
        assert_eq!(ts.stats().unwrap().near_ties, 1);
        let greedy = cases.iter().find(|c| c.id.contains("gate=greedy")).unwrap();
        assert_eq!(greedy.verdict, Verdict::Pass);
        assert!(greedy.message.as_deref().unwrap().contains("near tie"));
        assert!(cases.iter().any(|c| c.verdict == Verdict::Unsupported), "a one-shot engine's cache check is unsupported, not passed");
    }

    /// The mean absolute logit error and the top-5 agreement, on logits where both are known.
    #[test]
    fn mean_absolute_error_and_top5_agreement() {
        let v = 8;
        let o = logits(&[1, 2, 3, 4], v, 5.0);
        let mut d: Vec<f32> = o.iter().map(|x| *x as f32 + 0.25).collect();
        for x in &mut d[v..2 * v] {
            *x = -*x; // position 1: the order reversed, so its top-5 is another set
        }
        let s = position_stats(&o, &d, v, &Budget { rel: 1e-3, abs: 0.0 });
        assert!((s[0].mean_abs - 0.25).abs() < 1e-6, "{}", s[0].mean_abs);
        assert!(s[0].top5_equal && !s[1].top5_equal && s[2].top5_equal);
        let ts = token_stats(&s);
        assert_eq!(ts.same_top5, 3);
        assert!(ts.mean_abs_logit > 0.25);
    }

    #[test]
    fn a_stale_golden_fails() {
        let mut g = golden();
        g.continuation_ids = vec![2, 7];
        let v = 8;
        let o = logits(&[1, 2, 3, 4], v, 5.0);
        let d: Vec<f32> = o.iter().map(|x| *x as f32).collect();
        let (cases, _) = evaluate(&g, &o, &d, v, &Budget { rel: 1e-3, abs: 0.0 }, &DeviceRuns { greedy: None, cache_paths: None, routing_differs: Vec::new(), followed_oracle: None }, "dev");
        assert_eq!(cases.iter().find(|c| c.id.contains("gate=golden")).unwrap().verdict, Verdict::Fail);
    }

    #[test]
    fn wilson_interval_brackets_the_rate() {
        let (lo, hi) = wilson95(95, 100);
        assert!(lo < 0.95 && hi > 0.95 && lo > 0.88 && hi < 0.99);
        assert_eq!(wilson95(0, 0), (0.0, 1.0));
    }

    /// `kld_vs_emulation` passes an engine well under its emulation, and says that its
    /// declaration rounds more than it does (the gate then allows that much more); an engine
    /// near its emulation gets no such note, and one past the factor fails as before.
    #[test]
    fn an_engine_far_under_its_emulation_is_told_its_declaration_overstates_it() {
        let stats = |klds: &[f64]| {
            let at = |pos: usize, kld: f64| PositionStats { pos, kld, top1_oracle: 0, top1_device: 0, top5_overlap: 1.0, dp: 0.0, max_abs: 0.0, mean_abs: 0.0, top5_equal: true, margin: 1.0, delta: 0.1, near_tie: false, kld_bound: 0.005 };
            token_stats(&klds.iter().enumerate().map(|(p, k)| at(p, *k)).collect::<Vec<_>>())
        };
        let emulated: Vec<f64> = (0..40).map(|i| 1e-3 * (1.0 + (i % 7) as f64 * 0.1)).collect();
        let scaled = |f: f64| stats(&emulated.iter().enumerate().map(|(i, k)| k * f * (1.0 + (i % 3) as f64 * 0.05)).collect::<Vec<_>>());
        let under = against_emulation(&golden(), &TokenFindings::Logits(scaled(0.3)), &stats(&emulated), 4.0, "d");
        assert_eq!(under.verdict, Verdict::Pass);
        assert_eq!(under.metrics["declaration_overstates"], true);
        assert!(under.message.as_deref().unwrap().contains("the declared arithmetic rounds more than this engine does, so this gate allows over 1"), "{:?}", under.message);
        let near = against_emulation(&golden(), &TokenFindings::Logits(scaled(0.9)), &stats(&emulated), 4.0, "d");
        assert_eq!((near.verdict, near.metrics["declaration_overstates"].clone(), near.message.clone()), (Verdict::Pass, serde_json::Value::Bool(false), None));
        let over = against_emulation(&golden(), &TokenFindings::Logits(scaled(5.0)), &stats(&emulated), 4.0, "d");
        assert_eq!(over.verdict, Verdict::Fail);
        assert!(over.metrics.get("declaration_overstates").is_none() && over.message.as_deref().unwrap().contains("allowed 4x"));
    }
}
