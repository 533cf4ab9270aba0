//! What the devices share: the pieces `cpu`, `fixed` and the GPU devices each use the same way —
//! the weights as the file stores them (`host`), the reading of GGML block formats and the block
//! dots (`unpack`, `qdot`: the `cpu` device's products, `fixed`'s and the embedding's row
//! decoding), the host-side RoPE tables, the attention configuration and the sampling draw — so
//! that a line in `cpu/` is the `cpu` device's alone. None of it is the oracle's: the judge stays
//! apart (devices/tests/independence.rs).

pub mod host;
pub mod qdot;
pub mod segment_tap;
pub mod unpack;

use oracle::spec::{RopeScaling, RopeSpec, SsmBlock};

/// A gated DeltaNet's three projections joined into the rows the tap `ssm_in` holds (every
/// device records the tap so): q/k/v, z, then b and a each in value-head order (the stored b/a
/// rows hold, per key head, its value heads' b and then their a).
pub fn delta_in_rows<T: Copy>(b: &SsmBlock, qkv: &[T], z: &[T], ba: &[T], m: usize) -> Vec<T> {
    let (cd, nh) = (b.conv_dim(), b.n_head);
    let r = nh / b.n_group;
    let mut out = Vec::with_capacity(m * b.in_dim());
    for ((q, zr), bar) in qkv.chunks_exact(cd).zip(z.chunks_exact(b.d_inner)).zip(ba.chunks_exact(2 * nh)).take(m) {
        out.extend_from_slice(q);
        out.extend_from_slice(zr);
        // Key head g's block: b of its r value heads, then their a.
        let (bs, as_): (Vec<T>, Vec<T>) = bar.chunks_exact(2 * r).flat_map(|blk| (0..r).map(move |j| (blk[j], blk[r + j]))).unzip();
        out.extend(bs);
        out.extend(as_);
    }
    out
}

/// Row `t` of each of `parts` (each `(rows, width)`), joined, for every `t < m`: the
/// recurrent ops' separate inputs as the rows the model's kernels read.
pub fn join_rows(m: usize, parts: &[(&[f32], usize)]) -> Vec<f32> {
    (0..m).flat_map(|t| parts.iter().flat_map(move |(rows, w)| rows[t * w..(t + 1) * w].iter().copied())).collect()
}

/// cos/sin tables are built in f64 on the host and stored as f32, as engines that precompute
/// RoPE tables do; the rotation itself is f32. Scaling follows llama.cpp's definitions.
pub fn rope_table(spec: &RopeSpec, pos: usize) -> Vec<(f32, f32)> {
    rope_table_f64(spec, pos).into_iter().map(|(c, s)| (c as f32, s as f32)).collect()
}

/// The host-side f64 RoPE table (cos * magnitude, sin * magnitude) for one position.
pub fn rope_table_f64(spec: &RopeSpec, pos: usize) -> Vec<(f64, f64)> {
    let n_rot = spec.n_rot as f64;
    (0..spec.n_rot / 2)
        .map(|i| {
            let mut base = pos as f64 / spec.theta.powf(2.0 * i as f64 / n_rot);
            if let Some(f) = &spec.freq_factors {
                base /= f[i] as f64; // Llama 3.1's per-pair factors, before any scaling
            }
            let (angle, mag) = match spec.scaling {
                RopeScaling::None => (base, 1.0),
                RopeScaling::Linear { factor } => (base / factor, 1.0),
                RopeScaling::LongRope { attn_factor, .. } => (base, attn_factor),
                RopeScaling::Yarn { factor, original_context, beta_fast, beta_slow, ext_factor, attn_factor, truncate } => {
                    let corr = |beta: f64| n_rot * (original_context as f64 / (beta * 2.0 * std::f64::consts::PI)).ln() / (2.0 * spec.theta.ln());
                    let (lo, hi) = if truncate { (corr(beta_fast).floor(), corr(beta_slow).ceil()) } else { (corr(beta_fast), corr(beta_slow)) };
                    let (lo, hi) = (lo.max(0.0), hi.min(n_rot - 1.0));
                    if ext_factor == 0.0 {
                        (base / factor, attn_factor)
                    } else {
                        let mix = (1.0 - ((i as f64 - lo) / (hi - lo).max(0.001)).clamp(0.0, 1.0)) * ext_factor;
                        (base / factor * (1.0 - mix) + base * mix, attn_factor * (1.0 + 0.1 * factor.ln()))
                    }
                }
            };
            (angle.cos() * mag, angle.sin() * mag)
        })
        .collect()
}

/// One attention call's shape and options.
pub struct AttnCfg<'a> {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// 0 = no sliding window.
    pub window: usize,
    /// One sink logit per query head (GPT-OSS): a last score in the head's softmax whose weight
    /// goes to no value.
    pub sinks: Option<&'a [f32]>,
    /// Gemma 2's soft-cap of the scaled scores, `c * tanh(s / c)` (0: none).
    pub softcap: f32,
    /// The scores' scale: 1/sqrt(head_dim), or the model's own (Gemma's `query_pre_attn_scalar`).
    pub scale: f32,
}

/// The draw of `sample` once the top-k candidates `order` (best first) are known; shared with
/// devices that rank the candidates on an accelerator and draw on the host.
pub fn sample_ranked(x: &[f32], order: &[u32], temperature: f64, top_p: f64, rng: &mut oracle::ops::SplitMix64) -> u32 {
    let scaled: Vec<f64> = order.iter().map(|&i| x[i as usize] as f64 / temperature).collect();
    let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scaled.iter().map(|v| (v - max).exp()).collect();
    let total: f64 = e.iter().sum();
    let probs: Vec<f64> = e.iter().map(|v| v / total).collect();
    let mut keep = probs.len();
    let mut cum = 0.0;
    for (j, p) in probs.iter().enumerate() {
        cum += p;
        if cum >= top_p {
            keep = j + 1;
            break;
        }
    }
    let kept: f64 = probs[..keep].iter().sum();
    let mut r = rng.next_f64() * kept;
    for j in 0..keep {
        r -= probs[j];
        if r < 0.0 {
            return order[j];
        }
    }
    order[keep - 1]
}
