//! `fixed`'s model at load: the weights as the file stores them (`shared::host`, shapes checked
//! against the spec), converted layer by layer to the device's integer formats — matrices Q24
//! (or INT4 groups with a Q24 scale), norm scales Q20, biases and the embedding table Q16.

use super::kernels::*;
use super::model_err;
use super::model::{Expert, Ffn, FixedAttn, FixedLayer, FixedMixer, FixedMla, FixedModel, FixedSsm};
use crate::shared::host::{self, HostWeights, PackedMat};
use crate::shared::qdot;
use crate::DeviceError;
use oracle::spec::BlockKind;

/// A vector of float values on the grid of `frac` fractional bits.
fn vec_q(v: &[f32], frac: u32) -> Vec<i64> {
    v.iter().map(|x| to_q(*x as f64, frac)).collect()
}

/// Loads a GGUF file or a safetensors directory (float or block-quantized tensors).
pub(super) fn load(path: &std::path::Path, int4: bool) -> Result<FixedModel, DeviceError> {
    let (src, spec) = oracle::loader::open_weights(path).map_err(model_err)?;
    let label = src.label();
    // Every weight as a 32-bit Q24 value (one byte and a group scale in INT4; the embedding's
    // own count stands for its 32-bit Q16 table), and the table once more where the output
    // is tied to it or INT4, beside the stored bytes of one layer at a time: refused up front
    // when the machine cannot hold them.
    let values = src.n_elements().map_err(model_err)?;
    let table = (spec.n_vocab as u64).saturating_mul(spec.n_embd as u64);
    let needed = values.saturating_mul(if int4 { 2 } else { 4 }).saturating_add(if int4 || spec.tied_output { table.saturating_mul(4) } else { 0 });
    oracle::memory::check_fits(&label, "holding the weights as integers", needed).map_err(model_err)?;
    // Where the file stores a latent expansion split (llama.cpp's converter: each head's key
    // rows transposed), INT4 groups run along the stored rows, not the rows the kernel reads.
    let split_k_b: Vec<bool> = (0..spec.n_layer).map(|i| src.raw(&format!("blk.{i}.attn_kv_b.weight")).map(|t| t.is_none())).collect::<Result<_, _>>().map_err(model_err)?;
    drop(src);
    let HostWeights { spec, tok_embd, output_norm, output, layers: host_layers } = HostWeights::load(path, "fixed", &|_, _| Ok(()))?;
    let mat = |p: &PackedMat| convert_weights(p.ty, p.rows, p.cols, &p.bytes, int4 && p.cols.is_multiple_of(INT4_GROUP));
    let expert = |f: &host::Ffn| Expert { gate: mat(&f.gate), up: mat(&f.up), down: mat(&f.down), bias: f.bias.as_ref().map(|b| b.each_ref().map(|v| vec_q(v, ACT))) };
    let mut layers = Vec::with_capacity(host_layers.len());
    for (li, l) in host_layers.into_iter().enumerate() {
        let mixer = match (&l.mixer, spec.layers[li].block) {
            (host::Mixer::Attention(a), _) => FixedMixer::Attention(FixedAttn {
                wq: mat(&a.wq),
                wk: mat(&a.wk),
                wv: mat(&a.wv),
                wo: mat(&a.wo),
                bias: a.bias.as_ref().map(|b| b.each_ref().map(|v| vec_q(v, ACT))),
                bo: a.bo.as_deref().map(|v| vec_q(v, ACT)),
                sinks: a.sinks.as_deref().map(|v| vec_q(v, ACT)),
                qk_norm: a.qk_norm.as_ref().map(|n| n.each_ref().map(|v| vec_q(v, NORM))),
            }),
            (host::Mixer::Mla(w), BlockKind::Mla(b)) => {
                let (nope, r) = (b.qk_nope, b.kv_lora_rank);
                FixedMixer::Mla(FixedMla {
                    q_a: w.q_a.as_ref().map(|(m, n)| (mat(m), vec_q(n, NORM))),
                    q: mat(&w.q),
                    kv_a: mat(&w.kv_a),
                    kv_a_norm: vec_q(&w.kv_a_norm, NORM),
                    // Key rows `[head][qk_nope][rank]`: stored so (`attn_kv_b`), or each head's
                    // transposed (`attn_k_b`, rows of qk_nope).
                    k_b: expansion(&w.k_b, if split_k_b[li] { Some(nope) } else { None }, r, int4),
                    v_b: expansion(&w.v_b, None, r, int4),
                    wo: mat(&w.wo),
                })
            }
            (host::Mixer::Ssm(w), BlockKind::Ssm(_)) => FixedMixer::Ssm(FixedSsm {
                in_proj: mat(&w.in_proj),
                gate_proj: w.gate_proj.as_ref().map(mat),
                ba_proj: w.ba_proj.as_ref().map(mat),
                conv: vec_q(&w.conv, WGT),
                conv_bias: vec_q(&w.conv_bias, ACT),
                dt_bias: vec_q(&w.dt_bias, ACT),
                a: vec_q(&w.a, WGT),
                d: vec_q(&w.d, WGT),
                norm: vec_q(&w.norm, NORM),
                out: mat(&w.out),
            }),
            _ => return Err(model_err(format!("{label}: layer {li}: a block of a kind fixed does not run"))),
        };
        let ffn = match (&l.dense, &l.router) {
            (Some(f), _) => Some(Ffn::Dense(expert(f))),
            (None, Some(router)) => Some(Ffn::Moe {
                router: mat(router),
                router_bias: l.router_bias.as_deref().map(|v| vec_q(v, ACT)),
                choice_bias: l.choice_bias.as_deref().map(|v| vec_q(v, ACT)),
                experts: l.experts.iter().map(expert).collect(),
                shared: l.shared.as_ref().map(expert),
                shared_gate: l.shared_gate.as_deref().map(|v| vec_q(v, ACT)),
            }),
            (None, None) => None,
        };
        layers.push(FixedLayer { attn_norm: vec_q(&l.attn_norm, NORM), mixer, ffn_norm: vec_q(&l.ffn_norm, NORM), post_norms: l.post_norms.as_ref().map(|n| n.each_ref().map(|v| vec_q(v, NORM))), ffn });
    }
    // The embedding table as Q16 activations (rows are looked up, never multiplied).
    let d = spec.n_embd;
    let row_bytes = tok_embd.bytes.len() / spec.n_vocab.max(1);
    let mut table = IntValues::with_capacity(spec.n_vocab * d);
    let (mut row, mut row_q) = (vec![0.0f32; d], vec![0i64; d]);
    for rb in tok_embd.bytes.chunks_exact(row_bytes.max(1)).take(spec.n_vocab) {
        if qdot::is_float(tok_embd.ty) {
            qdot::float_row(tok_embd.ty, rb, &mut row);
        } else {
            qdot::dequantize_row(tok_embd.ty, rb, &mut row);
        }
        row_q.iter_mut().zip(&row).for_each(|(q, v)| *q = to_q(*v as f64, ACT));
        table.push_row(&row_q);
    }
    let head = mat(output.as_ref().unwrap_or(&tok_embd));
    Ok(FixedModel::new(spec, table, vec_q(&output_norm, NORM), head, layers, int4))
}

