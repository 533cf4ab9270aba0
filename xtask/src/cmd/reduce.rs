//! `cargo xtask reduce`: from the first tap over its budget to the smallest kernel case that
//! still fails on the device alone (suites::reduce), written as a case directory any device or
//! engine reruns (`kernels --cases`).

use super::{check_ids, load_engine};
use crate::Exit;
use devices::DeviceSpec;
use oracle::{Precision, RecordingTap};
use reports::{Provenance, Report};
use std::path::PathBuf;
use suites::layerdiff::{self, Mode};
use suites::reduce;

#[derive(clap::Args)]
pub struct ReduceArgs {
    #[arg(long, value_parser = super::device_arg, help = concat!("Device under test: ", devices::device_names!(), ". Its whole model gives the divergence, its ops run the case (an exec: engine speaks the dump and the op protocol).") )]
    device: DeviceSpec,
    #[arg(long, help = concat!("Model: ", fixtures::model_names!(), ", or a path to a .gguf file, a flat file or a safetensors directory."))]
    model: String,
    /// Token ids to run, comma-separated (default as layer-diff's).
    #[arg(long, conflicts_with = "prompt")]
    prompt_ids: Option<String>,
    /// Text to run instead, tokenized with the model's own tokenizer.
    #[arg(long)]
    prompt: Option<String>,
    /// A layer-diff report of this device on this model (its report.json, or the directory
    /// holding it): its first divergence is reduced, on its prompt, without judging every tap
    /// again.
    #[arg(long, conflicts_with_all = ["prompt", "prompt_ids"])]
    from: Option<PathBuf>,
    /// Where report.json (the divergence, each reduction step and its verdict) and case/ (the
    /// reduced case, for `kernels --cases`) go (default target/touchstone/reduce-YYYYMMDD-HHMMSS/).
    #[arg(long)]
    report_dir: Option<PathBuf>,
}

