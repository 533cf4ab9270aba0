//! What a layer-diff run reports: the first divergence, the cases, the gates on the emulation, the layer table and the charts.

use super::*;
use reports::plot::{Chart, Series};
use reports::{Case, Tolerance, Verdict};
use reports::findings::{Departure, FirstDivergence};
use reports::Metrics;

/// The first tap (execution order) whose isolated error exceeds its budget; taps without an
/// isolated comparison fall back to the propagated one.
pub fn first_divergence(taps: &[TapDiff]) -> Option<&TapDiff> {
    taps.iter().find(|t| t.exceeds(Mode::Isolated).or_else(|| t.exceeds(Mode::Propagated)) == Some(true))
}

/// The `first_divergence` section of report.json: the first tap over its budget, the op behind
/// it and that op's inputs.
pub fn first_divergence_finding(taps: &[TapDiff]) -> Option<FirstDivergence> {
    let t = first_divergence(taps)?;
    let mode = if t.isolated.is_some() { Mode::Isolated } else { Mode::Propagated };
    let (stats, budget) = t.compared(mode);
    Some(FirstDivergence {
        tap: t.name.clone(),
        layer: t.layer,
        kind: t.kind.name().to_string(),
        compared: mode,
        rms_err: stats.map(|s| s.rms_err),
        bound: stats.zip(budget).map(|(s, b)| b.bound(s.rms_ref)),
        worst_position: stats.map(|s| s.worst_pos),
        first_over_position: t.first_over,
        id_mismatches: t.id_mismatches,
        op: op_behind(t),
        inputs: inputs_of(taps, t),
        kernel_filter: kernel_filter(t.kind).map(String::from),
    })
}

/// The op that makes a tap, in words: what sits between the last tap within its budget and the
/// first one over it.
pub fn op_behind(t: &TapDiff) -> String {
    use TapKind::*;
    let w = |matrix: &str| match t.layer {
        Some(i) => format!("blk.{i}.{matrix}.weight"),
        None => format!("{matrix}.weight"),
    };
    match t.kind {
        InpEmbd => "the embedding row lookup (token_embd.weight)".into(),
        AttnNorm | FfnNorm | AttnPostNorm | FfnPostNorm => format!("the normalization (RMSNorm or LayerNorm) times {}", w(t.kind.name())),
        ResultNorm => format!("the normalization (RMSNorm or LayerNorm) times {}", w("output_norm")),
        AttnQNorm | AttnKNorm => format!("the per-head QK-norm times {}", w(t.kind.name())),
        AttnQ | AttnK | AttnV | FfnGate | FfnUp => format!("the matrix product with {}", w(t.kind.name())),
        AttnOut => format!("the matrix product with {}", w("attn_output")),
        FfnOut => format!("the matrix product with {} (a MoE layer: the chosen experts' products, weighted)", w("ffn_down")),
        ResultOutput => "the matrix product with output.weight (or the tied token_embd.weight)".into(),
        AttnQRope | AttnKRope => "RoPE (the rotation of each head's pairs by position)".into(),
        AttnKqv => "attention: scores, causal mask, softmax, the weighted sum of values".into(),
        AttnGate => format!("the matrix product with {} (its gate rows)", w(AttnQ.name())),
        AttnQA => format!("the matrix product with {} and the RMSNorm of the query's latent", w(t.kind.name())),
        AttnKvA => format!("the matrix product with {} (its latent rows) and the latent's RMSNorm", w("attn_kv_a_mqa")),
        AttnGated => "the output gate: attention's output times the sigmoid of the gate".into(),
        FfnInp => "the residual add after attention".into(),
        LOut => "the residual add after the FFN".into(),
        FfnAct => "the gated activation (SwiGLU or GeGLU: act(gate) x up)".into(),
        FfnMoeProbs => format!("the router: the matrix product with {} and its softmax", w("ffn_gate_inp")),
        FfnMoeTopk => "the router's choice of experts".into(),
        // The taps share their names with the weights that make them.
        SsmIn | SsmOut => format!("the matrix product with {}", w(t.kind.name())),
        SsmConv => "the state-space layer's causal convolution (ssm_conv1d) and SiLU".into(),
        SsmState => "the recurrent state update (Mamba-2: decay exp(dt A), plus dt x B; gated DeltaNet: decay, then the delta rule's correction k (v - S k) sigmoid(b))".into(),
        SsmScan => "the recurrence's output: the state read through C, plus D x (gated DeltaNet: through the L2-normed q)".into(),
        SsmNorm => format!("the gated norm: SiLU(z) and an RMSNorm per group, times {}", w(t.kind.name())),
    }
}

