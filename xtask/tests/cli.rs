//! End-to-end tests of the command line on the synthetic models and SmolLM2: the main job,
//! dump determinism, the report tools, and the exit-code contract.

mod common;

use common::*;
use std::path::Path;
use std::process::Command;

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
    let o = xtask(&["layer-diff", "--model", "models/missing.gguf", "--device", "cpu"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("models/missing.gguf: no such file or directory"), "{}", stderr(&o));
    // The binary knows its version and the revision it was built from.
    let o = xtask(&["--version"], &[]);
    let v = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(v.starts_with(&format!("cargo xtask {} (revision ", env!("CARGO_PKG_VERSION"))) && !v.contains("revision unknown"), "{v}");
    let o = xtask(&["gate", "--device", "cpuu", "--model", "tiny-llama", "--suite", "layers"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("unknown device `cpuu`: did you mean `cpu`?"), "{}", stderr(&o));

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
    assert!(stderr(&o).contains("no suite `benchmark` (suites: oracle, kernels, layers, tokens, serving, bench)"), "{}", stderr(&o));
    let o = xtask(&["layer-diff", "--device", "cpu", "--model", "tiny-llama", "--mode", "sideways"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("invalid value 'sideways' for '--mode <MODE>'") && stderr(&o).contains("[possible values: isolated, propagated]"), "{}", stderr(&o));
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
    // Each case's latency chart, drawn in its own process, is kept; a debug build says so.
    for (device, model) in [("cpu", "tiny-llama"), ("fixed", "tiny-moe")] {
        assert!(dir.path().join(format!("bench-{device}-{model}-itl_distribution.png")).exists(), "{device} {model}");
    }
    assert!(std::fs::read_to_string(dir.path().join("report.md")).unwrap().contains("Warning: measured with a debug build"));
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
    // report.md fits a CI job summary (1 MiB), summary first, unsupported counted not listed;
    // every chart the layers and tokens rungs draw is written, per device and model.
    let md = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    assert!(md.len() < reports::MARKDOWN_LIMIT, "report.md is {} bytes", md.len());
    assert!(md.starts_with("# Touchstone `gate` report\n\n## Layers: first divergence by device and model"), "{}", &md[..2000.min(md.len())]);
    assert!(md.contains("**PASS** (exit 0)") && md.contains("| ops | fixed |"), "{}", &md[..4000.min(md.len())]);
    assert!(!md.lines().any(|l| l.contains("| Unsupported |")), "unsupported cases are counted, not listed");
    for device in ["cpu", "fixed"] {
        for model in ::fixtures::SYNTHETIC {
            for chart in ["layers-{d}-{m}-budget_use_by_layer", "layers-{d}-{m}-error_by_layer_propagated", "layers-{d}-{m}-error_by_layer_isolated", "tokens-{d}-{m}-kld_by_position"] {
                let png = dir.path().join(chart.replace("{d}", device).replace("{m}", model) + ".png");
                assert!(png.exists(), "{}", png.display());
            }
        }
    }
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
