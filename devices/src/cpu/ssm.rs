//! The `cpu` device's state-space kernels, in f32 as an f32 engine computes them: the causal
//! convolution over a history the cache keeps, Mamba-2's selective scan and a gated DeltaNet's
//! delta rule one position at a time over a state the cache keeps, and their gated norms.

use super::kernels::silu;
use oracle::spec::SsmBlock;
use rayon::prelude::*;

/// softplus in f32 (`ln(1 + e^v)`, `v` itself above 20).
fn softplus(v: f32) -> f32 {
    if v > 20.0 {
        v
    } else {
        v.exp().ln_1p()
    }
}

/// The convolution of `x` (`m` rows of `c` channels, after the cache's `hist`, `k - 1` rows),
/// plus bias, then SiLU; `hist` then holds the last `k - 1` rows of inputs.
pub(crate) fn conv_silu(hist: &mut Vec<f32>, x: &[f32], m: usize, c: usize, w: &[f32], bias: &[f32], k: usize) -> Vec<f32> {
    let mut rows = std::mem::take(hist);
    rows.extend_from_slice(x);
    let mut out = vec![0.0f32; m * c];
    out.par_chunks_mut(c).enumerate().for_each(|(t, o)| {
        // Output row t reads input rows t..t + k of the joined history and inputs.
        let window = &rows[t * c..(t + k) * c];
        for (ch, oc) in o.iter_mut().enumerate() {
            let taps = &w[ch * k..(ch + 1) * k];
            let mut acc = bias[ch];
            for (j, wj) in taps.iter().enumerate() {
                acc += wj * window[j * c + ch];
            }
            *oc = silu(acc);
        }
    });
    *hist = rows.split_off(rows.len() - (k - 1) * c);
    out
}

/// The scan over `m` positions (`xbc` rows of `conv_dim`, `dt` rows of `n_head`), updating
/// `state` (`[n_head][head_dim][d_state]`) after each; returns the output rows (`d_inner`) and,
/// when `keep`, the state after each position. `round` (a seeded bug's only) rounds the state
/// after each position.
#[allow(clippy::too_many_arguments)]
pub(crate) fn scan(state: &mut [f32], xbc: &[f32], dt: &[f32], m: usize, b: &SsmBlock, dt_bias: &[f32], a: &[f32], d: &[f32], keep: bool, round: Option<fn(f32) -> f32>) -> (Vec<f32>, Vec<f32>) {
    let (nh, hd, ds, ng) = (b.n_head, b.head_dim(), b.d_state, b.n_group);
    let cd = b.conv_dim();
    each_head(state, m, b, keep, |h, g, t, st, y| {
        let row = &xbc[t * cd..(t + 1) * cd];
        let x = &row[h * hd..(h + 1) * hd];
        let bg = &row[b.d_inner + g * ds..b.d_inner + (g + 1) * ds];
        let cg = &row[b.d_inner + (ng + g) * ds..b.d_inner + (ng + g + 1) * ds];
        let step = softplus(dt[t * nh + h] + dt_bias[h]);
        let decay = (step * a[h]).exp();
        for (p, xp) in x.iter().enumerate() {
            let sx = step * xp;
            let srow = &mut st[p * ds..(p + 1) * ds];
            let mut acc = 0.0f32;
            for n in 0..ds {
                srow[n] = decay * srow[n] + sx * bg[n];
                if let Some(r) = round {
                    srow[n] = r(srow[n]);
                }
                acc += srow[n] * cg[n];
            }
            y[p] = acc + d[h] * xp;
        }
    })
}

/// `step(h, g, t, state, y)` for every head `h` (in parallel; `g` its key head or group) and
/// position `t` in order, `state` the head's `[head_dim][d_state]`, `y` its outputs at `t`; the
/// outputs joined into position rows (`[m][d_inner]`) and, when `keep`, the state after each
/// position (`[m][state_len]`).
fn each_head(state: &mut [f32], m: usize, b: &SsmBlock, keep: bool, step: impl Fn(usize, usize, usize, &mut [f32], &mut [f32]) + Sync) -> (Vec<f32>, Vec<f32>) {
    let (hd, ds) = (b.head_dim(), b.d_state);
    let per_group = b.n_head / b.n_group;
    let heads: Vec<(Vec<f32>, Vec<f32>)> = state
        .par_chunks_mut(hd * ds)
        .enumerate()
        .map(|(h, st)| {
            let (mut y, mut kept) = (vec![0.0f32; m * hd], Vec::new());
            for (t, yt) in y.chunks_exact_mut(hd).enumerate() {
                step(h, h / per_group, t, st, yt);
                if keep {
                    kept.extend_from_slice(st);
                }
            }
            (y, kept)
        })
        .collect();
    gather_heads(&heads, m, b, keep)
}

