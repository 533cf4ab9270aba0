//! Hostile model metadata, on every loader: each numeric metadata value of the three synthetic
//! fixtures set in turn to edge values (0, 1, off by one, doubled, 2^31, u32::MAX; for floats 0,
//! negative, NaN, infinity, 1e30), and every device that runs whole models (the oracle, `cpu`,
//! `fixed`, `gpu-emu`) asked to load the file and run a prefill and a decode step. Each must
//! either run or return an error; a panic (a division by zero, an index out of bounds, an
//! overflow, a capacity overflow) fails the test, naming the key, the value and the device.

use devices::ModelOptions;
use oracle::generate::AnyModel;
use oracle::{NoTap, Precision};

/// (key, value offset, GGUF type) of every u32 or f32 metadata value in `bytes`.
fn numeric_fields(bytes: &[u8]) -> Vec<(String, usize, u32)> {
    let g = oracle::gguf::GgufFile::from_bytes("fixture", bytes.to_vec()).unwrap();
    let mut out = Vec::new();
    for key in g.metadata.keys() {
        // The key as written (u64 length, then the bytes), followed by its u32 type.
        let mut needle = (key.len() as u64).to_le_bytes().to_vec();
        needle.extend_from_slice(key.as_bytes());
        let at = bytes.windows(needle.len()).position(|w| w == needle.as_slice()).unwrap() + needle.len();
        let ty = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        if ty == 4 || ty == 6 {
            out.push((key.clone(), at + 4, ty));
        }
    }
    out.sort();
    out
}

fn u32_values(orig: u32) -> Vec<u32> {
    vec![0, 1, 2, 3, 7, orig.wrapping_sub(1), orig.wrapping_add(1), orig.wrapping_mul(2), orig / 2, 1 << 31, u32::MAX]
}

fn f32_values() -> Vec<f32> {
    vec![0.0, -1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30, 1e-30]
}

/// Loads `path` on `device` and runs a two-token prefill and one decode step.
fn exercise(device: &str, path: &std::path::Path) -> Result<(), String> {
    if device == "ref" {
        let (m, _) = AnyModel::load(path, Precision::F32).map_err(|e| e.to_string())?;
        m.prefill_logits(&[1, 2], &mut NoTap).map_err(|e| e.to_string())?;
        return Ok(());
    }
    let mut m = devices::open(device).map_err(|e| e.to_string())?.load_model(path, &ModelOptions::default()).map_err(|e| e.to_string())?;
    m.forward(&[1, 2], &mut NoTap).map_err(|e| e.to_string())?;
    m.forward(&[3], &mut NoTap).map_err(|e| e.to_string())?;
    Ok(())
}

/// The devices that run whole models here (gpu-emu needs a C++ compiler; skipped, saying so).
fn model_devices() -> Vec<&'static str> {
    let mut devices = vec!["ref", "cpu", "fixed"];
    match devices::open("gpu-emu") {
        Ok(_) => devices.push("gpu-emu"),
        Err(e) => eprintln!("SKIPPED on gpu-emu: {e}"),
    }
    devices
}

#[test]
fn edge_values_in_every_numeric_metadata_field_never_panic_a_loader() {
    let devices = model_devices();
    let dir = tempfile::tempdir().unwrap();
    // Panics are caught and listed; the default hook's message for each would only be noise.
    let mut tally = fixtures::hostile::Tally::default();
    for fixture in ["tiny-llama", "tiny-qwen3", "tiny-moe"] {
        let good = std::fs::read(fixtures::resolve(fixture, true).unwrap()).unwrap();
        for (key, at, ty) in numeric_fields(&good) {
            let orig = u32::from_le_bytes(good[at..at + 4].try_into().unwrap());
            let values: Vec<u32> = if ty == 4 { u32_values(orig) } else { f32_values().into_iter().map(f32::to_bits).collect() };
            for v in values {
                let mut bytes = good.clone();
                bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
                let path = dir.path().join(format!("{fixture}.gguf"));
                std::fs::write(&path, &bytes).unwrap();
                let shown = if ty == 4 { v.to_string() } else { f32::from_bits(v).to_string() };
                for device in &devices {
                    tally.case(format!("{fixture} {key}={shown} on {device}"), || exercise(device, &path));
                }
            }
        }
    }
    tally.finish();
}

