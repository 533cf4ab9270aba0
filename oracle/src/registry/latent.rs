//! Latent attention's op (`mla_attention`, DeepSeek's MLA): queries (their rotated part already
//! rotated) attending to cached latents and shared rotated keys through the expansion
//! `attn_kv_b`. An engine may compute it absorbed (queries taken into the latent's space, the
//! weighted latents out through the value rows) or materialized; the reference is the
//! materialized form in f64.

use super::{case, normals, out, seed_of, t, Input, Op, OpCase, Output};
use crate::error::Result;
use crate::ops::{self, AttentionParams, Mat, SplitMix64};
use crate::spec::MlaBlock;

/// (heads, unrotated, rotated, latent, value, queries): one head; the DeepSeek-V3-shaped test
/// model's widths over 9 and 70 positions; DeepSeek V3's own head (128 + 64 over a latent of
/// 512, values of 128) on two heads; odd widths.
const SHAPES: [(usize, usize, usize, usize, usize, usize); 5] = [(1, 4, 2, 6, 4, 1), (4, 16, 8, 24, 12, 9), (4, 16, 8, 24, 12, 70), (2, 128, 64, 512, 128, 5), (3, 7, 4, 13, 5, 33)];

/// Seeds per shape: odd seeds put the queries after 7 cached positions (decode over a cache),
/// even ones at the start (prefill); the last seed of each shape scales the scores by YaRN's
/// factor as DeepSeek V3 does.
const SEEDS: u64 = 4;

/// The block a case describes.
pub fn block(c: &OpCase) -> Result<MlaBlock> {
    Ok(MlaBlock { n_head: c.pu("n_head")?, q_lora_rank: 0, kv_lora_rank: c.pu("kv_lora_rank")?, qk_nope: c.pu("qk_nope")?, qk_rope: c.pu("qk_rope")?, v_head_dim: c.pu("v_head_dim")? })
}

pub(super) fn mla_attention_cases(base: u64) -> Vec<OpCase> {
    let mut v = Vec::new();
    for (nh, nope, rope, r, vd, m) in SHAPES {
        for i in 0..SEEDS {
            let seed = seed_of(base, i) ^ (nh * 1000 + nope * 100 + rope * 10 + r + m * 7) as u64;
            let mut g = SplitMix64(seed ^ 0x37A);
            let before = if i % 2 == 1 { 7 } else { 0 };
            let kv_len = before + m;
            let q = normals(&mut g, m * nh * (nope + rope), 1.0);
            let latent = normals(&mut g, kv_len * r, 1.0);
            let k_pe = normals(&mut g, kv_len * rope, 1.0);
            let kv_b = normals(&mut g, nh * (nope + vd) * r, 1.0 / (r as f64).sqrt());
            let yarn = if i == SEEDS - 1 { (1.0 + 0.1 * 40f64.ln()).powi(2) } else { 1.0 };
            let scale = yarn / ((nope + rope) as f64).sqrt();
            v.push(case(
                Op::MlaAttention,
                format!("mla_attention(heads={nh},nope={nope},rope={rope},latent={r},v={vd},m={m},cached={before},seed={seed})"),
                seed,
                vec![
                    ("q", t(&[m, nh * (nope + rope)], q)),
                    ("latent", t(&[kv_len, r], latent)),
                    ("k_pe", t(&[kv_len, rope], k_pe)),
                    ("kv_b", t(&[nh * (nope + vd), r], kv_b)),
                    ("pos", Input::Ids((before..kv_len).map(|p| p as u32).collect())),
                ],
                &[("n_head", nh as f64), ("qk_nope", nope as f64), ("qk_rope", rope as f64), ("kv_lora_rank", r as f64), ("v_head_dim", vd as f64), ("scale", scale)],
            ));
        }
    }
    v
}

/// The materialized form in f64 (`ops::mla_expand`, `ops::attention_values`): `[m, n_head *
/// v_head_dim]`.
pub fn mla_attention_f64(c: &OpCase) -> Result<Vec<f64>> {
    let b = block(c)?;
    let f = |n: &str| -> Result<Vec<f64>> { Ok(c.f32(n)?.data.iter().map(|x| *x as f64).collect()) };
    let pos: Vec<usize> = c.ids("pos")?.iter().map(|&p| p as usize).collect();
    let kv_len = c.f32("latent")?.shape.first().copied().unwrap_or(0);
    let kv_b = Mat::new(b.kv_b_dim(), b.kv_lora_rank, f("kv_b")?)?;
    let (keys, values) = ops::mla_expand(&f("latent")?, &f("k_pe")?, kv_len, &kv_b, &b)?;
    let p = AttentionParams { n_head: b.n_head, n_head_kv: b.n_head, head_dim: b.qk_head_dim(), scale: c.p("scale")?, window: None, sinks: None, softcap: None };
    ops::attention_values(&f("q")?, &pos, &keys, &values, kv_len, &p, None, b.v_head_dim)
}

pub(super) fn mla_attention_ref(c: &OpCase) -> Result<Vec<Output>> {
    let y = mla_attention_f64(c)?;
    let m = c.ids("pos")?.len();
    Ok(vec![out(&[m, y.len() / m.max(1)], y.iter().map(|v| *v as f32).collect())])
}

/// Per query and head: the absorbed form's products (query into the latent's space, then over
/// each cached latent, then the value rows), about `2 (nope + kv_len) r + v r` each.
pub(super) fn mla_attention_flops(c: &OpCase) -> u64 {
    let Ok(b) = block(c) else { return 0 };
    let (m, kv) = (c.ids("pos").map_or(0, |p| p.len()), c.f32("latent").map_or(0, |l| l.shape[0]));
    (m * b.n_head * (2 * (b.qk_nope + kv) * b.kv_lora_rank + 2 * b.v_head_dim * b.kv_lora_rank + 2 * kv * b.qk_rope)) as u64
}
