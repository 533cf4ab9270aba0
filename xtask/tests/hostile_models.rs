//! Models users get wrong, through the command line: corrupt or inconsistent files refused by
//! name, memory checked before loading, files that are not regular files, and tokenizers this
//! tool does not build.

mod common;

use common::*;

#[test]
fn corrupt_gguf_is_reported_with_field_and_offset() {
    let src = fixtures::resolve("tiny-llama", true).unwrap();
    let mut bytes = std::fs::read(&src).unwrap();
    bytes.truncate(bytes.len() - 1000);
    let f = tempfile::Builder::new().suffix(".gguf").tempfile().unwrap();
    std::fs::write(f.path(), &bytes).unwrap();
    let o = xtask(&["run", "--model", f.path().to_str().unwrap(), "--prompt-ids", "1"], &[]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(e.contains("byte offset") && e.contains(".offset"), "{e}");
}

/// tiny-llama's bytes with the u32 value of metadata key `key` set to `v`.
fn with_meta_u32(bytes: &[u8], key: &str, v: u32) -> Vec<u8> {
    let mut b = bytes.to_vec();
    let at = b.windows(key.len()).position(|w| w == key.as_bytes()).unwrap() + key.len();
    assert_eq!(u32::from_le_bytes(b[at..at + 4].try_into().unwrap()), 4, "{key} is a u32");
    b[at + 4..at + 8].copy_from_slice(&v.to_le_bytes());
    b
}

#[test]
fn a_model_larger_than_the_memory_available_is_refused_before_it_is_loaded() {
    // TOUCHSTONE_MEMORY_LIMIT stands in for the machine's available memory: tiny-llama's weights
    // (about 1 MiB packed, more decoded) do not fit in 64 KiB, so every loader must refuse, say
    // what it would have held and how much there is, and exit 2, without a panic.
    for device in ["ref", "cpu", "fixed", "fixed-int4", "gpu-emu"] {
        let o = xtask(&["run", "--model", "tiny-llama", "--prompt-ids", "1", "--device", device], &[("TOUCHSTONE_MEMORY_LIMIT", "64K")]);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{device}: {e}");
        assert!(e.contains("tiny-llama.gguf") && e.contains("needs") && e.contains("more than the 64.0 KiB") && e.contains("nothing was loaded"), "{device}: {e}");
        assert!(!e.contains("panicked"), "{device}: {e}");
    }
    let o = xtask(&["run", "--model", "tiny-llama", "--prompt-ids", "1", "--max-new-tokens", "1", "--device", "cpu"], &[("TOUCHSTONE_MEMORY_LIMIT", "1G")]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = xtask(&["run", "--model", "tiny-llama", "--prompt-ids", "1", "--device", "ref"], &[("TOUCHSTONE_MEMORY_LIMIT", "lots")]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("TOUCHSTONE_MEMORY_LIMIT=\"lots\": expected a size"), "{}", stderr(&o));
}

#[test]
fn metadata_the_tensors_do_not_back_and_nan_weights_are_refused_by_every_loader() {
    // A vocabulary or block count of 2^30 over a 1 MB file: each loader would size its tables and
    // layer lists by it. The spec checks them against the tensors, so every device says why.
    let src = fixtures::resolve("tiny-llama", true).unwrap();
    let good = std::fs::read(&src).unwrap();
    let cases = [
        (with_meta_u32(&good, "llama.block_count", 1 << 30), "block_count is 1073741824 but the file has no `blk.1073741823.attn_norm.weight`"),
        (with_meta_u32(&good, "llama.vocab_size", 1 << 30), "metadata says embedding_length 256 and vocabulary 1073741824"),
        // An end-of-text id no token has: generation would never stop on it.
        (with_meta_u32(&good, "tokenizer.ggml.eos_token_id", 1 << 30), "tokenizer.ggml.eos_token_id is 1073741824, outside the vocabulary of 272 tokens"),
    ];
    for (bytes, want) in &cases {
        let f = tempfile::Builder::new().suffix(".gguf").tempfile().unwrap();
        std::fs::write(f.path(), bytes).unwrap();
        for device in ["ref", "cpu", "fixed", "gpu-emu"] {
            let o = xtask(&["run", "--model", f.path().to_str().unwrap(), "--prompt-ids", "1", "--device", device], &[]);
            let e = stderr(&o);
            assert_eq!(o.status.code(), Some(2), "{device}: {e}");
            assert!(e.contains(want) && !e.contains("panicked"), "{device}: {e}");
            assert_eq!(e.matches(f.path().to_str().unwrap()).count(), 1, "{device} names the file once: {e}");
        }
    }

    // A NaN or infinity in a weight: every loader refuses the file and names the tensor and the
    // element, whether the weight is F32 or a quantized block whose f16 scale `d` is not finite,
    // and (MoE) whichever expert of a stacked tensor holds it.
    let f32_nan = |t: &oracle::gguf::TensorInfo, b: &mut [u8]| b[t.file_offset as usize + 12..][..4].copy_from_slice(&f32::NAN.to_le_bytes());
    // 0x7c00 is f16 +infinity.
    let d_inf = |block: usize, d_at: usize| {
        move |t: &oracle::gguf::TensorInfo, b: &mut [u8]| {
            let at = t.file_offset as usize + block * t.ty.type_size() + d_at;
            b[at..at + 2].copy_from_slice(&0x7c00u16.to_le_bytes());
        }
    };
    let plants: [(&str, &str, Box<dyn Fn(&oracle::gguf::TensorInfo, &mut [u8])>, &str, &[&str]); 3] = [
        ("tiny-llama", "output_norm.weight", Box::new(f32_nan), "holds NaN at element 3 (row 0, column 3)", &["ref", "cpu", "fixed", "gpu-emu"]),
        // Q6_K keeps d last in its 210-byte block; block 2 starts at element 512, row 2 of 256.
        ("tiny-llama", "blk.1.attn_v.weight", Box::new(d_inf(2, 208)), "at element 512 (row 2, column 0)", &["ref", "cpu", "fixed", "gpu-emu"]),
        // Q8_0 experts of 128 x 256 (1,024 blocks each): expert 2's block 1 is block 2,049, element 65,568.
        ("tiny-moe", "blk.1.ffn_up_exps.weight", Box::new(d_inf(2 * 1024 + 1, 0)), "at element 65568 (row 256, column 32)", &["ref", "cpu", "gpu-emu"]),
    ];
    for (model, tensor, plant, want, devices) in &plants {
        let src = fixtures::resolve(model, true).unwrap();
        let g = oracle::gguf::GgufFile::open(&src).unwrap();
        let mut bytes = std::fs::read(&src).unwrap();
        plant(g.tensor(tensor).unwrap(), &mut bytes);
        let f = tempfile::Builder::new().suffix(".gguf").tempfile().unwrap();
        std::fs::write(f.path(), &bytes).unwrap();
        // The oracle is asked twice: weights decoded at load, and kept packed (checked as stored).
        let runs = devices.iter().map(|d| (*d, "decoded")).chain([("ref", "packed")]);
        for (device, store) in runs {
            let o = xtask(&["run", "--model", f.path().to_str().unwrap(), "--prompt-ids", "1", "--device", device], &[("TOUCHSTONE_ORACLE_WEIGHTS", store)]);
            let e = stderr(&o);
            assert_eq!(o.status.code(), Some(2), "{device} {store}: {e}");
            assert!(e.contains(&format!("tensor `{tensor}` holds")) && e.contains(want) && e.contains("weights must be finite"), "{model} {device} {store}: {e}");
        }
    }
}

#[test]
fn the_oracle_holds_weights_packed_when_their_decoded_copy_does_not_fit_and_gives_the_same_bits() {
    // A memory limit between the model's packed size and its f32 size: the oracle keeps the
    // matrices as stored and decodes rows as products use them, says so, and dumps the very bytes
    // (every tap, every logit) of the decoded run, prefill and decode steps alike. Below the
    // packed size it refuses, naming both sizes. Every weight type and the MoE experts are
    // covered by the two fixtures (and by the self-check of the random models).
    use oracle::loader::TensorSource;
    for model in ["tiny-llama", "tiny-moe"] {
        let path = fixtures::resolve(model, true).unwrap();
        let g = oracle::gguf::GgufFile::open(&path).unwrap();
        let (packed, decoded) = (g.n_bytes().unwrap(), g.n_elements().unwrap() * 4);
        assert!(packed * 2 < decoded, "{model}: {packed} vs {decoded}");
        let between = ((packed + decoded) / 2).to_string();
        for precision in ["f32", "f64"] {
            let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
            for (dir, env) in dirs.iter().zip([("TOUCHSTONE_ORACLE_WEIGHTS", "decoded"), ("TOUCHSTONE_MEMORY_LIMIT", between.as_str())]) {
                let o = xtask(&["dump", "--model", model, "--prompt-ids", "5,9,17,3,200,41", "--out", dir.path().to_str().unwrap(), "--device", "ref", "--precision", precision], &[env]);
                let e = stderr(&o);
                assert_eq!(o.status.code(), Some(0), "{model} {precision} {env:?}: {e}");
                assert_eq!(e.contains("holds") && e.contains("packed as stored"), env.0 == "TOUCHSTONE_MEMORY_LIMIT", "{model} {precision} {env:?}: {e}");
            }
            for f in ["logits.safetensors", "taps.safetensors"] {
                let (a, b) = (std::fs::read(dirs[0].path().join(f)).unwrap(), std::fs::read(dirs[1].path().join(f)).unwrap());
                assert!(a.len() > 1000 && a == b, "{model} {precision}: {f} differs between the decoded and the packed oracle");
            }
        }
        // Decode steps: a sampled generation draws on every probability, so it repeats only when
        // each step's logits do.
        let sampled = |env: (&str, &str)| {
            let o = xtask(&["run", "--model", model, "--prompt-ids", "5,9,17", "--max-new-tokens", "16", "--ignore-eos", "--temperature", "0.9", "--seed", "7", "--json", "--device", "ref"], &[env]);
            assert_eq!(o.status.code(), Some(0), "{model} {env:?}: {}", stderr(&o));
            serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["tokens"].clone()
        };
        let tokens = sampled(("TOUCHSTONE_ORACLE_WEIGHTS", "decoded"));
        assert_eq!(tokens.as_array().map(Vec::len), Some(16), "{model}: {tokens}");
        assert_eq!(sampled(("TOUCHSTONE_ORACLE_WEIGHTS", "packed")), tokens, "{model}: decode steps differ between the decoded and the packed oracle");
        // A bench of the oracle says which store its figures come from.
        for (env, want) in [(("TOUCHSTONE_MEMORY_LIMIT", between.as_str()), "packed"), (("TOUCHSTONE_ORACLE_WEIGHTS", "decoded"), "decoded")] {
            let dir = tempfile::tempdir().unwrap();
            let o = xtask(&["bench", "--device", "ref", "--model", model, "--prompt-len", "2", "--gen-len", "2", "--reps", "1", "--report-dir", dir.path().to_str().unwrap()], &[env]);
            assert_eq!(o.status.code(), Some(0), "{model} {env:?}: {}", stderr(&o));
            let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json")).unwrap()).unwrap();
            assert_eq!(r["cases"][0]["metrics"]["oracle_weights"], want, "{model} {env:?}");
        }
        let o = xtask(&["run", "--model", model, "--prompt-ids", "1", "--device", "ref"], &[("TOUCHSTONE_MEMORY_LIMIT", &(packed / 2).to_string())]);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{model}: {e}");
        assert!(e.contains("holding the weights packed as stored (decoded as f32 they would take") && e.contains("nothing was loaded"), "{model}: {e}");
    }
}

/// A norm weight with the right element count but a matrix shape is another tensor: refused,
/// naming it and its dims (exit 2).
#[test]
fn a_norm_with_a_matrix_shape_is_refused() {
    let g = oracle::gguf::GgufFile::open(fixtures::resolve("tiny-llama", true).unwrap()).unwrap();
    let mut w = oracle::gguf::GgufWriter::new();
    for (k, v) in &g.metadata {
        w.meta(k, v.clone());
    }
    for t in &g.tensors {
        let dims = if t.name == "output_norm.weight" { vec![t.dims[0] / 2, 2] } else { t.dims.clone() };
        w.tensor(&t.name, &dims, t.ty, g.tensor_bytes(t).to_vec());
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("matrix-norm.gguf");
    w.write_to(&path).unwrap();
    let o = xtask(&["run", "--model", path.to_str().unwrap(), "--prompt-ids", "1,2,3", "--max-new-tokens", "1"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("tensor `output_norm.weight` has dims") && stderr(&o).contains("expected a vector"), "{}", stderr(&o));
}

/// A named pipe where a model or a dump is expected is refused at once, naming the path (opening
/// it would wait for a writer forever); the run is bounded here so a regression fails, not hangs.
#[test]
fn a_named_pipe_for_a_model_or_a_dump_is_refused_not_waited_on() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("model.gguf");
    if !std::process::Command::new("mkfifo").arg(&fifo).status().is_ok_and(|s| s.success()) {
        eprintln!("SKIPPED: mkfifo is not available");
        return;
    }
    let dump = dir.path().join("dump");
    std::fs::create_dir_all(&dump).unwrap();
    assert!(std::process::Command::new("mkfifo").arg(dump.join("manifest.json")).status().unwrap().success());
    let external = format!("external:{}", dump.display());
    for args in [vec!["run", "--model", fifo.to_str().unwrap(), "--prompt-ids", "1,2", "--max-new-tokens", "1"], vec!["layer-diff", "--device", &external, "--model", "tiny-llama", "--prompt-ids", "1,2"]] {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_xtask")).args(&args).current_dir(workspace()).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().unwrap();
        let started = std::time::Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if started.elapsed().as_secs() > 60 {
                let _ = child.kill();
                panic!("{args:?}: still waiting on the named pipe after 60 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert_eq!(status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("named pipe"), "{args:?}: {err}");
    }
}

/// A GGUF with a SentencePiece (`llama`) tokenizer runs on text, on the oracle and on a device:
/// tiny-llama's weights with a 272-token SentencePiece vocabulary (3 specials, 256 byte tokens,
/// 13 scored pieces). BOS first (llama.cpp's default for these), `▁hello` reached by its scores,
/// `é` as its two byte tokens; the generated ids decode to text; `dump` and `layer-diff` take the
/// same text.
#[test]
fn a_sentencepiece_gguf_runs_on_text() {
    use oracle::gguf::Value;
    let g = oracle::gguf::GgufFile::open(fixtures::resolve("tiny-llama", true).unwrap()).unwrap();
    let pieces = [("\u{2581}", -1.0), ("h", -2.0), ("e", -2.0), ("l", -2.0), ("o", -2.0), ("\u{2581}h", -3.0), ("he", -4.0)];
    let pieces = pieces.into_iter().chain([("ll", -5.0), ("lo", -6.0), ("\u{2581}he", -7.0), ("llo", -8.0), ("\u{2581}hello", -9.0), ("w", -2.0)]);
    let mut tokens: Vec<(String, f32, i32)> = vec![("<unk>".into(), 0.0, 2), ("<s>".into(), 0.0, 3), ("</s>".into(), 0.0, 3)];
    tokens.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), 0.0, 6)));
    tokens.extend(pieces.map(|(p, s)| (p.to_string(), s, 1)));
    assert_eq!(tokens.len(), 272, "tiny-llama's vocabulary size");
    let mut w = oracle::gguf::GgufWriter::new();
    for (k, v) in &g.metadata {
        if !k.starts_with("tokenizer.") {
            w.meta(k, v.clone());
        }
    }
    w.meta("tokenizer.ggml.model", Value::String("llama".into()));
    w.meta("tokenizer.ggml.tokens", Value::Array(tokens.iter().map(|t| Value::String(t.0.clone())).collect()));
    w.meta("tokenizer.ggml.scores", Value::Array(tokens.iter().map(|t| Value::F32(t.1)).collect()));
    w.meta("tokenizer.ggml.token_type", Value::Array(tokens.iter().map(|t| Value::I32(t.2)).collect()));
    w.meta("tokenizer.ggml.unknown_token_id", Value::U32(0));
    w.meta("tokenizer.ggml.bos_token_id", Value::U32(1));
    w.meta("tokenizer.ggml.eos_token_id", Value::U32(2));
    for t in &g.tensors {
        w.tensor(&t.name, &t.dims, t.ty, g.tensor_bytes(t).to_vec());
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("spm.gguf");
    w.write_to(&path).unwrap();
    let id = |p: &str| tokens.iter().position(|t| t.0 == p).unwrap() as u64;
    let want: Vec<u64> = vec![1, id("\u{2581}hello"), id("\u{2581}"), id("<0xC3>"), id("<0xA9>")];
    for device in ["ref", "cpu"] {
        let o = xtask(&["run", "--model", path.to_str().unwrap(), "--prompt", "hello é", "--max-new-tokens", "4", "--ignore-eos", "--json", "--device", device], &[]);
        assert_eq!(o.status.code(), Some(0), "{device}: {}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let ids: Vec<u64> = v["prompt_ids"].as_array().unwrap().iter().map(|i| i.as_u64().unwrap()).collect();
        assert_eq!(ids, want, "{device}: {v}");
        assert_eq!(v["tokens"].as_array().map(Vec::len), Some(4), "{device}: {v}");
        assert!(v["text"].is_string(), "{device}: {v}");
    }
    // `dump` and `layer-diff` take the text too, tokenized the same way.
    let out = dir.path().join("dump");
    let o = xtask(&["dump", "--model", path.to_str().unwrap(), "--prompt", "hello é", "--out", out.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["token_ids"], serde_json::json!(want), "{manifest}");
    let o = xtask(&["layer-diff", "--model", path.to_str().unwrap(), "--device", "cpu", "--prompt", "hello é", "--report-dir", dir.path().join("ld").to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("over 5 tokens"), "{}", stderr(&o));
}

/// A GGUF whose tokenizer holds fewer tokens than its embedding and output head have rows
/// (200 against tiny-llama's 272; llama.cpp refuses it too) is refused before anything runs,
/// exit 2 naming both counts, by the oracle and by a device.
#[test]
fn a_gguf_whose_tokenizer_and_embedding_disagree_is_refused() {
    use oracle::gguf::Value;
    let g = oracle::gguf::GgufFile::open(fixtures::resolve("tiny-llama", true).unwrap()).unwrap();
    let mut w = oracle::gguf::GgufWriter::new();
    for (k, v) in &g.metadata {
        match (k.as_str(), v) {
            ("tokenizer.ggml.tokens" | "tokenizer.ggml.token_type", Value::Array(a)) => w.meta(k, Value::Array(a[..200].to_vec())),
            _ => w.meta(k, v.clone()),
        };
    }
    for t in &g.tensors {
        w.tensor(&t.name, &t.dims, t.ty, g.tensor_bytes(t).to_vec());
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("short-vocab.gguf");
    w.write_to(&path).unwrap();
    for device in ["ref", "cpu"] {
        let o = xtask(&["run", "--model", path.to_str().unwrap(), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--device", device], &[]);
        assert_eq!(o.status.code(), Some(2), "{device}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains("short-vocab.gguf") && e.contains("200 tokens") && e.contains("272 rows"), "{device}: {e}");
    }
}

/// A GGUF whose tokenizer is of a kind (`t5`'s Unigram) or has a pre-tokenizer (`tekken`) this
/// tool does not build still runs on token ids, on the oracle and on a device; text asks for
/// ids instead. A tokenizer model that is not a string stays an error naming the key.
#[test]
fn a_gguf_with_an_unbuilt_tokenizer_runs_on_token_ids_and_asks_for_them_for_text() {
    let g = oracle::gguf::GgufFile::open(fixtures::resolve("tiny-llama", true).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    use oracle::gguf::Value;
    // (key, value, runs on ids, why text is refused)
    let cases = [
        ("tokenizer.ggml.model", Value::String("t5".into()), true, "tokenizer kind `t5`"),
        ("tokenizer.ggml.pre", Value::String("tekken".into()), true, "tokenizer.ggml.pre `tekken` is not supported"),
        ("tokenizer.ggml.model", Value::U32(1), false, ""),
    ];
    for (key, value, ok, why) in cases {
        let mut w = oracle::gguf::GgufWriter::new();
        for (k, v) in &g.metadata {
            w.meta(k, if k == key { value.clone() } else { v.clone() });
        }
        for t in &g.tensors {
            w.tensor(&t.name, &t.dims, t.ty, g.tensor_bytes(t).to_vec());
        }
        let path = dir.path().join("t5.gguf");
        w.write_to(&path).unwrap();
        let model = path.to_str().unwrap();
        for device in ["ref", "cpu"] {
            let o = xtask(&["run", "--model", model, "--prompt-ids", "5,9,17", "--max-new-tokens", "3", "--ignore-eos", "--json", "--device", device], &[]);
            if ok {
                assert_eq!(o.status.code(), Some(0), "{device}: {}", stderr(&o));
                let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
                assert_eq!(v["tokens"].as_array().map(Vec::len), Some(3), "{v}");
            } else {
                assert_eq!(o.status.code(), Some(2), "{device}: {}", stderr(&o));
                assert!(stderr(&o).contains("`tokenizer.ggml.model`"), "{device}: {}", stderr(&o));
            }
        }
        if ok {
            let o = xtask(&["run", "--model", model, "--prompt", "hello", "--device", "ref"], &[]);
            assert_eq!(o.status.code(), Some(2));
            assert!(stderr(&o).contains("has no tokenizer this tool builds") && stderr(&o).contains(why) && stderr(&o).contains("use --prompt-ids"), "{}", stderr(&o));
            let o = xtask(&["tokenize", "--model", model, "--text", "hello"], &[]);
            assert_eq!(o.status.code(), Some(2));
            assert!(stderr(&o).contains(why), "{}", stderr(&o));
        }
    }
}

/// A one-row matrix stored as a vector: GGUF writers drop trailing dimensions of one, so the
/// Qwen2-MoE shared-expert gate ([1, n_embd]) that llama.cpp itself writes (`llama_model_quantize`
/// on tiny-moe, as on any Qwen2-MoE file it converts) has dims [n_embd], and the oracle refused
/// every such file ("has dims [256], expected [256, 1]"). Now the same bytes under either shape
/// give the same logits on every device that runs MoE.
#[test]
fn a_one_row_matrix_stored_as_a_vector_loads_on_every_device() {
    let g = oracle::gguf::GgufFile::open(fixtures::resolve("tiny-moe", true).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut w = oracle::gguf::GgufWriter::new();
    for (k, v) in &g.metadata {
        w.meta(k, v.clone());
    }
    let mut squeezed = 0;
    for t in &g.tensors {
        let dims: Vec<u64> = if t.name.ends_with("ffn_gate_inp_shexp.weight") {
            assert_eq!(t.dims[1..], [1], "{}: a one-row matrix in the fixture", t.name);
            squeezed += 1;
            t.dims[..1].to_vec()
        } else {
            t.dims.clone()
        };
        w.tensor(&t.name, &dims, t.ty, g.tensor_bytes(t).to_vec());
    }
    assert!(squeezed > 0, "tiny-moe has a shared-expert gate");
    let vector = dir.path().join("tiny-moe-vector-gate.gguf");
    w.write_to(&vector).unwrap();
    let ids = "5,17,42,99,3,250,7";
    for device in ["ref", "cpu", "gpu-emu"] {
        let a = dump_logits(&fixtures::resolve("tiny-moe", true).unwrap(), device, ids, &dir.path().join(format!("{device}-matrix")));
        let b = dump_logits(&vector, device, ids, &dir.path().join(format!("{device}-vector")));
        assert_eq!(a, b, "{device}: the same weights under either shape");
    }
}
