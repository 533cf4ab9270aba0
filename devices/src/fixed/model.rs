//! `fixed`'s whole model: the weights converted to its integer formats once at load, and the
//! forward pass in its kernels.

use super::kernels::*;
use super::FixedDevice;
use crate::shared::qdot;
use crate::{Arithmetic, DeviceError, FixedPoint, NumFormat};
use oracle::spec::{ModelSpec, Stage};

/// A whole model in integer arithmetic, dense or MoE.
pub struct FixedModel {
    spec: oracle::ModelSpec,
    /// The embedding table as Q16 values, `[n_vocab, n_embd]`.
    tok_embd: IntValues,
    output_norm: Vec<i64>,
    head: FixedWeights,
    layers: Vec<FixedLayer>,
    kv: LayerStates,
    /// The formats this model computes in (declared to the suites).
    point: FixedPoint,
}

/// What one layer keeps between calls, by the kind of its block.
enum LayerState {
    /// An attention layer's keys and values, Q16, `[len, kv_dim]` each.
    Kv { k: Vec<i64>, v: Vec<i64> },
}

/// Every layer's state and the positions it holds.
struct LayerStates {
    layers: Vec<LayerState>,
    len: usize,
}

impl LayerStates {
    fn new(spec: &ModelSpec) -> LayerStates {
        // A state-space layer is refused when the model loads (`shared::attention_block`).
        let layers = spec.layer_states(|_| LayerState::Kv { k: Vec::new(), v: Vec::new() }, |_| LayerState::Kv { k: Vec::new(), v: Vec::new() }, |_| LayerState::Kv { k: Vec::new(), v: Vec::new() });
        LayerStates { layers, len: 0 }
    }

    fn reset(&mut self) {
        for l in &mut self.layers {
            match l {
                LayerState::Kv { k, v } => {
                    k.clear();
                    v.clear();
                }
            }
        }
        self.len = 0;
    }

    /// Writes attention layer `li`'s keys and values for positions `start..` (rows of `width`),
    /// dropping anything it held from `start` on; returns everything it now holds.
    fn write(
        &mut self,
        li: usize,
        start: usize,
        width: usize,
        k: &[i64],
        v: &[i64],
    ) -> (&[i64], &[i64]) {
        let LayerState::Kv { k: kc, v: vc } = &mut self.layers[li];
        for (cache, new) in [(&mut *kc, k), (&mut *vc, v)] {
            cache.truncate(start * width);
            cache.extend_from_slice(new);
        }
        (kc, vc)
    }
}

struct FixedLayer {
    attn_norm: Vec<i64>,
    wq: FixedWeights,
    wk: FixedWeights,
    wv: FixedWeights,
    wo: FixedWeights,
    bias: Option<[Vec<i64>; 3]>,
    /// The attention output projection's bias (`attn_output.bias`), when the model has one.
    bo: Option<Vec<i64>>,
    /// GPT-OSS's sink logit per query head, in Q16.
    sinks: Option<Vec<i64>>,
    qk_norm: Option<[Vec<i64>; 2]>,
    ffn_norm: Vec<i64>,
    /// Gemma's norms of the attention and FFN outputs.
    post_norms: Option<[Vec<i64>; 2]>,
    ffn: Ffn,
}

/// One gated FFN (a dense layer's, an expert's or a shared expert's), with GPT-OSS's biases of
/// its gate, up and down products where the model has them, in Q16.
struct Expert {
    gate: FixedWeights,
    up: FixedWeights,
    down: FixedWeights,
    bias: Option<[Vec<i64>; 3]>,
}

/// A layer's FFN: dense, or a router over experts (with a shared expert and its sigmoid gate
/// where the model has them).
enum Ffn {
    Dense(Expert),
    Moe { router: FixedWeights, router_bias: Option<Vec<i64>>, experts: Vec<Expert>, shared: Option<Expert>, shared_gate: Option<Vec<i64>> },
}

fn model_err(what: impl std::fmt::Display) -> DeviceError {
    DeviceError::Failed { device: "fixed".into(), case: "model".into(), reason: what.to_string() }
}

