//! Whole-model runs on a GPU device (or the emulator): packed weights uploaded once, every op a
//! kernel launch, a device-resident KV cache, and taps downloaded only when a suite asks for them
//! (`Tap::enabled`). The weights come through the cpu device's GGUF loader, so both engines read
//! a model file the same way; nothing of the cpu device's arithmetic is reused.

use super::cache::{record, record_at, KvCache, LayerState, Seg};
use super::mla::{GpuMla, MlaStep, Rows};
use super::ssm::{GpuSsm, SsmStep};
use super::{DevBuf, Gpu, GpuMat};
use crate::shared::host::{Ffn, HostWeights, Mixer, PackedMat};
use crate::{Arithmetic, DeviceError, DeviceModel, ModelOptions};
use oracle::spec::{Activation, BlockKind, Gating, ModelSpec, RopeStyle, Stage};
use oracle::Tap;
use std::sync::Arc;

struct GpuFfn {
    gate: GpuMat,
    up: GpuMat,
    down: GpuMat,
    /// Biases of the gate, up and down products (GPT-OSS's experts).
    bias: Option<[DevBuf; 3]>,
}

struct GpuAttn {
    wq: GpuMat,
    wk: GpuMat,
    wv: GpuMat,
    wo: GpuMat,
    bias: Option<[DevBuf; 3]>,
    bo: Option<DevBuf>,
    qk_norm: Option<[DevBuf; 2]>,
    /// One sink logit per query head (GPT-OSS).
    sinks: Option<DevBuf>,
}

/// A layer's mixing block on the device.
enum GpuMixer {
    Attention(GpuAttn),
    Ssm(GpuSsm),
    Mla(GpuMla),
}

struct GpuLayer {
    attn_norm: DevBuf,
    mixer: GpuMixer,
    /// Empty (one zero) in a model without feed-forward blocks.
    ffn_norm: DevBuf,
    post_norms: Option<[DevBuf; 2]>,
    dense: Option<GpuFfn>,
    router: Option<GpuMat>,
    router_bias: Option<DevBuf>,
    /// DeepSeek V3's choice-only bias of the router's scores.
    choice_bias: Option<DevBuf>,
    experts: Vec<GpuFfn>,
    shared: Option<GpuFfn>,
    shared_gate: Option<DevBuf>,
}

pub struct GpuModel {
    pub(super) gpu: Arc<Gpu>,
    pub(super) spec: ModelSpec,
    tok_embd: GpuMat,
    output_norm: DevBuf,
    output: Option<GpuMat>,
    layers: Vec<GpuLayer>,
    kv: KvCache,
}

