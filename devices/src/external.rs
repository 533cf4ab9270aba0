//! External engines through the dump protocol (docs/DUMP_FORMAT.md).
//!
//! - `external:DIR` reads a dump another engine already wrote.
//! - `exec:CMD` runs `sh -c CMD` with the request in its environment, waits (with a timeout), then
//!   reads the dump it wrote:
//!   `TOUCHSTONE_MODEL` (model file), `TOUCHSTONE_PROMPT_IDS` (comma-separated ids),
//!   `TOUCHSTONE_N_GENERATE` (greedy tokens wanted; 0 = one prefill), `TOUCHSTONE_OUT` (the
//!   directory to write), `TOUCHSTONE_MODEL_SHA256` (what the manifest's `model.sha256` must
//!   say). Its stdout and stderr go to `engine.log` in that directory.
//! - `ids:CMD` runs a token-only engine that writes no dump at all (a bare-metal kernel whose only
//!   output is a serial console): the same environment, and the greedy ids it generated read from
//!   the last line of its stdout that holds nothing but ids (comma- or space-separated; boot
//!   messages before it are ignored). Only the greedy gate can judge it.
//!
//! Everything read is checked before it is used: format and version, the model's sha256, the token
//! ids, each tensor's shape and every value's finiteness. A bad dump is an error naming the file
//! and tap (exit 2 upstream), never a silent pass. An external engine runs one prefill per dump:
//! it cannot be stepped token by token, so suites that need that report it as unsupported.
//! An `exec:` engine may also run single ops through the op protocol (`ops_protocol`,
//! docs/OP_PROTOCOL.md); one that does not answer its capabilities request runs none.

use crate::ops_protocol::{self, CaseOutcome, Capabilities, OutputSpec};
pub use crate::process::{file_tail, kill_process_group, run_bounded, run_bounded_watching, OUTPUT_LIMIT};
use crate::process::log_tail;
use crate::{Arithmetic, Device, DeviceError, DeviceModel, ModelOptions, Support};
use oracle::dump::{canonical_tap_name, read_manifest, read_tensors_where, Manifest};
use oracle::taps::EngineTap;
use oracle::registry::{OpCase, Output};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Default time an `exec:` engine may take for one request.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Clone, Debug)]
pub enum Source {
    Dir(PathBuf),
    Exec(String),
    Ids(String),
}

pub struct ExternalDevice {
    pub source: Source,
    pub timeout: Duration,
    /// An `exec:` engine's answer to the op protocol's capabilities request, asked once, when
    /// the kernel suite first needs it (docs/OP_PROTOCOL.md).
    capabilities: std::sync::OnceLock<Result<Capabilities, String>>,
    /// Cases per op batch (`TOUCHSTONE_OPS_BATCH`).
    batch: usize,
}

impl ExternalDevice {
    /// `external:DIR`, `exec:CMD` or `ids:CMD` (None for any other name); `TOUCHSTONE_EXEC_TIMEOUT`
    /// (seconds, up to a year) overrides the timeout, and a value that is not one is an error.
    pub fn parse(name: &str) -> Option<Result<ExternalDevice, String>> {
        let source = if let Some(dir) = name.strip_prefix("external:") {
            Source::Dir(PathBuf::from(dir))
        } else if let Some(cmd) = name.strip_prefix("ids:") {
            Source::Ids(cmd.to_string())
        } else {
            Source::Exec(name.strip_prefix("exec:")?.to_string())
        };
        Some(exec_timeout().and_then(|timeout| Ok(ExternalDevice { source, timeout, capabilities: Default::default(), batch: ops_protocol::batch_size()? })))
    }

    /// The engine's capabilities, or why it has none (a dump directory, a token-only engine, an
    /// engine that does not answer the request).
    pub fn capabilities(&self) -> Result<&Capabilities, String> {
        let Source::Exec(cmd) = &self.source else {
            return Err("a dump directory or a token-only engine runs no single op (an `exec:` engine that speaks the op protocol does: docs/OP_PROTOCOL.md)".into());
        };
        self.capabilities.get_or_init(|| ops_protocol::query_capabilities(cmd, self.timeout)).as_ref().map_err(|e| e.clone())
    }
}

