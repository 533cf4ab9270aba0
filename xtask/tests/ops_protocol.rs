//! The op protocol (docs/OP_PROTOCOL.md): the kernel suite run on an `exec:` engine. The numpy
//! template (examples/ops_numpy) passes every case it supports with the same case ids as `cpu`;
//! its seeded bugs and outputs perturbed after it ran go red on exactly the affected cases; a
//! hostile or broken engine (crash, hang, missing or misshapen outputs, NaN, malformed or
//! lying results.json, a link out of its directory, a flood of output) fails its own cases with
//! a message naming the case and the file, and the report is still written. ggml's own CPU
//! kernels (examples/ops_ggml, libraries built by tools/peers/build_ggml.py) are judged op by op.

mod common;

use common::*;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

const NUMPY: &str = "exec:python3 examples/ops_numpy/engine.py";

fn kernels(device: &str, extra: &[&str], report: &Path, env: &[(&str, &str)]) -> (std::process::Output, serde_json::Value) {
    let mut args = vec!["kernels", "--device", device, "--report-dir", report.to_str().unwrap()];
    args.extend_from_slice(extra);
    let o = xtask(&args, env);
    let r = std::fs::read_to_string(report.join("report.json")).map(|t| serde_json::from_str(&t).unwrap()).unwrap_or(serde_json::Value::Null);
    (o, r)
}

/// Failed cases per op (matmuls per weight type), and all cases per op.
fn failed_by_op(r: &serde_json::Value) -> (BTreeMap<String, usize>, BTreeMap<String, usize>) {
    let (mut failed, mut all) = (BTreeMap::new(), BTreeMap::new());
    for c in r["cases"].as_array().unwrap() {
        let id = c["id"].as_str().unwrap();
        let mut op = id.split('(').next().unwrap().to_string();
        if let Some(w) = id.strip_prefix("matmul(w=") {
            op = format!("matmul/{}", w.split(',').next().unwrap());
        }
        *all.entry(op.clone()).or_default() += 1;
        if c["verdict"] == "fail" {
            *failed.entry(op).or_default() += 1;
        }
    }
    (failed, all)
}

