//! A safetensors checkpoint directory split from arbitrary bytes (`fuzz_bodies::checkpoint`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_bodies::checkpoint(data));
