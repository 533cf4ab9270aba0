//! `fixed` and `fixed-int4`: an integer-only engine in the style of the eBPF forward pass our
//! users build. Activations are Q16 integers, matrix weights Q24 (or group-wise INT4 with a Q24
//! scale per group of 32 in `fixed-int4`), norm scales Q20, RoPE cos/sin from host-precomputed
//! Q30 tables; exp, sigmoid and the RMSNorm inverse square root are integer approximations;
//! argmax compares integers. Floats appear only at the boundary: inputs are converted to Q16
//! and results back to f32 for the comparison.
//!
//! Ops without an integer kernel here (layer_norm, top_k, sample) are reported as unsupported.

use crate::{fail, Arithmetic, Device, DeviceError, FixedPoint, NumFormat, Support};
use oracle::registry::{Op, Input, OpCase, Output, Tensor};

mod kernels;
mod load;
mod model;
mod ssm;
pub use kernels::*;
pub use model::FixedModel;

/// A model-level error of `fixed` (loading or running a whole model).
fn model_err(what: impl std::fmt::Display) -> DeviceError {
    DeviceError::Failed { device: "fixed".into(), case: "model".into(), reason: what.to_string() }
}

pub struct FixedDevice {
    pub int4: bool,
}

impl FixedDevice {
    pub fn point(&self) -> FixedPoint {
        FixedPoint { act_frac: ACT, weight_frac: WGT, norm_frac: NORM, table_frac: TABLE, exp_abs: EXP_ABS, int4_group: self.int4.then_some(INT4_GROUP) }
    }
}

fn q_in(t: &Tensor) -> Vec<i64> {
    t.data.iter().map(|v| if v.is_finite() { to_q(*v as f64, ACT) } else { MASKED }).collect()
}

fn f_out(shape: &[usize], v: &[i64]) -> Output {
    Output::F32(Tensor { shape: shape.to_vec(), data: v.iter().map(|x| from_q(*x, ACT)).collect() })
}

impl FixedDevice {
    fn run(&self, case: &OpCase) -> Result<Vec<Output>, String> {
        let e = |r: oracle::OracleError| r.to_string();
        Ok(match case.op {
            Op::Embed => {
                let t = case.f32("table").map_err(e)?;
                let ids = case.ids("ids").map_err(e)?;
                let d = t.shape[1];
                let mut v = Vec::new();
                for &id in ids {
                    let row = t.data.get(id as usize * d..(id as usize + 1) * d).ok_or("token id outside the table")?;
                    v.extend(row.iter().map(|x| to_q(*x as f64, ACT)));
                }
                vec![f_out(&[ids.len(), d], &v)]
            }
            Op::RmsNorm | Op::QkNorm => {
                let x = case.f32("x").map_err(e)?;
                let n = if case.op == Op::QkNorm { case.pu("head_dim").map_err(e)? } else { x.shape[1] };
                let w: Vec<i64> = case.f32("weight").map_err(e)?.data.iter().map(|v| to_q(*v as f64, NORM)).collect();
                let w_full: Vec<i64> = w.iter().cycle().take(n).copied().collect();
                vec![f_out(&x.shape, &rms_norm_q(&q_in(x), n, &w_full, case.p("eps").map_err(e)?))]
            }
            Op::Matmul => {
                let x = case.f32("x").map_err(e)?;
                let Some((_, Input::Quant { ty, rows, cols, bytes })) = case.inputs.iter().find(|(n, _)| *n == "w") else { return Err("no weight".into()) };
                if self.int4 && cols % INT4_GROUP != 0 {
                    return Err(format!("k = {cols} is not a multiple of the INT4 group {INT4_GROUP}"));
                }
                let w = convert_weights(*ty, *rows, *cols, bytes, self.int4);
                let (m, k, stride) = oracle::registry::view_dims(case, x);
                // Quantize the view's rows (the gap between them is never read).
                let xq: Vec<i64> = (0..m).flat_map(|r| x.data[r * stride..r * stride + k].iter().map(|v| to_q(*v as f64, ACT))).collect();
                vec![f_out(&[m, *rows], &matmul_q(&xq, m, &w))]
            }
            Op::Add | Op::AddBias => {
                let a = case.f32("a").map_err(e)?;
                let b = q_in(case.f32("b").map_err(e)?);
                vec![f_out(&a.shape, &add_q(&q_in(a), &b))]
            }
            Op::Rope => {
                let x = case.f32("x").map_err(e)?;
                let pos: Vec<usize> = case.ids("pos").map_err(e)?.iter().map(|&p| p as usize).collect();
                let p = |n: &str| case.p(n).map_err(e);
                let spec = oracle::registry::rope_spec_of(case).map_err(e)?;
                let mut y = q_in(x);
                rope_q(&mut y, &pos, p("n_head")? as usize, p("head_dim")? as usize, &spec);
                vec![f_out(&x.shape, &y)]
            }
            Op::Attention | Op::AttentionSinks | Op::AttentionSoftcap => {
                let (q, k, v) = (case.f32("q").map_err(e)?, case.f32("k").map_err(e)?, case.f32("v").map_err(e)?);
                let pos: Vec<usize> = case.ids("pos").map_err(e)?.iter().map(|&p| p as usize).collect();
                let p = |n: &str| case.pu(n).map_err(e);
                let sinks = if case.op == Op::AttentionSinks { Some(q_in(case.f32("sinks").map_err(e)?)) } else { None };
                let softcap = if case.op == Op::AttentionSoftcap { Some(SoftcapQ::new(case.p("cap").map_err(e)?)) } else { None };
                let extras = AttnExtras { scale: None, sinks: sinks.as_deref(), softcap };
                let y = attention_q(&q_in(q), &pos, &q_in(k), &q_in(v), p("n_head")?, p("n_head_kv")?, p("head_dim")?, p("window")?, &extras);
                vec![f_out(&q.shape, &y)]
            }
            Op::Softmax => {
                let x = case.f32("x").map_err(e)?;
                let n = x.shape[1];
                let mut y = Vec::with_capacity(x.data.len());
                for row in q_in(x).chunks(n) {
                    let live: Vec<i64> = row.iter().copied().filter(|v| *v != MASKED).collect();
                    let p = softmax_q(&live);
                    let mut it = p.into_iter();
                    y.extend(row.iter().map(|v| if *v == MASKED { 0 } else { it.next().unwrap_or(0) }));
                }
                vec![f_out(&x.shape, &y)]
            }
            Op::Softcap => {
                let x = case.f32("x").map_err(e)?;
                let c = SoftcapQ::new(case.p("cap").map_err(e)?);
                vec![f_out(&x.shape, &q_in(x).into_iter().map(|v| c.apply(v)).collect::<Vec<_>>())]
            }
            Op::GeluTanh => {
                let g = case.f32("gate").map_err(e)?;
                vec![f_out(&g.shape, &q_in(g).into_iter().map(gelu_q16).collect::<Vec<_>>())]
            }
            Op::Geglu | Op::SwigluOai => {
                let g = case.f32("gate").map_err(e)?;
                let u = q_in(case.f32("up").map_err(e)?);
                let act = if case.op == Op::Geglu { oracle::spec::Activation::GeluTanh } else { oracle::spec::Activation::SwigluOai };
                let y: Vec<i64> = q_in(g).into_iter().zip(u).map(|(a, b)| glu_q16(act, a, b)).collect();
                vec![f_out(&g.shape, &y)]
            }
            Op::Silu => {
                let g = case.f32("gate").map_err(e)?;
                vec![f_out(&g.shape, &q_in(g).into_iter().map(silu_q16).collect::<Vec<_>>())]
            }
            Op::Swiglu => {
                let g = case.f32("gate").map_err(e)?;
                let u = q_in(case.f32("up").map_err(e)?);
                let y: Vec<i64> = q_in(g).into_iter().zip(u).map(|(a, b)| shr_round(silu_q16(a) as i128 * b as i128, ACT)).collect();
                vec![f_out(&g.shape, &y)]
            }
            Op::Argmax => {
                let x = case.f32("x").map_err(e)?;
                let n = x.shape[1];
                let ids = q_in(x)
                    .chunks(n)
                    .map(|r| r.iter().enumerate().fold(0usize, |best, (i, v)| if *v > r[best] { i } else { best }) as u32)
                    .collect();
                vec![Output::Ids(ids)]
            }
            Op::MoeRoute => {
                let l = case.f32("logits").map_err(e)?;
                let k = case.pu("k").map_err(e)?;
                let (ids, w, _) = moe_route_q(&q_in(l), l.shape[1], k, case.pu("sigmoid").map_err(e)? == 1, case.pu("normalize").map_err(e)? == 1, &RouteLimitQ::default());
                vec![Output::Ids(ids), f_out(&[l.shape[0], k], &w)]
            }
            op @ (Op::LayerNorm | Op::TopK | Op::Sample | Op::DeltaRule | Op::SsmScan | Op::MlaAttention) => return Err(format!("no integer kernel for `{op}`")),
        })
    }
}

