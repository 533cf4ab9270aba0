//! Whole-model runs on the cpu device: packed weights straight from the GGUF file, the cpu
//! kernels, an f32 (or f16) KV cache, and taps under the same names as the oracle's.

use super::{kernels, matmul_packed, matmul_packed_group, qdot, Packed};
pub(crate) use super::kvcache::KvCache;
use crate::{DeviceError, DeviceModel, ModelOptions};
use crate::shared::host::{Ffn, HostWeights, Layer, Mixer, PackedMat};
use oracle::spec::{Activation, BlockKind, Gating, ModelSpec, SsmKind, Stage};
use oracle::Tap;
use std::path::Path;

impl PackedMat {
    fn view(&self) -> Packed<'_> {
        Packed { ty: self.ty, rows: self.rows, cols: self.cols, bytes: &self.bytes }
    }
}

pub struct CpuModel {
    pub(crate) spec: ModelSpec,
    pub(crate) tok_embd: PackedMat,
    pub(crate) output_norm: Vec<f32>,
    pub(crate) output: Option<PackedMat>,
    pub(crate) layers: Vec<Layer>,
    pub(crate) kv_cache: crate::KvTypes,
    /// Keys and values `[len, n_head_kv * head_dim]` per layer (each in `kv_cache`'s format).
    pub(crate) kv: KvCache,
    /// A serving bug seeded into this model's schedule executor (the `faults` feature's
    /// `devices::faulty::ServeFault`); None in every device a user opens.
    pub(crate) serve_fault: Option<super::serve_faults::ServeFault>,
    /// A rounding applied to the state-space layers' state after every position: a seeded bug
    /// (`devices::faulty::ModelFault::SsmStateBf16`); None in every device a user opens.
    pub(crate) ssm_state_rounding: Option<fn(f32) -> f32>,
    /// A latent-attention error seeded (`devices::faulty::ModelFault::MlaAbsorbedScale`,
    /// `MlaRopeSliceSwapped`); `MlaFault::None` in every device a user opens.
    pub(crate) mla_fault: super::mla::MlaFault,
}

/// One sequence's part of a batch: its tokens, the position of the first, and its cache.
pub(crate) struct Seg<'a> {
    pub(crate) cache: usize,
    pub(crate) start: usize,
    pub(crate) tokens: &'a [u32],
    /// A seeded serving bug that applies to this segment (a chunk after a request's first).
    pub(crate) fault: Option<super::serve_faults::ServeFault>,
}

pub(crate) fn err(path: &str, reason: impl std::fmt::Display) -> DeviceError {
    DeviceError::Failed { device: "cpu".into(), case: path.to_string(), reason: reason.to_string() }
}

impl CpuModel {
    /// Every matrix the forward pass multiplies by (the embedding table only when the output is
    /// tied to it: its rows are otherwise looked up, not multiplied).
    fn matrices(&self) -> impl Iterator<Item = &PackedMat> {
        fn ffn(f: &Ffn) -> [&PackedMat; 3] {
            [&f.gate, &f.up, &f.down]
        }
        let layers = self.layers.iter().flat_map(move |l| {
            let mixer: Vec<&PackedMat> = match &l.mixer {
                Mixer::Attention(a) => vec![&a.wq, &a.wk, &a.wv, &a.wo],
                Mixer::Ssm(w) => vec![&w.in_proj, &w.out],
                Mixer::Mla(w) => w.q_a.iter().map(|(a, _)| a).chain([&w.q, &w.kv_a, &w.wo]).collect(),
            };
            mixer
                .into_iter()
                .chain(l.router.as_ref())
                .chain(l.dense.iter().chain(&l.experts).chain(l.shared.as_ref()).flat_map(ffn))
        });
        layers.chain(std::iter::once(self.output.as_ref().unwrap_or(&self.tok_embd)))
    }

