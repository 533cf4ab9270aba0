//! `cargo xtask gate`: the main job. With no arguments it runs the oracle self-check suite over
//! the synthetic models, the kernel suite on the `cpu` and `fixed` devices, and the layer-diff
//! and fixed-token suites for those devices over the synthetic models; prints a summary, writes
//! one report, and exits per the contract. A model a device cannot run (one it has no kernels for)
//! is an `unsupported` case, never a pass. The bench suite (`--suite bench`, not in
//! the default set: timings on a shared CI machine are noise unless paired, which `ab` does) times
//! greedy generation on each device and model and fails a run whose repetitions did not all
//! generate the same, complete output.

use super::resolve_model;
use crate::Exit;
use reports::{Provenance, Report};
use std::path::PathBuf;

/// The suites `gate` runs when none is named.
const DEFAULT_SUITES: [&str; 5] = ["oracle", "kernels", "layers", "tokens", "serving"];
const SUITES: [&str; 6] = ["oracle", "kernels", "layers", "tokens", "serving", "bench"];


#[derive(clap::Args)]
pub struct GateArgs {
    #[arg(long, help = concat!("Devices (default: cpu and fixed): ", devices::device_names!(), "; repeat the flag or give a comma list (`cpu,fixed`). An engine command (`exec:`, `ids:`, `external:`) is taken whole, commas and all."))]
    device: Vec<String>,
    #[arg(long, help = concat!("Models for the oracle self-check, layer-diff and fixed-token (default: the synthetic fixtures ", fixtures::synthetic_model_names!(), "): ", fixtures::model_names!(), ", or a path to a .gguf file, a flat file (`export`) or a safetensors directory; repeat the flag or give a comma list (a path that exists is taken whole)."))]
    model: Vec<String>,
    /// Suites: oracle, kernels, layers, tokens, serving (default: these five; serving is
    /// unsupported, never green, on a device that serves no schedules), bench (throughput on each
    /// device and model with `bench`'s defaults, each case in a process of its own; it fails when
    /// the repetitions' greedy outputs differ or stop short, and records the figures); repeat the
    /// flag or give a comma list (`layers,tokens`).
    #[arg(long, value_delimiter = ',')]
    suite: Vec<String>,
    /// Run shard K of N of the kernel cases (with `--suite kernels` alone: the other suites are
    /// not split, so each shard would run them whole and the shards' reports would not merge).
    #[arg(long)]
    shard: Option<String>,
    /// A label for the device (one `--device` only) in the console, report.json, report.md and
    /// JUnit (class names `touchstone.RUNG.LABEL`); report.json's `engine_labels` keeps the
    /// command it stands for. Without it an external engine goes by the name it gives itself (a
    /// dump manifest's `device`, the op protocol's `name`), with " (external)" where that reads
    /// as another device.
    #[arg(long)]
    name: Option<String>,
    /// Where the reports go (default: target/touchstone/gate-YYYYMMDD-HHMMSS/, the start time in
    /// UTC): report.json, report.md (summary first, under 1 MiB, for a CI job summary), junit.xml,
    /// cases.csv, and every chart the rungs draw (`layers-DEVICE-MODEL-*.png`, `tokens-…`,
    /// `bench-…`).
    #[arg(long)]
    report_dir: Option<PathBuf>,
    /// Which taps each device must give in the layers suite (`layer-diff --require-taps`): `all`,
    /// `layers` (the default: every layer's `l_out` and the logits), a comma list of kinds, a
    /// fraction, or `none` (reported, not gated).
    #[arg(long, default_value = suites::coverage::DEFAULT)]
    require_taps: String,
}

/// Comma lists split into their items, except the values `whole` keeps as they are.
fn split_lists(values: &[String], whole: impl Fn(&str) -> bool) -> Vec<String> {
    values.iter().flat_map(|v| if whole(v) { vec![v.clone()] } else { v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect() }).collect()
}

