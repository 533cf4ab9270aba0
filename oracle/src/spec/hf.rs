//! Specs from a Hugging Face `config.json` (safetensors checkpoints).

use super::*;
use crate::error::{OracleError, Result};

impl ModelSpec {
    /// Builds the spec of a safetensors model from its Hugging Face `config.json`.
    pub fn from_hf_config(cfg: &serde_json::Value, file: &str) -> Result<ModelSpec> {
        let err = |m: String| OracleError::Safetensors { file: file.to_string(), reason: m };
        let top = Fields { obj: cfg, at: "", file };
        let u = |k: &str| top.u(k);
        let req = |k: &str| u(k)?.ok_or_else(|| err(format!("config.json: missing integer `{k}`")));
        let model_type = top.s("model_type")?.unwrap_or("").to_string();
        // The GGUF architecture each model type converts to (Mixtral is a llama with experts).
        let arch = Arch::from_model_type(&model_type).ok_or_else(|| err(format!("config.json: model_type `{model_type}` is not supported ({})", Arch::model_type_names())))?;
        let row = arch.row();
        let gemma = row.gemma.is_some();
        let oss = arch == Arch::GptOss;
        let qwen = matches!(arch, Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen2Moe | Arch::Qwen3Moe);
        if arch == Arch::Mamba2 {
            return Self::mamba2_from_hf(&top, file);
        }
        if arch == Arch::GraniteHybrid {
            return Self::granite_hybrid_from_hf(&top, file);
        }
        let n_embd = req("hidden_size")?;
        let n_head = req("num_attention_heads")?;
        let head_dim = u("head_dim")?.unwrap_or(n_embd.checked_div(n_head).unwrap_or(0));
        let ctx = u("max_position_embeddings")?.unwrap_or(4096);
        // RoPE: `rope_theta` and `rope_scaling` at the top level, or (newer transformers) both
        // in `rope_parameters`.
        // Gemma 3 in transformers 5: one set of RoPE parameters per layer type; the global
        // layers' are the model's RoPE, the windowed layers' base their own (below).
        let per_type = |t: &str| top.get("rope_parameters").and_then(|p| p.get(t)).filter(|p| p.is_object());
        let rope_params = match top.get("rope_parameters") {
            Some(_) if gemma && per_type("full_attention").is_some() => per_type("full_attention").map(|p| Fields { obj: p, at: "rope_parameters.full_attention.", file }),
            Some(p) if p.is_object() => Some(Fields { obj: p, at: "rope_parameters.", file }),
            Some(p) => return Err(err(format!("config.json: `rope_parameters` is {p}, expected an object"))),
            None => None,
        };
        let theta = match &rope_params {
            Some(p) if p.get("rope_theta").is_some() => p.f("rope_theta")?,
            _ => top.f("rope_theta")?,
        }
        .unwrap_or(10_000.0);
        // transformers rotates only this share of each head where a config sets it (its first
        // `int(head_dim * share)` dimensions); Qwen3-Next does, the other architectures read here
        // rotate whole heads.
        let mut n_rot = head_dim;
        for fields in [Some(&top), rope_params.as_ref()].into_iter().flatten() {
            if let Some(share) = fields.f("partial_rotary_factor")?.filter(|&x| x != 1.0) {
                if !row.qwen_next || !(share > 0.0 && share < 1.0) {
                    return Err(err(format!("config.json: {}partial_rotary_factor {share} is not supported (whole heads rotate)", fields.at)));
                }
                n_rot = (head_dim as f64 * share) as usize;
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
                        attn_factor: match (s.f("attention_factor")?, s.f("mscale")?, s.f("mscale_all_dim")?) {
                            (Some(a), _, _) if factor > 0.0 => a / (1.0 + 0.1 * factor.ln()),
                            // DeepSeek's: the ratio of two such factors, each with its own weight
                            // on ln(factor).
                            (None, Some(m), Some(all)) if factor > 1.0 && m != 0.0 && all != 0.0 => yarn_mscale(factor, m) / yarn_mscale(factor, all) / (1.0 + 0.1 * factor.ln()),
                            _ => 1.0,
                        },
                        truncate: s.b("truncate")?.unwrap_or(true),
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
        let n_layer = layer_count(&top, file)?;
        // Mistral and Phi-3 window every layer by `sliding_window` (null: none). Qwen2/Qwen3 window only
        // with `use_sliding_window`, and then only layers from `max_window_layers` on (their
        // configs' default: 28): all of them (0) or none (>= the layer count) is one window for
        // the model; a split is not.
        let sliding_window = match model_type.as_str() {
            "mistral" | "mixtral" | "phi3" | "gemma2" | "gemma3_text" | "gpt_oss" => u("sliding_window")?,
            _ if qwen && top.b("use_sliding_window")?.unwrap_or(false) => match u("max_window_layers")?.unwrap_or(28) {
                0 => u("sliding_window")?,
                m if m >= n_layer => None,
                m => return Err(err(format!("config.json: a sliding window on layers {m}..{n_layer} only (max_window_layers {m}) is not supported: one window for all layers or none"))),
            },
            _ => None,
        };
        let act_key = if gemma { "hidden_activation" } else { "hidden_act" };
        let act = match top.s(act_key)?.unwrap_or(if gemma { "gelu_pytorch_tanh" } else { "silu" }) {
            // GPT-OSS's experts compute their own clamped SwiGLU whatever `hidden_act` says.
            _ if oss => {
                for (k, want) in [("swiglu_alpha", OAI_SWIGLU_ALPHA), ("swiglu_limit", OAI_SWIGLU_LIMIT)] {
                    if let Some(v) = top.f(k)?.filter(|v| *v != want) {
                        return Err(err(format!("config.json: {k} {v}: only GPT-OSS's {want} is supported")));
                    }
                }
                Activation::SwigluOai
            }
            "silu" | "swish" => Activation::Silu,
            "gelu_pytorch_tanh" | "gelu_tanh" => Activation::GeluTanh,
            other => return Err(err(format!("config.json: {act_key} `{other}` is not supported"))),
        };
        // Experts: Mixtral routes every layer through `num_local_experts` experts of
        // `intermediate_size` and renormalizes its top-k weights, as GPT-OSS does (its softmax
        // over the chosen experts' logits), whose router and experts have biases too; Qwen-MoE
        // has `num_experts` of `moe_intermediate_size`, renormalizes when `norm_topk_prob`
        // (transformers' default: false) and (Qwen2-MoE) adds a shared expert scaled by
        // sigmoid(shared_expert_gate . x).
        let moe = match model_type.as_str() {
            "mixtral" | "gpt_oss" => Some(MoeSpec {
                n_expert: req("num_local_experts")?,
                n_expert_used: req("num_experts_per_tok")?,
                expert_ffn: req("intermediate_size")?,
                gating: Gating::Softmax,
                normalize_topk: true,
                shared_ffn: None,
                shared_gate: false,
                biases: oss,
                groups: None,
                choice_bias: false,
                weights_scale: None,
                first_dense: 0,
            }),
            // Group-limited sigmoid routing: the choice biased by `e_score_correction_bias`, the
            // chosen weights renormalized (`norm_topk_prob`) and scaled; the shared experts one
            // FFN; the first `first_k_dense_replace` layers dense.
            "deepseek_v3" => match (u("n_routed_experts")?.unwrap_or(256), u("first_k_dense_replace")?.unwrap_or(3)) {
                (0, _) => None,
                (_, first) if first >= n_layer => None,
                (n_expert, first_dense) => Some(MoeSpec {
                    n_expert,
                    n_expert_used: req("num_experts_per_tok")?,
                    expert_ffn: req("moe_intermediate_size")?,
                    gating: Gating::Sigmoid,
                    normalize_topk: top.b("norm_topk_prob")?.unwrap_or(true),
                    shared_ffn: match u("n_shared_experts")?.unwrap_or(1) {
                        0 => None,
                        n => Some(n.saturating_mul(req("moe_intermediate_size")?)),
                    },
                    shared_gate: false,
                    biases: false,
                    groups: match (u("n_group")?.unwrap_or(8), u("topk_group")?.unwrap_or(4)) {
                        (g, _) if g <= 1 => None,
                        (g, k) => Some([g, k]),
                    },
                    choice_bias: true,
                    weights_scale: Some(top.f("routed_scaling_factor")?.unwrap_or(2.5)),
                    first_dense,
                }),
            },
            "qwen2_moe" | "qwen3_moe" | "qwen3_next" => {
                // Dense layers among the MoE ones (`mlp_only_layers`, `decoder_sparse_step`) are
                // not one stage list for every layer.
                let dense_layers = top.typed("mlp_only_layers", |v| v.as_array().map(Vec::len), "an array of layer indices")?.unwrap_or(0) > 0;
                if dense_layers || u("decoder_sparse_step")?.unwrap_or(1) != 1 {
                    return Err(err("config.json: dense layers among the MoE layers (`mlp_only_layers`, `decoder_sparse_step` other than 1) are not supported".into()));
                }
                let shared = model_type != "qwen3_moe";
                Some(MoeSpec {
                    n_expert: req("num_experts")?,
                    n_expert_used: req("num_experts_per_tok")?,
                    expert_ffn: req("moe_intermediate_size")?,
                    gating: Gating::Softmax,
                    normalize_topk: top.b("norm_topk_prob")?.unwrap_or(false),
                    shared_ffn: if shared { Some(req("shared_expert_intermediate_size")?) } else { None },
                    shared_gate: shared,
                    biases: false,
                    groups: None,
                    choice_bias: false,
                    weights_scale: None,
                    first_dense: 0,
                })
            }
            _ => None,
        };
        let n_ff = match &moe {
            Some(m) => u("intermediate_size")?.unwrap_or(m.expert_ffn),
            None => req("intermediate_size")?,
        };
        let mut spec = ModelSpec {
            arch,
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
                n_rot,
                scaling,
                freq_factors,
                longrope_factors,
            },
            qk_norm: row.qk_norm,
            // Qwen2 (and Qwen2-MoE) always biases Q/K/V (never O); llama, mistral and qwen3 bias
            // all four of them when `attention_bias` is set (their attention layers build
            // q/k/v/o_proj alike).
            qkv_bias: row.qkv_bias || attention_bias,
            out_bias: !row.qkv_bias && attention_bias,
            tied_output: top.b("tie_word_embeddings")?.unwrap_or(gemma),
            activation: act,
            moe,
            sliding_window,
            swa_period: 0,
            rope_swa: None,
            embd_scale: None,
            post_norms: false,
            attn_sinks: oss,
            attn_softcap: None,
            final_softcap: None,
            fused: row.fused,
            context_length: ctx,
            attn_scale: 1.0 / (head_dim.max(1) as f64).sqrt(),
            residual_scale: None,
            logit_scale: None,
            no_rope: false,
            attn_gate: false,
            ssm: None,
            mla: None,
            layers: Vec::new(),
        };
        if gemma {
            spec.gemma3_from_hf(&top, per_type("sliding_attention"), file)?;
        }
        if row.qwen_next {
            spec.qwen_next_from_hf(&top, file)?;
            return Ok(spec);
        }
        if row.mla {
            spec.mla_from_hf(&top, rope_params.as_ref(), file)?;
            return Ok(spec);
        }
        if oss {
            // Alternating windowed and global layers; all global without a window.
            let period = layer_types_period(&top, n_layer, file)?.unwrap_or(GPT_OSS_SWA_PERIOD);
            spec.swa_period = if spec.sliding_window.is_some() { period } else { 0 };
        }
        spec.derive_layers(None)?;
        spec.set_context(configured_context()?)?;
        spec.validate()?;
        Ok(spec)
    }

    /// A `granitemoehybrid` config (Granite 4.0-H, dense: `num_local_experts` 0): Mamba-2 and
    /// attention layers as `layer_types` says (`mamba`/`linear_attention`,
    /// `attention`/`full_attention`), each followed by the shared MLP (`shared_intermediate_size`),
    /// Granite's multipliers, RoPE only where `position_embedding_type` is `rope`.
    fn granite_hybrid_from_hf(top: &Fields<'_>, file: &str) -> Result<ModelSpec> {
        let err = |m: String| OracleError::Safetensors { file: file.to_string(), reason: m };
        let req = |k: &str| top.u(k)?.ok_or_else(|| err(format!("config.json: missing integer `{k}`")));
        if top.u("num_local_experts")?.unwrap_or(0) > 0 {
            return Err(err("config.json: num_local_experts above 0 (Granite 4.0-H's experts) is not supported; dense models are".into()));
        }
        if top.b("mamba_proj_bias")?.unwrap_or(false) || !top.b("mamba_conv_bias")?.unwrap_or(true) || top.b("attention_bias")?.unwrap_or(false) {
            return Err(err("config.json: mamba_proj_bias, attention_bias, or mamba_conv_bias false: not supported".into()));
        }
        no_time_step_clamp(top, file)?;
        let n_embd = req("hidden_size")?;
        let n_layer = layer_count(top, file)?;
        let n_head = req("num_attention_heads")?;
        let n_head_kv = top.u("num_key_value_heads")?.unwrap_or(n_head);
        let head_dim = n_embd.checked_div(n_head).unwrap_or(0);
        let types = top.typed("layer_types", |v| v.as_array(), "an array of layer types")?.ok_or_else(|| err("config.json: missing `layer_types`".into()))?;
        if types.len() != n_layer {
            return Err(err(format!("config.json: {} layer_types for {n_layer} layers", types.len())));
        }
        let shapes = types
            .iter()
            .map(|t| match t.as_str() {
                Some("mamba" | "linear_attention") => Ok(LayerShape { n_head: 0, n_head_kv: 0, windowed: false }),
                Some("attention" | "full_attention") => Ok(LayerShape { n_head, n_head_kv, windowed: false }),
                _ => Err(err(format!("config.json: layer type {t} is neither mamba nor attention"))),
            })
            .collect::<Result<Vec<_>>>()?;
        let rope = top.s("position_embedding_type")? == Some("rope");
        let theta = match top.get("rope_parameters") {
            Some(p) => Fields { obj: p, at: "rope_parameters.", file }.f("rope_theta")?,
            None => top.f("rope_theta")?,
        }
        .unwrap_or(10_000.0);
        let n_expand = top.u("mamba_expand")?.unwrap_or(2);
        let ssm_heads = req("mamba_n_heads")?;
        let ssm = SsmBlock {
            d_inner: match top.u("mamba_d_head")? {
                Some(hd) => hd.checked_mul(ssm_heads),
                None => n_expand.checked_mul(n_embd),
            }
            .ok_or_else(|| err("config.json: mamba_d_head x mamba_n_heads overflows".into()))?,
            d_state: top.u("mamba_d_state")?.unwrap_or(256),
            n_group: top.u("mamba_n_groups")?.unwrap_or(1),
            n_head: ssm_heads,
            d_conv: top.u("mamba_d_conv")?.unwrap_or(4),
            kind: SsmKind::Mamba2,
        };
        let mut spec = ModelSpec {
            arch: Arch::GraniteHybrid,
            n_vocab: req("vocab_size")?,
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            head_dim,
            n_ff: req("shared_intermediate_size")?,
            norm_eps: top.f("rms_norm_eps")?.unwrap_or(1e-6),
            rope: RopeSpec { style: RopeStyle::Neox, theta, n_rot: head_dim, scaling: RopeScaling::None, freq_factors: None, longrope_factors: None },
            qk_norm: false,
            qkv_bias: false,
            out_bias: false,
            tied_output: top.b("tie_word_embeddings")?.unwrap_or(false),
            activation: Activation::Silu,
            moe: None,
            sliding_window: None,
            swa_period: 0,
            rope_swa: None,
            embd_scale: top.f("embedding_multiplier")?,
            post_norms: false,
            attn_sinks: false,
            attn_softcap: None,
            final_softcap: None,
            fused: false,
            context_length: top.u("max_position_embeddings")?.unwrap_or(4096),
            attn_scale: top.f("attention_multiplier")?.unwrap_or(1.0 / (head_dim.max(1) as f64).sqrt()),
            residual_scale: top.f("residual_multiplier")?,
            logit_scale: top.f("logits_scaling")?,
            no_rope: !rope,
            attn_gate: false,
            ssm: Some(ssm),
            mla: None,
            layers: Vec::new(),
        };
        spec.derive_layers(Some(&shapes))?;
        spec.validate()?;
        Ok(spec)
    }

    /// What a `qwen3_next` config adds to the common fields: gated DeltaNet layers
    /// (`linear_*` dimensions) where `layer_types` says `linear_attention` (else every layer but
    /// each `full_attention_interval`-th), the attention output gate. Biases and dense layers
    /// among the MoE ones are refused.
    fn qwen_next_from_hf(&mut self, top: &Fields<'_>, file: &str) -> Result<()> {
        let err = |m: String| OracleError::Safetensors { file: file.to_string(), reason: m };
        let req = |k: &str| top.u(k)?.ok_or_else(|| err(format!("config.json: missing integer `{k}`")));
        if self.qkv_bias || self.out_bias {
            return Err(err("config.json: attention_bias on a qwen3_next model is not supported".into()));
        }
        let (n_k_head, n_v_head) = (req("linear_num_key_heads")?, req("linear_num_value_heads")?);
        let ssm = SsmBlock {
            d_inner: req("linear_value_head_dim")?.checked_mul(n_v_head).ok_or_else(|| err("config.json: linear_value_head_dim x linear_num_value_heads overflows".into()))?,
            d_state: req("linear_key_head_dim")?,
            n_group: n_k_head,
            n_head: n_v_head,
            d_conv: req("linear_conv_kernel_dim")?,
            kind: SsmKind::GatedDelta,
        };
        let n = self.n_layer;
        let recurrent: Vec<bool> = match top.typed("layer_types", |v| v.as_array(), "an array of layer types")? {
            Some(types) if types.len() != n => return Err(err(format!("config.json: {} layer_types for {n} layers", types.len()))),
            Some(types) => types
                .iter()
                .map(|t| match t.as_str() {
                    Some("linear_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(err(format!("config.json: layer type {t} is neither linear_attention nor full_attention"))),
                })
                .collect::<Result<_>>()?,
            None => {
                let every = top.u("full_attention_interval")?.unwrap_or(4);
                if every == 0 {
                    return Err(err("config.json: full_attention_interval is 0".into()));
                }
                (0..n).map(|li| !(li + 1).is_multiple_of(every)).collect()
            }
        };
        let shapes: Vec<LayerShape> = recurrent
            .into_iter()
            .map(|r| if r { LayerShape { n_head: 0, n_head_kv: 0, windowed: false } } else { LayerShape { n_head: self.n_head, n_head_kv: self.n_head_kv, windowed: false } })
            .collect();
        self.attn_gate = true;
        self.ssm = Some(ssm);
        self.derive_layers(Some(&shapes))?;
        self.set_context(configured_context()?)?;
        self.validate()
    }

    /// A `deepseek_v3` config (`DeepseekV3ForCausalLM`): latent attention on every layer
    /// (`q_lora_rank` null: one query projection), the RoPE on the last `qk_rope_head_dim` of
    /// each query head and on the shared key, in adjacent pairs where `rope_interleave` (the
    /// default) says so; the score scale `1/sqrt(qk_head_dim)` times YaRN's `mscale_all_dim`
    /// factor squared.
    fn mla_from_hf(&mut self, top: &Fields<'_>, rope: Option<&Fields<'_>>, file: &str) -> Result<()> {
        let err = |m: String| OracleError::Safetensors { file: file.to_string(), reason: m };
        let req = |k: &str| top.u(k)?.ok_or_else(|| err(format!("config.json: missing integer `{k}`")));
        if self.qkv_bias || self.out_bias {
            return Err(err("config.json: attention_bias on a deepseek_v3 model is not supported".into()));
        }
        let mla = MlaBlock {
            n_head: self.n_head,
            q_lora_rank: match top.get("q_lora_rank") {
                None | Some(serde_json::Value::Null) => 0,
                Some(_) => req("q_lora_rank")?,
            },
            kv_lora_rank: req("kv_lora_rank")?,
            qk_nope: req("qk_nope_head_dim")?,
            qk_rope: req("qk_rope_head_dim")?,
            v_head_dim: req("v_head_dim")?,
        };
        mla.validate().map_err(|e| err(format!("config.json: {e}")))?;
        self.head_dim = mla.qk_head_dim();
        self.n_head_kv = self.n_head;
        self.rope.n_rot = mla.qk_rope;
        self.rope.style = if top.b("rope_interleave")?.unwrap_or(true) { RopeStyle::Normal } else { RopeStyle::Neox };
        let mut scale = 1.0 / (mla.qk_head_dim() as f64).sqrt();
        if let (RopeScaling::Yarn { factor, .. }, Some(p)) = (self.rope.scaling, rope) {
            if let Some(all) = p.f("mscale_all_dim")?.filter(|m| *m != 0.0) {
                scale *= yarn_mscale(factor, all).powi(2);
            }
        }
        self.attn_scale = scale;
        self.mla = Some(mla);
        self.derive_layers(None)?;
        self.set_context(configured_context()?)?;
        self.validate()
    }

    /// A `mamba2` config (`Mamba2ForCausalLM`): state-space layers only, no heads, no FFN.
    /// What the GGUF form cannot hold is refused: biases on the projections (`use_bias`), a
    /// convolution without one (`use_conv_bias` false), a clamp of the time steps
    /// (`time_step_limit` other than (0, inf)), as for Granite's Mamba-2 layers.
    fn mamba2_from_hf(top: &Fields<'_>, file: &str) -> Result<ModelSpec> {
        let err = |m: String| OracleError::Safetensors { file: file.to_string(), reason: m };
        let req = |k: &str| top.u(k)?.ok_or_else(|| err(format!("config.json: missing integer `{k}`")));
        let n_embd = req("hidden_size")?;
        let n_layer = layer_count(top, file)?;
        let n_head = req("num_heads")?;
        let d_inner = match (top.u("head_dim")?, top.u("expand")?) {
            (Some(hd), _) => hd.checked_mul(n_head),
            (None, Some(e)) => e.checked_mul(n_embd),
            (None, None) => n_embd.checked_mul(2),
        }
        .ok_or_else(|| err("config.json: head_dim x num_heads overflows".into()))?;
        if top.b("use_bias")?.unwrap_or(false) {
            return Err(err("config.json: use_bias (biases on the input and output projections) is not supported".into()));
        }
        if !top.b("use_conv_bias")?.unwrap_or(true) {
            return Err(err("config.json: use_conv_bias false (a convolution without bias) is not supported".into()));
        }
        no_time_step_clamp(top, file)?;
        let ssm = SsmBlock {
            d_inner,
            d_state: top.u("state_size")?.unwrap_or(128),
            n_group: top.u("n_groups")?.unwrap_or(1),
            n_head,
            d_conv: top.u("conv_kernel")?.unwrap_or(4),
            kind: SsmKind::Mamba2,
        };
        let mut spec = ModelSpec {
            arch: Arch::Mamba2,
            n_vocab: req("vocab_size")?,
            n_embd,
            n_layer,
            n_head: 0,
            n_head_kv: 0,
            head_dim: 0,
            n_ff: 0,
            norm_eps: top.f("layer_norm_epsilon")?.unwrap_or(1e-5),
            rope: RopeSpec { style: RopeStyle::Normal, theta: 10_000.0, n_rot: 0, scaling: RopeScaling::None, freq_factors: None, longrope_factors: None },
            qk_norm: false,
            qkv_bias: false,
            out_bias: false,
            tied_output: top.b("tie_word_embeddings")?.unwrap_or(false),
            activation: Activation::Silu,
            moe: None,
            sliding_window: None,
            swa_period: 0,
            rope_swa: None,
            embd_scale: None,
            post_norms: false,
            attn_sinks: false,
            attn_softcap: None,
            final_softcap: None,
            fused: false,
            context_length: top.u("max_position_embeddings")?.unwrap_or(1 << 20),
            attn_scale: 1.0,
            residual_scale: None,
            logit_scale: None,
            no_rope: false,
            attn_gate: false,
            ssm: Some(ssm),
            mla: None,
            layers: Vec::new(),
        };
        spec.derive_layers(None)?;
        spec.validate()?;
        Ok(spec)
    }

    /// What a `gemma3_text` or `gemma2` config adds to the common fields: the windowed layers'
    /// pattern (`layer_types`, or `sliding_window_pattern` in older configs: every N-th layer
    /// global; Gemma 2 every other) and, for Gemma 3, their RoPE base
    /// (`rope_parameters.sliding_attention.rope_theta`, or `rope_local_base_freq`, unscaled), the
    /// query scale from `query_pre_attn_scalar`, scaled embeddings and post-norms, and
    /// soft-capping of the attention scores and the logits where the config sets it (Gemma 2;
    /// null in Gemma 3's).
    fn gemma3_from_hf(&mut self, top: &Fields<'_>, sliding: Option<&serde_json::Value>, file: &str) -> Result<()> {
        let err = |m: String| OracleError::Safetensors { file: file.to_string(), reason: m };
        let gemma2 = self.arch == Arch::Gemma2;
        self.attn_softcap = top.f("attn_logit_softcapping")?;
        self.final_softcap = top.f("final_logit_softcapping")?;
        let default_period = if gemma2 { crate::spec::GEMMA2_SWA_PERIOD } else { crate::spec::GEMMA3_SWA_PERIOD };
        let period = match layer_types_period(top, self.n_layer, file)? {
            Some(n) => n,
            None => top.u("sliding_window_pattern")?.unwrap_or(default_period),
        };
        // Without a window, or with every layer windowed (period 0), no layer is told apart.
        self.swa_period = if self.sliding_window.is_some() { period } else { 0 };
        let local_theta = match sliding {
            Some(p) => Fields { obj: p, at: "rope_parameters.sliding_attention.", file }.f("rope_theta")?,
            None => top.f("rope_local_base_freq")?,
        }
        .unwrap_or(crate::spec::GEMMA3_LOCAL_ROPE_BASE);
        if self.sliding_window.is_some() && !gemma2 {
            self.rope_swa = Some(self.rope.with_base(local_theta));
        }
        let scalar = top.f("query_pre_attn_scalar")?.unwrap_or(self.head_dim as f64);
        if !(scalar.is_finite() && scalar > 0.0) {
            return Err(err(format!("config.json: query_pre_attn_scalar {scalar} is not a positive number")));
        }
        self.attn_scale = 1.0 / scalar.sqrt();
        self.embd_scale = Some(crate::spec::gemma_embd_scale(self.n_embd));
        self.post_norms = true;
        Ok(())
    }
}

/// `num_hidden_layers`, refused beyond the layers a model may have.
/// YaRN's magnitude factor with weight `m` on ln(factor): `0.1 m ln(factor) + 1` (1 for a
/// factor of at most 1), as transformers' `yarn_get_mscale`.
fn yarn_mscale(factor: f64, m: f64) -> f64 {
    if factor <= 1.0 { 1.0 } else { 0.1 * m * factor.ln() + 1.0 }
}

fn layer_count(top: &Fields<'_>, file: &str) -> Result<usize> {
    let n_layer = top.u("num_hidden_layers")?.ok_or_else(|| OracleError::Safetensors { file: file.to_string(), reason: "config.json: missing integer `num_hidden_layers`".into() })?;
    if n_layer > super::MAX_LAYERS {
        return Err(OracleError::Safetensors { file: file.to_string(), reason: format!("config.json: num_hidden_layers {n_layer} is more than the {} layers a model may have", super::MAX_LAYERS) });
    }
    Ok(n_layer)
}

/// A Mamba-2 layer's `time_step_limit` must be (0, inf): a clamp of the time steps is not
/// supported (the GGUF form cannot hold one). Infinity as JSON cannot hold it either: null,
/// "Infinity", or transformers' {"__float__": "Infinity"}.
fn no_time_step_clamp(top: &Fields<'_>, file: &str) -> Result<()> {
    let Some(limit) = top.get("time_step_limit") else { return Ok(()) };
    let infinite = |v: &serde_json::Value| v.is_null() || v.as_str() == Some("Infinity") || v.get("__float__").and_then(|f| f.as_str()) == Some("Infinity");
    if limit.as_array().is_some_and(|l| l.len() == 2 && l[0].as_f64() == Some(0.0) && infinite(&l[1])) {
        return Ok(());
    }
    Err(OracleError::Safetensors { file: file.to_string(), reason: format!("config.json: time_step_limit {limit}: a clamp of the time steps is not supported") })
}

/// The period `config.json`'s `layer_types` describes (see [`ModelSpec::swa_period`]): N when
/// every N-th layer attends to every position and the others through the window, 0 when none
/// does; None without `layer_types`. Any other pattern is refused.
fn layer_types_period(top: &Fields<'_>, n_layer: usize, file: &str) -> Result<Option<usize>> {
    let err = |m: String| OracleError::Safetensors { file: file.to_string(), reason: m };
    let Some(types) = top.typed("layer_types", |v| v.as_array(), "an array of layer types")? else {
        return Ok(None);
    };
    let full: Vec<bool> = types
        .iter()
        .map(|t| match t.as_str() {
            Some("full_attention") => Ok(true),
            Some("sliding_attention") => Ok(false),
            _ => Err(err(format!("config.json: layer_types holds {t}, expected \"full_attention\" or \"sliding_attention\""))),
        })
        .collect::<Result<_>>()?;
    if full.len() != n_layer {
        return Err(err(format!("config.json: layer_types lists {} layers, num_hidden_layers is {n_layer}", full.len())));
    }
    let Some(first) = full.iter().position(|f| *f) else {
        return Ok(Some(0));
    };
    let n = first + 1;
    if full.iter().enumerate().any(|(i, f)| *f != (i + 1).is_multiple_of(n)) {
        return Err(err(format!("config.json: layer_types is not every {n}-th layer global and the others windowed, the one pattern supported")));
    }
    Ok(Some(n))
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
