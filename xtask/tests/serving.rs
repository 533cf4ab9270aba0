//! `cargo xtask serving`: green on `cpu`, every axis present in report.json; a device that serves
//! no schedules (`fixed`) is unsupported and the run is not green; a bad request is refused
//! naming it; the example engine and llama.cpp serve through the schedule task.

mod common;

use common::*;

#[test]
fn serving_judges_every_axis_on_cpu_and_is_unsupported_where_no_schedule_is_served() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cpu");
    let o = xtask(&["serving", "--device", "cpu", "--model", "tiny-mixed", "--report-dir", dir.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report(&dir);
    let cases = r["cases"].as_array().unwrap();
    for axis in ["batch", "neighbours", "prefix_cache", "chunks", "decode", "slot_reuse", "mixed_lengths"] {
        let of_axis: Vec<_> = cases.iter().filter(|c| c["id"].as_str().unwrap().contains(&format!("axis={axis},"))).collect();
        assert!(of_axis.len() >= 2 && of_axis.iter().all(|c| c["verdict"] == "pass"), "{axis}: {of_axis:?}");
    }
    assert_eq!(r["batch_invariant"], true);
    // The window of tiny-mixed puts a chunk boundary on its edge.
    assert!(cases.iter().any(|c| c["id"].as_str().unwrap().contains("axis=chunks,chunk=4)")), "{cases:?}");

    let dir = tmp.path().join("fixed");
    let o = xtask(&["serving", "--device", "fixed", "--model", "tiny-llama", "--report-dir", dir.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(1), "unsupported is never green: {}", text(&o));
    let r = report(&dir);
    assert_eq!((r["summary"]["unsupported"].as_u64(), r["summary"]["executed"].as_u64()), (Some(1), Some(1)), "{r}");

    let o = xtask(&["serving", "--device", "cpu", "--model", "tiny-llama", "--prompt-ids", "1,2,3", "--prompt-len", "3"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("a request of 3 tokens with a prompt of 3"), "{}", stderr(&o));
}

/// The example engine serves schedules through touchstone_serving.py and passes every axis; each
/// seeded serving bug in a copy of it (engine.py or touchstone_serving.py) is red on the axis that
/// shows it, naming the request and a position.
#[test]
fn the_example_engine_serves_schedules_and_each_seeded_serving_bug_is_red() {
    if !python_with_reference_peers() {
        eprintln!("skipped: python3 with numpy and gguf is not installed");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = workspace().join("examples/external_engine");
    let ids = "1,15,27,3,9,44,8,2,19,33,5,12,40,7,21,30";
    let run = |engine_dir: &std::path::Path, report: &str| {
        let device = format!("exec:python3 {}", engine_dir.join("engine.py").display());
        let dir = tmp.path().join(report);
        let o = xtask(&["serving", "--device", &device, "--model", "tiny-llama", "--prompt-ids", ids, "--prompt-len", "10", "--report-dir", dir.to_str().unwrap()], &[]);
        (o, dir)
    };
    let (o, dir) = run(&src, "example");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(report(&dir)["batch_invariant"], true);

    // (name, file, the line as written, the line seeded, the axis that must show it)
    let bugs = [
        ("prefix holds a wrong token", "engine.py", "prefix=lambda cache, n: list(cache[:n])", "prefix=lambda cache, n: list(cache[:n - 1]) + [0]", "prefix_cache"),
        ("recycled slot not cleared", "touchstone_serving.py", "                slots[r[\"slot\"]] = empty()", "                slots[r[\"slot\"]] = slots[r[\"slot\"]] if slots[r[\"slot\"]] is not None else empty()", "slot_reuse"),
        ("logits of two rows swapped", "touchstone_serving.py", "        for i, rows in zip(active, step(batch)):", "        answers = step(batch)\n        if len(answers) > 1:\n            last = answers[0][-1].copy()\n            answers[0][-1] = answers[1][-1]\n            answers[1][-1] = last\n        for i, rows in zip(active, answers):", "batch"),
        ("a neighbour's last token leaks into the context", "engine.py", "        for cache, ids in batch:\n            cache.extend(ids)\n            taps = {}\n            out.append(forward(cfg, w, cache, taps)[-len(ids):])", "        for j, (cache, ids) in enumerate(batch):\n            cache.extend(ids)\n            taps = {}\n            leak = batch[j - 1][0][-1:] if j > 0 else []\n            out.append(forward(cfg, w, leak + cache, taps)[-len(ids):])", "neighbours"),
        ("the cache dropped at a chunk boundary", "engine.py", "            out.append(forward(cfg, w, cache, taps)[-len(ids):])", "            out.append(forward(cfg, w, cache[-len(ids) - 1:] if len(cache) > len(ids) else cache, taps)[-len(ids):])", "chunks"),
    ];
    for (name, file, line, seeded_line, axis) in bugs {
        let copy = tmp.path().join(axis);
        std::fs::create_dir(&copy).unwrap();
        for f in ["engine.py", "touchstone_dump.py", "touchstone_serving.py"] {
            std::fs::copy(src.join(f), copy.join(f)).unwrap();
        }
        let text_of = std::fs::read_to_string(copy.join(file)).unwrap();
        let seeded = text_of.replace(line, seeded_line);
        assert_ne!(text_of, seeded, "{name}: the seeded line is in {file}");
        std::fs::write(copy.join(file), seeded).unwrap();
        let (o, dir) = run(&copy, &format!("seeded-{axis}"));
        assert_eq!(o.status.code(), Some(1), "{name}: {}", text(&o));
        let r = report(&dir);
        let red: Vec<&serde_json::Value> = r["cases"].as_array().unwrap().iter().filter(|c| c["verdict"] == "fail").collect();
        let on_axis = red.iter().find(|c| c["id"].as_str().unwrap().contains(&format!("axis={axis},")));
        let Some(c) = on_axis else { panic!("{name}: not red on {axis}: {:?}", red.iter().map(|c| &c["id"]).collect::<Vec<_>>()) };
        let msg = c["message"].as_str().unwrap();
        assert!(msg.contains(&format!("axis {axis}")) && msg.contains("request `") && msg.contains("position"), "{name}: {msg}");
        // The engine wrote the request's taps as it served it: the first that differs is named.
        if let Some(tap) = [("prefix_cache", "blk.0.attn_kqv"), ("neighbours", "blk.0.attn_kqv")].iter().find(|(a, _)| *a == axis).map(|(_, t)| t) {
            assert!(msg.contains(&format!("first tap that differs: {tap}")), "{name}: {msg}");
            assert_eq!(c["metrics"]["first_tap"], *tap, "{name}");
        }
    }
}

/// llama.cpp serving schedules through its multi-sequence batch API (tools/peers/llama_cpp_dump.py,
/// TOUCHSTONE_TASK=schedule): every axis and random schedules green against its declared
/// arithmetic's bound, the isolation axes bit for bit; a copy of the peer that does not clear a
/// recycled sequence is red on `slot_reuse`. A development peer: skipped, saying so, without
/// `pip install llama-cpp-python`.
#[test]
fn llama_cpp_serves_schedules_within_its_bound_and_a_seeded_bug_is_red() {
    let probe = std::process::Command::new("python3").args(["-c", "import llama_cpp, gguf, numpy"]).output();
    if !matches!(probe, Ok(ref o) if o.status.success()) {
        eprintln!("SKIPPED: llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp, ~12 min)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let peer = workspace().join("tools/peers/llama_cpp_dump.py");
    let run = |script: &std::path::Path, report: &str| {
        let dir = tmp.path().join(report);
        let device = format!("exec:python3 {}", script.display());
        let o = xtask(&["serving", "--device", &device, "--model", "tiny-llama", "--random", "10", "--report-dir", dir.to_str().unwrap()], &[]);
        (o, dir)
    };
    let (o, dir) = run(&peer, "llama");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report(&dir);
    assert_eq!(r["batch_invariant"], false);
    // Its declared arithmetic came with its answer (Q8 activations, an f16 cache).
    assert_eq!(r["arithmetic"]["kv_cache"], "f16", "{}", r["arithmetic"]);
    let cases = r["cases"].as_array().unwrap();
    for axis in ["neighbours", "slot_reuse"] {
        let c = cases.iter().find(|c| c["id"].as_str().unwrap().contains(&format!("axis={axis},")) && !c["id"].as_str().unwrap().ends_with(":vs_oracle")).unwrap();
        assert_eq!((c["verdict"].as_str(), c["tolerance"]["bound"].as_f64()), (Some("pass"), Some(0.0)), "{c}");
    }
    assert!(text(&o).contains("slot_reuse ") && text(&o).contains("bit-identical"), "the per-axis summary is printed: {}", text(&o));

    // Seeded copies (beside a link to the example engine they import from): a recycled sequence
    // not cleared (llama.cpp refuses the positions: the schedule that shows it is an error named
    // on its axis, never green); each row given another row's logits (red on the batch axis,
    // naming request and position).
    let copy_dir = tmp.path().join("peer/tools/peers");
    std::fs::create_dir_all(&copy_dir).unwrap();
    std::os::unix::fs::symlink(workspace().join("examples"), tmp.path().join("peer/examples")).unwrap();
    let text_of = std::fs::read_to_string(&peer).unwrap();
    let bugs = [
        ("            else:\n                llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)\n", "            else:\n                pass\n", "slot_reuse", "error", "step 34", 2),
        ("llama_cpp.llama_get_logits_ith(ctx, j)", "llama_cpp.llama_get_logits_ith(ctx, len(entries) - 1 - j)", "batch", "fail", "position", 1),
    ];
    for (line, seeded_line, axis, verdict, names, code) in bugs {
        assert_eq!(text_of.matches(line).count(), 1, "the line the bug is seeded in: {line}");
        let seeded = copy_dir.join("llama_cpp_dump.py");
        std::fs::write(&seeded, text_of.replace(line, seeded_line)).unwrap();
        let (o, dir) = run(&seeded, axis);
        assert_eq!(o.status.code(), Some(code), "{axis}: {}", text(&o));
        let red: Vec<serde_json::Value> = report(&dir)["cases"].as_array().unwrap().iter().filter(|c| c["verdict"] == verdict).cloned().collect();
        assert!(red.iter().any(|c| c["id"].as_str().unwrap().contains(&format!("axis={axis},")) && c["message"].as_str().unwrap().contains(names)), "{axis}: {red:?}");
    }
}
