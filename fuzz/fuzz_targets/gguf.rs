//! The GGUF reader on arbitrary bytes: the header, metadata and tensor table, then every
//! accepted tensor decoded, the model spec and the tokenizer built from the metadata, and a
//! text tokenized. A panic, an abort, an out-of-bounds read or a huge allocation is a bug;
//! an error is the expected answer to a bad file.
#![no_main]

use libfuzzer_sys::fuzz_target;
use oracle::gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else { return };
    for t in &g.tensors {
        let _ = g.tensor_f32(t);
    }
    let _ = oracle::spec::ModelSpec::from_gguf(&g);
    if let Ok(tok) = oracle::tokenizer::Tokenizer::from_gguf(&g) {
        let _ = tok.encode("The capital of France is Paris. <|im_start|> 1234 ünïcödé");
    }
});
