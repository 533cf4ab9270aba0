//! The devices' own unpacking of GGML block formats: scales, mins and quant digits as the
//! integer block dots (`qdot`) consume them. Written from the formats (ggml's block layouts), apart
//! from the oracle's decoders, so that a misreading of a format in either is a difference the
//! kernel gate sees rather than a bug the judge and the judged share (`xtask/tests/tidy.rs`,
//! `devices_do_their_own_unpacking`, keeps it so).

use oracle::quant::{GgmlType, QK_K};

/// The IQ4_NL / IQ4_XS non-linear levels.
pub(crate) const IQ4_LEVELS: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// E2M1 magnitudes doubled (so they are integers), sign in the high bit: MXFP4 and NVFP4.
const E2M1_DOUBLED: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Q4_K / Q5_K: sub-block `j`'s 6-bit scale and min from the 12 packed bytes: the first four
/// pairs sit in the low six bits of bytes 0-3 and 4-7; the last four take their low nibbles from
/// bytes 8-11 and their top two bits from the spare top bits of bytes 0-7.
pub fn k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 0x3F, q[j + 4] & 0x3F)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Q3_K: the sixteen 6-bit scales, less 32: scale `j`'s low nibble is the low (j < 8) or high
/// (j >= 8) nibble of byte `j % 8`; its top two bits are bits `2 * (j / 4)` of byte `8 + j % 4`.
pub fn q3_k_scales(sc: &[u8]) -> [i8; 16] {
    std::array::from_fn(|j| {
        let low = if j < 8 { sc[j] & 0x0F } else { sc[j - 8] >> 4 };
        let high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
        (low | (high << 4)) as i8 - 32
    })
}

/// Q2_K's 2-bit digits (0..3; its mins apply apart) or Q3_K's 3-bit ones (-4..3: the 2 low bits
/// less 4 where the high-bit mask is clear), in value order. Value `128 n + 32 j + l` takes bits
/// `2j` of quant byte `32 n + l`; Q3_K's high bit is bit `4 n + j` of mask byte `l`.
pub fn q2_q3_k_quants(ty: GgmlType, b: &[u8]) -> [i8; QK_K] {
    let (qs, hmask) = if ty == GgmlType::Q2_K { (&b[16..80], None) } else { (&b[32..96], Some(&b[..32])) };
    std::array::from_fn(|i| {
        let (n, j, l) = (i / 128, (i % 128) / 32, i % 32);
        let low = ((qs[32 * n + l] >> (2 * j)) & 3) as i8;
        match hmask {
            None => low,
            Some(h) if h[l] & (1 << (4 * n + j)) != 0 => low,
            Some(_) => low - 4,
        }
    })
}

/// IQ4_NL / IQ4_XS: 32 levels from 16 bytes (low nibbles the first 16 values, high the rest).
pub fn iq4_levels(qs: &[u8]) -> [i8; 32] {
    std::array::from_fn(|i| IQ4_LEVELS[(if i < 16 { qs[i] & 0x0F } else { qs[i - 16] >> 4 }) as usize])
}

/// IQ4_XS: sub-block `ib`'s 6-bit scale less 32 (low nibble in `scales_l` at bytes 4-7, two high
/// bits in the 16-bit `scales_h` at bytes 2-3).
pub fn iq4_xs_scale(b: &[u8], ib: usize) -> i32 {
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let low = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
    let high = ((scales_h >> (2 * ib)) & 3) as u8;
    (low | (high << 4)) as i32 - 32
}

/// TQ1_0's or TQ2_0's 256 ternary digits (-1, 0, 1) in value order. TQ2_0: value
/// `128 c + 32 s + m` is bits `2s` of byte `32 c + m`, less one. TQ1_0 packs five digits per byte
/// as a base-3 fraction of 256: digit `n` of byte `q` is `((q * 3^n mod 256) * 3) >> 8`; 32 bytes
/// give 160 values (digit-major), the next 16 bytes 80, and the 4 bytes at 48 the last 16 (four
/// digits each).
pub fn tq_trits(ty: GgmlType, b: &[u8]) -> [i8; QK_K] {
    let mut out = [0i8; QK_K];
    if ty == GgmlType::TQ2_0 {
        for (i, o) in out.iter_mut().enumerate() {
            let (c, s, m) = (i / 128, (i % 128) / 32, i % 32);
            *o = ((b[32 * c + m] >> (2 * s)) & 3) as i8 - 1;
        }
        return out;
    }
    let digit = |q: u8, n: u32| (((q.wrapping_mul(3u8.pow(n)) as u16) * 3) >> 8) as i8 - 1;
    let mut at = 0;
    for (start, len, digits) in [(0usize, 32usize, 5u32), (32, 16, 5), (48, 4, 4)] {
        for n in 0..digits {
            for m in 0..len {
                out[at] = digit(b[start + m], n);
                at += 1;
            }
        }
    }
    out
}

