//! Mamba-2's state-space operators: the causal depthwise convolution, the selective scan in its
//! recurrent form (one position after another, the state carried between them), and the gated
//! RMSNorm per group. Each accumulates in f64 in a fixed order and rounds once on store; the
//! state is stored in the storage scalar after every position, as the convolution's history is.

use super::act::silu;
use super::check_len;
use crate::error::{OracleError, Result};
use crate::real::Real;
use crate::spec::SsmBlock;
use rayon::prelude::*;

/// PyTorch's softplus (beta 1, threshold 20): `ln(1 + e^v)`, `v` itself above 20.
pub fn softplus(v: f64) -> f64 {
    if v > 20.0 {
        v
    } else {
        v.exp().ln_1p()
    }
}

/// The causal depthwise convolution of `x` (`[m, c]`, the positions after the `d_conv - 1`
/// rows of `hist`, `[d_conv - 1, c]`, the inputs before them, zeros at the start), then SiLU:
/// `out[t, i] = silu(b[i] + sum_k w[i, k] in[t + k, i])` over the rows of `hist` then `x`, `w`
/// `[c, d_conv]` (tap `k` multiplies the input `d_conv - 1 - k` positions back). Returns `[m, c]`.
pub fn ssm_conv<T: Real>(hist: &[T], x: &[T], m: usize, c: usize, w: &[T], b: &[T], d_conv: usize) -> Result<Vec<T>> {
    if d_conv == 0 {
        return Err(OracleError::Shape("ssm_conv: a kernel of width 0".into()));
    }
    check_len("ssm_conv history", hist.len(), d_conv - 1, c)?;
    check_len("ssm_conv input", x.len(), m, c)?;
    check_len("ssm_conv kernel", w.len(), c, d_conv)?;
    check_len("ssm_conv bias", b.len(), 1, c)?;
    let row = |r: usize| if r < d_conv - 1 { &hist[r * c..(r + 1) * c] } else { &x[(r - (d_conv - 1)) * c..(r + 2 - d_conv) * c] };
    let mut out = vec![T::default(); m * c];
    out.par_chunks_mut(c.max(1)).enumerate().for_each(|(t, o)| {
        for (i, oi) in o.iter_mut().enumerate() {
            let mut acc = b[i].to_f64();
            for k in 0..d_conv {
                acc += w[i * d_conv + k].to_f64() * row(t + k)[i].to_f64();
            }
            *oi = T::from_f64(silu(acc));
        }
    });
    Ok(out)
}

/// The inputs of one call of the selective scan, positions in rows: `xbc` `[m, conv_dim]` (x,
/// then B and C, each group's `d_state` values), `dt` `[m, n_head]` (the time steps before their
/// bias and softplus), and the layer's per-head `dt_bias`, `a` (negative: `-exp(A_log)`) and `d`.
pub struct ScanInputs<'a, T> {
    pub xbc: &'a [T],
    pub dt: &'a [T],
    pub dt_bias: &'a [T],
    pub a: &'a [T],
    pub d: &'a [T],
}