/// Two edits this test found accepted, each now refused by every loader with the reason: a
/// block count below the file's layers (the model ran without its last layer) and a value head
/// size other than the key head size (read as the key's). So is a tensor nothing reads, which
/// was skipped: Llama 3.1's `rope_freqs.weight`, a bias on one layer only.
#[test]
fn metadata_that_would_silently_drop_weights_or_resize_heads_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (fixture, key, value, want) in [
        ("tiny-llama", "llama.block_count", 1, "block_count is 1 but the file holds tensors of layer 1"),
        ("tiny-qwen3", "qwen3.attention.value_length", 32, "attention.value_length 32 differs from the key length"),
    ] {
        let good = std::fs::read(fixtures::resolve(fixture, true).unwrap()).unwrap();
        let (_, at, ty) = numeric_fields(&good).into_iter().find(|(k, _, _)| k == key).unwrap_or_else(|| panic!("{fixture} has no {key}"));
        assert_eq!(ty, 4);
        let mut bytes = good.clone();
        bytes[at..at + 4].copy_from_slice(&(value as u32).to_le_bytes());
        let path = dir.path().join(format!("{fixture}.gguf"));
        std::fs::write(&path, &bytes).unwrap();
        for device in model_devices() {
            let e = exercise(device, &path).expect_err(&format!("{fixture} {key}={value} on {device}"));
            assert!(e.contains(want), "{device}: {e}");
        }
    }
    // A tensor no loader reads (a bias on one layer only), and Llama 3.1's RoPE frequency
    // factors (tiny-llama rotates 64 dimensions: 32 pairs) that are zero or one short.
    use oracle::gguf::{GgufFile, GgufWriter};
    use oracle::quant::GgmlType;
    let g = GgufFile::open(fixtures::resolve("tiny-llama", true).unwrap()).unwrap();
    let ones = |n: usize| (0..n).flat_map(|_| 1f32.to_le_bytes()).collect::<Vec<u8>>();
    for (extra, n, bytes, want) in [
        ("rope_freqs.weight", 32, vec![0; 128], "holds 0 at element 0; RoPE frequency factors must be finite and positive"),
        ("rope_freqs.weight", 31, ones(31), "holds 31 values, but rope.dimension_count 64 makes 32 rotated pairs"),
        ("blk.1.attn_q.bias", 32, vec![0; 128], "a llama model with this metadata reads no such weight"),
    ] {
        let mut w = GgufWriter::new();
        for (k, v) in &g.metadata {
            w.meta(k, v.clone());
        }
        for t in &g.tensors {
            w.tensor(&t.name, &t.dims, t.ty, g.tensor_bytes(t).to_vec());
        }
        w.tensor(extra, &[n], GgmlType::F32, bytes);
        let path = dir.path().join("extra.gguf");
        w.write_to(&path).unwrap();
        for device in model_devices() {
            let e = exercise(device, &path).expect_err(&format!("{extra} on {device}"));
            assert!(e.contains(&format!("`{extra}`")) && e.contains(want), "{device}: {e}");
        }
    }
}

/// Every metadata value of the three fixtures stored with another type (a number as a string, a
/// string or flag as a number): each loader refuses the file naming the key, or the key is one
/// nothing reads (`general.*`). Before, a retyped value silently took its default: a
/// `rope.freq_base` written as a string ran with 10000.
#[test]
fn retyped_metadata_is_refused_naming_the_key_never_read_as_its_default() {
    use oracle::gguf::{GgufFile, GgufWriter, Value};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("retyped.gguf");
    let mut checked = 0;
    for fixture in ["tiny-llama", "tiny-qwen3", "tiny-moe"] {
        let g = GgufFile::open(fixtures::resolve(fixture, true).unwrap()).unwrap();
        for key in g.metadata.keys().filter(|k| !k.starts_with("general.")) {
            let retyped = match &g.metadata[key] {
                Value::String(_) | Value::Bool(_) | Value::Array(_) => Value::U32(1),
                _ => Value::String("1".into()),
            };
            let mut w = GgufWriter::new();
            for (k, v) in &g.metadata {
                w.meta(k, if k == key { retyped.clone() } else { v.clone() });
            }
            for t in &g.tensors {
                w.tensor(&t.name, &t.dims, t.ty, g.tensor_bytes(t).to_vec());
            }
            w.write_to(&path).unwrap();
            // The model and its tokenizer, as `run` opens them.
            let e = oracle::loader::open_tokenizer(&path).err().map(|e| e.to_string()).or_else(|| exercise("ref", &path).err());
            let e = e.unwrap_or_else(|| panic!("{fixture}: `{key}` stored as {retyped:?} was accepted"));
            assert!(e.contains(&format!("`{key}`")), "{fixture} {key}: {e}");
            checked += 1;
        }
    }
    assert!(checked > 40, "{checked} keys");
}
