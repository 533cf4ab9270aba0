//! A whole model run through a device's ops: the forward pass of a dense grouped-query attention
//! model composed of the kernel suite's op cases (`rms_norm`, `matmul` with the weights as the
//! file stores them, `add_bias`, `qk_norm`, `rope`, `attention`, `swiglu`/`geglu`, `add`), each
//! one `Device::run_op` call. A device with ops and no model of its own (a faulty variant of the
//! kernel-suite sensitivity tests, an op-only engine) runs layer-diff this way, so a bug in one of
//! its ops shows at the tap that op makes, and `reduce` can rebuild that op as a case the same
//! device fails alone. The embedding rows are looked up on the host (a copy, no arithmetic).

use crate::shared::host::{HostWeights, Mixer, PackedMat};
use crate::shared::qdot;
use crate::{Arithmetic, Device, DeviceError, DeviceModel};
use oracle::registry::{Input, Op, OpCase, Output, Tensor};
use oracle::spec::{Activation, BlockKind, ModelSpec, RopeScaling, RopeStyle, Stage};

pub struct OpModel {
    device: std::sync::Arc<dyn Device>,
    weights: HostWeights,
    /// Every layer's cached keys and values, `[len, kv_dim]` each.
    kv: Vec<(Vec<f32>, Vec<f32>)>,
    len: usize,
    arithmetic: Arithmetic,
}

/// Why a model cannot run as the kernel suite's ops, if it cannot: anything but dense GQA
/// attention layers with the standard stages, the suite's attention scale and RoPE unscaled.
fn refusal(spec: &ModelSpec) -> Result<(), String> {
    const STAGES: [Stage; 10] = [Stage::AttnNorm, Stage::QkvProj, Stage::QkNorm, Stage::Rope, Stage::Attention, Stage::AttnOutProj, Stage::AttnResidual, Stage::FfnNorm, Stage::DenseFfn, Stage::FfnResidual];
    for (li, l) in spec.layers.iter().enumerate() {
        let BlockKind::Attention(a) = l.block else { return Err(format!("layer {li} is not a grouped-query attention layer")) };
        if let Some(s) = l.stages.iter().find(|s| !STAGES.contains(s)) {
            return Err(format!("layer {li} has a {s:?} stage, which no op case composes"));
        }
        if (spec.attn_scale - 1.0 / (a.head_dim as f64).sqrt()).abs() > 1e-12 {
            return Err("the attention scale is not 1/sqrt(head_dim), the attention op's".into());
        }
    }
    if spec.rope.scaling != RopeScaling::None || spec.rope.freq_factors.is_some() || spec.rope_swa.is_some() {
        return Err("the model's RoPE is scaled; the rope op composed here takes none".into());
    }
    if spec.moe.is_some() || spec.attn_sinks || spec.attn_softcap.is_some() || spec.final_softcap.is_some() || spec.embd_scale.is_some() || spec.residual_scale.is_some() || spec.logit_scale.is_some() || spec.activation == Activation::SwigluOai {
        return Err("the model needs more than the dense ops composed here (experts, sinks, soft-caps or scales)".into());
    }
    Ok(())
}

fn f32_in(rows: usize, cols: usize, data: Vec<f32>) -> Input {
    Input::F32(Tensor { shape: vec![rows, cols], data })
}

fn vec_in(data: &[f32]) -> Input {
    Input::F32(Tensor { shape: vec![data.len()], data: data.to_vec() })
}

fn mat_in(p: &PackedMat) -> Input {
    Input::Quant { ty: p.ty, rows: p.rows, cols: p.cols, bytes: p.bytes.clone() }
}

impl OpModel {
    /// The model at `path` run through `device`'s ops; refused where the model needs an op or a
    /// parameter the composition does not have.
    pub fn load(device: std::sync::Arc<dyn Device>, path: &std::path::Path) -> Result<OpModel, DeviceError> {
        let name = device.name();
        let weights = HostWeights::load(path, &name, &|_, s| refusal(s))?;
        let probe = OpCase { op: Op::Matmul, id: "model".into(), seed: 0, inputs: vec![("w", mat_in(&weights.tok_embd))], params: Default::default() };
        let arithmetic = device.arithmetic(&probe);
        let kv = vec![(Vec::new(), Vec::new()); weights.layers.len()];
        Ok(OpModel { device, weights, kv, len: 0, arithmetic })
    }

