//! The cpu device's f32 kernels: norms, RoPE, attention, softmax, activations, routing and
//! selection. Written for speed the usual way (f32 accumulation, fixed-width lanes), and on
//! purpose independently of the oracle's code.

use super::qdot::{axpy_f32_impl, dot_f32, dot_f32_impl};
#[cfg(target_arch = "x86_64")]
use super::qdot::has_avx2;
use oracle::registry::Tensor;
pub use crate::shared::{rope_table, rope_table_f64, sample_ranked, AttnCfg};
use oracle::spec::{RopeSpec, RopeStyle};
use rayon::prelude::*;

/// Token positions (and weight rows) per tile of `transpose`: a tile's source rows and
/// destination rows are each a few cache lines, so both sides stay in L1 while it is copied.
const TRANSPOSE_TILE: usize = 16;

/// `y_t: [n][m]` (a matmul's output, weight row by token) as `[m][n]`, token by token. Tiled and
/// split over tokens (a 1,000-token prefill wrote each output to a new cache line).
pub fn transpose(y_t: &[f32], n: usize, m: usize) -> Vec<f32> {
    if m == 1 || n == 0 {
        return y_t.to_vec();
    }
    let mut y = vec![0.0f32; n * m];
    y.par_chunks_mut(TRANSPOSE_TILE * n).enumerate().for_each(|(c, ys)| {
        let (t0, tn) = (c * TRANSPOSE_TILE, ys.len() / n);
        for r0 in (0..n).step_by(TRANSPOSE_TILE) {
            for r in r0..n.min(r0 + TRANSPOSE_TILE) {
                for (dt, v) in y_t[r * m + t0..r * m + t0 + tn].iter().enumerate() {
                    ys[dt * n + r] = *v;
                }
            }
        }
    });
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


/// What a KV cache holds: f32, or f16 as an f16 cache holds it (half the memory), widened row by
/// row as attention reads it. Widening f16 is exact, so attention over an f16 cache gives the
/// same bits as over the same values stored as f32.
pub trait KvValue: Copy + Send + Sync {
    /// Whether `as_f32` needs a buffer (false: the row is f32 already).
    const WIDENS: bool;
    /// `row` as f32: itself, or widened into `buf` (at least `row.len()` long).
    fn as_f32<'a>(row: &'a [Self], buf: &'a mut [f32]) -> &'a [f32];
    /// `as_f32` inside attention: with `AVX` (only from `attend_avx2`) f16 widens 8 values per
    /// F16C instruction, inlined (exact, so the same values).
    #[inline(always)]
    fn as_f32_in<'a, const AVX: bool>(row: &'a [Self], buf: &'a mut [f32]) -> &'a [f32] {
        Self::as_f32(row, buf)
    }
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
    #[inline(always)]
    fn as_f32_in<'a, const AVX: bool>(row: &'a [half::f16], buf: &'a mut [f32]) -> &'a [f32] {
        #[cfg(target_arch = "x86_64")]
        if AVX {
            use std::arch::x86_64::*;
            let (n, out) = (row.len(), &mut buf[..row.len()]);
            let full = n / 8 * 8;
            let mut c = 0;
            while c < full {
                // SAFETY: AVX is true only inside `attend_avx2` (the CPU has F16C); `c + 8 <= n`,
                // the length of both `row` and `out`.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(c), _mm256_cvtph_ps(_mm_loadu_si128(row.as_ptr().add(c) as *const __m128i))) };
                c += 8;
            }
            for (o, h) in out[full..].iter_mut().zip(&row[full..]) {
                *o = h.to_f32();
            }
            return out;
        }
        Self::as_f32(row, buf)
    }
}

/// Query positions per attention task: the task's query heads (this many positions times the
/// query heads sharing one KV head) read each key and value row once between them.
const POSITIONS_PER_TASK: usize = 4;

pub fn attention<K: KvValue, V: KvValue>(q: &[f32], pos: &[usize], k: &[K], v: &[V], kv_len: usize, c: &AttnCfg) -> Result<Vec<f32>, String> {
    attend_rows(q, pos, k, v, kv_len, c)
}

/// A cache side's rows in pages of `1 << shift` rows each, `[rows, width]` within a page.
pub struct Pages<'a, T> {
    pages: &'a [&'a [T]],
    shift: u32,
}