    /// Loads a GGUF file or a safetensors directory (F32/F16/BF16 tensors, held as stored).
    pub fn load(path: &Path, opts: &ModelOptions) -> Result<CpuModel, DeviceError> {
        let check = |_: &str, spec: &ModelSpec| -> Result<(), String> {
            let hd = spec.head_dim;
            for f in opts.kv_cache.formats() {
                if let Some(b) = f.block().filter(|b| !hd.is_multiple_of(*b)) {
                    return Err(format!("a {f} KV cache quantizes each head's cached rows in blocks of {b}; this model's heads are {hd} wide"));
                }
            }
            Ok(())
        };
        let HostWeights { spec, tok_embd, output_norm, output, layers } = HostWeights::load(path, "cpu", &check)?;
        let kv = KvCache::new(opts.kv_cache, &spec);
        Ok(CpuModel { spec, tok_embd, output_norm, output, layers, kv_cache: opts.kv_cache, kv, serve_fault: None, ssm_state_rounding: None, mla_fault: Default::default() })
    }

    fn ffn(&self, f: &Ffn, h: &[f32], m: usize, taps: Option<(&mut dyn Tap, usize, usize)>) -> Vec<f32> {
        let [mut gate, mut up] = matmul_packed_group(h, m, f.gate.cols, &[f.gate.view(), f.up.view()]).try_into().expect("two outputs");
        if let Some([bg, bu, _]) = &f.bias {
            gate = kernels::add_broadcast(&gate, bg);
            up = kernels::add_broadcast(&up, bu);
        }
        let act: Vec<f32> = match self.spec.activation {
            Activation::Silu => gate.iter().zip(&up).map(|(g, u)| kernels::silu(*g) * u).collect(),
            Activation::GeluTanh => gate.iter().zip(&up).map(|(g, u)| kernels::gelu_tanh(*g) * u).collect(),
            Activation::SwigluOai => gate.iter().zip(&up).map(|(g, u)| kernels::swiglu_oai(*g, *u)).collect(),
        };
        if let Some((t, li, start)) = taps {
            if t.enabled() {
                let w = f.gate.rows;
                t.record(&format!("blk.{li}.ffn_gate"), start, m, w, &gate);
                t.record(&format!("blk.{li}.ffn_up"), start, m, w, &up);
                t.record(&format!("blk.{li}.ffn_act"), start, m, w, &act);
            }
        }
        let down = matmul_packed(&act, m, f.down.view());
        match &f.bias {
            Some([_, _, bd]) => kernels::add_broadcast(&down, bd),
            None => down,
        }
    }

    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, DeviceError> {
        let d = self.spec.n_embd;
        let row_bytes = self.tok_embd.bytes.len() / self.tok_embd.rows;
        let mut x = Vec::with_capacity(tokens.len() * d);
        let mut row = vec![0.0f32; d];
        for &t in tokens {
            if t as usize >= self.spec.n_vocab {
                return Err(err("forward", format!("token id {t} outside the vocabulary of {}", self.spec.n_vocab)));
            }
            let bytes = &self.tok_embd.bytes[t as usize * row_bytes..(t as usize + 1) * row_bytes];
            if qdot::is_float(self.tok_embd.ty) {
                qdot::float_row(self.tok_embd.ty, bytes, &mut row);
            } else {
                // The embedding row is decoded with this device's own block reader.
                qdot::dequantize_row(self.tok_embd.ty, bytes, &mut row);
            }
            x.extend_from_slice(&row);
        }
        Ok(x)
    }
}

fn rms_rows(x: &[f32], n: usize, w: &[f32], eps: f64) -> Vec<f32> {
    kernels::rms_norm(x, n, w, eps as f32)
}

/// `x + branch`, the branch first multiplied by `scale` where the model scales its residual
/// branches (Granite).
fn residual(x: &[f32], branch: &[f32], scale: Option<f64>) -> Vec<f32> {
    match scale {
        None => kernels::add_broadcast(x, branch),
        Some(c) => {
            let c = c as f32;
            x.iter().zip(branch).map(|(a, b)| a + c * b).collect()
        }
    }
}

fn record(t: &mut dyn Tap, name: &str, start: usize, m: usize, w: usize, data: &[f32]) {
    if t.enabled() {
        t.record(name, start, m, w, data);
    }
}

