//! The non-linear and low-bit formats: IQ4_NL/IQ4_XS, TQ1_0/TQ2_0, MXFP4, NVFP4, Q1_0/Q2_0.

use super::*;
use half::f16;

/// The sixteen levels of IQ4_NL and IQ4_XS (ggml's `kvalues_iq4nl`), indexed by a 4-bit q.
pub const IQ4_LEVELS: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// `N` values given as 4-bit indices into `levels`, ggml's nibble layout: the low nibbles of
/// `qs[0..N/2]` index values 0..N/2, the high ones N/2..N (IQ4_NL/IQ4_XS and MXFP4 blocks of 32,
/// NVFP4 sub-blocks of 16).
pub fn nibble_levels<const N: usize>(levels: &[i8; 16], qs: &[u8]) -> [i8; N] {
    std::array::from_fn(|j| levels[((qs[j % (N / 2)] >> (4 * (j / (N / 2)))) & 0xF) as usize])
}

/// The levels of 32 IQ4_NL/IQ4_XS values.
pub fn iq4_levels(qs: &[u8]) -> [i8; 32] {
    nibble_levels(&IQ4_LEVELS, qs)
}

// 32 values of IQ4_NL/IQ4_XS; value = dl * level.
#[inline(always)]
pub(crate) fn decode_iq4_32(qs: &[u8], dl: f32, y: &mut [f32]) {
    for (v, level) in y.iter_mut().zip(iq4_levels(qs)) {
        *v = dl * level as f32;
    }
}

// block_iq4_nl: d: f16, qs[16].
#[inline(always)]
pub(crate) fn decode_iq4_nl(b: &[u8], y: &mut [f32]) {
    decode_iq4_32(&b[2..18], rd_f16(b, 0), y);
}

/// The 6-bit scale of sub-block `ib` (0..8) of an IQ4_XS super-block, minus 32: its low four bits
/// in `scales_l` (byte 4 + ib / 2, nibble ib % 2), its high two in `scales_h` (bits 2ib, 2ib + 1).
pub fn iq4_xs_scale(b: &[u8], ib: usize) -> i32 {
    let high = u16::from_le_bytes([b[2], b[3]]);
    (((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) as i32 | ((((high >> (2 * ib)) & 3) as i32) << 4)) - 32
}

// block_iq4_xs: d: f16, scales_h: u16, scales_l[4], qs[128]; sub-block ib's value =
// (d * scale) * level.
#[inline(always)]
pub(crate) fn decode_iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    for (ib, y) in y.chunks_exact_mut(32).enumerate().take(8) {
        decode_iq4_32(&b[8 + 16 * ib..24 + 16 * ib], d * iq4_xs_scale(b, ib) as f32, y);
    }
}

/// 32 values as IQ4 levels of step `dl`: each value's nearest level (ties to the lower).
pub(crate) fn encode_iq4_32(x: &[f32], dl: f32) -> [u8; 16] {
    let level = |v: f32| -> u8 {
        if dl == 0.0 {
            return 8; // level 1, the one nearest zero
        }
        let t = v / dl;
        (0..16).min_by(|a, b| (t - IQ4_LEVELS[*a] as f32).abs().total_cmp(&(t - IQ4_LEVELS[*b] as f32).abs())).unwrap_or(8) as u8
    };
    std::array::from_fn(|j| level(x[j]) | (level(x[j + 16]) << 4))
}

/// IQ4_NL: a block's signed largest value maps to level -127 (ggml's symmetric rule), each value
/// to its nearest level (not ggml's searched scale).
pub(crate) fn encode_iq4_nl(x: &[f32], out: &mut Vec<u8>) {
    let d = push_f16(out, signed_absmax(x) / -127.0);
    out.extend_from_slice(&encode_iq4_32(x, d));
}

