//! Touchstone against llama.cpp (llama-cpp-python, when installed): tokenizers, BOS defaults,
//! greedy tokens, Phi-3's fused tensors and Llama 3.1's RoPE factors, side by side.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

/// SmolLM2's tokenizer (byte-level BPE with the SmolLM digit split, and its chat tokens matched
/// whole) gives llama.cpp's ids (through the PyPI bindings, when installed; skips, saying so,
/// otherwise). The `tokenize` command prints the oracle's ids as `--prompt-ids` takes them.
#[test]
fn smollm2_tokenizer_matches_llama_cpp_when_available() {
    let texts = [
        "The capital of France is",
        "",
        " ",
        "   \t\n\n\n  x",
        "3.14159 and 1234567 numbers, 2024-01-22",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "naïve café — 東京 🦙 Äpfel нещо",
        "Hello, y'all! How're you doin'? I'M FINE.",
        "fn main() {\n    println!(\"{}\", x >= 10);\n}",
    ];
    let model = smollm2();
    let o = xtask(&["tokenize", "--model", "smollm2", "--text", texts[0]], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "504,3575,282,4649,314");
    if !llama_cpp_installed() {
        return;
    }
    let theirs = llama_cpp_token_ids(&model, &texts, false);
    let tok = oracle::loader::open_tokenizer(&model).unwrap().unwrap();
    for (text, theirs) in texts.iter().zip(&theirs) {
        assert_eq!(&tok.encode(text).unwrap(), theirs, "{text:?}");
    }
    eprintln!("{} texts: the oracle's ids are llama.cpp's", texts.len());
}