pub fn main(mut a: GateArgs) -> Result<u8, Exit> {
    a.device = split_lists(&a.device, |d| ["exec:", "ids:", "external:"].iter().any(|p| d.starts_with(p)));
    a.model = split_lists(&a.model, |m| std::path::Path::new(m).exists());
    super::check_report_dir(a.report_dir.as_deref())?;
    let suites: Vec<String> = if a.suite.is_empty() { DEFAULT_SUITES.iter().map(|s| s.to_string()).collect() } else { a.suite.clone() };
    for s in &suites {
        if !SUITES.contains(&s.as_str()) {
            return Err(Exit::new(2, format!("no suite `{s}` (suites: {})", SUITES.join(", "))));
        }
    }
    if let Some(s) = a.shard.as_deref().filter(|_| suites.iter().any(|s| s != "kernels")) {
        return Err(Exit::new(2, format!("--shard {s} splits the kernel cases alone; the other suites would run whole in every shard (and the shards' reports not merge): give --suite kernels, and run the others unsharded")));
    }
    a.require_taps.parse::<suites::coverage::RequiredTaps>().map_err(|e| Exit::new(2, e))?;
    let device_names: Vec<String> = if a.device.is_empty() { vec!["cpu".into(), "fixed".into()] } else { a.device.clone() };
    super::check_label(a.name.as_deref())?;
    if a.name.is_some() && device_names.len() != 1 {
        return Err(Exit::new(2, format!("--name labels one device; {} are given", device_names.len())));
    }
    let label = |d: &str| a.name.clone().unwrap_or_else(|| d.to_string());
    // Each name parsed once (a comma list is split before clap could), then opened once.
    let specs = device_names.iter().map(|d| super::device_arg(d).map_err(|e| Exit::new(2, format!("--device: {e}")))).collect::<Result<Vec<devices::DeviceSpec>, _>>()?;
    if suites.iter().any(|s| s == "kernels") {
        device_names.iter().try_for_each(|d| super::check_runs_ops(d))?;
    }
    let devices = specs.iter().map(devices::open_spec).collect::<Result<Vec<_>, _>>().map_err(Exit::from)?;
    let shard = a.shard.as_deref().map(super::parse_shard).transpose()?;
    let mut cases = Vec::new();
    // The names external engines' dumps give themselves, for their labels.
    let mut declared = serde_json::Map::new();
    // Every chart the rungs draw, named by rung, device and model; and the layers rung's first
    // divergence per device and model.
    let mut charts: Vec<(String, reports::plot::Chart)> = Vec::new();
    let mut divergences: Vec<Vec<String>> = Vec::new();
    let models: Vec<String> = if a.model.is_empty() { ::fixtures::SYNTHETIC.iter().map(|s| s.to_string()).collect() } else { a.model.clone() };
    if suites.iter().any(|s| s == "oracle") {
        // A short fixed sequence (the default ids of layer-diff): crosses the prefill/decode
        // boundary and the YaRN/rope code paths.
        let tokens = super::layerdiff::DEFAULT_IDS;
        for m in &models {
            let path = resolve_model(m)?;
            eprintln!("gate: oracle self-check on {m} ...");
            cases.extend(suites::selfcheck::run(m, &path, &tokens)?);
        }
    }
    if suites.iter().any(|s| s == "kernels") {
        let opts = suites::kernels::KernelOptions { shard, ..Default::default() };
        let selected = suites::kernels::select_cases(&opts);
        for d in &devices {
            let pb = super::progress(selected.len() as u64, &format!("kernels on {}", d.name()));
            cases.extend(suites::kernels::run(d.as_ref(), &selected, false, |done, _| pb.set_position(done as u64)));
            pb.finish_and_clear();
        }
    }
    for suite in ["layers", "tokens", "serving", "bench"].into_iter().filter(|s| suites.iter().any(|x| x == s)) {
        for spec in &specs {
            let d = spec.name();
            for m in &models {
                eprintln!("gate: {suite} on {} / {m} ...", label(d));
                let t0 = std::time::Instant::now();
                let got = if suite == "layers" {
                    let args = super::layerdiff::LayerDiffArgs { device: spec.clone(), model: m.clone(), mode: None, prompt_ids: None, prompt: None, against: None, baseline_factor: 4.0, emulation_factor: suites::emulate::EMULATION_FACTOR, report_dir: None, require_taps: a.require_taps.clone(), name: None };
                    super::layerdiff::layer_diff(&args).map(|mut o| {
                        outln!("{}", super::layerdiff::story(&o, &label(d), m));
                        if let Some(div) = &o.findings.first_divergence {
                            outln!("  more: {}", super::layerdiff::next_steps(d, m, div));
                        }
                        divergences.push(super::layerdiff::divergence_row(&o, d, m));
                        charts.extend(o.report.charts().unwrap_or_default().into_iter().map(|(stem, c)| (chart_stem("layers", &label(d), m, &stem), c)));
                        declared.extend(o.report.sections.remove(super::DECLARED_NAMES).and_then(|v| v.as_object().cloned()).unwrap_or_default());
                        o.report.cases
                    })
                } else if suite == "serving" {
                    let args = super::serving::ServingArgs { device: spec.clone(), model: m.clone(), prompt_ids: None, prompt_len: None, seed: 1, random: 0, report_dir: None, name: None };
                    super::serving::serving(&args).map(|(r, _)| r.cases)
                } else if suite == "bench" {
                    super::bench::case_in_own_process(d, m).map(|(c, drawn)| {
                        charts.extend(drawn.into_iter().map(|(stem, c)| (chart_stem("bench", &label(d), m, &stem), c)));
                        vec![c]
                    })
                } else {
                    let args = super::fixedtoken::FixedTokenArgs { device: spec.clone(), model: m.clone(), golden: None, write_golden: false, n_generate: None, prompt: None, prompt_ids: None, prompt_file: None, baseline: None, baseline_factor: 1.5, emulation_factor: suites::fixedtoken::EMULATION_FACTOR, report_dir: None, name: None };
                    super::fixedtoken::fixed_token(&args).map(|r| {
                        r.map(|mut r| {
                            charts.extend(r.charts().unwrap_or_default().into_iter().map(|(stem, c)| (chart_stem("tokens", &label(d), m, &stem), c)));
                            declared.extend(r.sections.remove(super::DECLARED_NAMES).and_then(|v| v.as_object().cloned()).unwrap_or_default());
                            r.cases
                        })
                        .unwrap_or_default()
                    })
                };
                let mut got = got.unwrap_or_else(|e| vec![could_not_run(suite, d, m, e)]);
                super::spread_time(&mut got, t0.elapsed().as_secs_f64());
                cases.extend(got);
            }
        }
    }
    let bench_rows = bench_table(&cases);
    let mut report = Report::new("gate", Provenance::collect(rayon::current_num_threads()), cases);
    report.sections.insert(super::DECLARED_NAMES.into(), serde_json::Value::Object(declared));
    for (stem, chart) in charts {
        report.add_chart(&stem, chart);
    }
    super::note_declared_names(&mut report, &devices.iter().map(|d| d.as_ref()).collect::<Vec<_>>());
    let opened: Vec<String> = devices.iter().map(|x| x.name()).collect();
    super::label_devices(&mut report, &opened, a.name.as_deref());
    // After the labels: its commands name the device as it is given, not by its label; its first
    // column is the label the rest of the report uses.
    if !divergences.is_empty() {
        let labels = report.sections.get("engine_labels").and_then(|v| v.as_object()).cloned().unwrap_or_default();
        for row in &mut divergences {
            if let Some((label, _)) = labels.iter().find(|(_, spec)| spec.as_str() == Some(row[0].as_str())) {
                row[0] = label.clone();
            }
        }
        report.add_lead_table("layers_first_divergence", "Layers: first divergence by device and model", &super::layerdiff::DIVERGENCE_COLUMNS, divergences, &[]);
    }
    super::kernels::print_summary(&report);
    if !bench_rows.is_empty() {
        let columns: Vec<&str> = std::iter::once("case").chain(super::bench::TABLE_COLUMNS).collect();
        outln!("\nthroughput ({} repetitions, medians):", super::bench::REPS);
        for row in &bench_rows {
            outln!("  {:<56} prefill {:>9} tok/s  decode {:>9} tok/s  TTFT {:>8} ms  ITL p50/p90/p99 {} ms  peak RSS {:>6} MiB", row[0], row[1], row[2], row[3], row[4], row[5]);
        }
        report.add_table("bench_table", &format!("throughput ({} repetitions, medians)", super::bench::REPS), &columns, bench_rows);
    }
    let dir = super::write_report(&mut report, a.report_dir)?;
    outln!("report: {}", dir.join("report.json").display());
    Ok(report.exit_code())
}

