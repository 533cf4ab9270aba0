//! Codec tests: hand-built blocks with hand-computed values, round-trip bounds of the reference
//! encoders, and a cross-check of every decoder against candle-core and gguf-py on random blocks.

use half::f16;
use oracle::quant::{decode, encode, encode_error_bound, GgmlType, QK_K};
use oracle::ops::SplitMix64;

fn h(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

#[test]
fn q4_0_known_block() {
    let mut b = h(0.5).to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let y = decode(GgmlType::Q4_0, &b, 32).unwrap();
    for j in 0..16 {
        assert_eq!(y[j], (j as f32 - 8.0) * 0.5);
        assert_eq!(y[j + 16], (7.0 - j as f32) * 0.5);
    }
}

#[test]
fn q4_1_known_block() {
    let mut b = h(0.25).to_vec();
    b.extend(h(-1.0));
    b.extend((0..16u8).map(|j| j | (j << 4)));
    let y = decode(GgmlType::Q4_1, &b, 32).unwrap();
    for j in 0..16 {
        assert_eq!(y[j], j as f32 * 0.25 - 1.0);
        assert_eq!(y[j + 16], j as f32 * 0.25 - 1.0);
    }
}

#[test]
fn q5_0_known_block() {
    let mut b = h(1.0).to_vec();
    b.extend(0xFFFF_0000u32.to_le_bytes()); // 5th bit set for elements 16..32 only
    b.extend([3u8 | (5 << 4); 16]);
    let y = decode(GgmlType::Q5_0, &b, 32).unwrap();
    assert!(y[..16].iter().all(|&v| v == -13.0), "{:?}", &y[..16]);
    assert!(y[16..].iter().all(|&v| v == 5.0), "{:?}", &y[16..]);
}

#[test]
fn q5_1_known_block() {
    let mut b = h(2.0).to_vec();
    b.extend(h(0.5));
    b.extend(1u32.to_le_bytes()); // 5th bit only for element 0
    b.extend([0x21u8; 16]);
    let y = decode(GgmlType::Q5_1, &b, 32).unwrap();
    assert_eq!(y[0], 34.5);
    assert!(y[1..16].iter().all(|&v| v == 2.5));
    assert!(y[16..].iter().all(|&v| v == 4.5));
}

#[test]
fn q8_0_known_block() {
    let mut b = h(0.125).to_vec();
    b.extend((0..32i32).map(|j| (j - 16) as i8 as u8));
    let y = decode(GgmlType::Q8_0, &b, 32).unwrap();
    for j in 0..32 {
        assert_eq!(y[j], (j as f32 - 16.0) * 0.125);
    }
}

// Sub-block scales [1..7, 40] and mins [0..6, 33], packed by hand (see the 12-byte layout in quant.rs).
const K_SC: [f32; 8] = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 40.0];
const K_M: [f32; 8] = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 33.0];
const K_SCALES: [u8; 12] = [1, 2, 3, 0x84, 0, 1, 2, 0x83, 0x45, 0x56, 0x67, 0x18];

#[test]
fn q4_k_known_block() {
    let mut b = h(1.0).to_vec();
    b.extend(h(0.5));
    b.extend(K_SCALES);
    b.extend([0x21u8; 128]);
    let y = decode(GgmlType::Q4_K, &b, 256).unwrap();
    for (i, v) in y.iter().enumerate() {
        let s = i / 32;
        let q = if s % 2 == 0 { 1.0 } else { 2.0 };
        assert_eq!(*v, K_SC[s] * q - 0.5 * K_M[s], "element {i}");
    }
}

#[test]
fn q5_k_known_block() {
    let mut b = h(1.0).to_vec();
    b.extend(h(0.5));
    b.extend(K_SCALES);
    b.extend([0x01u8; 32]); // bit 0: the first 32 elements get +16
    b.extend([0x21u8; 128]);
    let y = decode(GgmlType::Q5_K, &b, 256).unwrap();
    for (i, v) in y.iter().enumerate() {
        let s = i / 32;
        let q = if s == 0 { 17.0 } else if s % 2 == 0 { 1.0 } else { 2.0 };
        assert_eq!(*v, K_SC[s] * q - 0.5 * K_M[s], "element {i}");
    }
}

