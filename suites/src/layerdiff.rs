//! The layer-diff gate: every tap (design.md §4) of a device's forward pass compared with the
//! oracle's, per tap, against a budget derived from the device's declared arithmetic and depth.
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
use oracle::{ModelSpec, RecordingTap, Tap};
use reports::{Provenance, Report};
use reports::plot::{Chart, Series};
use reports::{Case, Tolerance, Verdict};
use serde_json::{json, Map, Value};

/// Safety factor on the statistical √K rounding-error rule (Higham, "Accuracy and Stability",
/// §3.8): rounding errors of a length-K reduction typically grow like u·√K; the factor covers
/// the spread of that estimate.
pub const C_STAT: f64 = 4.0;
/// An op's output error may exceed its input's relative error by the conditioning of the
/// weights it applies; the budget allows a factor of this size (see ACCURACY.md).
pub const C_COND: f64 = 2.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Propagated,
    Isolated,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "propagated" => Ok(Mode::Propagated),
            "isolated" => Ok(Mode::Isolated),
            o => Err(format!("mode `{o}`: expected propagated or isolated")),
        }
    }
}

/// Allowed RMS error of a tap: `rel * rms(reference) + abs`.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Budget {
    pub rel: f64,
    pub abs: f64,
}

impl Budget {
    pub fn bound(&self, rms_ref: f64) -> f64 {
        self.rel * rms_ref + self.abs
    }

    /// This budget and `other` for independent errors: added in quadrature, term by term.
    pub fn and_independent(self, other: Budget) -> Budget {
        Budget { rel: self.rel.hypot(other.rel), abs: self.abs.hypot(other.abs) }
    }
}

/// Model dimensions the budgets read.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub d: usize,
    pub head_dim: usize,
    pub q_dim: usize,
    pub n_ff: usize,
    pub n_pos: usize,
    pub n_layer: usize,
    /// [`rope_angle_rms`] of the model's RoPE over these positions (the largest of its RoPEs').
    pub rope_angle_rms: f64,
    /// The factor the embeddings are multiplied by before the first layer (1: none).
    pub embd_scale: f64,
    /// The gated FFN's activation is GELU (what `Arithmetic::gelu_half_table` applies to).
    pub gelu: bool,
}

impl Dims {
    pub fn of(spec: &ModelSpec, n_pos: usize) -> Dims {
        let n_ff = spec.moe.as_ref().map_or(spec.n_ff, |m| m.expert_ffn.max(m.shared_ffn.unwrap_or(0)));
        let rope_angle_rms = spec.ropes().into_iter().map(|r| rope_angle_rms(r, n_pos)).fold(0.0, f64::max);
        Dims { d: spec.n_embd, head_dim: spec.head_dim, q_dim: spec.n_head * spec.head_dim, n_ff, n_pos, n_layer: spec.n_layer, rope_angle_rms, embd_scale: spec.embd_scale.unwrap_or(1.0), gelu: spec.activation == oracle::spec::Activation::GeluTanh }
    }
}

/// The RMS, over the rotated pairs and the positions 0..n_pos, of a RoPE angle p·w_i
/// (w_i = theta^(-2i/n_rot) divided by the pair's frequency factor; a context scaling only
/// lowers it and is left out), each weighted by the i + 1 roundings that forming w_i by repeated
/// multiplication (as ggml does) puts into it. An engine that holds the angle in its storage
/// format rotates by an angle that far off times u: at the highest frequencies the angle is the
/// position itself, so the error grows with the context (u * 8000 = 5e-4 in f32 at position
/// 8,000), and the oracle, which forms angles in f64, does not share it.
pub fn rope_angle_rms(rope: &oracle::spec::RopeSpec, n_pos: usize) -> f64 {
    let pairs = rope.n_rot / 2;
    if pairs == 0 || n_pos == 0 || !(rope.theta.is_finite() && rope.theta > 0.0) {
        return 0.0;
    }
    let n = n_pos as f64;
    let mean_p2 = (n - 1.0) * (2.0 * n - 1.0) / 6.0;
    // w_i is pair i's angle at position 1.
    let mean_w2 = (0..pairs).map(|i| oracle::ops::rope_base_angle(rope, 1, i).powi(2) * (i + 1) as f64).sum::<f64>() / pairs as f64;
    let rms = (mean_p2 * mean_w2).sqrt();
    if rms.is_finite() { rms } else { 0.0 }
}

/// `blk.{i}.{kind}` -> (Some(i), kind); other names -> (None, name).
pub fn split_tap(name: &str) -> (Option<usize>, &str) {
    if let Some(rest) = name.strip_prefix("blk.") {
        if let Some((i, kind)) = rest.split_once('.') {
            if let Ok(i) = i.parse() {
                return (Some(i), kind);
            }
        }
    }
    (None, name)
}

/// What produces a tap, for its budget: a reduction of length `k`, whether its input was a
/// matrix product's (quantized on Q8-activation devices), whether it uses exp/sin/sqrt.
struct OpShape {
    k: usize,
    matmul: bool,
    transcendental: bool,
}

fn op_shape(kind: &str, d: &Dims) -> Option<OpShape> {
    let s = |k, matmul, transcendental| Some(OpShape { k, matmul, transcendental });
    match kind {
        "inp_embd" => s(1, false, false),
        "attn_norm" | "ffn_norm" | "result_norm" | "attn_post_norm" | "ffn_post_norm" => s(d.d, false, true),
        "attn_q_norm" | "attn_k_norm" => s(d.head_dim, false, true),
        "attn_q" | "attn_k" | "attn_v" | "ffn_gate" | "ffn_up" | "result_output" => s(d.d, true, false),
        "attn_out" => s(d.q_dim, true, false),
        "ffn_out" => s(d.n_ff, true, false),
        "attn_q_rope" | "attn_k_rope" => s(2, false, true),
        "attn_kqv" => s(d.n_pos.max(d.head_dim), false, true),
        "ffn_inp" | "l_out" => s(2, false, false),
        "ffn_act" => s(2, false, true),
        "ffn_moe_probs" => s(d.d, true, true),
        _ => None,
    }
}

/// The budget of one op's own error (isolated comparison), from the device's arithmetic.
pub fn local_budget(kind: &str, a: &Arithmetic, d: &Dims) -> Option<Budget> {
    let op = op_shape(kind, d)?;
    let k = op.k as f64;
    let cache = kv_cache_rel(kind, a, d);
    if let Some(fp) = &a.fixed {
        // Integer device: results are rounded to Q(act_frac); weights carry a Q(weight_frac)
        // rounding each (relative 2^-wf, summed over K like any rounding); norm scales Q(norm_frac);
        // exp/sigmoid approximations add their absolute error per term.
        let q = (-(fp.act_frac as f64)).exp2();
        let mut rel = C_STAT * (-(fp.norm_frac as f64)).exp2();
        let mut abs = C_STAT * q;
        if op.matmul {
            rel += C_STAT * (-(fp.weight_frac as f64)).exp2() * k.sqrt();
            abs += C_STAT * q * k.sqrt() / 2.0;
            if let Some(g) = fp.int4_group {
                // Symmetric 4-bit groups: RMS rounding error of a group <= sqrt(G) * step/2
                // relative to the group's largest value, step = max/7.
                rel += C_COND * (g as f64).sqrt() / 14.0;
            }
        }
        if op.transcendental {
            rel += C_STAT * fp.exp_abs * k.sqrt();
            abs += C_STAT * fp.exp_abs;
        }
        if kind == "inp_embd" {
            // The table is held on the activation grid and scaled after the lookup (Gemma's
            // sqrt(n_embd)): its rounding, half a step, grows by the scale.
            abs += C_STAT * q * (d.embd_scale - 1.0).max(0.0) / 2.0;
        }
        return Some(Budget { rel: rel + cache, abs });
    }
    let (us, ua) = (a.storage.unit_roundoff(), a.accumulate.unit_roundoff());
    let mut rel = C_STAT * (us + ua * k.sqrt());
    if op.transcendental {
        rel += C_STAT * a.transcendental_ulps * us;
    }
    if matches!(kind, "attn_q_rope" | "attn_k_rope") {
        // The angle held in the storage format: a rotation by an angle off by u times it.
        rel += C_STAT * us * d.rope_angle_rms;
    }
    if kind == "ffn_act" && d.gelu && a.gelu_half_table {
        // GELU from an f16 table: the input rounded to f16, its relative error passed on by
        // x·gelu'(x)/gelu(x) (1 to 1.6 where the values are large: above -1 the activation's
        // magnitudes dominate the RMS), and the result rounded to f16.
        rel += C_STAT * devices::NumFormat::F16.unit_roundoff() * (1.6 + 1.0);
    }
    if op.matmul {
        // Q8_0 activations: each element rounds to a step of max|block|/127, so the RMS error of
        // a block is at most max/254 and its RMS value at least max/sqrt(B); inputs rounded to a
        // matrix's 16-bit format err by at most its unit roundoff (bf16's, the coarser). The
        // widest declared: a tap does not say which matrices its products met.
        let q8 = a.widest_q8_block().map_or(0.0, |b| (b as f64).sqrt() / 254.0);
        let half = if a.activation_half_rounding { devices::NumFormat::BF16.unit_roundoff() } else { 0.0 };
        rel += C_COND * q8.max(half);
    }
    // Values near zero: allow one rounding of the storage format at unit scale per element.
    Some(Budget { rel: rel + cache, abs: us * 1e-3 })
}