/// A chart's file name in the gate's folder: rung, device, model and the rung's own name, each
/// reduced to letters, digits, `-`, `_` and `.` (a device may be a command line, a model a path).
fn chart_stem(rung: &str, device: &str, model: &str, stem: &str) -> String {
    let model = std::path::Path::new(model).file_stem().map_or(model.to_string(), |s| s.to_string_lossy().into_owned());
    let slug = |s: &str| -> String {
        let s: String = s.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
        s.trim_matches(|c| c == '_' || c == '.').chars().take(48).collect()
    };
    format!("{rung}-{}-{}-{stem}", slug(device), slug(&model))
}

/// A suite that could not run on a device/model pair: `unsupported` when the device says it cannot
/// run that model (one it has no kernels for), otherwise an `error` case (exit 2) with the reason.
fn could_not_run(suite: &str, device: &str, model: &str, e: Exit) -> reports::Case {
    let unsupported = e.unavailable;
    reports::Case {
        id: format!("{suite}(model={model})"),
        device: device.to_string(),
        verdict: if unsupported { reports::Verdict::Unsupported } else { reports::Verdict::Error },
        metrics: Default::default(),
        tolerance: reports::Tolerance { rule: "could not run".into(), bound: 0.0 },
        margin: 0.0,
        message: Some(e.message),
    }
}

/// The bench suite's figures, one row per bench case that ran: the case id, then
/// `bench::TABLE_COLUMNS`.
fn bench_table(cases: &[reports::Case]) -> Vec<Vec<String>> {
    cases.iter().filter(|c| c.id.starts_with("bench(device=")).map(|c| std::iter::once(c.id.clone()).chain(super::bench::table_row(c)).collect()).collect()
}