/// IQ4_XS: each 32-value sub-block's scale (its signed largest value over -127) on a 6-bit grid of
/// the super-block's largest scale over -32, each value to its nearest level.
pub(crate) fn encode_iq4_xs(x: &[f32], out: &mut Vec<u8>) {
    let scales: Vec<f32> = x.chunks_exact(32).map(|b| signed_absmax(b) / -127.0).collect();
    let max_scale = scales.iter().fold(0f32, |m, s| if s.abs() > m.abs() { *s } else { m });
    let d = f16::from_f32(max_scale / -32.0).to_f32();
    let ls: Vec<i32> = scales.iter().map(|s| if d != 0.0 { ((s / d).round() as i32).clamp(-32, 31) } else { 0 }).collect();
    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
    let high = ls.iter().enumerate().fold(0u16, |h, (ib, l)| h | ((((l + 32) >> 4) & 3) as u16) << (2 * ib));
    out.extend_from_slice(&high.to_le_bytes());
    for pair in ls.chunks_exact(2) {
        out.push((((pair[0] + 32) & 0xF) | (((pair[1] + 32) & 0xF) << 4)) as u8);
    }
    for (b, l) in x.chunks_exact(32).zip(&ls) {
        out.extend_from_slice(&encode_iq4_32(b, d * *l as f32));
    }
}

/// The 256 ternary digits (-1, 0 or 1) of a TQ1_0 or TQ2_0 block. TQ2_0 (`qs[64]`, then d: f16)
/// packs four per byte: bits 2l..2l+2 of byte 32j + m hold value 128j + 32l + m, as 0..=2 for
/// -1..=1. TQ1_0 (`qs[48]`, `qh[4]`, then d: f16) packs five per byte in base 3, most significant
/// first, as the byte's fraction of 243 (b = ceil(v * 256 / 243)): digit n of byte m of the first
/// 32 is value 32n + m, of the next 16 value 160 + 16n + m, and digit n (< 4) of `qh[m]` value
/// 240 + 4n + m; digit n is the top base-3 digit of b * 3^n (mod 256), ((b * 3^n mod 256) * 3) >> 8.
pub fn tq_trits(ty: GgmlType, b: &[u8]) -> [i8; QK_K] {
    let mut t = [0i8; QK_K];
    if ty == GgmlType::TQ2_0 {
        for (i, v) in t.iter_mut().enumerate() {
            let (j, l, m) = (i / 128, (i % 128) / 32, i % 32);
            *v = ((b[32 * j + m] >> (2 * l)) & 3) as i8 - 1;
        }
        return t;
    }
    let digit = |byte: u8, n: u32| ((byte.wrapping_mul(3u8.pow(n)) as u16 * 3) >> 8) as i8 - 1;
    for n in 0..5 {
        for m in 0..32 {
            t[32 * n as usize + m] = digit(b[m], n);
        }
        for m in 0..16 {
            t[160 + 16 * n as usize + m] = digit(b[32 + m], n);
        }
    }
    for n in 0..4 {
        for m in 0..4 {
            t[240 + 4 * n as usize + m] = digit(b[48 + m], n);
        }
    }
    t
}

// TQ1_0 / TQ2_0: value = d * digit, d the f16 at the block's end.
#[inline(always)]
pub(crate) fn decode_tq(ty: GgmlType, b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, ty.type_size() - 2);
    for (o, t) in y.iter_mut().zip(tq_trits(ty, b)) {
        *o = d * t as f32;
    }
}

/// TQ1_0 / TQ2_0: d = the block's largest magnitude, each value rounded to the nearest of -d, 0, d.
pub(crate) fn encode_tq(ty: GgmlType, x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let id = inv(amax);
    // 0..=2 for -1..=1.
    let q: Vec<u8> = x.iter().map(|v| ((v * id).round().clamp(-1.0, 1.0) + 1.0) as u8).collect();
    if ty == GgmlType::TQ2_0 {
        for j in 0..2 {
            for m in 0..32 {
                out.push((0..4).fold(0u8, |b, l| b | (q[128 * j + 32 * l + m] << (2 * l))));
            }
        }
    } else {
        // Digits most significant first, the byte the value's fraction of 243 rounded up.
        let pack = |digits: &mut dyn Iterator<Item = u8>| -> u8 {
            let v = digits.fold(0u16, |v, d| v * 3 + d as u16);
            ((v * 256).div_ceil(243)) as u8
        };
        for m in 0..32 {
            out.push(pack(&mut (0..5).map(|n| q[32 * n + m])));
        }
        for m in 0..16 {
            out.push(pack(&mut (0..5).map(|n| q[160 + 16 * n + m])));
        }
        for m in 0..4 {
            // Four digits and a zero fifth.
            out.push(pack(&mut (0..4).map(|n| q[240 + 4 * n + m]).chain([0])));
        }
    }
    push_f16(out, amax);
}