/// The attention output's share of a cache that rounds keys and values (`kv_cache` coarser than
/// the storage format, e.g. an f16 cache behind f32 activations; the values' own format where
/// `kv_cache_v` declares one): each cached value carries one rounding of relative size u
/// (`KvFormat::rel_rounding`: a block format's relative to its block's RMS value, at its
/// worst). A score is a dot product over `head_dim` rounded keys, so its error grows like
/// u_k·√head_dim (the statistical rule of the accumulations above); the output, a
/// softmax-weighted sum of rounded values, adds one u_v. Keys in a block format meet the query
/// as Q8_0 blocks, one more rounding of each score's terms. Zero for every other tap and when the
/// cache holds what storage holds. Under a block format this allows what the worst block would
/// cost, far above what a Q8_0 cache costs a model's typical values: there the emulated
/// arithmetic's error (`emulated_departure`) holds the engine to what an honest one of its cache
/// gets.
fn kv_cache_rel(kind: &str, a: &Arithmetic, d: &Dims) -> f64 {
    if kind != "attn_kqv" {
        return 0.0;
    }
    let coarser = |f: Option<devices::KvFormat>| f.filter(|f| f.rel_rounding() > a.storage.unit_roundoff());
    let kv = a.kv_types();
    let sqrt_hd = (d.head_dim as f64).sqrt();
    let keys = coarser(kv.k).map_or(0.0, |f| {
        let query = f.block().map_or(0.0, |_| devices::KvFormat::Q8_0.rel_rounding());
        (f.rel_rounding() + query) * sqrt_hd
    });
    let values = coarser(kv.v).map_or(0.0, |f| f.rel_rounding());
    C_STAT * (keys + values)
}

/// The propagated budget at `layer` (None before the first layer, `n_layer` after the last):
/// the op's own budget plus one layer's worth of independent error per layer passed, added in
/// quadrature (independent roundings).
pub fn propagated_budget(kind: &str, layer: Option<usize>, a: &Arithmetic, d: &Dims) -> Option<Budget> {
    let local = local_budget(kind, a, d)?;
    let depth = match (kind, layer) {
        (_, Some(i)) => i + 1,
        ("inp_embd", None) => 0,
        (_, None) => d.n_layer,
    } as f64;
    let per_layer = ["attn_q", "attn_out", "ffn_gate", "ffn_out", "attn_kqv", "ffn_act"]
        .iter()
        .filter_map(|k| local_budget(k, a, d))
        .fold(Budget::default(), |m, b| Budget { rel: m.rel.max(b.rel), abs: m.abs.max(b.abs) });
    Some(Budget { rel: (local.rel.powi(2) + depth * per_layer.rel.powi(2)).sqrt(), abs: (local.abs.powi(2) + depth * per_layer.abs.powi(2)).sqrt() })
}

/// Error statistics of one tap over all its positions.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct ErrStats {
    pub max_abs: f64,
    pub rms_err: f64,
    pub rms_ref: f64,
    pub cosine: f64,
    /// Positions where one side is finite and the other is not.
    pub nonfinite: usize,
    /// Position of the largest absolute error.
    pub worst_pos: usize,
}

impl ErrStats {
    pub fn rel(&self) -> f64 {
        if self.rms_ref > 0.0 { self.rms_err / self.rms_ref } else { self.rms_err }
    }
}

pub fn err_stats(device: &[f32], reference: &[f32], width: usize) -> ErrStats {
    let (mut se, mut sr, mut sd, mut dot, mut max_abs, mut worst, mut nonfinite) = (0.0, 0.0, 0.0, 0.0, 0.0f64, 0usize, 0usize);
    for (i, (&x, &r)) in device.iter().zip(reference).enumerate() {
        if !x.is_finite() || !r.is_finite() {
            if x.is_finite() != r.is_finite() || (x.is_nan() != r.is_nan()) {
                nonfinite += 1;
            }
            continue;
        }
        let (x, r) = (x as f64, r as f64);
        let e = (x - r).abs();
        if e > max_abs {
            max_abs = e;
            worst = i / width.max(1);
        }
        se += e * e;
        sr += r * r;
        sd += x * x;
        dot += x * r;
    }
    let n = device.len().max(1) as f64;
    let cosine = if sr > 0.0 && sd > 0.0 { dot / (sr.sqrt() * sd.sqrt()) } else if sr == sd { 1.0 } else { 0.0 };
    ErrStats { max_abs, rms_err: (se / n).sqrt(), rms_ref: (sr / n).sqrt(), cosine, nonfinite, worst_pos: worst }
}

/// A tap's value is massive when its magnitude exceeds this many times the tap's median
/// magnitude (its mean where the median is 0): SmolLM2's 22,500 against a median under 1. On
/// SmolLM2 at most 2.4% of a tap's values are (`blk.11.ffn_out`), on the synthetic models none.
pub const MASSIVE: f64 = 64.0;

/// The device's and the emulation's errors over a tap's bulk — its values without the massive
/// ones ([`MASSIVE`]), whose error is a sample of a few roundings — as relative RMS errors of
/// the bulk, with the number of massive values left out and over how many elements the two
/// errors together sit: (sum w)^2 / sum w^2, w each element's two squared errors summed — 1
/// when one element holds all of it, n when n hold equal parts, 0 without error.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct BulkErrors {
    pub device_rel: f64,
    pub emulated_rel: f64,
    pub massive: usize,
    pub spread: f64,
}

/// [`BulkErrors`] of `device` and `emulated` against `reference` (same lengths; elements not
/// finite on any side are left out, as `err_stats` counts them apart).
pub fn bulk_errors(device: &[f32], emulated: &[f32], reference: &[f32]) -> BulkErrors {
    let finite = |i: usize| device[i].is_finite() && emulated[i].is_finite() && reference[i].is_finite();
    let n = reference.len().min(device.len()).min(emulated.len());
    let mut magnitudes: Vec<f32> = (0..n).filter(|i| finite(*i)).map(|i| reference[i].abs()).collect();
    if magnitudes.is_empty() {
        return BulkErrors::default();
    }
    let mid = magnitudes.len() / 2;
    let median = *magnitudes.select_nth_unstable_by(mid, f32::total_cmp).1 as f64;
    let typical = if median > 0.0 { median } else { magnitudes.iter().map(|m| *m as f64).sum::<f64>() / magnitudes.len() as f64 };
    // Sums of the squared errors, of the squared values, and of the pooled weights' squares
    // (the spread's denominator), in one pass: no copy of a tap as large as the logits.
    let (mut sd, mut se, mut sr, mut sw2, mut massive) = (0.0, 0.0, 0.0, 0.0, 0usize);
    for i in (0..n).filter(|i| finite(*i)) {
        let r = reference[i] as f64;
        if r.abs() > MASSIVE * typical {
            massive += 1;
            continue;
        }
        let (d, e) = ((device[i] as f64 - r).powi(2), (emulated[i] as f64 - r).powi(2));
        (sd, se, sr, sw2) = (sd + d, se + e, sr + r * r, sw2 + (d + e) * (d + e));
    }
    let rel = |x: f64| if sr > 0.0 { (x / sr).sqrt() } else { x.sqrt() };
    let spread = if sw2 > 0.0 && (sd + se).is_finite() { (sd + se) * (sd + se) / sw2 } else { 0.0 };
    BulkErrors { device_rel: rel(sd), emulated_rel: rel(se), massive, spread }
}