impl<T> Clone for Pages<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Pages<'_, T> {}

impl<'a, T> Pages<'a, T> {
    /// Pages of `1 << shift` rows (the last may hold fewer).
    pub fn paged(pages: &'a [&'a [T]], shift: u32) -> Pages<'a, T> {
        Pages { pages, shift: shift.min(usize::BITS - 1) }
    }
}

/// Where attention reads a cache side's rows from: one contiguous slice, or [`Pages`]. Each is
/// compiled into attention of its own, so the contiguous cache reads its rows as it always has.
pub trait RowSource<'a, T>: Copy + Send + Sync {
    /// Values `at..at + len` of row `j`, rows `width` apart (None past what it holds).
    fn row(self, j: usize, width: usize, at: usize, len: usize) -> Option<&'a [T]>;
    /// Rows of `width` values held from row 0 on without a gap.
    fn rows_held(self, width: usize) -> usize;
}

impl<'a, T: Sync> RowSource<'a, T> for &'a [T] {
    #[inline(always)]
    fn row(self, j: usize, width: usize, at: usize, len: usize) -> Option<&'a [T]> {
        let start = j * width + at;
        self.get(start..start + len)
    }
    fn rows_held(self, width: usize) -> usize {
        self.len().checked_div(width).unwrap_or(0)
    }
}

impl<'a, T: Sync> RowSource<'a, T> for Pages<'a, T> {
    #[inline(always)]
    fn row(self, j: usize, width: usize, at: usize, len: usize) -> Option<&'a [T]> {
        let (page, r) = (j >> self.shift, j & ((1usize << self.shift) - 1));
        let start = r * width + at;
        self.pages.get(page)?.get(start..start + len)
    }
    /// A page short of `1 << shift` rows ends the rows held.
    fn rows_held(self, width: usize) -> usize {
        let per_page = 1usize << self.shift;
        let mut n = 0usize;
        for p in self.pages {
            let rows = p.len().checked_div(width).unwrap_or(0).min(per_page);
            n = n.saturating_add(rows);
            if rows < per_page {
                break;
            }
        }
        n
    }
}

/// [`attention`] over a paged cache: row `j` of the keys (values) is in page `j >> shift`.
/// Which page a row sits in changes no value: the same bits as over the same rows contiguous.
pub fn attention_paged<K: KvValue, V: KvValue>(q: &[f32], pos: &[usize], k: Pages<'_, K>, v: Pages<'_, V>, kv_len: usize, c: &AttnCfg) -> Result<Vec<f32>, String> {
    attend_rows(q, pos, k, v, kv_len, c)
}

fn attend_rows<'s, K: KvValue + 's, V: KvValue + 's, KS: RowSource<'s, K>, VS: RowSource<'s, V>>(q: &[f32], pos: &[usize], k: KS, v: VS, kv_len: usize, c: &AttnCfg) -> Result<Vec<f32>, String> {
    let (nh, nkv, hd) = (c.n_head, c.n_head_kv, c.head_dim);
    if nkv == 0 || nh % nkv != 0 || pos.iter().any(|&p| p >= kv_len) {
        return Err("attention: bad head counts or a query past the cache".into());
    }
    if let Some(s) = c.sinks.filter(|s| s.len() != nh) {
        return Err(format!("attention: {} sink logits for {nh} query heads", s.len()));
    }
    let (k_rows, v_rows) = (k.rows_held(nkv * hd), v.rows_held(nkv * hd));
    if k_rows < kv_len || v_rows < kv_len {
        return Err(format!("attention: the cache holds {k_rows} key and {v_rows} value rows, {kv_len} are attended to"));
    }
    let scale = c.scale;
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
                    (kvh * group..(kvh + 1) * group).map(move |h| Query { at: (t * nh + h) * hd, rows: first..=p, sink: c.sinks.map(|s| s[h]) })
                })
                .collect();
            attend(q, &queries, &KvHead { k, v, stride: nkv * hd, offset: kvh * hd, hd }, scale, c.softcap)
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

/// One KV head's rows in the cache: row `j` is `[j * stride + offset ..][..hd]` (within its page).
struct KvHead<KS, VS> {
    k: KS,
    v: VS,
    stride: usize,
    offset: usize,
    hd: usize,
}

