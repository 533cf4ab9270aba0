//! The flat model format (`oracle::flat`, docs/FLAT_FORMAT.md) on every loader: a flat export of
//! each synthetic fixture runs on the oracle and on every device to the same bits as the GGUF it
//! came from; a converted export holds the reference encoder's blocks; and a damaged file (any
//! header or table byte changed, a tensor's bytes changed, a truncation, or a hostile header
//! whose checksum was made to match) is refused with an error naming the field or tensor and its
//! byte offset, never a panic, an out-of-bounds read or a huge allocation.

use devices::ModelOptions;
use oracle::flat::{self, FlatFile, Target};
use oracle::generate::AnyModel;
use oracle::loader::TensorSource;
use oracle::quant::{self, GgmlType};
use oracle::{NoTap, Precision};
use std::path::{Path, PathBuf};

const FIXTURES: [&str; 3] = ["tiny-llama", "tiny-qwen3", "tiny-moe"];

fn export(fixture: &str, dir: &Path, target: Target) -> PathBuf {
    let gguf = fixtures::resolve(fixture, true).unwrap();
    let (src, spec) = oracle::loader::open_weights(&gguf).unwrap();
    let out = dir.join(format!("{fixture}.flat"));
    let mut calls = 0;
    flat::export(&out, &spec, src.as_ref(), target, &mut |_, _, _| calls += 1).unwrap();
    assert!(calls > spec.n_layer, "progress was reported {calls} times");
    assert!(!dir.join(format!("{fixture}.flat.part")).exists(), "the partial file was left behind");
    out
}

/// The logits of a three-token prefill and a decode step on `device` (the oracle for `ref`).
fn logits(device: &str, path: &Path) -> Vec<u32> {
    if device == "ref" {
        let (m, _) = AnyModel::load(path, Precision::F32).unwrap();
        return m.prefill_logits(&[1, 2, 3, 4], &mut NoTap).unwrap().iter().map(|v| v.to_bits() as u32 ^ (v.to_bits() >> 32) as u32).collect();
    }
    let mut m = devices::open(device).unwrap().load_model(path, &ModelOptions::default()).unwrap_or_else(|e| panic!("{device} on {}: {e}", path.display()));
    let mut out = m.forward(&[1, 2, 3], &mut NoTap).unwrap();
    out.extend(m.forward(&[4], &mut NoTap).unwrap());
    out.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn every_device_runs_a_flat_export_to_the_bits_of_its_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let mut devices = vec!["ref", "cpu", "fixed"];
    match devices::open("gpu-emu") {
        Ok(_) => devices.push("gpu-emu"),
        Err(e) => eprintln!("SKIPPED on gpu-emu: {e}"),
    }
    let mut compared = 0;
    for fixture in FIXTURES {
        let gguf = fixtures::resolve(fixture, true).unwrap();
        let flat = export(fixture, dir.path(), Target::Keep);
        // The weights are the GGUF's bytes, as stored.
        let (g, _) = oracle::loader::open_weights(&gguf).unwrap();
        let (f, spec) = FlatFile::open(&flat).unwrap();
        for name in spec.tensor_names() {
            let (a, b) = (g.raw(&name).unwrap().unwrap(), f.raw(&name).unwrap().unwrap());
            assert!(a.ty == b.ty && a.dims == b.dims && a.bytes == b.bytes, "{fixture}: `{name}` differs");
        }
        for device in &devices {
            if *device == "fixed" && spec.moe.is_some() {
                continue; // fixed runs dense models only (says so: `unsupported`)
            }
            assert_eq!(logits(device, &gguf), logits(device, &flat), "{fixture} on {device}");
            compared += 1;
        }
    }
    assert!(compared >= 8, "{compared} comparisons");
}

