//! `cargo xtask bisect --good REV --bad REV -- <xtask command>`: drives `git bisect run` with the
//! exit-code contract, over one of two histories:
//! - `--repo DIR --build CMD`: an engine's repository. Each step checks the engine out at the
//!   revision in a worktree of its own, builds it with `sh -c CMD` there (a failed build is a
//!   skip, its log kept and shown when every step skips), and judges it with this Touchstone
//!   binary, the command running inside that worktree (so `exec:./run.sh` is the revision's own
//!   engine).
//! - without `--repo`: Touchstone's own history; each step builds and runs `cargo xtask
//!   <command>` at that revision.
//!
//! 0 = good, 1 = bad, 2/3 (could not run / inconclusive) and build failures = skip. The caller's
//! checkout is never touched. Prints the first bad commit and where the report for it is.

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
    /// Where the worktree and each revision's report go (default target/touchstone/bisect/ under
    /// the current directory).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Bisect this engine repository (any git repository) instead of Touchstone's own history;
    /// each revision is judged by this Touchstone binary, the command run inside the revision's
    /// worktree.
    #[arg(long)]
    repo: Option<PathBuf>,
    /// With `--repo`: how to build the engine at each revision (`sh -c CMD` in its worktree,
    /// e.g. `make`); a failed build skips the revision. None: nothing to build.
    #[arg(long, requires = "repo")]
    build: Option<String>,
    /// The xtask command to judge each revision with, after `--`, e.g. `-- gate --suite kernels`.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// Internal: one bisect step (run by `git bisect run`), not for direct use.
#[derive(clap::Args)]
pub struct StepArgs {
    #[arg(long)]
    reports: PathBuf,
    /// An engine's repository: build with `--build` (if given), then run this binary itself.
    #[arg(long)]
    engine: bool,
    #[arg(long)]
    build: Option<String>,
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
    let here = std::env::current_dir().map_err(|e| Exit::from(e))?;
    let repo = a.repo.clone().unwrap_or_else(|| here.clone());
    if !repo.is_dir() {
        return Err(Exit::new(2, format!("--repo {}: not a directory", repo.display())));
    }
    let top = PathBuf::from(git(&repo, &["rev-parse", "--show-toplevel"])?);
    let good = git(&top, &["rev-parse", "--verify", &format!("{}^{{commit}}", a.good)])?;
    let bad = git(&top, &["rev-parse", "--verify", &format!("{}^{{commit}}", a.bad)])?;
    // Refused before a worktree is made: git's own messages for these were empty or cryptic.
    if good == bad {
        return Err(Exit::new(2, format!("--good {} and --bad {} are the same commit {good:.10}: nothing lies between them", a.good, a.bad)));
    }
    let ancestor = Command::new("git").current_dir(&top).args(["merge-base", "--is-ancestor", &good, &bad]).status().map_err(|e| Exit::new(2, format!("git: {e}")))?;
    if !ancestor.success() {
        return Err(Exit::new(2, format!("--good {} ({good:.10}) is not an ancestor of --bad {} ({bad:.10}): the good revision must come first (swapped?)", a.good, a.bad)));
    }
    let work = match (&a.work_dir, &a.repo) {
        (Some(w), _) => w.clone(),
        (None, Some(_)) => here.join("target/touchstone/bisect"),
        (None, None) => top.join("target/touchstone/bisect"),
    };
    let work = if work.is_absolute() { work } else { here.join(work) };
    let tree = work.join("worktree");
    let reports = work.join("reports");
    std::fs::create_dir_all(&reports).map_err(|e| super::io_exit(&reports, e))?;
    if tree.exists() {
        let _ = git(&top, &["worktree", "remove", "--force", tree.to_str().unwrap_or_default()]);
    }
    git(&top, &["worktree", "add", "--detach", tree.to_str().unwrap_or_default(), &bad])?;
    // The step runner is this very binary, copied so that nothing a step builds replaces it.
    let exe = std::env::current_exe().map_err(|e| Exit::from(e))?;
    let runner = work.join("xtask-bisect-step");
    std::fs::copy(&exe, &runner).map_err(|e| super::io_exit(&runner, e))?;
    let result = (|| -> Result<u8, Exit> {
        git(&tree, &["bisect", "start", &bad, &good])?;
        let mut cmd = Command::new("git");
        // One target directory for every step: each revision's build is incremental.
        cmd.current_dir(&tree).args(["bisect", "run"]).arg(&runner).args(["bisect-step", "--reports"]).arg(&reports);
        if a.repo.is_some() {
            cmd.arg("--engine");
            if let Some(b) = &a.build {
                cmd.args(["--build", b]);
            }
        } else {
            // One target directory for every step: each revision's build is incremental.
            cmd.env("CARGO_TARGET_DIR", work.join("target"));
        }
        cmd.arg("--").args(&a.command);
        match &a.repo {
            Some(_) => eprintln!("bisect: {} {good:.10} (good) .. {bad:.10} (bad), building each revision with `{}` and judging it with `{} {}` in its worktree", top.display(), a.build.as_deref().unwrap_or("(nothing)"), exe.display(), a.command.join(" ")),
            None => eprintln!("bisect: {good:.10} (good) .. {bad:.10} (bad), judging each revision with `cargo xtask {}`", a.command.join(" ")),
        }
        // Each step's own lines (good, bad, skip and why) go to the user as they come.
        let o = cmd.stderr(std::process::Stdio::inherit()).output().map_err(|e| Exit::new(2, format!("git bisect run: {e}")))?;
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
                Err(Exit::new(2, format!("git bisect found no first bad commit (every candidate skipped, or good/bad swapped?):\n{}{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"), skipped_builds(&reports))))
            }
        }
    })();
    let _ = git(&tree, &["bisect", "reset"]);
    let _ = git(&top, &["worktree", "remove", "--force", tree.to_str().unwrap_or_default()]);
    result
}

