//! Gated DeltaNet's operators (Qwen3-Next's linear attention): the delta rule in its recurrent
//! form (one position after another, the state carried between them) and the norm-then-gate of
//! its output. The causal convolution before them is Mamba-2's (`ssm::ssm_conv`, without a
//! bias). Each accumulates in f64 in a fixed order and rounds once on store; the state is stored
//! in the storage scalar after every position.

use super::act::silu;
use super::check_len;
use super::ssm::{over_heads, softplus};
use crate::error::{OracleError, Result};
use crate::real::Real;
use crate::spec::SsmBlock;
use rayon::prelude::*;

/// The L2 norm's epsilon of q and k (the reference implementations': `x / sqrt(sum x^2 + 1e-6)`).
pub const L2_EPS: f64 = 1e-6;

/// The inputs of one call of the delta rule, positions in rows: `qkv` `[m, conv_dim]` (after the
/// convolution: every key head's q, then every key head's k, then every value head's v), `b` and
/// `a` `[m, n_head]` (one of each per value head), and the layer's per-head `dt_bias` and `a_log`
/// (negative: `-exp(A_log)`).
pub struct DeltaInputs<'a, T> {
    pub qkv: &'a [T],
    pub b: &'a [T],
    pub a: &'a [T],
    pub dt_bias: &'a [T],
    pub neg_a: &'a [T],
}

/// `v / sqrt(sum v^2 + L2_EPS)`, in f64.
fn l2_normed<T: Real>(v: &[T]) -> Vec<f64> {
    let r = 1.0 / (v.iter().map(|x| x.to_f64() * x.to_f64()).sum::<f64>() + L2_EPS).sqrt();
    v.iter().map(|x| x.to_f64() * r).collect()
}

/// The gated delta rule, recurrent form, over `m` positions: for each value head `h` (served by
/// key head `g = h / (n_head / n_group)`), with `k` and `q` L2-normed (q then divided by
/// `sqrt(d_state)`), `beta = sigmoid(b)` and decay `exp(-exp(A_log) softplus(a + dt_bias))`, and
/// every element `p` of the value head: `u = decay S[h,p,:]`, `delta = beta (v[p] - u . k)`,
/// `S[h,p,n] <- u[n] + k[n] delta` (stored after each position), then `y[p] = S[h,p,:] . q`
/// over the stored state. `state` (`[n_head, head_dim, d_state]`) is updated in place. Returns `y`
/// (`[m, d_inner]`) and, when `keep_states`, the state after each position (`[m, state_len]`).
pub fn delta_scan<T: Real>(state: &mut [T], inp: &DeltaInputs<'_, T>, m: usize, blk: &SsmBlock, keep_states: bool) -> Result<(Vec<T>, Vec<T>)> {
    let (nh, hd, ds, ng) = (blk.n_head, blk.head_dim(), blk.d_state, blk.n_group);
    let cd = blk.conv_dim();
    check_len("delta_scan state", state.len(), nh * hd, ds)?;
    check_len("delta_scan q/k/v", inp.qkv.len(), m, cd)?;
    check_len("delta_scan b", inp.b.len(), m, nh)?;
    check_len("delta_scan a", inp.a.len(), m, nh)?;
    for (what, v) in [("dt bias", inp.dt_bias), ("A", inp.neg_a)] {
        check_len(&format!("delta_scan {what}"), v.len(), 1, nh)?;
    }
    if ng == 0 || !nh.is_multiple_of(ng) {
        return Err(OracleError::Shape(format!("delta_scan: {nh} value heads over {ng} key heads")));
    }
    let q_scale = 1.0 / (ds as f64).sqrt();
    Ok(over_heads(state, m, blk, keep_states, |h, g, t, st, y| {
        let row = &inp.qkv[t * cd..(t + 1) * cd];
        let q: Vec<f64> = l2_normed(&row[g * ds..(g + 1) * ds]).into_iter().map(|x| x * q_scale).collect();
        let k = l2_normed(&row[(ng + g) * ds..(ng + g + 1) * ds]);
        let v = &row[2 * ng * ds + h * hd..][..hd];
        let beta = 1.0 / (1.0 + (-inp.b[t * nh + h].to_f64()).exp());
        let decay = (inp.neg_a[h].to_f64() * softplus(inp.a[t * nh + h].to_f64() + inp.dt_bias[h].to_f64())).exp();
        for p in 0..hd {
            let sp = &mut st[p * ds..(p + 1) * ds];
            let u: Vec<f64> = sp.iter().map(|s| decay * s.to_f64()).collect();
            let recalled: f64 = u.iter().zip(&k).map(|(u, k)| u * k).sum();
            let delta = beta * (v[p].to_f64() - recalled);
            let mut acc = 0.0f64;
            for n in 0..ds {
                let s = T::from_f64(u[n] + k[n] * delta);
                sp[n] = s;
                acc += s.to_f64() * q[n];
            }
            y[p] = T::from_f64(acc);
        }
    }))
}