impl DeviceModel for CpuModel {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }
    fn arithmetic(&self) -> crate::Arithmetic {
        // Products with quantized weights take Q8_0 activations (as in the kernel suite); a model
        // with any quantized matrix it multiplies by is judged by that arithmetic throughout
        // (every matrix counts: mixed recipes keep some at F16 and quantize the rest).
        let quantized = self.matrices().any(|m| !qdot::is_float(m.ty));
        crate::Arithmetic { activation_q8_block: quantized.then_some(32), ..crate::Arithmetic::F32 }.with_kv(self.kv_cache)
    }
    fn cached(&self) -> usize {
        self.kv.len()
    }
    fn reset(&mut self) {
        self.kv.reset();
    }

    fn forward(&mut self, tokens: &[u32], taps: &mut dyn Tap) -> Result<Vec<f32>, DeviceError> {
        self.run_on_pool(tokens, taps, true)
    }
    fn forward_last(&mut self, tokens: &[u32], taps: &mut dyn Tap) -> Result<Vec<f32>, DeviceError> {
        self.run_on_pool(tokens, taps, false)
    }
    fn batch_invariant(&self) -> bool {
        // Every row runs through the same products and each row's bits do not depend on the
        // others (the block dots, the f32 products and attention are per row and per head).
        true
    }
    fn serve(&mut self, schedule: &oracle::schedule::Schedule) -> Option<Result<oracle::schedule::Served, DeviceError>> {
        Some(rayon::scope(|_| self.serve_schedule(schedule, &mut Vec::new())))
    }
    fn serve_timed(&mut self, schedule: &oracle::schedule::Schedule, step_seconds: &mut Vec<f64>) -> Option<Result<oracle::schedule::Served, DeviceError>> {
        Some(rayon::scope(|_| self.serve_schedule(schedule, step_seconds)))
    }
    fn serve_tapped(&mut self, schedule: &oracle::schedule::Schedule, request: &str, taps: &mut dyn Tap) -> Option<Result<oracle::schedule::Served, DeviceError>> {
        // Taps are not `Send`: served on this thread.
        Some(self.serve_schedule_tapped(schedule, &mut Vec::new(), Some((request, taps))))
    }
}

impl CpuModel {
    /// [`CpuModel::run`] on a rayon worker thread when no tap records (taps are not `Send`): each
    /// op's parallel loop then starts from inside the pool, so a loop of one chunk runs in place
    /// and the others are stolen by the idle worker, instead of every op's loop being handed to
    /// the pool and waited for (hundreds of cross-thread handoffs per decoded token). Which
    /// thread runs a chunk changes no bit.
    fn run_on_pool(&mut self, tokens: &[u32], taps: &mut dyn Tap, all_logits: bool) -> Result<Vec<f32>, DeviceError> {
        if taps.enabled() {
            return self.run(tokens, taps, all_logits);
        }
        rayon::scope(|_| self.run(tokens, &mut oracle::NoTap, all_logits))
    }

    /// One step over `tokens` with the model's own cache.
    fn run(&mut self, tokens: &[u32], taps: &mut dyn Tap, all_logits: bool) -> Result<Vec<f32>, DeviceError> {
        let mut kv = std::mem::replace(&mut self.kv, KvCache::none());
        let seg = Seg { cache: 0, start: kv.len(), tokens, fault: None };
        let out = self.run_batch(std::slice::from_mut(&mut kv), &[seg], taps, all_logits);
        self.kv = kv;
        out
    }

