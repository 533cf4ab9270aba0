//! Unit tests of the parent module.

use super::kernels::{max_abs, wide_dot};
use super::*;
use oracle::quant::GgmlType;

/// splitmix64: a seeded generator, so a failure reproduces.
fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed;
    move || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// The product as the integer engine defines it: every product and sum in 128 bits.
fn reference(x: &[i64], m: usize, w: &FixedWeights) -> Vec<i64> {
    let (rows, cols) = w.dims();
    let mut y = Vec::new();
    for t in 0..m {
        let xt = &x[t * cols..(t + 1) * cols];
        for r in 0..rows {
            let acc: i128 = match w {
                FixedWeights::Q24 { w: IntValues::Narrow(w), .. } => (0..cols).map(|i| xt[i] as i128 * w[r * cols + i] as i128).sum(),
                FixedWeights::Q24 { w: IntValues::Wide(w), .. } => (0..cols).map(|i| xt[i] as i128 * w[r * cols + i] as i128).sum(),
                FixedWeights::Int4 { q, scale, .. } => (0..cols / INT4_GROUP)
                    .map(|g| (0..INT4_GROUP).map(|i| xt[g * INT4_GROUP + i] as i128 * q[r * cols + g * INT4_GROUP + i] as i128).sum::<i128>() * scale[r * cols / INT4_GROUP + g] as i128)
                    .sum(),
            };
            y.push(shr_round(acc, WGT));
        }
    }
    y
}

/// Values at the edges of each width: the largest 32-bit magnitudes (runs of one or two
/// products before an i64 could overflow), i32::MIN (which does not narrow), values past 32
/// bits, and ordinary ones.
fn edge(next: &mut impl FnMut() -> u64, wide: bool) -> i64 {
    let r = next();
    match r % 8 {
        0 => i32::MAX as i64,
        1 => -(i32::MAX as i64),
        2 if wide => i32::MIN as i64 - (r >> 40) as i64,
        3 if wide => (1i64 << 40) + (r >> 50) as i64,
        _ => (r >> 33) as i64 - (1i64 << 30),
    }
}

#[test]
fn matmul_q_is_the_exact_integer_product_at_every_width() {
    let mut next = rng(7);
    for &(m, rows, cols) in &[(1, 3, 5), (2, 70, 64), (3, 5, 1), (1, 129, 96)] {
        for case in 0..6 {
            // Case 0: activations and weights that fit 32 bits; 1: some activation rows do not;
            // 2: the weights do not; 3: ordinary values (one long run); 4, 5: INT4 (5 with wide rows).
            let x_wide = case == 1 || case == 5;
            let x: Vec<i64> = (0..m * cols).map(|_| if case == 3 { (next() >> 44) as i64 - (1 << 19) } else { edge(&mut next, x_wide) }).collect();
            let w = if case < 4 {
                let vals: Vec<i64> = (0..rows * cols).map(|_| if case == 3 { (next() >> 40) as i64 - (1 << 23) } else { edge(&mut next, case == 2) }).collect();
                let mut w = IntValues::with_capacity(vals.len());
                w.push_row(&vals);
                FixedWeights::Q24 { rows, cols, w, max_abs: max_abs(&vals) }
            } else {
                let cols = cols.div_ceil(INT4_GROUP) * INT4_GROUP;
                let q = (0..rows * cols).map(|_| (next() % 15) as i8 - 7).collect();
                let scale = (0..rows * cols / INT4_GROUP).map(|_| (next() >> 36) as i64).collect();
                FixedWeights::Int4 { rows, cols, q, scale }
            };
            let cols = w.dims().1;
            let x: Vec<i64> = x.iter().copied().cycle().take(m * cols).collect();
            assert_eq!(matmul_q(&x, m, &w), reference(&x, m, &w), "m={m} rows={rows} cols={cols} case={case}");
        }
    }
}

/// exp as first written: every step of the Horner series in 128 bits.
fn exp_q16_wide(z: i64) -> i64 {
    if z > 0 {
        return exp_q16_wide(0);
    }
    let t = ((z as i128) * 1_549_082_005) >> ACT;
    let k = (-t) >> 30;
    let k = if ((-t) & ((1 << 30) - 1)) != 0 { k + 1 } else { k };
    let f = t + (k << 30);
    if k >= 40 {
        return 0;
    }
    let y = (f * 744_261_118) >> 30;
    let mut acc: i128 = 1 << 30;
    for n in (1..=9).rev() {
        acc = (1 << 30) + ((acc * y) >> 30) / n;
    }
    shr_round(acc, (30 - ACT as i128 + k) as u32)
}

