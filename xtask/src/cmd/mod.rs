//! One module per subcommand, plus the argument helpers they share.

pub mod ab;
pub mod abcal;
pub mod abmatrix;
pub mod bench;
pub mod bisect;
pub mod chat;
pub mod dump;
pub mod export;
pub mod fixedtoken;
pub mod fixtures;
pub mod gate;
pub mod kernels;
pub mod layerdiff;
#[cfg(feature = "cuda")]
pub mod ptx;
pub mod reduce;
pub mod report;
pub mod roofline;
pub mod run;
pub mod serving;
pub mod tokenize;

use crate::Exit;
use oracle::generate::AnyModel;
use oracle::tokenizer::Tokenizer;
use oracle::Precision;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A factor option (`flag`: `--emulation-factor`, `--baseline-factor`): a finite number of at
/// least 1, else exit 2.
pub fn check_factor(flag: &str, f: f64) -> Result<(), Exit> {
    if f.is_finite() && f >= 1.0 {
        Ok(())
    } else {
        Err(Exit::new(2, format!("{flag} {f} must be a finite number of at least 1")))
    }
}

/// Checks that `device` opens (every device but `ref` runs whole models through
/// `Device::load_model`; `ref` is the oracle itself). Exit 2 with the device's reason if not.
/// Refuses the kernel suite on an engine judged through dumps of whole models (`external:`,
/// `exec:`, `ids:`): it runs no single op, so every case would be `unsupported`.
pub fn check_runs_ops(device: &str) -> Result<(), Exit> {
    if ["external:", "ids:"].iter().any(|p| device.starts_with(p)) {
        return Err(Exit::new(2, format!("`{device}` is an engine judged through a dump or its printed ids and runs no single op: the kernel suite cannot run on it (layer-diff and fixed-token judge it; an `exec:` engine that speaks the op protocol runs the kernel suite: docs/OP_PROTOCOL.md)")));
    }
    Ok(())
}

/// clap's parser for every `--device`: the name parsed once, where it enters; an unknown or
/// malformed one is refused with the other arguments (exit 2), with the name that was meant.
pub fn device_arg(s: &str) -> Result<devices::DeviceSpec, String> {
    s.parse().map_err(|e: devices::DeviceError| e.to_string())
}

/// Opens `device` to learn early, before long work, whether it is available here.
pub fn check_device(device: &devices::DeviceSpec) -> Result<(), Exit> {
    open_device(device).map(|_| ())
}

/// A device opened once, before long work, and kept to load the model on
/// ([`load_engine_on`]): `ref` (the oracle) needs no opening.
pub struct OpenedDevice {
    spec: devices::DeviceSpec,
    device: Option<Box<dyn devices::Device>>,
}

impl OpenedDevice {
    /// The device as named.
    pub fn spec(&self) -> &devices::DeviceSpec {
        &self.spec
    }
}

/// Opens `device` (an error here says it is not available on this machine).
pub fn open_device(device: &devices::DeviceSpec) -> Result<OpenedDevice, Exit> {
    let opened = if device.is_ref() { None } else { Some(devices::open_spec(device).map_err(Exit::from)?) };
    Ok(OpenedDevice { spec: device.clone(), device: opened })
}

/// Greedy/sampled generation on a device model: the oracle's generation loop, fed by the
/// device's forward pass (its logits of the last position).
pub fn generate_on_device(
    model: &mut dyn devices::DeviceModel,
    prompt: &[u32],
    max_new: usize,
    sampler: &oracle::ops::SamplerConfig,
    seed: u64,
    stop: &[u32],
) -> Result<oracle::generate::Generation, Exit> {
    model.reset();
    let forward_last = |ids: &[u32]| -> Result<Vec<f32>, Exit> { model.forward_last(ids, &mut oracle::NoTap).map_err(|e| Exit::from(e)) };
    oracle::generate::generate_with(forward_last, prompt, max_new, sampler, seed, stop)
}