/// `TOUCHSTONE_EXEC_TIMEOUT` (seconds), else [`DEFAULT_TIMEOUT`].
fn exec_timeout() -> Result<Duration, String> {
    let Ok(v) = std::env::var("TOUCHSTONE_EXEC_TIMEOUT") else { return Ok(DEFAULT_TIMEOUT) };
    v.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| *s > 0.0 && *s <= 365.0 * 86_400.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| format!("TOUCHSTONE_EXEC_TIMEOUT={v:?} is not a number of seconds (more than 0, at most a year)"))
}

impl Device for ExternalDevice {
    fn name(&self) -> String {
        match &self.source {
            Source::Dir(d) => format!("external:{}", d.display()),
            Source::Exec(c) => format!("exec:{c}"),
            Source::Ids(c) => format!("ids:{c}"),
        }
    }
    fn declared_name(&self) -> Option<String> {
        // Asked only of an engine that already answered the capabilities query.
        self.capabilities.get().and_then(|c| c.as_ref().ok()).and_then(|c| c.name.clone())
    }
    fn arithmetic(&self, case: &OpCase) -> Arithmetic {
        self.capabilities().map_or(Arithmetic::F32, |c| c.arithmetic_of(case.op.name()))
    }
    fn supports(&self, case: &OpCase) -> Support {
        match self.capabilities() {
            Ok(c) => c.refuses(case).map_or(Support::Yes, Support::Unsupported),
            Err(why) => Support::Unsupported(format!("the engine runs no single op: {why}")),
        }
    }
    fn run_op(&self, case: &OpCase) -> Result<Vec<Output>, DeviceError> {
        let reference = (oracle::registry::registry().into_iter().find(|e| e.op == case.op).ok_or_else(|| crate::fail(&self.name(), case, "not a registry op"))?.reference)(case)
            .map_err(|e| crate::fail(&self.name(), case, format!("the case's output shapes: {e}")))?;
        let specs = reference.iter().map(OutputSpec::of).collect();
        self.run_ops(&[(case, specs)]).pop().expect("one case, one result")
    }
    fn op_batch(&self) -> usize {
        self.batch
    }
    fn run_ops(&self, cases: &[(&OpCase, Vec<OutputSpec>)]) -> Vec<Result<Vec<Output>, DeviceError>> {
        let name = self.name();
        let Source::Exec(cmd) = &self.source else {
            return cases.iter().map(|(c, _)| Err(crate::fail(&name, c, "external engines given as a dump run whole models only"))).collect();
        };
        ops_protocol::run_batch(cmd, cases, self.timeout)
            .into_iter()
            .zip(cases)
            .map(|(o, (c, _))| match o {
                CaseOutcome::Done(out) => Ok(out),
                CaseOutcome::Unsupported(reason) => Err(DeviceError::Unsupported { device: name.clone(), case: c.id.clone(), reason }),
                CaseOutcome::Failed(reason) => Err(DeviceError::WrongResult { device: name.clone(), case: c.id.clone(), reason }),
            })
            .collect()
    }
    fn load_model(&self, path: &Path, opts: &ModelOptions) -> Result<Box<dyn DeviceModel>, DeviceError> {
        let (src, spec, _) = oracle::loader::open_model(path).map_err(|e| DeviceError::Unavailable(self.name(), e.to_string()))?;
        drop(src);
        Ok(Box::new(ExternalModel {
            name: self.name(),
            source: self.source.clone(),
            timeout: self.timeout,
            model_path: path.to_path_buf(),
            model_sha256: opts.model_sha256.clone(),
            spec,
            cached: 0,
            arithmetic: Arithmetic::F32,
            declared_name: None,
            workdir: None,
            batch_invariant: false,
            has_served: false,
        }))
    }
}

pub struct ExternalModel {
    name: String,
    source: Source,
    timeout: Duration,
    model_path: PathBuf,
    model_sha256: Option<String>,
    spec: oracle::ModelSpec,
    cached: usize,
    arithmetic: Arithmetic,
    /// The manifest's `device`, once a dump was read.
    declared_name: Option<String>,
    /// Where `exec:` dumps go (kept until the model is dropped, so they can be inspected).
    workdir: Option<tempfile::TempDir>,
    /// Whether the engine's answers to schedules declare it batch-invariant (the last answer's
    /// `__metadata__`).
    batch_invariant: bool,
    /// Whether it has answered a schedule: a later failure without an answer is then an error,
    /// not a sign that it serves none.
    has_served: bool,
}

