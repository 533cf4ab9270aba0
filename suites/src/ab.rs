//! Paired A/B statistics judged by restart group: per-pair B/A ratios of a timing, grouped by the
//! process lifetime they share, a Hodges-Lehmann estimate with an exact signed-rank 95%
//! confidence interval over the groups, a Wilcoxon signed-rank p-value over the groups, and the
//! verdict.
//!
//! **Why groups.** Pairs measured inside one lifetime of the arms' processes share that
//! lifetime's luck with memory placement (huge pages, cache colouring); measured on real engines
//! the luck moves one arm by ±2% (SmolLM2) to ±15% (tiny-llama) for as long as the process
//! lives. Pairs are therefore not independent; restart groups are (each starts both arms afresh).
//! A group's value is the median of its pairs' log ratios; the statistics see only group values.
//! An `exec:` arm is a fresh process per run, so each of its pairs is a group of one.
//!
//! **The rule** (threshold `t`, e.g. 0.015; `G` groups; `looks` the number of times the
//! procedure may look before `--max-pairs`, see [`Plan`]):
//! - fewer than [`MIN_GROUPS`] groups: `inconclusive`, whatever the numbers;
//! - `no change`: the 95% CI lies inside `[-t, +t]`;
//! - `slower`: the signed-rank p over groups is below `alpha = 1% / looks` (a Bonferroni split,
//!   so over all looks a comparison of identical arms says faster or slower at most 1% of the
//!   time: a CI gate that cries wolf is switched off), the estimate is positive and the CI reaches
//!   past `+t`; `faster` is its mirror;
//! - `inconclusive` otherwise, with `pairs_needed` (the CI half-width shrinks like 1/sqrt(G)).
//!
//! Assumptions: groups are independent (fresh processes) and, for identical arms, a group's
//! log ratio is symmetric around zero (A's luck and B's are drawn alike). No normality is
//! assumed; the CI and p-value are exact up to [`WILCOXON_EXACT_MAX`] groups. Timings are
//! compared as log ratios, so a 2% slowdown and a 2% speed-up are symmetric.

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
    /// Restart groups (independent units) the pairs fell into.
    pub groups: usize,
    /// B/A - 1 at the Hodges-Lehmann estimate over the groups' log ratios.
    pub median_change: f64,
    /// Exact signed-rank 95% CI of the change (infinite below 6 groups).
    pub ci95: (f64, f64),
    /// Two-sided Wilcoxon signed-rank p-value of the groups' log ratios.
    pub p_value: f64,
    /// The p-value a faster/slower verdict needs at this look (1% / looks).
    pub alpha: f64,
    pub threshold: f64,
    pub verdict: AbVerdict,
    /// When inconclusive: the estimated number of pairs that would decide it.
    pub pairs_needed: Option<usize>,
    /// The smallest change found with 80% power by the plan's last look, from this run's
    /// spread between groups (None below 3 groups or with no spread).
    pub min_detectable: Option<f64>,
}

/// No verdict before this many restart groups: below 6 the exact 95% CI is unbounded.
pub const MIN_GROUPS: usize = 6;

/// A comparison's false-alarm rate over all its looks.
pub const FAMILY_ALPHA: f64 = 0.01;

/// The adaptive procedure: a verdict is first sought after `start` pairs; while inconclusive the
/// pair count at least doubles (more when the CI says more are needed), up to `max_pairs`.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub threshold: f64,
    pub start: usize,
    pub max_pairs: usize,
}

impl Plan {
    /// How many times the procedure can look: start, then doubling, then the maximum.
    pub fn looks(&self) -> usize {
        let (mut n, mut cur) = (1, self.start.max(1));
        while cur < self.max_pairs {
            cur = (2 * cur).min(self.max_pairs);
            n += 1;
        }
        n
    }
    /// The p-value a direction verdict needs at each look.
    pub fn alpha(&self) -> f64 {
        FAMILY_ALPHA / self.looks() as f64
    }
    /// The next look's pair count after an inconclusive look at `current` pairs that estimated
    /// `needed`: at least double, rounded up to whole groups of `group`, at most `max_pairs`.
    pub fn next(&self, current: usize, needed: usize, group: usize) -> usize {
        let want = needed.max(2 * current.max(1));
        let group = group.max(1);
        (want.div_ceil(group) * group).min(self.max_pairs).max(current + 1)
    }
}

