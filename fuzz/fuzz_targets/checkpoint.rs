//! A safetensors checkpoint directory from arbitrary bytes: `config.json`, `tokenizer.json`,
//! `tokenizer_config.json` and `model.safetensors`, split from the input by its first three
//! 16-bit lengths. The model is opened (spec, tensor names, tokenizer), every tensor read as
//! stored and decoded when the file is small, a text tokenized and its ids decoded, and the chat
//! template read. A panic, an abort, an out-of-bounds read or a huge allocation is a bug; an
//! error is the expected answer to a bad checkpoint.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
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
        if let Ok(ids) = tok.encode("The capital of France is Paris. <|im_start|> 1234 ünïcödé") {
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
});
