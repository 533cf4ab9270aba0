//! The kept fuzz inputs, replayed on stable in `cargo test`: every file under
//! `fuzz/regressions/TARGET/` (the minimized corpus of each campaign, and every input that once
//! crashed, hung or over-allocated) goes through its target's body. A panic fails the test; so
//! does a target with no inputs kept (a replay that ran nothing guards nothing).

use std::path::Path;

#[test]
fn every_kept_fuzz_input_is_answered_without_a_panic() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/regressions");
    let t0 = std::time::Instant::now();
    let mut summary = Vec::new();
    for (target, body) in fuzz_bodies::TARGETS {
        let dir = root.join(target);
        let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())).map(|e| e.unwrap().path()).collect();
        files.sort();
        assert!(!files.is_empty(), "{}: no inputs kept for target `{target}`", dir.display());
        for f in &files {
            let data = std::fs::read(f).unwrap();
            // A panic is caught to name the input that caused it.
            let r = std::panic::catch_unwind(|| body(&data));
            assert!(r.is_ok(), "target `{target}` panicked on {}", f.display());
        }
        summary.push(format!("{target} {}", files.len()));
    }
    eprintln!("replayed {} in {:.1} s", summary.join(", "), t0.elapsed().as_secs_f64());
}