/// A checked dump: manifest + taps under our names + logits.
pub struct Dump {
    pub manifest: Manifest,
    /// Taps of known kinds, and (`EngineTap::Other`) of none, each as the dump gave it.
    pub taps: Vec<(EngineTap, usize, Vec<f32>)>,
    pub logits: Option<Vec<f32>>,
}

fn bad(dir: &Path, what: impl std::fmt::Display) -> DeviceError {
    DeviceError::Failed { device: format!("external:{}", dir.display()), case: "dump".into(), reason: what.to_string() }
}

/// Reads and checks the dump in `dir` against the request: the token ids, the model hash when
/// known, the shapes and the finiteness of every value.
pub fn read_dump(dir: &Path, tokens: &[u32], model_sha256: Option<&str>, n_vocab: usize) -> Result<Dump, DeviceError> {
    let manifest = read_manifest(dir).map_err(|e| bad(dir, e))?;
    let mpath = dir.join("manifest.json");
    if let Some(want) = model_sha256 {
        if !manifest.model.sha256.eq_ignore_ascii_case(want) {
            return Err(bad(dir, format!("{}: model.sha256 is {:?}, but the model under test has sha256 {want}", mpath.display(), manifest.model.sha256)));
        }
    }
    if manifest.token_ids != tokens {
        let at = manifest.token_ids.iter().zip(tokens).position(|(a, b)| a != b).unwrap_or(manifest.token_ids.len().min(tokens.len()));
        return Err(bad(dir, format!("{}: token_ids differ from the requested ids at position {at} ({} ids in the dump, {} requested)", mpath.display(), manifest.token_ids.len(), tokens.len())));
    }
    let n = tokens.len();
    if manifest.positions != (0..n).collect::<Vec<_>>() {
        return Err(bad(dir, format!("{}: positions must be 0..{n} (one per token id, in order)", mpath.display())));
    }
    if let Some(g) = &manifest.generated_ids {
        if let Some(id) = g.iter().find(|&&id| id as usize >= n_vocab) {
            return Err(bad(dir, format!("{}: generated id {id} is outside the vocabulary of {n_vocab}", mpath.display())));
        }
    }
    // Twice under one name, or under two names that are one tap (`l_out-3` is `blk.3.l_out`):
    // either copy could have been the one judged.
    let mut listed: std::collections::HashMap<String, &str> = std::collections::HashMap::new();
    for t in &manifest.taps {
        if let Some(first) = listed.insert(canonical_tap_name(&t.name), &t.name) {
            let what = if first == t.name { format!("tap `{first}` is listed twice") } else { format!("taps `{first}` and `{}` are one tap, `{}`", t.name, canonical_tap_name(&t.name)) };
            return Err(bad(dir, format!("{}: {what}", mpath.display())));
        }
    }
    let mut files: Vec<&str> = manifest.taps.iter().map(|t| t.file.as_str()).chain(manifest.logits.iter().map(|l| l.file.as_str())).collect();
    files.sort_unstable();
    files.dedup();
    let mut tensors = std::collections::HashMap::new();
    for f in files {
        let listed = |name: &str| manifest.taps.iter().chain(&manifest.logits).any(|t| t.file == f && t.name == name);
        for t in read_tensors_where(dir, f, &listed).map_err(|e| bad(dir, e))? {
            tensors.insert((f.to_string(), t.name.clone()), t);
        }
    }
    let mut take = |entry: &oracle::dump::TapEntry, width_must: Option<usize>| -> Result<(usize, Vec<f32>), DeviceError> {
        let file = dir.join(&entry.file);
        let t = tensors.remove(&(entry.file.clone(), entry.name.clone())).ok_or_else(|| bad(dir, format!("{}: no tensor `{}` (listed in manifest.json)", file.display(), entry.name)))?;
        if !["f32", "f16", "bf16"].contains(&entry.dtype.as_str()) {
            return Err(bad(dir, format!("manifest.json: tap `{}` has dtype {:?} (f32, f16, bf16 allowed)", entry.name, entry.dtype)));
        }
        if t.dtype != entry.dtype {
            return Err(bad(dir, format!("{}: tensor `{}` is stored as {}, but manifest.json says {}", file.display(), entry.name, t.dtype, entry.dtype)));
        }
        let (shape, vals) = (t.shape, t.values);
        if shape != entry.shape || shape.len() != 2 || shape[0] != n || width_must.is_some_and(|w| shape[1] != w) {
            return Err(bad(
                dir,
                format!("{}: tensor `{}` has shape {shape:?} (manifest says {:?}); expected [{n}, {}]", file.display(), entry.name, entry.shape, width_must.map_or("width".into(), |w| w.to_string())),
            ));
        }
        if let Some(i) = vals.iter().position(|v| !v.is_finite()) {
            return Err(bad(dir, format!("{}: tensor `{}` has a non-finite value ({}) at position {}, element {}", file.display(), entry.name, vals[i], i / shape[1].max(1), i % shape[1].max(1))));
        }
        Ok((shape[1], vals))
    };
    let mut taps = Vec::new();
    for t in &manifest.taps {
        let (w, v) = take(t, None)?;
        taps.push((EngineTap::parse(&canonical_tap_name(&t.name)), w, v));
    }
    let logits = match &manifest.logits {
        Some(l) => Some(take(l, Some(n_vocab))?.1),
        None => None,
    };
    if logits.is_none() && manifest.generated_ids.is_none() {
        return Err(bad(dir, format!("{}: neither logits nor generated_ids: nothing to judge", mpath.display())));
    }
    Ok(Dump { manifest, taps, logits })
}

