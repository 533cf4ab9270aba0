//! The cpu device's f32 kernels: norms, RoPE, attention, softmax, activations, routing and
//! selection. Written for speed the usual way (f32 accumulation, fixed-width lanes), and on
//! purpose independently of the oracle's code.

use super::qdot::{axpy_f32_impl, dot_f32, dot_f32_impl};
#[cfg(target_arch = "x86_64")]
use super::qdot::has_avx2;
use oracle::registry::Tensor;
use oracle::spec::{RopeScaling, RopeSpec, RopeStyle};
use rayon::prelude::*;

pub fn transpose(y_t: &[f32], n: usize, m: usize) -> Vec<f32> {
    if m == 1 {
        return y_t.to_vec();
    }
    let mut y = vec![0.0f32; n * m];
    for r in 0..n {
        for t in 0..m {
            y[t * n + r] = y_t[r * m + t];
        }
    }
    y
}

pub fn embed(table: &Tensor, ids: &[u32]) -> Result<Vec<f32>, String> {
    let (vocab, d) = (table.shape[0], table.shape[1]);
    let mut out = Vec::with_capacity(ids.len() * d);
    for &id in ids {
        if id as usize >= vocab {
            return Err(format!("token id {id} outside the vocabulary of {vocab}"));
        }
        out.extend_from_slice(&table.data[id as usize * d..(id as usize + 1) * d]);
    }
    Ok(out)
}

fn sum_sq(x: &[f32]) -> f32 {
    dot_f32(x, x)
}

pub fn rms_norm(x: &[f32], n: usize, w: &[f32], eps: f32) -> Vec<f32> {
    let mut y = vec![0.0f32; x.len()];
    y.par_chunks_mut(n).zip(x.par_chunks(n)).for_each(|(o, r)| {
        let scale = 1.0 / (sum_sq(r) / n as f32 + eps).sqrt();
        for i in 0..n {
            o[i] = r[i] * scale * w[i];
        }
    });
    y
}

pub fn layer_norm(x: &[f32], n: usize, w: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    let mut y = vec![0.0f32; x.len()];
    for (o, r) in y.chunks_mut(n).zip(x.chunks(n)) {
        let mean = r.iter().sum::<f32>() / n as f32;
        let centered: Vec<f32> = r.iter().map(|v| v - mean).collect();
        let scale = 1.0 / (sum_sq(&centered) / n as f32 + eps).sqrt();
        for i in 0..n {
            o[i] = centered[i] * scale * w[i] + b[i];
        }
    }
    y
}

/// `a + b`, with `b` broadcast over rows when it is shorter (bias).
pub fn add_broadcast(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter().zip(b.iter().cycle()).map(|(x, y)| x + y).collect()
}

/// cos/sin tables are built in f64 on the host and stored as f32, as engines that precompute
/// RoPE tables do; the rotation itself is f32. Scaling follows llama.cpp's definitions.
pub fn rope_table(spec: &RopeSpec, pos: usize) -> Vec<(f32, f32)> {
    rope_table_f64(spec, pos).into_iter().map(|(c, s)| (c as f32, s as f32)).collect()
}

/// The host-side f64 RoPE table (cos * magnitude, sin * magnitude) for one position.
pub fn rope_table_f64(spec: &RopeSpec, pos: usize) -> Vec<(f64, f64)> {
    let n_rot = spec.n_rot as f64;
    (0..spec.n_rot / 2)
        .map(|i| {
            let base = pos as f64 / spec.theta.powf(2.0 * i as f64 / n_rot);
            let (angle, mag) = match spec.scaling {
                RopeScaling::None => (base, 1.0),
                RopeScaling::Linear { factor } => (base / factor, 1.0),
                RopeScaling::Yarn { factor, original_context, beta_fast, beta_slow, ext_factor, attn_factor } => {
                    let corr = |beta: f64| n_rot * (original_context as f64 / (beta * 2.0 * std::f64::consts::PI)).ln() / (2.0 * spec.theta.ln());
                    let (lo, hi) = (corr(beta_fast).floor().max(0.0), corr(beta_slow).ceil().min(n_rot - 1.0));
                    if ext_factor == 0.0 {
                        (base / factor, attn_factor)
                    } else {
                        let mix = (1.0 - ((i as f64 - lo) / (hi - lo).max(0.001)).clamp(0.0, 1.0)) * ext_factor;
                        (base / factor * (1.0 - mix) + base * mix, attn_factor * (1.0 + 0.1 * factor.ln()))
                    }
                }
            };
            (angle.cos() * mag, angle.sin() * mag)
        })
        .collect()
}

