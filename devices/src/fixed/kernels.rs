//! The integer kernels of `fixed`: Q formats, exp and sigmoid, the matrix product, RMSNorm,
//! RoPE, softmax and attention, each in exact integer arithmetic with one rounding where it says.

use crate::shared::qdot;
use oracle::quant::GgmlType;
use oracle::spec::{RopeSpec, RopeStyle};

pub const ACT: u32 = 16;
pub const WGT: u32 = 24;
pub const NORM: u32 = 20;
pub const TABLE: u32 = 30;
pub const INT4_GROUP: usize = 32;
/// Declared absolute error of `exp_q16` and `sigmoid_q16` on their Q16 outputs.
pub const EXP_ABS: f64 = 2.0 / 65536.0;

/// Round-half-away-from-zero conversion to fixed point.
pub fn to_q(x: f64, frac: u32) -> i64 {
    (x * (1u64 << frac) as f64).round() as i64
}

pub fn from_q(v: i64, frac: u32) -> f32 {
    (v as f64 / (1u64 << frac) as f64) as f32
}

/// Arithmetic shift right with rounding to nearest (ties away from zero).
#[inline]
pub fn shr_round(v: i128, s: u32) -> i64 {
    if s == 0 {
        return v as i64;
    }
    let half = 1i128 << (s - 1);
    (if v >= 0 { (v + half) >> s } else { -((-v + half) >> s) }) as i64
}

/// Integer square root (floor) by Newton's method.
pub fn isqrt(n: u128) -> u128 {
    if n < 2 {
        return n;
    }
    let mut x = 1u128 << ((128 - n.leading_zeros()).div_ceil(2));
    loop {
        let y = (x + n / x) / 2;
        if y >= x {
            return x;
        }
        x = y;
    }
}

/// exp(z) for z <= 0, z and result in Q16: 2^(z log2 e) = 2^-k * 2^f, with 2^f (f in [0,1)) from a
/// Q30 Taylor series of 9 terms (truncation < 1e-7) and one rounding to Q16.
pub fn exp_q16(z: i64) -> i64 {
    let (k, acc) = exp2_parts(z.min(0), ACT);
    if k >= 40 {
        return 0;
    }
    shr_round(acc as i128, (30 - ACT as i128 + k) as u32)
}

/// exp(z) for z <= 0, z and result in Q30 ([`exp_q16`]'s series, rounded once to Q30).
pub fn exp_q30(z: i64) -> i64 {
    let (k, acc) = exp2_parts(z.min(0), 30);
    if k >= 62 {
        return 0;
    }
    shr_round(acc as i128, k as u32)
}

/// exp(z) (z <= 0, `frac` fractional bits) as 2^-k * 2^f: k, and 2^f in Q30.
fn exp2_parts(z: i64, frac: u32) -> (i128, i64) {
    // t = z * log2(e) in Q30.
    const LOG2E_Q30: i128 = 1_549_082_005; // round(log2(e) * 2^30)
    let t = ((z as i128) * LOG2E_Q30) >> frac; // Q30, <= 0
    let k = (-t) >> 30; // integer part of -t
    let k = if ((-t) & ((1 << 30) - 1)) != 0 { k + 1 } else { k };
    let f = t + (k << 30); // in [0, 2^30)
    // 2^f = e^(f ln 2): Horner over the Taylor series in Q30.
    const LN2_Q30: i128 = 744_261_118; // round(ln 2 * 2^30)
    // y < 2^30 and acc < 2^31 (2^f < 2), so every product stays under 2^61: i64 is exact.
    let y = ((f * LN2_Q30) >> 30) as i64;
    // Horner from the 9th term down, each divisor a constant (a multiply, not a division).
    fn term<const N: i64>(acc: i64, y: i64) -> i64 {
        (1 << 30) + ((acc * y) >> 30) / N
    }
    (k, term::<1>(term::<2>(term::<3>(term::<4>(term::<5>(term::<6>(term::<7>(term::<8>(term::<9>(1 << 30, y), y), y), y), y), y), y), y), y))
}

