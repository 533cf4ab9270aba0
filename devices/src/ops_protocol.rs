//! The op protocol (docs/OP_PROTOCOL.md): an `exec:` engine runs kernel-suite cases in batches.
//!
//! Touchstone asks the engine once for its capabilities (`TOUCHSTONE_TASK=capabilities`), then
//! writes each batch of cases as `cases.json` + `inputs.safetensors`, runs the engine
//! (`TOUCHSTONE_TASK=ops`) and reads `results.json` + `outputs.safetensors`. The engine is
//! untrusted: every file is size-checked before it is read, never followed through a symbolic
//! link, and every output's dtype, shape and case are checked; a batch that crashes, hangs or
//! breaks a limit fails its own cases and nothing else. Nothing here computes: the values are
//! handed over and back as they are.

use crate::process::{log_tail, run_bounded_watching};
use crate::Arithmetic;
use oracle::quant::GgmlType;
use oracle::registry::{Input, OpCase, Output, Tensor};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

/// The protocol's name and version (in `capabilities.json` and `cases.json`).
pub const PROTOCOL: &str = "touchstone-ops";
pub const VERSION: u32 = 1;

/// Cases per batch unless `TOUCHSTONE_OPS_BATCH` says otherwise.
pub const DEFAULT_BATCH: usize = 256;

/// The largest `capabilities.json` or `results.json` read.
const JSON_LIMIT: u64 = 16 << 20;

/// What a case's output is: ids (exact) or f32 values, and its shape.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputSpec {
    pub ids: bool,
    pub shape: Vec<usize>,
}

impl OutputSpec {
    /// The spec of a reference output: the engine is told what to return, never the values.
    pub fn of(o: &Output) -> OutputSpec {
        match o {
            Output::F32(t) => OutputSpec { ids: false, shape: t.shape.clone() },
            Output::Ids(v) => OutputSpec { ids: true, shape: vec![v.len()] },
        }
    }
    fn len(&self) -> usize {
        self.shape.iter().product()
    }
}

/// What an engine says it can do (`capabilities.json`).
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Capabilities {
    pub protocol: String,
    pub version: u32,
    #[serde(default)]
    pub name: Option<String>,
    pub ops: Vec<String>,
    #[serde(default)]
    pub weight_types: Vec<String>,
    pub arithmetic: Arithmetic,
    #[serde(default)]
    pub arithmetic_by_op: BTreeMap<String, Arithmetic>,
}

impl Capabilities {
    /// The arithmetic the engine declares for `op`.
    pub fn arithmetic_of(&self, op: &str) -> Arithmetic {
        self.arithmetic_by_op.get(op).copied().unwrap_or(self.arithmetic)
    }

    /// Why the engine cannot run `case`, or None when it can.
    pub fn refuses(&self, case: &OpCase) -> Option<String> {
        if !self.ops.iter().any(|o| o == case.op.name()) {
            return Some(format!("the engine's capabilities.json does not list op `{}`", case.op));
        }
        for (name, input) in &case.inputs {
            if let Input::Quant { ty, .. } = input {
                if !self.weight_types.iter().any(|t| t.eq_ignore_ascii_case(ty.name())) {
                    return Some(format!("the engine's capabilities.json does not list weight type `{}` (input `{name}`)", ty.name().to_lowercase()));
                }
            }
        }
        None
    }

    /// Refuses what the suite cannot use: another protocol or version, an op the registry does
    /// not have, a weight type GGML does not have, an arithmetic outside the bounds' domain.
    fn check(&self, file: &Path) -> Result<(), String> {
        let at = |what: String| format!("{}: {what}", file.display());
        if self.protocol != PROTOCOL || self.version != VERSION {
            return Err(at(format!("protocol {:?} version {} (Touchstone speaks {PROTOCOL} version {VERSION})", self.protocol, self.version)));
        }
        let known: BTreeSet<&str> = oracle::registry::Op::ALL.iter().map(|o| o.name()).collect();
        for op in self.ops.iter().chain(self.arithmetic_by_op.keys()) {
            if !known.contains(op.as_str()) {
                return Err(at(format!("op `{op}` is not a registry op ({})", known.iter().copied().collect::<Vec<_>>().join(", "))));
            }
        }
        if let Some(t) = self.weight_types.iter().find(|t| GgmlType::from_name(&t.to_uppercase()).is_none() && GgmlType::from_name(t).is_none()) {
            return Err(at(format!("weight type `{t}` is not a GGML type")));
        }
        self.arithmetic.check().map_err(|e| at(format!("arithmetic: {e}")))?;
        for (op, a) in &self.arithmetic_by_op {
            a.check().map_err(|e| at(format!("arithmetic_by_op.{op}: {e}")))?;
        }
        Ok(())
    }
}

