//! The GPU devices on a machine without a GPU. `gpu-emu` runs the CUDA/ROCm kernel source on the
//! host, so the kernel suite, layer-diff and fixed-token judge the GPU kernels' logic here; a
//! deliberately broken kernel source (`TOUCHSTONE_KERNEL_SOURCE`) must turn them red; and `cuda`
//! / `rocm` without a driver (or not compiled in) exit 2 with a one-line reason; the GPU check
//! script itself is rehearsed on the emulator from a stage. The emulator
//! needs a C++ compiler: without one these tests say SKIPPED, and fail instead when
//! `TOUCHSTONE_REQUIRE_GPU_EMU=1` (CI sets it).

mod common;

use common::*;

fn emulator_available() -> bool {
    match devices::open("gpu-emu") {
        Ok(_) => true,
        Err(e) => {
            assert!(std::env::var("TOUCHSTONE_REQUIRE_GPU_EMU").as_deref() != Ok("1"), "{e}");
            eprintln!("SKIPPED: {e}");
            false
        }
    }
}

#[test]
fn every_kernel_case_passes_on_the_emulated_gpu_kernels_in_any_thread_order() {
    if !emulator_available() {
        return;
    }
    // Forward, then shuffled thread and block order with the shared-memory race check: every
    // case passes both ways, with the same error figures, so no kernel's result depends on the
    // order a GPU picks and no two threads write one shared word between barriers.
    let n_cases: usize = oracle::registry::registry().iter().map(|e| (e.cases)(0).len()).sum();
    let mut runs = Vec::new();
    for device in ["gpu-emu", "gpu-emu:shuffle:racecheck"] {
        let dir = tempfile::tempdir().unwrap();
        let o = xtask(&["kernels", "--device", device, "--report-dir", dir.path().to_str().unwrap()], &[]);
        assert_eq!(o.status.code(), Some(0), "{device}: {}", text(&o));
        let r = report(dir.path());
        assert_eq!(r["summary"]["executed"], n_cases, "{device}: every registry case ran");
        assert_eq!(r["summary"]["passed"], n_cases, "{device}: {}", r["summary"]);
        assert!(r["provenance"]["devices"][device].as_str().unwrap().contains("emulation"), "{}", r["provenance"]);
        runs.push(r);
    }
    let (a, b) = (runs[0]["cases"].as_array().unwrap(), runs[1]["cases"].as_array().unwrap());
    assert_eq!(a.len(), b.len());
    // Every figure but the wall time each case took.
    let figures = |c: &serde_json::Value| {
        let mut m = c["metrics"].clone();
        m.as_object_mut().map(|o| o.remove("wall_seconds"));
        m
    };
    let differ: Vec<_> = a.iter().zip(b).filter(|(x, y)| figures(x) != figures(y)).map(|(x, _)| x["id"].clone()).collect();
    assert!(differ.is_empty(), "results depend on the thread order: {differ:?}");
}

