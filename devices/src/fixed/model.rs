//! `fixed`'s whole model: the weights converted to its integer formats once at load, and the
//! forward pass in its kernels.

use super::kernels::*;
use super::FixedDevice;
use super::model_err;
use crate::{Arithmetic, DeviceError, FixedPoint, NumFormat};
use oracle::spec::{BlockKind, ModelSpec, SsmKind, Stage};

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

/// What one layer keeps between calls: Q16 rows of two widths — an attention layer's keys and
/// values (`[len, kv_dim]` each), a latent-attention layer's normed latents (`[len,
/// kv_lora_rank]`) and rotated shared keys (`[len, qk_rope]`), a state-space layer's last
/// `d_conv - 1` convolution inputs (`first`) — and a state-space layer's state (Q32) as of
/// position `at`.
#[derive(Default)]
struct LayerState {
    first: Vec<i64>,
    second: Vec<i64>,
    state: Vec<i64>,
    at: usize,
}

/// Every layer's state and the positions it holds.
struct LayerStates {
    layers: Vec<LayerState>,
    len: usize,
}

impl LayerStates {
    fn new(n_layer: usize) -> LayerStates {
        LayerStates { layers: (0..n_layer).map(|_| LayerState::default()).collect(), len: 0 }
    }

    fn reset(&mut self) {
        self.layers.iter_mut().for_each(|l| *l = LayerState::default());
        self.len = 0;
    }

    /// Writes layer `li`'s two rows for positions `start..` (of widths `widths`), dropping
    /// anything it held from `start` on; returns everything it now holds.
    fn write(&mut self, li: usize, start: usize, widths: (usize, usize), a: &[i64], b: &[i64]) -> (&[i64], &[i64]) {
        let l = &mut self.layers[li];
        for (cache, new, w) in [(&mut l.first, a, widths.0), (&mut l.second, b, widths.1)] {
            cache.truncate(start * w);
            cache.extend_from_slice(new);
        }
        (&l.first, &l.second)
    }
}

/// An attention block's weights in the device's formats.
pub(super) struct FixedAttn {
    pub wq: FixedWeights,
    pub wk: FixedWeights,
    pub wv: FixedWeights,
    pub wo: FixedWeights,
    pub bias: Option<[Vec<i64>; 3]>,
    /// The attention output projection's bias (`attn_output.bias`), when the model has one.
    pub bo: Option<Vec<i64>>,
    /// GPT-OSS's sink logit per query head, in Q16.
    pub sinks: Option<Vec<i64>>,
    pub qk_norm: Option<[Vec<i64>; 2]>,
}

/// A latent-attention block's weights: the query's compression and its norm (if any), the
/// query projection, the latent/shared-key projection and the latent's norm, the expansion's
/// key and value rows per head (Q24, `[n_head][rows][kv_lora_rank]`), the output projection.
pub(super) struct FixedMla {
    pub q_a: Option<(FixedWeights, Vec<i64>)>,
    pub q: FixedWeights,
    pub kv_a: FixedWeights,
    pub kv_a_norm: Vec<i64>,
    pub k_b: Vec<i64>,
    pub v_b: Vec<i64>,
    pub wo: FixedWeights,
}

/// A state-space block's weights: the input projection (a gated DeltaNet's q/k/v, beside its z
/// and b/a projections), the convolution (Q24, `[conv_dim][d_conv]`) and its bias, per head the
/// time steps' bias (Q16), A and D (Q24; a DeltaNet has no D), the gated norm's scales (Q20,
/// `[d_inner]`, a DeltaNet's one head's), the output projection.
pub(super) struct FixedSsm {
    pub in_proj: FixedWeights,
    pub gate_proj: Option<FixedWeights>,
    pub ba_proj: Option<FixedWeights>,
    pub conv: Vec<i64>,
    pub conv_bias: Vec<i64>,
    pub dt_bias: Vec<i64>,
    pub a: Vec<i64>,
    pub d: Vec<i64>,
    pub norm: Vec<i64>,
    pub out: FixedWeights,
}

pub(super) enum FixedMixer {
    Attention(FixedAttn),
    Mla(FixedMla),
    Ssm(FixedSsm),
}

pub(super) struct FixedLayer {
    pub attn_norm: Vec<i64>,
    pub mixer: FixedMixer,
    pub ffn_norm: Vec<i64>,
    /// Gemma's norms of the attention and FFN outputs.
    pub post_norms: Option<[Vec<i64>; 2]>,
    pub ffn: Option<Ffn>,
}

/// One gated FFN (a dense layer's, an expert's or a shared expert's), with GPT-OSS's biases of
/// its gate, up and down products where the model has them, in Q16.
pub(super) struct Expert {
    pub gate: FixedWeights,
    pub up: FixedWeights,
    pub down: FixedWeights,
    pub bias: Option<[Vec<i64>; 3]>,
}

