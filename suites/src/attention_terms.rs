//! How much an attention output moves when its scores, keys, values and weights carry the
//! roundings a declared arithmetic puts into them, measured on the op's own inputs.
//!
//! Layer-diff's dims-only budget of `attn_kqv` ([`crate::layerdiff::local_budget`]) treats a
//! score's rounding as relative to the output. It is not: a score is a dot product, each of its
//! terms `q_i k_i` carries a relative rounding (a key held in an f16 cache, a query rounded before
//! its product with them, the accumulation), so the score's *absolute* error grows with the size
//! of its terms — and the softmax turns an absolute score error into a relative error of the
//! weight. Real checkpoints have large terms where the test models have unit ones: Qwen2's
//! key biases put a common offset of tens into every score, a sink token draws scores far above
//! the rest, a massive activation makes one key huge. There the dims model's budget was below
//! what the declared arithmetic itself produces (an emulated llama.cpp with an f16 cache erred
//! by 2.69% where `attn_kqv` allowed 1.76%).
//!
//! The model here is first order and statistical, as the rest of the budgets: independent
//! roundings, each of at most its unit size, their variances summed. For one query `t` of one head,
//! with weights `p_j = softmax(s)_j` and output `o = Σ_j p_j v_j`:
//! - a score error `δs_j` moves the output by `Σ_j p_j δs_j (v_j - o)`; `δs_j` has variance
//!   `scale² Σ_i (q_i δk_ji)² + (δq_i k_ji)² + (ρ_acc q_i k_ji)²`, with `δk` the key's
//!   rounding (relative to the key for a float cache, to its block's RMS for a block format),
//!   `δq` the query's, `ρ_acc = u_acc·√head_dim` the accumulation's;
//! - a value's rounding `δv_jc` adds `Σ_j p_j δv_jc`;
//! - a weight rounded to a 16-bit format, `p_j (1 + ε_j)`, adds `Σ_j p_j ε_j v_j`.
//!
//! [`sensitivity`] returns the RMS over every output of the standard deviation this predicts,
//! which layer-diff multiplies by its statistical factor `C_STAT`.

use devices::{Arithmetic, KvFormat, NumFormat};
use oracle::ops::AttentionParams;
use rayon::prelude::*;

/// One side's rounding: its unit size and, for a block format, the block it is relative to.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Rounding {
    pub unit: f64,
    /// Values per block whose RMS the rounding is relative to; None: relative to each value.
    pub block: Option<usize>,
}

impl Rounding {
    fn of_format(f: KvFormat) -> Rounding {
        Rounding { unit: f.rel_rounding(), block: f.block() }
    }
    /// Q8_0 blocks of 32: half a step of max/127, relative to the block's largest value.
    fn q8_query() -> Rounding {
        Rounding { unit: KvFormat::Q8_0.rel_rounding(), block: Some(32) }
    }
    /// The squared size of each value's rounding error, for the values `x` of one head.
    fn squared_errors(&self, x: &[f32]) -> Vec<f64> {
        match self.block {
            _ if self.unit == 0.0 => vec![0.0; x.len()],
            None => x.iter().map(|v| (self.unit * *v as f64).powi(2)).collect(),
            Some(b) => x
                .chunks(b.max(1))
                .flat_map(|blk| {
                    let ms = blk.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / blk.len() as f64;
                    std::iter::repeat_n(self.unit * self.unit * ms, blk.len())
                })
                .collect(),
        }
    }
}

/// The roundings a declared float arithmetic puts into attention, as its emulation
/// ([`crate::emulate::EmulatedArithmetic`]) applies them: keys and values rounded to the
/// cache's formats (where coarser than the storage format), the query rounded to a 16-bit
/// cache's format (multiplied in that type, `activation_half_rounding`) or to Q8_0 blocks before a
/// block-quantized cache's keys, the weights to a 16-bit value cache's format, and the score's
/// accumulation. None for fixed-point arithmetic, whose scores and weights sit on an absolute
/// grid that the dims model budgets as it is.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Roundings {
    pub key: Rounding,
    pub query: Rounding,
    pub value: Rounding,
    /// A weight's relative rounding.
    pub weight: f64,
    /// The score's accumulation, relative to each term (`u_acc·√head_dim`).
    pub accumulation: f64,
}

