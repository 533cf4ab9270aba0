//! Weight codecs: the tensor types of GGUF and their exact decoders, plus a plain reference
//! encoder for each (used to build the synthetic fixtures and to test the decoders).
//!
//! Decoding follows the format definitions bit for bit, in f32, with the same operation order as
//! ggml's reference dequantizers (`y = (d*sc)*q - dmin*m` for K-quants, `y = q*d + m` for Q4_1/Q5_1),
//! so a decoded weight equals what gguf-py or candle produce for the same bytes.
//!
//! The encoders are simple round-to-nearest quantizers (not ggml's iterative scale search); their
//! job is to produce valid blocks with a known error bound, not to minimise error.

use crate::error::{OracleError, Result};
use half::{bf16, f16};

/// The element types of GGUF tensors that the oracle reads (GGML type ids).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    BF16,
    IQ4_NL,
    IQ4_XS,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
    Q2_0,
}

pub const QK_K: usize = 256;

impl GgmlType {
    /// Every supported type, in GGML id order.
    pub const ALL: [GgmlType; 21] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_NL,
        GgmlType::IQ4_XS,
        GgmlType::BF16,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
        GgmlType::MXFP4,
        GgmlType::NVFP4,
        GgmlType::Q1_0,
        GgmlType::Q2_0,
    ];

    /// The GGML type id stored in GGUF tensor infos.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2_K => 10,
            GgmlType::Q3_K => 11,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::IQ4_NL => 20,
            GgmlType::IQ4_XS => 23,
            GgmlType::BF16 => 30,
            GgmlType::TQ1_0 => 34,
            GgmlType::TQ2_0 => 35,
            GgmlType::MXFP4 => 39,
            GgmlType::NVFP4 => 40,
            GgmlType::Q1_0 => 41,
            GgmlType::Q2_0 => 42,
        }
    }

    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.iter().copied().find(|t| t.id() == id)
    }

    /// ggml's name of a type id this tool does not decode (`iq2_xxs`, `q8_k`, `mxfp4`, ...), for
    /// saying which one a file holds; None for an id ggml does not name.
    pub fn ggml_name(id: u32) -> Option<&'static str> {
        const NAMES: [(u32, &str); 16] = [
            (4, "q4_2 (removed from ggml)"),
            (5, "q4_3 (removed from ggml)"),
            (9, "q8_1"),
            (15, "q8_k"),
            (16, "iq2_xxs"),
            (17, "iq2_xs"),
            (18, "iq3_xxs"),
            (19, "iq1_s"),
            (21, "iq3_s"),
            (22, "iq2_s"),
            (24, "i8"),
            (25, "i16"),
            (26, "i32"),
            (27, "i64"),
            (28, "f64"),
            (29, "iq1_m"),
        ];
        GgmlType::from_id(id).map(GgmlType::name).or_else(|| NAMES.iter().find(|(i, _)| *i == id).map(|(_, n)| *n))
    }

    /// Lower-case name as used in case ids and reports (`q4_1`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "f32",
            GgmlType::F16 => "f16",
            GgmlType::Q4_0 => "q4_0",
            GgmlType::Q4_1 => "q4_1",
            GgmlType::Q5_0 => "q5_0",
            GgmlType::Q5_1 => "q5_1",
            GgmlType::Q8_0 => "q8_0",
            GgmlType::Q2_K => "q2_k",
            GgmlType::Q3_K => "q3_k",
            GgmlType::Q4_K => "q4_k",
            GgmlType::Q5_K => "q5_k",
            GgmlType::Q6_K => "q6_k",
            GgmlType::IQ4_NL => "iq4_nl",
            GgmlType::IQ4_XS => "iq4_xs",
            GgmlType::BF16 => "bf16",
            GgmlType::TQ1_0 => "tq1_0",
            GgmlType::TQ2_0 => "tq2_0",
            GgmlType::MXFP4 => "mxfp4",
            GgmlType::NVFP4 => "nvfp4",
            GgmlType::Q1_0 => "q1_0",
            GgmlType::Q2_0 => "q2_0",
        }
    }

    pub fn from_name(name: &str) -> Option<GgmlType> {
        let lower = name.to_ascii_lowercase();
        GgmlType::ALL.iter().copied().find(|t| t.name() == lower)
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 | GgmlType::IQ4_NL | GgmlType::MXFP4 => 32,
            GgmlType::NVFP4 | GgmlType::Q2_0 => 64,
            GgmlType::Q1_0 => 128,
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K | GgmlType::IQ4_XS | GgmlType::TQ1_0 | GgmlType::TQ2_0 => QK_K,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q2_K => 84,
            GgmlType::Q3_K => 110,
            GgmlType::Q4_K => 144,
            GgmlType::Q5_K => 176,
            GgmlType::Q6_K => 210,
            GgmlType::IQ4_NL => 18,
            GgmlType::IQ4_XS => 136,
            GgmlType::TQ1_0 => 54,
            GgmlType::TQ2_0 => 66,
            GgmlType::MXFP4 => 17,
            GgmlType::NVFP4 => 36,
            GgmlType::Q1_0 | GgmlType::Q2_0 => 18,
        }
    }

    /// Bytes needed for `n_elements`, or None when `n_elements` is not a whole number of blocks
    /// or the size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !n_elements.is_multiple_of(bs) {
            return None;
        }
        (n_elements / bs).checked_mul(self.type_size() as u64)
    }
}