impl ExternalModel {
    /// The dump for `tokens` (and `n_generate` greedy ids): read from the directory, or produced by
    /// running the command.
    fn obtain(&mut self, tokens: &[u32], n_generate: usize) -> Result<Dump, DeviceError> {
        let dir = match &self.source {
            Source::Dir(d) => d.clone(),
            Source::Exec(cmd) => {
                let work = tempfile::Builder::new().prefix("touchstone-exec-").tempdir().map_err(|e| self.failed(format!("cannot create a work directory: {e}")))?;
                let out = work.path().join("dump");
                std::fs::create_dir_all(&out).map_err(|e| self.failed(format!("{}: {e}", out.display())))?;
                let ran = run_engine(cmd, &self.model_path, self.model_sha256.as_deref(), tokens, n_generate, &out, self.timeout, None);
                // TOUCHSTONE_KEEP_DUMPS=DIR: what the engine wrote stays there, to be inspected.
                let kept = keep_dump(&out);
                let note = kept.as_ref().map_or(String::new(), |k| format!(" (kept in {})", k.display()));
                ran.map_err(|r| self.failed(format!("{r}{note}")))?;
                if !out.join("manifest.json").exists() {
                    return Err(self.failed(format!("`{cmd}` exited 0 but wrote no dump (no manifest.json in $TOUCHSTONE_OUT; docs/DUMP_FORMAT.md){note}{}", log_tail(&out.join("engine.log")))));
                }
                if let Some(k) = kept {
                    let dump = read_dump(&k, tokens, self.model_sha256.as_deref(), self.spec.n_vocab).map_err(|e| self.failed(format!("{e} (kept in {})", k.display())))?;
                    self.workdir = Some(work);
                    return self.with_arithmetic(dump, &k);
                }
                self.workdir = Some(work);
                out
            }
            Source::Ids(_) => return Err(self.failed("an `ids:` engine prints the ids it generated and nothing else; this suite needs its logits or taps (`fixed-token` judges its greedy ids; an engine that can write a dump runs as `exec:`)")),
        };
        let dump = read_dump(&dir, tokens, self.model_sha256.as_deref(), self.spec.n_vocab)?;
        self.with_arithmetic(dump, &dir)
    }

