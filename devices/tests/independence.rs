//! The judge stays independent of the judged: outside their tests, devices take from the oracle
//! only what describes a case or a model and what reads files, never its arithmetic or its
//! unpacking of weight blocks. A bug in a decoder shared by the oracle and a device is wrong in
//! both alike and invisible to every gate, so a device reaching for one is a failure here.
//! docs/ARCHITECTURE.md ("Independence") lists what is allowed and why.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// What a device may name in each oracle module (`*`: the whole module).
const ALLOWED: &[(&str, &[&str])] = &[
    // Case definitions: op, dtypes, shapes, parameters, expected output kinds.
    ("registry", &["*"]),
    // Model descriptions (hyperparameters, RoPE and activation kinds).
    ("spec", &["*"]),
    // Serving schedules: what a serving case asks of an engine, and the shape of its answer.
    ("schedule", &["*"]),
    // File readers (GGUF, safetensors, dumps, an engine's output read without following links)
    // and the memory check before a load.
    ("loader", &["*"]),
    ("dump", &["*"]),
    ("files", &["open_written"]),
    // Tap names and kinds (what a dump's tap is, parsed where the dump is read).
    ("taps", &["*"]),
    ("memory", &["check_fits"]),
    // Type identities and sizes, never their decoding.
    ("quant", &["GgmlType", "QK_K"]),
    // The sampling op's specified random stream (the op protocol fixes it; not arithmetic).
    ("ops", &["SplitMix64"]),
];

/// Uses outside the rule, each with the reason it stands; the list only ever shrinks.
const EXCEPTIONS: &[(&str, &str, &str)] = &[
    // KvFormat::round_rows: the judge's emulation of a quantized cache (suites::emulate), kept
    // beside the format it emulates; no device calls it.
    ("kv.rs", "quant", "encode"),
    ("kv.rs", "quant", "decode_into"),
    // The bandwidth probe builds its weight rows (inputs, not the device's arithmetic).
    ("probe.rs", "quant", "encode"),
    // Test-only fault injection (feature `faults`) finds a block's scale bytes.
    ("faulty.rs", "quant", "scale_fields"),
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") && p.file_name().is_some_and(|n| n != "tests.rs") {
            // A module's unit tests in their own file (`#[cfg(test)] mod tests;`) may judge with
            // the oracle, as an inline test module may.
            out.push(p);
        }
    }
}

/// The source before its test module (`#[cfg(test)]` at the start of a line, then `mod`): tests
/// may judge with the oracle; test-only items elsewhere in a file are checked like the rest.
fn non_test(text: &str) -> &str {
    text.find("\n#[cfg(test)]\nmod ").map_or(text, |at| &text[..at])
}

/// Every (module, item) a source names under `oracle::`: paths `oracle::m::item` and the items
/// of `use oracle::m::{a, b}`; a glob or a bare module import is `(m, "*")`.
fn oracle_uses(src: &str) -> BTreeSet<(String, String)> {
    let mut found = BTreeSet::new();
    let mut rest = src;
    while let Some(at) = rest.find("oracle::") {
        rest = &rest[at + "oracle::".len()..];
        let module: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let after = &rest[module.len()..];
        if module.is_empty() || module.starts_with(char::is_uppercase) {
            continue; // a crate-root type (oracle::Tap, oracle::ModelSpec)
        }
        if let Some(tail) = after.strip_prefix("::") {
            if let Some(list) = tail.strip_prefix('{') {
                let end = list.find('}').unwrap_or(list.len());
                for item in list[..end].split(',').map(|s| s.trim()).filter(|s| !s.is_empty()) {
                    let name = item.split_whitespace().next().unwrap_or(item).split("::").next().unwrap_or(item);
                    found.insert((module.clone(), if name == "self" { "*".into() } else { name.to_string() }));
                }
            } else {
                let item: String = tail.chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '*').collect();
                found.insert((module.clone(), if item.is_empty() { "*".into() } else { item }));
            }
        } else {
            // `use oracle::quant;` or `oracle::quant as q`: the whole module is reachable.
            found.insert((module, "*".into()));
        }
    }
    found
}

fn allowed(file: &str, module: &str, item: &str) -> bool {
    ALLOWED.iter().any(|(m, items)| *m == module && (items.contains(&"*") || items.contains(&item))) || EXCEPTIONS.iter().any(|(f, m, i)| *f == file && *m == module && *i == item)
}

fn violations(root: &Path) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(root, &mut files);
    let mut bad = Vec::new();
    for f in files {
        let rel = f.strip_prefix(root).unwrap().to_string_lossy().replace('\\', "/");
        let text = std::fs::read_to_string(&f).unwrap();
        for (m, item) in oracle_uses(non_test(&text)) {
            if !allowed(&rel, &m, &item) {
                bad.push(format!("devices/src/{rel}: oracle::{m}::{item}"));
            }
        }
    }
    bad
}

#[test]
fn devices_do_their_own_unpacking() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let bad = violations(&root);
    assert!(bad.is_empty(), "devices reach into the oracle's arithmetic or unpacking (write the device's own; see docs/ARCHITECTURE.md, Independence):\n{}", bad.join("\n"));
    // Every exception still names a use that exists (a removed one leaves the list).
    for (file, m, item) in EXCEPTIONS {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        assert!(oracle_uses(non_test(&text)).contains(&(m.to_string(), item.to_string())), "stale exception {file}: oracle::{m}::{item}");
    }
}

/// The check sees each form a device could use to reach a decoder: a path, a braced import, a
/// module import; and lets through what a device may name.
#[test]
fn the_check_sees_every_way_to_reach_a_decoder() {
    let seeded = [
        "let q = oracle::quant::q2_q3_k_quants(ty, blk);",
        "use oracle::quant::{GgmlType, iq4_levels};",
        "use oracle::quant;",
        "use oracle::quant::*;",
        "let y = oracle::ops::rms_norm(&x, eps);",
        "use oracle::quant::{self, GgmlType};",
    ];
    for src in seeded {
        let uses = oracle_uses(src);
        assert!(uses.iter().any(|(m, i)| !allowed("shared/qdot.rs", m, i)), "not caught: {src} ({uses:?})");
    }
    let fine = "use oracle::quant::{GgmlType, QK_K};\nuse oracle::registry::{Input, OpCase};\nfn f(t: &mut dyn oracle::Tap, s: &oracle::ModelSpec) { let r = oracle::ops::SplitMix64(1); }\n\n#[cfg(test)]\nmod tests { fn g() { oracle::quant::decode(x); } }";
    let uses = oracle_uses(non_test(fine));
    assert!(uses.iter().all(|(m, i)| allowed("shared/qdot.rs", m, i)), "{uses:?}");
}
