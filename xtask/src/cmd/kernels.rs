//! `cargo xtask kernels`: the kernel-level gate (every registry case, op vs oracle).

use devices::DeviceSpec;
use super::parse_shard;
use crate::Exit;
use reports::{Provenance, Report};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct KernelsArgs {
    #[arg(long, value_parser = super::device_arg, help = concat!("Device under test: ", devices::device_names!(), ". gpu-emu's options: thread order, threads per block, shared-memory race check, the GPU's fused multiply-adds and 2-ulp expf/tanhf; a GPU device not compiled in, or without a driver, exits 2 saying why; exec:CMD answers the op protocol (docs/OP_PROTOCOL.md)."))]
    device: DeviceSpec,
    /// Only cases whose id matches this regular expression, e.g. 'matmul\(w=q4_1'.
    #[arg(long)]
    filter: Option<String>,
    /// Also time each case (best of 3) and report GB/s and GFLOP/s.
    #[arg(long)]
    perf: bool,
    /// Base seed of every case's inputs (0 = the recorded default; reported in each case id's seed=).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Run shard K of N (1-based), e.g. 2/4; the split is a stable hash of the case id.
    #[arg(long)]
    shard: Option<String>,
    /// List the selected cases (id, and why the device cannot run one it does not support) instead of running them.
    #[arg(long, conflicts_with_all = ["perf", "report_dir"])]
    list: bool,
    /// Where report.json, report.md, junit.xml and cases.csv go (default target/touchstone/kernels-YYYYMMDD-HHMMSS/, the start time in UTC).
    #[arg(long)]
    report_dir: Option<PathBuf>,
    /// A label for the device in the console, report.json, report.md and JUnit (an engine's
    /// command line is long); report.json's `engine_labels` keeps the command it stands for.
    /// Without it an external engine goes by the name it gives itself (a dump manifest's
    /// `device`, the op protocol's `name`), with " (external)" where that reads as another device.
    #[arg(long)]
    name: Option<String>,
    /// Run the cases written to this directory (by --write-cases: an op batch with the oracle's
    /// outputs) instead of the registry's; --filter still narrows them. The verdicts are the
    /// oracle's and the device's own, never the file's.
    #[arg(long, conflicts_with_all = ["seed", "shard"])]
    cases: Option<PathBuf>,
    /// Also write the selected cases (inputs, parameters, the oracle's outputs) to this
    /// directory, as an op batch any engine runs (docs/OP_PROTOCOL.md): a repro to attach to a
    /// bug report, rerun anywhere with --cases.
    #[arg(long, conflicts_with = "list")]
    write_cases: Option<PathBuf>,
}

pub fn main(a: KernelsArgs) -> Result<u8, Exit> {
    super::check_report_dir(a.report_dir.as_deref())?;
    super::check_runs_ops(a.device.name())?;
    super::check_label(a.name.as_deref())?;
    let device = devices::open_spec(&a.device).map_err(Exit::from)?;
    let filter = match &a.filter {
        Some(f) => Some(regex::Regex::new(f).map_err(|e| Exit::new(2, format!("--filter: {e}")))?),
        None => None,
    };
    let opts = suites::kernels::KernelOptions { filter, shard: a.shard.as_deref().map(parse_shard).transpose()?, perf: a.perf, seed: a.seed };
    let selected = match &a.cases {
        Some(dir) => {
            let read = devices::case_file::read_cases(dir).map_err(|e| Exit::new(2, format!("--cases: {e}")))?;
            read.into_iter().filter(|c| opts.filter.as_ref().is_none_or(|f| f.is_match(&c.id))).collect()
        }
        None => suites::kernels::select_cases(&opts),
    };
    if a.list {
        return list(device.as_ref(), &selected, a.filter.is_some() || a.shard.is_some());
    }
    if let Some(dir) = &a.write_cases {
        write_cases(dir, &selected)?;
    }
    if selected.is_empty() && a.cases.is_some() {
        return Err(Exit::new(2, "--filter holds none of the cases of --cases".to_string()));
    }
    if selected.is_empty() {
        eprintln!("note: the selection (--filter, --shard) holds none of the {} cases; list them with --list", suites::kernels::select_cases(&suites::kernels::KernelOptions { seed: a.seed, ..Default::default() }).len());
    }
    let pb = super::progress(selected.len() as u64, &format!("kernels on {}", a.device));
    let cases = suites::kernels::run(device.as_ref(), &selected, opts.perf, |done, _| pb.set_position(done as u64));
    pb.finish_and_clear();
    let mut report = Report::new("kernels", Provenance::collect(rayon::current_num_threads()), cases);
    super::note_declared_names(&mut report, &[device.as_ref()]);
    super::label_devices(&mut report, &[device.name()], a.name.as_deref());
    print_summary(&report);
    let dir = super::write_report(&mut report, a.report_dir)?;
    outln!("report: {}", dir.join("report.json").display());
    Ok(report.exit_code())
}

