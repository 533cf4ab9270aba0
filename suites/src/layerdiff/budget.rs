//! The budget model: what each tap's error may be, from the declared arithmetic, the op's reduction length and the depth.

use devices::Arithmetic;
use oracle::taps::TapKind;
use oracle::ModelSpec;

/// Safety factor on the statistical √K rounding-error rule (Higham, "Accuracy and Stability",
/// §3.8): rounding errors of a length-K reduction typically grow like u·√K; the factor covers
/// the spread of that estimate.
pub const C_STAT: f64 = 4.0;
/// An op's output error may exceed its input's relative error by the conditioning of the
/// weights it applies; the budget allows a factor of this size (see ACCURACY.md).
pub const C_COND: f64 = 2.0;

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
    /// The widest layer's query width (the attention output projection's dot length).
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
    /// The state-space layers' inner width, state size and convolution width (0 without them).
    pub ssm_inner: usize,
    pub ssm_state: usize,
    pub ssm_conv: usize,
    /// The state-space layers are gated DeltaNets.
    pub ssm_delta: bool,
    /// Latent attention's key/value latent width (0 without it): the expansion's dot length.
    pub mla_rank: usize,
}

impl Dims {
    pub fn of(spec: &ModelSpec, n_pos: usize) -> Dims {
        let n_ff = spec.moe.as_ref().map_or(spec.n_ff, |m| m.expert_ffn.max(m.shared_ffn.unwrap_or(0)));
        let rope_angle_rms = spec.ropes().into_iter().map(|r| rope_angle_rms(r, n_pos)).fold(0.0, f64::max);
        Dims { d: spec.n_embd, head_dim: spec.head_dim, q_dim: (spec.n_head * spec.head_dim).max(spec.mla.map_or(0, |b| b.out_dim())), n_ff, n_pos, n_layer: spec.n_layer, rope_angle_rms, embd_scale: spec.embd_scale.unwrap_or(1.0), gelu: spec.activation == oracle::spec::Activation::GeluTanh, ssm_inner: spec.ssm.map_or(0, |b| b.d_inner), ssm_state: spec.ssm.map_or(0, |b| b.d_state), ssm_conv: spec.ssm.map_or(0, |b| b.d_conv), ssm_delta: spec.ssm.is_some_and(|b| b.kind == oracle::spec::SsmKind::GatedDelta), mla_rank: spec.mla.map_or(0, |b| b.kv_lora_rank) }
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

/// What produces a tap, for its budget: a reduction of length `k`, whether its input was a
/// matrix product's (quantized on Q8-activation devices), whether it uses exp/sin/sqrt.
pub(crate) struct OpShape {
    k: usize,
    matmul: bool,
    transcendental: bool,
}

/// The op behind each kind of tap; None for the discrete ones (expert ids, compared exactly).
pub(crate) fn op_shape(kind: TapKind, d: &Dims) -> Option<OpShape> {
    let s = |k, matmul, transcendental| Some(OpShape { k, matmul, transcendental });
    match kind {
        TapKind::InpEmbd => s(1, false, false),
        TapKind::AttnNorm | TapKind::FfnNorm | TapKind::ResultNorm | TapKind::AttnPostNorm | TapKind::FfnPostNorm => s(d.d, false, true),
        TapKind::AttnQNorm | TapKind::AttnKNorm => s(d.head_dim, false, true),
        TapKind::AttnQ | TapKind::AttnK | TapKind::AttnV | TapKind::AttnGate | TapKind::FfnGate | TapKind::FfnUp | TapKind::ResultOutput => s(d.d, true, false),
        // A product, then an RMSNorm.
        TapKind::AttnQA | TapKind::AttnKvA => s(d.d, true, true),
        TapKind::AttnOut => s(d.q_dim, true, false),
        TapKind::FfnOut => s(d.n_ff, true, false),
        TapKind::AttnQRope | TapKind::AttnKRope => s(2, false, true),
        // Latent attention first expands each cached latent (a product over its width).
        TapKind::AttnKqv => s(d.n_pos.max(d.head_dim).max(d.mla_rank), d.mla_rank > 0, true),
        // A sigmoid and a product.
        TapKind::AttnGated => s(2, false, true),
        TapKind::FfnInp | TapKind::LOut => s(2, false, false),
        TapKind::FfnAct => s(2, false, true),
        TapKind::FfnMoeProbs => s(d.d, true, true),
        TapKind::FfnMoeTopk => None,
        TapKind::SsmIn => s(d.d, true, false),
        // d_conv products and a bias, then SiLU.
        TapKind::SsmConv => s(d.ssm_conv + 1, false, true),
        // The state carries one rounding of every earlier position forward (decayed, never
        // amplified: exp(dt A) <= 1; a gated DeltaNet's correction multiplies it by
        // I - beta k k^T, whose norm is at most 1 for an L2-normed k), and each step's decay is
        // an exp. The delta rule's recall S k is a dot product over the state's width.
        TapKind::SsmState => s(d.n_pos.max(1) + 1 + if d.ssm_delta { d.ssm_state } else { 0 }, false, true),
        // A dot product with C over the state, whose own error the state's term holds.
        TapKind::SsmScan => s(d.ssm_state.max(d.n_pos) + 1, false, true),
        TapKind::SsmNorm => s(d.ssm_inner, false, true),
        TapKind::SsmOut => s(d.ssm_inner, true, false),
    }
}

/// The budget of one op's own error (isolated comparison), from the device's arithmetic.
pub fn local_budget(kind: TapKind, a: &Arithmetic, d: &Dims) -> Option<Budget> {
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
        if kind == TapKind::InpEmbd {
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
    if matches!(kind, TapKind::AttnQRope | TapKind::AttnKRope) {
        // The angle held in the storage format: a rotation by an angle off by u times it.
        rel += C_STAT * us * d.rope_angle_rms;
    }
    if kind == TapKind::FfnAct && d.gelu && a.gelu_half_table {
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
pub(crate) fn kv_cache_rel(kind: TapKind, a: &Arithmetic, d: &Dims) -> f64 {
    if kind != TapKind::AttnKqv {
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
pub fn propagated_budget(kind: TapKind, layer: Option<usize>, a: &Arithmetic, d: &Dims) -> Option<Budget> {
    let local = local_budget(kind, a, d)?;
    let depth = match (kind, layer) {
        (_, Some(i)) => i + 1,
        (TapKind::InpEmbd, None) => 0,
        (_, None) => d.n_layer,
    } as f64;
    let per_layer = [TapKind::AttnQ, TapKind::AttnOut, TapKind::FfnGate, TapKind::FfnOut, TapKind::AttnKqv, TapKind::FfnAct]
        .into_iter()
        .filter_map(|k| local_budget(k, a, d))
        .fold(Budget::default(), |m, b| Budget { rel: m.rel.max(b.rel), abs: m.abs.max(b.abs) });
    Some(Budget { rel: (local.rel.powi(2) + depth * per_layer.rel.powi(2)).sqrt(), abs: (local.abs.powi(2) + depth * per_layer.abs.powi(2)).sqrt() })
}