/// Parses `504,3575,282`, `504, 3575` or `504 3575 282` given to `flag`; nothing between two
/// commas (`1,,2`, a lost id) is refused rather than skipped.
pub fn parse_ids(flag: &str, s: &str) -> Result<Vec<u32>, Exit> {
    let bad = |why: String| Exit::new(2, format!("{flag} `{s}`: {why} (expected comma-separated token ids)"));
    let mut ids = Vec::new();
    let pieces: Vec<&str> = s.split(',').collect();
    for (i, piece) in pieces.iter().enumerate() {
        let words: Vec<&str> = piece.split_whitespace().collect();
        if words.is_empty() && pieces.len() > 1 && s.trim() != "," && !(i + 1 == pieces.len() && i > 0) {
            return Err(bad(format!("nothing between commas at item {}", i + 1)));
        }
        for w in words {
            ids.push(w.parse::<u32>().map_err(|e| bad(format!("`{w}`: {e}")))?);
        }
    }
    if ids.is_empty() {
        return Err(Exit::new(2, format!("{flag} is empty")));
    }
    Ok(ids)
}

/// Resolves a model name/path (generating or fetching fixtures on first use).
pub fn resolve_model(model: &str) -> Result<PathBuf, Exit> {
    Ok(::fixtures::resolve(model, false)?)
}

/// The ids of a command's prompt given as `--prompt` text (encoded with the model's own
/// tokenizer; an error saying why when it has none, or when the text gives no tokens) or as
/// `--prompt-ids`; None when neither was given.
pub fn given_prompt(text: Option<&str>, ids: Option<&str>, tok: Option<&Tokenizer>, model: &str, path: &std::path::Path) -> Result<Option<Vec<u32>>, Exit> {
    match (text, ids) {
        (Some(_), Some(_)) => Err(Exit::new(2, "give --prompt or --prompt-ids, not both")),
        (None, Some(ids)) => parse_ids("--prompt-ids", ids).map(Some),
        (Some(text), None) => {
            let tok = tok.ok_or_else(|| Exit::new(2, format!("{}; use --prompt-ids", no_tokenizer(model, path))))?;
            let ids = tok.encode(text)?;
            if ids.is_empty() {
                return Err(Exit::new(2, format!("--prompt {text:?} gives no tokens: nothing to run")));
            }
            Ok(Some(ids))
        }
        (None, None) => Ok(None),
    }
}

/// The reason a model (at `path`) has no tokenizer this tool builds, for a command given text.
pub fn no_tokenizer(model: &str, path: &std::path::Path) -> String {
    let why = match oracle::loader::tokenizer_gap(path) {
        Ok(Some(why)) => why,
        Ok(None) => "its tokenizer was not built".into(),
        Err(e) => e.to_string(),
    };
    format!("model `{model}` has no tokenizer this tool builds: {why}")
}

/// What a model runs on: the oracle, or a device's own model (which loads its own weights, so the
/// oracle's f32 copy is never built for device runs).
#[allow(clippy::large_enum_variant)] // one per command, never in a collection
pub enum Engine {
    Oracle(AnyModel),
    Device(Box<dyn devices::DeviceModel>),
}

impl Engine {
    pub fn spec(&self) -> &oracle::ModelSpec {
        match self {
            Engine::Oracle(m) => m.spec(),
            Engine::Device(m) => m.spec(),
        }
    }

    pub fn generate(&mut self, prompt: &[u32], max_new: usize, sampler: &oracle::ops::SamplerConfig, seed: u64, stop: &[u32]) -> Result<oracle::generate::Generation, Exit> {
        match self {
            Engine::Oracle(m) => Ok(m.generate(prompt, max_new, sampler, seed, stop, &mut oracle::NoTap)?),
            Engine::Device(m) => generate_on_device(m.as_mut(), prompt, max_new, sampler, seed, stop),
        }
    }

    /// Device memory held at most by the engine's buffers (GPU devices).
    pub fn memory_peak_bytes(&self) -> Option<u64> {
        match self {
            Engine::Oracle(_) => None,
            Engine::Device(m) => m.memory_peak_bytes(),
        }
    }

    /// Starts timing each kernel launch (GPU devices); false when the engine has no kernels.
    pub fn start_kernel_profile(&mut self) -> bool {
        match self {
            Engine::Oracle(_) => false,
            Engine::Device(m) => m.start_kernel_profile(),
        }
    }