/// The selective scan, recurrent form, over `m` positions: for each head `h` (group
/// `g = h / (n_head / n_group)`), time step `dt = softplus(dt + dt_bias)`, and every
/// element `p` of the head and `n` of the state,
/// `S[h,p,n] <- exp(dt a) S[h,p,n] + dt x[p] B[g,n]` (stored after each position), then
/// `y[p] = sum_n S[h,p,n] C[g,n] + d x[p]` over the stored state. `state` (`[n_head, head_dim,
/// d_state]`) is updated in place. Returns `y` (`[m, d_inner]`) and, when `keep_states`, the
/// state after each position (`[m, state_len]`).
pub fn ssm_scan<T: Real>(state: &mut [T], inp: &ScanInputs<'_, T>, m: usize, blk: &SsmBlock, keep_states: bool) -> Result<(Vec<T>, Vec<T>)> {
    let (nh, hd, ds, ng) = (blk.n_head, blk.head_dim(), blk.d_state, blk.n_group);
    let cd = blk.conv_dim();
    check_len("ssm_scan state", state.len(), nh * hd, ds)?;
    check_len("ssm_scan x/B/C", inp.xbc.len(), m, cd)?;
    check_len("ssm_scan time steps", inp.dt.len(), m, nh)?;
    for (what, v) in [("dt bias", inp.dt_bias), ("A", inp.a), ("D", inp.d)] {
        check_len(&format!("ssm_scan {what}"), v.len(), 1, nh)?;
    }
    Ok(over_heads(state, m, blk, keep_states, |h, g, t, st, y| {
        let row = &inp.xbc[t * cd..(t + 1) * cd];
        let (x, b, c) = (&row[h * hd..(h + 1) * hd], &row[blk.d_inner + g * ds..][..ds], &row[blk.d_inner + (ng + g) * ds..][..ds]);
        let dt = softplus(inp.dt[t * nh + h].to_f64() + inp.dt_bias[h].to_f64());
        let decay = (dt * inp.a[h].to_f64()).exp();
        for p in 0..hd {
            let xp = x[p].to_f64();
            let sp = &mut st[p * ds..(p + 1) * ds];
            let mut acc = 0.0f64;
            for n in 0..ds {
                let s = T::from_f64(decay * sp[n].to_f64() + dt * xp * b[n].to_f64());
                sp[n] = s;
                acc += s.to_f64() * c[n].to_f64();
            }
            y[p] = T::from_f64(acc + inp.d[h].to_f64() * xp);
        }
    }))
}

/// Runs `step(h, g, t, state, y)` for every head `h` (in parallel; `g` its group, `n_head /
/// n_group` heads each) and position `t` in order, `state` the head's `[head_dim, d_state]`
/// and `y` its `head_dim` outputs at `t`; returns the outputs as rows (`[m, d_inner]`) and, when
/// `keep_states`, the whole state after each position (`[m, state_len]`).
pub(crate) fn over_heads<T: Real>(state: &mut [T], m: usize, blk: &SsmBlock, keep_states: bool, step: impl Fn(usize, usize, usize, &mut [T], &mut [T]) + Sync) -> (Vec<T>, Vec<T>) {
    let (hd, ds) = (blk.head_dim(), blk.d_state);
    let heads_per_group = blk.n_head / blk.n_group.max(1);
    let per_head: Vec<(Vec<T>, Vec<T>)> = state
        .par_chunks_mut((hd * ds).max(1))
        .enumerate()
        .map(|(h, st)| {
            let mut y = vec![T::default(); m * hd];
            let mut states = Vec::with_capacity(if keep_states { m * hd * ds } else { 0 });
            for (t, yt) in y.chunks_exact_mut(hd.max(1)).enumerate() {
                step(h, h / heads_per_group.max(1), t, st, yt);
                if keep_states {
                    states.extend_from_slice(st);
                }
            }
            (y, states)
        })
        .collect();
    let mut y = vec![T::default(); m * blk.d_inner];
    let mut states = vec![T::default(); if keep_states { m * blk.state_len() } else { 0 }];
    for (h, (yh, sh)) in per_head.iter().enumerate() {
        for t in 0..m {
            y[t * blk.d_inner + h * hd..][..hd].copy_from_slice(&yh[t * hd..(t + 1) * hd]);
            if keep_states {
                states[t * blk.state_len() + h * hd * ds..][..hd * ds].copy_from_slice(&sh[t * hd * ds..(t + 1) * hd * ds]);
            }
        }
    }
    (y, states)
}

