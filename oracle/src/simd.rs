//! Dot-product kernels of the oracle: f32 x f32 products accumulated in f64.
//!
//! The product of two f32 values is exact in f64, so fused or unfused multiply-add gives the same
//! bits; only the summation order matters, and it is fixed (see `real::DOT_LANES`). The AVX-512 and
//! AVX2 paths are chosen at run time and must return exactly what `dot_lanes_portable` returns;
//! a test checks that on random vectors of every length up to a few hundred.

use crate::real::{reduce_lanes, DOT_LANES};

/// Portable reference of the fixed-order dot: lane `i % 32` accumulates element `i`.
#[inline]
pub fn dot_lanes_portable<T: Copy>(a: &[T], b: &[T], to_f64: impl Fn(T) -> f64) -> f64 {
    assert_eq!(a.len(), b.len(), "dot of vectors with different lengths");
    let mut lanes = [0.0f64; DOT_LANES];
    let full = a.len() / DOT_LANES * DOT_LANES;
    let mut i = 0;
    while i < full {
        for j in 0..DOT_LANES {
            lanes[j] += to_f64(a[i + j]) * to_f64(b[i + j]);
        }
        i += DOT_LANES;
    }
    for t in full..a.len() {
        lanes[t - full] += to_f64(a[t]) * to_f64(b[t]);
    }
    reduce_lanes(lanes)
}

/// f32 dot with f64 accumulation, dispatched at run time to the widest SIMD the CPU has.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "dot of vectors with different lengths");
    #[cfg(target_arch = "x86_64")]
    {
        if a.len() >= DOT_LANES {
            if has_avx512() {
                // SAFETY: the CPU reports avx512f; lengths are equal (asserted above).
                return unsafe { x86::dot_f32_avx512(a, b) };
            }
            if has_avx2_fma() {
                // SAFETY: the CPU reports avx2 and fma; lengths are equal (asserted above).
                return unsafe { x86::dot_f32_avx2(a, b) };
            }
        }
    }
    dot_lanes_portable(a, b, |x| x as f64)
}

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    use std::sync::OnceLock;
    static FLAG: OnceLock<bool> = OnceLock::new();
    *FLAG.get_or_init(|| {
        std::env::var_os("TOUCHSTONE_NO_SIMD").is_none() && is_x86_feature_detected!("avx512f")
    })
}

#[cfg(target_arch = "x86_64")]
fn has_avx2_fma() -> bool {
    use std::sync::OnceLock;
    static FLAG: OnceLock<bool> = OnceLock::new();
    *FLAG.get_or_init(|| {
        std::env::var_os("TOUCHSTONE_NO_SIMD").is_none()
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
    })
}

/// Which dot-product path this CPU uses (for reports and benchmarks).
pub fn dot_path_name() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512() {
            return "avx512f";
        }
        if has_avx2_fma() {
            return "avx2+fma";
        }
    }
    "portable"
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{reduce_lanes, DOT_LANES};
    use std::arch::x86_64::*;

    /// Four 8-lane f64 accumulators = lanes 0..32 in order.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_f32_avx512(a: &[f32], b: &[f32]) -> f64 {
        let n = a.len();
        let full = n / DOT_LANES * DOT_LANES;
        let pa = a.as_ptr();
        let pb = b.as_ptr();
        let mut acc0 = _mm512_setzero_pd();
        let mut acc1 = _mm512_setzero_pd();
        let mut acc2 = _mm512_setzero_pd();
        let mut acc3 = _mm512_setzero_pd();
        let mut i = 0;
        while i < full {
            let a01 = _mm512_loadu_ps(pa.add(i));
            let b01 = _mm512_loadu_ps(pb.add(i));
            let a23 = _mm512_loadu_ps(pa.add(i + 16));
            let b23 = _mm512_loadu_ps(pb.add(i + 16));
            let a0 = _mm512_cvtps_pd(_mm512_castps512_ps256(a01));
            let b0 = _mm512_cvtps_pd(_mm512_castps512_ps256(b01));
            let a1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a01), 1)));
            let b1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(b01), 1)));
            let a2 = _mm512_cvtps_pd(_mm512_castps512_ps256(a23));
            let b2 = _mm512_cvtps_pd(_mm512_castps512_ps256(b23));
            let a3 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a23), 1)));
            let b3 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(b23), 1)));
            // The products are exact in f64, so fmadd and mul+add give identical bits.
            acc0 = _mm512_fmadd_pd(a0, b0, acc0);
            acc1 = _mm512_fmadd_pd(a1, b1, acc1);
            acc2 = _mm512_fmadd_pd(a2, b2, acc2);
            acc3 = _mm512_fmadd_pd(a3, b3, acc3);
            i += DOT_LANES;
        }
        let mut lanes = [0.0f64; DOT_LANES];
        _mm512_storeu_pd(lanes.as_mut_ptr(), acc0);
        _mm512_storeu_pd(lanes.as_mut_ptr().add(8), acc1);
        _mm512_storeu_pd(lanes.as_mut_ptr().add(16), acc2);
        _mm512_storeu_pd(lanes.as_mut_ptr().add(24), acc3);
        for t in full..n {
            lanes[t - full] += (*pa.add(t) as f64) * (*pb.add(t) as f64);
        }
        reduce_lanes(lanes)
    }

    /// Eight 4-lane f64 accumulators = lanes 0..32 in order.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f64 {
        let n = a.len();
        let full = n / DOT_LANES * DOT_LANES;
        let pa = a.as_ptr();
        let pb = b.as_ptr();
        let mut acc = [_mm256_setzero_pd(); 8];
        let mut i = 0;
        while i < full {
            for (j, slot) in acc.iter_mut().enumerate() {
                let av = _mm256_cvtps_pd(_mm_loadu_ps(pa.add(i + 4 * j)));
                let bv = _mm256_cvtps_pd(_mm_loadu_ps(pb.add(i + 4 * j)));
                *slot = _mm256_fmadd_pd(av, bv, *slot);
            }
            i += DOT_LANES;
        }
        let mut lanes = [0.0f64; DOT_LANES];
        for (j, slot) in acc.iter().enumerate() {
            _mm256_storeu_pd(lanes.as_mut_ptr().add(4 * j), *slot);
        }
        for t in full..n {
            lanes[t - full] += (*pa.add(t) as f64) * (*pb.add(t) as f64);
        }
        reduce_lanes(lanes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(state: &mut u64) -> f32 {
        *state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
    }

    #[test]
    fn simd_dot_is_bit_identical_to_portable_order() {
        let mut s = 7u64;
        for n in 0..300 {
            let a: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
            let b: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
            let fast = dot_f32(&a, &b);
            let slow = dot_lanes_portable(&a, &b, |x| x as f64);
            assert_eq!(fast.to_bits(), slow.to_bits(), "n={n} path={}", dot_path_name());
        }
    }

    #[test]
    fn dot_matches_hand_computed_values() {
        // 1*4 + 2*5 + 3*6 = 32 exactly.
        assert_eq!(dot_f32(&[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0]), 32.0);
        // f64 accumulation keeps what f32 would lose: 1e8 + 1 - 1e8 = 1.
        let a = [1.0e8f32, 1.0, -1.0e8];
        let b = [1.0f32, 1.0, 1.0];
        assert_eq!(dot_f32(&a, &b), 1.0);
        // A long vector of ones: the exact length.
        let ones = vec![1.0f32; 1000];
        assert_eq!(dot_f32(&ones, &ones), 1000.0);
    }
}