/// What became of one case of a batch.
#[derive(Debug)]
pub enum CaseOutcome {
    Done(Vec<Output>),
    /// The engine says it cannot run the case (reported `unsupported`).
    Unsupported(String),
    /// The engine failed the case: its error, a crash, a timeout, a bad output.
    Failed(String),
}

/// `sh -c cmd` with `env`, in a process group, bounded in time and in what it writes to `out`.
pub(crate) fn run(cmd: &str, env: &[(&str, &Path)], task: &str, out: &Path, timeout: Duration, out_limit: u64) -> Result<(), String> {
    let log = out.parent().unwrap_or(out).join("engine.log");
    let mut command = std::process::Command::new("sh");
    command.arg("-c").arg(cmd).env("TOUCHSTONE_TASK", task).env("TOUCHSTONE_OUT", out);
    for (k, v) in env {
        command.env(k, v);
    }
    let tail = || log_tail(&log);
    match run_bounded_watching(&mut command, &log, &log, timeout, "set TOUCHSTONE_EXEC_TIMEOUT to allow more", Some((out, out_limit))) {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => Err(format!("`{cmd}` exited with {status} (TOUCHSTONE_TASK={task}){}", tail())),
        Err(e) => Err(format!("`{cmd}` {e} (TOUCHSTONE_TASK={task}){}", tail())),
    }
}

/// A file the engine wrote: a regular file (not a link) of at most `limit` bytes, read whole.
fn read_limited(path: &Path, limit: u64) -> Result<Option<Vec<u8>>, String> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    if !meta.file_type().is_file() {
        return Err(format!("{}: not a regular file (a link or a directory is never followed)", path.display()));
    }
    if meta.len() > limit {
        return Err(format!("{}: {} bytes, more than the {} allowed", path.display(), meta.len(), limit));
    }
    std::fs::read(path).map(Some).map_err(|e| format!("{}: {e}", path.display()))
}

/// Asks the engine what it supports.
pub fn query_capabilities(cmd: &str, timeout: Duration) -> Result<Capabilities, String> {
    let work = tempfile::Builder::new().prefix("touchstone-ops-").tempdir().map_err(|e| format!("cannot create a work directory: {e}"))?;
    let out = work.path().join("out");
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    run(cmd, &[], "capabilities", &out, timeout, JSON_LIMIT + (1 << 20)).map_err(|e| format!("{e}; an engine that speaks the op protocol answers it (docs/OP_PROTOCOL.md)"))?;
    read_capabilities(&out.join("capabilities.json"))?.ok_or_else(|| format!("`{cmd}` wrote no capabilities.json: it does not speak the op protocol (docs/OP_PROTOCOL.md)"))
}

/// An engine's `capabilities.json`, parsed and checked (None when it is absent).
pub fn read_capabilities(path: &Path) -> Result<Option<Capabilities>, String> {
    let Some(bytes) = read_limited(path, JSON_LIMIT)? else { return Ok(None) };
    let caps: Capabilities = serde_json::from_slice(&bytes).map_err(|e| format!("capabilities.json: {e}"))?;
    caps.check(Path::new("capabilities.json"))?;
    Ok(Some(caps))
}

