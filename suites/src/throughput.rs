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
    /// Per repetition: how many tokens it generated (`gen_len` unless the engine stopped early).
    pub generated: Vec<usize>,
    /// Per repetition: a hash (FNV-1a 64, hex) of the generated ids. Greedy decoding of one
    /// prompt must give the same tokens every time: figures from runs that computed different
    /// things are not one measurement.
    pub output_hashes: Vec<String>,
}

impl RefBench {
    /// What the run must show before its figures mean anything: every repetition generated the
    /// tokens asked for, all of them the same tokens, with finite, positive timings. Returns what
    /// failed (empty when nothing did).
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.generated.len() != self.reps || self.output_hashes.len() != self.reps {
            p.push(format!("{} repetitions asked for, {} ran", self.reps, self.generated.len()));
        }
        for (i, n) in self.generated.iter().enumerate().filter(|(_, n)| **n != self.gen_len) {
            p.push(format!("repetition {} generated {n} tokens, not {}", i + 1, self.gen_len));
        }
        if let Some(first) = self.output_hashes.first() {
            let differ: Vec<String> = self.output_hashes.iter().enumerate().filter(|(_, h)| *h != first).map(|(i, _)| (i + 1).to_string()).collect();
            if !differ.is_empty() {
                p.push(format!("greedy outputs differ between repetitions (repetition {} != repetition 1): the engine is not deterministic", differ.join(", ")));
            }
        }
        let timings = self.prefill_tok_per_s.iter().chain(&self.decode_tok_per_s).chain(&self.ttft_ms).chain(self.itl_ms.iter().flatten());
        if let Some(t) = timings.into_iter().find(|t| !(t.is_finite() && **t > 0.0)) {
            p.push(format!("a timing is {t} (every rate and latency must be finite and positive)"));
        }
        p
    }
}

/// One repetition of one batch size in `bench --batch`: `batch` requests prefilled together,
/// then decoded together one token per step.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BatchRep {
    pub batch: usize,
    /// The repetition (the batch sizes of one repetition ran back to back, in an order rotated
    /// per repetition, so each is paired with the others of its repetition).
    pub rep: usize,
    /// Seconds of the step that prefilled every request's prompt.
    pub prefill_s: f64,
    /// Seconds of each decode step (every request one token).
    pub step_s: Vec<f64>,
}

impl BatchRep {
    /// Decode tokens per second over all requests: batch x steps / their seconds.
    pub fn decode_tok_per_s(&self) -> f64 {
        (self.batch * self.step_s.len()) as f64 / self.step_s.iter().sum::<f64>()
    }
    /// Prefill tokens per second over all requests.
    pub fn prefill_tok_per_s(&self, prompt_len: usize) -> f64 {
        (self.batch * prompt_len) as f64 / self.prefill_s
    }
}

/// FNV-1a 64 of the ids' little-endian bytes, as 16 hex digits.
fn hash_ids(ids: &[u32]) -> String {
    let h = ids.iter().flat_map(|t| t.to_le_bytes()).fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3));
    format!("{h:016x}")
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
    bench_with(|p, n| model.generate(p, n, &greedy, 0, &[], &mut NoTap), model.weight_bytes_per_token(), prompt, gen_len, reps, progress)
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
    let (mut generated, mut output_hashes) = (Vec::new(), Vec::new());
    // The peak RSS reported is the engine's: the peak is reset before each generation, after
    // the probe's 1 GiB of buffers is freed and whatever ran earlier in the process (another
    // gate suite) is gone. Where it cannot be reset after a probe it is not reported; with no
    // probe, the peak since the process started is the best figure there is.
    let mut rss_is_engines = true;
    for r in 0..reps {
        // Bandwidth figures need the bytes read per token; without them a probe only costs time.
        if wb > 0 {
            probes.push(membw::probe(512 << 20, 3));
        }
        let reset = crate::machine::reset_peak_rss();
        if wb > 0 {
            rss_is_engines &= reset;
        }
        let g = generate(prompt, gen_len)?;
        prefill.push(prompt.len() as f64 / g.prefill_s);
        decode.push(g.decode_tok_per_s());
        ttft.push(g.prefill_s * 1e3);
        itl.push(g.step_s.iter().map(|s| s * 1e3).collect::<Vec<f64>>());
        machine.push(crate::machine::state());
        generated.push(g.tokens.len());
        output_hashes.push(hash_ids(&g.tokens));
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
        generated,
        output_hashes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake engine: `tokens(rep)` gives each call's output (call 0 is the warm-up).
    fn bench_fake(tokens: impl Fn(usize, usize) -> Vec<u32>, step_s: f64) -> RefBench {
        let mut call = 0;
        let generate = |prompt: &[u32], n: usize| -> Result<Generation, ()> {
            let t = tokens(call, n);
            call += 1;
            let steps = t.len().saturating_sub(1);
            Ok(Generation { prompt: prompt.to_vec(), tokens: t, prefill_s: 1e-3, decode_s: step_s * steps as f64, decode_steps: steps, step_s: vec![step_s; steps] })
        };
        bench_with(generate, 0, &[1, 2, 3], 8, 3, |_| {}).unwrap()
    }

    #[test]
    fn a_steady_deterministic_run_has_no_problems() {
        let r = bench_fake(|_, n| (0..n as u32).collect(), 1e-3);
        assert_eq!(r.problems(), Vec::<String>::new());
        assert_eq!((r.generated.clone(), r.output_hashes.len()), (vec![8, 8, 8], 3));
        assert!((median(&r.decode_tok_per_s) - 1000.0).abs() < 1e-6);
    }

    #[test]
    fn different_outputs_an_early_stop_or_a_zero_timing_are_problems() {
        // Repetition 2 (call 2) generates other tokens.
        let r = bench_fake(|call, n| (0..n as u32).map(|t| if call == 2 { t + 1 } else { t }).collect(), 1e-3);
        let p = r.problems();
        assert!(p.len() == 1 && p[0].contains("repetition 2 != repetition 1"), "{p:?}");
        // Repetition 3 (call 3) stops after 5 tokens: its tok/s would flatter the engine.
        let p = bench_fake(|call, n| (0..if call == 3 { 5 } else { n as u32 }).collect(), 1e-3).problems();
        assert!(p.iter().any(|m| m.contains("repetition 3 generated 5 tokens, not 8")), "{p:?}");
        let p = bench_fake(|_, n| (0..n as u32).collect(), 0.0).problems();
        assert!(p.iter().any(|m| m.contains("a timing is")), "{p:?}");
    }
}