    /// One step over a batch: each segment's tokens at its positions, attending to its own cache
    /// (`caches[seg.cache]`); every row runs through the same products, each row's bits not
    /// depending on the others. Logits of every row (`all_logits`) or of the last one only (the
    /// output norm and head then run on that row alone). Taps record a batch of one segment.
    pub(crate) fn run_batch(&self, caches: &mut [KvCache], segs: &[Seg], taps: &mut dyn Tap, all_logits: bool) -> Result<Vec<f32>, DeviceError> {
        let s = &self.spec;
        // One segment (the one-sequence path) is used in place; a batch is joined once.
        let tokens: std::borrow::Cow<[u32]> = match segs {
            [g] => g.tokens.into(),
            _ => segs.iter().flat_map(|g| g.tokens.iter().copied()).collect::<Vec<u32>>().into(),
        };
        let m = tokens.len();
        if m == 0 || segs.iter().any(|g| g.tokens.is_empty() || g.cache >= caches.len()) {
            return Err(err("forward", "no tokens"));
        }
        let start = segs[0].start;
        let views: Vec<super::serve_faults::SegView> = segs.iter().map(|g| (g.start, g.tokens.len(), g.fault)).collect();
        let pos: Vec<usize> = segs.iter().flat_map(|g| g.start..g.start + g.tokens.len()).collect();
        let d = s.n_embd;
        let mut x = self.embed(&tokens)?;
        if let Some(scale) = s.embd_scale {
            let scale = scale as f32;
            x.iter_mut().for_each(|v| *v *= scale);
        }
        record(taps, "inp_embd", start, m, d, &x);
        for li in 0..s.n_layer {
            let name = |t: &str| format!("blk.{li}.{t}");
            let (mut h, mut q, mut k, mut v, mut attn, mut ffn_out) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let layer = &self.layers[li];
            // The layer's block and weights by kind; a stage of another kind is an error.
            let (attn_parts, ssm_parts) = match (s.layers[li].block, &layer.mixer) {
                (BlockKind::Attention(a), Mixer::Attention(w)) => (Some((a, w)), None),
                (BlockKind::Ssm(b), Mixer::Ssm(w)) => (None, Some((b, w))),
                _ => (None, None),
            };
            let mla_parts = match (s.layers[li].block, &layer.mixer) {
                (BlockKind::Mla(b), Mixer::Mla(w)) => Some((b, w)),
                _ => None,
            };
            let mut latent = Vec::new();
            let wrong = |what: &str| err("forward", format!("layer {li}: {what} stage in a layer of another kind"));
            let (hd, qd, kvd) = attn_parts.map_or((0, 0, 0), |(a, _)| (a.head_dim, a.q_dim(), a.kv_dim()));
            let (mut zx, mut xbc, mut y, mut gate) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for stage in &s.layers[li].stages {
                // A latent-attention layer's own projections, rotation and attention.
                if let Some((b, w)) = mla_parts {
                    match stage {
                        Stage::QkvProj => {
                            let q_in = match &w.q_a {
                                Some((qa, norm)) => {
                                    let a = rms_rows(&matmul_packed(&h, m, qa.view()), qa.rows, norm, s.norm_eps);
                                    record(taps, &name("attn_q_a"), start, m, qa.rows, &a);
                                    a
                                }
                                None => h.clone(),
                            };
                            q = matmul_packed(&q_in, m, w.q.view());
                            record(taps, &name("attn_q"), start, m, b.q_dim(), &q);
                            let kv_a = matmul_packed(&h, m, w.kv_a.view());
                            let (r, rr) = (b.kv_lora_rank, b.qk_rope);
                            let lat: Vec<f32> = kv_a.chunks_exact(r + rr).flat_map(|row| row[..r].iter().copied()).collect();
                            latent = rms_rows(&lat, r, &w.kv_a_norm, s.norm_eps);
                            k = kv_a.chunks_exact(r + rr).flat_map(|row| row[r..].iter().copied()).collect();
                            record(taps, &name("attn_kv_a"), start, m, r, &latent);
                            record(taps, &name("attn_k"), start, m, rr, &k);
                            continue;
                        }
                        Stage::Rope => {
                            let mut tails = Vec::new();
                            let at = if self.mla_fault == super::mla::MlaFault::RopeOnUnrotated { 0 } else { b.qk_nope };
                            super::mla::rope_tails(&mut q, &mut tails, &b, at, false);
                            kernels::rope(&mut tails, &pos, b.n_head, b.qk_rope, &s.rope);
                            super::mla::rope_tails(&mut q, &mut tails, &b, at, true);
                            kernels::rope(&mut k, &pos, 1, b.qk_rope, &s.rope);
                            record(taps, &name("attn_q_rope"), start, m, b.q_dim(), &q);
                            record(taps, &name("attn_k_rope"), start, m, b.qk_rope, &k);
                            continue;
                        }
                        Stage::Attention => {
                            let (r, rr, qd) = (b.kv_lora_rank, b.qk_rope, b.q_dim());
                            let scale = match self.mla_fault {
                                super::mla::MlaFault::ScaleOfCachedRow => (s.attn_scale * (b.qk_head_dim() as f64).sqrt() / ((r + rr) as f64).sqrt()) as f32,
                                _ => s.attn_scale as f32,
                            };
                            attn = Vec::with_capacity(m * b.out_dim());
                            let mut r0 = 0;
                            for g in segs {
                                let rows = r0..r0 + g.tokens.len();
                                let (lat, kpe) = caches[g.cache].write_and_read_latent(li, g.start, (&latent[rows.start * r..rows.end * r], &k[rows.start * rr..rows.end * rr]), (r, rr)).map_err(|e| err("attention", e))?;
                                attn.extend(super::mla::attend_absorbed(&q[rows.start * qd..rows.end * qd], &pos[rows.clone()], (&lat, &kpe), (&w.k_b, &w.v_b), &b, scale).map_err(|e| err("attention", e))?);
                                r0 = rows.end;
                            }
                            record(taps, &name("attn_kqv"), start, m, b.out_dim(), &attn);
                            continue;
                        }
                        Stage::AttnOutProj => {
                            attn = matmul_packed(&attn, m, w.wo.view());
                            record(taps, &name("attn_out"), start, m, d, &attn);
                            continue;
                        }
                        _ => {}
                    }
                }
                match stage {
                    Stage::AttnNorm => {
                        h = rms_rows(&x, d, &layer.attn_norm, s.norm_eps);
                        record(taps, &name("attn_norm"), start, m, d, &h);
                    }
                    Stage::QkvProj => {
                        let (_, w) = attn_parts.ok_or_else(|| wrong("an attention"))?;
                        [q, k, v] = matmul_packed_group(&h, m, w.wq.cols, &[w.wq.view(), w.wk.view(), w.wv.view()]).try_into().expect("three outputs");
                        if s.attn_gate {
                            // Per head: its query's hd values, then its gate's.
                            let (mut qs, mut gs) = (Vec::with_capacity(m * qd), Vec::with_capacity(m * qd));
                            for c in q.chunks_exact(2 * hd) {
                                qs.extend_from_slice(&c[..hd]);
                                gs.extend_from_slice(&c[hd..]);
                            }
                            (q, gate) = (qs, gs);
                            record(taps, &name("attn_gate"), start, m, qd, &gate);
                        }
                        if let Some([bq, bk, bv]) = &w.bias {
                            q = kernels::add_broadcast(&q, bq);
                            k = kernels::add_broadcast(&k, bk);
                            v = kernels::add_broadcast(&v, bv);
                        }
                        record(taps, &name("attn_q"), start, m, qd, &q);
                        record(taps, &name("attn_k"), start, m, kvd, &k);
                        record(taps, &name("attn_v"), start, m, kvd, &v);
                    }
                    Stage::QkNorm => {
                        let (_, w) = attn_parts.ok_or_else(|| wrong("an attention"))?;
                        if let Some([qn, kn]) = &w.qk_norm {
                            q = kernels::rms_norm(&q, hd, qn, s.norm_eps as f32);
                            k = kernels::rms_norm(&k, hd, kn, s.norm_eps as f32);
                        }
                        record(taps, &name("attn_q_norm"), start, m, qd, &q);
                        record(taps, &name("attn_k_norm"), start, m, kvd, &k);
                    }
                    Stage::Rope => {
                        let (a, _) = attn_parts.ok_or_else(|| wrong("an attention"))?;
                        let pos = super::serve_faults::rope_positions(&views, &pos);
                        kernels::rope(&mut q, &pos, a.n_head, hd, s.rope_of(&a));
                        kernels::rope(&mut k, &pos, a.n_head_kv, hd, s.rope_of(&a));
                        record(taps, &name("attn_q_rope"), start, m, qd, &q);
                        record(taps, &name("attn_k_rope"), start, m, kvd, &k);
                    }
                    Stage::Attention => {
                        let (a, w) = attn_parts.ok_or_else(|| wrong("an attention"))?;
                        let cfg = kernels::AttnCfg {
                            n_head: a.n_head,
                            n_head_kv: a.n_head_kv,
                            head_dim: hd,
                            window: a.window.unwrap_or(0),
                            sinks: w.sinks.as_deref(),
                            softcap: s.attn_softcap.unwrap_or(0.0) as f32,
                            scale: s.attn_scale as f32,
                        };
                        attn = if segs.len() == 1 { Vec::new() } else { Vec::with_capacity(m * qd) };
                        let mut r0 = 0;
                        for g in segs {
                            let rows = r0..r0 + g.tokens.len();
                            let (qs, ks, vs) = (&q[rows.start * qd..rows.end * qd], &k[rows.start * kvd..rows.end * kvd], &v[rows.start * kvd..rows.end * kvd]);
                            let (seg_pos, seg_cfg) = super::serve_faults::attention_view(g.fault, &pos[rows.clone()], &cfg);
                            let out = caches[g.cache].write_and_attend(li, g.start, kvd, (qs, ks, vs), &seg_pos, &seg_cfg).map_err(|e| err("attention", e))?;
                            if segs.len() == 1 {
                                attn = out;
                            } else {
                                attn.extend_from_slice(&out);
                            }
                            r0 = rows.end;
                        }
                        super::serve_faults::batch_faults(self.serve_fault, &views, &mut attn, qd);
                        record(taps, &name("attn_kqv"), start, m, qd, &attn);
                    }
                    Stage::AttnGate => {
                        if gate.len() != attn.len() {
                            return Err(wrong("an output-gate"));
                        }
                        attn.iter_mut().zip(&gate).for_each(|(a, g)| *a /= 1.0 + (-g).exp());
                        record(taps, &name("attn_gated"), start, m, qd, &attn);
                    }
                    Stage::AttnOutProj => {
                        let (_, w) = attn_parts.ok_or_else(|| wrong("an attention"))?;
                        attn = matmul_packed(&attn, m, w.wo.view());
                        if let Some(bo) = &w.bo {
                            attn = kernels::add_broadcast(&attn, bo);
                        }
                        record(taps, &name("attn_out"), start, m, d, &attn);
                    }
                    Stage::AttnPostNorm | Stage::FfnPostNorm => {
                        let [pa, pf] = layer.post_norms.as_ref().ok_or_else(|| err("forward", "post-norm stage without its weights"))?;
                        let (out, w, tap) = if *stage == Stage::AttnPostNorm { (&mut attn, pa, "attn_post_norm") } else { (&mut ffn_out, pf, "ffn_post_norm") };
                        *out = rms_rows(out, d, w, s.norm_eps);
                        record(taps, &name(tap), start, m, d, out);
                    }
                    Stage::AttnResidual => {
                        x = residual(&x, &attn, s.residual_scale);
                        record(taps, &name("ffn_inp"), start, m, d, &x);
                    }
                    Stage::FfnNorm => {
                        h = rms_rows(&x, d, &layer.ffn_norm, s.norm_eps);
                        record(taps, &name("ffn_norm"), start, m, d, &h);
                    }
                    Stage::DenseFfn => {
                        let f = layer.dense.as_ref().ok_or_else(|| err("forward", "dense stage without weights"))?;
                        ffn_out = self.ffn(f, &h, m, Some((taps, li, start)));
                        record(taps, &name("ffn_out"), start, m, d, &ffn_out);
                    }
                    Stage::MoeFfn => {
                        ffn_out = self.moe(li, &h, m, taps, start)?;
                        record(taps, &name("ffn_out"), start, m, d, &ffn_out);
                    }
                    Stage::SsmInProj => {
                        let (b, w) = ssm_parts.ok_or_else(|| wrong("a state-space"))?;
                        zx = match (&w.gate_proj, &w.ba_proj) {
                            (Some(gp), Some(bap)) => {
                                let [qkv, z, ba]: [Vec<f32>; 3] = matmul_packed_group(&h, m, w.in_proj.cols, &[w.in_proj.view(), gp.view(), bap.view()]).try_into().expect("three outputs");
                                crate::shared::delta_in_rows(&b, &qkv, &z, &ba, m)
                            }
                            _ => matmul_packed(&h, m, w.in_proj.view()),
                        };
                        record(taps, &name("ssm_in"), start, m, b.in_dim(), &zx);
                    }
                    Stage::SsmConv => {
                        let (b, w) = ssm_parts.ok_or_else(|| wrong("a state-space"))?;
                        let (cd, id) = (b.conv_dim(), b.in_dim());
                        xbc = Vec::with_capacity(m * cd);
                        let mut r0 = 0;
                        for g in segs {
                            let n = g.tokens.len();
                            let (hist, _, at, history) = caches[g.cache].ssm_state(li).map_err(|e| err("forward", e))?;
                            if *at != g.start {
                                return Err(err("forward", format!("layer {li}: the state-space state is as of position {at}; a call from position {} cannot continue it (a recurrent state is not cut back)", g.start)));
                            }
                            let input: Vec<f32> = zx[r0 * id..(r0 + n) * id].chunks_exact(id).flat_map(|r| r[b.conv_at()..b.conv_at() + cd].iter().copied()).collect();
                            xbc.extend(super::ssm::conv_silu(hist, &input, n, cd, &w.conv, &w.conv_bias, b.d_conv));
                            if let Some(h) = history {
                                h.inputs.extend_from_slice(&input);
                            }
                            r0 += n;
                        }
                        record(taps, &name("ssm_conv"), start, m, cd, &xbc);
                    }
                    Stage::SsmScan => {
                        let (b, w) = ssm_parts.ok_or_else(|| wrong("a state-space"))?;
                        let (cd, id) = (b.conv_dim(), b.in_dim());
                        let keep = taps.enabled();
                        let (mut states, mut r0) = (Vec::new(), 0);
                        y = Vec::with_capacity(m * b.d_inner);
                        for g in segs {
                            let n = g.tokens.len();
                            let (_, state, at, history) = caches[g.cache].ssm_state(li).map_err(|e| err("forward", e))?;
                            let keep = keep || history.is_some();
                            let heads = |i: usize| -> Vec<f32> { zx[r0 * id..(r0 + n) * id].chunks_exact(id).flat_map(|r| r[b.heads_at() + i * b.n_head..][..b.n_head].iter().copied()).collect() };
                            let rows = &xbc[r0 * cd..(r0 + n) * cd];
                            let (out, kept) = match b.kind {
                                SsmKind::Mamba2 => super::ssm::scan(state, rows, &heads(0), n, &b, &w.dt_bias, &w.a, &w.d, keep, self.ssm_state_rounding),
                                SsmKind::GatedDelta => super::ssm::delta_scan(state, rows, &heads(0), &heads(1), n, &b, &w.dt_bias, &w.a, keep, self.ssm_state_rounding),
                            };
                            *at = g.start + n;
                            y.extend(out);
                            if let Some(h) = history {
                                h.states.extend_from_slice(&kept);
                            }
                            if taps.enabled() {
                                states.extend(kept);
                            }
                            r0 += n;
                        }
                        record(taps, &name("ssm_state"), start, m, b.state_len(), &states);
                        record(taps, &name("ssm_scan"), start, m, b.d_inner, &y);
                    }
                    Stage::SsmNorm => {
                        let (b, w) = ssm_parts.ok_or_else(|| wrong("a state-space"))?;
                        let z: Vec<f32> = zx.chunks_exact(b.in_dim()).flat_map(|r| r[b.z_at()..b.z_at() + b.d_inner].iter().copied()).collect();
                        y = match b.kind {
                            SsmKind::Mamba2 => super::ssm::gated_norm(&y, &z, b.d_inner, b.n_group, &w.norm, s.norm_eps as f32),
                            SsmKind::GatedDelta => super::ssm::delta_norm(&y, &z, b.head_dim(), &w.norm, s.norm_eps as f32),
                        };
                        record(taps, &name("ssm_norm"), start, m, b.d_inner, &y);
                    }
                    Stage::SsmOutProj => {
                        let (_, w) = ssm_parts.ok_or_else(|| wrong("a state-space"))?;
                        attn = matmul_packed(&y, m, w.out.view());
                        record(taps, &name("ssm_out"), start, m, d, &attn);
                    }
                    Stage::MixerResidual => {
                        x = residual(&x, &attn, s.residual_scale);
                        record(taps, &name("l_out"), start, m, d, &x);
                    }
                    Stage::FfnResidual => {
                        x = residual(&x, &ffn_out, s.residual_scale);
                        record(taps, &name("l_out"), start, m, d, &x);
                    }
                }
            }
        }
        for g in segs {
            caches[g.cache].set_len(g.start + g.tokens.len());
        }
        let (rows, row0) = if all_logits { (m, 0) } else { (1, m - 1) };
        let normed = rms_rows(&x[row0 * d..], d, &self.output_norm, s.norm_eps);
        record(taps, "result_norm", start + row0, rows, d, &normed);
        let head = self.output.as_ref().unwrap_or(&self.tok_embd);
        let mut logits = matmul_packed(&normed, rows, head.view());
        if let Some(c) = s.logit_scale {
            let inv = 1.0 / c as f32;
            logits.iter_mut().for_each(|l| *l *= inv);
        }
        if let Some(c) = s.final_softcap {
            let c = c as f32;
            logits.iter_mut().for_each(|l| *l = kernels::softcap(*l, c));
        }
        record(taps, "result_output", start + row0, rows, s.n_vocab, &logits);
        Ok(logits)
    }

