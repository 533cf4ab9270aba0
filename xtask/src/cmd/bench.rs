//! `cargo xtask bench`: prefill and decode throughput, time to first token, inter-token latency
//! percentiles, peak resident memory and the machine's state per repetition (every raw sample kept
//! in report.json); for the oracle also its weight bandwidth against a probe taken in the same run;
//! for GPU devices the device memory peak, the kernel launches of a prefill and of a decode step,
//! and a decode step's kernel time. An `exec:CMD` engine is timed through the arm protocol of
//! `ab` (one JSON line per run, a fresh process each): the same figures from its own timings,
//! its peak RSS as its line states it.

use devices::DeviceSpec;
use crate::Exit;
use oracle::Precision;
use serde_json::json;
use std::path::PathBuf;

/// The defaults of a bench run (the `bench` command's and `gate --suite bench`'s): `ab`'s
/// lengths, so a tok/s figure means the same in both.
use super::ab::{GEN_LEN, PROMPT_LEN};
pub const REPS: usize = 3;

#[derive(clap::Args)]
pub struct BenchArgs {
    #[arg(long, default_value = "ref", value_parser = super::device_arg, help = concat!("Device to time: ", devices::device_names!(), "; exec:CMD here answers `ab`'s arm protocol (one JSON line per run; `cargo xtask ab --help`)."))]
    device: DeviceSpec,
    #[arg(long, default_value = "smollm2", help = concat!("Model: ", fixtures::model_names!(), ", or a path to a .gguf file, a flat file (`export`) or a safetensors directory."))]
    model: String,
    /// Prompt length in tokens (token ids 1..=N cycled through the vocabulary).
    #[arg(long, default_value_t = PROMPT_LEN)]
    prompt_len: usize,
    /// Tokens generated per repetition.
    #[arg(long, default_value_t = GEN_LEN)]
    gen_len: usize,
    /// Measured repetitions (after one warm-up).
    #[arg(long, default_value_t = REPS)]
    reps: usize,
    /// Where report.json (with every raw sample), report.md and the latency plot go (default target/touchstone/bench-YYYYMMDD-HHMMSS/, the start time in UTC).
    #[arg(long)]
    report_dir: Option<PathBuf>,
    /// Oracle storage precision (`--device ref`): f32 (f64 accumulation) or f64 throughout.
    #[arg(long, default_value = "f32")]
    precision: Precision,
    /// Batched decode instead (a device that serves schedules: cpu): batch sizes, comma-separated,
    /// one of them 1 (e.g. `1,4,16`). Every repetition serves each size once, in an order rotated
    /// per repetition: N requests prefilled together, then decoded together one token per step.
    /// Reports decode tok/s over all requests per size and its paired ratio against batch 1
    /// (Hodges-Lehmann estimate, 95% CI: take --reps 8 or more).
    #[arg(long, value_delimiter = ',')]
    batch: Vec<usize>,
}

mod batch;