    /// Stops the kernel profile and returns it.
    pub fn take_kernel_profile(&mut self) -> Option<devices::KernelProfile> {
        match self {
            Engine::Oracle(_) => None,
            Engine::Device(m) => m.take_kernel_profile(),
        }
    }

    /// The arithmetic the engine declares (the oracle: f32 or f64 storage, f64 accumulation).
    pub fn arithmetic(&self) -> devices::Arithmetic {
        match self {
            Engine::Oracle(AnyModel::F64(_)) => devices::Arithmetic::F64,
            Engine::Oracle(_) => devices::Arithmetic { accumulate: devices::NumFormat::F64, ..devices::Arithmetic::F32 },
            Engine::Device(m) => m.arithmetic(),
        }
    }

    /// The name an external engine gave itself in its dump (see [`label_of`]).
    pub fn declared_name(&self) -> Option<String> {
        match self {
            Engine::Oracle(_) => None,
            Engine::Device(m) => m.declared_name(),
        }
    }

    /// One prefill over `ids` from an empty cache, recording every tap (logits included).
    pub fn prefill(&mut self, ids: &[u32], taps: &mut dyn oracle::Tap) -> Result<(), Exit> {
        match self {
            Engine::Oracle(m) => m.prefill_logits(ids, taps).map(|_| ()).map_err(Exit::from),
            Engine::Device(m) => {
                m.reset();
                m.forward(ids, taps).map(|_| ()).map_err(Exit::from)
            }
        }
    }
}

/// Loads the oracle's copy of the model at `path`, saying on stderr when its weight matrices are
/// held packed (the decoded copy would not fit, or `TOUCHSTONE_ORACLE_WEIGHTS=packed`): the same
/// bits, but every product decodes its rows again, so the oracle runs several times slower.
pub fn load_oracle(path: &Path, precision: Precision) -> Result<(AnyModel, Option<Tokenizer>), Exit> {
    let (m, tok) = AnyModel::load(path, precision)?;
    context_note(path, m.spec());
    if m.store() == oracle::WeightStore::Packed {
        eprintln!(
            "note: the oracle holds {}'s weights packed as stored and decodes each row when a product uses it \
             (same results, slower); {}=decoded forces the decoded copy",
            path.display(),
            oracle::WEIGHTS_ENV
        );
    }
    Ok((m, tok))
}

/// Says once, on stderr, when `--context` was given for a model it changes nothing for (no
/// LongRoPE scaling), so nobody takes it for a limit on the positions judged.
fn context_note(path: &Path, spec: &oracle::spec::ModelSpec) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if let Ok(c) = std::env::var(oracle::spec::CONTEXT_ENV) {
        if !matches!(spec.rope.scaling, oracle::spec::RopeScaling::LongRope { .. }) && !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
            eprintln!("note: --context {c} changes nothing for {}: it configures LongRoPE models only, and this one has none", path.display());
        }
    }
}

/// Resolves `model` and loads it on `device` (`ref` = the oracle at `precision`), with the
/// model's tokenizer when it has one.
pub fn load_engine(model: &str, device: &devices::DeviceSpec, precision: Precision) -> Result<(PathBuf, Engine, Option<Tokenizer>), Exit> {
    if !device.is_ref() && precision != Precision::F32 {
        return Err(precision_refused(device, precision));
    }
    load_engine_on(model, open_device(device)?, precision)
}

fn precision_refused(device: &devices::DeviceSpec, precision: Precision) -> Exit {
    Exit::new(2, format!("--precision {}: the oracle's storage precision (--device ref); `{device}` computes in its own declared arithmetic", format!("{precision:?}").to_lowercase()))
}