#[test]
fn q6_k_known_block() {
    let mut b = vec![0x53u8; 128]; // ql: low nibble 3, high nibble 5
    b.extend([0xE4u8; 64]); // qh: 2-bit fields 0, 1, 2, 3
    b.extend((0..16i32).map(|i| (i - 8) as i8 as u8));
    b.extend(h(0.5));
    let y = decode(GgmlType::Q6_K, &b, 256).unwrap();
    // Group g of each 128-half: q = (low|high<<4) - 32 = -29, -13, 5, 21.
    let q = [-29.0f32, -13.0, 5.0, 21.0];
    for half in 0..2 {
        for g in 0..4 {
            for l in 0..32 {
                let i = 128 * half + 32 * g + l;
                let sc = (8 * half + l / 16 + 2 * g) as f32 - 8.0;
                assert_eq!(y[i], 0.5 * sc * q[g], "element {i}");
            }
        }
    }
}

#[test]
fn scalar_types_known_values() {
    let x = [1.0f32, -2.5, 0.333_333_34, 65504.0];
    assert_eq!(decode(GgmlType::F32, &encode(GgmlType::F32, &x).unwrap(), 4).unwrap(), x);
    let f = decode(GgmlType::F16, &[0x00, 0x3C, 0x00, 0xC1], 2).unwrap();
    assert_eq!(f, [1.0, -2.5]);
    let bf = decode(GgmlType::BF16, &[0x80, 0x3F, 0x20, 0xC0], 2).unwrap();
    assert_eq!(bf, [1.0, -2.5]);
}

#[test]
fn decode_rejects_wrong_lengths() {
    assert!(decode(GgmlType::Q4_0, &[0u8; 17], 32).is_err());
    assert!(decode(GgmlType::Q4_K, &[0u8; 144], 255).is_err());
    assert!(decode(GgmlType::F16, &[0u8; 3], 2).is_err());
}

fn random_values(rng: &mut SplitMix64, n: usize, scale: f64) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let v = rng.next_normal() * scale;
            // A few outliers, as real weights have.
            (if i % 97 == 5 { v * 8.0 } else { v }) as f32
        })
        .collect()
}

#[test]
fn encoders_round_trip_within_their_bounds() {
    let mut rng = SplitMix64(42);
    for ty in GgmlType::ALL {
        for trial in 0..40 {
            let bs = ty.block_size().max(32);
            let scale = [1e-3, 0.02, 1.0, 300.0][trial % 4];
            let x = random_values(&mut rng, bs * 4, scale);
            let bytes = encode(ty, &x).unwrap();
            assert_eq!(bytes.len() as u64, ty.bytes_for(x.len() as u64).unwrap());
            let y = decode(ty, &bytes, x.len()).unwrap();
            let per_block = ty.type_size() * bs / ty.block_size();
            for (bi, (xb, yb)) in x.chunks(bs).zip(y.chunks(bs)).enumerate() {
                let blk = &bytes[bi * per_block..(bi + 1) * per_block];
                let bound = encode_error_bound(ty, xb, blk);
                for (a, b) in xb.iter().zip(yb) {
                    assert!((a - b).abs() <= bound, "{}: |{a} - {b}| > bound {bound} (scale {scale})", ty.name());
                }
            }
        }
    }
}

