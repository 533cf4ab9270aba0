//! Weights as the file stores them, in host memory: the packed matrices and float vectors of
//! every layer, each tensor's shape checked against the spec as it is read. The `cpu` device
//! computes from them; the GPU devices upload them.

use crate::DeviceError;
use oracle::loader::{RawTensor, TensorSource};
use oracle::quant::GgmlType;
use oracle::spec::{BlockKind, ModelSpec, Stage};
use std::path::Path;

/// A matrix as the file stores it: `rows` rows of `cols` values in `ty`'s blocks.
pub struct PackedMat {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: Vec<u8>,
}

/// A feed-forward block's matrices (one expert's, or the dense FFN's).
pub struct Ffn {
    pub gate: PackedMat,
    pub up: PackedMat,
    pub down: PackedMat,
    /// Biases of the gate, up and down products (GPT-OSS's experts).
    pub bias: Option<[Vec<f32>; 3]>,
}

/// An attention block's weights.
pub struct AttnWeights {
    pub wq: PackedMat,
    pub wk: PackedMat,
    pub wv: PackedMat,
    pub wo: PackedMat,
    pub bias: Option<[Vec<f32>; 3]>,
    pub bo: Option<Vec<f32>>,
    pub qk_norm: Option<[Vec<f32>; 2]>,
    /// One sink logit per query head (GPT-OSS).
    pub sinks: Option<Vec<f32>>,
}

/// A state-space block's weights: the input and output projections, the convolution's kernel
/// (`[conv_dim][d_conv]`) and bias, per head the time steps' bias, A (`-exp(A_log)`) and D, and
/// the gated norm's scales (`[d_inner]`, group after group). A gated DeltaNet's input
/// projection is q/k/v's (`attn_qkv`) beside z's (`gate_proj`) and b/a's (`ba_proj`, as stored:
/// interleaved per key head); it has no convolution bias (zeros) and no D, and its norm's scales
/// are one head's.
pub struct SsmWeights {
    pub in_proj: PackedMat,
    pub gate_proj: Option<PackedMat>,
    pub ba_proj: Option<PackedMat>,
    pub conv: Vec<f32>,
    pub conv_bias: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub a: Vec<f32>,
    pub d: Vec<f32>,
    pub norm: Vec<f32>,
    pub out: PackedMat,
}

/// A latent-attention block's weights: the query's compression and its norm (if any), the
/// query projection, the latent/shared-key projection and the latent's norm, the expansion as
/// the absorbed form uses it (per head its key rows `[n_head][qk_nope][kv_lora_rank]` and value
/// rows `[n_head][v_head_dim][kv_lora_rank]`, f32), the output projection.
pub struct MlaWeights {
    pub q_a: Option<(PackedMat, Vec<f32>)>,
    pub q: PackedMat,
    pub kv_a: PackedMat,
    pub kv_a_norm: Vec<f32>,
    pub k_b: Vec<f32>,
    pub v_b: Vec<f32>,
    pub wo: PackedMat,
}

/// Latent attention's whole expansion (`[n_head * (qk_nope + v_head_dim), kv_lora_rank]`, per
/// head its key rows then its value rows) as the absorbed form reads it: the key rows of every
/// head, then the value rows of every head.
pub fn split_kv_b(kv_b: &[f32], b: &oracle::spec::MlaBlock) -> (Vec<f32>, Vec<f32>) {
    let (nope, vd, r) = (b.qk_nope, b.v_head_dim, b.kv_lora_rank);
    let (mut k_b, mut v_b) = (Vec::with_capacity(b.n_head * nope * r), Vec::with_capacity(b.n_head * vd * r));
    for head in kv_b.chunks_exact(((nope + vd) * r).max(1)) {
        k_b.extend_from_slice(&head[..nope * r]);
        v_b.extend_from_slice(&head[nope * r..]);
    }
    (k_b, v_b)
}

/// A layer's mixing block, by kind.
pub enum Mixer {
    Attention(AttnWeights),
    Ssm(SsmWeights),
    Mla(MlaWeights),
}