impl GpuModel {
    pub fn load(gpu: Arc<Gpu>, path: &std::path::Path, opts: &ModelOptions) -> Result<GpuModel, DeviceError> {
        let name = gpu.backend.name();
        let fail = |reason: String| DeviceError::Failed { device: name.clone(), case: path.display().to_string(), reason };
        let kv = opts.kv_cache;
        if kv != crate::KvTypes::default() {
            return Err(fail(format!("a {kv} KV cache is not implemented on GPU devices (the cache is f32)")));
        }
        let host = HostWeights::load(path, &name, &|_, _| Ok(()))?;
        let mat = |p: &PackedMat| gpu.upload_mat(p.ty, p.rows, p.cols, &p.bytes);
        let vec = |v: &Vec<f32>| gpu.upload_f32(v);
        let ffn = |f: &Ffn| -> Result<GpuFfn, String> {
            let bias = match &f.bias {
                Some([g, u, d]) => Some([vec(g)?, vec(u)?, vec(d)?]),
                None => None,
            };
            Ok(GpuFfn { gate: mat(&f.gate)?, up: mat(&f.up)?, down: mat(&f.down)?, bias })
        };
        let upload = || -> Result<GpuModel, String> {
            let mut layers = Vec::with_capacity(host.layers.len());
            for l in &host.layers {
                let mixer = match &l.mixer {
                    Mixer::Attention(a) => GpuMixer::Attention(GpuAttn {
                        wq: mat(&a.wq)?,
                        wk: mat(&a.wk)?,
                        wv: mat(&a.wv)?,
                        wo: mat(&a.wo)?,
                        bias: match &a.bias {
                            Some([a, b, c]) => Some([vec(a)?, vec(b)?, vec(c)?]),
                            None => None,
                        },
                        bo: a.bo.as_ref().map(vec).transpose()?,
                        qk_norm: match &a.qk_norm {
                            Some([a, b]) => Some([vec(a)?, vec(b)?]),
                            None => None,
                        },
                        sinks: a.sinks.as_ref().map(vec).transpose()?,
                    }),
                    Mixer::Ssm(w) => GpuMixer::Ssm(GpuSsm::upload(&gpu, w)?),
                    Mixer::Mla(w) => GpuMixer::Mla(GpuMla::upload(&gpu, w)?),
                };
                layers.push(GpuLayer {
                    attn_norm: vec(&l.attn_norm)?,
                    mixer,
                    ffn_norm: if l.ffn_norm.is_empty() { vec(&vec![0.0])? } else { vec(&l.ffn_norm)? },
                    post_norms: match &l.post_norms {
                        Some([a, b]) => Some([vec(a)?, vec(b)?]),
                        None => None,
                    },
                    dense: l.dense.as_ref().map(ffn).transpose()?,
                    router: l.router.as_ref().map(mat).transpose()?,
                    router_bias: l.router_bias.as_ref().map(vec).transpose()?,
                    choice_bias: l.choice_bias.as_ref().map(vec).transpose()?,
                    experts: l.experts.iter().map(ffn).collect::<Result<_, _>>()?,
                    shared: l.shared.as_ref().map(ffn).transpose()?,
                    shared_gate: l.shared_gate.as_ref().map(vec).transpose()?,
                });
            }
            Ok(GpuModel {
                gpu: gpu.clone(),
                spec: host.spec.clone(),
                tok_embd: mat(&host.tok_embd)?,
                output_norm: vec(&host.output_norm)?,
                output: host.output.as_ref().map(mat).transpose()?,
                layers,
                kv: KvCache::empty(),
            })
        };
        upload().map_err(fail)
    }

    fn fail(&self, reason: String) -> DeviceError {
        DeviceError::Failed { device: self.gpu.backend.name(), case: "forward".into(), reason }
    }

    fn ffn(&self, f: &GpuFfn, h: u64, m: usize, taps: Option<(&mut dyn Tap, usize, usize)>) -> Result<DevBuf, String> {
        let g = &self.gpu;
        let width = f.gate.rows;
        let (gate, up, act) = (g.alloc(4 * m * width)?, g.alloc(4 * m * width)?, g.alloc(4 * m * width)?);
        g.matmul_group(&[(&f.gate, gate.ptr), (&f.up, up.ptr)], h, f.gate.cols, m)?;
        if let Some([bg, bu, _]) = &f.bias {
            g.add(gate.ptr, bg.ptr, gate.ptr, m * width, width)?;
            g.add(up.ptr, bu.ptr, up.ptr, m * width, width)?;
        }
        let kind = match self.spec.activation {
            Activation::Silu => 0,
            Activation::GeluTanh => 1,
            Activation::SwigluOai => 3,
        };
        g.glu(gate.ptr, up.ptr, act.ptr, m * width, kind)?;
        if let Some((t, li, start)) = taps {
            record(t, &format!("blk.{li}.ffn_gate"), &gate, start, m, width)?;
            record(t, &format!("blk.{li}.ffn_up"), &up, start, m, width)?;
            record(t, &format!("blk.{li}.ffn_act"), &act, start, m, width)?;
        }
        let out = g.alloc(4 * m * f.down.rows)?;
        g.matmul(&f.down, act.ptr, width, m, out.ptr)?;
        if let Some([_, _, bd]) = &f.bias {
            g.add(out.ptr, bd.ptr, out.ptr, m * f.down.rows, f.down.rows)?;
        }
        Ok(out)
    }