#[test]
fn encoders_are_not_trivially_lossy() {
    // The bound test above would pass for an encoder that returns all zeros if the bound were
    // loose; check the relative RMS error is what each bit width implies.
    // Pure normals (no outliers): for a uniform quantizer the RMS error is step/sqrt(12), with
    // step ~ 2*2.2 sigma / (2^bits - 1) for 32-element blocks; limits are about 1.5x that.
    let mut rng = SplitMix64(7);
    let x: Vec<f32> = (0..256 * 16).map(|_| rng.next_normal() as f32).collect();
    let limits = [
        (GgmlType::Q4_0, 0.13),
        (GgmlType::Q4_1, 0.13),
        (GgmlType::Q5_0, 0.065),
        (GgmlType::Q5_1, 0.065),
        (GgmlType::Q8_0, 0.008),
        (GgmlType::Q4_K, 0.13),
        (GgmlType::Q5_K, 0.065),
        (GgmlType::Q6_K, 0.035),
        (GgmlType::Q2_K, 0.45),
        (GgmlType::Q3_K, 0.2),
        (GgmlType::IQ4_NL, 0.13),
        (GgmlType::IQ4_XS, 0.13),
        (GgmlType::TQ1_0, 0.9),
        (GgmlType::TQ2_0, 0.9),
        (GgmlType::MXFP4, 0.2),
        (GgmlType::NVFP4, 0.2),
        (GgmlType::Q1_0, 0.9),
        (GgmlType::Q2_0, 0.9),
        (GgmlType::F16, 0.001),
        (GgmlType::BF16, 0.005),
    ];
    let rms = |v: &[f32]| (v.iter().map(|a| (*a as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
    for (ty, limit) in limits {
        let y = decode(ty, &encode(ty, &x).unwrap(), x.len()).unwrap();
        let err: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a - b).collect();
        let rel = rms(&err) / rms(&x);
        eprintln!("{}: relative RMS error {rel:.5} (limit {limit})", ty.name());
        assert!(rel < limit && rel > 0.0, "{}: relative RMS error {rel}", ty.name());
    }
}

/// candle's type of `ty`; None for the IQ4, TQ, FP4, Q1_0 and Q2_0 types, which candle does not
/// decode (gguf-py's dequantizers judge most of them, `decoders_match_gguf_py_on_random_blocks`).
fn candle_dtype(ty: GgmlType) -> Option<candle_core::quantized::GgmlDType> {
    use candle_core::quantized::GgmlDType as C;
    Some(match ty {
        GgmlType::F32 => C::F32,
        GgmlType::F16 => C::F16,
        GgmlType::BF16 => C::BF16,
        GgmlType::Q4_0 => C::Q4_0,
        GgmlType::Q4_1 => C::Q4_1,
        GgmlType::Q5_0 => C::Q5_0,
        GgmlType::Q5_1 => C::Q5_1,
        GgmlType::Q8_0 => C::Q8_0,
        GgmlType::Q2_K => C::Q2K,
        GgmlType::Q3_K => C::Q3K,
        GgmlType::Q4_K => C::Q4K,
        GgmlType::Q5_K => C::Q5K,
        GgmlType::Q6_K => C::Q6K,
        GgmlType::IQ4_NL | GgmlType::IQ4_XS | GgmlType::TQ1_0 | GgmlType::TQ2_0 | GgmlType::MXFP4 | GgmlType::NVFP4 | GgmlType::Q1_0 | GgmlType::Q2_0 => return None,
    })
}

/// Random blocks: random bytes everywhere, with the f16 scale fields replaced by finite values
/// (MXFP4's exponent byte by one of 2^-28..2^22).
fn random_blocks(ty: GgmlType, n_blocks: usize, rng: &mut SplitMix64) -> Vec<u8> {
    let ts = ty.type_size();
    let mut b: Vec<u8> = (0..n_blocks * ts).map(|_| rng.next_u64() as u8).collect();
    let scale_fields: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::IQ4_NL | GgmlType::IQ4_XS => &[0],
        GgmlType::TQ1_0 => &[52],
        GgmlType::TQ2_0 => &[64],
        GgmlType::Q1_0 | GgmlType::Q2_0 => &[0],
        // Any byte is a finite UE4M3 scale.
        GgmlType::NVFP4 => &[],
        GgmlType::MXFP4 => {
            b.chunks_mut(ts).for_each(|blk| blk[0] = 100 + (rng.next_u64() % 51) as u8);
            return b;
        }
        GgmlType::F16 => return (0..n_blocks).flat_map(|_| h((rng.next_normal() * 4.0) as f32)).collect(),
        GgmlType::BF16 => return (0..n_blocks).flat_map(|_| half::bf16::from_f64(rng.next_normal()).to_le_bytes()).collect(),
        GgmlType::F32 => return (0..n_blocks).flat_map(|_| (rng.next_normal() as f32).to_le_bytes()).collect(),
    };
    for blk in b.chunks_mut(ts) {
        for &at in scale_fields {
            blk[at..at + 2].copy_from_slice(&h((rng.next_normal() * 0.05) as f32));
        }
    }
    b
}

#[test]
fn decoders_match_candle_on_random_blocks() {
    let dev = candle_core::Device::Cpu;
    let mut rng = SplitMix64(2024);
    for ty in GgmlType::ALL {
        let n_blocks = if ty.block_size() == 1 { 512 } else { 64 };
        let n = n_blocks * ty.block_size();
        let bytes = random_blocks(ty, n_blocks, &mut rng);
        let ours = decode(ty, &bytes, n).unwrap();
        let Some(dtype) = candle_dtype(ty) else { continue };
        let q = candle_core::quantized::ggml_file::qtensor_from_ggml(dtype, &bytes, vec![n], &dev).unwrap();
        let theirs: Vec<f32> = q.dequantize(&dev).unwrap().to_vec1().unwrap();
        assert_eq!(ours.len(), theirs.len());
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert!(a.to_bits() == b.to_bits(), "{}: element {i}: ours {a} vs candle {b}", ty.name());
        }
    }
}

