//! Tidy checks that run inside `cargo test`: every Rust file says what it is for (a `//!`
//! header), no test is marked ignored, and the README's two commands are the ones CI runs.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if p.is_dir() {
            if name != "target" && !name.starts_with('.') {
                rust_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

#[test]
fn every_rust_file_has_a_purpose_header_and_no_ignored_tests() {
    let mut files = Vec::new();
    for c in ["oracle", "devices", "suites", "reports", "fixtures", "xtask"] {
        rust_files(&root().join(c), &mut files);
    }
    assert!(files.len() > 20);
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        assert!(text.starts_with("//!"), "{} does not start with a //! header", f.display());
        let ignore = ["#[", "ignore]"].concat();
        assert!(!text.contains(&ignore), "{} has an ignored test", f.display());
    }
}

#[test]
fn ci_runs_the_readme_test_command() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let ci = std::fs::read_to_string(root().join(".ci/run")).unwrap();
    for cmd in ["cargo test --workspace", "cargo xtask gate"] {
        assert!(readme.contains(cmd), "README lacks `{cmd}`");
        assert!(ci.contains(cmd), ".ci/run lacks `{cmd}`");
    }
}
