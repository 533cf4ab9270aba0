//! Dot-product kernels of the oracle: f32 x f32 products accumulated in f64.
//!
//! The product of two f32 values is exact in f64, so fused or unfused multiply-add gives the same
//! bits; only the summation order matters, and it is fixed (see `DOT_LANES`). The AVX-512 and
//! AVX2 paths are chosen at run time and must return exactly what `dot_lanes_portable` returns;
//! a test checks that on random vectors of every length up to a few hundred.

/// Number of independent f64 partial sums in a dot product. Element `i` always goes to lane
/// `i % DOT_LANES`; the lanes are then added in a fixed pairwise tree. Every implementation
/// (AVX-512, AVX2, portable) follows this exact order, which is what makes the result reproducible.
pub const DOT_LANES: usize = 32;

/// Adds the lane partial sums in the fixed pairwise tree: lane j += lane j+16, then j+8, j+4, j+2, j+1.
#[inline]
pub fn reduce_lanes(mut lanes: [f64; DOT_LANES]) -> f64 {
    let mut width = DOT_LANES / 2;
    while width >= 1 {
        for j in 0..width {
            lanes[j] += lanes[j + width];
        }
        width /= 2;
    }
    lanes[0]
}


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

/// Dot of an activation already widened to f64 with f32 weights: the same products (exact in
/// f64) and the same lane order as `dot_f32`, so the bits are identical; the activation is widened
/// once per matmul instead of once per weight row.
#[inline]
pub fn dot_f64_f32(x: &[f64], w: &[f32]) -> f64 {
    assert_eq!(x.len(), w.len(), "dot of vectors with different lengths");
    #[cfg(target_arch = "x86_64")]
    {
        if x.len() >= DOT_LANES && has_avx512() {
            // SAFETY: the CPU reports avx512f; lengths are equal (asserted above).
            return unsafe { x86::dot_f64_f32_avx512(x, w) };
        }
    }
    dot_mixed_portable(x, w)
}

/// Four dots sharing one weight row (prefill: each weight is loaded and widened once for four
/// tokens). Each result is bit-identical to `dot_f64_f32` of that token.
#[inline]
pub fn dot4_f64_f32(xs: [&[f64]; 4], w: &[f32]) -> [f64; 4] {
    for x in xs {
        assert_eq!(x.len(), w.len(), "dot of vectors with different lengths");
    }
    #[cfg(target_arch = "x86_64")]
    {
        if w.len() >= DOT_LANES && has_avx512() {
            // SAFETY: the CPU reports avx512f; lengths are equal (asserted above).
            return unsafe { x86::dot4_f64_f32_avx512::<4>(xs, w) };
        }
    }
    xs.map(|x| dot_f64_f32(x, w))
}