/// Whether gguf-py and numpy import; when not, says the test is skipped.
fn gguf_py_present() -> bool {
    let probe = std::process::Command::new("python3").args(["-c", "import gguf.quants, numpy"]).output();
    let present = matches!(probe, Ok(ref o) if o.status.success());
    if !present {
        eprintln!("SKIPPED: gguf-py is not installed (pip install -r tools/reference/requirements.txt)");
    }
    present
}

/// Every quantized decoder against gguf-py's (llama.cpp's own Python package, numpy) on random
/// blocks: the same values to within an f32 rounding of each (its numpy order of the scale
/// products may differ). Skipped, saying so, without gguf-py.
#[test]
fn decoders_match_gguf_py_on_random_blocks() {
    if !gguf_py_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut rng = SplitMix64(77);
    let mut checked = 0;
    for ty in GgmlType::ALL.into_iter().filter(|t| t.block_size() > 1 && !NOT_IN_GGUF_PY.contains(t)) {
        let n_blocks = 64;
        let n = n_blocks * ty.block_size();
        let bytes = random_blocks(ty, n_blocks, &mut rng);
        let (input, output) = (dir.path().join(format!("{}.in", ty.name())), dir.path().join(format!("{}.out", ty.name())));
        std::fs::write(&input, &bytes).unwrap();
        let script = format!(
            "import numpy as np, gguf\nfrom gguf.quants import dequantize\nt = gguf.GGMLQuantizationType({})\ndata = np.fromfile({:?}, dtype=np.uint8).reshape({n_blocks}, {})\ndequantize(data, t).astype('<f4').reshape(-1).tofile({:?})",
            ty.id(), input.to_str().unwrap(), ty.type_size(), output.to_str().unwrap()
        );
        let o = std::process::Command::new("python3").args(["-c", &script]).output().unwrap();
        assert!(o.status.success(), "{}: {}", ty.name(), String::from_utf8_lossy(&o.stderr));
        let theirs: Vec<f32> = std::fs::read(&output).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let ours = decode(ty, &bytes, n).unwrap();
        assert_eq!(ours.len(), theirs.len(), "{}", ty.name());
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert!((a - b).abs() <= 2.0 * f32::EPSILON * a.abs().max(b.abs()) || (a.is_nan() && b.is_nan()), "{}: element {i}: ours {a} vs gguf-py {b}", ty.name());
        }
        checked += 1;
    }
    assert_eq!(checked, GgmlType::ALL.iter().filter(|t| t.block_size() > 1).count() - NOT_IN_GGUF_PY.len());
}