#[test]
fn every_op_passes_with_the_block_size_the_gpus_use() {
    if !emulator_available() {
        return;
    }
    // GPUs launch 256 threads per block, the emulator 32 unless asked: the whole suite again with
    // 256 shuffled, race-checked threads and the GPU's arithmetic (products contracted into fused
    // multiply-adds as NVRTC does, expf/tanhf at CUDA's 2-ulp worst case) (about 50 s here).
    let device = "gpu-emu:shuffle:256:racecheck:fma:ulp2";
    let dir = tempfile::tempdir().unwrap();
    let o = xtask(&["kernels", "--device", device, "--report-dir", dir.path().to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report(dir.path());
    // Every case passes.
    assert_eq!(r["summary"]["passed"], r["summary"]["executed"], "{}", r["summary"]);
    let described = r["provenance"]["devices"][device].as_str().unwrap();
    assert!(described.contains("blocks of 256 fibers") && described.contains("fma") && described.contains("2 ulp"), "{}", r["provenance"]);
    let ran: std::collections::BTreeSet<&str> = r["cases"].as_array().unwrap().iter().map(|c| c["id"].as_str().unwrap().split('(').next().unwrap()).collect();
    for e in oracle::registry::registry() {
        assert!(ran.contains(e.op.name()), "no case of `{}` ran at 256 threads", e.op);
    }
}

/// The kernel budgets take the transcendental error an f32 GPU device declares (4 ulp per
/// expf/tanhf; CUDA documents 2) and refuse much more: the ops that use them pass with expf/tanhf
/// 4 ulp off and fail with them 8 ulp off.
#[test]
fn the_budgets_take_the_declared_expf_error_and_refuse_twice_as_much() {
    if !emulator_available() {
        return;
    }
    for (device, code) in [("gpu-emu:ulp4", 0), ("gpu-emu:ulp8", 1)] {
        let dir = tempfile::tempdir().unwrap();
        let o = xtask(&["kernels", "--device", device, "--filter", "softmax|moe_route|silu|gelu|glu|attention|softcap", "--report-dir", dir.path().to_str().unwrap()], &[]);
        assert_eq!(o.status.code(), Some(code), "{device}: {}", text(&o));
        let r = report(dir.path());
        assert!(r["summary"]["executed"].as_u64().unwrap() >= 400, "{}", r["summary"]);
        if code == 1 {
            let failed: Vec<&str> = r["cases"].as_array().unwrap().iter().filter(|c| c["verdict"] == "fail").map(|c| c["id"].as_str().unwrap()).collect();
            assert!(failed.iter().any(|id| id.starts_with("softmax(")), "{failed:?}");
        }
    }
}

#[test]
fn models_run_on_the_emulated_gpu_within_budget() {
    if !emulator_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let o = xtask(&["layer-diff", "--device", "gpu-emu", "--model", "tiny-qwen3", "--report-dir", d], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(report(dir.path())["summary"]["failed"], 0);
    let o = xtask(&["fixed-token", "--device", "gpu-emu", "--model", "tiny-moe", "--report-dir", d], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report(dir.path());
    assert!(r["summary"]["passed"].as_u64().unwrap() >= 5, "{}", r["summary"]);
}

/// The real model as a GPU runs it: SmolLM2 through the GPU model code with 256 threads per
/// block (what `cuda` and `rocm` launch), threads and blocks in shuffled order, shared-memory
/// races checked, products contracted into fused multiply-adds and expf/tanhf 2 ulp off (the
/// GPU's arithmetic); every layer-diff tap within its budget.
#[test]
fn smollm2_passes_layer_diff_at_the_gpus_block_size_and_arithmetic_in_shuffled_order_race_checked() {
    if !emulator_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let o = xtask(&["layer-diff", "--device", "gpu-emu:shuffle:256:racecheck:fma:ulp2", "--model", "smollm2", "--report-dir", dir.path().to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report(dir.path());
    assert_eq!(r["summary"]["failed"], 0, "{}", r["summary"]);
    assert!(r["summary"]["passed"].as_u64().unwrap() >= 400, "{}", r["summary"]);
}

/// ci/device-check.sh run from the workspace root with `env`.
fn device_check(env: &[(&str, &str)]) -> std::process::Output {
    std::process::Command::new("bash").arg("ci/device-check.sh").current_dir(workspace()).envs(env.iter().copied()).output().unwrap()
}

/// ci/device-check.sh rehearsed on the emulator from a stage as ci/device-stage.sh lays it out:
/// the model's two parts are joined byte for byte into the stage's cache, only the STEPS asked
/// for run, each step is listed with its verdict, the roofline, timed on the host, leaves the
/// run inconclusive (exit 3) rather than passed, and everything comes back as two files.
#[test]
fn the_device_check_runs_from_a_stage_on_the_emulator() {
    if !emulator_available() {
        return;
    }
    let stage = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let s = stage.path();
    for d in ["bin", "smol-a", "smol-b"] {
        std::fs::create_dir_all(s.join(d)).unwrap();
    }
    std::fs::copy(env!("CARGO_BIN_EXE_xtask"), s.join("bin/xtask")).unwrap();
    let model: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(s.join("smol-a/part"), &model[..600]).unwrap();
    std::fs::write(s.join("smol-b/part"), &model[600..]).unwrap();
    std::fs::write(s.join("smol-a/dest"), "real/staged/model.gguf\n").unwrap();
    let out_dir = out.path().to_str().unwrap();
    let stash = tempfile::tempdir().unwrap();
    let stash_dir = stash.path().join("parts");
    let stash_dir = stash_dir.to_str().unwrap();
    let o = device_check(&[("STAGE", s.to_str().unwrap()), ("STASH", stash_dir), ("OUT", out_dir), ("DEVICE", "gpu-emu"), ("STEPS", "models roofline"), ("MODELS", "tiny-llama"), ("ROOFLINE_MIB", "1")]);
    let summary = std::fs::read_to_string(out.path().join("summary.txt")).unwrap();
    assert_eq!(o.status.code(), Some(3), "{}\n{summary}", text(&o));
    assert_eq!(std::fs::read(s.join("cache/real/staged/model.gguf")).unwrap(), model);
    for line in ["joined SmolLM2", "fixtures-tiny-llama", "layer-diff-tiny-llama", "fixed-token-tiny-llama", "first divergence: none", "6 gates: 6 passed"] {
        assert!(summary.contains(line), "`{line}` missing:\n{summary}");
    }
    assert!(summary.lines().any(|l| l.starts_with("roofline") && l.contains("inconclusive")), "{summary}");
    assert!(!summary.lines().any(|l| l.starts_with("kernels") || l.starts_with("bench")), "steps not asked for ran:\n{summary}");
    // A staged run packs (the runner brings back at most 8 files from $OUT): two files, the
    // archive holding every step's log and report and the summary.
    let mut files: Vec<String> = std::fs::read_dir(out.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    files.sort();
    assert_eq!(files, ["reports.tar.gz", "summary.txt"]);
    let listing = std::process::Command::new("tar").arg("-tzf").arg(out.path().join("reports.tar.gz")).output().unwrap();
    let listing = String::from_utf8_lossy(&listing.stdout);
    for f in ["./gpu.txt", "./summary.txt", "./layer-diff-tiny-llama.log", "./layer-diff-tiny-llama/report.json", "./fixed-token-tiny-llama/report.json", "./roofline/report.json"] {
        assert!(listing.lines().any(|l| l == f), "`{f}` not in the archive:\n{listing}");
    }
    // A second transfer that brings only the model's second part (the runner dropped the first
    // transfer's folders): with STASH the first transfer's parts come back from outside the
    // repository, and the model is joined as before.
    let stage2 = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(stage2.path().join("smol-b")).unwrap();
    std::fs::write(stage2.path().join("smol-b/part"), &model[600..]).unwrap();
    let o = device_check(&[("STAGE", stage2.path().to_str().unwrap()), ("STASH", stash_dir), ("OUT", out_dir), ("DEVICE", "gpu-emu"), ("STEPS", "models"), ("MODELS", "tiny-llama")]);
    let summary = std::fs::read_to_string(out.path().join("summary.txt")).unwrap();
    assert_eq!(o.status.code(), Some(0), "{}\n{summary}", text(&o));
    for part in ["bin", "smol-a"] {
        assert!(summary.contains(&format!("/{part}: restored from {stash_dir}")), "{part}:\n{summary}");
    }
    assert_eq!(std::fs::read(stage2.path().join("cache/real/staged/model.gguf")).unwrap(), model);
    // Without STASH nothing is kept or restored: the same transfer finds no binary and says so.
    let stage3 = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(stage3.path().join("smol-b")).unwrap();
    let o = device_check(&[("STAGE", stage3.path().to_str().unwrap()), ("OUT", out_dir), ("DEVICE", "gpu-emu"), ("STEPS", "models"), ("MODELS", "tiny-llama")]);
    let summary = std::fs::read_to_string(out.path().join("summary.txt")).unwrap();
    assert_eq!(o.status.code(), Some(2), "{}\n{summary}", text(&o));
    assert!(summary.contains("no xtask binary at") && !summary.contains("restored from"), "{summary}");
    // A misspelt step must not make a run that checks nothing and exits 0.
    let o = device_check(&[("STEPS", "kernel"), ("OUT", out_dir)]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("unknown step `kernel'"), "{}", text(&o));
    // The families step with no family model to run is a step that could not run, not a pass.
    let empty = tempfile::tempdir().unwrap();
    let o = device_check(&[("STAGE", stage.path().to_str().unwrap()), ("FAMILIES", empty.path().to_str().unwrap()), ("OUT", out_dir), ("DEVICE", "gpu-emu"), ("STEPS", "families")]);
    let summary = std::fs::read_to_string(out.path().join("summary.txt")).unwrap();
    assert_eq!(o.status.code(), Some(2), "{}\n{summary}", text(&o));
    assert!(summary.contains("no *.gguf in"), "{summary}");
}

#[test]
fn a_broken_gpu_kernel_turns_the_gates_red() {
    if !emulator_available() {
        return;
    }
    // SiLU with a 0.1% error in its exponent's argument: inside f32 noise for a casual look,
    // far outside the bound the device's declared arithmetic implies.
    let broken = broken_kernel_source("return x / (1.0f + expf(-x));", "return x / (1.0f + expf(-1.001f * x));");
    let env = [("TOUCHSTONE_KERNEL_SOURCE", broken.path().to_str().unwrap())];
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let o = xtask(&["kernels", "--device", "gpu-emu", "--filter", "^(silu|swiglu)\\(", "--report-dir", d], &env);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(report(dir.path())["summary"]["failed"].as_u64().unwrap() > 0);
    let o = xtask(&["layer-diff", "--device", "gpu-emu", "--model", "tiny-llama", "--report-dir", d], &env);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("first divergence: blk.0.ffn_act"), "{}", text(&o));
}

/// Runs the f32 `add` cases of shape [3,5] with `add`'s body replaced by `bad`; every case must
/// fail (exit 1: a kernel's own fault is a failed case, not one that could not run). Returns the
/// command's output text.
fn every_add_case_fails_with(bad: &str) -> String {
    let broken = broken_kernel_source("if (i < n) y[i] = a[i] + b[i % bn];", bad);
    let dir = tempfile::tempdir().unwrap();
    let o = xtask(
        &["kernels", "--device", "gpu-emu", "--filter", "^add\\(dtype=f32,shape=\\[3,5\\]", "--report-dir", dir.path().to_str().unwrap()],
        &[("TOUCHSTONE_KERNEL_SOURCE", broken.path().to_str().unwrap())],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let r = report(dir.path());
    assert_eq!(r["summary"]["failed"], r["summary"]["executed"], "{}", r["summary"]);
    text(&o)
}

#[test]
fn a_kernel_that_writes_past_its_output_is_caught() {
    if !emulator_available() {
        return;
    }
    let out = every_add_case_fails_with("if (i <= n) y[i] = a[i] + b[i % bn];");
    assert!(out.contains("wrote outside its 60-byte output: after it, up to 4 bytes away"), "{out}");
}

#[test]
fn a_kernel_that_reads_past_its_input_is_caught() {
    if !emulator_available() {
        return;
    }
    // Reads 8 elements too far into `b`: the emulator's allocation ends at an inaccessible page,
    // so the launch fails (a GPU's illegal address) instead of adding whatever lies there.
    let out = every_add_case_fails_with("if (i < n) y[i] = a[i] + b[i % bn + 8];");
    assert!(out.contains("kernel fault: ts_add: block (0,0,0), thread 8: memory fault at address"), "{out}");
    assert!(out.contains("bytes past the end of the 60-byte allocation"), "{out}");
}

#[test]
fn racecheck_finds_the_unsynchronised_sum_that_passes_everywhere_else() {
    if !emulator_available() {
        return;
    }
    // The block sum as one shared total every thread adds to without atomics. In the emulator a
    // thread's turn runs whole, so the sum comes out right and the suite passes; on a GPU the
    // threads' read-add-write sequences interleave and updates are lost. racecheck sees two
    // threads write one shared word between two barriers.
    let broken = broken_kernel_source(
        "    red[tid] = v;\n    __syncthreads();\n    for (int s = blockDim.x / 2; s > 0; s >>= 1) {\n        if (tid < s) red[tid] += red[tid + s];\n        __syncthreads();\n    }",
        "    if (tid == 0) red[0] = 0.0f;\n    __syncthreads();\n    red[0] += v;\n    __syncthreads();",
    );
    let env = [("TOUCHSTONE_KERNEL_SOURCE", broken.path().to_str().unwrap())];
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let o = xtask(&["kernels", "--device", "gpu-emu:shuffle", "--filter", "^rms_norm\\(", "--report-dir", d], &env);
    assert_eq!(o.status.code(), Some(0), "the race is invisible without the check: {}", text(&o));
    let o = xtask(&["kernels", "--device", "gpu-emu:racecheck", "--filter", "^rms_norm\\(", "--report-dir", d], &env);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert_eq!(report(dir.path())["summary"]["passed"], 0);
    assert!(text(&o).contains("kernel fault: ts_rms_norm: block (") && text(&o).contains("both wrote the word at byte 0 of a static array in shared memory"), "{}", text(&o));
}

#[test]
fn gpu_devices_without_a_gpu_exit_2_with_one_line() {
    for device in ["cuda", "cuda:1", "rocm"] {
        let o = xtask(&["kernels", "--device", device], &[]);
        assert_eq!(o.status.code(), Some(2), "{device}: {}", text(&o));
        let err = stderr(&o);
        assert_eq!(err.trim().lines().count(), 1, "{device}: {err}");
        assert!(err.contains(&format!("device `{device}` is unavailable")), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn roofline_measures_every_weight_type_against_copy() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    // cpu always; gpu-emu when the emulator builds. Small buffers: this checks the plumbing and
    // the gate's arithmetic, not a machine's speed.
    let mut devices = vec!["cpu"];
    if emulator_available() {
        devices.push("gpu-emu");
    }
    for device in devices {
        let o = xtask(&["roofline", "--device", device, "--mib", "2", "--reps", "1", "--report-dir", d], &[]);
        let r = report(dir.path());
        let cases = r["cases"].as_array().unwrap();
        // One case per weight type on cpu; the emulator's 32-thread blocks also time the other
        // shapes that fit them (float: 8 and 16 lanes, and the half-batch kernel at 8, 16 and
        // 32; packed: 8 and 32 lanes).
        let want = if device == "cpu" { 7 } else { 3 * 6 + 4 * 3 };
        assert_eq!(cases.len(), want, "{device}: {}", text(&o));
        let f16 = cases.iter().find(|c| c["id"].as_str().unwrap().contains("w=f16")).unwrap();
        let ratio = f16["metrics"]["ratio_to_copy"].as_f64().unwrap();
        assert!(cases.iter().all(|c| c["metrics"]["gbps"].as_f64().unwrap() > 0.0), "{device}");
        if device == "cpu" {
            assert_eq!(o.status.code(), Some(if ratio >= 0.85 { 0 } else { 1 }), "{device}: ratio {ratio}: {}", text(&o));
        } else {
            // The emulator's timings are the host's: whatever the ratio, the gate is not passed.
            assert_eq!(o.status.code(), Some(3), "{device}: ratio {ratio}: {}", text(&o));
            assert_eq!(f16["verdict"], "inconclusive", "{f16}");
            assert!(f16["message"].as_str().unwrap().contains("say nothing about a GPU"), "{f16}");
            // The report names the code each figure came from.
            let probe_f16 = r["bandwidth_probe"]["gemv"].as_array().unwrap().iter().find(|g| g["ty"] == "f16").unwrap().clone();
            assert!(probe_f16["kernel"].as_str().unwrap().starts_with("ts_matmul_v1: 32 threads per row, 1 row per 32-thread block"), "{probe_f16}");
        }
    }
    if emulator_available() {
        // With the GPUs' 256-thread blocks the probe also times the other threads-per-row shapes
        // of each type's kernel (and, for float weights, the one-token kernel with half the load
        // batch): listed after the matmul's own, checked to compute the same rows, never gated
        // (the gated case is still the f16 matmul's own shape).
        let o = xtask(&["roofline", "--device", "gpu-emu:256", "--mib", "1", "--reps", "1", "--report-dir", d], &[]);
        assert_eq!(o.status.code(), Some(3), "{}", text(&o));
        let r = report(dir.path());
        let cases = r["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 3 * 12 + 4 * 6, "{}", text(&o));
        let gemv = r["bandwidth_probe"]["gemv"].as_array().unwrap();
        for ty in ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k"] {
            let shapes: Vec<(&str, bool)> = gemv.iter().filter(|g| g["ty"] == ty).map(|g| (g["kernel"].as_str().unwrap(), g["alternative"].as_bool().unwrap())).collect();
            let shape = |k: &str| {
                let (kernel, rest) = k.split_once(": ").unwrap();
                format!("{kernel}/{}", rest.split(' ').next().unwrap())
            };
            let got: Vec<String> = shapes.iter().map(|(k, _)| shape(k)).collect();
            let want: Vec<String> = if ty.starts_with('q') {
                ["16", "8", "32", "64", "128", "256"].iter().map(|l| format!("ts_matmul_q1/{l}")).collect()
            } else {
                let mut w: Vec<String> = ["32", "8", "16", "64", "128", "256"].iter().map(|l| format!("ts_matmul_v1/{l}")).collect();
                w.extend(["8", "16", "32", "64", "128", "256"].iter().map(|l| format!("ts_matmul_v1b2/{l}")));
                w
            };
            assert_eq!(got, want, "{ty}: {shapes:?}");
            assert!(!shapes[0].1 && shapes[1..].iter().all(|s| s.1), "{ty}: only the matmul's own shape is not an alternative: {shapes:?}");
        }
        let gated: Vec<&serde_json::Value> = cases.iter().filter(|c| c["verdict"] != "pass").collect();
        assert_eq!(gated.len(), 1, "{gated:?}");
        assert_eq!(gated[0]["id"], "roofline(gemv,w=f16,k=8192,m=1)");
        assert_eq!(cases.iter().filter(|c| c["id"].as_str().unwrap().contains(",shape=")).count(), 3 * 12 + 4 * 6 - 7);
    }
    let o = xtask(&["roofline", "--device", "fixed"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("has no bandwidth probe"), "{}", stderr(&o));
}

/// `bench` on a GPU device profiles the kernels of its decode steps (each launch timed alone, in
/// an untimed run): the launches it reports per decode token are the profile's (which
/// devices/tests/gpu_model.rs checks against the launch counter), and the report says what share
/// of a timed step the kernels took (on the emulator, labelled as host timings that say nothing
/// about a GPU).
#[test]
fn bench_on_a_gpu_device_profiles_the_kernels_of_a_decode_step() {
    if !emulator_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let o = xtask(&["bench", "--device", "gpu-emu", "--model", "tiny-llama", "--reps", "1", "--gen-len", "4", "--prompt-len", "4", "--report-dir", dir.path().to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("us of kernel time per token") && text(&o).contains("say nothing about a GPU"), "{}", text(&o));
    let r = report(dir.path());
    let m = &r["cases"][0]["metrics"];
    let p = &r["decode_kernel_profile"];
    assert_eq!(p["tokens"], 3);
    let kernels = p["profile"]["kernels"].as_array().unwrap();
    let launches: u64 = kernels.iter().map(|k| k["launches"].as_u64().unwrap()).sum();
    assert_eq!(launches as f64 / 3.0, m["kernel_launches_per_decode_token"].as_f64().unwrap(), "{p}");
    let seconds: f64 = kernels.iter().map(|k| k["seconds"].as_f64().unwrap()).sum();
    assert!((m["decode_kernel_us_per_token"].as_f64().unwrap() - 1e6 * seconds / 3.0).abs() < 1e-6, "{m}");
    assert!(m["decode_kernel_busy_fraction"].as_f64().unwrap() > 0.0, "{m}");
    assert_eq!(r["decode_kernels"]["rows"].as_array().map(Vec::len), Some(kernels.len()), "{}", r["decode_kernels"]);
}

/// `reduce` turns a red layer-diff into a one-op case: with the SiLU kernel 0.1% off or the
/// attention scores 1% off, the first divergence (`ffn_act`, `attn_kqv`) becomes a `swiglu` or
/// `attention` case over one position that still fails on the device; the case directory it
/// writes fails again through `kernels --cases` on that device and passes on `cpu`; from
/// layer-diff's report (`--from`) the same case is found. A correct device has nothing to reduce
/// (exit 0).
#[test]
fn reduce_turns_a_red_tap_into_a_one_op_case_that_reruns() {
    if !emulator_available() {
        return;
    }
    let o = xtask(&["reduce", "--device", "gpu-emu", "--model", "tiny-llama"], &[]);
    assert!(o.status.code() == Some(0) && text(&o).contains("nothing to reduce"), "{}", text(&o));
    for (good, bad, op, tap) in [("return x / (1.0f + expf(-x));", "return x / (1.0f + expf(-1.001f * x));", "swiglu", "blk.0.ffn_act"), ("        s *= scale;", "        s *= scale * 1.01f;", "attention", "blk.0.attn_kqv")] {
        let broken = broken_kernel_source(good, bad);
        let env = [("TOUCHSTONE_KERNEL_SOURCE", broken.path().to_str().unwrap())];
        let dir = tempfile::tempdir().unwrap();
        let o = xtask(&["reduce", "--device", "gpu-emu", "--model", "tiny-llama", "--report-dir", dir.path().to_str().unwrap()], &env);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        let r = report(dir.path());
        let red = &r["reduce"];
        assert_eq!(red["tap"], tap, "{red}");
        assert_eq!(red["reduced"], true, "{red}");
        assert_eq!(red["rerun"], "fail", "{red}");
        let case = red["case"].as_str().unwrap();
        assert!(case.starts_with(&format!("{op}(from={tap},")) && case.contains("rows=1x"), "{case}");
        let steps = red["steps"].as_array().unwrap();
        assert!(steps.len() >= 2 && steps.iter().all(|s| s["verdict"].is_string()), "{red}");
        assert!(steps.last().unwrap()["values"].as_u64() < steps[0]["values"].as_u64(), "{red}");
        let cases = dir.path().join("case");
        let o = xtask(&["kernels", "--device", "gpu-emu", "--cases", cases.to_str().unwrap(), "--report-dir", dir.path().join("rerun").to_str().unwrap()], &env);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        let o = xtask(&["kernels", "--device", "cpu", "--cases", cases.to_str().unwrap(), "--report-dir", dir.path().join("cpu").to_str().unwrap()], &[]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        if op != "swiglu" {
            continue;
        }
        // From layer-diff's report: the same case, without judging every tap again; a report of
        // another device is refused, naming the field.
        let ld = dir.path().join("ld");
        let o = xtask(&["layer-diff", "--device", "gpu-emu", "--model", "tiny-llama", "--mode", "isolated", "--report-dir", ld.to_str().unwrap()], &env);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        let again = dir.path().join("again");
        let o = xtask(&["reduce", "--device", "gpu-emu", "--model", "tiny-llama", "--from", ld.to_str().unwrap(), "--report-dir", again.to_str().unwrap()], &env);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert_eq!(report(&again)["reduce"]["case"].as_str(), Some(case), "{}", text(&o));
        let o = xtask(&["reduce", "--device", "cpu", "--model", "tiny-llama", "--from", ld.to_str().unwrap()], &[]);
        assert!(o.status.code() == Some(2) && stderr(&o).contains("judged device `gpu-emu`, not `cpu`"), "{}", text(&o));
    }
}