/// [`load_engine`] on a device opened before ([`open_device`]), so it is opened once per run.
pub fn load_engine_on(model: &str, opened: OpenedDevice, precision: Precision) -> Result<(PathBuf, Engine, Option<Tokenizer>), Exit> {
    let path = resolve_model(model)?;
    let device = &opened.spec;
    let Some(dev) = opened.device else {
        let (m, tok) = load_oracle(&path, precision)?;
        return Ok((path, Engine::Oracle(m), tok));
    };
    if precision != Precision::F32 {
        return Err(precision_refused(device, precision));
    }
    // External dumps must name the model under test by its hash.
    let model_sha256 = if *device.kind() == devices::DeviceKind::External && !device.name().starts_with("ids:") { Some(::fixtures::sha256_model(&path)?) } else { None };
    let dm = dev.load_model(&path, &devices::ModelOptions { model_sha256, ..Default::default() }).map_err(Exit::from)?;
    context_note(&path, dm.spec());
    let tok = oracle::loader::open_tokenizer(&path)?;
    Ok((path, Engine::Device(dm), tok))
}

/// Checks every id is inside the vocabulary (a clear error instead of a failure deep inside).
pub fn check_ids(ids: &[u32], n_vocab: usize) -> Result<(), Exit> {
    if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= n_vocab) {
        return Err(Exit::new(2, format!("token id {id} at position {i} is outside the vocabulary of {n_vocab} tokens")));
    }
    Ok(())
}

/// f32 values a forward pass over one position records: its logits, and with `taps` every tap
/// besides (the embedding, each layer's attention and FFN taps, the final norm), as the oracle
/// and the devices record them.
pub fn floats_per_position(spec: &oracle::ModelSpec, taps: bool) -> u64 {
    let (d, q, kv) = (spec.n_embd as u64, (spec.n_head * spec.head_dim) as u64, (spec.n_head_kv * spec.head_dim) as u64);
    if !taps {
        return spec.n_vocab as u64;
    }
    let ffn = match &spec.moe {
        None => 3 * spec.n_ff as u64,
        Some(m) => (m.n_expert + m.n_expert_used) as u64,
    };
    let layer = 6 * d + 3 * q + 3 * kv + if spec.qk_norm { q + kv } else { 0 } + ffn;
    (spec.n_vocab as u64).saturating_add(2 * d).saturating_add(layer.saturating_mul(spec.n_layer as u64))
}

/// Refuses, before a run, `copies` recordings of `n_positions` positions (`floats_per_position`)
/// that would not fit in the memory available: a long prompt would otherwise run for minutes
/// and end in the OOM killer, with no message.
pub fn check_recordings_fit(what: &str, spec: &oracle::ModelSpec, taps: bool, n_positions: usize, copies: u64) -> Result<(), Exit> {
    let recorded = if taps { "every tap and the logits" } else { "the logits" };
    check_positions_fit(what, &format!("{copies} recordings of {recorded}"), floats_per_position(spec, taps).saturating_mul(copies), n_positions)?;
    note_past_context(what, spec, n_positions);
    Ok(())
}

/// The same for the KV cache a run of `n_positions` positions fills (keys and values of every
/// layer, f32: the oracle's and the `cpu` device's default).
pub fn check_kv_fits(what: &str, spec: &oracle::ModelSpec, n_positions: usize) -> Result<(), Exit> {
    let per_position = 2 * spec.n_layer as u64 * (spec.n_head_kv * spec.head_dim) as u64;
    check_positions_fit(what, "a KV cache of every layer", per_position, n_positions)?;
    note_past_context(what, spec, n_positions);
    Ok(())
}

/// A note (stderr, once per process) when a run takes more positions than the model's
/// `context_length`, the positions it was trained for: what it computes there is judged as
/// anywhere else, but may be poor text, as llama.cpp warns too.
fn note_past_context(what: &str, spec: &oracle::ModelSpec, n_positions: usize) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if n_positions > spec.context_length {
        ONCE.call_once(|| eprintln!("note: {what}: {n_positions} positions, past the model's context_length of {} (the positions it was trained for): they are computed and judged as any others, but the model's text there may be poor", spec.context_length));
    }
}

