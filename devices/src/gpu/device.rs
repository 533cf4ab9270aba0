//! A GPU (or the emulator) as a kernel-suite device: each op case run as the launches `Gpu` provides, and the bandwidth probe.

use super::*;
use crate::{Arithmetic, Device, DeviceError, Support};
use oracle::quant::GgmlType;
use oracle::registry::{Op, Input, OpCase, Output, Tensor};
use std::sync::Arc;

/// A GPU (or the emulator) as a kernel-suite device.
pub struct GpuDevice {
    pub gpu: Arc<Gpu>,
    /// Device time of the last case's kernel launches (events), for `kernels --perf`.
    kernel_seconds: std::sync::Mutex<Option<f64>>,
}

fn out(shape: &[usize], data: Vec<f32>) -> Output {
    Output::F32(Tensor { shape: shape.to_vec(), data })
}

impl GpuDevice {
    pub fn new(gpu: Arc<Gpu>) -> GpuDevice {
        GpuDevice { gpu, kernel_seconds: Default::default() }
    }

    /// Runs a case's launches under device timing (uploads and downloads stay outside).
    fn timed(&self, mut launches: impl FnMut() -> Result<(), GpuError>) -> Result<(), GpuError> {
        let t = self.gpu.backend.time(&mut launches)?;
        *self.kernel_seconds.lock().unwrap_or_else(|e| e.into_inner()) = Some(t);
        Ok(())
    }

    /// `ssm_scan` and `delta_rule`: the model's scan kernels over the case's rows, from its
    /// state; the outputs and the state after the last row.
    fn recurrent(&self, case: &OpCase) -> Result<Vec<Output>, CaseError> {
        let g = &self.gpu;
        let e = |r: oracle::OracleError| r.to_string();
        let f = |n: &str| case.f32(n).map_err(e);
        let u = |n: &str| case.pu(n).map_err(e);
        let delta = case.op == Op::DeltaRule;
        let blk = if delta {
            let (nk, nv, dk, dv) = (u("n_k_head")?, u("n_v_head")?, u("d_k")?, u("d_v")?);
            oracle::spec::SsmBlock { d_inner: nv * dv, d_state: dk, n_group: nk, n_head: nv, d_conv: 1, kind: oracle::spec::SsmKind::GatedDelta }
        } else {
            let (nh, ng, hd, ds) = (u("n_head")?, u("n_group")?, u("head_dim")?, u("d_state")?);
            oracle::spec::SsmBlock { d_inner: nh * hd, d_state: ds, n_group: ng, n_head: nh, d_conv: 1, kind: oracle::spec::SsmKind::Mamba2 }
        };
        blk.validate().map_err(e)?;
        let (nh, gd, di) = (blk.n_head, blk.n_group * blk.d_state, blk.d_inner);
        // Mamba-2's x, B, C; a gated DeltaNet's q, k, v: the rows the model's kernels read.
        let parts: [(&str, usize); 3] = if delta { [("q", gd), ("k", gd), ("v", di)] } else { [("x", di), ("b", gd), ("c", gd)] };
        let t: Vec<_> = parts.iter().map(|(n, _)| f(n)).collect::<Result<_, _>>()?;
        let m = t[0].shape[0];
        if t.iter().zip(&parts).any(|(x, (_, w))| x.data.len() != m * w) {
            return Err(format!("{}: {} of {m} rows are not {}, {} and {} wide", case.id, parts.map(|p| p.0).join(", "), parts[0].1, parts[1].1, parts[2].1).into());
        }
        let rows = crate::shared::join_rows(m, &[(&t[0].data, parts[0].1), (&t[1].data, parts[1].1), (&t[2].data, parts[2].1)]);
        let state = f("state")?;
        if state.data.len() != blk.state_len() {
            return Err(format!("{}: a state of {} values, not {}", case.id, state.data.len(), blk.state_len()).into());
        }
        let heads = if delta {
            // b and a per value head, in the order the projection stores them: per key head, its
            // value heads' b, then their a.
            let (b, a) = (f("b")?, f("a")?);
            if b.data.len() != m * nh || a.data.len() != m * nh {
                return Err(format!("{}: b and a of {m} rows are not {nh} wide", case.id).into());
            }
            let r = nh / blk.n_group;
            let ba: Vec<f32> = (0..m).flat_map(|t| (0..blk.n_group).flat_map(move |kg| [&b, &a].map(|x| &x.data[t * nh + kg * r..t * nh + (kg + 1) * r]).concat())).collect();
            ba
        } else {
            f("dt")?.data.clone()
        };
        let per_head = |n: &str| -> Result<DevBuf, CaseError> {
            let v = f(n)?;
            if v.data.len() != nh {
                return Err(format!("{}: `{n}` has {} values for {nh} heads", case.id, v.data.len()).into());
            }
            Ok(g.upload_f32(&v.data)?)
        };
        let (dt_bias, neg_a) = (per_head("dt_bias")?, per_head("neg_a")?);
        let d = if delta { None } else { Some(per_head("d")?) };
        let (xb, hb, s0) = (g.upload_f32(&rows)?, g.upload_f32(&heads)?, g.upload_f32(&state.data)?);
        let (y, s1) = (g.alloc_guarded(4 * m * di)?, g.alloc_guarded(4 * blk.state_len())?);
        let io = super::recurrent::StateIo { from: s0.ptr, to: s1.ptr, stride: 0 };
        // The state after no rows is the state before them.
        self.timed(|| {
            g.copy(s0.ptr, s1.ptr, blk.state_len())?;
            g.scan(&blk, xb.ptr, (hb.ptr, nh), [dt_bias.ptr, neg_a.ptr, d.as_ref().map_or(0, |d| d.ptr)], io, y.ptr, m)
        })?;
        Ok(vec![out(&[m, di], y.download_f32(m * di)?), out(&[nh, blk.head_dim(), blk.d_state], s1.download_f32(blk.state_len())?)])
    }