impl FixedModel {
    /// Loads a GGUF file or a safetensors directory (F32/F16/BF16 tensors).
    pub fn load(path: &std::path::Path, int4: bool) -> Result<FixedModel, DeviceError> {
        let (src, spec) = oracle::loader::open_weights(path).map_err(model_err)?;
        let label = src.label();
        crate::shared::attention_model(&spec, "fixed").map_err(|why| model_err(format!("{label}: {why}")))?;
        // Every weight as a 32-bit Q24 value (one byte and a group scale in INT4; the embedding's
        // own count stands for its 32-bit Q16 table), and the table once more where the output
        // is tied to it or INT4: refused up front when the machine cannot hold them.
        let values = src.n_elements().map_err(model_err)?;
        let table = (spec.n_vocab as u64).saturating_mul(spec.n_embd as u64);
        let needed = values.saturating_mul(if int4 { 2 } else { 4 }).saturating_add(if int4 || spec.tied_output { table.saturating_mul(4) } else { 0 });
        oracle::memory::check_fits(&label, "holding the weights as integers", needed).map_err(model_err)?;
        let raw = |name: &str| -> Result<oracle::loader::RawTensor<'_>, DeviceError> { src.raw(name).map_err(model_err)?.ok_or_else(|| model_err(format!("{label}: missing tensor `{name}`"))) };
        let mat = |name: &str, rows: usize, cols: usize| -> Result<FixedWeights, DeviceError> {
            let t = raw(name)?;
            if Some(t.n_elements()) != rows.checked_mul(cols) || t.dims[0] != cols {
                return Err(model_err(format!("{label}: tensor `{name}` has dims {:?}, expected [{cols}, {rows}]", t.dims)));
            }
            Ok(convert_weights(t.ty, rows, cols, &t.bytes, int4 && cols.is_multiple_of(INT4_GROUP)))
        };
        let vecq = |name: &str, n: usize, frac: u32| -> Result<Vec<i64>, DeviceError> {
            let t = raw(name)?;
            if t.n_elements() != n || !qdot::is_float(t.ty) {
                return Err(model_err(format!("{label}: tensor `{name}`: expected {n} float values")));
            }
            let mut f = vec![0.0f32; n];
            qdot::float_row(t.ty, &t.bytes, &mut f);
            Ok(f.iter().map(|v| to_q(*v as f64, frac)).collect())
        };
        let (d, hd) = (spec.n_embd, spec.head_dim);
        // Every expert's matrix out of a stacked [cols, rows, n_expert] tensor; every expert's
        // bias out of a stacked [n, n_expert] one.
        let experts = |name: &str, n_expert: usize, rows: usize, cols: usize| -> Result<Vec<FixedWeights>, DeviceError> {
            let t = raw(name)?;
            if t.dims != [cols, rows, n_expert] {
                return Err(model_err(format!("{label}: tensor `{name}` has dims {:?}, expected [{cols}, {rows}, {n_expert}]", t.dims)));
            }
            let parts = t.parts(n_expert).map_err(|e| model_err(format!("{label}: tensor `{name}`: {e} (one per expert)")))?;
            Ok(parts.map(|b| convert_weights(t.ty, rows, cols, b, int4 && cols.is_multiple_of(INT4_GROUP))).collect())
        };
        let expert_vecs = |name: &str, n_expert: usize, n: usize| -> Result<Vec<Vec<i64>>, DeviceError> {
            Ok(vecq(name, n * n_expert, ACT)?.chunks_exact(n).map(<[i64]>::to_vec).collect())
        };
        let dense = |i: usize, suffix: &str, f: usize| -> Result<Expert, DeviceError> {
            let n = |t: &str| format!("blk.{i}.ffn_{t}{suffix}.weight");
            Ok(Expert { gate: mat(&n("gate"), f, d)?, up: mat(&n("up"), f, d)?, down: mat(&n("down"), d, f)?, bias: None })
        };
        let mut layers = Vec::new();
        for i in 0..spec.n_layer {
            let n = |t: &str| format!("blk.{i}.{t}");
            let a = crate::shared::attention_block(&spec, i, "fixed").map_err(model_err)?;
            let (qd, kvd) = (a.q_dim(), a.kv_dim());
            let ffn = match &spec.moe {
                None => Ffn::Dense(dense(i, "", spec.n_ff)?),
                Some(m) => {
                    let (ne, f) = (m.n_expert, m.expert_ffn);
                    let (gates, ups, downs) = (experts(&n("ffn_gate_exps.weight"), ne, f, d)?, experts(&n("ffn_up_exps.weight"), ne, f, d)?, experts(&n("ffn_down_exps.weight"), ne, d, f)?);
                    let mut biases: Vec<Option<[Vec<i64>; 3]>> = Vec::new();
                    if m.biases {
                        let (g, u, dn) = (expert_vecs(&n("ffn_gate_exps.bias"), ne, f)?, expert_vecs(&n("ffn_up_exps.bias"), ne, f)?, expert_vecs(&n("ffn_down_exps.bias"), ne, d)?);
                        biases = g.into_iter().zip(u).zip(dn).map(|((g, u), dn)| Some([g, u, dn])).collect();
                    }
                    biases.resize_with(ne, || None);
                    Ffn::Moe {
                        router: mat(&n("ffn_gate_inp.weight"), ne, d)?,
                        router_bias: if m.biases { Some(vecq(&n("ffn_gate_inp.bias"), ne, ACT)?) } else { None },
                        experts: gates.into_iter().zip(ups).zip(downs).zip(biases).map(|(((gate, up), down), bias)| Expert { gate, up, down, bias }).collect(),
                        shared: match m.shared_ffn {
                            Some(f) => Some(dense(i, "_shexp", f)?),
                            None => None,
                        },
                        shared_gate: if m.shared_gate { Some(vecq(&n("ffn_gate_inp_shexp.weight"), d, ACT)?) } else { None },
                    }
                }
            };
            layers.push(FixedLayer {
                attn_norm: vecq(&n("attn_norm.weight"), d, NORM)?,
                wq: mat(&n("attn_q.weight"), qd, d)?,
                wk: mat(&n("attn_k.weight"), kvd, d)?,
                wv: mat(&n("attn_v.weight"), kvd, d)?,
                wo: mat(&n("attn_output.weight"), d, qd)?,
                bias: if spec.qkv_bias {
                    Some([
                        vecq(&n("attn_q.bias"), qd, ACT)?,
                        vecq(&n("attn_k.bias"), kvd, ACT)?,
                        vecq(&n("attn_v.bias"), kvd, ACT)?,
                    ])
                } else {
                    None
                },
                bo: if spec.out_bias {
                    Some(vecq(&n("attn_output.bias"), d, ACT)?)
                } else {
                    None
                },
                sinks: if spec.attn_sinks {
                    Some(vecq(&n("attn_sinks.weight"), a.n_head, ACT)?)
                } else {
                    None
                },
                qk_norm: if spec.qk_norm {
                    Some([
                        vecq(&n("attn_q_norm.weight"), hd, NORM)?,
                        vecq(&n("attn_k_norm.weight"), hd, NORM)?,
                    ])
                } else {
                    None
                },
                ffn_norm: vecq(&n(spec.stored_ffn_norm()), d, NORM)?,
                post_norms: if spec.post_norms { Some([vecq(&n("post_attention_norm.weight"), d, NORM)?, vecq(&n("post_ffw_norm.weight"), d, NORM)?]) } else { None },
                ffn,
            });
        }
        // The embedding table as Q16 activations (rows are looked up, never multiplied).
        let te = raw("token_embd.weight")?;
        if Some(te.n_elements()) != spec.n_vocab.checked_mul(d) || te.dims[0] != d {
            return Err(model_err(format!("{label}: tensor `token_embd.weight` has dims {:?}, expected [{d}, {}]", te.dims, spec.n_vocab)));
        }
        let te_bytes = te.bytes;
        let row_bytes = te_bytes.len() / spec.n_vocab;
        let mut tok_embd = IntValues::with_capacity(spec.n_vocab * d);
        let (mut row, mut row_q) = (vec![0.0f32; d], vec![0i64; d]);
        for r in 0..spec.n_vocab {
            let rb = &te_bytes[r * row_bytes..(r + 1) * row_bytes];
            if qdot::is_float(te.ty) {
                qdot::float_row(te.ty, rb, &mut row);
            } else {
                qdot::dequantize_row(te.ty, rb, &mut row);
            }
            row_q.iter_mut().zip(&row).for_each(|(q, v)| *q = to_q(*v as f64, ACT));
            tok_embd.push_row(&row_q);
        }
        let head = if spec.tied_output { mat("token_embd.weight", spec.n_vocab, d)? } else { mat("output.weight", spec.n_vocab, d)? };
        let output_norm = vecq("output_norm.weight", d, NORM)?;
        let kv = LayerStates::new(&spec);
        Ok(FixedModel {
            spec,
            tok_embd,
            output_norm,
            head,
            layers,
            kv,
            point: FixedDevice { int4 }.point(),
        })
    }
}

