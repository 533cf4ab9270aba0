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

mod legacy;
mod kquants;
mod small;
use legacy::*;
pub use kquants::*;
pub use small::*;
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

/// What a weight type is, in one row: its GGUF id and name, its block (elements and bytes), the
/// byte offsets of its f16 scale fields ([`scale_fields`]) and its reference encoder (one block
/// of `block_size` values appended to the output). The decoders stay a `match` in
/// [`decode_into`], each inlined into a loop of its own: a call through a table per block costs
/// the packed store's decode its speed.
pub struct TypeTraits {
    pub ty: GgmlType,
    pub id: u32,
    pub name: &'static str,
    pub block_size: usize,
    pub type_size: usize,
    pub scale_fields: &'static [usize],
    encode_block: fn(&[f32], &mut Vec<u8>),
}

macro_rules! row {
    ($ty:ident, $id:expr, $name:expr, $bs:expr, $ts:expr, $scales:expr, $enc:expr) => {
        TypeTraits { ty: GgmlType::$ty, id: $id, name: $name, block_size: $bs, type_size: $ts, scale_fields: $scales, encode_block: $enc }
    };
}

/// Every type's traits, in the order of [`GgmlType`]'s variants (`ty as usize` indexes it).
pub static TRAITS: [TypeTraits; 21] = [
    row!(F32, 0, "f32", 1, 4, &[], |x, o| x.iter().for_each(|v| o.extend_from_slice(&v.to_le_bytes()))),
    row!(F16, 1, "f16", 1, 2, &[], |x, o| x.iter().for_each(|v| o.extend_from_slice(&f16::from_f32(*v).to_le_bytes()))),
    row!(Q4_0, 2, "q4_0", 32, 18, &[0], encode_q4_0),
    row!(Q4_1, 3, "q4_1", 32, 20, &[0, 2], encode_q4_1),
    row!(Q5_0, 6, "q5_0", 32, 22, &[0], encode_q5_0),
    row!(Q5_1, 7, "q5_1", 32, 24, &[0, 2], encode_q5_1),
    row!(Q8_0, 8, "q8_0", 32, 34, &[0], encode_q8_0),
    row!(Q2_K, 10, "q2_k", QK_K, 84, &[80, 82], encode_q2_k),
    row!(Q3_K, 11, "q3_k", QK_K, 110, &[108], encode_q3_k),
    row!(Q4_K, 12, "q4_k", QK_K, 144, &[0, 2], |x, o| encode_qk_asym(x, false, o)),
    row!(Q5_K, 13, "q5_k", QK_K, 176, &[0, 2], |x, o| encode_qk_asym(x, true, o)),
    row!(Q6_K, 14, "q6_k", QK_K, 210, &[208], encode_q6_k),
    row!(BF16, 30, "bf16", 1, 2, &[], |x, o| x.iter().for_each(|v| o.extend_from_slice(&bf16::from_f32(*v).to_le_bytes()))),
    row!(IQ4_NL, 20, "iq4_nl", 32, 18, &[0], encode_iq4_nl),
    row!(IQ4_XS, 23, "iq4_xs", QK_K, 136, &[0], encode_iq4_xs),
    row!(TQ1_0, 34, "tq1_0", QK_K, 54, &[52], |x, o| encode_tq(GgmlType::TQ1_0, x, o)),
    row!(TQ2_0, 35, "tq2_0", QK_K, 66, &[64], |x, o| encode_tq(GgmlType::TQ2_0, x, o)),
    row!(MXFP4, 39, "mxfp4", 32, 17, &[], encode_mxfp4),
    row!(NVFP4, 40, "nvfp4", 64, 36, &[], encode_nvfp4),
    row!(Q1_0, 41, "q1_0", 128, 18, &[0], |x, o| encode_q1_q2_0(GgmlType::Q1_0, x, o)),
    row!(Q2_0, 42, "q2_0", 64, 18, &[0], |x, o| encode_q1_q2_0(GgmlType::Q2_0, x, o)),
];

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

    /// What this type is: one row of [`TRAITS`].
    pub fn traits(self) -> &'static TypeTraits {
        &TRAITS[self as usize]
    }

    /// The GGML type id stored in GGUF tensor infos.
    pub fn id(self) -> u32 {
        self.traits().id
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
        self.traits().name
    }

    pub fn from_name(name: &str) -> Option<GgmlType> {
        let lower = name.to_ascii_lowercase();
        GgmlType::ALL.iter().copied().find(|t| t.name() == lower)
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        self.traits().block_size
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.traits().type_size
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

/// Every f16 bit pattern's f32 value (`half`'s conversion, once): block scales are read by lookup,
/// as the conversion in software costs more than the nibbles it scales.
static F16_TO_F32: std::sync::LazyLock<Box<[f32]>> = std::sync::LazyLock::new(|| (0..=u16::MAX).map(|b| f16::from_bits(b).to_f32()).collect());

#[inline]
fn rd_f16(b: &[u8], at: usize) -> f32 {
    F16_TO_F32[u16::from_le_bytes([b[at], b[at + 1]]) as usize]
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
        _ => decode_blocks_dispatch(ty, bytes, out, ts, bs),
    }
    Ok(())
}