    /// Takes the arithmetic a checked dump declares, and the name it gives its engine.
    fn with_arithmetic(&mut self, dump: Dump, dir: &Path) -> Result<Dump, DeviceError> {
        self.declared_name = Some(dump.manifest.device.clone());
        if let Some(a) = &dump.manifest.arithmetic {
            let arithmetic: Arithmetic = serde_json::from_value(a.clone()).map_err(|e| bad(dir, format!("manifest.json: arithmetic: {e}")))?;
            arithmetic.check().map_err(|e| bad(dir, format!("manifest.json: arithmetic: {e}")))?;
            self.arithmetic = arithmetic;
        }
        Ok(dump)
    }

    /// Runs the schedule task (docs/SERVING_PROTOCOL.md): `TOUCHSTONE_TASK=schedule`,
    /// `TOUCHSTONE_SCHEDULE` (schedule.json), `TOUCHSTONE_MODEL`, `TOUCHSTONE_OUT`; the answer is
    /// `served.safetensors` there, one f32 tensor `[positions, n_vocab]` per request, named by its
    /// id. An engine that exits non-zero and writes no answer to its first schedule does not
    /// serve schedules (None). With `tapped` (a request's id and a tap), the engine is asked for
    /// that request's taps (`TOUCHSTONE_SERVE_TAPS`), recorded at its computed positions.
    fn served(&mut self, cmd: &str, schedule: &oracle::schedule::Schedule, tapped: Option<(&str, &mut dyn oracle::Tap)>) -> Result<Option<oracle::schedule::Served>, String> {
        schedule.validate().map_err(|e| format!("schedule: {e}"))?;
        let work = tempfile::Builder::new().prefix("touchstone-serve-").tempdir().map_err(|e| format!("cannot create a work directory: {e}"))?;
        let out = work.path().join("out");
        std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
        let task = work.path().join("schedule.json");
        std::fs::write(&task, serde_json::to_vec(schedule).map_err(|e| e.to_string())?).map_err(|e| format!("{}: {e}", task.display()))?;
        let n_vocab = self.spec.n_vocab;
        let values: u64 = schedule.requests.iter().map(|r| ((r.tokens.len() - r.first_computed()) * n_vocab) as u64).sum();
        let mut limit = values.saturating_mul(4).saturating_add(16 << 20);
        let mut env: Vec<(&str, &Path)> = vec![("TOUCHSTONE_SCHEDULE", task.as_path()), ("TOUCHSTONE_MODEL", self.model_path.as_path())];
        let tapped_id = tapped.as_ref().map(|(id, _)| id.to_string());
        if let Some(id) = &tapped_id {
            // A request's taps: every position, up to 32 taps a layer of the widest activation.
            let r = schedule.request(id).ok_or_else(|| format!("no request `{id}` to record the taps of"))?;
            let s = &self.spec;
            let per_position = (s.n_layer as u64 * 32 + 8) * s.n_embd.max(s.n_ff).max(s.n_head * s.head_dim) as u64;
            limit = limit.saturating_add((r.tokens.len() as u64).saturating_mul(per_position).saturating_mul(4));
            env.push(("TOUCHSTONE_SERVE_TAPS", Path::new(id.as_str())));
        }
        let ran = ops_protocol::run(cmd, &env, "schedule", &out, self.timeout, limit);
        let answered = std::fs::symlink_metadata(out.join(SERVED_FILE)).is_ok();
        self.workdir = Some(work);
        match (ran, answered) {
            (Err(e), false) if !self.has_served => {
                // Unsupported, not an error: but why it did not answer is said.
                eprintln!("note: `{cmd}` answered no schedule, so it is taken not to serve them: {e}");
                return Ok(None);
            }
            (Err(e), false) => return Err(format!("{e} (it answered earlier schedules; this one: {})", schedule_summary(schedule))),
            (Err(e), true) => return Err(e),
            (Ok(()), false) => return Err(format!("`{cmd}` exited 0 for TOUCHSTONE_TASK=schedule but wrote no {SERVED_FILE} (docs/SERVING_PROTOCOL.md)")),
            (Ok(()), true) => {}
        }
        let answer = read_served(&out, n_vocab)?;
        self.has_served = true;
        if let Some(id) = answer.taps.keys().find(|id| schedule.request(id).is_none()) {
            return Err(format!("taps of request `{id}`, which is not in the schedule"));
        }
        if let (Some((id, taps)), Some(r)) = (tapped, tapped_id.as_deref().and_then(|id| schedule.request(id))) {
            let first = r.first_computed();
            let n = r.tokens.len() - first;
            for (name, width, values) in answer.taps.get(id).map(Vec::as_slice).unwrap_or_default() {
                if values.len() != n * width {
                    return Err(format!("request `{id}` tap `{name}`: {} values, expected {n} positions x {width}", values.len()));
                }
                taps.record(&canonical_tap_name(name), first, n, *width, values);
            }
        }
        self.batch_invariant = answer.batch_invariant;
        if let Some(a) = answer.arithmetic {
            self.arithmetic = a;
        }
        Ok(Some(answer.served))
    }