/// The types gguf-py 0.19 has no dequantizer for (Q1_0: an id only; Q2_0: not even that). Their
/// reference is llama.cpp itself: `q1_0_and_q2_0_known_blocks` below holds the decoders to
/// ggml's layout, and ACCURACY.md records real llama.cpp files against its own F32 dequantization.
const NOT_IN_GGUF_PY: [GgmlType; 2] = [GgmlType::Q1_0, GgmlType::Q2_0];

/// Q1_0 (one sign bit per value, 128 per block) and Q2_0 (two-bit digits -1..=2, 64 per block),
/// written by hand in ggml's layout: d (f16), then the bits, least significant first.
#[test]
fn q1_0_and_q2_0_known_blocks() {
    let mut b = h(0.5).to_vec();
    let bits: [u8; 16] = std::array::from_fn(|i| [0b1010_0001, 0xff, 0x00, 0x80][i % 4]);
    b.extend_from_slice(&bits);
    let y = decode(GgmlType::Q1_0, &b, 128).unwrap();
    assert_eq!(&y[..8], &[0.5, -0.5, -0.5, -0.5, -0.5, 0.5, -0.5, 0.5]);
    assert!(y[8..16].iter().all(|v| *v == 0.5) && y[16..24].iter().all(|v| *v == -0.5));
    assert_eq!(&y[24..32], &[-0.5, -0.5, -0.5, -0.5, -0.5, -0.5, -0.5, 0.5]);
    let mut b = h(0.25).to_vec();
    let digits: [u8; 16] = std::array::from_fn(|i| if i == 0 { 0b11_10_01_00 } else { 0b01_01_01_01 });
    b.extend_from_slice(&digits);
    let y = decode(GgmlType::Q2_0, &b, 64).unwrap();
    assert_eq!(&y[..4], &[-0.25, 0.0, 0.25, 0.5]);
    assert!(y[4..].iter().all(|v| *v == 0.0));
    // The encoders round trip values on their grids exactly (ggml's Q2_0 rule scales by the
    // largest magnitude, so its digit 2 goes unused).
    let x: Vec<f32> = (0..64).map(|i| [-0.5f32, 0.0, 0.5][i % 3]).collect();
    assert_eq!(decode(GgmlType::Q2_0, &encode(GgmlType::Q2_0, &x).unwrap(), 64).unwrap(), x);
    let x: Vec<f32> = (0..128).map(|i| if i % 3 == 0 { 0.75 } else { -0.75 }).collect();
    assert_eq!(decode(GgmlType::Q1_0, &encode(GgmlType::Q1_0, &x).unwrap(), 128).unwrap(), x);
}