#[inline]
fn rd_f16(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Decodes `n` elements of type `ty` from `bytes` into `out` (which must hold `n` values).
pub fn decode_into(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let n = out.len();
    let need = ty.bytes_for(n as u64).ok_or_else(|| {
        OracleError::Codec(format!("{} elements is not a whole number of {} blocks ({} per block)", n, ty.name(), ty.block_size()))
    })?;
    if bytes.len() as u64 != need {
        return Err(OracleError::Codec(format!(
            "{}: {} elements need {} bytes, got {}",
            ty.name(),
            n,
            need,
            bytes.len()
        )));
    }
    let ts = ty.type_size();
    let bs = ty.block_size();
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        _ => {
            for (blk, y) in bytes.chunks_exact(ts).zip(out.chunks_exact_mut(bs)) {
                match ty {
                    GgmlType::Q4_0 => decode_q4_0(blk, y),
                    GgmlType::Q4_1 => decode_q4_1(blk, y),
                    GgmlType::Q5_0 => decode_q5_0(blk, y),
                    GgmlType::Q5_1 => decode_q5_1(blk, y),
                    GgmlType::Q8_0 => decode_q8_0(blk, y),
                    GgmlType::Q2_K => decode_q2_k(blk, y),
                    GgmlType::Q3_K => decode_q3_k(blk, y),
                    GgmlType::Q4_K => decode_q4_k(blk, y),
                    GgmlType::Q5_K => decode_q5_k(blk, y),
                    GgmlType::Q6_K => decode_q6_k(blk, y),
                    GgmlType::IQ4_NL => decode_iq4_nl(blk, y),
                    GgmlType::IQ4_XS => decode_iq4_xs(blk, y),
                    GgmlType::TQ1_0 | GgmlType::TQ2_0 => decode_tq(ty, blk, y),
                    GgmlType::MXFP4 => decode_mxfp4(blk, y),
                    GgmlType::NVFP4 => decode_nvfp4(blk, y),
                    GgmlType::Q1_0 | GgmlType::Q2_0 => decode_q1_q2_0(ty, blk, y),
                    _ => unreachable!("scalar types handled above"),
                }
            }
        }
    }
    Ok(())
}

/// Decodes `n` elements into a new vector.
pub fn decode(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>> {
    let mut out = vec![0.0f32; n];
    decode_into(ty, bytes, &mut out)?;
    Ok(out)
}

/// Byte offsets of a block's f16 scale fields, the scale (`d`) first and then the min where there
/// is one (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K); every other field is a small integer. A block
/// decodes to finite values exactly when these are finite: with a finite f16 `d` (at most 65504)
/// the largest product, d * 63 * 31 or d * 127, stays far inside f32's range, and IEEE arithmetic
/// makes every value that uses a NaN or infinite scale NaN or infinite (infinity times 0 is NaN).
/// MXFP4's scale is a power of two, never NaN, but its largest overflow f32
/// ([`may_not_be_finite`]); NVFP4's are UE4M3 values, each at most 240 (times a level of at
/// most 6: always finite).
pub fn scale_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::MXFP4 | GgmlType::NVFP4 => &[],
        GgmlType::Q1_0 | GgmlType::Q2_0 => &[0],
        GgmlType::TQ1_0 => &[52],
        GgmlType::TQ2_0 => &[64],
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::IQ4_NL | GgmlType::IQ4_XS => &[0],
    }
}