impl<KS, VS> KvHead<KS, VS> {
    /// Rows `rows` (at most `N`) of `src` (its keys or values) as f32, widened into `buf` when
    /// they are f16; the rest of the array empty.
    #[inline(always)]
    fn rows<'b, 's: 'b, T: KvValue + 's, S: RowSource<'s, T>, const N: usize, const AVX: bool>(&self, src: S, rows: std::ops::Range<usize>, buf: &'b mut [f32]) -> [&'b [f32]; N] {
        let mut out: [&[f32]; N] = [&[]; N];
        let mut widened = buf.chunks_exact_mut(self.hd.max(1));
        for (o, j) in out.iter_mut().zip(rows) {
            let into: &mut [f32] = if T::WIDENS { widened.next().unwrap_or_default() } else { &mut [] };
            let row = src.row(j, self.stride, self.offset, self.hd).expect("attention reads rows its cache holds");
            *o = T::as_f32_in::<AVX>(row, into);
        }
        out
    }

    /// Asks the CPU to start loading rows `rows` of `src` (those the cache holds) into L1: a
    /// long cache comes from memory, and one KV head's rows are `stride` apart, a pattern the
    /// hardware prefetchers follow too late. No effect on any value.
    #[inline(always)]
    fn prefetch<'s, T: 's, S: RowSource<'s, T>>(&self, src: S, rows: std::ops::Range<usize>) {
        #[cfg(target_arch = "x86_64")]
        for j in rows {
            let Some(row) = src.row(j, self.stride, self.offset, self.hd) else { return };
            for line in (0..std::mem::size_of_val(row)).step_by(64) {
                // SAFETY: `line` is within `row`; a prefetch reads nothing into the program.
                unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>((row.as_ptr() as *const i8).add(line)) };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (src, rows);
    }
}

/// Rows ahead of the one being read that attention asks the CPU to load.
const PREFETCH_ROWS: usize = 16;

/// One query head: its vector at `q[at..at + hd]`, and the cache rows it attends to.
struct Query {
    at: usize,
    rows: std::ops::RangeInclusive<usize>,
    /// The head's sink logit, if the model has sinks.
    sink: Option<f32>,
}

/// Key rows scored together against one query (independent sums, so the CPU overlaps them).
pub(crate) const KEYS_PER_STEP: usize = 4;

/// Value rows added into a query's outputs while those stay in registers.
const VALUES_PER_STEP: usize = 8;

/// Queries of one KV head: for each, the softmax of its scaled scores over its rows, then its
/// rows' values weighted by it, into `hd` outputs (query after query). Each key and value row is
/// read (and widened) once for all the queries that attend to it. Per query the operations and
/// their order are those of one query alone (scores in row order, each the lane sums of
/// `dot_f32`, no fused multiply-add), and the body is compiled a second time with AVX2/FMA/F16C
/// (chosen at run time), where four keys are scored at once with 8-lane vectors: the same bits.
fn attend<'s, K: KvValue + 's, V: KvValue + 's, KS: RowSource<'s, K>, VS: RowSource<'s, V>>(q: &[f32], queries: &[Query], kv: &KvHead<KS, VS>, scale: f32, softcap: f32) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2() {
            // SAFETY: the CPU reports avx2, fma and f16c.
            return unsafe { attend_avx2(q, queries, kv, scale, softcap) };
        }
    }
    attend_impl::<K, V, KS, VS, false>(q, queries, kv, scale, softcap)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2<'s, K: KvValue + 's, V: KvValue + 's, KS: RowSource<'s, K>, VS: RowSource<'s, V>>(q: &[f32], queries: &[Query], kv: &KvHead<KS, VS>, scale: f32, softcap: f32) -> Vec<f32> {
    attend_impl::<K, V, KS, VS, true>(q, queries, kv, scale, softcap)
}

/// `dot_f32(q, r)` for each of four rows, with its bits (four independent accumulators instead
/// of one dependent chain): attention's four keys per query, a float matmul's four tokens per
/// weight row. The AVX2 copy is chosen at run time.
pub(crate) fn dot_f32_x4(q: &[f32], rows: &[&[f32]; KEYS_PER_STEP]) -> [f32; KEYS_PER_STEP] {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU reports AVX2, FMA and F16C; dot4_avx2 asserts the row lengths.
        return unsafe { dot4_avx2(q, rows) };
    }
    dot4::<false>(q, rows)
}

