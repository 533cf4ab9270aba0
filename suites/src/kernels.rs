//! The kernel-level gate: every registry case, run on the oracle and on a device, compared
//! element by element against the bound derived from the device's declared arithmetic.
//!
//! Rules of the gate: discrete outputs must match exactly (for a device that holds its tensors in
//! a format coarser than f32, the oracle's on the inputs rounded to that format also counts); a
//! non-finite device value where the oracle is finite fails; shapes must match; an op the device
//! does not support is reported as `unsupported` (never a pass); a panic or error inside the
//! device is an `error` case.

use crate::tolerance::{bounds, Bounds};
use devices::{Device, Support};
use oracle::registry::{registry, OpCase, Output};
use reports::{Case, Tolerance, Verdict};
use reports::Metrics;
use std::time::Instant;

#[derive(Default, Clone)]
pub struct KernelOptions {
    /// Only cases whose id matches.
    pub filter: Option<regex::Regex>,
    /// `(k, n)`: run shard k of n (1-based), split by a stable hash of the case id.
    pub shard: Option<(usize, usize)>,
    /// Also time each case and report GB/s and GFLOP/s.
    pub perf: bool,
    /// Base seed of every case's inputs (0 = the recorded default streams).
    pub seed: u64,
}

/// FNV-1a of the case id: stable across runs, machines and versions.
pub fn shard_of(id: &str, n: usize) -> usize {
    let h = id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    (h % n as u64) as usize
}

/// All registry cases selected by the options, in registry order.
pub fn select_cases(opts: &KernelOptions) -> Vec<OpCase> {
    let keep = |id: &str| opts.filter.as_ref().is_none_or(|f| f.is_match(id)) && opts.shard.is_none_or(|(k, n)| shard_of(id, n) == k - 1);
    registry().iter().flat_map(|e| e.cases_where(opts.seed, &keep)).collect()
}

fn ulp_distance(a: f32, b: f32) -> u64 {
    let key = |x: f32| {
        let i = x.to_bits() as i32;
        if i < 0 { (i32::MIN - i) as i64 } else { i as i64 }
    };
    (key(a) - key(b)).unsigned_abs()
}