/// A layer's FFN: dense, or a router over experts (with a shared expert and its sigmoid gate,
/// and DeepSeek V3's choice bias, where the model has them).
pub(super) enum Ffn {
    Dense(Expert),
    Moe { router: FixedWeights, router_bias: Option<Vec<i64>>, choice_bias: Option<Vec<i64>>, experts: Vec<Expert>, shared: Option<Expert>, shared_gate: Option<Vec<i64>> },
}

impl FixedModel {
    pub(super) fn new(spec: ModelSpec, tok_embd: IntValues, output_norm: Vec<i64>, head: FixedWeights, layers: Vec<FixedLayer>, int4: bool) -> FixedModel {
        let kv = LayerStates::new(layers.len());
        FixedModel { spec, tok_embd, output_norm, head, layers, kv, point: FixedDevice { int4 }.point() }
    }
}

/// `x + scale * branch` (Granite's residual multiplier, a Q30 constant, each product rounded
/// once), or `x + branch`.
fn residual_q(x: &[i64], branch: &[i64], scale: Option<f64>) -> Vec<i64> {
    match scale {
        None => add_q(x, branch),
        Some(c) => {
            let c = to_q(c, TABLE) as i128;
            x.iter().zip(branch).map(|(a, b)| a + shr_round(*b as i128 * c, TABLE)).collect()
        }
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
            let (mut h, mut q, mut k, mut v, mut attn, mut out) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let (mut zx, mut xbc, mut y, mut gate) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let wrong = || model_err(format!("layer {li}: its weights are not of its block's kind"));
            for stage in &s.layers[li].stages {
                // A latent-attention layer's own projections, rotation and attention.
                if let (BlockKind::Mla(b), FixedMixer::Mla(w)) = (s.layers[li].block, &l.mixer) {
                    match stage {
                        Stage::QkvProj => {
                            let q_in = match &w.q_a {
                                Some((qa, norm)) => {
                                    let a = rms_norm_q(&matmul_q(&h, m, qa), b.q_lora_rank, norm, s.norm_eps);
                                    tap_q(taps, &name("attn_q_a"), start, m, b.q_lora_rank, &a);
                                    a
                                }
                                None => h.clone(),
                            };
                            q = matmul_q(&q_in, m, &w.q);
                            tap_q(taps, &name("attn_q"), start, m, b.q_dim(), &q);
                            let kv_a = matmul_q(&h, m, &w.kv_a);
                            let (r, rr) = (b.kv_lora_rank, b.qk_rope);
                            let lat: Vec<i64> = kv_a.chunks_exact(r + rr).flat_map(|row| row[..r].iter().copied()).collect();
                            v = rms_norm_q(&lat, r, &w.kv_a_norm, s.norm_eps);
                            k = kv_a.chunks_exact(r + rr).flat_map(|row| row[r..].iter().copied()).collect();
                            tap_q(taps, &name("attn_kv_a"), start, m, r, &v);
                            tap_q(taps, &name("attn_k"), start, m, rr, &k);
                            continue;
                        }
                        Stage::Rope => {
                            // Each head's rotated part (its last qk_rope values) gathered, rotated, put back.
                            let hd = b.qk_head_dim();
                            let mut tails: Vec<i64> = q.chunks_exact(hd).flat_map(|hq| hq[b.qk_nope..].iter().copied()).collect();
                            rope_q(&mut tails, &pos, b.n_head, b.qk_rope, &s.rope);
                            q.chunks_exact_mut(hd).zip(tails.chunks_exact(b.qk_rope)).for_each(|(hq, t)| hq[b.qk_nope..].copy_from_slice(t));
                            rope_q(&mut k, &pos, 1, b.qk_rope, &s.rope);
                            tap_q(taps, &name("attn_q_rope"), start, m, b.q_dim(), &q);
                            tap_q(taps, &name("attn_k_rope"), start, m, b.qk_rope, &k);
                            continue;
                        }
                        Stage::Attention => {
                            let cached = self.kv.write(li, start, (b.kv_lora_rank, b.qk_rope), &v, &k);
                            attn = mla_attention_q(&q, &pos, cached, (&w.k_b, &w.v_b), &b, s.attn_scale);
                            tap_q(taps, &name("attn_kqv"), start, m, b.out_dim(), &attn);
                            continue;
                        }
                        Stage::AttnOutProj => {
                            attn = matmul_q(&attn, m, &w.wo);
                            tap_q(taps, &name("attn_out"), start, m, d, &attn);
                            continue;
                        }
                        _ => {}
                    }
                }
                let attn_parts = || match (s.layers[li].block, &l.mixer) {
                    (BlockKind::Attention(a), FixedMixer::Attention(w)) => Ok((a, w)),
                    _ => Err(wrong()),
                };
                match stage {
                    Stage::AttnNorm => {
                        h = rms_norm_q(&x, d, &l.attn_norm, s.norm_eps);
                        tap_q(taps, &name("attn_norm"), start, m, d, &h);
                    }
                    Stage::QkvProj => {
                        let (a, w) = attn_parts()?;
                        (q, k, v) = (matmul_q(&h, m, &w.wq), matmul_q(&h, m, &w.wk), matmul_q(&h, m, &w.wv));
                        if s.attn_gate {
                            // Per head: its query's head_dim values, then its gate's.
                            let hd = a.head_dim;
                            (q, gate) = (q.chunks_exact(2 * hd).flat_map(|c| c[..hd].iter().copied()).collect(), q.chunks_exact(2 * hd).flat_map(|c| c[hd..].iter().copied()).collect());
                            tap_q(taps, &name("attn_gate"), start, m, a.q_dim(), &gate);
                        }
                        if let Some([bq, bk, bv]) = &w.bias {
                            (q, k, v) = (add_q(&q, bq), add_q(&k, bk), add_q(&v, bv));
                        }
                        tap_q(taps, &name("attn_q"), start, m, a.q_dim(), &q);
                        tap_q(taps, &name("attn_k"), start, m, a.kv_dim(), &k);
                        tap_q(taps, &name("attn_v"), start, m, a.kv_dim(), &v);
                    }
                    Stage::QkNorm => {
                        let (a, w) = attn_parts()?;
                        let [qn, kn] = w.qk_norm.as_ref().ok_or_else(|| model_err("a q/k-norm stage without its weights"))?;
                        q = rms_norm_q(&q, a.head_dim, qn, s.norm_eps);
                        k = rms_norm_q(&k, a.head_dim, kn, s.norm_eps);
                        tap_q(taps, &name("attn_q_norm"), start, m, a.q_dim(), &q);
                        tap_q(taps, &name("attn_k_norm"), start, m, a.kv_dim(), &k);
                    }
                    Stage::Rope => {
                        let (a, _) = attn_parts()?;
                        rope_q(&mut q, &pos, a.n_head, a.head_dim, s.rope_of(&a));
                        rope_q(&mut k, &pos, a.n_head_kv, a.head_dim, s.rope_of(&a));
                        tap_q(taps, &name("attn_q_rope"), start, m, a.q_dim(), &q);
                        tap_q(taps, &name("attn_k_rope"), start, m, a.kv_dim(), &k);
                    }
                    Stage::Attention => {
                        let (a, w) = attn_parts()?;
                        let (kc, vc) = self.kv.write(li, start, (a.kv_dim(), a.kv_dim()), &k, &v);
                        let extras = AttnExtras { scale: Some(s.attn_scale), sinks: w.sinks.as_deref(), softcap: s.attn_softcap.map(SoftcapQ::new) };
                        attn = attention_q(&q, &pos, kc, vc, a.n_head, a.n_head_kv, a.head_dim, a.window.unwrap_or(0), &extras);
                        tap_q(taps, &name("attn_kqv"), start, m, a.q_dim(), &attn);
                    }
                    Stage::AttnOutProj => {
                        let (_, w) = attn_parts()?;
                        attn = matmul_q(&attn, m, &w.wo);
                        if let Some(bo) = &w.bo {
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
                        x = residual_q(&x, &attn, s.residual_scale);
                        tap_q(taps, &name("ffn_inp"), start, m, d, &x);
                    }
                    Stage::FfnNorm => {
                        h = rms_norm_q(&x, d, &l.ffn_norm, s.norm_eps);
                        tap_q(taps, &name("ffn_norm"), start, m, d, &h);
                    }
                    Stage::DenseFfn | Stage::MoeFfn => {
                        let f = l.ffn.as_ref().ok_or_else(|| model_err(format!("layer {li}: an FFN stage without its weights")))?;
                        out = self.ffn(f, &h, m, taps, li, start)?;
                        tap_q(taps, &name("ffn_out"), start, m, d, &out);
                    }
                    Stage::SsmInProj | Stage::SsmConv | Stage::SsmScan | Stage::SsmNorm | Stage::SsmOutProj => {
                        let (BlockKind::Ssm(b), FixedMixer::Ssm(w)) = (s.layers[li].block, &l.mixer) else { return Err(wrong()) };
                        let (cd, id) = (b.conv_dim(), b.in_dim());
                        match stage {
                            Stage::SsmInProj => {
                                zx = match (&w.gate_proj, &w.ba_proj) {
                                    (Some(gp), Some(bap)) => crate::shared::delta_in_rows(&b, &matmul_q(&h, m, &w.in_proj), &matmul_q(&h, m, gp), &matmul_q(&h, m, bap), m),
                                    _ => matmul_q(&h, m, &w.in_proj),
                                };
                                tap_q(taps, &name("ssm_in"), start, m, id, &zx);
                            }
                            Stage::SsmConv => {
                                let st = &mut self.kv.layers[li];
                                if st.at != start {
                                    return Err(model_err(format!("layer {li}: the state-space state is as of position {}; a call from position {start} cannot continue it (a recurrent state is not cut back)", st.at)));
                                }
                                let input: Vec<i64> = zx.chunks_exact(id).flat_map(|r| r[b.conv_at()..b.conv_at() + cd].iter().copied()).collect();
                                xbc = super::ssm::conv_silu_q(&mut st.first, &input, m, cd, &w.conv, &w.conv_bias, b.d_conv);
                                tap_q(taps, &name("ssm_conv"), start, m, cd, &xbc);
                            }
                            Stage::SsmScan => {
                                let st = &mut self.kv.layers[li];
                                if st.state.len() != b.state_len() {
                                    st.state = vec![0; b.state_len()];
                                }
                                let heads = |i: usize| -> Vec<i64> { zx.chunks_exact(id).flat_map(|r| r[b.heads_at() + i * b.n_head..][..b.n_head].iter().copied()).collect() };
                                let params = super::ssm::ScanParams { dt_bias: &w.dt_bias, a: &w.a, d: &w.d };
                                let states;
                                (y, states) = match b.kind {
                                    SsmKind::Mamba2 => super::ssm::scan_q(&mut st.state, &xbc, &heads(0), m, &b, &params),
                                    SsmKind::GatedDelta => super::ssm::delta_scan_q(&mut st.state, &xbc, &heads(0), &heads(1), m, &b, &params),
                                };
                                st.at = start + m;
                                if taps.enabled() {
                                    let f: Vec<f32> = states.iter().map(|v| from_q(*v, super::ssm::STATE)).collect();
                                    taps.record(&name("ssm_state"), start, m, b.state_len(), &f);
                                }
                                tap_q(taps, &name("ssm_scan"), start, m, b.d_inner, &y);
                            }
                            Stage::SsmNorm => {
                                let z: Vec<i64> = zx.chunks_exact(id).flat_map(|r| r[b.z_at()..b.z_at() + b.d_inner].iter().copied()).collect();
                                y = match b.kind {
                                    SsmKind::Mamba2 => super::ssm::gated_norm_q(&y, &z, b.d_inner, b.n_group, &w.norm, s.norm_eps),
                                    SsmKind::GatedDelta => super::ssm::delta_norm_q(&y, &z, b.head_dim(), &w.norm, s.norm_eps),
                                };
                                tap_q(taps, &name("ssm_norm"), start, m, b.d_inner, &y);
                            }
                            _ => {
                                attn = matmul_q(&y, m, &w.out);
                                tap_q(taps, &name("ssm_out"), start, m, d, &attn);
                            }
                        }
                    }
                    Stage::AttnGate => {
                        if gate.len() != attn.len() {
                            return Err(wrong());
                        }
                        attn.iter_mut().zip(&gate).for_each(|(a, g)| *a = shr_round(*a as i128 * sigmoid_q16(*g) as i128, ACT));
                        tap_q(taps, &name("attn_gated"), start, m, attn.len() / m.max(1), &attn);
                    }
                    Stage::MixerResidual => {
                        x = residual_q(&x, &attn, s.residual_scale);
                        tap_q(taps, &name("l_out"), start, m, d, &x);
                    }
                    Stage::FfnResidual => {
                        x = residual_q(&x, &out, s.residual_scale);
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
        if let Some(c) = s.logit_scale {
            // Granite's logits divided by its scale: 1/scale in Q30, each product rounded once.
            let inv = to_q(1.0 / c, TABLE) as i128;
            logits.iter_mut().for_each(|l| *l = shr_round(*l as i128 * inv, TABLE));
        }
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
        ffn: &Ffn,
        h: &[i64],
        m: usize,
        taps: &mut dyn oracle::Tap,
        li: usize,
        start: usize,
    ) -> Result<Vec<i64>, DeviceError> {
        let s = &self.spec;
        let d = s.n_embd;
        let name = |t: &str| format!("blk.{li}.{t}");
        Ok(match ffn {
            Ffn::Dense(f) => expert_q(s.activation, f, h, m, Some((taps, li, start))),
            Ffn::Moe {
                router,
                router_bias,
                choice_bias,
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
                    &RouteLimitQ { bias: choice_bias.as_deref(), groups: ms.groups, scale_q30: ms.weights_scale.map(|w| to_q(w, TABLE)) },
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