fn tap_q(t: &mut dyn oracle::Tap, name: &str, start: usize, m: usize, w: usize, v: &[i64]) {
    if t.enabled() {
        let f: Vec<f32> = v.iter().map(|x| from_q(*x, ACT)).collect();
        t.record(name, start, m, w, &f);
    }
}

/// One gated FFN over `m` rows of `h`: gate and up products (with their biases), the model's
/// gated activation, the down product (with its bias). Records `ffn_gate`, `ffn_up` and
/// `ffn_act` where given a tap (a dense layer's; an expert's are not tapped).
fn expert_q(act: oracle::spec::Activation, f: &Expert, h: &[i64], m: usize, taps: Option<(&mut dyn oracle::Tap, usize, usize)>) -> Vec<i64> {
    let (mut g, mut u) = (matmul_q(h, m, &f.gate), matmul_q(h, m, &f.up));
    if let Some([bg, bu, _]) = &f.bias {
        (g, u) = (add_q(&g, bg), add_q(&u, bu));
    }
    let a: Vec<i64> = g.iter().zip(&u).map(|(x, y)| glu_q16(act, *x, *y)).collect();
    if let Some((t, li, start)) = taps {
        let w = g.len() / m.max(1);
        tap_q(t, &format!("blk.{li}.ffn_gate"), start, m, w, &g);
        tap_q(t, &format!("blk.{li}.ffn_up"), start, m, w, &u);
        tap_q(t, &format!("blk.{li}.ffn_act"), start, m, w, &a);
    }
    let down = matmul_q(&a, m, &f.down);
    match &f.bias {
        Some([_, _, bd]) => add_q(&down, bd),
        None => down,
    }
}

