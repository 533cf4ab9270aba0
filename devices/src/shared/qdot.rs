//! Quantized matrix-vector products the way fast CPU engines do them: activations quantized to
//! Q8_0 blocks (32 values, symmetric, f16 scale, as llama.cpp's `quantize_row_q8_0`), integer dot
//! products against the packed weight blocks, one f32 multiply-add per (sub-)block. No weight is
//! ever expanded to an f32 matrix. The `cpu` device's products; the row decoding here
//! (`dequantize_row`, `float_row`) is how `cpu`, `fixed` and the GPU hosts read a stored row.

use half::f16;
use super::unpack::{self, k_scale_min};
use oracle::quant::{GgmlType, QK_K};

/// Activations of one row quantized to Q8_0 blocks.
pub struct Q8Row {
    pub q: Vec<i8>,
    /// Per 32-block scale (f16-rounded, as stored by llama.cpp).
    pub d: Vec<f32>,
    /// Per 32-block scale times the sum of `q` (for formats with a min term): exact in f32 (the
    /// f16 scale's 11 significant bits times at most 32 × 127 < 2^12).
    pub dsum: Vec<f32>,
}

/// Quantizes `x` (length a multiple of 32) to Q8_0 blocks: per block `d = amax / 127` (stored
/// f16-rounded) and `q = round(x / d)` computed as `x * (1 / d)`, rounded half away from zero.
/// On AVX2 machines the blocks whose values are all finite go through 8-lane code with the same
/// bits (max is exact, `x * id` is one rounding either way, and the rounding is done exactly).
pub fn quantize_q8(x: &[f32]) -> Q8Row {
    let nb = x.len() / 32;
    let mut r = Q8Row { q: vec![0; x.len()], d: vec![0.0; nb], dsum: vec![0.0; nb] };
    #[cfg(target_arch = "x86_64")]
    let avx2 = has_avx2();
    for b in 0..nb {
        let xs = &x[32 * b..32 * b + 32];
        let q: &mut [i8; 32] = (&mut r.q[32 * b..32 * b + 32]).try_into().expect("32 values");
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `avx2`: the CPU reports avx2, fma and f16c.
        let fast = if avx2 { unsafe { quantize_block_avx2(xs, q) } } else { None };
        #[cfg(not(target_arch = "x86_64"))]
        let fast = None;
        let (d, s) = fast.unwrap_or_else(|| quantize_block(xs, q));
        (r.d[b], r.dsum[b]) = (d, d * s as f32);
    }
    r
}

/// One block: its f16-rounded scale and the sum of its quantized values.
fn quantize_block(xs: &[f32], q: &mut [i8; 32]) -> (f32, i32) {
    let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut s = 0i32;
    for (o, v) in q.iter_mut().zip(xs) {
        let v = (v * id).round() as i32; // |v*id| <= 127 by construction
        *o = v as i8;
        s += v;
    }
    (f16::from_f32(d).to_f32(), s)
}

/// `quantize_block` for a block of finite values (`None`, nothing written, otherwise).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_block_avx2(xs: &[f32], q: &mut [i8; 32]) -> Option<(f32, i32)> {
    use std::arch::x86_64::*;
    assert!(xs.len() >= 32);
    let sign = _mm256_set1_ps(-0.0);
    let mut v = [_mm256_setzero_ps(); 4];
    for (i, v) in v.iter_mut().enumerate() {
        *v = _mm256_loadu_ps(xs.as_ptr().add(8 * i));
    }
    let mut m = _mm256_setzero_ps();
    let mut bad = _mm256_setzero_ps();
    for v in v {
        let a = _mm256_andnot_ps(sign, v);
        m = _mm256_max_ps(m, a);
        // Infinite or NaN: not (|v| <= f32::MAX).
        bad = _mm256_or_ps(bad, _mm256_cmp_ps::<_CMP_NLE_UQ>(a, _mm256_set1_ps(f32::MAX)));
    }
    if _mm256_movemask_ps(bad) != 0 {
        return None;
    }
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), m);
    let amax = lanes.iter().fold(0.0f32, |a, b| a.max(*b));
    let d = amax / 127.0;
    let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
    let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    let mut qi = [_mm256_setzero_si256(); 4];
    for (o, v) in qi.iter_mut().zip(v) {
        // Round half away from zero: truncate, then step away from zero when the dropped part
        // (exact: `p` minus its own integer part) is at least one half.
        let p = _mm256_mul_ps(v, id);
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(p);
        let up = _mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_andnot_ps(sign, _mm256_sub_ps(p, t)), half);
        let step = _mm256_and_ps(up, _mm256_or_ps(one, _mm256_and_ps(p, sign)));
        *o = _mm256_cvttps_epi32(_mm256_add_ps(t, step));
    }
    let total = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    let mut sums = [0i32; 8];
    _mm256_storeu_si256(sums.as_mut_ptr() as *mut __m256i, total);
    // i32 -> i16 -> i8 packs interleave 128-bit lanes; the permute restores element order.
    let packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    let ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, ordered);
    Some((f16::from_f32(d).to_f32(), sums.iter().sum()))
}

