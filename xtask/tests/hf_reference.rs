//! Random checkpoints written by Hugging Face transformers (tools/reference/make_checkpoint.py)
//! against transformers' own float64 forward (tools/reference/hf_f64.py): read as safetensors
//! by the oracle, and converted to GGUF by llama.cpp's own converter (hf_to_gguf.py), then run
//! on the devices. Each test skips, saying so, without transformers and torch, unless
//! TOUCHSTONE_REQUIRE_TRANSFORMERS is set (CI).

mod common;

use common::*;
use std::path::Path;
use std::process::Command;

/// Whether Python has transformers and torch (the Hugging Face reference); when it does not,
/// says so and the caller skips, unless TOUCHSTONE_REQUIRE_TRANSFORMERS is set (CI).
fn transformers_installed() -> bool {
    let probe = Command::new("python3").args(["-c", "import transformers, torch"]).output();
    let ok = matches!(probe, Ok(ref o) if o.status.success());
    if !ok {
        assert!(std::env::var_os("TOUCHSTONE_REQUIRE_TRANSFORMERS").is_none(), "TOUCHSTONE_REQUIRE_TRANSFORMERS is set but Python cannot import transformers and torch");
        eprintln!("SKIPPED: transformers and torch are not installed (pip install -r tools/peers/requirements-torch.txt)");
    }
    ok
}

/// Transformers' float64 logits at every position of `ids` (`r`, hf_f64.py's output) against
/// the oracle's on `model` (a checkpoint directory or a GGUF): within 1e-5 relative RMS at every
/// position; and the layer states tap by tap, each within 1e-5 relative RMS over the prompt:
/// the scaled embedding (`inp_embd`), every layer's output but the last (`blk.N.l_out`), and
/// the last after the final norm (`result_norm`), as transformers' `hidden_states` holds them.
fn logits_agree(model: &Path, ids: &str, r: &serde_json::Value, dir: &Path, what: &str) {
    let dump = dir.join(format!("dump-{what}"));
    let o = xtask(&["dump", "--model", model.to_str().unwrap(), "--prompt-ids", ids, "--out", dump.to_str().unwrap()], &[]);
    assert!(o.status.success(), "{what}: {}", stderr(&o));
    let (shape, logits) = read_logits(&dump);
    let theirs = r["logits"].as_array().unwrap();
    assert_eq!(theirs.len(), shape[0]);
    let mut worst = (0.0f64, 0.0f64);
    for (p, row) in theirs.iter().enumerate() {
        let want: Vec<f32> = row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        let e = rel_rms(&logits[p * shape[1]..(p + 1) * shape[1]], &want);
        assert!(e <= 1e-5, "{what}: position {p}: relative RMS {e:.3e} against transformers float64");
        worst.0 = worst.0.max(e);
    }
    let hidden = r["hidden"].as_array().unwrap();
    let layers = hidden.len() - 1;
    let tap_names = std::iter::once("inp_embd".to_string()).chain((0..layers - 1).map(|i| format!("blk.{i}.l_out"))).chain(["result_norm".to_string()]);
    for (name, want) in tap_names.zip(hidden) {
        let want: Vec<f32> = want.as_array().unwrap().iter().flat_map(|row| row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32)).collect();
        let (_, ours) = oracle::dump::read_tensor(&dump, oracle::dump::TAPS_FILE, &name).unwrap();
        let e = rel_rms(&ours, &want);
        assert!(e <= 1e-5, "{what}: {name}: relative RMS {e:.3e} against transformers float64");
        worst.1 = worst.1.max(e);
    }
    eprintln!("{what}: against transformers float64, largest relative RMS: logits {:.2e} ({} positions), layer states {:.2e} ({} taps)", worst.0, theirs.len(), worst.1, hidden.len());
}

