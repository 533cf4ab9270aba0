//! `cargo xtask gate`: the main job. With no arguments it runs the oracle self-check suite over
//! the synthetic models and the kernel suite on the `cpu` and `fixed` devices, prints a summary,
//! writes one report, and exits per the contract. Suites and devices that are not built yet
//! (layer-diff, fixed-token, bench; cuda, rocm, external) are named in the output and, when asked
//! for explicitly, exit 2 — never counted as passed.

use super::resolve_model;
use crate::Exit;
use reports::{Provenance, Report};
use std::path::PathBuf;

const SUITES: [&str; 2] = ["oracle", "kernels"];

#[derive(clap::Args)]
pub struct GateArgs {
    /// Devices for the kernel suite (default: cpu and fixed).
    #[arg(long)]
    device: Vec<String>,
    /// Models for the oracle self-check (default: tiny-llama, tiny-qwen3, tiny-moe).
    #[arg(long)]
    model: Vec<String>,
    /// Suites: oracle, kernels (default: both). layers, tokens and bench are not built yet.
    #[arg(long)]
    suite: Vec<String>,
    /// Run shard K of N of the kernel cases.
    #[arg(long)]
    shard: Option<String>,
    /// Where the reports go (default: target/touchstone/gate-<timestamp>/).
    #[arg(long)]
    report_dir: Option<PathBuf>,
}

pub fn main(a: GateArgs) -> Result<u8, Exit> {
    let suites: Vec<String> = if a.suite.is_empty() { SUITES.iter().map(|s| s.to_string()).collect() } else { a.suite.clone() };
    for s in &suites {
        if !SUITES.contains(&s.as_str()) {
            return Err(Exit { code: 2, message: format!("suite `{s}` is not available in this build (available: oracle, kernels)") });
        }
    }
    let device_names: Vec<String> = if a.device.is_empty() { vec!["cpu".into(), "fixed".into()] } else { a.device.clone() };
    let devices = device_names.iter().map(|d| devices::open(d)).collect::<Result<Vec<_>, _>>().map_err(|e| Exit { code: 2, message: e.to_string() })?;
    let shard = a.shard.as_deref().map(super::parse_shard).transpose()?;
    let mut cases = Vec::new();
    if suites.iter().any(|s| s == "oracle") {
        let models: Vec<String> = if a.model.is_empty() { ::fixtures::SYNTHETIC.iter().map(|s| s.to_string()).collect() } else { a.model.clone() };
        // A short fixed sequence: crosses the prefill/decode boundary and the YaRN/rope code paths.
        let tokens: Vec<u32> = vec![17, 101, 44, 3, 250, 99, 7, 61, 200, 11, 5];
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
    let report = Report::new("gate", Provenance::collect(rayon::current_num_threads()), cases);
    super::kernels::print_summary(&report);
    println!("not built yet (not run, not counted): suites layers, tokens, bench; devices cuda, rocm, external");
    let dir = super::report_dir(a.report_dir, "gate");
    report.write(&dir).map_err(|e| super::io_exit(&dir, e))?;
    println!("report: {}", dir.join("report.json").display());
    Ok(report.exit_code())
}