/// TQ1_0, TQ2_0 and MXFP4 encode as ggml's reference quantizers do (absmax ternary digits; OCP's
/// exponent and the nearest level): the same bytes as gguf-py's quantizers on random values.
/// (gguf-py 0.19 has no NVFP4 quantizer; the oracle's follows ggml's reference rule too.)
/// Skipped, saying so, without gguf-py.
#[test]
fn tq_and_mxfp4_encoders_match_gguf_py() {
    if !gguf_py_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut rng = SplitMix64(91);
    for ty in [GgmlType::TQ1_0, GgmlType::TQ2_0, GgmlType::MXFP4] {
        let mut x = random_values(&mut rng, 16 * QK_K, 0.05);
        x[..QK_K].iter_mut().for_each(|v| *v = 0.0); // an all-zero block too
        let (input, output) = (dir.path().join(format!("{}.in", ty.name())), dir.path().join(format!("{}.out", ty.name())));
        std::fs::write(&input, x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        let script = format!(
            "import numpy as np, gguf\nfrom gguf.quants import quantize\nx = np.fromfile({:?}, dtype='<f4').reshape(1, -1)\nquantize(x, gguf.GGMLQuantizationType({})).tofile({:?})",
            input.to_str().unwrap(), ty.id(), output.to_str().unwrap()
        );
        let o = std::process::Command::new("python3").args(["-c", &script]).output().unwrap();
        assert!(o.status.success(), "{}: {}", ty.name(), String::from_utf8_lossy(&o.stderr));
        let (ours, theirs) = (encode(ty, &x).unwrap(), std::fs::read(&output).unwrap());
        assert_eq!(ours.len(), theirs.len(), "{}", ty.name());
        let first = ours.iter().zip(&theirs).position(|(a, b)| a != b);
        assert_eq!(first, None, "{}: first differing byte (block {:?})", ty.name(), first.map(|i| i / ty.type_size()));
    }
}

/// Where a block keeps its f16 scale `d`.
fn d_offset(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q6_K => 208,
        GgmlType::Q2_K => 80,
        GgmlType::Q3_K => 108,
        GgmlType::TQ1_0 => 52,
        GgmlType::TQ2_0 => 64,
        _ => 0,
    }
}

/// The finiteness check reads only the scale fields of quantized blocks; it must find exactly what
/// a full decode finds (the first non-finite element and its value), whatever the bytes hold.
#[test]
fn first_non_finite_agrees_with_a_full_decode_on_arbitrary_bytes() {
    use oracle::quant::first_non_finite;
    let mut rng = SplitMix64(0x5eed_f1a7);
    let mut found = 0;
    for ty in GgmlType::ALL {
        let (ts, bs) = (ty.type_size(), ty.block_size());
        for trial in 0..400 {
            let n_blocks = 1 + (rng.next_u64() % 4) as usize;
            let mut b: Vec<u8> = (0..n_blocks * ts).map(|_| rng.next_u64() as u8).collect();
            if trial % 2 == 0 {
                // Arbitrary bytes make a non-finite f16 one time in 32; half the trials get every
                // 16-bit word's exponent cleared instead, so all-finite tensors are tried as well.
                for w in b.chunks_exact_mut(2) {
                    w[1] &= 0x83;
                }
                if ty == GgmlType::F32 {
                    b.chunks_exact_mut(4).for_each(|w| w[3] &= 0x83);
                }
            } else {
                // The other half get one NaN or infinity planted: an element of a float tensor,
                // or the `d` of one block of a quantized one, its 16 bits otherwise arbitrary.
                let at = (rng.next_u64() as usize % n_blocks) * ts;
                let r = rng.next_u64();
                let f16_bad = 0x7c00 | (r >> 8) as u16 & 0x83ff;
                match ty {
                    GgmlType::F32 => b[at..at + 4].copy_from_slice(&f32::from_bits(0x7f80_0000 | (r >> 8) as u32 & 0x807f_ffff).to_le_bytes()),
                    GgmlType::BF16 => b[at..at + 2].copy_from_slice(&(0x7f80 | (r >> 8) as u16 & 0x807f).to_le_bytes()),
                    // An MXFP4 exponent of 2^125 or more: its levels of 4 and more overflow.
                    GgmlType::MXFP4 => b[at] = 253 + (r % 3) as u8,
                    // F16 and every block's d (at 0 but for the K-quants that keep it last).
                    _ => b[at + d_offset(ty)..at + d_offset(ty) + 2].copy_from_slice(&f16_bad.to_le_bytes()),
                }
            }
            let y = decode(ty, &b, n_blocks * bs).unwrap();
            let want = y.iter().position(|v| !v.is_finite()).map(|i| (i, y[i]));
            let got = first_non_finite(ty, &b);
            assert_eq!(got.map(|(i, v)| (i, v.to_bits())), want.map(|(i, v)| (i, v.to_bits())), "{} trial {trial}", ty.name());
            found += want.is_some() as usize;
        }
    }
    // NVFP4 never decodes to a non-finite value (its largest scale, 240, times 6).
    assert!(found >= 200 * (GgmlType::ALL.len() - 1), "the trials planted too few non-finite values to test anything: {found}");
}

