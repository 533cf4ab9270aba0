//! `cargo xtask layer-diff`: every tap of a device's forward pass against the oracle's, with the
//! first divergence, a per-layer table and error-by-layer plots (suites::layerdiff).

use devices::DeviceSpec;
use super::{check_ids, load_engine, Engine};
use crate::Exit;
use oracle::{Precision, RecordingTap};
use reports::findings::{Emulation, FirstDivergence, Gate};
use std::path::PathBuf;
use suites::layerdiff::{self, Mode};

/// The default prompt when the model has a tokenizer and no ids are given.
pub const DEFAULT_PROMPT: &str = "The quick brown fox jumps over the lazy dog. The capital of France is";
/// The default ids for models without a tokenizer (the synthetic fixtures have 272 tokens).
pub const DEFAULT_IDS: [u32; 11] = [17, 101, 44, 3, 250, 99, 7, 61, 200, 11, 5];

/// `--mode`, as clap parses it (and lists it in `--help` and in its refusal of another word).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeArg {
    Isolated,
    Propagated,
}

#[derive(clap::Args)]
pub struct LayerDiffArgs {
    #[arg(long, value_parser = super::device_arg, help = concat!("Device under test: ", devices::device_names!(), "."))]
    pub device: DeviceSpec,
    #[arg(long, help = concat!("Model: ", fixtures::model_names!(), ", or a path to a .gguf file, a flat file (`export`) or a safetensors directory."))]
    pub model: String,
    /// Which comparison gates: `isolated` (each op fed the device's own inputs: the op's own
    /// error) or `propagated` (the device's whole run against the oracle's: accumulated error).
    /// Both are always measured and reported; the first divergence is always the isolated one.
    /// Default `isolated`; with `--against`, `propagated` (the only comparison of two devices).
    #[arg(long, value_enum)]
    pub mode: Option<ModeArg>,
    /// Token ids to run, comma-separated (default: a fixed English prompt, or fixed ids when the
    /// model has no tokenizer).
    #[arg(long, conflicts_with = "prompt")]
    pub prompt_ids: Option<String>,
    /// Text to run instead, tokenized with the model's own tokenizer.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Compare the device with this second device (or dump) tap by tap instead of gating it
    /// against the oracle: each tap within the sum of what each device's own comparison with the
    /// oracle allows it (past a MoE token the two route otherwise at a near tie, each device
    /// against the oracle routed as it was); the oracle's distance to each stays in the report.
    #[arg(long, value_parser = super::device_arg)]
    pub against: Option<DeviceSpec>,
    /// With `--against` (the baseline; `--device` is the candidate): gate `baseline_departure`
    /// holds the candidate's propagated error against the oracle at each tap to this many times
    /// the baseline's (floor 1e-6 relative), naming the first tap past it.
    #[arg(long, default_value_t = 4.0, requires = "against")]
    pub baseline_factor: f64,
    /// The `emulated_departure` gate: where the device's declared arithmetic can be emulated on
    /// the oracle, its propagated error at each tap may be at most this many times the emulated
    /// run's, both over each tap's bulk (values under 64x its median magnitude), at taps where that
    /// is at least 1e-4 relative. Honest engines, llama.cpp among them, measure 1.00-1.23x on the
    /// fixtures and SmolLM2 (docs/ACCURACY.md); 1.5 suits engines whose arithmetic the emulation
    /// models (cpu, fixed, fixed-int4).
    /// Not with `--against` (two devices are held to each other's budgets, not to an emulation).
    #[arg(long, default_value_t = suites::emulate::EMULATION_FACTOR, allow_negative_numbers = true, conflicts_with = "against")]
    pub emulation_factor: f64,
    /// Where report.json, report.md, junit.xml, cases.csv and the plots go (default target/touchstone/layer-diff-YYYYMMDD-HHMMSS/, the start time in UTC).
    #[arg(long)]
    pub report_dir: Option<PathBuf>,
    /// Which taps the device must give (gate case `tap_coverage`): `all`, a comma list of tap
    /// kinds (`l_out,attn_out`; `result_output` is the logits), a fraction of the oracle's taps
    /// (`0.9`), `layers` (the default: every layer's `l_out` and the logits, so an engine that
    /// dumps only its logits fails rather than pass with every layer unjudged), or `none`
    /// (coverage reported in report.json's `tap_coverage`, not gated).
    #[arg(long, default_value = suites::coverage::DEFAULT)]
    pub require_taps: String,
    /// A label for the device in the console, report.json, report.md and JUnit (an engine's
    /// command line is long); report.json's `engine_labels` keeps the command it stands for.
    /// Without it an external engine goes by the name it gives itself (a dump manifest's
    /// `device`, the op protocol's `name`), with " (external)" where that reads as another device.
    #[arg(long)]
    pub name: Option<String>,
}

