//! Token selection: argmax, top-k, and seeded temperature / top-k / top-p sampling.
//! Ties always resolve to the lower token id, so discrete results are reproducible.

use crate::real::Real;

/// Index of the largest value (the first one on ties). NaN values are never chosen.
pub fn argmax<T: Real>(x: &[T]) -> usize {
    let mut best = 0;
    let mut best_v = f64::NEG_INFINITY;
    for (i, v) in x.iter().enumerate() {
        let v = v.to_f64();
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best
}

/// The `k` largest indices, best first; ties go to the lower index.
pub fn top_k<T: Real>(x: &[T], k: usize) -> Vec<usize> {
    top_k_f64(&x.iter().map(|v| v.to_f64()).collect::<Vec<_>>(), k)
}

pub(crate) fn top_k_f64(x: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).filter(|&i| !x[i].is_nan()).collect();
    idx.sort_by(|&a, &b| x[b].partial_cmp(&x[a]).expect("NaN filtered").then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// SplitMix64: a tiny, fully specified PRNG, so a seed means the same stream on every machine
/// and every version of this crate.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal via Box-Muller.
    pub fn next_normal(&mut self) -> f64 {
        let u1 = self.next_f64().max(f64::MIN_POSITIVE);
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// Sampling settings; `temperature == 0` means greedy.
#[derive(Clone, Copy, Debug)]
pub struct SamplerConfig {
    pub temperature: f64,
    /// Keep only the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches p (1.0 = all).
    pub top_p: f64,
}

impl SamplerConfig {
    /// Greedy decoding: always the most likely token.
    pub const GREEDY: SamplerConfig = SamplerConfig { temperature: 0.0, top_k: 0, top_p: 1.0 };
}

/// Picks the next token from `logits` with the seeded `rng`.
pub fn sample<T: Real>(logits: &[T], cfg: &SamplerConfig, rng: &mut SplitMix64) -> usize {
    if cfg.temperature <= 0.0 {
        return argmax(logits);
    }
    let k = if cfg.top_k == 0 { logits.len() } else { cfg.top_k.min(logits.len()) };
    let order = top_k(logits, k);
    let scaled: Vec<f64> = order.iter().map(|&i| logits[i].to_f64() / cfg.temperature).collect();
    let probs = super::act::softmax_f64(&scaled);
    // Top-p: cut after the cumulative probability first reaches p.
    let mut keep = probs.len();
    let mut cum = 0.0;
    for (j, p) in probs.iter().enumerate() {
        cum += p;
        if cum >= cfg.top_p {
            keep = j + 1;
            break;
        }
    }
    let total: f64 = probs[..keep].iter().sum();
    let mut r = rng.next_f64() * total;
    for j in 0..keep {
        r -= probs[j];
        if r < 0.0 {
            return order[j];
        }
    }
    order[keep - 1]
}