    fn failed(&self, reason: impl std::fmt::Display) -> DeviceError {
        DeviceError::Failed { device: self.name.clone(), case: "run".into(), reason: reason.to_string() }
    }

    /// The greedy ids an `ids:` engine printed for `prompt`: the last line of its stdout that
    /// holds only ids, checked against the vocabulary; ids beyond `max_new` are ignored.
    fn printed_ids(&mut self, cmd: &str, prompt: &[u32], max_new: usize) -> Result<Vec<u32>, DeviceError> {
        let work = tempfile::Builder::new().prefix("touchstone-ids-").tempdir().map_err(|e| self.failed(format!("cannot create a work directory: {e}")))?;
        let out = work.path().join("out");
        std::fs::create_dir_all(&out).map_err(|e| self.failed(format!("{}: {e}", out.display())))?;
        let stdout_path = work.path().join("stdout.txt");
        let result = run_engine(cmd, &self.model_path, self.model_sha256.as_deref(), prompt, max_new, &out, self.timeout, Some(&stdout_path));
        self.workdir = Some(work);
        result.map_err(|r| self.failed(r))?;
        // The ids are on its last lines: 16 MiB holds 2^20 ids of 7 digits and their separators.
        let text = file_tail(&stdout_path, 16 << 20);
        let text = String::from_utf8_lossy(&text);
        let line = text.lines().rev().map(str::trim).find(|l| !l.is_empty() && l.chars().all(|c| c.is_ascii_digit() || c == ',' || c.is_whitespace()) && l.chars().any(|c| c.is_ascii_digit()));
        let Some(line) = line else {
            let last: Vec<&str> = text.lines().rev().take(3).collect();
            return Err(self.failed(format!("`{cmd}` printed no line of token ids on stdout (the last lines: {:?})", last.into_iter().rev().collect::<Vec<_>>())));
        };
        let mut ids = Vec::new();
        for t in line.split(|c: char| c == ',' || c.is_whitespace()).filter(|t| !t.is_empty()) {
            let id: u32 = t.parse().map_err(|_| self.failed(format!("`{cmd}` printed `{t}`, not a token id")))?;
            if id as usize >= self.spec.n_vocab {
                return Err(self.failed(format!("`{cmd}` printed id {id}, outside the vocabulary of {}", self.spec.n_vocab)));
            }
            ids.push(id);
        }
        ids.truncate(max_new);
        Ok(ids)
    }
}

/// The answer file of the schedule task.
pub const SERVED_FILE: &str = "served.safetensors";

/// A schedule in a few words for an error: its requests with their slots and arrivals.
fn schedule_summary(s: &oracle::schedule::Schedule) -> String {
    let mut parts: Vec<String> = s.requests.iter().take(8).map(|r| format!("`{}` slot {} at step {}", r.id, r.slot, r.arrive)).collect();
    if s.requests.len() > 8 {
        parts.push(format!("{} more", s.requests.len() - 8));
    }
    format!("{} slots, {}", s.slots, parts.join(", "))
}

