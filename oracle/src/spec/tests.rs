//! Unit tests of the parent module.

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
    assert_eq!((s.arch.gguf_name(), m.n_expert, m.n_expert_used, m.expert_ffn, m.normalize_topk, m.shared_ffn, s.qk_norm), ("qwen3moe", 8, 2, 32, true, None, true));
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

/// A GPT-OSS config: sinks, biased router and experts, the clamped SwiGLU, alternating windowed
/// and global layers, YaRN untruncated as its config says; its FFN norm read from where the
/// files store it (`post_attention_norm`) and handed out as `ffn_norm`; another SwiGLU limit or
/// layer pattern refused.
#[test]
fn gpt_oss_config() {
    let cfg = |extra: serde_json::Value| {
        let mut c = serde_json::json!({
            "model_type": "gpt_oss", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "sliding_window": 4, "num_local_experts": 8,
            "num_experts_per_tok": 2, "attention_bias": true, "swiglu_limit": 7.0,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false, "original_max_position_embeddings": 32, "rope_theta": 150000.0}
        });
        c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        ModelSpec::from_hf_config(&c, "config.json")
    };
    let s = cfg(serde_json::json!({})).unwrap();
    assert_eq!((s.arch.gguf_name(), s.activation, s.attn_sinks, s.swa_period, s.qkv_bias, s.out_bias), ("gpt-oss", Activation::SwigluOai, true, 2, true, true));
    assert!(s.moe.as_ref().is_some_and(|m| m.biases && m.normalize_topk && m.gating == Gating::Softmax));
    assert!(matches!(s.rope.scaling, RopeScaling::Yarn { truncate: false, .. }));
    assert_eq!(
        (s.attention(0).unwrap().window, s.attention(1).unwrap().window),
        (Some(4), None)
    );
    assert!(
        s.reads_tensor("blk.1.post_attention_norm.weight")
            && !s.reads_tensor("blk.1.ffn_norm.weight")
    );
    let names = s.tensor_names();
    for n in ["blk.1.ffn_norm.weight", "blk.1.attn_sinks.weight", "blk.1.ffn_gate_inp.bias", "blk.1.ffn_down_exps.bias"] {
        assert!(names.contains(&n.to_string()), "{n}");
    }
    let e = cfg(serde_json::json!({"swiglu_limit": 6.0})).unwrap_err().to_string();
    assert!(e.contains("swiglu_limit 6"), "{e}");
    let e = cfg(serde_json::json!({"layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]})).unwrap_err().to_string();
    assert!(e.contains("layer_types"), "{e}");
}

/// A `gemma2` GGUF: Gemma's norms, scaled embeddings and GELU, no QK-norm, every other layer
/// windowed with one RoPE base, and the two soft-caps from its metadata; the 46-layer 27B
/// model's query scale from n_embd / n_head.
#[test]
fn gemma2_gguf_metadata() {
    use crate::gguf::{GgufFile, GgufWriter, Value};
    use crate::quant::{encode, GgmlType};
    let file = |n_layer: usize| {
        let mut w = GgufWriter::new();
        w.meta("general.architecture", Value::String("gemma2".into()));
        for (k, v) in [("embedding_length", 64), ("block_count", n_layer), ("attention.head_count", 4), ("attention.head_count_kv", 2), ("attention.key_length", 32), ("attention.sliding_window", 4)] {
            w.meta(&format!("gemma2.{k}"), Value::U32(v as u32));
        }
        w.meta("gemma2.attn_logit_softcapping", Value::F32(50.0));
        w.meta("gemma2.final_logit_softcapping", Value::F32(30.0));
        w.tensor("token_embd.weight", &[64, 8], GgmlType::F32, encode(GgmlType::F32, &[0.0; 512]).unwrap());
        w.tensor(&format!("blk.{}.attn_norm.weight", n_layer - 1), &[64], GgmlType::F32, encode(GgmlType::F32, &[1.0; 64]).unwrap());
        GgufFile::from_bytes("gemma2.gguf", w.to_bytes()).unwrap()
    };
    let s = ModelSpec::from_gguf(&file(4)).unwrap();
    assert_eq!((s.attn_softcap, s.final_softcap, s.swa_period, s.qk_norm, s.post_norms, s.rope_swa.is_none()), (Some(50.0), Some(30.0), 2, false, true, true));
    assert_eq!((s.activation, s.embd_scale), (Activation::GeluTanh, Some(8.0)));
    assert_eq!(
        (s.attention(0).unwrap().window, s.attention(1).unwrap().window),
        (Some(4), None)
    );
    assert_eq!(s.attn_scale, 1.0 / 32f64.sqrt());
    assert_eq!(ModelSpec::from_gguf(&file(46)).unwrap().attn_scale, 1.0 / 16f64.sqrt());
}
