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

/// CI runs the README's test command, and the test command runs the README's main job as
/// written (`cargo xtask gate`, no further arguments but where its reports go).
#[test]
fn ci_runs_the_readme_test_command_and_the_tests_run_the_main_job() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let ci = std::fs::read_to_string(root().join(".ci/run")).unwrap();
    assert!(readme.contains("cargo test --workspace") && ci.contains("\ncargo test --workspace\n"), "README and .ci/run must both hold `cargo test --workspace`");
    assert!(readme.contains("cargo xtask gate  "), "README lacks the main job `cargo xtask gate`");
    let cli = std::fs::read_to_string(root().join("xtask/tests/cli.rs")).unwrap();
    assert!(cli.contains("xtask(&[\"gate\", \"--report-dir\", dir.path().to_str().unwrap()], &[])"), "no test runs the main job as the README gives it");
}

/// A crate's non-test source files, with the top-level module each belongs to (`src/a.rs` and
/// `src/a/...` are module `a`; `lib.rs` and `main.rs` the crate root, left out).
fn modules_of(krate: &str) -> Vec<(String, PathBuf)> {
    let src = root().join(krate).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n != "tests.rs"))
        .filter_map(|p| {
            let first = p.strip_prefix(&src).ok()?.components().next()?.as_os_str().to_string_lossy().trim_end_matches(".rs").to_string();
            (first != "lib" && first != "main" && first != "bin").then_some((first, p))
        })
        .collect()
}

/// A file's text before its unit tests (`#[cfg(test)]` to the end, where they live inline).
fn non_test_text(p: &Path) -> String {
    let text = std::fs::read_to_string(p).unwrap();
    match text.find("\n#[cfg(test)]\nmod tests {") {
        Some(i) => text[..i].to_string(),
        None => text,
    }
}

/// No source file over 900 lines (unit tests live beside their module, in `tests.rs`).
#[test]
fn no_source_file_is_over_900_lines() {
    let mut long = Vec::new();
    for c in ["oracle", "devices", "suites", "reports", "fixtures", "xtask"] {
        for (_, p) in modules_of(c) {
            let n = non_test_text(&p).lines().count();
            if n > 900 {
                long.push(format!("{} ({n} lines)", p.strip_prefix(root()).unwrap().display()));
            }
        }
    }
    assert!(long.is_empty(), "split these by job: {long:?}");
}

/// The items the crate root re-exports (`pub use m::{A, B}`, `pub use m::*`), by the module
/// that defines them: `crate::A` in another module depends on `m` as `crate::m::A` would.
fn reexports(krate: &str, modules: &[(String, PathBuf)]) -> std::collections::BTreeMap<String, String> {
    let src = root().join(krate).join("src");
    let lib = ["lib.rs", "main.rs"].iter().map(|f| src.join(f)).find(|p| p.is_file());
    let text = lib.map(|p| non_test_text(&p)).unwrap_or_default();
    let mut out = std::collections::BTreeMap::new();
    for line in text.lines().map(str::trim).filter(|l| l.starts_with("pub use ")) {
        let Some((m, rest)) = line["pub use ".len()..].trim_end_matches(';').split_once("::") else { continue };
        if rest == "*" {
            // Every public item the module's own files define.
            for (_, p) in modules.iter().filter(|(name, _)| name == m) {
                for l in non_test_text(p).lines() {
                    let words: Vec<&str> = l.split(|ch: char| !(ch.is_alphanumeric() || ch == '_')).filter(|w| !w.is_empty()).collect();
                    if let [first, kind, name, ..] = words.as_slice() {
                        if *first == "pub" && ["struct", "enum", "fn", "trait", "const", "static", "type"].contains(kind) {
                            out.insert(name.to_string(), m.to_string());
                        }
                    }
                }
            }
        } else {
            for item in rest.trim_start_matches('{').trim_end_matches('}').split(',') {
                let name = item.split(" as ").last().unwrap_or(item).trim().rsplit("::").next().unwrap_or("").to_string();
                if !name.is_empty() {
                    out.insert(name, m.to_string());
                }
            }
        }
    }
    out
}