/// A random checkpoint of `arch` written by tools/reference/make_checkpoint.py, read by the
/// oracle, agrees with transformers' own float64 forward (`hf_f64.py`, every op checked float64)
/// within 1e-5 relative RMS at every position of `ids` (`make_args` adds arguments to
/// make_checkpoint.py). With `gguf`, the checkpoint also gets a
/// tokenizer and is converted by llama.cpp's converter (`hf_to_gguf.py`, `gguf` holding its
/// `--pre` argument, empty for none) to `model.gguf`, which must agree as closely. Returns the
/// temporary directory (the checkpoint as `ck`) and transformers' 32 greedy tokens.
fn checkpoint_agrees_with_transformers(arch: &str, ids: &str, make_args: &[&str], gguf: Option<&str>) -> (tempfile::TempDir, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let mut make = Command::new("python3");
    make.arg(workspace().join("tools/reference/make_checkpoint.py")).arg(arch).arg(&ck).args(make_args);
    if gguf.is_some() {
        make.arg("--tokenizer");
    }
    assert!(make.status().unwrap().success(), "make_checkpoint.py {arch} failed");
    let out = dir.path().join("ref.json");
    let st = Command::new("python3").arg(workspace().join("tools/reference/hf_f64.py")).arg(&ck).args(["--prompt-ids", ids, "--greedy", "32", "--out"]).arg(&out).status().unwrap();
    assert!(st.success(), "hf_f64.py failed");
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    logits_agree(&ck, ids, &r, dir.path(), &format!("{arch} safetensors"));
    if let Some(pre) = gguf {
        let file = dir.path().join("model.gguf");
        let mut conv = Command::new("python3");
        conv.arg(workspace().join("tools/reference/hf_to_gguf.py")).arg(&ck).arg(&file);
        if !pre.is_empty() {
            conv.args(["--pre", pre]);
        }
        let o = conv.output().unwrap();
        assert!(o.status.success(), "hf_to_gguf.py {arch} failed (python3 tools/reference/llama_vocab.py fetches the converter): {}", stderr(&o));
        logits_agree(&file, ids, &r, dir.path(), &format!("{arch} gguf"));
    }
    (dir, r["greedy"].clone())
}

