//! `cargo xtask ab --a ARM --b ARM --model M`: a paired, interleaved A/B benchmark.
//!
//! An ARM is a device of this build (`cpu`, `fixed`, `ref`, ...), a git revision of this
//! repository (`git:REV` or `git:REV:DEVICE`, built once in its own worktree and cached), or an
//! external command (`exec:CMD`) that prints one JSON line per run:
//! `{"prefill_ms":…, "decode_ms":…, "n_prompt":…, "n_gen":…, "tokens":[…]}` (it gets
//! TOUCHSTONE_MODEL, TOUCHSTONE_PROMPT_IDS and TOUCHSTONE_N_GENERATE in its environment;
//! `n_gen` must be the number of `tokens`, from 2 to TOUCHSTONE_N_GENERATE, times finite and
//! non-negative, `decode_ms` positive; optional `step_ms`, `cpu`, `peak_rss_kb`).
//! Both arms get identical inputs; pairs run in ABBA order. Device and git arms are servers of
//! `xtask ab-run --serve` stepped token by token in lockstep (restarted every few pairs); `exec:`
//! arms are a fresh process per run. The per-pair B/A ratio of decode time per token is judged by
//! suites::ab (bootstrap CI + Wilcoxon). Exit 0 for
//! faster / no change, 1 for slower, 3 for inconclusive (after --max-pairs), 2 when an arm fails
//! (the samples gathered so far are kept in the report).

use devices::DeviceSpec;
use crate::Exit;
use reports::Provenance;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use suites::ab::{self, AbVerdict};

mod table;
use table::*;

#[derive(clap::Args)]
pub struct AbArgs {
    /// Baseline arm: a device (cpu, fixed, ref; DEVICE+slow=PCT for one really PCT% slower), git:REV or git:REV:DEVICE, or exec:CMD.
    #[arg(long)]
    pub(super) a: String,
    /// Candidate arm (same forms as --a).
    #[arg(long)]
    pub(super) b: String,
    #[arg(long, default_value = "smollm2", help = concat!("Model: ", fixtures::model_names!(), ", or a path to a .gguf file, a flat file (`export`) or a safetensors directory. A comma list (`smollm2,tiny-llama`) runs a matrix: each model and prompt length its own comparison, one table."))]
    pub(super) model: String,
    /// Pairs to run before the first verdict. A verdict needs at least 6 restart groups (see
    /// --respawn-every); faster or slower, at 1% split over the looks, needs 10 or more groups.
    #[arg(long, default_value_t = 16)]
    pub(super) pairs: usize,
    /// While inconclusive, keep adding pairs (at least doubling each time) up to this many.
    #[arg(long, default_value_t = 100)]
    pub(super) max_pairs: usize,
    /// The change (percent) that matters: "no change" means the 95% CI lies inside ±threshold.
    #[arg(long, default_value_t = 1.5, allow_negative_numbers = true)]
    pub(super) threshold: f64,
    /// Prompt length in tokens; a comma list (`16,512`) runs a matrix (see --model).
    #[arg(long, value_delimiter = ',', default_values_t = [PROMPT_LEN])]
    pub(super) prompt_len: Vec<usize>,
    /// Tokens generated per run (`bench` takes the same default lengths).
    #[arg(long, default_value_t = GEN_LEN)]
    pub(super) gen_len: usize,
    /// A label for arm A in the tables, console and plots (default: its spec, `--a`).
    #[arg(long)]
    pub(super) a_name: Option<String>,
    /// A label for arm B (default: its spec, `--b`).
    #[arg(long)]
    pub(super) b_name: Option<String>,
    /// Compare arms whose outputs differ (two different engines on purpose); the report says where
    /// their outputs first differ. Without it, different outputs are an error.
    #[arg(long)]
    pub(super) allow_different_outputs: bool,
    /// Restart both arms' server processes every N pairs, in alternating order. A process's luck
    /// with memory placement (huge pages, page colouring) lasts as long as the process: ±2% on
    /// SmolLM2 and ±15% on tiny-llama between two lifetimes of the same build. The pairs of one
    /// lifetime (a restart group) share that luck, so the statistics count each group once. 0:
    /// never restart, and treat every pair as independent (the CI may then be too narrow).
    /// `exec:` arms start a fresh process per run: each of their pairs is a group.
    #[arg(long, default_value_t = 2)]
    pub(super) respawn_every: usize,
    /// Seconds one run may take before it is killed (an error, exit 2).
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_S)]
    pub(super) timeout: u64,
    /// What the verdict compares per run. `fastest-step`: the run's fastest decode step (the
    /// engine's own speed: noise on a shared machine only adds time; 1-2% pair-to-pair noise
    /// here). `mean`: decode time per token with every stall in it, as users wait through them
    /// (5-9% noise here: more pairs, or a wider --threshold). `request`: the whole request,
    /// prefill plus decode (time to the last token), for long prompts.
    #[arg(long, value_enum, default_value_t = Metric::FastestStep)]
    pub(super) metric: Metric,
    /// Where report.json (every pair's samples), report.md, junit.xml, cases.csv and the plots go (default target/touchstone/ab-YYYYMMDD-HHMMSS/, the start time in UTC).
    #[arg(long)]
    pub(super) report_dir: Option<PathBuf>,
}