/// `dot_f32_impl(q, k)` for each of four keys; with `AVX` (only from `attend_avx2`) in 8-lane
/// vectors.
#[inline(always)]
fn dot4<const AVX: bool>(q: &[f32], keys: &[&[f32]; KEYS_PER_STEP]) -> [f32; KEYS_PER_STEP] {
    #[cfg(target_arch = "x86_64")]
    if AVX {
        // SAFETY: AVX is true only inside `attend_avx2`, entered when the CPU has AVX2; every key
        // is as long as `q` (rows of `hd`).
        return unsafe { dot4_avx2(q, keys) };
    }
    [dot_f32_impl(q, keys[0]), dot_f32_impl(q, keys[1]), dot_f32_impl(q, keys[2]), dot_f32_impl(q, keys[3])]
}

/// Four `dot_f32_impl`s with the same bits: lane `l` of a key's accumulator sums
/// `q[l + 8c] * k[l + 8c]` over chunks `c` in order (a multiply, then an add), then
/// `(((a0 + a4) + (a1 + a5)) + (a2 + a6)) + (a3 + a7)` and the scalar tail, here for the four
/// keys at once after a 4 x 4 transpose of the pair sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot4_avx2(q: &[f32], keys: &[&[f32]; KEYS_PER_STEP]) -> [f32; KEYS_PER_STEP] {
    use std::arch::x86_64::*;
    let n = q.len();
    assert!(keys.iter().all(|k| k.len() == n), "dot4: key rows must be as long as the query");
    let full = n / 8 * 8;
    let mut acc = [_mm256_setzero_ps(); KEYS_PER_STEP];
    let mut c = 0;
    while c < full {
        let x = _mm256_loadu_ps(q.as_ptr().add(c));
        for (a, k) in acc.iter_mut().zip(keys) {
            *a = _mm256_add_ps(*a, _mm256_mul_ps(x, _mm256_loadu_ps(k.as_ptr().add(c))));
        }
        c += 8;
    }
    // Per key [a0 + a4, a1 + a5, a2 + a6, a3 + a7]; transposed so that p[i] holds pair sum i of
    // every key.
    let mut h = [_mm_setzero_ps(); KEYS_PER_STEP];
    for (h, a) in h.iter_mut().zip(&acc) {
        *h = _mm_add_ps(_mm256_castps256_ps128(*a), _mm256_extractf128_ps::<1>(*a));
    }
    let (t0, t1) = (_mm_unpacklo_ps(h[0], h[1]), _mm_unpacklo_ps(h[2], h[3]));
    let (t2, t3) = (_mm_unpackhi_ps(h[0], h[1]), _mm_unpackhi_ps(h[2], h[3]));
    let p = [_mm_movelh_ps(t0, t1), _mm_movehl_ps(t1, t0), _mm_movelh_ps(t2, t3), _mm_movehl_ps(t3, t2)];
    let sums = _mm_add_ps(_mm_add_ps(_mm_add_ps(p[0], p[1]), p[2]), p[3]);
    let mut out = [0.0f32; KEYS_PER_STEP];
    _mm_storeu_ps(out.as_mut_ptr(), sums);
    for (o, k) in out.iter_mut().zip(keys) {
        let tail: f32 = q[full..].iter().zip(&k[full..]).map(|(x, y)| x * y).sum();
        *o += tail;
    }
    out
}