#[test]
fn a_converted_export_holds_the_reference_encoding() {
    let dir = tempfile::tempdir().unwrap();
    for (fixture, ty) in [("tiny-llama", GgmlType::Q8_0), ("tiny-moe", GgmlType::Q4_K), ("tiny-qwen3", GgmlType::F32)] {
        let gguf = fixtures::resolve(fixture, true).unwrap();
        let flat = export(fixture, dir.path(), Target::To(ty));
        let (g, _) = oracle::loader::open_weights(&gguf).unwrap();
        let (f, spec) = FlatFile::open(&flat).unwrap();
        let mut converted = 0;
        for name in spec.tensor_names() {
            let (a, b) = (g.raw(&name).unwrap().unwrap(), f.raw(&name).unwrap().unwrap());
            let matrix = a.dims.len() >= 2 && !name.contains("ffn_gate_inp") && a.dims[0] % ty.block_size() == 0;
            let want = if matrix { ty } else { GgmlType::F32 };
            assert_eq!(b.ty, want, "{fixture}: `{name}` {:?}", a.dims);
            let values = quant::decode(a.ty, &a.bytes, a.n_elements()).unwrap();
            assert!(b.bytes.as_ref() == quant::encode(want, &values).unwrap().as_slice(), "{fixture}: `{name}` is not the reference encoding");
            converted += (matrix && a.ty != ty) as usize;
        }
        assert!(converted > 0, "{fixture}: nothing converted");
        // The converted file is a model like any other.
        let (m, _) = AnyModel::load(&flat, Precision::F32).unwrap();
        assert!(m.prefill_logits(&[1, 2], &mut NoTap).unwrap().iter().all(|v| v.is_finite()));
    }
}

/// Recomputes the header's checksum (FNV-1a 64 of the header's first 504 bytes, then the table),
/// as a hostile writer would.
fn reseal(b: &mut [u8]) {
    let n = u32::from_le_bytes(b[32..36].try_into().unwrap()) as usize;
    let end = (512 + n * 128).min(b.len());
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &x in b[..504].iter().chain(&b[512..end]) {
        h ^= x as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    b[504..512].copy_from_slice(&h.to_le_bytes());
}

fn parse(b: Vec<u8>) -> Result<(), String> {
    FlatFile::from_bytes("hostile.flat", b).map(|_| ()).map_err(|e| e.to_string())
}

#[test]
fn every_header_and_table_byte_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read(export("tiny-llama", dir.path(), Target::Keep)).unwrap();
    parse(good.clone()).unwrap();
    let data_offset = u64::from_le_bytes(good[40..48].try_into().unwrap()) as usize;
    assert!(data_offset > 512 + 20 * 128);
    for at in 0..data_offset {
        let mut b = good.clone();
        b[at] ^= 0x41;
        let e = parse(b).expect_err(&format!("byte {at} changed, still accepted"));
        assert!(e.contains("hostile.flat: flat model field `") && e.contains("at byte offset"), "byte {at}: {e}");
    }
    for len in [0, 7, 8, 100, 511, 512, 513, data_offset - 1, data_offset, good.len() - 1] {
        let e = parse(good[..len].to_vec()).expect_err(&format!("truncated to {len}, accepted"));
        assert!(e.contains("hostile.flat"), "{len}: {e}");
    }
}

#[test]
fn a_changed_tensor_byte_is_refused_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = export("tiny-llama", dir.path(), Target::Keep);
    let mut b = std::fs::read(&path).unwrap();
    let (f, _) = FlatFile::from_bytes("x", b.clone()).unwrap();
    let t = f.tensors.iter().find(|t| t.name == "blk.1.ffn_down.weight").unwrap().clone();
    b[(t.offset + t.n_bytes / 2) as usize] ^= 1;
    std::fs::write(&path, &b).unwrap();
    let (f, _) = FlatFile::open(&path).unwrap(); // tensors are checked when first read
    let e = f.raw("blk.1.ffn_down.weight").err().unwrap().to_string();
    assert!(e.contains("tensor `blk.1.ffn_down.weight`") && e.contains(&format!("byte offset {}", t.offset)) && e.contains("corrupt"), "{e}");
    assert!(f.raw("blk.1.ffn_up.weight").is_ok());
    for device in ["cpu", "fixed"] {
        let e = devices::open(device).unwrap().load_model(&path, &ModelOptions::default()).err().unwrap().to_string();
        assert!(e.contains("blk.1.ffn_down.weight") && e.contains("corrupt"), "{device}: {e}");
    }
    let e = AnyModel::load(&path, Precision::F32).err().unwrap().to_string();
    assert!(e.contains("blk.1.ffn_down.weight") && e.contains("corrupt"), "ref: {e}");
}