/// Compares device outputs with the reference under `b`; returns (pass, metrics, worst bound, margin, message).
fn compare(reference: &[Output], device: &[Output], b: &Bounds) -> (bool, Metrics, f64, f64, Option<String>) {
    let mut m = Metrics::new();
    if reference.len() != device.len() {
        return (false, m, 0.0, f64::NEG_INFINITY, Some(format!("device returned {} outputs, expected {}", device.len(), reference.len())));
    }
    let (mut max_abs, mut max_rel, mut max_ulp, mut worst_ratio) = (0.0f64, 0.0f64, 0u64, 0.0f64);
    let (mut err2, mut ref2, mut dot, mut dev2, mut n) = (0.0f64, 0.0f64, 0.0f64, 0.0f64, 0usize);
    let (mut bound_at_worst, mut margin) = (0.0f64, f64::INFINITY);
    let mut pass = true;
    let mut have_worst = false;
    let mut message = None;
    for (oi, (r, d)) in reference.iter().zip(device).enumerate() {
        match (r, d, &b.per_output[oi]) {
            (Output::Ids(a), Output::Ids(bb), _) => {
                n += a.len();
                // A device that holds its inputs in a coarser format may decide near-ties as
                // the oracle does on the rounded inputs.
                let stored = b.stored_inputs_reference.as_ref().and_then(|s| s.get(oi));
                if a != bb && stored != Some(d) {
                    pass = false;
                    let first = a.iter().zip(bb).position(|(x, y)| x != y).unwrap_or(a.len().min(bb.len()));
                    message = Some(format!("output {oi}: ids differ at index {first}: expected {:?}, got {:?}", a.get(first), bb.get(first)));
                    margin = margin.min(-1.0);
                } else {
                    margin = margin.min(0.0);
                }
            }
            (Output::F32(a), Output::F32(bb), Some(bound)) => {
                if a.shape != bb.shape || a.data.len() != bb.data.len() {
                    return (false, m, 0.0, f64::NEG_INFINITY, Some(format!("output {oi}: shape {:?}, expected {:?}", bb.shape, a.shape)));
                }
                for i in 0..a.data.len() {
                    let (x, y) = (a.data[i], bb.data[i]);
                    n += 1;
                    if x.is_finite() != y.is_finite() || (x.is_nan() != y.is_nan()) {
                        pass = false;
                        margin = f64::NEG_INFINITY;
                        message.get_or_insert_with(|| format!("output {oi}[{i}]: device {y}, oracle {x} (non-finite mismatch)"));
                        continue;
                    }
                    if !x.is_finite() {
                        if x != y && !(x.is_nan() && y.is_nan()) {
                            pass = false;
                            margin = f64::NEG_INFINITY;
                        }
                        continue;
                    }
                    let (xf, yf) = (x as f64, y as f64);
                    let err = (xf - yf).abs();
                    max_abs = max_abs.max(err);
                    if xf.abs() > f32::MIN_POSITIVE as f64 {
                        max_rel = max_rel.max(err / xf.abs());
                    }
                    max_ulp = max_ulp.max(ulp_distance(x, y));
                    err2 += err * err;
                    ref2 += xf * xf;
                    dev2 += yf * yf;
                    dot += xf * yf;
                    let ratio = if bound[i] > 0.0 { err / bound[i] } else if err > 0.0 { f64::INFINITY } else { 0.0 };
                    if ratio > worst_ratio || !have_worst {
                        worst_ratio = worst_ratio.max(ratio);
                        bound_at_worst = bound[i];
                        have_worst = true;
                    }
                    margin = margin.min(bound[i] - err);
                    if err > bound[i] {
                        pass = false;
                        message.get_or_insert_with(|| format!("output {oi}[{i}]: |{y} - {x}| = {err:.3e} > bound {:.3e}", bound[i]));
                    }
                }
            }
            _ => return (false, m, 0.0, f64::NEG_INFINITY, Some(format!("output {oi}: kind differs from the reference"))),
        }
    }
    m.set("max_abs", max_abs);
    m.set("max_rel", max_rel);
    m.set("max_ulp", max_ulp);
    m.set("nmse", if ref2 > 0.0 { err2 / ref2 } else { err2 });
    m.set("cosine", if ref2 > 0.0 && dev2 > 0.0 { dot / (ref2 * dev2).sqrt() } else { 1.0 });
    m.set("worst_error_over_bound", worst_ratio.is_finite().then_some(worst_ratio));
    m.set("values", n);
    if n == 0 {
        return (false, m, 0.0, f64::NEG_INFINITY, Some("no values compared".into()));
    }
    (pass, m, bound_at_worst, if margin == f64::INFINITY { 0.0 } else { margin }, message)
}

/// A case's verdict before the device runs it (unsupported, or the oracle could not run it), or
/// the reference outputs it will be judged against.
fn prepare(device: &dyn Device, case: &OpCase) -> Result<Vec<Output>, Case> {
    if let Support::Unsupported(why) = device.supports(case) {
        return Err(verdict(device, case, Verdict::Unsupported, Some(why)));
    }
    reference(case).map_err(|e| verdict(device, case, Verdict::Error, Some(e)))
}

/// The oracle's outputs for `case`. A case read from a file whose inputs do not fit together
/// (shapes its parameters contradict) is an error naming it, never a panic of the run.
pub fn reference(case: &OpCase) -> Result<Vec<Output>, String> {
    let entry = registry().into_iter().find(|e| e.op == case.op).ok_or_else(|| format!("oracle: no op `{}` in the registry", case.op))?;
    match std::panic::catch_unwind(|| (entry.reference)(case)) {
        Ok(r) => r.map_err(|e| format!("oracle: {e}")),
        Err(_) => Err(format!("oracle: the inputs of `{}` do not fit its op's shapes and parameters", case.id)),
    }
}

/// A case decided without a comparison.
fn verdict(device: &dyn Device, case: &OpCase, verdict: Verdict, message: Option<String>) -> Case {
    Case { id: case.id.clone(), device: device.name(), verdict, metrics: Metrics::new(), tolerance: Tolerance { rule: "-".into(), bound: 0.0 }, margin: 0.0, message }
}