/// The sixteen values of a 4-bit MXFP4 element (OCP MX E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
/// negatives), doubled to integers as ggml stores them; the block's scale is halved to match.
pub const MXFP4_LEVELS: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// The scale of an MXFP4 block with E8M0 exponent byte `e`, halved (the levels are doubled):
/// 2^(e - 128), subnormal for e < 2.
pub fn mxfp4_scale(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits(((e - 1) as u32) << 23)
    }
}

/// The levels of an MXFP4 block's 32 values.
pub fn mxfp4_levels(qs: &[u8]) -> [i8; 32] {
    nibble_levels(&MXFP4_LEVELS, qs)
}

/// The levels of sub-block `s` (0..4) of an NVFP4 block `b`: 16 values, in `qs[8s..8s + 8]`.
pub fn nvfp4_levels(b: &[u8], s: usize) -> [i8; 16] {
    nibble_levels(&MXFP4_LEVELS, &b[4 + 8 * s..12 + 8 * s])
}

// block_mxfp4: e: u8 (E8M0), qs[16]; value = scale * level.
#[inline(always)]
pub(crate) fn decode_mxfp4(b: &[u8], y: &mut [f32]) {
    let d = mxfp4_scale(b[0]);
    for (o, l) in y.iter_mut().zip(mxfp4_levels(&b[1..17])) {
        *o = d * l as f32;
    }
}

/// MXFP4: the exponent puts the block's largest magnitude in [8, 16) steps (OCP's rule:
/// floor(log2(max)) - 2, so it lands on or above level 8, the largest in range for the top
/// exponent), each value to its nearest level (ties to the lower index); 0 for an all-zero block.
pub(crate) fn encode_mxfp4(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let e = if amax > 0.0 { (amax.log2().floor() as i32 - 2 + 127).clamp(0, 255) as u8 } else { 0 };
    let d = mxfp4_scale(e);
    out.push(e);
    out.extend((0..16).map(|j| nearest_fp4(x[j], d) | (nearest_fp4(x[j + 16], d) << 4)));
}

/// The digits of a Q1_0 block (128 values, bit j of `qs[j / 8]`: 1 for +1, 0 for -1) or a Q2_0
/// one (its 64 values first, bits 2(j % 4).. of `qs[j / 4]` as 0..=3 for -1..=2; the rest 0),
/// `qs` after the f16 d. A fixed array: the cpu block dots unpack a block at a time.
pub fn q1_q2_0_digits(ty: GgmlType, b: &[u8]) -> [i8; 128] {
    let qs = &b[2..18];
    match ty {
        GgmlType::Q1_0 => std::array::from_fn(|j| if (qs[j / 8] >> (j % 8)) & 1 == 1 { 1 } else { -1 }),
        _ => std::array::from_fn(|j| if j < 64 { ((qs[j / 4] >> (2 * (j % 4))) & 3) as i8 - 1 } else { 0 }),
    }
}

// Q1_0 / Q2_0: d: f16, qs[16]; value = digit * d.
#[inline(always)]
pub(crate) fn decode_q1_q2_0(ty: GgmlType, b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    for (o, q) in y.iter_mut().zip(q1_q2_0_digits(ty, b)) {
        *o = q as f32 * d;
    }
}