/// The input tensors of a batch, named `{index}.{input}`, and each case's entry of `cases.json`.
pub(crate) fn write_batch(dir: &Path, batch: &[(&OpCase, Vec<OutputSpec>)]) -> Result<(), String> {
    let mut owned: Vec<OwnedTensor> = Vec::new();
    let mut entries = Vec::new();
    for (i, (case, outputs)) in batch.iter().enumerate() {
        let mut inputs = Vec::new();
        for (name, input) in &case.inputs {
            let tensor = format!("{i}.{name}");
            let (dtype, shape) = match input {
                Input::F32(t) => {
                    owned.push((tensor.clone(), safetensors::Dtype::F32, t.shape.clone(), t.data.iter().flat_map(|v| v.to_le_bytes()).collect()));
                    ("f32".to_string(), t.shape.clone())
                }
                Input::Ids(v) => {
                    owned.push((tensor.clone(), safetensors::Dtype::U32, vec![v.len()], v.iter().flat_map(|v| v.to_le_bytes()).collect()));
                    ("u32".to_string(), vec![v.len()])
                }
                Input::Quant { ty, rows, cols, bytes } => {
                    owned.push((tensor.clone(), safetensors::Dtype::U8, vec![bytes.len()], bytes.clone()));
                    (ty.name().to_lowercase(), vec![*rows, *cols])
                }
            };
            let mut entry = json!({ "name": name, "tensor": tensor, "dtype": dtype, "shape": shape });
            if let Input::Quant { ty, .. } = input {
                entry["dtype"] = json!("ggml");
                entry["ggml_type"] = json!(ty.name().to_lowercase());
            }
            inputs.push(entry);
        }
        let outs: Vec<Value> = outputs.iter().enumerate().map(|(j, o)| json!({ "tensor": format!("{i}.out{j}"), "dtype": if o.ids { "u32" } else { "f32" }, "shape": o.shape })).collect();
        let params: serde_json::Map<String, Value> = case.params.iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
        entries.push(json!({ "id": case.id, "op": case.op, "seed": case.seed, "params": params, "inputs": inputs, "outputs": outs }));
    }
    write_safetensors(&dir.join("inputs.safetensors"), &owned)?;
    let cases = json!({ "protocol": PROTOCOL, "version": VERSION, "cases": entries });
    let path = dir.join("cases.json");
    std::fs::write(&path, serde_json::to_string(&cases).expect("json") + "\n").map_err(|e| format!("{}: {e}", path.display()))
}

/// A tensor to write: its name, dtype, shape and little-endian bytes.
pub(crate) type OwnedTensor = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// `tensors` written to `path` as one safetensors file.
pub(crate) fn write_safetensors(path: &Path, tensors: &[OwnedTensor]) -> Result<(), String> {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| safetensors::tensor::TensorView::new(*d, s.clone(), b).map(|v| (n.clone(), v)).map_err(|e| format!("{n}: {e}")))
        .collect::<Result<_, _>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The most the engine may write for a batch: four times its outputs' f32 size and 16 MiB.
fn output_limit(batch: &[(&OpCase, Vec<OutputSpec>)]) -> u64 {
    let values: u64 = batch.iter().flat_map(|(_, o)| o.iter().map(|s| s.len() as u64)).sum();
    values.saturating_mul(16).saturating_add(16 << 20)
}