/// MXFP4's E8M0 scale halved (its levels are doubled): 2^(e - 128), exact down to e = 0.
pub fn mxfp4_scale(e: u8) -> f32 {
    (2f64).powi(e as i32 - 128) as f32
}

/// MXFP4: 32 doubled E2M1 levels from 16 bytes (low nibbles first).
pub fn mxfp4_levels(qs: &[u8]) -> [i8; 32] {
    std::array::from_fn(|i| E2M1_DOUBLED[(if i < 16 { qs[i] & 0x0F } else { qs[i - 16] >> 4 }) as usize])
}

/// NVFP4: sub-block `s`'s 16 doubled E2M1 levels: bytes `4 + 8 s ..` (after the four scales),
/// low nibbles the first 8 values.
pub fn nvfp4_levels(b: &[u8], s: usize) -> [i8; 16] {
    let qs = &b[4 + 8 * s..12 + 8 * s];
    std::array::from_fn(|i| E2M1_DOUBLED[(if i < 8 { qs[i] & 0x0F } else { qs[i - 8] >> 4 }) as usize])
}

/// NVFP4's unsigned E4M3 scale, halved for the doubled levels: exponent bits 3-6 (bias 7),
/// mantissa bits 0-2, subnormal at exponent 0; 0 and 0x7F (NaN) give 0; bit 7 is not read.
pub fn ue4m3_scale(x: u8) -> f32 {
    if x == 0 || x == 0x7F {
        return 0.0;
    }
    let (e, m) = (((x >> 3) & 0x0F) as i32, (x & 7) as f64);
    let v = if e == 0 { m * (2f64).powi(-9) } else { (1.0 + m / 8.0) * (2f64).powi(e - 7) };
    (0.5 * v) as f32
}

/// Q1_0's 128 signs (bit `j % 8` of byte `j / 8` after the f16 scale: set +1, clear -1) or
/// Q2_0's 64 two-bit digits less one (-1..2, bits `2 (j % 4)` of byte `j / 4`); a Q2_0 block
/// fills the first 64 entries.
pub fn q1_q2_0_digits(ty: GgmlType, b: &[u8]) -> [i8; 128] {
    let qs = &b[2..18];
    std::array::from_fn(|j| match ty {
        GgmlType::Q1_0 => {
            if (qs[j / 8] >> (j % 8)) & 1 == 1 {
                1
            } else {
                -1
            }
        }
        _ if j < 64 => ((qs[j / 4] >> (2 * (j % 4))) & 3) as i8 - 1,
        _ => 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use oracle::quant as judge;

    /// Each unpacking agrees with the oracle's, bit for bit, on random blocks of every byte
    /// pattern (two implementations of each format, written apart: a disagreement is a misread
    /// format in one of them).
    #[test]
    fn unpacking_agrees_with_the_oracle_on_random_blocks() {
        let mut rng = oracle::ops::SplitMix64(0x756e_7061_636b);
        for _ in 0..2000 {
            let b: Vec<u8> = (0..256).map(|_| rng.next_u64() as u8).collect();
            for j in 0..8 {
                assert_eq!(k_scale_min(j, &b[..12]), judge::k_scale_min(j, &b[..12]));
            }
            assert_eq!(q3_k_scales(&b[..12]), judge::q3_k_scales(&b[..12]));
            for ty in [GgmlType::Q2_K, GgmlType::Q3_K] {
                assert_eq!(q2_q3_k_quants(ty, &b[..ty.type_size()]), judge::q2_q3_k_quants(ty, &b[..ty.type_size()]), "{ty:?}");
            }
            assert_eq!(iq4_levels(&b[..16]), judge::iq4_levels(&b[..16]));
            for ib in 0..8 {
                assert_eq!(iq4_xs_scale(&b[..136], ib), judge::iq4_xs_scale(&b[..136], ib));
            }
            for ty in [GgmlType::TQ1_0, GgmlType::TQ2_0] {
                assert_eq!(tq_trits(ty, &b[..ty.type_size()]), judge::tq_trits(ty, &b[..ty.type_size()]), "{ty:?}");
            }
            assert_eq!(mxfp4_levels(&b[1..17]), judge::mxfp4_levels(&b[1..17]));
            for s in 0..4 {
                assert_eq!(nvfp4_levels(&b[..36], s), judge::nvfp4_levels(&b[..36], s));
            }
            for ty in [GgmlType::Q1_0, GgmlType::Q2_0] {
                let n = ty.block_size();
                assert_eq!(q1_q2_0_digits(ty, &b[..18])[..n], judge::q1_q2_0_digits(ty, &b[..18])[..n], "{ty:?}");
            }
        }
        for x in 0..=255u8 {
            assert_eq!(mxfp4_scale(x).to_bits(), judge::mxfp4_scale(x).to_bits(), "e8m0 {x}");
            assert_eq!(ue4m3_scale(x).to_bits(), judge::ue4m3_scale(x).to_bits(), "ue4m3 {x:#x}");
        }
    }
}
