//! `bench --batch 1,4,16`: batched decode throughput of a device that serves schedules
//! (`oracle::schedule`), the batch sizes paired repetition by repetition.
//!
//! A repetition serves, for each batch size in an order rotated per repetition, one schedule of
//! N requests that arrive together: their prompts (the bench prompt, its ids shifted per request)
//! prefilled in one step, then one decode step per generated token with every request feeding
//! one token, teacher-forced on the greedy continuation of the first request (the cost of a step
//! does not depend on which ids it feeds). The device times each step. A batch size's decode
//! throughput is N x steps / their seconds; its speedup over batch 1 is the Hodges-Lehmann
//! estimate of the per-repetition ratios with its 95% interval (`suites::ab::paired_speedup`).

use crate::Exit;
use oracle::schedule::{Request, Schedule};
use suites::ab::paired_speedup;
use suites::throughput::{median, BatchRep};

/// The largest batch `--batch` takes.
const MAX_BATCH: usize = 1024;

pub fn check_batches(batches: &[usize]) -> Result<(), Exit> {
    if let Some(b) = batches.iter().find(|b| **b == 0 || **b > MAX_BATCH) {
        return Err(Exit::new(2, format!("--batch {b}: batch sizes from 1 to {MAX_BATCH}")));
    }
    if !batches.contains(&1) {
        return Err(Exit::new(2, "--batch: include 1, the size every other is paired with (e.g. --batch 1,4,16)"));
    }
    Ok(())
}

/// The schedule of one batch: `n` requests in slots 0..n, prompt then decode tokens.
fn schedule(prompt: &[u32], decoded: &[u32], n: usize, n_vocab: usize) -> Schedule {
    let requests = (0..n)
        .map(|k| {
            let shifted = prompt.iter().map(|t| ((*t as u64 + 97 * k as u64) % n_vocab as u64) as u32);
            let tokens: Vec<u32> = shifted.chain(decoded.iter().copied()).collect();
            let mut chunks = vec![prompt.len()];
            chunks.extend(std::iter::repeat(1).take(decoded.len()));
            Request { id: format!("r{k}"), tokens, arrive: 0, chunks, slot: k, prefix: None }
        })
        .collect();
    Schedule { slots: n, requests }
}

