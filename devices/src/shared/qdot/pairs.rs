//! Four or eight tokens' Q4_1 block dots on AVX-512, two tokens to a 512-bit register: a block's 32
//! weights unpacked once and broadcast to both halves, each half the 256-bit path's operations
//! for its own token (the same `vpdpbusd` lanes, the same f32 scale `d * d_x`, the same fused
//! multiply-add per lane, the min terms summed in block order, the same horizontal sum), so each
//! token's result has the bits of its own [`super::dot_row`]. Half the instructions per token of
//! the 256-bit path, where a prefill spends most of its time.

use super::{has_avx512_vnni, Avx2, BlockDot, Q8Row, Strides, AVX512_VNNI};
use std::sync::OnceLock;

/// Q4_1's block: f16 d, f16 m, 16 bytes of nibbles.
const Q4_1_BYTES: usize = 20;

/// Whether this CPU runs [`q4_1_rows`].
pub(super) fn available() -> bool {
    static F: OnceLock<bool> = OnceLock::new();
    // The 256-bit EVEX path's features (avx2, fma, f16c, avx512vnni, avx512vl) and 512-bit registers.
    *F.get_or_init(|| has_avx512_vnni() && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw"))
}

/// `super::dot_rows_block` of Q4_1 rows with `T` tokens (4 or 8, in `P = T / 2` registers):
/// row `r`, token `t` into `out[r * at.row + t * at.token]`.
///
/// # Safety
/// The CPU must have what [`available`] checks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q4_1_rows<const T: usize, const P: usize>(rows: &[u8], row_bytes: usize, xs: [&Q8Row; T], out: &mut [f32], at: Strides) {
    use std::arch::x86_64::*;
    assert!(T == 2 * P && T <= 16, "q4_1_rows: two tokens to a register, at most 16");
    if row_bytes == 0 {
        return; // empty rows: their dots are the zeros `out` holds
    }
    let nb = row_bytes / Q4_1_BYTES;
    assert!(row_bytes == nb * Q4_1_BYTES && xs.iter().all(|x| x.q.len() >= 32 * nb && x.d.len() >= nb && x.dsum.len() >= nb));
    assert!(out.len() >= at.needs(rows.len() / row_bytes, T));
    // Per block, the tokens' activations side by side (tokens 0 and 1 fill the first register,
    // 2 and 3 the next, ...), their scales as the halves want them ([d_x of token 0] x 8,
    // [token 1] x 8, ...), and their scaled block sums (16 to a block, the unused ones 0).
    let mut acts = vec![0i8; 32 * T * nb];
    let mut scales = vec![0.0f32; 8 * T * nb];
    let mut dsums = vec![0.0f32; 16 * nb];
    for b in 0..nb {
        for (t, x) in xs.iter().enumerate() {
            acts[32 * (T * b + t)..32 * (T * b + t + 1)].copy_from_slice(&x.q[32 * b..32 * b + 32]);
            scales[8 * (T * b + t)..8 * (T * b + t + 1)].fill(x.d[b]);
            dsums[16 * b + t] = x.dsum[b];
        }
    }
    for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
        let (mut acc, mut mins) = ([_mm512_setzero_ps(); P], _mm512_setzero_ps());
        for (b, blk) in row.chunks_exact(Q4_1_BYTES).enumerate() {
            let d = <Avx2<AVX512_VNNI> as BlockDot>::f16(blk, 0);
            let m = <Avx2<AVX512_VNNI> as BlockDot>::f16(blk, 2);
            // The 256-bit path's own unpacking (Q4_1: no fifth bit, no offset), to both halves.
            let w = _mm512_broadcast_i64x4(<Avx2<AVX512_VNNI> as BlockDot>::nibbles(&blk[4..20], 0, 0).mag);
            let (a, s) = (&acts[32 * T * b..32 * T * (b + 1)], &scales[8 * T * b..8 * T * (b + 1)]);
            let dv = _mm512_set1_ps(d);
            for (p, acc) in acc.iter_mut().enumerate() {
                // SAFETY: 64 activations and 16 scales inside `a` and `s` (p < P = T / 2).
                let (x, sx) = unsafe { (_mm512_loadu_si512(a[64 * p..64 * p + 64].as_ptr() as *const __m512i), _mm512_loadu_ps(s[16 * p..16 * p + 16].as_ptr())) };
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x)), _mm512_mul_ps(dv, sx), *acc);
            }
            // The min terms: one product then one sum each, as the 256-bit path rounds them.
            // SAFETY: 16 sums at 16b (b < nb).
            mins = _mm512_add_ps(mins, _mm512_mul_ps(_mm512_set1_ps(m), unsafe { _mm512_loadu_ps(dsums[16 * b..16 * b + 16].as_ptr()) }));
        }
        let mut m16 = [0.0f32; 16];
        // SAFETY: a 64-byte store into a 16-float array.
        unsafe { _mm512_storeu_ps(m16.as_mut_ptr(), mins) };
        for (p, acc) in acc.iter().enumerate() {
            let halves = [_mm512_castps512_ps256(*acc), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*acc)))];
            for (h, half) in halves.into_iter().enumerate() {
                let t = 2 * p + h;
                out[r * at.row + t * at.token] = <Avx2<AVX512_VNNI> as BlockDot>::hsum(half) + m16[t];
            }
        }
    }
}