#[inline(always)]
fn rd16(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The block dots, in a portable form and (x86-64) an AVX2 form. A block's 32 weights are
/// unpacked once ([`BlockDot::W`]) and then dotted with the Q8_0 activations of one or more
/// tokens; each dot is kept as eight i32 lanes (lane `i` sums elements `4i..4i + 4`), each block
/// adds its lanes times its f32 scale into eight f32 accumulators (one FMA per lane), and the row
/// ends with one horizontal sum in a fixed tree. The two forms do the same integer and f32
/// operations lane for lane, so they give the same bits. `dot_rows_impl` is generic over this,
/// so the AVX2 copy is monomorphised inside the `avx2` target-feature function.
trait BlockDot {
    /// Eight i32 lane sums of one block.
    type I: Copy;
    /// Eight f32 accumulators.
    type F: Copy;
    /// One block's 32 weights (small integers), ready for [`BlockDot::dot`].
    type W: Copy;
    fn zero() -> Self::F;
    /// `acc + lanes * s`, one rounding per lane.
    fn fma(acc: Self::F, lanes: Self::I, s: f32) -> Self::F;
    /// `acc - a * b` lane by lane, one rounding per lane (`b`: eight values).
    fn fnma8(acc: Self::F, a: &[f32; 8], b: &[f32]) -> Self::F;
    /// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
    fn hsum(acc: Self::F) -> f32;
    /// A 16-byte nibble block (element `j < 16`: low nibble of byte `j`; `16 + j`: its high
    /// nibble), plus 16 on element `j` where bit `j` of `qh` is set (Q5 types; 0 for Q4), minus
    /// `offset`.
    fn nibbles(qs: &[u8], qh: u32, offset: i8) -> Self::W;
    /// 32 i8 weights (Q8_0's; Q6_K's unpacked values).
    fn i8s(a: &[i8]) -> Self::W;
    /// K-quant chunk `c` of 32 bytes: the low nibbles (sub-block `2c`) and the high nibbles
    /// (`2c + 1`), each plus 16 where its bit of `qh` is set (Q5_K; `qh` empty for Q4_K).
    fn k_chunk(qs: &[u8], qh: &[u8], c: usize) -> (Self::W, Self::W);
    /// The lanes of `w` times 32 activations.
    fn dot(w: Self::W, x: &[i8]) -> Self::I;
    /// Lanes 0..4 times `lo`, lanes 4..8 times `hi` (Q6_K's two 16-value scales).
    fn scale_halves(l: Self::I, lo: i32, hi: i32) -> Self::I;
    #[inline(always)]
    fn f16(b: &[u8], at: usize) -> f32 {
        rd16(b, at)
    }
    #[cfg(test)]
    fn lanes(l: Self::I) -> [i32; 8];
}

struct Portable;

/// Lane `i` = sum of `w[e] * x[e]` over elements `4i..4i + 4`.
#[inline(always)]
fn lanes_of(w: &[i8; 32], x: &[i8]) -> [i32; 8] {
    let mut l = [0i32; 8];
    for (e, (a, b)) in w.iter().zip(x).enumerate() {
        l[e / 4] += *a as i32 * *b as i32;
    }
    l
}

impl BlockDot for Portable {
    type I = [i32; 8];
    type F = [f32; 8];
    type W = [i8; 32];
    #[inline(always)]
    fn zero() -> [f32; 8] {
        [0.0; 8]
    }
    #[inline(always)]
    fn fma(acc: [f32; 8], lanes: [i32; 8], s: f32) -> [f32; 8] {
        std::array::from_fn(|i| (lanes[i] as f32).mul_add(s, acc[i]))
    }
    #[inline(always)]
    fn fnma8(acc: [f32; 8], a: &[f32; 8], b: &[f32]) -> [f32; 8] {
        std::array::from_fn(|i| (-a[i]).mul_add(b[i], acc[i]))
    }
    #[inline(always)]
    fn hsum(a: [f32; 8]) -> f32 {
        ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
    }
    #[inline(always)]
    fn nibbles(qs: &[u8], qh: u32, offset: i8) -> [i8; 32] {
        let mut w = [0i8; 32];
        nibbles(qs, &mut w, 0);
        for (j, v) in w.iter_mut().enumerate() {
            *v = (*v | (((qh >> j) & 1) << 4) as i8) - offset;
        }
        w
    }
    #[inline(always)]
    fn i8s(a: &[i8]) -> [i8; 32] {
        a[..32].try_into().expect("32 values")
    }
    #[inline(always)]
    fn k_chunk(qs: &[u8], qh: &[u8], c: usize) -> ([i8; 32], [i8; 32]) {
        let (mut lo, mut hi) = ([0i8; 32], [0i8; 32]);
        for l in 0..32 {
            let (mut a, mut b) = (qs[l] & 0x0F, qs[l] >> 4);
            if !qh.is_empty() {
                a |= ((qh[l] >> (2 * c)) & 1) << 4;
                b |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
            }
            (lo[l], hi[l]) = (a as i8, b as i8);
        }
        (lo, hi)
    }
    #[inline(always)]
    fn dot(w: [i8; 32], x: &[i8]) -> [i32; 8] {
        lanes_of(&w, x)
    }
    #[inline(always)]
    fn scale_halves(l: [i32; 8], lo: i32, hi: i32) -> [i32; 8] {
        std::array::from_fn(|i| l[i] * if i < 4 { lo } else { hi })
    }
    #[cfg(test)]
    fn lanes(l: [i32; 8]) -> [i32; 8] {
        l
    }
}

#[cfg(target_arch = "x86_64")]
/// The AVX2 block dots. With `VNNI` = [`AVX_VNNI`] or [`AVX512_VNNI`] each block's
/// four-products-per-lane sum is one `vpdpbusd` instead of two instructions (VEX-encoded on
/// AVX-VNNI CPUs, EVEX-encoded on AVX-512 VNNI + VL ones; the same 256-bit operation), exact
/// integer sums either way, so the same bits.
struct Avx2<const VNNI: u8>;

/// `Avx2`'s product-sum instruction: `maddubs` + `madd`, or one `vpdpbusd` in either encoding.
#[cfg(target_arch = "x86_64")]
const NO_VNNI: u8 = 0;
#[cfg(target_arch = "x86_64")]
const AVX_VNNI: u8 = 1;
#[cfg(target_arch = "x86_64")]
const AVX512_VNNI: u8 = 2;

/// One block's weights for `_mm256_maddubs_epi16` (u8 times i8): their magnitudes, and, where
/// any may be negative, the weights themselves (whose signs go onto the activations).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Avx2W {
    mag: std::arch::x86_64::__m256i,
    signs: Option<std::arch::x86_64::__m256i>,
}