impl Mixer {
    /// The attention block's weights; None for a block of another kind.
    pub fn attention(&self) -> Option<&AttnWeights> {
        match self {
            Mixer::Attention(a) => Some(a),
            Mixer::Ssm(_) | Mixer::Mla(_) => None,
        }
    }
}

/// One layer's weights.
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub mixer: Mixer,
    /// Empty in a model without feed-forward blocks (Mamba-2).
    pub ffn_norm: Vec<f32>,
    /// Gemma's norms of the attention and FFN outputs.
    pub post_norms: Option<[Vec<f32>; 2]>,
    pub dense: Option<Ffn>,
    pub router: Option<PackedMat>,
    pub router_bias: Option<Vec<f32>>,
    pub experts: Vec<Ffn>,
    pub shared: Option<Ffn>,
    pub shared_gate: Option<Vec<f32>>,
    /// The bias added to the router's scores for the choice only (DeepSeek V3's `exp_probs_b`).
    pub choice_bias: Option<Vec<f32>>,
}

/// A model's weights and its spec.
pub struct HostWeights {
    pub spec: ModelSpec,
    pub tok_embd: PackedMat,
    pub output_norm: Vec<f32>,
    pub output: Option<PackedMat>,
    pub layers: Vec<Layer>,
}

struct Loader<'a> {
    src: &'a dyn TensorSource,
    /// The file or directory, for error messages.
    label: String,
    /// The device loading it, for error messages.
    device: &'a str,
}

impl Loader<'_> {
    fn err(&self, case: &str, reason: impl std::fmt::Display) -> DeviceError {
        DeviceError::Failed { device: self.device.to_string(), case: case.to_string(), reason: reason.to_string() }
    }
    fn raw(&self, name: &str) -> Result<Option<RawTensor<'_>>, DeviceError> {
        self.src.raw(name).map_err(|e| self.err("model", e))
    }
    fn mat(&self, name: &str, rows: usize, cols: usize) -> Result<PackedMat, DeviceError> {
        self.opt_mat(name, rows, cols)?.ok_or_else(|| self.err(&self.label, format!("missing tensor `{name}`")))
    }
    fn opt_mat(&self, name: &str, rows: usize, cols: usize) -> Result<Option<PackedMat>, DeviceError> {
        let Some(t) = self.raw(name)? else { return Ok(None) };
        if t.dims.len() < 2 || t.dims[0] != cols || Some(t.n_elements()) != rows.checked_mul(cols) {
            return Err(self.err(&self.label, format!("tensor `{name}` has dims {:?}, expected [{cols}, {rows}]", t.dims)));
        }
        Ok(Some(PackedMat { ty: t.ty, rows, cols, bytes: t.bytes.to_vec() }))
    }
    /// Every expert's matrix out of a stacked [cols, rows, n_expert] tensor.
    fn experts(&self, name: &str, n_expert: usize, rows: usize, cols: usize) -> Result<Vec<PackedMat>, DeviceError> {
        let t = self.raw(name)?.ok_or_else(|| self.err(&self.label, format!("missing tensor `{name}`")))?;
        if t.dims != [cols, rows, n_expert] {
            return Err(self.err(&self.label, format!("tensor `{name}` has dims {:?}, expected [{cols}, {rows}, {n_expert}]", t.dims)));
        }
        let parts = t.parts(n_expert).map_err(|e| self.err(&self.label, format!("tensor `{name}`: {e} (one per expert)")))?;
        Ok(parts.map(|b| PackedMat { ty: t.ty, rows, cols, bytes: b.to_vec() }).collect())
    }
    /// Every expert's vector out of a stacked [n, n_expert] float tensor.
    fn expert_vecs(&self, name: &str, n_expert: usize, n: usize) -> Result<Vec<Vec<f32>>, DeviceError> {
        let t = self.raw(name)?.ok_or_else(|| self.err(&self.label, format!("missing tensor `{name}`")))?;
        if t.dims != [n, n_expert] {
            return Err(self.err(&self.label, format!("tensor `{name}` has dims {:?}, expected [{n}, {n_expert}]", t.dims)));
        }
        if !crate::shared::qdot::is_float(t.ty) {
            return Err(self.err(&self.label, format!("tensor `{name}`: expected float values, found {}", t.ty.name())));
        }
        let mut all = vec![0.0f32; n * n_expert];
        crate::shared::qdot::float_row(t.ty, &t.bytes, &mut all);
        Ok(all.chunks_exact(n).map(<[f32]>::to_vec).collect())
    }
    /// A float tensor of exactly GGML dims `dims` (trailing dimensions of one aside), row-major.
    fn shaped(&self, name: &str, dims: &[usize]) -> Result<Vec<f32>, DeviceError> {
        let t = self.raw(name)?.ok_or_else(|| self.err(&self.label, format!("missing tensor `{name}`")))?;
        let mut have = t.dims.clone();
        while have.len() > dims.len() && have.last() == Some(&1) {
            have.pop();
        }
        if have != dims {
            return Err(self.err(&self.label, format!("tensor `{name}` has dims {:?}, expected {dims:?}", t.dims)));
        }
        self.vec(name, dims.iter().product())
    }
    fn vec(&self, name: &str, n: usize) -> Result<Vec<f32>, DeviceError> {
        let m = self.mat_like_vec(name, n)?;
        m.ok_or_else(|| self.err(&self.label, format!("missing tensor `{name}`")))
    }
    fn mat_like_vec(&self, name: &str, n: usize) -> Result<Option<Vec<f32>>, DeviceError> {
        let Some(t) = self.raw(name)? else { return Ok(None) };
        if t.n_elements() != n || !crate::shared::qdot::is_float(t.ty) {
            return Err(self.err(&self.label, format!("tensor `{name}`: expected {n} float values, found {:?} {}", t.dims, t.ty.name())));
        }
        let mut out = vec![0.0f32; n];
        crate::shared::qdot::float_row(t.ty, &t.bytes, &mut out);
        Ok(Some(out))
    }
}