/// `bytes` (a tensor `name` of `label`, rows of `row_len` values) when every value is finite;
/// else the error every loader gives for a NaN or infinite weight, naming element, row and column.
pub fn finite_weight<'a>(label: &str, name: &str, ty: GgmlType, bytes: &'a [u8], row_len: usize) -> Result<&'a [u8]> {
    match first_non_finite(ty, bytes) {
        Some((element, v)) => Err(crate::OracleError::non_finite_weight(label, name, element, v, row_len)),
        None => Ok(bytes),
    }
}

/// The first element of `bytes` (packed type `ty`, a whole number of blocks) that decodes to NaN or
/// an infinity, with the value it decodes to; None when every element is finite. Reads the scale
/// fields of quantized blocks and decodes only a block whose scales are not finite, so checking a
/// model's packed weights costs a small fraction of decoding them. A trailing partial block is
/// ignored (the loaders check sizes).
pub fn first_non_finite(ty: GgmlType, bytes: &[u8]) -> Option<(usize, f32)> {
    let hit = |i: usize, v: f32| (!v.is_finite()).then_some((i, v));
    match ty {
        GgmlType::F32 => bytes.chunks_exact(4).enumerate().find_map(|(i, c)| hit(i, f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        GgmlType::F16 => bytes.chunks_exact(2).enumerate().find_map(|(i, c)| hit(i, f16::from_le_bytes([c[0], c[1]]).to_f32())),
        GgmlType::BF16 => bytes.chunks_exact(2).enumerate().find_map(|(i, c)| hit(i, bf16::from_le_bytes([c[0], c[1]]).to_f32())),
        _ => {
            let (ts, bs) = (ty.type_size(), ty.block_size());
            let mut y = vec![0.0f32; bs];
            bytes.chunks_exact(ts).enumerate().find_map(|(bi, blk)| {
                if !may_not_be_finite(ty, blk) {
                    return None;
                }
                decode_into(ty, blk, &mut y).ok()?;
                y.iter().enumerate().find_map(|(j, &v)| hit(bi * bs + j, v))
            })
        }
    }
}

/// Whether a block of `ty` may decode to a value that is not finite (then decoded to see): a
/// scale field that is not finite, or an MXFP4 exponent of 2^125 or more (times its largest
/// level, 6, past f32's range).
fn may_not_be_finite(ty: GgmlType, blk: &[u8]) -> bool {
    match ty {
        GgmlType::MXFP4 => blk[0] >= 253,
        _ => !scale_fields(ty).iter().all(|&at| rd_f16(blk, at).is_finite()),
    }
}

// block_q4_0: d: f16, qs[16]. Low nibbles are elements 0..16, high nibbles 16..32; value = (q - 8) * d.
fn decode_q4_0(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

// block_q4_1: d: f16, m: f16, qs[16]; value = q * d + m.
fn decode_q4_1(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    let m = rd_f16(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

// block_q5_0: d: f16, qh: u32 (bit j = 5th bit of element j), qs[16]; value = (q - 16) * d.
fn decode_q5_0(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let h0 = ((qh >> j) & 1) << 4;
        let h1 = ((qh >> (j + 16)) & 1) << 4;
        y[j] = (((qs[j] & 0x0F) as u32 | h0) as i32 - 16) as f32 * d;
        y[j + 16] = (((qs[j] >> 4) as u32 | h1) as i32 - 16) as f32 * d;
    }
}

// block_q5_1: d: f16, m: f16, qh: u32, qs[16]; value = q * d + m.
fn decode_q5_1(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    let m = rd_f16(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let h0 = ((qh >> j) & 1) << 4;
        let h1 = ((qh >> (j + 16)) & 1) << 4;
        y[j] = ((qs[j] & 0x0F) as u32 | h0) as f32 * d + m;
        y[j + 16] = ((qs[j] >> 4) as u32 | h1) as f32 * d + m;
    }
}

// block_q8_0: d: f16, qs: i8[32]; value = q * d.
fn decode_q8_0(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

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
fn decode_q2_k(b: &[u8], y: &mut [f32]) {
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
fn decode_q3_k(b: &[u8], y: &mut [f32]) {
    let (d, scales) = (rd_f16(b, 108), q3_k_scales(&b[96..108]));
    for (i, (v, q)) in y.iter_mut().zip(q2_q3_k_quants(GgmlType::Q3_K, b)).enumerate() {
        *v = d * scales[i / 16] as f32 * q as f32;
    }
}

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
fn decode_iq4_32(qs: &[u8], dl: f32, y: &mut [f32]) {
    for (v, level) in y.iter_mut().zip(iq4_levels(qs)) {
        *v = dl * level as f32;
    }
}

// block_iq4_nl: d: f16, qs[16].
fn decode_iq4_nl(b: &[u8], y: &mut [f32]) {
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
fn decode_iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    for (ib, y) in y.chunks_exact_mut(32).enumerate().take(8) {
        decode_iq4_32(&b[8 + 16 * ib..24 + 16 * ib], d * iq4_xs_scale(b, ib) as f32, y);
    }
}

/// 32 values as IQ4 levels of step `dl`: each value's nearest level (ties to the lower).
fn encode_iq4_32(x: &[f32], dl: f32) -> [u8; 16] {
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
fn encode_iq4_nl(x: &[f32], out: &mut Vec<u8>) {
    let d = push_f16(out, signed_absmax(x) / -127.0);
    out.extend_from_slice(&encode_iq4_32(x, d));
}

/// IQ4_XS: each 32-value sub-block's scale (its signed largest value over -127) on a 6-bit grid of
/// the super-block's largest scale over -32, each value to its nearest level.
fn encode_iq4_xs(x: &[f32], out: &mut Vec<u8>) {
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
fn decode_tq(ty: GgmlType, b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, ty.type_size() - 2);
    for (o, t) in y.iter_mut().zip(tq_trits(ty, b)) {
        *o = d * t as f32;
    }
}

/// TQ1_0 / TQ2_0: d = the block's largest magnitude, each value rounded to the nearest of -d, 0, d.
fn encode_tq(ty: GgmlType, x: &[f32], out: &mut Vec<u8>) {
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
fn decode_mxfp4(b: &[u8], y: &mut [f32]) {
    let d = mxfp4_scale(b[0]);
    for (o, l) in y.iter_mut().zip(mxfp4_levels(&b[1..17])) {
        *o = d * l as f32;
    }
}

/// MXFP4: the exponent puts the block's largest magnitude in [8, 16) steps (OCP's rule:
/// floor(log2(max)) - 2, so it lands on or above level 8, the largest in range for the top
/// exponent), each value to its nearest level (ties to the lower index); 0 for an all-zero block.
fn encode_mxfp4(x: &[f32], out: &mut Vec<u8>) {
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
fn decode_q1_q2_0(ty: GgmlType, b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    for (o, q) in y.iter_mut().zip(q1_q2_0_digits(ty, b)) {
        *o = q as f32 * d;
    }
}

/// Q1_0: d = the block's mean magnitude, each value's sign (zero as +). Q2_0: d = its largest
/// magnitude, each value rounded to the nearest of -d, 0, d, 2d (ggml's reference rules).
fn encode_q1_q2_0(ty: GgmlType, x: &[f32], out: &mut Vec<u8>) {
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
fn to_ue4m3(x: f32) -> u8 {
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
fn decode_nvfp4(b: &[u8], y: &mut [f32]) {
    for (s, y) in y.chunks_exact_mut(16).enumerate() {
        let d = ue4m3_scale(b[s]);
        for (o, l) in y.iter_mut().zip(nvfp4_levels(b, s)) {
            *o = l as f32 * d;
        }
    }
}

/// The nearest of the sixteen (doubled) E2M1 levels at scale `d` (the first of equals).
fn nearest_fp4(v: f32, d: f32) -> u8 {
    (0..16u8).min_by(|a, b| (MXFP4_LEVELS[*a as usize] as f32 * d - v).abs().total_cmp(&(MXFP4_LEVELS[*b as usize] as f32 * d - v).abs())).unwrap_or(0)
}

/// NVFP4: each 16-value sub-block's scale its largest magnitude over 6 in UE4M3, each value to
/// its nearest level (ggml's reference rule).
fn encode_nvfp4(x: &[f32], out: &mut Vec<u8>) {
    let scales: Vec<u8> = x.chunks_exact(16).map(|b| to_ue4m3(b.iter().fold(0.0f32, |a, v| a.max(v.abs())) / 6.0)).collect();
    out.extend_from_slice(&scales);
    for (b, ue) in x.chunks_exact(16).zip(&scales) {
        let d = ue4m3_scale(*ue);
        out.extend((0..8).map(|j| nearest_fp4(b[j], d) | (nearest_fp4(b[j + 8], d) << 4)));
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
fn decode_q4_k(b: &[u8], y: &mut [f32]) {
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
fn decode_q5_k(b: &[u8], y: &mut [f32]) {
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
fn decode_q6_k(b: &[u8], y: &mut [f32]) {
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

/// Encodes `x` (a whole number of blocks) into type `ty`.
pub fn encode(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>> {
    let need = ty.bytes_for(x.len() as u64).ok_or_else(|| {
        OracleError::Codec(format!("{} elements is not a whole number of {} blocks ({} per block)", x.len(), ty.name(), ty.block_size()))
    })?;
    let mut out = Vec::with_capacity(need as usize);
    match ty {
        GgmlType::F32 => x.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgmlType::F16 => x.iter().for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        GgmlType::BF16 => x.iter().for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        _ => {
            for blk in x.chunks_exact(ty.block_size()) {
                match ty {
                    GgmlType::Q4_0 => encode_q4_0(blk, &mut out),
                    GgmlType::Q4_1 => encode_q4_1(blk, &mut out),
                    GgmlType::Q5_0 => encode_q5_0(blk, &mut out),
                    GgmlType::Q5_1 => encode_q5_1(blk, &mut out),
                    GgmlType::Q8_0 => encode_q8_0(blk, &mut out),
                    GgmlType::Q2_K => encode_q2_k(blk, &mut out),
                    GgmlType::Q3_K => encode_q3_k(blk, &mut out),
                    GgmlType::Q4_K => encode_qk_asym(blk, false, &mut out),
                    GgmlType::Q5_K => encode_qk_asym(blk, true, &mut out),
                    GgmlType::Q6_K => encode_q6_k(blk, &mut out),
                    GgmlType::IQ4_NL => encode_iq4_nl(blk, &mut out),
                    GgmlType::IQ4_XS => encode_iq4_xs(blk, &mut out),
                    GgmlType::TQ1_0 | GgmlType::TQ2_0 => encode_tq(ty, blk, &mut out),
                    GgmlType::MXFP4 => encode_mxfp4(blk, &mut out),
                    GgmlType::NVFP4 => encode_nvfp4(blk, &mut out),
                    GgmlType::Q1_0 | GgmlType::Q2_0 => encode_q1_q2_0(ty, blk, &mut out),
                    _ => unreachable!(),
                }
            }
        }
    }
    debug_assert_eq!(out.len() as u64, need);
    Ok(out)
}

fn push_f16(out: &mut Vec<u8>, v: f32) -> f32 {
    let h = f16::from_f32(v);
    out.extend_from_slice(&h.to_le_bytes());
    h.to_f32()
}

/// The element of largest magnitude, with its sign (ggml's symmetric formats scale by it).
fn signed_absmax(x: &[f32]) -> f32 {
    let mut best = 0.0f32;
    for &v in x {
        if v.abs() > best.abs() {
            best = v;
        }
    }
    best
}

fn inv(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

fn encode_q4_0(x: &[f32], out: &mut Vec<u8>) {
    let max = signed_absmax(x);
    let d = push_f16(out, max / -8.0);
    let id = inv(d);
    let q = |v: f32| ((v * id + 8.5).floor().clamp(0.0, 15.0)) as u8;
    for j in 0..16 {
        out.push(q(x[j]) | (q(x[j + 16]) << 4));
    }
}

fn encode_q4_1(x: &[f32], out: &mut Vec<u8>) {
    let min = x.iter().copied().fold(f32::INFINITY, f32::min);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = push_f16(out, (max - min) / 15.0);
    let m = push_f16(out, min);
    let id = inv(d);
    let q = |v: f32| (((v - m) * id + 0.5).floor().clamp(0.0, 15.0)) as u8;
    for j in 0..16 {
        out.push(q(x[j]) | (q(x[j + 16]) << 4));
    }
}

fn encode_q5_0(x: &[f32], out: &mut Vec<u8>) {
    let max = signed_absmax(x);
    let d = push_f16(out, max / -16.0);
    let id = inv(d);
    let q = |v: f32| ((v * id + 16.5).floor().clamp(0.0, 31.0)) as u32;
    let mut qh = 0u32;
    let mut qs = [0u8; 16];
    for j in 0..16 {
        let (a, b) = (q(x[j]), q(x[j + 16]));
        qs[j] = (a & 0x0F) as u8 | (((b & 0x0F) as u8) << 4);
        qh |= ((a >> 4) & 1) << j;
        qh |= ((b >> 4) & 1) << (j + 16);
    }
    out.extend_from_slice(&qh.to_le_bytes());
    out.extend_from_slice(&qs);
}

fn encode_q5_1(x: &[f32], out: &mut Vec<u8>) {
    let min = x.iter().copied().fold(f32::INFINITY, f32::min);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = push_f16(out, (max - min) / 31.0);
    let m = push_f16(out, min);
    let id = inv(d);
    let q = |v: f32| (((v - m) * id + 0.5).floor().clamp(0.0, 31.0)) as u32;
    let mut qh = 0u32;
    let mut qs = [0u8; 16];
    for j in 0..16 {
        let (a, b) = (q(x[j]), q(x[j + 16]));
        qs[j] = (a & 0x0F) as u8 | (((b & 0x0F) as u8) << 4);
        qh |= ((a >> 4) & 1) << j;
        qh |= ((b >> 4) & 1) << (j + 16);
    }
    out.extend_from_slice(&qh.to_le_bytes());
    out.extend_from_slice(&qs);
}

fn encode_q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = push_f16(out, amax / 127.0);
    let id = inv(d);
    for &v in x {
        out.push(((v * id).round().clamp(-127.0, 127.0) as i8) as u8);
    }
}

/// Packs eight 6-bit (scale, min) pairs the way `k_scale_min` unpacks them.
fn pack_k_scales(sc: &[u8; 8], mn: &[u8; 8]) -> [u8; 12] {
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
fn encode_qk_asym(x: &[f32], five_bits: bool, out: &mut Vec<u8>) {
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
fn pack_k_low_bits(levels: &[u8; QK_K]) -> [u8; 64] {
    std::array::from_fn(|b| {
        let (n, l) = (b / 32, b % 32);
        (0..4).fold(0u8, |acc, j| acc | ((levels[128 * n + 32 * j + l] & 3) << (2 * j)))
    })
}

/// Q2_K: sixteen 16-element groups, each with a 4-bit scale and a 4-bit min on top of f16 `d` and
/// `dmin`. A simple encoder (not ggml's iterative one): each group's range [min(0, lo), hi]
/// split in 3 steps, the scales and mins rounded up to their 4-bit grids so the grid covers the
/// group (to within one `dmin`), each value rounded to the nearest of its four levels.
fn encode_q2_k(x: &[f32], out: &mut Vec<u8>) {
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
fn encode_q3_k(x: &[f32], out: &mut Vec<u8>) {
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
fn encode_q6_k(x: &[f32], out: &mut Vec<u8>) {
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

/// Largest absolute error the reference encoder may make on one block of `x`, derived from the
/// block's decoded scales: half a quantization step (round-to-nearest), plus for the asymmetric
/// K-formats half a `dmin` step from rounding the 6-bit min, plus f32 rounding of the decode.
pub fn encode_error_bound(ty: GgmlType, x: &[f32], block: &[u8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let rounding = amax * 4.0 * f32::EPSILON;
    match ty {
        GgmlType::F32 => 0.0,
        GgmlType::F16 => amax * 2f32.powi(-11) + 6.0e-8,
        GgmlType::BF16 => amax * 2f32.powi(-8),
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => {
            // ggml's symmetric formats clamp at the positive end: q = 7 (Q4_0) / 15 (Q5_0) with scale
            // -max/8, so an element of magnitude |max| on the other side is one full step away at most.
            rd_f16(block, 0).abs() + rounding
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 => 0.5 * rd_f16(block, 0).abs() + rounding + 1.0e-6 * amax,
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let d = rd_f16(block, 0);
            let dmin = rd_f16(block, 2);
            let mut worst = 0.0f32;
            for j in 0..8 {
                let (sc, _) = k_scale_min(j, &block[4..16]);
                worst = worst.max(0.5 * d * sc as f32);
            }
            worst + 0.5 * dmin + amax * 2f32.powi(-9) + rounding
        }
        GgmlType::Q2_K => {
            // Half a step of the group's grid; the grid, its scale and min rounded up, covers
            // the group but for up to one `dmin` at its top; f16 rounding of d and dmin.
            let (d, dmin) = (rd_f16(block, 80), rd_f16(block, 82));
            let worst = block[0..16].iter().map(|s| 0.5 * d * (s & 0xF) as f32).fold(0.0f32, f32::max);
            worst + dmin + amax * 2f32.powi(-9) + rounding
        }
        GgmlType::Q3_K => {
            // One full step at the clamped end (q = 3 for a value 4 steps away) plus what the
            // scale's 6-bit rounding (half a `d`) costs over four steps.
            let d = rd_f16(block, 108).abs();
            let worst = q3_k_scales(&block[96..108]).iter().map(|s| d * (*s as f32).abs()).fold(0.0f32, f32::max);
            worst + 2.0 * d + amax * 2f32.powi(-9) + rounding
        }
        GgmlType::IQ4_NL => {
            // Half the widest gap between levels (24 steps), or the 14 steps past level 113 at
            // the clamped end; f16 rounding of d.
            14.0 * rd_f16(block, 0).abs() + amax * 2f32.powi(-10) + rounding
        }
        GgmlType::IQ4_XS => {
            // As IQ4_NL per sub-block, plus the 6-bit rounding of its scale (half a `d`) over
            // 127 steps.
            let d = rd_f16(block, 0).abs();
            let worst = (0..8).map(|ib| 14.0 * d * (iq4_xs_scale(block, ib) as f32).abs()).fold(0.0f32, f32::max);
            worst + 64.0 * d + amax * 2f32.powi(-9) + rounding
        }
        GgmlType::TQ1_0 | GgmlType::TQ2_0 => {
            // Half of d (a value between 0 and d rounds to one of them); f16 rounding of d.
            0.5 * rd_f16(block, ty.type_size() - 2).abs() + amax * 2f32.powi(-10) + rounding
        }
        GgmlType::MXFP4 => {
            // Half the widest gap between levels (4 steps: 8 to 12), or the up to 4 steps past
            // level 12 of a largest value in [8, 16) steps.
            4.0 * mxfp4_scale(block[0]) + rounding
        }
        GgmlType::NVFP4 => {
            // Half the widest gap (2 steps) of a sub-block whose largest value sits at level 12
            // but for the scale's rounding (E4M3: 2^-4 of it, so 0.75 steps at 12), or a value
            // past a saturated scale; subnormal scales round by up to 2^-10 absolute.
            let worst = (0..4).map(|s| ue4m3_scale(block[s])).fold(0.0f32, f32::max);
            // A sub-block whose max/6 passes 448 saturates the scale (0x7e, 224): its values
            // past level 12 clamp there.
            2.75 * worst + 12.0 * 2f32.powi(-10) + (amax - 12.0 * 224.0).max(0.0) + rounding
        }
        GgmlType::Q1_0 => {
            // Every value becomes +-mean|x|: off by at most the block's largest magnitude plus d.
            amax + rd_f16(block, 0).abs() + rounding
        }
        GgmlType::Q2_0 => {
            // Half of d (values span -d..d, the grid -d..2d); f16 rounding of d.
            0.5 * rd_f16(block, 0).abs() + amax * 2f32.powi(-10) + rounding
        }
        GgmlType::Q6_K => {
            let d = rd_f16(block, 208).abs();
            let sc = &block[192..208];
            let worst = sc.iter().map(|s| (*s as i8).unsigned_abs() as f32).fold(0.0f32, f32::max);
            // Round-to-nearest costs half a step; the asymmetric range (-32..31 steps) can cost one
            // full step at the clamped end; f16 rounding of d can shave 2^-10 off the range.
            d * worst + amax * 2f32.powi(-9) + rounding
        }
    }
}
