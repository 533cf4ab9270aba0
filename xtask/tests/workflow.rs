//! The engine workflow template (ci/github/engine-gate.yml) run as shipped, step by step and in
//! order, on the template engine, the way a GitHub runner would for a pull request: every job,
//! every `run:` step under bash with the workflow's environment; `actions/checkout` is the engine
//! repository already checked out (a git repository of examples/external_engine's files, a base
//! commit and a head commit), the `cargo install` of the pinned Touchstone is this build's binary
//! put where it would be installed, and `actions/upload-artifact` checks that each path it uploads
//! exists. Every step must exit 0, and the job summary must hold each report's summary.

mod common;

use common::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// The workflow file as JSON (PyYAML reads it: the template engine's `gguf` requires it).
fn workflow_json(path: &Path) -> Option<Value> {
    let o = std::process::Command::new("python3").args(["-c", "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))", path.to_str().unwrap()]).output().ok()?;
    o.status.success().then(|| serde_json::from_slice(&o.stdout).unwrap())
}

/// `${{ … }}` expressions of the template, as GitHub gives them for a pull request; any other is
/// a change of the template this test must learn.
fn expand(s: &str, ctx: &BTreeMap<&str, String>) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("${{") {
        out += &rest[..i];
        let j = rest[i..].find("}}").unwrap_or_else(|| panic!("unclosed expression in {s}")) + i;
        let expr = rest[i + 3..j].trim();
        out += ctx.get(expr).unwrap_or_else(|| panic!("the workflow uses `{expr}`, which this test does not know"));
        rest = &rest[j + 2..];
    }
    out + rest
}

fn env_of(v: &Value, ctx: &BTreeMap<&str, String>) -> BTreeMap<String, String> {
    v.get("env").and_then(|e| e.as_object()).into_iter().flatten().map(|(k, v)| (k.clone(), expand(v.as_str().map_or_else(|| v.to_string(), String::from).as_str(), ctx))).collect()
}

#[test]
fn the_engine_workflow_runs_green_on_the_template_engine() {
    if !python_with_reference_peers() {
        return;
    }
    let wf = workflow_json(&workspace().join("ci/github/engine-gate.yml")).expect("PyYAML reads the workflow");
    let tmp = tempfile::tempdir().unwrap();
    // The engine's repository: the template's files at its root, a base commit and a head commit.
    let repo = tmp.path().join("engine");
    std::fs::create_dir_all(&repo).unwrap();
    for f in ["engine.py", "touchstone_dump.py", "ab_arm.py", "requirements.txt"] {
        std::fs::copy(workspace().join("examples/external_engine").join(f), repo.join(f)).unwrap();
    }
    std::fs::write(repo.join(".gitignore"), ".venv/\n__pycache__/\n.touchstone-cache/\n").unwrap();
    let git = |args: &[&str]| {
        let o = std::process::Command::new("git").args(["-c", "user.name=t", "-c", "user.email=t@example.com"]).args(args).current_dir(&repo).output().unwrap();
        assert!(o.status.success(), "git {args:?}: {}", text(&o));
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    git(&["init", "-q"]);
    git(&["add", "-A"]);
    git(&["commit", "-q", "-m", "base"]);
    let base = git(&["rev-parse", "HEAD"]);
    std::fs::write(repo.join("NOTES"), "head\n").unwrap();
    git(&["add", "-A"]);
    git(&["commit", "-q", "-m", "head"]);

    let jobs = wf["jobs"].as_object().expect("jobs");
    assert!(jobs.contains_key("gate") && jobs.contains_key("ab"), "{jobs:?}");
    for (job_name, job) in jobs {
        // Each job on a runner of its own: its own temp directory, PATH additions and summary.
        let runner_temp = tmp.path().join(format!("runner-{job_name}"));
        std::fs::create_dir_all(&runner_temp).unwrap();
        let summary = runner_temp.join("step_summary.md");
        let github_path = runner_temp.join("github_path");
        std::fs::write(&github_path, "").unwrap();
        let ctx: BTreeMap<&str, String> = [
            ("github.workspace", repo.display().to_string()),
            ("runner.temp", runner_temp.display().to_string()),
            ("github.event_name", "pull_request".to_string()),
            ("github.event.pull_request.base.sha", base.clone()),
        ]
        .into_iter()
        .collect();
        if let Some(cond) = job.get("if").and_then(|c| c.as_str()) {
            assert_eq!(cond, "github.event_name == 'pull_request'", "a condition this test does not know");
        }
        let mut env = env_of(&wf, &ctx);
        env.extend(env_of(job, &ctx));
        let steps = job["steps"].as_array().unwrap();
        for (i, step) in steps.iter().enumerate() {
            let what = format!("job {job_name}, step {} ({})", i + 1, step.get("name").or(step.get("uses")).and_then(|n| n.as_str()).unwrap_or("?"));
            if let Some(action) = step.get("uses").and_then(|u| u.as_str()) {
                if action.starts_with("actions/checkout@") {
                    continue; // the repository is checked out at head, its history whole
                }
                assert!(action.starts_with("actions/upload-artifact@"), "{what}: an action this test does not know");
                let paths = expand(step["with"]["path"].as_str().unwrap(), &ctx);
                for p in paths.lines().map(str::trim).filter(|p| !p.is_empty()) {
                    let o = std::process::Command::new("sh").arg("-c").arg(format!("ls -d {p}")).output().unwrap();
                    assert!(o.status.success(), "{what}: nothing at {p}");
                }
                continue;
            }
            let mut script = expand(step["run"].as_str().expect("a run step"), &ctx);
            if script.contains("cargo install") {
                // This build's binary, where the pinned one would be installed.
                let bin = runner_temp.join("touchstone/bin");
                std::fs::create_dir_all(&bin).unwrap();
                std::fs::copy(env!("CARGO_BIN_EXE_touchstone"), bin.join("touchstone")).unwrap();
                script = script.lines().filter(|l| !l.contains("cargo install")).collect::<Vec<_>>().join("\n");
            }
            let mut step_env = env.clone();
            step_env.extend(env_of(step, &ctx));
            let extra: Vec<String> = std::fs::read_to_string(&github_path).unwrap().lines().map(String::from).collect();
            let path = extra.iter().cloned().chain([std::env::var("PATH").unwrap_or_default()]).collect::<Vec<_>>().join(":");
            let o = std::process::Command::new("bash")
                .args(["--noprofile", "--norc", "-eo", "pipefail", "-c", &script])
                .current_dir(&repo)
                .envs(&step_env)
                .env("PATH", path)
                .env("RUNNER_TEMP", &runner_temp)
                .env("GITHUB_PATH", &github_path)
                .env("GITHUB_STEP_SUMMARY", &summary)
                .env("GITHUB_WORKSPACE", &repo)
                .output()
                .unwrap();
            assert!(o.status.success(), "{what} failed:\n{script}\n{}", text(&o));
        }
        let md = std::fs::read_to_string(&summary).unwrap_or_default();
        assert!(md.len() < reports::MARKDOWN_LIMIT, "{job_name}: job summary of {} bytes", md.len());
        // The gate passes; the A/B of two equal revisions is no change, or inconclusive (a warning).
        let want: &[&str] = if job_name == "gate" { &["# Touchstone `gate` report", "**PASS** (exit 0)", "| engine | tiny-llama | PASS |"] } else { &["# Touchstone `ab` report", "| B's change (95% CI) |"] };
        for w in want {
            assert!(md.contains(w), "{job_name}'s job summary lacks `{w}`:\n{md}");
        }
    }
}
