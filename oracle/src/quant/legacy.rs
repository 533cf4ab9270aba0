//! The legacy block formats Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0: decoders and reference encoders.

use super::*;

// Each decoder writes a block's two halves through fixed-length slices and zipped iterators, so
// that the compiler sees every length and vectorizes without bounds checks.

/// A block's 32 outputs as its two halves (elements 0..16 and 16..32).
#[inline(always)]
fn halves(y: &mut [f32]) -> (&mut [f32], &mut [f32]) {
    y[..32].split_at_mut(16)
}

// block_q4_0: d: f16, qs[16]. Low nibbles are elements 0..16, high nibbles 16..32; value = (q - 8) * d.
#[inline(always)]
pub(crate) fn decode_q4_0(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    let (lo, hi) = halves(y);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..18]) {
        *l = ((q & 0x0F) as i32 - 8) as f32 * d;
        *h = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

// block_q4_1: d: f16, m: f16, qs[16]; value = q * d + m.
#[inline(always)]
pub(crate) fn decode_q4_1(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    let m = rd_f16(b, 2);
    let (lo, hi) = halves(y);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[4..20]) {
        *l = (q & 0x0F) as f32 * d + m;
        *h = (q >> 4) as f32 * d + m;
    }
}

// block_q5_0: d: f16, qh: u32 (bit j = 5th bit of element j), qs[16]; value = (q - 16) * d.
#[inline(always)]
pub(crate) fn decode_q5_0(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let (lo, hi) = halves(y);
    for (j, ((l, h), &q)) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[6..22]).enumerate() {
        let h0 = ((qh >> j) & 1) << 4;
        let h1 = ((qh >> (j + 16)) & 1) << 4;
        *l = (((q & 0x0F) as u32 | h0) as i32 - 16) as f32 * d;
        *h = (((q >> 4) as u32 | h1) as i32 - 16) as f32 * d;
    }
}

// block_q5_1: d: f16, m: f16, qh: u32, qs[16]; value = q * d + m.
#[inline(always)]
pub(crate) fn decode_q5_1(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    let m = rd_f16(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let (lo, hi) = halves(y);
    for (j, ((l, h), &q)) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[8..24]).enumerate() {
        let h0 = ((qh >> j) & 1) << 4;
        let h1 = ((qh >> (j + 16)) & 1) << 4;
        *l = ((q & 0x0F) as u32 | h0) as f32 * d + m;
        *h = ((q >> 4) as u32 | h1) as f32 * d + m;
    }
}

// block_q8_0: d: f16, qs: i8[32]; value = q * d.
#[inline(always)]
pub(crate) fn decode_q8_0(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    for (v, &q) in y[..32].iter_mut().zip(&b[2..34]) {
        *v = (q as i8) as f32 * d;
    }
}

pub(crate) fn encode_q4_0(x: &[f32], out: &mut Vec<u8>) {
    let max = signed_absmax(x);
    let d = push_f16(out, max / -8.0);
    let id = inv(d);
    let q = |v: f32| ((v * id + 8.5).floor().clamp(0.0, 15.0)) as u8;
    for j in 0..16 {
        out.push(q(x[j]) | (q(x[j + 16]) << 4));
    }
}

pub(crate) fn encode_q4_1(x: &[f32], out: &mut Vec<u8>) {
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

/// A block's 5-bit codes `q(x)` as Q5_0 and Q5_1 store them: the fifth bits of the 32 codes in
/// one little-endian u32, then the low nibbles, value j with value j + 16 in one byte.
fn push_5bit(x: &[f32], q: impl Fn(f32) -> u32, out: &mut Vec<u8>) {
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

pub(crate) fn encode_q5_0(x: &[f32], out: &mut Vec<u8>) {
    let max = signed_absmax(x);
    let d = push_f16(out, max / -16.0);
    let id = inv(d);
    let q = |v: f32| ((v * id + 16.5).floor().clamp(0.0, 31.0)) as u32;
    push_5bit(x, q, out);
}

pub(crate) fn encode_q5_1(x: &[f32], out: &mut Vec<u8>) {
    let min = x.iter().copied().fold(f32::INFINITY, f32::min);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = push_f16(out, (max - min) / 31.0);
    let m = push_f16(out, min);
    let id = inv(d);
    let q = |v: f32| (((v - m) * id + 0.5).floor().clamp(0.0, 31.0)) as u32;
    push_5bit(x, q, out);
}

pub(crate) fn encode_q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = push_f16(out, amax / 127.0);
    let id = inv(d);
    for &v in x {
        out.push(((v * id).round().clamp(-127.0, 127.0) as i8) as u8);
    }
}