#[inline(always)]
fn attend_impl<'s, K: KvValue + 's, V: KvValue + 's, KS: RowSource<'s, K>, VS: RowSource<'s, V>, const AVX: bool>(q: &[f32], queries: &[Query], kv: &KvHead<KS, VS>, scale: f32, softcap: f32) -> Vec<f32> {
    // Plain loops, no closures: a closure would not inherit the AVX2 target features.
    let hd = kv.hd;
    let (mut lo, mut hi) = (usize::MAX, 0);
    for qr in queries {
        lo = lo.min(*qr.rows.start());
        hi = hi.max(*qr.rows.end());
    }
    let mut buf = vec![0.0f32; if K::WIDENS || V::WIDENS { KEYS_PER_STEP.max(VALUES_PER_STEP) * hd } else { 0 }]; // empty: no allocation
    let mut scores: Vec<Vec<f32>> = Vec::with_capacity(queries.len());
    for qr in queries {
        scores.push(Vec::with_capacity(qr.rows.end() + 1 - qr.rows.start()));
    }
    let mut j = lo;
    while j <= hi {
        let step = KEYS_PER_STEP.min(hi + 1 - j);
        kv.prefetch(kv.k, j + PREFETCH_ROWS..(j + PREFETCH_ROWS + step).min(hi + 1));
        let keys: [&[f32]; KEYS_PER_STEP] = kv.rows::<K, KS, KEYS_PER_STEP, AVX>(kv.k, j..j + step, &mut buf);
        for (qr, s) in queries.iter().zip(scores.iter_mut()) {
            let qv = &q[qr.at..qr.at + hd];
            if step == KEYS_PER_STEP && qr.rows.contains(&j) && qr.rows.contains(&(j + KEYS_PER_STEP - 1)) {
                for d in dot4::<AVX>(qv, &keys) {
                    s.push(d * scale);
                }
            } else {
                for (i, key) in keys.iter().enumerate().take(step) {
                    if qr.rows.contains(&(j + i)) {
                        s.push(dot_f32_impl(qv, key) * scale);
                    }
                }
            }
        }
        j += step;
    }
    if softcap > 0.0 {
        for s in scores.iter_mut().flatten() {
            *s = self::softcap(*s, softcap);
        }
    }
    let mut probs = Vec::with_capacity(queries.len());
    for (qr, s) in queries.iter().zip(scores.iter_mut()) {
        match qr.sink {
            None => probs.push(softmax(s)),
            // The sink joins the softmax as a last score; its weight is dropped.
            Some(sink) => {
                s.push(sink);
                let mut p = softmax(s);
                p.pop();
                probs.push(p);
            }
        }
    }
    let mut out = vec![0.0f32; queries.len() * hd];
    let mut j = lo;
    while j <= hi {
        let step = VALUES_PER_STEP.min(hi + 1 - j);
        kv.prefetch(kv.v, j + PREFETCH_ROWS..(j + PREFETCH_ROWS + step).min(hi + 1));
        let values: [&[f32]; VALUES_PER_STEP] = kv.rows::<V, VS, VALUES_PER_STEP, AVX>(kv.v, j..j + step, &mut buf);
        for (i, qr) in queries.iter().enumerate() {
            // The query's rows among j..j + step: one run.
            let (a, b) = ((*qr.rows.start()).max(j), (*qr.rows.end() + 1).min(j + step));
            if a < b {
                let first = *qr.rows.start();
                axpy_rows::<AVX>(&mut out[i * hd..(i + 1) * hd], &probs[i][a - first..b - first], &values[a - j..b - j]);
            }
        }
        j += step;
    }
    out
}