/// Rotates `x: [positions, n_head * hd]` in place.
pub fn rope(x: &mut [f32], pos: &[usize], n_head: usize, hd: usize, spec: &RopeSpec) {
    let half = spec.n_rot / 2;
    let neox = spec.style == RopeStyle::Neox;
    for (t, &p) in pos.iter().enumerate() {
        let table = rope_table(spec, p);
        for h in 0..n_head {
            let head = &mut x[(t * n_head + h) * hd..(t * n_head + h + 1) * hd];
            for (i, &(c, s)) in table.iter().enumerate() {
                let (a, b) = if neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
}

pub struct AttnCfg {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// 0 = no sliding window.
    pub window: usize,
}

/// What a KV cache holds: f32, or f16 as an f16 cache holds it (half the memory), widened row by
/// row as attention reads it. Widening f16 is exact, so attention over an f16 cache gives the
/// same bits as over the same values stored as f32.
pub trait KvValue: Copy + Send + Sync {
    /// Whether `as_f32` needs a buffer (false: the row is f32 already).
    const WIDENS: bool;
    /// `row` as f32: itself, or widened into `buf` (at least `row.len()` long).
    fn as_f32<'a>(row: &'a [Self], buf: &'a mut [f32]) -> &'a [f32];
}

impl KvValue for f32 {
    const WIDENS: bool = false;
    fn as_f32<'a>(row: &'a [f32], _: &'a mut [f32]) -> &'a [f32] {
        row
    }
}

impl KvValue for half::f16 {
    const WIDENS: bool = true;
    fn as_f32<'a>(row: &'a [half::f16], buf: &'a mut [f32]) -> &'a [f32] {
        use half::slice::HalfFloatSliceExt;
        row.convert_to_f32_slice(&mut buf[..row.len()]);
        &buf[..row.len()]
    }
}

/// Query positions per attention task: the task's query heads (this many positions times the
/// query heads sharing one KV head) read each key and value row once between them.
const POSITIONS_PER_TASK: usize = 4;

pub fn attention<T: KvValue>(q: &[f32], pos: &[usize], k: &[T], v: &[T], kv_len: usize, c: &AttnCfg) -> Result<Vec<f32>, String> {
    let (nh, nkv, hd) = (c.n_head, c.n_head_kv, c.head_dim);
    if nkv == 0 || nh % nkv != 0 || pos.iter().any(|&p| p >= kv_len) {
        return Err("attention: bad head counts or a query past the cache".into());
    }
    let scale = 1.0 / (hd as f32).sqrt();
    let group = nh / nkv;
    let blocks = pos.len().div_ceil(POSITIONS_PER_TASK);
    // One task per (block of positions, KV head); each returns its queries' outputs, position
    // by position, head by head, which land at their places in `out` below.
    let parts: Vec<Vec<f32>> = (0..blocks * nkv)
        .into_par_iter()
        .map(|task| {
            let (b, kvh) = (task / nkv, task % nkv);
            let ts = b * POSITIONS_PER_TASK..(pos.len()).min((b + 1) * POSITIONS_PER_TASK);
            let queries: Vec<Query> = ts
                .flat_map(|t| {
                    let p = pos[t];
                    let first = if c.window > 0 { (p + 1).saturating_sub(c.window) } else { 0 };
                    (kvh * group..(kvh + 1) * group).map(move |h| Query { at: (t * nh + h) * hd, rows: first..=p })
                })
                .collect();
            attend(q, &queries, &KvHead { k, v, stride: nkv * hd, offset: kvh * hd, hd }, scale)
        })
        .collect();
    let mut out = vec![0.0f32; pos.len() * nh * hd];
    for (task, part) in parts.iter().enumerate() {
        let (b, kvh) = (task / nkv, task % nkv);
        for (i, o) in part.chunks_exact(group * hd).enumerate() {
            let at = ((b * POSITIONS_PER_TASK + i) * nh + kvh * group) * hd;
            out[at..at + group * hd].copy_from_slice(o);
        }
    }
    Ok(out)
}

/// One KV head's rows in the cache: row `j` is `[j * stride + offset ..][..hd]`.
struct KvHead<'a, T> {
    k: &'a [T],
    v: &'a [T],
    stride: usize,
    offset: usize,
    hd: usize,
}

/// One query head: its vector at `q[at..at + hd]`, and the cache rows it attends to.
struct Query {
    at: usize,
    rows: std::ops::RangeInclusive<usize>,
}

/// Queries of one KV head: for each, the softmax of its scaled scores over its rows, then its
/// rows' values weighted by it, into `hd` outputs (query after query). Each key and value row is
/// read (and widened) once for all the queries that attend to it. Per query the operations and
/// their order are those of one query alone (scores in row order, no fused multiply-add), and the
/// body is compiled a second time with AVX2/FMA/F16C (chosen at run time): the same bits.
fn attend<T: KvValue>(q: &[f32], queries: &[Query], kv: &KvHead<T>, scale: f32) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2() {
            // SAFETY: the CPU reports avx2, fma and f16c.
            return unsafe { attend_avx2(q, queries, kv, scale) };
        }
    }
    attend_impl(q, queries, kv, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2<T: KvValue>(q: &[f32], queries: &[Query], kv: &KvHead<T>, scale: f32) -> Vec<f32> {
    attend_impl(q, queries, kv, scale)
}

#[inline(always)]
fn attend_impl<T: KvValue>(q: &[f32], queries: &[Query], kv: &KvHead<T>, scale: f32) -> Vec<f32> {
    // Plain loops, no closures: a closure would not inherit the AVX2 target features.
    let hd = kv.hd;
    let (mut lo, mut hi) = (usize::MAX, 0);
    for qr in queries {
        lo = lo.min(*qr.rows.start());
        hi = hi.max(*qr.rows.end());
    }
    let mut buf = vec![0.0f32; if T::WIDENS { hd } else { 0 }]; // empty: no allocation
    let mut scores: Vec<Vec<f32>> = Vec::with_capacity(queries.len());
    for qr in queries {
        scores.push(Vec::with_capacity(qr.rows.end() + 1 - qr.rows.start()));
    }
    for j in lo..=hi {
        let at = j * kv.stride + kv.offset;
        let key = T::as_f32(&kv.k[at..at + hd], &mut buf);
        for (qr, s) in queries.iter().zip(scores.iter_mut()) {
            if qr.rows.contains(&j) {
                s.push(dot_f32_impl(&q[qr.at..qr.at + hd], key) * scale);
            }
        }
    }
    let mut probs = Vec::with_capacity(queries.len());
    for s in &scores {
        probs.push(softmax(s));
    }
    let mut out = vec![0.0f32; queries.len() * hd];
    for j in lo..=hi {
        let at = j * kv.stride + kv.offset;
        let value = T::as_f32(&kv.v[at..at + hd], &mut buf);
        for (i, qr) in queries.iter().enumerate() {
            if qr.rows.contains(&j) {
                axpy_f32_impl(&mut out[i * hd..(i + 1) * hd], probs[i][j - qr.rows.start()], value);
            }
        }
    }
    out
}

pub fn softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = x.iter().map(|v| (v - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.into_iter().map(|v| v / sum).collect()
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + (0.797_884_6f32 * (x + 0.044715 * x * x * x)).tanh())
}

/// First index of the maximum.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] || x[best].is_nan() {
            best = i;
        }
    }
    best
}