/// One tap's comparison.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TapDiff {
    pub name: String,
    pub layer: Option<usize>,
    pub kind: String,
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
    /// Tap `name` before anything is compared: no errors, budgets or grants.
    pub fn uncompared(name: &str) -> TapDiff {
        let (layer, kind) = split_tap(name);
        TapDiff {
            name: name.to_string(),
            layer,
            kind: kind.to_string(),
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

/// One token whose experts the oracle took from the device instead of choosing its own: the two
/// choices differ only at a near tie (see [`follow_at_near_tie`]).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct RoutingFollow {
    /// The `blk.L.ffn_moe_topk` tap.
    pub tap: String,
    pub position: usize,
    /// The oracle's choice and the device's, best first.
    pub oracle: Vec<usize>,
    pub device: Vec<usize>,
    /// How far apart (in the oracle's scores) the experts the two choices swap are, and how far
    /// apart they may be for the device's error to explain the swap: its recorded scores' error
    /// in those two experts (or, without recorded scores, what its score budget allows).
    pub margin: f64,
    pub tolerance: f64,
    /// `propagated` (the oracle's own run), `isolated` (its re-run on the device's inputs) or
    /// `teacher-forced` (fixed-token's re-run).
    pub run: &'static str,
}

/// Whether the oracle should take the device's expert choice `device` instead of its own
/// `oracle` (both best first) for a token whose scores are `probs`: when they differ only at a
/// near tie. Let d be the expert the device dropped with the highest score and t the one it took
/// with the lowest; the choices are `margin = probs[d] - probs[t]` apart. A device that ranks its
/// own scores correctly can only have swapped them if its scores of d and t are off by at least
/// that much together, so where the device recorded its scores (`device_probs`, the
/// `ffn_moe_probs` row) the swap is followed when the margin is within their observed error (plus
/// f32 rounding): then a top-k bug still shows as a mismatch, and the scores' error is judged by
/// their own tap. Without recorded scores, the scores' `budget` (an RMS bound, so one score may
/// be off by sqrt(n) times it and a pair by sqrt(2n)) sets the tolerance. Returns (margin,
/// tolerance) when it should follow.
pub fn follow_at_near_tie(probs: &[f64], oracle: &[usize], device: &[usize], device_probs: Option<&[f32]>, budget: Option<Budget>) -> Option<(f64, f64)> {
    let pick = |ids: &[usize], other: &[usize], best: bool| {
        let outside = ids.iter().copied().filter(|e| !other.contains(e));
        if best { outside.max_by(|&a, &b| probs[a].total_cmp(&probs[b])) } else { outside.min_by(|&a, &b| probs[a].total_cmp(&probs[b])) }
    };
    // The same set (or nothing comparable): nothing to follow.
    let (d, t) = (pick(oracle, device, true)?, pick(device, oracle, false)?);
    let margin = probs[d] - probs[t];
    let tolerance = match device_probs.filter(|dp| dp.len() == probs.len()) {
        Some(dp) => {
            let observed = (dp[d] as f64 - probs[d]).abs() + (dp[t] as f64 - probs[t]).abs();
            observed + 4.0 * f32::EPSILON as f64 * probs[d].abs().max(probs[t].abs())
        }
        None => {
            let rms = (probs.iter().map(|p| p * p).sum::<f64>() / probs.len().max(1) as f64).sqrt();
            (2.0 * probs.len() as f64).sqrt() * budget?.bound(rms)
        }
    };
    (margin <= tolerance).then_some((margin, tolerance))
}

impl std::fmt::Display for RoutingFollow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} position {} ({} run): the oracle chose experts {:?}, the device {:?}, {:.2e} apart where its score error allows {:.2e}: a near tie, so the oracle followed the device",
            self.tap, self.position, self.run, self.oracle, self.device, self.margin, self.tolerance
        )
    }
}

/// The oracle's side of routing MoE tokens (`Tap::route`) against a device's recorded taps, for
/// any oracle run that follows the device: each token goes to the device's experts (its
/// `ffn_moe_topk` row, with its scores from the layer's `ffn_moe_probs` when it recorded them)
/// when [`follow_at_near_tie`] says the two choices differ only at a near tie (`budget_of` gives a
/// layer's score budget for devices that did not record their scores), and is listed in
/// `follows`; otherwise the oracle keeps its own choice (same experts, no valid device choice, or
/// no near tie).
pub struct RoutingFollower<'a> {
    pub device: &'a RecordingTap,
    pub budget_of: Box<dyn Fn(Option<usize>) -> Option<Budget> + 'a>,
    /// Which oracle run this is, for the report (`propagated`, `isolated`, `teacher-forced`).
    pub run: &'static str,
    pub follows: Vec<RoutingFollow>,
}

impl<'a> RoutingFollower<'a> {
    pub fn new(device: &'a RecordingTap, budget_of: Box<dyn Fn(Option<usize>) -> Option<Budget> + 'a>, run: &'static str) -> Self {
        RoutingFollower { device, budget_of, run, follows: Vec::new() }
    }

    /// A follower for a propagated run (the oracle's own, or the emulated arithmetic's): a near
    /// tie is judged by the propagated budget of the expert scores.
    pub fn propagated(device: &'a RecordingTap, arith: &'a Arithmetic, dims: &'a Dims, run: &'static str) -> Self {
        Self::new(device, Box::new(move |layer| propagated_budget("ffn_moe_probs", layer, arith, dims)), run)
    }

    /// `Tap::route` for the run this follower serves.
    pub fn route(&mut self, name: &str, pos: usize, probs: &[f64], chosen: &[usize]) -> Option<Vec<usize>> {
        let (w, data) = self.device.tensors.get(name)?;
        let row = data.get(pos * w..(pos + 1) * w).filter(|_| *w == chosen.len())?;
        // The device's ids, if they are a valid choice (else the mismatch is reported as such).
        let ids: Vec<usize> = row.iter().map(|&v| (v >= 0.0 && v.fract() == 0.0 && (v as usize) < probs.len()).then_some(v as usize)).collect::<Option<_>>()?;
        let scores = name.strip_suffix("ffn_moe_topk").map(|l| format!("{l}ffn_moe_probs"));
        let device_probs = scores.and_then(|n| self.device.tensors.get(&n)).and_then(|(w, v)| v.get(pos * w..(pos + 1) * w));
        let (margin, tolerance) = follow_at_near_tie(probs, chosen, &ids, device_probs, (self.budget_of)(split_tap(name).0))?;
        self.follows.push(RoutingFollow { tap: name.to_string(), position: pos, oracle: chosen.to_vec(), device: ids.clone(), margin, tolerance, run: self.run });
        Some(ids)
    }
}

/// The oracle's tap for layer-diff's two runs: records every tap; in the isolated run
/// (`substitute_values`) hands the interpreter the device's value of each tap; in both, follows
/// the device's MoE routing at near ties (`routing`).
pub struct Rerun<'a> {
    pub routing: RoutingFollower<'a>,
    pub substitute_values: bool,
    pub recorded: RecordingTap,
    /// Where given, a sample of every matrix product's input rows ([`term_scales`]).
    pub products: Option<ProductRows>,
}

impl Tap for Rerun<'_> {
    fn record(&mut self, name: &str, start_pos: usize, n_tokens: usize, width: usize, data: &[f32]) {
        self.recorded.record(name, start_pos, n_tokens, width, data);
    }
    fn substitute(&mut self, name: &str, start_pos: usize, n_tokens: usize, width: usize) -> Option<Vec<f32>> {
        if !self.substitute_values {
            return None;
        }
        let (w, data) = self.routing.device.tensors.get(name)?;
        let range = start_pos * width..(start_pos + n_tokens) * width;
        (*w == width && data.len() >= range.end).then(|| data[range].to_vec())
    }
    fn route(&mut self, name: &str, pos: usize, probs: &[f64], chosen: &[usize]) -> Option<Vec<usize>> {
        let forced = self.routing.route(name, pos, probs, chosen);
        if let Some(p) = &mut self.products {
            p.routed(name, forced.as_deref().unwrap_or(chosen));
        }
        forced
    }
    fn product_input(&mut self, weight: &str, width: usize, data: &[f32]) -> Option<Vec<f32>> {
        if let Some(p) = &mut self.products {
            p.add(weight, width, data);
        }
        None
    }
}

