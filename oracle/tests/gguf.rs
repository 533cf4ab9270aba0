//! GGUF reader tests: a writer -> reader round trip, and a corpus of broken and hostile files
//! generated here. Every broken file must give an error that names a field and an offset — never
//! a panic, an out-of-bounds read, or an allocation the file size does not justify.

use oracle::gguf::{GgufFile, GgufWriter, Value};
use oracle::quant::{encode, GgmlType};
use oracle::OracleError;

fn sample_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.meta("general.architecture", Value::String("llama".into()));
    w.meta("general.alignment", Value::U32(32));
    w.meta("x.list", Value::Array(vec![Value::I32(1), Value::I32(-2)]));
    w.meta("x.f", Value::F64(0.5));
    let a: Vec<f32> = (0..64).map(|i| i as f32 * 0.25).collect();
    w.tensor("a", &[32, 2], GgmlType::Q8_0, encode(GgmlType::Q8_0, &a).unwrap());
    w.tensor("b", &[3], GgmlType::F32, encode(GgmlType::F32, &[1.0, 2.0, 3.0]).unwrap());
    w.to_bytes()
}

#[test]
fn round_trip() {
    let g = GgufFile::from_bytes("sample", sample_file()).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.get("general.architecture").unwrap().as_str(), Some("llama"));
    assert_eq!(g.get("x.list").unwrap().as_array().unwrap().len(), 2);
    assert_eq!(g.get("x.f").unwrap().as_f64(), Some(0.5));
    let b = g.tensor("b").unwrap();
    assert_eq!(g.tensor_f32(b).unwrap(), vec![1.0, 2.0, 3.0]);
    let a = g.tensor("a").unwrap();
    assert_eq!(a.dims, vec![32, 2]);
    assert_eq!(a.file_offset % 32, 0);
    let av = g.tensor_f32(a).unwrap();
    // Q8_0 of values up to 15.75: within half a step (15.75 / 127 / 2) of the input.
    assert!(av.iter().enumerate().all(|(i, v)| (v - i as f32 * 0.25).abs() <= 0.0625), "{av:?}");
}

fn expect_err(name: &str, bytes: Vec<u8>, field_part: &str) -> String {
    match GgufFile::from_bytes(name, bytes) {
        Ok(_) => panic!("{name}: a broken file was accepted"),
        Err(e @ OracleError::Gguf { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(field_part), "{name}: error `{msg}` does not mention `{field_part}`");
            assert!(msg.contains("byte offset"), "{name}: error `{msg}` has no offset");
            msg
        }
        Err(e) => panic!("{name}: wrong error kind: {e}"),
    }
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let full = sample_file();
    for len in 0..full.len() {
        let cut = full[..len].to_vec();
        assert!(GgufFile::from_bytes("cut", cut).is_err(), "truncation to {len} bytes was accepted");
    }
}

/// Byte offset of the first occurrence of `needle`.
fn find(h: &[u8], needle: &[u8]) -> usize {
    h.windows(needle.len()).position(|w| w == needle).expect("needle present")
}

fn patch_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Offset of the u32 n_dims field of tensor `name` (just after its name string).
fn tensor_info_at(b: &[u8], name: &str) -> usize {
    let mut pat = (name.len() as u64).to_le_bytes().to_vec();
    pat.extend(name.as_bytes());
    // the tensor infos come after the metadata; search from the end of the last key.
    let start = find(b, b"x.f");
    start + find(&b[start..], &pat) + pat.len()
}