/// Greedy 32 tokens of `model` on each of `devices` equal `greedy`; layer-diff passes on each of
/// `judged`.
fn devices_follow(model: &str, ids: &str, greedy: &serde_json::Value, devices: &[&str], judged: &[&str], reports: &Path) {
    for device in devices {
        let o = xtask(&["run", "--model", model, "--prompt-ids", ids, "--max-new-tokens", "32", "--ignore-eos", "--json", "--device", device], &[]);
        assert!(o.status.success(), "{device}: {}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(&v["tokens"], greedy, "{device}: greedy sequences differ from transformers'");
    }
    for device in judged {
        let o = xtask(&["layer-diff", "--device", device, "--model", model, "--prompt-ids", ids, "--report-dir", reports.join(device).to_str().unwrap()], &[]);
        assert_eq!(o.status.code(), Some(0), "{device}: {}", text(&o));
    }
}

/// A random GPT-OSS checkpoint written by transformers (`GptOssForCausalLM`: sinks, biased
/// router and experts with gate and up interleaved in one `x @ W` tensor, the clamped SwiGLU,
/// YaRN untruncated, alternating windowed and global layers) agrees with transformers' float64
/// forward, and so does its GGUF written by llama.cpp's converter (F32 experts); greedy
/// identical on `ref`, `cpu` and `gpu-emu` (the GGUF: `ref`, `cpu`); layer-diff passes on `cpu`
/// and `gpu-emu` (the GGUF: `cpu`); the GGUF's tokenizer gives transformers' ids. The prompt is
/// longer than the window of 4.
#[test]
fn gpt_oss_checkpoints_agree_with_transformers_in_f64() {
    if !transformers_installed() {
        return;
    }
    let ids = "5,17,99,3,250,42,7,8,9,10,11,12,13,14,15,16";
    let (dir, greedy) = checkpoint_agrees_with_transformers("gpt-oss", ids, &[], Some("gpt-4o"));
    devices_follow(dir.path().join("ck").to_str().unwrap(), ids, &greedy, &["ref", "cpu", "gpu-emu"], &["cpu", "gpu-emu"], dir.path());
    let gguf = dir.path().join("model.gguf");
    devices_follow(gguf.to_str().unwrap(), ids, &greedy, &["ref", "cpu"], &["cpu"], &dir.path().join("gguf"));
    // The converted tokenizer (byte-level BPE split by GPT-4o's pattern, `gpt-4o` in the GGUF)
    // gives transformers' ids for the checkpoint's tokenizer.json.
    // The second and third tell GPT-4o's split from Qwen2's, Llama 3's and GPT-2's on this vocabulary.
    let texts = ["The capital of France is Paris.", "They didn't answer; It's late, we'll go.", "Numbers 12, 345 and 6789 and/or 100 degrees", "aÉb CAFÉs\n\n  tabs\tend", "naïve café — 東京 😀"];
    let script = "import json,sys\nfrom transformers import AutoTokenizer\nt=AutoTokenizer.from_pretrained(sys.argv[1])\nprint(json.dumps([t.encode(s, add_special_tokens=False) for s in json.loads(sys.argv[2])]))";
    let o = Command::new("python3").args(["-c", script]).arg(dir.path().join("ck")).arg(serde_json::to_string(&texts).unwrap()).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let theirs: Vec<Vec<u32>> = serde_json::from_slice(&o.stdout).unwrap();
    for (text, theirs) in texts.iter().zip(&theirs) {
        let o = xtask(&["tokenize", "--model", gguf.to_str().unwrap(), "--text", text], &[]);
        assert!(o.status.success(), "{}", stderr(&o));
        let ours: Vec<u32> = String::from_utf8_lossy(&o.stdout).trim().split(',').map(|v| v.parse().unwrap()).collect();
        assert_eq!(&ours, theirs, "{text:?}");
    }
}

/// A random GPT-OSS checkpoint whose experts are stored as OpenAI publishes them (MXFP4
/// `*_blocks` and `*_scales`, `quantization_config` in config.json; make_checkpoint.py --mxfp4)
/// agrees with transformers' float64 forward over the experts transformers itself dequantizes;
/// so does its GGUF, in which llama.cpp's converter repacks the blocks as GGUF MXFP4. Greedy
/// identical on `ref`, `cpu` and `gpu-emu`; layer-diff passes on `cpu`.
#[test]
fn gpt_oss_mxfp4_checkpoints_agree_with_transformers_in_f64() {
    if !transformers_installed() {
        return;
    }
    let ids = "5,17,99,3,250,42,7,8,9,10,11,12,13,14,15,16";
    let (dir, greedy) = checkpoint_agrees_with_transformers("gpt-oss", ids, &["--mxfp4"], Some("gpt-4o"));
    devices_follow(dir.path().join("ck").to_str().unwrap(), ids, &greedy, &["ref", "cpu", "gpu-emu"], &["cpu"], dir.path());
    let gguf = dir.path().join("model.gguf");
    devices_follow(gguf.to_str().unwrap(), ids, &greedy, &["ref"], &[], &dir.path().join("gguf"));
}

/// A random Gemma 2 checkpoint written by transformers (`Gemma2ForCausalLM`: soft-capping of
/// the attention scores and of the logits, set low so that tanh bends them; every other layer
/// windowed) agrees with transformers' float64 forward; greedy identical on `ref`, `cpu` and
/// `gpu-emu`; layer-diff passes on `cpu` and `gpu-emu`.
#[test]
fn gemma2_checkpoints_agree_with_transformers_in_f64() {
    if !transformers_installed() {
        return;
    }
    let ids = "5,17,99,3,250,42,7,8,9,10,11,12,13,14";
    let (dir, greedy) = checkpoint_agrees_with_transformers("gemma2", ids, &[], None);
    devices_follow(dir.path().join("ck").to_str().unwrap(), ids, &greedy, &["ref", "cpu", "gpu-emu"], &["cpu", "gpu-emu"], dir.path());
}

/// A random Gemma 3 checkpoint written by transformers (`Gemma3ForCausalLM`, norms stored less
/// one, `layer_types` and per-type RoPE parameters in its config) agrees with transformers'
/// float64 forward, and so does its GGUF written by llama.cpp's converter (norms stored with the
/// one folded in, a SentencePiece vocabulary); greedy 32 tokens identical on `ref`, `cpu` and
/// `fixed` (the GGUF: `ref`, `cpu`); and layer-diff passes on `cpu`, `fixed` and `gpu-emu` (the
/// GGUF: `cpu`, `fixed`). The prompt is longer than the window of 4, so the windowed layers and
/// the global one see different keys.
#[test]
fn gemma3_checkpoints_agree_with_transformers_in_f64() {
    if !transformers_installed() {
        return;
    }
    let ids = "5,17,99,3,250,42,7,8,9,10,11,12";
    let (dir, greedy) = checkpoint_agrees_with_transformers("gemma3", ids, &[], Some(""));
    devices_follow(dir.path().join("ck").to_str().unwrap(), ids, &greedy, &["ref", "cpu", "fixed"], &["cpu", "fixed", "gpu-emu"], dir.path());
    let gguf = dir.path().join("model.gguf");
    devices_follow(gguf.to_str().unwrap(), ids, &greedy, &["ref", "cpu"], &["cpu", "fixed"], &dir.path().join("gguf"));
}

/// A random Mamba-2 checkpoint written by transformers (`Mamba2ForCausalLM`: three state-space
/// layers, heads in two groups, transformers running the prompt through its chunked scan in
/// chunks of 8) agrees with transformers' float64 forward, layer by layer, as read by the oracle
/// (its recurrent scan) from the checkpoint and from the GGUF llama.cpp's converter writes;
/// greedy 32 tokens identical on `ref`, `cpu`, `fixed` and `gpu-emu` from both, each decode step
/// carrying the state forward (transformers recomputes the whole sequence each step); layer-diff
/// and fixed-token pass on `cpu`, `fixed` and `gpu-emu` (the GGUF: `fixed-int4` too), the serving
/// rung on `gpu-emu`; the GPU kernels with the convolution's window shifted or the decay's sign
/// flipped are red at `ssm_conv` and `ssm_state`, the latter reduced to a one-position `ssm_scan`
/// case. The example
/// engine (examples/external_engine, numpy) passes layer-diff on the GGUF, and each of its seeded
/// bugs is red at its tap.
#[test]
fn mamba2_checkpoints_agree_with_transformers_in_f64() {
    if !transformers_installed() {
        return;
    }
    let ids = "5,17,99,3,250,42,7,8,9,10,11,12,13,14,15,16,17,18,19,20";
    let (dir, greedy) = checkpoint_agrees_with_transformers("mamba2", ids, &[], Some(""));
    devices_follow(dir.path().join("ck").to_str().unwrap(), ids, &greedy, &["ref", "cpu", "fixed", "gpu-emu"], &["cpu", "fixed", "gpu-emu"], dir.path());
    let gguf = dir.path().join("model.gguf");
    devices_follow(gguf.to_str().unwrap(), ids, &greedy, &["ref", "cpu", "fixed", "gpu-emu"], &["cpu", "gpu-emu"], &dir.path().join("gguf"));
    cache_rungs_pass(&gguf, ids, dir.path());
    fixed_rungs_pass(&gguf, ids, dir.path());
    gpu_kernel_bugs(&gguf, ids, dir.path(), &[("- (k - 1) + j;", "- k + j;", "ssm_conv"), ("float decay = expf(step * a[h]);", "float decay = expf(-step * a[h]);", "ssm_state")]);
    gpu_bug_reduces(&gguf, ids, dir.path(), ("float decay = expf(step * a[h]);", "float decay = expf(-step * a[h]);"), "ssm_scan");
    // The example engine (numpy, its own Mamba-2) passes layer-diff on the GGUF; each bug it can
    // seed is named at its tap, with the position its error first crossed the bound.
    example_engine_bugs(&gguf, ids, dir.path(), &[("", None, None), ("ssm_state_bf16", Some("ssm_state"), Some(0)), ("ssm_conv_shifted", Some("ssm_conv"), Some(0)), ("ssm_decay_sign", Some("ssm_state"), Some(1))]);
    llama_cpp_passes(&gguf, ids, dir.path());
}

/// A random Granite 4.0-H-structured checkpoint written by transformers
/// (`GraniteMoeHybridForCausalLM`, dense: Mamba-2 and attention layers alternating, attention
/// without RoPE, each layer's FFN after it, embeddings, attention scores, residual branches and
/// logits scaled apart from 1) agrees with transformers' float64 forward, as read by the oracle
/// from the checkpoint and from the GGUF llama.cpp's converter writes (`granitehybrid`,
/// `head_count_kv` 0 on the state-space layers); greedy 32 tokens identical on `ref`, `cpu`,
/// `fixed` and `gpu-emu`; layer-diff and fixed-token pass on `cpu`, `fixed` and `gpu-emu` (the
/// GGUF: `fixed-int4` too), serving on `gpu-emu`. The example engine (numpy, its own hybrid)
/// passes layer-diff on the GGUF;
/// its residual branches added unscaled are red at `blk.0.ffn_inp`, its state in bf16 at
/// `blk.0.ssm_state`.
#[test]
fn granite_hybrid_checkpoints_agree_with_transformers_in_f64() {
    if !transformers_installed() {
        return;
    }
    let ids = "5,17,99,3,250,42,7,8,9,10,11,12,13,14,15,16,17,18,19,20";
    let (dir, greedy) = checkpoint_agrees_with_transformers("granite-hybrid", ids, &[], Some(""));
    devices_follow(dir.path().join("ck").to_str().unwrap(), ids, &greedy, &["ref", "cpu", "fixed", "gpu-emu"], &["cpu", "fixed", "gpu-emu"], dir.path());
    let gguf = dir.path().join("model.gguf");
    devices_follow(gguf.to_str().unwrap(), ids, &greedy, &["ref", "cpu", "fixed", "gpu-emu"], &["cpu", "gpu-emu"], &dir.path().join("gguf"));
    cache_rungs_pass(&gguf, ids, dir.path());
    fixed_rungs_pass(&gguf, ids, dir.path());
    example_engine_bugs(&gguf, ids, dir.path(), &[("", None, None), ("residual_scale_dropped", Some("ffn_inp"), Some(0)), ("ssm_state_bf16", Some("ssm_state"), Some(0))]);
    llama_cpp_passes(&gguf, ids, dir.path());
}

/// A 70-token prompt over the test checkpoints' 300-token vocabulary: past a 64-position chunk.
fn prompt_of_70() -> String {
    (0..70).map(|i| ((i * 37 + 11) % 300).to_string()).collect::<Vec<_>>().join(",")
}

/// llama.cpp's CPU backend (tools/peers/llama_cpp_dump.py, PyPI's llama-cpp-python) on `gguf`:
/// layer-diff passes on the taps its graph names, every layer output among them. A development
/// peer: skipped, saying so, where llama-cpp-python is not installed.
fn llama_cpp_passes(gguf: &Path, ids: &str, dir: &Path) {
    let probe = Command::new("python3").args(["-c", "import llama_cpp, gguf, numpy"]).output();
    if !matches!(probe, Ok(ref o) if o.status.success()) {
        eprintln!("SKIPPED: llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp, ~12 min)");
        return;
    }
    let report = dir.join("llama-cpp");
    let o = xtask(&["layer-diff", "--device", "exec:python3 tools/peers/llama_cpp_dump.py", "--model", gguf.to_str().unwrap(), "--prompt-ids", ids, "--report-dir", report.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "llama.cpp: {}", text(&o));
    eprintln!("llama.cpp on {}: {}", gguf.display(), text(&o).lines().filter(|l| l.starts_with("first divergence") || l.contains("cases (")).collect::<Vec<_>>().join("; "));
}

/// Fixed-token (cache consistency included) on `cpu` and `gpu-emu`, and the serving rung on
/// `gpu-emu` (prefixes reused: recurrent states restored from a kept history, latents copied),
/// pass on `gguf`.
fn cache_rungs_pass(gguf: &Path, ids: &str, dir: &Path) {
    for device in ["cpu", "gpu-emu"] {
        let o = xtask(&["fixed-token", "--device", device, "--model", gguf.to_str().unwrap(), "--prompt-ids", ids, "--report-dir", dir.join(format!("ft-{device}")).to_str().unwrap()], &[]);
        assert_eq!(o.status.code(), Some(0), "{device}: {}", text(&o));
    }
    let o = xtask(&["serving", "--device", "gpu-emu", "--model", gguf.to_str().unwrap(), "--prompt-ids", ids, "--prompt-len", &(ids.split(',').count() / 2).clamp(1, 10).to_string(), "--report-dir", dir.join("serving").to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "gpu-emu serving: {}", text(&o));
}

/// Layer-diff and fixed-token pass on `fixed` and `fixed-int4` (each held to its own declared
/// arithmetic's emulation).
fn fixed_rungs_pass(gguf: &Path, ids: &str, dir: &Path) {
    for device in ["fixed", "fixed-int4"] {
        for gate in ["layer-diff", "fixed-token"] {
            let o = xtask(&[gate, "--device", device, "--model", gguf.to_str().unwrap(), "--prompt-ids", ids, "--report-dir", dir.join(format!("{gate}-{device}")).to_str().unwrap()], &[]);
            assert_eq!(o.status.code(), Some(0), "{gate} on {device}: {}", text(&o));
        }
    }
}

/// `reduce` on `gpu-emu` with its kernel source changed (`good` replaced by `bad`): a one-op case
/// of `op` over one position (its state the tap's at the position before), which fails again
/// from its file and passes on `cpu`.
fn gpu_bug_reduces(gguf: &Path, ids: &str, dir: &Path, (good, bad): (&str, &str), op: &str) {
    let file = broken_kernel_source(good, bad);
    let env = [("TOUCHSTONE_KERNEL_SOURCE", file.path().to_str().unwrap())];
    let red = dir.join(format!("reduce-{op}"));
    let o = xtask(&["reduce", "--device", "gpu-emu", "--model", gguf.to_str().unwrap(), "--prompt-ids", ids, "--report-dir", red.to_str().unwrap()], &env);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(red.join("report.json")).unwrap()).unwrap();
    let case = r["reduce"]["case"].as_str().unwrap_or_default();
    assert!(case.starts_with(&format!("{op}(from=blk.0.ssm_state,")) && case.contains("rows=1x") && r["reduce"]["rerun"] == "fail", "{}", r["reduce"]);
    let o = xtask(&["kernels", "--device", "cpu", "--cases", red.join("case").to_str().unwrap(), "--report-dir", red.join("cpu").to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
}

/// Layer-diff on `gpu-emu` with its kernel source changed (each case's `good` text replaced by
/// `bad`, `TOUCHSTONE_KERNEL_SOURCE`) is red, first at the case's tap kind.
fn gpu_kernel_bugs(gguf: &Path, ids: &str, dir: &Path, cases: &[(&str, &str, &str)]) {
    for (i, &(good, bad, tap)) in cases.iter().enumerate() {
        let file = broken_kernel_source(good, bad);
        let report = dir.join(format!("gpu-bug-{i}"));
        let o = xtask(&["layer-diff", "--device", "gpu-emu", "--model", gguf.to_str().unwrap(), "--prompt-ids", ids, "--report-dir", report.to_str().unwrap()], &[("TOUCHSTONE_KERNEL_SOURCE", file.path().to_str().unwrap())]);
        assert_eq!(o.status.code(), Some(1), "gpu-emu with `{bad}`: {}", text(&o));
        let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(report.join("report.json")).unwrap()).unwrap();
        assert_eq!(r["first_divergence"]["kind"].as_str(), Some(tap), "gpu-emu with `{bad}`: {}", r["first_divergence"]);
    }
}

/// The example engine (examples/external_engine, numpy) on `gguf`: layer-diff passes without a
/// seeded bug; each of `cases`' bugs (`TOUCHSTONE_EXAMPLE_BUG`) is first red at its tap kind,
/// from the given position where one is given.
fn example_engine_bugs(gguf: &Path, ids: &str, dir: &Path, cases: &[(&str, Option<&str>, Option<u64>)]) {
    const ENGINE: &str = "exec:python3 examples/external_engine/engine.py";
    for &(bug, tap, at) in cases {
        let report = dir.join(format!("example-{bug}"));
        let o = xtask(&["layer-diff", "--device", ENGINE, "--model", gguf.to_str().unwrap(), "--prompt-ids", ids, "--report-dir", report.to_str().unwrap()], &[("TOUCHSTONE_EXAMPLE_BUG", bug)]);
        assert_eq!(o.status.code(), Some(if tap.is_some() { 1 } else { 0 }), "example engine {bug}: {}", text(&o));
        let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(report.join("report.json")).unwrap()).unwrap();
        let first = &r["first_divergence"];
        assert_eq!(first["kind"].as_str(), tap, "example engine {bug}: {first}");
        if at.is_some() {
            assert_eq!(first["first_over_position"].as_u64(), at, "example engine {bug}: {first}");
        }
    }
}

/// A random Qwen3-Next-structured checkpoint written by transformers (`Qwen3NextForCausalLM`:
/// gated DeltaNet and gated attention layers alternating, two key heads serving four value
/// heads, a quarter of each attention head rotated, (1 + w) norms, MoE with a gated shared
/// expert) agrees with transformers' float64 forward over a prompt of 70 positions (transformers
/// runs it through its chunked delta rule, chunks of 64: one boundary crossed; the oracle
/// through the recurrent form), as read by the oracle from the checkpoint and from the GGUF
/// llama.cpp's converter writes (`qwen3next`: q/k/v and z split, `attention.recurrent_layers`);
/// greedy 32 tokens identical on `ref`, `cpu`, `fixed` and `gpu-emu`, each decode step carrying
/// the state forward; layer-diff and fixed-token pass on `cpu`, `fixed` and `gpu-emu` (the GGUF:
/// `fixed-int4` too), serving on `gpu-emu`; the GPU kernels with the convolution's window shifted
/// or the sign of b's sigmoid flipped are red at `ssm_conv` and `ssm_state`, the latter reduced
/// to a one-position `delta_rule` case. The example engine passes layer-diff on the GGUF and names each of its seeded
/// bugs at its tap.
#[test]
fn qwen3_next_checkpoints_agree_with_transformers_in_f64() {
    if !transformers_installed() {
        return;
    }
    let ids = prompt_of_70();
    let (dir, greedy) = checkpoint_agrees_with_transformers("qwen3-next", &ids, &[], Some("qwen2"));
    devices_follow(dir.path().join("ck").to_str().unwrap(), &ids, &greedy, &["ref", "cpu", "fixed", "gpu-emu"], &["cpu", "fixed", "gpu-emu"], dir.path());
    let gguf = dir.path().join("model.gguf");
    devices_follow(gguf.to_str().unwrap(), &ids, &greedy, &["ref", "cpu", "fixed", "gpu-emu"], &["cpu", "gpu-emu"], &dir.path().join("gguf"));
    cache_rungs_pass(&gguf, &ids, dir.path());
    fixed_rungs_pass(&gguf, &ids, dir.path());
    let short = "5,17,99,3,250,42,7,8,9,10";
    gpu_kernel_bugs(&gguf, short, dir.path(), &[("- (k - 1) + j;", "- k + j;", "ssm_conv"), ("1.0f / (1.0f + expf(-bar[j]))", "1.0f / (1.0f + expf(bar[j]))", "ssm_state")]);
    gpu_bug_reduces(&gguf, short, dir.path(), ("1.0f / (1.0f + expf(-bar[j]))", "1.0f / (1.0f + expf(bar[j]))"), "delta_rule");
    // The example engine (numpy, its own DeltaNet and gated attention) passes over the whole
    // prompt; each bug it can seed is named at its tap, over 10 positions (the decay's sign
    // flipped makes the state grow past f32's range within 20).
    example_engine_bugs(&gguf, &ids, dir.path(), &[("", None, None)]);
    example_engine_bugs(&gguf, short, dir.path(), &[("ssm_state_bf16", Some("ssm_state"), Some(0)), ("ssm_conv_shifted", Some("ssm_conv"), Some(0)), ("attn_gate_dropped", Some("attn_out"), Some(0)), ("rope_whole_head", Some("attn_q_rope"), Some(1)), ("ssm_decay_sign", Some("ssm_state"), Some(1))]);
    llama_cpp_passes(&gguf, &ids, dir.path());
}

/// A random DeepSeek-V3-structured checkpoint written by transformers (`DeepseekV3ForCausalLM`:
/// latent attention with a compressed query, a key/value latent of 24 and one shared rotated
/// key, values narrower than keys, RoPE in adjacent pairs under YaRN with DeepSeek's score
/// scale; a dense first layer, then eight experts in four groups routed by biased sigmoid scores
/// from the best two groups, scaled, beside a shared expert) agrees with transformers' float64
/// forward over 70 positions, as read
/// by the oracle from the checkpoint and from the GGUF llama.cpp's converter writes
/// (`deepseek2`: the expansion split per head into `attn_k_b`/`attn_v_b`); greedy 32 tokens
/// identical on `ref`, `cpu`, `fixed` and `gpu-emu` (all run the absorbed form, caching
/// latents), layer-diff and fixed-token (cache consistency included) pass on them and on
/// `fixed-int4` (the GGUF), serving on `gpu-emu`;
/// the GPU kernels with the absorbed scale of the cached row, the rotated keys dotted with the
/// unrotated query slice, or the group limit dropped are red at `attn_kqv`, `attn_kqv` and
/// `ffn_moe_topk`. A dense checkpoint without the query's compression agrees too, and runs green
/// on `fixed` and `gpu-emu`. The example engine
/// (examples/external_engine, numpy, absorbed) passes layer-diff on the GGUF, and each of its
/// seeded bugs is red at its tap (the first two from position 1: one key cannot show a scale,
/// position 0 rotates by nothing).
#[test]
fn deepseek_v3_checkpoints_agree_with_transformers_in_f64() {
    if !transformers_installed() {
        return;
    }
    let ids = prompt_of_70();
    let (dir, greedy) = checkpoint_agrees_with_transformers("deepseek-v3", &ids, &[], Some("deepseek-v3"));
    for (model, reports) in [(dir.path().join("ck"), dir.path().join("ck-reports")), (dir.path().join("model.gguf"), dir.path().join("gguf-reports"))] {
        devices_follow(model.to_str().unwrap(), &ids, &greedy, &["ref", "cpu", "fixed", "gpu-emu"], &["cpu", "fixed", "gpu-emu"], &reports);
    }
    let gguf = dir.path().join("model.gguf");
    cache_rungs_pass(&gguf, &ids, dir.path());
    fixed_rungs_pass(&gguf, &ids, dir.path());
    gpu_kernel_bugs(
        &gguf,
        &ids,
        dir.path(),
        &[
            ("s = (s + sp) * scale;", "s = (s + sp) * scale * sqrtf((float)(nope + rr) / (float)(r + rr));", "attn_kqv"),
            ("sp += qh[nope + c] * pj[c];", "sp += qh[c] * pj[c];", "attn_kqv"),
            ("    if (n_group > 0) {", "    if (n_group < 0) {", "ffn_moe_topk"),
        ],
    );
    example_engine_bugs(&gguf, &ids, dir.path(), &[("", None, None), ("mla_absorbed_scale", Some("attn_kqv"), Some(1)), ("mla_rope_slice_swapped", Some("attn_q_rope"), Some(1)), ("expert_groups_ignored", Some("ffn_moe_topk"), None)]);
    llama_cpp_passes(&gguf, &ids, dir.path());
    let (dense, greedy) = checkpoint_agrees_with_transformers("deepseek-v3", &ids, &["--no-q-lora", "--dense", "--seed", "3"], None);
    devices_follow(dense.path().join("ck").to_str().unwrap(), &ids, &greedy, &["ref", "cpu", "fixed", "gpu-emu"], &["fixed", "gpu-emu"], dense.path());
}