impl AbArgs {
    /// Pairs per independent unit: 1 for two per-run (`exec:`) arms or without restarts, else
    /// the restart interval.
    fn group_size(&self) -> usize {
        if (self.a.starts_with("exec:") && self.b.starts_with("exec:")) || self.respawn_every == 0 {
            1
        } else {
            self.respawn_every
        }
    }
    fn plan(&self) -> ab::Plan {
        ab::Plan { threshold: self.threshold / 100.0, start: self.pairs, max_pairs: self.max_pairs }
    }
    /// The statistics of B's change in `metric` over `pairs`, by restart group.
    fn stats(&self, pairs: &[Pair], metric: Metric) -> ab::AbStats {
        let ratios: Vec<f64> = pairs.iter().map(|p| p.change(metric) + 1.0).collect();
        ab::analyze(&ab::split_groups(&ratios, self.group_size()), &self.plan())
    }
}

/// The per-run figure an A/B compares (see `AbArgs::metric`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Metric {
    FastestStep,
    Mean,
    Request,
}

impl Metric {
    fn of(self, s: &RunSample) -> f64 {
        match self {
            Metric::FastestStep => s.ms_per_token(),
            Metric::Mean => s.mean_ms_per_token(),
            Metric::Request => s.prefill_ms + s.decode_ms,
        }
    }
    /// The column heading of one arm's figure.
    fn unit(self) -> &'static str {
        match self {
            Metric::FastestStep => "ms/token (fastest step)",
            Metric::Mean => "ms/token (mean)",
            Metric::Request => "ms/request",
        }
    }
    /// What is compared, in words.
    pub(super) fn words(self) -> &'static str {
        match self {
            Metric::FastestStep => "decode ms per token (fastest step of each run; mean when steps are unknown)",
            Metric::Mean => "decode ms per token (mean of each run, stalls included)",
            Metric::Request => "ms per request (prefill + decode of each run)",
        }
    }
    /// The name in the case id (`decode_ms_per_token` as before for the default).
    fn id(self) -> &'static str {
        match self {
            Metric::FastestStep => "decode_ms_per_token",
            Metric::Mean => "decode_mean_ms_per_token",
            Metric::Request => "request_ms",
        }
    }
}

/// Internal: one measured run on a device of this build, printed as one JSON line.
#[derive(clap::Args)]
pub struct AbRunArgs {
    #[arg(long, value_parser = super::device_arg)]
    device: DeviceSpec,
    #[arg(long)]
    model: String,
    #[arg(long)]
    prompt_ids: String,
    #[arg(long)]
    gen_len: usize,
    /// Stay up: load the model once, then perform one run per line read on stdin, printing one
    /// JSON line each (so the harness can alternate arms with no process start in between).
    #[arg(long)]
    serve: bool,
}

/// One run of an arm, as the arm protocol states it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunSample {
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub n_prompt: usize,
    pub n_gen: usize,
    pub tokens: Vec<u32>,
    /// Optional: per-token decode latencies.
    #[serde(default)]
    pub step_ms: Vec<f64>,
    /// Optional: the engine's machine (refused when the arms' differ).
    #[serde(default)]
    pub cpu: Option<String>,
    /// Optional: peak resident memory of the run's process.
    #[serde(default)]
    pub peak_rss_kb: Option<u64>,
}

