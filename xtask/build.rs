//! Records which revision of Touchstone the binary was built from (`touchstone --version`, and
//! `touchstone_revision` in every report's provenance): an installed binary runs in another
//! repository, whose own revision says nothing about the judge. Without git (a source archive)
//! the revision is "unknown".

use std::path::Path;
use std::process::Command;

fn main() {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    let root = Path::new(&manifest).parent().unwrap_or(Path::new(".")).to_path_buf();
    let git = |args: &[&str]| Command::new("git").args(args).current_dir(&root).output().ok().filter(|o| o.status.success()).map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let revision = match git(&["rev-parse", "HEAD"]) {
        // Uncommitted changes in the sources the binary is built from (documents aside).
        Some(rev) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no", "--", "Cargo.toml", "Cargo.lock", "oracle", "devices", "suites", "reports", "fixtures", "xtask"]).is_some_and(|s| !s.is_empty());
            format!("{}{}", &rev[..rev.len().min(12)], if dirty { "-dirty" } else { "" })
        }
        None => "unknown".to_string(),
    };
    println!("cargo:rustc-env=TOUCHSTONE_REVISION={revision}");
    // Again when the checked-out commit moves or any source the binary is built from changes.
    if let Some(git_dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        for p in ["HEAD", "refs", "packed-refs"] {
            println!("cargo:rerun-if-changed={git_dir}/{p}");
        }
    }
    for p in ["Cargo.toml", "Cargo.lock", "oracle", "devices", "suites", "reports", "fixtures", "xtask/src"] {
        println!("cargo:rerun-if-changed={}", root.join(p).display());
    }
}
