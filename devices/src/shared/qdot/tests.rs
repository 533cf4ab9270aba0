//! Unit tests of the parent module.

use super::*;

/// A seeded 64-bit LCG's high bits: the same inputs on every run and machine.
fn lcg(seed: u64) -> impl FnMut() -> u32 {
    let mut s = seed;
    move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 33) as u32
    }
}

/// Every block form's lanes, for the inputs of one test round.
struct Block {
    qs: Vec<u8>,
    qh_k: Vec<u8>,
    qh: u32,
    a: Vec<i8>,
    x: Vec<i8>,
    q6: Vec<i8>,
    scales: (i32, i32),
}

#[inline(always)]
fn all_lanes<I: BlockDot>(t: &Block) -> Vec<[i32; 8]> {
    let x = &t.x[..32];
    let mut out = vec![
        I::lanes(I::dot(I::nibbles(&t.qs, 0, 8), x)),
        I::lanes(I::dot(I::nibbles(&t.qs, 0, 0), x)),
        I::lanes(I::dot(I::nibbles(&t.qs, t.qh, 16), x)),
        I::lanes(I::dot(I::nibbles(&t.qs, t.qh, 0), x)),
        I::lanes(I::dot(I::i8s(&t.a), x)),
    ];
    for c in 0..4 {
        for qh in [&t.qh_k[..0], &t.qh_k[..]] {
            let (lo, hi) = I::k_chunk(&t.qs, qh, c);
            out.extend([I::lanes(I::dot(lo, x)), I::lanes(I::dot(hi, &t.x[32..]))]);
        }
    }
    out.push(I::lanes(I::scale_halves(I::dot(I::i8s(&t.q6), x), t.scales.0, t.scales.1)));
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn all_lanes_avx2(t: &Block) -> Vec<[i32; 8]> {
    all_lanes::<Avx2<NO_VNNI>>(t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn all_lanes_vnni(t: &Block) -> Vec<[i32; 8]> {
    all_lanes::<Avx2<AVX_VNNI>>(t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn all_lanes_vnni512(t: &Block) -> Vec<[i32; 8]> {
    all_lanes::<Avx2<AVX512_VNNI>>(t)
}

/// Each block form's eight lanes, AVX2 against portable (random blocks: every nibble, high
/// bit and sign), and the portable Q5_0 lanes against their definition.
#[test]
fn avx2_block_lanes_equal_the_portable_ones() {
    let mut next = lcg(1);
    // Activations (and Q8_0 weights) come from the Q8_0 quantizer: always within -127..=127.
    let mut i8s = |n: usize, lo: i32, hi: i32| -> Vec<i8> { (0..n).map(|_| (lo + (next() % (hi - lo + 1) as u32) as i32) as i8).collect() };
    let (mut compared, mut compared_vnni, mut compared_vnni512) = (0, 0, 0);
    for round in 0..500 {
        let bytes: Vec<u8> = i8s(64, -128, 127).into_iter().map(|v| v as u8).collect();
        let t = Block {
            qs: bytes[..32].to_vec(),
            qh_k: bytes[32..].to_vec(),
            qh: u32::from_le_bytes([bytes[0], bytes[9], bytes[20], bytes[33]]) ^ (round as u32).wrapping_mul(2654435761),
            a: i8s(32, -127, 127),
            x: i8s(64, -127, 127),
            q6: i8s(32, -32, 31),
            scales: (i8s(1, -128, 127)[0] as i32, i8s(1, -128, 127)[0] as i32),
        };
        let want = all_lanes::<Portable>(&t);
        let q5: Vec<i32> = (0..32).map(|j| ((if j < 16 { t.qs[j] & 15 } else { t.qs[j - 16] >> 4 }) as i32 | (((t.qh >> j) & 1) << 4) as i32) - 16).collect();
        let by_definition: [i32; 8] = std::array::from_fn(|i| (4 * i..4 * i + 4).map(|e| q5[e] * t.x[e] as i32).sum());
        assert_eq!(want[2], by_definition);
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU reports AVX2, FMA and F16C (checked just above).
            assert_eq!(unsafe { all_lanes_avx2(&t) }, want, "round {round}");
            compared += 1;
        }
        #[cfg(target_arch = "x86_64")]
        if has_avx_vnni() {
            // SAFETY: the CPU reports AVX2, FMA, F16C and AVX-VNNI (checked just above).
            assert_eq!(unsafe { all_lanes_vnni(&t) }, want, "AVX-VNNI, round {round}");
            compared_vnni += 1;
        }
        #[cfg(target_arch = "x86_64")]
        if has_avx512_vnni() {
            // SAFETY: the CPU reports AVX2, FMA, F16C, AVX-512 VNNI and VL (checked just above).
            assert_eq!(unsafe { all_lanes_vnni512(&t) }, want, "AVX-512 VNNI, round {round}");
            compared_vnni512 += 1;
        }
    }
    if compared == 0 {
        eprintln!("no AVX2 on this CPU: only the portable lanes were checked (against their definition)");
    }
    eprintln!("AVX2 lanes checked in {compared} rounds, AVX-VNNI lanes in {compared_vnni}, AVX-512 VNNI lanes in {compared_vnni512}");
}

/// Whole rows of every quantized type (random bytes, so every nibble, high bit and 6-bit
/// scale pattern occurs; scales that decode to NaN count as equal to NaN) through the AVX2
/// copy and the portable one: both do the same integer and f32 operations lane for lane, so
/// the results must be the same bits.
#[test]
fn avx2_rows_equal_the_portable_rows_for_every_quantized_type() {
    #[cfg(target_arch = "x86_64")]
    if !has_avx2() {
        eprintln!("no AVX2 on this CPU: only the portable block dots exist here");
        return;
    }
    let checked = for_random_rows(7, 200, |ty, row, next| {
        let x = random_q8(next);
        let want = dot_rows_impl::<Portable, 1>(ty, row, [&x])[0];
        let same = |got: f32, path: &str| assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{ty:?}: {path} {got} vs portable {want}");
        #[cfg(target_arch = "x86_64")]
        {
            let mut got = [0.0f32];
            // SAFETY: the CPU reports AVX2, FMA and F16C (checked above); one row of `row_bytes`.
            unsafe { dot_rows_block_avx2(ty, row, row.len(), [&x], &mut got, Strides { row: 1, token: 1 }) };
            same(got[0], "AVX2");
            if has_avx_vnni() {
                // SAFETY: the CPU reports AVX-VNNI too.
                unsafe { dot_rows_block_vnni(ty, row, row.len(), [&x], &mut got, Strides { row: 1, token: 1 }) };
                same(got[0], "AVX-VNNI");
            }
            if has_avx512_vnni() {
                // SAFETY: the CPU reports AVX-512 VNNI and VL too.
                unsafe { dot_rows_block_vnni512(ty, row, row.len(), [&x], &mut got, Strides { row: 1, token: 1 }) };
                same(got[0], "AVX-512 VNNI");
            }
        }
        same(dot_row(ty, row, &x), path_name());
    });
    assert_eq!(checked, QUANTIZED_TYPES * 200);
    eprintln!("checked: {}", path_name());
}

const K: usize = 2 * QK_K;

/// The quantized types (every one has block dots; eight of them before Q2_K, Q3_K, IQ4_NL,
/// IQ4_XS, TQ1_0, TQ2_0, MXFP4, NVFP4, Q1_0 and Q2_0 came): a literal, so a type missing
/// from the rows checked is caught.
const QUANTIZED_TYPES: usize = 18;

/// Calls `check` with `per_type` random rows of `K` values of every quantized type and the
/// seeded generator; returns how many rows it checked.
fn for_random_rows(seed: u64, per_type: usize, mut check: impl FnMut(GgmlType, &[u8], &mut dyn FnMut() -> u32)) -> usize {
    let mut next = lcg(seed);
    let mut checked = 0;
    for ty in GgmlType::ALL.into_iter().filter(|t| !is_float(*t)) {
        let row_bytes = K / ty.block_size() * ty.type_size();
        for _ in 0..per_type {
            let row: Vec<u8> = (0..row_bytes).map(|_| next() as u8).collect();
            check(ty, &row, &mut next);
            checked += 1;
        }
    }
    checked
}

/// `K` activations in [-1, 1], quantized.
fn random_q8(next: &mut dyn FnMut() -> u32) -> Q8Row {
    quantize_q8(&(0..K).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect::<Vec<_>>())
}

/// `quantize_q8` (8-lane blocks where all values are finite) against the plain per-block
/// quantizer: random blocks, exact ties (amax 127 makes the scale 1, so `k + 0.5` must round
/// away from zero), values just under a half, zeros, signed zeros, and blocks holding an
/// infinity or a NaN.
#[test]
fn quantized_activations_equal_the_plain_quantizer() {
    let mut next = lcg(5);
    let mut blocks: Vec<Vec<f32>> = (0..300).map(|_| (0..32).map(|_| (next() % 200001) as f32 / 1000.0 - 100.0).collect()).collect();
    let ties: Vec<f32> = (0..32).map(|j| if j == 0 { 127.0 } else { (j as f32 - 16.0) * 7.0 + if j % 2 == 0 { 0.5 } else { -0.5 } }).collect();
    let near: Vec<f32> = (0..32).map(|j| if j == 5 { -127.0 } else { f32::from_bits(0.5f32.to_bits() - 1 + (j % 3) as u32) * if j % 2 == 0 { 1.0 } else { -1.0 } }).collect();
    blocks.extend([ties, near, vec![0.0; 32], vec![-0.0; 32]]);
    for special in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
        blocks.push((0..32).map(|j| if j == 9 { special } else { j as f32 - 3.0 }).collect());
    }
    let x: Vec<f32> = blocks.concat();
    let got = quantize_q8(&x);
    for (b, xs) in x.chunks_exact(32).enumerate() {
        let mut q = [0i8; 32];
        let (d, s) = quantize_block(xs, &mut q);
        assert_eq!((&got.q[32 * b..32 * b + 32], got.d[b].to_bits()), (&q[..], d.to_bits()), "block {b}: {xs:?}");
        assert!(got.dsum[b].to_bits() == (d * s as f32).to_bits() || d.is_nan(), "block {b}");
    }
    let ties = &got.q[300 * 32..301 * 32];
    assert_eq!((ties[2], ties[3], ties[1]), (-98, -92, -106), "-97.5, -91.5 and -105.5 round away from zero");
    #[cfg(target_arch = "x86_64")]
    eprintln!("8-lane quantizer {}", if has_avx2() { "checked" } else { "absent: plain one only" });
}

/// Several tokens through one call (each block's weights unpacked once for all) against
/// each token alone, for every quantized type and both paths: the same bits.
#[test]
fn multi_token_dots_equal_one_token_dots() {
    let checked = for_random_rows(11, 50, |ty, row, next| {
        let xs: Vec<Q8Row> = (0..8).map(|_| random_q8(next)).collect();
        let one: Vec<u32> = xs.iter().map(|x| dot_row(ty, row, x).to_bits()).collect();
        let eight = dot_rows(ty, row, std::array::from_fn::<_, 8, _>(|i| &xs[i])).map(f32::to_bits);
        let four = dot_rows(ty, row, [&xs[0], &xs[1], &xs[2], &xs[3]]).map(f32::to_bits);
        let three = dot_rows(ty, row, [&xs[1], &xs[2], &xs[3]]).map(f32::to_bits);
        let portable = dot_rows_impl::<Portable, 4>(ty, row, [&xs[0], &xs[1], &xs[2], &xs[3]]).map(f32::to_bits);
        // Random scales can decode to NaN; NaN payloads aside, every result must match.
        let same = |a: &[u32], b: &[u32]| a.iter().zip(b).all(|(p, q)| p == q || (f32::from_bits(*p).is_nan() && f32::from_bits(*q).is_nan()));
        assert!(
            same(&eight, &one) && same(&four, &one) && same(&three, &one[1..]) && same(&portable, &one),
            "{ty:?}: {eight:?} / {four:?} / {three:?} / {portable:?} vs {one:?}"
        );
    });
    assert_eq!(checked, QUANTIZED_TYPES * 50);
}

/// The embedding lookup's row expansion against the oracle's decoders (which the kernel
/// suite checks against gguf-py): the same values for every quantized type, random bytes.
#[test]
fn dequantized_rows_equal_the_oracle_decoders() {
    let checked = for_random_rows(5, 50, |ty, row, _| {
        let want = oracle::quant::decode(ty, row, K).expect("decodes");
        let mut got = vec![0.0f32; K];
        dequantize_row(ty, row, &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // `==`: the same value (bits, but for the sign of a zero, which both orders of
            // `d * q - m` can give), or NaN from a NaN scale on both sides.
            assert!(g == w || (g.is_nan() && w.is_nan()), "{ty:?} element {i}: {g} vs oracle {w}");
        }
    });
    assert_eq!(checked, QUANTIZED_TYPES * 50);
}

/// The fused float-row dot against widening the row and `dot_f32`: every length up to 40
/// (every tail) and a long row, random bits (so subnormals, infinities and NaN occur in F16
/// and BF16), must give the same bits.
#[test]
fn fused_float_row_dot_equals_widen_then_dot() {
    if !has_fused_float_dot() {
        eprintln!("no AVX2/F16C on this CPU: the fused dot does not exist here (nothing to compare)");
        return;
    }
    let mut next = lcg(3);
    let mut checked = 0;
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for n in (0..=40).chain([8192, 8195]) {
            for _ in 0..20 {
                // F32 weights from random halves' values (finite, varied); F16/BF16 from raw bits.
                let row: Vec<u8> = match ty {
                    GgmlType::F32 => (0..n).flat_map(|_| (((next() % 20001) as f32 - 10000.0) / 997.0).to_le_bytes()).collect(),
                    _ => (0..2 * n).map(|_| next() as u8).collect(),
                };
                let x: Vec<f32> = (0..n).map(|_| ((next() % 20001) as f32 - 10000.0) / 1013.0).collect();
                let mut w = vec![0.0f32; n];
                float_row(ty, &row, &mut w);
                let want = dot_f32(&x, &w);
                let got = dot_float_row(ty, &row, &x);
                assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{ty:?} n={n}: fused {got} vs {want}");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 3 * 43 * 20);
}

/// No rows (or rows of no bytes) with eight tokens and an output too short for any: nothing
/// to compute and nothing written, on every type's path (eight tokens split in fours included).
#[test]
fn no_rows_write_nothing() {
    let mut next = lcg(9);
    let xs: Vec<Q8Row> = (0..8).map(|_| random_q8(&mut next)).collect();
    for ty in [GgmlType::Q4_1, GgmlType::Q4_K, GgmlType::Q8_0] {
        let mut out: [f32; 0] = [];
        dot_rows_block(ty, &[], ty.type_size(), std::array::from_fn::<_, 8, _>(|i| &xs[i]), &mut out, Strides { row: 1, token: 5 });
        dot_rows_block(ty, &[], 0, std::array::from_fn::<_, 8, _>(|i| &xs[i]), &mut out, Strides { row: 1, token: 5 });
    }
}