impl Roundings {
    pub fn of(a: &Arithmetic, head_dim: usize) -> Option<Roundings> {
        if a.fixed.is_some() {
            return None;
        }
        let storage = a.storage.unit_roundoff();
        let coarser = |f: Option<KvFormat>| f.filter(|f| f.rel_rounding() > storage);
        let kv = a.kv_types();
        let (k, v) = (coarser(kv.k), coarser(kv.v));
        let half = |f: Option<KvFormat>| f.and_then(KvFormat::float).filter(|_| a.activation_half_rounding);
        let query = match k.and_then(KvFormat::block) {
            Some(_) => Rounding::q8_query(),
            None => half(k).map_or(Rounding::default(), |f| Rounding { unit: f.unit_roundoff(), block: None }),
        };
        // Values in a 16-bit storage format are rounded there like any value.
        let storage_rounding = Rounding { unit: if matches!(a.storage, NumFormat::F16 | NumFormat::BF16) { storage } else { 0.0 }, block: None };
        Some(Roundings {
            key: k.map_or(storage_rounding, Rounding::of_format),
            query: if query.unit > 0.0 { query } else { storage_rounding },
            value: v.map_or(storage_rounding, Rounding::of_format),
            weight: half(v).map_or(0.0, NumFormat::unit_roundoff).max(storage_rounding.unit),
            accumulation: a.accumulate.unit_roundoff() * (head_dim as f64).sqrt(),
        })
    }
}

