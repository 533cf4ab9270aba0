//! `fixed` and `fixed-int4`: an integer-only engine in the style of the eBPF forward pass our
//! users build. Activations are Q16 integers, matrix weights Q24 (or group-wise INT4 with a Q24
//! scale per group of 32 in `fixed-int4`), norm scales Q20, RoPE cos/sin from host-precomputed
//! Q30 tables; exp, sigmoid and the RMSNorm inverse square root are integer approximations;
//! argmax compares integers. Floats appear only at the boundary: inputs are converted to Q16
//! and results back to f32 for the comparison.
//!
//! Ops without an integer kernel here (layer_norm, gelu, geglu, swiglu_oai, moe_route, top_k, sample) are
//! reported as unsupported.

use crate::cpu::qdot;
use crate::{fail, Arithmetic, Device, DeviceError, FixedPoint, NumFormat, Support};
use oracle::quant::GgmlType;
use oracle::registry::{Op, Input, OpCase, Output, Tensor};
use oracle::spec::{RopeSpec, RopeStyle};

pub const ACT: u32 = 16;
pub const WGT: u32 = 24;
pub const NORM: u32 = 20;
pub const TABLE: u32 = 30;
pub const INT4_GROUP: usize = 32;
/// Declared absolute error of `exp_q16` and `sigmoid_q16` on their Q16 outputs.
pub const EXP_ABS: f64 = 2.0 / 65536.0;

pub struct FixedDevice {
    pub int4: bool,
}