/// Within each crate, the top-level modules' `crate::` references form no cycle: each module can
/// be understood (and changed) from those below it. An item the crate root re-exports counts as
/// a reference to the module that defines it.
#[test]
fn no_module_import_cycle() {
    for c in ["oracle", "devices", "suites", "reports", "fixtures", "xtask"] {
        let mut edges: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> = Default::default();
        let modules = modules_of(c);
        let names: std::collections::BTreeSet<String> = modules.iter().map(|(m, _)| m.clone()).collect();
        let reexported = reexports(c, &modules);
        for (m, p) in &modules {
            let text = non_test_text(p);
            // Doc comments name other modules for the reader; only code depends on them.
            let code: String = text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
            let mut deps = std::collections::BTreeSet::new();
            for (i, _) in code.match_indices("crate::") {
                let rest = &code[i + 7..];
                if let Some(group) = rest.strip_prefix('{') {
                    // `use crate::{a, b::c}`: each first segment.
                    let group = &group[..group.find('}').unwrap_or(group.len())];
                    deps.extend(group.split(',').map(|s| s.trim().split("::").next().unwrap_or("").to_string()));
                } else {
                    deps.insert(rest.split(|ch: char| !(ch.is_alphanumeric() || ch == '_')).next().unwrap_or("").to_string());
                }
            }
            let deps: std::collections::BTreeSet<String> = deps.into_iter().map(|d| reexported.get(&d).cloned().unwrap_or(d)).filter(|d| d != m && names.contains(d)).collect();
            edges.entry(m.clone()).or_default().extend(deps);
        }
        // Depth-first search for a back edge.
        fn visit(m: &str, edges: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>, path: &mut Vec<String>, done: &mut std::collections::BTreeSet<String>) -> Option<Vec<String>> {
            if let Some(i) = path.iter().position(|p| p == m) {
                let mut cycle = path[i..].to_vec();
                cycle.push(m.to_string());
                return Some(cycle);
            }
            if done.contains(m) {
                return None;
            }
            path.push(m.to_string());
            for d in edges.get(m).into_iter().flatten() {
                if let Some(c) = visit(d, edges, path, done) {
                    return Some(c);
                }
            }
            path.pop();
            done.insert(m.to_string());
            None
        }
        let mut done = Default::default();
        for m in edges.keys() {
            if let Some(cycle) = visit(m, &edges, &mut Vec::new(), &mut done) {
                panic!("crate {c}: module import cycle {}", cycle.join(" -> "));
            }
        }
        // At every depth: the modules of a directory that is a module (`xtask/src/cmd/` with its
        // `mod.rs`, `devices/src/shared/` beside `shared.rs`) and their references to each other,
        // as `super::sibling` or by the whole path (`crate::shared::sibling`).
        let mut dirs = Vec::new();
        let mut files = Vec::new();
        let src = root().join(c).join("src");
        rust_files(&src, &mut files);
        dirs.extend(files.iter().filter(|f| f.file_name().is_some_and(|n| n == "mod.rs")).filter_map(|f| f.parent().map(Path::to_path_buf)));
        dirs.extend(files.iter().filter(|f| f.file_name().is_some_and(|n| n != "mod.rs" && n != "lib.rs" && n != "main.rs")).map(|f| f.with_extension("")).filter(|d| d.is_dir()));
        dirs.sort();
        dirs.dedup();
        for dir in dirs {
            let siblings: Vec<(String, PathBuf)> = std::fs::read_dir(&dir)
                .unwrap()
                .filter_map(|e| {
                    let p = e.ok()?.path();
                    let name = p.file_name()?.to_string_lossy().into_owned();
                    match name.strip_suffix(".rs") {
                        Some(stem) if stem != "mod" && stem != "tests" => Some((stem.to_string(), p)),
                        None if p.join("mod.rs").is_file() => Some((name, p.join("mod.rs"))),
                        _ => None,
                    }
                })
                .collect();
            let names: std::collections::BTreeSet<String> = siblings.iter().map(|(m, _)| m.clone()).collect();
            let mut edges: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> = Default::default();
            let whole = format!("crate::{}::", dir.strip_prefix(&src).unwrap().to_string_lossy().replace('/', "::"));
            for (m, p) in &siblings {
                let code: String = non_test_text(p).lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
                let after = |prefix: &str| code.match_indices(prefix).map(|(i, _)| code[i + prefix.len()..].split(|ch: char| !(ch.is_alphanumeric() || ch == '_')).next().unwrap_or("").to_string()).collect::<Vec<_>>();
                let deps = after("super::").into_iter().chain(after(&whole)).filter(|d| d != m && names.contains(d));
                edges.entry(m.clone()).or_default().extend(deps);
            }
            let mut done = Default::default();
            for m in edges.keys() {
                if let Some(cycle) = visit(m, &edges, &mut Vec::new(), &mut done) {
                    panic!("{}: module import cycle {}", dir.strip_prefix(root()).unwrap().display(), cycle.join(" -> "));
                }
            }
        }
    }
}