/// sigmoid(x) in Q16 from the integer exp, using the symmetry for negative inputs.
pub fn sigmoid_q16(x: i64) -> i64 {
    let one = 1i64 << ACT;
    let e = exp_q16(-x.abs()); // in (0, 1]
    let pos = (one << ACT) / (one + e); // 1 / (1 + e^-|x|): 2^32 / (2^16 + e), exact in i64
    if x >= 0 {
        pos
    } else {
        one - pos
    }
}

pub fn silu_q16(x: i64) -> i64 {
    shr_round(x as i128 * sigmoid_q16(x) as i128, ACT)
}

/// GELU's tanh approximation as `x * sigmoid(2z)`, `z = sqrt(2/pi) (x + 0.044715 x^3)` (since
/// `(1 + tanh z) / 2 = sigmoid(2z)`): the cube in 128 bits, the constants in Q30, the sigmoid
/// the integer one above.
pub fn gelu_q16(x: i64) -> i64 {
    const C1: f64 = 2.0 * 0.797_884_560_802_865_4;
    let (c1, c3) = (to_q(C1, TABLE) as i128, to_q(C1 * 0.044_715, TABLE) as i128);
    let x = x as i128;
    // x^3 in Q16; the product saturates far past where the sigmoid has reached 0 or 1.
    let cube = (x * x).checked_mul(x).map_or(if x < 0 { i128::MIN / 4 } else { i128::MAX / 4 }, |c| c >> (2 * ACT));
    let z = (c1 * x).saturating_add(c3.saturating_mul(cube)) >> TABLE;
    let z = z.clamp(i64::MIN as i128 / 2, i64::MAX as i128 / 2) as i64;
    shr_round(x * sigmoid_q16(z) as i128, ACT)
}

/// The gated unit of the model's FFN in Q16: act(gate) * up, or GPT-OSS's clamped SwiGLU
/// (gate clamped above at 7, up to ±7, `g * sigmoid(1.702 g) * (u + 1)`, 1.702 in Q16).
pub fn glu_q16(act: oracle::spec::Activation, g: i64, u: i64) -> i64 {
    let gated = |a: i64, b: i64| shr_round(a as i128 * b as i128, ACT);
    match act {
        oracle::spec::Activation::Silu => gated(silu_q16(g), u),
        oracle::spec::Activation::GeluTanh => gated(gelu_q16(g), u),
        oracle::spec::Activation::SwigluOai => {
            let (one, limit) = (1i64 << ACT, 7i64 << ACT);
            const ALPHA_Q16: i64 = 111_543; // round(1.702 * 2^16)
            let g = g.min(limit);
            let a = gated(g, sigmoid_q16(gated(g, ALPHA_Q16)));
            gated(a, u.clamp(-limit, limit) + one)
        }
    }
}

/// Integer values (Q24 weights, the Q16 embedding table): 32-bit while every value fits (the
/// declared I32 storage, and half the bytes to stream), 64-bit from the first that does not, so
/// a weight of magnitude 128 or more (an embedding value of 32,768 or more) keeps its exact value.
pub enum IntValues {
    Narrow(Vec<i32>),
    Wide(Vec<i64>),
}

impl IntValues {
    pub(crate) fn with_capacity(n: usize) -> IntValues {
        IntValues::Narrow(Vec::with_capacity(n))
    }

    /// Appends `row`, first widening everything held when a value does not fit 32 bits.
    pub(crate) fn push_row(&mut self, row: &[i64]) {
        if let IntValues::Narrow(n) = self {
            if max_abs(row) > i32::MAX as u64 {
                *self = IntValues::Wide(n.iter().map(|v| *v as i64).collect());
            }
        }
        match self {
            IntValues::Narrow(n) => n.extend(row.iter().map(|v| *v as i32)),
            IntValues::Wide(n) => n.extend_from_slice(row),
        }
    }

