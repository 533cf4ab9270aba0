//! An `ab` arm's JSON line from arbitrary bytes (`fuzz_bodies::ab_line`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_bodies::ab_line(data));
