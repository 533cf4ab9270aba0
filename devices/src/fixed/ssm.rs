//! `fixed`'s state-space kernels, in integers: the causal convolution over a Q16 history,
//! Mamba-2's selective scan and a gated DeltaNet's delta rule over a Q32 state, their gated
//! norms. Time steps, decays, the delta rule's normed keys and queries and its sigmoid(b) are
//! Q30 (softplus from the integer exp and an atanh series for ln(1 + v)); the state is kept in
//! Q32 so that its own rounding, repeated at every position, stays far under the Q16 rounding
//! of the taps the declared arithmetic names.

use super::kernels::*;
use oracle::spec::SsmBlock;
use rayon::prelude::*;

/// The state's fractional bits.
pub const STATE: u32 = 32;

/// ln(1 + v) for v in [0, 1] (Q30 in, Q30 out): 2 atanh(s) with s = v / (2 + v) <= 1/3, 14 terms
/// of its odd series (truncation under 3^-28, far below a Q30 step).
pub fn ln1p_q30(v: i64) -> i64 {
    let one = 1i128 << 30;
    let s = ((v as i128) << 30) / (2 * one + v as i128); // Q30, in [0, 1/3]
    let s2 = (s * s) >> 30;
    let (mut p, mut total) = (s, 0i128);
    for k in 0..14 {
        total += p / (2 * k + 1);
        p = (p * s2) >> 30;
    }
    (2 * total) as i64
}

/// softplus(x) = ln(1 + e^x) for `x` in Q16, in Q30: max(x, 0) + ln(1 + e^-|x|).
pub fn softplus_q30(x: i64) -> i64 {
    let e = exp_q30(-(x.unsigned_abs().min(1 << 40) as i64) << (30 - ACT));
    (x.max(0) << (30 - ACT)) + ln1p_q30(e)
}

/// The convolution of `x` (`m` rows of `c` Q16 channels, after `hist`, the `k - 1` rows before
/// them) with `w` (Q24, `[c][k]`) plus `bias` (Q16), rounded once to Q16, then SiLU; `hist` then
/// holds the last `k - 1` rows of inputs.
pub fn conv_silu_q(hist: &mut Vec<i64>, x: &[i64], m: usize, c: usize, w: &[i64], bias: &[i64], k: usize) -> Vec<i64> {
    let mut rows = std::mem::take(hist);
    if rows.len() < (k - 1) * c {
        rows = vec![0; (k - 1) * c];
    }
    rows.extend_from_slice(x);
    let mut out = vec![0i64; m * c];
    out.par_chunks_mut(c.max(1)).enumerate().for_each(|(t, o)| {
        let window = &rows[t * c..(t + k) * c];
        for (ch, oc) in o.iter_mut().enumerate() {
            let acc: i128 = ((bias[ch] as i128) << WGT) + (0..k).map(|j| w[ch * k + j] as i128 * window[j * c + ch] as i128).sum::<i128>();
            *oc = silu_q16(shr_round(acc, WGT));
        }
    });
    *hist = rows.split_off(rows.len() - (k - 1) * c);
    out
}

/// The per-head parameters of a Mamba-2 scan: the time steps' bias (Q16), A (Q24, negative)
/// and D (Q24).
pub struct ScanParams<'a> {
    pub dt_bias: &'a [i64],
    pub a: &'a [i64],
    pub d: &'a [i64],
}