/// The case judged: the device's result against the reference, under the bounds of the
/// arithmetic it declares for the case.
fn judge(device: &dyn Device, case: &OpCase, reference: &[Output], result: std::thread::Result<Result<Vec<Output>, devices::DeviceError>>) -> Case {
    let dev_out = match result {
        Ok(Ok(o)) => o,
        Ok(Err(e @ devices::DeviceError::WrongResult { .. })) => return verdict(device, case, Verdict::Fail, Some(e.to_string())),
        Ok(Err(devices::DeviceError::Unsupported { reason, .. })) => return verdict(device, case, Verdict::Unsupported, Some(reason)),
        Ok(Err(e)) => return verdict(device, case, Verdict::Error, Some(e.to_string())),
        Err(_) => return verdict(device, case, Verdict::Error, Some("the device panicked".into())),
    };
    let arith = device.arithmetic(case);
    let b = bounds(case, reference, &arith);
    let (pass, mut metrics, bound, margin, message) = compare(reference, &dev_out, &b);
    metrics.set("arithmetic", arith);
    Case { id: case.id.clone(), device: device.name(), verdict: if pass { Verdict::Pass } else { Verdict::Fail }, metrics, tolerance: Tolerance { rule: b.rule, bound }, margin, message }
}

/// Runs one case on `device`.
pub fn run_case(device: &dyn Device, case: &OpCase, perf: bool) -> Case {
    let reference = match prepare(device, case) {
        Ok(r) => r,
        Err(decided) => return decided,
    };
    let t = Instant::now();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| device.run_op(case)));
    let mut seconds = t.elapsed().as_secs_f64();
    let mut judged = judge(device, case, &reference, result);
    judged.metrics.set("wall_seconds", seconds);
    if perf && judged.verdict != Verdict::Error {
        let entry = registry().into_iter().find(|e| e.op == case.op).expect("case from the registry");
        // GPU devices report their kernels' own time (device events, copies excluded).
        let events = device.last_kernel_seconds().is_some();
        if let Some(s) = device.last_kernel_seconds() {
            seconds = s;
        }
        for _ in 0..2 {
            let t = Instant::now();
            let _ = device.run_op(case);
            device.synchronize();
            seconds = seconds.min(device.last_kernel_seconds().unwrap_or_else(|| t.elapsed().as_secs_f64()));
        }
        let metrics = &mut judged.metrics;
        metrics.set("seconds", seconds);
        metrics.set("timing", if events { "device events (kernels only)" } else { "wall clock" });
        metrics.set("gbps", (entry.bytes)(case) as f64 / seconds / 1e9);
        metrics.set("gflops", (entry.flops)(case) as f64 / seconds / 1e9);
    }
    judged
}

/// Runs `cases` (from `select_cases`) on `device`; `progress(done, total)` is called after each
/// case, or after each batch on a device that takes cases in batches (an `exec:` engine through
/// the op protocol; `perf` does not apply there: a batch has one wall time).
pub fn run(device: &dyn Device, cases: &[OpCase], perf: bool, mut progress: impl FnMut(usize, usize)) -> Vec<Case> {
    let total = cases.len();
    let batch = device.op_batch().max(1);
    if batch == 1 {
        return cases
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let r = run_case(device, c, perf);
                progress(i + 1, total);
                r
            })
            .collect();
    }
    let mut out: Vec<Case> = Vec::with_capacity(total);
    for chunk in cases.chunks(batch) {
        let prepared: Vec<Result<Vec<Output>, Case>> = chunk.iter().map(|c| prepare(device, c)).collect();
        let ready: Vec<(&OpCase, Vec<devices::ops_protocol::OutputSpec>)> =
            chunk.iter().zip(&prepared).filter_map(|(c, p)| p.as_ref().ok().map(|r| (c, r.iter().map(devices::ops_protocol::OutputSpec::of).collect()))).collect();
        let t = Instant::now();
        let mut results = if ready.is_empty() { Vec::new() } else { device.run_ops(&ready) }.into_iter();
        let each = t.elapsed().as_secs_f64() / ready.len().max(1) as f64;
        for (c, p) in chunk.iter().zip(prepared) {
            out.push(match p {
                Err(decided) => decided,
                Ok(reference) => {
                    let result = results.next().unwrap_or_else(|| Err(devices::DeviceError::WrongResult { device: device.name(), case: c.id.clone(), reason: "the device returned fewer results than cases".into() }));
                    let mut judged = judge(device, c, &reference, Ok(result));
                    judged.metrics.set("wall_seconds", each);
                    judged
                }
            });
        }
        progress(out.len(), total);
    }
    out
}