    /// One op case on the device: its first output's values.
    fn op(&self, op: Op, what: &str, inputs: Vec<(&'static str, Input)>, params: &[(&'static str, f64)]) -> Result<Vec<f32>, DeviceError> {
        let case = OpCase { op, id: format!("model:{what}"), seed: 0, inputs, params: params.iter().copied().collect() };
        match self.device.run_op(&case)?.into_iter().next() {
            Some(Output::F32(t)) => Ok(t.data),
            _ => Err(DeviceError::Failed { device: self.device.name(), case: case.id, reason: "no f32 output".into() }),
        }
    }

    fn matmul(&self, what: &str, x: &[f32], m: usize, w: &PackedMat) -> Result<Vec<f32>, DeviceError> {
        self.op(Op::Matmul, what, vec![("x", f32_in(m, w.cols, x.to_vec())), ("w", mat_in(w))], &[])
    }

    fn rms_norm(&self, what: &str, x: &[f32], m: usize, w: &[f32]) -> Result<Vec<f32>, DeviceError> {
        self.op(Op::RmsNorm, what, vec![("x", f32_in(m, w.len(), x.to_vec())), ("weight", vec_in(w))], &[("eps", self.weights.spec.norm_eps)])
    }

    fn add(&self, what: &str, a: &[f32], m: usize, b: &[f32], op: Op) -> Result<Vec<f32>, DeviceError> {
        let w = a.len() / m.max(1);
        let b = if op == Op::AddBias { vec_in(b) } else { f32_in(m, w, b.to_vec()) };
        self.op(op, what, vec![("a", f32_in(m, w, a.to_vec())), ("b", b)], &[])
    }

    fn run(&mut self, tokens: &[u32], taps: &mut dyn oracle::Tap) -> Result<Vec<f32>, DeviceError> {
        let s = self.weights.spec.clone();
        let (m, d, start) = (tokens.len(), s.n_embd, self.len);
        let err = |reason: String| DeviceError::Failed { device: self.device.name(), case: "model".into(), reason };
        let pos: Vec<u32> = (start..start + m).map(|p| p as u32).collect();
        let te = &self.weights.tok_embd;
        let row_bytes = te.bytes.len() / te.rows.max(1);
        let mut x = vec![0.0f32; m * d];
        for (t, &id) in tokens.iter().enumerate() {
            let id = id as usize;
            if id >= te.rows {
                return Err(err(format!("token id {id} outside the vocabulary of {}", te.rows)));
            }
            let rb = &te.bytes[id * row_bytes..(id + 1) * row_bytes];
            let row = &mut x[t * d..(t + 1) * d];
            if qdot::is_float(te.ty) { qdot::float_row(te.ty, rb, row) } else { qdot::dequantize_row(te.ty, rb, row) }
        }
        taps.record("inp_embd", start, m, d, &x);
        for li in 0..s.n_layer {
            let (BlockKind::Attention(a), Mixer::Attention(w)) = (s.layers[li].block, &self.weights.layers[li].mixer) else {
                return Err(err(format!("layer {li} is not an attention layer")));
            };
            let l = &self.weights.layers[li];
            let n = |t: &str| format!("blk.{li}.{t}");
            let (hd, qd, kvd) = (a.head_dim, a.q_dim(), a.kv_dim());
            let rope = |x: Vec<f32>, heads: usize, what: &str| -> Result<Vec<f32>, DeviceError> {
                let params = [("neox", (s.rope.style == RopeStyle::Neox) as u8 as f64), ("scaling", 0.0), ("theta", s.rope.theta), ("n_rot", s.rope.n_rot as f64), ("n_head", heads as f64), ("head_dim", hd as f64)];
                self.op(Op::Rope, what, vec![("x", f32_in(m, heads * hd, x)), ("pos", Input::Ids(pos.clone()))], &params)
            };
            let h = self.rms_norm(&n("attn_norm"), &x, m, &l.attn_norm)?;
            taps.record(&n("attn_norm"), start, m, d, &h);
            let (mut q, mut k, mut v) = (self.matmul(&n("attn_q"), &h, m, &w.wq)?, self.matmul(&n("attn_k"), &h, m, &w.wk)?, self.matmul(&n("attn_v"), &h, m, &w.wv)?);
            if let Some([bq, bk, bv]) = &w.bias {
                (q, k, v) = (self.add(&n("attn_q.bias"), &q, m, bq, Op::AddBias)?, self.add(&n("attn_k.bias"), &k, m, bk, Op::AddBias)?, self.add(&n("attn_v.bias"), &v, m, bv, Op::AddBias)?);
            }
            taps.record(&n("attn_q"), start, m, qd, &q);
            taps.record(&n("attn_k"), start, m, kvd, &k);
            taps.record(&n("attn_v"), start, m, kvd, &v);
            if let Some([qn, kn]) = &w.qk_norm {
                let norm = |x: Vec<f32>, wt: &[f32], width: usize, what: &str| self.op(Op::QkNorm, what, vec![("x", f32_in(m, width, x)), ("weight", vec_in(wt))], &[("head_dim", hd as f64), ("eps", s.norm_eps)]);
                (q, k) = (norm(q, qn, qd, &n("attn_q_norm"))?, norm(k, kn, kvd, &n("attn_k_norm"))?);
                taps.record(&n("attn_q_norm"), start, m, qd, &q);
                taps.record(&n("attn_k_norm"), start, m, kvd, &k);
            }
            (q, k) = (rope(q, a.n_head, &n("attn_q_rope"))?, rope(k, a.n_head_kv, &n("attn_k_rope"))?);
            taps.record(&n("attn_q_rope"), start, m, qd, &q);
            taps.record(&n("attn_k_rope"), start, m, kvd, &k);
            let (kc, vc) = &mut self.kv[li];
            kc.truncate(start * kvd);
            vc.truncate(start * kvd);
            kc.extend_from_slice(&k);
            vc.extend_from_slice(&v);
            let (kc, vc) = (kc.clone(), vc.clone());
            let params = [("n_head", a.n_head as f64), ("n_head_kv", a.n_head_kv as f64), ("head_dim", hd as f64), ("window", a.window.unwrap_or(0) as f64)];
            let attn = self.op(Op::Attention, &n("attn_kqv"), vec![("q", f32_in(m, qd, q)), ("k", f32_in(start + m, kvd, kc)), ("v", f32_in(start + m, kvd, vc)), ("pos", Input::Ids(pos.clone()))], &params)?;
            taps.record(&n("attn_kqv"), start, m, qd, &attn);
            let mut out = self.matmul(&n("attn_out"), &attn, m, &w.wo)?;
            if let Some(bo) = &w.bo {
                out = self.add(&n("attn_output.bias"), &out, m, bo, Op::AddBias)?;
            }
            taps.record(&n("attn_out"), start, m, d, &out);
            x = self.add(&n("ffn_inp"), &x, m, &out, Op::Add)?;
            taps.record(&n("ffn_inp"), start, m, d, &x);
            let f = l.dense.as_ref().ok_or_else(|| err(format!("layer {li} has no dense FFN")))?;
            let h = self.rms_norm(&n("ffn_norm"), &x, m, &l.ffn_norm)?;
            taps.record(&n("ffn_norm"), start, m, d, &h);
            let (g, u) = (self.matmul(&n("ffn_gate"), &h, m, &f.gate)?, self.matmul(&n("ffn_up"), &h, m, &f.up)?);
            taps.record(&n("ffn_gate"), start, m, f.gate.rows, &g);
            taps.record(&n("ffn_up"), start, m, f.up.rows, &u);
            let glu = if s.activation == Activation::GeluTanh { Op::Geglu } else { Op::Swiglu };
            let act = self.op(glu, &n("ffn_act"), vec![("gate", f32_in(m, f.gate.rows, g)), ("up", f32_in(m, f.up.rows, u))], &[])?;
            taps.record(&n("ffn_act"), start, m, f.gate.rows, &act);
            let out = self.matmul(&n("ffn_out"), &act, m, &f.down)?;
            taps.record(&n("ffn_out"), start, m, d, &out);
            x = self.add(&n("l_out"), &x, m, &out, Op::Add)?;
            taps.record(&n("l_out"), start, m, d, &x);
        }
        self.len = start + m;
        let normed = self.rms_norm("result_norm", &x, m, &self.weights.output_norm)?;
        taps.record("result_norm", start, m, d, &normed);
        let head = self.weights.output.as_ref().unwrap_or(&self.weights.tok_embd);
        let logits = self.matmul("result_output", &normed, m, head)?;
        taps.record("result_output", start, m, s.n_vocab, &logits);
        Ok(logits)
    }
}