    fn moe(&self, li: usize, h: &DevBuf, m: usize, taps: &mut dyn Tap, start: usize) -> Result<DevBuf, String> {
        let g = &self.gpu;
        let layer = &self.layers[li];
        let ms = self.spec.moe.as_ref().ok_or("MoE stage without an MoE spec")?;
        let router = layer.router.as_ref().ok_or("MoE stage without a router")?;
        let (d, ne, k) = (self.spec.n_embd, ms.n_expert, ms.n_expert_used);
        let logits = g.alloc(4 * m * ne)?;
        g.matmul(router, h.ptr, d, m, logits.ptr)?;
        if let Some(b) = &layer.router_bias {
            g.add(logits.ptr, b.ptr, logits.ptr, m * ne, ne)?;
        }
        let (ids_buf, weights) = (g.alloc(4 * m * k)?, g.alloc(4 * m * k)?);
        let sigmoid = ms.gating == Gating::Sigmoid;
        let limit = super::RouteLimit { bias: layer.choice_bias.as_ref().map_or(0, |b| b.ptr), groups: ms.groups, scale: ms.weights_scale.unwrap_or(1.0) as f32 };
        g.moe_route(logits.ptr, ids_buf.ptr, weights.ptr, m, ne, k, sigmoid, ms.normalize_topk, limit)?;
        // The host launches the chosen experts, so it needs their ids (as engines that route
        // on the host do); the weights stay on the device.
        let ids = ids_buf.download_u32(m * k)?;
        if taps.enabled() {
            let probs = g.alloc(4 * m * ne)?;
            if sigmoid {
                g.glu(logits.ptr, 0, probs.ptr, m * ne, 2)?;
            } else {
                g.softmax(logits.ptr, probs.ptr, m, ne)?;
            }
            record(taps, &format!("blk.{li}.ffn_moe_probs"), &probs, start, m, ne)?;
            let topk: Vec<f32> = ids.iter().map(|&e| e as f32).collect();
            taps.record(&format!("blk.{li}.ffn_moe_topk"), start, m, k, &topk);
        }
        let out = g.upload_f32(&vec![0.0; m * d])?;
        for t in 0..m {
            for j in 0..k {
                let e = ids[t * k + j] as usize;
                let expert = layer.experts.get(e).ok_or_else(|| format!("router chose expert {e} of {}", layer.experts.len()))?;
                let y = self.ffn(expert, h.at_f32(t * d), 1, None)?;
                g.axpy_rows(out.at_f32(t * d), y.ptr, weights.at_f32(t * k + j), 0, 1, d)?;
            }
        }
        if let Some(sf) = &layer.shared {
            let y = self.ffn(sf, h.ptr, m, None)?;
            let gate = match &layer.shared_gate {
                Some(gw) => {
                    let s = g.alloc(4 * m)?;
                    g.sigmoid_dot(h.ptr, gw.ptr, s.ptr, m, d)?;
                    s
                }
                None => g.upload_f32(&vec![1.0; m])?,
            };
            g.axpy_rows(out.ptr, y.ptr, gate.ptr, 1, m, d)?;
        }
        Ok(out)
    }

    /// One step over `tokens`; logits of every token (`all_logits`) or of the last one only (the
    /// output head then multiplies that row alone: no other row's logits are computed or
    /// downloaded; each row's bits do not depend on how many rows the matmul ran).
    fn run(&mut self, tokens: &[u32], taps: &mut dyn Tap, all_logits: bool) -> Result<Vec<f32>, String> {
        let mut kv = std::mem::replace(&mut self.kv, KvCache::empty());
        let seg = Seg { cache: 0, start: kv.len, tokens };
        let out = self.run_batch(std::slice::from_mut(&mut kv), &[seg], taps, all_logits);
        self.kv = kv;
        out
    }

