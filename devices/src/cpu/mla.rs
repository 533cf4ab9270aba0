//! The cpu device's latent attention (DeepSeek MLA), in the absorbed form llama.cpp and other
//! engines run: keys and values are never expanded. Each head's unrotated query is taken into
//! the latent's space through its key rows of the expansion, scored against the cached latents
//! (plus its rotated part against the shared rotated keys), and the weighted sum of latents is
//! taken out through its value rows. The oracle runs the materialized form; the two are the
//! same sum in another order, so a gate that passes judges the absorption itself.

use crate::shared::qdot::dot_f32;
use oracle::spec::MlaBlock;
use rayon::prelude::*;

/// An error of a latent-attention engine to seed (sensitivity tests; `devices::faulty`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(not(feature = "faults"), allow(dead_code))]
pub(crate) enum MlaFault {
    #[default]
    None,
    /// The absorbed form's score scale taken from the cached row's width (`kv_lora_rank +
    /// qk_rope`, what it dots the query with) instead of the query head's.
    ScaleOfCachedRow,
    /// RoPE applied to the first `qk_rope` values of each query head (its unrotated part)
    /// instead of the last.
    RopeOnUnrotated,
}

/// Each query (`q: [m, n_head * qk_head_dim]`, rotated, at positions `pos`) attending to the
/// cached latents (`[kv_len, kv_lora_rank]`) and shared rotated keys (`[kv_len, qk_rope]`) of
/// positions `0..=pos`, through the expansion's key rows (`k_b: [n_head][qk_nope][kv_lora_rank]`)
/// and value rows (`v_b: [n_head][v_head_dim][kv_lora_rank]`): `[m, n_head * v_head_dim]`. f32
/// throughout, one task per (row, head). Refused when a length does not fit.
pub(crate) fn attend_absorbed(q: &[f32], pos: &[usize], (latent, k_pe): (&[f32], &[f32]), (k_b, v_b): (&[f32], &[f32]), b: &MlaBlock, scale: f32) -> Result<Vec<f32>, String> {
    let (nh, nope, rr, r, vd) = (b.n_head, b.qk_nope, b.qk_rope, b.kv_lora_rank, b.v_head_dim);
    let hd = nope + rr;
    let kv_len = pos.iter().max().map_or(0, |p| p + 1);
    if q.len() != pos.len() * nh * hd || latent.len() < kv_len * r || k_pe.len() < kv_len * rr || k_b.len() != nh * nope * r || v_b.len() != nh * vd * r {
        return Err(format!("latent attention: {} query values for {} positions of {nh} heads of {hd}; {} latent and {} key values for {kv_len} positions; expansion {} + {} values", q.len(), pos.len(), latent.len(), k_pe.len(), k_b.len(), v_b.len()));
    }
    let mut out = vec![0.0f32; pos.len() * nh * vd];
    out.par_chunks_mut(vd).enumerate().for_each(|(th, o)| {
        let (t, h) = (th / nh, th % nh);
        let qh = &q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
        let (q_nope, q_pe) = qh.split_at(nope);
        let k_rows = &k_b[h * nope * r..(h + 1) * nope * r];
        let mut q_abs = vec![0.0f32; r];
        for (qc, row) in q_nope.iter().zip(k_rows.chunks_exact(r)) {
            q_abs.iter_mut().zip(row).for_each(|(a, w)| *a += qc * w);
        }
        let keys = pos[t] + 1;
        let mut scores: Vec<f32> = (0..keys)
            .map(|j| {
                (dot_f32(&q_abs, &latent[j * r..(j + 1) * r]) + dot_f32(q_pe, &k_pe[j * rr..(j + 1) * rr])) * scale
            })
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        scores.iter_mut().for_each(|s| {
            *s = (*s - max).exp();
            sum += *s;
        });
        let mut ctx = vec![0.0f32; r];
        for (j, p) in scores.iter().enumerate() {
            let p = p / sum;
            ctx.iter_mut().zip(&latent[j * r..(j + 1) * r]).for_each(|(c, l)| *c += p * l);
        }
        let v_rows = &v_b[h * vd * r..(h + 1) * vd * r];
        o.iter_mut().zip(v_rows.chunks_exact(r)).for_each(|(o, row)| *o = dot_f32(row, &ctx));
    });
    Ok(out)
}

/// The `qk_rope` values from `at` of every head of `q` (`[m, n_head * qk_head_dim]`; `at` is
/// `qk_nope`, the rotated part), gathered (`put` false) into `[m, n_head * qk_rope]`, or
/// written back from `tails` (`put` true).
pub(crate) fn rope_tails(q: &mut [f32], tails: &mut Vec<f32>, b: &MlaBlock, at: usize, put: bool) {
    let (rr, hd) = (b.qk_rope, b.qk_nope + b.qk_rope);
    if put {
        q.chunks_exact_mut(hd).zip(tails.chunks_exact(rr)).for_each(|(h, t)| h[at..at + rr].copy_from_slice(t));
    } else {
        *tails = q.chunks_exact(hd).flat_map(|h| h[at..at + rr].iter().copied()).collect();
    }
}