    fn run(&self, case: &OpCase) -> Result<Vec<Output>, CaseError> {
        let g = &self.gpu;
        let e = |r: oracle::OracleError| r.to_string();
        let input = |name: &str| case.f32(name).map_err(e);
        let param = |name: &str| case.p(name).map_err(e);
        let uparam = |name: &str| case.pu(name).map_err(e);
        Ok(match case.op {
            Op::MlaAttention => {
                let b = oracle::spec::MlaBlock { n_head: uparam("n_head")?, q_lora_rank: 0, kv_lora_rank: uparam("kv_lora_rank")?, qk_nope: uparam("qk_nope")?, qk_rope: uparam("qk_rope")?, v_head_dim: uparam("v_head_dim")? };
                b.validate().map_err(e)?;
                let (q, kv_b, latent, k_pe) = (input("q")?, input("kv_b")?, input("latent")?, input("k_pe")?);
                let pos = case.ids("pos").map_err(e)?;
                let kv_len = pos.iter().max().map_or(0, |p| *p as usize + 1);
                let (r, rr) = (b.kv_lora_rank, b.qk_rope);
                if kv_b.data.len() != b.kv_b_dim() * r || q.data.len() != pos.len() * b.q_dim() || latent.data.len() < kv_len * r || k_pe.data.len() < kv_len * rr {
                    return Err(format!("{}: q of {} values for {} positions of {} heads, kv_b of {}, latent of {} and k_pe of {} for {kv_len} cached positions", case.id, q.data.len(), pos.len(), b.n_head, kv_b.data.len(), latent.data.len(), k_pe.data.len()).into());
                }
                let (k_b, v_b) = crate::shared::host::split_kv_b(&kv_b.data, &b);
                let (qb, pb) = (g.upload_f32(&q.data)?, g.upload_u32(pos)?);
                let (lb, kb) = (g.upload_f32(&latent.data)?, g.upload_f32(&k_pe.data)?);
                let (kbb, vbb) = (g.upload_f32(&k_b)?, g.upload_f32(&v_b)?);
                let n = pos.len() * b.out_dim();
                let o = g.alloc_guarded(4 * n)?;
                let scale = param("scale")? as f32;
                self.timed(|| g.mla_attention(&b, (qb.ptr, pb.ptr), (lb.ptr, kb.ptr), (kbb.ptr, vbb.ptr), o.ptr, pos.len(), kv_len, scale))?;
                vec![out(&[pos.len(), b.out_dim()], o.download_f32(n)?)]
            }
            Op::SsmScan | Op::DeltaRule => self.recurrent(case)?,
            Op::Embed => {
                let t = input("table")?;
                let ids = case.ids("ids").map_err(e)?;
                let (vocab, d) = (t.shape[0], t.shape[1]);
                if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
                    return Err(format!("token id {bad} outside the vocabulary of {vocab}").into());
                }
                let w = g.upload_mat(GgmlType::F32, vocab, d, &f32_bytes(&t.data))?;
                let (ib, o) = (g.upload_u32(ids)?, g.alloc_guarded(4 * ids.len() * d)?);
                self.timed(|| g.get_rows(&w, ib.ptr, ids.len(), o.ptr))?;
                vec![out(&[ids.len(), d], o.download_f32(ids.len() * d)?)]
            }
            Op::RmsNorm | Op::QkNorm | Op::LayerNorm => {
                let x = input("x")?;
                let n = if case.op == Op::QkNorm { uparam("head_dim")? } else { x.shape[1] };
                let (xb, wb, yb) = (g.upload_f32(&x.data)?, g.upload_f32(&input("weight")?.data)?, g.alloc_guarded(4 * x.data.len())?);
                let eps = param("eps")? as f32;
                if case.op == Op::LayerNorm {
                    let bb = g.upload_f32(&input("bias")?.data)?;
                    self.timed(|| g.layer_norm(xb.ptr, wb.ptr, bb.ptr, yb.ptr, x.data.len() / n, n, eps))?;
                } else {
                    self.timed(|| g.rms_norm(xb.ptr, wb.ptr, yb.ptr, x.data.len() / n, n, eps))?;
                }
                vec![out(&x.shape, yb.download_f32(x.data.len())?)]
            }
            Op::Matmul => {
                let x = input("x")?;
                let Some((_, Input::Quant { ty, rows, cols, bytes })) = case.inputs.iter().find(|(n, _)| *n == "w") else {
                    return Err("matmul weight must be a packed input".into());
                };
                let (m, k, stride) = oracle::registry::view_dims(case, x);
                if *cols != k || stride < k || x.data.len() < m * stride {
                    return Err(format!("weight [{rows}, {cols}] does not fit x [{m}, {k}] (row stride {stride})").into());
                }
                let w = g.upload_mat(*ty, *rows, *cols, bytes)?;
                let (xb, yb) = (g.upload_f32(&x.data)?, g.alloc_guarded(4 * m * rows)?);
                self.timed(|| g.matmul(&w, xb.ptr, stride, m, yb.ptr))?;
                vec![out(&[m, *rows], yb.download_f32(m * rows)?)]
            }
            Op::Add | Op::AddBias => {
                let (a, b) = (input("a")?, input("b")?);
                if b.data.is_empty() || a.data.len() % b.data.len() != 0 {
                    return Err(format!("add: {} values do not repeat over {}", b.data.len(), a.data.len()).into());
                }
                let (ab, bb, yb) = (g.upload_f32(&a.data)?, g.upload_f32(&b.data)?, g.alloc_guarded(4 * a.data.len())?);
                self.timed(|| g.add(ab.ptr, bb.ptr, yb.ptr, a.data.len(), b.data.len()))?;
                vec![out(&a.shape, yb.download_f32(a.data.len())?)]
            }
            Op::Rope => {
                let x = input("x")?;
                let pos = case.ids("pos").map_err(e)?;
                let spec = oracle::registry::rope_spec_of(case).map_err(e)?;
                let table = g.upload_f32(&rope_table(&spec, pos.iter().map(|&p| p as usize)))?;
                let xb = g.upload_guarded(&x.data)?;
                self.timed(|| g.rope(xb.ptr, &table, pos.len(), uparam("n_head")?, uparam("head_dim")?, spec.n_rot, spec.style == oracle::spec::RopeStyle::Neox))?;
                vec![out(&x.shape, xb.download_f32(x.data.len())?)]
            }
            Op::Attention | Op::AttentionSinks | Op::AttentionSoftcap => {
                let (q, k, v) = (input("q")?, input("k")?, input("v")?);
                let pos = case.ids("pos").map_err(e)?;
                let kv_len = k.shape[0];
                if pos.iter().any(|&p| p as usize >= kv_len) {
                    return Err("attention: a query past the cache".into());
                }
                let cfg = crate::shared::AttnCfg {
                    n_head: uparam("n_head")?,
                    n_head_kv: uparam("n_head_kv")?,
                    head_dim: uparam("head_dim")?,
                    window: uparam("window")?,
                    sinks: None,
                    softcap: if case.op == Op::AttentionSoftcap { param("cap")? as f32 } else { 0.0 },
                    scale: 1.0 / (uparam("head_dim")? as f32).sqrt(),
                };
                let (qb, pb, kb, vb) = (g.upload_f32(&q.data)?, g.upload_u32(pos)?, g.upload_f32(&k.data)?, g.upload_f32(&v.data)?);
                let sb = if case.op == Op::AttentionSinks { Some(g.upload_f32(&input("sinks")?.data)?) } else { None };
                let ob = g.alloc_guarded(4 * q.data.len())?;
                self.timed(|| g.attention(qb.ptr, pb.ptr, kb.ptr, vb.ptr, ob.ptr, pos.len(), kv_len, &cfg, sb.as_ref().map_or(0, |b| b.ptr)))?;
                vec![out(&q.shape, ob.download_f32(q.data.len())?)]
            }
            Op::Softcap => {
                let x = input("x")?;
                let xb = g.upload_guarded(&x.data)?;
                self.timed(|| g.softcap(xb.ptr, param("cap")? as f32, x.data.len()))?;
                vec![out(&x.shape, xb.download_f32(x.data.len())?)]
            }
            Op::Softmax => {
                let x = input("x")?;
                let (xb, yb) = (g.upload_f32(&x.data)?, g.alloc_guarded(4 * x.data.len())?);
                self.timed(|| g.softmax(xb.ptr, yb.ptr, x.shape[0], x.shape[1]))?;
                vec![out(&x.shape, yb.download_f32(x.data.len())?)]
            }
            Op::Silu | Op::GeluTanh | Op::Swiglu | Op::Geglu | Op::SwigluOai => {
                let gate = input("gate")?;
                let act = match case.op {
                    Op::Silu | Op::Swiglu => 0,
                    Op::SwigluOai => 3,
                    _ => 1,
                };
                let (gb, yb) = (g.upload_f32(&gate.data)?, g.alloc_guarded(4 * gate.data.len())?);
                let ub = if matches!(case.op, Op::Swiglu | Op::Geglu | Op::SwigluOai) { Some(g.upload_f32(&input("up")?.data)?) } else { None };
                self.timed(|| g.glu(gb.ptr, ub.as_ref().map_or(0, |b| b.ptr), yb.ptr, gate.data.len(), act))?;
                vec![out(&gate.shape, yb.download_f32(gate.data.len())?)]
            }
            Op::MoeRoute => {
                let l = input("logits")?;
                let (rows, n, k) = (l.shape[0], l.shape[1], uparam("k")?);
                let (lb, ib, wb) = (g.upload_f32(&l.data)?, g.alloc_guarded(4 * rows * k)?, g.alloc_guarded(4 * rows * k)?);
                self.timed(|| g.moe_route(lb.ptr, ib.ptr, wb.ptr, rows, n, k, uparam("sigmoid")? == 1, uparam("normalize")? == 1, RouteLimit::default()))?;
                vec![Output::Ids(ib.download_u32(rows * k)?), out(&[rows, k], wb.download_f32(rows * k)?)]
            }
            Op::Argmax | Op::TopK | Op::Sample => {
                let x = input("x")?;
                let (rows, n) = (x.shape[0], x.shape[1]);
                let sampling = case.op == Op::Sample && param("temperature")? > 0.0;
                let k = match case.op {
                    Op::Argmax => 1,
                    Op::Sample if !sampling => 1,
                    _ => uparam("k")?.min(n),
                };
                let (xb, ib) = (g.upload_f32(&x.data)?, g.alloc_guarded(4 * rows * k)?);
                self.timed(|| g.top_k(xb.ptr, ib.ptr, rows, n, k))?;
                let ranked = ib.download_u32(rows * k)?;
                if sampling {
                    // The device ranks the candidates; the seeded draw over them is the host's,
                    // as in engines that sample on the CPU.
                    let mut rng = oracle::ops::SplitMix64(case.seed);
                    let (t, p) = (param("temperature")?, param("top_p")?);
                    let picks = x.data.chunks(n).zip(ranked.chunks(k)).map(|(row, order)| crate::shared::sample_ranked(row, order, t, p, &mut rng)).collect();
                    vec![Output::Ids(picks)]
                } else {
                    vec![Output::Ids(ranked)]
                }
            }
        })
    }
}