    /// Appends values `range` to `out` as i64.
    pub(crate) fn extend_into(&self, range: std::ops::Range<usize>, out: &mut Vec<i64>) {
        match self {
            IntValues::Narrow(n) => out.extend(n[range].iter().map(|v| *v as i64)),
            IntValues::Wide(n) => out.extend_from_slice(&n[range]),
        }
    }
}

/// The weights of a matrix in the device's formats: Q24 per value (with the largest magnitude,
/// which bounds the products), or INT4 values with one Q24 scale per group.
pub enum FixedWeights {
    Q24 { rows: usize, cols: usize, w: IntValues, max_abs: u64 },
    Int4 { rows: usize, cols: usize, q: Vec<i8>, scale: Vec<i64> },
}

impl FixedWeights {
    pub fn dims(&self) -> (usize, usize) {
        match self {
            FixedWeights::Q24 { rows, cols, .. } | FixedWeights::Int4 { rows, cols, .. } => (*rows, *cols),
        }
    }
}

/// Host-side conversion of a packed row to the device's formats (the model loader's job).
pub fn convert_weights(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8], int4: bool) -> FixedWeights {
    let row_bytes = bytes.len() / rows.max(1);
    let mut vals = vec![0.0f32; cols];
    let mut row_q = vec![0i64; cols];
    let mut w = IntValues::with_capacity(if int4 { 0 } else { rows * cols });
    let mut max_abs = 0u64;
    let (mut q, mut scale) = (Vec::new(), Vec::new());
    for r in 0..rows {
        let rb = &bytes[r * row_bytes..(r + 1) * row_bytes];
        if qdot::is_float(ty) {
            qdot::float_row(ty, rb, &mut vals);
        } else {
            qdot::dequantize_row(ty, rb, &mut vals);
        }
        if int4 {
            for g in vals.chunks(INT4_GROUP) {
                let (gq, gs) = int4_group(g);
                q.extend(gq);
                scale.push(gs);
            }
            continue;
        }
        row_q.iter_mut().zip(&vals).for_each(|(o, v)| *o = to_q(*v as f64, WGT));
        max_abs = max_abs.max(self::max_abs(&row_q));
        w.push_row(&row_q);
    }
    if int4 {
        FixedWeights::Int4 { rows, cols, q, scale }
    } else {
        FixedWeights::Q24 { rows, cols, w, max_abs }
    }
}

/// Symmetric INT4 quantization of one group: scale = amax / 7 in Q24, q = round(x / scale) in
/// -7..=7. Returns (q, scale_q24). The tolerance rule re-derives exactly this.
pub fn int4_group(g: &[f32]) -> (Vec<i8>, i64) {
    let amax = g.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
    let scale = to_q(amax / 7.0, WGT);
    let s = scale as f64 / (1u64 << WGT) as f64;
    let q = g.iter().map(|v| if s > 0.0 { (*v as f64 / s).round().clamp(-7.0, 7.0) as i8 } else { 0 }).collect();
    (q, scale)
}

/// Weight rows per parallel task of `matmul_q`: each task takes its rows (a few KiB each, kept in
/// cache) through every token.
const ROWS_PER_TASK: usize = 16;

/// An activation row narrowed to 32 bits, with its largest magnitude; None when a value does not
/// fit (that row then takes the 128-bit products).
fn narrow_row(x: &[i64]) -> Option<(Vec<i32>, u64)> {
    let m = max_abs(x);
    (m <= i32::MAX as u64).then(|| (x.iter().map(|v| *v as i32).collect(), m))
}

/// The largest magnitude in `x` (what bounds every product it takes part in).
pub(super) fn max_abs(x: &[i64]) -> u64 {
    x.iter().fold(0u64, |m, v| m.max(v.unsigned_abs()))
}

