//! The op protocol's readers on arbitrary bytes, as an untrusted engine hands them over: by the
//! first byte, `capabilities.json` (parsed and its declaration checked), `results.json` beside a
//! valid `outputs.safetensors`, or `outputs.safetensors` beside a `results.json` that says every
//! case is done — for a batch of three registry cases (an f32 op, a matmul, an op with ids).
//! With TOUCHSTONE_FUZZ_OPS_SEEDS=DIR it writes its valid answer there as seeds
//! (fuzz/seeds/make_ops_seeds.sh).
#![no_main]

use devices::ops_protocol::{read_capabilities, read_outcomes, OutputSpec};
use libfuzzer_sys::fuzz_target;
use oracle::registry::{registry, OpCase};
use std::path::PathBuf;
use std::sync::OnceLock;

struct Setup {
    dir: PathBuf,
    cases: Vec<(OpCase, Vec<OutputSpec>)>,
    results: Vec<u8>,
    outputs: Vec<u8>,
}

fn setup() -> &'static Setup {
    static S: OnceLock<Setup> = OnceLock::new();
    S.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("touchstone-fuzz-ops-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        let mut cases = Vec::new();
        for op in ["rms_norm", "matmul", "top_k"] {
            let entry = registry().into_iter().find(|e| e.name == op).expect("registry op");
            let case = entry.cases_where(0, &|_: &str| true).into_iter().next().expect("a case");
            let specs: Vec<OutputSpec> = (entry.reference)(&case).expect("reference").iter().map(OutputSpec::of).collect();
            cases.push((case, specs));
        }
        // A valid answer: every case done, its outputs zeros of the right shapes.
        let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        let mut entries = Vec::new();
        for (i, (case, specs)) in cases.iter().enumerate() {
            entries.push(format!("\"{}\": {{\"status\": \"done\"}}", case.id.replace('"', "\\\"")));
            for (j, s) in specs.iter().enumerate() {
                let dtype = if s.ids { safetensors::Dtype::U32 } else { safetensors::Dtype::F32 };
                tensors.push((format!("{i}.out{j}"), dtype, s.shape.clone(), vec![0u8; 4 * s.shape.iter().product::<usize>()]));
            }
        }
        let views: Vec<(String, safetensors::tensor::TensorView)> = tensors.iter().map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view"))).collect();
        let outputs = safetensors::serialize(views, None).expect("serialize");
        let results = format!("{{\"results\": {{{}}}}}", entries.join(", ")).into_bytes();
        // Seeds: this valid answer, each file behind the byte that selects it.
        if let Some(seeds) = std::env::var_os("TOUCHSTONE_FUZZ_OPS_SEEDS") {
            let seeds = PathBuf::from(seeds);
            std::fs::create_dir_all(&seeds).expect("seed directory");
            std::fs::write(seeds.join("results"), [&[1u8][..], &results].concat()).expect("seed");
            std::fs::write(seeds.join("outputs"), [&[2u8][..], &outputs].concat()).expect("seed");
        }
        Setup { dir, cases, results, outputs }
    })
}

fuzz_target!(|data: &[u8]| {
    let s = setup();
    let Some((&first, rest)) = data.split_first() else { return };
    let batch: Vec<(&OpCase, Vec<OutputSpec>)> = s.cases.iter().map(|(c, o)| (c, o.clone())).collect();
    let write = |name: &str, bytes: &[u8]| std::fs::write(s.dir.join(name), bytes).expect("write");
    match first % 3 {
        0 => {
            write("capabilities.json", rest);
            let _ = read_capabilities(&s.dir.join("capabilities.json"));
        }
        1 => {
            write("results.json", rest);
            write("outputs.safetensors", &s.outputs);
            let _ = read_outcomes(&s.dir, &batch, 1 << 24);
        }
        _ => {
            write("results.json", &s.results);
            write("outputs.safetensors", rest);
            let _ = read_outcomes(&s.dir, &batch, 1 << 24);
        }
    }
});
