//! The `cpu` device's Mamba-2 kernels, in f32 as an f32 engine computes them: the causal
//! convolution over a history the cache keeps, the selective scan one position at a time over a
//! state the cache keeps, and the gated RMSNorm per group.

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
    let per_group = nh / ng;
    let heads: Vec<(Vec<f32>, Vec<f32>)> = state
        .par_chunks_mut(hd * ds)
        .enumerate()
        .map(|(h, st)| {
            let g = h / per_group;
            let (mut y, mut kept) = (Vec::with_capacity(m * hd), Vec::new());
            for t in 0..m {
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
                    y.push(acc + d[h] * xp);
                }
                if keep {
                    kept.extend_from_slice(st);
                }
            }
            (y, kept)
        })
        .collect();
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
