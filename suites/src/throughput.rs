//! Throughput of the oracle (`--device ref`): prefill and decode speed, and the effective weight
//! bandwidth of decode compared with a memory-bandwidth probe taken in the same run.

use crate::membw::{self, Bandwidth};
use oracle::generate::AnyModel;
use oracle::ops::SamplerConfig;
use oracle::NoTap;
use std::time::Instant;

#[derive(Clone, Debug, serde::Serialize)]
pub struct RefBench {
    pub prompt_len: usize,
    pub gen_len: usize,
    pub reps: usize,
    pub threads: usize,
    pub dot_path: &'static str,
    /// Per repetition: prefill tokens/s.
    pub prefill_tok_per_s: Vec<f64>,
    /// Per repetition: decode tokens/s.
    pub decode_tok_per_s: Vec<f64>,
    pub weight_bytes_per_token: usize,
    /// Weight bytes per token / median decode time per token, GB/s.
    pub effective_gbps: f64,
    pub probe: Bandwidth,
    /// effective_gbps / probe.read_gbps.
    pub fraction_of_read_probe: f64,
}

pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    if s.is_empty() {
        return f64::NAN;
    }
    if s.len() % 2 == 1 {
        s[s.len() / 2]
    } else {
        0.5 * (s[s.len() / 2 - 1] + s[s.len() / 2])
    }
}

/// Runs one warm-up and `reps` measured generations (greedy), then the bandwidth probe.
pub fn bench_ref(model: &AnyModel, prompt: &[u32], gen_len: usize, reps: usize, mut progress: impl FnMut(usize)) -> oracle::Result<RefBench> {
    let greedy = SamplerConfig { temperature: 0.0, top_k: 0, top_p: 1.0 };
    model.generate(prompt, 2, &greedy, 0, None, &mut NoTap)?;
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    for r in 0..reps {
        let t = Instant::now();
        let g = model.generate(prompt, gen_len, &greedy, 0, None, &mut NoTap)?;
        let _ = t;
        prefill.push(prompt.len() as f64 / g.prefill_s);
        decode.push(g.decode_tok_per_s());
        progress(r + 1);
    }
    let probe = membw::probe(512 << 20, 5);
    let wb = model.weight_bytes_per_token();
    let effective = wb as f64 * median(&decode) / 1e9;
    Ok(RefBench {
        prompt_len: prompt.len(),
        gen_len,
        reps,
        threads: rayon::current_num_threads(),
        dot_path: oracle::simd::dot_path_name(),
        prefill_tok_per_s: prefill,
        decode_tok_per_s: decode,
        weight_bytes_per_token: wb,
        effective_gbps: effective,
        fraction_of_read_probe: effective / probe.read_gbps,
        probe,
    })
}