fn dot_mixed_portable(x: &[f64], w: &[f32]) -> f64 {
    let mut lanes = [0.0f64; DOT_LANES];
    let full = x.len() / DOT_LANES * DOT_LANES;
    let mut i = 0;
    while i < full {
        for j in 0..DOT_LANES {
            lanes[j] += x[i + j] * w[i + j] as f64;
        }
        i += DOT_LANES;
    }
    for t in full..x.len() {
        lanes[t - full] += x[t] * w[t] as f64;
    }
    reduce_lanes(lanes)
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
pub(crate) fn has_avx2_fma() -> bool {
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

    /// How far ahead of their loads the weight-row kernels prefetch. On a SmolLM2-sized f32 GEMV
    /// (540 MB on huge pages, 2-thread Intel Xeon VM; `cargo run --release -p oracle --example
    /// gemv_variants`) the hardware prefetchers alone gave 21.6 GB/s; 768 to 2,048 bytes ahead
    /// 24.2-24.9, 4 KiB ahead 21.8; an L2-only hint 23.7 and a non-temporal one 9.0.
    const PREFETCH_BYTES: usize = 1536;

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

    /// One dot of an f64 activation with an f32 weight row (decode): four 8-lane accumulators =
    /// lanes 0..32 in order, the weights prefetched `PREFETCH_BYTES` ahead. Its own loop, not
    /// `dot4_f64_f32_avx512::<1>`: with the generic one the oracle's GEMV (`gemv_variants`) ran
    /// at 22.9 / 23.4 GB/s, with this one 24.1 / 24.2.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_f64_f32_avx512(x: &[f64], w: &[f32]) -> f64 {
        let n = w.len();
        let full = n / DOT_LANES * DOT_LANES;
        let (px, pw) = (x.as_ptr(), w.as_ptr());
        let mut acc = [_mm512_setzero_pd(); 4];
        let mut i = 0;
        while i < full {
            prefetch_step(pw.wrapping_add(i));
            for (q, a) in acc.iter_mut().enumerate() {
                let wv = _mm512_cvtps_pd(_mm256_loadu_ps(pw.add(i + 8 * q)));
                *a = _mm512_fmadd_pd(_mm512_loadu_pd(px.add(i + 8 * q)), wv, *a);
            }
            i += DOT_LANES;
        }
        finish(acc, px, pw, full, n)
    }

    /// Asks for both cache lines of the 128-byte weight step at `w`, `PREFETCH_BYTES` ahead (past
    /// a row's end this reaches into the next row; a prefetch never faults).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn prefetch_step(w: *const f32) {
        let ahead = w.cast::<i8>().wrapping_add(PREFETCH_BYTES);
        _mm_prefetch::<_MM_HINT_T0>(ahead);
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64));
    }

    /// One token's dot from its four accumulators (lanes 0..32, elements `..full`): with no tail
    /// the tree in registers, else the lanes stored, elements `full..n` of `x` and `w` added to
    /// lanes `0..n - full`, and `reduce_lanes`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn finish(acc: [__m512d; 4], x: *const f64, w: *const f32, full: usize, n: usize) -> f64 {
        if full == n {
            return reduce_in_registers(acc);
        }
        let mut lanes = [0.0f64; DOT_LANES];
        for (q, a) in acc.iter().enumerate() {
            _mm512_storeu_pd(lanes.as_mut_ptr().add(8 * q), *a);
        }
        for k in full..n {
            lanes[k - full] += *x.add(k) * (*w.add(k) as f64);
        }
        reduce_lanes(lanes)
    }

    /// The fixed pairwise tree of `reduce_lanes` done in registers: each step adds the same lane
    /// pairs (j += j+16, j += j+8, j += j+4, j += j+2, j += j+1).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn reduce_in_registers(acc: [__m512d; 4]) -> f64 {
        let a = _mm512_add_pd(acc[0], acc[2]); // lanes 0..8 += 16..24
        let b = _mm512_add_pd(acc[1], acc[3]); // lanes 8..16 += 24..32
        let c = _mm512_add_pd(a, b); // lanes 0..8 += 8..16
        let d = _mm256_add_pd(_mm512_castpd512_pd256(c), _mm512_extractf64x4_pd(c, 1)); // 0..4 += 4..8
        let e = _mm_add_pd(_mm256_castpd256_pd128(d), _mm256_extractf128_pd(d, 1)); // 0..2 += 2..4
        _mm_cvtsd_f64(e) + _mm_cvtsd_f64(_mm_unpackhi_pd(e, e)) // 0 += 1
    }

    /// `N` dots of f64 activations with one f32 weight row (prefill calls it with four); per
    /// token, four 8-lane accumulators = lanes 0..32 in order.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot4_f64_f32_avx512<const N: usize>(xs: [&[f64]; 4], w: &[f32]) -> [f64; 4] {
        let n = w.len();
        let full = n / DOT_LANES * DOT_LANES;
        let pw = w.as_ptr();
        let px = xs.map(|x| x.as_ptr());
        let mut acc = [[_mm512_setzero_pd(); 4]; N];
        let mut i = 0;
        while i < full {
            prefetch_step(pw.wrapping_add(i));
            let w01 = _mm512_loadu_ps(pw.add(i));
            let w23 = _mm512_loadu_ps(pw.add(i + 16));
            let wv = [
                _mm512_cvtps_pd(_mm512_castps512_ps256(w01)),
                _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w01), 1))),
                _mm512_cvtps_pd(_mm512_castps512_ps256(w23)),
                _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w23), 1))),
            ];
            for t in 0..N {
                for q in 0..4 {
                    acc[t][q] = _mm512_fmadd_pd(_mm512_loadu_pd(px[t].add(i + 8 * q)), wv[q], acc[t][q]);
                }
            }
            i += DOT_LANES;
        }
        let mut res = [0.0f64; 4];
        for t in 0..N {
            res[t] = finish(acc[t], px[t], pw, full, n);
        }
        res
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
    fn prepared_dots_are_bit_identical_to_dot_f32() {
        let mut s = 11u64;
        for n in 0..200 {
            let w: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
            let xs: Vec<Vec<f32>> = (0..4).map(|_| (0..n).map(|_| lcg(&mut s)).collect()).collect();
            let xd: Vec<Vec<f64>> = xs.iter().map(|x| x.iter().map(|v| *v as f64).collect()).collect();
            let four = dot4_f64_f32([&xd[0], &xd[1], &xd[2], &xd[3]], &w);
            for t in 0..4 {
                let want = dot_lanes_portable(&xs[t], &w, |x| x as f64);
                assert_eq!(dot_f64_f32(&xd[t], &w).to_bits(), want.to_bits(), "n={n}");
                assert_eq!(four[t].to_bits(), want.to_bits(), "n={n} t={t}");
            }
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
