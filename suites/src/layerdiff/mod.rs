//! The layer-diff gate: every tap (`oracle::taps::TapKind`, docs/DUMP_FORMAT.md's table) of a
//! device's forward pass compared with the oracle's, per tap, against a budget derived from the
//! device's declared arithmetic and depth.
//!
//! Two comparisons are made from one device run:
//! - **propagated**: the device's taps against the oracle's own forward pass. Error accumulates
//!   with depth, so the budget grows with the layer index.
//! - **isolated**: the oracle's interpreter is re-run with every tap *substituted* by the device's
//!   value (`oracle::Tap::substitute`), so each op of the oracle starts from exactly the inputs the
//!   device's op saw. The difference at a tap is then that op's own error, separated from what it
//!   inherited (the "shadow" comparison of PyTorch's Numeric Suite). This works for any device,
//!   including external engines that only wrote a dump.
//!
//! The first tap, in execution order, whose isolated error exceeds its budget is the
//! `first_divergence`: the guilty op.
//!
//! Where the device's declared arithmetic can be emulated on the oracle
//! ([`crate::emulate::EmulatedArithmetic`]), a third run gives each tap the propagated error an
//! honest engine of that arithmetic has, and one more gate, `emulated_departure`, holds the
//! device's propagated error to `factor` times it at every tap where it is material: a change of
//! numerics inside the worst-case budgets, located at the first tap it shows in.
//!
//! Budgets bound the RMS error of a tap over all its positions: `rms_err <= rel * rms_ref + abs`.
//! They are a stated model (docs/ACCURACY.md, "Layer-diff budgets"), not a proof: the kernel gate
//! proves per-element bounds op by op; this gate localizes drift in a whole model.

use devices::Arithmetic;
use oracle::generate::AnyModel;
use oracle::RecordingTap;
use reports::{Provenance, Report};
use oracle::taps::{TapKind, TapName};
use reports::{Case, Tolerance, Verdict};
use reports::findings::{Departure, Emulation, FirstDifference, FirstDivergence, Gate, RoutingSplit, TightestBudget};
use reports::Metrics;

mod budget;
mod stats;
mod routing;
mod terms;
mod render;
pub use budget::*;
pub use stats::*;
pub use routing::*;
pub use terms::*;
pub use render::*;
#[cfg(test)]
mod tests;
pub use reports::findings::Mode;

/// One tap's comparison.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TapDiff {
    pub name: String,
    pub layer: Option<usize>,
    pub kind: TapKind,
    /// The device did not produce this tap (reported as missing, never as a pass).
    pub missing: bool,
    /// Against the oracle's own forward pass.
    pub propagated: Option<ErrStats>,
    pub budget_propagated: Option<Budget>,
    /// Against the oracle re-run on the device's inputs (the op's own error).
    pub isolated: Option<ErrStats>,
    pub budget_isolated: Option<Budget>,
    /// Discrete taps (MoE expert ids): positions whose ids differ.
    pub id_mismatches: Option<usize>,
    /// MoE expert ids: tokens (over both runs) where the oracle followed the device's choice at a
    /// near tie.
    pub routing_followed: usize,
    /// How much this op magnified the relative error of the inputs the device gave it, measured
    /// by the oracle itself (see `carry_through_ops`); None where not measured.
    pub amplification: Option<f64>,
    /// What was added to the depth model's relative propagated budget for error magnified here
    /// and upstream (0: none; see `carry_through_ops`).
    pub magnified: f64,
    /// The first position whose own error is over its budget at that position
    /// ([`first_position_over`], isolated comparison where there is one).
    pub first_over: Option<usize>,
    /// Relative RMS error, against the oracle's own pass, of the oracle run with the device's
    /// declared arithmetic emulated ([`crate::emulate::EmulatedArithmetic`]): the propagated
    /// error an honest engine of that arithmetic has here. Reported beside the device's and held
    /// to it by the `emulated_departure` gate ([`emulated_departure`]); None where the arithmetic
    /// is not emulated.
    pub emulated: Option<f64>,
    /// The device's and the emulation's errors over the tap's bulk, its massive values left out
    /// ([`bulk_errors`]): what the `emulated_departure` gate compares. None where the arithmetic
    /// is not emulated or the device gave no such tap.
    pub emulated_bulk: Option<BulkErrors>,
    /// A matrix product's tap: the scale of its dot products' terms beside that of its outputs
    /// ([`TermScale`]), where measured; its budgets are widened where the terms cancel.
    pub terms: Option<TermScale>,
    /// The allowance for the terms' cancelling (0: none): absolute RMS on the isolated budget;
    /// on the propagated one, relative to the tap and carried downstream (`carry_through_ops`;
    /// absolute where there is no isolated run to carry it).
    pub terms_grant: f64,
    /// `attn_kqv`: the allowance for the declared roundings of its scores, keys, values and
    /// weights as measured on the inputs the device gave it ([`attention_allowances`]), beyond
    /// what the dims model's cache term allows (0: none). Held and carried as `terms_grant` is.
    pub attention_grant: f64,
}

impl TapDiff {
    /// Tap `tap` before anything is compared: no errors, budgets or grants.
    pub fn uncompared(tap: TapName) -> TapDiff {
        TapDiff {
            name: tap.to_string(),
            layer: tap.layer,
            kind: tap.kind,
            missing: false,
            propagated: None,
            budget_propagated: None,
            isolated: None,
            budget_isolated: None,
            id_mismatches: None,
            routing_followed: 0,
            amplification: None,
            magnified: 0.0,
            emulated: None,
            emulated_bulk: None,
            terms: None,
            terms_grant: 0.0,
            attention_grant: 0.0,
            first_over: None,
        }
    }

    /// What the measured terms granted this tap: cancelling products' terms and attention's
    /// scores (absolute RMS; see the two fields).
    pub fn grant(&self) -> f64 {
        self.terms_grant + self.attention_grant
    }