impl Device for FixedDevice {
    fn name(&self) -> String {
        if self.int4 { "fixed-int4".into() } else { "fixed".into() }
    }
    fn arithmetic(&self, _: &OpCase) -> Arithmetic {
        Arithmetic { storage: NumFormat::I32, accumulate: NumFormat::I32, transcendental_ulps: 0.0, fixed: Some(self.point()), ..Arithmetic::F32 }
    }
    fn supports(&self, case: &OpCase) -> Support {
        if self.int4 && case.op == Op::Matmul {
            if let Some((_, Input::Quant { cols, .. })) = case.inputs.iter().find(|(n, _)| *n == "w") {
                if cols % INT4_GROUP != 0 {
                    return Support::Unsupported(format!("k = {cols} is not a whole number of INT4 groups of {INT4_GROUP}"));
                }
            }
        }
        match case.op {
            // Argmax compares Q16 integers: two logits within 2^-17 of each other round to one
            // value and resolve to the lower index, which the exact rule would report as a failure.
            Op::Embed | Op::RmsNorm | Op::QkNorm | Op::Matmul | Op::Add | Op::AddBias | Op::Rope | Op::Attention | Op::AttentionSinks | Op::AttentionSoftcap | Op::Softmax | Op::Softcap | Op::Silu | Op::GeluTanh | Op::Swiglu | Op::Geglu | Op::SwigluOai | Op::MoeRoute | Op::Argmax => Support::Yes,
            op @ (Op::LayerNorm | Op::TopK | Op::Sample | Op::DeltaRule | Op::SsmScan | Op::MlaAttention) => Support::Unsupported(format!("no integer kernel for `{op}` on {}", self.name())),
        }
    }
    fn run_op(&self, case: &OpCase) -> Result<Vec<Output>, DeviceError> {
        self.run(case).map_err(|r| fail(&self.name(), case, r))
    }
    fn load_model(&self, path: &std::path::Path, opts: &crate::ModelOptions) -> Result<Box<dyn crate::DeviceModel>, DeviceError> {
        let kv = opts.kv_cache;
        if kv != crate::KvTypes::default() {
            // Unsupported, not ignored: a run asked for such a cache must not report one it did not have.
            return Err(DeviceError::Unavailable(self.name(), format!("a {kv} KV cache is not implemented on the integer device (its cache holds Q16 integers)")));
        }
        Ok(Box::new(load::load(path, self.int4)?))
    }
}


#[cfg(test)]
mod tests;