/// The taps a tap's op reads, among those compared: where a red op's inputs were still within
/// their budgets.
fn inputs_of(taps: &[TapDiff], t: &TapDiff) -> Vec<String> {
    let n_layer = taps.iter().filter_map(|t| t.layer).max().map_or(0, |l| l + 1);
    let has = |n: &str| taps.iter().any(|x| x.name == n && !x.missing);
    super::tap_inputs(t.layer, t.kind, n_layer, &has)
}

/// The kernel suite's filter for the op that makes a tap kind (`kernels --filter`), where the
/// kernel suite has that op.
pub fn kernel_filter(kind: TapKind) -> Option<&'static str> {
    use TapKind::*;
    Some(match kind {
        InpEmbd => "^embed\\(",
        AttnNorm | FfnNorm | AttnPostNorm | FfnPostNorm | ResultNorm => "^(rms_norm|layer_norm)\\(",
        AttnQNorm | AttnKNorm => "^qk_norm\\(",
        AttnQ | AttnK | AttnV | AttnGate | FfnGate | FfnUp | AttnOut | FfnOut | ResultOutput => "^matmul\\(",
        AttnQRope | AttnKRope => "^rope\\(",
        // Grouped-query attention and its variants, or latent attention's `mla_attention`.
        AttnKqv => "attention",
        FfnInp | LOut => "^add\\(",
        FfnAct => "^(swiglu|geglu|swiglu_oai)\\(",
        FfnMoeProbs | FfnMoeTopk => "^moe_route\\(",
        SsmIn | SsmOut | AttnQA | AttnKvA => "^matmul\\(",
        // The recurrence's own ops (Mamba-2's scan, a gated DeltaNet's delta rule).
        SsmState | SsmScan => "^(ssm_scan|delta_rule)\\(",
        SsmConv | SsmNorm | AttnGated => return None,
    })
}

pub(crate) fn stats_metrics(prefix: &str, s: &Option<ErrStats>, b: &Option<Budget>, m: &mut Metrics) {
    if let Some(s) = s {
        m.set(format!("{prefix}_rms_err"), s.rms_err);
        m.set(format!("{prefix}_rel_rms"), s.rel());
        m.set(format!("{prefix}_max_abs"), s.max_abs);
        m.set(format!("{prefix}_cosine"), s.cosine);
        m.set(format!("{prefix}_nonfinite"), s.nonfinite);
        if let Some(b) = b {
            m.set(format!("{prefix}_bound"), b.bound(s.rms_ref));
        }
    }
}