    /// What the grant is for, in a budget rule's words (`None` without one).
    fn grant_source(&self) -> Option<&'static str> {
        match (self.terms_grant > 0.0, self.attention_grant > 0.0) {
            (true, true) => Some("cancelling terms and attention's rounded scores"),
            (true, false) => Some("cancelling terms"),
            (false, true) => Some("attention's rounded scores"),
            (false, false) => None,
        }
    }

    /// The comparison of `mode` and its budget.
    pub fn compared(&self, mode: Mode) -> (Option<ErrStats>, Option<Budget>) {
        match mode {
            Mode::Propagated => (self.propagated, self.budget_propagated),
            Mode::Isolated => (self.isolated, self.budget_isolated),
        }
    }

    fn over(stats: &Option<ErrStats>, budget: &Option<Budget>) -> Option<bool> {
        let (s, b) = (stats.as_ref()?, budget.as_ref()?);
        Some(s.nonfinite > 0 || !(s.rms_err <= b.bound(s.rms_ref)))
    }

    /// Whether the comparison of `mode` exceeds its budget (None when it has none).
    pub fn exceeds(&self, mode: Mode) -> Option<bool> {
        if let Some(n) = self.id_mismatches {
            return Some(n > 0);
        }
        let (s, b) = self.compared(mode);
        Self::over(&s, &b)
    }

    /// How much of the propagated budget the declared arithmetic emulated uses here: its error
    /// over the bound (the headroom an honest engine of that arithmetic has is `1 - this`; above
    /// 1 the budget is below what the declaration itself produces). None where not emulated.
    pub fn emulated_budget_use(&self) -> Option<f64> {
        let (e, s, b) = (self.emulated?, self.propagated?, self.budget_propagated?);
        let bound = b.bound(s.rms_ref);
        (bound > 0.0).then(|| e * s.rms_ref / bound)
    }

    /// Measured RMS error over its bound (> 1 is over budget).
    pub fn budget_use(&self, mode: Mode) -> Option<f64> {
        let (s, b) = self.compared(mode);
        let (s, b) = (s?, b?);
        Some(s.rms_err / b.bound(s.rms_ref))
    }
}

/// A tap of the device's run that cannot be compared: wrong width or number of positions.
#[derive(Debug)]
pub struct ShapeError(pub String);

/// Compares every tap the oracle produced with the device's (`device`), against the oracle's own
/// run (`reference`) and, when given, the oracle re-run on the device's values (`isolated`).
pub fn diff(reference: &RecordingTap, isolated: Option<&RecordingTap>, device: &RecordingTap, arith: &Arithmetic, dims: &Dims) -> Result<Vec<TapDiff>, ShapeError> {
    diff_with_terms(reference, isolated, device, arith, dims, &Measured::default())
}

/// What the oracle measured on the device's inputs that widens a budget: the products' term
/// scales ([`term_scales`]) and attention's sensitivity to its declared roundings
/// ([`attention_allowances`]), each by tap.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    pub terms: std::collections::BTreeMap<String, TermScale>,
    pub attention: std::collections::BTreeMap<String, f64>,
}

/// [`diff`], with the products' term scales ([`term_scales`]): a product tap whose terms cancel
/// gets its op's relative budget over the excess of the terms' RMS over the outputs'
/// ([`cancellation_grant`]) as an absolute allowance on its isolated budget, and as a grant on
/// its propagated budget that the ops after it carry on as they carry magnified error
/// (`carry_through_ops`): the error an honest engine makes there flows downstream.
pub fn diff_with_terms(reference: &RecordingTap, isolated: Option<&RecordingTap>, device: &RecordingTap, arith: &Arithmetic, dims: &Dims, measured: &Measured) -> Result<Vec<TapDiff>, ShapeError> {
    let mut out = Vec::new();
    // The isolated re-run substitutes the device's values only at the taps the device gave. Where
    // it gave fewer (an engine that dumps layer outputs alone), a tap's isolated error holds the
    // errors of every op since the last tap it gave, so its budget adds theirs in quadrature
    // (independent roundings, as across layers). With every tap given this is zero.
    let mut since_given = Budget::default();
    for name in &reference.order {
        let (width, rdata) = &reference.tensors[name];
        // The oracle records taps of known kinds only; a name of none is its own defect, said so.
        let tap = TapName::parse(name).ok_or_else(|| ShapeError(format!("tap `{name}`: the oracle recorded a tap of no known kind")))?;
        let (layer, kind) = (tap.layer, tap.kind);
        let local = local_budget(kind, arith, dims);
        let mut t = TapDiff { budget_propagated: propagated_budget(kind, layer, arith, dims), budget_isolated: local.map(|b| b.and_independent(since_given)), ..TapDiff::uncompared(tap) };
        let Some((dw, ddata)) = device.tensors.get(name) else {
            if let Some(b) = local {
                since_given = since_given.and_independent(b);
            }
            t.missing = true;
            out.push(t);
            continue;
        };
        if local.is_some() {
            since_given = Budget::default();
        }
        if dw != width || ddata.len() != rdata.len() {
            return Err(ShapeError(format!(
                "tap `{name}`: the device gave {} positions x {dw}, the oracle {} positions x {width}",
                ddata.len() / dw.max(&1),
                rdata.len() / width.max(&1)
            )));
        }
        if kind == TapKind::FfnMoeTopk {
            // Expert ids are discrete: a position passes only if its chosen set is the same.
            // Compared against the isolated run (same router inputs) when there is one.
            let against = isolated.and_then(|i| i.tensors.get(name)).map(|(_, v)| v).unwrap_or(rdata);
            let mismatches = ddata
                .chunks(*width)
                .zip(against.chunks(*width))
                .filter(|(a, b)| {
                    let (mut a, mut b) = (a.to_vec(), b.to_vec());
                    a.sort_by(f32::total_cmp);
                    b.sort_by(f32::total_cmp);
                    a != b
                })
                .count();
            t.id_mismatches = Some(mismatches);
            out.push(t);
            continue;
        }
        t.propagated = Some(err_stats(ddata, rdata, *width));
        if let Some((_, idata)) = isolated.and_then(|i| i.tensors.get(name)) {
            t.isolated = Some(err_stats(ddata, idata, *width));
        }
        if let Some(scale) = measured.terms.get(name) {
            t.terms = Some(*scale);
            t.terms_grant = cancellation_grant(kind, scale, arith, dims).unwrap_or(0.0);
        }
        if let Some(allowance) = measured.attention.get(name) {
            // The measured allowance replaces the dims model's cache term where it is larger.
            let rms_ref = t.isolated.or(t.propagated).map_or(0.0, |s| s.rms_ref);
            t.attention_grant = (allowance - kv_cache_rel(kind, arith, dims) * rms_ref).max(0.0);
        }
        let grant = t.grant();
        if let Some(b) = &mut t.budget_isolated {
            b.abs += grant;
        }
        let against = isolated.and_then(|i| i.tensors.get(name)).map_or(rdata, |(_, v)| v);
        t.first_over = first_position_over(kind, ddata, against, *width, grant, arith, dims);
        out.push(t);
    }
    match isolated {
        Some(isolated) => carry_through_ops(&mut out, reference, isolated, dims),
        None => {
            for t in &mut out {
                let grant = t.grant();
                if let Some(b) = &mut t.budget_propagated {
                    b.abs += grant;
                }
            }
        }
    }
    Ok(out)
}

