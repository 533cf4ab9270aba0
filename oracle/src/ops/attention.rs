//! Grouped-query causal attention over a KV cache (MHA when n_kv = n_head, MQA when n_kv = 1),
//! with an optional sliding window. Scores, softmax and the weighted sum are all f64.

use crate::error::{OracleError, Result};
use crate::real::Real;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug)]
pub struct AttentionParams<'a> {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub scale: f64,
    /// Keys older than `window` positions are not seen (Mistral-style sliding window).
    pub window: Option<usize>,
    /// One logit per query head (`[n_head]`, GPT-OSS's attention sinks) that joins the head's
    /// softmax after the scaled scores and takes its share of the weight to no value.
    pub sinks: Option<&'a [f64]>,
    /// Gemma 2's soft-cap of the scaled scores: `c * tanh(s / c)`.
    pub softcap: Option<f64>,
}

/// A rule that turns one query head's scaled scores (over the keys it sees, in order, then its
/// sink logit where the model has sinks) into its
/// attention weights, one per score, in place of the softmax: the emulation of a fixed-point
/// arithmetic computes them on its grid. Pure, and run on worker threads.
pub type AttentionWeights = dyn Fn(&[f64]) -> Vec<f64> + Send + Sync;

/// `q: [m, n_head*hd]` for queries at `positions`; `k, v: [kv_len, n_kv*hd]` hold positions
/// `0..kv_len`. Query `t` attends to keys `j <= positions[t]` (and within the window).
/// Returns `[m, n_head*hd]`.
pub fn attention<T: Real>(q: &[T], positions: &[usize], k: &[T], v: &[T], kv_len: usize, p: &AttentionParams) -> Result<Vec<T>> {
    attention_with(q, positions, k, v, kv_len, p, None)
}

/// [`attention`], with the weights from `weights` instead of the softmax where given (a rule
/// that returns another number of weights than scores is an error).
pub fn attention_with<T: Real>(q: &[T], positions: &[usize], k: &[T], v: &[T], kv_len: usize, p: &AttentionParams, weights: Option<&AttentionWeights>) -> Result<Vec<T>> {
    attention_values(q, positions, k, v, kv_len, p, weights, p.head_dim)
}

/// [`attention_with`] over values `vd` wide a head (`v: [kv_len, n_kv*vd]`; latent attention's
/// values are narrower than its keys). Returns `[m, n_head*vd]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_values<T: Real>(q: &[T], positions: &[usize], k: &[T], v: &[T], kv_len: usize, p: &AttentionParams, weights: Option<&AttentionWeights>, vd: usize) -> Result<Vec<T>> {
    let (nh, nkv, hd) = (p.n_head, p.n_head_kv, p.head_dim);
    if nkv == 0 || nh % nkv != 0 {
        return Err(OracleError::Shape(format!("attention: {nh} query heads cannot share {nkv} kv heads")));
    }
    let m = positions.len();
    if q.len() != m * nh * hd || k.len() < kv_len * nkv * hd || v.len() < kv_len * nkv * vd {
        return Err(OracleError::Shape(format!(
            "attention: q has {} values (expected {m} x {nh} x {hd}), k/v {} / {} (need {kv_len} x {nkv} x {hd} / {vd})",
            q.len(),
            k.len(),
            v.len()
        )));
    }
    if let Some(s) = p.sinks.filter(|s| s.len() != nh) {
        return Err(OracleError::Shape(format!("attention: {} sink logits for {nh} query heads", s.len())));
    }
    if let Some(&bad) = positions.iter().find(|&&pos| pos >= kv_len) {
        return Err(OracleError::Shape(format!("attention: query position {bad} has no key in a cache of {kv_len}")));
    }
    let group = nh / nkv;
    let mut out = vec![T::default(); m * nh * vd];
    let bad_rule = std::sync::atomic::AtomicBool::new(false);
    // One task per (token, head): independent outputs, each reduction stays on one thread.
    out.par_chunks_mut(vd.max(1)).enumerate().for_each(|(th, o)| {
        let (t, h) = (th / nh, th % nh);
        let kvh = h / group;
        let pos = positions[t];
        let first = match p.window {
            Some(w) if w > 0 => (pos + 1).saturating_sub(w),
            _ => 0,
        };
        let qh = &q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
        // scores over keys first..=pos
        let mut scores: Vec<f64> = (first..=pos)
            .map(|j| T::dot(qh, &k[(j * nkv + kvh) * hd..(j * nkv + kvh + 1) * hd]) * p.scale)
            .map(|s| p.softcap.map_or(s, |c| c * (s / c).tanh()))
            .collect();
        let n_keys = scores.len();
        // A sink is one more logit in the softmax; its weight goes to no value.
        if let Some(s) = p.sinks {
            scores.push(s[h]);
        }
        let probs = match weights {
            Some(rule) => rule(&scores),
            None => super::act::softmax_f64(&scores),
        };
        if probs.len() != scores.len() {
            bad_rule.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let probs = &probs[..n_keys.min(probs.len())];
        let mut acc = vec![0.0f64; vd];
        for (pj, j) in probs.iter().zip(first..=pos) {
            let vj = &v[(j * nkv + kvh) * vd..(j * nkv + kvh + 1) * vd];
            for d in 0..vd {
                acc[d] += pj * vj[d].to_f64();
            }
        }
        for d in 0..vd {
            o[d] = T::from_f64(acc[d]);
        }
    });
    if bad_rule.into_inner() {
        return Err(OracleError::Shape("attention: the weights rule returned another number of weights than scores".into()));
    }
    Ok(out)
}