#[cfg(target_arch = "x86_64")]
impl Avx2W {
    /// Weights that may be negative (`|w| <= 128`: pairs of `|w| * |x|` sum to at most
    /// 2 * 128 * 127 in an i16, no saturation).
    #[inline(always)]
    fn signed(w: std::arch::x86_64::__m256i) -> Avx2W {
        // SAFETY: only reached from the AVX2 path (see the impl below).
        Avx2W { mag: unsafe { std::arch::x86_64::_mm256_sign_epi8(w, w) }, signs: Some(w) }
    }
}

// SAFETY (every `unsafe` block of this impl): only reached from `dot_rows_block_avx2`, which runs after
// the AVX2/FMA check; each method asserts the lengths it reads.
#[cfg(target_arch = "x86_64")]
impl<const VNNI: u8> BlockDot for Avx2<VNNI> {
    type I = std::arch::x86_64::__m256i;
    type F = std::arch::x86_64::__m256;
    type W = Avx2W;
    #[inline(always)]
    fn zero() -> Self::F {
        unsafe { std::arch::x86_64::_mm256_setzero_ps() }
    }
    #[inline(always)]
    fn fma(acc: Self::F, lanes: Self::I, s: f32) -> Self::F {
        use std::arch::x86_64::*;
        unsafe { _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(s), acc) }
    }
    #[inline(always)]
    fn fnma8(acc: Self::F, a: &[f32; 8], b: &[f32]) -> Self::F {
        use std::arch::x86_64::*;
        assert!(b.len() >= 8);
        unsafe { _mm256_fnmadd_ps(_mm256_loadu_ps(a.as_ptr()), _mm256_loadu_ps(b.as_ptr()), acc) }
    }
    #[inline(always)]
    fn hsum(acc: Self::F) -> f32 {
        use std::arch::x86_64::*;
        unsafe {
            // (l0 + l4, l1 + l5, l2 + l6, l3 + l7), then (.. + (l2 + l6), .. + (l3 + l7)), then the two.
            let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 0b01)))
        }
    }
    #[inline(always)]
    fn nibbles(qs: &[u8], qh: u32, offset: i8) -> Avx2W {
        use std::arch::x86_64::*;
        assert!(qs.len() >= 16);
        unsafe {
            let raw = _mm_loadu_si128(qs.as_ptr() as *const __m128i);
            let mask = _mm_set1_epi8(0x0F);
            let mut w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
            if qh != 0 {
                // Byte j gets byte j / 8 of qh (shuffles stay within 128-bit lanes, and each lane
                // holds qh in its first four bytes), then tests its own bit j % 8.
                let spread = _mm256_shuffle_epi8(
                    _mm256_set1_epi32(qh as i32),
                    _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
                );
                let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
                w = _mm256_or_si256(w, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16)));
            }
            if offset == 0 {
                // u8, at most 31.
                Avx2W { mag: w, signs: None }
            } else {
                // |w - offset| <= 16.
                Avx2W::signed(_mm256_sub_epi8(w, _mm256_set1_epi8(offset)))
            }
        }
    }
    #[inline(always)]
    fn i8s(a: &[i8]) -> Avx2W {
        use std::arch::x86_64::*;
        assert!(a.len() >= 32);
        Avx2W::signed(unsafe { _mm256_loadu_si256(a.as_ptr() as *const __m256i) })
    }
    #[inline(always)]
    fn k_chunk(qs: &[u8], qh: &[u8], c: usize) -> (Avx2W, Avx2W) {
        use std::arch::x86_64::*;
        assert!(qs.len() >= 32 && c < 4 && (qh.is_empty() || qh.len() >= 32));
        unsafe {
            let raw = _mm256_loadu_si256(qs.as_ptr() as *const __m256i);
            let mask = _mm256_set1_epi8(0x0F);
            let mut lo = _mm256_and_si256(raw, mask);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            if !qh.is_empty() {
                let h = _mm256_loadu_si256(qh.as_ptr() as *const __m256i);
                let sixteen = _mm256_set1_epi8(16);
                let (bl, bh) = (_mm256_set1_epi8((1u8 << (2 * c)) as i8), _mm256_set1_epi8((1u8 << (2 * c + 1)) as i8));
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bl), bl), sixteen));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bh), bh), sixteen));
            }
            // u8, at most 31.
            (Avx2W { mag: lo, signs: None }, Avx2W { mag: hi, signs: None })
        }
    }
    #[inline(always)]
    fn dot(w: Avx2W, x: &[i8]) -> Self::I {
        use std::arch::x86_64::*;
        assert!(x.len() >= 32);
        unsafe {
            let xv = _mm256_loadu_si256(x.as_ptr() as *const __m256i);
            // |w| as u8 times x with w's sign: u8 x i8 pairs summed into i16 without saturation
            // (bounds at the constructors), then pairs of i16 into the i32 lanes.
            let xs = match w.signs {
                Some(s) => _mm256_sign_epi8(xv, s),
                None => xv,
            };
            // With VNNI, the same four products per lane summed straight into i32.
            match VNNI {
                AVX_VNNI => _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w.mag, xs),
                AVX512_VNNI => _mm256_dpbusd_epi32(_mm256_setzero_si256(), w.mag, xs),
                _ => _mm256_madd_epi16(_mm256_maddubs_epi16(w.mag, xs), _mm256_set1_epi16(1)),
            }
        }
    }
    #[inline(always)]
    fn scale_halves(l: Self::I, lo: i32, hi: i32) -> Self::I {
        use std::arch::x86_64::*;
        // Q6_K: |q| <= 32 times |x| <= 127, four per lane, times an i8 scale: within i32.
        unsafe { _mm256_mullo_epi32(l, _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi)) }
    }
    #[inline(always)]
    fn f16(b: &[u8], at: usize) -> f32 {
        let bits = u16::from_le_bytes([b[at], b[at + 1]]);
        // One F16C conversion (exact, as `half`'s) without `half`'s per-call feature check. In
        // assembly because from intrinsics LLVM moves the bits into lane 0 with `vpinsrw`, which
        // merges into whatever register it picks: it picked the block dot's accumulator,
        // chaining each block's scale to the previous block's sum. `vmovd` depends on nothing.
        let v: f32;
        // SAFETY: register-only instructions; the CPU has F16C (this impl runs after the
        // AVX2/FMA/F16C check).
        unsafe { std::arch::asm!("vmovd {t}, {b:e}", "vcvtph2ps {t}, {t}", b = in(reg) bits as u32, t = out(xmm_reg) v, options(pure, nomem, nostack, preserves_flags)) };
        v
    }
    #[cfg(test)]
    fn lanes(l: Self::I) -> [i32; 8] {
        let mut out = [0i32; 8];
        // SAFETY: an unaligned 32-byte store into a 32-byte array.
        unsafe { std::arch::x86_64::_mm256_storeu_si256(out.as_mut_ptr() as *mut std::arch::x86_64::__m256i, l) };
        out
    }
}

