//! The GGUF reader alone on arbitrary bytes (header, metadata, tensor table, every accepted
//! tensor decoded): the fast target, many times the `gguf` target's executions per second, for
//! long campaigns on the parsing code itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use oracle::gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else { return };
    for t in &g.tensors {
        let _ = g.tensor_f32(t);
    }
});