/// One report case per tap; the verdict is the comparison of `mode`.
pub fn cases(taps: &[TapDiff], device: &str, model: &str, mode: Mode) -> Vec<Case> {
    taps.iter()
        .map(|t| {
            let mut m = Metrics::new();
            m.set("tap", &t.name);
            m.set("layer", t.layer);
            m.set("kind", t.kind.name());
            stats_metrics("propagated", &t.propagated, &t.budget_propagated, &mut m);
            stats_metrics("isolated", &t.isolated, &t.budget_isolated, &mut m);
            if let Some(a) = t.amplification {
                m.set("propagated_amplification", a);
                m.set("propagated_magnified", t.magnified);
            }
            if let Some(e) = t.emulated {
                m.set("emulated_rel", e);
                if let Some(b) = t.emulated_bulk {
                    m.set("bulk_propagated_rel", b.device_rel);
                    m.set("bulk_emulated_rel", b.emulated_rel);
                    m.set("massive_values", b.massive);
                    m.set("bulk_error_spread", b.spread);
                }
                if let Some(u) = t.emulated_budget_use() {
                    m.set("emulated_budget_use", u);
                }
                // No ratio where the emulation has no error yet (no rounding before this tap).
                if let Some(p) = t.propagated.as_ref().filter(|_| e > 0.0) {
                    m.set("propagated_over_emulated", p.rel() / e);
                }
            }
            if let Some(ts) = t.terms {
                m.set("term_rms", ts.term_rms);
                m.set("output_rms", ts.output_rms);
                m.set("terms_grant", t.terms_grant);
            }
            if t.attention_grant > 0.0 {
                m.set("attention_grant", t.attention_grant);
            }
            if let Some(n) = t.id_mismatches {
                m.set("id_mismatches", n);
                m.set("routing_followed_at_near_ties", t.routing_followed);
            }
            let (gated, budget) = t.compared(mode);
            if let Some(s) = gated {
                m.set("max_abs", s.max_abs);
            }
            let id = format!("layer_diff(model={model},tap={},mode={})", t.name, mode.name());
            let (verdict, bound, margin, rule, message) = if t.missing {
                (Verdict::Unsupported, 0.0, 0.0, "missing".to_string(), Some("the device did not produce this tap".to_string()))
            } else if let Some(n) = t.id_mismatches {
                (
                    if n == 0 { Verdict::Pass } else { Verdict::Fail },
                    0.0,
                    -(n as f64),
                    "expert ids identical at every position (the oracle following the device at near ties)".into(),
                    if n > 0 {
                        Some(format!("{n} positions chose other experts"))
                    } else {
                        (t.routing_followed > 0).then(|| format!("the oracle followed the device's choice at {} near tie(s)", t.routing_followed))
                    },
                )
            } else {
                match (gated, budget) {
                    (Some(s), Some(b)) => {
                        let bound = b.bound(s.rms_ref);
                        let over = t.exceeds(mode) == Some(true);
                        let msg = if s.nonfinite > 0 {
                            Some(format!("{} values non-finite on one side only", s.nonfinite))
                        } else if over {
                            Some(format!("RMS error {:.3e} > bound {bound:.3e} (worst position {})", s.rms_err, s.worst_pos))
                        } else {
                            None
                        };
                        let rel = if mode == Mode::Propagated && t.magnified > 0.0 {
                            // Say what part of the budget magnification upstream and here granted.
                            format!("({:.3e} + {:.3e} magnified{})", b.rel - t.magnified, t.magnified, t.grant_source().map_or(String::new(), |w| format!(" or {w}")))
                        } else {
                            format!("{:.3e}", b.rel)
                        };
                        // The grant for cancelling terms sits in the absolute part, except in a
                        // propagated budget that carried it on as a relative grant.
                        let abs_holds_grant = (mode == Mode::Isolated || t.magnified == 0.0) && b.abs >= t.grant();
                        let abs = if t.grant() > 0.0 && abs_holds_grant {
                            // Say what part of the allowance the measured terms granted.
                            format!("({:.3e} + {:.3e} {})", b.abs - t.grant(), t.grant(), t.grant_source().unwrap_or_default())
                        } else {
                            format!("{:.3e}", b.abs)
                        };
                        (if over { Verdict::Fail } else { Verdict::Pass }, bound, bound - s.rms_err, format!("rms_err <= {rel}*rms_ref + {abs}"), msg)
                    }
                    (None, _) => (Verdict::Unsupported, 0.0, 0.0, "not compared".into(), Some(format!("no {mode:?} comparison for this tap"))),
                    (_, None) => (Verdict::Unsupported, 0.0, 0.0, "no budget".into(), Some(format!("no budget rule for tap kind `{}`", t.kind))),
                }
            };
            Case { id, device: device.to_string(), verdict, metrics: m, tolerance: Tolerance { rule, bound }, margin, message }
        })
        .collect()
}

