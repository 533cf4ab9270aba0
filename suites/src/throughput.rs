//! Throughput of the oracle (`--device ref`): prefill and decode speed, and the effective weight
//! bandwidth of decode compared with a memory-bandwidth probe taken in the same run.

use crate::membw::{self, Bandwidth};
use oracle::generate::{AnyModel, Generation};
use oracle::ops::SamplerConfig;
use oracle::NoTap;

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
    /// Weight bytes read per generated token, when the device can say (the oracle can).
    pub weight_bytes_per_token: usize,
    /// Per repetition: weight bytes per token x decode tokens/s, GB/s (empty when unknown).
    pub effective_gbps: Vec<f64>,
    /// Per repetition: the probe taken just before that repetition's generation.
    pub probes: Vec<Bandwidth>,
    /// Median over repetitions of effective / copy probe (the STREAM-style figure).
    pub fraction_of_copy_probe: f64,
    /// Median over repetitions of effective / read-only probe (the stricter figure).
    pub fraction_of_read_probe: f64,
    /// Per repetition: time to first token (prefill + the first sampled token), ms.
    pub ttft_ms: Vec<f64>,
    /// Per repetition: every inter-token latency of the decode steps, ms (the raw samples).
    pub itl_ms: Vec<Vec<f64>>,
    /// Inter-token latency percentiles over all repetitions, ms: p50, p90, p99.
    pub itl_p50_p90_p99_ms: [f64; 3],
    /// Per repetition: the machine's state right after it (load, CPU clock, peak RSS since the
    /// probe before it, or since the start where no probe ran).
    pub machine: Vec<crate::machine::MachineState>,
    /// Peak resident memory of the process while it generated, KiB: the largest of the
    /// repetitions' peaks (the bandwidth probe's buffers excluded); None where the peak could
    /// not be reset after a probe.
    pub peak_rss_kb: Option<u64>,
}

/// The `q` quantile (0..1) of `v` by nearest rank.
pub fn percentile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    s[((s.len() - 1) as f64 * q).round() as usize]
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

/// Runs one warm-up, then `reps` repetitions of (bandwidth probe, greedy generation), so every
/// decode figure has a probe taken seconds before it on the same noisy machine.
pub fn bench_ref(model: &AnyModel, prompt: &[u32], gen_len: usize, reps: usize, progress: impl FnMut(usize)) -> oracle::Result<RefBench> {
    let greedy = SamplerConfig::GREEDY;
    bench_with(|p, n| model.generate(p, n, &greedy, 0, None, &mut NoTap), model.weight_bytes_per_token(), prompt, gen_len, reps, progress)
}

/// The same measurement over any generator (a device model's greedy loop, say);
/// `weight_bytes_per_token = 0` means unknown (no bandwidth figures then).
pub fn bench_with<E>(
    mut generate: impl FnMut(&[u32], usize) -> Result<Generation, E>,
    weight_bytes_per_token: usize,
    prompt: &[u32],
    gen_len: usize,
    reps: usize,
    mut progress: impl FnMut(usize),
) -> Result<RefBench, E> {
    generate(prompt, 2)?;
    let wb = weight_bytes_per_token;
    let (mut prefill, mut decode, mut effective, mut probes) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut ttft, mut itl, mut machine) = (Vec::new(), Vec::new(), Vec::new());
    // The peak RSS reported is the engine's: the probe's 1 GiB of buffers is freed before each
    // generation and the peak reset then. Where it cannot be reset it is not reported.
    let mut rss_is_engines = true;
    for r in 0..reps {
        // Bandwidth figures need the bytes read per token; without them a probe only costs time.
        if wb > 0 {
            probes.push(membw::probe(512 << 20, 3));
            rss_is_engines &= crate::machine::reset_peak_rss();
        }
        let g = generate(prompt, gen_len)?;
        prefill.push(prompt.len() as f64 / g.prefill_s);
        decode.push(g.decode_tok_per_s());
        ttft.push(g.prefill_s * 1e3);
        itl.push(g.step_s.iter().map(|s| s * 1e3).collect::<Vec<f64>>());
        machine.push(crate::machine::state());
        if wb > 0 {
            effective.push(wb as f64 * g.decode_tok_per_s() / 1e9);
        }
        progress(r + 1);
    }
    let peak_rss_kb = if rss_is_engines { machine.iter().filter_map(|m: &crate::machine::MachineState| m.peak_rss_kb).max() } else { None };
    let ratio = |f: fn(&Bandwidth) -> f64| median(&effective.iter().zip(&probes).map(|(e, p)| e / f(p)).collect::<Vec<_>>());
    Ok(RefBench {
        prompt_len: prompt.len(),
        gen_len,
        reps,
        threads: rayon::current_num_threads(),
        dot_path: oracle::simd::dot_path_name(),
        prefill_tok_per_s: prefill,
        decode_tok_per_s: decode,
        weight_bytes_per_token: wb,
        fraction_of_copy_probe: ratio(|p| p.copy_gbps),
        fraction_of_read_probe: ratio(|p| p.read_gbps),
        effective_gbps: effective,
        probes,
        itl_p50_p90_p99_ms: {
            let all: Vec<f64> = itl.iter().flatten().copied().collect();
            [percentile(&all, 0.5), percentile(&all, 0.9), percentile(&all, 0.99)]
        },
        ttft_ms: ttft,
        itl_ms: itl,
        machine,
        peak_rss_kb,
    })
}