pub fn main(a: &super::BenchArgs) -> Result<u8, Exit> {
    check_batches(&a.batch)?;
    let opened = super::super::open_device(&a.device)?;
    super::check_sizes(a.prompt_len, a.gen_len, a.reps)?;
    super::super::print_timing_notes();
    let (_, mut engine, _) = super::super::load_engine_on(&a.model, opened, a.precision)?;
    let spec = engine.spec().clone();
    let prompt = super::super::bench_prompt(a.prompt_len, a.gen_len, spec.n_vocab)?;
    super::super::check_kv_fits("bench", &spec, a.prompt_len.saturating_add(a.gen_len))?;
    let greedy = oracle::ops::SamplerConfig::GREEDY;
    let continuation = engine.generate(&prompt, a.gen_len, &greedy, 0, &[])?.tokens;
    let super::super::Engine::Device(m) = &mut engine else {
        return Err(Exit::new(2, format!("--batch: {} runs one request at a time; batches are timed on a device that serves schedules (cpu)", a.device)));
    };
    if continuation.len() != a.gen_len {
        return Err(Exit::new(2, format!("{}: generated {} tokens, not {}", a.device, continuation.len(), a.gen_len)));
    }
    // Fed after the prompt: every generated token but the last (whose logits nobody reads).
    let decoded = &continuation[..a.gen_len - 1];
    let mut batches = a.batch.clone();
    batches.sort_unstable();
    batches.dedup();
    let mut serve = |n: usize| -> Result<(Vec<f64>, Vec<String>), Exit> {
        let s = schedule(&prompt, decoded, n, spec.n_vocab);
        let mut step_s = Vec::new();
        let served = m.serve_timed(&s, &mut step_s).ok_or_else(|| Exit::new(2, format!("--batch: {} does not serve schedules (docs/SERVING_PROTOCOL.md)", a.device)))?.map_err(Exit::from)?;
        if step_s.len() != a.gen_len {
            return Err(Exit::new(2, format!("--batch: {} timed {} steps of a schedule of {} (it does not time its steps)", a.device, step_s.len(), a.gen_len)));
        }
        // The first request's greedy tokens, from its logits: what batch 1's generation gave.
        let mut problems = Vec::new();
        let logits = served.get("r0").map(Vec::as_slice).unwrap_or_default();
        let v = spec.n_vocab;
        for (i, want) in continuation.iter().enumerate() {
            let row = a.prompt_len - 1 + i;
            let got = logits.get(row * v..(row + 1) * v).map(|l| oracle::ops::argmax(l) as u32);
            if got != Some(*want) {
                problems.push(format!("batch {n}: request r0's greedy token {} is {got:?}, the batch-1 generation's {want}", i + 1));
                break;
            }
        }
        Ok((step_s, problems))
    };
    // Warm-up: each batch size once (pages in its cache and scratch sizes).
    for &n in &batches {
        serve(n)?;
    }
    let pb = indicatif::ProgressBar::new((a.reps * batches.len()) as u64);
    pb.set_style(indicatif::ProgressStyle::with_template("bench {prefix} {pos}/{len} [{bar:30}] {elapsed}").expect("template"));
    pb.set_prefix(format!("{} / {} batches {:?}", a.device, a.model, batches));
    let mut reps = Vec::new();
    let mut problems = Vec::new();
    for r in 0..a.reps {
        for j in 0..batches.len() {
            let n = batches[(j + r) % batches.len()];
            let (step_s, p) = serve(n)?;
            problems.extend(p);
            reps.push(BatchRep { batch: n, rep: r, prefill_s: step_s[0], step_s: step_s[1..].to_vec() });
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    problems.dedup();
    if let Some(t) = reps.iter().flat_map(|r| r.step_s.iter().chain([&r.prefill_s])).find(|t| !(t.is_finite() && **t > 0.0)) {
        problems.push(format!("a step took {t} s (every step's time must be finite and positive)"));
    }
    write_report(a, &batches, &reps, &problems)
}

fn write_report(a: &super::BenchArgs, batches: &[usize], reps: &[BatchRep], problems: &[String]) -> Result<u8, Exit> {
    let threads = rayon::current_num_threads();
    outln!("device {} model {}, {threads} threads, prompt {} tokens, {} decode steps, {} repetitions paired", a.device, a.model, a.prompt_len, a.gen_len - 1, a.reps);
    let mut cases = Vec::new();
    let mut rows = Vec::new();
    for &n in batches {
        let of: Vec<&BatchRep> = reps.iter().filter(|r| r.batch == n).collect();
        let decode: Vec<f64> = of.iter().map(|r| r.decode_tok_per_s()).collect();
        let prefill: Vec<f64> = of.iter().map(|r| r.prefill_tok_per_s(a.prompt_len)).collect();
        let step_ms: Vec<f64> = of.iter().flat_map(|r| r.step_s.iter().map(|s| s * 1e3)).collect();
        let speedup = if n == 1 { None } else { paired_speedup(reps, n) };
        let speedup_text = match speedup {
            Some((e, lo, hi)) if hi.is_finite() => format!("{e:.2}x (95% CI {lo:.2}-{hi:.2})"),
            Some((e, _, _)) => format!("{e:.2}x (too few repetitions for an interval)"),
            None => "-".into(),
        };
        outln!("batch {n:>4}: decode median {:.1} tok/s (step p50 {:.2} ms), prefill median {:.1} tok/s; against batch 1: {speedup_text}", median(&decode), median(&step_ms), median(&prefill));
        rows.push(vec![n.to_string(), format!("{:.1}", median(&decode)), format!("{:.2}", median(&step_ms)), format!("{:.1}", median(&prefill)), speedup_text]);
        let mut metrics = reports::Metrics::new();
        metrics.set("batch", n);
        metrics.set("decode_tok_per_s", median(&decode));
        metrics.set("decode_step_ms_p50", median(&step_ms));
        metrics.set("prefill_tok_per_s", median(&prefill));
        metrics.set("decode_speedup_vs_batch1", speedup.map(|s| [s.0, s.1, s.2]));
        let mine: Vec<&String> = problems.iter().filter(|p| p.starts_with(&format!("batch {n}:")) || !p.starts_with("batch ")).collect();
        cases.push(reports::Case {
            id: format!("bench(device={},model={},prompt={},gen={},batch={n})", a.device.name(), a.model, a.prompt_len, a.gen_len),
            device: a.device.name().to_string(),
            verdict: if mine.is_empty() { reports::Verdict::Pass } else { reports::Verdict::Fail },
            metrics,
            tolerance: reports::Tolerance { rule: "the first request's greedy tokens are batch 1's generation, every step timed finite and positive (speed has no target here)".into(), bound: 0.0 },
            margin: 0.0,
            message: (!mine.is_empty()).then(|| mine.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("; ")),
        });
    }
    for p in problems {
        outln!("FAIL: {p}");
    }
    let mut report = reports::Report::new("bench", reports::Provenance::collect(threads), cases);
    let title = format!("{} on {}: batched decode ({threads} threads, prompt {}, {} decode steps, {} paired repetitions)", a.device, a.model, a.prompt_len, a.gen_len - 1, a.reps);
    report.add_table("bench_batch_table", &title, &["batch", "decode tok/s", "step p50 ms", "prefill tok/s", "decode tok/s against batch 1"], rows);
    report.set_section("batched", &reps);
    let dir = super::super::write_report(&mut report, a.report_dir.clone())?;
    outln!("report: {}", dir.join("report.json").display());
    Ok(report.exit_code())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_schedule_is_valid_and_decodes_one_token_per_step() {
        let s = schedule(&[5, 6, 7], &[8, 9], 4, 10);
        s.validate().unwrap();
        assert_eq!(s.steps().len(), 3);
        assert!(s.steps().iter().all(|st| st.segments.len() == 4));
        assert_eq!(s.requests[1].tokens, vec![2, 3, 4, 8, 9]);
        assert_eq!(s.requests[3].chunks, vec![3, 1, 1]);
        assert!(check_batches(&[4, 16]).is_err() && check_batches(&[1, 0]).is_err() && check_batches(&[1, 4, 16]).is_ok());
    }
}
