//! The oracle's tokenizers against llama.cpp's own tokenizer test vectors: for each vocabulary
//! (a vocabulary-only GGUF from llama.cpp's tree), the texts llama.cpp's test feeds it and the
//! ids llama.cpp gives. `tools/reference/llama_vocab.py` fetches them (from the PyPI sdist of
//! llama-cpp-python); without them this test says SKIPPED, unless
//! TOUCHSTONE_REQUIRE_LLAMA_VOCAB=1 (as CI sets), when their absence fails it.

use oracle::gguf::GgufFile;
use oracle::tokenizer::Tokenizer;
use std::path::PathBuf;

/// Gemma 4's BPE (`gemma4`), SentencePiece (`llama`: Llama 2, Phi-3) and byte-level BPE (`gpt2` with the gpt-2, llama-bpe,
/// qwen2, qwen35, deepseek-llm, deepseek-coder, falcon, mpt, starcoder, refact and command-r
/// pre-tokenizers).
const VOCABS: [&str; 14] = [
    "gemma-4", "llama-spm", "phi-3", "gpt-2", "llama-bpe", "qwen2", "deepseek-llm", "deepseek-coder", "qwen35", "falcon", "mpt", "starcoder", "refact", "command-r",
];

fn vocab_dir() -> PathBuf {
    match std::env::var_os("TOUCHSTONE_CACHE") {
        Some(c) => PathBuf::from(c),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join(".cache").join("touchstone"),
    }
    .join("llama-vocab")
}

/// The cases of one vocabulary: (text, llama.cpp's ids without BOS).
fn cases(gguf: &std::path::Path) -> Vec<(String, Vec<u32>)> {
    let read = |ext: &str| std::fs::read_to_string(gguf.with_extension(format!("gguf.{ext}"))).unwrap();
    let inp = read("inp");
    // Texts separated by `__ggml_vocab_test__` lines; most files end with one (Gemma 4's does not).
    let mut texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    if texts.last() == Some(&"") {
        texts.pop();
    }
    let out = read("out");
    let ids: Vec<Vec<u32>> = out.lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect();
    assert_eq!(texts.len(), ids.len(), "{}: as many outputs as inputs", gguf.display());
    texts.into_iter().map(String::from).zip(ids).collect()
}

#[test]
fn tokenizers_give_llama_cpps_ids_on_its_test_vectors() {
    let dir = vocab_dir();
    let present: Vec<_> = VOCABS.iter().map(|v| dir.join(format!("ggml-vocab-{v}.gguf"))).filter(|p| p.exists()).collect();
    if present.is_empty() {
        let why = format!("no llama.cpp vocabularies in {} (python3 tools/reference/llama_vocab.py fetches them)", dir.display());
        assert!(std::env::var("TOUCHSTONE_REQUIRE_LLAMA_VOCAB").as_deref() != Ok("1"), "{why}");
        eprintln!("SKIPPED: {why}");
        return;
    }
    assert_eq!(present.len(), VOCABS.len(), "some vocabularies of {VOCABS:?} missing in {}", dir.display());
    let mut failures = Vec::new();
    for path in &present {
        let g = GgufFile::open(path).unwrap();
        let tok = Tokenizer::from_gguf(&g).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let cases = cases(path);
        let mut passed = 0;
        for (text, want) in &cases {
            let mut got = tok.encode(text).unwrap();
            if tok.add_bos && !got.is_empty() && Some(got[0]) == tok.bos {
                got.remove(0);
            }
            if &got == want {
                passed += 1;
                // Decoding llama.cpp's ids gives the text back (as llama.cpp's test checks).
                let back = tok.decode(want).unwrap();
                if &back != text {
                    failures.push(format!("{}: decode({want:?}) = {back:?}, not {text:?}", path.display()));
                }
            } else {
                failures.push(format!("{}: {text:?}: llama.cpp {want:?}, oracle {got:?}", path.display()));
            }
        }
        eprintln!("{}: {passed}/{} texts tokenized as llama.cpp does", path.file_name().unwrap().to_string_lossy(), cases.len());
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}
