//! A dump's two readers on arbitrary bytes, as an engine under test hands them over: the
//! manifest (JSON, its format and version checked) when the first byte is even, else a
//! safetensors tap file read whole. Written into one scratch directory per process.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;

fn scratch() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("touchstone-fuzz-dump-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("scratch directory");
        d
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else { return };
    let dir = scratch();
    if first % 2 == 0 {
        std::fs::write(dir.join("manifest.json"), rest).expect("write");
        let _ = oracle::dump::read_manifest(dir);
    } else {
        std::fs::write(dir.join("taps.safetensors"), rest).expect("write");
        let _ = oracle::dump::read_tensors(dir, "taps.safetensors");
    }
});
