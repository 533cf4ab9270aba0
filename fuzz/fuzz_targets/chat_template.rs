//! A chat template and its messages from arbitrary bytes, rendered on a fuel budget
//! (`fuzz_bodies::chat_template`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_bodies::chat_template(data));