/// Mamba-2's scan over `m` positions (`xbc` rows of `conv_dim` Q16 values, `dt` rows of `n_head`
/// Q16 raw time steps), updating `state` (`[n_head][head_dim][d_state]`, Q32) after each: per
/// head, step = softplus(dt + bias) and decay = exp(step * A) in Q30; each state value decay *
/// h + step * x * B, each product rounded once to Q32; the output C . h + D * x exact, rounded
/// once to Q16. Returns the outputs (`[m][d_inner]`) and the state after each position
/// (`[m][state_len]`, Q32).
pub fn scan_q(state: &mut [i64], xbc: &[i64], dt: &[i64], m: usize, b: &SsmBlock, p: &ScanParams) -> (Vec<i64>, Vec<i64>) {
    let (nh, hd, ds, ng) = (b.n_head, b.head_dim(), b.d_state, b.n_group);
    let cd = b.conv_dim();
    each_head(state, m, b, |h, g, t, st, y| {
        let row = &xbc[t * cd..(t + 1) * cd];
        let x = &row[h * hd..(h + 1) * hd];
        let bg = &row[b.d_inner + g * ds..b.d_inner + (g + 1) * ds];
        let cg = &row[b.d_inner + (ng + g) * ds..b.d_inner + (ng + g + 1) * ds];
        let step = softplus_q30(dt[t * nh + h] + p.dt_bias[h]) as i128; // Q30
        let decay = exp_q30(shr_round(step * p.a[h] as i128, WGT)) as i128; // Q30
        for (i, &xi) in x.iter().enumerate() {
            let sx = step * xi as i128; // Q46
            let srow = &mut st[i * ds..(i + 1) * ds];
            let mut acc = 0i128; // Q48
            for n in 0..ds {
                srow[n] = shr_round(decay * srow[n] as i128, 30) + shr_round(sx * bg[n] as i128, 30 + 2 * ACT - STATE);
                acc += srow[n] as i128 * cg[n] as i128;
            }
            acc += (p.d[h] as i128 * xi as i128) << (STATE - WGT);
            y[i] = shr_round(acc, STATE);
        }
    })
}

/// `step(h, g, t, state, y)` for every head `h` (in parallel; `g` its key head or group) and
/// position `t` in order, `state` the head's `[head_dim][d_state]`, `y` its outputs at `t`;
/// returns the outputs joined into position rows (`[m][d_inner]`) and the state after each
/// position (`[m][state_len]`).
fn each_head(state: &mut [i64], m: usize, b: &SsmBlock, step: impl Fn(usize, usize, usize, &mut [i64], &mut [i64]) + Sync) -> (Vec<i64>, Vec<i64>) {
    let (hd, ds) = (b.head_dim(), b.d_state);
    let per_group = (b.n_head / b.n_group).max(1);
    let heads: Vec<(Vec<i64>, Vec<i64>)> = state
        .par_chunks_mut((hd * ds).max(1))
        .enumerate()
        .map(|(h, st)| {
            let (mut y, mut kept) = (vec![0i64; m * hd], Vec::with_capacity(m * hd * ds));
            for (t, yt) in y.chunks_exact_mut(hd.max(1)).enumerate() {
                step(h, h / per_group, t, st, yt);
                kept.extend_from_slice(st);
            }
            (y, kept)
        })
        .collect();
    gather_heads(&heads, m, b)
}

/// Each head's output rows and states joined into position rows: `[m][d_inner]`, `[m][state_len]`.
fn gather_heads(heads: &[(Vec<i64>, Vec<i64>)], m: usize, b: &SsmBlock) -> (Vec<i64>, Vec<i64>) {
    let (hd, ds) = (b.head_dim(), b.d_state);
    let mut y = vec![0i64; m * b.d_inner];
    let mut states = vec![0i64; m * b.state_len()];
    for (h, (yh, kh)) in heads.iter().enumerate() {
        for t in 0..m {
            y[t * b.d_inner + h * hd..t * b.d_inner + (h + 1) * hd].copy_from_slice(&yh[t * hd..(t + 1) * hd]);
            let at = t * b.state_len() + h * hd * ds;
            states[at..at + hd * ds].copy_from_slice(&kh[t * hd * ds..(t + 1) * hd * ds]);
        }
    }
    (y, states)
}

/// sigmoid(x) for `x` in Q16, in Q30: 1 / (1 + e^-|x|) from [`exp_q30`], by symmetry below 0.
pub fn sigmoid_q30(x: i64) -> i64 {
    let one = 1i128 << 30;
    let e = exp_q30(-(x.unsigned_abs().min(1 << 40) as i64) << (30 - ACT)) as i128;
    let pos = ((one << 30) / (one + e)) as i64;
    if x >= 0 {
        pos
    } else {
        (1 << 30) - pos
    }
}