/// The documents stay readable as reference: the README at most 250 lines, and no table cell in
/// the README, CONTRIBUTING.md or docs/ over 200 characters (details belong in prose or in
/// `--help`).
#[test]
fn documents_keep_short_readmes_and_table_cells() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    assert!(readme.lines().count() <= 250, "README.md has {} lines (at most 250)", readme.lines().count());
    let mut docs = vec![root().join("README.md"), root().join("CONTRIBUTING.md")];
    docs.extend(std::fs::read_dir(root().join("docs")).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "md")));
    let mut long = Vec::new();
    for doc in &docs {
        for (i, line) in std::fs::read_to_string(doc).unwrap().lines().enumerate() {
            if !line.starts_with('|') {
                continue;
            }
            for cell in line.trim().trim_matches('|').split('|') {
                let n = cell.trim().chars().count();
                if n > 200 {
                    long.push(format!("{}:{} ({n} characters)", doc.strip_prefix(root()).unwrap().display(), i + 1));
                }
            }
        }
    }
    assert!(long.is_empty(), "table cells over 200 characters: {long:?}");
}

/// Tap kinds are `oracle::taps::TapKind`, matched exhaustively: no code in the oracle's
/// interpreter, the suites or the commands compares or builds a tap-kind name as a string
/// (`"l_out"`), outside the parsing edge (`oracle/src/taps.rs`) and the two places GGUF matrix
/// names, some of which are spelt like taps (`attn_q`, `ffn_gate`), are read. Unit tests may
/// name taps as text.
#[test]
fn tap_kinds_are_matched_as_an_enum_not_as_strings() {
    // The kinds as text, from the one list.
    let taps = std::fs::read_to_string(root().join("oracle/src/taps.rs")).unwrap();
    let kinds: Vec<String> = taps.lines().filter_map(|l| l.trim().strip_prefix("TapKind::")?.split_once(" => \"")?.1.strip_suffix("\",").map(String::from)).collect();
    assert_eq!(kinds.len(), oracle::taps::TapKind::ALL.len(), "{kinds:?}");
    // Where GGUF matrix names (not taps) are read: `product_tap`'s weight names, the emulated
    // products' weight list.
    let matrix_names = ["suites/src/layerdiff/terms.rs", "suites/src/emulate.rs"];
    let mut files = Vec::new();
    rust_files(&root().join("suites/src"), &mut files);
    files.extend(["oracle/src/model.rs", "xtask/src/cmd/layerdiff.rs", "xtask/src/cmd/gate.rs", "xtask/src/cmd/fixedtoken.rs"].map(|f| root().join(f)));
    let mut found = Vec::new();
    for f in files.iter().filter(|f| f.file_name().is_some_and(|n| n != "tests.rs")) {
        let rel = f.strip_prefix(root()).unwrap().to_string_lossy().into_owned();
        if matrix_names.contains(&rel.as_str()) {
            continue;
        }
        for (i, line) in non_test_text(f).lines().enumerate() {
            for k in &kinds {
                if line.contains(&format!("\"{k}\"")) || line.contains(&format!(".{k}\"")) {
                    found.push(format!("{rel}:{}: {}", i + 1, line.trim()));
                }
            }
        }
    }
    assert!(found.is_empty(), "tap kinds written as strings (use oracle::taps::TapKind):\n{}", found.join("\n"));
}