#[test]
fn hostile_headers() {
    let good = sample_file();

    let mut b = good.clone();
    b[0] = b'X';
    expect_err("bad magic", b, "magic");

    let mut b = good.clone();
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    expect_err("v1", b, "version");

    let mut b = good.clone();
    patch_u64(&mut b, 8, u64::MAX);
    expect_err("absurd tensor count", b, "tensor_count");

    let mut b = good.clone();
    patch_u64(&mut b, 16, 1 << 60);
    expect_err("absurd kv count", b, "metadata_kv_count");

    // First key's length -> huge.
    let mut b = good.clone();
    patch_u64(&mut b, 24, u64::MAX / 2);
    expect_err("huge key length", b, "metadata[0].key");

    // Array count -> huge (would allocate exabytes if trusted).
    let mut b = good.clone();
    let at = find(&b, b"x.list") + 6 + 4 + 4; // key, value type (9), item type
    patch_u64(&mut b, at, u64::MAX / 4);
    expect_err("huge array", b, "x.list");

    // Unknown value type.
    let mut b = good.clone();
    let at = find(&b, b"x.f") + 3;
    b[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
    expect_err("unknown value type", b, "x.f");

    // Alignment that is not a power of two.
    let mut b = good.clone();
    let at = find(&b, b"general.alignment") + 17 + 4;
    b[at..at + 4].copy_from_slice(&33u32.to_le_bytes());
    expect_err("bad alignment", b, "general.alignment");
}

#[test]
fn hostile_tensor_infos() {
    let good = sample_file();
    let at = tensor_info_at(&good, "a"); // n_dims u32, dims 2 x u64, type u32, offset u64

    let mut b = good.clone();
    b[at..at + 4].copy_from_slice(&7u32.to_le_bytes());
    expect_err("too many dims", b, "n_dims");

    let mut b = good.clone();
    patch_u64(&mut b, at + 4 + 8, 0);
    expect_err("zero dim", b, "dims[1]");

    let mut b = good.clone();
    patch_u64(&mut b, at + 4, 1 << 40);
    patch_u64(&mut b, at + 4 + 8, 1 << 40);
    expect_err("overflowing size", b, "tensor `a`");

    let mut b = good.clone();
    patch_u64(&mut b, at + 4 + 8, 1 << 30);
    expect_err("data past the end", b, "tensor `a`.offset");

    let mut b = good.clone();
    b[at + 20..at + 24].copy_from_slice(&1234u32.to_le_bytes());
    let msg = expect_err("unknown type", b, "tensor `a`.type");
    assert!(msg.contains("id 1234; this tool decodes f32, f16, q4_0"), "{msg}");
    // A type ggml has and this tool does not decode is named, so the user knows which.
    let mut b = good.clone();
    b[at + 20..at + 24].copy_from_slice(&16u32.to_le_bytes());
    let msg = expect_err("iq2_xxs", b, "tensor `a`.type");
    assert!(msg.contains("type id 16 (iq2_xxs)") && msg.contains("iq4_xs"), "{msg}");

    let mut b = good.clone();
    patch_u64(&mut b, at + 4, 33); // Q8_0 rows must be a multiple of 32
    expect_err("partial block", b, "dims[0]");

    let mut b = good.clone();
    patch_u64(&mut b, at + 24, 7);
    expect_err("misaligned offset", b, "offset");

    let mut b = good.clone();
    patch_u64(&mut b, at + 24, u64::MAX - 31);
    expect_err("offset overflow", b, "offset");
}

#[test]
fn random_corruption_never_panics() {
    let good = sample_file();
    let mut rng = oracle::ops::SplitMix64(99);
    for _ in 0..3000 {
        let mut b = good.clone();
        let n_flips = 1 + (rng.next_u64() % 4) as usize;
        for _ in 0..n_flips {
            let i = (rng.next_u64() % b.len() as u64) as usize;
            b[i] = rng.next_u64() as u8;
        }
        // Either outcome is fine; a panic fails the test. Accepted files must decode in bounds.
        if let Ok(g) = GgufFile::from_bytes("fuzz", b) {
            for t in &g.tensors {
                let _ = g.tensor_f32(t);
            }
        }
    }
}

#[test]
fn missing_file_names_the_path() {
    let e = GgufFile::open("/definitely/not/here.gguf").err().expect("error");
    assert!(e.to_string().contains("/definitely/not/here.gguf"));
}