/// `y = x W^T` with Q16 activations: exact integer products and sums, one rounding to Q16.
///
/// Every sum is the exact integer sum, so the order and width in which it is formed cannot change
/// a bit. Where activations and weights fit in 32 bits, products are formed in 64 bits and summed
/// in 64 bits over runs short enough that no partial sum can overflow (the run length comes from
/// the two largest magnitudes), the runs then added in 128 bits; otherwise every product and sum
/// is 128-bit. Rows are split over threads, so one token's rows run in parallel.
pub fn matmul_q(x: &[i64], m: usize, w: &FixedWeights) -> Vec<i64> {
    use rayon::prelude::*;
    let (rows, cols) = w.dims();
    let narrow: Vec<Option<(Vec<i32>, u64)>> = (0..m).map(|t| narrow_row(&x[t * cols..(t + 1) * cols])).collect();
    let avx2 = has_avx2();
    let dot = |t: usize, r: usize| -> i64 {
        let xt = &x[t * cols..(t + 1) * cols];
        let acc = match (w, &narrow[t]) {
            (FixedWeights::Q24 { w: IntValues::Narrow(w), max_abs, .. }, Some((x32, x_max))) => {
                let run = exact_run(*x_max, *max_abs, cols);
                let wr = &w[r * cols..(r + 1) * cols];
                x32.chunks(run).zip(wr.chunks(run)).map(|(a, b)| dot_i32(a, b, avx2) as i128).sum()
            }
            (FixedWeights::Q24 { w: IntValues::Narrow(w), .. }, None) => wide_dot(xt, &w[r * cols..(r + 1) * cols]),
            (FixedWeights::Q24 { w: IntValues::Wide(w), .. }, _) => wide_dot(xt, &w[r * cols..(r + 1) * cols]),
            (FixedWeights::Int4 { q, scale, .. }, x32) => {
                let groups = cols / INT4_GROUP;
                let mut acc: i128 = 0;
                for g in 0..groups {
                    let qs = &q[r * cols + g * INT4_GROUP..r * cols + (g + 1) * INT4_GROUP];
                    // A group of 32 products of a 32-bit value and |q| <= 7 stays under 2^39.
                    let s: i128 = match x32 {
                        Some((x32, _)) => x32[g * INT4_GROUP..(g + 1) * INT4_GROUP].iter().zip(qs).map(|(a, b)| *a as i64 * *b as i64).sum::<i64>() as i128,
                        None => wide_dot(&xt[g * INT4_GROUP..(g + 1) * INT4_GROUP], qs),
                    };
                    acc += s * scale[r * groups + g] as i128;
                }
                acc
            }
        };
        shr_round(acc, WGT)
    };
    // Outputs by row (`[rows, m]`), then transposed to `[m, rows]`.
    let mut by_row = vec![0i64; rows * m];
    by_row.par_chunks_mut(ROWS_PER_TASK * m.max(1)).enumerate().for_each(|(task, block)| {
        let r0 = task * ROWS_PER_TASK;
        let n_rows = block.len() / m.max(1);
        for t in 0..m {
            for i in 0..n_rows {
                block[i * m + t] = dot(t, r0 + i);
            }
        }
    });
    if m == 1 {
        return by_row;
    }
    let mut y = vec![0i64; m * rows];
    for (r, outs) in by_row.chunks(m).enumerate() {
        for (t, v) in outs.iter().enumerate() {
            y[t * rows + r] = *v;
        }
    }
    y
}

/// The longest run of products of magnitude at most `a * b` whose sum cannot overflow an i64.
fn exact_run(a: u64, b: u64, cols: usize) -> usize {
    let bound = (a as u128 * b as u128).max(1);
    ((i64::MAX as u128 / bound).min(cols.max(1) as u128) as usize).max(1)
}

/// Sum of 128-bit products.
pub(super) fn wide_dot<A: Copy + Into<i128>, B: Copy + Into<i128>>(a: &[A], b: &[B]) -> i128 {
    a.iter().zip(b).map(|(p, q)| (*p).into() * (*q).into()).sum()
}