impl RunSample {
    /// The compared metric: the run's fastest decode step when per-step latencies are known,
    /// else its mean decode time per token. On a shared machine the host adds time, never removes
    /// it, so the fastest step tracks the engine's own speed; measured here the pair-to-pair noise
    /// of the fastest step is 1.1-2.1% (robust sigma) against 5-9% for the mean
    /// (docs/BENCHMARKS.md, "A/B statistics").
    fn ms_per_token(&self) -> f64 {
        match self.step_ms.iter().copied().filter(|x| x.is_finite() && *x > 0.0).min_by(f64::total_cmp) {
            Some(m) => m,
            None => self.mean_ms_per_token(),
        }
    }
    fn mean_ms_per_token(&self) -> f64 {
        self.decode_ms / (self.n_gen.saturating_sub(1).max(1)) as f64
    }
}

/// One whole measured run, as the arm protocol's JSON line.
fn one_run(engine: &mut super::Engine, ids: &[u32], gen_len: usize, cpu: &str) -> Result<String, Exit> {
    let greedy = oracle::ops::SamplerConfig::GREEDY;
    let g = engine.generate(ids, gen_len, &greedy, 0, &[])?;
    let s = RunSample {
        prefill_ms: g.prefill_s * 1e3,
        decode_ms: g.decode_s * 1e3,
        n_prompt: ids.len(),
        n_gen: g.tokens.len(),
        tokens: g.tokens.clone(),
        step_ms: g.step_s.iter().map(|s| s * 1e3).collect(),
        cpu: Some(cpu.to_string()),
        peak_rss_kb: suites::machine::peak_rss_kb(),
    };
    Ok(serde_json::to_string(&s).expect("sample serializes"))
}

/// Runs `ids` on the device model and picks the greedy next token: (token, milliseconds).
fn timed_next(m: &mut dyn devices::DeviceModel, ids: &[u32]) -> Result<(u32, f64), Exit> {
    let t = Instant::now();
    let logits = m.forward_last(ids, &mut oracle::NoTap).map_err(|e| Exit::from(e))?;
    let tok = oracle::ops::argmax(&logits) as u32;
    Ok((tok, t.elapsed().as_secs_f64() * 1e3))
}

pub fn run_main(a: AbRunArgs) -> Result<u8, Exit> {
    use std::io::Write;
    let ids = super::parse_ids("--prompt-ids", &a.prompt_ids)?;
    let (_, mut engine, _) = super::load_engine(&a.model, &a.device, oracle::Precision::F32)?;
    super::check_ids(&ids, engine.spec().n_vocab)?;
    let greedy = oracle::ops::SamplerConfig::GREEDY;
    // Warm-up: page in the weights and the code paths before the measured run.
    engine.generate(&ids, 2, &greedy, 0, &[])?;
    let cpu = Provenance::collect(rayon::current_num_threads()).cpu;
    let say = |line: String| -> Result<(), Exit> {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}").and_then(|_| out.flush()).map_err(|e| Exit::new(2, format!("stdout: {e}")))
    };
    if !a.serve {
        say(one_run(&mut engine, &ids, a.gen_len, &cpu)?)?;
        return Ok(0);
    }
    // Server: `run` = one whole run; `begin` / `step` = the same run one token at a time, so the
    // harness can interleave two arms token by token (device models only).
    let mut last: Option<u32> = None;
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).map_err(|e| Exit::new(2, format!("stdin: {e}")))? > 0 {
        let reply = match (line.trim(), &mut engine) {
            ("run", e) => one_run(e, &ids, a.gen_len, &cpu)?,
            ("begin", super::Engine::Device(m)) => {
                m.reset();
                let (tok, ms) = timed_next(m.as_mut(), &ids)?;
                last = Some(tok);
                json!({ "prefill_ms": ms, "token": tok, "cpu": cpu }).to_string()
            }
            ("step", super::Engine::Device(m)) => match last {
                Some(prev) => {
                    let (tok, ms) = timed_next(m.as_mut(), &[prev])?;
                    last = Some(tok);
                    json!({ "step_ms": ms, "token": tok }).to_string()
                }
                None => json!({ "error": "step before begin" }).to_string(),
            },
            // The server process's peak resident memory so far (outside any timed step).
            ("rss", _) => json!({ "peak_rss_kb": suites::machine::peak_rss_kb() }).to_string(),
            (cmd, _) => json!({ "error": format!("`{cmd}` is not supported by this arm") }).to_string(),
        };
        say(reply)?;
        line.clear();
    }
    Ok(0)
}