impl crate::DeviceModel for FixedModel {
    fn spec(&self) -> &oracle::ModelSpec {
        &self.spec
    }
    fn arithmetic(&self) -> Arithmetic {
        Arithmetic { storage: NumFormat::I32, accumulate: NumFormat::I32, transcendental_ulps: 0.0, fixed: Some(self.point), ..Arithmetic::F32 }
    }
    fn cached(&self) -> usize {
        self.kv.len
    }
    fn reset(&mut self) {
        self.kv.reset();
    }
    fn forward(&mut self, tokens: &[u32], taps: &mut dyn oracle::Tap) -> Result<Vec<f32>, DeviceError> {
        self.run(tokens, taps, true)
    }
    fn forward_last(&mut self, tokens: &[u32], taps: &mut dyn oracle::Tap) -> Result<Vec<f32>, DeviceError> {
        self.run(tokens, taps, false)
    }
}

impl FixedModel {
    /// One step over `tokens`; logits of every token (`all_logits`) or of the last one only (the
    /// output norm and head then run on that row alone; both are row by row).
    fn run(&mut self, tokens: &[u32], taps: &mut dyn oracle::Tap, all_logits: bool) -> Result<Vec<f32>, DeviceError> {
        let s = self.spec.clone();
        let m = tokens.len();
        if m == 0 {
            return Err(model_err("no tokens"));
        }
        let start = self.kv.len;
        let pos: Vec<usize> = (start..start + m).collect();
        let d = s.n_embd;
        let mut x = Vec::with_capacity(m * d);
        for &t in tokens {
            let t = t as usize;
            if t >= s.n_vocab {
                return Err(model_err(format!("token id {t} outside the vocabulary of {}", s.n_vocab)));
            }
            self.tok_embd.extend_into(t * d..(t + 1) * d, &mut x);
        }
        if let Some(scale) = s.embd_scale {
            // The scale in Q30, the product rounded back to Q16.
            let c = to_q(scale, TABLE) as i128;
            x.iter_mut().for_each(|v| *v = shr_round(*v as i128 * c, TABLE));
        }
        tap_q(taps, "inp_embd", start, m, d, &x);
        for li in 0..s.n_layer {
            let l = &self.layers[li];
            let name = |t: &str| format!("blk.{li}.{t}");
            let a = crate::shared::attention_block(&s, li, "fixed").map_err(model_err)?;
            let (hd, qd, kvd) = (a.head_dim, a.q_dim(), a.kv_dim());
            let (mut h, mut q, mut k, mut v, mut attn, mut out) = (
                Vec::new(),
                Vec::new(),
                Vec::new(),
                Vec::new(),
                Vec::new(),
                Vec::new(),
            );
            for stage in &s.layers[li].stages {
                match stage {
                    Stage::AttnNorm => {
                        h = rms_norm_q(&x, d, &l.attn_norm, s.norm_eps);
                        tap_q(taps, &name("attn_norm"), start, m, d, &h);
                    }
                    Stage::QkvProj => {
                        (q, k, v) = (
                            matmul_q(&h, m, &l.wq),
                            matmul_q(&h, m, &l.wk),
                            matmul_q(&h, m, &l.wv),
                        );
                        if let Some([bq, bk, bv]) = &l.bias {
                            (q, k, v) = (add_q(&q, bq), add_q(&k, bk), add_q(&v, bv));
                        }
                        tap_q(taps, &name("attn_q"), start, m, qd, &q);
                        tap_q(taps, &name("attn_k"), start, m, kvd, &k);
                        tap_q(taps, &name("attn_v"), start, m, kvd, &v);
                    }
                    Stage::QkNorm => {
                        let [qn, kn] = l
                            .qk_norm
                            .as_ref()
                            .ok_or_else(|| model_err("a q/k-norm stage without its weights"))?;
                        q = rms_norm_q(&q, hd, qn, s.norm_eps);
                        k = rms_norm_q(&k, hd, kn, s.norm_eps);
                        tap_q(taps, &name("attn_q_norm"), start, m, qd, &q);
                        tap_q(taps, &name("attn_k_norm"), start, m, kvd, &k);
                    }
                    Stage::Rope => {
                        rope_q(&mut q, &pos, a.n_head, hd, s.rope_of(&a));
                        rope_q(&mut k, &pos, a.n_head_kv, hd, s.rope_of(&a));
                        tap_q(taps, &name("attn_q_rope"), start, m, qd, &q);
                        tap_q(taps, &name("attn_k_rope"), start, m, kvd, &k);
                    }
                    Stage::Attention => {
                        let (kc, vc) = self.kv.write(li, start, kvd, &k, &v);
                        let extras = AttnExtras {
                            scale: Some(s.attn_scale),
                            sinks: l.sinks.as_deref(),
                            softcap: s.attn_softcap.map(SoftcapQ::new),
                        };
                        attn = attention_q(
                            &q,
                            &pos,
                            kc,
                            vc,
                            a.n_head,
                            a.n_head_kv,
                            hd,
                            a.window.unwrap_or(0),
                            &extras,
                        );
                        tap_q(taps, &name("attn_kqv"), start, m, qd, &attn);
                    }
                    Stage::AttnOutProj => {
                        attn = matmul_q(&attn, m, &l.wo);
                        if let Some(bo) = &l.bo {
                            attn = add_q(&attn, bo);
                        }
                        tap_q(taps, &name("attn_out"), start, m, d, &attn);
                    }
                    Stage::AttnPostNorm | Stage::FfnPostNorm => {
                        let [pa, pf] = l.post_norms.as_ref().ok_or_else(|| model_err("a post-norm stage without its weights"))?;
                        let (v, w, tap) = if *stage == Stage::AttnPostNorm { (&mut attn, pa, "attn_post_norm") } else { (&mut out, pf, "ffn_post_norm") };
                        *v = rms_norm_q(v, d, w, s.norm_eps);
                        tap_q(taps, &name(tap), start, m, d, v);
                    }
                    Stage::AttnResidual => {
                        x = add_q(&x, &attn);
                        tap_q(taps, &name("ffn_inp"), start, m, d, &x);
                    }
                    Stage::FfnNorm => {
                        h = rms_norm_q(&x, d, &l.ffn_norm, s.norm_eps);
                        tap_q(taps, &name("ffn_norm"), start, m, d, &h);
                    }
                    Stage::DenseFfn | Stage::MoeFfn => {
                        out = self.ffn(l, &h, m, taps, li, start)?;
                        tap_q(taps, &name("ffn_out"), start, m, d, &out);
                    }
                    Stage::SsmInProj | Stage::SsmConv | Stage::SsmScan | Stage::SsmNorm | Stage::SsmOutProj | Stage::MixerResidual | Stage::AttnGate => {
                        return Err(model_err(format!("layer {li}: a {stage:?} stage; fixed runs attention layers without an output gate only")));
                    }
                    Stage::FfnResidual => {
                        x = add_q(&x, &out);
                        tap_q(taps, &name("l_out"), start, m, d, &x);
                    }
                }
            }
        }
        self.kv.len = start + m;
        let (rows, row0) = if all_logits { (m, 0) } else { (1, m - 1) };
        let normed = rms_norm_q(&x[row0 * d..], d, &self.output_norm, s.norm_eps);
        tap_q(taps, "result_norm", start + row0, rows, d, &normed);
        let mut logits = matmul_q(&normed, rows, &self.head);
        if let Some(c) = s.final_softcap.map(SoftcapQ::new) {
            logits.iter_mut().for_each(|l| *l = c.apply(*l));
        }
        tap_q(taps, "result_output", start + row0, rows, s.n_vocab, &logits);
        Ok(logits.iter().map(|v| from_q(*v, ACT)).collect())
    }
}