/// The first position (row) whose own error is over the op's budget at that position: the budget
/// of a run of that many positions (a recurrent state's carries one rounding of every earlier
/// position), plus the tap's measured grant. Where an error grows with every step (a state held
/// too coarsely), the position it crossed its bound; None where no row is over.
fn first_position_over(kind: TapKind, device: &[f32], reference: &[f32], width: usize, grant: f64, arith: &Arithmetic, dims: &Dims) -> Option<usize> {
    device.chunks(width.max(1)).zip(reference.chunks(width.max(1))).enumerate().find_map(|(p, (d, r))| {
        let s = err_stats(d, r, width);
        let b = local_budget(kind, arith, &Dims { n_pos: p + 1, ..*dims })?;
        (s.nonfinite > 0 || s.rms_err > b.bound(s.rms_ref) + grant).then_some(p)
    })
}

/// The taps the op behind tap `kind` of `layer` reads, by name (the stage order of
/// `oracle::model`), each the nearest one the oracle recorded (`has`).
fn tap_inputs(layer: Option<usize>, kind: TapKind, n_layer: usize, has: &dyn Fn(&str) -> bool) -> Vec<String> {
    use TapKind::*;
    let Some(i) = layer else {
        return match kind {
            ResultNorm if n_layer > 0 => vec![TapName::layer(n_layer - 1, LOut).to_string()],
            ResultOutput => vec![TapName::model(ResultNorm).to_string()],
            _ => Vec::new(),
        };
    };
    let first = |kinds: &[TapKind]| kinds.iter().map(|k| TapName::layer(i, *k).to_string()).find(|n| has(n));
    let residual = Some(if i == 0 { TapName::model(InpEmbd) } else { TapName::layer(i - 1, LOut) }.to_string());
    let names = match kind {
        AttnNorm => vec![residual],
        AttnQA | AttnKvA | AttnK | AttnV | AttnGate => vec![first(&[AttnNorm])],
        AttnQ => vec![first(&[AttnQA, AttnNorm])],
        AttnQNorm => vec![first(&[AttnQ])],
        AttnKNorm => vec![first(&[AttnK])],
        AttnQRope => vec![first(&[AttnQNorm, AttnQ])],
        AttnKRope => vec![first(&[AttnKNorm, AttnK])],
        // Latent attention expands its keys and values from the latent.
        AttnKqv => vec![first(&[AttnQRope, AttnQNorm, AttnQ]), first(&[AttnKRope, AttnKNorm, AttnK]), first(&[AttnV, AttnKvA])],
        AttnGated => vec![first(&[AttnKqv]), first(&[AttnGate])],
        AttnOut => vec![first(&[AttnGated, AttnKqv])],
        AttnPostNorm => vec![first(&[AttnOut])],
        FfnInp => vec![residual, first(&[AttnPostNorm, AttnOut, SsmOut])],
        FfnNorm => vec![first(&[FfnInp])],
        FfnGate | FfnUp | FfnMoeProbs => vec![first(&[FfnNorm])],
        FfnAct => vec![first(&[FfnGate]), first(&[FfnUp])],
        FfnOut => vec![first(&[FfnAct, FfnNorm])],
        FfnPostNorm => vec![first(&[FfnOut])],
        // A layer without an FFN (Mamba-2) adds its mixer's output to the residual.
        LOut if !has(&TapName::layer(i, FfnInp).to_string()) => vec![residual, first(&[SsmOut, AttnOut])],
        LOut => vec![first(&[FfnInp]), first(&[FfnPostNorm, FfnOut])],
        SsmIn => vec![first(&[AttnNorm])],
        SsmConv => vec![first(&[SsmIn])],
        SsmState => vec![first(&[SsmConv]), first(&[SsmIn])],
        SsmScan => vec![first(&[SsmState]), first(&[SsmConv])],
        SsmNorm => vec![first(&[SsmScan]), first(&[SsmIn])],
        SsmOut => vec![first(&[SsmNorm])],
        // Chosen from the router's scores, compared exactly: no op error to carry.
        FfnMoeTopk => Vec::new(),
        // Kinds that stand alone have no layer.
        InpEmbd | ResultNorm | ResultOutput => Vec::new(),
    };
    names.into_iter().flatten().filter(|n| has(n)).collect()
}