/// An engine's answer to a schedule: the logits, and what its `__metadata__` declares.
pub struct ServedAnswer {
    pub served: oracle::schedule::Served,
    /// `batch_invariant`: "true".
    pub batch_invariant: bool,
    /// `arithmetic`: the engine's declared arithmetic, as a dump manifest's `arithmetic` (JSON),
    /// checked; None when not given (the arithmetic of the engine's dumps, or f32, stands).
    pub arithmetic: Option<Arithmetic>,
    /// Taps of a request, by its id: tensors named `ID/TAP` (`[positions, width]`, the positions
    /// it computed), as the engine wrote them when asked (`TOUCHSTONE_SERVE_TAPS=ID`).
    pub taps: BTreeMap<String, Vec<(String, usize, Vec<f32>)>>,
}

/// An engine's answer to a schedule in `dir`: each request's logits (f32 `[positions, n_vocab]`,
/// named by its id), what its `__metadata__` declares (`batch_invariant`, `arithmetic`) and the
/// taps it wrote (`ID/TAP`). A link, another dtype or shape is an error naming the request or
/// tap; the counts against the schedule are the caller's check.
pub fn read_served(dir: &Path, n_vocab: usize) -> Result<ServedAnswer, String> {
    let path = dir.join(SERVED_FILE);
    let mut file = oracle::files::open_written(dir, SERVED_FILE).map_err(|e| e.to_string())?;
    // Its size is bounded by what the engine was allowed to write (the schedule's logits).
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut file, &mut bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    let bad = |why: String| format!("{}: {why}", path.display());
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| bad(e.to_string()))?;
    let invariant = meta.metadata().as_ref().and_then(|m| m.get("batch_invariant")).is_some_and(|v| v == "true");
    let arithmetic = match meta.metadata().as_ref().and_then(|m| m.get("arithmetic")) {
        None => None,
        Some(text) => {
            let a: Arithmetic = serde_json::from_str(text).map_err(|e| bad(format!("__metadata__ arithmetic: {e}")))?;
            a.check().map_err(|e| bad(format!("__metadata__ arithmetic: {e}")))?;
            Some(a)
        }
    };
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    let mut served = oracle::schedule::Served::new();
    let mut taps: BTreeMap<String, Vec<(String, usize, Vec<f32>)>> = BTreeMap::new();
    for (name, t) in st.tensors() {
        if let Some((id, tap)) = name.split_once('/') {
            if t.dtype() != safetensors::Dtype::F32 || t.shape().len() != 2 || t.shape()[1] == 0 {
                return Err(bad(format!("tap `{name}`: {:?} {:?}, expected F32 [positions, width]", t.dtype(), t.shape())));
            }
            let values = t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            taps.entry(id.to_string()).or_default().push((tap.to_string(), t.shape()[1], values));
            continue;
        }
        if t.dtype() != safetensors::Dtype::F32 || t.shape().len() != 2 || t.shape()[1] != n_vocab {
            return Err(bad(format!("request `{name}`: {:?} {:?}, expected F32 [positions, {n_vocab}]", t.dtype(), t.shape())));
        }
        served.insert(name, t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect());
    }
    Ok(ServedAnswer { served, batch_invariant: invariant, arithmetic, taps })
}

/// With `TOUCHSTONE_KEEP_DUMPS=DIR`, copies what an `exec:` engine wrote in `out` (its dump and
/// engine.log, links not followed) to `DIR/dump-N` (the first N free) and returns that path.
fn keep_dump(out: &Path) -> Option<PathBuf> {
    let root = PathBuf::from(std::env::var_os("TOUCHSTONE_KEEP_DUMPS")?);
    std::fs::create_dir_all(&root).ok()?;
    let dest = (1..=100_000).map(|n| root.join(format!("dump-{n}"))).find(|d| std::fs::create_dir(d).is_ok())?;
    for e in std::fs::read_dir(out).ok()?.flatten() {
        if e.file_type().is_ok_and(|t| t.is_file()) {
            std::fs::copy(e.path(), dest.join(e.file_name())).ok()?;
        }
    }
    Some(dest)
}

