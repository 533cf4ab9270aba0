//! The flat model file reader (`export`'s format, the one bare-metal and C engines load) on
//! arbitrary bytes: header, table, checksums, then every tensor the table names read. An error
//! is the expected answer to a bad file; a panic, an abort or a huge allocation is a bug.
#![no_main]

use libfuzzer_sys::fuzz_target;
use oracle::flat::FlatFile;
use oracle::loader::TensorSource;

fuzz_target!(|data: &[u8]| {
    let Ok((f, _spec)) = FlatFile::from_bytes("fuzz.flat", data.to_vec()) else { return };
    let names: Vec<String> = f.tensors.iter().map(|t| t.name.clone()).collect();
    for name in names {
        let _ = f.load(&name);
    }
});