/// `--write-cases`: the selected cases and the oracle's outputs for each, written to `dir`.
fn write_cases(dir: &std::path::Path, selected: &[oracle::registry::OpCase]) -> Result<(), Exit> {
    if selected.is_empty() {
        return Err(Exit::new(2, "--write-cases: the selection holds no case".to_string()));
    }
    let expected = selected.iter().map(suites::kernels::reference).collect::<Result<Vec<_>, _>>().map_err(|e| Exit::new(1, format!("--write-cases: {e}")))?;
    devices::case_file::write_cases(dir, selected, &expected).map_err(|e| Exit::new(1, format!("--write-cases: {e}")))?;
    outln!("wrote {} cases to {} (rerun: cargo xtask kernels --cases {} --device D)", selected.len(), dir.display(), dir.display());
    Ok(())
}

/// `--list`: one line per selected case, `unsupported: WHY` after those the device cannot run;
/// exit 2 when a selection (filter or shard) holds no case.
fn list(device: &dyn devices::Device, selected: &[oracle::registry::OpCase], narrowed: bool) -> Result<u8, Exit> {
    let mut unsupported = 0;
    for c in selected {
        match device.supports(c) {
            devices::Support::Yes => outln!("{}", c.id),
            devices::Support::Unsupported(why) => {
                unsupported += 1;
                outln!("{}  unsupported: {why}", c.id)
            }
        }
    }
    outln!("{} cases, {unsupported} of them unsupported on {}", selected.len(), device.name());
    if selected.is_empty() && narrowed {
        return Err(Exit::new(2, "the selection (--filter, --shard) holds no case"));
    }
    Ok(0)
}

/// Per-op summary lines, then failures, then the totals.
pub fn print_summary(r: &Report) {
    let coverage = r.coverage();
    let w = coverage.keys().map(|(op, _)| op.len()).max().unwrap_or(0).max(12);
    // `worst err/bound`: the largest measured error over its bound among the row's cases (an op
    // case's worst element; a layer-diff tap's RMS error over its budget; a gate's value over
    // its limit); 0 where every rule is exact.
    outln!("{:<w$} {:<8} {:>6} {:>6} {:>6} {:>6} {:>14}", "op", "dtype", "pass", "fail", "unsup", "error", "worst err/bound");
    let mut worst: std::collections::BTreeMap<(String, String), f64> = Default::default();
    for c in &r.cases {
        let w = c.error_over_bound().unwrap_or(0.0);
        let e = worst.entry(Report::op_and_dtype(&c.id)).or_insert(0.0);
        *e = e.max(w);
    }
    for ((op, dt), per) in coverage {
        let t = per.values().fold([0; 4], |mut acc, c| {
            (0..4).for_each(|i| acc[i] += c[i]);
            acc
        });
        outln!("{op:<w$} {dt:<8} {:>6} {:>6} {:>6} {:>6} {:>14.3}", t[0], t[1], t[2], t[3], worst.get(&(op.clone(), dt.clone())).copied().unwrap_or(0.0));
    }
    for c in r.cases.iter().filter(|c| matches!(c.verdict, reports::Verdict::Fail | reports::Verdict::Error)).take(20) {
        outln!("  {:?} {}: {}", c.verdict, c.id, c.message.as_deref().unwrap_or(""));
    }
    let s = &r.summary;
    outln!("\n{} executed, {} passed, {} failed, {} unsupported, {} errors", s.executed, s.passed, s.failed, s.unsupported, s.errors);
    if s.passed == 0 {
        outln!("no case passed: the gate fails (zero executed cases is never green)");
    }
}
