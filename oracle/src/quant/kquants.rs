//! The K-quants Q2_K to Q6_K (super-blocks of 256 with packed sub-block scales): decoders and reference encoders.

use super::*;
use half::f16;

/// The 256 quants of a Q2_K (0..4) or Q3_K (-4..4) super-block `b`, in value order; value i's
/// 16-value group (its scale) is i / 16. In each half (128 values, 32 bytes of `qs`), value
/// 128n + 32j + l (l < 32) is bits 2j..2j+2 of qs[32n + l]; Q3_K's third bit is bit 4n + j of
/// hmask[l] (clear: minus 4).
pub fn q2_q3_k_quants(ty: GgmlType, b: &[u8]) -> [i8; QK_K] {
    let q3 = ty == GgmlType::Q3_K;
    let qs = if q3 { &b[32..96] } else { &b[16..80] };
    std::array::from_fn(|i| {
        let (n, j, l) = (i / 128, (i % 128) / 32, i % 32);
        let low = ((qs[32 * n + l] >> (2 * j)) & 3) as i8;
        if q3 && b[l] & (1 << (4 * n + j)) == 0 {
            low - 4
        } else {
            low
        }
    })
}

// block_q2_K: scales[16] (low nibble scale, high nibble min of each 16-value group), qs[64],
// d: f16, dmin: f16; value = d * scale * q - dmin * min, q in 0..4.
#[inline(always)]
pub(crate) fn decode_q2_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (rd_f16(b, 80), rd_f16(b, 82));
    for (i, (v, q)) in y.iter_mut().zip(q2_q3_k_quants(GgmlType::Q2_K, b)).enumerate() {
        let g = b[i / 16];
        let (dl, ml) = (d * (g & 0xF) as f32, dmin * (g >> 4) as f32);
        *v = dl * q as f32 - ml;
    }
}

/// The sixteen 6-bit scales of a Q3_K super-block, unpacked from its 12 bytes (low nibbles in
/// bytes 0..8, the two high bits of scale j in byte 8 + j % 4 at bit 2 * (j / 4)), minus 32.
pub fn q3_k_scales(sc: &[u8]) -> [i8; 16] {
    std::array::from_fn(|j| {
        let low = if j < 8 { sc[j] & 0xF } else { sc[j - 8] >> 4 };
        let high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
        ((low | (high << 4)) as i32 - 32) as i8
    })
}

