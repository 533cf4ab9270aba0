//! The GGUF reader on arbitrary bytes, then the model spec and tokenizer built from the
//! metadata and a text tokenized (`fuzz_bodies::gguf`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_bodies::gguf(data));
