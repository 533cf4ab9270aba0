//! `cargo xtask roofline`: how close a device's GEMV gets to its memory bandwidth. Copy bandwidth
//! and GEMV (one token) weight bandwidth per weight type, measured in the same run with device
//! events (wall clock on `cpu`); the gate is the GEMV of the chosen type reaching `--min-ratio`
//! of the copy bandwidth.

use devices::DeviceSpec;
use crate::Exit;
use reports::{Case, Provenance, Report, Tolerance, Verdict};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct RooflineArgs {
    /// cuda or cuda:N, rocm or rocm:N (device events), cpu (wall clock), gpu-emu (its figures say nothing about a GPU, so its gate is inconclusive: exit 3).
    #[arg(long, value_parser = super::device_arg)]
    device: DeviceSpec,
    /// Size of the copy buffer and of each GEMV weight matrix, in MiB (large enough to defeat caches).
    #[arg(long, default_value_t = 256)]
    mib: usize,
    /// Timed runs per measurement (the best is kept).
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// The weight type whose GEMV is gated.
    #[arg(long, default_value = "f16")]
    gate_type: String,
    /// Gated GEMV bandwidth / copy bandwidth must reach this.
    #[arg(long, default_value_t = 0.85, allow_negative_numbers = true)]
    min_ratio: f64,
    /// Where report.json and report.md go (default target/touchstone/roofline-YYYYMMDD-HHMMSS/, the start time in UTC).
    #[arg(long)]
    report_dir: Option<PathBuf>,
}

pub fn main(a: RooflineArgs) -> Result<u8, Exit> {
    super::check_report_dir(a.report_dir.as_deref())?;
    if a.mib == 0 || a.reps == 0 {
        return Err(Exit::new(2, "--mib and --reps must be at least 1"));
    }
    let bytes = a.mib.checked_mul(1 << 20).filter(|b| *b <= isize::MAX as usize / 4).ok_or_else(|| Exit::new(2, format!("--mib {} is more memory than this machine can address", a.mib)))?;
    if !(a.min_ratio.is_finite() && a.min_ratio > 0.0) {
        return Err(Exit::new(2, format!("--min-ratio {} must be a positive number", a.min_ratio)));
    }
    let device = devices::open_spec(&a.device).map_err(Exit::from)?;
    let probe = device
        .bandwidth_probe(bytes, a.reps)
        .ok_or_else(|| Exit::new(2, format!("device `{}` has no bandwidth probe (cpu and the GPU devices have one)", a.device)))?
        .map_err(|e| Exit::from(e))?;
    if !probe.gemv.iter().any(|g| g.ty == a.gate_type && !g.alternative) {
        return Err(Exit::new(2, format!("--gate-type {}: measured types are {:?}", a.gate_type, probe.gemv.iter().map(|g| &g.ty).collect::<Vec<_>>())));
    }
    super::print_timing_notes();
    outln!("{} ({}): copy {:.1} GB/s (read + write, {} MiB, best of {})", a.device, device.describe(), probe.copy_gbps, a.mib, probe.reps);
    if let Some(why) = &probe.not_hardware {
        outln!("  not a hardware measurement: {why}; the gate is inconclusive (exit 3)");
    }
    let mut cases = Vec::new();
    let mut rows = Vec::new();
    for devices::GemvRate { ty, weight_bytes: bytes, gbps, kernel, alternative } in &probe.gemv {
        let ratio = gbps / probe.copy_gbps;
        let gated = *ty == a.gate_type && !alternative;
        let verdict = match (&probe.not_hardware, gated) {
            (_, false) => Verdict::Pass,
            (Some(_), true) => Verdict::Inconclusive,
            (None, true) if ratio >= a.min_ratio => Verdict::Pass,
            (None, true) => Verdict::Fail,
        };
        // Other launch shapes of the same kernel (a GPU's sweep of threads per row) are listed
        // under the matmul's own shape, marked, never gated.
        let label = if *alternative { format!("  {ty}*") } else { ty.clone() };
        outln!("  gemv {label:<7} {:>8.1} GB/s of weights = {:>5.1}% of copy{}  [{kernel}]", gbps, 100.0 * ratio, if gated { format!("  (gate >= {:.0}%: {verdict:?})", 100.0 * a.min_ratio) } else { String::new() });
        rows.push(vec![label, format!("{:.1}", *bytes as f64 / (1 << 20) as f64), format!("{gbps:.1}"), format!("{:.1}%", 100.0 * ratio), if gated { format!("{verdict:?}") } else { "-".into() }, kernel.clone()]);
        let mut metrics = reports::Metrics::new();
        metrics.set("gbps", gbps);
        metrics.set("copy_gbps", probe.copy_gbps);
        metrics.set("ratio_to_copy", ratio);
        metrics.set("weight_bytes", bytes);
        cases.push(Case {
            id: if *alternative { format!("roofline(gemv,w={ty},k=8192,m=1,shape={kernel})") } else { format!("roofline(gemv,w={ty},k=8192,m=1)") },
            device: a.device.name().to_string(),
            verdict,
            metrics,
            tolerance: Tolerance {
                rule: if gated {
                    format!("gemv GB/s >= {} x copy GB/s", a.min_ratio)
                } else if *alternative {
                    "measurement (another launch shape than the matmul's own)".into()
                } else {
                    "measurement".into()
                },
                bound: if gated { a.min_ratio } else { 0.0 },
            },
            margin: if gated { ratio - a.min_ratio } else { 0.0 },
            message: match verdict {
                Verdict::Fail => Some(format!("{ty} GEMV reads {gbps:.1} GB/s, {:.1}% of the {:.1} GB/s copy", 100.0 * ratio, probe.copy_gbps)),
                Verdict::Inconclusive => probe.not_hardware.clone(),
                _ => None,
            },
        });
    }
    let mut report = Report::new("roofline", Provenance::collect(rayon::current_num_threads()), cases);
    report.add_table("roofline_table", &format!(
            "{}: GEMV weight bandwidth vs copy {:.1} GB/s{}",
            a.device,
            probe.copy_gbps,
            if probe.gemv.iter().any(|g| g.alternative) { " (* another launch shape of the same kernel, timed for comparison, not gated)" } else { "" }
        ), &["weights", "MiB", "GB/s", "of copy", "gate", "kernel"], rows);
    report.set_section("bandwidth_probe", &probe);
    let dir = super::write_report(&mut report, a.report_dir)?;
    outln!("report: {}", dir.join("report.json").display());
    Ok(report.exit_code())
}