    /// One step over a batch: each segment's tokens at its positions, attending to its own cache;
    /// the products run over every row at once, attention segment by segment. One segment's keys
    /// and values are computed straight into its cache; a batch's into batch buffers, copied
    /// into each segment's cache before its attention. Logits of every row (`all_logits`) or of
    /// the last one only. Taps record every row of the batch (a `SegmentTap` keeps one
    /// segment's); the keys' and values' taps of a batch are its batch buffers' rows.
    pub(super) fn run_batch(&self, caches: &mut [KvCache], segs: &[Seg], taps: &mut dyn Tap, all_logits: bool) -> Result<Vec<f32>, String> {
        let s = &self.spec;
        let tokens: Vec<u32> = segs.iter().flat_map(|g| g.tokens.iter().copied()).collect();
        let m = tokens.len();
        if m == 0 || segs.iter().any(|g| g.tokens.is_empty() || g.cache >= caches.len()) {
            return Err("no tokens".into());
        }
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= s.n_vocab) {
            return Err(format!("token id {bad} outside the vocabulary of {}", s.n_vocab));
        }
        let g = self.gpu.clone();
        for seg in segs {
            caches[seg.cache].reserve(&g, s, seg.start + seg.tokens.len())?;
        }
        let start = segs[0].start;
        let positions: Vec<usize> = segs.iter().flat_map(|g| g.start..g.start + g.tokens.len()).collect();
        let d = s.n_embd;
        // Query-sized buffers hold the widest layer's (an output gate's rows beside its query's
        // before they are split).
        let qd_max = s.layers.iter().fold(s.n_head * s.head_dim, |w, l| match l.block {
            BlockKind::Mla(b) => w.max(b.q_dim()).max(b.out_dim()),
            _ => w,
        });
        let gate = if s.attn_gate { Some((g.alloc(4 * m * 2 * qd_max)?, g.alloc(4 * m * qd_max)?)) } else { None };
        let kvd_max = s.layers.iter().map(|l| match l.block {
            BlockKind::Attention(a) => a.kv_dim(),
            BlockKind::Ssm(_) | BlockKind::Mla(_) => 0,
        }).max().unwrap_or(0);
        let eps = s.norm_eps as f32;
        let ids = g.upload_u32(&tokens)?;
        let pos = g.upload_u32(&positions.iter().map(|p| *p as u32).collect::<Vec<_>>())?;
        // A batch's keys and values, before they go to each segment's cache.
        let batch_kv = if segs.len() > 1 { Some((g.alloc(4 * m * kvd_max)?, g.alloc(4 * m * kvd_max)?)) } else { None };
        let x = g.alloc(4 * m * d)?;
        g.get_rows(&self.tok_embd, ids.ptr, m, x.ptr)?;
        if let Some(scale) = s.embd_scale {
            g.scale(x.ptr, scale as f32, m * d)?;
        }
        record(taps, "inp_embd", &x, start, m, d)?;
        // K and V are computed straight into the cache (its rows are the matmul's [m, kvd] output
        // at position `start`), so no copy launches; Q into its own buffer.
        let (h, q) = (g.alloc(4 * m * d)?, g.alloc(4 * m * qd_max)?);
        let (attn, attn_out) = (g.alloc(4 * m * qd_max)?, g.alloc(4 * m * d)?);
        // One table per distinct RoPE (Gemma 3's windowed layers have their own base).
        let tables = s.ropes().into_iter().map(|r| Ok((r, g.upload_f32(&super::rope_table(r, positions.iter().copied()))?))).collect::<Result<Vec<_>, String>>()?;
        let neox = s.rope.style == RopeStyle::Neox;
        let post = if s.post_norms { Some(g.alloc(4 * m * d)?) } else { None };
        // A residual add and the norm right after it are one launch (add_rms_norm): the attention
        // residual with the FFN norm, the FFN residual with the next layer's attention norm (or
        // the output norm). `normed` says the norm the next stage would run is already in h.
        let mut normed = false;
        for li in 0..s.n_layer {
            let name = |t: &str| format!("blk.{li}.{t}");
            let mut ffn_out: Option<DevBuf> = None;
            // What each residual adds: the sublayer's output, or its post-norm (held in `post`).
            let (mut attn_res, mut ffn_res) = (attn_out.ptr, None);
            // An attention layer's shapes and where this step's keys and values are until
            // attention: the batch buffers, or the cache (placeholders in another layer, whose
            // stages do not read them).
            let (a, kv_bufs, kv_at) = match (&s.layers[li].block, &caches[segs[0].cache].layers[li], &batch_kv) {
                (BlockKind::Attention(a), _, Some((kb, vb))) => (Some(*a), Some((kb, vb)), 0),
                (BlockKind::Attention(a), LayerState::Kv { k, v }, None) => (Some(*a), Some((k, v)), start * a.kv_dim()),
                _ => (None, None, 0),
            };
            let (hd, qd, kvd) = a.map_or((0, 0, 0), |a| (a.head_dim, a.q_dim(), a.kv_dim()));
            let (k, v) = kv_bufs.map_or((0, 0), |(kb, vb)| (kb.at_f32(kv_at), vb.at_f32(kv_at)));
            let (mut ssm, mut ssm_normed): (Option<SsmStep>, Option<DevBuf>) = (None, None);
            let mut mla: Option<MlaStep> = None;
            let stages = &s.layers[li].stages;
            // The layer's weights by the kind of its mixer; a stage of another kind is an error.
            let layer = &self.layers[li];
            let (lw, sw, mw) = match (&layer.mixer, s.layers[li].block) {
                (GpuMixer::Attention(w), BlockKind::Attention(_)) => (Some(w), None, None),
                (GpuMixer::Ssm(w), BlockKind::Ssm(b)) => (None, Some((w, b)), None),
                (GpuMixer::Mla(w), BlockKind::Mla(b)) => (None, None, Some((w, b))),
                _ => return Err(format!("layer {li}: its weights and its block disagree")),
            };
            for (si, stage) in stages.iter().enumerate() {
                let wrong = |what: &str| format!("layer {li}: a {stage:?} stage in a layer without {what}");
                let kv_bufs = || kv_bufs.ok_or_else(|| wrong("keys and values"));
                // A latent-attention layer's own projections, rotation and attention.
                if let Some((w, b)) = mw {
                    let rows = Rows { m, start, name: &name };
                    match stage {
                        Stage::QkvProj => {
                            mla = Some(MlaStep::project(&g, &b, w, h.ptr, d, &q, eps, &rows, taps)?);
                            continue;
                        }
                        Stage::Rope => {
                            let table = &tables.iter().find(|(r, _)| *r == &s.rope).ok_or("no RoPE table for latent attention")?.1;
                            mla.as_ref().ok_or_else(|| wrong("a latent projection"))?.rope(&g, &b, &q, table, s.rope.n_rot, neox, &rows, taps)?;
                            continue;
                        }
                        Stage::Attention => {
                            mla.as_ref().ok_or_else(|| wrong("a latent projection"))?.attend(&g, &b, w, li, caches, segs, (q.ptr, pos.ptr, attn.ptr), s.attn_scale as f32)?;
                            record(taps, &name("attn_kqv"), &attn, start, m, b.out_dim())?;
                            continue;
                        }
                        Stage::AttnOutProj => {
                            g.matmul(&w.wo, attn.ptr, b.out_dim(), m, attn_out.ptr)?;
                            record(taps, &name("attn_out"), &attn_out, start, m, d)?;
                            continue;
                        }
                        _ => {}
                    }
                }
                if std::mem::take(&mut normed) {
                    // Its tap was recorded where the launch ran.
                    debug_assert!(matches!(stage, Stage::AttnNorm | Stage::FfnNorm));
                    continue;
                }
                match stage {
                    Stage::AttnNorm => {
                        g.rms_norm(x.ptr, layer.attn_norm.ptr, h.ptr, m, d, eps)?;
                        record(taps, &name("attn_norm"), &h, start, m, d)?;
                    }
                    Stage::QkvProj => {
                        let (w, (kbuf, vbuf)) = (lw.ok_or_else(|| wrong("attention weights"))?, kv_bufs()?);
                        match &gate {
                            // Per head: its query's hd values, then its gate's.
                            Some((qg, gt)) => {
                                g.matmul_group(&[(&w.wq, qg.ptr), (&w.wk, k), (&w.wv, v)], h.ptr, d, m)?;
                                g.copy_cols((qg.ptr, 2 * hd, 0), (q.ptr, hd, 0), m * qd / hd, hd)?;
                                g.copy_cols((qg.ptr, 2 * hd, hd), (gt.ptr, hd, 0), m * qd / hd, hd)?;
                                record(taps, &name("attn_gate"), gt, start, m, qd)?;
                            }
                            None => g.matmul_group(&[(&w.wq, q.ptr), (&w.wk, k), (&w.wv, v)], h.ptr, d, m)?,
                        }
                        if let Some([bq, bk, bv]) = &w.bias {
                            g.add(q.ptr, bq.ptr, q.ptr, m * qd, qd)?;
                            g.add(k, bk.ptr, k, m * kvd, kvd)?;
                            g.add(v, bv.ptr, v, m * kvd, kvd)?;
                        }
                        record(taps, &name("attn_q"), &q, start, m, qd)?;
                        record_at(taps, &name("attn_k"), kbuf, kv_at, start, m, kvd)?;
                        record_at(taps, &name("attn_v"), vbuf, kv_at, start, m, kvd)?;
                    }
                    Stage::QkNorm => {
                        let (w, (kbuf, _), a) = (lw.ok_or_else(|| wrong("attention weights"))?, kv_bufs()?, a.ok_or_else(|| wrong("attention"))?);
                        if let Some([qn, kn]) = &w.qk_norm {
                            g.rms_norm_pair(
                                (q.ptr, qn.ptr, q.ptr, m * a.n_head),
                                (k, kn.ptr, k, m * a.n_head_kv),
                                hd,
                                eps,
                            )?;
                        }
                        record(taps, &name("attn_q_norm"), &q, start, m, qd)?;
                        record_at(taps, &name("attn_k_norm"), kbuf, kv_at, start, m, kvd)?;
                    }
                    Stage::Rope => {
                        let ((kbuf, _), a) = (kv_bufs()?, a.ok_or_else(|| wrong("attention"))?);
                        let rope = s.rope_of(&a);
                        let table = &tables
                            .iter()
                            .find(|(r, _)| *r == rope)
                            .ok_or("no RoPE table for this layer")?
                            .1;
                        g.rope_pair(
                            (q.ptr, a.n_head),
                            (k, a.n_head_kv),
                            table,
                            m,
                            hd,
                            rope.n_rot,
                            neox,
                        )?;
                        record(taps, &name("attn_q_rope"), &q, start, m, qd)?;
                        record_at(taps, &name("attn_k_rope"), kbuf, kv_at, start, m, kvd)?;
                    }
                    Stage::Attention => {
                        let (w, a) = (lw.ok_or_else(|| wrong("attention weights"))?, a.ok_or_else(|| wrong("attention"))?);
                        let cfg = crate::shared::AttnCfg {
                            n_head: a.n_head,
                            n_head_kv: a.n_head_kv,
                            head_dim: hd,
                            window: a.window.unwrap_or(0),
                            sinks: None,
                            softcap: s.attn_softcap.unwrap_or(0.0) as f32,
                            scale: s.attn_scale as f32,
                        };
                        let sinks = w.sinks.as_ref().map_or(0, |b| b.ptr);
                        let mut r0 = 0;
                        for seg in segs {
                            let n = seg.tokens.len();
                            let LayerState::Kv { k: kc, v: vc } = &caches[seg.cache].layers[li] else { return Err(wrong("a key/value cache")) };
                            if batch_kv.is_some() {
                                g.copy(k + 4 * (r0 * kvd) as u64, kc.at_f32(seg.start * kvd), n * kvd)?;
                                g.copy(v + 4 * (r0 * kvd) as u64, vc.at_f32(seg.start * kvd), n * kvd)?;
                            }
                            g.attention(q.at_f32(r0 * qd), pos.at_f32(r0) /* 4-byte entries */, kc.ptr, vc.ptr, attn.at_f32(r0 * qd), n, seg.start + n, &cfg, sinks)?;
                            r0 += n;
                        }
                        record(taps, &name("attn_kqv"), &attn, start, m, qd)?;
                    }
                    Stage::AttnGate => {
                        let (_, gt) = gate.as_ref().ok_or_else(|| wrong("an output gate"))?;
                        g.glu(gt.ptr, attn.ptr, attn.ptr, m * qd, 2)?;
                        record(taps, &name("attn_gated"), &attn, start, m, qd)?;
                    }
                    Stage::AttnOutProj => {
                        let w = lw.ok_or_else(|| wrong("attention weights"))?;
                        g.matmul(&w.wo, attn.ptr, qd, m, attn_out.ptr)?;
                        if let Some(bo) = &w.bo {
                            g.add(attn_out.ptr, bo.ptr, attn_out.ptr, m * d, d)?;
                        }
                        record(taps, &name("attn_out"), &attn_out, start, m, d)?;
                    }
                    Stage::SsmInProj => {
                        let (w, b) = sw.ok_or_else(|| wrong("a state-space block"))?;
                        ssm = Some(SsmStep::project(&g, &b, w, h.ptr, d, m, taps, &name("ssm_in"), start)?);
                    }
                    Stage::SsmConv => {
                        let ((w, b), st) = (sw.ok_or_else(|| wrong("a state-space block"))?, ssm.as_mut().ok_or_else(|| wrong("an input projection"))?);
                        let xbc = st.convolve(&g, &b, w, li, caches, segs)?;
                        record(taps, &name("ssm_conv"), xbc, start, m, b.conv_dim())?;
                    }
                    Stage::SsmScan => {
                        let ((w, b), st) = (sw.ok_or_else(|| wrong("a state-space block"))?, ssm.as_mut().ok_or_else(|| wrong("an input projection"))?);
                        let y = st.scan(&g, &b, w, li, caches, segs, taps, &name("ssm_state"), start)?;
                        record(taps, &name("ssm_scan"), y, start, m, b.d_inner)?;
                    }
                    Stage::SsmNorm => {
                        let ((w, b), st) = (sw.ok_or_else(|| wrong("a state-space block"))?, ssm.as_ref().ok_or_else(|| wrong("an input projection"))?);
                        let normed = st.norm(&g, &b, w, eps)?;
                        record(taps, &name("ssm_norm"), &normed, start, m, b.d_inner)?;
                        ssm_normed = Some(normed);
                    }
                    Stage::SsmOutProj => {
                        let ((w, b), y) = (sw.ok_or_else(|| wrong("a state-space block"))?, ssm_normed.as_ref().ok_or_else(|| wrong("a gated norm"))?);
                        g.matmul(&w.out, y.ptr, b.d_inner, m, attn_out.ptr)?;
                        record(taps, &name("ssm_out"), &attn_out, start, m, d)?;
                    }
                    // The attention residual is added before the FFN runs, so one buffer serves
                    // both post-norms.
                    Stage::AttnPostNorm => {
                        let (Some([w, _]), Some(p)) = (&layer.post_norms, &post) else { return Err("post-norm stage without its weights".into()) };
                        g.rms_norm(attn_out.ptr, w.ptr, p.ptr, m, d, eps)?;
                        record(taps, &name("attn_post_norm"), p, start, m, d)?;
                        attn_res = p.ptr;
                    }
                    Stage::FfnPostNorm => {
                        let (Some([_, w]), Some(o), Some(p)) = (&layer.post_norms, &ffn_out, &post) else { return Err("post-norm stage without its weights or an FFN output".into()) };
                        g.rms_norm(o.ptr, w.ptr, p.ptr, m, d, eps)?;
                        record(taps, &name("ffn_post_norm"), p, start, m, d)?;
                        ffn_res = Some(p.ptr);
                    }
                    Stage::AttnResidual => {
                        if let Some(c) = s.residual_scale {
                            g.scale(attn_res, c as f32, m * d)?;
                        }
                        if stages.get(si + 1) == Some(&Stage::FfnNorm) {
                            g.add_rms_norm(x.ptr, attn_res, layer.ffn_norm.ptr, h.ptr, m, d, eps)?;
                            record(taps, &name("ffn_inp"), &x, start, m, d)?;
                            record(taps, &name("ffn_norm"), &h, start, m, d)?;
                            normed = true;
                        } else {
                            g.add(x.ptr, attn_res, x.ptr, m * d, m * d)?;
                            record(taps, &name("ffn_inp"), &x, start, m, d)?;
                        }
                    }
                    Stage::FfnNorm => {
                        g.rms_norm(x.ptr, layer.ffn_norm.ptr, h.ptr, m, d, eps)?;
                        record(taps, &name("ffn_norm"), &h, start, m, d)?;
                    }
                    Stage::DenseFfn => {
                        let f = layer.dense.as_ref().ok_or("dense stage without weights")?;
                        let o = self.ffn(f, h.ptr, m, Some((&mut *taps, li, start)))?;
                        record(taps, &name("ffn_out"), &o, start, m, d)?;
                        ffn_out = Some(o);
                    }
                    Stage::MoeFfn => {
                        let o = self.moe(li, &h, m, taps, start)?;
                        record(taps, &name("ffn_out"), &o, start, m, d)?;
                        ffn_out = Some(o);
                    }
                    // The residual that ends a layer: the FFN's, or (a layer without one) the mixer's.
                    Stage::FfnResidual | Stage::MixerResidual => {
                        let o = match stage {
                            Stage::MixerResidual => attn_out.ptr,
                            _ => ffn_res.or(ffn_out.as_ref().map(|o| o.ptr)).ok_or("FFN residual before an FFN stage")?,
                        };
                        if let Some(c) = s.residual_scale {
                            g.scale(o, c as f32, m * d)?;
                        }
                        // The norm that comes next: the next layer's attention norm when its
                        // stages start with it, else (the last layer) the output norm.
                        let next = if si + 1 < stages.len() {
                            None
                        } else if li + 1 == s.n_layer {
                            Some((self.output_norm.ptr, "result_norm".to_string()))
                        } else if s.layers[li + 1].stages.first() == Some(&Stage::AttnNorm) {
                            Some((
                                self.layers[li + 1].attn_norm.ptr,
                                format!("blk.{}.attn_norm", li + 1),
                            ))
                        } else {
                            None
                        };
                        match next {
                            Some((w, tap)) => {
                                g.add_rms_norm(x.ptr, o, w, h.ptr, m, d, eps)?;
                                record(taps, &name("l_out"), &x, start, m, d)?;
                                record(taps, &tap, &h, start, m, d)?;
                                normed = true;
                            }
                            None => {
                                g.add(x.ptr, o, x.ptr, m * d, m * d)?;
                                record(taps, &name("l_out"), &x, start, m, d)?;
                            }
                        }
                    }
                }
            }
        }
        for seg in segs {
            caches[seg.cache].len = seg.start + seg.tokens.len();
        }
        if !std::mem::take(&mut normed) {
            g.rms_norm(x.ptr, self.output_norm.ptr, h.ptr, m, d, eps)?;
            record(taps, "result_norm", &h, start, m, d)?;
        }
        let head = self.output.as_ref().unwrap_or(&self.tok_embd);
        let (rows, row0) = if all_logits { (m, 0) } else { (1, m - 1) };
        let logits = g.alloc(4 * rows * s.n_vocab)?;
        g.matmul(head, h.at_f32(row0 * d), d, rows, logits.ptr)?;
        if let Some(c) = s.logit_scale {
            g.scale(logits.ptr, 1.0 / c as f32, rows * s.n_vocab)?;
        }
        if let Some(c) = s.final_softcap {
            g.softcap(logits.ptr, c as f32, rows * s.n_vocab)?;
        }
        let out = logits.download_f32(rows * s.n_vocab)?;
        if taps.enabled() {
            taps.record("result_output", start + row0, rows, s.n_vocab, &out);
        }
        Ok(out)
    }
}