/// What two evaluations of one op by the oracle (f32 results) may differ by, relative, with no
/// difference in what they compute: a few roundings of the output.
const ORACLE_ROUNDING: f64 = 8.0 * (f32::EPSILON as f64 / 2.0);

/// The depth model of [`propagated_budget`] lets each op pass its inputs' relative error on
/// unmagnified. Some ops magnify it, by an amount that depends on the data: a gated activation
/// whose output is much smaller than its inputs' product (silu(g)·u over few, cancelling
/// channels), attention with peaked scores, a norm whose weights single out the channels where
/// the error sits. The oracle measures this itself: the isolated re-run evaluates each op on
/// the device's inputs, so `inherited = rel(isolated - reference)` (less the oracle's own output
/// rounding) is what the op made of the error the device's inputs carried, `input` the largest
/// relative error among those inputs, and `amplification = inherited / input`. What the op added
/// beyond passing that error on, `max(0, inherited - input)`, is granted on top of the depth
/// model, together with what was granted upstream carried through this op
/// (`amplification * the largest grant among its inputs`, so a residual add dilutes it):
/// `magnified = amplification * upstream + max(0, inherited - input)`, budget `depth + magnified`.
/// Both terms are the device's measured errors, not budgets, so the grant is as small as the
/// inputs' errors are, and an error that grows through ops that do not magnify it (what the
/// depth model is there to catch) is granted nothing. Taps are visited in execution order; one
/// whose inputs the device did not give keeps the depth model.
fn carry_through_ops(taps: &mut [TapDiff], reference: &RecordingTap, isolated: &RecordingTap, dims: &Dims) {
    let index: std::collections::HashMap<String, usize> = taps.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
    let has = |n: &str| reference.tensors.contains_key(n);
    for ti in 0..taps.len() {
        let t = &taps[ti];
        let (Some(depth), Some(stats), None) = (t.budget_propagated, t.propagated, t.id_mismatches) else { continue };
        // A product's own grant for its cancelling terms, relative to the tap: granted here, and
        // carried on like magnified error.
        let own = if t.grant() > 0.0 && stats.rms_ref > 0.0 { t.grant() / stats.rms_ref } else { 0.0 };
        let grant_own_only = |t: &mut TapDiff| {
            t.magnified = own;
            t.budget_propagated = Some(Budget { rel: depth.rel + own, abs: depth.abs });
        };
        let inputs = tap_inputs(t.layer, t.kind, dims.n_layer, &has);
        // (largest relative error, largest grant) over the inputs, all compared.
        let worst = inputs.iter().try_fold((0.0f64, 0.0f64), |(e, g), n| {
            let input = &taps[*index.get(n)?];
            let s = input.propagated?;
            // The residual add passes a branch's grant into the stream as its own amplification
            // measured it (diluted by the stream's size), and the stream carries it on: the error
            // it grants is in every later layer's input.
            (s.rms_ref > 0.0).then(|| (e.max(s.rel()), g.max(input.magnified)))
        });
        let (Some((input, upstream)), Some((width, r)), Some((_, iso))) = (worst.filter(|_| !inputs.is_empty()), reference.tensors.get(&t.name), isolated.tensors.get(&t.name)) else {
            grant_own_only(&mut taps[ti]);
            continue;
        };
        if input <= 0.0 {
            grant_own_only(&mut taps[ti]);
            continue;
        }
        let inherited = (err_stats(iso, r, *width).rel() - ORACLE_ROUNDING).max(0.0);
        let amplification = inherited / input;
        let t = &mut taps[ti];
        t.amplification = Some(amplification);
        t.magnified = amplification * upstream + (inherited - input).max(0.0) + own;
        t.budget_propagated = Some(Budget { rel: depth.rel + t.magnified, abs: depth.abs });
    }
}

/// The device's taps the oracle has no tap of that name for (a dump's misspelt or foreign
/// names, of no kind this tool knows: `RecordingTap::others`; a layer past the model's):
/// compared with nothing, so listed, never counted as passes.
pub fn unjudged(reference: &RecordingTap, device: &RecordingTap) -> Vec<String> {
    device.others.iter().chain(device.order.iter().filter(|n| !reference.tensors.contains_key(*n))).cloned().collect()
}

/// Everything one layer-diff run produced.
pub struct Outcome {
    pub taps: Vec<TapDiff>,
    pub report: Report,
    /// MoE tokens where the oracle followed the device's expert choice at a near tie.
    pub follows: Vec<RoutingFollow>,
    /// What the run found beyond its cases (written into `report`'s sections).
    pub findings: Findings,
}

/// What a layer-diff run found beyond its cases, typed: a command reads these, and
/// [`Findings::record`] hands them to the report, which makes its JSON of them.
#[derive(Clone, Debug, Default)]
pub struct Findings {
    /// The first tap over its budget, and the op behind it.
    pub first_divergence: Option<FirstDivergence>,
    /// The device's declared arithmetic run on the oracle (a run against the oracle only).
    pub emulation: Option<Emulation>,
    /// The device's taps compared with nothing ([`unjudged`]).
    pub unjudged_taps: Vec<String>,
    /// Those of no kind this tool knows.
    pub unknown_tap_kinds: Vec<String>,
    /// `--against`: what the comparison of two devices adds.
    pub against: Option<Against>,
}

/// What `--against` finds besides its taps' cases.
#[derive(Clone, Debug)]
pub struct Against {
    /// The `baseline_departure` gate (held only between two declarations of one arithmetic).
    pub baseline_departure: Gate,
    /// MoE: the first position where the two took other experts, each explained.
    pub routing_split: Option<RoutingSplit>,
    /// The first tap where the two differ at all (None: bit for bit equal at every tap).
    pub first_difference: Option<FirstDifference>,
    /// Each device's own first divergence from the oracle, by device.
    pub first_divergence_vs_oracle: Vec<(String, Option<FirstDivergence>)>,
    /// Where each device's comparison with the oracle followed its routing at a near tie.
    pub routing_followed: Vec<(String, Vec<RoutingFollow>)>,
}

