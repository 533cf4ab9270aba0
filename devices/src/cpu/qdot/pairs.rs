//! Four tokens' Q4_1 block dots on AVX-512, two tokens to a 512-bit register: a block's 32
//! weights unpacked once and broadcast to both halves, each half the 256-bit path's operations
//! for its own token (the same `vpdpbusd` lanes, the same f32 scale `d * d_x`, the same fused
//! multiply-add per lane, the min terms summed in block order, the same horizontal sum), so each
//! token's result has the bits of its own [`super::dot_row`]. Half the instructions per token of
//! the 256-bit path, where a prefill spends most of its time.

use super::{has_avx512_vnni, Avx2, BlockDot, Q8Row, Strides, AVX512_VNNI};
use std::sync::OnceLock;

/// Q4_1's block: f16 d, f16 m, 16 bytes of nibbles.
const Q4_1_BYTES: usize = 20;

/// Whether this CPU runs [`q4_1_rows_x4`].
pub(super) fn available() -> bool {
    static F: OnceLock<bool> = OnceLock::new();
    // The 256-bit EVEX path's features (avx2, fma, f16c, avx512vnni, avx512vl) and 512-bit registers.
    *F.get_or_init(|| has_avx512_vnni() && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw"))
}

/// `super::dot_rows_block` of Q4_1 rows with four tokens: row `r`, token `t` into
/// `out[r * at.row + t * at.token]`.
///
/// # Safety
/// The CPU must have what [`available`] checks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q4_1_rows_x4(rows: &[u8], row_bytes: usize, xs: [&Q8Row; 4], out: &mut [f32], at: Strides) {
    use std::arch::x86_64::*;
    if row_bytes == 0 {
        return; // empty rows: their dots are the zeros `out` holds
    }
    let nb = row_bytes / Q4_1_BYTES;
    assert!(row_bytes == nb * Q4_1_BYTES && xs.iter().all(|x| x.q.len() >= 32 * nb && x.d.len() >= nb && x.dsum.len() >= nb));
    assert!(out.len() >= at.needs(rows.len() / row_bytes, 4));
    // Per block, the four tokens' activations side by side (tokens 0 and 1 fill one register,
    // 2 and 3 the next), their scales as the halves want them ([d_x of token 0] x 8, [token 1]
    // x 8, ...), and their scaled block sums.
    let mut acts = vec![0i8; 128 * nb];
    let mut scales = vec![0.0f32; 32 * nb];
    let mut dsums = vec![0.0f32; 4 * nb];
    for b in 0..nb {
        for (t, x) in xs.iter().enumerate() {
            acts[128 * b + 32 * t..128 * b + 32 * t + 32].copy_from_slice(&x.q[32 * b..32 * b + 32]);
            scales[32 * b + 8 * t..32 * b + 8 * t + 8].fill(x.d[b]);
            dsums[4 * b + t] = x.dsum[b];
        }
    }
    for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
        let (mut acc01, mut acc23, mut mins) = (_mm512_setzero_ps(), _mm512_setzero_ps(), _mm_setzero_ps());
        for (b, blk) in row.chunks_exact(Q4_1_BYTES).enumerate() {
            let d = <Avx2<AVX512_VNNI> as BlockDot>::f16(blk, 0);
            let m = <Avx2<AVX512_VNNI> as BlockDot>::f16(blk, 2);
            // The 256-bit path's own unpacking (Q4_1: no fifth bit, no offset), to both halves.
            let w = _mm512_broadcast_i64x4(<Avx2<AVX512_VNNI> as BlockDot>::nibbles(&blk[4..20], 0, 0).mag);
            // SAFETY (loads): each reads inside a slice whose length is checked above (64
            // activations at 128b and 128b + 64; 16 scales at 32b and 32b + 16; 4 sums at 4b;
            // b < nb).
            let (x01, x23) = unsafe {
                (_mm512_loadu_si512(acts[128 * b..128 * b + 64].as_ptr() as *const __m512i), _mm512_loadu_si512(acts[128 * b + 64..128 * b + 128].as_ptr() as *const __m512i))
            };
            let dv = _mm512_set1_ps(d);
            let s01 = _mm512_mul_ps(dv, unsafe { _mm512_loadu_ps(scales[32 * b..32 * b + 16].as_ptr()) });
            let s23 = _mm512_mul_ps(dv, unsafe { _mm512_loadu_ps(scales[32 * b + 16..32 * b + 32].as_ptr()) });
            acc01 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x01)), s01, acc01);
            acc23 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x23)), s23, acc23);
            // The min terms: one product then one sum each, as the 256-bit path rounds them.
            mins = _mm_add_ps(mins, _mm_mul_ps(_mm_set1_ps(m), unsafe { _mm_loadu_ps(dsums[4 * b..4 * b + 4].as_ptr()) }));
        }
        let halves = [
            _mm512_castps512_ps256(acc01),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc01))),
            _mm512_castps512_ps256(acc23),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc23))),
        ];
        let mut m4 = [0.0f32; 4];
        // SAFETY: a 16-byte store into a 4-float array.
        unsafe { _mm_storeu_ps(m4.as_mut_ptr(), mins) };
        for t in 0..4 {
            out[r * at.row + t * at.token] = <Avx2<AVX512_VNNI> as BlockDot>::hsum(halves[t]) + m4[t];
        }
    }
}