/// How many input rows of each matrix product [`term_scales`] measures (spread evenly over the
/// positions): the scales are ratios of RMS values, steady over a few dozen rows.
pub const TERM_SAMPLE_ROWS: usize = 32;

/// A sample of the input rows of the oracle's matrix products, by the matrix's GGUF name; for a
/// MoE layer's expert matrices (`blk.L.ffn_{gate,up,down}_exps.weight`, one token at a time),
/// each row with the expert it went to.
#[derive(Default, Debug)]
pub struct ProductRows {
    rows: std::collections::BTreeMap<String, (usize, Vec<f32>)>,
    experts: std::collections::BTreeMap<String, ExpertRows>,
    /// By layer: the experts the token now computed was routed to, and how many of their
    /// products of each kind (gate, up, down) the interpreter has asked for so far.
    routing: std::collections::BTreeMap<usize, (Vec<usize>, [usize; 3])>,
}

/// Rows of one stacked expert matrix's products, each with its expert, sampled evenly over the
/// run: every `stride`-th row is kept, and when more than [`TERM_SAMPLE_ROWS`] are kept every
/// other one is dropped and the stride doubled (the same rows for the same run).
#[derive(Default, Debug)]
struct ExpertRows {
    width: usize,
    seen: usize,
    stride: usize,
    rows: Vec<(usize, Vec<f32>)>,
}

impl ProductRows {
    /// The experts a token is routed to at MoE layer tap `name` (`blk.L.ffn_moe_topk`): its
    /// expert products that follow are theirs, in this order.
    pub fn routed(&mut self, name: &str, experts: &[usize]) {
        if let (Some(layer), "ffn_moe_topk") = split_tap(name) {
            self.routing.insert(layer, (experts.to_vec(), [0; 3]));
        }
    }

    /// Keeps evenly spaced rows of `data` (`[n, width]`, the input of the product with `weight`)
    /// until the product has [`TERM_SAMPLE_ROWS`]; an expert matrix's rows with their expert.
    pub fn add(&mut self, weight: &str, width: usize, data: &[f32]) {
        if let Some((layer, kind)) = expert_product(weight) {
            let Some((experts, calls)) = self.routing.get_mut(&layer) else { return };
            let Some(&expert) = experts.get(calls[kind]) else { return };
            calls[kind] += 1;
            let e = self.experts.entry(weight.to_string()).or_insert_with(|| ExpertRows { width, stride: 1, ..Default::default() });
            if e.width != width || data.len() != width {
                return;
            }
            if e.seen.is_multiple_of(e.stride) {
                e.rows.push((expert, data.to_vec()));
                if e.rows.len() > TERM_SAMPLE_ROWS {
                    let kept = std::mem::take(&mut e.rows);
                    e.rows = kept.into_iter().step_by(2).collect();
                    e.stride *= 2;
                }
            }
            e.seen += 1;
            return;
        }
        let n = data.len() / width.max(1);
        let (w, kept) = self.rows.entry(weight.to_string()).or_insert_with(|| (width, Vec::new()));
        if *w != width || n == 0 {
            return;
        }
        let take = TERM_SAMPLE_ROWS.saturating_sub(kept.len() / width).min(n);
        for i in 0..take {
            let row = i * n / take;
            kept.extend_from_slice(&data[row * width..(row + 1) * width]);
        }
    }
}

/// `blk.L.ffn_{gate,up,down}_exps.weight` -> (L, 0|1|2): a MoE layer's stacked expert matrix.
fn expert_product(weight: &str) -> Option<(usize, usize)> {
    let (layer, kind) = weight.strip_prefix("blk.")?.strip_suffix("_exps.weight")?.split_once('.')?;
    let kind = ["ffn_gate", "ffn_up", "ffn_down"].iter().position(|k| *k == kind)?;
    Some((layer.parse().ok()?, kind))
}

/// The tap a matrix product's output is recorded as, for the products whose every output is
/// one dot product with one matrix (not a MoE's experts, whose outputs are mixed, or its router,
/// whose scores pass through a softmax before the tap).
pub fn product_tap(weight: &str) -> Option<String> {
    let stem = weight.strip_suffix(".weight")?;
    if stem == "output" || stem == "token_embd" {
        return Some("result_output".into());
    }
    let (layer, kind) = stem.strip_prefix("blk.")?.split_once('.')?;
    let tap = match kind {
        "attn_q" | "attn_k" | "attn_v" | "ffn_gate" | "ffn_up" => kind,
        "attn_output" => "attn_out",
        "ffn_down" => "ffn_out",
        _ => return None,
    };
    Some(format!("blk.{layer}.{tap}"))
}

/// The scale of a matrix product's terms beside that of its outputs, over a sample of input
/// rows `a` and every output `j`: `term_rms` = RMS of `sqrt(sum_i (a_i w_ji)^2)`, `output_rms` =
/// RMS of `sum_i a_i w_ji + b_j`. The roundings in a dot product (its inputs', its weights',
/// its accumulation's) are each relative to a term, so their sum grows like `term_rms`; the
/// budgets' statistical rule reads it off the output's RMS, which is the same where the terms'
/// signs are random (0.98 on random weights) and smaller where they cancel: a checkpoint whose
/// weight rows are smooth (sin(i k)) gave 19.9 for `attn_out`, where an honest f32 engine then
/// measured 1.1x its budget. [`diff_with_terms`] grants the difference.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct TermScale {
    pub term_rms: f64,
    pub output_rms: f64,
}

/// [`TermScale`] of every product in `products` that a tap records, from the matrices (and
/// biases) in `weights`, in f64. Each output row's sums are taken in a fixed order, so the
/// scales are the same bits for any thread count.
pub fn term_scales(products: &ProductRows, weights: &dyn oracle::loader::TensorSource) -> oracle::Result<std::collections::BTreeMap<String, TermScale>> {
    let mut out = std::collections::BTreeMap::new();
    for (weight, (width, rows)) in &products.rows {
        let Some(tap) = product_tap(weight) else { continue };
        let Some((t, o, n)) = product_sums(weights, weight, *width, rows)? else { continue };
        out.insert(tap, TermScale { term_rms: (t / n).sqrt(), output_rms: (o / n).sqrt() });
    }
    Ok(out)
}

/// [`term_sums`] of the product of the sampled input `rows` (of `width`) with the 2-D matrix
/// `weight` as stored in `weights` (and its bias, if it has one); None where there is no such
/// matrix of rows of `width`, no row sampled, or a bias of another length.
fn product_sums(weights: &dyn oracle::loader::TensorSource, weight: &str, width: usize, rows: &[f32]) -> oracle::Result<Option<(f64, f64, f64)>> {
    if rows.is_empty() {
        return Ok(None);
    }
    let Some(w) = weights.raw(weight)? else { return Ok(None) };
    let Some(row_bytes) = row_bytes(&w, width) else { return Ok(None) };
    let bias = weights.load(&weight.replace(".weight", ".bias"))?.map(|b| b.data);
    if bias.as_ref().is_some_and(|b| b.len() != w.bytes.len() / row_bytes) {
        return Ok(None);
    }
    term_sums(w.ty, &w.bytes, row_bytes, width, rows, bias.as_deref()).map(Some)
}

/// The bytes of one row of `width` values of matrix `w`, if `w` is a matrix of such rows.
fn row_bytes(w: &oracle::loader::RawTensor<'_>, width: usize) -> Option<usize> {
    let row_bytes = (width / w.ty.block_size().max(1)) * w.ty.type_size();
    (w.dims.first() == Some(&width) && width.is_multiple_of(w.ty.block_size()) && row_bytes > 0 && w.bytes.len().is_multiple_of(row_bytes)).then_some(row_bytes)
}