/// A latent expansion's rows (`[n_head][rows][rank]`, f32) as Q24 values, or, under INT4, each
/// value as its group of the stored layout gives it (`q * s`, the same values the emulation of
/// the declared arithmetic holds): groups along each row of `rank` where the file stores these
/// rows, along each column of `transposed` rows where it stores every head transposed (a
/// length that is not a multiple of the group stays on the Q24 grid).
fn expansion(w: &[f32], transposed: Option<usize>, rank: usize, int4: bool) -> Vec<i64> {
    let grouped = |g: &[f32]| -> Vec<i64> {
        let (q, s) = int4_group(g);
        q.iter().map(|q| *q as i64 * s).collect()
    };
    match (int4, transposed) {
        (false, _) => vec_q(w, WGT),
        (true, None) if rank.is_multiple_of(INT4_GROUP) => w.chunks(INT4_GROUP).flat_map(grouped).collect(),
        (true, Some(rows)) if rows.is_multiple_of(INT4_GROUP) && rank > 0 => {
            // Per head `[rows][rank]`: each column's `rows` values are one stored row.
            let mut out = vec![0i64; w.len()];
            for (head, o) in w.chunks(rows * rank).zip(out.chunks_mut(rows * rank)) {
                for c in 0..rank {
                    let col: Vec<f32> = (0..rows).map(|i| head[i * rank + c]).collect();
                    for (i, g) in col.chunks(INT4_GROUP).enumerate() {
                        for (j, v) in grouped(g).into_iter().enumerate() {
                            o[(i * INT4_GROUP + j) * rank + c] = v;
                        }
                    }
                }
            }
            out
        }
        (true, _) => vec_q(w, WGT),
    }
}