// block_q3_K: hmask[32], qs[64], scales[12], d: f16; value = d * scale * q, q in -4..4.
#[inline(always)]
pub(crate) fn decode_q3_k(b: &[u8], y: &mut [f32]) {
    let (d, scales) = (rd_f16(b, 108), q3_k_scales(&b[96..108]));
    for (i, (v, q)) in y.iter_mut().zip(q2_q3_k_quants(GgmlType::Q3_K, b)).enumerate() {
        *v = d * scales[i / 16] as f32 * q as f32;
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) packed in the 12 `scales` bytes of Q4_K/Q5_K.
#[inline]
pub fn k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

// block_q4_K: d: f16, dmin: f16, scales[12] (8 x (6-bit scale, 6-bit min)), qs[128].
// Each 64-element chunk uses one byte row of 32 qs: low nibbles = first 32 elements, high = next 32.
#[inline(always)]
pub(crate) fn decode_q4_k(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    let dmin = rd_f16(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for chunk in 0..4 {
        let (sc0, m0) = k_scale_min(2 * chunk, scales);
        let (sc1, m1) = k_scale_min(2 * chunk + 1, scales);
        let (d0, min0) = (d * sc0 as f32, dmin * m0 as f32);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let q = &qs[32 * chunk..32 * chunk + 32];
        let out = &mut y[64 * chunk..64 * chunk + 64];
        for l in 0..32 {
            out[l] = d0 * (q[l] & 0x0F) as f32 - min0;
            out[l + 32] = d1 * (q[l] >> 4) as f32 - min1;
        }
    }
}

// block_q5_K: d, dmin, scales[12], qh[32], qs[128]. Like Q4_K plus a 5th bit from qh:
// chunk c takes bit 2c of qh[l] for its first 32 elements and bit 2c+1 for the next 32.
#[inline(always)]
pub(crate) fn decode_q5_k(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    let dmin = rd_f16(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for chunk in 0..4 {
        let (sc0, m0) = k_scale_min(2 * chunk, scales);
        let (sc1, m1) = k_scale_min(2 * chunk + 1, scales);
        let (d0, min0) = (d * sc0 as f32, dmin * m0 as f32);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let q = &qs[32 * chunk..32 * chunk + 32];
        let (u0, u1) = (1u8 << (2 * chunk), 1u8 << (2 * chunk + 1));
        let out = &mut y[64 * chunk..64 * chunk + 64];
        for l in 0..32 {
            let h0 = if qh[l] & u0 != 0 { 16 } else { 0 };
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            out[l] = d0 * ((q[l] & 0x0F) + h0) as f32 - min0;
            out[l + 32] = d1 * ((q[l] >> 4) + h1) as f32 - min1;
        }
    }
}

// block_q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), scales: i8[16], d: f16 (last).
// Each 128-element half uses 64 ql, 32 qh and 8 scales; value = d * scale * (q - 32).
#[inline(always)]
pub(crate) fn decode_q6_k(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let out = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            out[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            out[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            out[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            out[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Reference encoders.
// ---------------------------------------------------------------------------------------------

/// Packs eight 6-bit (scale, min) pairs the way `k_scale_min` unpacks them.
pub(crate) fn pack_k_scales(sc: &[u8; 8], mn: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            q[j] |= sc[j] & 63;
            q[j + 4] |= mn[j] & 63;
        } else {
            q[j + 4] = (sc[j] & 0x0F) | ((mn[j] & 0x0F) << 4);
            q[j - 4] |= (sc[j] >> 4) << 6;
            q[j] |= (mn[j] >> 4) << 6;
        }
    }
    q
}

/// Q4_K (`five_bits = false`) or Q5_K: eight 32-element sub-blocks, each with a 6-bit scale and a
/// 6-bit min on top of the block's f16 `d` and `dmin`; value = d*sc*q - dmin*m.
pub(crate) fn encode_qk_asym(x: &[f32], five_bits: bool, out: &mut Vec<u8>) {
    let qmax = if five_bits { 31.0f32 } else { 15.0 };
    let mut sub_scale = [0.0f32; 8];
    let mut sub_min = [0.0f32; 8];
    for j in 0..8 {
        let s = &x[32 * j..32 * j + 32];
        let lo = s.iter().copied().fold(0.0f32, f32::min); // the min is stored as a non-negative offset
        let hi = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        sub_scale[j] = (hi - lo) / qmax;
        sub_min[j] = -lo;
    }
    let max_scale = sub_scale.iter().copied().fold(0.0f32, f32::max);
    let max_min = sub_min.iter().copied().fold(0.0f32, f32::max);
    let d = push_f16(out, max_scale / 63.0);
    let dmin = push_f16(out, max_min / 63.0);
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..8 {
        // Scales are rounded up so the sub-block range still fits in qmax steps.
        sc[j] = (sub_scale[j] * inv(d)).ceil().clamp(0.0, 63.0) as u8;
        mn[j] = (sub_min[j] * inv(dmin)).round().clamp(0.0, 63.0) as u8;
    }
    out.extend_from_slice(&pack_k_scales(&sc, &mn));
    let mut q = [0u8; QK_K];
    for j in 0..8 {
        let step = d * sc[j] as f32;
        let off = dmin * mn[j] as f32;
        let istep = inv(step);
        for l in 0..32 {
            q[32 * j + l] = ((x[32 * j + l] + off) * istep).round().clamp(0.0, qmax) as u8;
        }
    }
    if five_bits {
        let mut qh = [0u8; 32];
        for chunk in 0..4 {
            for l in 0..32 {
                qh[l] |= ((q[64 * chunk + l] >> 4) & 1) << (2 * chunk);
                qh[l] |= ((q[64 * chunk + 32 + l] >> 4) & 1) << (2 * chunk + 1);
            }
        }
        out.extend_from_slice(&qh);
    }
    for chunk in 0..4 {
        for l in 0..32 {
            out.push((q[64 * chunk + l] & 0x0F) | ((q[64 * chunk + 32 + l] & 0x0F) << 4));
        }
    }
}

/// Packs 256 two-bit values into Q2_K/Q3_K's `qs` layout (`k_low_bits`).
pub(crate) fn pack_k_low_bits(levels: &[u8; QK_K]) -> [u8; 64] {
    std::array::from_fn(|b| {
        let (n, l) = (b / 32, b % 32);
        (0..4).fold(0u8, |acc, j| acc | ((levels[128 * n + 32 * j + l] & 3) << (2 * j)))
    })
}

/// Q2_K: sixteen 16-element groups, each with a 4-bit scale and a 4-bit min on top of f16 `d` and
/// `dmin`. A simple encoder (not ggml's iterative one): each group's range [min(0, lo), hi]
/// split in 3 steps, the scales and mins rounded up to their 4-bit grids so the grid covers the
/// group (to within one `dmin`), each value rounded to the nearest of its four levels.
pub(crate) fn encode_q2_k(x: &[f32], out: &mut Vec<u8>) {
    let groups: Vec<(f32, f32)> = x.chunks_exact(16).map(|g| {
        let lo = g.iter().fold(0f32, |m, v| m.min(*v));
        let hi = g.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
        ((hi - lo).max(0.0) / 3.0, -lo)
    }).collect();
    let up = |v: f32| f16::from_f32(v * (1.0 + 2f32.powi(-10))).to_f32();
    let d = up(groups.iter().fold(0f32, |m, g| m.max(g.0)) / 15.0);
    let dmin = up(groups.iter().fold(0f32, |m, g| m.max(g.1)) / 15.0);
    let grid = |v: f32, step: f32| if step > 0.0 { (v / step).ceil().clamp(0.0, 15.0) as u8 } else { 0 };
    let scales: Vec<u8> = groups.iter().map(|(sc, mn)| grid(*sc, d) | (grid(*mn, dmin) << 4)).collect();
    let mut levels = [0u8; QK_K];
    for (i, v) in x.iter().enumerate() {
        let g = scales[i / 16];
        let (dl, ml) = (d * (g & 0xF) as f32, dmin * (g >> 4) as f32);
        levels[i] = if dl > 0.0 { ((v + ml) / dl).round().clamp(0.0, 3.0) as u8 } else { 0 };
    }
    out.extend_from_slice(&scales);
    out.extend_from_slice(&pack_k_low_bits(&levels));
    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
    out.extend_from_slice(&f16::from_f32(dmin).to_le_bytes());
}

/// Q3_K: sixteen 16-element groups with 6-bit signed scales on top of an f16 `d`, values in
/// -4..4. Each group's scale is its signed largest value over -4 (ggml's symmetric rule), the
/// scales put on their 6-bit grid by the largest one, each value rounded to its group's grid.
pub(crate) fn encode_q3_k(x: &[f32], out: &mut Vec<u8>) {
    let scales: Vec<f32> = x.chunks_exact(16).map(|g| signed_absmax(g) / -4.0).collect();
    let max_scale = scales.iter().fold(0f32, |m, s| if s.abs() > m.abs() { *s } else { m });
    let (d, ls): (f32, Vec<i32>) = if max_scale == 0.0 {
        (0.0, vec![0; 16])
    } else {
        let iscale = -32.0 / max_scale;
        let d = f16::from_f32(1.0 / iscale).to_f32();
        (d, scales.iter().map(|s| ((iscale * s).round() as i32).clamp(-32, 31)).collect())
    };
    let mut packed = [0u8; 12];
    for (j, l) in ls.iter().enumerate() {
        let l = (l + 32) as u8;
        if j < 8 {
            packed[j] = l & 0xF;
        } else {
            packed[j - 8] |= (l & 0xF) << 4;
        }
        packed[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
    }
    let (mut levels, mut hmask) = ([0u8; QK_K], [0u8; 32]);
    for (i, v) in x.iter().enumerate() {
        let dl = d * ls[i / 16] as f32;
        let q = if dl != 0.0 { (v / dl).round().clamp(-4.0, 3.0) as i32 } else { 0 };
        let stored = (q + 4) as u8;
        levels[i] = stored & 3;
        if stored > 3 {
            let (n, j, l) = (i / 128, (i % 128) / 32, i % 32);
            hmask[l] |= 1 << (4 * n + j);
        }
    }
    out.extend_from_slice(&hmask);
    out.extend_from_slice(&pack_k_low_bits(&levels));
    out.extend_from_slice(&packed);
    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
}

/// Q6_K: sixteen 16-element sub-blocks with signed 8-bit scales on top of an f16 `d`;
/// value = d*sc*(q-32), q in 0..64.
pub(crate) fn encode_q6_k(x: &[f32], out: &mut Vec<u8>) {
    let mut sub = [0.0f32; 16];
    for j in 0..16 {
        sub[j] = signed_absmax(&x[16 * j..16 * j + 16]) / -32.0;
    }
    let max_sub = signed_absmax(&sub);
    let d_f32 = max_sub / -127.0;
    let d = f16::from_f32(d_f32).to_f32();
    let mut sc = [0i8; 16];
    for j in 0..16 {
        // Sub-scales are rounded away from zero so each sub-block's range still fits in 64 steps.
        let v = sub[j] * inv(d);
        sc[j] = (v.signum() * v.abs().ceil()).clamp(-127.0, 127.0) as i8;
    }
    let mut q = [0u8; QK_K];
    for j in 0..16 {
        let step = d * sc[j] as f32;
        let istep = inv(step);
        for l in 0..16 {
            q[16 * j + l] = ((x[16 * j + l] * istep).round() + 32.0).clamp(0.0, 63.0) as u8;
        }
    }
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for half in 0..2 {
        let qq = &q[128 * half..128 * half + 128];
        for l in 0..32 {
            ql[64 * half + l] = (qq[l] & 0x0F) | ((qq[l + 64] & 0x0F) << 4);
            ql[64 * half + l + 32] = (qq[l + 32] & 0x0F) | ((qq[l + 96] & 0x0F) << 4);
            qh[32 * half + l] = (qq[l] >> 4) | ((qq[l + 32] >> 4) << 2) | ((qq[l + 64] >> 4) << 4) | ((qq[l + 96] >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|s| *s as u8));
    out.extend_from_slice(&f16::from_f32(d_f32).to_le_bytes());
}