enum Arm {
    Device(String),
    Git { rev: String, device: String },
    Exec(String),
}

impl Arm {
    fn parse(s: &str) -> Result<Arm, Exit> {
        if let Some(cmd) = s.strip_prefix("exec:") {
            return Ok(Arm::Exec(cmd.to_string()));
        }
        if let Some(rest) = s.strip_prefix("git:") {
            let (rev, device) = rest.split_once(':').unwrap_or((rest, "cpu"));
            return Ok(Arm::Git { rev: rev.to_string(), device: device.to_string() });
        }
        super::check_device(&super::device_arg(s).map_err(|e| Exit::new(2, e))?)?;
        Ok(Arm::Device(s.to_string()))
    }
}

/// A ready-to-run arm: a command started once per run (`exec:`), or a server process of this
/// repository's xtask that performs one run per request (devices and git revisions).
struct Runner {
    name: String,
    cmd: Box<dyn Fn() -> Command>,
    server: Option<std::cell::RefCell<Server>>,
}

struct Server {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    lines: std::sync::mpsc::Receiver<String>,
    stderr: tempfile::NamedTempFile,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server(mut cmd: Command) -> Result<Server, String> {
    let stderr = tempfile::NamedTempFile::new().map_err(|e| e.to_string())?;
    cmd.arg("--serve").stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).stderr(stderr.reopen().map_err(|e| e.to_string())?);
    let mut child = cmd.spawn().map_err(|e| format!("cannot start: {e}"))?;
    let stdin = child.stdin.take().ok_or("no stdin")?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Ok(Server { child, stdin, lines: rx, stderr })
}

fn prepare(arm_name: &str, arm: Arm, model: &Path, model_name: &str, ids: &str, gen_len: usize) -> Result<Runner, Exit> {
    let ab_run = |bin: PathBuf, device: String| -> Box<dyn Fn() -> Command> {
        let (model, ids) = (model_name.to_string(), ids.to_string());
        Box::new(move || {
            let mut c = Command::new(&bin);
            c.args(["ab-run", "--device", &device, "--model", &model, "--prompt-ids", &ids, "--gen-len", &gen_len.to_string()]);
            c
        })
    };
    let exe = std::env::current_exe().map_err(|e| Exit::from(e))?;
    let serve = |name: &str, cmd: Box<dyn Fn() -> Command>| -> Result<Runner, Exit> {
        let server = start_server(cmd()).map_err(|e| Exit::new(2, format!("arm {name}: {e}")))?;
        Ok(Runner { name: name.to_string(), cmd, server: Some(std::cell::RefCell::new(server)) })
    };
    match arm {
        Arm::Device(d) => serve(arm_name, ab_run(exe, d)),
        Arm::Git { rev, device } => serve(arm_name, ab_run(build_rev(&rev)?, device)),
        Arm::Exec(c) => {
            let (model, ids) = (model.to_path_buf(), ids.to_string());
            Ok(Runner {
                name: arm_name.to_string(),
                cmd: Box::new(move || {
                    let mut cmd = Command::new("sh");
                    cmd.arg("-c").arg(&c).env("TOUCHSTONE_MODEL", &model).env("TOUCHSTONE_PROMPT_IDS", &ids).env("TOUCHSTONE_N_GENERATE", gen_len.to_string());
                    cmd
                }),
                server: None,
            })
        }
    }
}