#[test]
fn exp_sigmoid_and_softmax_in_64_bits_equal_their_128_bit_forms() {
    let mut next = rng(3);
    let zs: Vec<i64> = (0..200_000).map(|i| -(i * 17)).chain((0..20_000).map(|_| -((next() >> 20) as i64))).chain([1, 0, -1, i64::MIN / 2, -(40 << 16)]).collect();
    for &z in &zs {
        assert_eq!(exp_q16(z), exp_q16_wide(z), "exp at z = {z}");
        let one = 1i128 << ACT;
        let e = exp_q16_wide(-z.abs()) as i128;
        let pos = ((one << ACT) / (one + e)) as i64;
        assert_eq!(sigmoid_q16(z), if z >= 0 { pos } else { (1 << ACT) - pos }, "sigmoid at {z}");
        assert_eq!(sigmoid_q16(-z), if -z >= 0 { pos } else { (1 << ACT) - pos }, "sigmoid at {}", -z);
    }
    for n in [1usize, 2, 7, 1000] {
        let x: Vec<i64> = (0..n).map(|_| (next() >> 40) as i64 - (1 << 23)).collect();
        let max = *x.iter().max().unwrap();
        let e: Vec<i128> = x.iter().map(|v| exp_q16_wide(v - max) as i128).collect();
        let sum = e.iter().sum::<i128>().max(1);
        let want: Vec<i64> = e.iter().map(|v| (((v << ACT) + sum / 2) / sum) as i64).collect();
        assert_eq!(softmax_q(&x), want, "softmax of {n}");
    }
}

/// Attention as first written: one query and head at a time, every product and sum in 128 bits.
fn attention_wide(q: &[i64], pos: &[usize], k: &[i64], v: &[i64], nh: usize, nkv: usize, hd: usize, window: usize) -> Vec<i64> {
    let scale_q30 = to_q(1.0 / (hd as f64).sqrt(), 30) as i128;
    let mut out = vec![0i64; pos.len() * nh * hd];
    for (t, &p) in pos.iter().enumerate() {
        let first = if window > 0 { (p + 1).saturating_sub(window) } else { 0 };
        for h in 0..nh {
            let kvh = h / (nh / nkv);
            let qh = &q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
            let scores: Vec<i64> = (first..=p).map(|j| shr_round(wide_dot(qh, &k[(j * nkv + kvh) * hd..(j * nkv + kvh + 1) * hd]) * scale_q30, 30 + ACT)).collect();
            let probs = softmax_q(&scores);
            for d in 0..hd {
                let acc: i128 = probs.iter().zip(first..=p).map(|(pj, j)| *pj as i128 * v[(j * nkv + kvh) * hd + d] as i128).sum();
                out[(t * nh + h) * hd + d] = shr_round(acc, ACT);
            }
        }
    }
    out
}

#[test]
fn attention_in_64_bits_equals_the_128_bit_form_and_takes_it_when_values_are_large() {
    let mut next = rng(11);
    let (nh, nkv, hd, len) = (4, 2, 16, 9);
    let pos: Vec<usize> = (3..len).collect();
    // Bits of the query, key and value magnitudes: ordinary Q16 values (64-bit sums); keys
    // near 2^40 (scores past 64 bits); values near 2^49 (weighted sums past 64 bits).
    for (bits, window) in [([20u32, 20, 20], 0usize), ([20, 20, 20], 4), ([20, 41, 20], 0), ([20, 20, 50], 0), ([20, 41, 50], 3)] {
        let mut val = |n: usize, b: u32| -> Vec<i64> { (0..n).map(|_| (next() >> (64 - b)) as i64 - (1i64 << (b - 1))).collect() };
        let q = val(pos.len() * nh * hd, bits[0]);
        let (k, v) = (val(len * nkv * hd, bits[1]), val(len * nkv * hd, bits[2]));
        assert_eq!(attention_q(&q, &pos, &k, &v, nh, nkv, hd, window, &AttnExtras::default()), attention_wide(&q, &pos, &k, &v, nh, nkv, hd, window), "{bits:?}-bit values, window {window}");
    }
}

#[test]
fn int_values_widen_at_the_first_value_past_32_bits_and_keep_every_value() {
    let mut v = IntValues::with_capacity(6);
    v.push_row(&[1, -(i32::MAX as i64)]);
    assert!(matches!(v, IntValues::Narrow(_)));
    v.push_row(&[i32::MIN as i64, 5]);
    v.push_row(&[7, 1 << 40]);
    assert!(matches!(v, IntValues::Wide(_)));
    let mut out = vec![9];
    v.extend_into(1..6, &mut out);
    assert_eq!(out, vec![9, -(i32::MAX as i64), i32::MIN as i64, 5, 7, 1 << 40]);
}

#[test]
fn weights_past_32_bits_keep_their_exact_values() {
    let row = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let small = convert_weights(GgmlType::F32, 1, 3, &row(&[0.5, -1.25, 127.0]), false);
    assert!(matches!(small, FixedWeights::Q24 { w: IntValues::Narrow(_), max_abs, .. } if max_abs == 127 << 24), "fits 32 bits");
    let big = convert_weights(GgmlType::F32, 2, 2, &row(&[0.5, -1.0, 200.0, -0.25]), false);
    match big {
        FixedWeights::Q24 { w: IntValues::Wide(w), .. } => assert_eq!(w, vec![1 << 23, -(1 << 24), 200 << 24, -(1 << 22)]),
        _ => panic!("a weight of 200 needs 64-bit storage"),
    }
}