/// The `emulated_departure` gate: at every tap where the declared arithmetic emulated has a
/// relative propagated error of at least [`crate::emulate::EMULATED_FLOOR`] over the tap's bulk
/// (its massive values left out, [`bulk_errors`]: their errors are samples of a few roundings,
/// and the worst-case budgets hold them), the device's error over the same bulk is at most
/// `factor` times it. The verdict names the first tap (execution order) past the factor —
/// where a change of numerics shows first — and the largest ratio. Taps whose bulk errors still
/// sit in fewer than [`crate::emulate::EMULATED_MIN_SPREAD`] elements are named, not held. None
/// when no tap qualifies (nothing to hold the device to). A tap with values non-finite on the
/// device's side only is past any factor (its ratio is infinite).
pub fn emulated_departure(taps: &[TapDiff], factor: f64, model: &str, device: &str) -> Option<Case> {
    emulated_departure_gate(taps, factor, model, device).map(|(case, _)| case)
}

/// [`emulated_departure`], with the tap it found the largest ratio at.
pub(crate) fn emulated_departure_gate(taps: &[TapDiff], factor: f64, model: &str, device: &str) -> Option<(Case, Departure)> {
    use crate::emulate::{EMULATED_FLOOR as FLOOR, EMULATED_MIN_SPREAD as MIN_SPREAD};
    let material: Vec<(&TapDiff, &ErrStats, BulkErrors)> = taps.iter().filter(|t| !t.missing).filter_map(|t| Some((t, t.propagated.as_ref()?, t.emulated_bulk.filter(|b| b.emulated_rel >= FLOOR)?))).collect();
    let (held, concentrated): (Vec<_>, Vec<_>) = material.into_iter().partition(|(_, _, b)| b.spread >= MIN_SPREAD);
    let ratios: Vec<(&TapDiff, f64)> = held.iter().map(|(t, p, b)| (*t, if p.nonfinite > 0 { f64::INFINITY } else { b.device_rel / b.emulated_rel })).collect();
    let over = |r: f64| r.is_nan() || r > factor;
    let (largest, largest_ratio) = *ratios.iter().max_by(|a, b| a.1.total_cmp(&b.1))?;
    let first = ratios.iter().find(|(_, r)| over(*r));
    let mut m = Metrics::new();
    m.set("taps_compared", ratios.len());
    m.set("largest_ratio", largest_ratio);
    m.set("largest_tap", &largest.name);
    m.set("factor", factor);
    m.set("taps_concentrated", concentrated.iter().map(|(t, _, _)| &t.name).collect::<Vec<_>>());
    m.set("massive_values", held.iter().map(|(_, _, b)| b.massive).sum::<usize>());
    if let Some((t, r)) = first {
        m.set("first_departure_tap", &t.name);
        m.set("first_departure_ratio", r);
    }
    let not_held = match concentrated.len() {
        0 => String::new(),
        n => format!("; {n} taps not held, their errors in under {MIN_SPREAD} elements (first {})", concentrated[0].0.name),
    };
    let message = match first {
        Some((t, r)) => format!(
            "{}: propagated error {r:.2}x that of the declared arithmetic emulated (allowed {factor}x); {} of {} taps past it, the largest {largest_ratio:.2}x at {}{not_held}",
            t.name,
            ratios.iter().filter(|(_, r)| over(*r)).count(),
            ratios.len(),
            largest.name
        ),
        None => format!("largest {largest_ratio:.2}x the emulated arithmetic's error, at {} ({} taps compared{not_held})", largest.name, ratios.len()),
    };
    let case = Case {
        id: format!("layer_diff(model={model},gate=emulated_departure)"),
        device: device.to_string(),
        verdict: if first.is_some() { Verdict::Fail } else { Verdict::Pass },
        metrics: m,
        tolerance: Tolerance { rule: format!("propagated rel. error <= {factor} x the declared arithmetic emulated's, over each tap's bulk (values under {MASSIVE} x its median magnitude), where that is >= {FLOOR:e} and the errors sit in >= {MIN_SPREAD} elements"), bound: factor },
        margin: factor - largest_ratio,
        message: Some(message),
    };
    Some((case, Departure { tap: largest.name.clone(), propagated_over_emulated: largest_ratio }))
}