/// A NaN or infinite scale makes its whole block non-finite, element 0 included (infinity times a
/// zero quant is NaN), and the check names the block's first element.
#[test]
fn first_non_finite_finds_a_planted_scale() {
    use oracle::quant::first_non_finite;
    for ty in GgmlType::ALL.into_iter().filter(|t| t.block_size() > 1) {
        let x: Vec<f32> = (0..3 * ty.block_size()).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut b = encode(ty, &x).unwrap();
        assert_eq!(first_non_finite(ty, &b), None, "{}", ty.name());
        if ty == GgmlType::NVFP4 {
            // Every byte is a finite scale, the largest (0xff: 1.875 x 2^8, halved) 240: block 1
            // with every scale at it reaches 12 x 240 and stays finite.
            let at = ty.type_size();
            b[at..at + 4].fill(0xff);
            assert_eq!(first_non_finite(ty, &b), None);
            let y = decode(ty, &b, x.len()).unwrap();
            assert!(y.iter().all(|v| v.is_finite()) && y[64..128].iter().fold(0f32, |m, v| m.max(v.abs())) == 12.0 * 240.0);
            continue;
        }
        if ty == GgmlType::MXFP4 {
            // Its scale is a power of two, never NaN; the largest, 2^127, overflows every level
            // from 2 up (a zero stays zero): the first such element of block 1 is found.
            b[ty.type_size()] = 255;
            let want = decode(ty, &b, x.len()).unwrap().iter().position(|v| !v.is_finite());
            assert!(want.is_some_and(|i| (32..64).contains(&i)));
            assert_eq!(first_non_finite(ty, &b).map(|(i, _)| i), want);
            continue;
        }
        let d_at = d_offset(ty);
        for bad in [f16::NAN, f16::INFINITY, f16::NEG_INFINITY] {
            let at = ty.type_size() + d_at; // block 1's d
            let keep = [b[at], b[at + 1]];
            b[at..at + 2].copy_from_slice(&bad.to_le_bytes());
            let (i, v) = first_non_finite(ty, &b).unwrap_or_else(|| panic!("{}: {bad} scale not found", ty.name()));
            assert_eq!(i, ty.block_size(), "{}", ty.name());
            assert!(!v.is_finite());
            b[at..at + 2].copy_from_slice(&keep);
        }
    }
}

/// The traits table is the one place a weight type is described: each row sits at its variant's
/// index, ids and names are unique and round-trip, `ALL` lists every row in GGUF id order, and
/// each row's encoder writes whole blocks of `type_size` bytes (the round trip within the bound
/// is `encoders_round_trip_within_their_bounds`).
#[test]
fn the_traits_table_describes_every_type_once() {
    use oracle::quant::TRAITS;
    for (i, t) in TRAITS.iter().enumerate() {
        assert_eq!(t.ty as usize, i, "{} is not at its variant's index", t.name);
        assert_eq!(GgmlType::from_id(t.id), Some(t.ty));
        assert_eq!(GgmlType::from_name(t.name), Some(t.ty));
        assert_eq!(TRAITS.iter().filter(|u| u.id == t.id || u.name == t.name).count(), 1, "{}", t.name);
        let x: Vec<f32> = (0..2 * t.block_size).map(|k| ((k * 37 % 23) as f32 - 11.0) / 7.0).collect();
        assert_eq!(encode(t.ty, &x).unwrap().len(), 2 * t.type_size, "{}", t.name);
    }
    let mut by_id: Vec<GgmlType> = TRAITS.iter().map(|t| t.ty).collect();
    by_id.sort_by_key(|t| t.id());
    assert_eq!(GgmlType::ALL.to_vec(), by_id);
}