impl Findings {
    /// Names device `from` as `to` (its label) wherever the findings name a device.
    pub fn relabel(&mut self, from: &str, to: &str) {
        let Some(a) = &mut self.against else { return };
        let rename = |d: &mut String| {
            if d == from {
                *d = to.to_string();
            }
        };
        a.first_divergence_vs_oracle.iter_mut().for_each(|(d, _)| rename(d));
        a.routing_followed.iter_mut().for_each(|(d, _)| rename(d));
        if let Some(split) = &mut a.routing_split {
            if let Some(ids) = split.choices.remove(from) {
                split.choices.insert(to.to_string(), ids);
            }
        }
    }

    /// Writes the findings into `report`'s sections (docs/REPORT_SCHEMA.md, layer-diff).
    pub fn record(&self, report: &mut Report) {
        report.set_section("first_divergence", &self.first_divergence);
        if let Some(e) = &self.emulation {
            report.set_section("emulated_arithmetic", e);
        }
        report.set_section("unjudged_taps", &self.unjudged_taps);
        report.set_section("unknown_tap_kinds", &self.unknown_tap_kinds);
        let Some(a) = &self.against else { return };
        if let Gate::NotApplicable(why) = &a.baseline_departure {
            report.set_section("baseline_departure", why);
        }
        report.set_section("routing_split", &a.routing_split);
        report.set_section("first_difference", &a.first_difference);
        report.set_section("first_divergence_vs_oracle", &a.first_divergence_vs_oracle.iter().map(|(d, f)| (d, f)).collect::<std::collections::BTreeMap<_, _>>());
        report.set_section("routing_followed", &a.routing_followed.iter().map(|(d, f)| (d, f)).collect::<std::collections::BTreeMap<_, _>>());
    }
}

/// One device's taps judged against the oracle: the oracle's own run and its re-run on the
/// device's values (each following the device's MoE routing at near ties), and every tap
/// compared with both, its budgets granted what the oracle measured (magnification by the ops,
/// [`carry_through_ops`]; cancelling terms, [`term_scales`] over the device's product inputs).
struct Judged<'a> {
    reference: Rerun<'a>,
    isolated: Rerun<'a>,
    taps: Vec<TapDiff>,
}

fn judge<'a>(oracle_model: &AnyModel, path: &std::path::Path, ids: &[u32], device_taps: &'a RecordingTap, arith: &'a Arithmetic, dims: &'a Dims) -> Result<Judged<'a>, String> {
    let rerun = |substitute_values: bool, run: &'static str| {
        let routing = if substitute_values {
            RoutingFollower::new(device_taps, Box::new(move |_| local_budget(TapKind::FfnMoeProbs, arith, dims)), run)
        } else {
            RoutingFollower::propagated(device_taps, arith, dims, run)
        };
        // The isolated run also samples each product's inputs (the device's values).
        Rerun { routing, substitute_values, recorded: RecordingTap::default(), products: substitute_values.then(ProductRows::default) }
    };
    let mut reference = rerun(false, "propagated");
    oracle_model.prefill_logits(ids, &mut reference).map_err(|e| e.to_string())?;
    let mut isolated = rerun(true, "isolated");
    oracle_model.prefill_logits(ids, &mut isolated).map_err(|e| e.to_string())?;
    let mut measured = Measured { attention: attention_allowances(oracle_model.spec(), device_taps, &isolated.recorded, arith, dims.n_pos), ..Measured::default() };
    if let Some(products) = &isolated.products {
        let scales = oracle::loader::open_weights(path).and_then(|(weights, _)| Ok((term_scales(products, weights.as_ref())?, moe_term_ratios(products, weights.as_ref())?)));
        let (dense, moe) = scales.map_err(|e| format!("the scale of the products' terms: {e}"))?;
        measured.terms = dense;
        // A MoE layer's output, in the units of its tap: its RMS in the isolated run, and the
        // terms' that many times it.
        for (tap, ratio) in moe {
            if let Some((_, v)) = isolated.recorded.tensors.get(&tap) {
                let rms = (v.iter().map(|x| *x as f64 * *x as f64).sum::<f64>() / v.len().max(1) as f64).sqrt();
                measured.terms.insert(tap, TermScale { term_rms: ratio * rms, output_rms: rms });
            }
        }
    }
    let taps = diff_with_terms(&reference.recorded, Some(&isolated.recorded), device_taps, arith, dims, &measured).map_err(|e| e.0)?;
    Ok(Judged { reference, isolated, taps })
}

