//! `ModelSpec`: everything the forward interpreter needs to know about a model, as data.
//!
//! A spec is parsed from GGUF metadata (plus which tensors exist) or from a Hugging Face
//! `config.json`. Nothing about an architecture is implied by its name inside the interpreter:
//! the RoPE layout, QK-norm, biases, tied output, MoE routing and the stage order are explicit
//! fields here, so one interpreter runs every supported architecture.

use crate::error::{OracleError, Result};
use crate::gguf::GgufFile;
use serde::{Deserialize, Serialize};

/// How RoPE pairs the elements of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): llama.cpp's layout for `llama` GGUF files (Q/K rows permuted by the converter).
    Normal,
    /// Rotate-half pairs (i, i + n_rot/2): GPT-NeoX / Hugging Face layout, used by Qwen and by safetensors Llama.
    Neox,
}

/// Context-extension scaling of RoPE frequencies.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (frequency scale 1/factor).
    Linear { factor: f64 },
    /// YaRN: interpolation blended with extrapolation per dimension, plus attention magnitude scaling.
    Yarn {
        factor: f64,
        original_context: usize,
        beta_fast: f64,
        beta_slow: f64,
        ext_factor: f64,
        attn_factor: f64,
        /// The correction range's ends rounded out to whole dimensions, as llama.cpp always
        /// does and Hugging Face does unless a config says `truncate: false` (GPT-OSS).
        #[serde(default = "yes")]
        truncate: bool,
    },
    /// Phi-3's LongRoPE: per-pair factors (`RopeSpec::freq_factors`) divide the angles, and
    /// `attn_factor` scales every cos and sin. Which factors: as llama.cpp, by the context the
    /// engine is configured for (`context`, `--context` / `TOUCHSTONE_CONTEXT`; by default the
    /// original context): the short ones up to `original_context` positions, the long ones at
    /// every position when the context is longer. Positions at or past `context` are refused.
    /// (Transformers switches the whole sequence to the long factors once it is longer than the
    /// original context, keeping keys it cached with the short ones: not modelled.)
    LongRope {
        attn_factor: f64,
        original_context: usize,
        #[serde(default)]
        context: usize,
    },
}

fn yes() -> bool {
    true
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeSpec {
    pub style: RopeStyle,
    pub theta: f64,
    /// Number of rotated dimensions per head (the rest pass through unchanged).
    pub n_rot: usize,
    pub scaling: RopeScaling,
    /// Per-pair frequency factors (`n_rot / 2`, f32 as a GGUF's `rope_freqs.weight` holds them):
    /// pair `i`'s angle is divided by factor `i` before any scaling, as llama.cpp does. Llama 3.1's
    /// "llama3" scaling is carried this way (`llama3_freq_factors`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freq_factors: Option<Vec<f32>>,
    /// LongRoPE's two factor lists (short, long) as the model stores them, from which
    /// `ModelSpec::set_context` picks `freq_factors`; absent from a flat file, which holds the
    /// factors its export was configured for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub longrope_factors: Option<(Vec<f32>, Vec<f32>)>,
}

/// Gemma 3's pattern of attention: five windowed layers, then one that sees every position.
pub const GEMMA3_SWA_PERIOD: usize = 6;
/// Gemma 3's RoPE base on its windowed ("local") layers.
pub const GEMMA3_LOCAL_ROPE_BASE: f64 = 10_000.0;

/// Gemma's embedding scale for a model `n_embd` wide: sqrt(n_embd) in f32, as llama.cpp and
/// transformers compute it.
pub fn gemma_embd_scale(n_embd: usize) -> f64 {
    (n_embd as f32).sqrt() as f64
}

impl RopeSpec {
    /// The same rotation with base `theta`, unscaled and without frequency factors: the RoPE of
    /// Gemma 3's windowed layers beside its global one.
    pub fn with_base(&self, theta: f64) -> RopeSpec {
        RopeSpec { theta, scaling: RopeScaling::None, freq_factors: None, longrope_factors: None, ..self.clone() }
    }
}

/// The environment variable that tells every model loader the context (positions) the engine
/// under test is configured for (`cargo xtask --context N` sets it).
pub const CONTEXT_ENV: &str = "TOUCHSTONE_CONTEXT";

/// The context `TOUCHSTONE_CONTEXT` asks for, if set: a positive integer, else an error naming it.
pub fn configured_context() -> Result<Option<usize>> {
    match std::env::var(CONTEXT_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => Err(spec_err(format!("{CONTEXT_ENV}=`{v}` is not a positive number of positions"))),
        },
        Err(e) => Err(spec_err(format!("{CONTEXT_ENV}: {e}"))),
    }
}

