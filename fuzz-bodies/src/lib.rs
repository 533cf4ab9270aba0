//! What each fuzz target does with its input: one function per target, taking the bytes a hostile
//! file or engine would hand over. The cargo-fuzz targets in `fuzz/fuzz_targets/` (libFuzzer,
//! nightly) call these, and so does the replay test (`tests/replay.rs`, stable, in `cargo test`),
//! which runs every input kept in `fuzz/regressions/`. An error is the expected answer to a bad
//! input; a panic, an abort, an out-of-bounds read, a hang or a huge allocation is a bug.

use devices::ops_protocol::{read_capabilities, read_outcomes, OutputSpec};
use oracle::registry::{registry, Op, OpCase};
use std::path::PathBuf;
use std::sync::OnceLock;

/// The targets, by name (the directory names under `fuzz/regressions/` and the fuzz binaries).
pub const TARGETS: [(&str, fn(&[u8])); 8] = [
    ("gguf", gguf),
    ("gguf_header", gguf_header),
    ("flat", flat),
    ("dump", dump),
    ("checkpoint", checkpoint),
    ("ops", ops),
    ("chat_template", chat_template),
    ("ab_line", ab_line),
];

/// A text with ASCII, multi-byte characters, digits and a special-token look-alike.
const TEXT: &str = "The capital of France is Paris. <|im_start|> 1234 ünïcödé";

/// One scratch directory per process and target (the targets write the files they read).
fn scratch(target: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("touchstone-fuzz-{target}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("scratch directory");
    d
}

/// The GGUF reader: header, metadata and tensor table, every accepted tensor decoded, the model
/// spec and the tokenizer built from the metadata, a text tokenized.
pub fn gguf(data: &[u8]) {
    let Ok(g) = oracle::gguf::GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else { return };
    for t in &g.tensors {
        let _ = g.tensor_f32(t);
    }
    let _ = oracle::spec::ModelSpec::from_gguf(&g);
    if let Ok(tok) = oracle::tokenizer::Tokenizer::from_gguf(&g) {
        let _ = tok.encode(TEXT);
    }
}

/// The GGUF reader and the tensor decoders alone: the fast target, for long campaigns on the
/// parsing code itself.
pub fn gguf_header(data: &[u8]) {
    let Ok(g) = oracle::gguf::GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else { return };
    for t in &g.tensors {
        let _ = g.tensor_f32(t);
    }
}

/// The flat model file (`export`'s format): header, table, checksums, every tensor read.
pub fn flat(data: &[u8]) {
    use oracle::loader::TensorSource;
    let Ok((f, _spec)) = oracle::flat::FlatFile::from_bytes("fuzz.flat", data.to_vec()) else { return };
    let names: Vec<String> = f.tensors.iter().map(|t| t.name.clone()).collect();
    for name in names {
        let _ = f.load(&name);
    }
}

/// A dump's readers, as an engine under test hands them over: the manifest (JSON, format and
/// version checked) when the first byte is even, else a safetensors tap file read whole.
pub fn dump(data: &[u8]) {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let Some((&first, rest)) = data.split_first() else { return };
    let dir = DIR.get_or_init(|| scratch("dump"));
    if first % 2 == 0 {
        std::fs::write(dir.join("manifest.json"), rest).expect("write");
        let _ = oracle::dump::read_manifest(dir);
    } else {
        std::fs::write(dir.join("taps.safetensors"), rest).expect("write");
        let _ = oracle::dump::read_tensors(dir, "taps.safetensors");
    }
}

/// A safetensors checkpoint directory: `config.json`, `tokenizer.json` and
/// `tokenizer_config.json` split from the input by its first three 16-bit lengths, the rest
/// `model.safetensors`. Opened (spec, tensor names, tokenizer), every tensor read as stored and
/// decoded when small, a text tokenized and decoded, the chat template read.
pub fn checkpoint(data: &[u8]) {
    let Some((lens, mut rest)) = data.split_first_chunk::<6>() else { return };
    let mut parts = Vec::new();
    for i in 0..3 {
        let n = (u16::from_le_bytes([lens[2 * i], lens[2 * i + 1]]) as usize).min(rest.len());
        let (part, tail) = rest.split_at(n);
        parts.push(part);
        rest = tail;
    }
    let Ok(dir) = tempfile::tempdir() else { return };
    for (name, bytes) in ["config.json", "tokenizer.json", "tokenizer_config.json"].iter().zip(&parts) {
        if !bytes.is_empty() && std::fs::write(dir.path().join(name), bytes).is_err() {
            return;
        }
    }
    if std::fs::write(dir.path().join("model.safetensors"), rest).is_err() {
        return;
    }
    let _ = oracle::loader::chat_template(dir.path());
    if let Ok(Some(tok)) = oracle::loader::open_tokenizer(dir.path()) {
        if let Ok(ids) = tok.encode(TEXT) {
            let _ = tok.decode(&ids);
        }
    }
    let Ok((src, spec, _)) = oracle::loader::open_model(dir.path()) else { return };
    for name in spec.tensor_names() {
        let _ = src.raw(&name);
        if src.n_elements().is_ok_and(|n| n <= 1 << 16) {
            let _ = src.load(&name);
        }
    }
}

struct OpsSetup {
    dir: PathBuf,
    cases: Vec<(OpCase, Vec<OutputSpec>)>,
    results: Vec<u8>,
    outputs: Vec<u8>,
}

/// A batch of three registry cases (an f32 op, a matmul, an op with ids) and a valid answer to
/// it: every case done, its outputs zeros of the right shapes.
fn ops_setup() -> &'static OpsSetup {
    static S: OnceLock<OpsSetup> = OnceLock::new();
    S.get_or_init(|| {
        let mut cases = Vec::new();
        for op in [Op::RmsNorm, Op::Matmul, Op::TopK] {
            let entry = registry().into_iter().find(|e| e.op == op).expect("registry op");
            let case = entry.cases_where(0, &|_: &str| true).into_iter().next().expect("a case");
            let specs: Vec<OutputSpec> = (entry.reference)(&case).expect("reference").iter().map(OutputSpec::of).collect();
            cases.push((case, specs));
        }
        let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        let mut entries = Vec::new();
        for (i, (case, specs)) in cases.iter().enumerate() {
            entries.push(format!("\"{}\": {{\"status\": \"done\"}}", case.id.replace('"', "\\\"")));
            for (j, s) in specs.iter().enumerate() {
                let dtype = if s.ids { safetensors::Dtype::U32 } else { safetensors::Dtype::F32 };
                tensors.push((format!("{i}.out{j}"), dtype, s.shape.clone(), vec![0u8; 4 * s.shape.iter().product::<usize>()]));
            }
        }
        let views: Vec<(String, safetensors::tensor::TensorView)> = tensors.iter().map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view"))).collect();
        let outputs = safetensors::serialize(views, None).expect("serialize");
        let results = format!("{{\"results\": {{{}}}}}", entries.join(", ")).into_bytes();
        OpsSetup { dir: scratch("ops"), cases, results, outputs }
    })
}