impl FixedModel {
    /// Layer `li`'s FFN (dense or MoE) on its normed input `h` (`m` rows).
    fn ffn(
        &self,
        l: &FixedLayer,
        h: &[i64],
        m: usize,
        taps: &mut dyn oracle::Tap,
        li: usize,
        start: usize,
    ) -> Result<Vec<i64>, DeviceError> {
        let s = &self.spec;
        let d = s.n_embd;
        let name = |t: &str| format!("blk.{li}.{t}");
        Ok(match &l.ffn {
            Ffn::Dense(f) => expert_q(s.activation, f, h, m, Some((taps, li, start))),
            Ffn::Moe {
                router,
                router_bias,
                experts,
                shared,
                shared_gate,
            } => {
                let ms = s
                    .moe
                    .as_ref()
                    .ok_or_else(|| model_err("a MoE layer without the MoE spec"))?;
                let mut logits = matmul_q(h, m, router);
                if let Some(b) = router_bias {
                    logits = add_q(&logits, b);
                }
                let (ids, weights, probs) = moe_route_q(
                    &logits,
                    ms.n_expert,
                    ms.n_expert_used,
                    ms.gating == oracle::spec::Gating::Sigmoid,
                    ms.normalize_topk,
                );
                tap_q(taps, &name("ffn_moe_probs"), start, m, ms.n_expert, &probs);
                if taps.enabled() {
                    let topk: Vec<f32> = ids.iter().map(|&e| e as f32).collect();
                    taps.record(&name("ffn_moe_topk"), start, m, ms.n_expert_used, &topk);
                }
                let mut out = vec![0i64; m * d];
                for t in 0..m {
                    let ht = &h[t * d..(t + 1) * d];
                    let o = &mut out[t * d..(t + 1) * d];
                    for j in 0..ms.n_expert_used {
                        let e = experts
                            .get(ids[t * ms.n_expert_used + j] as usize)
                            .ok_or_else(|| model_err("an expert id past the experts"))?;
                        add_scaled_q(
                            o,
                            &expert_q(s.activation, e, ht, 1, None),
                            weights[t * ms.n_expert_used + j],
                        );
                    }
                    if let Some(sf) = shared {
                        // The shared expert's gate: sigmoid of a Q16 dot product, exact in 128 bits.
                        let g = shared_gate.as_ref().map_or(1i64 << ACT, |gw| {
                            sigmoid_q16(shr_round(
                                ht.iter()
                                    .zip(gw)
                                    .map(|(a, b)| *a as i128 * *b as i128)
                                    .sum(),
                                ACT,
                            ))
                        });
                        add_scaled_q(o, &expert_q(s.activation, sf, ht, 1, None), g);
                    }
                }
                out
            }
        })
    }
}