/// Builds this repository's xtask at `rev` in its own worktree, with the GPU features this binary
/// has (so `git:REV:cuda:0` works from a `--features cuda` build), cached by commit and features.
fn build_rev(rev: &str) -> Result<PathBuf, Exit> {
    use super::git;
    let here = std::env::current_dir().map_err(|e| Exit::from(e))?;
    let top = PathBuf::from(git(&here, &["rev-parse", "--show-toplevel"])?);
    let sha = git(&top, &["rev-parse", "--verify", &format!("{rev}^{{commit}}")])?;
    let root = top.join("target/touchstone/ab");
    let features: Vec<&str> = crate::FEATURES.iter().filter(|(f, on)| *on && *f != "parquet").map(|(f, _)| *f).collect();
    let bin = root.join(if features.is_empty() { format!("xtask-{sha}") } else { format!("xtask-{sha}-{}", features.join("-")) });
    if bin.exists() {
        return Ok(bin);
    }
    let tree = root.join(format!("src-{sha}"));
    if !tree.exists() {
        git(&top, &["worktree", "add", "--detach", tree.to_str().unwrap_or_default(), &sha])?;
    }
    eprintln!("ab: building xtask at {sha:.10} (release; cached as {})", bin.display());
    let st = Command::new("cargo")
        .args(["build", "--release", "--quiet", "--package", "xtask"])
        .args(if features.is_empty() { vec![] } else { vec!["--features".to_string(), features.join(",")] })
        .current_dir(&tree)
        .env("CARGO_TARGET_DIR", root.join("target"))
        .status()
        .map_err(|e| Exit::new(2, format!("cargo build at {sha:.10}: {e}")))?;
    if !st.success() {
        return Err(Exit::new(2, format!("arm git:{rev}: the build at {sha:.10} failed ({st})")));
    }
    std::fs::copy(root.join("target/release/xtask"), &bin).map_err(|e| super::io_exit(&bin, e))?;
    let _ = git(&top, &["worktree", "remove", "--force", tree.to_str().unwrap_or_default()]);
    Ok(bin)
}

/// Replaces an arm's server process with a fresh one (no-op for per-run arms).
fn respawn(r: &Runner) -> Result<(), String> {
    if let Some(server) = &r.server {
        let fresh = start_server((r.cmd)())?;
        // The old server is dropped (killed) here.
        *server.borrow_mut() = fresh;
    }
    Ok(())
}

/// The last four lines of an arm's stderr, on one line.
fn last_lines(text: &str) -> String {
    let tail: Vec<&str> = text.lines().rev().take(4).collect();
    tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
}

/// Sends one request line to an arm's server and returns its JSON answer.
fn request(r: &Runner, cmd: &str, timeout: Duration) -> Result<serde_json::Value, String> {
    use std::io::Write;
    let Some(server) = &r.server else { return Err("not a server arm".into()) };
    let mut sv = server.borrow_mut();
    sv.stdin.write_all(format!("{cmd}\n").as_bytes()).and_then(|_| sv.stdin.flush()).map_err(|e| format!("the arm's server stopped ({e})"))?;
    let line = match sv.lines.recv_timeout(timeout) {
        Ok(l) => l,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => return Err(format!("did not answer within {} s", timeout.as_secs())),
        Err(_) => {
            let _ = sv.child.wait();
            return Err(format!("exited: {}", last_lines(&std::fs::read_to_string(sv.stderr.path()).unwrap_or_default())));
        }
    };
    serde_json::from_str(&line).map_err(|e| format!("answered `{line}` ({e})"))
}

/// Whether both arms can be stepped token by token (device or git arms of this repository).
fn can_lockstep(a: &Runner, b: &Runner, timeout: Duration) -> bool {
    [a, b].iter().all(|r| r.server.is_some() && request(r, "begin", timeout).is_ok_and(|v| v.get("error").is_none()))
}

