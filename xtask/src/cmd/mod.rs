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

/// Devices this build can run. Others are reported as unavailable (exit 2) with the reason.
pub fn check_device(device: &str) -> Result<(), Exit> {
    match device {
        "ref" => Ok(()),
        "cpu" | "fixed" | "fixed-int4" => Err(Exit {
            code: 2,
            message: format!("device `{device}` is unavailable: this build has only the oracle (`ref`); the cpu and fixed backends are not implemented yet"),
        }),
        d if d.starts_with("cuda") => Err(Exit { code: 2, message: format!("device `{d}` is unavailable: not compiled with feature cuda") }),
        d if d.starts_with("rocm") => Err(Exit { code: 2, message: format!("device `{d}` is unavailable: not compiled with feature rocm") }),
        d if d.starts_with("external:") || d.starts_with("exec:") => {
            Err(Exit { code: 2, message: format!("device `{d}` is unavailable: external engines are not implemented yet") })
        }
        d => Err(Exit { code: 2, message: format!("unknown device `{d}` (ref, cpu, fixed, cuda[:N], rocm[:N], external:DIR, exec:CMD)") }),
    }
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