/// Q1_0: d = the block's mean magnitude, each value's sign (zero as +). Q2_0: d = its largest
/// magnitude, each value rounded to the nearest of -d, 0, d, 2d (ggml's reference rules).
pub(crate) fn encode_q1_q2_0(ty: GgmlType, x: &[f32], out: &mut Vec<u8>) {
    let mut qs = [0u8; 16];
    if ty == GgmlType::Q1_0 {
        let d = x.iter().fold(0.0f32, |s, v| s + v.abs()) / 128.0;
        push_f16(out, d);
        for (j, v) in x.iter().enumerate() {
            qs[j / 8] |= ((*v >= 0.0) as u8) << (j % 8);
        }
    } else {
        let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        push_f16(out, amax);
        let id = inv(amax);
        for (j, v) in x.iter().enumerate() {
            qs[j / 4] |= (((v * id).round() as i32 + 1).clamp(0, 3) as u8) << (2 * (j % 4));
        }
    }
    out.extend_from_slice(&qs);
}

/// An NVFP4 sub-block scale: unsigned E4M3 (4 exponent bits, bias 7; subnormal below exponent 1;
/// 0 and 0x7f, E4M3's NaN, read as 0; the top bit ignored), halved as MXFP4's is (the levels are
/// doubled): ggml's `ggml_ue4m3_to_fp32`.
pub fn ue4m3_scale(x: u8) -> f32 {
    if x == 0 || x == 0x7f {
        return 0.0;
    }
    let (e, m) = (((x >> 3) & 0xf) as i32, (x & 7) as f32);
    let raw = if e == 0 { m * 2f32.powi(-9) } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) };
    raw * 0.5
}

/// `x` as unsigned E4M3, as ggml rounds it (`ggml_fp32_to_ue4m3`: clamped to 448, the mantissa's
/// top three bits rounded by the next one, the largest normal 0x7e).
pub(crate) fn to_ue4m3(x: f32) -> u8 {
    if x.is_nan() || x <= 0.0 {
        return 0;
    }
    let x = x.min(448.0);
    let bits = x.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32 - 127 + 7;
    if exp <= 0 {
        let m = ((x * 512.0 + 0.5) as i32).min(7);
        return if m < 1 { 0 } else { m as u8 };
    }
    if exp >= 15 {
        return 0x7e;
    }
    let (mut e, mut m) = (exp, ((bits >> 20) & 7) as i32 + ((bits >> 19) & 1) as i32);
    if m > 7 {
        m = 0;
        e += 1;
        if e >= 15 {
            return 0x7e;
        }
    }
    ((e << 3) | m) as u8
}

// block_nvfp4: d[4] (UE4M3, one per 16 values), qs[32]; sub-block s's 16 values are the low
// nibbles of qs[8s..8s + 8], then their high nibbles; value = level * scale.
#[inline(always)]
pub(crate) fn decode_nvfp4(b: &[u8], y: &mut [f32]) {
    for (s, y) in y.chunks_exact_mut(16).enumerate() {
        let d = ue4m3_scale(b[s]);
        for (o, l) in y.iter_mut().zip(nvfp4_levels(b, s)) {
            *o = l as f32 * d;
        }
    }
}

/// The nearest of the sixteen (doubled) E2M1 levels at scale `d` (the first of equals).
pub(crate) fn nearest_fp4(v: f32, d: f32) -> u8 {
    (0..16u8).min_by(|a, b| (MXFP4_LEVELS[*a as usize] as f32 * d - v).abs().total_cmp(&(MXFP4_LEVELS[*b as usize] as f32 * d - v).abs())).unwrap_or(0)
}

/// NVFP4: each 16-value sub-block's scale its largest magnitude over 6 in UE4M3, each value to
/// its nearest level (ggml's reference rule).
pub(crate) fn encode_nvfp4(x: &[f32], out: &mut Vec<u8>) {
    let scales: Vec<u8> = x.chunks_exact(16).map(|b| to_ue4m3(b.iter().fold(0.0f32, |a, v| a.max(v.abs())) / 6.0)).collect();
    out.extend_from_slice(&scales);
    for (b, ue) in x.chunks_exact(16).zip(&scales) {
        let d = ue4m3_scale(*ue);
        out.extend((0..8).map(|j| nearest_fp4(b[j], d) | (nearest_fp4(b[j + 8], d) << 4)));
    }
}