/// Unpacks 16 bytes of nibbles into 32 values: low nibbles first, then high nibbles.
#[inline(always)]
fn nibbles(qs: &[u8], out: &mut [i8; 32], offset: i8) {
    for j in 0..16 {
        out[j] = (qs[j] & 0x0F) as i8 - offset;
        out[j + 16] = (qs[j] >> 4) as i8 - offset;
    }
}

/// The dot of one packed weight row with one token's Q8_0 activations.
pub fn dot_row(ty: GgmlType, row: &[u8], x: &Q8Row) -> f32 {
    dot_rows(ty, row, [x])[0]
}

/// The dots of one packed weight row with `T` tokens' Q8_0 activations: each block's weights are
/// unpacked once for all `T` (a prefill reuses them), and each token's result is the bits
/// [`dot_row`] gives it (the same operations in the same order, token by token).
///
/// [`dot_rows_block`] of the one row; the body is plain fixed-width Rust, and on x86-64 a second
/// copy compiled with AVX2/FMA/F16C is chosen at run time (the build itself stays generic).
pub fn dot_rows<const T: usize>(ty: GgmlType, row: &[u8], xs: [&Q8Row; T]) -> [f32; T] {
    let mut out = [0.0f32; T];
    dot_rows_block(ty, row, row.len(), xs, &mut out, Strides { row: T, token: 1 });
    out
}

/// Where [`dot_rows_block`] writes the dot of row `r` and token `t`: `out[r * row + t * token]`
/// (`row: T, token: 1` for results row by row; `row: 1, token: n` for an `[m][n]` output).
#[derive(Clone, Copy, Debug)]
pub struct Strides {
    pub row: usize,
    pub token: usize,
}

impl Strides {
    /// The length `out` needs for `rows` rows and `tokens` tokens (0 when either is 0).
    pub fn needs(self, rows: usize, tokens: usize) -> usize {
        if rows == 0 || tokens == 0 {
            return 0;
        }
        (rows - 1) * self.row + (tokens - 1) * self.token + 1
    }
}