/// Over the input rows `rows` (of `width`) and every output row of the matrix stored in `bytes`
/// (`ty`, rows of `row_bytes`; `bias` per output): (sum of `sum_i (a_i w_ji)^2`, sum of
/// `(a.w_j + b_j)^2`, how many outputs), in f64, in a fixed order (the same bits for any thread
/// count). The matrix is decoded 64 rows at a time (a model's output head decoded whole would
/// take gigabytes beside a model held packed).
fn term_sums(ty: oracle::quant::GgmlType, bytes: &[u8], row_bytes: usize, width: usize, rows: &[f32], bias: Option<&[f32]>) -> oracle::Result<(f64, f64, f64)> {
    use rayon::prelude::*;
    const ROWS_PER_BLOCK: usize = 64;
    let per_block: Vec<oracle::Result<(f64, f64)>> = bytes
        .par_chunks(row_bytes * ROWS_PER_BLOCK)
        .enumerate()
        .map(|(block, bytes)| {
            let values = oracle::quant::decode(ty, bytes, bytes.len() / row_bytes * width)?;
            Ok(values.chunks_exact(width).enumerate().fold((0.0, 0.0), |(t, o), (i, wj)| {
                let b = bias.map_or(0.0, |b| b[block * ROWS_PER_BLOCK + i] as f64);
                rows.chunks_exact(width).fold((t, o), |(t, o), a| {
                    let (mut sq, mut dot) = (0.0f64, 0.0f64);
                    for (x, y) in a.iter().zip(wj) {
                        let term = *x as f64 * *y as f64;
                        sq += term * term;
                        dot += term;
                    }
                    (t + sq, o + (dot + b) * (dot + b))
                })
            }))
        })
        .collect();
    let (mut t, mut o) = (0.0, 0.0);
    for r in per_block {
        let (bt, bo) = r?;
        t += bt;
        o += bo;
    }
    Ok((t, o, (bytes.len() / row_bytes * (rows.len() / width.max(1))) as f64))
}

/// For each MoE layer whose expert products were sampled, by its `blk.L.ffn_out` tap: how many
/// times the outputs' RMS the products' rounding errors may reach there, `1 + excess`, where a
/// product's excess is `term_rms / output_rms - 1` (0 where its terms do not cancel; pooled
/// over the experts' sampled rows, [`term_sums`]) and the block's is that of its gate or up
/// product (whichever is larger) plus its down product's — each passed on to the output
/// unmagnified, as the depth model of [`propagated_budget`] has it and as the dense taps carry
/// their grants (`carry_through_ops`) — or the shared expert's, if larger. The experts have no
/// taps of their own, so the layer's `ffn_out` compared in isolation holds all their errors.
pub fn moe_term_ratios(products: &ProductRows, weights: &dyn oracle::loader::TensorSource) -> oracle::Result<std::collections::BTreeMap<String, f64>> {
    let excess = |t: f64, o: f64| if o > 0.0 { ((t / o).sqrt() - 1.0).max(0.0) } else { 0.0 };
    let mut per_layer: std::collections::BTreeMap<usize, ([f64; 3], [f64; 3])> = Default::default();
    for (weight, e) in &products.experts {
        let (Some((layer, kind)), Some(w)) = (expert_product(weight), weights.raw(weight)?) else { continue };
        let (Some(row_bytes), Some(&n_out)) = (row_bytes(&w, e.width), w.dims.get(1)) else { continue };
        let block = n_out * row_bytes;
        let (mut t, mut o) = (0.0, 0.0);
        let mut by_expert: std::collections::BTreeMap<usize, Vec<f32>> = Default::default();
        for (expert, row) in &e.rows {
            by_expert.entry(*expert).or_default().extend_from_slice(row);
        }
        for (expert, rows) in by_expert {
            let Some(bytes) = w.bytes.get(expert * block..(expert + 1) * block) else { continue };
            let (bt, bo, _) = term_sums(w.ty, bytes, row_bytes, e.width, &rows, None)?;
            t += bt;
            o += bo;
        }
        per_layer.entry(layer).or_default().0[kind] = excess(t, o);
    }
    // The shared expert's products (2-D matrices, every token).
    for (layer, (_, shared)) in per_layer.iter_mut() {
        for (kind, p) in ["gate", "up", "down"].iter().enumerate() {
            let weight = format!("blk.{layer}.ffn_{p}_shexp.weight");
            let Some((width, rows)) = products.rows.get(&weight) else { continue };
            if let Some((t, o, _)) = product_sums(weights, &weight, *width, rows)? {
                shared[kind] = excess(t, o);
            }
        }
    }
    let block = |r: [f64; 3]| r[0].max(r[1]) + r[2];
    Ok(per_layer.into_iter().map(|(layer, (experts, shared))| (format!("blk.{layer}.ffn_out"), 1.0 + block(experts).max(block(shared)))).collect())
}

/// The absolute RMS allowance for the cancelling terms of the product behind tap `kind`: its
/// op's relative budget over the excess of the terms' RMS over the outputs' (0 where they do not
/// cancel); None for a kind without a budget rule.
pub fn cancellation_grant(kind: &str, scale: &TermScale, arith: &Arithmetic, dims: &Dims) -> Option<f64> {
    Some(local_budget(kind, arith, dims)?.rel * (scale.term_rms - scale.output_rms).max(0.0))
}