/// llama.cpp's ids for each of `texts` (through the PyPI bindings; special tokens matched whole,
/// BOS first when `bos`).
fn llama_cpp_token_ids(model: &Path, texts: &[&str], bos: bool) -> Vec<Vec<u32>> {
    let script = format!(
        "import json, sys\nfrom llama_cpp import Llama\nm = Llama(model_path={:?}, vocab_only=True, verbose=False)\nprint(json.dumps([m.tokenize(t.encode(), add_bos={}, special=True) for t in json.load(sys.stdin)]))",
        model.display().to_string(),
        if bos { "True" } else { "False" }
    );
    let mut child = Command::new("python3")
        .args(["-c", &script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), serde_json::to_string(texts).unwrap().as_bytes()).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// 48 token ids spread over a tiny model's vocabulary, as `--prompt-ids` takes them.
fn tiny_ids_48() -> String {
    (0..48).map(|i| ((i * 37 + 11) % 250 + 5).to_string()).collect::<Vec<_>>().join(",")
}

/// llama.cpp's logits (through the PyPI bindings) of every position of `ids`, `[48, n_vocab]` flat.
fn llama_cpp_logits(model: &Path, ids: &str) -> Vec<f32> {
    let script = format!(
        "import json\nfrom llama_cpp import Llama\nm = Llama(model_path={:?}, n_threads=2, n_ctx=128, logits_all=True, verbose=False)\nm.eval([{ids}])\nprint(json.dumps(m.scores[:48].tolist()))",
        model.display().to_string()
    );
    let o = Command::new("python3").args(["-c", &script]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice::<Vec<Vec<f32>>>(&o.stdout).unwrap().concat()
}

fn llama_cpp_installed() -> bool {
    let probe = Command::new("python3").args(["-c", "import llama_cpp"]).output();
    let ok = matches!(probe, Ok(ref o) if o.status.success());
    if !ok {
        eprintln!("SKIPPED (llama.cpp part): llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp, ~12 min)");
    }
    ok
}

/// Phi-3's fused tensors. tiny-llama's weights are written twice, Q/K/V and gate/up re-encoded
/// as Q4_K (the rest as f32): as a `qwen2` GGUF with separate Q/K/V and gate/up tensors
/// (rotate-half RoPE, no biases: the computation Phi-3 does) and as a `phi3` GGUF with the same
/// blocks joined into `attn_qkv` (Q, K, V rows) and `ffn_up` (gate rows, then up rows). The same
/// model, so each device's logits are byte-identical between the two files (packed rows sliced
/// out of the fused tensors); gate and up joined the other way round are not. When llama-cpp-python is installed,
/// llama.cpp's logits on the phi3 file are as close to the oracle's as on the qwen2 file (and
/// the swapped file is far from both); with LongRoPE factors, llama.cpp and the oracle agree as
/// closely, and the oracle without them is far.
#[test]
fn phi3_fused_tensors_run_as_the_separate_ones_on_every_device() {
    use oracle::gguf::Value;
    let g = oracle::gguf::GgufFile::open(fixtures::resolve("tiny-llama", true).unwrap()).unwrap();
    let joined = |name: &str| {
        let tail = name.split_once('.').and_then(|(_, r)| r.split_once('.')).map(|(_, tail)| tail).unwrap_or("");
        matches!(tail, "attn_q.weight" | "attn_k.weight" | "attn_v.weight" | "ffn_gate.weight" | "ffn_up.weight")
    };
    let ty = |name: &str| if joined(name) { oracle::quant::GgmlType::Q4_K } else { oracle::quant::GgmlType::F32 };
    let stored = |name: &str| -> Vec<u8> {
        let t = g.tensor(name).unwrap_or_else(|| panic!("{name}"));
        oracle::quant::encode(ty(name), &g.tensor_f32(t).unwrap()).unwrap()
    };
    let dims = |name: &str| g.tensor(name).unwrap().dims.clone();
    let n_layer = g.tensors.iter().filter(|t| t.name.ends_with("attn_norm.weight")).count();
    // Phi-3 128k's LongRoPE: short factors rising 1..3.5, long ones four times those (an engine
    // at most at the original context uses the short), cos and sin scaled by 1.19.
    let half = oracle::spec::ModelSpec::from_gguf(&g).unwrap().rope.n_rot / 2;
    let short: Vec<f32> = (0..half).map(|i| 1.0 + 2.5 * i as f32 / half as f32).collect();
    let long: Vec<f32> = short.iter().map(|f| 4.0 * f).collect();
    let write = |arch: &str, fused: Option<bool>, longrope: bool, path: &Path| {
        let mut w = oracle::gguf::GgufWriter::new();
        for (k, v) in &g.metadata {
            match k.strip_prefix("llama.") {
                Some(rest) => w.meta(&format!("{arch}.{rest}"), v.clone()),
                None if k == "general.architecture" => w.meta(k, Value::String(arch.into())),
                None => w.meta(k, v.clone()),
            };
        }
        for t in &g.tensors {
            if fused.is_none() || !joined(&t.name) {
                w.tensor(&t.name, &t.dims, ty(&t.name), stored(&t.name));
            }
        }
        if let Some(gate_first) = fused {
            for l in 0..n_layer {
                let n = |tail: &str| format!("blk.{l}.{tail}");
                let (q, k, v) = (dims(&n("attn_q.weight")), dims(&n("attn_k.weight")), dims(&n("attn_v.weight")));
                let qkv = [stored(&n("attn_q.weight")), stored(&n("attn_k.weight")), stored(&n("attn_v.weight"))].concat();
                w.tensor(&n("attn_qkv.weight"), &[q[0], q[1] + k[1] + v[1]], oracle::quant::GgmlType::Q4_K, qkv);
                let (gate, up) = (stored(&n("ffn_gate.weight")), stored(&n("ffn_up.weight")));
                let gu = if gate_first { [gate, up].concat() } else { [up, gate].concat() };
                let d = dims(&n("ffn_up.weight"));
                w.tensor(&n("ffn_up.weight"), &[d[0], 2 * d[1]], oracle::quant::GgmlType::Q4_K, gu);
            }
        }
        if longrope {
            w.meta(&format!("{arch}.rope.scaling.attn_factor"), Value::F32(1.19));
            for (name, f) in [("rope_factors_short.weight", &short), ("rope_factors_long.weight", &long)] {
                w.tensor(name, &[half as u64], oracle::quant::GgmlType::F32, f.iter().flat_map(|v| v.to_le_bytes()).collect());
            }
        }
        w.write_to(path).unwrap();
    };
    let dir = tempfile::tempdir().unwrap();
    let (separate, phi3, swapped) = (dir.path().join("qwen2.gguf"), dir.path().join("phi3.gguf"), dir.path().join("phi3-swapped.gguf"));
    let longrope = dir.path().join("phi3-longrope.gguf");
    write("qwen2", None, false, &separate);
    write("phi3", Some(true), false, &phi3);
    write("phi3", Some(false), false, &swapped);
    write("phi3", Some(true), true, &longrope);
    let ids = tiny_ids_48();
    let logits = |model: &Path, device: &str| dump_logits(model, device, &ids, &dir.path().join(format!("{}-{device}", model.file_stem().unwrap().to_string_lossy())));
    for device in ["ref", "cpu", "gpu-emu", "fixed"] {
        let (a, b) = (logits(&separate, device), logits(&phi3, device));
        assert!(a == b, "{device}: phi3 logits differ from the separate tensors' (relative RMS {:.2e})", rel_rms(&b, &a));
        let off = rel_rms(&logits(&swapped, device), &a);
        assert!(off > 1e-2, "{device}: gate and up swapped should change the logits, relative RMS {off:.2e}");
    }
    // LongRoPE passes layer-diff on every device (their RoPE tables take the factors and the
    // cos/sin scale) and moves the logits.
    for device in ["cpu", "gpu-emu", "fixed"] {
        let o = xtask(&["layer-diff", "--model", longrope.to_str().unwrap(), "--device", device, "--prompt-ids", &ids, "--report-dir", dir.path().join(format!("ld-{device}")).to_str().unwrap()], &[]);
        assert_eq!(o.status.code(), Some(0), "{device}: {}", stderr(&o));
    }
    assert!(rel_rms(&logits(&longrope, "ref"), &logits(&phi3, "ref")) > 1e-2, "LongRoPE should change the logits");
    // With an original context of 16 positions (`rope.scaling.original_context_length`), the
    // oracle judges 16 and refuses the 17th, saying why, rather than rotate it with the short factors.
    let short_ctx = dir.path().join("phi3-longrope-16.gguf");
    let lr = oracle::gguf::GgufFile::open(&longrope).unwrap();
    let mut w = oracle::gguf::GgufWriter::new();
    for (k, v) in &lr.metadata {
        w.meta(k, v.clone());
    }
    w.meta("phi3.rope.scaling.original_context_length", Value::U32(16));
    for t in &lr.tensors {
        w.tensor(&t.name, &t.dims, t.ty, lr.tensor_bytes(t).to_vec());
    }
    w.write_to(&short_ctx).unwrap();
    let first = |n: usize| ids.split(',').take(n).collect::<Vec<_>>().join(",");
    // The same as a flat file (`export`), whose header carries the original context.
    let flat = dir.path().join("phi3-longrope-16.flat");
    let o = xtask(&["export", "--model", short_ctx.to_str().unwrap(), "--out", flat.to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    for model in [&short_ctx, &flat] {
        for (n, ok) in [(16, true), (17, false)] {
            let o = xtask(&["dump", "--model", model.to_str().unwrap(), "--prompt-ids", &first(n), "--out", dir.path().join(format!("lr16-{n}")).to_str().unwrap()], &[]);
            assert_eq!(o.status.success(), ok, "{}, {n} positions: {}", model.display(), stderr(&o));
            assert!(ok || stderr(&o).contains("position 16 is past the 16-position context this LongRoPE model is configured for"), "{}", stderr(&o));
        }
    }
    // Configured for 128 positions (`--context 128`, as llama.cpp run with `-c 128`), the model
    // takes its long factors at every position: all 48 positions run, layer-diff passes on every
    // device (each reads the factors the loader picked), and even the first 16 positions' logits
    // move from the short factors'. A flat file exported so holds the long factors and that
    // context, runs 48 positions as the GGUF does, and refuses to be judged at another context.
    let dump_at = |model: &Path, context: Option<&str>, n: usize, tag: &str| {
        let mut args = vec!["dump", "--model", model.to_str().unwrap(), "--prompt-ids"];
        let (ids_n, out) = (first(n), dir.path().join(tag));
        args.extend([ids_n.as_str(), "--out", out.to_str().unwrap()]);
        if let Some(c) = context {
            args.extend(["--context", c]);
        }
        (xtask(&args, &[]), out)
    };
    let long_logits = |model: &Path, context: Option<&str>, n: usize, tag: &str| {
        let (o, out) = dump_at(model, context, n, tag);
        assert!(o.status.success(), "{}: {}", model.display(), stderr(&o));
        read_logits(&out).1
    };
    let oracle_long = long_logits(&short_ctx, Some("128"), 48, "lr128");
    // On a model without LongRoPE the option changes nothing, and says so (once).
    let (o, _) = dump_at(&phi3, Some("128"), 4, "plain128");
    assert!(o.status.success() && stderr(&o).matches("changes nothing for").count() == 1, "{}", stderr(&o));
    let (o, _) = dump_at(&short_ctx, Some("128"), 4, "lr128-4");
    assert!(!stderr(&o).contains("changes nothing"), "{}", stderr(&o));
    let (short16, long16) = (long_logits(&short_ctx, None, 16, "lr16-short"), long_logits(&short_ctx, Some("128"), 16, "lr16-long"));
    let moved = rel_rms(&long16, &short16);
    assert!(moved > 1e-2, "the long factors should move the first 16 positions' logits: {moved:.2e}");
    for device in ["cpu", "gpu-emu", "fixed"] {
        let o = xtask(&["--context", "128", "layer-diff", "--model", short_ctx.to_str().unwrap(), "--device", device, "--prompt-ids", &ids, "--report-dir", dir.path().join(format!("ld128-{device}")).to_str().unwrap()], &[]);
        assert_eq!(o.status.code(), Some(0), "{device} at --context 128: {}", stderr(&o));
        let report: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.path().join(format!("ld128-{device}/report.json"))).unwrap()).unwrap();
        assert_eq!(report["provenance"]["context"], "128", "the report says which context it judged");
    }
    let flat_long = dir.path().join("phi3-longrope-16-ctx128.flat");
    let o = xtask(&["export", "--context", "128", "--model", short_ctx.to_str().unwrap(), "--out", flat_long.to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(long_logits(&flat_long, None, 48, "flat128") == oracle_long, "the flat file exported at --context 128 gives the GGUF's logits at that context");
    let (o, _) = dump_at(&flat_long, Some("16"), 8, "flat128-at16");
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("LongRoPE factors of a 128-position context") && stderr(&o).contains("export it again with --context 16"), "{}", stderr(&o));
    if llama_cpp_installed() {
        // llama.cpp at n_ctx 128 (past the original 16) uses the long factors too.
        let theirs = llama_cpp_logits(&short_ctx, &ids);
        let (same, short) = (rel_rms(&theirs, &oracle_long), rel_rms(&theirs, &logits(&longrope, "ref")));
        eprintln!("llama.cpp at n_ctx 128 on the original-context-16 file vs the oracle at --context 128: {same:.2e}, vs the short factors: {short:.2e}");
        assert!(same < 5e-2 && short > 10.0 * same, "{same:.3e} {short:.3e}");
    }
    // The same models as Phi-3 checkpoints (`qkv_proj`, `gate_up_proj`; LongRoPE's factors and
    // attention factor in config.json), dequantized by gguf-py to the values the oracle decodes
    // (so on the oracle only: a device multiplies Q4_K rows otherwise than f32 ones).
    let script = fixtures::workspace_root().join("tools/reference/gguf_to_safetensors.py");
    for gguf in [&phi3, &longrope] {
        let ckpt = dir.path().join(format!("{}-hf", gguf.file_stem().unwrap().to_string_lossy()));
        let o = Command::new("python3").arg(&script).arg(gguf).arg(&ckpt).args(["--dtype", "f32"]).output().unwrap();
        if o.status.success() {
            assert!(logits(&ckpt, "ref") == logits(gguf, "ref"), "{}: the checkpoint's logits differ from its GGUF's", gguf.display());
        } else {
            assert!(String::from_utf8_lossy(&o.stderr).contains("No module named"), "{}", String::from_utf8_lossy(&o.stderr));
            eprintln!("SKIPPED (checkpoint part): gguf-py is not installed (pip install -r tools/reference/requirements.txt)");
        }
    }
    if llama_cpp_installed() {
        let oracle = logits(&separate, "ref");
        let (baseline, phi3_err, swapped_err) =
            (rel_rms(&llama_cpp_logits(&separate, &ids), &oracle), rel_rms(&llama_cpp_logits(&phi3, &ids), &oracle), rel_rms(&llama_cpp_logits(&swapped, &ids), &oracle));
        eprintln!("llama.cpp vs the oracle (relative RMS, 48 positions): qwen2 file {baseline:.2e}, phi3 file {phi3_err:.2e}, phi3 with gate/up swapped {swapped_err:.2e}");
        assert!(phi3_err <= 2.0 * baseline.max(1e-6) && swapped_err > 10.0 * phi3_err, "{baseline:.3e} {phi3_err:.3e} {swapped_err:.3e}");
        let theirs = llama_cpp_logits(&longrope, &ids);
        let (same, without) = (rel_rms(&theirs, &logits(&longrope, "ref")), rel_rms(&theirs, &logits(&phi3, "ref")));
        eprintln!("llama.cpp with LongRoPE vs the oracle with it {same:.2e}, without it {without:.2e}");
        assert!(same <= 2.0 * baseline.max(1e-6) && without > 10.0 * same, "{baseline:.3e} {same:.3e} {without:.3e}");
    }
}

/// Whether a tokenizer puts BOS first when its GGUF does not say (`add_bos_token` absent): as
/// llama.cpp does for each of its test vocabularies (SentencePiece and Llama 3: yes; GPT-2 and
/// Qwen2: no; Gemma 4: always), through `tokenize`. Skips without the vocabularies (tools/reference/llama_vocab.py)
/// or the llama.cpp bindings.
#[test]
fn bos_defaults_match_llama_cpp_when_available() {
    let dir = fixtures::cache_dir().join("llama-vocab");
    let names = [
        "llama-spm", "phi-3", "gpt-2", "llama-bpe", "qwen2", "deepseek-llm", "deepseek-coder", "qwen35", "falcon", "mpt", "starcoder", "refact", "command-r", "gemma-4",
    ];
    let vocabs: Vec<PathBuf> = names.iter().map(|v| dir.join(format!("ggml-vocab-{v}.gguf"))).filter(|p| p.exists()).collect();
    if vocabs.is_empty() {
        eprintln!("SKIPPED: no llama.cpp vocabularies in {} (python3 tools/reference/llama_vocab.py)", dir.display());
        return;
    }
    if !llama_cpp_installed() {
        return;
    }
    for v in &vocabs {
        let script = format!("from llama_cpp import Llama\nm = Llama(model_path={:?}, vocab_only=True, verbose=False)\nprint(','.join(map(str, m.tokenize(b'Hello world', add_bos=True))))", v.display().to_string());
        let o = Command::new("python3").args(["-c", &script]).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let ours = xtask(&["tokenize", "--model", v.to_str().unwrap(), "--text", "Hello world"], &[]);
        assert_eq!(String::from_utf8_lossy(&ours.stdout).trim(), String::from_utf8_lossy(&o.stdout).trim(), "{}", v.display());
    }
}

/// llama.cpp (through the PyPI `llama-cpp-python` bindings, when installed) on the same Q4_1 GGUF:
/// its CPU path also multiplies Q4_1 weights with Q8 activations, so the `cpu` device should
/// produce the same greedy tokens up to a first difference at a near tie of the oracle's logits.
/// Skips, saying so, when the bindings are absent.
#[test]
fn cpu_device_greedy_matches_llama_cpp_when_available() {
    let probe = Command::new("python3").args(["-c", "import llama_cpp"]).output();
    if !matches!(probe, Ok(ref o) if o.status.success()) {
        eprintln!("SKIPPED: llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp, ~12 min)");
        return;
    }
    let model = smollm2();
    let script = format!(
        "from llama_cpp import Llama\nm = Llama(model_path={:?}, n_threads=2, n_ctx=256, verbose=False)\nout = []\nfor t in m.generate([{PROMPT_IDS}], temp=0.0, top_k=1):\n    out.append(t)\n    if len(out) == 8: break\nprint(out)",
        model.display().to_string()
    );
    let o = Command::new("python3").args(["-c", &script]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let theirs: Vec<u64> = serde_json::from_str(String::from_utf8_lossy(&o.stdout).trim()).unwrap();
    let r = xtask(&["run", "--model", "smollm2", "--prompt-ids", PROMPT_IDS, "--max-new-tokens", "8", "--ignore-eos", "--device", "cpu", "--json"], &[]);
    let v: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
    let ours: Vec<u64> = v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    eprintln!("llama.cpp {theirs:?}\ncpu       {ours:?}");
    assert_eq!(ours.len(), theirs.len(), "both generate 8 tokens");
    // Both engines round activations to Q8 blocks but sum in different orders, so where the
    // oracle's two best tokens are closer than such an engine's logit error, either may win; after
    // that first difference the sequences continue from different prefixes and say nothing more.
    // The error is measured here: the `cpu` device's RMS logit error against the oracle at that
    // position. Any other difference fails.
    let Some(k) = ours.iter().zip(&theirs).position(|(a, b)| a != b) else { return };
    let mut ids: Vec<String> = PROMPT_IDS.split(',').map(str::to_string).collect();
    ids.extend(ours[..k].iter().map(u64::to_string));
    let last_logits = |device: &str| {
        let dir = tempfile::tempdir().unwrap();
        let o = xtask(&["dump", "--model", "smollm2", "--device", device, "--prompt-ids", &ids.join(","), "--out", dir.path().to_str().unwrap()], &[]);
        assert!(o.status.success(), "{}", stderr(&o));
        let (shape, logits) = read_logits(dir.path());
        logits[(shape[0] - 1) * shape[1]..].to_vec()
    };
    let (oracle_logits, cpu_logits) = (last_logits("ref"), last_logits("cpu"));
    let cpu_rms = suites::layerdiff::err_stats(&cpu_logits, &oracle_logits, oracle_logits.len()).rms_err;
    let top2 = oracle::ops::top_k(&oracle_logits, 2);
    let (a, b) = (ours[k] as usize, theirs[k] as usize);
    let margin = f64::from((oracle_logits[a] - oracle_logits[b]).abs());
    eprintln!("first difference at generated token {k}: cpu {a}, llama.cpp {b}; oracle top-2 {top2:?}, oracle logit margin {margin:.4}, cpu RMS logit error {cpu_rms:.4}");
    assert!(
        top2.contains(&a) && top2.contains(&b) && margin <= 2.0 * cpu_rms,
        "cpu and llama.cpp differ at generated token {k} where the oracle sees no near tie (margin {margin:.4} > 2 x {cpu_rms:.4})"
    );
}

/// Llama 3.1's RoPE frequency factors mean here what they mean in llama.cpp (the PyPI
/// `llama-cpp-python` bindings, when installed; skips, saying so, otherwise): tiny-llama given a
/// `rope_freqs.weight` of llama3 factors (x8, low/high 1 and 4, a 64-position original context,
/// so pairs fall in all three bands) runs 48 positions in both. llama.cpp's logits must sit near
/// the oracle's for that file (its Q8 activations are all that separates them) and far from the
/// oracle's for the file without the factors.
#[test]
fn llama3_rope_factors_agree_with_llama_cpp_when_available() {
    let probe = Command::new("python3").args(["-c", "import llama_cpp"]).output();
    if !matches!(probe, Ok(ref o) if o.status.success()) {
        eprintln!("SKIPPED: llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp, ~12 min)");
        return;
    }
    let src = fixtures::resolve("tiny-llama", true).unwrap();
    let g = oracle::gguf::GgufFile::open(&src).unwrap();
    let rope = oracle::spec::ModelSpec::from_gguf(&g).unwrap().rope;
    let factors = oracle::spec::llama3_freq_factors(rope.theta, rope.n_rot, 8.0, 1.0, 4.0, 64);
    assert!(factors.contains(&1.0) && factors.contains(&8.0) && factors.iter().any(|&f| f > 1.0 && f < 8.0), "{factors:?}");
    let mut w = oracle::gguf::GgufWriter::new();
    for (k, v) in &g.metadata {
        w.meta(k, v.clone());
    }
    w.tensor("rope_freqs.weight", &[factors.len() as u64], oracle::quant::GgmlType::F32, factors.iter().flat_map(|f| f.to_le_bytes()).collect());
    for t in &g.tensors {
        w.tensor(&t.name, &t.dims, t.ty, g.tensor_bytes(t).to_vec());
    }
    let dir = tempfile::tempdir().unwrap();
    let with = dir.path().join("tiny-llama-llama3.gguf");
    w.write_to(&with).unwrap();
    let ids = tiny_ids_48();
    let llama_cpp_logits = |model: &Path| llama_cpp_logits(model, &ids);
    let oracle_logits = |model: &Path| dump_logits(model, "ref", &ids, &dir.path().join(model.file_stem().unwrap()));
    let (theirs, oracle_with, oracle_without) = (llama_cpp_logits(&with), oracle_logits(&with), oracle_logits(&src));
    // What llama.cpp's Q8 activations alone cost on this model: both engines without factors.
    let baseline = rel_rms(&llama_cpp_logits(&src), &oracle_without);
    let same = rel_rms(&theirs, &oracle_with);
    let without = rel_rms(&theirs, &oracle_without);
    eprintln!("llama.cpp vs the oracle (relative RMS over 48 positions): both without factors {baseline:.2e}; llama.cpp with factors vs the oracle with {same:.2e}, without {without:.2e}");
    assert!(same <= 2.0 * baseline && same * 10.0 < without, "baseline {baseline:.3e}, with {same:.3e}, without {without:.3e}");
}

/// Gemma 3's tokenizer (SentencePiece BPE, 262,144 tokens, no space prefix) gives llama.cpp's ids:
/// those below were printed by llama-cpp-python 0.3.36 (`tokenize(text, add_bos=True,
/// special=True)`), and are checked against the installed bindings too when present.
#[test]
fn gemma3_tokenizer_matches_llama_cpp() {
    let cases: [(&str, &[u32]); 8] = [
        ("The capital of France is", &[2, 818, 5279, 529, 7001, 563]),
        ("Hello, world!  Two  spaces", &[2, 9259, 236764, 1902, 236888, 138, 11634, 138, 35220]),
        ("naïve café — 東京 😀", &[2, 1789, 238527, 560, 33443, 2192, 86459, 163543]),
        ("  leading spaces", &[2, 138, 26016, 9952]),
        ("tabs\tand\nnewlines\n\n", &[2, 39218, 255968, 624, 107, 208697, 108]),
        ("x=1; y = x**2 + 3.14159", &[2, 236781, 236784, 236770, 236793, 570, 578, 1123, 1018, 236778, 900, 236743, 236800, 236761, 236770, 236812, 236770, 236810, 236819]),
        ("ÀÉÎõü 12345 67890", &[2, 238974, 237642, 239259, 237391, 236959, 236743, 236770, 236778, 236800, 236812, 236810, 236743, 236825, 236832, 236828, 236819, 236771]),
        ("<start_of_turn>user", &[2, 105, 2364]),
    ];
    let model = gemma3();
    let tok = oracle::loader::open_tokenizer(&model).unwrap().unwrap();
    for (text, ids) in &cases {
        assert_eq!(tok.encode(text).unwrap(), ids.to_vec(), "{text:?}");
    }
    let o = xtask(&["tokenize", "--model", "gemma3", "--text", cases[0].0], &[]);
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "2,818,5279,529,7001,563", "{}", stderr(&o));
    if !llama_cpp_installed() {
        return;
    }
    let texts: Vec<&str> = cases.iter().map(|(t, _)| *t).collect();
    let theirs = llama_cpp_token_ids(&model, &texts, true);
    for (text, theirs) in texts.iter().zip(&theirs) {
        assert_eq!(&tok.encode(text).unwrap(), theirs, "{text:?}");
    }
}