#[test]
fn the_numpy_engine_passes_every_case_it_runs_and_its_seeded_bugs_go_red() {
    if !python_with_reference_peers() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (o, r) = kernels(NUMPY, &[], &tmp.path().join("ok"), &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let s = &r["summary"];
    assert!(s["executed"].as_u64().unwrap() >= 2000 && s["failed"] == 0 && s["errors"] == 0, "{s}");
    assert!(s["passed"].as_u64().unwrap() >= 2000, "{s}");
    // The same case ids as the built-in devices run.
    let listed = xtask(&["kernels", "--device", "cpu", "--list"], &[]);
    let cpu_ids: BTreeSet<String> = String::from_utf8_lossy(&listed.stdout).lines().filter(|l| l.contains('(')).map(|l| l.split_whitespace().next().unwrap().to_string()).collect();
    let ids: BTreeSet<String> = r["cases"].as_array().unwrap().iter().map(|c| c["id"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids, cpu_ids);
    // Every executed case has its bound, its measured error and its margin; the rest say why not.
    for c in r["cases"].as_array().unwrap() {
        if c["verdict"] == "pass" {
            assert!(c["tolerance"]["bound"].is_number() && c["metrics"]["max_abs"].is_number() && c["margin"].as_f64().unwrap() >= 0.0, "{c}");
        } else {
            assert_eq!(c["verdict"], "unsupported", "{c}");
            assert!(c["message"].as_str().is_some_and(|m| !m.is_empty()), "{c}");
        }
    }
    // Each seeded bug fails exactly the cases it touches.
    for (bug, touched) in [("rms_eps_x10", &["rms_norm", "qk_norm"][..]), ("rope_pairs_swapped", &["rope"]), ("q4_0_nibbles_swapped", &["matmul/q4_0"])] {
        let (o, r) = kernels(NUMPY, &["--filter", "^(rms_norm|qk_norm|rope|add|matmul\\(w=q4_[01],k=(32|64))"], &tmp.path().join(bug), &[("TOUCHSTONE_EXAMPLE_BUG", bug)]);
        assert_eq!(o.status.code(), Some(1), "{bug}: {}", text(&o));
        let (failed, all) = failed_by_op(&r);
        assert!(failed.keys().all(|k| touched.contains(&k.as_str())), "{bug}: {failed:?}");
        for t in touched {
            assert!(failed.get(*t).copied().unwrap_or(0) * 2 > all[*t], "{bug}: most {t} cases fail: {failed:?} of {all:?}");
        }
    }
}

/// A wrapper that runs the numpy engine, then scales every float output by (1 + 1e-3 noise).
#[test]
fn outputs_perturbed_after_the_engine_ran_fail() {
    if !python_with_reference_peers() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let perturb = tmp.path().join("perturb.py");
    std::fs::write(
        &perturb,
        r#"
import json, os, struct, numpy as np
p = os.path.join(os.environ["TOUCHSTONE_OUT"], "outputs.safetensors")
if os.environ.get("TOUCHSTONE_TASK") == "ops" and os.path.exists(p):
    d = bytearray(open(p, "rb").read()); n = struct.unpack("<Q", d[:8])[0]; h = json.loads(d[8:8 + n])
    rng = np.random.default_rng(7)
    for name, t in h.items():
        if t["dtype"] == "F32":
            a, b = t["data_offsets"]; v = np.frombuffer(bytes(d[8 + n + a:8 + n + b]), "<f4")
            d[8 + n + a:8 + n + b] = (v * (1 + 1e-3 * rng.standard_normal(v.size))).astype("<f4").tobytes()
    open(p, "wb").write(bytes(d))
"#,
    )
    .unwrap();
    let device = format!("exec:python3 examples/ops_numpy/engine.py && python3 {}", perturb.display());
    let (o, r) = kernels(&device, &["--filter", "^(rms_norm|softmax|matmul\\(w=q8_0)"], &tmp.path().join("r"), &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let (failed, all) = failed_by_op(&r);
    for op in ["rms_norm", "softmax", "matmul/q8_0"] {
        assert!(failed.get(op).copied().unwrap_or(0) * 2 > all[op], "{failed:?} of {all:?}");
    }
}

/// A hostile engine: the numpy template, then one thing done wrong to the batch that holds a
/// chosen case (MODE). Each failure names the case and the file; the other batches pass.
const HOSTILE: &str = r#"
import json, os, struct, sys, time, subprocess
mode, out = os.environ.get("MODE"), os.environ["TOUCHSTONE_OUT"]
task = os.environ.get("TOUCHSTONE_TASK")
here = os.environ["ENGINE"]
if task != "ops":
    sys.exit(subprocess.call([sys.executable, here]))
cases = json.load(open(os.path.join(os.environ["TOUCHSTONE_BATCH"], "cases.json")))["cases"]
target = any(c["id"].endswith("seed=3)") and "shape=[3,7]" in c["id"] for c in cases)
if target and mode == "crash":
    sys.exit("segfault, say")
if target and mode == "hang":
    time.sleep(600)
if target and mode == "flood":
    with open(os.path.join(out, "junk"), "wb") as f:
        for _ in range(64):
            f.write(b"x" * (1 << 20))
    time.sleep(600)
rc = subprocess.call([sys.executable, here])
if not target or rc != 0:
    sys.exit(rc)
res = os.path.join(out, "results.json"); outs = os.path.join(out, "outputs.safetensors")
r = json.load(open(res))
victim = [c for c in cases if c["id"].endswith("seed=3)") and "shape=[3,7]" in c["id"]][0]
if mode == "malformed":
    open(res, "w").write("{\"results\": [")
elif mode == "unknown":
    r["results"]["add(dtype=f32,shape=[3,9999],seed=1)"] = {"status": "done"}; json.dump(r, open(res, "w"))
elif mode == "symlink":
    os.remove(outs); os.symlink("/etc/passwd", outs)
elif mode in ("missing", "shape", "dtype", "nan"):
    d = bytearray(open(outs, "rb").read()); n = struct.unpack("<Q", d[:8])[0]; h = json.loads(d[8:8 + n])
    name = victim["outputs"][0]["tensor"]
    if mode == "missing":
        h[name + ".gone"] = h.pop(name)
    elif mode == "shape":
        h[name]["shape"] = [21]
    elif mode == "dtype":
        h[name]["dtype"] = "I32"
    else:
        a = h[name]["data_offsets"][0]; d[8 + n + a:8 + n + a + 4] = struct.pack("<f", float("nan"))
    head = json.dumps(h).encode(); head += b" " * (-len(head) % 8)
    open(outs, "wb").write(struct.pack("<Q", len(head)) + head + bytes(d[8 + n:]))
"#;

#[test]
fn a_broken_or_hostile_engine_fails_its_own_cases_with_the_reason() {
    if !python_with_reference_peers() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let script = tmp.path().join("hostile.py");
    std::fs::write(&script, HOSTILE).unwrap();
    let engine = workspace().join("examples/ops_numpy/engine.py");
    let device = format!("exec:python3 {}", script.display());
    for (mode, says) in [
        ("crash", "exited with exit status: 1"),
        ("hang", "did not finish within 5 s"),
        ("flood", "wrote more than"),
        ("malformed", "results.json: "),
        ("unknown", "names case `add(dtype=f32,shape=[3,9999],seed=1)`, which is not in this batch"),
        ("symlink", "outputs.safetensors: not a regular file"),
        ("missing", "outputs.safetensors: no tensor"),
        ("shape", "outputs.safetensors: "),
        ("dtype", "outputs.safetensors: "),
        ("nan", "non-finite"),
    ] {
        let env = [("MODE", mode), ("ENGINE", engine.to_str().unwrap()), ("TOUCHSTONE_OPS_BATCH", "4"), ("TOUCHSTONE_EXEC_TIMEOUT", "5")];
        let report = tmp.path().join(mode);
        let (o, r) = kernels(&device, &["--filter", "^add\\(dtype=f32,shape=\\[3,(5|7)\\]"], &report, &env);
        assert_eq!(o.status.code(), Some(1), "{mode}: {}", text(&o));
        let cases = r["cases"].as_array().unwrap_or_else(|| panic!("{mode}: no report: {}", text(&o)));
        let failed: Vec<&serde_json::Value> = cases.iter().filter(|c| c["verdict"] == "fail").collect();
        assert!(!failed.is_empty() && failed.len() <= 4, "{mode}: the failing batch's cases alone: {}", failed.len());
        assert!(failed.iter().any(|c| c["id"] == "add(dtype=f32,shape=[3,7],seed=3)"), "{mode}");
        assert!(failed.iter().all(|c| c["message"].as_str().unwrap().contains(says)), "{mode}: {failed:?}");
        assert_eq!(r["summary"]["passed"].as_u64().unwrap() as usize + failed.len(), cases.len(), "{mode}: the other batches pass");
    }
}

/// An engine that speaks only the dump protocol (or nothing) runs no op: every case is
/// unsupported, with the reason, and zero executed cases are not a pass.
#[test]
fn an_engine_without_the_op_protocol_is_unsupported_never_green() {
    let tmp = tempfile::tempdir().unwrap();
    let (o, r) = kernels("exec:true", &["--filter", "^add\\("], &tmp.path().join("r"), &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert_eq!(r["summary"]["unsupported"], r["cases"].as_array().unwrap().len());
    assert!(r["cases"][0]["message"].as_str().unwrap().contains("wrote no capabilities.json: it does not speak the op protocol"), "{}", r["cases"][0]);
    // A declaration outside the bounds' domain is refused, naming the field.
    let caps = r#"{"protocol":"touchstone-ops","version":1,"ops":["add"],"arithmetic":{"storage":"f32","accumulate":"f32","activation_q8_block":null,"transcendental_ulps":1e300,"fixed":null}}"#;
    let cmd = format!("exec:[ \"$TOUCHSTONE_TASK\" = capabilities ] && echo '{caps}' > \"$TOUCHSTONE_OUT/capabilities.json\"");
    let (o, r) = kernels(&cmd, &["--filter", "^add\\("], &tmp.path().join("r2"), &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(r["cases"][0]["message"].as_str().unwrap().contains("capabilities.json: arithmetic: transcendental_ulps"), "{}", r["cases"][0]);
}

/// ggml's CPU kernels through the op protocol (skipped, saying so, without the libraries that
/// tools/peers/build_ggml.py builds, unless TOUCHSTONE_REQUIRE_GGML=1). What passes and what ggml
/// does that its declaration cannot say are both pinned here (docs/ACCURACY.md, "ggml's CPU
/// kernels"); its seeded bug and a GELU declared as f32 go red.
#[test]
fn ggml_cpu_kernels_are_judged_op_by_op() {
    let lib = workspace().join(".cache/touchstone/ggml/lib/libggml-cpu.so");
    if !lib.exists() || !python_with_reference_peers() {
        assert!(std::env::var("TOUCHSTONE_REQUIRE_GGML").is_err(), "TOUCHSTONE_REQUIRE_GGML is set but {} is missing (python3 tools/peers/build_ggml.py)", lib.display());
        eprintln!("SKIPPED: ggml's libraries are not built (python3 tools/peers/build_ggml.py)");
        return;
    }
    const GGML: &str = "exec:python3 examples/ops_ggml/engine.py";
    let tmp = tempfile::tempdir().unwrap();
    let (o, r) = kernels(GGML, &[], &tmp.path().join("all"), &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(r["summary"]["executed"].as_u64().unwrap() >= 2000, "{}", r["summary"]);
    let (failed, all) = failed_by_op(&r);
    for op in ["matmul/f32", "matmul/f16", "matmul/bf16", "matmul/q4_0", "matmul/q8_0", "matmul/q4_k", "matmul/q5_k", "matmul/q6_k", "rms_norm", "layer_norm", "rope", "softmax", "swiglu", "gelu_tanh", "attention", "moe_route"] {
        assert!(all.get(op).copied().unwrap_or(0) > 0 && !failed.contains_key(op), "{op}: {failed:?}");
    }
    // Q8_1's block sums, held in f16, in products with Q4_1/Q5_1 matrices; the last index on ties.
    for op in ["matmul/q4_1", "matmul/q5_1", "argmax"] {
        assert!(failed.get(op).copied().unwrap_or(0) * 2 > all[op], "{op}: {failed:?} of {all:?}");
    }
    for (bug, touched) in [("rms_eps_x10", "rms_norm"), ("gelu_declared_f32", "gelu_tanh")] {
        let (o, r) = kernels(GGML, &["--filter", "^(rms_norm|gelu_tanh|add)\\("], &tmp.path().join(bug), &[("TOUCHSTONE_EXAMPLE_BUG", bug)]);
        assert_eq!(o.status.code(), Some(1), "{bug}: {}", text(&o));
        let (failed, all) = failed_by_op(&r);
        assert!(failed.keys().all(|k| k == touched) && failed[touched] * 2 > all[touched], "{bug}: {failed:?} of {all:?}");
    }
}

/// PyTorch's CPU kernels through the op protocol (examples/ops_torch; skipped, saying so,
/// without torch, unless TOUCHSTONE_REQUIRE_TORCH=1): every case it runs passes in f32 and as a
/// bf16 engine declared as one (its inputs held in bf16 included); the same bf16 arithmetic
/// declared as f32 fails, and each seeded bug fails exactly the cases it touches, in both modes
/// (the delta rule through transformers' chunked form among them).
#[test]
fn torch_cpu_kernels_pass_in_f32_and_bf16_and_their_seeded_bugs_go_red() {
    let probe = std::process::Command::new("python3").args(["-c", "import torch, transformers, gguf, numpy"]).output();
    if !matches!(probe, Ok(ref o) if o.status.success()) {
        assert!(std::env::var("TOUCHSTONE_REQUIRE_TORCH").is_err(), "TOUCHSTONE_REQUIRE_TORCH is set but python3 cannot import torch, transformers, gguf and numpy");
        eprintln!("SKIPPED: python3 with torch, transformers, gguf and numpy is not installed (pip install -r tools/peers/requirements-torch.txt)");
        return;
    }
    const TORCH: &str = "exec:python3 examples/ops_torch/engine.py";
    // One process per mode: torch takes seconds to import.
    let one_batch = ("TOUCHSTONE_OPS_BATCH", "4000");
    let tmp = tempfile::tempdir().unwrap();
    for (mode, storage) in [("f32", "f32"), ("bf16", "bf16")] {
        let (o, r) = kernels(TORCH, &[], &tmp.path().join(mode), &[one_batch, ("OPS_TORCH_DTYPE", mode)]);
        assert_eq!(o.status.code(), Some(0), "{mode}: {}", text(&o));
        let s = &r["summary"];
        assert!(s["passed"].as_u64().unwrap() >= 2000 && s["failed"] == 0 && s["errors"] == 0, "{mode}: {s}");
        let first = r["cases"].as_array().unwrap().iter().find(|c| c["verdict"] == "pass").unwrap();
        assert_eq!(first["metrics"]["arithmetic"]["storage"], storage, "{first}");
    }
    let (o, r) = kernels(TORCH, &["--filter", "^(embed|rope|rms_norm|softmax|add|matmul\\(w=q8_0)"], &tmp.path().join("declared_f32"), &[("TOUCHSTONE_EXAMPLE_BUG", "bf16_declared_f32")]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let (failed, all) = failed_by_op(&r);
    for op in ["embed", "rope", "rms_norm", "softmax", "add", "matmul/q8_0"] {
        assert!(failed.get(op).copied().unwrap_or(0) * 2 > all[op], "bf16 declared f32, {op}: {failed:?} of {all:?}");
    }
    for mode in ["f32", "bf16"] {
        for (bug, touched) in [("rms_eps_x10", &["rms_norm", "qk_norm"][..]), ("rope_pairs_swapped", &["rope"]), ("q4_0_nibbles_swapped", &["matmul/q4_0"])] {
            let report = tmp.path().join(format!("{mode}-{bug}"));
            let env = [("TOUCHSTONE_EXAMPLE_BUG", bug), ("OPS_TORCH_DTYPE", mode)];
            let (o, r) = kernels(TORCH, &["--filter", "^(rms_norm|qk_norm|rope|add|matmul\\(w=q4_[01],k=(32|64))"], &report, &env);
            assert_eq!(o.status.code(), Some(1), "{mode} {bug}: {}", text(&o));
            let (failed, all) = failed_by_op(&r);
            assert!(failed.keys().all(|k| touched.contains(&k.as_str())), "{mode} {bug}: {failed:?}");
            // In bf16, eps x10 moves a QK-norm's short rows by less than bf16 resolves.
            let shown = if mode == "bf16" && bug == "rms_eps_x10" { &["rms_norm"][..] } else { touched };
            for t in shown {
                assert!(failed.get(*t).copied().unwrap_or(0) * 2 > all[*t], "{mode} {bug}: most {t} cases fail: {failed:?} of {all:?}");
            }
        }
    }
    // transformers' chunked delta rule (chunks of 16) passes against the recurrent oracle above;
    // carried across chunk boundaries without the boundary position's term, it fails exactly the
    // cases of more than one chunk.
    let (o, r) = kernels(TORCH, &["--filter", "^delta_rule"], &tmp.path().join("delta"), &[("TOUCHSTONE_EXAMPLE_BUG", "delta_chunk_term_dropped")]);
    assert_eq!(o.status.code(), Some(1), "delta_chunk_term_dropped: {}", text(&o));
    for c in r["cases"].as_array().unwrap() {
        let id = c["id"].as_str().unwrap();
        let chunks = id.split(",m=").nth(1).and_then(|t| t.split(',').next()).and_then(|m| m.parse::<usize>().ok()).unwrap().div_ceil(16);
        assert_eq!(c["verdict"], if chunks > 1 { "fail" } else { "pass" }, "delta_chunk_term_dropped: {id}");
    }
    // Latent attention in the absorbed form (torch's einsums) passes against the materialized
    // oracle above; its scores scaled by the cached row's width fail every case with more than
    // one key to weigh.
    let (o, r) = kernels(TORCH, &["--filter", "^mla_attention"], &tmp.path().join("mla"), &[("TOUCHSTONE_EXAMPLE_BUG", "mla_scale_of_cached_row")]);
    assert_eq!(o.status.code(), Some(1), "mla_scale_of_cached_row: {}", text(&o));
    for c in r["cases"].as_array().unwrap() {
        let id = c["id"].as_str().unwrap();
        let one_key = id.contains(",m=1,cached=0,");
        assert_eq!(c["verdict"], if one_key { "pass" } else { "fail" }, "mla_scale_of_cached_row: {id}");
    }
}

/// One command gates an engine on every rung it speaks: an `exec:` command that answers the op
/// protocol (the numpy template) and the dump protocol (the example dump engine) gets ops,
/// layers and tokens in one report from `gate` with no `--suite`.
#[test]
fn gate_runs_ops_layers_and_tokens_on_one_exec_engine() {
    if !python_with_reference_peers() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let engine = r#"exec:if [ -n "$TOUCHSTONE_TASK" ]; then python3 examples/ops_numpy/engine.py; else python3 examples/external_engine/engine.py; fi"#;
    let report = tmp.path().join("gate");
    let o = xtask(&["gate", "--device", engine, "--model", "tiny-llama", "--report-dir", report.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = common::report(&report);
    let passed = |prefix: &str| r["cases"].as_array().unwrap().iter().filter(|c| c["id"].as_str().unwrap().starts_with(prefix) && c["verdict"] == "pass").count();
    assert!(passed("matmul(") > 1000 && passed("rms_norm(") > 0, "the op rung ran");
    assert!(passed("layer_diff(model=tiny-llama,gate=tap_coverage)") == 1 && passed("layer_diff(") > 5, "the layer rung ran");
    assert!(passed("fixed_token(") > 0, "the token rung ran");
}

/// Declared arithmetic decides the bounds: the numpy template storing its results in bf16
/// passes declared as bf16 (embedding rows and RoPE's untouched dimensions included: a copy is
/// rounded once on store) and fails declared as f32.
#[test]
fn a_bf16_engine_passes_declared_as_bf16_and_fails_declared_as_f32() {
    if !python_with_reference_peers() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let filter = ["--filter", "^(embed|rope|rms_norm|softmax|add|matmul\\(w=q8_0)"];
    let (o, r) = kernels(NUMPY, &filter, &tmp.path().join("bf16"), &[("OPS_NUMPY_BF16", "1")]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(r["summary"]["passed"].as_u64().unwrap() > 600, "{}", r["summary"]);
    assert_eq!(r["cases"][0]["metrics"]["arithmetic"]["storage"], "bf16", "{}", r["cases"][0]);
    let (o, r) = kernels(NUMPY, &filter, &tmp.path().join("f32"), &[("TOUCHSTONE_EXAMPLE_BUG", "bf16_declared_f32")]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let (failed, all) = failed_by_op(&r);
    for op in ["embed", "rope", "rms_norm", "softmax", "add", "matmul/q8_0"] {
        assert!(failed.get(op).copied().unwrap_or(0) * 2 > all[op], "{op}: {failed:?} of {all:?}");
    }
}

/// `kernels --write-cases DIR` writes the selected cases (an op batch with the oracle's outputs);
/// `kernels --cases DIR` reruns them on any device with the same verdicts: green on `cpu` and on
/// the numpy engine, red on exactly the same cases as the registry's own run where the numpy
/// engine has a seeded bug. A case file whose case does not fit its op's form (an input renamed,
/// a shape that contradicts its tensor) or is missing is refused with exit 2, naming the file,
/// the case and the input; nothing runs.
#[test]
fn written_cases_rerun_anywhere_with_the_same_verdicts() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cases");
    let filter = "^(rms_norm|rope)\\(";
    let (o, r) = kernels("cpu", &["--filter", filter, "--write-cases", dir.to_str().unwrap()], &tmp.path().join("written"), &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let n = r["summary"]["executed"].as_u64().unwrap();
    assert!(n > 100 && text(&o).contains(&format!("wrote {n} cases")), "{}", text(&o));
    for f in ["cases.json", "inputs.safetensors", "expected.safetensors"] {
        assert!(dir.join(f).is_file(), "{f} not written");
    }
    let failing = |r: &serde_json::Value| -> BTreeSet<String> { r["cases"].as_array().unwrap().iter().filter(|c| c["verdict"] != "pass").map(|c| c["id"].as_str().unwrap().to_string()).collect() };
    for device in ["cpu", NUMPY] {
        let (o, r) = kernels(device, &["--cases", dir.to_str().unwrap()], &tmp.path().join("rerun"), &[]);
        assert_eq!(o.status.code(), Some(0), "{device}: {}", text(&o));
        assert_eq!(r["summary"]["passed"].as_u64(), Some(n), "{device}: {}", r["summary"]);
    }
    let bug = [("TOUCHSTONE_EXAMPLE_BUG", "rope_pairs_swapped")];
    let (_, direct) = kernels(NUMPY, &["--filter", filter], &tmp.path().join("direct-bug"), &bug);
    let (o, rerun) = kernels(NUMPY, &["--cases", dir.to_str().unwrap()], &tmp.path().join("rerun-bug"), &bug);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(!failing(&direct).is_empty() && failing(&direct) == failing(&rerun), "direct {:?} vs rerun {:?}", failing(&direct), failing(&rerun));
    // Hostile files: refused before anything runs, naming what is wrong.
    let cases: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    for (what, path, value, says) in [("renamed", "/cases/0/inputs/0/name", serde_json::json!("y"), "inputs y (f32)"), ("reshaped", "/cases/0/inputs/0/shape", serde_json::json!([2, 2]), "declared f32 [2, 2], stored F32")] {
        let bad = tmp.path().join(what);
        std::fs::create_dir_all(&bad).unwrap();
        for f in ["inputs.safetensors", "expected.safetensors"] {
            std::fs::copy(dir.join(f), bad.join(f)).unwrap();
        }
        let mut c = cases.clone();
        *c.pointer_mut(path).unwrap() = value;
        std::fs::write(bad.join("cases.json"), c.to_string()).unwrap();
        let o = xtask(&["kernels", "--device", "cpu", "--cases", bad.to_str().unwrap()], &[]);
        let id = cases["cases"][0]["id"].as_str().unwrap();
        assert!(o.status.code() == Some(2) && stderr(&o).contains(says) && stderr(&o).contains(id) && stderr(&o).contains("cases.json"), "{what}: {}", text(&o));
    }
    let o = xtask(&["kernels", "--device", "cpu", "--cases", tmp.path().join("absent").to_str().unwrap()], &[]);
    assert!(o.status.code() == Some(2) && stderr(&o).contains("absent"), "{}", text(&o));
}