/// For each layer's `attn_kqv`: `C_STAT` times the attention output's error that the declared
/// roundings of its scores, keys, values and weights produce on the inputs the device gave it
/// (its `attn_q_rope`/`attn_k_rope`/`attn_v` taps, or the nearest earlier ones; where it gave none,
/// the oracle's values from `fallback`), as an absolute RMS ([`crate::attention_terms`]). The
/// dims model's cache term assumes scores made of unit terms; real models' are not (key biases,
/// sinks, massive activations), and there the declared arithmetic errs beyond it.
pub fn attention_allowances(spec: &ModelSpec, device: &RecordingTap, fallback: &RecordingTap, arith: &Arithmetic, n_pos: usize) -> std::collections::BTreeMap<String, f64> {
    let mut out = std::collections::BTreeMap::new();
    let Some(roundings) = crate::attention_terms::Roundings::of(arith, spec.head_dim) else { return out };
    let params = oracle::ops::AttentionParams { n_head: spec.n_head, n_head_kv: spec.n_head_kv, head_dim: spec.head_dim, scale: spec.attn_scale, window: spec.sliding_window };
    let get = |layer: usize, kinds: &[&str]| {
        kinds.iter().map(|k| format!("blk.{layer}.{k}")).find_map(|n| device.tensors.get(&n).or_else(|| fallback.tensors.get(&n))).map(|(_, v)| v.as_slice())
    };
    for layer in 0..spec.n_layer {
        let (Some(q), Some(k), Some(v)) = (get(layer, &["attn_q_rope", "attn_q_norm", "attn_q"]), get(layer, &["attn_k_rope", "attn_k_norm", "attn_k"]), get(layer, &["attn_v"])) else { continue };
        if let Some(s) = crate::attention_terms::sensitivity(q, k, v, n_pos, &params, &roundings) {
            out.insert(format!("blk.{layer}.attn_kqv"), C_STAT * s);
        }
    }
    out
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
        let (layer, kind) = split_tap(name);
        let local = local_budget(kind, arith, dims);
        let mut t = TapDiff { budget_propagated: propagated_budget(kind, layer, arith, dims), budget_isolated: local.map(|b| b.and_independent(since_given)), ..TapDiff::uncompared(name) };
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
        if kind == "ffn_moe_topk" {
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

/// The taps the op behind tap `kind` of `layer` reads, by name (the stage order of
/// `oracle::model`), each the nearest one the oracle recorded (`has`).
fn tap_inputs(layer: Option<usize>, kind: &str, n_layer: usize, has: &dyn Fn(&str) -> bool) -> Vec<String> {
    let Some(i) = layer else {
        return match kind {
            "result_norm" if n_layer > 0 => vec![format!("blk.{}.l_out", n_layer - 1)],
            "result_output" => vec!["result_norm".to_string()],
            _ => Vec::new(),
        };
    };
    let first = |kinds: &[&str]| kinds.iter().map(|k| format!("blk.{i}.{k}")).find(|n| has(n));
    let residual = Some(if i == 0 { "inp_embd".to_string() } else { format!("blk.{}.l_out", i - 1) });
    let names = match kind {
        "attn_norm" => vec![residual],
        "attn_q" | "attn_k" | "attn_v" => vec![first(&["attn_norm"])],
        "attn_q_norm" => vec![first(&["attn_q"])],
        "attn_k_norm" => vec![first(&["attn_k"])],
        "attn_q_rope" => vec![first(&["attn_q_norm", "attn_q"])],
        "attn_k_rope" => vec![first(&["attn_k_norm", "attn_k"])],
        "attn_kqv" => vec![first(&["attn_q_rope", "attn_q_norm", "attn_q"]), first(&["attn_k_rope", "attn_k_norm", "attn_k"]), first(&["attn_v"])],
        "attn_out" => vec![first(&["attn_kqv"])],
        "attn_post_norm" => vec![first(&["attn_out"])],
        "ffn_inp" => vec![residual, first(&["attn_post_norm", "attn_out"])],
        "ffn_norm" => vec![first(&["ffn_inp"])],
        "ffn_gate" | "ffn_up" | "ffn_moe_probs" => vec![first(&["ffn_norm"])],
        "ffn_act" => vec![first(&["ffn_gate"]), first(&["ffn_up"])],
        "ffn_out" => vec![first(&["ffn_act", "ffn_norm"])],
        "ffn_post_norm" => vec![first(&["ffn_out"])],
        "l_out" => vec![first(&["ffn_inp"]), first(&["ffn_post_norm", "ffn_out"])],
        _ => Vec::new(),
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
        let inputs = tap_inputs(t.layer, &t.kind, dims.n_layer, &has);
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

/// The first tap (execution order) whose isolated error exceeds its budget; taps without an
/// isolated comparison fall back to the propagated one.
pub fn first_divergence(taps: &[TapDiff]) -> Option<&TapDiff> {
    taps.iter().find(|t| t.exceeds(Mode::Isolated).or_else(|| t.exceeds(Mode::Propagated)) == Some(true))
}

/// The `first_divergence` section of report.json.
pub fn first_divergence_json(taps: &[TapDiff]) -> Value {
    match first_divergence(taps) {
        None => Value::Null,
        Some(t) => {
            let mode = if t.isolated.is_some() { Mode::Isolated } else { Mode::Propagated };
            let (stats, budget) = t.compared(mode);
            json!({
                "tap": t.name,
                "layer": t.layer,
                "kind": t.kind,
                "compared": mode,
                "rms_err": stats.map(|s| s.rms_err),
                "bound": stats.zip(budget).map(|(s, b)| b.bound(s.rms_ref)),
                "worst_position": stats.map(|s| s.worst_pos),
                "id_mismatches": t.id_mismatches,
            })
        }
    }
}

fn stats_json(prefix: &str, s: &Option<ErrStats>, b: &Option<Budget>, m: &mut Map<String, Value>) {
    if let Some(s) = s {
        m.insert(format!("{prefix}_rms_err"), json!(s.rms_err));
        m.insert(format!("{prefix}_rel_rms"), json!(s.rel()));
        m.insert(format!("{prefix}_max_abs"), json!(s.max_abs));
        m.insert(format!("{prefix}_cosine"), json!(s.cosine));
        m.insert(format!("{prefix}_nonfinite"), json!(s.nonfinite));
        if let Some(b) = b {
            m.insert(format!("{prefix}_bound"), json!(b.bound(s.rms_ref)));
        }
    }
}

/// One report case per tap; the verdict is the comparison of `mode`.
pub fn cases(taps: &[TapDiff], device: &str, model: &str, mode: Mode) -> Vec<Case> {
    taps.iter()
        .map(|t| {
            let mut m = Map::new();
            m.insert("tap".into(), json!(t.name));
            m.insert("layer".into(), json!(t.layer));
            m.insert("kind".into(), json!(t.kind));
            stats_json("propagated", &t.propagated, &t.budget_propagated, &mut m);
            stats_json("isolated", &t.isolated, &t.budget_isolated, &mut m);
            if let Some(a) = t.amplification {
                m.insert("propagated_amplification".into(), json!(a));
                m.insert("propagated_magnified".into(), json!(t.magnified));
            }
            if let Some(e) = t.emulated {
                m.insert("emulated_rel".into(), json!(e));
                if let Some(b) = t.emulated_bulk {
                    m.insert("bulk_propagated_rel".into(), json!(b.device_rel));
                    m.insert("bulk_emulated_rel".into(), json!(b.emulated_rel));
                    m.insert("massive_values".into(), json!(b.massive));
                    m.insert("bulk_error_spread".into(), json!(b.spread));
                }
                if let Some(u) = t.emulated_budget_use() {
                    m.insert("emulated_budget_use".into(), json!(u));
                }
                // No ratio where the emulation has no error yet (no rounding before this tap).
                if let Some(p) = t.propagated.as_ref().filter(|_| e > 0.0) {
                    m.insert("propagated_over_emulated".into(), json!(p.rel() / e));
                }
            }
            if let Some(ts) = t.terms {
                m.insert("term_rms".into(), json!(ts.term_rms));
                m.insert("output_rms".into(), json!(ts.output_rms));
                m.insert("terms_grant".into(), json!(t.terms_grant));
            }
            if t.attention_grant > 0.0 {
                m.insert("attention_grant".into(), json!(t.attention_grant));
            }
            if let Some(n) = t.id_mismatches {
                m.insert("id_mismatches".into(), json!(n));
                m.insert("routing_followed_at_near_ties".into(), json!(t.routing_followed));
            }
            let (gated, budget) = t.compared(mode);
            if let Some(s) = gated {
                m.insert("max_abs".into(), json!(s.max_abs));
            }
            let id = format!("layer_diff(model={model},tap={},mode={})", t.name, serde_json::to_value(mode).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default());
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
    use crate::emulate::{EMULATED_FLOOR as FLOOR, EMULATED_MIN_SPREAD as MIN_SPREAD};
    let material: Vec<(&TapDiff, &ErrStats, BulkErrors)> = taps.iter().filter(|t| !t.missing).filter_map(|t| Some((t, t.propagated.as_ref()?, t.emulated_bulk.filter(|b| b.emulated_rel >= FLOOR)?))).collect();
    let (held, concentrated): (Vec<_>, Vec<_>) = material.into_iter().partition(|(_, _, b)| b.spread >= MIN_SPREAD);
    let ratios: Vec<(&TapDiff, f64)> = held.iter().map(|(t, p, b)| (*t, if p.nonfinite > 0 { f64::INFINITY } else { b.device_rel / b.emulated_rel })).collect();
    let over = |r: f64| r.is_nan() || r > factor;
    let (largest, largest_ratio) = *ratios.iter().max_by(|a, b| a.1.total_cmp(&b.1))?;
    let first = ratios.iter().find(|(_, r)| over(*r));
    let mut m = Map::new();
    m.insert("taps_compared".into(), json!(ratios.len()));
    m.insert("largest_ratio".into(), json!(largest_ratio));
    m.insert("largest_tap".into(), json!(largest.name));
    m.insert("factor".into(), json!(factor));
    m.insert("taps_concentrated".into(), json!(concentrated.iter().map(|(t, _, _)| &t.name).collect::<Vec<_>>()));
    m.insert("massive_values".into(), json!(held.iter().map(|(_, _, b)| b.massive).sum::<usize>()));
    if let Some((t, r)) = first {
        m.insert("first_departure_tap".into(), json!(t.name));
        m.insert("first_departure_ratio".into(), json!(r));
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
    Some(Case {
        id: format!("layer_diff(model={model},gate=emulated_departure)"),
        device: device.to_string(),
        verdict: if first.is_some() { Verdict::Fail } else { Verdict::Pass },
        metrics: m,
        tolerance: Tolerance { rule: format!("propagated rel. error <= {factor} x the declared arithmetic emulated's, over each tap's bulk (values under {MASSIVE} x its median magnitude), where that is >= {FLOOR:e} and the errors sit in >= {MIN_SPREAD} elements"), bound: factor },
        margin: factor - largest_ratio,
        message: Some(message),
    })
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
                out.map_or("-".into(), |t| t.kind.clone()),
                fmt_rel(out, Mode::Propagated),
                out.and_then(|t| t.emulated).map_or("-".into(), |e| format!("{e:.2e}")),
                worst.map_or("-".into(), |t| t.kind.clone()),
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

/// Error by layer: relative RMS error of each tap kind (solid) and its budget (dashed), log scale.
pub fn chart(taps: &[TapDiff], mode: Mode, title: &str) -> Chart {
    let mut kinds: Vec<&str> = Vec::new();
    for t in taps.iter().filter(|t| t.layer.is_some()) {
        if !kinds.contains(&t.kind.as_str()) {
            kinds.push(&t.kind);
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
    let emulated: Vec<(f64, f64)> = taps.iter().filter(|t| t.kind == "l_out").filter_map(|t| Some((t.layer? as f64, t.emulated?.max(f32::EPSILON as f64 / 4.0)))).collect();
    if mode == Mode::Propagated && !emulated.is_empty() {
        series.push(Series { name: "l_out, declared arithmetic emulated".into(), points: emulated, colour: kinds.len(), dashed: false });
    }
    Chart { title: title.into(), x_label: "layer".into(), y_label: "relative RMS error".into(), log_y: true, series, band: None, markers: Vec::new() }
}

/// Error over budget by layer, read at a glance: per mode, the worst tap of each layer (the
/// output head after the last layer), the budget as a dashed line at 1, and each layer's worst
/// tap over it marked and named.
pub fn budget_chart(taps: &[TapDiff], modes: &[Mode], title: &str) -> Chart {
    let last = taps.iter().filter_map(|t| t.layer).max().map_or(0, |l| l + 1);
    let x_of = |t: &TapDiff| t.layer.unwrap_or(if t.kind == "inp_embd" { 0 } else { last }) as f64;
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
    Chart { title: title.into(), x_label: "layer (after the last: the output head)".into(), y_label: "error / budget".into(), log_y: true, series, band: None, markers }
}

/// The device's taps the oracle has no tap of that name for (a dump's misspelt or foreign
/// names, a layer past the model's): compared with nothing, so listed, never counted as passes.
pub fn unjudged(reference: &RecordingTap, device: &RecordingTap) -> Vec<String> {
    device.order.iter().filter(|n| !reference.tensors.contains_key(*n)).cloned().collect()
}

/// Everything one layer-diff run produced.
pub struct Outcome {
    pub taps: Vec<TapDiff>,
    pub report: Report,
    /// MoE tokens where the oracle followed the device's expert choice at a near tie.
    pub follows: Vec<RoutingFollow>,
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
            RoutingFollower::new(device_taps, Box::new(move |_| local_budget("ffn_moe_probs", arith, dims)), run)
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
            let mut run = crate::emulate::Following { emu: emu.recording(), routing: RoutingFollower::propagated(device_taps, arith, &dims, "emulated") };
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
            departure_case = emulated_departure(&taps, emulation_factor, model, device);
            let largest = match &departure_case {
                Some(c) => Some((c.metrics["largest_tap"].clone(), c.metrics["largest_ratio"].clone())),
                None => taps.iter().filter_map(|t| Some((t, t.propagated.as_ref()?.rel() / t.emulated.filter(|e| *e > 0.0)?))).max_by(|a, b| a.1.total_cmp(&b.1)).map(|(t, r)| (json!(t.name), json!(r))),
            };
            // The tap where the emulated arithmetic comes closest to its own propagated budget:
            // how much room an honest engine of this arithmetic has (a use near or above 1 is a
            // budget too tight for the declaration, before any engine meets it).
            let tightest = taps.iter().filter_map(|t| Some((t, t.emulated_budget_use()?))).max_by(|a, b| a.1.total_cmp(&b.1)).map(|(t, u)| json!({ "tap": t.name, "budget_use": u }));
            let mut section = json!({ "applied": true, "largest_departure": largest.map(|(t, r)| json!({ "tap": t, "propagated_over_emulated": r })), "tightest_budget": tightest, "factor": emulation_factor, "floor": crate::emulate::EMULATED_FLOOR, "min_spread": crate::emulate::EMULATED_MIN_SPREAD });
            if departure_case.is_none() {
                section["gate"] = json!(format!(
                    "not applicable: the emulated error over a tap's bulk reaches {:e} at no tap whose errors are spread over {} elements (the declared roundings barely touch this model)",
                    crate::emulate::EMULATED_FLOOR,
                    crate::emulate::EMULATED_MIN_SPREAD
                ));
            }
            section
        }
        Err(why) => json!({ "not_applicable": why }),
    };
    let follows: Vec<RoutingFollow> = reference.routing.follows.into_iter().chain(sub.routing.follows).collect();
    for t in &mut taps {
        t.routing_followed = follows.iter().filter(|f| f.tap == t.name).count();
    }
    let mut report = report(&taps, mode, model, device, ids, None, departure_case);
    report.sections.insert("unjudged_taps".into(), json!(unjudged(&reference.recorded, device_taps)));
    report.sections.insert("routing_followed".into(), json!(follows));
    report.sections.insert("arithmetic".into(), json!(arith));
    report.sections.insert("emulated_arithmetic".into(), emulation);
    Ok(Outcome { taps, report, follows })
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
    let mut m = Map::new();
    m.insert("taps_compared".into(), json!(compared));
    m.insert("worst_tap".into(), json!(worst_tap));
    m.insert("worst_error_over_bound".into(), json!(worst_ratio / factor));
    m.insert("candidate_over_baseline".into(), json!(worst_ratio));
    let message = first.map(|(tap, r, cr, br)| {
        m.insert("first_departure".into(), json!(tap));
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
    if !same_arithmetic {
        report.sections.insert("baseline_departure".into(), json!("not applied: the two declare different arithmetic (each is held to its own emulation by `layer-diff --device D`)"));
    }
    report.sections.insert("routing_split".into(), split.as_ref().map_or(Value::Null, |(at, position, choices)| json!({ "tap": taps[*at].name, "position": position, a.0: choices.0, b.0: choices.1 })));
    for c in &mut report.cases {
        let name = c.metrics.get("tap").and_then(|v| v.as_str()).unwrap_or("").to_string();
        for (device, t) in [a.0, b.0].into_iter().zip(own(&name)) {
            c.metrics.insert(format!("oracle_vs_{device}_rel_rms"), json!(t.and_then(|t| t.propagated).map(|s| s.rel())));
        }
        if let Some(n) = c.metrics.get("routing_followed_at_near_ties").and_then(|v| v.as_u64()).filter(|n| *n > 0) {
            c.message = Some(format!("the two chose other experts at {n} position(s), each as the oracle routed as it was at a near tie"));
        }
        if let Some(device) = judged_alone.get(&name) {
            c.metrics.insert("judged_against_the_oracle_routed_as".into(), json!(device));
            c.tolerance.rule = format!("{} (past the routing split: {device} against the oracle routed as it was, the worse of the two)", c.tolerance.rule);
        }
    }
    let reference = &vs_oracle_a.reference.recorded;
    let mut names = unjudged(reference, a.1);
    names.extend(unjudged(reference, b.1).into_iter().filter(|n| !a.1.tensors.contains_key(n)));
    report.sections.insert("unjudged_taps".into(), json!(names));
    report.sections.insert("arithmetic".into(), Value::Object(Map::from_iter([(a.0.to_string(), json!(a.2)), (b.0.to_string(), json!(b.2))])));
    // Two builds of one engine often agree bit for bit up to a change: the first tap where they
    // differ at all is worth knowing even when the difference is inside the budget.
    let first_difference = taps.iter().find(|t| t.propagated.is_some_and(|s| s.rms_err > 0.0 || s.nonfinite > 0) || t.id_mismatches.is_some_and(|n| n > 0) || t.routing_followed > 0);
    report.sections.insert("first_difference".into(), first_difference.map_or(serde_json::Value::Null, |t| json!({ "tap": t.name, "rms_err": t.propagated.map(|s| s.rms_err), "worst_position": t.propagated.map(|s| s.worst_pos) })));
    // Each device's own first divergence from the oracle (isolated where it can be), for the
    // reader: the pair's gate holds their difference to the sum of two propagated budgets, which
    // a tap that one device computes wrong can stay inside.
    report.sections.insert("first_divergence_vs_oracle".into(), json!({ a.0: first_divergence_json(&vs_oracle_a.taps), b.0: first_divergence_json(&vs_oracle_b.taps) }));
    // Where each comparison with the oracle followed its device's MoE routing at a near tie, by
    // device (the budgets above rest on those runs).
    let followed = [(a.0, vs_oracle_a), (b.0, vs_oracle_b)].map(|(device, j)| (device.to_string(), json!(j.reference.routing.follows.into_iter().chain(j.isolated.routing.follows).collect::<Vec<_>>())));
    report.sections.insert("routing_followed".into(), Value::Object(Map::from_iter(followed)));
    Ok(Outcome { taps, report, follows: Vec::new() })
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
        if t.kind != "ffn_moe_topk" || t.id_mismatches.is_none_or(|n| n == 0) {
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
    report.sections.insert("mode".into(), json!(mode));
    report.sections.insert("model".into(), json!(model));
    report.sections.insert("prompt_ids".into(), json!(ids));
    if let Some(b) = against {
        report.sections.insert("against".into(), json!(b));
    }
    report.sections.insert("first_divergence".into(), first_divergence_json(taps));
    report.add_table("layer_table", "Per layer", &LAYER_TABLE_COLUMNS, layer_table(taps));
    let modes: &[Mode] = if against.is_none() { &[Mode::Isolated, Mode::Propagated] } else { &[Mode::Propagated] };
    report.add_chart("budget_use_by_layer", budget_chart(taps, modes, &format!("{device} on {model}: error over budget by layer")));
    report.add_chart("error_by_layer_propagated", chart(taps, Mode::Propagated, &format!("{device} on {model}: propagated error by layer")));
    if against.is_none() {
        report.add_chart("error_by_layer_isolated", chart(taps, Mode::Isolated, &format!("{device} on {model}: each op's own error (isolated)")));
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(product_tap("token_embd.weight").as_deref(), Some("result_output"));
        assert_eq!(product_tap("blk.3.ffn_down.weight").as_deref(), Some("blk.3.ffn_out"));
        assert_eq!(product_tap("blk.3.ffn_gate_inp.weight"), None);
    }

    fn dims() -> Dims {
        Dims { d: 64, head_dim: 16, q_dim: 64, n_ff: 128, n_pos: 5, n_layer: 4, rope_angle_rms: 2.0, embd_scale: 1.0, gelu: false }
    }

    #[test]
    fn budgets_grow_with_depth_and_q8_activations() {
        let d = dims();
        let a = Arithmetic::F32;
        let early = propagated_budget("l_out", Some(0), &a, &d).unwrap();
        let late = propagated_budget("l_out", Some(3), &a, &d).unwrap();
        assert!(late.rel > early.rel);
        let q8 = Arithmetic { activation_q8_block: Some(32), ..a };
        assert!(local_budget("attn_q", &q8, &d).unwrap().rel > 10.0 * local_budget("attn_q", &a, &d).unwrap().rel);
        assert_eq!(local_budget("attn_norm", &q8, &d), local_budget("attn_norm", &a, &d), "Q8 applies to products only");
        // The widest rounding declared: K-quants' blocks of 256 over 32, half-precision inputs
        // (below a block of 32's, so they add nothing beside it).
        let kquant = Arithmetic { activation_q8_block_kquant: Some(256), ..q8 };
        assert!(local_budget("attn_q", &kquant, &d).unwrap().rel > 2.0 * local_budget("attn_q", &q8, &d).unwrap().rel);
        let half = Arithmetic { activation_half_rounding: true, ..a };
        assert!(local_budget("attn_q", &half, &d).unwrap().rel > 10.0 * local_budget("attn_q", &a, &d).unwrap().rel);
        assert_eq!(local_budget("attn_q", &Arithmetic { activation_half_rounding: true, ..q8 }, &d), local_budget("attn_q", &q8, &d));
        assert_eq!(local_budget("attn_norm", &half, &d), local_budget("attn_norm", &a, &d));
        assert!(local_budget("no_such_tap", &a, &d).is_none());
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
        let budget = local_budget("attn_q_rope", &Arithmetic::F32, &d).unwrap().rel;
        assert!(measured < budget, "measured {measured:e}, budget {budget:e}");
        let without = local_budget("attn_q_rope", &Arithmetic::F32, &Dims { rope_angle_rms: 0.0, ..d }).unwrap().rel;
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
        let (plain, cached) = (local_budget("attn_kqv", &a, &d).unwrap(), local_budget("attn_kqv", &f16, &d).unwrap());
        // One f16 rounding per cached value: u = 2^-11, times (1 + sqrt(head_dim)) = 5 for head_dim 16.
        assert_eq!(cached.rel - plain.rel, C_STAT * (-11f64).exp2() * 5.0);
        for kind in ["attn_q", "attn_k_rope", "attn_out", "ffn_out", "result_norm"] {
            assert_eq!(local_budget(kind, &f16, &d), local_budget(kind, &a, &d), "{kind} does not read the cache");
        }
        assert!(propagated_budget("l_out", Some(2), &f16, &d).unwrap().rel > propagated_budget("l_out", Some(2), &a, &d).unwrap().rel);
        // An f16 GELU table widens the activation's budget on a GELU model only.
        let table = Arithmetic { gelu_half_table: true, ..a };
        let gelu = Dims { gelu: true, ..d };
        assert!(local_budget("ffn_act", &table, &gelu).unwrap().rel > 50.0 * local_budget("ffn_act", &a, &gelu).unwrap().rel);
        assert_eq!(local_budget("ffn_act", &table, &d), local_budget("ffn_act", &a, &d));
        assert_eq!(local_budget("ffn_out", &table, &gelu), local_budget("ffn_out", &a, &gelu));
        // A cache no coarser than storage adds nothing; a bf16 one more than an f16 one.
        let same = Arithmetic { kv_cache: devices::KvFormat::parse("f32"), ..a };
        assert_eq!(local_budget("attn_kqv", &same, &d), Some(plain));
        let bf16 = Arithmetic { kv_cache: devices::KvFormat::parse("bf16"), ..a };
        assert!(local_budget("attn_kqv", &bf16, &d).unwrap().rel > cached.rel);
        // Keys and values apart: the keys' rounding counts sqrt(head_dim) times (with the
        // query's Q8_0 blocks before block keys), the values' once.
        let rel = |k: &str, v: &str| local_budget("attn_kqv", &a.with_kv(devices::KvTypes::parse(&format!("{k}-{v}")).unwrap()), &d).unwrap().rel - plain.rel;
        let (u16, u8) = ((-11f64).exp2(), devices::KvFormat::Q8_0.rel_rounding());
        for (k, v, want) in [("f16", "f32", u16 * 4.0), ("f32", "f16", u16), ("q8_0", "f16", 2.0 * u8 * 4.0 + u16), ("f16", "q8_0", u16 * 4.0 + u8)] {
            let got = rel(k, v);
            assert!((got / (C_STAT * want) - 1.0).abs() < 1e-9, "{k}-{v}: {got:e}, want {:e}", C_STAT * want);
        }
    }

    #[test]
    fn routing_follows_the_device_only_at_a_near_tie_its_own_scores_explain() {
        let probs = [0.30, 0.29, 0.10, 0.31];
        let b = Some(Budget { rel: 0.01, abs: 0.0 });
        // Same experts (any order): nothing to follow.
        assert_eq!(follow_at_near_tie(&probs, &[3, 0], &[0, 3], None, b), None);
        // The device took 1 for 0 (0.01 apart) with its scores of the two off by 0.006 each.
        let dev = [0.294f32, 0.296, 0.10, 0.31];
        let (margin, tol) = follow_at_near_tie(&probs, &[3, 0], &[3, 1], Some(&dev), b).unwrap();
        assert!((margin - 0.01).abs() < 1e-12 && (0.012..0.0121).contains(&tol), "{margin} {tol}");
        // The same swap with scores that do not explain it (a top-k bug): not followed.
        assert_eq!(follow_at_near_tie(&probs, &[3, 0], &[3, 1], Some(&[0.30f32, 0.29, 0.10, 0.31]), b), None);
        // Taking the worst expert is no near tie, whatever the scores' budget.
        let dev = [0.30f32, 0.29, 0.10, 0.31];
        assert_eq!(follow_at_near_tie(&probs, &[3, 0], &[3, 2], Some(&dev), b), None);
        // Without recorded scores the budget decides: sqrt(2 * 4) * 0.01 * rms(probs) ~ 0.007.
        assert_eq!(follow_at_near_tie(&probs, &[3, 0], &[3, 1], None, b), None);
        assert!(follow_at_near_tie(&probs, &[3, 0], &[3, 1], None, Some(Budget { rel: 0.02, abs: 0.0 })).is_some());
        assert_eq!(follow_at_near_tie(&probs, &[3, 0], &[3, 1], None, None), None);
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
        let depth = propagated_budget("ffn_act", Some(0), &q8, &d).unwrap().rel;
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
}