/// Rows of the per-layer table: layer, l_out propagated error/bound, worst isolated op.
pub fn layer_table(taps: &[TapDiff]) -> Vec<Vec<String>> {
    let mut groups: Vec<(String, Vec<&TapDiff>)> = Vec::new();
    for t in taps {
        let key = t.layer.map_or_else(|| t.name.clone(), |i| i.to_string());
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(t),
            None => groups.push((key, vec![t])),
        }
    }
    groups
        .into_iter()
        .map(|(key, ts)| {
            let out = ts.iter().rev().find(|t| t.propagated.is_some()).copied();
            let worst = ts.iter().filter(|t| t.budget_use(Mode::Isolated).is_some()).max_by(|a, b| a.budget_use(Mode::Isolated).unwrap_or(0.0).total_cmp(&b.budget_use(Mode::Isolated).unwrap_or(0.0)));
            let fmt_rel = |t: Option<&TapDiff>, mode: Mode| -> String {
                let Some(t) = t else { return "-".into() };
                match t.compared(mode) {
                    (Some(s), Some(b)) => format!("{:.2e} / {:.2e}", s.rel(), b.bound(s.rms_ref) / s.rms_ref.max(f64::MIN_POSITIVE)),
                    _ => "-".into(),
                }
            };
            let missing = ts.iter().filter(|t| t.missing).count();
            let failed_iso = ts.iter().filter(|t| t.exceeds(Mode::Isolated) == Some(true)).count();
            let failed_prop = ts.iter().filter(|t| t.exceeds(Mode::Propagated) == Some(true)).count();
            vec![
                key,
                out.map_or("-".into(), |t| t.kind.name().to_string()),
                fmt_rel(out, Mode::Propagated),
                out.and_then(|t| t.emulated).map_or("-".into(), |e| format!("{e:.2e}")),
                worst.map_or("-".into(), |t| t.kind.name().to_string()),
                fmt_rel(worst.copied(), Mode::Isolated),
                format!("{failed_prop} / {failed_iso} / {missing}"),
            ]
        })
        .collect()
}

pub const LAYER_TABLE_COLUMNS: [&str; 7] = [
    "layer",
    "output tap",
    "its rel. RMS error / budget (propagated)",
    "its rel. RMS error with the declared arithmetic emulated",
    "worst op (isolated, by budget use)",
    "its rel. RMS error / budget (isolated)",
    "taps over budget propagated / isolated / missing",
];