/// One pair run token by token: both arms prefill, then decode steps alternate between the arms
/// (A,B then B,A, ...), so both see the same machine state within milliseconds.
fn lockstep_pair(first: &Runner, second: &Runner, gen_len: usize, n_prompt: usize, timeout: Duration) -> Result<(RunSample, RunSample), (String, String)> {
    let mut samples = Vec::new();
    for r in [first, second] {
        let v = request(r, "begin", timeout).map_err(|e| (r.name.clone(), e))?;
        let tok = v.get("token").and_then(|t| t.as_u64()).ok_or_else(|| (r.name.clone(), format!("bad answer to begin: {v}")))?;
        samples.push(RunSample { prefill_ms: v["prefill_ms"].as_f64().unwrap_or(0.0), decode_ms: 0.0, n_prompt, n_gen: 1, tokens: vec![tok as u32], step_ms: Vec::new(), cpu: v.get("cpu").and_then(|c| c.as_str()).map(String::from), peak_rss_kb: None });
    }
    for k in 0..gen_len.saturating_sub(1) {
        let order = if k % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let r = if i == 0 { first } else { second };
            let v = request(r, "step", timeout).map_err(|e| (r.name.clone(), e))?;
            let (Some(ms), Some(tok)) = (v.get("step_ms").and_then(|x| x.as_f64()), v.get("token").and_then(|t| t.as_u64())) else {
                return Err((r.name.clone(), format!("bad answer to step: {v}")));
            };
            let s = &mut samples[i];
            s.step_ms.push(ms);
            s.decode_ms += ms;
            s.tokens.push(tok as u32);
            s.n_gen += 1;
        }
    }
    for (s, r) in samples.iter_mut().zip([first, second]) {
        s.peak_rss_kb = request(r, "rss", timeout).ok().and_then(|v| v.get("peak_rss_kb").and_then(|k| k.as_u64()));
    }
    let second_sample = samples.pop().expect("two samples");
    Ok((samples.pop().expect("two samples"), second_sample))
}

/// `--timeout`'s default: seconds one run of an arm may take.
pub const DEFAULT_TIMEOUT_S: u64 = 300;

/// A measured request's prompt and generated tokens unless given (`ab` and `bench` alike, so a
/// tok/s figure means the same in both).
pub const PROMPT_LEN: usize = 16;
pub const GEN_LEN: usize = 32;

/// One run of the `exec:` engine `cmd` (as an `ab` arm runs it): its checked JSON line.
pub fn run_exec(cmd: &str, model: &Path, ids: &str, gen_len: usize, timeout: Duration) -> Result<RunSample, String> {
    let runner = prepare("exec", Arm::Exec(cmd.to_string()), model, "", ids, gen_len).map_err(|e| e.message)?;
    run_once(&runner, timeout, gen_len)
}

/// Runs one arm once: its JSON line, or why not.
fn run_once(r: &Runner, timeout: Duration, gen_len: usize) -> Result<RunSample, String> {
    if r.server.is_some() {
        return request(r, "run", timeout).and_then(|v| parse_sample(&v.to_string(), gen_len));
    }
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let status = devices::external::run_bounded(&mut (r.cmd)(), &out, &err, timeout, "--timeout allows more")?;
    // The JSON line is its last; 16 MiB holds one listing 2^20 ids.
    let stdout = String::from_utf8_lossy(&devices::external::file_tail(&out, 16 << 20)).into_owned();
    let stderr = String::from_utf8_lossy(&devices::external::file_tail(&err, 64 << 10)).into_owned();
    if !status.success() {
        return Err(format!("exited with {status}: {}", last_lines(&stderr)));
    }
    let line = stdout.lines().rev().find(|l| l.trim_start().starts_with('{')).ok_or("printed no JSON line")?;
    parse_sample(line, gen_len)
}

/// An arm's JSON line, checked: at least 2 and at most `gen_len` (the request) tokens
/// generated, as many as it lists, positive finite times.
pub(crate) fn parse_sample(line: &str, gen_len: usize) -> Result<RunSample, String> {
    let s: RunSample = serde_json::from_str(line).map_err(|e| format!("its JSON line is not the arm protocol ({e}): {line}"))?;
    let finite = |x: f64| x.is_finite() && x >= 0.0;
    if s.n_gen < 2 || !(s.decode_ms > 0.0) || !finite(s.decode_ms) || !finite(s.prefill_ms) || !s.step_ms.iter().all(|x| finite(*x)) {
        return Err(format!("implausible sample (n_gen {}, decode_ms {}, prefill_ms {}, a step_ms not a finite time)", s.n_gen, s.decode_ms, s.prefill_ms));
    }
    if s.n_gen > gen_len || s.tokens.len() != s.n_gen {
        return Err(format!("says n_gen {} with {} tokens listed, for a request of {gen_len} (TOUCHSTONE_N_GENERATE)", s.n_gen, s.tokens.len()));
    }
    Ok(s)
}