/// The RMS, over every output of every query and head, of the standard deviation of the
/// attention output's error under roundings `r` (the module's model), for queries `q: [n, n_head·hd]`
/// at positions `0..n` over keys and values `k, v: [n, n_kv·hd]` (causal, within `p.window`).
/// Each (query, head) is summed on its own in a fixed order and the sums added in order, so the
/// result has the same bits for any thread count. None when the shapes do not fit.
pub fn sensitivity(q: &[f32], k: &[f32], v: &[f32], n: usize, p: &AttentionParams, r: &Roundings) -> Option<f64> {
    let (nh, nkv, hd) = (p.n_head, p.n_head_kv, p.head_dim);
    if n == 0 || nkv == 0 || hd == 0 || !nh.is_multiple_of(nkv) || q.len() != n * nh * hd || k.len() != n * nkv * hd || v.len() != n * nkv * hd {
        return None;
    }
    let group = nh / nkv;
    // Each cached row's rounding errors, squared, per head: keys, values.
    let per_row = |x: &[f32], rounding: &Rounding| -> Vec<f64> { x.chunks(hd).flat_map(|h| rounding.squared_errors(h)).collect() };
    let (dk2, dv2) = (per_row(k, &r.key), per_row(v, &r.value));
    let dq2 = per_row(q, &r.query);
    let variances: Vec<f64> = (0..n * nh)
        .into_par_iter()
        .map(|th| {
            let (t, h) = (th / nh, th % nh);
            let kvh = h / group;
            let first = match p.window {
                Some(w) if w > 0 => (t + 1).saturating_sub(w),
                _ => 0,
            };
            let qh = &q[th * hd..(th + 1) * hd];
            let dqh = &dq2[th * hd..(th + 1) * hd];
            let row = |j: usize| (j * nkv + kvh) * hd..(j * nkv + kvh + 1) * hd;
            let mut scores = Vec::with_capacity(t + 1 - first);
            let mut score_var = Vec::with_capacity(t + 1 - first);
            for j in first..=t {
                let (kj, dkj) = (&k[row(j)], &dk2[row(j)]);
                let (mut s, mut var) = (0.0f64, 0.0f64);
                for i in 0..hd {
                    let (qi, ki) = (qh[i] as f64, kj[i] as f64);
                    s += qi * ki;
                    var += qi * qi * dkj[i] + dqh[i] * ki * ki + (r.accumulation * qi * ki).powi(2);
                }
                scores.push(s * p.scale);
                score_var.push(var * p.scale * p.scale);
            }
            let probs = oracle::ops::act::softmax_f64(&scores);
            let mut o = vec![0.0f64; hd];
            for (pj, j) in probs.iter().zip(first..=t) {
                for (oc, vc) in o.iter_mut().zip(&v[row(j)]) {
                    *oc += pj * *vc as f64;
                }
            }
            let mut var = 0.0;
            for ((pj, sv), j) in probs.iter().zip(&score_var).zip(first..=t) {
                let (vj, dvj) = (&v[row(j)], &dv2[row(j)]);
                for c in 0..hd {
                    let vc = vj[c] as f64;
                    var += pj * pj * (sv * (vc - o[c]).powi(2) + dvj[c] + (r.weight * vc).powi(2));
                }
            }
            var
        })
        .collect();
    let mean = variances.iter().sum::<f64>() / (n * nh * hd) as f64;
    mean.is_finite().then(|| mean.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(n_head: usize, n_head_kv: usize, head_dim: usize) -> AttentionParams<'static> {
        AttentionParams { n_head, n_head_kv, head_dim, scale: 1.0 / (head_dim as f64).sqrt(), window: None, sinks: None, softcap: None }
    }

    /// The prediction matches what rounding the keys by a random relative error of the declared
    /// size does to the exact output, measured over many draws, and grows with a common offset
    /// of the keys (a key bias) that leaves the exact output unchanged.
    #[test]
    fn predicts_the_spread_of_a_key_rounding_and_grows_with_a_key_offset() {
        let (n, hd) = (12, 16);
        let p = params(2, 1, hd);
        let mut rng = oracle::ops::SplitMix64(7);
        let q: Vec<f32> = (0..n * 2 * hd).map(|_| rng.next_normal() as f32).collect();
        let v: Vec<f32> = (0..n * hd).map(|_| rng.next_normal() as f32).collect();
        let u = 1e-3;
        let r = Roundings { key: Rounding { unit: u, block: None }, ..Default::default() };
        for offset in [0.0f32, 20.0] {
            let k: Vec<f32> = (0..n * hd).map(|i| rng.next_normal() as f32 + if i % hd == 0 { offset } else { 0.0 }).collect();
            let predicted = sensitivity(&q, &k, &v, n, &p, &r).unwrap();
            let exact = oracle::ops::attention(&q, &(0..n).collect::<Vec<_>>(), &k, &v, n, &p).unwrap();
            let (mut sq, mut count) = (0.0, 0);
            for _ in 0..200 {
                // Uniform in [-u√3, u√3]: a relative error of standard deviation u.
                let kr: Vec<f32> = k.iter().map(|x| (*x as f64 * (1.0 + u * 3f64.sqrt() * (2.0 * rng.next_f64() - 1.0))) as f32).collect();
                let out = oracle::ops::attention(&q, &(0..n).collect::<Vec<_>>(), &kr, &v, n, &p).unwrap();
                sq += out.iter().zip(&exact).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum::<f64>();
                count += out.len();
            }
            let measured = (sq / count as f64).sqrt();
            let ratio = measured / predicted;
            assert!((0.7..1.3).contains(&ratio), "offset {offset}: measured {measured:e}, predicted {predicted:e}");
            if offset > 0.0 {
                let r0 = sensitivity(&q, &k.iter().enumerate().map(|(i, x)| if i % hd == 0 { x - offset } else { *x }).collect::<Vec<_>>(), &v, n, &p, &r).unwrap();
                assert!(predicted > 3.0 * r0, "a key offset of {offset} should raise the prediction: {predicted:e} vs {r0:e}");
            }
        }
    }

    #[test]
    fn shapes_that_do_not_fit_give_none_and_an_exact_arithmetic_gives_zero() {
        let p = params(2, 1, 4);
        assert_eq!(sensitivity(&[0.0; 8], &[0.0; 4], &[0.0; 4], 1, &p, &Roundings::default()), Some(0.0));
        assert_eq!(sensitivity(&[0.0; 7], &[0.0; 4], &[0.0; 4], 1, &p, &Roundings::default()), None);
        assert_eq!(sensitivity(&[0.0; 8], &[0.0; 4], &[0.0; 4], 1, &params(3, 2, 4), &Roundings::default()), None);
    }
}