/// The prompt when none is given: the default prompt encoded, or, without a tokenizer, the
/// default ids (taken modulo the vocabulary, so a model of fewer than 251 tokens gets ids it has).
pub fn default_prompt(tok: Option<&oracle::tokenizer::Tokenizer>, n_vocab: usize) -> Result<Vec<u32>, Exit> {
    match tok {
        Some(t) => Ok(t.encode(DEFAULT_PROMPT)?),
        None => Ok(DEFAULT_IDS.iter().map(|&id| id % n_vocab.max(1) as u32).collect()),
    }
}

fn device_taps(engine: &mut Engine, ids: &[u32]) -> Result<RecordingTap, Exit> {
    let mut taps = RecordingTap::default();
    engine.prefill(ids, &mut taps)?;
    Ok(taps)
}

pub fn main(a: LayerDiffArgs) -> Result<u8, Exit> {
    super::check_report_dir(a.report_dir.as_deref())?;
    super::check_label(a.name.as_deref())?;
    let t0 = std::time::Instant::now();
    let mut outcome = layer_diff(&a)?;
    super::spread_time(&mut outcome.report.cases, t0.elapsed().as_secs_f64());
    let devices: Vec<String> = std::iter::once(&a.device).chain(&a.against).map(|d| d.name().to_string()).collect();
    for (device, label) in super::label_devices(&mut outcome.report, &devices, a.name.as_deref()) {
        outcome.findings.relabel(&device, &label);
    }
    print_table(&outcome);
    for f in &outcome.follows {
        outln!("routing: {f}");
    }
    // `--against`: each device's comparison with the oracle, by device.
    for (device, follows) in outcome.findings.against.iter().flat_map(|a| &a.routing_followed).filter(|(_, f)| !f.is_empty()) {
        outln!("routing: the oracle followed {device}'s experts at {} near tie(s) (report.json's routing_followed)", follows.len());
    }
    let (others, unjudged) = (&outcome.findings.unknown_tap_kinds, &outcome.findings.unjudged_taps);
    let names = |n: &[String]| n.iter().take(12).map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ") + if n.len() > 12 { ", ..." } else { "" };
    if !others.is_empty() {
        eprintln!("note: {} of the device's taps are of no kind this tool knows, so were not judged: {} (the kinds it knows: docs/DUMP_FORMAT.md)", others.len(), names(&others));
    }
    let rest: Vec<String> = unjudged.iter().filter(|n| !others.contains(n)).cloned().collect();
    if !rest.is_empty() {
        eprintln!("note: {} of the device's taps have no tap of that name in the oracle (a layer the model does not have), so were not judged: {}", rest.len(), names(&rest));
    }
    if let Some(c) = outcome.report.cases.iter().find(|c| c.id.ends_with(",gate=tap_coverage)")) {
        outln!("tap_coverage gate ({}): {:?} — {} of {} taps given{}", c.tolerance.rule, c.verdict, c.metrics["taps_given"], c.metrics["taps_expected"], c.message.as_deref().map(|m| format!("; {m}")).unwrap_or_default());
    }
    let dir = super::write_report(&mut outcome.report, a.report_dir)?;
    if let Some(d) = &outcome.findings.first_divergence {
        outln!("more: {}", next_steps(a.device.name(), &a.model, d));
    }
    let s = &outcome.report.summary;
    outln!("{} cases (a tap each, and the emulated_departure gate where it applies): {} passed, {} failed, {} missing/unsupported", s.executed, s.passed, s.failed, s.unsupported);
    outln!("report: {} (plots: error_by_layer_*.png/.svg)", dir.join("report.json").display());
    Ok(outcome.report.exit_code())
}

/// Runs the comparison the arguments describe (no printing, no files).
pub fn layer_diff(a: &LayerDiffArgs) -> Result<layerdiff::Outcome, Exit> {
    let required: suites::coverage::RequiredTaps = a.require_taps.parse().map_err(|e: String| Exit::new(2, e))?;
    let mut outcome = layer_diff_taps(a)?;
    // Which taps the device gave, by kind, and the gate on the ones required.
    outcome.report.set_section("tap_coverage", &suites::coverage::section(&outcome.taps, &required));
    if let Some(c) = suites::coverage::case(&outcome.taps, &required, &a.model, a.device.name()) {
        outcome.report.push_case(c);
    }
    Ok(outcome)
}