impl Device for GpuDevice {
    fn name(&self) -> String {
        self.gpu.backend.name()
    }
    fn describe(&self) -> String {
        self.gpu.backend.describe()
    }
    fn arithmetic(&self, _case: &OpCase) -> Arithmetic {
        // f32 storage and accumulation everywhere; quantized weights are dequantized to f32 in
        // registers (no activation quantization); expf/tanhf are within 2 ulp without fast-math.
        Arithmetic::F32
    }
    fn supports(&self, case: &OpCase) -> Support {
        match case.op {
            Op::Sample if case.pu("k").unwrap_or(0) == 0 || case.pu("k").unwrap_or(0) > 64 => Support::Unsupported("sampling ranks at most 64 candidates on the device (top_k 1..=64)".into()),
            // Every other op: `run_op` matches them all (a new op does not compile until it has
            // a kernel).
            _ => Support::Yes,
        }
    }
    fn run_op(&self, case: &OpCase) -> Result<Vec<Output>, DeviceError> {
        let r = self.run(case).and_then(|o| Ok(self.gpu.backend.synchronize().map(|_| o)?));
        r.map_err(|e| match e {
            CaseError::Failed(reason) => crate::fail(&self.name(), case, reason),
            CaseError::Wrong(reason) => DeviceError::WrongResult { device: self.name(), case: case.id.clone(), reason },
        })
    }
    fn synchronize(&self) {
        let _ = self.gpu.backend.synchronize();
    }
    fn last_kernel_seconds(&self) -> Option<f64> {
        *self.kernel_seconds.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn load_model(&self, path: &std::path::Path, opts: &crate::ModelOptions) -> Result<Box<dyn crate::DeviceModel>, DeviceError> {
        Ok(Box::new(model::GpuModel::load(self.gpu.clone(), path, opts)?))
    }
    fn bandwidth_probe(&self, bytes: usize, reps: usize) -> Option<Result<crate::BandwidthProbe, DeviceError>> {
        Some(self.probe(bytes, reps).map_err(|reason| DeviceError::Failed { device: self.name(), case: "bandwidth probe".into(), reason }))
    }
}

impl GpuDevice {
    /// Copy bandwidth, then GEMV weight bandwidth per type, each the best of `reps` runs timed
    /// with device events, all in one run so the ratios are like for like.
    fn probe(&self, bytes: usize, reps: usize) -> Result<crate::BandwidthProbe, String> {
        use crate::probe;
        let g = &self.gpu;
        let events = |f: &mut dyn FnMut() -> Result<(), String>| Ok(g.backend.time(&mut || Ok(f()?))?);
        let n = probe::copy_floats(bytes);
        let (src, dst) = (g.upload_f32(&probe::filled(1.0, n, "copy source")?)?, g.alloc(4 * n)?);
        let t = probe::best_of(reps, &events, &mut || Ok(g.copy(src.ptr, dst.ptr, n)?))?;
        let copy_gbps = 2.0 * (4 * n) as f64 / t / 1e9;
        drop((src, dst));
        let x = g.upload_f32(&probe::activations())?;
        let mut gemv = Vec::new();
        for ty in probe::TYPES {
            let (rows, packed) = probe::weights(ty, bytes)?;
            let w = g.upload_mat(ty, rows, probe::COLS, &packed)?;
            let own = g.matmul_plan(&w, x.ptr, probe::COLS);
            // The matmul's own launch shape first (the one gated), then the other thread counts
            // per row, each checked to compute what the first did (a fast wrong GEMV is no figure).
            let mut plans = vec![own];
            plans.extend(probe::SWEEP_LANES.iter().filter(|&&l| l != own.lanes && l <= own.block).map(|&lanes| MatmulPlan { lanes, ..own }));
            // The float kernel's smaller load batch, at every thread count.
            if own.kernel == "ts_matmul_v" {
                plans.extend(probe::SWEEP_LANES.iter().filter(|&&l| l <= own.block).map(|&lanes| MatmulPlan { kernel: "ts_matmul_v1b2", lanes, ..own }));
            }
            let mut first: Option<Vec<f32>> = None;
            for plan in plans {
                let y = g.alloc(4 * rows)?;
                let t = probe::best_of(reps, &events, &mut || Ok(g.matmul_planned(&[(&w, y.ptr)], &[plan], x.ptr, probe::COLS, 1)?))?;
                let out = y.download_f32(rows)?;
                match &first {
                    None => first = Some(out),
                    Some(want) => probe::same_gemv(want, &out, &format!("{} GEMV with `{plan}`", ty.name()))?,
                }
                gemv.push(crate::GemvRate { ty: ty.name().to_string(), weight_bytes: packed.len(), gbps: packed.len() as f64 / t / 1e9, kernel: plan.for_tokens(1).to_string(), alternative: plan != own });
            }
        }
        Ok(crate::BandwidthProbe { bytes, copy_gbps, gemv, reps, not_hardware: g.backend.timings_not_of_hardware() })
    }
}
