//! One module per subcommand, plus the argument helpers they share.

pub mod bench;
pub mod dump;
pub mod fixtures;
pub mod gate;
pub mod kernels;
pub mod report;
pub mod run;

use crate::Exit;
use oracle::generate::AnyModel;
use oracle::tokenizer::Tokenizer;
use oracle::Precision;
use std::path::PathBuf;

/// Devices that can run whole models in this build: `ref` (the oracle), `cpu`, `fixed`, `fixed-int4`.
pub fn check_device(device: &str) -> Result<(), Exit> {
    match device {
        "ref" | "cpu" | "fixed" | "fixed-int4" => Ok(()),
        d => match devices::open(d) {
            Err(e) => Err(Exit { code: 2, message: e.to_string() }),
            Ok(_) => Err(Exit { code: 2, message: format!("device `{d}` cannot run whole models yet") }),
        },
    }
}

/// Greedy/sampled generation on a device model (the same loop as the oracle's `generate`).
pub fn generate_on_device(
    model: &mut dyn devices::DeviceModel,
    prompt: &[u32],
    max_new: usize,
    sampler: &oracle::ops::SamplerConfig,
    seed: u64,
    stop: Option<u32>,
) -> Result<oracle::generate::Generation, Exit> {
    use std::time::Instant;
    let mut rng = oracle::ops::SplitMix64(seed);
    let n_vocab = model.spec().n_vocab;
    model.reset();
    let t0 = Instant::now();
    let logits = model.forward(prompt, &mut oracle::NoTap).map_err(|e| Exit { code: 2, message: e.to_string() })?;
    let mut tokens = Vec::new();
    if max_new == 0 {
        return Ok(oracle::generate::Generation { prompt: prompt.to_vec(), tokens, prefill_s: t0.elapsed().as_secs_f64(), decode_s: 0.0, decode_steps: 0 });
    }
    let mut next = oracle::ops::sample(&logits[logits.len() - n_vocab..], sampler, &mut rng) as u32;
    tokens.push(next);
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut steps = 0;
    while tokens.len() < max_new && Some(next) != stop {
        let logits = model.forward(&[next], &mut oracle::NoTap).map_err(|e| Exit { code: 2, message: e.to_string() })?;
        next = oracle::ops::sample(&logits, sampler, &mut rng) as u32;
        tokens.push(next);
        steps += 1;
    }
    Ok(oracle::generate::Generation { prompt: prompt.to_vec(), tokens, prefill_s, decode_s: t1.elapsed().as_secs_f64(), decode_steps: steps })
}

/// Parses `504,3575,282` or `504 3575 282`.
pub fn parse_ids(s: &str) -> Result<Vec<u32>, Exit> {
    let ids: Result<Vec<u32>, _> = s.split(|c: char| c == ',' || c.is_whitespace()).filter(|t| !t.is_empty()).map(|t| t.parse::<u32>()).collect();
    match ids {
        Ok(v) if !v.is_empty() => Ok(v),
        Ok(_) => Err(Exit { code: 2, message: "--prompt-ids is empty".into() }),
        Err(e) => Err(Exit { code: 2, message: format!("--prompt-ids `{s}`: {e} (expected comma-separated token ids)") }),
    }
}

/// Resolves a model name/path (generating or fetching fixtures on first use).
pub fn resolve_model(model: &str) -> Result<PathBuf, Exit> {
    Ok(::fixtures::resolve(model, false)?)
}

/// Loads a model with a spinner-free message (loading SmolLM2 takes about a second).
pub fn load_model(model: &str, precision: Precision) -> Result<(PathBuf, AnyModel, Option<Tokenizer>), Exit> {
    let path = resolve_model(model)?;
    let (m, tok) = AnyModel::load(&path, precision)?;
    Ok((path, m, tok))
}

/// Checks every id is inside the vocabulary (a clear error instead of a failure deep inside).
pub fn check_ids(ids: &[u32], n_vocab: usize) -> Result<(), Exit> {
    if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= n_vocab) {
        return Err(Exit { code: 2, message: format!("token id {id} at position {i} is outside the vocabulary of {n_vocab} tokens") });
    }
    Ok(())
}

/// Parses `K/N` (1 <= K <= N).
pub fn parse_shard(s: &str) -> Result<(usize, usize), Exit> {
    let bad = || Exit { code: 2, message: format!("--shard `{s}`: expected K/N with 1 <= K <= N, e.g. 2/4") };
    let (k, n) = s.split_once('/').ok_or_else(bad)?;
    let (k, n): (usize, usize) = (k.trim().parse().map_err(|_| bad())?, n.trim().parse().map_err(|_| bad())?);
    if k == 0 || n == 0 || k > n {
        return Err(bad());
    }
    Ok((k, n))
}

/// A progress bar on stderr (hidden when stderr is not a terminal).
pub fn progress(total: u64, what: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(total);
    pb.set_style(indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} ({elapsed}, eta {eta})").expect("template").progress_chars("=> "));
    pb.set_message(what.to_string());
    pb
}

/// `--report-dir` or `target/touchstone/<suite>-<unix time>/`.
pub fn report_dir(given: Option<PathBuf>, suite: &str) -> PathBuf {
    given.unwrap_or_else(|| {
        let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        PathBuf::from("target/touchstone").join(format!("{suite}-{ts}"))
    })
}

/// An I/O failure on `path` as a could-not-run exit that names the path.
pub fn io_exit(path: &std::path::Path, e: std::io::Error) -> Exit {
    Exit { code: 2, message: format!("{}: {e}", path.display()) }
}