/// The block loops compiled for the widest vector unit the CPU has. The decoders are integer
/// and single f32 operations, which Rust never contracts or reorders, so every target gives the
/// same bits; wider registers only let the compiler vectorize more of each block.
fn decode_blocks_dispatch(ty: GgmlType, bytes: &[u8], out: &mut [f32], ts: usize, bs: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::has_avx2_fma() {
            // SAFETY: the CPU reports avx2.
            return unsafe { decode_blocks_avx2(ty, bytes, out, ts, bs) };
        }
    }
    decode_blocks(ty, bytes, out, ts, bs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn decode_blocks_avx2(ty: GgmlType, bytes: &[u8], out: &mut [f32], ts: usize, bs: usize) {
    decode_blocks(ty, bytes, out, ts, bs)
}

/// The quantized types' loops: one per type, its decoder inlined into it (not a dispatch per
/// block, and compiled with the caller's target features).
#[inline(always)]
fn decode_blocks(ty: GgmlType, bytes: &[u8], out: &mut [f32], ts: usize, bs: usize) {
    macro_rules! each_block {
        ($decode:expr) => {
            for (b, y) in bytes.chunks_exact(ts).zip(out.chunks_exact_mut(bs)) {
                $decode(b, y)
            }
        };
    }
    match ty {
        GgmlType::Q4_0 => each_block!(decode_q4_0),
        GgmlType::Q4_1 => each_block!(decode_q4_1),
        GgmlType::Q5_0 => each_block!(decode_q5_0),
        GgmlType::Q5_1 => each_block!(decode_q5_1),
        GgmlType::Q8_0 => each_block!(decode_q8_0),
        GgmlType::Q2_K => each_block!(decode_q2_k),
        GgmlType::Q3_K => each_block!(decode_q3_k),
        GgmlType::Q4_K => each_block!(decode_q4_k),
        GgmlType::Q5_K => each_block!(decode_q5_k),
        GgmlType::Q6_K => each_block!(decode_q6_k),
        GgmlType::IQ4_NL => each_block!(decode_iq4_nl),
        GgmlType::IQ4_XS => each_block!(decode_iq4_xs),
        GgmlType::TQ1_0 | GgmlType::TQ2_0 => each_block!(|b, y| decode_tq(ty, b, y)),
        GgmlType::MXFP4 => each_block!(decode_mxfp4),
        GgmlType::NVFP4 => each_block!(decode_nvfp4),
        GgmlType::Q1_0 | GgmlType::Q2_0 => each_block!(|b, y| decode_q1_q2_0(ty, b, y)),
        _ => unreachable!("scalar types handled above"),
    }
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
    ty.traits().scale_fields
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

/// Encodes `x` (a whole number of blocks) into type `ty`.
pub fn encode(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>> {
    let need = ty.bytes_for(x.len() as u64).ok_or_else(|| {
        OracleError::Codec(format!("{} elements is not a whole number of {} blocks ({} per block)", x.len(), ty.name(), ty.block_size()))
    })?;
    let mut out = Vec::with_capacity(need as usize);
    let t = ty.traits();
    for blk in x.chunks_exact(t.block_size) {
        (t.encode_block)(blk, &mut out);
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