/// The standard normal quantile (bisection on erfc: exact to f64 rounding, no table).
pub fn normal_quantile(p: f64) -> f64 {
    let cdf = |z: f64| 0.5 * libm::erfc(-z / std::f64::consts::SQRT_2);
    let (mut lo, mut hi) = (-40.0, 40.0);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if cdf(mid) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// P(T+ <= t) for t = 0..=n(n+1)/2, T+ the signed-rank statistic of `n` untied differences
/// when each sign is a fair coin.
fn signed_rank_cdf(n: usize) -> Vec<f64> {
    let ranks2: Vec<usize> = (1..=n).map(|r| 2 * r).collect();
    let mut acc = 0.0;
    // Doubled sums of integer ranks are even: every other entry.
    signed_rank_distribution(&ranks2).iter().step_by(2).map(|p| {
        acc += p;
        acc
    }).collect()
}

/// The k-th smallest (0-based) of `v`, reordering it.
fn kth(v: &mut [f64], k: usize) -> f64 {
    *v.select_nth_unstable_by(k, f64::total_cmp).1
}

/// Hodges-Lehmann estimate (median of the Walsh averages) of `x`'s centre with its exact
/// distribution-free confidence interval at level `1 - a` from the signed-rank distribution
/// (normal approximation past [`WILCOXON_EXACT_MAX`] values): `(estimate, lo, hi)`, the interval
/// infinite when `x` is too short for the level.
pub fn hodges_lehmann(x: &[f64], a: f64) -> (f64, f64, f64) {
    let n = x.len();
    if n == 0 {
        return (f64::NAN, f64::NEG_INFINITY, f64::INFINITY);
    }
    let mut walsh: Vec<f64> = Vec::with_capacity(n * (n + 1) / 2);
    for i in 0..n {
        for j in i..n {
            walsh.push(0.5 * (x[i] + x[j]));
        }
    }
    let m = walsh.len();
    let est = if m % 2 == 1 { kth(&mut walsh, m / 2) } else { 0.5 * (kth(&mut walsh, m / 2 - 1) + kth(&mut walsh, m / 2)) };
    // c: the largest t with P(T+ <= t) <= a/2; the CI is [W(c), W(m-1-c)] (0-based).
    let c = if n <= WILCOXON_EXACT_MAX {
        signed_rank_cdf(n).iter().take_while(|p| **p <= a / 2.0 + 1e-12).count().checked_sub(1)
    } else {
        let nf = n as f64;
        let sd = (nf * (nf + 1.0) * (2.0 * nf + 1.0) / 24.0).sqrt();
        let t = (m as f64 / 2.0 + normal_quantile(a / 2.0) * sd - 0.5).floor();
        (t >= 0.0).then_some(t as usize)
    };
    match c {
        Some(c) if c < m / 2 + 1 => (est, kth(&mut walsh, c), kth(&mut walsh, m - 1 - c)),
        _ => (est, f64::NEG_INFINITY, f64::INFINITY),
    }
}

/// A batch size's decode throughput against batch 1's, paired by repetition: the Hodges-Lehmann
/// estimate of the per-repetition ratio (batch N's tokens/s over batch 1's, on a log scale) with
/// its 95% distribution-free interval, as `(estimate, lo, hi)`; None without pairs. An interval
/// is infinite when there are too few repetitions for the level (fewer than 6).
pub fn paired_speedup(reps: &[crate::throughput::BatchRep], batch: usize) -> Option<(f64, f64, f64)> {
    let rate = |b: usize, r: usize| reps.iter().find(|x| x.batch == b && x.rep == r).map(crate::throughput::BatchRep::decode_tok_per_s);
    let logs: Vec<f64> = reps.iter().filter(|x| x.batch == batch).filter_map(|x| Some((x.decode_tok_per_s() / rate(1, x.rep)?).ln())).filter(|v| v.is_finite()).collect();
    if logs.is_empty() {
        return None;
    }
    let (est, lo, hi) = hodges_lehmann(&logs, 0.05);
    Some((est.exp(), lo.exp(), hi.exp()))
}

/// 1.4826 x the median absolute deviation: the SD of normal data, robust to a wild group.
pub fn robust_sd(x: &[f64]) -> f64 {
    let m = median(x);
    1.4826 * median(&x.iter().map(|v| (v - m).abs()).collect::<Vec<_>>())
}

fn stdev(x: &[f64]) -> f64 {
    let n = x.len() as f64;
    let m = x.iter().sum::<f64>() / n;
    (x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (n - 1.0).max(1.0)).sqrt()
}

/// The statistics and verdict of per-pair ratios B/A (timings: > 1 means B is slower), each
/// inner slice one restart group's pairs, under `plan`.
pub fn analyze(groups: &[Vec<f64>], plan: &Plan) -> AbStats {
    let groups: Vec<&Vec<f64>> = groups.iter().filter(|g| !g.is_empty()).collect();
    let pairs: usize = groups.iter().map(|g| g.len()).sum();
    let values: Vec<f64> = groups.iter().map(|g| median(&g.iter().map(|r| r.ln()).collect::<Vec<_>>())).collect();
    let g = values.len();
    let threshold = plan.threshold;
    let alpha = plan.alpha();
    let (est, lo, hi) = hodges_lehmann(&values, 0.05);
    let (med, lo, hi) = (est.exp() - 1.0, lo.exp() - 1.0, hi.exp() - 1.0);
    let p = wilcoxon_p(&values);
    let verdict = if g < MIN_GROUPS {
        AbVerdict::Inconclusive
    } else if lo >= -threshold && hi <= threshold {
        AbVerdict::NoChange
    } else if p < alpha && med > 0.0 && hi > threshold {
        AbVerdict::Slower
    } else if p < alpha && med < 0.0 && lo < -threshold {
        AbVerdict::Faster
    } else {
        AbVerdict::Inconclusive
    };
    let per_group = pairs as f64 / g.max(1) as f64;
    let pairs_needed = (verdict == AbVerdict::Inconclusive).then(|| {
        if g < MIN_GROUPS || !(hi - lo).is_finite() {
            return ((MIN_GROUPS.max(g + 1)) as f64 * per_group.max(1.0)).ceil() as usize;
        }
        let half = ((hi - lo) / 2.0).max(1e-12);
        // The half-width that would decide: inside ±t around the estimate, or clear of zero.
        let want = if med.abs() < threshold { threshold - med.abs() } else { med.abs() }.max(threshold / 4.0);
        let groups_needed = ((g as f64) * (half / want).powi(2)).ceil().max(g as f64 + 1.0);
        (groups_needed * per_group).ceil() as usize
    });
    let min_detectable = (g >= 3).then(|| {
        let s = robust_sd(&values);
        let s = if s > 0.0 { s } else { stdev(&values) };
        let g_max = g as f64 * plan.max_pairs.max(pairs) as f64 / pairs.max(1) as f64;
        // The signed-rank test needs sqrt(pi/3) of a t-test's spread (its efficiency 3/pi).
        let d = (normal_quantile(1.0 - alpha / 2.0) + normal_quantile(0.8)) * s * (std::f64::consts::PI / 3.0).sqrt() / g_max.sqrt();
        d.exp() - 1.0
    }).filter(|d| d.is_finite() && *d > 0.0);
    AbStats { pairs, groups: g, median_change: med, ci95: (lo, hi), p_value: p, alpha, threshold, verdict, pairs_needed, min_detectable }
}

/// Splits per-pair values into restart groups of `every` consecutive pairs (0: every pair its
/// own group, for arms that run a fresh process per run).
pub fn split_groups(values: &[f64], every: usize) -> Vec<Vec<f64>> {
    values.chunks(every.max(1)).map(|c| c.to_vec()).collect()
}

/// The bootstrap's and the simulation's generator: the oracle's SplitMix64 (seeded, the same
/// stream on every machine).
pub use oracle::ops::SplitMix64 as Rng;


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

/// P(doubled positive-rank sum <= `extreme`) when each rank's sign is a fair coin.
fn wilcoxon_exact_tail(ranks2: &[usize], extreme: usize) -> f64 {
    signed_rank_distribution(ranks2)[..=extreme].iter().sum()
}

/// P(doubled positive-rank sum = s) for every s, when each (doubled) rank's sign is a fair coin:
/// built one rank at a time as probabilities (halved at each step, so 2^n assignments never
/// overflow an f64, which counting them did past 1,023 ranks).
fn signed_rank_distribution(ranks2: &[usize]) -> Vec<f64> {
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
    prob
}

/// P(X <= k) for X ~ Binomial(n, p), summed in log space (no overflow at any n).
fn binomial_cdf(k: usize, n: usize, p: f64) -> f64 {
    if p <= 0.0 {
        return 1.0;
    }
    if p >= 1.0 {
        return if k >= n { 1.0 } else { 0.0 };
    }
    let lc = |i: usize| libm::lgamma(n as f64 + 1.0) - libm::lgamma(i as f64 + 1.0) - libm::lgamma((n - i) as f64 + 1.0);
    (0..=k.min(n)).map(|i| (lc(i) + i as f64 * p.ln() + (n - i) as f64 * (-p).ln_1p()).exp()).sum::<f64>().min(1.0)
}

/// The Clopper-Pearson ("exact") 95% interval of a rate seen `k` times in `n` trials: the rates
/// under which seeing k or fewer (for the upper end), or k or more (the lower), has probability
/// 2.5%. For calibration tables: 0 false alarms in 40 decisions still allows 8.8%.
pub fn clopper_pearson(k: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let solve = |f: &dyn Fn(f64) -> f64, target: f64| {
        // f decreases in p through `target`.
        let (mut lo, mut hi) = (0.0f64, 1.0f64);
        for _ in 0..200 {
            let mid = 0.5 * (lo + hi);
            if f(mid) > target {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        0.5 * (lo + hi)
    };
    let upper = if k >= n { 1.0 } else { solve(&|p| binomial_cdf(k, n, p), 0.025) };
    // P(X >= k) = 1 - P(X <= k-1) = 2.5%.
    let lower = if k == 0 { 0.0 } else { solve(&|p| binomial_cdf(k - 1, n, p), 0.975) };
    (lower, upper)
}

/// Which arm runs first in pair `pair` (0-based) when restart groups hold `group` pairs: A,B and
/// B,A alternate within a group, and each group starts with the arm the last did not (groups of
/// two, the first arm of each pair: A B | B A | A B ...), so a drift of the machine cancels and neither arm goes first more
/// often in any group's first pair.
pub fn a_first(pair: usize, group: usize) -> bool {
    let group = group.max(1);
    (pair % group + pair / group).is_multiple_of(2)
}

/// Which arm's process is started first when restart group `g` begins (0-based): A in even
/// groups, B in odd ones. Measured on tiny-llama with the start order fixed, the process started
/// first was the slower in 26 of 34 A/A comparisons (+2.3% on average, three false alarms of
/// 40): a start order is a treatment, so it alternates.
pub fn a_started_first(g: usize) -> bool {
    g.is_multiple_of(2)
}

/// Simulated pairs for the statistical-validity tests: the log of each pair's B/A ratio is
/// `ln(1 + slowdown) + luck_B - luck_A + noise`, where each arm's luck is drawn once per restart
/// group (normal, `sigma_group`: the process lifetime's memory placement) and the pair noise is
/// a mixture (with probability `1 - p_outlier` a normal of `sigma_pair`, otherwise one of
/// `sigma_outlier`: the host stealing time from one arm for a whole run).
pub struct NoisyMachine {
    pub rng: Rng,
    pub sigma_group: f64,
    pub sigma_pair: f64,
    pub p_outlier: f64,
    pub sigma_outlier: f64,
    pub group_size: usize,
    luck: f64,
}

impl NoisyMachine {
    /// The structure measured on SmolLM2 with the `cpu` device in 20 restart groups of 2 pairs
    /// (docs/BENCHMARKS.md, "Paired A/B"): SD of a pair's log ratio within its group 2.7%, of a
    /// group's 2.7%, so a lifetime's luck of about 2%; here 2% luck, 2.5% pair noise and one pair
    /// in 50 an outlier of 12% (a pair SD of 3.0%, a little worse than measured).
    pub fn measured(seed: u64, group_size: usize) -> Self {
        NoisyMachine { rng: Rng(seed), sigma_group: 0.02, sigma_pair: 0.025, p_outlier: 0.02, sigma_outlier: 0.12, group_size, luck: 0.0 }
    }
    /// Pair `i`: the ratio B/A.
    pub fn pair(&mut self, i: usize, slowdown_b: f64) -> f64 {
        if i.is_multiple_of(self.group_size.max(1)) {
            self.luck = self.sigma_group * self.rng.next_normal();
        }
        let sigma = if self.rng.next_f64() < self.p_outlier { self.sigma_outlier } else { self.sigma_pair };
        ((1.0 + slowdown_b).ln() + self.luck + sigma * self.rng.next_normal()).exp()
    }
}

/// Runs the adaptive procedure on a simulated machine, as `cargo xtask ab` runs it: `plan.start`
/// pairs, then while inconclusive [`Plan::next`] pairs, up to `plan.max_pairs`.
pub fn simulate(m: &mut NoisyMachine, slowdown_b: f64, plan: &Plan) -> AbStats {
    let mut ratios: Vec<f64> = (0..plan.start).map(|i| m.pair(i, slowdown_b)).collect();
    loop {
        let s = analyze(&split_groups(&ratios, m.group_size), plan);
        match s.pairs_needed {
            Some(need) if ratios.len() < plan.max_pairs => {
                let target = plan.next(ratios.len(), need, m.group_size);
                while ratios.len() < target {
                    let i = ratios.len();
                    ratios.push(m.pair(i, slowdown_b));
                }
            }
            _ => return s,
        }
    }
}

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

    /// The exact signed-rank CI: for x = 1..10 the estimate is 5.5 and, the table's critical
    /// value at n = 10 being 8 (P(T+ <= 8) = 25/1024 <= 2.5%), the CI runs from the 9th smallest
    /// Walsh average (3) to the 9th largest (8); six values give their range (the smallest n
    /// with a finite 95% interval); five give none.
    #[test]
    fn hodges_lehmann_interval_is_the_exact_signed_rank_one() {
        let x: Vec<f64> = (1..=10).map(|i| i as f64).collect();
        assert_eq!(hodges_lehmann(&x, 0.05), (5.5, 3.0, 8.0));
        let six = [0.3, -1.0, 2.0, 0.5, 4.0, 1.0];
        assert_eq!(hodges_lehmann(&six, 0.05).1, -1.0);
        assert_eq!(hodges_lehmann(&six, 0.05).2, 4.0);
        let five = hodges_lehmann(&six[..5], 0.05);
        assert!(five.1 == f64::NEG_INFINITY && five.2 == f64::INFINITY);
        // Past the exact limit the normal approximation gives a nearly symmetric interval.
        let many: Vec<f64> = (0..1001).map(|i| i as f64 - 500.0).collect();
        let (e, lo, hi) = hodges_lehmann(&many, 0.05);
        assert!(e == 0.0 && lo < -10.0 && (lo + hi).abs() <= 1.0, "{lo} {hi}");
    }

    /// Against scipy 1.17's `beta.ppf(0.025, k, n-k+1)` and `beta.ppf(0.975, k+1, n-k)`.
    #[test]
    fn clopper_pearson_matches_scipy() {
        for (k, n, lo, hi) in [(0, 40, 0.0, 0.08809730287880237), (1, 40, 0.0006327449320494191, 0.13158585848276572), (2, 50, 0.004881433426164382, 0.1371376256039674), (36, 40, 0.7633626001239001, 0.9720745847057807), (40, 40, 0.9119026971211976, 1.0)] {
            let (l, h) = clopper_pearson(k, n);
            assert!((l - lo).abs() < 1e-9 && (h - hi).abs() < 1e-9, "{k}/{n}: ({l}, {h}) vs scipy ({lo}, {hi})");
        }
        assert_eq!(clopper_pearson(0, 0), (0.0, 1.0));
    }

    #[test]
    fn normal_quantiles() {
        assert!((normal_quantile(0.975) - 1.959963984540054).abs() < 1e-12);
        assert!((normal_quantile(0.8) - 0.8416212335729143).abs() < 1e-12);
        assert!(normal_quantile(0.5).abs() < 1e-12);
    }

    #[test]
    fn orders_alternate_within_and_across_groups() {
        let pattern = |group: usize| (0..8).map(|i| if a_first(i, group) { 'A' } else { 'B' }).collect::<String>();
        assert_eq!(pattern(1), "ABABABAB");
        assert_eq!(pattern(2), "ABBAABBA");
        assert_eq!(pattern(4), "ABABBABA");
        assert!(a_started_first(0) && !a_started_first(1) && a_started_first(2));
    }

    /// Looks: 16 -> 32 -> 64 -> 80 is four looks, each at 0.25%; the next target is whole groups.
    #[test]
    fn the_plan_splits_alpha_over_its_looks() {
        let plan = Plan { threshold: 0.015, start: 16, max_pairs: 80 };
        assert_eq!(plan.looks(), 4);
        assert!((plan.alpha() - 0.0025).abs() < 1e-15);
        assert_eq!(plan.next(16, 20, 2), 32);
        assert_eq!(plan.next(16, 47, 2), 48);
        assert_eq!(plan.next(64, 500, 2), 80);
        assert_eq!(Plan { threshold: 0.015, start: 10, max_pairs: 10 }.looks(), 1);
    }

    /// Pairs of one group count once: thirty pairs in three groups give no verdict (fewer than
    /// MIN_GROUPS), the same pairs as thirty groups do.
    #[test]
    fn verdicts_need_enough_groups() {
        let slower: Vec<f64> = (0..30).map(|i| 1.05 + 0.002 * (i % 3) as f64).collect();
        let plan = Plan { threshold: 0.01, start: 10, max_pairs: 40 };
        let three = analyze(&split_groups(&slower, 10), &plan);
        assert_eq!((three.groups, three.verdict), (3, AbVerdict::Inconclusive));
        assert!(three.pairs_needed.unwrap() >= 60, "{three:?}");
        assert_eq!(analyze(&split_groups(&slower, 1), &plan).verdict, AbVerdict::Slower);
    }

    #[test]
    fn verdicts_follow_the_ci() {
        let plan = Plan { threshold: 0.01, start: 10, max_pairs: 40 };
        let same: Vec<f64> = (0..30).map(|i| 1.0 + if i % 2 == 0 { 0.001 } else { -0.001 }).collect();
        assert_eq!(analyze(&split_groups(&same, 1), &plan).verdict, AbVerdict::NoChange);
        let slower: Vec<f64> = (0..20).map(|i| 1.05 + 0.002 * (i % 3) as f64).collect();
        let s = analyze(&split_groups(&slower, 2), &plan);
        assert_eq!(s.verdict, AbVerdict::Slower, "{s:?}");
        assert!(s.min_detectable.is_some_and(|d| d > 0.0 && d < 0.01), "{s:?}");
        let faster: Vec<f64> = slower.iter().map(|r| 1.0 / r).collect();
        assert_eq!(analyze(&split_groups(&faster, 2), &plan).verdict, AbVerdict::Faster);
        let noisy = [1.1, 0.9, 1.05, 0.95, 1.08, 0.93, 1.02, 0.97];
        let s = analyze(&split_groups(&noisy, 1), &plan);
        assert_eq!(s.verdict, AbVerdict::Inconclusive);
        assert!(s.pairs_needed.unwrap() > 8);
    }

    /// Statistical validity on the measured structure (a luck per restart group, pair noise,
    /// outliers): comparisons of identical arms say faster or slower in at most 5% of trials
    /// with the default plan (16 pairs, up to 100, groups of 2), and a real 2% slowdown is
    /// `slower` in >= 90%. Rates are printed for docs/BENCHMARKS.md.
    #[test]
    fn simulated_a_a_rarely_alarms_and_a_2_percent_slowdown_is_slower() {
        let trials = 1000;
        let plan = Plan { threshold: 0.015, start: 16, max_pairs: 100 };
        let (mut aa_alarm, mut aa_no_change, mut slow_detected) = (0, 0, 0);
        let mut slow_pairs = Vec::new();
        for t in 0..trials {
            let s = simulate(&mut NoisyMachine::measured(1000 + t, 2), 0.0, &plan);
            aa_alarm += matches!(s.verdict, AbVerdict::Slower | AbVerdict::Faster) as usize;
            aa_no_change += (s.verdict == AbVerdict::NoChange) as usize;
            let s = simulate(&mut NoisyMachine::measured(5000 + t, 2), 0.02, &plan);
            slow_detected += (s.verdict == AbVerdict::Slower) as usize;
            slow_pairs.push(s.pairs);
        }
        let rate = |k: usize| k as f64 / trials as f64;
        slow_pairs.sort();
        eprintln!(
            "A/A: faster or slower {:.1}%, no change {:.1}% | 2% slowdown: slower {:.1}% (median pairs used {})",
            100.0 * rate(aa_alarm),
            100.0 * rate(aa_no_change),
            100.0 * rate(slow_detected),
            slow_pairs[trials as usize / 2]
        );
        assert!(rate(aa_alarm) <= 0.05, "A/A false alarms {}", rate(aa_alarm));
        assert!(rate(slow_detected) >= 0.9, "2% slowdown detection rate {}", rate(slow_detected));
    }

    #[test]
    fn paired_speedup_is_the_ratio_of_rates_within_each_repetition() {
        // Batch 4 decodes 4 tokens per step in twice batch 1's step time: 2x, whatever each
        // repetition's machine speed (the pairing removes it).
        let reps: Vec<crate::throughput::BatchRep> = (0..8)
            .flat_map(|r| {
                let slow = 1.0 + 0.3 * r as f64;
                [crate::throughput::BatchRep { batch: 1, rep: r, prefill_s: 1.0, step_s: vec![0.010 * slow; 5] }, crate::throughput::BatchRep { batch: 4, rep: r, prefill_s: 1.0, step_s: vec![0.020 * slow; 5] }]
            })
            .collect();
        let (est, lo, hi) = paired_speedup(&reps, 4).unwrap();
        assert!((est - 2.0).abs() < 1e-9 && (lo - 2.0).abs() < 1e-9 && (hi - 2.0).abs() < 1e-9, "{est} {lo} {hi}");
        assert!((reps[1].decode_tok_per_s() - 4.0 * 5.0 / 0.1).abs() < 1e-6);
        assert_eq!(paired_speedup(&reps, 16), None);
        // Two repetitions: an estimate, but no finite interval at 95%.
        let (_, lo, hi) = paired_speedup(&reps[..4], 4).unwrap();
        assert!(lo == 0.0 && hi.is_infinite(), "{lo} {hi}");
    }
}
