//! A dump's manifest or tap file on arbitrary bytes (`fuzz_bodies::dump`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_bodies::dump(data));