pub fn main(a: BenchArgs) -> Result<u8, Exit> {
    super::check_report_dir(a.report_dir.as_deref())?;
    if !a.batch.is_empty() {
        return batch::main(&a);
    }
    let opened = super::open_device(&a.device)?;
    check_sizes(a.prompt_len, a.gen_len, a.reps)?;
    super::print_timing_notes();
    let m = measure(opened, &a.model, a.precision, a.prompt_len, a.gen_len, a.reps).inspect_err(|e| {
        // A device that cannot serve this model says so in the report directory too, for the
        // `gate` that runs this bench in a process of its own (`case_in_own_process`).
        if let (true, Some(dir)) = (e.unavailable, a.report_dir.as_deref()) {
            let _ = std::fs::write(dir.join(UNAVAILABLE), &e.message);
        }
    })?;
    let (r, device_peak, kernels) = (&m.r, m.device_peak, &m.kernels);
    let med = suites::throughput::median;
    let path_note = if a.device.is_ref() { format!(", oracle dot path {}", r.dot_path) } else { String::new() };
    let precision = if a.device.is_ref() { format!(" precision {:?}", a.precision).to_lowercase() } else { String::new() };
    outln!("device {} model {}{precision}, {} threads{path_note}", a.device, a.model, r.threads);
    outln!("prefill ({} tokens): median {:.1} tok/s   samples {}", r.prompt_len, med(&r.prefill_tok_per_s), fmt(&r.prefill_tok_per_s));
    outln!("decode  ({} tokens): median {:.2} tok/s   samples {}", r.gen_len, med(&r.decode_tok_per_s), fmt(&r.decode_tok_per_s));
    let [p50, p90, p99] = r.itl_p50_p90_p99_ms;
    outln!("time to first token: median {:.1} ms; inter-token latency p50 {p50:.2} ms, p90 {p90:.2} ms, p99 {p99:.2} ms; peak RSS {}", med(&r.ttft_ms), r.peak_rss_kb.map_or("unknown".into(), |k| format!("{:.0} MiB", k as f64 / 1024.0)));
    if let Some(b) = device_peak {
        outln!("device memory peak: {:.1} MiB (weights, KV cache and activations held at once)", b as f64 / (1 << 20) as f64);
    }
    if let Some(k) = &kernels {
        outln!(
            "kernel launches: prefill ({} tokens) {}, decode {:.1} per token -> {:.2} us of decode time per launch",
            r.prompt_len,
            k.prefill_launches,
            k.launches_per_token(),
            1e6 / (med(&r.decode_tok_per_s) * k.launches_per_token())
        );
        let step_us = 1e6 / med(&r.decode_tok_per_s);
        let busy_us = 1e6 * k.seconds() / k.tokens as f64;
        outln!(
            "decode kernels (a profiled run, each launch timed alone): {busy_us:.1} us of kernel time per token = {:.0}% of the {step_us:.1} us a timed decode step took (what kernels leave of a step goes to launches and the host){}",
            100.0 * busy_us / step_us,
            k.profile.not_hardware.as_ref().map_or(String::new(), |why| format!(" ({why})"))
        );
        for t in k.top(5) {
            outln!("  {:<16} {:>6.1} launches {:>8.1} us per token ({:.0}% of kernel time)", t.kernel, t.launches as f64 / k.tokens as f64, 1e6 * t.seconds / k.tokens as f64, 100.0 * t.seconds / k.seconds().max(f64::MIN_POSITIVE));
        }
    }
    if r.effective_gbps.is_empty() {
        outln!("(this device does not report the bytes it reads per token: no bandwidth figures)");
        return write_report(&a, m);
    }
    let copy: Vec<f64> = r.probes.iter().map(|p| p.copy_gbps).collect();
    let read: Vec<f64> = r.probes.iter().map(|p| p.read_gbps).collect();
    outln!(
        "weights read per token {:.1} MB -> effective {:.2} GB/s (median)   samples {}",
        r.weight_bytes_per_token as f64 / 1e6,
        med(&r.effective_gbps),
        fmt(&r.effective_gbps)
    );
    outln!("probe before each rep (512 MB, same threads): copy {} GB/s, read {} GB/s", fmt(&copy), fmt(&read));
    outln!(
        "effective / probe, median of per-rep ratios: {:.0}% of STREAM-style copy, {:.0}% of read-only",
        100.0 * r.fraction_of_copy_probe,
        100.0 * r.fraction_of_read_probe
    );
    write_report(&a, m)
}

/// One bench measurement: the timed generations, the device memory peak, and (GPU devices) the
/// kernels of a decode step.
pub struct Measured {
    r: suites::throughput::RefBench,
    device_peak: Option<u64>,
    kernels: Option<DecodeKernels>,
    /// The oracle's weight store (`decoded` or `packed`; None for a device): packed decode steps
    /// are slower, so a figure says which it is.
    oracle_weights: Option<&'static str>,
}

/// A bench needs a prompt, two generated tokens (a decode step to time) and one repetition.
fn check_sizes(prompt_len: usize, gen_len: usize, reps: usize) -> Result<(), Exit> {
    if prompt_len == 0 || gen_len < 2 || reps == 0 {
        return Err(Exit::new(2, format!("--prompt-len >= 1, --gen-len >= 2 and --reps >= 1 are required (given {prompt_len}, {gen_len}, {reps})")));
    }
    Ok(())
}