/// Llama 3.1's RoPE frequency factors (Hugging Face `rope_type: "llama3"`): pairs whose
/// wavelength is shorter than `original_context / high_freq_factor` keep their frequency (factor
/// 1), those longer than `original_context / low_freq_factor` are slowed by `factor`, and those
/// between are blended: `1 / ((1 - s) / factor + s)` with `s = (original_context / wavelength -
/// low) / (high - low)`. Computed in f64 and stored as f32, as llama.cpp's converter writes
/// `rope_freqs.weight`, so a checkpoint and its GGUF give the same angles.
pub fn llama3_freq_factors(theta: f64, n_rot: usize, factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_context: usize) -> Vec<f32> {
    let (low_wavelen, high_wavelen) = (original_context as f64 / low_freq_factor, original_context as f64 / high_freq_factor);
    (0..n_rot / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf(2.0 * i as f64 / n_rot as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let f = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (original_context as f64 / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                1.0 / ((1.0 - smooth) / factor + smooth)
            };
            f as f32
        })
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    Silu,
    GeluTanh,
    /// GPT-OSS's clamped SwiGLU: `g = min(gate, L)`, `u = clamp(up, -L, L)`,
    /// `g * sigmoid(A * g) * (u + 1)` with A = [`OAI_SWIGLU_ALPHA`], L = [`OAI_SWIGLU_LIMIT`].
    SwigluOai,
}

/// GPT-OSS's SwiGLU slope (Hugging Face `swiglu_alpha`; llama.cpp's constant).
pub const OAI_SWIGLU_ALPHA: f64 = 1.702;
/// GPT-OSS's SwiGLU clamp (Hugging Face `swiglu_limit`; llama.cpp's constant).
pub const OAI_SWIGLU_LIMIT: f64 = 7.0;
/// Gemma 2's pattern of attention: windowed layers alternating with global ones.
pub const GEMMA2_SWA_PERIOD: usize = 2;
/// GPT-OSS's pattern of attention: windowed layers alternating with layers that see every position.
pub const GPT_OSS_SWA_PERIOD: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Gating {
    Softmax,
    Sigmoid,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeSpec {
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub expert_ffn: usize,
    pub gating: Gating,
    /// Renormalise the selected experts' weights to sum to one.
    pub normalize_topk: bool,
    /// Hidden size of the always-on shared expert, if any.
    pub shared_ffn: Option<usize>,
    /// The shared expert's output is scaled by sigmoid(w . x) (Qwen-MoE).
    pub shared_gate: bool,
    /// The router and every expert's gate, up and down products add a bias (GPT-OSS:
    /// `ffn_gate_inp.bias`, `ffn_{gate,up,down}_exps.bias`).
    #[serde(default)]
    pub biases: bool,
    /// DeepSeek V3's group-limited choice: the experts in `[0]` groups, each group ranked by the
    /// sum of its two best scores, the experts chosen from the best `[1]` groups only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub groups: Option<[usize; 2]>,
    /// A bias added to the scores for the choice only, not for the weights
    /// (`blk.N.exp_probs_b.bias`, a checkpoint's `e_score_correction_bias`).
    #[serde(default)]
    pub choice_bias: bool,
    /// The chosen experts' weights are multiplied by this after any renormalization
    /// (`expert_weights_scale`, `routed_scaling_factor`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights_scale: Option<f64>,
    /// The first layers have a dense FFN (`n_ff` wide) in place of the experts
    /// (`leading_dense_block_count`, `first_k_dense_replace`).
    #[serde(default)]
    pub first_dense: usize,
}

/// One step of a transformer block, in execution order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    AttnNorm,
    QkvProj,
    QkNorm,
    Rope,
    Attention,
    /// The attention output times the sigmoid of a gate the query projection also makes
    /// (Qwen3-Next: taps `attn_gate` from `QkvProj`, `attn_gated`).
    AttnGate,
    AttnOutProj,
    /// RMSNorm of the attention output before its residual add (Gemma 2/3: tap `attn_post_norm`).
    AttnPostNorm,
    AttnResidual,
    FfnNorm,
    DenseFfn,
    MoeFfn,
    /// RMSNorm of the FFN output before its residual add (Gemma 2/3: tap `ffn_post_norm`).
    FfnPostNorm,
    FfnResidual,
    /// A state-space block's input projection (tap `ssm_in`: z, x/B/C and the time steps).
    SsmInProj,
    /// The causal depthwise convolution of x/B/C over the last `d_conv` positions, then SiLU
    /// (tap `ssm_conv`).
    SsmConv,
    /// The selective scan: each head's state decays by `exp(dt A)` and takes `dt x B`; the
    /// output reads it through C, plus `D x` (taps `ssm_state`, `ssm_scan`).
    SsmScan,
    /// The scan's output times SiLU of the gate z, RMS-normed per group (tap `ssm_norm`).
    SsmNorm,
    /// The output projection (tap `ssm_out`).
    SsmOutProj,
    /// The residual add that ends a layer without a feed-forward block (Mamba-2: tap `l_out`).
    MixerResidual,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub arch: Arch,
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub norm_eps: f64,
    pub rope: RopeSpec,
    pub qk_norm: bool,
    pub qkv_bias: bool,
    pub out_bias: bool,
    pub tied_output: bool,
    pub activation: Activation,
    pub moe: Option<MoeSpec>,
    pub sliding_window: Option<usize>,
    /// With a sliding window: 0 windows every layer; N windows every layer but each N-th (layers
    /// N-1, 2N-1, ... attend to every position), as Gemma 3 does with N = 6.
    #[serde(default)]
    pub swa_period: usize,
    /// The RoPE of the windowed layers where it differs from the other layers' (Gemma 3's local
    /// base, 10,000, beside the global base its file stores).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_swa: Option<RopeSpec>,
    /// The embeddings are multiplied by this before the first layer (Gemma: sqrt(n_embd), as f32).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embd_scale: Option<f64>,
    /// RMSNorm of the attention output and of the FFN output before each residual add (Gemma 2/3:
    /// `post_attention_norm` and `post_ffw_norm`, stages `AttnPostNorm` and `FfnPostNorm`).
    #[serde(default)]
    pub post_norms: bool,
    /// Every query head has a learned logit (`blk.L.attn_sinks.weight`, one per head) that joins
    /// its softmax over the scores and takes its share of the weight to no value (GPT-OSS).
    #[serde(default)]
    pub attn_sinks: bool,
    /// Gemma 2's soft-capping of the attention scores (after the query scale): `c * tanh(s / c)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_softcap: Option<f64>,
    /// Gemma 2's soft-capping of the output logits: `c * tanh(l / c)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_softcap: Option<f64>,
    /// Phi-3 stores Q, K and V as one `attn_qkv` tensor (rows: Q, then K, then V) and gate and up
    /// as one `ffn_up` tensor of twice the rows (gate first). The loaders hand them out split
    /// (`loader::Unfused`): the interpreter and every device read `attn_q`, `ffn_gate`, ... as
    /// for any other model.
    #[serde(default)]
    pub fused: bool,
    pub context_length: usize,
    /// Attention score scale; 1/sqrt(head_dim) unless the model says otherwise.
    pub attn_scale: f64,
    /// Each residual branch (attention or state-space block, FFN) is multiplied by this before
    /// it is added (Granite's `residual_multiplier`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub residual_scale: Option<f64>,
    /// The logits are divided by this (Granite's `logits_scaling`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_scale: Option<f64>,
    /// The attention layers rotate nothing (no `Rope` stage: Granite 4.0-H's attention).
    #[serde(default)]
    pub no_rope: bool,
    /// The query projection makes, per head, the query and then a gate of the same width; the
    /// attention output is multiplied by the gate's sigmoid before its projection (Qwen3-Next:
    /// `attn_q` of twice the query width, stage `AttnGate`).
    #[serde(default)]
    pub attn_gate: bool,
    /// The state-space layers' dimensions (Mamba-2, gated DeltaNet); which layers are
    /// state-space layers the per-layer shapes say (no key/value heads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssm: Option<SsmBlock>,
    /// The latent-attention dimensions (DeepSeek V2/V3): every attention layer is then an
    /// [`MlaBlock`] with its own head count; `head_dim` is a query head's width
    /// (`qk_nope + qk_rope`) and the RoPE rotates the last `qk_rope` of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<MlaBlock>,
    /// Every layer: its block kind and dimensions, and the stages it runs in order
    /// ([`ModelSpec::derive_layers`]). `n_head` and `n_head_kv` above are the widest layer's.
    pub layers: Vec<LayerSpec>,
}

