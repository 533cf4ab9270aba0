//! The flat model file reader on arbitrary bytes, every tensor read (`fuzz_bodies::flat`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_bodies::flat(data));
