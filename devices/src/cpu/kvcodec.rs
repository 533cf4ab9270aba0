//! The `cpu` device's own encoders for the KV cache formats (`cpu:kv-*`), as ggml's CPU backend
//! writes a cache row (its reference quantizers: f32 arithmetic, C's truncating casts), and the
//! Q8_0 rounding of a query before its product with quantized keys. Decoding is the device's
//! block reader (`qdot::dequantize_row`). Written apart from the oracle's codec, which the
//! judge's emulation of a quantized cache uses.

use half::{bf16, f16};
use oracle::quant::GgmlType;

use crate::shared::unpack::IQ4_LEVELS;

fn put_f16(out: &mut Vec<u8>, v: f32) {
    out.extend_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// The value of largest magnitude (the first of equals), signed, and that magnitude.
fn signed_max(x: &[f32]) -> (f32, f32) {
    x.iter().fold((0.0f32, 0.0f32), |(max, amax), &v| if v.abs() > amax { (v, v.abs()) } else { (max, amax) })
}

/// C's `(int8_t)` of a float in range: truncation toward zero.
fn trunc_i8(v: f32) -> i32 {
    v as i8 as i32
}

/// The IQ4_NL level index nearest `x` (the lower on a tie), as ggml searches its table.
fn nearest_level(x: f32) -> u8 {
    let v = |i: usize| IQ4_LEVELS[i] as f32;
    if x <= v(0) {
        return 0;
    }
    if x >= v(15) {
        return 15;
    }
    let (mut lo, mut hi) = (0usize, 15usize);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if x < v(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    if x - v(hi - 1) < v(hi) - x {
        (hi - 1) as u8
    } else {
        hi as u8
    }
}

/// Encodes `x` (a whole number of blocks) in `ty`'s block format.
pub fn encode(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>, String> {
    let bs = ty.block_size();
    if !x.len().is_multiple_of(bs) {
        return Err(format!("{} values are not whole {ty:?} blocks of {bs}", x.len()));
    }
    let mut out = Vec::with_capacity(x.len() / bs * ty.type_size());
    match ty {
        GgmlType::F32 => x.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgmlType::F16 => x.iter().for_each(|v| put_f16(&mut out, *v)),
        GgmlType::BF16 => x.iter().for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        GgmlType::Q8_0 => {
            for b in x.chunks_exact(32) {
                let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                put_f16(&mut out, d);
                out.extend(b.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        GgmlType::Q4_0 | GgmlType::Q5_0 => {
            let five = ty == GgmlType::Q5_0;
            let (half_range, top) = if five { (16.0f32, 31) } else { (8.0f32, 15) };
            for b in x.chunks_exact(32) {
                let (max, _) = signed_max(b);
                let d = max / -half_range;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q: Vec<i32> = b.iter().map(|v| trunc_i8(v * id + half_range + 0.5).min(top)).collect();
                put_f16(&mut out, d);
                push_nibbles_and_high_bits(&mut out, &q, five);
            }
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 => {
            let five = ty == GgmlType::Q5_1;
            let steps = if five { 31.0f32 } else { 15.0 };
            for b in x.chunks_exact(32) {
                let (min, max) = b.iter().fold((f32::MAX, -f32::MAX), |(lo, hi), &v| (lo.min(v), hi.max(v)));
                let d = (max - min) / steps;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                // Q4_1 clamps to 15; Q5_1's codes cannot pass 31.
                let q: Vec<i32> = b.iter().map(|v| if five { ((v - min) * id + 0.5) as u8 as i32 } else { trunc_i8((v - min) * id + 0.5).min(15) }).collect();
                put_f16(&mut out, d);
                put_f16(&mut out, min);
                push_nibbles_and_high_bits(&mut out, &q, five);
            }
        }
        GgmlType::IQ4_NL => {
            for b in x.chunks_exact(32) {
                let (max, amax) = signed_max(b);
                let mut levels = [0u8; 32];
                let mut d = 0.0f32;
                if amax >= 1e-15 {
                    let id = 1.0 / (max / IQ4_LEVELS[0] as f32);
                    let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
                    for (l, v) in levels.iter_mut().zip(b) {
                        *l = nearest_level(id * v);
                        let (q, w) = (IQ4_LEVELS[*l as usize] as f32, v * v);
                        sumqx += w * q * v;
                        sumq2 += w * q * q;
                    }
                    d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
                }
                put_f16(&mut out, d);
                out.extend((0..16).map(|j| levels[j] | (levels[j + 16] << 4)));
            }
        }
        other => return Err(format!("no KV cache encoder for {other:?}")),
    }
    Ok(out)
}

/// 32 codes as ggml packs them: the low nibbles (value j and j + 16 share byte j), preceded for
/// the 5-bit types by the 32 fifth bits as a little-endian u32.
fn push_nibbles_and_high_bits(out: &mut Vec<u8>, q: &[i32], five: bool) {
    if five {
        let qh = q.iter().enumerate().fold(0u32, |h, (j, v)| h | ((((v & 0x10) >> 4) as u32) << j));
        out.extend_from_slice(&qh.to_le_bytes());
    }
    out.extend((0..16).map(|j| ((q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4)) as u8));
}

/// `x` as a row of `ty` gives it back: encoded, then read with the device's block reader.
pub fn round_trip(ty: GgmlType, x: &mut [f32]) -> Result<(), String> {
    let bytes = encode(ty, x)?;
    decode(ty, &bytes, x);
    Ok(())
}

/// Reads `out.len()` values of `ty` from `bytes` with the device's block reader.
pub fn decode(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    if super::qdot::is_float(ty) {
        super::qdot::float_row(ty, bytes, out);
    } else {
        super::qdot::dequantize_row(ty, bytes, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random rows (and all-zero, constant and sparse ones) of 64 values.
    pub fn rows() -> Vec<Vec<f32>> {
        let mut rng = oracle::ops::SplitMix64(0x6b76_636f_6465);
        let mut rows: Vec<Vec<f32>> = (0..300).map(|i| (0..64).map(|_| (rng.next_f64() as f32 - 0.5) * (1.0 + i as f32)).collect()).collect();
        rows.push(vec![0.0; 64]);
        rows.push(vec![0.25; 64]);
        rows.push((0..64).map(|i| if i % 7 == 0 { -3.0 } else { 0.0 }).collect());
        rows
    }

    /// Float formats: the oracle's bytes. Block formats: every decoded value within half a step
    /// of its block's own scale (a whole step at Q4_0's and Q5_0's clamped top code; IQ4_NL, whose
    /// least-squares scale can leave the largest value 17 steps off, a sixth of the block's
    /// largest magnitude), a row of a part block refused. Byte equality with ggml's reference quantizers is
    /// `devices/tests/kv_codec_vs_ggml.rs`.
    #[test]
    fn encoders_round_within_half_a_step() {
        for x in rows() {
            for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
                assert_eq!(encode(ty, &x).unwrap(), oracle::quant::encode(ty, &x).unwrap(), "{ty:?}");
            }
            for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::IQ4_NL] {
                let bytes = encode(ty, &x).unwrap();
                assert_eq!(bytes.len(), 2 * ty.type_size());
                let mut y = vec![0.0f32; 64];
                decode(ty, &bytes, &mut y);
                for (b, (xs, ys)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
                    let d = f16::from_le_bytes([bytes[b * ty.type_size()], bytes[b * ty.type_size() + 1]]).to_f32().abs();
                    // Q4_0/Q5_0 clamp the top code: a value opposite the block's signed maximum
                    // can be a whole step off.
                    let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let half_step = match ty {
                        GgmlType::IQ4_NL => amax / 6.0,
                        GgmlType::Q4_0 | GgmlType::Q5_0 => d,
                        _ => 0.5 * d,
                    };
                    for (a, b) in xs.iter().zip(ys) {
                        // The f16 scale moves the grid by up to 2^-11 of the block's largest value.
                        assert!((a - b).abs() <= half_step * 1.001 + amax * 1e-3 + 1e-7, "{ty:?}: {a} -> {b}, step {d}");
                    }
                }
            }
        }
        assert!(encode(GgmlType::Q4_0, &[1.0; 31]).is_err());
    }
}