/// The op protocol's answer files, as an untrusted engine hands them over: by the first byte,
/// `capabilities.json` (parsed, its declaration checked), `results.json` beside a valid
/// `outputs.safetensors`, or `outputs.safetensors` beside a `results.json` that says every case
/// is done.
pub fn ops(data: &[u8]) {
    let s = ops_setup();
    let Some((&first, rest)) = data.split_first() else { return };
    let batch: Vec<(&OpCase, Vec<OutputSpec>)> = s.cases.iter().map(|(c, o)| (c, o.clone())).collect();
    let write = |name: &str, bytes: &[u8]| std::fs::write(s.dir.join(name), bytes).expect("write");
    match first % 3 {
        0 => {
            write("capabilities.json", rest);
            let _ = read_capabilities(&s.dir.join("capabilities.json"));
        }
        1 => {
            write("results.json", rest);
            write("outputs.safetensors", &s.outputs);
            let _ = read_outcomes(&s.dir, &batch, 1 << 24);
        }
        _ => {
            write("results.json", &s.results);
            write("outputs.safetensors", rest);
            let _ = read_outcomes(&s.dir, &batch, 1 << 24);
        }
    }
}

/// The valid answers `ops` starts from (the seeds of its campaign): each file behind the byte
/// that selects it.
pub fn ops_seeds() -> [(&'static str, Vec<u8>); 2] {
    let s = ops_setup();
    [("results", [&[1u8][..], &s.results].concat()), ("outputs", [&[2u8][..], &s.outputs].concat())]
}

/// A chat template from a model file, rendered as `run --chat` renders it: the input up to its
/// first NUL byte is the template, what follows the messages' contents (split at NUL bytes,
/// alternating user and assistant). Its loops and strings run on a fuel budget, so every
/// template ends, with text or an error, in bounded time and memory.
pub fn chat_template(data: &[u8]) {
    static TOK: OnceLock<oracle::tokenizer::Tokenizer> = OnceLock::new();
    let tok = TOK.get_or_init(|| {
        let bytes = fixtures::synthetic::build("tiny-llama").expect("tiny-llama");
        let g = oracle::gguf::GgufFile::from_bytes("tiny-llama.gguf", bytes).expect("tiny-llama GGUF");
        oracle::tokenizer::Tokenizer::from_gguf(&g).expect("tiny-llama tokenizer")
    });
    let text = String::from_utf8_lossy(data);
    let mut parts = text.split('\0');
    let template = parts.next().unwrap_or_default();
    let contents: Vec<&str> = parts.take(16).collect();
    let messages: Vec<(&str, &str)> = contents.iter().enumerate().map(|(i, c)| (if i % 2 == 0 { "user" } else { "assistant" }, *c)).collect();
    let messages = if messages.is_empty() { vec![("user", TEXT)] } else { messages };
    if let Ok(rendered) = xtask::fuzzing::render_chat(template, &messages, tok) {
        let _ = tok.encode(&rendered);
    }
}

/// The JSON line an `ab` arm prints for one run (the arm protocol), checked as `ab` checks it,
/// for a request of 32 tokens.
pub fn ab_line(data: &[u8]) {
    let _ = xtask::fuzzing::parse_ab_line(&String::from_utf8_lossy(data), 32);
}
