//! Paired A/B statistics: per-pair B/A ratios of a timing, the median change with a seeded
//! bootstrap 95% confidence interval, an exact Wilcoxon signed-rank p-value, and the verdict.
//!
//! Verdicts (threshold `t`, e.g. 0.01 = 1%), on the median change `m` (B/A - 1) and its CI
//! `[lo, hi]`:
//! - `no change`: the whole CI lies inside `[-t, +t]`;
//! - `slower`: B is significantly slower (`lo > 0`, Wilcoxon p < 0.05) and the CI reaches past
//!   `+t` (a slowdown beyond the threshold is not ruled out);
//! - `faster`: the mirror image;
//! - `inconclusive`: anything else — then `pairs_needed` estimates how many pairs would decide
//!   it (the CI half-width shrinks like 1/sqrt(n)).
//!
//! Timings are compared as log ratios, so a 2% slowdown and a 2% speed-up are symmetric.

use crate::throughput::median;
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AbVerdict {
    Faster,
    Slower,
    NoChange,
    Inconclusive,
}

impl AbVerdict {
    pub fn words(self) -> &'static str {
        match self {
            AbVerdict::Faster => "faster",
            AbVerdict::Slower => "slower",
            AbVerdict::NoChange => "no change",
            AbVerdict::Inconclusive => "inconclusive",
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct AbStats {
    pub pairs: usize,
    /// Median of B/A - 1.
    pub median_change: f64,
    /// Bootstrap 95% CI of the median change.
    pub ci95: (f64, f64),
    /// Two-sided Wilcoxon signed-rank p-value of the log ratios.
    pub p_value: f64,
    pub threshold: f64,
    pub verdict: AbVerdict,
    /// When inconclusive: the estimated number of pairs that would decide it.
    pub pairs_needed: Option<usize>,
}

/// The bootstrap's and the simulation's generator: the oracle's SplitMix64 (seeded, the same
/// stream on every machine).
pub use oracle::ops::SplitMix64 as Rng;


/// Bootstrap percentile 95% CI of the median of `x` (seeded).
pub fn bootstrap_median_ci(x: &[f64], resamples: usize, seed: u64) -> (f64, f64) {
    let mut rng = Rng(seed);
    let n = x.len();
    let mut meds = Vec::with_capacity(resamples);
    let mut buf = vec![0.0; n];
    for _ in 0..resamples {
        for b in buf.iter_mut() {
            *b = x[(rng.next_u64() % n as u64) as usize];
        }
        meds.push(median(&buf));
    }
    meds.sort_by(f64::total_cmp);
    let at = |q: f64| meds[((resamples - 1) as f64 * q).round() as usize];
    (at(0.025), at(0.975))
}

/// Paired bootstrap percentile 95% CI of sum(a)/sum(b) (the ratio of two means over the same
/// items, resampled together; seeded); None when there is nothing to resample or a resample's
/// denominator is 0.
pub fn bootstrap_ratio_ci(a: &[f64], b: &[f64], resamples: usize, seed: u64) -> Option<(f64, f64)> {
    let n = a.len();
    if n == 0 || b.len() != n || resamples == 0 {
        return None;
    }
    let mut rng = Rng(seed);
    let mut ratios = Vec::with_capacity(resamples);
    for _ in 0..resamples {
        let (mut sa, mut sb) = (0.0, 0.0);
        for _ in 0..n {
            let i = (rng.next_u64() % n as u64) as usize;
            sa += a[i];
            sb += b[i];
        }
        if sb == 0.0 {
            return None;
        }
        ratios.push(sa / sb);
    }
    ratios.sort_by(f64::total_cmp);
    let at = |q: f64| ratios[((resamples - 1) as f64 * q).round() as usize];
    Some((at(0.025), at(0.975)))
}

/// Up to this many non-zero differences the Wilcoxon p-value is exact; beyond it, the normal
/// approximation. The exact count costs n^3/2 steps (0.05 s at 400 here, 1.2 s at 1,000) and is
/// re-done after every batch of pairs; at 400 the approximation is off by 0.2% of p near 0.05
/// (scipy 1.17: exact 0.04064, asymptotic 0.04073).
pub const WILCOXON_EXACT_MAX: usize = 400;

/// Two-sided Wilcoxon signed-rank p-value (zeros dropped; tied magnitudes get mid-ranks): exact
/// up to [`WILCOXON_EXACT_MAX`] differences, counted on doubled integer ranks; beyond, the
/// normal approximation with the tie-corrected variance and a continuity correction (as R's
/// `wilcox.test` and scipy's `wilcoxon(method="asymptotic", correction=True)` compute it).
pub fn wilcoxon_p(x: &[f64]) -> f64 {
    let mut d: Vec<f64> = x.iter().copied().filter(|v| *v != 0.0 && v.is_finite()).collect();
    let n = d.len();
    if n == 0 {
        return 1.0;
    }
    d.sort_by(|a, b| a.abs().total_cmp(&b.abs()));
    // Doubled mid-ranks: ties at positions i..j share rank (i+1 + j+1)/2, doubled = i+1+j+1.
    let mut ranks2 = vec![0usize; n];
    // Sum over tie groups of t^3 - t (the variance's tie correction).
    let mut ties = 0f64;
    let mut i = 0;
    while i < n {
        let mut j = i;
        while j + 1 < n && d[j + 1].abs() == d[i].abs() {
            j += 1;
        }
        for r in ranks2.iter_mut().take(j + 1).skip(i) {
            *r = i + 1 + j + 1;
        }
        let t = (j + 1 - i) as f64;
        ties += t * t * t - t;
        i = j + 1;
    }
    let w_plus2: usize = d.iter().zip(&ranks2).filter(|(v, _)| **v > 0.0).map(|(_, r)| *r).sum();
    let total2: usize = ranks2.iter().sum();
    let p = if n <= WILCOXON_EXACT_MAX {
        wilcoxon_exact_tail(&ranks2, w_plus2.min(total2 - w_plus2))
    } else {
        let nf = n as f64;
        let mean = nf * (nf + 1.0) / 4.0;
        let sd = (nf * (nf + 1.0) * (2.0 * nf + 1.0) / 24.0 - ties / 48.0).sqrt();
        // The smaller of W+ and W-, moved half a rank towards the mean.
        let w = w_plus2.min(total2 - w_plus2) as f64 / 2.0;
        let z = ((mean - w) - 0.5).max(0.0) / sd;
        0.5 * libm::erfc(z / std::f64::consts::SQRT_2)
    };
    (2.0 * p).min(1.0)
}

/// P(doubled positive-rank sum <= `extreme`) when each rank's sign is a fair coin: the
/// distribution is built one rank at a time as probabilities (halved at each step, so 2^n
/// assignments never overflow an f64, which counting them did past 1,023 ranks).
fn wilcoxon_exact_tail(ranks2: &[usize], extreme: usize) -> f64 {
    let total: usize = ranks2.iter().sum();
    let mut prob = vec![0f64; total + 1];
    prob[0] = 1.0;
    let mut reach = 0;
    for &r in ranks2 {
        reach += r;
        for s in (r..=reach).rev() {
            prob[s] = 0.5 * (prob[s] + prob[s - r]);
        }
        for p in prob.iter_mut().take(r.min(reach + 1)) {
            *p *= 0.5;
        }
    }
    prob[..=extreme].iter().sum()
}

/// The statistics and verdict of per-pair ratios B/A (timings: > 1 means B is slower).
pub fn analyze(ratios: &[f64], threshold: f64, seed: u64) -> AbStats {
    let logs: Vec<f64> = ratios.iter().map(|r| r.ln()).collect();
    let n = logs.len();
    let med = median(&logs).exp() - 1.0;
    let (lo, hi) = if n >= 2 { bootstrap_median_ci(&logs, 2000, seed) } else { (f64::NEG_INFINITY, f64::INFINITY) };
    let (lo, hi) = (lo.exp() - 1.0, hi.exp() - 1.0);
    let p = wilcoxon_p(&logs);
    let verdict = if lo >= -threshold && hi <= threshold {
        AbVerdict::NoChange
    } else if lo > 0.0 && p < 0.05 && hi > threshold {
        AbVerdict::Slower
    } else if hi < 0.0 && p < 0.05 && lo < -threshold {
        AbVerdict::Faster
    } else {
        AbVerdict::Inconclusive
    };
    let pairs_needed = (verdict == AbVerdict::Inconclusive && n >= 2).then(|| {
        let half = ((hi - lo) / 2.0).max(1e-12);
        // The half-width that would decide: inside ±t around the median, or clear of zero.
        let want = if med.abs() < threshold { threshold - med.abs() } else { med.abs() }.max(threshold / 4.0);
        ((n as f64) * (half / want).powi(2)).ceil().max(n as f64 + 1.0) as usize
    });
    AbStats { pairs: n, median_change: med, ci95: (lo, hi), p_value: p, threshold, verdict, pairs_needed }
}

/// Which arm runs first in pair `i` (0-based): ABBA order, pair by pair (A,B then B,A ...), so a
/// drift of the machine within a pair cancels over two pairs.
pub fn a_first(pair: usize) -> bool {
    pair.is_multiple_of(2)
}

/// Simulated pairs for the statistical-validity tests and docs/BENCHMARKS.md: the log of each
/// pair's B/A ratio is `ln(1 + slowdown) + noise`, the noise a mixture measured on the development
/// machine: with probability `1 - p_outlier` a normal of `sigma_core`, otherwise a normal of
/// `sigma_outlier` (the host stealing time from one arm for a whole run).
pub struct NoisyMachine {
    pub rng: Rng,
    pub sigma_core: f64,
    pub p_outlier: f64,
    pub sigma_outlier: f64,
}

impl NoisyMachine {
    pub fn measured(seed: u64) -> Self {
        NoisyMachine { rng: Rng(seed), sigma_core: MEASURED_SIGMA, p_outlier: MEASURED_P_OUTLIER, sigma_outlier: MEASURED_SIGMA_OUTLIER }
    }
    /// One pair: the ratio B/A.
    pub fn pair(&mut self, _i: usize, slowdown_b: f64) -> f64 {
        let sigma = if self.rng.next_f64() < self.p_outlier { self.sigma_outlier } else { self.sigma_core };
        ((1.0 + slowdown_b).ln() + sigma * self.rng.next_normal()).exp()
    }
}

/// Runs the adaptive procedure on a simulated machine: `start` pairs, then more (as many as
/// `pairs_needed` says, at most `max_pairs`) while inconclusive.
pub fn simulate(m: &mut NoisyMachine, slowdown_b: f64, threshold: f64, start: usize, max_pairs: usize, seed: u64) -> AbStats {
    let mut ratios: Vec<f64> = (0..start).map(|i| m.pair(i, slowdown_b)).collect();
    loop {
        let s = analyze(&ratios, threshold, seed);
        match s.pairs_needed {
            Some(need) if ratios.len() < max_pairs => {
                let target = need.min(max_pairs).max(ratios.len() + 1);
                while ratios.len() < target {
                    let i = ratios.len();
                    ratios.push(m.pair(i, slowdown_b));
                }
            }
            _ => return s,
        }
    }
}

/// The pair noise measured on the development machine with the `cpu` device on SmolLM2
/// (docs/BENCHMARKS.md, "A/B statistics"): log-ratio of the per-run minimum decode step time,
/// token-interleaved arms; robust sigma 1.1-2.1% over three A/A runs of 20-27 pairs, with
/// occasional outliers up to 25%.
pub const MEASURED_SIGMA: f64 = 0.015;
pub const MEASURED_P_OUTLIER: f64 = 0.1;
pub const MEASURED_SIGMA_OUTLIER: f64 = 0.12;

#[cfg(test)]
mod tests {
    use super::*;

    /// Integer differences from a 64-bit LCG (`(state >> 33) % spread - spread/2 + shift`), the
    /// same sequence scipy was given for the reference p-values below.
    fn lcg_differences(n: usize, seed: u64, spread: u64, shift: i64) -> Vec<f64> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 33) % spread) as f64 - (spread / 2) as f64 + shift as f64
            })
            .collect()
    }

    /// p-values from scipy 1.17.1's `scipy.stats.wilcoxon` (default zero_method "wilcox"): the
    /// exact distribution without ties (`method="exact"`), every sign assignment enumerated with
    /// ties (`method=PermutationMethod(n_resamples=np.inf)`), and the normal approximation with
    /// a continuity correction past the exact limit (`method="asymptotic", correction=True`) —
    /// up to 3,000 pairs, where counting sign assignments in an f64 had overflowed (p = 0 or 1
    /// past 1,023 pairs, whatever the data).
    #[test]
    fn wilcoxon_matches_scipy() {
        let cases: [(usize, u64, u64, i64, f64); 6] = [
            (20, 1, 1000003, 150000, 0.04405403137207031),
            (12, 2, 7, 1, 0.203125),
            (16, 3, 9, 1, 0.020263671875),
            (1000, 4, 41, 1, 0.0394291153308269),
            (1500, 5, 1001, 10, 0.019536362944464692),
            (3000, 6, 101, 0, 0.814221366674481),
        ];
        for (n, seed, spread, shift, want) in cases {
            let got = wilcoxon_p(&lcg_differences(n, seed, spread, shift));
            assert!((got - want).abs() <= 1e-9 * want, "n={n} seed={seed}: {got} vs scipy {want}");
        }
    }

    #[test]
    fn wilcoxon_matches_known_values() {
        // All 10 differences positive: p = 2 / 2^10.
        let x: Vec<f64> = (1..=10).map(|i| i as f64).collect();
        assert!((wilcoxon_p(&x) - 2.0 / 1024.0).abs() < 1e-12);
        // Symmetric around zero: p = 1.
        assert!(wilcoxon_p(&[-1.0, 1.0, -2.0, 2.0]) > 0.99);
        assert_eq!(wilcoxon_p(&[]), 1.0);
    }

    /// The paired ratio CI: exact for a constant ratio, around the point ratio and wider for
    /// one heavy item than for even ones, the same bits for the same seed; None with nothing to
    /// resample or a zero denominator.
    #[test]
    fn paired_ratio_ci_resamples_items_together() {
        let b: Vec<f64> = (1..=40).map(|i| i as f64 * 0.01).collect();
        let twice: Vec<f64> = b.iter().map(|v| 2.0 * v).collect();
        assert_eq!(bootstrap_ratio_ci(&twice, &b, 500, 7), Some((2.0, 2.0)));
        let mut heavy = twice.clone();
        heavy[3] *= 30.0;
        let (lo, hi) = bootstrap_ratio_ci(&heavy, &b, 2000, 7).unwrap();
        let point = heavy.iter().sum::<f64>() / b.iter().sum::<f64>();
        assert!(lo < point && point < hi && hi - lo > 0.5, "{lo} {point} {hi}");
        assert_eq!(bootstrap_ratio_ci(&heavy, &b, 2000, 7), Some((lo, hi)));
        assert_eq!(bootstrap_ratio_ci(&[], &[], 100, 1), None);
        assert_eq!(bootstrap_ratio_ci(&[1.0], &[0.0], 100, 1), None);
        assert_eq!(bootstrap_ratio_ci(&[1.0, 2.0], &[1.0], 100, 1), None);
    }

    #[test]
    fn verdicts_follow_the_ci() {
        let same: Vec<f64> = (0..30).map(|i| 1.0 + if i % 2 == 0 { 0.001 } else { -0.001 }).collect();
        assert_eq!(analyze(&same, 0.01, 1).verdict, AbVerdict::NoChange);
        let slower: Vec<f64> = (0..20).map(|i| 1.05 + 0.002 * (i % 3) as f64).collect();
        assert_eq!(analyze(&slower, 0.01, 1).verdict, AbVerdict::Slower);
        let faster: Vec<f64> = slower.iter().map(|r| 1.0 / r).collect();
        assert_eq!(analyze(&faster, 0.01, 1).verdict, AbVerdict::Faster);
        let noisy = [1.1, 0.9, 1.05, 0.95];
        let s = analyze(&noisy, 0.01, 1);
        assert_eq!(s.verdict, AbVerdict::Inconclusive);
        assert!(s.pairs_needed.unwrap() > 4);
    }

    /// Statistical validity on the measured noise: an A/A comparison says `no change` in >= 95%
    /// of trials (10 pairs, more while inconclusive, at most 40), and a real 2% slowdown is
    /// `slower` in >= 95% of trials within 20 pairs (threshold 2%, the default). Rates are printed
    /// for docs/BENCHMARKS.md.
    #[test]
    fn simulated_a_a_is_no_change_and_a_2_percent_slowdown_is_slower() {
        let trials = 1000;
        let mut aa_no_change = 0;
        let mut aa_false_slower = 0;
        let mut slow_detected = 0;
        let mut slow_pairs = Vec::new();
        for t in 0..trials {
            let mut m = NoisyMachine::measured(1000 + t);
            let s = simulate(&mut m, 0.0, 0.015, 10, 40, t);
            aa_no_change += (s.verdict == AbVerdict::NoChange) as usize;
            aa_false_slower += (s.verdict == AbVerdict::Slower) as usize;
            let mut m = NoisyMachine::measured(5000 + t);
            let s = simulate(&mut m, 0.02, 0.015, 10, 20, t);
            slow_detected += (s.verdict == AbVerdict::Slower) as usize;
            slow_pairs.push(s.pairs);
        }
        let (aa, fs, sl) = (aa_no_change as f64 / trials as f64, aa_false_slower as f64 / trials as f64, slow_detected as f64 / trials as f64);
        slow_pairs.sort();
        eprintln!("A/A: no change {:.1}%, slower {:.1}% | 2% slowdown: slower {:.1}% within 20 pairs (median pairs used {})", aa * 100.0, fs * 100.0, sl * 100.0, slow_pairs[trials as usize / 2]);
        assert!(aa >= 0.95, "A/A no-change rate {aa}");
        assert!(sl >= 0.95, "2% slowdown detection rate {sl}");
    }
}