/// Gated DeltaNet's output norm: each head's `width` values of `y` RMS-normed
/// (`y / sqrt(mean(y^2) + eps)`), scaled by `w` (one head's scales, shared by every head), then
/// multiplied by `silu(z)`, rounded once.
pub fn delta_gated_norm<T: Real>(y: &[T], z: &[T], width: usize, w: &[T], eps: f64) -> Result<Vec<T>> {
    if width == 0 || y.len() != z.len() || !y.len().is_multiple_of(width) || w.len() != width {
        return Err(OracleError::Shape(format!("delta_gated_norm: {} values and {} gates in heads of {width}, {} scales", y.len(), z.len(), w.len())));
    }
    let mut out = vec![T::default(); y.len()];
    out.par_chunks_mut(width).enumerate().for_each(|(ci, o)| {
        let base = ci * width;
        let ms = y[base..base + width].iter().map(|a| a.to_f64() * a.to_f64()).sum::<f64>() / width as f64;
        let r = 1.0 / (ms + eps).sqrt();
        for i in 0..width {
            o[i] = T::from_f64(y[base + i].to_f64() * r * w[i].to_f64() * silu(z[base + i].to_f64()));
        }
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::SsmKind;

    fn blk() -> SsmBlock {
        SsmBlock { d_inner: 4, d_state: 2, n_group: 1, n_head: 2, d_conv: 3, kind: SsmKind::GatedDelta }
    }

    /// One position by hand: from a zero state the delta rule writes `beta k v^T`, and the
    /// output reads it through the normed, scaled q.
    #[test]
    fn first_position_by_hand() {
        let b = blk();
        // q = (3, 4) -> (0.6, 0.8) / sqrt(2); k = (1, 0); v = (1, 2 | 3, 4).
        let qkv = [3.0f64, 4.0, 1.0, 0.0, 1.0, 2.0, 3.0, 4.0];
        let (bb, aa) = ([0.0f64, 0.0], [0.0f64, 0.0]);
        let (dtb, na) = ([0.0f64, 0.0], [-1.0f64, -1.0]);
        let mut state = vec![0.0f64; b.state_len()];
        let inp = DeltaInputs { qkv: &qkv, b: &bb, a: &aa, dt_bias: &dtb, neg_a: &na };
        let (y, states) = delta_scan(&mut state, &inp, 1, &b, true).unwrap();
        let qn = 0.6 / (1.0 + L2_EPS / 25.0).sqrt() / 2f64.sqrt();
        let kn = 1.0 / (1.0 + L2_EPS).sqrt();
        for (p, v) in [1.0, 2.0, 3.0, 4.0].into_iter().enumerate() {
            // S[p] = (kn * 0.5 * v, 0); y = S[p][0] * qn[0].
            assert!((y[p] - kn * 0.5 * v * qn).abs() < 1e-12, "{p}: {}", y[p]);
        }
        assert_eq!(states, state);
    }

    /// Feeding the positions one call at a time gives the bits of one call over all of them.
    #[test]
    fn split_calls_match_one_call() {
        let b = blk();
        let m = 5;
        let qkv: Vec<f64> = (0..m * b.conv_dim()).map(|i| ((i * 37 % 11) as f64 - 5.0) / 3.0).collect();
        let bb: Vec<f64> = (0..m * b.n_head).map(|i| (i as f64 - 4.0) / 2.0).collect();
        let aa: Vec<f64> = (0..m * b.n_head).map(|i| (i as f64 * 0.3).sin()).collect();
        let (dtb, na) = ([0.5f64, -0.5], [-2.0f64, -0.3]);
        let mut whole = vec![0.0f64; b.state_len()];
        let all = DeltaInputs { qkv: &qkv, b: &bb, a: &aa, dt_bias: &dtb, neg_a: &na };
        let (y_all, _) = delta_scan(&mut whole, &all, m, &b, false).unwrap();
        let mut st = vec![0.0f64; b.state_len()];
        let mut y = Vec::new();
        for t in 0..m {
            let one = DeltaInputs { qkv: &qkv[t * b.conv_dim()..(t + 1) * b.conv_dim()], b: &bb[t * 2..t * 2 + 2], a: &aa[t * 2..t * 2 + 2], dt_bias: &dtb, neg_a: &na };
            y.extend(delta_scan(&mut st, &one, 1, &b, false).unwrap().0);
        }
        assert_eq!(y, y_all);
        assert_eq!(st, whole);
    }

    #[test]
    fn norm_then_gate() {
        let out = delta_gated_norm(&[3.0f64, 4.0], &[0.0, 50.0], 2, &[1.0, 2.0], 0.0).unwrap();
        let r = 1.0 / (12.5f64).sqrt();
        assert_eq!(out[0], 0.0);
        assert!((out[1] - 4.0 * r * 2.0 * silu(50.0)).abs() < 1e-12);
        assert!(delta_gated_norm(&[1.0f64; 3], &[1.0; 3], 2, &[1.0, 1.0], 0.0).is_err());
    }
}
