//! GPT-OSS checkpoints (`GptOssForCausalLM`): their names, their expert tensors rearranged to
//! the GGUF layout, and experts stored as OpenAI publishes them (MXFP4 blocks and scales)
//! repacked into GGUF MXFP4 rows.

use super::{rename, LAYER_NAMES, MODEL_NAMES};

/// How a GPT-OSS checkpoint's expert tensor (Transformers `GptOssExperts`, torch order; its
/// matrices multiply as `x @ W`, gate and up interleaved column by column) becomes a GGUF one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum OssPart {
    /// `gate_up_proj` `[n_expert, hidden, 2 * ffn]`: columns `h, h + 2, ...` (0 gate, 1 up), as
    /// `[n_expert, ffn, hidden]`.
    GateUp(usize),
    /// `gate_up_proj_bias` `[n_expert, 2 * ffn]`: elements `h, h + 2, ...`, as `[n_expert, ffn]`.
    GateUpBias(usize),
    /// `down_proj` `[n_expert, ffn, hidden]` as `[n_expert, hidden, ffn]`.
    Down,
    /// `gate_up_proj_blocks` `[n_expert, 2 * ffn, hidden / 32, 16]` with its `_scales`: rows
    /// `h, h + 2, ...` as MXFP4 `[n_expert, ffn, hidden]`.
    GateUpBlocks(usize),
    /// `down_proj_blocks` `[n_expert, hidden, ffn / 32, 16]` with its `_scales`, as MXFP4.
    DownBlocks,
}

impl OssPart {
    /// Whether this part is MXFP4 blocks, read with their scales.
    pub(super) fn is_blocks(self) -> bool {
        matches!(self, OssPart::GateUpBlocks(_) | OssPart::DownBlocks)
    }

    /// The torch-order shape and values of `x` (torch-order `shape`) rearranged; None when
    /// `shape` is not what this part expects.
    pub(super) fn apply(self, shape: &[usize], x: &[f32]) -> Option<(Vec<usize>, Vec<f32>)> {
        match (self, shape) {
            (OssPart::GateUp(h), &[e, rows, cols2]) if cols2 % 2 == 0 => {
                let f = cols2 / 2;
                let out = (0..e).flat_map(|ei| (0..f).flat_map(move |j| (0..rows).map(move |c| x[(ei * rows + c) * cols2 + 2 * j + h]))).collect();
                Some((vec![e, f, rows], out))
            }
            (OssPart::GateUpBias(h), &[e, n2]) if n2 % 2 == 0 => Some((vec![e, n2 / 2], x.iter().skip(h).step_by(2).copied().collect())),
            (OssPart::Down, &[e, rows, cols]) => {
                let out = (0..e).flat_map(|ei| (0..cols).flat_map(move |c| (0..rows).map(move |j| x[(ei * rows + j) * cols + c]))).collect();
                Some((vec![e, cols, rows], out))
            }
            _ => None,
        }
    }
}

/// GPT-OSS's per-layer tensors (`GptOssForCausalLM`) other than the experts: its FFN norm is
/// stored as llama.cpp's converter stores it ([`ModelSpec::stored_ffn_norm`]), its router and
/// sinks under their GGUF names, the rest as [`LAYER_NAMES`] names them.
const GPT_OSS_LAYER_NAMES: [(&str, &str); 5] = [
    ("post_attention_layernorm.weight", "post_attention_norm.weight"),
    ("self_attn.sinks", "attn_sinks.weight"),
    ("mlp.router.weight", "ffn_gate_inp.weight"),
    ("mlp.router.bias", "ffn_gate_inp.bias"),
    // [n_expert, hidden] in torch order: the GGUF tensor as it is.
    ("mlp.experts.down_proj_bias", "ffn_down_exps.bias"),
];

/// Maps a GPT-OSS checkpoint's tensor name (other than its experts') to its GGUF name.
pub fn gpt_oss_hf_to_gguf_name(hf: &str) -> Option<String> {
    let others = LAYER_NAMES.into_iter().filter(|(h, _)| *h != "post_attention_layernorm.weight");
    rename(hf, MODEL_NAMES.into_iter(), GPT_OSS_LAYER_NAMES.into_iter().chain(others), "model.layers.", "blk.")
}