/// A device's ops as a device that also runs whole models (through [`OpModel`]): the correct
/// `cpu`'s ops composed, say, beside a faulty variant's.
pub struct Composed(pub std::sync::Arc<dyn Device>);

impl Device for Composed {
    fn name(&self) -> String {
        self.0.name()
    }
    fn arithmetic(&self, case: &OpCase) -> Arithmetic {
        self.0.arithmetic(case)
    }
    fn supports(&self, case: &OpCase) -> crate::Support {
        self.0.supports(case)
    }
    fn run_op(&self, case: &OpCase) -> Result<Vec<Output>, DeviceError> {
        self.0.run_op(case)
    }
    fn load_model(&self, path: &std::path::Path, _opts: &crate::ModelOptions) -> Result<Box<dyn DeviceModel>, DeviceError> {
        Ok(Box::new(OpModel::load(self.0.clone(), path)?))
    }
}

impl DeviceModel for OpModel {
    fn spec(&self) -> &ModelSpec {
        &self.weights.spec
    }
    fn arithmetic(&self) -> Arithmetic {
        self.arithmetic.clone()
    }
    fn cached(&self) -> usize {
        self.len
    }
    fn reset(&mut self) {
        self.kv.iter_mut().for_each(|(k, v)| {
            k.clear();
            v.clear();
        });
        self.len = 0;
    }
    fn forward(&mut self, tokens: &[u32], taps: &mut dyn oracle::Tap) -> Result<Vec<f32>, DeviceError> {
        if tokens.is_empty() {
            return Err(DeviceError::Failed { device: self.device.name(), case: "model".into(), reason: "no tokens".into() });
        }
        self.run(tokens, taps)
    }
}