impl HostWeights {
    /// Loads a GGUF file or a safetensors directory (F32/F16/BF16 tensors, held as stored),
    /// every tensor's shape checked against the spec; `check` refuses a spec the device cannot
    /// run before any weight is read (errors name `device`).
    pub fn load(path: &Path, device: &str, check: &dyn Fn(&str, &ModelSpec) -> Result<(), String>) -> Result<HostWeights, DeviceError> {
        let err = |case: &str, reason: String| DeviceError::Failed { device: device.to_string(), case: case.to_string(), reason };
        // These errors name the file themselves.
        let (src, spec) = oracle::loader::open_weights(path).map_err(|e| err("model", e.to_string()))?;
        let label = src.label();
        // A copy of every stored tensor: refused up front when the machine cannot hold them.
        let packed = src.n_bytes().map_err(|e| err("model", e.to_string()))?;
        oracle::memory::check_fits(&label, "holding the packed weights", packed).map_err(|e| err("model", e.to_string()))?;
        check(&label, &spec).map_err(|why| err(&label, why))?;
        let (d, hd) = (spec.n_embd, spec.head_dim);
        let l = Loader { src: src.as_ref(), label, device };
        let ffn = |i: usize, suffix: &str, f: usize| -> Result<Ffn, DeviceError> {
            Ok(Ffn {
                gate: l.mat(&format!("blk.{i}.ffn_gate{suffix}.weight"), f, d)?,
                up: l.mat(&format!("blk.{i}.ffn_up{suffix}.weight"), f, d)?,
                down: l.mat(&format!("blk.{i}.ffn_down{suffix}.weight"), d, f)?,
                bias: None,
            })
        };
        let mut layers = Vec::new(); // not sized by the spec: a layer count the files do not back is an error below, not an allocation
        for i in 0..spec.n_layer {
            let n = |t: &str| format!("blk.{i}.{t}");
            let has_ffn = spec.layers[i].stages.iter().any(|s| matches!(s, Stage::DenseFfn | Stage::MoeFfn));
            let dense_stage = spec.layers[i].stages.contains(&Stage::DenseFfn);
            let moe = spec.moe.as_ref().filter(|_| has_ffn && !dense_stage);
            let (dense, router, experts, shared, shared_gate) = match moe {
                _ if !has_ffn => (None, None, Vec::new(), None, None),
                None => (Some(ffn(i, "", spec.n_ff)?), None, Vec::new(), None, None),
                Some(m) => {
                    let gates = l.experts(&n("ffn_gate_exps.weight"), m.n_expert, m.expert_ffn, d)?;
                    let ups = l.experts(&n("ffn_up_exps.weight"), m.n_expert, m.expert_ffn, d)?;
                    let downs = l.experts(&n("ffn_down_exps.weight"), m.n_expert, d, m.expert_ffn)?;
                    let mut biases: Vec<Option<[Vec<f32>; 3]>> = Vec::new();
                    if m.biases {
                        let g = l.expert_vecs(&n("ffn_gate_exps.bias"), m.n_expert, m.expert_ffn)?;
                        let u = l.expert_vecs(&n("ffn_up_exps.bias"), m.n_expert, m.expert_ffn)?;
                        let dn = l.expert_vecs(&n("ffn_down_exps.bias"), m.n_expert, d)?;
                        biases = g.into_iter().zip(u).zip(dn).map(|((g, u), dn)| Some([g, u, dn])).collect();
                    }
                    biases.resize_with(m.n_expert, || None);
                    let ex: Vec<Ffn> = gates.into_iter().zip(ups).zip(downs).zip(biases).map(|(((gate, up), down), bias)| Ffn { gate, up, down, bias }).collect();
                    let shared = match m.shared_ffn {
                        Some(f) => Some(ffn(i, "_shexp", f)?),
                        None => None,
                    };
                    let sg = if m.shared_gate { Some(l.vec(&n("ffn_gate_inp_shexp.weight"), d)?) } else { None };
                    (None, Some(l.mat(&n("ffn_gate_inp.weight"), m.n_expert, d)?), ex, shared, sg)
                }
            };
            let mixer = match spec.layers[i].block {
                BlockKind::Mla(b) => {
                    let (nope, vd, r, nh) = (b.qk_nope, b.v_head_dim, b.kv_lora_rank, b.n_head);
                    // The expansion, whole (per head its key rows, then its value rows) or split
                    // as llama.cpp's converter writes it (key rows transposed per head).
                    let (k_b, v_b) = if l.raw(&n("attn_kv_b.weight"))?.is_some() {
                        split_kv_b(&l.shaped(&n("attn_kv_b.weight"), &[r, b.kv_b_dim()])?, &b)
                    } else {
                        let kt = l.shaped(&n("attn_k_b.weight"), &[nope, r, nh])?;
                        let mut k_b = vec![0.0f32; nh * nope * r];
                        for (hj, row) in kt.chunks_exact(nope).enumerate() {
                            let (h, j) = (hj / r, hj % r);
                            row.iter().enumerate().for_each(|(c, v)| k_b[(h * nope + c) * r + j] = *v);
                        }
                        (k_b, l.shaped(&n("attn_v_b.weight"), &[r, vd, nh])?)
                    };
                    Mixer::Mla(MlaWeights {
                        q_a: match b.q_lora_rank {
                            0 => None,
                            qr => Some((l.mat(&n("attn_q_a.weight"), qr, d)?, l.vec(&n("attn_q_a_norm.weight"), qr)?)),
                        },
                        q: match b.q_lora_rank {
                            0 => l.mat(&n("attn_q.weight"), b.q_dim(), d)?,
                            qr => l.mat(&n("attn_q_b.weight"), b.q_dim(), qr)?,
                        },
                        kv_a: l.mat(&n("attn_kv_a_mqa.weight"), b.kv_a_dim(), d)?,
                        kv_a_norm: l.vec(&n("attn_kv_a_norm.weight"), r)?,
                        k_b,
                        v_b,
                        wo: l.mat(&n("attn_output.weight"), d, b.out_dim())?,
                    })
                }
                BlockKind::Attention(a) => {
                    let (qd, kvd) = (a.q_dim(), a.kv_dim());
                    Mixer::Attention(AttnWeights {
                        // With an output gate, each head's query rows then its gate's.
                        wq: l.mat(&n("attn_q.weight"), if spec.attn_gate { 2 * qd } else { qd }, d)?,
                        wk: l.mat(&n("attn_k.weight"), kvd, d)?,
                        wv: l.mat(&n("attn_v.weight"), kvd, d)?,
                        wo: l.mat(&n("attn_output.weight"), d, qd)?,
                        bias: if spec.qkv_bias { Some([l.vec(&n("attn_q.bias"), qd)?, l.vec(&n("attn_k.bias"), kvd)?, l.vec(&n("attn_v.bias"), kvd)?]) } else { None },
                        bo: if spec.out_bias { Some(l.vec(&n("attn_output.bias"), d)?) } else { None },
                        qk_norm: if spec.qk_norm { Some([l.vec(&n("attn_q_norm.weight"), hd)?, l.vec(&n("attn_k_norm.weight"), hd)?]) } else { None },
                        sinks: if spec.attn_sinks { Some(l.vec(&n("attn_sinks.weight"), a.n_head)?) } else { None },
                    })
                }
                BlockKind::Ssm(b) if b.kind == oracle::spec::SsmKind::GatedDelta => Mixer::Ssm(SsmWeights {
                    in_proj: l.mat(&n("attn_qkv.weight"), b.conv_dim(), d)?,
                    gate_proj: Some(l.mat(&n("attn_gate.weight"), b.d_inner, d)?),
                    ba_proj: Some(l.mat(&n("ssm_ba.weight"), 2 * b.n_head, d)?),
                    conv: l.shaped(&n("ssm_conv1d.weight"), &[b.d_conv, b.conv_dim()])?,
                    conv_bias: vec![0.0; b.conv_dim()],
                    dt_bias: l.vec(&n("ssm_dt.bias"), b.n_head)?,
                    a: l.vec(&n("ssm_a"), b.n_head)?,
                    d: Vec::new(),
                    norm: l.vec(&n("ssm_norm.weight"), b.head_dim())?,
                    out: l.mat(&n("ssm_out.weight"), d, b.d_inner)?,
                }),
                BlockKind::Ssm(b) => Mixer::Ssm(SsmWeights {
                    in_proj: l.mat(&n("ssm_in.weight"), b.in_dim(), d)?,
                    gate_proj: None,
                    ba_proj: None,
                    conv: l.shaped(&n("ssm_conv1d.weight"), &[b.d_conv, b.conv_dim()])?,
                    conv_bias: l.vec(&n("ssm_conv1d.bias"), b.conv_dim())?,
                    dt_bias: l.vec(&n("ssm_dt.bias"), b.n_head)?,
                    a: l.vec(&n("ssm_a"), b.n_head)?,
                    d: l.vec(&n("ssm_d"), b.n_head)?,
                    norm: l.shaped(&n("ssm_norm.weight"), &[b.d_inner / b.n_group, b.n_group])?,
                    out: l.mat(&n("ssm_out.weight"), d, b.d_inner)?,
                }),
            };
            layers.push(Layer {
                attn_norm: l.vec(&n("attn_norm.weight"), d)?,
                mixer,
                ffn_norm: if has_ffn { l.vec(&n("ffn_norm.weight"), d)? } else { Vec::new() },
                post_norms: if spec.post_norms {
                    Some([
                        l.vec(&n("post_attention_norm.weight"), d)?,
                        l.vec(&n("post_ffw_norm.weight"), d)?,
                    ])
                } else {
                    None
                },
                dense,
                router_bias: match moe {
                    Some(m) if m.biases => Some(l.vec(&n("ffn_gate_inp.bias"), m.n_expert)?),
                    _ => None,
                },
                choice_bias: match moe {
                    Some(m) if m.choice_bias => Some(l.vec(&n("exp_probs_b.bias"), m.n_expert)?),
                    _ => None,
                },
                router,
                experts,
                shared,
                shared_gate,
            });
        }
        let tok_embd = l.mat("token_embd.weight", spec.n_vocab, d)?;
        let output = if spec.tied_output { None } else { Some(l.mat("output.weight", spec.n_vocab, d)?) };
        let output_norm = l.vec("output_norm.weight", d)?;
        Ok(HostWeights { spec, tok_embd, output_norm, output, layers })
    }

}