/// Each head's output rows and kept states joined into position rows: `[m][d_inner]` and, when
/// `keep`, `[m][state_len]`.
fn gather_heads(heads: &[(Vec<f32>, Vec<f32>)], m: usize, b: &SsmBlock, keep: bool) -> (Vec<f32>, Vec<f32>) {
    let (hd, ds) = (b.head_dim(), b.d_state);
    let mut y = vec![0.0f32; m * b.d_inner];
    let mut states = vec![0.0f32; if keep { m * b.state_len() } else { 0 }];
    for (h, (yh, kh)) in heads.iter().enumerate() {
        for t in 0..m {
            y[t * b.d_inner + h * hd..t * b.d_inner + (h + 1) * hd].copy_from_slice(&yh[t * hd..(t + 1) * hd]);
            if keep {
                let at = t * b.state_len() + h * hd * ds;
                states[at..at + hd * ds].copy_from_slice(&kh[t * hd * ds..(t + 1) * hd * ds]);
            }
        }
    }
    (y, states)
}

/// `v / sqrt(sum v^2 + 1e-6)`.
fn l2_normed(v: &[f32]) -> Vec<f32> {
    let r = 1.0 / (v.iter().map(|x| x * x).sum::<f32>() + 1e-6).sqrt();
    v.iter().map(|x| x * r).collect()
}

/// The gated delta rule over `m` positions (`qkv` rows of `conv_dim`, `bs` and `as_` rows of
/// `n_head`), updating `state` (`[n_head][head_dim][d_state]`) after each: per value head, its
/// key head's k and q L2-normed (q over sqrt(d_state)), the state decayed by
/// `exp(A softplus(a + dt_bias))`, corrected by `k (v - S k) sigmoid(b)`, read through q.
/// Returns the output rows and, when `keep`, the state after each position; `round` as [`scan`]'s.
#[allow(clippy::too_many_arguments)]
pub(crate) fn delta_scan(state: &mut [f32], qkv: &[f32], bs: &[f32], as_: &[f32], m: usize, b: &SsmBlock, dt_bias: &[f32], a: &[f32], keep: bool, round: Option<fn(f32) -> f32>) -> (Vec<f32>, Vec<f32>) {
    let (nh, hd, ds, ng) = (b.n_head, b.head_dim(), b.d_state, b.n_group);
    let cd = b.conv_dim();
    let q_scale = 1.0 / (ds as f32).sqrt();
    each_head(state, m, b, keep, |h, g, t, st, y| {
        let row = &qkv[t * cd..(t + 1) * cd];
        let q: Vec<f32> = l2_normed(&row[g * ds..(g + 1) * ds]).iter().map(|x| x * q_scale).collect();
        let k = l2_normed(&row[(ng + g) * ds..(ng + g + 1) * ds]);
        let v = &row[2 * ng * ds + h * hd..2 * ng * ds + (h + 1) * hd];
        let beta = 1.0 / (1.0 + (-bs[t * nh + h]).exp());
        let decay = (a[h] * softplus(as_[t * nh + h] + dt_bias[h])).exp();
        for (p, vp) in v.iter().enumerate() {
            let srow = &mut st[p * ds..(p + 1) * ds];
            srow.iter_mut().for_each(|s| *s *= decay);
            let recalled: f32 = srow.iter().zip(&k).map(|(s, k)| s * k).sum();
            let delta = beta * (vp - recalled);
            let mut acc = 0.0f32;
            for n in 0..ds {
                srow[n] += k[n] * delta;
                if let Some(r) = round {
                    srow[n] = r(srow[n]);
                }
                acc += srow[n] * q[n];
            }
            y[p] = acc;
        }
    })
}

/// Each head's `width` values of `y` RMS-normed, times `w` (one head's scales), times `silu(z)`.
pub(crate) fn delta_norm(y: &[f32], z: &[f32], width: usize, w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = y.to_vec();
    out.par_chunks_mut(width).zip(z.par_chunks(width)).for_each(|(v, zg)| {
        let r = 1.0 / (v.iter().map(|a| a * a).sum::<f32>() / width as f32 + eps).sqrt();
        v.iter_mut().zip(w).zip(zg).for_each(|((a, s), g)| *a = *a * r * s * silu(*g));
    });
    out
}

/// `y * silu(z)`, RMS-normed over each group of `width / n_group` values, times `w`.
pub(crate) fn gated_norm(y: &[f32], z: &[f32], width: usize, n_group: usize, w: &[f32], eps: f32) -> Vec<f32> {
    let gs = width / n_group;
    let mut out: Vec<f32> = y.iter().zip(z).map(|(a, g)| a * silu(*g)).collect();
    out.par_chunks_mut(gs).enumerate().for_each(|(i, v)| {
        let mean = v.iter().map(|a| a * a).sum::<f32>() / gs as f32;
        let r = 1.0 / (mean + eps).sqrt();
        let wg = &w[(i * gs) % width..(i * gs) % width + gs];
        v.iter_mut().zip(wg).for_each(|(a, s)| *a = *a * r * s);
    });
    out
}