/// Runs one batch on the engine: an outcome per case, in order. Problems of the whole batch
/// (a crash, a timeout, a malformed results.json) fail every case with the reason.
pub fn run_batch(cmd: &str, batch: &[(&OpCase, Vec<OutputSpec>)], timeout: Duration) -> Vec<CaseOutcome> {
    let all_failed = |why: String| batch.iter().map(|_| CaseOutcome::Failed(why.clone())).collect();
    let work = match tempfile::Builder::new().prefix("touchstone-ops-").tempdir() {
        Ok(w) => w,
        Err(e) => return all_failed(format!("cannot create a work directory: {e}")),
    };
    let (dir, out) = (work.path().join("batch"), work.path().join("out"));
    if let Err(e) = std::fs::create_dir_all(&dir).and_then(|_| std::fs::create_dir_all(&out)) {
        return all_failed(format!("{}: {e}", work.path().display()));
    }
    if let Err(e) = write_batch(&dir, batch) {
        return all_failed(format!("writing the batch: {e}"));
    }
    let limit = output_limit(batch);
    if let Err(e) = run(cmd, &[("TOUCHSTONE_BATCH", &dir)], "ops", &out, timeout, limit) {
        return all_failed(format!("its batch of {} cases failed: {e}", batch.len()));
    }
    match read_outcomes(&out, batch, limit) {
        Ok(o) => o,
        Err(e) => all_failed(format!("its batch of {} cases: {e}", batch.len())),
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Results {
    results: BTreeMap<String, CaseResult>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CaseResult {
    status: String,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    message: Option<String>,
}

/// Reads `results.json` and `outputs.safetensors` of a finished batch in `out` (at most `limit`
/// bytes of outputs): each case's outcome, or why the batch as a whole is refused.
pub fn read_outcomes(out: &Path, batch: &[(&OpCase, Vec<OutputSpec>)], limit: u64) -> Result<Vec<CaseOutcome>, String> {
    let rpath = out.join("results.json");
    let bytes = read_limited(&rpath, JSON_LIMIT)?.ok_or_else(|| format!("{}: not written (docs/OP_PROTOCOL.md)", rpath.display()))?;
    let results: Results = serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", rpath.display()))?;
    let ids: BTreeSet<&str> = batch.iter().map(|(c, _)| c.id.as_str()).collect();
    if let Some(unknown) = results.results.keys().find(|k| !ids.contains(k.as_str())) {
        return Err(format!("{}: names case `{unknown}`, which is not in this batch", rpath.display()));
    }
    let opath = out.join("outputs.safetensors");
    let any_done = results.results.values().any(|r| r.status == "done");
    let obytes = if any_done { read_limited(&opath, limit)?.ok_or_else(|| format!("{}: not written, but results.json says cases are done", opath.display()))? } else { Vec::new() };
    let tensors = if any_done { Some(safetensors::SafeTensors::deserialize(&obytes).map_err(|e| format!("{}: {e}", opath.display()))?) } else { None };
    let mut outcomes = Vec::with_capacity(batch.len());
    for (i, (case, specs)) in batch.iter().enumerate() {
        let Some(r) = results.results.get(&case.id) else {
            outcomes.push(CaseOutcome::Failed(format!("{}: no entry for this case", rpath.display())));
            continue;
        };
        outcomes.push(match r.status.as_str() {
            "done" => match tensors.as_ref().map(|t| read_outputs(t, i, specs)) {
                Some(Ok(o)) => CaseOutcome::Done(o),
                Some(Err(e)) => CaseOutcome::Failed(format!("{}: {e}", opath.display())),
                None => CaseOutcome::Failed(format!("{}: not read", opath.display())),
            },
            "unsupported" => CaseOutcome::Unsupported(format!("the engine: {}", r.reason.as_deref().or(r.message.as_deref()).unwrap_or("unsupported (no reason given)"))),
            "error" => CaseOutcome::Failed(format!("the engine's error: {}", r.message.as_deref().or(r.reason.as_deref()).unwrap_or("(no message)"))),
            other => CaseOutcome::Failed(format!("{}: status {other:?} (done, unsupported or error)", rpath.display())),
        });
    }
    Ok(outcomes)
}

/// The outputs of case `i`, checked against their specs.
fn read_outputs(st: &safetensors::SafeTensors, i: usize, specs: &[OutputSpec]) -> Result<Vec<Output>, String> {
    use safetensors::Dtype;
    let mut outs = Vec::with_capacity(specs.len());
    for (j, spec) in specs.iter().enumerate() {
        let name = format!("{i}.out{j}");
        let t = st.tensor(&name).map_err(|_| format!("no tensor `{name}`"))?;
        if t.shape() != spec.shape.as_slice() {
            return Err(format!("tensor `{name}` has shape {:?}, expected {:?}", t.shape(), spec.shape));
        }
        let d = t.data();
        let out = match (spec.ids, t.dtype()) {
            (false, Dtype::F32) => Output::F32(Tensor { shape: spec.shape.clone(), data: d.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect() }),
            (false, Dtype::F16) => Output::F32(Tensor { shape: spec.shape.clone(), data: d.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect() }),
            (false, Dtype::BF16) => Output::F32(Tensor { shape: spec.shape.clone(), data: d.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect() }),
            (true, Dtype::U32) => Output::Ids(d.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
            (true, Dtype::I32 | Dtype::I64) => {
                let w = if t.dtype() == Dtype::I32 { 4 } else { 8 };
                let mut ids = Vec::with_capacity(spec.len());
                for c in d.chunks_exact(w) {
                    let v = if w == 4 { i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64 } else { i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) };
                    ids.push(u32::try_from(v).map_err(|_| format!("tensor `{name}` holds id {v}, outside 0..2^32"))?);
                }
                Output::Ids(ids)
            }
            (ids, dt) => return Err(format!("tensor `{name}` is {dt:?}; expected {}", if ids { "U32, I32 or I64 ids" } else { "F32, F16 or BF16" })),
        };
        outs.push(out);
    }
    Ok(outs)
}

/// Cases per batch: `TOUCHSTONE_OPS_BATCH`, else [`DEFAULT_BATCH`].
pub fn batch_size() -> Result<usize, String> {
    let Ok(v) = std::env::var("TOUCHSTONE_OPS_BATCH") else { return Ok(DEFAULT_BATCH) };
    v.trim().parse::<usize>().ok().filter(|n| (1..=100_000).contains(n)).ok_or_else(|| format!("TOUCHSTONE_OPS_BATCH={v:?} is not a number of cases from 1 to 100000"))
}