/// Runs the oracle on `ids` (its own forward pass, then again fed the device's taps), compares
/// with `device_taps` and builds the report (cases gated by `mode`, first divergence, per-layer
/// table, error-by-layer charts).
/// Where a MoE device's expert choice differs from the oracle's only at a near tie (a device
/// within its error budget may pick either), both runs route that token as the device did
/// ([`follow_at_near_tie`], listed in the `routing_followed` section): otherwise everything
/// after it would be compared with a different expert's output.
/// `path` is the model's file: the emulation of the declared arithmetic reads its matrix types
/// there (and, for fixed point, loads its weights anew).
/// `emulation_factor` is the `emulated_departure` gate's factor ([`emulated_departure`]).
#[allow(clippy::too_many_arguments)]
pub fn run(oracle_model: &AnyModel, path: &std::path::Path, ids: &[u32], device_taps: &RecordingTap, arith: &Arithmetic, mode: Mode, emulation_factor: f64, model: &str, device: &str) -> Result<Outcome, String> {
    arith.check().map_err(|e| format!("{device}: declared arithmetic: {e}"))?;
    let dims = Dims::of(oracle_model.spec(), ids.len());
    let Judged { reference, isolated: sub, mut taps } = judge(oracle_model, path, ids, device_taps, arith, &dims)?;
    // Once more with the declared arithmetic emulated, where it can be: each tap's propagated
    // error an honest engine of that arithmetic has, beside the device's.
    let mut departure_case = None;
    let emulation = match crate::emulate::EmulatedArithmetic::new(arith, path).and_then(|emu| {
        let own = emu.load_model().map_err(|e| format!("the emulated weights could not be loaded: {e}"))?;
        Ok((emu, own))
    }) {
        Ok((emu, own)) => {
            let mut run = Following { emu: emu.recording(), routing: RoutingFollower::propagated(device_taps, arith, &dims, "emulated") };
            own.as_ref().unwrap_or(oracle_model).prefill_logits(ids, &mut run).map_err(|e| e.to_string())?;
            let recorded = run.emu.recorded.unwrap_or_default();
            for t in &mut taps {
                if let (Some((w, e)), Some((_, r))) = (recorded.tensors.get(&t.name), reference.recorded.tensors.get(&t.name)) {
                    t.emulated = Some(err_stats(e, r, *w).rel());
                    t.emulated_bulk = match device_taps.tensors.get(&t.name) {
                        Some((_, d)) if d.len() == r.len() && e.len() == r.len() => Some(bulk_errors(d, e, r)),
                        _ => None,
                    };
                }
            }
            // Where the device leaves the emulated line most: where to look when it leaves it at
            // all. Among the taps the gate compares; where it compares none, among those the
            // emulation has rounded anything before.
            let gate = emulated_departure_gate(&taps, emulation_factor, model, device);
            let largest = match &gate {
                Some((_, d)) => Some(d.clone()),
                None => taps.iter().filter_map(|t| Some((t, t.propagated.as_ref()?.rel() / t.emulated.filter(|e| *e > 0.0)?))).max_by(|a, b| a.1.total_cmp(&b.1)).map(|(t, r)| Departure { tap: t.name.clone(), propagated_over_emulated: r }),
            };
            // The tap where the emulated arithmetic comes closest to its own propagated budget:
            // how much room an honest engine of this arithmetic has (a use near or above 1 is a
            // budget too tight for the declaration, before any engine meets it).
            let tightest = taps.iter().filter_map(|t| Some((t, t.emulated_budget_use()?))).max_by(|a, b| a.1.total_cmp(&b.1)).map(|(t, u)| TightestBudget { tap: t.name.clone(), budget_use: u });
            let held = match gate {
                Some((case, _)) => {
                    departure_case = Some(case);
                    Gate::Held
                }
                None => Gate::NotApplicable(format!(
                    "not applicable: the emulated error over a tap's bulk reaches {:e} at no tap whose errors are spread over {} elements (the declared roundings barely touch this model)",
                    crate::emulate::EMULATED_FLOOR,
                    crate::emulate::EMULATED_MIN_SPREAD
                )),
            };
            Emulation::Applied { largest_departure: largest, tightest_budget: tightest, factor: emulation_factor, floor: crate::emulate::EMULATED_FLOOR, min_spread: crate::emulate::EMULATED_MIN_SPREAD, gate: held }
        }
        Err(why) => Emulation::NotApplicable(why),
    };
    let follows: Vec<RoutingFollow> = reference.routing.follows.into_iter().chain(sub.routing.follows).collect();
    for t in &mut taps {
        t.routing_followed = follows.iter().filter(|f| f.tap == t.name).count();
    }
    let mut report = report(&taps, mode, model, device, ids, None, departure_case);
    let findings = Findings { first_divergence: first_divergence_finding(&taps), emulation: Some(emulation), unjudged_taps: unjudged(&reference.recorded, device_taps), unknown_tap_kinds: device_taps.others.clone(), against: None };
    findings.record(&mut report);
    report.set_section("routing_followed", &follows);
    report.set_section("arithmetic", arith);
    Ok(Outcome { taps, report, follows, findings })
}

/// `--against`: device A compared with device B tap by tap. Each may be its own propagated
/// budget away from the oracle, so the budget is the sum of both, each as a comparison with the
/// oracle grants it (magnification measured by the oracle's re-run on that device's values,
/// cancelling terms over that device's product inputs: [`judge`]); the oracle's distance to each
/// stays in the report as the reference column.
/// The relative error under which two engines' errors against the oracle are not told apart by
/// the `baseline_departure` gate (a few f32 roundings of an exact computation).
pub const BASELINE_FLOOR: f64 = 1e-6;

/// The `baseline_departure` gate of `--against`: at every tap, the candidate's propagated
/// relative error against the oracle is at most `factor` times the baseline's (or the floor,
/// [`BASELINE_FLOOR`]); the first tap in execution order past it fails the case, naming it. A
/// candidate that departs where its own budget would still allow it (a 1% error in an engine
/// whose baseline is exact) goes red here. None when no tap has both errors.
pub fn baseline_departure(candidate: &[TapDiff], baseline: &[TapDiff], factor: f64, model: &str, device: &str) -> Option<Case> {
    let mut compared = 0usize;
    let (mut worst, mut first): (Option<(&str, f64)>, Option<(&str, f64, f64, f64)>) = (None, None);
    for c in candidate {
        let (Some(ce), Some(be)) = (c.propagated, baseline.iter().find(|t| t.name == c.name).and_then(|t| t.propagated)) else { continue };
        let (cr, br) = (ce.rel(), be.rel());
        if !(cr.is_finite() && br.is_finite()) {
            continue;
        }
        compared += 1;
        let ratio = cr / br.max(BASELINE_FLOOR);
        if worst.is_none_or(|(_, r)| ratio > r) {
            worst = Some((&c.name, ratio));
        }
        if ratio > factor && first.is_none() {
            first = Some((&c.name, ratio, cr, br));
        }
    }
    let (worst_tap, worst_ratio) = worst?;
    let mut m = Metrics::new().with("taps_compared", compared).with("worst_tap", worst_tap).with("worst_error_over_bound", worst_ratio / factor).with("candidate_over_baseline", worst_ratio);
    let message = first.map(|(tap, r, cr, br)| {
        m.set("first_departure", tap);
        format!("{tap}: the candidate's propagated error {cr:.3e} is {r:.1}x the baseline's {br:.3e}")
    });
    Some(Case {
        id: format!("layer_diff(model={model},gate=baseline_departure)"),
        device: device.to_string(),
        verdict: if first.is_some() { Verdict::Fail } else { Verdict::Pass },
        metrics: m,
        tolerance: Tolerance { rule: format!("candidate's propagated rel. error <= {factor} x the baseline's at every tap (floor {BASELINE_FLOOR:e})"), bound: factor },
        margin: factor - worst_ratio,
        message,
    })
}