impl FixedDevice {
    pub fn point(&self) -> FixedPoint {
        FixedPoint { act_frac: ACT, weight_frac: WGT, norm_frac: NORM, table_frac: TABLE, exp_abs: EXP_ABS, int4_group: self.int4.then_some(INT4_GROUP) }
    }
}

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
    if z > 0 {
        return exp_q16(0);
    }
    // t = z * log2(e) in Q30.
    const LOG2E_Q30: i128 = 1_549_082_005; // round(log2(e) * 2^30)
    let t = ((z as i128) * LOG2E_Q30) >> ACT; // Q30, <= 0
    let k = (-t) >> 30; // integer part of -t
    let k = if ((-t) & ((1 << 30) - 1)) != 0 { k + 1 } else { k };
    let f = t + (k << 30); // in [0, 2^30)
    if k >= 40 {
        return 0;
    }
    // 2^f = e^(f ln 2): Horner over the Taylor series in Q30.
    const LN2_Q30: i128 = 744_261_118; // round(ln 2 * 2^30)
    // y < 2^30 and acc < 2^31 (2^f < 2), so every product stays under 2^61: i64 is exact.
    let y = ((f * LN2_Q30) >> 30) as i64;
    // Horner from the 9th term down, each divisor a constant (a multiply, not a division).
    fn term<const N: i64>(acc: i64, y: i64) -> i64 {
        (1 << 30) + ((acc * y) >> 30) / N
    }
    let acc = term::<1>(term::<2>(term::<3>(term::<4>(term::<5>(term::<6>(term::<7>(term::<8>(term::<9>(1 << 30, y), y), y), y), y), y), y), y), y);
    shr_round(acc as i128, (30 - ACT as i128 + k) as u32)
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
fn glu_q16(act: oracle::spec::Activation, g: i64, u: i64) -> i64 {
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
    fn with_capacity(n: usize) -> IntValues {
        IntValues::Narrow(Vec::with_capacity(n))
    }

    /// Appends `row`, first widening everything held when a value does not fit 32 bits.
    fn push_row(&mut self, row: &[i64]) {
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
    fn extend_into(&self, range: std::ops::Range<usize>, out: &mut Vec<i64>) {
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
fn max_abs(x: &[i64]) -> u64 {
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
fn wide_dot<A: Copy + Into<i128>, B: Copy + Into<i128>>(a: &[A], b: &[B]) -> i128 {
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
        let table: Vec<(i64, i64)> = crate::cpu::kernels::rope_table_f64(spec, p).into_iter().map(|(c, s)| (to_q(c, TABLE), to_q(s, TABLE))).collect();
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

/// Masked positions (-inf in the case) are represented by this sentinel and excluded.
const MASKED: i64 = i64::MIN;

pub fn attention_q(q: &[i64], pos: &[usize], k: &[i64], v: &[i64], nh: usize, nkv: usize, hd: usize, window: usize) -> Vec<i64> {
    use rayon::prelude::*;
    // 1/sqrt(hd) in Q30 (host constant).
    let scale_q30 = to_q(1.0 / (hd as f64).sqrt(), 30) as i128;
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
                shr_round(dot * scale_q30, 30 + ACT) // Q16
            })
            .collect();
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

fn q_in(t: &Tensor) -> Vec<i64> {
    t.data.iter().map(|v| if v.is_finite() { to_q(*v as f64, ACT) } else { MASKED }).collect()
}

fn f_out(shape: &[usize], v: &[i64]) -> Output {
    Output::F32(Tensor { shape: shape.to_vec(), data: v.iter().map(|x| from_q(*x, ACT)).collect() })
}

impl FixedDevice {
    fn run(&self, case: &OpCase) -> Result<Vec<Output>, String> {
        let e = |r: oracle::OracleError| r.to_string();
        Ok(match case.op {
            Op::Embed => {
                let t = case.f32("table").map_err(e)?;
                let ids = case.ids("ids").map_err(e)?;
                let d = t.shape[1];
                let mut v = Vec::new();
                for &id in ids {
                    let row = t.data.get(id as usize * d..(id as usize + 1) * d).ok_or("token id outside the table")?;
                    v.extend(row.iter().map(|x| to_q(*x as f64, ACT)));
                }
                vec![f_out(&[ids.len(), d], &v)]
            }
            Op::RmsNorm | Op::QkNorm => {
                let x = case.f32("x").map_err(e)?;
                let n = if case.op == Op::QkNorm { case.pu("head_dim").map_err(e)? } else { x.shape[1] };
                let w: Vec<i64> = case.f32("weight").map_err(e)?.data.iter().map(|v| to_q(*v as f64, NORM)).collect();
                let w_full: Vec<i64> = w.iter().cycle().take(n).copied().collect();
                vec![f_out(&x.shape, &rms_norm_q(&q_in(x), n, &w_full, case.p("eps").map_err(e)?))]
            }
            Op::Matmul => {
                let x = case.f32("x").map_err(e)?;
                let Some((_, Input::Quant { ty, rows, cols, bytes })) = case.inputs.iter().find(|(n, _)| *n == "w") else { return Err("no weight".into()) };
                if self.int4 && cols % INT4_GROUP != 0 {
                    return Err(format!("k = {cols} is not a multiple of the INT4 group {INT4_GROUP}"));
                }
                let w = convert_weights(*ty, *rows, *cols, bytes, self.int4);
                let (m, k, stride) = oracle::registry::view_dims(case, x);
                // Quantize the view's rows (the gap between them is never read).
                let xq: Vec<i64> = (0..m).flat_map(|r| x.data[r * stride..r * stride + k].iter().map(|v| to_q(*v as f64, ACT))).collect();
                vec![f_out(&[m, *rows], &matmul_q(&xq, m, &w))]
            }
            Op::Add | Op::AddBias => {
                let a = case.f32("a").map_err(e)?;
                let b = q_in(case.f32("b").map_err(e)?);
                let v: Vec<i64> = q_in(a).iter().zip(b.iter().cycle()).map(|(x, y)| x + y).collect();
                vec![f_out(&a.shape, &v)]
            }
            Op::Rope => {
                let x = case.f32("x").map_err(e)?;
                let pos: Vec<usize> = case.ids("pos").map_err(e)?.iter().map(|&p| p as usize).collect();
                let p = |n: &str| case.p(n).map_err(e);
                let spec = oracle::registry::rope_spec_of(case).map_err(e)?;
                let mut y = q_in(x);
                rope_q(&mut y, &pos, p("n_head")? as usize, p("head_dim")? as usize, &spec);
                vec![f_out(&x.shape, &y)]
            }
            Op::Attention => {
                let (q, k, v) = (case.f32("q").map_err(e)?, case.f32("k").map_err(e)?, case.f32("v").map_err(e)?);
                let pos: Vec<usize> = case.ids("pos").map_err(e)?.iter().map(|&p| p as usize).collect();
                let p = |n: &str| case.pu(n).map_err(e);
                let y = attention_q(&q_in(q), &pos, &q_in(k), &q_in(v), p("n_head")?, p("n_head_kv")?, p("head_dim")?, p("window")?);
                vec![f_out(&q.shape, &y)]
            }
            Op::Softmax => {
                let x = case.f32("x").map_err(e)?;
                let n = x.shape[1];
                let mut y = Vec::with_capacity(x.data.len());
                for row in q_in(x).chunks(n) {
                    let live: Vec<i64> = row.iter().copied().filter(|v| *v != MASKED).collect();
                    let p = softmax_q(&live);
                    let mut it = p.into_iter();
                    y.extend(row.iter().map(|v| if *v == MASKED { 0 } else { it.next().unwrap_or(0) }));
                }
                vec![f_out(&x.shape, &y)]
            }
            Op::Silu => {
                let g = case.f32("gate").map_err(e)?;
                vec![f_out(&g.shape, &q_in(g).into_iter().map(silu_q16).collect::<Vec<_>>())]
            }
            Op::Swiglu => {
                let g = case.f32("gate").map_err(e)?;
                let u = q_in(case.f32("up").map_err(e)?);
                let y: Vec<i64> = q_in(g).into_iter().zip(u).map(|(a, b)| shr_round(silu_q16(a) as i128 * b as i128, ACT)).collect();
                vec![f_out(&g.shape, &y)]
            }
            Op::Argmax => {
                let x = case.f32("x").map_err(e)?;
                let n = x.shape[1];
                let ids = q_in(x)
                    .chunks(n)
                    .map(|r| r.iter().enumerate().fold(0usize, |best, (i, v)| if *v > r[best] { i } else { best }) as u32)
                    .collect();
                vec![Output::Ids(ids)]
            }
            op @ (Op::LayerNorm | Op::GeluTanh | Op::Geglu | Op::SwigluOai | Op::MoeRoute | Op::TopK | Op::Sample) => return Err(format!("no integer kernel for `{op}`")),
        })
    }
}

impl Device for FixedDevice {
    fn name(&self) -> String {
        if self.int4 { "fixed-int4".into() } else { "fixed".into() }
    }
    fn arithmetic(&self, _: &OpCase) -> Arithmetic {
        Arithmetic { storage: NumFormat::I32, accumulate: NumFormat::I32, transcendental_ulps: 0.0, fixed: Some(self.point()), ..Arithmetic::F32 }
    }
    fn supports(&self, case: &OpCase) -> Support {
        if self.int4 && case.op == Op::Matmul {
            if let Some((_, Input::Quant { cols, .. })) = case.inputs.iter().find(|(n, _)| *n == "w") {
                if cols % INT4_GROUP != 0 {
                    return Support::Unsupported(format!("k = {cols} is not a whole number of INT4 groups of {INT4_GROUP}"));
                }
            }
        }
        match case.op {
            // Argmax compares Q16 integers: two logits within 2^-17 of each other round to one
            // value and resolve to the lower index, which the exact rule would report as a failure.
            Op::Embed | Op::RmsNorm | Op::QkNorm | Op::Matmul | Op::Add | Op::AddBias | Op::Rope | Op::Attention | Op::Softmax | Op::Silu | Op::Swiglu | Op::Argmax => Support::Yes,
            op @ (Op::LayerNorm | Op::GeluTanh | Op::Geglu | Op::SwigluOai | Op::MoeRoute | Op::TopK | Op::Sample) => Support::Unsupported(format!("no integer kernel for `{op}` on {}", self.name())),
        }
    }
    fn run_op(&self, case: &OpCase) -> Result<Vec<Output>, DeviceError> {
        self.run(case).map_err(|r| fail(&self.name(), case, r))
    }
    fn load_model(&self, path: &std::path::Path, opts: &crate::ModelOptions) -> Result<Box<dyn crate::DeviceModel>, DeviceError> {
        let kv = opts.kv_cache;
        if kv != crate::KvTypes::default() {
            // Unsupported, not ignored: a run asked for such a cache must not report one it did not have.
            return Err(DeviceError::Unavailable(self.name(), format!("a {kv} KV cache is not implemented on the integer device (its cache holds Q16 integers)")));
        }
        Ok(Box::new(FixedModel::load(path, self.int4)?))
    }
}

/// A whole model in integer arithmetic (dense Llama/Qwen; MoE is not supported here).
pub struct FixedModel {
    spec: oracle::ModelSpec,
    /// The embedding table as Q16 values, `[n_vocab, n_embd]`.
    tok_embd: IntValues,
    output_norm: Vec<i64>,
    head: FixedWeights,
    layers: Vec<FixedLayer>,
    kv: crate::KvStore<i64>,
    /// The formats this model computes in (declared to the suites).
    point: FixedPoint,
}

struct FixedLayer {
    attn_norm: Vec<i64>,
    wq: FixedWeights,
    wk: FixedWeights,
    wv: FixedWeights,
    wo: FixedWeights,
    bias: Option<[Vec<i64>; 3]>,
    /// The attention output projection's bias (`attn_output.bias`), when the model has one.
    bo: Option<Vec<i64>>,
    qk_norm: Option<[Vec<i64>; 2]>,
    ffn_norm: Vec<i64>,
    /// Gemma's norms of the attention and FFN outputs.
    post_norms: Option<[Vec<i64>; 2]>,
    gate: FixedWeights,
    up: FixedWeights,
    down: FixedWeights,
}

fn model_err(what: impl std::fmt::Display) -> DeviceError {
    DeviceError::Failed { device: "fixed".into(), case: "model".into(), reason: what.to_string() }
}

impl FixedModel {
    /// Loads a GGUF file or a safetensors directory (F32/F16/BF16 tensors).
    pub fn load(path: &std::path::Path, int4: bool) -> Result<FixedModel, DeviceError> {
        let (src, spec) = oracle::loader::open_weights(path).map_err(model_err)?;
        let label = src.label();
        if spec.moe.is_some() {
            return Err(DeviceError::Unavailable("fixed".into(), format!("{}: MoE models have no integer kernels here", path.display())));
        }
        if spec.attn_sinks {
            return Err(DeviceError::Unavailable("fixed".into(), format!("{}: attention sinks have no integer kernel here", path.display())));
        }
        if spec.attn_softcap.is_some() || spec.final_softcap.is_some() {
            return Err(DeviceError::Unavailable("fixed".into(), format!("{}: soft-capping (tanh) has no integer kernel here", path.display())));
        }
        // Every weight as a 32-bit Q24 value (one byte and a group scale in INT4; the embedding's
        // own count stands for its 32-bit Q16 table), and the table once more where the output
        // is tied to it or INT4: refused up front when the machine cannot hold them.
        let values = src.n_elements().map_err(model_err)?;
        let table = (spec.n_vocab as u64).saturating_mul(spec.n_embd as u64);
        let needed = values.saturating_mul(if int4 { 2 } else { 4 }).saturating_add(if int4 || spec.tied_output { table.saturating_mul(4) } else { 0 });
        oracle::memory::check_fits(&label, "holding the weights as integers", needed).map_err(model_err)?;
        let raw = |name: &str| -> Result<oracle::loader::RawTensor<'_>, DeviceError> { src.raw(name).map_err(model_err)?.ok_or_else(|| model_err(format!("{label}: missing tensor `{name}`"))) };
        let mat = |name: &str, rows: usize, cols: usize| -> Result<FixedWeights, DeviceError> {
            let t = raw(name)?;
            if Some(t.n_elements()) != rows.checked_mul(cols) || t.dims[0] != cols {
                return Err(model_err(format!("{label}: tensor `{name}` has dims {:?}, expected [{cols}, {rows}]", t.dims)));
            }
            Ok(convert_weights(t.ty, rows, cols, &t.bytes, int4 && cols.is_multiple_of(INT4_GROUP)))
        };
        let vecq = |name: &str, n: usize, frac: u32| -> Result<Vec<i64>, DeviceError> {
            let t = raw(name)?;
            if t.n_elements() != n || !qdot::is_float(t.ty) {
                return Err(model_err(format!("{label}: tensor `{name}`: expected {n} float values")));
            }
            let mut f = vec![0.0f32; n];
            qdot::float_row(t.ty, &t.bytes, &mut f);
            Ok(f.iter().map(|v| to_q(*v as f64, frac)).collect())
        };
        let (d, hd) = (spec.n_embd, spec.head_dim);
        let (qd, kvd) = (spec.n_head * hd, spec.n_head_kv * hd);
        let mut layers = Vec::new();
        for i in 0..spec.n_layer {
            let n = |t: &str| format!("blk.{i}.{t}");
            layers.push(FixedLayer {
                attn_norm: vecq(&n("attn_norm.weight"), d, NORM)?,
                wq: mat(&n("attn_q.weight"), qd, d)?,
                wk: mat(&n("attn_k.weight"), kvd, d)?,
                wv: mat(&n("attn_v.weight"), kvd, d)?,
                wo: mat(&n("attn_output.weight"), d, qd)?,
                bias: if spec.qkv_bias { Some([vecq(&n("attn_q.bias"), qd, ACT)?, vecq(&n("attn_k.bias"), kvd, ACT)?, vecq(&n("attn_v.bias"), kvd, ACT)?]) } else { None },
                bo: if spec.out_bias { Some(vecq(&n("attn_output.bias"), d, ACT)?) } else { None },
                qk_norm: if spec.qk_norm { Some([vecq(&n("attn_q_norm.weight"), hd, NORM)?, vecq(&n("attn_k_norm.weight"), hd, NORM)?]) } else { None },
                ffn_norm: vecq(&n("ffn_norm.weight"), d, NORM)?,
                post_norms: if spec.post_norms { Some([vecq(&n("post_attention_norm.weight"), d, NORM)?, vecq(&n("post_ffw_norm.weight"), d, NORM)?]) } else { None },
                gate: mat(&n("ffn_gate.weight"), spec.n_ff, d)?,
                up: mat(&n("ffn_up.weight"), spec.n_ff, d)?,
                down: mat(&n("ffn_down.weight"), d, spec.n_ff)?,
            });
        }
        // The embedding table as Q16 activations (rows are looked up, never multiplied).
        let te = raw("token_embd.weight")?;
        if Some(te.n_elements()) != spec.n_vocab.checked_mul(d) || te.dims[0] != d {
            return Err(model_err(format!("{label}: tensor `token_embd.weight` has dims {:?}, expected [{d}, {}]", te.dims, spec.n_vocab)));
        }
        let te_bytes = te.bytes;
        let row_bytes = te_bytes.len() / spec.n_vocab;
        let mut tok_embd = IntValues::with_capacity(spec.n_vocab * d);
        let (mut row, mut row_q) = (vec![0.0f32; d], vec![0i64; d]);
        for r in 0..spec.n_vocab {
            let rb = &te_bytes[r * row_bytes..(r + 1) * row_bytes];
            if qdot::is_float(te.ty) {
                qdot::float_row(te.ty, rb, &mut row);
            } else {
                qdot::dequantize_row(te.ty, rb, &mut row);
            }
            row_q.iter_mut().zip(&row).for_each(|(q, v)| *q = to_q(*v as f64, ACT));
            tok_embd.push_row(&row_q);
        }
        let head = if spec.tied_output { mat("token_embd.weight", spec.n_vocab, d)? } else { mat("output.weight", spec.n_vocab, d)? };
        let output_norm = vecq("output_norm.weight", d, NORM)?;
        let n_layer = spec.n_layer;
        Ok(FixedModel { spec, tok_embd, output_norm, head, layers, kv: crate::KvStore::new(n_layer), point: FixedDevice { int4 }.point() })
    }
}

fn tap_q(t: &mut dyn oracle::Tap, name: &str, start: usize, m: usize, w: usize, v: &[i64]) {
    if t.enabled() {
        let f: Vec<f32> = v.iter().map(|x| from_q(*x, ACT)).collect();
        t.record(name, start, m, w, &f);
    }
}

impl crate::DeviceModel for FixedModel {
    fn spec(&self) -> &oracle::ModelSpec {
        &self.spec
    }
    fn arithmetic(&self) -> Arithmetic {
        Arithmetic { storage: NumFormat::I32, accumulate: NumFormat::I32, transcendental_ulps: 0.0, fixed: Some(self.point), ..Arithmetic::F32 }
    }
    fn cached(&self) -> usize {
        self.kv.len
    }
    fn reset(&mut self) {
        self.kv.reset();
    }
    fn forward(&mut self, tokens: &[u32], taps: &mut dyn oracle::Tap) -> Result<Vec<f32>, DeviceError> {
        self.run(tokens, taps, true)
    }
    fn forward_last(&mut self, tokens: &[u32], taps: &mut dyn oracle::Tap) -> Result<Vec<f32>, DeviceError> {
        self.run(tokens, taps, false)
    }
}

impl FixedModel {
    /// One step over `tokens`; logits of every token (`all_logits`) or of the last one only (the
    /// output norm and head then run on that row alone; both are row by row).
    fn run(&mut self, tokens: &[u32], taps: &mut dyn oracle::Tap, all_logits: bool) -> Result<Vec<f32>, DeviceError> {
        let s = self.spec.clone();
        let m = tokens.len();
        if m == 0 {
            return Err(model_err("no tokens"));
        }
        let start = self.kv.len;
        let pos: Vec<usize> = (start..start + m).collect();
        let (d, hd) = (s.n_embd, s.head_dim);
        let (qd, kvd) = (s.n_head * hd, s.n_head_kv * hd);
        let mut x = Vec::with_capacity(m * d);
        for &t in tokens {
            let t = t as usize;
            if t >= s.n_vocab {
                return Err(model_err(format!("token id {t} outside the vocabulary of {}", s.n_vocab)));
            }
            self.tok_embd.extend_into(t * d..(t + 1) * d, &mut x);
        }
        if let Some(scale) = s.embd_scale {
            // The scale in Q30, the product rounded back to Q16.
            let c = to_q(scale, TABLE) as i128;
            x.iter_mut().for_each(|v| *v = shr_round(*v as i128 * c, TABLE));
        }
        tap_q(taps, "inp_embd", start, m, d, &x);
        let add = |a: &[i64], b: &[i64]| -> Vec<i64> { a.iter().zip(b.iter().cycle()).map(|(x, y)| x + y).collect() };
        for li in 0..s.n_layer {
            let l = &self.layers[li];
            let name = |t: &str| format!("blk.{li}.{t}");
            let h = rms_norm_q(&x, d, &l.attn_norm, s.norm_eps);
            tap_q(taps, &name("attn_norm"), start, m, d, &h);
            let (mut q, mut k, mut v) = (matmul_q(&h, m, &l.wq), matmul_q(&h, m, &l.wk), matmul_q(&h, m, &l.wv));
            if let Some([bq, bk, bv]) = &l.bias {
                (q, k, v) = (add(&q, bq), add(&k, bk), add(&v, bv));
            }
            tap_q(taps, &name("attn_q"), start, m, qd, &q);
            tap_q(taps, &name("attn_k"), start, m, kvd, &k);
            tap_q(taps, &name("attn_v"), start, m, kvd, &v);
            if let Some([qn, kn]) = &l.qk_norm {
                q = rms_norm_q(&q, hd, qn, s.norm_eps);
                k = rms_norm_q(&k, hd, kn, s.norm_eps);
                tap_q(taps, &name("attn_q_norm"), start, m, qd, &q);
                tap_q(taps, &name("attn_k_norm"), start, m, kvd, &k);
            }
            rope_q(&mut q, &pos, s.n_head, hd, s.layer_rope(li));
            rope_q(&mut k, &pos, s.n_head_kv, hd, s.layer_rope(li));
            tap_q(taps, &name("attn_q_rope"), start, m, qd, &q);
            tap_q(taps, &name("attn_k_rope"), start, m, kvd, &k);
            self.kv.write(li, start, kvd, &k, &v);
            let attn = attention_q(&q, &pos, &self.kv.k[li], &self.kv.v[li], s.n_head, s.n_head_kv, hd, s.layer_window(li).unwrap_or(0));
            tap_q(taps, &name("attn_kqv"), start, m, qd, &attn);
            let mut attn = matmul_q(&attn, m, &l.wo);
            if let Some(bo) = &l.bo {
                attn = add(&attn, bo);
            }
            tap_q(taps, &name("attn_out"), start, m, d, &attn);
            if let Some([pa, _]) = &l.post_norms {
                attn = rms_norm_q(&attn, d, pa, s.norm_eps);
                tap_q(taps, &name("attn_post_norm"), start, m, d, &attn);
            }
            x = add(&x, &attn);
            tap_q(taps, &name("ffn_inp"), start, m, d, &x);
            let h = rms_norm_q(&x, d, &l.ffn_norm, s.norm_eps);
            tap_q(taps, &name("ffn_norm"), start, m, d, &h);
            let (g, u) = (matmul_q(&h, m, &l.gate), matmul_q(&h, m, &l.up));
            let act: Vec<i64> = g.iter().zip(&u).map(|(a, b)| glu_q16(s.activation, *a, *b)).collect();
            tap_q(taps, &name("ffn_gate"), start, m, s.n_ff, &g);
            tap_q(taps, &name("ffn_up"), start, m, s.n_ff, &u);
            tap_q(taps, &name("ffn_act"), start, m, s.n_ff, &act);
            let mut out = matmul_q(&act, m, &l.down);
            tap_q(taps, &name("ffn_out"), start, m, d, &out);
            if let Some([_, pf]) = &l.post_norms {
                out = rms_norm_q(&out, d, pf, s.norm_eps);
                tap_q(taps, &name("ffn_post_norm"), start, m, d, &out);
            }
            x = add(&x, &out);
            tap_q(taps, &name("l_out"), start, m, d, &x);
        }
        self.kv.len = start + m;
        let (rows, row0) = if all_logits { (m, 0) } else { (1, m - 1) };
        let normed = rms_norm_q(&x[row0 * d..], d, &self.output_norm, s.norm_eps);
        tap_q(taps, "result_norm", start + row0, rows, d, &normed);
        let logits = matmul_q(&normed, rows, &self.head);
        tap_q(taps, "result_output", start + row0, rows, s.n_vocab, &logits);
        Ok(logits.iter().map(|v| from_q(*v, ACT)).collect())
    }
}

#[cfg(test)]
mod tests;
