//! The devices under test on a Hugging Face safetensors directory (config.json + F32 or BF16
//! tensors, as checkpoints ship), judged by the oracle reading the same directory: `cpu` and
//! the GPU devices hold the tensors as stored, `fixed` converts them to its integer formats.

mod common;

use common::*;
use std::path::Path;

/// Writes synthetic `model` (tiny-llama or tiny-qwen3) under `dir` with Hugging Face names and a
/// config.json, every tensor's decoded values stored as `dtype` (F32, or BF16 rounded to nearest
/// even); `plant` may change a tensor's bytes (Hugging Face name, bytes).
fn write_dir(dir: &Path, model: &str, dtype: safetensors::Dtype, plant: impl Fn(&str, &mut Vec<u8>)) {
    let g = oracle::gguf::GgufFile::open(fixtures::resolve(model, true).unwrap()).unwrap();
    let mut bufs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for t in &g.tensors {
        let values = g.tensor_f32(t).unwrap();
        let name = oracle::loader::gguf_to_hf_name(&t.name).unwrap();
        let shape: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect(); // torch order
        let mut bytes: Vec<u8> = match dtype {
            safetensors::Dtype::BF16 => values
                .iter()
                .flat_map(|v| {
                    let b = v.to_bits();
                    (((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16).to_le_bytes()
                })
                .collect(),
            _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        plant(&name, &mut bytes);
        bufs.push((name, shape, bytes));
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = bufs.iter().map(|(n, s, b)| (n.clone(), safetensors::tensor::TensorView::new(dtype, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let (model_type, n_kv, eps, theta, tied) = if model == "tiny-qwen3" { ("qwen3", 1, 1e-6, 1_000_000.0, true) } else { ("llama", 2, 1e-5, 10_000.0, false) };
    let cfg = serde_json::json!({
        "model_type": model_type, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": n_kv,
        "head_dim": 64, "intermediate_size": 512, "num_hidden_layers": 2, "vocab_size": fixtures::synthetic::TINY_VOCAB,
        "rms_norm_eps": eps, "rope_theta": theta, "tie_word_embeddings": tied, "max_position_embeddings": 512,
        "hidden_act": "silu"
    });
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
}

#[test]
fn devices_run_safetensors_directories_and_pass_layer_diff_against_the_oracle() {
    for (model, dtype, devices) in [
        ("tiny-llama", safetensors::Dtype::F32, &["cpu", "fixed"][..]),
        ("tiny-qwen3", safetensors::Dtype::BF16, &["cpu", "fixed", "gpu-emu"][..]),
    ] {
        let dir = tempfile::tempdir().unwrap();
        write_dir(dir.path(), model, dtype, |_, _| {});
        for device in devices {
            let o = xtask(&["layer-diff", "--device", device, "--model", dir.path().to_str().unwrap(), "--report-dir", dir.path().join(format!("ld-{device}")).to_str().unwrap()], &[]);
            assert_eq!(o.status.code(), Some(0), "{model} {dtype:?} on {device}: {}", text(&o));
            let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join(format!("ld-{device}/report.json"))).unwrap()).unwrap();
            let executed = report["summary"]["executed"].as_u64().unwrap();
            assert!(executed > 20, "{model} {device}: {executed} taps compared");
        }
    }
}

#[test]
fn a_nan_in_a_safetensors_weight_is_refused_by_every_device_loader() {
    let dir = tempfile::tempdir().unwrap();
    // BF16 0x7fc0 is a NaN; element 5 of layer 1's up projection (row 0, column 5).
    write_dir(dir.path(), "tiny-llama", safetensors::Dtype::BF16, |name, b| {
        if name == "model.layers.1.mlp.up_proj.weight" {
            b[10..12].copy_from_slice(&0x7fc0u16.to_le_bytes());
        }
    });
    for device in ["ref", "cpu", "fixed", "gpu-emu"] {
        let o = xtask(&["run", "--model", dir.path().to_str().unwrap(), "--prompt-ids", "1", "--device", device], &[]);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{device}: {e}");
        // The oracle names the tensor by its GGUF name, the device loaders by the file's own.
        let named = e.contains("`blk.1.ffn_up.weight` holds") || e.contains("model.safetensors: tensor `model.layers.1.mlp.up_proj.weight` holds");
        assert!(named && e.contains("NaN at element 5 (row 0, column 5)") && !e.contains("panicked"), "{device}: {e}");
    }
}