/// Mamba-2's gated norm: `v = y silu(z)`, then each group of `y`'s `width / n_group` values
/// RMS-normed (`v / sqrt(mean(v^2) + eps)`) and scaled by `w`, rounded once. Rows of `width`.
pub fn ssm_gated_norm<T: Real>(y: &[T], z: &[T], width: usize, n_group: usize, w: &[T], eps: f64) -> Result<Vec<T>> {
    if width == 0 || n_group == 0 || !width.is_multiple_of(n_group) || y.len() != z.len() || !y.len().is_multiple_of(width) || w.len() != width {
        return Err(OracleError::Shape(format!("ssm_gated_norm: {} values and {} gates in rows of {width}, {n_group} groups, {} scales", y.len(), z.len(), w.len())));
    }
    let gs = width / n_group;
    let mut out = vec![T::default(); y.len()];
    out.par_chunks_mut(gs).enumerate().for_each(|(ci, o)| {
        let base = ci * gs;
        let v: Vec<f64> = (0..gs).map(|i| y[base + i].to_f64() * silu(z[base + i].to_f64())).collect();
        let ms = v.iter().map(|a| a * a).sum::<f64>() / gs as f64;
        let r = 1.0 / (ms + eps).sqrt();
        let wi = &w[(base % width)..][..gs];
        for i in 0..gs {
            o[i] = T::from_f64(v[i] * r * wi[i].to_f64());
        }
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blk() -> SsmBlock {
        SsmBlock { d_inner: 4, d_state: 2, n_group: 1, n_head: 2, d_conv: 3, kind: Default::default() }
    }

    /// Feeding the positions one call at a time gives the bits of one call over all of them: the
    /// convolution's history and the scan's state carry exactly what the next call needs.
    #[test]
    fn one_call_or_one_position_at_a_time_gives_the_same_bits() {
        let b = blk();
        let (cd, nh, m) = (b.conv_dim(), b.n_head, 5);
        let f = |i: usize| ((i * 37 % 17) as f64 / 8.0 - 1.0) as f32;
        let x: Vec<f32> = (0..m * cd).map(f).collect();
        let dt: Vec<f32> = (0..m * nh).map(|i| f(i + 3)).collect();
        let w: Vec<f32> = (0..cd * b.d_conv).map(|i| f(i + 5)).collect();
        let bias: Vec<f32> = (0..cd).map(|i| f(i + 7) / 4.0).collect();
        let (dtb, a, d) = (vec![0.5f32; nh], vec![-1.0f32, -2.0], vec![1.0f32; nh]);
        let hist0 = vec![0.0f32; (b.d_conv - 1) * cd];
        let conv = ssm_conv(&hist0, &x, m, cd, &w, &bias, b.d_conv).unwrap();
        let mut s = vec![0.0f32; b.state_len()];
        let (y, _) = ssm_scan(&mut s, &ScanInputs { xbc: &conv, dt: &dt, dt_bias: &dtb, a: &a, d: &d }, m, &b, false).unwrap();
        let (mut hist, mut s1, mut ys, mut convs) = (hist0.clone(), vec![0.0f32; b.state_len()], Vec::new(), Vec::new());
        for t in 0..m {
            let xt = &x[t * cd..(t + 1) * cd];
            let c = ssm_conv(&hist, xt, 1, cd, &w, &bias, b.d_conv).unwrap();
            hist.drain(..cd);
            hist.extend_from_slice(xt);
            let (yt, _) = ssm_scan(&mut s1, &ScanInputs { xbc: &c, dt: &dt[t * nh..(t + 1) * nh], dt_bias: &dtb, a: &a, d: &d }, 1, &b, false).unwrap();
            convs.extend(c);
            ys.extend(yt);
        }
        assert_eq!(conv, convs);
        assert_eq!(y, ys);
        assert_eq!(s, s1);
    }

    /// The first position's output by hand: a state starting at zero takes `dt x B`, and the
    /// output reads it through C, plus `D x`.
    #[test]
    fn first_position_by_hand() {
        let b = SsmBlock { d_inner: 1, d_state: 1, n_group: 1, n_head: 1, d_conv: 1, kind: Default::default() };
        let xbc = [2.0f64, 3.0, 0.5]; // x, B, C
        let mut s = [0.0f64];
        let (y, st) = ssm_scan(&mut s, &ScanInputs { xbc: &xbc, dt: &[0.0], dt_bias: &[0.0], a: &[-1.0], d: &[0.25] }, 1, &b, true).unwrap();
        let dt = 2f64.ln(); // softplus(0)
        assert!((st[0] - dt * 2.0 * 3.0).abs() < 1e-15);
        assert!((y[0] - (dt * 6.0 * 0.5 + 0.5)).abs() < 1e-15);
        // The convolution reads the newest input with the last tap.
        let c = ssm_conv(&[1.0f64, 2.0], &[4.0], 1, 1, &[1.0, 10.0, 100.0], &[0.0], 3).unwrap();
        assert!((c[0] - silu(1.0 + 20.0 + 400.0)).abs() < 1e-12);
    }
}
