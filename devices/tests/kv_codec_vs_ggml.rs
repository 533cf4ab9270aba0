//! The `cpu` device's KV cache encoders against ggml's own reference quantizers (its type
//! traits' `from_float_ref`, what ggml's CPU backend writes a cache row with), byte for byte, on
//! random rows and on all-zero, constant and sparse ones. ggml comes from
//! tools/peers/build_ggml.py through tools/peers/ggml_quantize.py; without it the test is skipped,
//! saying so, unless TOUCHSTONE_REQUIRE_GGML=1.

use devices::cpu::kvcodec;
use oracle::quant::GgmlType;
use std::path::Path;

#[test]
fn kv_cache_encoders_write_ggmls_bytes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    if !root.join(".cache/touchstone/ggml/lib/libggml-base.so").exists() && std::env::var("GGML_LIB_DIR").is_err() {
        assert!(std::env::var("TOUCHSTONE_REQUIRE_GGML").is_err(), "TOUCHSTONE_REQUIRE_GGML is set but ggml is not built (python3 tools/peers/build_ggml.py)");
        eprintln!("SKIPPED: ggml's libraries are not built (python3 tools/peers/build_ggml.py)");
        return;
    }
    let mut rng = oracle::ops::SplitMix64(0x6767_6d6c);
    let mut rows: Vec<f32> = (0..400).flat_map(|i| (0..64).map(|_| (rng.next_f64() as f32 - 0.5) * (1.0 + i as f32)).collect::<Vec<_>>()).collect();
    rows.extend([0.0f32; 64]);
    rows.extend([0.25f32; 64]);
    rows.extend((0..64).map(|i| if i % 7 == 0 { -3.0f32 } else { 0.0 }));
    rows.extend((0..64).map(|i| if i == 5 { 1e-20f32 } else { -1e-20 }));
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("x.f32");
    std::fs::write(&input, rows.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    for (name, ty) in [("f16", GgmlType::F16), ("bf16", GgmlType::BF16), ("q8_0", GgmlType::Q8_0), ("q4_0", GgmlType::Q4_0), ("q4_1", GgmlType::Q4_1), ("q5_0", GgmlType::Q5_0), ("q5_1", GgmlType::Q5_1), ("iq4_nl", GgmlType::IQ4_NL)] {
        let out = dir.path().join(name);
        let st = std::process::Command::new("python3").arg(root.join("tools/peers/ggml_quantize.py")).args([name, input.to_str().unwrap(), out.to_str().unwrap()]).status().unwrap();
        assert!(st.success(), "ggml_quantize.py {name}: {st}");
        let theirs = std::fs::read(&out).unwrap();
        let ours = kvcodec::encode(ty, &rows).unwrap();
        assert_eq!(ours.len(), theirs.len(), "{name}");
        let bs = ty.type_size();
        // IQ4_NL: a block too small to scale (largest magnitude under 1e-15) gets d = 0 and, in
        // ggml, whatever levels its buffer held from the block before: it decodes to zeros as
        // ours does, so only its scale is compared.
        let zero_scale = |b: &[u8]| ty == GgmlType::IQ4_NL && b[..2] == [0, 0];
        let differ: Vec<usize> = (0..ours.len() / bs)
            .filter(|b| {
                let (o, t) = (&ours[b * bs..(b + 1) * bs], &theirs[b * bs..(b + 1) * bs]);
                o != t && !(zero_scale(o) && zero_scale(t))
            })
            .collect();
        assert!(differ.is_empty(), "{name}: {} of {} blocks differ from ggml's, first block {} (ours {:02x?}, ggml {:02x?})", differ.len(), ours.len() / bs, differ[0], &ours[differ[0] * bs..(differ[0] + 1) * bs], &theirs[differ[0] * bs..(differ[0] + 1) * bs]);
    }
}