/// Error by layer: relative RMS error of each tap kind (solid) and its budget (dashed), log scale,
/// a panel per tap kind on one shared scale (fifteen kinds on one plot are unreadable).
pub fn chart(taps: &[TapDiff], mode: Mode, title: &str) -> Chart {
    let mut kinds: Vec<TapKind> = Vec::new();
    for t in taps.iter().filter(|t| t.layer.is_some()) {
        if !kinds.contains(&t.kind) {
            kinds.push(t.kind);
        }
    }
    let mut series = Vec::new();
    for (ci, kind) in kinds.iter().enumerate() {
        let mut measured = Vec::new();
        let mut budget = Vec::new();
        for t in taps.iter().filter(|t| t.kind == *kind) {
            let (s, b) = t.compared(mode);
            if let (Some(layer), Some(s)) = (t.layer, s) {
                // A tap equal to the oracle to the last bit has no place on a log scale; it is
                // drawn at the smallest f32 relative step instead of vanishing.
                measured.push((layer as f64, s.rel().max(f32::EPSILON as f64 / 4.0)));
                if let Some(b) = b {
                    budget.push((layer as f64, b.bound(s.rms_ref) / s.rms_ref.max(f64::MIN_POSITIVE)));
                }
            }
        }
        if measured.is_empty() {
            continue;
        }
        series.push(Series { name: kind.to_string(), points: measured, colour: ci, dashed: false });
        if !budget.is_empty() {
            series.push(Series { name: format!("{kind} budget"), points: budget, colour: ci, dashed: true });
        }
    }
    // The residual stream's error with the declared arithmetic emulated: what an honest engine of
    // it accumulates.
    let emulated: Vec<(f64, f64)> = taps.iter().filter(|t| t.kind == TapKind::LOut).filter_map(|t| Some((t.layer? as f64, t.emulated?.max(f32::EPSILON as f64 / 4.0)))).collect();
    if mode == Mode::Propagated && !emulated.is_empty() {
        // Drawn in l_out's panel (panels group series by colour).
        let colour = kinds.iter().position(|k| *k == TapKind::LOut).unwrap_or(kinds.len());
        series.push(Series { name: "l_out, declared arithmetic emulated".into(), points: emulated, colour, dashed: false });
    }
    Chart { title: title.into(), x_label: "layer".into(), y_label: "relative RMS error".into(), log_y: true, series, band: None, markers: Vec::new(), panels: true }
}

/// Error over budget by layer, read at a glance: per mode, the worst tap of each layer (the
/// output head after the last layer), the budget as a dashed line at 1, and each layer's worst
/// tap over it marked and named.
pub fn budget_chart(taps: &[TapDiff], modes: &[Mode], title: &str) -> Chart {
    let last = taps.iter().filter_map(|t| t.layer).max().map_or(0, |l| l + 1);
    let x_of = |t: &TapDiff| t.layer.unwrap_or(if t.kind == TapKind::InpEmbd { 0 } else { last }) as f64;
    let mut series = Vec::new();
    let mut markers = Vec::new();
    for (ci, mode) in modes.iter().enumerate() {
        // Per layer, the worst tap and its use of its budget.
        let mut worst: std::collections::BTreeMap<u64, (f64, &str)> = std::collections::BTreeMap::new();
        for t in taps {
            let Some(u) = t.budget_use(*mode).filter(|u| u.is_finite()) else { continue };
            let e = worst.entry(x_of(t) as u64).or_insert((0.0, &t.name));
            if u.max(1e-6) > e.0 {
                *e = (u.max(1e-6), &t.name);
            }
        }
        for (x, (u, name)) in &worst {
            if *u > 1.0 {
                markers.push(reports::plot::Marker { x: *x as f64, y: *u, label: format!("{name} ({})", if *mode == Mode::Isolated { "isolated" } else { "propagated" }) });
            }
        }
        let worst: std::collections::BTreeMap<u64, f64> = worst.into_iter().map(|(x, (u, _))| (x, u)).collect();
        if !worst.is_empty() {
            let name = if *mode == Mode::Isolated { "isolated: each op's own error, worst tap of the layer" } else { "propagated: accumulated error, worst tap of the layer" };
            series.push(Series { name: name.into(), points: worst.into_iter().map(|(x, u)| (x as f64, u)).collect(), colour: ci, dashed: false });
        }
    }
    series.push(Series { name: "budget".into(), points: vec![(0.0, 1.0), (last as f64, 1.0)], colour: 3, dashed: true });
    Chart { title: title.into(), x_label: "layer (after the last: the output head)".into(), y_label: "error / budget".into(), log_y: true, series, band: None, markers, panels: false }
}