/// Sum of the 64-bit products of two 32-bit rows; the caller keeps the run short enough that the
/// sum cannot overflow, so the wrapping adds are exact.
fn dot_i32(a: &[i32], b: &[i32], avx2: bool) -> i64 {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: `avx2` is true only when the CPU has AVX2 (`has_avx2`).
        return unsafe { dot_i32_avx2(a, b) };
    }
    let _ = avx2;
    dot_i32_body(a, b)
}

#[inline(always)]
fn dot_i32_body(a: &[i32], b: &[i32]) -> i64 {
    let n = a.len().min(b.len());
    let mut s = 0i64;
    for i in 0..n {
        s = s.wrapping_add(a[i] as i64 * b[i] as i64);
    }
    s
}

/// The same loop compiled for AVX2 (`vpmuldq`: four 32 × 32 → 64-bit products per instruction).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_i32_avx2(a: &[i32], b: &[i32]) -> i64 {
    dot_i32_body(a, b)
}

fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    return qdot::has_avx2();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// RMSNorm in integers: mean of squares in Q32 (exact), sqrt in Q32 via an integer square root
/// of a Q64 value, inverse in Q32, then x * inv * w (Q20) rounded once to Q16.
pub fn rms_norm_q(x: &[i64], n: usize, w: &[i64], eps: f64) -> Vec<i64> {
    let eps_q32 = to_q(eps, 32) as i128;
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks(n) {
        let ss: i128 = row.iter().map(|v| *v as i128 * *v as i128).sum(); // Q32
        let mean = ss / n as i128 + eps_q32; // Q32
        let root = isqrt((mean as u128) << 32).max(1); // sqrt in Q32
        let inv = (1u128 << 64) / root; // 1/sqrt in Q32
        for (v, wi) in row.iter().zip(w) {
            y.push(shr_round(*v as i128 * inv as i128 * *wi as i128, 32 + NORM));
        }
    }
    y
}

/// RoPE with host-precomputed Q30 cos/sin tables (computed in f64 on the host, like the eBPF
/// engine's driver does).
pub fn rope_q(x: &mut [i64], pos: &[usize], n_head: usize, hd: usize, spec: &RopeSpec) {
    let half = spec.n_rot / 2;
    let neox = spec.style == RopeStyle::Neox;
    for (t, &p) in pos.iter().enumerate() {
        let table: Vec<(i64, i64)> = crate::shared::rope_table_f64(spec, p).into_iter().map(|(c, s)| (to_q(c, TABLE), to_q(s, TABLE))).collect();
        for h in 0..n_head {
            let head = &mut x[(t * n_head + h) * hd..(t * n_head + h + 1) * hd];
            for (i, &(c, s)) in table.iter().enumerate() {
                let (a, b) = if neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
                let (x0, x1) = (head[a] as i128, head[b] as i128);
                head[a] = shr_round(x0 * c as i128 - x1 * s as i128, TABLE);
                head[b] = shr_round(x0 * s as i128 + x1 * c as i128, TABLE);
            }
        }
    }
}

/// Softmax of Q16 values: integer exp of (x - max), exact integer sum, Q16 division.
pub fn softmax_q(x: &[i64]) -> Vec<i64> {
    let max = *x.iter().max().unwrap_or(&0);
    let e: Vec<i64> = x.iter().map(|v| exp_q16(v - max)).collect();
    // Each e is at most 2^16 (exp of a non-positive value): the shifted values and the sum fit
    // an i64 for any row shorter than 2^40, so the division is the exact one.
    let sum: i64 = e.iter().sum::<i64>().max(1);
    e.iter().map(|v| ((*v << ACT) + sum / 2) / sum).collect()
}

/// `a + b` with `b` repeated along `a` (a bias per row, or a residual of the same length): exact.
pub fn add_q(a: &[i64], b: &[i64]) -> Vec<i64> {
    a.iter().zip(b.iter().cycle()).map(|(x, y)| x + y).collect()
}