/// A GPT-OSS checkpoint's expert tensor: the GGUF tensors it holds, each with how to read it.
pub(super) fn gpt_oss_experts(hf: &str) -> Option<Vec<(String, OssPart)>> {
    let (layer, rest) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let n = |t: &str| format!("blk.{layer}.{t}");
    match rest {
        "mlp.experts.gate_up_proj" => Some(vec![(n("ffn_gate_exps.weight"), OssPart::GateUp(0)), (n("ffn_up_exps.weight"), OssPart::GateUp(1))]),
        "mlp.experts.gate_up_proj_bias" => Some(vec![(n("ffn_gate_exps.bias"), OssPart::GateUpBias(0)), (n("ffn_up_exps.bias"), OssPart::GateUpBias(1))]),
        "mlp.experts.down_proj" => Some(vec![(n("ffn_down_exps.weight"), OssPart::Down)]),
        "mlp.experts.gate_up_proj_blocks" => Some(vec![(n("ffn_gate_exps.weight"), OssPart::GateUpBlocks(0)), (n("ffn_up_exps.weight"), OssPart::GateUpBlocks(1))]),
        "mlp.experts.down_proj_blocks" => Some(vec![(n("ffn_down_exps.weight"), OssPart::DownBlocks)]),
        _ => None,
    }
}

/// The `_blocks` tensor whose scales a GPT-OSS expert `_scales` tensor holds; None for any
/// other name.
pub(super) fn blocks_of_scales(hf: &str) -> Option<String> {
    let base = hf.strip_suffix("_scales")?;
    (base.ends_with(".mlp.experts.gate_up_proj") || base.ends_with(".mlp.experts.down_proj")).then(|| format!("{base}_blocks"))
}