/// `v` (Q16) over sqrt(sum v^2 + 1e-6), times `scale` (Q30), in Q30: the sum exact in Q32, its
/// inverse square root in Q32 (as [`rms_norm_q`]'s), each value rounded once.
fn l2_normed_q30(v: &[i64], scale: i64) -> Vec<i64> {
    let ss: i128 = v.iter().map(|x| *x as i128 * *x as i128).sum::<i128>() + to_q(1e-6, 32) as i128; // Q32
    let inv = ((1u128 << 64) / isqrt((ss as u128) << 32).max(1)) as i128; // Q32
    v.iter().map(|x| shr_round(*x as i128 * inv * scale as i128, ACT + 32)).collect()
}

/// The gated delta rule over `m` positions (`qkv` rows of `conv_dim` Q16 values, `bs` and `as_`
/// rows of `n_head`), updating `state` (`[n_head][head_dim][d_state]`, Q32) after each: per
/// value head, its key head's k and q L2-normed (q over sqrt(d_state)) in Q30, the state decayed
/// by exp(A softplus(a + dt_bias)) (Q30), corrected by k (v - S k) sigmoid(b) (sigmoid in Q30),
/// read through q; each product rounded once to Q32, the output once to Q16. `p.d` is unused.
pub fn delta_scan_q(state: &mut [i64], qkv: &[i64], bs: &[i64], as_: &[i64], m: usize, b: &SsmBlock, p: &ScanParams) -> (Vec<i64>, Vec<i64>) {
    let (nh, hd, ds, ng) = (b.n_head, b.head_dim(), b.d_state, b.n_group);
    let cd = b.conv_dim();
    let q_scale = to_q(1.0 / (ds as f64).sqrt(), 30);
    each_head(state, m, b, |h, g, t, st, y| {
        let row = &qkv[t * cd..(t + 1) * cd];
        let q = l2_normed_q30(&row[g * ds..(g + 1) * ds], q_scale);
        let k = l2_normed_q30(&row[(ng + g) * ds..(ng + g + 1) * ds], 1 << 30);
        let v = &row[2 * ng * ds + h * hd..2 * ng * ds + (h + 1) * hd];
        let beta = sigmoid_q30(bs[t * nh + h]) as i128;
        let step = softplus_q30(as_[t * nh + h] + p.dt_bias[h]) as i128;
        let decay = exp_q30(shr_round(step * p.a[h] as i128, WGT)) as i128;
        for (i, &vi) in v.iter().enumerate() {
            let srow = &mut st[i * ds..(i + 1) * ds];
            srow.iter_mut().for_each(|s| *s = shr_round(decay * *s as i128, 30));
            let recalled = shr_round(srow.iter().zip(&k).map(|(s, k)| *s as i128 * *k as i128).sum(), 30); // Q32
            let delta = shr_round((((vi as i128) << (STATE - ACT)) - recalled as i128) * beta, 30) as i128; // Q32
            let mut acc = 0i128; // Q62
            for n in 0..ds {
                srow[n] += shr_round(k[n] as i128 * delta, 30);
                acc += srow[n] as i128 * q[n] as i128;
            }
            y[i] = shr_round(acc, STATE + 30 - ACT);
        }
    })
}

/// Each head's `width` values of `y` RMS-normed, times `w` (one head's scales, Q20), rounded to
/// Q16, times silu(z), rounded once more.
pub fn delta_norm_q(y: &[i64], z: &[i64], width: usize, w: &[i64], eps: f64) -> Vec<i64> {
    rms_norm_q(y, width, w, eps).iter().zip(z).map(|(a, g)| shr_round(*a as i128 * silu_q16(*g) as i128, ACT)).collect()
}

/// `y * silu(z)` rounded to Q16, RMS-normed over each group of `width / n_group` values, times
/// `w` (Q20, that group's part).
pub fn gated_norm_q(y: &[i64], z: &[i64], width: usize, n_group: usize, w: &[i64], eps: f64) -> Vec<i64> {
    let gs = (width / n_group.max(1)).max(1);
    let gated: Vec<i64> = y.iter().zip(z).map(|(a, g)| shr_round(*a as i128 * silu_q16(*g) as i128, ACT)).collect();
    gated.chunks(gs).enumerate().flat_map(|(i, v)| rms_norm_q(v, gs, &w[(i * gs) % width..(i * gs) % width + gs], eps)).collect()
}