/// `out += w * y` in Q16 (`w` a Q16 weight), each product rounded once.
pub fn add_scaled_q(out: &mut [i64], y: &[i64], w: i64) {
    out.iter_mut().zip(y).for_each(|(a, b)| *a += shr_round(w as i128 * *b as i128, ACT));
}

/// DeepSeek V3's additions to the routing, in Q16: a bias on the scores for the choice only, the
/// choice limited to the best `groups[1]` of `groups[0]` groups (each ranked by the sum of its
/// two best biased scores), the chosen weights multiplied by a Q30 scale.
#[derive(Clone, Copy, Debug, Default)]
pub struct RouteLimitQ<'a> {
    pub bias: Option<&'a [i64]>,
    pub groups: Option<[usize; 2]>,
    pub scale_q30: Option<i64>,
}

/// MoE routing over rows of `n_expert` Q16 logits: scores by the integer softmax (or sigmoid),
/// the `k` experts of the largest logits (scores rise with the logits, and the logits hold no
/// ties the scores' rounding would make; the lower index first on a tie) or, with a choice bias
/// or groups, of the largest (biased) scores, within the kept groups; their scores as
/// weights, divided by their sum (Q16, rounded) where `normalize`, then scaled. Returns the ids,
/// the weights and every score (`[rows, n_expert]`).
pub fn moe_route_q(logits: &[i64], n_expert: usize, k: usize, sigmoid: bool, normalize: bool, limit: &RouteLimitQ) -> (Vec<u32>, Vec<i64>, Vec<i64>) {
    let (mut ids, mut weights, mut probs) = (Vec::new(), Vec::new(), Vec::with_capacity(logits.len()));
    let ranked = |x: &[i64]| -> Vec<usize> {
        let mut order: Vec<usize> = (0..x.len()).collect();
        order.sort_by(|a, b| x[*b].cmp(&x[*a]).then(a.cmp(b)));
        order
    };
    for row in logits.chunks(n_expert.max(1)) {
        let p: Vec<i64> = if sigmoid { row.iter().map(|l| sigmoid_q16(*l)).collect() } else { softmax_q(row) };
        // The logits rank as the scores do; a bias or a group's sum needs the scores themselves.
        let mut choice: Vec<i64> = match (limit.bias, limit.groups) {
            (None, None) => row.to_vec(),
            (b, _) => p.iter().zip(b.unwrap_or(&[]).iter().chain(std::iter::repeat(&0))).map(|(p, b)| p + b).collect(),
        };
        if let Some([g, keep]) = limit.groups.filter(|[g, _]| *g > 0 && row.len().is_multiple_of(*g)) {
            let per = row.len() / g;
            let best: Vec<i64> = choice.chunks(per).map(|c| ranked(c).iter().take(2).map(|&i| c[i]).sum()).collect();
            let kept = ranked(&best);
            for (gi, c) in choice.chunks_mut(per).enumerate() {
                if !kept[..keep.min(kept.len())].contains(&gi) {
                    c.iter_mut().for_each(|v| *v = i64::MIN);
                }
            }
        }
        let order = ranked(&choice);
        let chosen = &order[..k.min(row.len())];
        let sum: i64 = chosen.iter().map(|e| p[*e]).sum::<i64>().max(1);
        for e in chosen {
            ids.push(*e as u32);
            let w = if normalize { ((p[*e] << ACT) + sum / 2) / sum } else { p[*e] };
            weights.push(limit.scale_q30.map_or(w, |s| shr_round(w as i128 * s as i128, TABLE)));
        }
        probs.extend(p);
    }
    (ids, weights, probs)
}