/// Loads `model` on `device` (opened by the caller) and times `reps` greedy generations of
/// `gen_len` tokens after a `prompt_len`-token prompt, with a progress bar.
pub fn measure(opened: super::OpenedDevice, model: &str, precision: Precision, prompt_len: usize, gen_len: usize, reps: usize) -> Result<Measured, Exit> {
    check_sizes(prompt_len, gen_len, reps)?;
    let device = opened.spec().clone();
    if let Some(cmd) = device.name().strip_prefix("exec:") {
        return measure_exec(cmd, model, prompt_len, gen_len, reps);
    }
    let (_, mut engine, _) = super::load_engine_on(model, opened, precision)?;
    let prompt = super::bench_prompt(prompt_len, gen_len, engine.spec().n_vocab)?;
    super::check_kv_fits("bench", engine.spec(), prompt_len.saturating_add(gen_len))?;
    let pb = indicatif::ProgressBar::new(reps as u64);
    pb.set_style(indicatif::ProgressStyle::with_template("bench {prefix} {pos}/{len} [{bar:30}] {elapsed}").expect("template"));
    // A prefix, not part of the template: a model path may hold braces.
    pb.set_prefix(format!("{device} / {model}"));
    let r = match &mut engine {
        super::Engine::Oracle(model) => suites::throughput::bench_ref(model, &prompt, gen_len, reps, |i| pb.set_position(i as u64))?,
        engine => {
            let greedy = oracle::ops::SamplerConfig::GREEDY;
            suites::throughput::bench_with(|p, n| engine.generate(p, n, &greedy, 0, &[]), 0, &prompt, gen_len, reps, |i| pb.set_position(i as u64))?
        }
    };
    pb.finish_and_clear();
    let device_peak = engine.memory_peak_bytes();
    let kernels = profile_decode(&mut engine, &prompt, gen_len)?;
    let oracle_weights = match &engine {
        super::Engine::Oracle(m) => Some(m.store().name()),
        _ => None,
    };
    Ok(Measured { r, device_peak, kernels, oracle_weights })
}

/// An `exec:` engine timed through `ab`'s arm protocol: one fresh process per run (a warm-up of
/// two tokens, then `reps` runs), each run's line checked as `ab` checks it. Its figures are its
/// own timings; its peak RSS the largest its lines state (none when they state none).
fn measure_exec(cmd: &str, model: &str, prompt_len: usize, gen_len: usize, reps: usize) -> Result<Measured, Exit> {
    let path = super::resolve_model(model)?;
    let (_, spec, _) = oracle::loader::open_model(&path)?;
    let prompt = super::bench_prompt(prompt_len, gen_len, spec.n_vocab)?;
    let ids = prompt.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let timeout = std::time::Duration::from_secs(super::ab::DEFAULT_TIMEOUT_S);
    let peak = std::cell::Cell::new(None::<u64>);
    let pb = indicatif::ProgressBar::new(reps as u64);
    pb.set_style(indicatif::ProgressStyle::with_template("bench {prefix} {pos}/{len} [{bar:30}] {elapsed}").expect("template"));
    pb.set_prefix(format!("exec:{cmd} / {model}"));
    let run = |p: &[u32], n: usize| -> Result<oracle::generate::Generation, Exit> {
        let s = super::ab::run_exec(cmd, &path, &ids, n, timeout).map_err(|e| Exit::new(2, format!("exec:{cmd}: {e}")))?;
        peak.set(peak.get().max(s.peak_rss_kb));
        Ok(oracle::generate::Generation { prompt: p.to_vec(), decode_steps: s.n_gen - 1, prefill_s: s.prefill_ms / 1e3, decode_s: s.decode_ms / 1e3, step_s: s.step_ms.iter().map(|m| m / 1e3).collect(), tokens: s.tokens })
    };
    let mut r = suites::throughput::bench_with(run, 0, &prompt, gen_len, reps, |i| pb.set_position(i as u64))?;
    pb.finish_and_clear();
    // What this process held is not the engine's.
    r.peak_rss_kb = peak.get();
    r.machine.iter_mut().for_each(|m| m.peak_rss_kb = None);
    Ok(Measured { r, device_peak: None, kernels: None, oracle_weights: None })
}

/// The file a bench writes in its report directory when the device cannot serve the model at
/// all (its message inside): `gate` reports that case unsupported, not as an error.
const UNAVAILABLE: &str = "device-unavailable.txt";

/// One bench case run by `bench` in a process of its own (`gate --suite bench`): its peak RSS is
/// then the case's, whatever ran before it in the gate. Returns the case and the charts it drew.
pub fn case_in_own_process(device: &str, model: &str) -> Result<(reports::Case, Vec<(String, reports::plot::Chart)>), Exit> {
    let exe = std::env::current_exe().map_err(|e| Exit::new(2, format!("cannot find this program to run `bench`: {e}")))?;
    let dir = tempfile::tempdir().map_err(|e| Exit::new(2, format!("cannot create a report directory for `bench`: {e}")))?;
    let o = std::process::Command::new(exe)
        .args(["bench", "--device", device, "--model", model, "--reps", &REPS.to_string(), "--report-dir"])
        .arg(dir.path())
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| Exit::new(2, format!("cannot run `bench`: {e}")))?;
    let file = dir.path().join("report.json");
    let report: Option<reports::Report> = std::fs::read_to_string(&file).ok().and_then(|t| serde_json::from_str(&t).ok());
    match report.and_then(|r| {
        let charts = r.charts().unwrap_or_default();
        r.cases.into_iter().next().map(|c| (c, charts))
    }) {
        Some(found) => Ok(found),
        None => {
            let err = String::from_utf8_lossy(&o.stderr);
            let tail: Vec<&str> = err.lines().rev().take(3).collect();
            let e = Exit::new(2, format!("bench on {device} / {model} ({}): {}", o.status, tail.into_iter().rev().collect::<Vec<_>>().join(" / ")));
            Err(Exit { unavailable: dir.path().join(UNAVAILABLE).is_file(), ..e })
        }
    }
}