pub fn run_against(oracle_model: &AnyModel, path: &std::path::Path, ids: &[u32], a: (&str, &RecordingTap, &Arithmetic), b: (&str, &RecordingTap, &Arithmetic), model: &str, factor: f64) -> Result<Outcome, String> {
    for (device, _, arith) in [&a, &b] {
        arith.check().map_err(|e| format!("{device}: declared arithmetic: {e}"))?;
    }
    let dims = Dims::of(oracle_model.spec(), ids.len());
    let vs_oracle_a = judge(oracle_model, path, ids, a.1, a.2, &dims).map_err(|e| format!("{}: {e}", a.0))?;
    let vs_oracle_b = judge(oracle_model, path, ids, b.1, b.2, &dims).map_err(|e| format!("{}: {e}", b.0))?;
    let mut taps = diff(b.1, None, a.1, a.2, &dims).map_err(|e| e.0)?;
    // Tap `name` in each device's comparison with the oracle.
    let own = |name: &str| [&vs_oracle_a.taps, &vs_oracle_b.taps].map(|v| v.iter().find(|t| t.name == name));
    for t in &mut taps {
        let [ta, tb] = own(&t.name);
        t.budget_propagated = match (ta.and_then(|t| t.budget_propagated), tb.and_then(|t| t.budget_propagated)) {
            (Some(x), Some(y)) => Some(Budget { rel: x.rel + y.rel, abs: x.abs + y.abs }),
            _ => None,
        };
        t.budget_isolated = None;
        // What of the budget the two comparisons with the oracle granted, for the rule's text.
        t.magnified = ta.map_or(0.0, |t| t.magnified) + tb.map_or(0.0, |t| t.magnified);
        t.terms_grant = ta.map_or(0.0, |t| t.terms_grant) + tb.map_or(0.0, |t| t.terms_grant);
        t.attention_grant = ta.map_or(0.0, |t| t.attention_grant) + tb.map_or(0.0, |t| t.attention_grant);
        t.terms = ta.and_then(|t| t.terms);
    }
    // Where the two took other experts for a token and each choice is one its own comparison with
    // the oracle followed at a near tie (or the oracle's own), both are honest, and from there on
    // they compute different things: that token's expert mix and, through attention, every later
    // position of the later layers. From that tap on, each tap is held to the two devices' own
    // comparisons with the oracle routed as each was (the worse of the two, against its own
    // budget). An expert choice that neither comparison explains fails as before.
    let split = routing_split(&mut taps, (a.1, &vs_oracle_a.reference.recorded), (b.1, &vs_oracle_b.reference.recorded));
    let mut judged_alone = std::collections::BTreeMap::new();
    if let Some((at, _, _)) = &split {
        for t in taps.iter_mut().skip(*at + 1) {
            let [ta, tb] = own(&t.name);
            if t.id_mismatches.is_some() {
                t.id_mismatches = Some(ta.and_then(|t| t.id_mismatches).unwrap_or(0) + tb.and_then(|t| t.id_mismatches).unwrap_or(0));
                continue;
            }
            let worse = [(a.0, ta), (b.0, tb)].into_iter().filter_map(|(d, t)| Some((d, t?.budget_use(Mode::Propagated)?, t?))).max_by(|x, y| x.1.total_cmp(&y.1));
            if let Some((device, _, own)) = worse {
                (t.propagated, t.budget_propagated, t.magnified, t.terms_grant, t.attention_grant) = (own.propagated, own.budget_propagated, own.magnified, own.terms_grant, own.attention_grant);
                judged_alone.insert(t.name.clone(), device);
            }
        }
    }
    // Two builds of one arithmetic: the candidate's error may not leave the baseline's. Two
    // declarations apart, a coarser candidate's larger error is its declaration's (each is held
    // to its own emulation by `layer-diff --device D`), so the gate does not apply.
    let same_arithmetic = a.2 == b.2;
    let departure = if same_arithmetic { baseline_departure(&vs_oracle_a.taps, &vs_oracle_b.taps, factor, model, &format!("{} vs {}", a.0, b.0)) } else { None };
    let mut report = report(&taps, Mode::Propagated, model, &format!("{} vs {}", a.0, b.0), ids, Some(b.0), departure);
    for c in &mut report.cases {
        let name = c.metrics.str("tap").unwrap_or("").to_string();
        for (device, t) in [a.0, b.0].into_iter().zip(own(&name)) {
            c.metrics.set(format!("oracle_vs_{device}_rel_rms"), t.and_then(|t| t.propagated).map(|s| s.rel()));
        }
        if let Some(n) = taps.iter().find(|t| t.name == name).map(|t| t.routing_followed).filter(|n| *n > 0 && c.metrics.contains_key("routing_followed_at_near_ties")) {
            c.message = Some(format!("the two chose other experts at {n} position(s), each as the oracle routed as it was at a near tie"));
        }
        if let Some(device) = judged_alone.get(&name) {
            c.metrics.set("judged_against_the_oracle_routed_as", device);
            c.tolerance.rule = format!("{} (past the routing split: {device} against the oracle routed as it was, the worse of the two)", c.tolerance.rule);
        }
    }
    let reference = &vs_oracle_a.reference.recorded;
    let mut names = unjudged(reference, a.1);
    names.extend(unjudged(reference, b.1).into_iter().filter(|n| !a.1.tensors.contains_key(n) && !a.1.others.contains(n)));
    let others: Vec<String> = a.1.others.iter().chain(b.1.others.iter().filter(|n| !a.1.others.contains(n))).cloned().collect();
    // Two builds of one engine often agree bit for bit up to a change: the first tap where they
    // differ at all is worth knowing even when the difference is inside the budget.
    let first_difference = taps.iter().find(|t| t.propagated.is_some_and(|s| s.rms_err > 0.0 || s.nonfinite > 0) || t.id_mismatches.is_some_and(|n| n > 0) || t.routing_followed > 0);
    let against = Against {
        baseline_departure: if same_arithmetic { Gate::Held } else { Gate::NotApplicable("not applied: the two declare different arithmetic (each is held to its own emulation by `layer-diff --device D`)".into()) },
        routing_split: split.map(|(at, position, choices)| RoutingSplit { tap: taps[at].name.clone(), position, choices: [(a.0.to_string(), choices.0), (b.0.to_string(), choices.1)].into_iter().collect() }),
        first_difference: first_difference.map(|t| FirstDifference { tap: t.name.clone(), rms_err: t.propagated.map(|s| s.rms_err), worst_position: t.propagated.map(|s| s.worst_pos) }),
        // Each device's own first divergence from the oracle (isolated where it can be), for the
        // reader: the pair's gate holds their difference to the sum of two propagated budgets,
        // which a tap that one device computes wrong can stay inside.
        first_divergence_vs_oracle: vec![(a.0.to_string(), first_divergence_finding(&vs_oracle_a.taps)), (b.0.to_string(), first_divergence_finding(&vs_oracle_b.taps))],
        // Where each comparison with the oracle followed its device's MoE routing at a near tie,
        // by device (the budgets above rest on those runs).
        routing_followed: [(a.0, vs_oracle_a), (b.0, vs_oracle_b)].into_iter().map(|(device, j)| (device.to_string(), j.reference.routing.follows.into_iter().chain(j.isolated.routing.follows).collect())).collect(),
    };
    let findings = Findings { first_divergence: first_divergence_finding(&taps), emulation: None, unjudged_taps: names, unknown_tap_kinds: others, against: Some(against) };
    findings.record(&mut report);
    report.set_section("arithmetic", &std::collections::BTreeMap::from([(a.0, a.2), (b.0, b.2)]));
    Ok(Outcome { taps, report, follows: Vec::new(), findings })
}