/// Refuses `floats` f32 values per position (`held`: what they are) over `n_positions` when
/// they exceed the memory available (`oracle::memory::available`).
fn check_positions_fit(what: &str, held: &str, floats: u64, n_positions: usize) -> Result<(), Exit> {
    let bytes = floats.saturating_mul(n_positions as u64).saturating_mul(4);
    let Some((avail, source)) = oracle::memory::available()? else { return Ok(()) };
    if bytes <= avail {
        return Ok(());
    }
    Err(Exit::new(2, format!(
            "{what} over {n_positions} positions would hold {held} at once: about {}, more than the {} this machine has available ({source}); nothing was run. Give fewer positions: a shorter prompt, fewer tokens to generate ({} overrides the estimate)",
            oracle::memory::human(bytes),
            oracle::memory::human(avail),
            oracle::memory::LIMIT_ENV
        )))
}

/// The synthetic prompt of `bench` and `ab`: `prompt_len` ids spread over the vocabulary (never
/// id 0 unless it is the only one), refused when prompt and generation together exceed the 2^20
/// positions a run may take.
pub fn bench_prompt(prompt_len: usize, gen_len: usize, n_vocab: usize) -> Result<Vec<u32>, Exit> {
    if prompt_len.saturating_add(gen_len) > 1 << 20 {
        return Err(Exit::new(2, format!("--prompt-len {prompt_len} + --gen-len {gen_len} exceed 2^20 positions")));
    }
    let spread = (n_vocab as u64).saturating_sub(1).max(1);
    // `% n_vocab`: a one-token vocabulary has only id 0.
    Ok((0..prompt_len as u64).map(|i| ((1 + i * 7919 % spread) % n_vocab as u64) as u32).collect())
}

/// Parses `K/N` (1 <= K <= N).
pub fn parse_shard(s: &str) -> Result<(usize, usize), Exit> {
    let bad = || Exit::new(2, format!("--shard `{s}`: expected K/N with 1 <= K <= N, e.g. 2/4"));
    let (k, n) = s.split_once('/').ok_or_else(bad)?;
    let (k, n): (usize, usize) = (k.trim().parse().map_err(|_| bad())?, n.trim().parse().map_err(|_| bad())?);
    if k == 0 || n == 0 || k > n {
        return Err(bad());
    }
    Ok((k, n))
}

/// Prints (stderr) what in this machine's settings can disturb a timing, for the commands that
/// time things; the same settings are in every report's provenance.
pub fn print_timing_notes() {
    if cfg!(debug_assertions) {
        eprintln!("WARNING: this is a debug build (`cargo xtask` builds the dev profile, with overflow checks and debug assertions): its timings are not the engine's. Publish figures from `cargo xtask-release ...` (the same commands, optimized) or an installed `touchstone`; report.md says the same.");
    }
    for n in reports::settings::timing_notes(&reports::settings::collect()) {
        eprintln!("note: {n}");
    }
}

/// A progress bar on stderr (hidden when stderr is not a terminal).
pub fn progress(total: u64, what: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(total);
    pb.set_style(indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} ({elapsed}, eta {eta})").expect("template").progress_chars("=> "));
    pb.set_message(what.to_string());
    pb
}

/// A progress line on stderr for work done in a few long stages (a spinner, the stage's name
/// and the time taken; hidden when stderr is not a terminal): `next` names the stage begun.
pub struct Stages {
    pb: indicatif::ProgressBar,
    what: String,
}

impl Stages {
    pub fn new(total: u64, what: &str) -> Stages {
        let pb = indicatif::ProgressBar::new(total);
        pb.set_style(indicatif::ProgressStyle::with_template("{spinner} {msg} (stage {pos}/{len}, {elapsed})").expect("template"));
        pb.enable_steady_tick(std::time::Duration::from_millis(200));
        Stages { pb, what: what.to_string() }
    }

    /// Begins the next stage (one past the count given is counted in).
    pub fn next(&self, stage: &str) {
        self.pb.set_message(format!("{}: {stage}", self.what));
        if self.pb.length().is_some_and(|n| self.pb.position() >= n) {
            self.pb.inc_length(1);
        }
        self.pb.inc(1);
    }

    /// A line on stderr above the progress line.
    pub fn note(&self, line: &str) {
        self.pb.suspend(|| eprintln!("{line}"));
    }
}

impl Drop for Stages {
    fn drop(&mut self) {
        self.pb.finish_and_clear();
    }
}

