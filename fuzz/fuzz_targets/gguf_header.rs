//! The GGUF reader and tensor decoders alone on arbitrary bytes: the fast target
//! (`fuzz_bodies::gguf_header`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_bodies::gguf_header(data));