/// [`dot_rows`] of `n` consecutive packed rows (`rows`, `row_bytes` each) with the same `T`
/// tokens: row `r`, token `i` into `out[r * at.row + i * at.token]`. One run-time path choice
/// for all of them (a one-token GEMV calls this once per task of rows, not once per row).
pub fn dot_rows_block<const T: usize>(ty: GgmlType, rows: &[u8], row_bytes: usize, xs: [&Q8Row; T], out: &mut [f32], at: Strides) {
    if rows.is_empty() || row_bytes == 0 {
        return; // no rows, or empty ones: their dots are the zeros `out` holds
    }
    if T == 8 && !(ty == GgmlType::Q4_1 && pairs_available()) {
        // Eight tokens take a register pair each only on the two-token path; elsewhere they
        // are two calls of four (eight sums of eight lanes would not stay in registers).
        let first: [&Q8Row; 4] = std::array::from_fn(|i| xs[i]);
        let last: [&Q8Row; 4] = std::array::from_fn(|i| xs[4 + i]);
        assert!(out.len() >= at.needs(rows.len() / row_bytes, T), "dot_rows_block: output shorter than its rows and tokens");
        dot_rows_block(ty, rows, row_bytes, first, out, at);
        return dot_rows_block(ty, rows, row_bytes, last, &mut out[4 * at.token..], at);
    }
    #[cfg(target_arch = "x86_64")]
    {
        if ty == GgmlType::Q4_1 && (T == 4 || T == 8) && pairs_available() {
            // SAFETY: the CPU reports what `pairs::available` checks.
            return unsafe {
                match T {
                    4 => pairs::q4_1_rows::<4, 2>(rows, row_bytes, std::array::from_fn(|i| xs[i]), out, at),
                    _ => pairs::q4_1_rows::<8, 4>(rows, row_bytes, std::array::from_fn(|i| xs[i]), out, at),
                }
            };
        }
        if has_avx_vnni() {
            // SAFETY: the CPU reports avx2, fma, f16c and avxvnni.
            return unsafe { dot_rows_block_vnni(ty, rows, row_bytes, xs, out, at) };
        }
        if has_avx512_vnni() {
            // SAFETY: the CPU reports avx2, fma, f16c, avx512vnni and avx512vl.
            return unsafe { dot_rows_block_vnni512(ty, rows, row_bytes, xs, out, at) };
        }
        if has_avx2() {
            // SAFETY: the CPU reports avx2, fma and f16c.
            return unsafe { dot_rows_block_avx2(ty, rows, row_bytes, xs, out, at) };
        }
    }
    dot_rows_block_impl::<Portable, T>(ty, rows, row_bytes, xs, out, at)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_rows_block_avx2<const T: usize>(ty: GgmlType, rows: &[u8], row_bytes: usize, xs: [&Q8Row; T], out: &mut [f32], at: Strides) {
    dot_rows_block_impl::<Avx2<NO_VNNI>, T>(ty, rows, row_bytes, xs, out, at)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn dot_rows_block_vnni<const T: usize>(ty: GgmlType, rows: &[u8], row_bytes: usize, xs: [&Q8Row; T], out: &mut [f32], at: Strides) {
    dot_rows_block_impl::<Avx2<AVX_VNNI>, T>(ty, rows, row_bytes, xs, out, at)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn dot_rows_block_vnni512<const T: usize>(ty: GgmlType, rows: &[u8], row_bytes: usize, xs: [&Q8Row; T], out: &mut [f32], at: Strides) {
    dot_rows_block_impl::<Avx2<AVX512_VNNI>, T>(ty, rows, row_bytes, xs, out, at)
}

#[inline(always)]
fn dot_rows_block_impl<I: BlockDot, const T: usize>(ty: GgmlType, rows: &[u8], row_bytes: usize, xs: [&Q8Row; T], out: &mut [f32], at: Strides) {
    if row_bytes == 0 {
        return; // empty rows: their dots are the zeros `out` holds
    }
    assert!(out.len() >= at.needs(rows.len() / row_bytes, T), "dot_rows_block: output shorter than its rows and tokens");
    for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
        prefetch_ahead(rows, r * row_bytes, row_bytes);
        let v = dot_rows_impl::<I, T>(ty, row, xs);
        if at.token == 1 {
            out[r * at.row..r * at.row + T].copy_from_slice(&v);
        } else {
            for (t, v) in v.into_iter().enumerate() {
                out[r * at.row + t * at.token] = v;
            }
        }
    }
}

/// Bytes ahead of the row being read that a block's loop asks the CPU to load.
const PREFETCH_BYTES: usize = 1536;

/// Asks the CPU to load the row's worth of bytes `PREFETCH_BYTES` past `at` in `rows` (those that
/// exist) into L1. No effect on any value.
#[inline(always)]
fn prefetch_ahead(rows: &[u8], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(ahead) = rows.get(at + PREFETCH_BYTES..(at + PREFETCH_BYTES + len).min(rows.len())) {
        for line in (0..ahead.len()).step_by(64) {
            // SAFETY: `line` is within `ahead`; a prefetch reads nothing into the program.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ahead.as_ptr().add(line).cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (rows, at, len);
}

/// Whether this machine has the two-token Q4_1 kernel ([`pairs`]).
fn pairs_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    return pairs::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The block-dot path this machine runs (for report provenance).
pub fn path_name() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if has_avx_vnni() {
        return "AVX2+FMA block dots with AVX-VNNI";
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx512_vnni() {
        return "AVX2+FMA block dots with AVX-512 VNNI (256-bit)";
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        return "AVX2+FMA block dots";
    }
    "portable block dots"
}

/// AVX2 and AVX-VNNI (256-bit `vpdpbusd`).
#[cfg(target_arch = "x86_64")]
fn has_avx_vnni() -> bool {
    use std::sync::OnceLock;
    static F: OnceLock<bool> = OnceLock::new();
    *F.get_or_init(|| has_avx2() && is_x86_feature_detected!("avxvnni"))
}

/// AVX2 and the EVEX-encoded 256-bit `vpdpbusd` (AVX-512 VNNI with VL), for CPUs that have
/// AVX-512 but not AVX-VNNI (the VEX form).
#[cfg(target_arch = "x86_64")]
fn has_avx512_vnni() -> bool {
    use std::sync::OnceLock;
    static F: OnceLock<bool> = OnceLock::new();
    *F.get_or_init(|| has_avx2() && is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl"))
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static F: OnceLock<bool> = OnceLock::new();
    *F.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c"))
}

#[inline(always)]
fn dot_rows_impl<I: BlockDot, const T: usize>(ty: GgmlType, row: &[u8], xs: [&Q8Row; T]) -> [f32; T] {
    let mut acc = [I::zero(); T];
    // The min/offset terms (scale * block sum of x), summed in block order apart from `acc`.
    let mut mins = [0.0f32; T];
    let xq = |t: usize, b: usize| &xs[t].q[32 * b..32 * b + 32];
    match ty {
        GgmlType::Q4_0 => {
            for (b, blk) in row.chunks_exact(18).enumerate() {
                let (w, d) = (I::nibbles(&blk[2..18], 0, 8), I::f16(blk, 0));
                for t in 0..T {
                    acc[t] = I::fma(acc[t], I::dot(w, xq(t, b)), d * xs[t].d[b]);
                }
            }
        }
        GgmlType::Q4_1 => {
            for (b, blk) in row.chunks_exact(20).enumerate() {
                let (w, d, m) = (I::nibbles(&blk[4..20], 0, 0), I::f16(blk, 0), I::f16(blk, 2));
                for t in 0..T {
                    acc[t] = I::fma(acc[t], I::dot(w, xq(t, b)), d * xs[t].d[b]);
                    mins[t] += m * xs[t].dsum[b];
                }
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (size, qh_at, has_min) = if ty == GgmlType::Q5_0 { (22, 2, false) } else { (24, 4, true) };
            for (b, blk) in row.chunks_exact(size).enumerate() {
                let qh = u32::from_le_bytes([blk[qh_at], blk[qh_at + 1], blk[qh_at + 2], blk[qh_at + 3]]);
                // Q5_0's values are q - 16; Q5_1's are q (its min is the separate term).
                let offset = if has_min { 0 } else { 16 };
                let (w, d) = (I::nibbles(&blk[qh_at + 4..qh_at + 20], qh, offset), I::f16(blk, 0));
                for t in 0..T {
                    acc[t] = I::fma(acc[t], I::dot(w, xq(t, b)), d * xs[t].d[b]);
                }
                if has_min {
                    let m = I::f16(blk, 2);
                    for t in 0..T {
                        mins[t] += m * xs[t].dsum[b];
                    }
                }
            }
        }
        GgmlType::Q8_0 => {
            for (b, blk) in row.chunks_exact(34).enumerate() {
                let (w, d) = (I::i8s(bytemuck_i8(&blk[2..34])), I::f16(blk, 0));
                for t in 0..T {
                    acc[t] = I::fma(acc[t], I::dot(w, xq(t, b)), d * xs[t].d[b]);
                }
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let five = ty == GgmlType::Q5_K;
            let size = ty.type_size();
            for (kb, blk) in row.chunks_exact(size).enumerate() {
                let (d, dmin) = (I::f16(blk, 0), I::f16(blk, 2));
                let scales = &blk[4..16];
                let (qh, qs) = if five { (&blk[16..48], &blk[48..176]) } else { (&blk[0..0], &blk[16..144]) };
                let sm: [(u8, u8); 8] = std::array::from_fn(|sub| k_scale_min(sub, scales));
                for c in 0..4 {
                    let ws = I::k_chunk(&qs[32 * c..32 * c + 32], qh, c);
                    for (half, w) in [ws.0, ws.1].into_iter().enumerate() {
                        let sub = 2 * c + half;
                        let b = kb * (QK_K / 32) + sub;
                        let ds = d * sm[sub].0 as f32;
                        for t in 0..T {
                            acc[t] = I::fma(acc[t], I::dot(w, xq(t, b)), ds * xs[t].d[b]);
                        }
                    }
                }
                // The super-block's eight min terms, sub-block `i` in lane `i`: one fused
                // multiply-subtract per token instead of eight scalar ones.
                let dm: [f32; 8] = std::array::from_fn(|sub| dmin * sm[sub].1 as f32);
                for t in 0..T {
                    acc[t] = I::fnma8(acc[t], &dm, &xs[t].dsum[8 * kb..8 * kb + 8]);
                }
            }
        }
        GgmlType::Q6_K => {
            for (kb, blk) in row.chunks_exact(210).enumerate() {
                let d = I::f16(blk, 208);
                let mut q = [0i8; QK_K];
                for half in 0..2 {
                    let (ql, qh) = (&blk[64 * half..64 * half + 64], &blk[128 + 32 * half..128 + 32 * half + 32]);
                    for l in 0..32 {
                        let base = 128 * half + l;
                        q[base] = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
                        q[base + 32] = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                        q[base + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                        q[base + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                    }
                }
                let sc = &blk[192..208];
                for sub in 0..8 {
                    let b = kb * 8 + sub;
                    let w = I::i8s(&q[32 * sub..32 * sub + 32]);
                    let (lo, hi) = ((sc[2 * sub] as i8) as i32, (sc[2 * sub + 1] as i8) as i32);
                    for t in 0..T {
                        acc[t] = I::fma(acc[t], I::scale_halves(I::dot(w, xq(t, b)), lo, hi), d * xs[t].d[b]);
                    }
                }
            }
        }
        GgmlType::Q2_K | GgmlType::Q3_K => {
            // Sixteen 16-value groups, each with its own scale (Q2_K's 4-bit scale and min,
            // Q3_K's 6-bit signed one): 32 values unpacked to i8, their two scales applied to
            // the halves of the block dot, as for Q6_K.
            let two = ty == GgmlType::Q2_K;
            for (kb, blk) in row.chunks_exact(ty.type_size()).enumerate() {
                let (d, dmin) = if two { (I::f16(blk, 80), I::f16(blk, 82)) } else { (I::f16(blk, 108), 0.0) };
                let scales: [i32; 16] = if two { std::array::from_fn(|g| (blk[g] & 0xF) as i32) } else { unpack::q3_k_scales(&blk[96..108]).map(|s| s as i32) };
                let q = unpack::q2_q3_k_quants(ty, blk);
                for sub in 0..8 {
                    let b = kb * 8 + sub;
                    let w = I::i8s(&q[32 * sub..32 * sub + 32]);
                    for t in 0..T {
                        acc[t] = I::fma(acc[t], I::scale_halves(I::dot(w, xq(t, b)), scales[2 * sub], scales[2 * sub + 1]), d * xs[t].d[b]);
                    }
                    if two {
                        // Each group's min times its 16 activations' sum.
                        let (m_lo, m_hi) = ((blk[2 * sub] >> 4) as i32, (blk[2 * sub + 1] >> 4) as i32);
                        for t in 0..T {
                            let x = xq(t, b);
                            let (lo, hi) = (x[..16].iter().map(|v| *v as i32).sum::<i32>(), x[16..].iter().map(|v| *v as i32).sum::<i32>());
                            mins[t] -= dmin * (m_lo * lo + m_hi * hi) as f32 * xs[t].d[b];
                        }
                    }
                }
            }
        }
        GgmlType::IQ4_NL | GgmlType::IQ4_XS => {
            // 32-value blocks of non-linear levels (i8), with IQ4_NL's f16 scale or IQ4_XS's
            // 6-bit one on its super-block's d: Q8_0's block dot once the levels are looked up.
            let nl = ty == GgmlType::IQ4_NL;
            let mut block = |b: usize, qs: &[u8], dl: f32| {
                let wv = I::i8s(&unpack::iq4_levels(qs));
                for t in 0..T {
                    acc[t] = I::fma(acc[t], I::dot(wv, xq(t, b)), dl * xs[t].d[b]);
                }
            };
            for (kb, blk) in row.chunks_exact(ty.type_size()).enumerate() {
                let d = I::f16(blk, 0);
                if nl {
                    block(kb, &blk[2..18], d);
                } else {
                    for ib in 0..8 {
                        block(8 * kb + ib, &blk[8 + 16 * ib..24 + 16 * ib], d * unpack::iq4_xs_scale(blk, ib) as f32);
                    }
                }
            }
        }
        GgmlType::TQ1_0 | GgmlType::TQ2_0 => {
            // 256 ternary digits on one f16 d (at the block's end): Q8_0's block dot on each 32.
            for (kb, blk) in row.chunks_exact(ty.type_size()).enumerate() {
                let d = I::f16(blk, ty.type_size() - 2);
                let trits = unpack::tq_trits(ty, blk);
                for (ib, w) in trits.chunks_exact(32).enumerate() {
                    let wv = I::i8s(w);
                    for t in 0..T {
                        acc[t] = I::fma(acc[t], I::dot(wv, xq(t, 8 * kb + ib)), d * xs[t].d[8 * kb + ib]);
                    }
                }
            }
        }
        GgmlType::MXFP4 => {
            // 32 doubled E2M1 levels on a power-of-two scale: Q8_0's block dot.
            for (kb, blk) in row.chunks_exact(ty.type_size()).enumerate() {
                let wv = I::i8s(&unpack::mxfp4_levels(&blk[1..17]));
                let d = unpack::mxfp4_scale(blk[0]);
                for t in 0..T {
                    acc[t] = I::fma(acc[t], I::dot(wv, xq(t, kb)), d * xs[t].d[kb]);
                }
            }
        }
        GgmlType::Q1_0 | GgmlType::Q2_0 => {
            // Sign bits (Q1_0, 128 values) or 2-bit digits (Q2_0, 64) on one f16 d: Q8_0's block
            // dot on each 32.
            let per = ty.block_size() / 32;
            for (kb, blk) in row.chunks_exact(ty.type_size()).enumerate() {
                let d = I::f16(blk, 0);
                for (ib, w) in unpack::q1_q2_0_digits(ty, blk)[..ty.block_size()].chunks_exact(32).enumerate() {
                    let (wv, b) = (I::i8s(w), per * kb + ib);
                    for t in 0..T {
                        acc[t] = I::fma(acc[t], I::dot(wv, xq(t, b)), d * xs[t].d[b]);
                    }
                }
            }
        }
        GgmlType::NVFP4 => {
            // 64 values in four 16-value sub-blocks, each with its own UE4M3 scale: the block dot
            // of each 32 taken once per sub-block, the other sub-block's levels zeroed.
            for (kb, blk) in row.chunks_exact(ty.type_size()).enumerate() {
                for s in 0..4 {
                    let (b, d, at) = (2 * kb + s / 2, unpack::ue4m3_scale(blk[s]), 16 * (s % 2));
                    let mut w = [0i8; 32];
                    w[at..at + 16].copy_from_slice(&unpack::nvfp4_levels(blk, s));
                    let wv = I::i8s(&w);
                    for t in 0..T {
                        acc[t] = I::fma(acc[t], I::dot(wv, xq(t, b)), d * xs[t].d[b]);
                    }
                }
            }
        }
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => unreachable!("float weights use the f32 path"),
    }
    std::array::from_fn(|t| I::hsum(acc[t]) + mins[t])
}

fn bytemuck_i8(b: &[u8]) -> &[i8] {
    // SAFETY: u8 and i8 have the same size, alignment and validity.
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const i8, b.len()) }
}

/// Expands one quantized row to f32 (the embedding lookup; matmuls never do this).
pub fn dequantize_row(ty: GgmlType, row: &[u8], out: &mut [f32]) {
    // A one-hot activation block per element would work through `dot_row` but costs O(k^2);
    // the block layouts are simple enough to read directly.
    let mut w = [0i8; 32];
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
            let size = ty.type_size();
            for (b, blk) in row.chunks_exact(size).enumerate() {
                let o = &mut out[32 * b..32 * b + 32];
                let d = rd16(blk, 0);
                match ty {
                    GgmlType::Q8_0 => o.iter_mut().zip(&blk[2..34]).for_each(|(y, q)| *y = (*q as i8) as f32 * d),
                    GgmlType::Q4_0 => {
                        nibbles(&blk[2..18], &mut w, 8);
                        o.iter_mut().zip(&w).for_each(|(y, q)| *y = *q as f32 * d);
                    }
                    GgmlType::Q4_1 => {
                        nibbles(&blk[4..20], &mut w, 0);
                        let m = rd16(blk, 2);
                        o.iter_mut().zip(&w).for_each(|(y, q)| *y = *q as f32 * d + m);
                    }
                    _ => {
                        let five_one = ty == GgmlType::Q5_1;
                        let qh_at = if five_one { 4 } else { 2 };
                        let qh = u32::from_le_bytes([blk[qh_at], blk[qh_at + 1], blk[qh_at + 2], blk[qh_at + 3]]);
                        nibbles(&blk[qh_at + 4..qh_at + 20], &mut w, 0);
                        for (j, y) in o.iter_mut().enumerate() {
                            let q = (w[j] as i32 | (((qh >> j) & 1) << 4) as i32) as f32;
                            *y = if five_one { q * d + rd16(blk, 2) } else { (q - 16.0) * d };
                        }
                    }
                }
            }
        }
        GgmlType::IQ4_NL => {
            for (blk, o) in row.chunks_exact(ty.type_size()).zip(out.chunks_exact_mut(32)) {
                let d = rd16(blk, 0);
                o.iter_mut().zip(unpack::iq4_levels(&blk[2..18])).for_each(|(y, q)| *y = q as f32 * d);
            }
        }
        _ => {
            // K-quants and IQ4_XS: run the block dot of each block against one-hot Q8
            // blocks of exactly representable scale (d = 1), which returns each element's value.
            let (size, bs) = (ty.type_size(), ty.block_size());
            let mut x = Q8Row { q: vec![0; bs], d: vec![1.0; bs / 32], dsum: vec![0.0; bs / 32] };
            for (blk, o) in row.chunks_exact(size).zip(out.chunks_exact_mut(bs)) {
                for (j, y) in o.iter_mut().enumerate() {
                    x.q[j] = 1;
                    x.dsum[j / 32] = 1.0;
                    *y = dot_rows_impl::<Portable, 1>(ty, blk, [&x])[0];
                    x.q[j] = 0;
                    x.dsum[j / 32] = 0.0;
                }
            }
        }
    }
}

mod float;
#[cfg(target_arch = "x86_64")]
mod pairs;
pub use float::*;

#[cfg(test)]
mod tests;