/// Architectures are `oracle::spec::Arch`, one row each in `ARCHES`: no code compares an
/// architecture's name as a string (`arch == "gpt-oss"`, `match arch.as_str()`); its names are
/// parsed in oracle/src/spec/arch.rs alone.
#[test]
fn architectures_are_matched_as_an_enum_not_as_strings() {
    let mut files = Vec::new();
    for c in ["oracle", "devices", "suites", "xtask", "fixtures", "reports"] {
        rust_files(&root().join(c).join("src"), &mut files);
    }
    let compared = regex::Regex::new(r#"\barch(_name)?\s*[!=]=\s*""#).unwrap();
    let mut found = Vec::new();
    for f in files.iter().filter(|f| f.file_name().is_some_and(|n| n != "tests.rs")) {
        let rel = f.strip_prefix(root()).unwrap().to_string_lossy().into_owned();
        for (i, line) in non_test_text(f).lines().enumerate() {
            if compared.is_match(line) || line.contains("arch.as_str()") {
                found.push(format!("{rel}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "architecture names compared as strings (use oracle::spec::Arch and its row):\n{}", found.join("\n"));
}

/// Suites return typed results (`reports::findings`, `reports::Metrics`, their own outcome
/// types): no code in suites/src builds JSON (`serde_json`, `json!`) — only `reports` turns what
/// they found into report.json — and no command reads a suite's section back out of the JSON by
/// key: it reads the typed outcome (or, for a report from disk, `Report::section` as a type).
#[test]
fn suites_build_no_json_and_commands_read_their_findings_typed() {
    let mut files = Vec::new();
    rust_files(&root().join("suites/src"), &mut files);
    let mut found = Vec::new();
    for f in files.iter().filter(|f| f.file_name().is_some_and(|n| n != "tests.rs")) {
        let rel = f.strip_prefix(root()).unwrap().to_string_lossy().into_owned();
        for (i, line) in non_test_text(f).lines().enumerate() {
            if line.contains("serde_json") || line.contains("json!") {
                found.push(format!("{rel}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "JSON built in a suite (return a typed value; reports makes the JSON):\n{}", found.join("\n"));
    // The sections the suites fill, read back by key.
    let suite_sections = ["first_divergence", "emulated_arithmetic", "routing_split", "first_difference", "first_divergence_vs_oracle", "baseline_departure", "unjudged_taps", "unknown_tap_kinds", "routing_followed", "token_stats", "tap_coverage", "golden"];
    let mut files = Vec::new();
    rust_files(&root().join("xtask/src"), &mut files);
    for f in &files {
        let rel = f.strip_prefix(root()).unwrap().to_string_lossy().into_owned();
        for (i, line) in non_test_text(f).lines().enumerate() {
            for s in suite_sections {
                if [format!("sections.get(\"{s}\")"), format!("sections[\"{s}\"]"), format!("sections.remove(\"{s}\")")].iter().any(|p| line.contains(p.as_str())) {
                    found.push(format!("{rel}:{}: {}", i + 1, line.trim()));
                }
            }
        }
    }
    assert!(found.is_empty(), "a suite's section read back from the JSON by key (read the typed outcome):\n{}", found.join("\n"));
}