#[test]
fn hostile_headers_with_a_matching_checksum_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read(export("tiny-llama", dir.path(), Target::Keep)).unwrap();
    let entry = |name: &str| -> usize {
        let n = u32::from_le_bytes(good[32..36].try_into().unwrap()) as usize;
        (0..n).map(|i| 512 + i * 128).find(|&at| good[at..at + 64].starts_with(name.as_bytes()) && good[at + name.len()] == 0).unwrap()
    };
    let (embd, q, down) = (entry("token_embd.weight"), entry("blk.0.attn_q.weight"), entry("blk.1.ffn_down.weight"));
    let cases: Vec<(&str, Box<dyn Fn(&mut Vec<u8>)>, &str)> = vec![
        ("n_tensors u32::MAX", Box::new(|b| b[32..36].copy_from_slice(&u32::MAX.to_le_bytes())), "n_tensors"),
        ("unknown type", Box::new(move |b| b[q + 64..q + 68].copy_from_slice(&99u32.to_le_bytes())), "unknown GGML type id 99"),
        ("five dims", Box::new(move |b| b[q + 68..q + 72].copy_from_slice(&5u32.to_le_bytes())), "expected 1 to 4"),
        // attn_q's rows given as 48 values: not whole blocks of its quantized type.
        ("rows not whole blocks", Box::new(move |b| { let ty = u32::from_le_bytes(b[q + 64..q + 68].try_into().unwrap()); assert_ne!(ty, 0, "attn_q is quantized here"); b[q + 72..q + 80].copy_from_slice(&48u64.to_le_bytes()) }), "is not a multiple of the"),
        ("dims overflow", Box::new(move |b| b[q + 80..q + 88].copy_from_slice(&u64::MAX.to_le_bytes())), "n_bytes"),
        ("size off", Box::new(move |b| { let n = u64::from_le_bytes(b[q + 112..q + 120].try_into().unwrap()) - 2; b[q + 112..q + 120].copy_from_slice(&n.to_le_bytes()) }), "take"),
        ("offset past the end", Box::new(move |b| b[down + 104..down + 112].copy_from_slice(&(1u64 << 62).to_le_bytes())), "end within the file"),
        ("overlap", Box::new(move |b| { let o = b[embd + 104..embd + 112].to_vec(); b[q + 104..q + 112].copy_from_slice(&o) }), "previous tensor's end"),
        ("name without NUL", Box::new(move |b| b[q..q + 64].fill(b'a')), "no NUL"),
        ("renamed tensor", Box::new(move |b| b[q + 6] = b'7'), "has no tensor `blk.0.attn_q.weight`"),
        ("unknown flag", Box::new(|b| b[113] |= 1), "bits this reader does not know"),
        ("tied output declared", Box::new(|b| b[112] |= 8), "tensor `output.weight` would not be read"),
        ("rope scaling 9", Box::new(|b| b[104] = 9), "expected 0 none"),
        ("zero heads", Box::new(|b| b[76..80].fill(0)), "n_head is zero"),
        ("2^32-1 layers", Box::new(|b| b[72..76].fill(0xff)), "4294967295 layers, but the table holds 21 tensors"),
        ("vocabulary off", Box::new(|b| b[64] ^= 1), "n_vocab"),
        ("a reserved byte", Box::new(|b| b[300] = 1), "reserved"),
        ("version 2", Box::new(|b| b[8] = 2), "this reader reads version 1"),
    ];
    for (what, change, want) in cases {
        let mut b = good.clone();
        change(&mut b);
        reseal(&mut b);
        let e = parse(b).expect_err(what);
        assert!(e.contains(want), "{what}: {e}");
    }
}
