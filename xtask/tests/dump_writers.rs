//! The dump writers an engine imports instead of writing the format by hand — Python
//! (`examples/external_engine/touchstone_dump.py`), C (`examples/flat_engine/touchstone_dump.h`)
//! and Rust (`oracle::dump::DumpWriter`) — each write what the reader reads: the `cpu` device's
//! dump of tiny-llama, rewritten through each writer by an `exec:` engine, passes layer-diff as
//! the original does; the Python one with nothing but the standard library.

mod common;

use common::*;
use std::path::Path;

/// The cpu device's dump of tiny-llama's ids `1,2,3,4,5` in `dir`.
fn cpu_dump(dir: &Path) {
    let o = xtask(&["dump", "--device", "cpu", "--model", "tiny-llama", "--prompt-ids", "1,2,3,4,5", "--out", dir.to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", text(&o));
}

/// layer-diff of an `exec:` engine on tiny-llama's ids `1,2,3,4,5`, its report in `report`.
fn judge(engine: &str, report: &Path) -> std::process::Output {
    xtask(&["layer-diff", "--device", engine, "--model", "tiny-llama", "--prompt-ids", "1,2,3,4,5", "--report-dir", report.to_str().unwrap()], &[])
}

/// Every tensor of the dump in `src` as (name, rows, cols, values), taps in manifest order, then
/// the logits.
fn tensors(src: &Path) -> Vec<(String, usize, usize, Vec<f32>)> {
    let m = oracle::dump::read_manifest(src).unwrap();
    let mut out = Vec::new();
    for t in m.taps.iter().chain(m.logits.as_ref()) {
        let (shape, values) = oracle::dump::read_tensor(src, &t.file, &t.name).unwrap();
        out.push((t.name.clone(), shape[0], shape[1], values));
    }
    out
}

#[test]
fn the_python_writer_needs_only_the_standard_library() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("cpu");
    cpu_dump(&src);
    let writer_dir = workspace().join("examples/external_engine");
    // An engine that reads the cpu dump with the standard library and writes it again.
    let script = tmp.path().join("rewrite.py");
    std::fs::write(
        &script,
        format!(
            r#"import json, os, struct, sys
from array import array
sys.path.insert(0, {writer:?})
import touchstone_dump

src = {src:?}
m = json.load(open(os.path.join(src, "manifest.json")))

def read(file):
    b = open(os.path.join(src, file), "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    out = {{}}
    for name, t in json.loads(b[8:8 + n]).items():
        if name == "__metadata__":
            continue
        s, e = t["data_offsets"]
        a = array("f")
        a.frombytes(b[8 + n + s:8 + n + e])
        rows, cols = t["shape"]
        out[name] = [list(a[i * cols:(i + 1) * cols]) for i in range(rows)]
    return out

assert "numpy" not in sys.modules
taps = read("taps.safetensors")
dump = touchstone_dump.Dump(device="python-writer", arithmetic=m.get("arithmetic"))
for t in m["taps"]:
    dump.tap(t["name"], taps[t["name"]])
dump.logits(read("logits.safetensors")["logits"])
dump.write()
"#,
            writer = writer_dir.to_str().unwrap(),
            src = src.to_str().unwrap()
        ),
    )
    .unwrap();
    // -I -S: no site-packages (no numpy), no user paths.
    let o = judge(&format!("exec:python3 -I -S {}", script.display()), &tmp.path().join("r"));
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report(&tmp.path().join("r"));
    assert!(r["summary"]["passed"].as_u64().unwrap() > 30, "{}", r["summary"]);
    assert_eq!(r["cases"][0]["device"], "python-writer", "the manifest's device name reads back");
}

#[test]
fn the_c_writer_writes_a_dump_the_reader_takes() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("cpu");
    cpu_dump(&src);
    // The tensors as raw little-endian f32 files and a list: name rows cols file.
    let mut list = String::new();
    for (i, (name, rows, cols, values)) in tensors(&src).into_iter().enumerate() {
        let file = tmp.path().join(format!("t{i}.f32"));
        std::fs::write(&file, values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        list += &format!("{name} {rows} {cols} {}\n", file.display());
    }
    std::fs::write(tmp.path().join("list.txt"), list).unwrap();
    let c = tmp.path().join("rewrite.c");
    std::fs::write(
        &c,
        r#"#include "touchstone_dump.h"
int main(int argc, char **argv) {
    if (argc != 3) return 4;
    int ids[64], n = 0;
    for (const char *p = getenv("TOUCHSTONE_PROMPT_IDS"); p && *p; p++) {
        ids[n++] = atoi(p);
        while (*p && *p != ',') p++;
        if (!*p) break;
    }
    ts_dump d;
    /* A device name that needs escaping in JSON. */
    ts_dump_begin(&d, getenv("TOUCHSTONE_OUT"), "c \"writer\" \\ test", "tiny", getenv("TOUCHSTONE_MODEL_SHA256"), "llama", ids, n, argv[2]);
    FILE *list = fopen(argv[1], "r");
    char name[256], path[4096];
    int rows, cols;
    while (list && fscanf(list, "%255s %d %d %4095s", name, &rows, &cols, path) == 4) {
        float *v = malloc((size_t)rows * cols * 4);
        FILE *f = fopen(path, "rb");
        if (!v || !f || fread(v, 4, (size_t)rows * cols, f) != (size_t)rows * cols) return 3;
        fclose(f);
        if (strcmp(name, "logits") == 0) ts_dump_logits(&d, v, rows, cols);
        else ts_dump_tap(&d, name, v, rows, cols);
        free(v);
    }
    if (ts_dump_finish(&d)) { fprintf(stderr, "%s\n", d.error); return 2; }
    return 0;
}
"#,
    )
    .unwrap();
    let bin = tmp.path().join("rewrite");
    let include = format!("-I{}", workspace().join("examples/flat_engine").display());
    let o = std::process::Command::new("cc").args(["-std=c99", "-Wall", "-Wextra", "-Werror", &include, "-o", bin.to_str().unwrap(), c.to_str().unwrap()]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    // The cpu device's declaration, passed on as the engine's own.
    let arithmetic = oracle::dump::read_manifest(&src).unwrap().arithmetic.unwrap().to_string();
    std::fs::write(tmp.path().join("arith.json"), &arithmetic).unwrap();
    let o = judge(&format!("exec:{} {} \"$(cat {})\"", bin.display(), tmp.path().join("list.txt").display(), tmp.path().join("arith.json").display()), &tmp.path().join("r"));
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report(&tmp.path().join("r"));
    assert!(r["summary"]["passed"].as_u64().unwrap() > 30, "{}", r["summary"]);
    assert_eq!(r["cases"][0]["device"], "c \"writer\" \\ test", "the escaped device name reads back");
}

#[test]
fn the_rust_writer_writes_a_dump_the_reader_takes() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("cpu");
    cpu_dump(&src);
    let m = oracle::dump::read_manifest(&src).unwrap();
    let out = tmp.path().join("rust");
    let mut w = oracle::dump::DumpWriter::new(&out, m.model.clone(), "rust-writer", &m.token_ids);
    w.arithmetic(m.arithmetic.clone().unwrap(), "f32");
    for (name, rows, cols, values) in tensors(&src) {
        assert_eq!(rows, 5);
        if name == "logits" {
            w.logits(cols, &values).unwrap();
        } else {
            w.tap(&name, cols, &values).unwrap();
        }
    }
    // Rows that do not match the request are refused, naming the tap.
    let e = w.tap("blk.9.l_out", 7, &[0.0; 6]).unwrap_err().to_string();
    assert!(e.contains("blk.9.l_out: 6 values for 5 positions of width 7"), "{e}");
    w.finish().unwrap();
    let o = judge(&format!("external:{}", out.display()), &tmp.path().join("r"));
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(report(&tmp.path().join("r"))["cases"][0]["device"], "rust-writer");
}