/// Refuses, before anything runs, a `--report-dir` that cannot become a directory: an existing
/// file, or a path under one (it failed only when the report was written, after the whole run).
pub fn check_report_dir(given: Option<&Path>) -> Result<(), Exit> {
    let Some(dir) = given else { return Ok(()) };
    let blocker = dir.ancestors().find(|p| !p.as_os_str().is_empty() && p.exists());
    match blocker {
        Some(p) if !p.is_dir() => Err(Exit::new(2, format!("--report-dir {}: {} is a file, not a directory; nothing was run", dir.display(), p.display()))),
        _ => Ok(()),
    }
}

/// Writes `report` under `--report-dir` (`given`), else under a new directory
/// `target/touchstone/<suite>-<start time, UTC>` (`kernels-20261203-165031`, then `-2`, `-3`, ...:
/// runs started in the same second never share one), after adding what only the binary knows to
/// its provenance: the devices it opened (with their hardware and driver) and the features it was
/// built with. Returns the directory.
/// A run's wall time shared among the cases it produced (`wall_seconds`, JUnit's `time`), for
/// suites that judge many cases from one run (layer-diff, fixed-token); cases that timed
/// themselves keep their own.
pub fn spread_time(cases: &mut [reports::Case], seconds: f64) {
    let n = cases.len().max(1) as f64;
    for c in cases {
        c.metrics.set_default("wall_seconds", seconds / n);
    }
}

/// `--name LABEL`: checked (1 to 64 printable characters).
pub fn check_label(name: Option<&str>) -> Result<(), Exit> {
    match name {
        Some(n) if n.trim().is_empty() || n.chars().count() > 64 || n.chars().any(char::is_control) => Err(Exit::new(2, format!("--name {n:?}: a label is 1 to 64 printable characters"))),
        _ => Ok(()),
    }
}

/// Where a run notes the names its external engines gave themselves (taken out by [`label_of`]).
pub const DECLARED_NAMES: &str = "declared_names";

/// Notes the names the op-protocol engines among `devices` gave themselves (where a dump's name
/// was not noted already).
pub fn note_declared_names(report: &mut reports::Report, devices: &[&dyn devices::Device]) {
    let names = report.sections.entry(DECLARED_NAMES).or_insert_with(|| serde_json::json!({}));
    if let Some(m) = names.as_object_mut() {
        for d in devices {
            if let Some(n) = d.declared_name() {
                m.entry(d.name()).or_insert(serde_json::json!(n));
            }
        }
    }
}

/// Labels the devices of a run (in order; `--name` is the first one's): `--name` when given;
/// else the name an external engine's dump gives itself (its manifest's `device`, noted under
/// [`DECLARED_NAMES`]) when it is a valid label, with " (external)" added where it would read as
/// a built-in device or as another device of the run; else the device as given.
/// Returns the labels given, (device, label) each.
pub fn label_devices(report: &mut reports::Report, devices: &[String], given: Option<&str>) -> Vec<(String, String)> {
    let declared = report.sections.remove(DECLARED_NAMES).unwrap_or_default();
    let mut taken: Vec<String> = devices.to_vec();
    let mut given_labels = Vec::new();
    for (i, device) in devices.iter().enumerate() {
        let own = declared.get(device).and_then(|n| n.as_str()).map(|n| n.trim().to_string()).filter(|n| check_label(Some(n)).is_ok());
        let label = match (given.filter(|_| i == 0), own) {
            (Some(g), _) => g.to_string(),
            (None, Some(name)) => {
                if devices::is_device_name(&name) || taken.contains(&name) { format!("{name} (external)") } else { name }
            }
            (None, None) => continue,
        };
        relabel(report, device, Some(&label));
        given_labels.push((device.clone(), label.clone()));
        taken.push(label);
    }
    given_labels
}

