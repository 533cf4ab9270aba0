//! Touchstone's command line, `cargo xtask …` in this checkout and the `touchstone` (or `xtask`)
//! binary where it is installed: the same [`main`] behind both. A thin dispatcher: each
//! subcommand parses its arguments, calls the library crates, prints, and maps the outcome to the
//! exit-code contract (0 pass, 1 gate failed, 2 could not run, 3 inconclusive).

/// `outln!` for the command's output: when whoever reads stdout has gone (`cargo xtask … |
/// head`), the process ends quietly with status 141, as a program killed by SIGPIPE would,
/// instead of panicking. (SIGPIPE itself stays ignored: `ab` must see a dead arm server as an
/// error on its pipe, not die of it.)
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout(), $($arg)*) {
            crate::stdout_failed(e);
        }
    }};
}

mod cmd;

/// The readers of hostile input that live in this crate, for the fuzz targets (`fuzz/bodies`).
pub mod fuzzing {
    pub use crate::cmd::chat::render as render_chat;

    /// An `ab` arm's JSON line, checked as `ab` checks it for a request of `gen_len` tokens.
    pub fn parse_ab_line(line: &str, gen_len: usize) -> Result<(), String> {
        crate::cmd::ab::parse_sample(line, gen_len).map(|_| ())
    }
}

/// Ends the process after a failed write to stdout: status 141 when the reader has gone (broken
/// pipe), 2 for any other error.
pub fn stdout_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(141);
    }
    eprintln!("error: writing to stdout: {e}");
    std::process::exit(2);
}

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// `--version`: the crate's version and the revision it was built from (xtask/build.rs).
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (revision ", env!("TOUCHSTONE_REVISION"), ")");

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Touchstone: a correctness oracle and benchmarking toolkit for LLM inference engines", version = VERSION)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// The context (positions) the engine under test is configured for, as llama.cpp's `-c`: a
    /// LongRoPE model (Phi-3 128k) takes its long factors, at every position, when this is longer
    /// than its original context, else its short ones (the default); positions past it are
    /// refused. Other models are unchanged. Sets TOUCHSTONE_CONTEXT, which every model loader,
    /// child process and `exec:` engine sees.
    #[arg(long, global = true, value_name = "POSITIONS", value_parser = clap::value_parser!(u64).range(1..))]
    context: Option<u64>,
    /// Keep what each `exec:` engine writes (its dump and engine.log) in DIR/dump-N, to inspect
    /// after the run; the same as TOUCHSTONE_KEEP_DUMPS=DIR.
    #[arg(long, global = true, value_name = "DIR")]
    keep_dumps: Option<std::path::PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// The main job: run the gates that exist on the default devices and models; exit 0/1/2/3.
    Gate(cmd::gate::GateArgs),
    /// Kernel-level gate: every registry op case on a device vs the oracle, with derived tolerances.
    Kernels(cmd::kernels::KernelsArgs),
    /// From the first tap over its budget to the smallest kernel case that still fails on the device alone, written for `kernels --cases`.
    Reduce(cmd::reduce::ReduceArgs),
    /// Layer-diff gate: every tap of a device's forward pass vs the oracle (isolated and propagated), first divergence, plots.
    LayerDiff(cmd::layerdiff::LayerDiffArgs),
    /// Fixed-token gate: teacher-forced KLD/top-1/Δp vs the oracle, greedy vs the golden sequence, cache consistency.
    FixedToken(cmd::fixedtoken::FixedTokenArgs),
    /// Serving gate: one request batched, beside other requests, reusing a cached prefix, chunked, decoded and in a recycled slot, vs its own run alone and the oracle.
    Serving(cmd::serving::ServingArgs),
    /// Finds the first bad commit with `git bisect run`, judging each revision by an xtask command (0 good, 1 bad, 2/3 skip).
    Bisect(cmd::bisect::BisectArgs),
    #[command(hide = true)]
    BisectStep(cmd::bisect::StepArgs),
    /// Paired, interleaved A/B benchmark of two arms (devices, git revisions, exec commands): verdict faster/slower/no change/inconclusive.
    Ab(cmd::ab::AbArgs),
    #[command(hide = true)]
    AbRun(cmd::ab::AbRunArgs),
    /// How often `ab` is wrong on a real engine: many A/A and really-slower decisions, false-alarm rate and power with 95% intervals.
    AbCalibrate(cmd::abcal::AbCalibrateArgs),
    /// Merge shard reports or re-render a report's Markdown/JUnit/CSV/plots from report.json.
    Report(cmd::report::ReportArgs),
    /// Greedy (or seeded sampled) generation; prints the text and the decode speed.
    Run(cmd::run::RunArgs),
    /// A model's tokenizer alone: text to comma-separated ids (as --prompt-ids takes them), or --ids back to text.
    Tokenize(cmd::tokenize::TokenizeArgs),
    /// Writes every tap and the logits of every position in the dump format (docs/DUMP_FORMAT.md).
    Dump(cmd::dump::DumpArgs),
    /// Writes a model as one flat file (fixed header, tensor table, aligned tensors; docs/FLAT_FORMAT.md) for engines without a GGUF parser; every command reads it back as a model.
    Export(cmd::export::ExportArgs),
    /// Throughput of a device on a model: prefill/decode tok/s, time to first token, inter-token latency percentiles, peak RSS (for the oracle also weight bandwidth vs a memory probe; for GPU devices device memory peak and kernel launches per step).
    Bench(cmd::bench::BenchArgs),
    /// GEMV weight bandwidth per weight type vs the device's copy bandwidth, measured in one run (GPU devices and cpu); gated by --min-ratio.
    Roofline(cmd::roofline::RooflineArgs),
    /// Compiles the GPU kernels to PTX with NVRTC into the PTX cache (for GPU machines without NVRTC).
    #[cfg(feature = "cuda")]
    Ptx(cmd::ptx::PtxArgs),
    /// Generates the synthetic models and fetches/verifies the real ones (idempotent).
    Fixtures(cmd::fixtures::FixturesArgs),
}