impl DeviceModel for GpuModel {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }
    fn arithmetic(&self) -> Arithmetic {
        Arithmetic::F32
    }
    fn forward(&mut self, tokens: &[u32], taps: &mut dyn Tap) -> Result<Vec<f32>, DeviceError> {
        self.run(tokens, taps, true).map_err(|r| self.fail(r))
    }
    fn forward_last(&mut self, tokens: &[u32], taps: &mut dyn Tap) -> Result<Vec<f32>, DeviceError> {
        self.run(tokens, taps, false).map_err(|r| self.fail(r))
    }
    fn cached(&self) -> usize {
        self.kv.len
    }
    fn reset(&mut self) {
        self.kv.len = 0;
    }
    fn memory_peak_bytes(&self) -> Option<u64> {
        Some(self.gpu.peak_bytes())
    }
    fn start_kernel_profile(&mut self) -> bool {
        self.gpu.start_profile();
        true
    }
    fn take_kernel_profile(&mut self) -> Option<crate::KernelProfile> {
        Some(self.gpu.take_profile())
    }
    fn kernel_launches(&self) -> Option<u64> {
        Some(self.gpu.launches())
    }
    fn batch_invariant(&self) -> bool {
        // Every product computes each row on its own (a row's bits do not depend on how many
        // rows the launch ran), attention runs segment by segment, experts token by token.
        true
    }
    fn serve(&mut self, schedule: &oracle::schedule::Schedule) -> Option<Result<oracle::schedule::Served, DeviceError>> {
        Some(self.serve_schedule(schedule, &mut Vec::new(), None).map_err(|r| self.fail(r)))
    }
    fn serve_timed(&mut self, schedule: &oracle::schedule::Schedule, step_seconds: &mut Vec<f64>) -> Option<Result<oracle::schedule::Served, DeviceError>> {
        Some(self.serve_schedule(schedule, step_seconds, None).map_err(|r| self.fail(r)))
    }
    fn serve_tapped(&mut self, schedule: &oracle::schedule::Schedule, request: &str, taps: &mut dyn Tap) -> Option<Result<oracle::schedule::Served, DeviceError>> {
        Some(self.serve_schedule(schedule, &mut Vec::new(), Some((request, taps))).map_err(|r| self.fail(r)))
    }
}