pub fn main(a: ReduceArgs) -> Result<u8, Exit> {
    super::check_report_dir(a.report_dir.as_deref())?;
    super::check_runs_ops(a.device.name())?;
    let from = a.from.as_deref().map(|p| from_report(p, &a.model, a.device.name())).transpose()?;
    if let (Some(p), Some(FromReport { first: None, .. })) = (&a.from, &from) {
        outln!("nothing to reduce: {} found every tap of {} on {} within its budget", p.display(), a.device, a.model);
        return Ok(0);
    }
    let (path, mut engine, tok) = load_engine(&a.model, &a.device, Precision::F32)?;
    let ids = match (&from, super::given_prompt(a.prompt.as_deref(), a.prompt_ids.as_deref(), tok.as_ref(), &a.model, &path)?) {
        (Some(r), _) => r.ids.clone(),
        (None, Some(ids)) => ids,
        (None, None) => super::layerdiff::default_prompt(tok.as_ref(), engine.spec().n_vocab)?,
    };
    check_ids(&ids, engine.spec().n_vocab)?;
    super::check_recordings_fit("reduce", engine.spec(), true, ids.len(), 5)?;
    let stages = super::Stages::new(3, &format!("reduce {} on {}", a.device, a.model));
    stages.next(&format!("{}: every tap", a.device));
    let mut device_taps = RecordingTap::default();
    engine.prefill(&ids, &mut device_taps)?;
    let arith = engine.arithmetic();
    let spec = engine.spec().clone();
    drop(engine);
    stages.next("the oracle: its own run and on the device's values");
    let (oracle_model, _) = super::load_oracle(&path, Precision::F32)?;
    let first = match from {
        Some(r) => r.first,
        None => layerdiff::run(&oracle_model, &path, &ids, &device_taps, &arith, Mode::Isolated, 4.0, &a.model, a.device.name()).map_err(|e| Exit::new(2, e))?.findings.first_divergence.clone(),
    };
    let Some(first) = first else {
        drop(stages);
        outln!("nothing to reduce: every tap of {} on {} is within its budget", a.device, a.model);
        return Ok(0);
    };
    let mut oracle_taps = RecordingTap::default();
    oracle_model.prefill_logits(&ids, &mut oracle_taps).map_err(|e| Exit::new(1, e.to_string()))?;
    drop(oracle_model);
    stages.next("the op alone: built, checked, cut down");
    let (src, _) = oracle::loader::open_weights(&path).map_err(|e| Exit::new(2, format!("{}: {e}", path.display())))?;
    let tap = oracle::taps::TapName::parse(&first.tap).ok_or_else(|| Exit::new(1, format!("first divergence at `{}`, a tap of no known kind", first.tap)))?;
    outln!("first divergence: {}", first.describe());
    let mut report = Report::new("reduce", Provenance::collect(rayon::current_num_threads()), Vec::new());
    report.set_section("first_divergence", &first);
    let device = devices::open_spec(&a.device).map_err(Exit::from)?;
    let found = reduce::reduce(device.as_ref(), tap, &spec, src.as_ref(), &oracle_taps, &device_taps);
    let mut report_dir = a.report_dir.clone();
    drop(stages);
    let (section, code) = match found {
        Err(why) => {
            outln!("no one-op case: {why}");
            (serde_json::json!({ "tap": first.tap, "reduced": false, "why": why }), 1)
        }
        Ok(reduce::Reduction { steps, reduced: None }) => {
            outln!("no one-op case: `{}` passes alone on the oracle's inputs and on the device's: the bug needs context (a cache, a batch, the layers before)", tap);
            (serde_json::json!({ "tap": first.tap, "steps": steps, "reduced": false, "why": "the op passes alone" }), 1)
        }
        Ok(reduce::Reduction { steps, reduced: Some((case, judged, inputs_from)) }) => {
            // The case goes beside the report, which is written once, last.
            let dir = match &report_dir {
                Some(d) => d.clone(),
                None => super::new_report_dir(&report.suite, report.provenance.started_at.as_deref())?,
            };
            report_dir = Some(dir.clone());
            let case_dir = dir.join("case");
            let expected = suites::kernels::reference(&case).map_err(|e| Exit::new(1, e))?;
            devices::case_file::write_cases(&case_dir, std::slice::from_ref(&case), &[expected]).map_err(|e| Exit::new(1, e))?;
            // The written file, read back and rerun, must give the same verdict.
            let back = devices::case_file::read_cases(&case_dir).map_err(|e| Exit::new(1, e))?;
            let rerun = suites::kernels::run_case(device.as_ref(), &back[0], false);
            outln!("reduced: `{}` fails on {} ({}), {}", case.id, a.device, judged.message.as_deref().unwrap_or("over its bound"), steps.last().map(|s| format!("{} values", s.values)).unwrap_or_default());
            outln!("rerun from {}: {:?} (cargo xtask kernels --cases {} --device D)", case_dir.display(), rerun.verdict, case_dir.display());
            let section = serde_json::json!({ "tap": first.tap, "steps": steps, "reduced": true, "case": case.id, "inputs": inputs_from, "rerun": rerun.verdict });
            (section, 1)
        }
    };
    report.set_section("reduce", &section);
    let dir = super::write_report(&mut report, report_dir)?;
    outln!("report: {}", dir.join("report.json").display());
    Ok(code)
}

/// What `--from` takes from a layer-diff report: its prompt and its first divergence.
struct FromReport {
    ids: Vec<u32>,
    first: Option<reports::findings::FirstDivergence>,
}

/// Reads a layer-diff report (`path`, or `path/report.json`) of `device` on `model`; refuses
/// (exit 2, naming the file and the field) one of another suite, model or device, or one
/// without a prompt.
fn from_report(path: &std::path::Path, model: &str, device: &str) -> Result<FromReport, Exit> {
    let file = if path.is_dir() { path.join("report.json") } else { path.to_path_buf() };
    let bad = |why: String| Exit::new(2, format!("--from {}: {why}", file.display()));
    let text = std::fs::read_to_string(&file).map_err(|e| bad(e.to_string()))?;
    let r: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    if r["suite"] != "layer-diff" {
        return Err(bad(format!("a report of suite {}, not layer-diff", r["suite"])));
    }
    if r["model"].as_str() != Some(model) {
        return Err(bad(format!("judged model {}, not `{model}`", r["model"])));
    }
    let judged = r["cases"].as_array().and_then(|c| c.first()).and_then(|c| c["device"].as_str());
    if judged != Some(device) {
        return Err(bad(format!("judged device {}, not `{device}`", judged.map_or("(none)".to_string(), |d| format!("`{d}`")))));
    }
    let ids: Vec<u32> = r["prompt_ids"]
        .as_array()
        .filter(|v| !v.is_empty())
        .and_then(|v| v.iter().map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok())).collect())
        .ok_or_else(|| bad("`prompt_ids`: no list of token ids".into()))?;
    let first = serde_json::from_value(r["first_divergence"].clone()).map_err(|e| bad(format!("`first_divergence`: {e}")))?;
    Ok(FromReport { ids, first })
}