/// The build logs of the revisions whose build failed, with the end of the last one, for the
/// message when no first bad commit was found.
fn skipped_builds(reports: &std::path::Path) -> String {
    let mut logs: Vec<PathBuf> = std::fs::read_dir(reports).into_iter().flatten().flatten().map(|e| e.path().join("build-failed.log")).filter(|p| p.exists()).collect();
    logs.sort();
    let Some(last) = logs.last() else { return String::new() };
    let text = String::from_utf8_lossy(&devices::external::file_tail(last, 4 << 10)).into_owned();
    let lines: Vec<&str> = text.lines().collect();
    format!(
        "\n{} revision(s) failed to build: {}\nthe end of {}:\n  {}",
        logs.len(),
        logs.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
        last.display(),
        lines[lines.len().saturating_sub(10)..].join("\n  ")
    )
}

/// One step inside the worktree: build (an engine: its `--build`; Touchstone: cargo) and run the
/// command, write its report under `reports/<rev>/`, exit with git bisect's code.
pub fn step(a: StepArgs) -> Result<u8, Exit> {
    let here = std::env::current_dir().map_err(|e| Exit::from(e))?;
    let rev = git(&here, &["rev-parse", "HEAD"])?;
    let dir = a.reports.join(&rev);
    std::fs::create_dir_all(&dir).map_err(|e| super::io_exit(&dir, e))?;
    let status = if a.engine {
        if let Some(build) = &a.build {
            let log = dir.join("build.log");
            let file = std::fs::File::create(&log).map_err(|e| super::io_exit(&log, e))?;
            let err = file.try_clone().map_err(|e| super::io_exit(&log, e))?;
            let built = Command::new("sh").arg("-c").arg(build).current_dir(&here).stdin(std::process::Stdio::null()).stdout(file).stderr(err).status();
            if !built.as_ref().is_ok_and(|s| s.success()) {
                let kept = dir.join("build-failed.log");
                let _ = std::fs::rename(&log, &kept);
                eprintln!("bisect step {rev:.10}: skip (`{build}` failed: {}; its log: {})", built.map_or_else(|e| e.to_string(), |s| s.to_string()), kept.display());
                return Ok(125);
            }
        }
        let exe = std::env::current_exe().map_err(|e| Exit::from(e))?;
        Command::new(exe).args(&a.command).arg("--report-dir").arg(&dir).current_dir(&here).status()
    } else {
        Command::new("cargo").args(["run", "--quiet", "--package", "xtask", "--"]).args(&a.command).arg("--report-dir").arg(&dir).current_dir(&here).status()
    };
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
