//! Grouped-query causal attention over a KV cache (MHA when n_kv = n_head, MQA when n_kv = 1),
//! with an optional sliding window. Scores, softmax and the weighted sum are all f64.

use crate::error::{OracleError, Result};
use crate::real::Real;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug)]
pub struct AttentionParams {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub scale: f64,
    /// Keys older than `window` positions are not seen (Mistral-style sliding window).
    pub window: Option<usize>,
}

/// `q: [m, n_head*hd]` for queries at `positions`; `k, v: [kv_len, n_kv*hd]` hold positions
/// `0..kv_len`. Query `t` attends to keys `j <= positions[t]` (and within the window).
/// Returns `[m, n_head*hd]`.
pub fn attention<T: Real>(q: &[T], positions: &[usize], k: &[T], v: &[T], kv_len: usize, p: &AttentionParams) -> Result<Vec<T>> {
    let (nh, nkv, hd) = (p.n_head, p.n_head_kv, p.head_dim);
    if nkv == 0 || nh % nkv != 0 {
        return Err(OracleError::Shape(format!("attention: {nh} query heads cannot share {nkv} kv heads")));
    }
    let m = positions.len();
    if q.len() != m * nh * hd || k.len() < kv_len * nkv * hd || v.len() < kv_len * nkv * hd {
        return Err(OracleError::Shape(format!(
            "attention: q has {} values (expected {m} x {nh} x {hd}), k/v {} / {} (need {kv_len} x {nkv} x {hd})",
            q.len(),
            k.len(),
            v.len()
        )));
    }
    if let Some(&bad) = positions.iter().find(|&&pos| pos >= kv_len) {
        return Err(OracleError::Shape(format!("attention: query position {bad} has no key in a cache of {kv_len}")));
    }
    let group = nh / nkv;
    let mut out = vec![T::default(); m * nh * hd];
    // One task per (token, head): independent outputs, each reduction stays on one thread.
    out.par_chunks_mut(hd).enumerate().for_each(|(th, o)| {
        let (t, h) = (th / nh, th % nh);
        let kvh = h / group;
        let pos = positions[t];
        let first = match p.window {
            Some(w) if w > 0 => (pos + 1).saturating_sub(w),
            _ => 0,
        };
        let qh = &q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
        // scores over keys first..=pos
        let scores: Vec<f64> = (first..=pos)
            .map(|j| T::dot(qh, &k[(j * nkv + kvh) * hd..(j * nkv + kvh + 1) * hd]) * p.scale)
            .collect();
        let probs = super::act::softmax_f64(&scores);
        let mut acc = vec![0.0f64; hd];
        for (pj, j) in probs.iter().zip(first..=pos) {
            let vj = &v[(j * nkv + kvh) * hd..(j * nkv + kvh + 1) * hd];
            for d in 0..hd {
                acc[d] += pj * vj[d].to_f64();
            }
        }
        for d in 0..hd {
            o[d] = T::from_f64(acc[d]);
        }
    });
    Ok(out)
}