fn hash(tokens: &[u32]) -> String {
    let h = tokens.iter().flat_map(|t| t.to_le_bytes()).fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    format!("{h:016x}")
}

struct Pair {
    a: RunSample,
    b: RunSample,
    a_first: bool,
}

impl Pair {
    /// B's change against A in `metric` (B/A - 1: positive is slower).
    fn change(&self, metric: Metric) -> f64 {
        metric.of(&self.b) / metric.of(&self.a) - 1.0
    }
}

/// One comparison (`abmatrix::main` runs a matrix of them).
pub fn main(a: AbArgs) -> Result<u8, Exit> {
    super::check_report_dir(a.report_dir.as_deref())?;
    let broken: Vec<&str> = [
        (a.pairs < 2, "--pairs >= 2"),
        (a.max_pairs < a.pairs, "--max-pairs >= --pairs"),
        (a.gen_len < 2, "--gen-len >= 2"),
        (a.prompt_len.contains(&0), "--prompt-len >= 1"),
        (!(a.threshold > 0.0 && a.threshold.is_finite()), "--threshold a positive percentage"),
        (a.timeout == 0, "--timeout >= 1 (seconds)"),
    ]
    .into_iter()
    .filter_map(|(bad, rule)| bad.then_some(rule))
    .collect();
    if !broken.is_empty() {
        return Err(Exit::new(2, format!("need {}", broken.join(", "))));
    }
    let model = super::resolve_model(&a.model)?;
    let n_vocab = oracle::loader::open_model(&model)?.1.n_vocab;
    let ids: Vec<String> = super::bench_prompt(a.prompt_len[0], a.gen_len, n_vocab)?.iter().map(u32::to_string).collect();
    let ids = ids.join(",");
    let ra = prepare("A", Arm::parse(&a.a)?, &model, &a.model, &ids, a.gen_len)?;
    let rb = prepare("B", Arm::parse(&a.b)?, &model, &a.model, &ids, a.gen_len)?;
    let timeout = Duration::from_secs(a.timeout);
    let mut pairs: Vec<Pair> = Vec::new();
    let mut failure: Option<Exit> = None;
    let mut target = a.pairs;
    let mut stats;
    let mut outputs_differ = false;
    let lockstep = can_lockstep(&ra, &rb, timeout);
    super::print_timing_notes();
    eprintln!("ab: {}", if lockstep { "both arms step token by token: decode steps of A and B alternate (A,B / B,A) within each pair" } else { "whole runs per pair in ABBA order" });
    let pb = super::progress(a.pairs as u64, &format!("ab {} vs {}", a.a, a.b));
    loop {
        while pairs.len() < target && failure.is_none() {
            let i = pairs.len();
            let first = ab::a_first(i, a.group_size());
            let order: [&Runner; 2] = if first { [&ra, &rb] } else { [&rb, &ra] };
            if a.respawn_every > 0 && i > 0 && i.is_multiple_of(a.respawn_every) {
                // Which arm starts first alternates by group: a start order is a treatment.
                let starts = if ab::a_started_first(i / a.respawn_every) { [&ra, &rb] } else { [&rb, &ra] };
                for r in starts {
                    if let Err(e) = respawn(r) {
                        failure = Some(Exit::new(2, format!("arm {} could not be restarted before pair {}: {e}", r.name, i + 1)));
                    }
                }
                if failure.is_some() {
                    break;
                }
            }
            let ran = if lockstep {
                lockstep_pair(order[0], order[1], a.gen_len, a.prompt_len[0], timeout)
            } else {
                let run = |r: &Runner| run_once(r, timeout, a.gen_len).map_err(|e| (r.name.clone(), e));
                run(order[0]).and_then(|first| Ok((first, run(order[1])?)))
            };
            match ran {
                Ok((x, y)) => {
                    let (sa, sb) = if first { (x, y) } else { (y, x) };
                    pairs.push(Pair { a: sa, b: sb, a_first: first });
                    // Outputs that differ (arm from arm unless allowed, or a run from the arm's
                    // first) end the comparison at once: more pairs cannot make it valid.
                    let (p, p0) = (&pairs[pairs.len() - 1], &pairs[0]);
                    if (!a.allow_different_outputs && p.a.tokens != p.b.tokens) || p.a.tokens != p0.a.tokens || p.b.tokens != p0.b.tokens {
                        outputs_differ = true;
                        break;
                    }
                }
                Err((name, e)) => {
                    let which = if name == "A" { &a.a } else { &a.b };
                    failure = Some(Exit::new(2, format!("arm {name} (`{which}`) failed in pair {}: {e}", i + 1)));
                }
            }
            pb.set_length(target as u64);
            pb.set_position(pairs.len() as u64);
        }
        stats = a.stats(&pairs, a.metric);
        match (stats.verdict, stats.pairs_needed, &failure) {
            (AbVerdict::Inconclusive, Some(need), None) if pairs.len() < a.max_pairs && !outputs_differ => {
                target = a.plan().next(pairs.len(), need, a.group_size());
                eprintln!("ab: inconclusive after {} pairs in {} groups (CI {:+.2}%..{:+.2}%); about {need} pairs would decide, running {target} (max {})", pairs.len(), stats.groups, stats.ci95.0 * 100.0, stats.ci95.1 * 100.0, a.max_pairs);
            }
            _ => break,
        }
    }
    pb.finish_and_clear();

    // Identical inputs must give identical outputs, run to run and arm to arm.
    let mut problems = Vec::new();
    let mut first_difference = None;
    if let Some(p0) = pairs.first() {
        for (i, p) in pairs.iter().enumerate() {
            for (arm, s, base) in [("A", &p.a, &p0.a), ("B", &p.b, &p0.b)] {
                if s.tokens != base.tokens {
                    problems.push(format!("arm {arm} produced different tokens in pair {} than in pair 1 (hash {} vs {})", i + 1, hash(&s.tokens), hash(&base.tokens)));
                }
            }
        }
        if p0.a.tokens != p0.b.tokens {
            let at = p0.a.tokens.iter().zip(&p0.b.tokens).position(|(x, y)| x != y).unwrap_or(p0.a.tokens.len().min(p0.b.tokens.len()));
            first_difference = Some(at);
            if !a.allow_different_outputs {
                problems.push(format!(
                    "the arms' outputs differ from generated token {at} (A hash {}, B hash {}): a faster wrong answer is not faster; pass --allow-different-outputs to compare different engines on purpose",
                    hash(&p0.a.tokens),
                    hash(&p0.b.tokens)
                ));
            }
        }
        if let (Some(ca), Some(cb)) = (&p0.a.cpu, &p0.b.cpu) {
            if ca != cb {
                problems.push(format!("the arms ran on different hardware (A: {ca}, B: {cb}); refusing to compare"));
            }
        }
    }

    let stop = if failure.is_some() {
        Stop::ArmFailed
    } else if outputs_differ {
        Stop::OutputsDiffer
    } else if pairs.len() >= a.max_pairs && matches!(stats.verdict, AbVerdict::Inconclusive) {
        Stop::MaxPairs
    } else {
        Stop::Decided
    };
    let mut report = build_report(&a, &pairs, &stats, first_difference, failure.as_ref().map(|f| f.message.clone()).or_else(|| problems.first().cloned()), stop);
    let dir = super::write_report(&mut report, a.report_dir.clone())?;
    print_table(&a, &pairs, &stats, first_difference, stop);
    outln!("report: {}", dir.join("report.json").display());
    if let Some(f) = failure {
        return Err(Exit::new(2, format!("{} ({} pairs kept in {})", f.message, pairs.len(), dir.display())));
    }
    if let Some(p) = problems.into_iter().next() {
        return Err(Exit::new(2, p));
    }
    Ok(match stats.verdict {
        AbVerdict::Faster | AbVerdict::NoChange => 0,
        AbVerdict::Slower => 1,
        AbVerdict::Inconclusive => 3,
    })
}
