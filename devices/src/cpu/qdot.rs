//! Quantized matrix-vector products the way fast CPU engines do them: activations quantized to
//! Q8_0 blocks (32 values, symmetric, f16 scale, as llama.cpp's `quantize_row_q8_0`), integer dot
//! products against the packed weight blocks, one f32 multiply-add per (sub-)block. No weight is
//! ever expanded to an f32 matrix.

use half::f16;
use oracle::quant::{k_scale_min, GgmlType, QK_K};

/// Activations of one row quantized to Q8_0 blocks.
pub struct Q8Row {
    pub q: Vec<i8>,
    /// Per 32-block scale (f16-rounded, as stored by llama.cpp).
    pub d: Vec<f32>,
    /// Per 32-block sum of `q` (for formats with a min/offset term).
    pub sum: Vec<i32>,
}

/// Quantizes `x` (length a multiple of 32) to Q8_0 blocks.
pub fn quantize_q8(x: &[f32]) -> Q8Row {
    let nb = x.len() / 32;
    let mut r = Q8Row { q: vec![0; x.len()], d: vec![0.0; nb], sum: vec![0; nb] };
    for b in 0..nb {
        let xs = &x[32 * b..32 * b + 32];
        let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut s = 0i32;
        for (j, v) in xs.iter().enumerate() {
            let q = (v * id).round() as i32; // |v*id| <= 127 by construction
            r.q[32 * b + j] = q as i8;
            s += q;
        }
        r.d[b] = f16::from_f32(d).to_f32();
        r.sum[b] = s;
    }
    r
}

#[inline]
fn rd16(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

#[inline]
fn idot(a: &[i8], b: &[i8]) -> i32 {
    a.iter().zip(b).map(|(x, y)| *x as i32 * *y as i32).sum()
}

/// Unpacks 16 bytes of nibbles into 32 values: low nibbles first, then high nibbles.
#[inline]
fn nibbles(qs: &[u8], out: &mut [i8; 32], offset: i8) {
    for j in 0..16 {
        out[j] = (qs[j] & 0x0F) as i8 - offset;
        out[j + 16] = (qs[j] >> 4) as i8 - offset;
    }
}

/// Dot of one packed weight row (`ty`, `k` values) with quantized activations.
pub fn dot_row(ty: GgmlType, row: &[u8], x: &Q8Row) -> f32 {
    let mut acc = 0.0f32;
    let mut w = [0i8; 32];
    match ty {
        GgmlType::Q4_0 => {
            for (b, blk) in row.chunks_exact(18).enumerate() {
                nibbles(&blk[2..18], &mut w, 8);
                acc += rd16(blk, 0) * x.d[b] * idot(&w, &x.q[32 * b..32 * b + 32]) as f32;
            }
        }
        GgmlType::Q4_1 => {
            for (b, blk) in row.chunks_exact(20).enumerate() {
                nibbles(&blk[4..20], &mut w, 0);
                let isum = idot(&w, &x.q[32 * b..32 * b + 32]) as f32;
                acc += rd16(blk, 0) * x.d[b] * isum + rd16(blk, 2) * x.d[b] * x.sum[b] as f32;
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (size, qh_at, has_min) = if ty == GgmlType::Q5_0 { (22, 2, false) } else { (24, 4, true) };
            for (b, blk) in row.chunks_exact(size).enumerate() {
                let qh = u32::from_le_bytes([blk[qh_at], blk[qh_at + 1], blk[qh_at + 2], blk[qh_at + 3]]);
                nibbles(&blk[qh_at + 4..qh_at + 20], &mut w, 0);
                let off = if has_min { 0 } else { 16 };
                for (j, v) in w.iter_mut().enumerate() {
                    *v = (*v as i32 | (((qh >> j) & 1) << 4) as i32) as i8 - off;
                }
                let isum = idot(&w, &x.q[32 * b..32 * b + 32]) as f32;
                acc += rd16(blk, 0) * x.d[b] * isum;
                if has_min {
                    acc += rd16(blk, 2) * x.d[b] * x.sum[b] as f32;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (b, blk) in row.chunks_exact(34).enumerate() {
                let wq: &[i8] = bytemuck_i8(&blk[2..34]);
                acc += rd16(blk, 0) * x.d[b] * idot(wq, &x.q[32 * b..32 * b + 32]) as f32;
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let five = ty == GgmlType::Q5_K;
            let size = ty.type_size();
            for (kb, blk) in row.chunks_exact(size).enumerate() {
                let (d, dmin) = (rd16(blk, 0), rd16(blk, 2));
                let scales = &blk[4..16];
                let (qh, qs) = if five { (&blk[16..48], &blk[48..176]) } else { (&blk[0..0], &blk[16..144]) };
                for sub in 0..8 {
                    let (chunk, high) = (sub / 2, sub % 2 == 1);
                    for l in 0..32 {
                        let byte = qs[32 * chunk + l];
                        let mut v = if high { byte >> 4 } else { byte & 0x0F };
                        if five && qh[l] & (1 << sub) != 0 {
                            v += 16;
                        }
                        w[l] = v as i8;
                    }
                    let b = kb * (QK_K / 32) + sub;
                    let (sc, m) = k_scale_min(sub, scales);
                    let isum = idot(&w, &x.q[32 * b..32 * b + 32]) as f32;
                    acc += d * sc as f32 * x.d[b] * isum - dmin * m as f32 * x.d[b] * x.sum[b] as f32;
                }
            }
        }
        GgmlType::Q6_K => {
            for (kb, blk) in row.chunks_exact(210).enumerate() {
                let d = rd16(blk, 208);
                let mut q = [0i8; QK_K];
                for half in 0..2 {
                    let (ql, qh) = (&blk[64 * half..64 * half + 64], &blk[128 + 32 * half..128 + 32 * half + 32]);
                    for l in 0..32 {
                        let base = 128 * half + l;
                        q[base] = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
                        q[base + 32] = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                        q[base + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                        q[base + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                    }
                }
                let sc = &blk[192..208];
                for sub in 0..8 {
                    let b = kb * 8 + sub;
                    let xq = &x.q[32 * b..32 * b + 32];
                    let lo = idot(&q[32 * sub..32 * sub + 16], &xq[..16]) as f32 * (sc[2 * sub] as i8) as f32;
                    let hi = idot(&q[32 * sub + 16..32 * sub + 32], &xq[16..]) as f32 * (sc[2 * sub + 1] as i8) as f32;
                    acc += d * x.d[b] * (lo + hi);
                }
            }
        }
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => unreachable!("float weights use the f32 path"),
    }
    acc
}

fn bytemuck_i8(b: &[u8]) -> &[i8] {
    // SAFETY: u8 and i8 have the same size, alignment and validity.
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const i8, b.len()) }
}

/// Widens one row of a float weight type to f32 into `out`.
pub fn float_row(ty: GgmlType, row: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => row.chunks_exact(4).zip(out).for_each(|(c, o)| *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        GgmlType::F16 => row.chunks_exact(2).zip(out).for_each(|(c, o)| *o = f16::from_le_bytes([c[0], c[1]]).to_f32()),
        GgmlType::BF16 => row.chunks_exact(2).zip(out).for_each(|(c, o)| *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        _ => unreachable!("quantized weights use dot_row"),
    }
}

/// f32 dot with eight accumulators (vectorizes on any x86-64 / ARM target).
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]) + tail
}

pub fn is_float(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}