/// `--against`'s expert choices: at each `ffn_moe_topk` tap, the positions where device A (`a`:
/// its taps, and the oracle's run that followed it) and device B took other experts count as
/// explained when each device's choice is what the oracle took routing as that device did (its
/// own choice or a near tie it followed); the tap's `id_mismatches` keeps the rest and
/// `routing_followed` counts the explained ones. The first explained split: (index of its tap,
/// position, the two choices).
fn routing_split(taps: &mut [TapDiff], a: (&RecordingTap, &RecordingTap), b: (&RecordingTap, &RecordingTap)) -> Option<(usize, usize, (Vec<usize>, Vec<usize>))> {
    let mut first = None;
    for (i, t) in taps.iter_mut().enumerate() {
        if t.kind != TapKind::FfnMoeTopk || t.id_mismatches.is_none_or(|n| n == 0) {
            continue;
        }
        let rows = |r: &RecordingTap| r.tensors.get(&t.name).map(|(w, v)| v.chunks((*w).max(1)).map(|row| {
            let mut ids: Vec<usize> = row.iter().map(|x| *x as usize).collect();
            ids.sort_unstable();
            ids
        }).collect::<Vec<_>>());
        let (Some(da), Some(oa), Some(db), Some(ob)) = (rows(a.0), rows(a.1), rows(b.0), rows(b.1)) else { continue };
        let (mut unexplained, mut explained) = (0, 0);
        for (p, (((da, oa), db), ob)) in da.iter().zip(&oa).zip(&db).zip(&ob).enumerate() {
            if da == db {
                continue;
            }
            if da == oa && db == ob {
                explained += 1;
                first.get_or_insert((i, p, (da.clone(), db.clone())));
            } else {
                unexplained += 1;
            }
        }
        t.id_mismatches = Some(unexplained);
        t.routing_followed = explained;
    }
    first
}

/// The report of a run: one case per tap, then `departure` (the `emulated_departure` gate).
fn report(taps: &[TapDiff], mode: Mode, model: &str, device: &str, ids: &[u32], against: Option<&str>, departure: Option<Case>) -> Report {
    let mut cases = cases(taps, device, model, mode);
    cases.extend(departure);
    let mut report = Report::new("layer-diff", Provenance::collect(rayon::current_num_threads()), cases);
    report.set_section("mode", &mode);
    report.set_section("model", &model);
    report.set_section("prompt_ids", &ids);
    if let Some(b) = against {
        report.set_section("against", &b);
    }
    report.add_table("layer_table", "Per layer", &LAYER_TABLE_COLUMNS, layer_table(taps));
    let modes: &[Mode] = if against.is_none() { &[Mode::Isolated, Mode::Propagated] } else { &[Mode::Propagated] };
    report.add_chart("budget_use_by_layer", budget_chart(taps, modes, &format!("{device} on {model}: error over budget by layer")));
    report.add_chart("error_by_layer_propagated", chart(taps, Mode::Propagated, &format!("{device} on {model}: propagated error by layer")));
    if against.is_none() {
        report.add_chart("error_by_layer_isolated", chart(taps, Mode::Isolated, &format!("{device} on {model}: each op's own error (isolated)")));
    }
    report
}