/// `y += w[r] * rows[r]` for each row in order (per element a multiply, then an add: the bits of
/// `axpy_f32_impl` row after row); with `AVX` (only from `attend_avx2`) each 8 outputs stay in a
/// register across the rows.
#[inline(always)]
fn axpy_rows<const AVX: bool>(y: &mut [f32], w: &[f32], rows: &[&[f32]]) {
    #[cfg(target_arch = "x86_64")]
    if AVX {
        // SAFETY: AVX is true only inside `attend_avx2`, entered when the CPU has AVX2; every row
        // is as long as `y` (rows of `hd`).
        return unsafe { axpy_rows_avx2(y, w, rows) };
    }
    for (a, x) in w.iter().zip(rows) {
        axpy_f32_impl(y, *a, x);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn axpy_rows_avx2(y: &mut [f32], w: &[f32], rows: &[&[f32]]) {
    use std::arch::x86_64::*;
    let n = y.len();
    assert!(w.len() == rows.len() && rows.iter().all(|r| r.len() == n), "axpy_rows: one weight per row, rows as long as the output");
    let full = n / 8 * 8;
    let mut c = 0;
    // 32 outputs at a time: four independent sums per row, so the adds overlap.
    while c + 32 <= full {
        let mut acc = [_mm256_setzero_ps(); 4];
        for (l, a) in acc.iter_mut().enumerate() {
            *a = _mm256_loadu_ps(y.as_ptr().add(c + 8 * l));
        }
        for (a, x) in w.iter().zip(rows) {
            let a = _mm256_set1_ps(*a);
            for (l, s) in acc.iter_mut().enumerate() {
                *s = _mm256_add_ps(*s, _mm256_mul_ps(a, _mm256_loadu_ps(x.as_ptr().add(c + 8 * l))));
            }
        }
        for (l, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(y.as_mut_ptr().add(c + 8 * l), *a);
        }
        c += 32;
    }
    while c < full {
        let mut acc = _mm256_loadu_ps(y.as_ptr().add(c));
        for (a, x) in w.iter().zip(rows) {
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(*a), _mm256_loadu_ps(x.as_ptr().add(c))));
        }
        _mm256_storeu_ps(y.as_mut_ptr().add(c), acc);
        c += 8;
    }
    for (a, x) in w.iter().zip(rows) {
        for (o, v) in y[full..].iter_mut().zip(&x[full..]) {
            *o += a * v;
        }
    }
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

/// GPT-OSS's clamped SwiGLU of one gate and up value, in f32: the gate clamped above at 7, up
/// to ±7, `g * sigmoid(1.702 g) * (u + 1)`.
pub fn swiglu_oai(g: f32, u: f32) -> f32 {
    const ALPHA: f32 = 1.702;
    const LIMIT: f32 = 7.0;
    let g = g.min(LIMIT);
    let u = u.clamp(-LIMIT, LIMIT);
    g / (1.0 + (-ALPHA * g).exp()) * (u + 1.0)
}

/// Gemma 2's soft-cap, `c * tanh(x / c)`, in f32.
pub fn softcap(x: f32, c: f32) -> f32 {
    c * (x / c).tanh()
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
    moe_route_limited(logits, n, k, sigmoid, normalize, &GroupLimit::default())
}

/// DeepSeek V3's additions to the routing: a bias on the scores for the choice only, the choice
/// limited to the best `groups[1]` of `groups[0]` groups (each ranked by its two best biased
/// scores), the chosen weights multiplied by `scale`.
#[derive(Clone, Copy, Debug)]
pub struct GroupLimit<'a> {
    pub bias: Option<&'a [f32]>,
    pub groups: Option<[usize; 2]>,
    pub scale: f32,
}

impl Default for GroupLimit<'_> {
    fn default() -> Self {
        GroupLimit { bias: None, groups: None, scale: 1.0 }
    }
}

