//! The op protocol's answer files on arbitrary bytes (`fuzz_bodies::ops`). With
//! TOUCHSTONE_FUZZ_OPS_SEEDS=DIR it first writes its valid answers there as seeds
//! (fuzz/seeds/make_ops_seeds.sh).
#![no_main]

libfuzzer_sys::fuzz_target!(
    init: {
        if let Some(dir) = std::env::var_os("TOUCHSTONE_FUZZ_OPS_SEEDS") {
            let dir = std::path::PathBuf::from(dir);
            std::fs::create_dir_all(&dir).expect("seed directory");
            for (name, bytes) in fuzz_bodies::ops_seeds() {
                std::fs::write(dir.join(name), bytes).expect("seed");
            }
        }
    },
    |data: &[u8]| fuzz_bodies::ops(data)
);