/// Latent attention (DeepSeek MLA) in the absorbed form, in integers: for each query (`q: [m,
/// n_head * (qk_nope + qk_rope)]`, Q16, rotated, at positions `pos`) and head, the unrotated part
/// taken into the latent's space through the head's key rows (`k_b: [n_head][qk_nope][kv_lora_rank]`,
/// Q24; exact, then rounded once to Q32), scored against the cached latents (`[len,
/// kv_lora_rank]`, Q16) plus the rotated part against the shared rotated keys (`[len, qk_rope]`,
/// Q16), exactly, the scaled score rounded once to Q16; the integer softmax; the weighted sum of
/// latents (exact, Q32) taken out through the head's value rows (`v_b: [n_head][v_head_dim]
/// [kv_lora_rank]`, Q24), rounded once to Q16. Every score is the materialized form's up to the
/// Q32 rounding of the absorbed query. `[m, n_head * v_head_dim]`.
pub fn mla_attention_q(q: &[i64], pos: &[usize], (latent, k_pe): (&[i64], &[i64]), (k_b, v_b): (&[i64], &[i64]), b: &oracle::spec::MlaBlock, scale: f64) -> Vec<i64> {
    use rayon::prelude::*;
    let (nh, nope, rr, r, vd) = (b.n_head, b.qk_nope, b.qk_rope, b.kv_lora_rank, b.v_head_dim);
    let hd = nope + rr;
    let scale_q30 = to_q(scale, TABLE) as i128;
    let mut out = vec![0i64; pos.len() * nh * vd];
    out.par_chunks_mut(vd.max(1)).enumerate().for_each(|(th, o)| {
        let (t, h) = (th / nh, th % nh);
        let (q_nope, q_pe) = q[(t * nh + h) * hd..(t * nh + h + 1) * hd].split_at(nope);
        let mut q_abs = vec![0i128; r]; // Q40
        for (qc, row) in q_nope.iter().zip(k_b[h * nope * r..(h + 1) * nope * r].chunks_exact(r.max(1))) {
            q_abs.iter_mut().zip(row).for_each(|(a, w)| *a += *qc as i128 * *w as i128);
        }
        let q_abs: Vec<i64> = q_abs.into_iter().map(|a| shr_round(a, WGT - 16)).collect(); // Q32
        let keys = pos[t] + 1;
        let scores: Vec<i64> = (0..keys)
            .map(|j| {
                let lat = wide_dot(&q_abs, &latent[j * r..(j + 1) * r]); // Q48
                let pe = wide_dot(q_pe, &k_pe[j * rr..(j + 1) * rr]); // Q32
                shr_round((lat + (pe << 16)) * scale_q30, 48 + TABLE - ACT)
            })
            .collect();
        let probs = softmax_q(&scores);
        let mut ctx = vec![0i128; r]; // Q32
        for (p, j) in probs.iter().zip(0..keys) {
            ctx.iter_mut().zip(&latent[j * r..(j + 1) * r]).for_each(|(c, l)| *c += *p as i128 * *l as i128);
        }
        for (o, row) in o.iter_mut().zip(v_b[h * vd * r..(h + 1) * vd * r].chunks_exact(r.max(1))) {
            *o = shr_round(row.iter().zip(&ctx).map(|(w, c)| *w as i128 * c).sum(), WGT + 32 - ACT);
        }
    });
    out
}

/// Masked positions (-inf in the case) are represented by this sentinel and excluded.
pub(crate) const MASKED: i64 = i64::MIN;

/// `cap * tanh(x / cap)` in Q16, as `cap * (2 sigmoid(2x / cap) - 1)`: `2 / cap` a Q30 host
/// constant, the argument rounded to Q16, the integer sigmoid, the product rounded once.
#[derive(Clone, Copy, Debug)]
pub struct SoftcapQ {
    /// The cap in Q16.
    cap: i64,
    /// 2 / cap in Q30.
    two_over_cap: i64,
}