/// The `k` largest values' indices, best first, the lower index first among equal values (-0.0
/// equals +0.0: `total_cmp` would rank +0.0 first); NaN never ranks.
pub fn top_k(x: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..x.len() as u32).filter(|&i| !x[i as usize].is_nan()).collect();
    idx.sort_by(|&a, &b| x[b as usize].partial_cmp(&x[a as usize]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

pub fn moe_route(logits: &[f32], n: usize, k: usize, sigmoid: bool, normalize: bool) -> (Vec<u32>, Vec<f32>) {
    let (mut ids, mut ws) = (Vec::new(), Vec::new());
    for row in logits.chunks(n) {
        let p: Vec<f32> = if sigmoid { row.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect() } else { softmax(row) };
        let sel = top_k(&p, k);
        let mut w: Vec<f32> = sel.iter().map(|&e| p[e as usize]).collect();
        if normalize {
            let s: f32 = w.iter().sum();
            w.iter_mut().for_each(|v| *v /= s);
        }
        ids.extend(sel);
        ws.extend(w);
    }
    (ids, ws)
}

/// Seeded sampling. The decision is discrete, so probabilities are computed in f64 to make the
/// choice agree with any other engine that uses the same RNG stream.
pub fn sample(x: &[f32], temperature: f64, k: usize, top_p: f64, rng: &mut oracle::ops::SplitMix64) -> u32 {
    if temperature <= 0.0 {
        return argmax(x) as u32;
    }
    sample_ranked(x, &top_k(x, if k == 0 { x.len() } else { k }), temperature, top_p, rng)
}

/// The draw of `sample` once the top-k candidates `order` (best first) are known; shared with
/// devices that rank the candidates on an accelerator and draw on the host.
pub fn sample_ranked(x: &[f32], order: &[u32], temperature: f64, top_p: f64, rng: &mut oracle::ops::SplitMix64) -> u32 {
    let scaled: Vec<f64> = order.iter().map(|&i| x[i as usize] as f64 / temperature).collect();
    let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scaled.iter().map(|v| (v - max).exp()).collect();
    let total: f64 = e.iter().sum();
    let probs: Vec<f64> = e.iter().map(|v| v / total).collect();
    let mut keep = probs.len();
    let mut cum = 0.0;
    for (j, p) in probs.iter().enumerate() {
        cum += p;
        if cum >= top_p {
            keep = j + 1;
            break;
        }
    }
    let kept: f64 = probs[..keep].iter().sum();
    let mut r = rng.next_f64() * kept;
    for j in 0..keep {
        r -= probs[j];
        if r < 0.0 {
            return order[j];
        }
    }
    order[keep - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An f16 cache holds half the bytes and gives the same bits as the same rounded values held
    /// in f32 (widening f16 is exact), for GQA, a sliding window and several query positions.
    #[test]
    fn attention_over_an_f16_cache_equals_the_rounded_f32_cache() {
        let (nh, nkv, hd, len) = (6, 2, 40, 13);
        let val = |i: usize, salt: usize| (((i * 2654435761 + salt * 40503) % 10007) as f32 / 10007.0 - 0.5) * 3.0;
        let q: Vec<f32> = (0..3 * nh * hd).map(|i| val(i, 1)).collect();
        let (k, v): (Vec<f32>, Vec<f32>) = ((0..len * nkv * hd).map(|i| val(i, 2)).collect(), (0..len * nkv * hd).map(|i| val(i, 3)).collect());
        let half = |x: &[f32]| -> Vec<half::f16> { x.iter().map(|v| half::f16::from_f32(*v)).collect() };
        let (kh, vh) = (half(&k), half(&v));
        let (kr, vr): (Vec<f32>, Vec<f32>) = (kh.iter().map(|x| x.to_f32()).collect(), vh.iter().map(|x| x.to_f32()).collect());
        assert!(kr != k, "the inputs must need rounding for the test to mean anything");
        for window in [0, 4] {
            let c = AttnCfg { n_head: nh, n_head_kv: nkv, head_dim: hd, window };
            let pos = [5, 11, 12];
            let want = attention(&q, &pos, &kr, &vr, len, &c).unwrap();
            let got = attention(&q, &pos, &kh, &vh, len, &c).unwrap();
            assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "window {window}");
        }
        assert_eq!(std::mem::size_of_val(kh.as_slice()) * 2, std::mem::size_of_val(k.as_slice()));
    }

    /// Queries attended together (blocks of positions sharing each key and value row, a partial
    /// last block, GQA, a sliding window) give each query the bits it gets alone.
    #[test]
    fn queries_attended_together_get_the_bits_of_each_alone() {
        let (nh, nkv, hd, len) = (6, 2, 24, 23);
        let val = |i: usize, salt: usize| (((i * 2654435761 + salt * 40503) % 10007) as f32 / 10007.0 - 0.5) * 3.0;
        let pos: Vec<usize> = vec![0, 3, 4, 9, 10, 11, 15, 22, 17];
        let q: Vec<f32> = (0..pos.len() * nh * hd).map(|i| val(i, 1)).collect();
        let (k, v): (Vec<f32>, Vec<f32>) = ((0..len * nkv * hd).map(|i| val(i, 2)).collect(), (0..len * nkv * hd).map(|i| val(i, 3)).collect());
        for window in [0, 5] {
            let c = AttnCfg { n_head: nh, n_head_kv: nkv, head_dim: hd, window };
            let together = attention(&q, &pos, &k, &v, len, &c).unwrap();
            let alone: Vec<f32> = pos.iter().enumerate().flat_map(|(t, p)| attention(&q[t * nh * hd..(t + 1) * nh * hd], &[*p], &k, &v, len, &c).unwrap()).collect();
            assert_eq!(together.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), alone.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "window {window}");
            assert!(together.iter().all(|x| x.is_finite()) && together.iter().any(|x| *x != 0.0));
        }
    }
}
