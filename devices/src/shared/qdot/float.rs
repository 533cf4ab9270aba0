//! Rows of float weights (F32, F16, BF16): widened to f32, and dot products with f32 activations.

use super::*;
/// Widens one row of a float weight type to f32 into `out`.
pub fn float_row(ty: GgmlType, row: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => row.chunks_exact(4).zip(out).for_each(|(c, o)| *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        GgmlType::F16 => {
            // half's slice conversion uses the F16C instructions when the CPU has them (checked
            // once per slice); converting value by value pays that check per value and does not
            // vectorize (measured 2.6 GB/s of weights, see docs/BENCHMARKS.md).
            use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
            // SAFETY: every bit pattern is a valid u16; align_to only hands out aligned halves.
            let (head, words, tail) = unsafe { row.align_to::<u16>() };
            if cfg!(target_endian = "little") && head.is_empty() && tail.is_empty() {
                words.reinterpret_cast::<f16>().convert_to_f32_slice(&mut out[..words.len()]);
            } else {
                let bits: Vec<f16> = row.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect();
                bits.as_slice().convert_to_f32_slice(&mut out[..bits.len()]);
            }
        }
        // bf16 is the top half of an f32: a shift, which the compiler vectorizes.
        GgmlType::BF16 => row.chunks_exact(2).zip(out).for_each(|(c, o)| *o = f32::from_bits(((c[1] as u32) << 24) | ((c[0] as u32) << 16))),
        _ => unreachable!("quantized weights use dot_row"),
    }
}

/// f32 dot with eight accumulators (vectorizes on any x86-64 / ARM target; AVX2 copy chosen at
/// run time). The summation order is the same in both copies.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2() {
            // SAFETY: the CPU reports avx2, fma and f16c.
            return unsafe { dot_f32_avx2(a, b) };
        }
    }
    dot_f32_impl(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_f32_impl(a, b)
}

#[inline(always)]
pub(crate) fn dot_f32_impl(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]) + tail
}

/// `y[i] += a * x[i]`, a multiply then an add (never fused): inlined into callers compiled for
/// AVX2 and for the portable target alike, with the same bits.
#[inline(always)]
pub(crate) fn axpy_f32_impl(y: &mut [f32], a: f32, x: &[f32]) {
    for (o, v) in y.iter_mut().zip(x) {
        *o += a * v;
    }
}

/// `dot_f32(x, w)` where `w` is `row` (F32, F16 or BF16 bytes, as many values as `x`) widened to
/// f32: the same arithmetic, so the same bits, but on AVX2 machines each 8 weights are widened
/// in a register as they are used instead of into a row buffer that is then read again (a
/// one-token GEMV on float weights is bound by that extra pass). Elsewhere it widens the row into
/// a buffer of its own, so callers on a hot path check `has_fused_float_dot` and widen into a
/// buffer they reuse instead.
pub fn dot_float_row(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    assert!(is_float(ty) && row.len() == x.len() * ty.type_size(), "dot_float_row: {} bytes of {ty:?} for {} values", row.len(), x.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU reports avx2, fma and f16c; lengths asserted above.
        return unsafe { dot_float_row_avx2(ty, row, x) };
    }
    let mut w = vec![0.0f32; x.len()];
    float_row(ty, row, &mut w);
    dot_f32(x, &w)
}

/// Whether `dot_float_row` has its fused form on this CPU.
pub fn has_fused_float_dot() -> bool {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        return true;
    }
    false
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_float_row_avx2(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let (n, size) = (x.len(), ty.type_size());
    let full = n / 8 * 8;
    let (xp, wp) = (x.as_ptr(), row.as_ptr());
    // The lanes are dot_f32_impl's eight accumulators: lane j sums x[8i + j] * w[8i + j] in
    // order, a multiply then an add (no fused multiply-add, as in the scalar code).
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i < full {
        let w = match ty {
            GgmlType::F32 => _mm256_loadu_ps(wp.add(4 * i) as *const f32),
            GgmlType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(wp.add(2 * i) as *const __m128i)),
            // bf16 is the top half of an f32.
            _ => _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(wp.add(2 * i) as *const __m128i)), 16)),
        };
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(xp.add(i)), w));
        i += 8;
    }
    let mut a = [0.0f32; 8];
    _mm256_storeu_ps(a.as_mut_ptr(), acc);
    let mut tail_w = [0.0f32; 8];
    float_row(ty, &row[full * size..], &mut tail_w[..n - full]);
    let tail: f32 = x[full..].iter().zip(&tail_w[..n - full]).map(|(x, y)| x * y).sum();
    (a[0] + a[4]) + (a[1] + a[5]) + (a[2] + a[6]) + (a[3] + a[7]) + tail
}

pub fn is_float(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}