    fn moe(&self, li: usize, h: &[f32], m: usize, taps: &mut dyn Tap, start: usize) -> Result<Vec<f32>, DeviceError> {
        let layer = &self.layers[li];
        let ms = self.spec.moe.as_ref().ok_or_else(|| err("forward", "MoE stage without MoE spec"))?;
        let router = layer.router.as_ref().ok_or_else(|| err("forward", "MoE stage without router"))?;
        let d = self.spec.n_embd;
        let mut logits = matmul_packed(h, m, router.view());
        if let Some(b) = &layer.router_bias {
            logits = kernels::add_broadcast(&logits, b);
        }
        let limit = kernels::GroupLimit { bias: layer.choice_bias.as_deref(), groups: ms.groups, scale: ms.weights_scale.unwrap_or(1.0) as f32 };
        let (ids, weights) = kernels::moe_route_limited(&logits, ms.n_expert, ms.n_expert_used, ms.gating == Gating::Sigmoid, ms.normalize_topk, &limit);
        let mut out = vec![0.0f32; m * d];
        for t in 0..m {
            let ht = &h[t * d..(t + 1) * d];
            let o = &mut out[t * d..(t + 1) * d];
            for j in 0..ms.n_expert_used {
                let e = ids[t * ms.n_expert_used + j] as usize;
                let y = self.ffn(&layer.experts[e], ht, 1, None);
                let w = weights[t * ms.n_expert_used + j];
                o.iter_mut().zip(&y).for_each(|(a, b)| *a += w * b);
            }
            if let Some(sf) = &layer.shared {
                let y = self.ffn(sf, ht, 1, None);
                let g = match &layer.shared_gate {
                    Some(gw) => 1.0 / (1.0 + (-qdot::dot_f32(ht, gw)).exp()),
                    None => 1.0,
                };
                o.iter_mut().zip(&y).for_each(|(a, b)| *a += g * b);
            }
        }
        if taps.enabled() {
            let probs: Vec<f32> = logits
                .chunks(ms.n_expert)
                .flat_map(|r| if ms.gating == Gating::Sigmoid { r.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect::<Vec<_>>() } else { kernels::softmax(r) })
                .collect();
            taps.record(&format!("blk.{li}.ffn_moe_probs"), start, m, ms.n_expert, &probs);
            let topk: Vec<f32> = ids.iter().map(|&e| e as f32).collect();
            taps.record(&format!("blk.{li}.ffn_moe_topk"), start, m, ms.n_expert_used, &topk);
        }
        Ok(out)
    }
}