/// [`moe_route`] with DeepSeek's group limit, choice bias and scale.
pub fn moe_route_limited(logits: &[f32], n: usize, k: usize, sigmoid: bool, normalize: bool, limit: &GroupLimit) -> (Vec<u32>, Vec<f32>) {
    let (mut ids, mut ws) = (Vec::new(), Vec::new());
    for row in logits.chunks(n) {
        let p: Vec<f32> = if sigmoid { row.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect() } else { softmax(row) };
        let mut choice = p.clone();
        if let Some(b) = limit.bias {
            choice.iter_mut().zip(b).for_each(|(c, b)| *c += b);
        }
        if let Some([g, keep]) = limit.groups.filter(|[g, _]| *g > 0 && n.is_multiple_of(*g)) {
            let per = n / g;
            let best: Vec<f32> = choice.chunks(per).map(|c| top_k(c, 2).iter().map(|&i| c[i as usize]).sum()).collect();
            let kept = top_k(&best, keep);
            for (gi, c) in choice.chunks_mut(per).enumerate() {
                if !kept.contains(&(gi as u32)) {
                    c.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
                }
            }
        }
        let sel = top_k(&choice, k);
        let mut w: Vec<f32> = sel.iter().map(|&e| p[e as usize]).collect();
        if normalize {
            let s: f32 = w.iter().sum();
            w.iter_mut().for_each(|v| *v /= s);
        }
        w.iter_mut().for_each(|v| *v *= limit.scale);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic value in [-1.5, 1.5) for index `i` of input `salt`.
    fn val(i: usize, salt: usize) -> f32 {
        (((i * 2654435761 + salt * 40503) % 10007) as f32 / 10007.0 - 0.5) * 3.0
    }

    /// Keys and values of `n` values each.
    fn cache(n: usize) -> (Vec<f32>, Vec<f32>) {
        ((0..n).map(|i| val(i, 2)).collect(), (0..n).map(|i| val(i, 3)).collect())
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|x| x.to_bits()).collect()
    }

    /// An f16 cache holds half the bytes and gives the same bits as the same rounded values held
    /// in f32 (widening f16 is exact), for GQA, a sliding window and several query positions.
    #[test]
    fn attention_over_an_f16_cache_equals_the_rounded_f32_cache() {
        let (nh, nkv, hd, len) = (6, 2, 40, 13);
        let q: Vec<f32> = (0..3 * nh * hd).map(|i| val(i, 1)).collect();
        let (k, v) = cache(len * nkv * hd);
        let half = |x: &[f32]| -> Vec<half::f16> { x.iter().map(|v| half::f16::from_f32(*v)).collect() };
        let (kh, vh) = (half(&k), half(&v));
        let (kr, vr): (Vec<f32>, Vec<f32>) = (kh.iter().map(|x| x.to_f32()).collect(), vh.iter().map(|x| x.to_f32()).collect());
        assert!(kr != k, "the inputs must need rounding for the test to mean anything");
        for window in [0, 4] {
            let c = AttnCfg { n_head: nh, n_head_kv: nkv, head_dim: hd, window, sinks: None, softcap: 0.0, scale: 1.0 / (hd as f32).sqrt() };
            let pos = [5, 11, 12];
            let want = attention(&q, &pos, &kr, &vr, len, &c).unwrap();
            let got = attention(&q, &pos, &kh, &vh, len, &c).unwrap();
            assert_eq!(bits(&got), bits(&want), "window {window}");
            // Keys and values each in its own format (`cpu:kv-f16-f32`, `cpu:kv-f32-f16`).
            assert_eq!(bits(&attention(&q, &pos, &kh, &v, len, &c).unwrap()), bits(&attention(&q, &pos, &kr, &v, len, &c).unwrap()), "f16 keys, window {window}");
            assert_eq!(bits(&attention(&q, &pos, &k, &vh, len, &c).unwrap()), bits(&attention(&q, &pos, &k, &vr, len, &c).unwrap()), "f16 values, window {window}");
        }
        assert_eq!(std::mem::size_of_val(kh.as_slice()) * 2, std::mem::size_of_val(k.as_slice()));
    }

    /// A cache held in pages of 1, 2, 4, 8 or 16 rows (the last partial) gives the bits of the
    /// same rows held contiguous; pages that hold fewer rows than attended to are an error.
    #[test]
    fn attention_over_pages_equals_attention_over_contiguous_rows() {
        let (nh, nkv, hd, len) = (4, 2, 24, 21);
        let pos = [0, 7, 16, 20];
        let q: Vec<f32> = (0..pos.len() * nh * hd).map(|i| val(i, 1)).collect();
        let (k, v) = cache(len * nkv * hd);
        let row = nkv * hd;
        for window in [0, 6] {
            let c = AttnCfg { n_head: nh, n_head_kv: nkv, head_dim: hd, window, sinks: None, softcap: 0.0, scale: 1.0 / (hd as f32).sqrt() };
            let want = attention(&q, &pos, &k, &v, len, &c).unwrap();
            for shift in 0..5u32 {
                let (kp, vp): (Vec<&[f32]>, Vec<&[f32]>) = (k.chunks(row << shift).collect(), v.chunks(row << shift).collect());
                let got = attention_paged(&q, &pos, Pages::paged(&kp, shift), Pages::paged(&vp, shift), len, &c).unwrap();
                assert_eq!(bits(&got), bits(&want), "pages of {} rows, window {window}", 1 << shift);
                let short = &kp[..kp.len() - 1];
                assert!(attention_paged(&q, &pos, Pages::paged(short, shift), Pages::paged(&vp, shift), len, &c).unwrap_err().contains("the cache holds"));
            }
        }
    }

    /// Queries attended together (blocks of positions sharing each key and value row, a partial
    /// last block, GQA, a sliding window) give each query the bits it gets alone.
    #[test]
    fn queries_attended_together_get_the_bits_of_each_alone() {
        let (nh, nkv, hd, len) = (6, 2, 24, 23);
        let pos: Vec<usize> = vec![0, 3, 4, 9, 10, 11, 15, 22, 17];
        let q: Vec<f32> = (0..pos.len() * nh * hd).map(|i| val(i, 1)).collect();
        let (k, v) = cache(len * nkv * hd);
        for window in [0, 5] {
            let c = AttnCfg { n_head: nh, n_head_kv: nkv, head_dim: hd, window, sinks: None, softcap: 0.0, scale: 1.0 / (hd as f32).sqrt() };
            let together = attention(&q, &pos, &k, &v, len, &c).unwrap();
            let alone: Vec<f32> = pos.iter().enumerate().flat_map(|(t, p)| attention(&q[t * nh * hd..(t + 1) * nh * hd], &[*p], &k, &v, len, &c).unwrap()).collect();
            assert_eq!(bits(&together), bits(&alone), "window {window}");
            assert!(together.iter().all(|x| x.is_finite()) && together.iter().any(|x| *x != 0.0));
        }
    }

    /// Attention as the plain loops say it (per query: scaled `dot_f32` scores in row order, the
    /// softmax, then the value rows added in order, a multiply then an add per element) has the
    /// bits of `attention`, whose AVX2 body scores four keys and adds eight value rows at a time.
    /// Head sizes with and without 32-wide blocks, single 8-wide chunks and a scalar tail; f32
    /// and f16 caches; a sliding window.
    #[test]
    fn attention_has_the_bits_of_the_plain_loops() {
        #[cfg(target_arch = "x86_64")]
        eprintln!("AVX2 body {}", if crate::shared::qdot::has_avx2() { "checked" } else { "absent: portable body checked" });
        for (hd, window) in [(64, 0), (20, 0), (40, 7), (3, 0)] {
            let (nh, nkv, len) = (4, 2, 29);
            let pos: Vec<usize> = vec![0, 1, 2, 13, 14, 28, 27, 26, 25, 9];
            let q: Vec<f32> = (0..pos.len() * nh * hd).map(|i| val(i, 1)).collect();
            let (k, v) = cache(len * nkv * hd);
            let (kh, vh): (Vec<half::f16>, Vec<half::f16>) = (k.iter().map(|x| half::f16::from_f32(*x)).collect(), v.iter().map(|x| half::f16::from_f32(*x)).collect());
            let (kr, vr): (Vec<f32>, Vec<f32>) = (kh.iter().map(|x| x.to_f32()).collect(), vh.iter().map(|x| x.to_f32()).collect());
            let c = AttnCfg { n_head: nh, n_head_kv: nkv, head_dim: hd, window, sinks: None, softcap: 0.0, scale: 1.0 / (hd as f32).sqrt() };
            let plain = |k: &[f32], v: &[f32]| -> Vec<u32> {
                let mut out = vec![0.0f32; pos.len() * nh * hd];
                for (t, &p) in pos.iter().enumerate() {
                    for h in 0..nh {
                        let first = if window > 0 { (p + 1).saturating_sub(window) } else { 0 };
                        let at = |j: usize| j * nkv * hd + (h / (nh / nkv)) * hd;
                        let qv = &q[(t * nh + h) * hd..][..hd];
                        let scores: Vec<f32> = (first..=p).map(|j| dot_f32_impl(qv, &k[at(j)..][..hd]) * (1.0 / (hd as f32).sqrt())).collect();
                        let o = &mut out[(t * nh + h) * hd..][..hd];
                        for (j, w) in (first..=p).zip(softmax(&scores)) {
                            for (o, x) in o.iter_mut().zip(&v[at(j)..][..hd]) {
                                *o += w * x;
                            }
                        }
                    }
                }
                bits(&out)
            };
            assert_eq!(bits(&attention(&q, &pos, &k, &v, len, &c).unwrap()), plain(&k, &v), "f32 cache, hd {hd}, window {window}");
            assert_eq!(bits(&attention(&q, &pos, &kh, &vh, len, &c).unwrap()), plain(&kr, &vr), "f16 cache, hd {hd}, window {window}");
        }
    }

    /// The tiled transpose moves every value to its place for shapes that fill no tile, several
    /// and a partial one.
    #[test]
    fn transpose_puts_every_value_in_its_place() {
        for (n, m) in [(1, 3), (5, 2), (16, 16), (37, 53), (576, 19)] {
            let y_t: Vec<f32> = (0..n * m).map(|i| i as f32).collect();
            let y = transpose(&y_t, n, m);
            for r in 0..n {
                for t in 0..m {
                    assert_eq!(y[t * n + r], y_t[r * m + t], "n {n} m {m} r {r} t {t}");
                }
            }
        }
    }
}