impl SoftcapQ {
    pub fn new(cap: f64) -> SoftcapQ {
        SoftcapQ { cap: to_q(cap, ACT), two_over_cap: to_q(2.0 / cap, TABLE) }
    }
    pub fn apply(self, x: i64) -> i64 {
        let z = shr_round(x as i128 * self.two_over_cap as i128, TABLE);
        shr_round(self.cap as i128 * (2 * sigmoid_q16(z) - (1i64 << ACT)) as i128, ACT)
    }
}

/// What attention adds to its scores beyond the plain softmax: a soft-cap (Gemma 2) and a sink
/// logit per query head in Q16 (GPT-OSS).
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnExtras<'a> {
    /// The scores' scale where it is not 1/sqrt(head_dim) (Gemma's `query_pre_attn_scalar`).
    pub scale: Option<f64>,
    pub sinks: Option<&'a [i64]>,
    pub softcap: Option<SoftcapQ>,
}

pub fn attention_q(q: &[i64], pos: &[usize], k: &[i64], v: &[i64], nh: usize, nkv: usize, hd: usize, window: usize, extras: &AttnExtras) -> Vec<i64> {
    use rayon::prelude::*;
    // 1/sqrt(hd) in Q30 (host constant).
    let scale_q30 = to_q(extras.scale.unwrap_or(1.0 / (hd as f64).sqrt()), 30) as i128;
    let group = nh / nkv;
    // Exact integer sums in 64 bits where the largest magnitudes prove no partial sum can
    // overflow (a score sums hd products of at most q_max * k_max), else in 128 bits.
    let (k_max, v_max) = (max_abs(k) as u128, max_abs(v) as u128);
    let scores_fit = (max_abs(q) as u128).checked_mul(k_max).and_then(|b| b.checked_mul(hd as u128)).is_some_and(|b| b <= i64::MAX as u128);
    let mut out = vec![0i64; pos.len() * nh * hd];
    out.par_chunks_mut(hd.max(1)).enumerate().for_each(|(i, o)| {
        let (t, h) = (i / nh, i % nh);
        let p = pos[t];
        let first = if window > 0 { (p + 1).saturating_sub(window) } else { 0 };
        let kvh = h / group;
        let qh = &q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
        let scores: Vec<i64> = (first..=p)
            .map(|j| {
                let kj = &k[(j * nkv + kvh) * hd..(j * nkv + kvh + 1) * hd];
                let dot: i128 = if scores_fit { qh.iter().zip(kj).map(|(a, b)| a * b).sum::<i64>() as i128 } else { wide_dot(qh, kj) }; // Q32
                let s = shr_round(dot * scale_q30, 30 + ACT); // Q16
                extras.softcap.map_or(s, |c| c.apply(s))
            })
            .chain(extras.sinks.map(|s| s[h]))
            .collect();
        // With a sink, its probability is the last one; the zip with the keys below leaves it.
        let probs = softmax_q(&scores);
        // Probabilities are non-negative, so |sum_j p_j v_j| <= (sum_j p_j) * v_max bounds every
        // partial sum of every output.
        let p_sum: u128 = probs.iter().map(|p| *p as u128).sum();
        let row = |j: usize| &v[(j * nkv + kvh) * hd..(j * nkv + kvh + 1) * hd];
        if p_sum.checked_mul(v_max).is_some_and(|b| b <= i64::MAX as u128) {
            let mut acc = vec![0i64; hd];
            for (pj, j) in probs.iter().zip(first..=p) {
                for (a, vd) in acc.iter_mut().zip(row(j)) {
                    *a += pj * vd;
                }
            }
            o.iter_mut().zip(&acc).for_each(|(o, a)| *o = shr_round(*a as i128, ACT));
        } else {
            let mut acc = vec![0i128; hd];
            for (pj, j) in probs.iter().zip(first..=p) {
                for (a, vd) in acc.iter_mut().zip(row(j)) {
                    *a += *pj as i128 * *vd as i128;
                }
            }
            o.iter_mut().zip(&acc).for_each(|(o, a)| *o = shr_round(*a, ACT));
        }
    });
    out
}