/// The comparison of every tap, before the coverage gate.
fn layer_diff_taps(a: &LayerDiffArgs) -> Result<layerdiff::Outcome, Exit> {
    let mode = match a.mode.unwrap_or(ModeArg::Isolated) {
        ModeArg::Isolated => Mode::Isolated,
        ModeArg::Propagated => Mode::Propagated,
    };
    if a.against.is_some() && a.mode.is_some() && mode != Mode::Propagated {
        return Err(Exit::new(2, "--mode isolated: --against compares the two devices' whole runs (propagated); each device's isolated comparison is `layer-diff --device D` against the oracle"));
    }
    super::check_factor("--emulation-factor", a.emulation_factor)?;
    // The candidate opens with its model below; the baseline is opened first so that one not
    // available here is said before the candidate's run.
    let mut opened_b = a.against.as_ref().map(super::open_device).transpose()?;
    let (path, mut engine, tok) = load_engine(&a.model, &a.device, Precision::F32)?;
    let ids = match super::given_prompt(a.prompt.as_deref(), a.prompt_ids.as_deref(), tok.as_ref(), &a.model, &path)? {
        Some(ids) => ids,
        None => default_prompt(tok.as_ref(), engine.spec().n_vocab)?,
    };
    check_ids(&ids, engine.spec().n_vocab)?;
    // The device's taps, the oracle's own, its isolated and its emulated re-runs; with
    // `--against`, both devices' taps and the oracle's own and isolated runs for each.
    super::check_recordings_fit("layer-diff", engine.spec(), true, ids.len(), if a.against.is_some() { 6 } else { 4 })?;
    eprintln!("layer-diff: {} on {} over {} tokens ...", a.device, a.model, ids.len());
    let stages = super::Stages::new(if a.against.is_some() { 3 } else { 2 }, &format!("layer-diff {} on {}", a.device, a.model));
    stages.next(&format!("{}: every tap", a.device));
    let taps_a = device_taps(&mut engine, &ids)?;
    let arith_a = engine.arithmetic();
    let mut declared = vec![(a.device.name().to_string(), engine.declared_name())];
    drop(engine);
    let (oracle_model, _) = super::load_oracle(&path, Precision::F32)?;
    let shape_err = |e: String| Exit::new(2, e);
    let mut outcome = match &a.against {
        None => {
            stages.next("the oracle: its own run, on the device's values, with the declared arithmetic emulated");
            layerdiff::run(&oracle_model, &path, &ids, &taps_a, &arith_a, mode, a.emulation_factor, &a.model, a.device.name()).map_err(shape_err)?
        }
        Some(b) => {
            let opened = match opened_b.take() {
                Some(o) => o,
                None => super::open_device(b)?,
            };
            let (_, mut engine_b, _) = super::load_engine_on(&a.model, opened, Precision::F32)?;
            stages.next(&format!("{b}: every tap"));
            let taps_b = device_taps(&mut engine_b, &ids)?;
            let arith_b = engine_b.arithmetic();
            declared.push((b.name().to_string(), engine_b.declared_name()));
            stages.next("the oracle: its own run and on each device's values");
            layerdiff::run_against(&oracle_model, &path, &ids, (a.device.name(), &taps_a, &arith_a), (b.name(), &taps_b, &arith_b), &a.model, a.baseline_factor).map_err(shape_err)?
        }
    };
    let names: std::collections::BTreeMap<String, String> = declared.into_iter().filter_map(|(d, n)| Some((d, n?))).collect();
    if !names.is_empty() {
        outcome.report.set_section(super::DECLARED_NAMES, &names);
    }
    Ok(outcome)
}

/// The commands that show more about a divergence: the per-layer table and charts of this
/// device and model, and the kernel suite on the op that made the tap.
pub fn next_steps(device: &str, model: &str, d: &FirstDivergence) -> String {
    let quote = |s: &str| if s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.:/=,".contains(c)) { s.to_string() } else { format!("'{}'", s.replace('\'', "'\\''")) };
    let mut s = format!("`cargo xtask layer-diff --device {} --model {}` (every tap, the per-layer table, charts)", quote(device), quote(model));
    if let Some(f) = &d.kernel_filter {
        s += &format!("; `cargo xtask kernels --device {} --filter '{f}'` (that op alone, on the kernel suite's cases)", quote(device));
    }
    s
}

/// One line for `gate`: where the device first leaves its budgets and its worst tap.
pub fn story(o: &layerdiff::Outcome, device: &str, model: &str) -> String {
    let first = o.findings.first_divergence.as_ref().map_or("none".into(), FirstDivergence::describe);
    let worst = o.report.cases.iter().filter(|c| c.id.contains(",tap=")).filter_map(|c| Some((c, c.error_over_bound()?))).max_by(|a, b| a.1.total_cmp(&b.1));
    let worst = worst.map_or("none compared".into(), |(c, r)| {
        let mode = if c.id.contains("mode=isolated") { "isolated" } else { "propagated" };
        format!("{} ({mode}) at {r:.3} of its budget", c.metrics.str("tap").unwrap_or(&c.id))
    });
    format!("layers on {device} / {model}: first divergence: {first}; worst tap: {worst}")
}