/// This binary's optional features and whether each was compiled in (report provenance).
pub const FEATURES: [(&str, bool); 3] = [("cuda", cfg!(feature = "cuda")), ("rocm", cfg!(feature = "rocm")), ("parquet", cfg!(feature = "parquet"))];

/// An error with the exit code it maps to.
#[derive(Debug)]
pub struct Exit {
    pub code: u8,
    pub message: String,
    /// The error was a device saying it cannot serve this request at all
    /// ([`devices::DeviceError::Unavailable`]: not built in, no such hardware, a model it has no
    /// kernels for), which `gate` reports as unsupported rather than as an error.
    pub unavailable: bool,
}

impl Exit {
    pub fn new(code: u8, message: impl Into<String>) -> Exit {
        Exit { code, message: message.into(), unavailable: false }
    }
}

impl<E: Into<anyhow::Error>> From<E> for Exit {
    fn from(e: E) -> Self {
        let e: anyhow::Error = e.into();
        let unavailable = e.chain().any(|c| matches!(c.downcast_ref::<devices::DeviceError>(), Some(devices::DeviceError::Unavailable(..))));
        // Our library errors already name file, field and cause in their own message; anyhow's
        // alternate form would repeat the cause.
        Exit { unavailable, ..Exit::new(2, format!("{e}")) }
    }
}

/// The most worker threads `RAYON_NUM_THREADS` may ask for: more than any machine's cores by
/// far (100,000 spent minutes creating threads before a token ran).
const MAX_THREADS: usize = 4096;

/// `RAYON_NUM_THREADS`, read by rayon when its pool first starts: a count past [`MAX_THREADS`]
/// is refused here, before any thread starts. rayon itself falls back to one thread per core
/// for 0 and for what is not a number, as documented.
fn check_thread_count() -> Result<(), Exit> {
    match std::env::var("RAYON_NUM_THREADS").ok().and_then(|v| v.trim().parse::<usize>().ok()) {
        Some(n) if n > MAX_THREADS => Err(Exit::new(2, format!("RAYON_NUM_THREADS={n}: more than {MAX_THREADS} worker threads (0 or unset: one per core)"))),
        _ => Ok(()),
    }
}