/// The report case of a measurement: its figures as metrics, and a verdict on what the figures
/// rest on (`RefBench::problems`: every repetition generated the tokens asked for, the same
/// ones, with finite positive timings). Speed itself has no target here: a regression is
/// judged by `ab` (paired, interleaved runs) or the criterion benches.
pub fn case(device: &str, model: &str, m: &Measured) -> reports::Case {
    let (r, kernels) = (&m.r, &m.kernels);
    let med = suites::throughput::median;
    let mut metrics = reports::Metrics::new();
    metrics.set("prefill_tok_per_s", med(&r.prefill_tok_per_s));
    metrics.set("decode_tok_per_s", med(&r.decode_tok_per_s));
    metrics.set("ttft_ms", med(&r.ttft_ms));
    metrics.set("itl_p50_p90_p99_ms", r.itl_p50_p90_p99_ms);
    metrics.set("peak_rss_kb", r.peak_rss_kb);
    metrics.set("device_memory_peak_bytes", m.device_peak);
    metrics.set("kernel_launches_prefill", kernels.as_ref().map(|k| k.prefill_launches));
    metrics.set("kernel_launches_per_decode_token", kernels.as_ref().map(|k| k.launches_per_token()));
    let kernel_us = kernels.as_ref().map(|k| 1e6 * k.seconds() / k.tokens as f64);
    metrics.set("decode_kernel_us_per_token", kernel_us);
    metrics.set("decode_kernel_busy_fraction", kernel_us.map(|us| us * med(&r.decode_tok_per_s) / 1e6));
    metrics.set("output_hash", r.output_hashes.first());
    if let Some(store) = m.oracle_weights {
        metrics.set("oracle_weights", store);
    }
    let problems = r.problems();
    reports::Case {
        id: format!("bench(device={device},model={model},prompt={},gen={})", r.prompt_len, r.gen_len),
        device: device.to_string(),
        verdict: if problems.is_empty() { reports::Verdict::Pass } else { reports::Verdict::Fail },
        metrics,
        tolerance: reports::Tolerance { rule: "every repetition generates the tokens asked for, the same tokens, with finite positive timings (speed has no target here: `ab` judges regressions)".into(), bound: 0.0 },
        margin: 0.0,
        message: (!problems.is_empty()).then(|| problems.join("; ")),
    }
}

/// The figure columns of a bench table, as `table_row` fills them.
pub const TABLE_COLUMNS: [&str; 5] = ["prefill tok/s", "decode tok/s", "TTFT ms", "ITL p50 / p90 / p99 ms", "peak RSS MiB"];

/// A bench case's figures (medians over its repetitions) in `TABLE_COLUMNS` order, read from the
/// metrics `case` wrote; "-" where one is absent (e.g. no peak RSS on this OS).
pub fn table_row(c: &reports::Case) -> Vec<String> {
    let num = |key: &str, digits: usize, scale: f64| c.metrics.get(key).and_then(|v| v.as_f64()).map_or("-".into(), |v| format!("{:.*}", digits, v * scale));
    let itl = match c.metrics.get("itl_p50_p90_p99_ms").and_then(|v| v.as_array()).map(|a| a.iter().filter_map(|x| x.as_f64()).collect::<Vec<_>>()) {
        Some(p) if p.len() == 3 => format!("{:.2} / {:.2} / {:.2}", p[0], p[1], p[2]),
        _ => "-".into(),
    };
    vec![num("prefill_tok_per_s", 1, 1.0), num("decode_tok_per_s", 2, 1.0), num("ttft_ms", 1, 1.0), itl, num("peak_rss_kb", 0, 1.0 / 1024.0)]
}

/// The kernels of the prefill and of the decode steps of one greedy generation (GPU devices).
struct DecodeKernels {
    /// Launches of the prefill (a generation of one token).
    prefill_launches: u64,
    /// The decode steps' kernels.
    profile: devices::KernelProfile,
    /// Decode steps the profile covers.
    tokens: usize,
}