/// MXFP4 expert blocks (`[n_expert, rows, blocks, 16]`: two E2M1 codes a byte, element `2k` in
/// byte `k`'s low nibble, `2k + 1` in its high one) and their E8M0 scales (`[n_expert, rows,
/// blocks]`) as GGUF MXFP4 rows: each block its scale byte, then 16 bytes holding element `k` in
/// the low nibble and `k + 16` in the high. `how` picks the rows (gate or up of interleaved
/// rows, or all). Returns GGML dims `[blocks * 32, rows, n_expert]` and the bytes; None when
/// the shapes do not fit together or the data is not as long as they say.
pub(super) fn mxfp4_rows(how: OssPart, blocks_shape: &[usize], blocks: &[u8], scales_shape: &[usize], scales: &[u8]) -> Option<(Vec<usize>, Vec<u8>)> {
    let &[e, r, g, 16] = blocks_shape else { return None };
    if scales_shape != [e, r, g] || scales.len() != e.checked_mul(r)?.checked_mul(g)? || blocks.len() != scales.len().checked_mul(16)? {
        return None;
    }
    let (rows, step, first) = match how {
        OssPart::GateUpBlocks(h) if r % 2 == 0 && h < 2 => (r / 2, 2, h),
        OssPart::DownBlocks => (r, 1, 0),
        _ => return None,
    };
    let mut out = Vec::with_capacity(e * rows * g * 17);
    for ei in 0..e {
        for j in 0..rows {
            let row = ei * r + first + j * step;
            for b in 0..g {
                let at = row * g + b;
                out.push(scales[at]);
                let src = &blocks[at * 16..at * 16 + 16];
                let code = |i: usize| if i % 2 == 0 { src[i / 2] & 0xF } else { src[i / 2] >> 4 };
                out.extend((0..16).map(|k| code(k) | (code(k + 16) << 4)));
            }
        }
    }
    Some((vec![g * 32, rows, e], out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::SafetensorsDir;
    use crate::quant::GgmlType;
    use crate::tensor::RawTensor;
    use std::borrow::Cow;

    /// E2M1's sixteen values (OCP MX), as transformers' `FP4_VALUES` lists them.
    const E2M1: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

    #[test]
    fn mxfp4_expert_blocks_become_gguf_rows_of_the_same_values() {
        // One expert, rows gate 0, up 0, gate 1, up 1 (interleaved), one block each: element i of
        // row r holds code (i + r) % 16, two a byte, the low nibble first; scales 2^(r - 1).
        let (e, r) = (1usize, 4usize);
        let blocks: Vec<u8> = (0..r).flat_map(|row| (0..16).map(move |k| (((2 * k + row) % 16) | (((2 * k + 1 + row) % 16) << 4)) as u8)).collect();
        let scales: Vec<u8> = (0..r).map(|row| 126 + row as u8).collect();
        for (how, picked) in [(OssPart::GateUpBlocks(0), [0, 2]), (OssPart::GateUpBlocks(1), [1, 3])] {
            let (dims, bytes) = mxfp4_rows(how, &[e, r, 1, 16], &blocks, &[e, r, 1], &scales).unwrap();
            assert_eq!(dims, [32, 2, 1]);
            let got = RawTensor { dims, ty: GgmlType::MXFP4, bytes: Cow::Owned(bytes) }.decode().unwrap().data;
            let want: Vec<f32> = picked.iter().flat_map(|&row| (0..32).map(move |i| E2M1[(i + row) % 16] * 2f32.powi(row as i32 - 1))).collect();
            assert_eq!(got, want, "{how:?}");
        }
        let (dims, _) = mxfp4_rows(OssPart::DownBlocks, &[e, r, 1, 16], &blocks, &[e, r, 1], &scales).unwrap();
        assert_eq!(dims, [32, 4, 1]);
        // Shapes that do not fit together, or data shorter than they say.
        assert!(mxfp4_rows(OssPart::DownBlocks, &[e, r, 1, 16], &blocks, &[e, r, 2], &scales).is_none());
        assert!(mxfp4_rows(OssPart::DownBlocks, &[e, r, 1, 8], &blocks, &[e, r, 1], &scales).is_none());
        assert!(mxfp4_rows(OssPart::DownBlocks, &[e, r, 1, 16], &blocks[1..], &[e, r, 1], &scales).is_none());
        assert!(mxfp4_rows(OssPart::GateUpBlocks(0), &[e, 3, 1, 16], &blocks[..48], &[e, 3, 1], &scales[..3]).is_none());
        assert!(mxfp4_rows(OssPart::Down, &[e, r, 1, 16], &blocks, &[e, r, 1], &scales).is_none());
    }

    #[test]
    fn mxfp4_blocks_need_their_scales_and_scales_their_blocks() {
        let cfg = r#"{"model_type": "gpt_oss", "hidden_size": 32, "intermediate_size": 32, "num_attention_heads": 1, "num_key_value_heads": 1,
            "head_dim": 32, "num_hidden_layers": 1, "vocab_size": 2, "num_local_experts": 1, "num_experts_per_tok": 1, "sliding_window": 4,
            "layer_types": ["full_attention"], "rope_theta": 10000.0}"#;
        let blocks = vec![0u8; 64 * 16];
        let scales = vec![127u8; 64];
        for (names, expect) in [
            (["gate_up_proj_blocks", "down_proj_scales"], "`model.layers.0.mlp.experts.gate_up_proj_blocks` holds MXFP4 blocks, but its scales (`model.layers.0.mlp.experts.gate_up_proj_scales`) are not in the files"),
            (["down_proj_scales", "gate_up_proj_scales"], "model.layers.0.mlp.experts.down_proj_scales in"),
        ] {
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("config.json"), cfg).unwrap();
            let view = |n: &str| {
                let (shape, data) = if n.ends_with("_blocks") { (vec![1, 64, 1, 16], &blocks) } else { (vec![1, 64, 1], &scales) };
                (format!("model.layers.0.mlp.experts.{n}"), safetensors::tensor::TensorView::new(safetensors::Dtype::U8, shape, data).unwrap())
            };
            safetensors::serialize_to_file(names.map(view), None, &dir.path().join("model.safetensors")).unwrap();
            let e = SafetensorsDir::open(dir.path()).err().expect("refused").to_string();
            assert!(e.contains(expect), "{e}");
        }
    }
}