/// The command line: parses the arguments, runs the subcommand, returns its exit code.
pub fn main() -> ExitCode {
    reports::mark_start();
    reports::set_build_revision(env!("TOUCHSTONE_REVISION"));
    // Named as it was called: `touchstone` where installed under that name, else `cargo xtask`.
    let called = std::env::args_os().next().and_then(|a| std::path::Path::new(&a).file_stem().map(|s| s.to_string_lossy().into_owned()));
    let cli = if called.as_deref() == Some("touchstone") {
        use clap::{CommandFactory, FromArgMatches};
        let matches = Cli::command().name("touchstone").bin_name("touchstone").get_matches();
        Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
    } else {
        Cli::parse()
    };
    if let Err(e) = check_thread_count() {
        eprintln!("error: {}", e.message);
        return ExitCode::from(e.code);
    }
    if let Some(n) = cli.context {
        // Before any thread starts.
        std::env::set_var(oracle::spec::CONTEXT_ENV, n.to_string());
    }
    if let Some(dir) = &cli.keep_dumps {
        std::env::set_var("TOUCHSTONE_KEEP_DUMPS", dir);
    }
    let result = match cli.command {
        Command::Gate(a) => cmd::gate::main(a),
        Command::Kernels(a) => cmd::kernels::main(a),
        Command::LayerDiff(a) => cmd::layerdiff::main(a),
        Command::Reduce(a) => cmd::reduce::main(a),
        Command::FixedToken(a) => cmd::fixedtoken::main(a),
        Command::Serving(a) => cmd::serving::main(a),
        Command::Bisect(a) => cmd::bisect::main(a),
        Command::BisectStep(a) => cmd::bisect::step(a),
        Command::Ab(a) => cmd::abmatrix::main(a),
        Command::AbRun(a) => cmd::ab::run_main(a),
        Command::AbCalibrate(a) => cmd::abcal::main(a),
        Command::Report(a) => cmd::report::main(a),
        Command::Run(a) => cmd::run::main(a),
        Command::Tokenize(a) => cmd::tokenize::main(a),
        Command::Dump(a) => cmd::dump::main(a),
        Command::Export(a) => cmd::export::main(a),
        Command::Bench(a) => cmd::bench::main(a),
        Command::Roofline(a) => cmd::roofline::main(a),
        #[cfg(feature = "cuda")]
        Command::Ptx(a) => cmd::ptx::main(a),
        Command::Fixtures(a) => cmd::fixtures::main(a),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("error: {}", e.message);
            ExitCode::from(e.code)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every command's `--device` help gives the one list of devices (`devices::device_names!`),
    /// so a new device reaches every help text at once. `roofline` times kernels on a device that
    /// has a clock of its own and says which those are; hidden commands are internal.
    #[test]
    fn every_device_flag_gives_the_one_list_of_devices() {
        use clap::CommandFactory;
        let cli = Cli::command();
        let mut checked = Vec::new();
        for sub in cli.get_subcommands().filter(|s| s.get_name() != "roofline" && !s.is_hide_set()) {
            for arg in sub.get_arguments().filter(|a| a.get_id() == "device") {
                let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
                assert!(help.contains(devices::device_names!()), "{} --device: {help}", sub.get_name());
                checked.push(sub.get_name().to_string());
            }
        }
        for cmd in ["run", "dump", "layer-diff", "fixed-token", "kernels", "bench"] {
            assert!(checked.iter().any(|c| c == cmd), "{cmd} has no --device flag checked: {checked:?}");
        }
    }

    /// Every command's `--model` help gives the one list of model names (`fixtures::model_names!`),
    /// so a new fixture reaches every help text at once.
    #[test]
    fn every_model_flag_gives_the_one_list_of_models() {
        use clap::CommandFactory;
        let cli = Cli::command();
        let mut checked = Vec::new();
        for sub in cli.get_subcommands().filter(|s| !s.is_hide_set()) {
            for arg in sub.get_arguments().filter(|a| a.get_id() == "model") {
                let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
                assert!(help.contains(fixtures::model_names!()), "{} --model: {help}", sub.get_name());
                checked.push(sub.get_name().to_string());
            }
        }
        for cmd in ["run", "dump", "layer-diff", "fixed-token", "bench", "ab", "gate", "tokenize", "export"] {
            assert!(checked.iter().any(|c| c == cmd), "{cmd} has no --model flag checked: {checked:?}");
        }
    }
}