fn print_table(o: &layerdiff::Outcome) {
    let rows = layerdiff::layer_table(&o.taps);
    outln!("{:<14} {:<10} {:>24} {:>9} {:<14} {:>24} {:>10}", "layer", "out tap", "prop. rel err / budget", "emulated", "worst op", "iso. rel err / budget", "over p/i/m");
    for r in rows {
        outln!("{:<14} {:<10} {:>24} {:>9} {:<14} {:>24} {:>10}", r[0], r[1], r[2], r[3], r[4], r[5], r[6]);
    }
    let against = o.findings.against.as_ref();
    if let Some(a) = against {
        match &a.first_difference {
            Some(d) => outln!("detail: the first tap where the two differ at all: {} (RMS difference {:.3e}, largest at position {})", d.tap, d.rms_err.unwrap_or(f64::NAN), d.worst_position.map_or("-".into(), |p| p.to_string())),
            None => outln!("the two agree bit for bit at every tap"),
        }
    }
    if let Some(c) = o.report.cases.iter().find(|c| c.id.ends_with(",gate=baseline_departure)")) {
        outln!("baseline_departure gate ({}x): {:?} — {}", c.tolerance.bound, c.verdict, c.message.clone().unwrap_or_else(|| format!("worst {} at {:.2}x the baseline's error", c.metrics.str("worst_tap").unwrap_or("?"), c.metrics.f64("candidate_over_baseline").unwrap_or(f64::NAN))));
    }
    if let Some(Gate::NotApplicable(why)) = against.map(|a| &a.baseline_departure) {
        outln!("baseline_departure gate: {why}");
    }
    // Against the declared arithmetic emulated: the gate's line, naming the tap that leaves
    // the emulated line most; where the gate does not apply, that tap and why.
    let emulation = match &o.findings.emulation {
        Some(Emulation::Applied { largest_departure, tightest_budget, gate, .. }) => Some((largest_departure, tightest_budget, gate)),
        _ => None,
    };
    if let Some(c) = o.report.cases.iter().find(|c| c.id.ends_with(",gate=emulated_departure)")) {
        outln!("emulated_departure gate ({}x): {:?} — {}", c.tolerance.bound, c.verdict, c.message.as_deref().unwrap_or(""));
    } else if let Some((largest, _, gate)) = emulation {
        if let Some(d) = largest {
            outln!("largest departure from the declared arithmetic emulated: {} (propagated error {:.2}x the emulation's)", d.tap, d.propagated_over_emulated);
        }
        if let Gate::NotApplicable(why) = gate {
            outln!("emulated_departure gate: {why}");
        }
    }
    if let Some((_, Some(t), _)) = emulation {
        outln!("headroom of the declared arithmetic emulated: at {} it uses {:.0}% of its propagated budget", t.tap, 100.0 * t.budget_use);
    }
    // `--against` on MoE: where the two took other experts at a near tie each one's comparison
    // explains, and what the taps after it are held to.
    if let Some(s) = against.and_then(|a| a.routing_split.as_ref()) {
        let ids = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
        let choices: Vec<String> = s.choices.iter().map(|(k, v)| format!("{k} [{}]", ids(v))).collect();
        outln!("routing split: {} position {}: {} (each as the oracle routed as it was, at a near tie); every tap after it is held to each device's own comparison with the oracle", s.tap, s.position, choices.join(", "));
    }
    // `--against`: where each device leaves the oracle (not gated here; `layer-diff --device D`
    // gates it).
    for (device, d) in against.iter().flat_map(|a| &a.first_divergence_vs_oracle) {
        match d {
            Some(d) => outln!("{device} against the oracle (not gated here): first divergence {}", d.describe()),
            None => outln!("{device} against the oracle (not gated here): every tap within its budget"),
        }
    }
    match &o.findings.first_divergence {
        Some(d) => outln!("first divergence: {}", d.describe()),
        None => outln!("first divergence: none (every tap within its budget)"),
    }
}

/// The first divergence as a report.md lead table (one row): what went red, the op that made it,
/// and the command that shows that op alone; `device` as it is run (the gate maps it to its label
/// after labelling, so the commands stay runnable).
pub fn divergence_row(o: &layerdiff::Outcome, device: &str, model: &str) -> Vec<String> {
    let verdict = reports::verdict_word(o.report.exit_code()).to_string();
    match &o.findings.first_divergence {
        Some(d) => vec![device.to_string(), model.to_string(), verdict, d.describe(), next_steps(device, model, d)],
        None => vec![device.to_string(), model.to_string(), verdict, "none: every tap within its budget".into(), "-".into()],
    }
}

/// The columns of [`divergence_row`].
pub const DIVERGENCE_COLUMNS: [&str; 5] = ["device", "model", "layers", "first divergence (the op that made it, its inputs)", "to see more"];