/// Labels device `from` as `to` throughout a report (`--name`): every case's device, message
/// and the sections' strings and keys (charts' titles included); the section `engine_labels`
/// keeps what each label stands for.
pub fn relabel(report: &mut reports::Report, from: &str, to: Option<&str>) {
    let Some(to) = to else { return };
    if from == to {
        return;
    }
    fn walk(v: &mut serde_json::Value, from: &str, to: &str) {
        match v {
            serde_json::Value::String(s) if s.contains(from) => *s = s.replace(from, to),
            serde_json::Value::Array(a) => a.iter_mut().for_each(|x| walk(x, from, to)),
            serde_json::Value::Object(m) => {
                let old = std::mem::take(m);
                for (k, mut x) in old {
                    walk(&mut x, from, to);
                    m.insert(k.replace(from, to), x);
                }
            }
            _ => {}
        }
    }
    for c in &mut report.cases {
        c.device = c.device.replace(from, to);
        if let Some(msg) = &mut c.message {
            *msg = msg.replace(from, to);
        }
    }
    let mut sections = serde_json::Value::Object(std::mem::take(&mut report.sections));
    walk(&mut sections, from, to);
    if let serde_json::Value::Object(m) = sections {
        report.sections = m;
    }
    let labels = report.sections.entry("engine_labels").or_insert_with(|| serde_json::json!({}));
    if let Some(m) = labels.as_object_mut() {
        m.insert(to.to_string(), serde_json::json!(from));
    }
}

pub fn write_report(report: &mut reports::Report, given: Option<PathBuf>) -> Result<PathBuf, Exit> {
    report.provenance.devices.extend(devices::opened());
    report.provenance.features = crate::FEATURES.iter().filter(|(_, on)| *on).map(|(f, _)| f.to_string()).collect();
    let dir = match given {
        Some(d) => d,
        None => new_report_dir(&report.suite, report.provenance.started_at.as_deref())?,
    };
    report.write(&dir).map_err(|e| io_exit(&dir, e))?;
    Ok(dir)
}

/// Creates `target/touchstone/<suite>-<stamp>[-K]`, the first of those names not yet taken
/// (created, not just tested, so two processes cannot both take one).
pub fn new_report_dir(suite: &str, started_at: Option<&str>) -> Result<PathBuf, Exit> {
    let root = PathBuf::from("target/touchstone");
    std::fs::create_dir_all(&root).map_err(|e| io_exit(&root, e))?;
    // `2026-12-03T16:50:31Z` -> `20261203-165031`.
    let stamp: String = started_at.unwrap_or("unknown-time").chars().filter(|c| c.is_ascii_alphanumeric()).map(|c| if c == 'T' { '-' } else { c }).filter(|c| *c != 'Z').collect();
    for k in 1..=1000 {
        let dir = root.join(if k == 1 { format!("{suite}-{stamp}") } else { format!("{suite}-{stamp}-{k}") });
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io_exit(&dir, e)),
        }
    }
    Err(Exit::new(2, format!("{}: 1000 reports of `{suite}` started at {stamp} already; give --report-dir", root.display())))
}

/// An I/O failure on `path` as a could-not-run exit that names the path.
pub fn io_exit(path: &std::path::Path, e: std::io::Error) -> Exit {
    Exit::new(2, format!("{}: {e}", path.display()))
}

/// Runs `git ARGS` in `dir`; its trimmed stdout, or an exit-2 error quoting git's stderr.
pub fn git(dir: &Path, args: &[&str]) -> Result<String, Exit> {
    let o = Command::new("git").args(args).current_dir(dir).output().map_err(|e| Exit::new(2, format!("git: {e}")))?;
    if !o.status.success() {
        return Err(Exit::new(2, format!("git {}: {}", args.join(" "), String::from_utf8_lossy(&o.stderr).trim())));
    }
    Ok(String::from_utf8_lossy(&o.stdout).trim().to_string())
}

#[cfg(test)]
mod tests {
    #[test]
    fn runs_started_in_the_same_second_get_directories_of_their_own() {
        let suite = format!("unit-test-{}", std::process::id());
        let dirs: Vec<_> = (0..3).map(|_| super::new_report_dir(&suite, Some("2026-12-03T16:32:50Z")).unwrap()).collect();
        let names: Vec<String> = dirs.iter().map(|d| d.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(names, [format!("{suite}-20261203-163250"), format!("{suite}-20261203-163250-2"), format!("{suite}-20261203-163250-3")]);
        assert!(dirs.iter().all(|d| d.is_dir()));
        for d in dirs {
            std::fs::remove_dir(d).unwrap();
        }
    }
}