/// Runs an `exec:` or `ids:` engine for one request; Err names the exit status or the timeout and
/// shows the end of its log. Its stdout goes to `stdout` when given, else with stderr to the log.
fn run_engine(cmd: &str, model: &Path, model_sha256: Option<&str>, tokens: &[u32], n_generate: usize, out: &Path, timeout: Duration, stdout: Option<&Path>) -> Result<(), String> {
    let log_path = out.join("engine.log");
    let ids: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
    let mut command = std::process::Command::new("sh");
    command.arg("-c").arg(cmd).env("TOUCHSTONE_MODEL", model).env("TOUCHSTONE_PROMPT_IDS", ids.join(",")).env("TOUCHSTONE_N_GENERATE", n_generate.to_string()).env("TOUCHSTONE_OUT", out);
    // What the manifest's `model.sha256` must say: the engine need not hash the model itself.
    if let Some(sha) = model_sha256 {
        command.env("TOUCHSTONE_MODEL_SHA256", sha);
    }
    match run_bounded(&mut command, stdout.unwrap_or(&log_path), &log_path, timeout, "set TOUCHSTONE_EXEC_TIMEOUT to allow more") {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => Err(format!("`{cmd}` exited with {status}{}", log_tail(&log_path))),
        Err(e) => Err(format!("`{cmd}` {e}{}", log_tail(&log_path))),
    }
}

impl DeviceModel for ExternalModel {
    fn spec(&self) -> &oracle::ModelSpec {
        &self.spec
    }
    fn arithmetic(&self) -> Arithmetic {
        self.arithmetic
    }
    fn declared_name(&self) -> Option<String> {
        self.declared_name.clone()
    }
    fn forward(&mut self, tokens: &[u32], taps: &mut dyn oracle::Tap) -> Result<Vec<f32>, DeviceError> {
        if self.cached > 0 {
            return Err(self.failed("an external engine runs one prefill per dump; it cannot continue from a cache (decode steps are not part of the dump protocol)"));
        }
        let dump = self.obtain(tokens, 0)?;
        let logits = dump.logits.ok_or_else(|| self.failed("the dump is token-only (no logits); this suite needs logits"))?;
        for (tap, width, vals) in &dump.taps {
            match tap {
                EngineTap::Known(t) => taps.record(&t.to_string(), 0, tokens.len(), *width, vals),
                EngineTap::Other(name) => taps.other(name),
            }
        }
        taps.record("result_output", 0, tokens.len(), self.spec.n_vocab, &logits);
        self.cached = tokens.len();
        Ok(logits)
    }
    fn generate_ids(&mut self, prompt: &[u32], max_new: usize) -> Option<Result<Vec<u32>, DeviceError>> {
        if let Source::Ids(cmd) = &self.source {
            let cmd = cmd.clone();
            return Some(self.printed_ids(&cmd, prompt, max_new));
        }
        if let Source::Dir(d) = &self.source {
            // A directory holds one dump: it answers a generation request only if it is a
            // token-only dump of exactly this prompt.
            let m = read_manifest(d).ok()?;
            if m.token_ids != prompt || m.generated_ids.is_none() {
                return None;
            }
        }
        let dump = match self.obtain(prompt, max_new) {
            Ok(d) => d,
            Err(e) => return Some(Err(e)),
        };
        dump.manifest.generated_ids.map(Ok)
    }
    fn one_shot(&self) -> bool {
        true
    }
    fn batch_invariant(&self) -> bool {
        self.batch_invariant
    }
    fn serve_tapped(&mut self, schedule: &oracle::schedule::Schedule, request: &str, taps: &mut dyn oracle::Tap) -> Option<Result<oracle::schedule::Served, DeviceError>> {
        let Source::Exec(cmd) = &self.source else { return None };
        let cmd = cmd.clone();
        match self.served(&cmd, schedule, Some((request, taps))) {
            Ok(None) => None,
            Ok(Some(s)) => Some(Ok(s)),
            Err(e) => Some(Err(self.failed(e))),
        }
    }
    fn serve(&mut self, schedule: &oracle::schedule::Schedule) -> Option<Result<oracle::schedule::Served, DeviceError>> {
        let Source::Exec(cmd) = &self.source else { return None };
        let cmd = cmd.clone();
        match self.served(&cmd, schedule, None) {
            Ok(None) => None,
            Ok(Some(s)) => Some(Ok(s)),
            Err(e) => Some(Err(self.failed(e))),
        }
    }
    fn cached(&self) -> usize {
        self.cached
    }
    fn reset(&mut self) {
        self.cached = 0;
    }
}
