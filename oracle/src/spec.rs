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
}

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
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub arch: String,
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
    /// Phi-3 stores Q, K and V as one `attn_qkv` tensor (rows: Q, then K, then V) and gate and up
    /// as one `ffn_up` tensor of twice the rows (gate first). The loaders hand them out split
    /// (`loader::Unfused`): the interpreter and every device read `attn_q`, `ffn_gate`, ... as
    /// for any other model.
    #[serde(default)]
    pub fused: bool,
    pub context_length: usize,
    /// Attention score scale; 1/sqrt(head_dim) unless the model says otherwise.
    pub attn_scale: f64,
    /// The stages of every block, in order.
    pub stages: Vec<Stage>,
}

fn spec_err(msg: impl Into<String>) -> OracleError {
    OracleError::Spec(msg.into())
}

impl ModelSpec {
    /// Derives the stage list from the feature flags.
    pub fn derive_stages(&mut self) {
        let mut s = vec![Stage::AttnNorm, Stage::QkvProj];
        if self.qk_norm {
            s.push(Stage::QkNorm);
        }
        s.extend([Stage::Rope, Stage::Attention, Stage::AttnOutProj]);
        if self.post_norms {
            s.push(Stage::AttnPostNorm);
        }
        s.extend([Stage::AttnResidual, Stage::FfnNorm]);
        s.push(if self.moe.is_some() { Stage::MoeFfn } else { Stage::DenseFfn });
        if self.post_norms {
            s.push(Stage::FfnPostNorm);
        }
        s.push(Stage::FfnResidual);
        self.stages = s;
    }

    /// Whether layer `li` attends through the sliding window.
    pub fn layer_windowed(&self, li: usize) -> bool {
        self.sliding_window.is_some() && (self.swa_period == 0 || (li + 1) % self.swa_period != 0)
    }

    /// Layer `li`'s sliding window (None: it sees every earlier position).
    pub fn layer_window(&self, li: usize) -> Option<usize> {
        self.sliding_window.filter(|_| self.layer_windowed(li))
    }

    /// Layer `li`'s RoPE: `rope_swa` on a windowed layer where the model has one, else `rope`.
    pub fn layer_rope(&self, li: usize) -> &RopeSpec {
        match &self.rope_swa {
            Some(r) if self.layer_windowed(li) => r,
            _ => &self.rope,
        }
    }