fn spec_err(msg: impl Into<String>) -> OracleError {
    OracleError::Spec(msg.into())
}

impl ModelSpec {
    /// Every distinct RoPE the layers use (`rope`, then `rope_swa` if any layer uses it).
    pub fn ropes(&self) -> Vec<&RopeSpec> {
        let mut v = vec![&self.rope];
        if let Some(r) = &self.rope_swa {
            if self
                .layers
                .iter()
                .any(|l| matches!(l.block, BlockKind::Attention(a) if a.local_rope))
            {
                v.push(r);
            }
        }
        v
    }

    /// Checks the dimensions fit together, so the interpreter can index without surprises.
    pub fn validate(&self) -> Result<()> {
        let pos = |v: usize, n: &str| if v == 0 { Err(spec_err(format!("{n} is zero"))) } else { Ok(()) };
        pos(self.n_vocab, "n_vocab")?;
        pos(self.n_embd, "n_embd")?;
        pos(self.n_layer, "n_layer")?;
        // A model of state-space layers alone has no heads.
        if self.has_attention() || self.layers.is_empty() {
            pos(self.n_head, "n_head")?;
            pos(self.n_head_kv, "n_head_kv")?;
            pos(self.head_dim, "head_dim")?;
        }
        if let Some(b) = &self.ssm {
            b.validate()?;
        }
        self.validate_layers()?;
        if self.rope.n_rot > self.head_dim || !self.rope.n_rot.is_multiple_of(2) {
            return Err(spec_err(format!("rope n_rot {} must be even and at most head_dim {}", self.rope.n_rot, self.head_dim)));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps >= 0.0) {
            return Err(spec_err(format!("norm eps {} is not a finite non-negative number", self.norm_eps)));
        }
        if !(self.rope.theta.is_finite() && self.rope.theta > 0.0) {
            return Err(spec_err(format!("rope theta {} is not positive", self.rope.theta)));
        }
        let positive = |v: f64, what: &str| if v.is_finite() && v > 0.0 { Ok(()) } else { Err(spec_err(format!("rope scaling {what} {v} is not a finite positive number"))) };
        match self.rope.scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => positive(factor, "factor")?,
            RopeScaling::Yarn { factor, original_context, beta_fast, beta_slow, ext_factor, attn_factor, .. } => {
                positive(factor, "factor")?;
                positive(beta_fast, "yarn beta_fast")?;
                positive(beta_slow, "yarn beta_slow")?;
                positive(attn_factor, "attention factor")?;
                if !(ext_factor.is_finite() && ext_factor >= 0.0) {
                    return Err(spec_err(format!("rope scaling yarn ext_factor {ext_factor} is not a finite non-negative number")));
                }
                pos(original_context, "rope scaling original context length")?;
            }
            RopeScaling::LongRope { attn_factor, original_context, context } => {
                positive(attn_factor, "attention factor")?;
                pos(original_context, "LongRoPE original context length")?;
                if context < original_context {
                    return Err(spec_err(format!("LongRoPE context {context} is shorter than its original context {original_context}")));
                }
                if self.rope.freq_factors.is_none() {
                    return Err(spec_err("LongRoPE scaling without its per-pair frequency factors"));
                }
            }
        }
        if let Some(f) = &self.rope.freq_factors {
            if f.len() != self.rope.n_rot / 2 {
                return Err(spec_err(format!("rope frequency factors: {} values for {} rotated pairs (n_rot {})", f.len(), self.rope.n_rot / 2, self.rope.n_rot)));
            }
            if let Some((i, v)) = f.iter().enumerate().find(|(_, v)| !(v.is_finite() && **v > 0.0)) {
                return Err(spec_err(format!("rope frequency factor {i} is {v}, not a finite positive number")));
            }
        }
        if let Some(r) = &self.rope_swa {
            if !(r.theta.is_finite() && r.theta > 0.0) || r.n_rot != self.rope.n_rot || r.freq_factors.is_some() {
                return Err(spec_err(format!("the windowed layers' RoPE (base {}, {} rotated) must have a positive base, the same rotated dimensions as the other layers ({}) and no frequency factors", r.theta, r.n_rot, self.rope.n_rot)));
            }
        }
        for (what, v) in [("embedding scale", self.embd_scale), ("residual scale", self.residual_scale), ("logit scale", self.logit_scale)] {
            if let Some(e) = v.filter(|e| !(e.is_finite() && *e > 0.0)) {
                return Err(spec_err(format!("{what} {e} is not a finite positive number")));
            }
        }
        if !(self.attn_scale.is_finite() && self.attn_scale > 0.0) {
            return Err(spec_err(format!("attention scale {} is not a finite positive number", self.attn_scale)));
        }
        if self.sliding_window == Some(0) {
            return Err(spec_err("sliding window is zero"));
        }
        for (what, cap) in [("attention soft-cap", self.attn_softcap), ("final logit soft-cap", self.final_softcap)] {
            if let Some(c) = cap.filter(|c| !(c.is_finite() && *c > 0.0)) {
                return Err(spec_err(format!("{what} {c} is not a finite positive number")));
            }
        }
        if self.post_norms && self.stored_ffn_norm() != "ffn_norm.weight" {
            return Err(spec_err(format!(
                "a {} model stores its FFN norm as `{}`, which post-norms (Gemma) would read as the attention output's norm",
                self.arch,
                self.stored_ffn_norm()
            )));
        }
        if self.fused && (self.moe.is_some() || self.qkv_bias || !self.uniform_heads()) {
            return Err(spec_err("fused Q/K/V and gate/up tensors (phi3) are read for dense models without Q/K/V biases and with one head count for every layer only"));
        }
        if let Some(m) = &self.moe {
            if m.n_expert_used == 0 || m.n_expert_used > m.n_expert {
                return Err(spec_err(format!("{} experts used out of {}", m.n_expert_used, m.n_expert)));
            }
            if let Some([g, k]) = m.groups.filter(|[g, k]| *g == 0 || !m.n_expert.is_multiple_of(*g) || *k == 0 || k > g) {
                return Err(spec_err(format!("{} experts in {g} groups, {k} of them used: the groups must divide the experts and at least one, at most all, be used", m.n_expert)));
            }
        }
        Ok(())
    }

    /// Builds the spec of a GGUF model from its metadata and the tensors it holds.
    pub fn from_gguf(g: &GgufFile) -> Result<ModelSpec> {
        let arch_name = g.get("general.architecture").and_then(|v| v.as_str()).ok_or_else(|| spec_err(format!("{}: no general.architecture", g.path)))?;
        let arch = Arch::from_gguf(arch_name).ok_or_else(|| spec_err(format!("{}: architecture `{arch_name}` is not supported ({})", g.path, Arch::gguf_names())))?;
        let row = arch.row();
        let key = |k: &str| format!("{arch}.{k}");
        // Present with another type is an error, not the default (`GgufFile::field`).
        let opt_u = |k: &str| g.field(&key(k), |v| v.as_u64().and_then(|x| usize::try_from(x).ok()), "a non-negative integer").map_err(spec_err);
        let req_u = |k: &str| -> Result<usize> { opt_u(k)?.ok_or_else(|| spec_err(format!("{}: missing metadata `{}`", g.path, key(k)))) };
        let opt_f = |k: &str| g.field(&key(k), |v| v.as_f64(), "a number").map_err(spec_err);
        let has = |name: &str| g.tensor(name).is_some();

        let style = row.rope;
        let gemma2 = row.gemma == Some(GemmaKind::Gemma2);
        let gemma = row.gemma.is_some();
        let oss = arch == Arch::GptOss;
        let n_embd = req_u("embedding_length")?;
        // A head count is one value, or one per layer (llama.cpp's per-layer arrays); the model's
        // own is the widest layer's.
        let n_layer = req_u("block_count")?;
        // The layer count is a claim until the tensors back it: checked before anything is sized
        // by it.
        if let Some(last) = n_layer.checked_sub(1).map(|l| format!("blk.{l}.attn_norm.weight")) {
            if g.tensor(&last).is_none() {
                return Err(spec_err(format!("{}: block_count is {n_layer} but the file has no `{last}`", g.path)));
            }
        }
        let per_layer = |k: &str| -> Result<Option<Vec<usize>>> {
            let Some(v) = g.get(&key(k)) else {
                return Ok(None);
            };
            let bad = || {
                spec_err(format!(
                    "{}: metadata `{}` is not a non-negative integer or one per layer ({n_layer})",
                    g.path,
                    key(k)
                ))
            };
            let vals = match v.as_array() {
                Some(items) if items.len() == n_layer => items
                    .iter()
                    .map(|x| {
                        x.as_u64()
                            .and_then(|x| usize::try_from(x).ok())
                            .ok_or_else(bad)
                    })
                    .collect::<Result<Vec<_>>>()?,
                Some(_) => return Err(bad()),
                None => vec![
                    v.as_u64()
                        .and_then(|x| usize::try_from(x).ok())
                        .ok_or_else(bad)?;
                    n_layer.min(MAX_LAYERS)
                ],
            };
            Ok(Some(vals))
        };
        let layer_heads = per_layer("attention.head_count")?.ok_or_else(|| {
            spec_err(format!(
                "{}: missing metadata `{}`",
                g.path,
                key("attention.head_count")
            ))
        })?;
        let layer_heads_kv =
            per_layer("attention.head_count_kv")?.unwrap_or_else(|| layer_heads.clone());
        let n_head = layer_heads.iter().copied().max().unwrap_or(0);
        let n_head_kv = layer_heads_kv.iter().copied().max().unwrap_or(0);
        let mut heads: Vec<(usize, usize)> = layer_heads.into_iter().zip(layer_heads_kv).collect();
        if row.qwen_next {
            // Qwen3-Next's recurrent layers: one flag per layer, else every layer but each
            // `full_attention_interval`-th (llama.cpp's default 4). They have no heads.
            let flags_key = key("attention.recurrent_layers");
            let recurrent: Vec<bool> = match g.get(&flags_key) {
                Some(v) => v
                    .as_array()
                    .filter(|items| items.len() == n_layer)
                    .and_then(|items| items.iter().map(|x| x.as_bool()).collect::<Option<Vec<bool>>>())
                    .ok_or_else(|| spec_err(format!("{}: metadata `{flags_key}` is not one flag (true or false) per layer ({n_layer})", g.path)))?,
                None => {
                    let every = opt_u("full_attention_interval")?.unwrap_or(4);
                    if every == 0 {
                        return Err(spec_err(format!("{}: metadata `{}` is 0", g.path, key("full_attention_interval"))));
                    }
                    (0..heads.len()).map(|li| !(li + 1).is_multiple_of(every)).collect()
                }
            };
            for (h, r) in heads.iter_mut().zip(recurrent) {
                if r {
                    *h = (0, 0);
                }
            }
        }
        // Which layers attend through the window: every layer but each N-th (a period), or one
        // flag per layer (llama.cpp's `sliding_window_pattern`); else the architecture's rule.
        let pattern_key = key("attention.sliding_window_pattern");
        let (pattern_period, pattern_flags) = match g.get(&pattern_key) {
            None => (None, None),
            Some(v) => match (v.as_u64(), v.as_array()) {
                (Some(p), _) => (Some(usize::try_from(p).unwrap_or(usize::MAX)), None),
                (None, Some(items)) if items.len() == n_layer => {
                    let flags = items.iter().map(|x| x.as_bool()).collect::<Option<Vec<bool>>>();
                    (None, Some(flags.ok_or_else(|| spec_err(format!("{}: metadata `{pattern_key}` holds a value that is not true or false", g.path)))?))
                }
                _ => return Err(spec_err(format!("{}: metadata `{pattern_key}` is neither a period nor one flag per layer ({n_layer})", g.path))),
            },
        };
        // Latent attention (`deepseek2`): its dimensions; every head reads the one latent
        // (llama.cpp's files say one key/value head). `key_length`/`value_length` are the
        // absorbed form's (latent + rotated key, latent) where the `_mla` keys give the heads'.
        let mla = match row.mla {
            false => None,
            true => {
                let rope = req_u("rope.dimension_count")?;
                let (k, v) = match (opt_u("attention.key_length_mla")?, opt_u("attention.value_length_mla")?) {
                    (Some(k), Some(v)) => (k, v),
                    _ => (req_u("attention.key_length")?, req_u("attention.value_length")?),
                };
                let b = MlaBlock {
                    n_head,
                    q_lora_rank: opt_u("attention.q_lora_rank")?.unwrap_or(0),
                    kv_lora_rank: req_u("attention.kv_lora_rank")?,
                    qk_nope: k.checked_sub(rope).filter(|n| *n > 0).ok_or_else(|| spec_err(format!("{}: a key of {k} leaves no unrotated part beside rope.dimension_count {rope}", g.path)))?,
                    qk_rope: rope,
                    v_head_dim: v,
                };
                b.validate().map_err(|e| spec_err(format!("{}: {e}", g.path)))?;
                heads.iter_mut().for_each(|h| h.1 = h.0);
                Some(b)
            }
        };
        let n_head_kv = if mla.is_some() { n_head } else { n_head_kv };
        let head_dim = match opt_u("attention.key_length")? {
            _ if mla.is_some() => mla.map_or(0, |b| b.qk_head_dim()),
            Some(v) => v,
            // No layer attends (a state-space model): no head width.
            None if n_head == 0 => 0,
            None if n_head > 0 && n_embd % n_head == 0 => n_embd / n_head,
            None => return Err(spec_err(format!("{}: embedding_length {n_embd} not divisible by head_count {n_head}", g.path))),
        };
        if let Some(v) = opt_u("attention.value_length")?.filter(|&v| v != head_dim && mla.is_none()) {
            return Err(spec_err(format!("{}: attention.value_length {v} differs from the key length {head_dim}: value heads of another size are not supported", g.path)));
        }
        let n_vocab = match opt_u("vocab_size")? {
            Some(v) => v,
            None => g
                .tensor("token_embd.weight")
                .and_then(|t| t.dims.get(1).copied())
                .ok_or_else(|| spec_err(format!("{}: no vocab size and no token_embd.weight", g.path)))? as usize,
        };
        let ctx = opt_u("context_length")?.unwrap_or(4096);
        let scaling_type = g.field(&key("rope.scaling.type"), |v| v.as_str(), "a string").map_err(spec_err)?.unwrap_or("none");
        let scaling = match scaling_type {
            "none" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: opt_f("rope.scaling.factor")?.unwrap_or(1.0),
            },
            "yarn" => RopeScaling::Yarn {
                factor: opt_f("rope.scaling.factor")?.unwrap_or(1.0),
                original_context: opt_u("rope.scaling.original_context_length")?.unwrap_or(ctx),
                beta_fast: opt_f("rope.scaling.yarn_beta_fast")?.unwrap_or(32.0),
                beta_slow: opt_f("rope.scaling.yarn_beta_slow")?.unwrap_or(1.0),
                ext_factor: opt_f("rope.scaling.yarn_ext_factor")?.unwrap_or(1.0),
                attn_factor: opt_f("rope.scaling.attn_factor")?.unwrap_or(1.0),
                // GPT-OSS is defined with the correction range as computed (its checkpoints'
                // `truncate: false`); a GGUF does not say, and llama.cpp rounds it out.
                truncate: !oss,
            },
            other => return Err(spec_err(format!("{}: rope scaling `{other}` is not supported (none, linear, yarn)", g.path))),
        };
        let moe = match opt_u("expert_count")? {
            Some(n_expert) if n_expert > 0 => {
                // GPT-OSS's softmax over the chosen experts' logits (llama.cpp's gating 3) is
                // the softmax over all of them renormalized over the chosen.
                let gating = match opt_u("expert_gating_func")? {
                    None | Some(1) => Gating::Softmax,
                    Some(2) => Gating::Sigmoid,
                    Some(3) if oss => Gating::Softmax,
                    Some(v) => return Err(spec_err(format!("{}: expert_gating_func {v} is not supported", g.path))),
                };
                let normalize_default = row.moe_normalize_default;
                Some(MoeSpec {
                    n_expert,
                    n_expert_used: req_u("expert_used_count")?,
                    expert_ffn: opt_u("expert_feed_forward_length")?.unwrap_or(opt_u("feed_forward_length")?.unwrap_or(0)),
                    gating,
                    normalize_topk: g.field(&key("expert_weights_norm"), |v| v.as_bool(), "true or false").map_err(spec_err)?.unwrap_or(normalize_default),
                    shared_ffn: if has("blk.0.ffn_up_shexp.weight") {
                        Some(opt_u("expert_shared_feed_forward_length")?.unwrap_or(0))
                    } else {
                        None
                    },
                    shared_gate: has("blk.0.ffn_gate_inp_shexp.weight"),
                    biases: has("blk.0.ffn_gate_inp.bias"),
                    groups: None,
                    choice_bias: false,
                    weights_scale: None,
                    first_dense: 0,
                })
            }
            _ => None,
        };
        // Per-pair frequency factors, one finite positive value per rotated pair: Llama 3.1's
        // `rope_freqs`, or Phi-3 128k's LongRoPE pair, of which an engine at most at the original
        // context (as llama.cpp then, and Transformers up to that many positions) uses the short.
        let n_rot = opt_u("rope.dimension_count")?.unwrap_or(head_dim);
        let factors = |name: &str| -> Result<Option<Vec<f32>>> {
            let Some(t) = g.tensor(name) else { return Ok(None) };
            let bad = |why: String| spec_err(format!("{}: tensor `{name}` {why}", g.path));
            let f = g.tensor_f32(t).map_err(|e| bad(e.to_string()))?;
            if f.len() != n_rot / 2 {
                return Err(bad(format!("holds {} values, but rope.dimension_count {n_rot} makes {} rotated pairs, one factor each", f.len(), n_rot / 2)));
            }
            if let Some((i, v)) = f.iter().enumerate().find(|(_, v)| !(v.is_finite() && **v > 0.0)) {
                return Err(bad(format!("holds {v} at element {i}; RoPE frequency factors must be finite and positive")));
            }
            Ok(Some(f))
        };
        let (short, long) = (factors("rope_factors_short.weight")?, factors("rope_factors_long.weight")?);
        let mut scaling = scaling;
        let mut longrope_factors = None;
        let freq_factors = match (factors("rope_freqs.weight")?, short, long) {
            (f, None, None) => f,
            (None, Some(short), Some(long)) if scaling == RopeScaling::None => {
                let original_context = opt_u("rope.scaling.original_context_length")?.unwrap_or(ctx);
                scaling = RopeScaling::LongRope { attn_factor: opt_f("rope.scaling.attn_factor")?.unwrap_or(1.0), original_context, context: original_context };
                longrope_factors = Some((short.clone(), long));
                Some(short)
            }
            _ => return Err(spec_err(format!("{}: LongRoPE needs both `rope_factors_short.weight` and `rope_factors_long.weight`, without `rope_freqs.weight` or another rope scaling", g.path))),
        };
        // State-space layers (Mamba-2): their dimensions, for every layer the head counts leave
        // without key/value heads.
        let ssm = match opt_u("ssm.inner_size")? {
            None => None,
            Some(d_inner) => Some(SsmBlock {
                d_inner,
                d_state: req_u("ssm.state_size")?,
                n_group: opt_u("ssm.group_count")?.unwrap_or(1),
                n_head: req_u("ssm.time_step_rank")?,
                d_conv: req_u("ssm.conv_kernel")?,
                kind: if row.qwen_next { SsmKind::GatedDelta } else { SsmKind::Mamba2 },
            }),
        };
        // The attention weights a model has, as its first attention layer holds them (a hybrid's
        // first layer may be a recurrent one).
        let first_attn = heads.iter().position(|h| h.0 > 0).unwrap_or(0);
        let has_attn = |tail: &str| has(&format!("blk.{first_attn}.{tail}"));
        let mut spec = ModelSpec {
            arch,
            n_vocab,
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            head_dim,
            n_ff: opt_u("feed_forward_length")?.unwrap_or(0),
            norm_eps: opt_f("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
            rope: RopeSpec {
                style,
                theta: opt_f("rope.freq_base")?.unwrap_or(10_000.0),
                n_rot,
                scaling,
                freq_factors,
                longrope_factors,
            },
            qk_norm: has_attn("attn_q_norm.weight"),
            qkv_bias: has_attn("attn_q.bias"),
            out_bias: has_attn("attn_output.bias"),
            tied_output: !has("output.weight"),
            activation: if gemma {
                Activation::GeluTanh
            } else if oss {
                Activation::SwigluOai
            } else {
                Activation::Silu
            },
            moe,
            sliding_window: opt_u("attention.sliding_window")?.filter(|w| *w > 0),
            swa_period: if let Some(p) = pattern_period {
                p
            } else if gemma2 {
                GEMMA2_SWA_PERIOD
            } else if gemma {
                GEMMA3_SWA_PERIOD
            } else if oss {
                GPT_OSS_SWA_PERIOD
            } else {
                0
            },
            rope_swa: None,
            embd_scale: if row.granite { opt_f("embedding_scale")? } else { gemma.then(|| gemma_embd_scale(n_embd)) },
            post_norms: gemma,
            attn_sinks: has_attn("attn_sinks.weight"),
            attn_softcap: opt_f("attn_logit_softcapping")?.filter(|_| gemma2),
            final_softcap: opt_f("final_logit_softcapping")?.filter(|_| gemma2),
            fused: row.fused,
            context_length: ctx,
            attn_scale: match opt_f("attention.scale")?.filter(|_| row.granite) {
                Some(s) => s,
                None if head_dim > 0 => 1.0 / (head_dim as f64).sqrt(),
                None => 1.0,
            },
            residual_scale: if row.granite { opt_f("residual_scale")? } else { None },
            logit_scale: if row.granite { opt_f("logit_scale")? } else { None },
            // Granite 4.0-H's attention takes no positions (llama.cpp rotates a granite
            // hybrid's queries and keys only where the file says RoPE was trained).
            no_rope: row.granite && !g.field(&key("rope.scaling.finetuned"), |v| v.as_bool(), "true or false").map_err(spec_err)?.unwrap_or(false),
            attn_gate: row.qwen_next,
            ssm,
            mla,
            layers: Vec::new(),
        };
        if let Some(b) = mla {
            let leading_dense = opt_u("leading_dense_block_count")?.unwrap_or(0);
            let groups = match (opt_u("expert_group_count")?, opt_u("expert_group_used_count")?) {
                (Some(n), Some(k)) if n > 1 => Some([n, k]),
                _ => None,
            };
            let routing = DeepseekRouting {
                leading_dense,
                groups,
                weights_scale: opt_f("expert_weights_scale")?,
                shared_experts: opt_u("expert_shared_count")?.unwrap_or(0),
                choice_bias: has(&format!("blk.{leading_dense}.exp_probs_b.bias")),
            };
            spec.mla_from_gguf(&b, &routing, opt_f("rope.scaling.yarn_log_multiplier")?.unwrap_or(0.0)).map_err(|e| spec_err(format!("{}: {e}", g.path)))?;
        }
        if gemma {
            // What a `gemma3` GGUF does not store, as llama.cpp and Transformers take it: the
            // local layers' RoPE (base 10,000, unscaled), and the query scale, 1/sqrt(head_dim)
            // but for the 27B model (62 layers), whose query_pre_attn_scalar is n_embd / n_head.
            // Gemma 2 rotates every layer with one base; its 27B model has 46 layers.
            if !gemma2 {
                spec.rope_swa = Some(spec.rope.with_base(GEMMA3_LOCAL_ROPE_BASE));
            }
            if spec.n_layer == if gemma2 { 46 } else { 62 } {
                spec.attn_scale = 1.0 / ((n_embd / n_head) as f64).sqrt();
            }
        }
        let shapes: Vec<LayerShape> = heads
            .iter()
            .enumerate()
            .map(|(li, &(n_head, n_head_kv))| {
                let windowed = match &pattern_flags {
                    Some(f) => f[li],
                    None => spec.scalar_shape(li).windowed,
                };
                LayerShape {
                    n_head,
                    n_head_kv,
                    windowed,
                }
            })
            .collect();
        spec.derive_layers(Some(&shapes))?;
        spec.set_context(configured_context()?)?;
        spec.validate()?;
        spec.check_against_tensors(g)?;
        Ok(spec)
    }

    /// Configures the model for an engine running `context` positions (None: the default), as
    /// llama.cpp's context size does: a LongRoPE model takes its short factors up to its original
    /// context and its long factors, at every position, when the context is longer. Other models
    /// are unchanged. A flat file holds the factors of the context it was exported for, and
    /// refuses another.
    pub fn set_context(&mut self, context: Option<usize>) -> Result<()> {
        let RopeScaling::LongRope { original_context, context: current, .. } = &mut self.rope.scaling else { return Ok(()) };
        let Some(want) = context else { return Ok(()) };
        let want = want.max(*original_context);
        match &self.rope.longrope_factors {
            Some((short, long)) => {
                self.rope.freq_factors = Some(if want > *original_context { long.clone() } else { short.clone() });
                *current = want;
                Ok(())
            }
            None if want == *current => Ok(()),
            None => Err(spec_err(format!(
                "this model holds the LongRoPE factors of a {current}-position context (original context {original_context}) only, not those of {want} positions (a flat file: export it again with --context {want})"
            ))),
        }
    }

    /// The sizes every loader allocates by (vocabulary, width, layer count) must be backed by the
    /// file's tensors: metadata claiming 2^40 tokens or layers over a small file is an error here,
    /// not a huge allocation in whichever device loads the file next.
    fn check_against_tensors(&self, g: &GgufFile) -> Result<()> {
        let te = g.tensor("token_embd.weight").ok_or_else(|| spec_err(format!("{}: missing tensor `token_embd.weight`", g.path)))?;
        if te.dims.as_slice() != [self.n_embd as u64, self.n_vocab as u64] {
            return Err(spec_err(format!(
                "{}: tensor `token_embd.weight` has dims {:?}, but the metadata says embedding_length {} and vocabulary {}",
                g.path, te.dims, self.n_embd, self.n_vocab
            )));
        }
        // The tokenizer's ids index the embedding's and the output head's rows, so the two counts
        // must agree (llama.cpp refuses a mismatch too; its converters pad a short vocabulary
        // with `[PAD...]` tokens, so a real file agrees): more tokens would read past the rows,
        // fewer leave rows that no id names and logits that no id decodes.
        if let Some(tokens) = g.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
            if tokens.len() != self.n_vocab {
                let output = match g.tensor("output.weight") {
                    Some(o) => format!(", `output.weight` {} rows", o.dims.get(1).copied().unwrap_or(0)),
                    None => String::new(),
                };
                return Err(spec_err(format!(
                    "{}: the tokenizer holds {} tokens (tokenizer.ggml.tokens) but the model has {} (`token_embd.weight` {} rows{output}): ids and rows must agree",
                    g.path,
                    tokens.len(),
                    self.n_vocab,
                    self.n_vocab
                )));
            }
        }
        self.check_no_unread(g.tensors.iter().map(|t| t.name.as_str()), "block_count").map_err(|e| spec_err(format!("{}: {e}", g.path)))
    }
}

mod arch;
pub use arch::{Arch, ArchRow, GemmaKind, ARCHES};
mod layers;
pub use layers::{AttentionBlock, BlockKind, LayerShape, LayerSpec, MlaBlock, SsmBlock, SsmKind, MAX_LAYERS};
mod hf;
mod tensors;
mod mla;
use mla::DeepseekRouting;
pub use tensors::{DELTA_TAILS, SSM_TAILS};
#[cfg(test)]
mod tests;
