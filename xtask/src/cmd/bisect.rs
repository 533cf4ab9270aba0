//! `cargo xtask bisect --good REV --bad REV -- <xtask command>`: drives `git bisect run` over
//! this repository's history with the exit-code contract. Each step builds and runs
//! `cargo xtask <command>` at that revision in a separate worktree (the caller's checkout is never
//! touched): 0 = good, 1 = bad, 2/3 (could not run / inconclusive) and build failures = skip.
//! Prints the first bad commit and where the gate's report for it is.

use super::git;
use crate::Exit;
use std::path::PathBuf;
use std::process::Command;

#[derive(clap::Args)]
pub struct BisectArgs {
    /// A revision where the command passes (exit 0).
    #[arg(long)]
    good: String,
    /// A revision where the command fails (exit 1).
    #[arg(long)]
    bad: String,
    /// Where the worktree and each revision's report go (default target/touchstone/bisect/).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// The xtask command to judge each revision with, after `--`, e.g. `-- gate --suite kernels`.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// Internal: one bisect step (run by `git bisect run`), not for direct use.
#[derive(clap::Args)]
pub struct StepArgs {
    #[arg(long)]
    reports: PathBuf,
    #[arg(last = true)]
    command: Vec<String>,
}

/// git bisect run's meaning of an xtask exit code: 0 good, 1 bad, anything else skip (125).
pub fn bisect_code(xtask_exit: Option<i32>) -> u8 {
    match xtask_exit {
        Some(0) => 0,
        Some(1) => 1,
        _ => 125,
    }
}


pub fn main(a: BisectArgs) -> Result<u8, Exit> {
    let here = std::env::current_dir().map_err(|e| Exit { code: 2, message: e.to_string() })?;
    let top = PathBuf::from(git(&here, &["rev-parse", "--show-toplevel"])?);
    let good = git(&top, &["rev-parse", "--verify", &format!("{}^{{commit}}", a.good)])?;
    let bad = git(&top, &["rev-parse", "--verify", &format!("{}^{{commit}}", a.bad)])?;
    // Refused before a worktree is made: git's own messages for these were empty or cryptic.
    if good == bad {
        return Err(Exit { code: 2, message: format!("--good {} and --bad {} are the same commit {good:.10}: nothing lies between them", a.good, a.bad) });
    }
    let ancestor = Command::new("git").current_dir(&top).args(["merge-base", "--is-ancestor", &good, &bad]).status().map_err(|e| Exit { code: 2, message: format!("git: {e}") })?;
    if !ancestor.success() {
        return Err(Exit { code: 2, message: format!("--good {} ({good:.10}) is not an ancestor of --bad {} ({bad:.10}): the good revision must come first (swapped?)", a.good, a.bad) });
    }
    let work = a.work_dir.unwrap_or_else(|| top.join("target/touchstone/bisect"));
    let tree = work.join("worktree");
    let reports = work.join("reports");
    std::fs::create_dir_all(&reports).map_err(|e| super::io_exit(&reports, e))?;
    if tree.exists() {
        let _ = git(&top, &["worktree", "remove", "--force", tree.to_str().unwrap_or_default()]);
    }
    git(&top, &["worktree", "add", "--detach", tree.to_str().unwrap_or_default(), &bad])?;
    // The step runner is this very binary, copied so that nothing a step builds replaces it.
    let exe = std::env::current_exe().map_err(|e| Exit { code: 2, message: e.to_string() })?;
    let runner = work.join("xtask-bisect-step");
    std::fs::copy(&exe, &runner).map_err(|e| super::io_exit(&runner, e))?;
    let result = (|| -> Result<u8, Exit> {
        git(&tree, &["bisect", "start", &bad, &good])?;
        let mut cmd = Command::new("git");
        // One target directory for every step: each revision's build is incremental.
        cmd.current_dir(&tree).env("CARGO_TARGET_DIR", work.join("target")).args(["bisect", "run"]).arg(&runner).args(["bisect-step", "--reports"]).arg(&reports).arg("--").args(&a.command);
        eprintln!("bisect: {good:.10} (good) .. {bad:.10} (bad), judging each revision with `cargo xtask {}`", a.command.join(" "));
        let o = cmd.output().map_err(|e| Exit { code: 2, message: format!("git bisect run: {e}") })?;
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        let first_bad = out.lines().find(|l| l.contains("is the first bad commit")).and_then(|l| l.split_whitespace().next()).map(String::from);
        match first_bad {
            Some(rev) => {
                let subject = git(&top, &["log", "-1", "--format=%h %s", &rev]).unwrap_or_default();
                outln!("first bad commit: {subject}");
                outln!("its report: {}", reports.join(&rev).join("report.json").display());
                Ok(0)
            }
            None => {
                let tail: Vec<&str> = out.lines().rev().take(12).collect();
                Err(Exit { code: 2, message: format!("git bisect found no first bad commit (every candidate skipped, or good/bad swapped?):\n{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n")) })
            }
        }
    })();
    let _ = git(&tree, &["bisect", "reset"]);
    let _ = git(&top, &["worktree", "remove", "--force", tree.to_str().unwrap_or_default()]);
    result
}

/// One step inside the worktree: build and run the command, write its report under
/// `reports/<rev>/`, exit with git bisect's code.
pub fn step(a: StepArgs) -> Result<u8, Exit> {
    let here = std::env::current_dir().map_err(|e| Exit { code: 2, message: e.to_string() })?;
    let rev = git(&here, &["rev-parse", "HEAD"])?;
    let dir = a.reports.join(&rev);
    let status = Command::new("cargo")
        .args(["run", "--quiet", "--package", "xtask", "--"])
        .args(&a.command)
        .arg("--report-dir")
        .arg(&dir)
        .current_dir(&here)
        .status();
    let code = bisect_code(status.ok().and_then(|s| s.code()));
    eprintln!("bisect step {rev:.10}: {}", match code {
        0 => "good",
        1 => "bad",
        _ => "skip (could not build or run)",
    });
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_map_to_git_bisect() {
        assert_eq!(bisect_code(Some(0)), 0);
        assert_eq!(bisect_code(Some(1)), 1);
        assert_eq!(bisect_code(Some(2)), 125, "could not run = skip");
        assert_eq!(bisect_code(Some(3)), 125, "inconclusive = skip");
        assert_eq!(bisect_code(Some(101)), 125, "a panic or build failure = skip");
        assert_eq!(bisect_code(None), 125, "killed by a signal = skip");
    }
}