    /// Every distinct RoPE the layers use (`rope`, then `rope_swa` if any layer uses it).
    pub fn ropes(&self) -> Vec<&RopeSpec> {
        let mut v = vec![&self.rope];
        if let Some(r) = &self.rope_swa {
            if (0..self.n_layer).any(|l| self.layer_windowed(l)) {
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
        pos(self.n_head, "n_head")?;
        pos(self.n_head_kv, "n_head_kv")?;
        pos(self.head_dim, "head_dim")?;
        if !self.n_head.is_multiple_of(self.n_head_kv) {
            return Err(spec_err(format!("n_head {} is not a multiple of n_head_kv {}", self.n_head, self.n_head_kv)));
        }
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
            RopeScaling::Yarn { factor, original_context, beta_fast, beta_slow, ext_factor, attn_factor } => {
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
        if let Some(e) = self.embd_scale {
            if !(e.is_finite() && e > 0.0) {
                return Err(spec_err(format!("embedding scale {e} is not a finite positive number")));
            }
        }
        if self.sliding_window == Some(0) {
            return Err(spec_err("sliding window is zero"));
        }
        if self.fused && (self.moe.is_some() || self.qkv_bias) {
            return Err(spec_err("fused Q/K/V and gate/up tensors (phi3) are read for dense models without Q/K/V biases only"));
        }
        if let Some(m) = &self.moe {
            if m.n_expert_used == 0 || m.n_expert_used > m.n_expert {
                return Err(spec_err(format!("{} experts used out of {}", m.n_expert_used, m.n_expert)));
            }
        }
        Ok(())
    }

    /// Builds the spec of a GGUF model from its metadata and the tensors it holds.
    pub fn from_gguf(g: &GgufFile) -> Result<ModelSpec> {
        let arch = g
            .get("general.architecture")
            .and_then(|v| v.as_str())
            .ok_or_else(|| spec_err(format!("{}: no general.architecture", g.path)))?
            .to_string();
        let key = |k: &str| format!("{arch}.{k}");
        // Present with another type is an error, not the default (`GgufFile::field`).
        let opt_u = |k: &str| g.field(&key(k), |v| v.as_u64().and_then(|x| usize::try_from(x).ok()), "a non-negative integer").map_err(spec_err);
        let req_u = |k: &str| -> Result<usize> { opt_u(k)?.ok_or_else(|| spec_err(format!("{}: missing metadata `{}`", g.path, key(k)))) };
        let opt_f = |k: &str| g.field(&key(k), |v| v.as_f64(), "a number").map_err(spec_err);
        let has = |name: &str| g.tensor(name).is_some();

        let style = match arch.as_str() {
            "llama" | "mistral" | "mixtral" => RopeStyle::Normal,
            "qwen2" | "qwen3" | "qwen2moe" | "qwen3moe" | "phi3" | "gemma3" => RopeStyle::Neox,
            other => return Err(spec_err(format!("{}: architecture `{other}` is not supported (llama, qwen2, qwen3, qwen2moe, qwen3moe, phi3, gemma3)", g.path))),
        };
        let gemma = arch == "gemma3";
        let n_embd = req_u("embedding_length")?;
        let n_head = req_u("attention.head_count")?;
        let n_head_kv = opt_u("attention.head_count_kv")?.unwrap_or(n_head);
        let head_dim = match opt_u("attention.key_length")? {
            Some(v) => v,
            None if n_head > 0 && n_embd % n_head == 0 => n_embd / n_head,
            None => return Err(spec_err(format!("{}: embedding_length {n_embd} not divisible by head_count {n_head}", g.path))),
        };
        if let Some(v) = opt_u("attention.value_length")?.filter(|&v| v != head_dim) {
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
            },
            other => return Err(spec_err(format!("{}: rope scaling `{other}` is not supported (none, linear, yarn)", g.path))),
        };
        let moe = match opt_u("expert_count")? {
            Some(n_expert) if n_expert > 0 => {
                let gating = match opt_u("expert_gating_func")? {
                    None | Some(1) => Gating::Softmax,
                    Some(2) => Gating::Sigmoid,
                    Some(v) => return Err(spec_err(format!("{}: expert_gating_func {v} is not supported", g.path))),
                };
                let normalize_default = matches!(arch.as_str(), "llama" | "mixtral" | "qwen3moe");
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
        let mut spec = ModelSpec {
            arch: arch.clone(),
            n_vocab,
            n_embd,
            n_layer: req_u("block_count")?,
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
            qk_norm: has("blk.0.attn_q_norm.weight"),
            qkv_bias: has("blk.0.attn_q.bias"),
            out_bias: has("blk.0.attn_output.bias"),
            tied_output: !has("output.weight"),
            activation: if gemma { Activation::GeluTanh } else { Activation::Silu },
            moe,
            sliding_window: opt_u("attention.sliding_window")?.filter(|w| *w > 0),
            swa_period: if gemma { GEMMA3_SWA_PERIOD } else { 0 },
            rope_swa: None,
            embd_scale: gemma.then(|| (n_embd as f32).sqrt() as f64),
            post_norms: gemma,
            fused: arch == "phi3",
            context_length: ctx,
            attn_scale: 1.0 / (head_dim as f64).sqrt(),
            stages: Vec::new(),
        };
        if gemma {
            // What a `gemma3` GGUF does not store, as llama.cpp and Transformers take it: the
            // local layers' RoPE (base 10,000, unscaled), and the query scale, 1/sqrt(head_dim)
            // but for the 27B model (62 layers), whose query_pre_attn_scalar is n_embd / n_head.
            spec.rope_swa = Some(RopeSpec { theta: GEMMA3_LOCAL_ROPE_BASE, scaling: RopeScaling::None, freq_factors: None, longrope_factors: None, ..spec.rope.clone() });
            if spec.n_layer == 62 {
                spec.attn_scale = 1.0 / ((n_embd / n_head) as f64).sqrt();
            }
        }
        spec.derive_stages();
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
        let last = format!("blk.{}.attn_norm.weight", self.n_layer - 1);
        if g.tensor(&last).is_none() {
            return Err(spec_err(format!("{}: block_count is {} but the file has no `{last}`", g.path, self.n_layer)));
        }
        self.check_no_unread(g.tensors.iter().map(|t| t.name.as_str()), "block_count").map_err(|e| spec_err(format!("{}: {e}", g.path)))
    }

    /// Whether a model of this spec reads the tensor `name` (a GGUF name). The interpreter and
    /// every device loader read these and no other, so a file that holds any other is refused
    /// (`check_no_unread`). Decided per name, never by listing every layer's names: the layer
    /// count may still be an unchecked claim here.
    pub fn reads_tensor(&self, name: &str) -> bool {
        match name {
            "token_embd.weight" | "output_norm.weight" => return true,
            "output.weight" => return !self.tied_output,
            "rope_freqs.weight" => return self.rope.freq_factors.is_some() && !matches!(self.rope.scaling, RopeScaling::LongRope { .. }),
            "rope_factors_short.weight" | "rope_factors_long.weight" => return matches!(self.rope.scaling, RopeScaling::LongRope { .. }),
            _ => {}
        }
        let Some((layer, tail)) = name.strip_prefix("blk.").and_then(|r| r.split_once('.')) else { return false };
        if !layer.parse::<usize>().is_ok_and(|i| i < self.n_layer) {
            return false;
        }
        self.layer_tails(self.fused).contains(&tail)
    }

    /// The names (after `blk.N.`) of each layer's weights, in the order of a forward pass; with
    /// `fused`, Phi-3's joined `attn_qkv` and gate/up `ffn_up` in place of the separate ones.
    fn layer_tails(&self, fused: bool) -> Vec<&'static str> {
        let mut tails = vec!["attn_norm.weight"];
        if fused {
            tails.push("attn_qkv.weight");
        } else {
            for (w, b) in [("attn_q.weight", "attn_q.bias"), ("attn_k.weight", "attn_k.bias"), ("attn_v.weight", "attn_v.bias")] {
                tails.push(w);
                if self.qkv_bias {
                    tails.push(b);
                }
            }
        }
        if self.qk_norm {
            tails.extend(["attn_q_norm.weight", "attn_k_norm.weight"]);
        }
        tails.push("attn_output.weight");
        if self.out_bias {
            tails.push("attn_output.bias");
        }
        if self.post_norms {
            tails.push("post_attention_norm.weight");
        }
        tails.push("ffn_norm.weight");
        if self.post_norms {
            tails.push("post_ffw_norm.weight");
        }
        match &self.moe {
            None if fused => tails.extend(["ffn_up.weight", "ffn_down.weight"]),
            None => tails.extend(["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]),
            Some(m) => {
                tails.extend(["ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"]);
                if m.shared_ffn.is_some() {
                    tails.extend(["ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"]);
                }
                if m.shared_gate {
                    tails.push("ffn_gate_inp_shexp.weight");
                }
            }
        }
        tails
    }

    /// The weights the interpreter reads by name, in the order of a forward pass (fused tensors
    /// as the loaders hand them out: `attn_q`, `attn_k`, `attn_v`, `ffn_gate`, `ffn_up`).
    /// RoPE frequency factors are not among them: they are part of the spec. Only for a spec
    /// whose layer count was checked against a file (it lists every layer's names).
    pub fn tensor_names(&self) -> Vec<String> {
        let tails = self.layer_tails(false);
        let mut names = vec!["token_embd.weight".to_string()];
        for i in 0..self.n_layer {
            names.extend(tails.iter().map(|t| format!("blk.{i}.{t}")));
        }
        names.push("output_norm.weight".into());
        if !self.tied_output {
            names.push("output.weight".into());
        }
        names
    }

    /// Refuses tensors (GGUF names) this spec does not read: the model would run without them
    /// and the judge would be wrong without saying so. `layers_key` names the metadata that set
    /// the layer count, for the message about a layer beyond it.
    pub fn check_no_unread<'a>(&self, present: impl Iterator<Item = &'a str>, layers_key: &str) -> std::result::Result<(), String> {
        let unread: Vec<&str> = present.filter(|n| !self.reads_tensor(n)).collect();
        let Some(first) = unread.iter().min() else { return Ok(()) };
        let beyond = unread.iter().find_map(|n| n.strip_prefix("blk.")?.split_once('.')?.0.parse::<usize>().ok().filter(|&i| i >= self.n_layer));
        let why = match beyond {
            Some(i) => format!("{layers_key} is {} but the file holds tensors of layer {i}", self.n_layer),
            None => format!("a {} model with this metadata reads no such weight", self.arch),
        };
        Err(format!("{} tensor(s) would not be read, e.g. `{first}`: {why}; a file whose weights would be ignored is refused", unread.len()))
    }

    /// Builds the spec of a safetensors model from its Hugging Face `config.json`.
    pub fn from_hf_config(cfg: &serde_json::Value, file: &str) -> Result<ModelSpec> {
        let err = |m: String| OracleError::Safetensors { file: file.to_string(), reason: m };
        let top = Fields { obj: cfg, at: "", file };
        let u = |k: &str| top.u(k);
        let req = |k: &str| u(k)?.ok_or_else(|| err(format!("config.json: missing integer `{k}`")));
        let model_type = top.s("model_type")?.unwrap_or("").to_string();
        // The GGUF architecture each model type converts to (Mixtral is a llama with experts).
        let arch = match model_type.as_str() {
            "llama" | "mistral" | "mixtral" => "llama",
            "qwen2" => "qwen2",
            "qwen3" => "qwen3",
            "qwen2_moe" => "qwen2moe",
            "qwen3_moe" => "qwen3moe",
            "phi3" => "phi3",
            other => return Err(err(format!("config.json: model_type `{other}` is not supported (llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, phi3)"))),
        };
        let qwen = arch.starts_with("qwen");
        let n_embd = req("hidden_size")?;
        let n_head = req("num_attention_heads")?;
        let head_dim = u("head_dim")?.unwrap_or(n_embd.checked_div(n_head).unwrap_or(0));
        let ctx = u("max_position_embeddings")?.unwrap_or(4096);
        // RoPE: `rope_theta` and `rope_scaling` at the top level, or (newer transformers) both
        // in `rope_parameters`.
        let rope_params = match top.get("rope_parameters") {
            Some(p) if p.is_object() => Some(Fields { obj: p, at: "rope_parameters.", file }),
            Some(p) => return Err(err(format!("config.json: `rope_parameters` is {p}, expected an object"))),
            None => None,
        };
        let theta = match &rope_params {
            Some(p) if p.get("rope_theta").is_some() => p.f("rope_theta")?,
            _ => top.f("rope_theta")?,
        }
        .unwrap_or(10_000.0);
        // transformers rotates only this share of each head where a config sets it; the
        // architectures read here rotate whole heads.
        for fields in [Some(&top), rope_params.as_ref()].into_iter().flatten() {
            if let Some(share) = fields.f("partial_rotary_factor")?.filter(|&x| x != 1.0) {
                return Err(err(format!("config.json: {}partial_rotary_factor {share} is not supported (whole heads rotate)", fields.at)));
            }
        }
        let scaling_fields = match (&rope_params, top.get("rope_scaling")) {
            (Some(p), _) => Some(*p),
            (None, Some(s)) if s.is_object() => Some(Fields { obj: s, at: "rope_scaling.", file }),
            (None, Some(s)) => return Err(err(format!("config.json: `rope_scaling` is {s}, expected an object or null"))),
            (None, None) => None,
        };
        let mut freq_factors = None;
        let mut longrope_factors = None;
        let scaling = match scaling_fields {
            None => RopeScaling::None,
            Some(s) => {
                let ty = match s.get("rope_type") {
                    Some(_) => s.s("rope_type")?,
                    None => s.s("type")?,
                }
                .unwrap_or("");
                let factor = s.f("factor")?.unwrap_or(1.0);
                match ty {
                    "default" => RopeScaling::None,
                    "linear" => RopeScaling::Linear { factor },
                    "yarn" => RopeScaling::Yarn {
                        factor,
                        original_context: s.u("original_max_position_embeddings")?.unwrap_or(ctx),
                        beta_fast: s.f("beta_fast")?.unwrap_or(32.0),
                        beta_slow: s.f("beta_slow")?.unwrap_or(1.0),
                        ext_factor: 1.0,
                        // Hugging Face scales cos/sin by `attention_factor` as given, defaulting
                        // to 1 + 0.1 ln(factor); ours (llama.cpp's) multiplies `attn_factor` by
                        // that default itself, so a given value is divided by it here.
                        attn_factor: match s.f("attention_factor")? {
                            Some(a) if factor > 0.0 => a / (1.0 + 0.1 * factor.ln()),
                            _ => 1.0,
                        },
                    },
                    "llama3" => {
                        let low = s.f("low_freq_factor")?.unwrap_or(1.0);
                        let high = s.f("high_freq_factor")?.unwrap_or(4.0);
                        let original = s.u("original_max_position_embeddings")?.unwrap_or(8192);
                        if !(factor.is_finite() && factor > 0.0 && low.is_finite() && high.is_finite() && high > low && low > 0.0 && original > 0) {
                            return Err(err(format!("config.json: {}llama3 rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0 (factor {factor}, low {low}, high {high}, original {original})", s.at)));
                        }
                        freq_factors = Some(llama3_freq_factors(theta, head_dim, factor, low, high, original));
                        RopeScaling::None
                    }
                    // Phi-3's LongRoPE ("su" in its first configs): the short factors (what an
                    // engine at most at the original context uses), and cos/sin scaled by
                    // `attention_factor`, by default sqrt(1 + ln(s) / ln(original)) for the
                    // extension s = max_position_embeddings / original (1 when s <= 1).
                    "longrope" | "su" => {
                        let pairs = |k: &str| -> Result<Vec<f32>> {
                            let xs = s.typed(k, |v| v.as_array(), "an array of numbers")?.ok_or_else(|| err(format!("config.json: {}longrope scaling needs `{k}`", s.at)))?;
                            let f: Vec<f32> = xs.iter().map(|x| x.as_f64().map(|x| x as f32).filter(|x| x.is_finite() && *x > 0.0)).collect::<Option<_>>().ok_or_else(|| err(format!("config.json: `{}{k}` holds a value that is not a finite positive number", s.at)))?;
                            if f.len() != head_dim / 2 {
                                return Err(err(format!("config.json: `{}{k}` has {} values for {} rotated pairs", s.at, f.len(), head_dim / 2)));
                            }
                            Ok(f)
                        };
                        let (short, long) = (pairs("short_factor")?, pairs("long_factor")?);
                        let original = match s.u("original_max_position_embeddings")? {
                            Some(o) => o,
                            None => top.u("original_max_position_embeddings")?.ok_or_else(|| err("config.json: longrope scaling needs `original_max_position_embeddings`".into()))?,
                        };
                        let extension = ctx as f64 / original.max(1) as f64;
                        let attn_factor = match s.f("attention_factor")? {
                            Some(a) => a,
                            None if extension <= 1.0 || original <= 1 => 1.0,
                            None => (1.0 + extension.ln() / (original as f64).ln()).sqrt(),
                        };
                        freq_factors = Some(short.clone());
                        longrope_factors = Some((short, long));
                        RopeScaling::LongRope { attn_factor, original_context: original, context: original }
                    }
                    other => return Err(err(format!("config.json: rope type `{other}` is not supported (default, linear, yarn, llama3, longrope)"))),
                }
            }
        };
        let attention_bias = top.b("attention_bias")?.unwrap_or(false);
        let n_layer = req("num_hidden_layers")?;
        // Mistral and Phi-3 window every layer by `sliding_window` (null: none). Qwen2/Qwen3 window only
        // with `use_sliding_window`, and then only layers from `max_window_layers` on (their
        // configs' default: 28): all of them (0) or none (>= the layer count) is one window for
        // the model; a split is not.
        let sliding_window = match model_type.as_str() {
            "mistral" | "mixtral" | "phi3" => u("sliding_window")?,
            _ if qwen && top.b("use_sliding_window")?.unwrap_or(false) => match u("max_window_layers")?.unwrap_or(28) {
                0 => u("sliding_window")?,
                m if m >= n_layer => None,
                m => return Err(err(format!("config.json: a sliding window on layers {m}..{n_layer} only (max_window_layers {m}) is not supported: one window for all layers or none"))),
            },
            _ => None,
        };
        let act = match top.s("hidden_act")?.unwrap_or("silu") {
            "silu" | "swish" => Activation::Silu,
            "gelu_pytorch_tanh" | "gelu_tanh" => Activation::GeluTanh,
            other => return Err(err(format!("config.json: hidden_act `{other}` is not supported"))),
        };
        // Experts: Mixtral routes every layer through `num_local_experts` experts of
        // `intermediate_size` and renormalizes its top-k weights; Qwen-MoE has `num_experts` of
        // `moe_intermediate_size`, renormalizes when `norm_topk_prob` (transformers' default:
        // false) and (Qwen2-MoE) adds a shared expert scaled by sigmoid(shared_expert_gate . x).
        let moe = match model_type.as_str() {
            "mixtral" => Some(MoeSpec {
                n_expert: req("num_local_experts")?,
                n_expert_used: req("num_experts_per_tok")?,
                expert_ffn: req("intermediate_size")?,
                gating: Gating::Softmax,
                normalize_topk: true,
                shared_ffn: None,
                shared_gate: false,
            }),
            "qwen2_moe" | "qwen3_moe" => {
                // Dense layers among the MoE ones (`mlp_only_layers`, `decoder_sparse_step`) are
                // not one stage list for every layer.
                let dense_layers = top.typed("mlp_only_layers", |v| v.as_array().map(Vec::len), "an array of layer indices")?.unwrap_or(0) > 0;
                if dense_layers || u("decoder_sparse_step")?.unwrap_or(1) != 1 {
                    return Err(err("config.json: dense layers among the MoE layers (`mlp_only_layers`, `decoder_sparse_step` other than 1) are not supported".into()));
                }
                let shared = model_type == "qwen2_moe";
                Some(MoeSpec {
                    n_expert: req("num_experts")?,
                    n_expert_used: req("num_experts_per_tok")?,
                    expert_ffn: req("moe_intermediate_size")?,
                    gating: Gating::Softmax,
                    normalize_topk: top.b("norm_topk_prob")?.unwrap_or(false),
                    shared_ffn: if shared { Some(req("shared_expert_intermediate_size")?) } else { None },
                    shared_gate: shared,
                })
            }
            _ => None,
        };
        let n_ff = match &moe {
            Some(m) => u("intermediate_size")?.unwrap_or(m.expert_ffn),
            None => req("intermediate_size")?,
        };
        let mut spec = ModelSpec {
            arch: arch.to_string(),
            n_vocab: req("vocab_size")?,
            n_embd,
            n_layer,
            n_head,
            n_head_kv: u("num_key_value_heads")?.unwrap_or(n_head),
            head_dim,
            n_ff,
            norm_eps: top.f("rms_norm_eps")?.unwrap_or(1e-6),
            rope: RopeSpec {
                // Hugging Face checkpoints keep Q/K in rotate-half order for every architecture.
                style: RopeStyle::Neox,
                theta,
                n_rot: head_dim,
                scaling,
                freq_factors,
                longrope_factors,
            },
            qk_norm: arch == "qwen3" || arch == "qwen3moe",
            // Qwen2 (and Qwen2-MoE) always biases Q/K/V (never O); llama, mistral and qwen3 bias
            // all four of them when `attention_bias` is set (their attention layers build
            // q/k/v/o_proj alike).
            qkv_bias: arch == "qwen2" || arch == "qwen2moe" || attention_bias,
            out_bias: arch != "qwen2" && arch != "qwen2moe" && attention_bias,
            tied_output: top.b("tie_word_embeddings")?.unwrap_or(false),
            activation: act,
            moe,
            sliding_window,
            swa_period: 0,
            rope_swa: None,
            embd_scale: None,
            post_norms: false,
            fused: arch == "phi3",
            context_length: ctx,
            attn_scale: 1.0 / (head_dim.max(1) as f64).sqrt(),
            stages: Vec::new(),
        };
        spec.derive_stages();
        spec.set_context(configured_context()?)?;
        spec.validate()?;
        Ok(spec)
    }
}

/// The fields of one JSON object of a config.json, read strictly: a field that is present with
/// the wrong type is an error naming it, never its default (a quoted number or a misplaced value
/// would otherwise load another model without a word). null reads as absent, as configs use it.
#[derive(Clone, Copy)]
struct Fields<'a> {
    obj: &'a serde_json::Value,
    /// Where the object sits (`rope_parameters.`), for messages.
    at: &'a str,
    file: &'a str,
}

impl<'a> Fields<'a> {
    fn get(&self, k: &str) -> Option<&'a serde_json::Value> {
        self.obj.get(k).filter(|v| !v.is_null())
    }
    fn typed<T>(&self, k: &str, read: impl Fn(&'a serde_json::Value) -> Option<T>, expected: &str) -> Result<Option<T>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => read(v).map(Some).ok_or_else(|| OracleError::Safetensors { file: self.file.to_string(), reason: format!("config.json: `{}{k}` is {v}, expected {expected}", self.at) }),
        }
    }
    fn u(&self, k: &str) -> Result<Option<usize>> {
        self.typed(k, |v| v.as_u64().and_then(|x| usize::try_from(x).ok()), "a non-negative integer")
    }
    fn f(&self, k: &str) -> Result<Option<f64>> {
        self.typed(k, |v| v.as_f64(), "a number")
    }
    fn b(&self, k: &str) -> Result<Option<bool>> {
        self.typed(k, |v| v.as_bool(), "true or false")
    }
    fn s(&self, k: &str) -> Result<Option<&'a str>> {
        self.typed(k, |v| v.as_str(), "a string")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3_moe(extra: serde_json::Value) -> Result<ModelSpec> {
        let mut cfg = serde_json::json!({"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16, "num_hidden_layers": 2,
            "vocab_size": 100, "intermediate_size": 96, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32});
        for (k, v) in extra.as_object().unwrap() {
            cfg[k] = v.clone();
        }
        ModelSpec::from_hf_config(&cfg, "config.json")
    }

    #[test]
    fn moe_configs_read_their_fields_and_refuse_what_they_cannot_express() {
        let s = qwen3_moe(serde_json::json!({"norm_topk_prob": true})).unwrap();
        let m = s.moe.as_ref().unwrap();
        assert_eq!((s.arch.as_str(), m.n_expert, m.n_expert_used, m.expert_ffn, m.normalize_topk, m.shared_ffn, s.qk_norm), ("qwen3moe", 8, 2, 32, true, None, true));
        assert!(!qwen3_moe(serde_json::json!({})).unwrap().moe.unwrap().normalize_topk, "transformers' default");
        for (extra, want) in [
            (serde_json::json!({"mlp_only_layers": [1]}), "dense layers among the MoE layers"),
            (serde_json::json!({"decoder_sparse_step": 2}), "dense layers among the MoE layers"),
            (serde_json::json!({"mlp_only_layers": 1}), "`mlp_only_layers` is 1, expected an array of layer indices"),
            (serde_json::json!({"num_experts_per_tok": 9}), "9 experts used out of 8"),
        ] {
            let e = qwen3_moe(extra.clone()).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(want), "{extra}: {e}");
        }
        assert!(qwen3_moe(serde_json::json!({"mlp_only_layers": []})).is_ok());
    }

    /// `tensor_names` lists exactly what `reads_tensor` accepts for an unfused spec: every name
    /// read, each once, and a name of each kind the spec does not read absent.
    #[test]
    fn tensor_names_are_the_tensors_read() {
        let mut shared = qwen3_moe(serde_json::json!({})).unwrap();
        shared.moe.as_mut().unwrap().shared_ffn = Some(16);
        shared.moe.as_mut().unwrap().shared_gate = true;
        let mut biased = qwen3_moe(serde_json::json!({})).unwrap();
        biased.moe = None;
        (biased.qkv_bias, biased.out_bias, biased.qk_norm, biased.tied_output) = (true, true, false, true);
        for spec in [qwen3_moe(serde_json::json!({})).unwrap(), shared, biased] {
            let names = spec.tensor_names();
            assert!(names.iter().all(|n| spec.reads_tensor(n)), "{names:?}");
            let unique: std::collections::HashSet<_> = names.iter().collect();
            assert_eq!(unique.len(), names.len());
            let per_layer = names.iter().filter(|n| n.starts_with("blk.0.")).count();
            assert_eq!(names.len(), 2 + !spec.tied_output as usize + spec.n_layer * per_layer);
            for tail in ["attn_q.bias", "attn_output.bias", "attn_q_norm.weight", "ffn_gate.weight", "ffn_gate_exps.weight", "ffn_up_shexp.weight", "ffn_gate_inp_shexp.weight"] {
                let name = format!("blk.1.{tail}");
                assert_eq!(names.contains(&name), spec.reads_tensor(&name), "{name}");
            }
            assert_eq!(names.contains(&"output.weight".to_string()), !spec.tied_output);
        }
    }

    /// Phi-3's config: fused tensors, its window, and LongRoPE's short factors with the attention
    /// factor Transformers derives (sqrt(1 + ln 32 / ln 4096) for 131072 over 4096 positions)
    /// unless given; factors of the wrong count or sign are refused naming the key.
    #[test]
    fn phi3_configs_read_longrope() {
        let phi3 = |rope: serde_json::Value| {
            let cfg = serde_json::json!({"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100,
                "intermediate_size": 96, "sliding_window": 2047, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_scaling": rope});
            ModelSpec::from_hf_config(&cfg, "config.json")
        };
        let short: Vec<f64> = (0..8).map(|i| 1.0 + i as f64 / 8.0).collect();
        let s = phi3(serde_json::json!({"type": "longrope", "short_factor": short, "long_factor": vec![4.0; 8]})).unwrap();
        assert!(s.fused && s.sliding_window == Some(2047));
        let RopeScaling::LongRope { attn_factor, original_context: 4096, context: 4096 } = s.rope.scaling else { panic!("{:?}", s.rope.scaling) };
        assert!((attn_factor - (1.0 + 32f64.ln() / 4096f64.ln()).sqrt()).abs() < 1e-12, "{attn_factor}");
        assert_eq!(s.rope.freq_factors.as_deref().unwrap()[1], 1.125);
        let given = phi3(serde_json::json!({"rope_type": "longrope", "short_factor": short, "long_factor": short, "attention_factor": 1.5})).unwrap();
        assert_eq!(given.rope.scaling, RopeScaling::LongRope { attn_factor: 1.5, original_context: 4096, context: 4096 });
        // A longer context takes the long factors (at every position), a shorter one the short.
        let mut long = s.clone();
        long.set_context(Some(8192)).unwrap();
        assert_eq!((long.rope.freq_factors.as_deref(), long.rope.scaling), (Some(&[4.0f32; 8][..]), RopeScaling::LongRope { attn_factor, original_context: 4096, context: 8192 }));
        long.set_context(Some(100)).unwrap();
        assert_eq!(long, s, "back to the short factors and the original context");
        // Without both lists (a flat file's spec) another context is refused, the same one kept.
        let mut flat = s.clone();
        flat.rope.longrope_factors = None;
        flat.set_context(Some(4096)).unwrap();
        let e = flat.set_context(Some(8192)).unwrap_err().to_string();
        assert!(e.contains("of a 4096-position context") && e.contains("--context 8192"), "{e}");
        flat.rope.scaling = RopeScaling::LongRope { attn_factor, original_context: 4096, context: 100 };
        assert!(flat.validate().unwrap_err().to_string().contains("LongRoPE context 100 is shorter than its original context 4096"));
        assert!(phi3(serde_json::Value::Null).unwrap().rope.scaling == RopeScaling::None);
        for (rope, want) in [
            (serde_json::json!({"type": "longrope", "short_factor": [1.0], "long_factor": short}), "`rope_scaling.short_factor` has 1 values for 8 rotated pairs"),
            (serde_json::json!({"type": "longrope", "short_factor": short, "long_factor": [-1.0, 1, 1, 1, 1, 1, 1, 1]}), "`rope_scaling.long_factor` holds a value that is not a finite positive number"),
            (serde_json::json!({"type": "longrope", "short_factor": short}), "needs `long_factor`"),
        ] {
            let e = phi3(rope.clone()).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(want), "{rope}: {e}");
        }
    }
}