impl DecodeKernels {
    fn seconds(&self) -> f64 {
        self.profile.seconds()
    }
    fn launches_per_token(&self) -> f64 {
        self.profile.launches() as f64 / self.tokens as f64
    }
    /// The `n` kernels that took the most time.
    fn top(&self, n: usize) -> Vec<&devices::KernelTime> {
        let mut k: Vec<_> = self.profile.kernels.iter().collect();
        k.sort_by(|a, b| b.seconds.total_cmp(&a.seconds).then(a.kernel.cmp(&b.kernel)));
        k.truncate(n);
        k
    }
}

/// Profiles two untimed greedy generations of the bench prompt, of 1 token (the prefill alone)
/// and of `gen_len` tokens, each launch counted and timed alone; their difference is the kernels
/// of `gen_len - 1` decode steps. Their sum against the timed decode step says how much of a step
/// the GPU spends computing: far under 100% means the step is bound by launches and the host, not
/// by kernels. None for engines without kernels to profile.
fn profile_decode(engine: &mut super::Engine, prompt: &[u32], gen_len: usize) -> Result<Option<DecodeKernels>, Exit> {
    let greedy = oracle::ops::SamplerConfig::GREEDY;
    let mut profile_of = |n: usize| -> Result<Option<devices::KernelProfile>, Exit> {
        if !engine.start_kernel_profile() {
            return Ok(None);
        }
        let run = engine.generate(prompt, n, &greedy, 0, &[]);
        let profile = engine.take_kernel_profile();
        run?;
        Ok(profile)
    };
    let (Some(prefill), Some(all)) = (profile_of(1)?, profile_of(gen_len)?) else { return Ok(None) };
    Ok(Some(DecodeKernels { prefill_launches: prefill.launches(), profile: all.minus(&prefill), tokens: gen_len - 1 }))
}

/// report.json (the bench section holds every raw sample), report.md with the summary table, and
/// the inter-token latency distribution plot.
fn write_report(a: &BenchArgs, m: Measured) -> Result<u8, Exit> {
    use reports::plot::{Chart, Series};
    let case = case(a.device.name(), &a.model, &m);
    if let Some(why) = &case.message {
        outln!("FAIL: {why}");
    }
    let mut row = table_row(&case);
    let Measured { r, kernels, .. } = m;
    row.push(r.reps.to_string());
    let mut report = reports::Report::new("bench", reports::Provenance::collect(r.threads), vec![case]);
    let columns: Vec<&str> = TABLE_COLUMNS.iter().copied().chain(["reps"]).collect();
    report.add_table("bench_table", &format!("{} on {} ({} threads)", a.device, a.model, r.threads), &columns, vec![row]);
    let series = r
        .itl_ms
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let mut v = v.clone();
            v.sort_by(f64::total_cmp);
            let n = v.len().max(1) as f64;
            Series { name: format!("rep {}", i + 1), points: v.iter().enumerate().map(|(k, x)| (100.0 * (k as f64 + 0.5) / n, *x)).collect(), colour: i, dashed: false }
        })
        .collect();
    report.add_chart("itl_distribution", Chart { title: format!("{} on {}: inter-token latency by percentile", a.device, a.model), x_label: "percentile".into(), y_label: "ms".into(), log_y: false, series, band: None, markers: Vec::new(), panels: false });
    if let Some(k) = &kernels {
        let rows = k
            .top(usize::MAX)
            .into_iter()
            .map(|t| vec![t.kernel.clone(), format!("{:.1}", t.launches as f64 / k.tokens as f64), format!("{:.2}", 1e6 * t.seconds / k.tokens as f64), format!("{:.1}%", 100.0 * t.seconds / k.seconds().max(f64::MIN_POSITIVE))])
            .collect();
        let title = format!("{}: kernels of a decode step ({} steps profiled, each launch timed alone){}", a.device, k.tokens, k.profile.not_hardware.as_ref().map_or(String::new(), |why| format!("; {why}")));
        report.add_table("decode_kernels", &title, &["kernel", "launches per token", "us per token", "of kernel time"], rows);
        report.sections.insert("decode_kernel_profile".into(), json!({"tokens": k.tokens, "profile": k.profile}));
    }
    report.set_section("bench", &r);
    let dir = super::write_report(&mut report, a.report_dir.clone())?;
    outln!("report: {}", dir.join("report.json").display());
    Ok(report.exit_code())
}

/// Samples as `[13237.54, 11325.18]`.
fn fmt(v: &[f64]) -> String {
    format!("[{}]", v.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(", "))
}
