//! What `ab` prints and writes: the summary and per-group tables, the verdict in words, report.json and its chart.

use super::*;
use reports::plot::{Chart, Series};
use reports::{Case, Provenance, Report, Tolerance, Verdict};
use serde_json::json;
use suites::ab::{self, AbVerdict};

pub(super) fn pct(x: f64) -> String {
    format!("{:+.2}%", x * 100.0)
}

/// A 95% CI in words: unbounded below six groups.
pub(super) fn ci_words((lo, hi): (f64, f64)) -> String {
    if lo.is_finite() && hi.is_finite() && lo > -1.0 {
        format!("95% CI {} .. {}", pct(lo), pct(hi))
    } else {
        format!("95% CI unbounded: fewer than {} restart groups", ab::MIN_GROUPS)
    }
}

/// One restart group (`--respawn-every` pairs: one lifetime of each arm's server process).
pub(super) struct Group {
    pub(super) first_pair: usize,
    pub(super) pairs: usize,
    /// The median of its pairs' changes.
    pub(super) median: f64,
    /// B's summed metric over A's, less one: the group's loss as users publish it per restart.
    pub(super) summed: f64,
}

/// The pairs in consecutive groups of `every` (at least 1): whether a change holds in every
/// process lifetime, or one lifetime's luck with memory placement carries it.
pub(super) fn groups(pairs: &[Pair], m: Metric, every: usize) -> Vec<Group> {
    let every = every.max(1);
    pairs
        .chunks(every)
        .enumerate()
        .map(|(i, g)| {
            let changes: Vec<f64> = g.iter().map(|p| p.change(m)).collect();
            let (sa, sb) = g.iter().fold((0.0, 0.0), |(sa, sb), p| (sa + m.of(&p.a), sb + m.of(&p.b)));
            Group { first_pair: i * every + 1, pairs: g.len(), median: suites::throughput::median(&changes), summed: sb / sa - 1.0 }
        })
        .collect()
}

pub(super) fn print_table(a: &AbArgs, pairs: &[Pair], s: &ab::AbStats, first_difference: Option<usize>, stop: Stop) {
    let m = a.metric;
    let (name_a, name_b) = names(a);
    outln!("{}", summary_title(a, pairs));
    let rows = summary_rows(a, pairs, &name_a, &name_b);
    let widths: Vec<usize> = (0..SUMMARY_COLUMNS.len()).map(|i| rows.iter().map(|r| r[i].chars().count()).chain([SUMMARY_COLUMNS[i].chars().count()]).max().unwrap_or(0)).collect();
    let line = |cells: &[String]| cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect::<Vec<_>>().join("  ");
    outln!("{}", line(&SUMMARY_COLUMNS.map(String::from)));
    for r in &rows {
        outln!("{}", line(r));
    }
    outln!();
    outln!("pair  order   A {unit}   B {unit}   change", unit = m.unit());
    for (i, p) in pairs.iter().enumerate() {
        outln!("{:>4}  {}   {:>10.3}   {:>10.3}   {}", i + 1, if p.a_first { "A,B" } else { "B,A" }, m.of(&p.a), m.of(&p.b), pct(p.change(m)));
    }
    if pairs.is_empty() {
        outln!("B ({name_b}) vs A ({name_a}): no pair completed, nothing to compare");
        return;
    }
    outln!("B ({name_b}) vs A ({name_a}), {}: {}", m.words(), verdict_words(a, s, stop));
    outln!("{}", rule_words(a, s));
    let g = groups(pairs, m, a.group_size());
    if g.len() > 1 && a.group_size() > 1 {
        let slower = g.iter().filter(|g| g.summed > 0.0).count();
        outln!("per restart group of {} pairs, B's summed {} over A's: {} ({slower} of {} groups slower)", a.group_size(), m.unit(), g.iter().map(|g| pct(g.summed)).collect::<Vec<_>>().join(", "), g.len());
    }
    if let (Some(p), Some(at)) = (pairs.first(), first_difference) {
        outln!("outputs differ from generated token {at}: A hash {}, B hash {}", hash(&p.a.tokens), hash(&p.b.tokens));
    } else if let Some(p) = pairs.first() {
        outln!("outputs identical in every run: hash {}", hash(&p.a.tokens));
    }
}

/// Why the pairs ended where they did.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Stop {
    /// The statistics decided (or the planned pairs ran).
    Decided,
    /// `--max-pairs` ran without a decision.
    MaxPairs,
    /// Outputs differed (arm from arm, or a run from its arm's first): more pairs cannot make
    /// the comparison valid.
    OutputsDiffer,
    /// An arm failed or could not be restarted.
    ArmFailed,
}

impl Stop {
    fn words(self, a: &AbArgs, pairs: usize) -> String {
        let pairs = if pairs == 1 { "1 pair".to_string() } else { format!("{pairs} pairs") };
        match self {
            Stop::Decided => format!("stopped after {pairs}"),
            Stop::MaxPairs => format!("--max-pairs {} reached", a.max_pairs),
            Stop::OutputsDiffer => format!("stopped after {pairs} because the outputs differ"),
            Stop::ArmFailed => format!("stopped after {pairs} because an arm failed"),
        }
    }
}

/// The verdict in one line: the change, its CI and p over restart groups, the verdict, and why
/// the pairs ended where they did when more would have decided.
pub(super) fn verdict_words(a: &AbArgs, s: &ab::AbStats, stop: Stop) -> String {
    format!(
        "change {} ({}), signed-rank p = {:.4} over {} restart groups of {} pairs, threshold ±{}% -> {}{}",
        pct(s.median_change),
        ci_words(s.ci95),
        s.p_value,
        s.groups,
        s.pairs,
        a.threshold,
        s.verdict.words().to_uppercase(),
        s.pairs_needed.map(|n| format!(" (about {n} pairs would decide; {})", stop.words(a, s.pairs))).unwrap_or_default()
    )
}

/// How the verdict is reached and what this setup can resolve, in words.
pub(super) fn rule_words(a: &AbArgs, s: &ab::AbStats) -> String {
    let unit = if a.group_size() > 1 { format!("a restart group ({} pairs sharing one lifetime of both arms' processes) counts once", a.group_size()) } else if a.respawn_every == 0 && !(a.a.starts_with("exec:") && a.b.starts_with("exec:")) { "every pair counts once (--respawn-every 0: the pairs share one process lifetime, so the CI may be too narrow)".to_string() } else { "every pair counts once (each run a fresh process)".to_string() };
    let mde = match s.min_detectable {
        Some(d) => format!("with this run's spread between groups, {} pairs would detect a change of about {} with 80% power", a.max_pairs.max(s.pairs), pct(d).trim_start_matches('+')),
        None => "too few groups to estimate the smallest detectable change".to_string(),
    };
    format!("rule: {unit}; Hodges-Lehmann estimate and exact signed-rank 95% CI; faster/slower needs p < {:.4} (1% over {} looks) and a CI reaching past the threshold; no change needs the CI inside it; {mde}", s.alpha, a.plan().looks())
}

/// The arms' labels: `--a-name`/`--b-name`, else their specs.
pub(super) fn names(a: &AbArgs) -> (String, String) {
    (a.a_name.clone().unwrap_or_else(|| a.a.clone()), a.b_name.clone().unwrap_or_else(|| a.b.clone()))
}

pub(super) const SUMMARY_COLUMNS: [&str; 9] = ["arm", "decode tok/s (mean, stalls in)", "fastest step ms/token", "prefill tok/s", "TTFT ms", "ITL p50 / p90 / p99 ms", "peak RSS MiB (arm process)", "output hash", "runs"];

/// What the summary table covers: model, lengths, the compared metric.
pub(super) fn summary_title(a: &AbArgs, pairs: &[Pair]) -> String {
    let (n_prompt, n_gen) = pairs.first().map_or((a.prompt_len[0], a.gen_len), |p| (p.a.n_prompt, p.a.n_gen));
    format!("Summary: {} with a {n_prompt}-token prompt and {n_gen} generated tokens; medians over runs (the verdict compares {})", a.model, a.metric.words())
}

/// One row per arm (medians over its runs), then B's change in each figure (median of the
/// paired changes, with its bootstrap 95% CI) and the verdict's metric marked.
pub(super) fn summary_rows(a: &AbArgs, pairs: &[Pair], name_a: &str, name_b: &str) -> Vec<Vec<String>> {
    let med = |v: Vec<f64>| suites::throughput::median(&v);
    let arm_row = |name: &str, arm: fn(&Pair) -> &RunSample| -> Vec<String> {
        if pairs.is_empty() {
            return vec![name.to_string(), "-".into(), "-".into(), "-".into(), "-".into(), "-".into(), "-".into(), "-".into(), "0".into()];
        }
        let runs: Vec<&RunSample> = pairs.iter().map(arm).collect();
        let mut steps: Vec<f64> = runs.iter().flat_map(|r| r.step_ms.iter().copied()).filter(|x| x.is_finite()).collect();
        steps.sort_by(f64::total_cmp);
        let q = |p: f64| steps.get(((steps.len() as f64 - 1.0) * p).round() as usize).copied();
        let itl = match (q(0.5), q(0.9), q(0.99)) {
            (Some(a), Some(b), Some(c)) => format!("{a:.2} / {b:.2} / {c:.2}"),
            _ => "-".into(),
        };
        let rss = runs.iter().filter_map(|r| r.peak_rss_kb).max().map_or("-".into(), |k| format!("{:.0}", k as f64 / 1024.0));
        vec![
            name.to_string(),
            format!("{:.1}", med(runs.iter().map(|r| 1000.0 / r.mean_ms_per_token()).collect())),
            format!("{:.3}", med(runs.iter().map(|r| r.ms_per_token()).collect())),
            format!("{:.0}", med(runs.iter().map(|r| r.n_prompt as f64 * 1000.0 / r.prefill_ms.max(1e-9)).collect())),
            format!("{:.2}", med(runs.iter().map(|r| r.prefill_ms).collect())),
            itl,
            rss,
            hash(&runs[0].tokens),
            runs.len().to_string(),
        ]
    };
    let mut rows = vec![arm_row(&format!("A: {name_a}"), |p| &p.a), arm_row(&format!("B: {name_b}"), |p| &p.b)];
    if pairs.len() >= 2 {
        // B's change in `m`; `as_rate`: a change of time per token turned into one of tok/s (a
        // time 10% longer is a rate 9.09% lower; the CI's ends swap).
        let change = |m: Metric, as_rate: bool| {
            let st = a.stats(pairs, m);
            let f = |t: f64| if as_rate { 1.0 / (1.0 + t) - 1.0 } else { t };
            let ci = if as_rate { (f(st.ci95.1), f(st.ci95.0)) } else { st.ci95 };
            let mark = if m == a.metric { format!(" **{}**", st.verdict.words()) } else { String::new() };
            format!("{} ({}){mark}", pct(f(st.median_change)), ci_words(ci).trim_start_matches("95% CI "))
        };
        let prefill: Vec<f64> = pairs.iter().map(|p| p.b.prefill_ms / p.a.prefill_ms - 1.0).collect();
        rows.push(vec![
            "B's change (95% CI)".into(),
            change(Metric::Mean, true),
            change(Metric::FastestStep, false),
            String::new(),
            format!("{} (median)", pct(med(prefill))),
            String::new(),
            String::new(),
            if pairs[0].a.tokens == pairs[0].b.tokens { "identical".into() } else { "differ".into() },
            String::new(),
        ]);
    }
    rows
}

pub(super) fn build_report(a: &AbArgs, pairs: &[Pair], s: &ab::AbStats, first_difference: Option<usize>, problem: Option<String>, stop: Stop) -> Report {
    let verdict = match (&problem, s.verdict) {
        (Some(_), _) => Verdict::Error,
        (None, AbVerdict::Slower) => Verdict::Fail,
        (None, AbVerdict::Inconclusive) => Verdict::Inconclusive,
        (None, _) => Verdict::Pass,
    };
    let mut metrics = reports::Metrics::new();
    metrics.set("median_change", s.median_change);
    metrics.set("ci95", [s.ci95.0, s.ci95.1]);
    metrics.set("p_value", s.p_value);
    metrics.set("pairs", s.pairs);
    let case = Case {
        id: format!("ab(metric={},a={},b={},model={})", a.metric.id(), a.a, a.b, a.model),
        device: format!("{} vs {}", a.b, a.a),
        verdict,
        metrics,
        tolerance: Tolerance { rule: format!("no change if the 95% CI of the median change lies inside ±{}%", a.threshold), bound: s.threshold },
        margin: s.threshold - s.median_change,
        message: problem.clone().or_else(|| Some(verdict_words(a, s, stop))),
    };
    let mut r = Report::new("ab", Provenance::collect(rayon::current_num_threads()), vec![case]);
    let (name_a, name_b) = names(a);
    let mut notes = vec![format!("**{}**: {}", a.metric.words(), verdict_words(a, s, stop)), rule_words(a, s)];
    if let Some(p) = &problem {
        notes.insert(0, format!("**Could not compare**: {p}"));
    }
    if let (Some(p), Some(at)) = (pairs.first(), first_difference) {
        notes.push(format!("Outputs differ from generated token {at}: A hash {}, B hash {}.", hash(&p.a.tokens), hash(&p.b.tokens)));
    }
    r.add_lead_table("ab_summary", &summary_title(a, pairs), &SUMMARY_COLUMNS, summary_rows(a, pairs, &name_a, &name_b), &notes);
    let samples: Vec<serde_json::Value> = pairs.iter().enumerate().map(|(i, p)| json!({ "pair": i + 1, "order": if p.a_first { "AB" } else { "BA" }, "a": p.a, "b": p.b, "change": p.change(a.metric) })).collect();
    r.sections.insert(
        "ab".into(),
        json!({
            "a": a.a, "b": a.b, "model": a.model, "metric": a.metric.words(), "threshold": s.threshold,
            "stats": s, "verdict": s.verdict.words(),
            "tokens_hash": { "a": pairs.first().map(|p| hash(&p.a.tokens)), "b": pairs.first().map(|p| hash(&p.b.tokens)) },
            "first_output_difference": first_difference,
            "pairs": samples,
        }),
    );
    let mut rows: Vec<Vec<String>> = pairs
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (ra, rb) = (a.metric.of(&p.a), a.metric.of(&p.b));
            vec![
                (i + 1).to_string(),
                if p.a_first { "A,B".into() } else { "B,A".into() },
                format!("{ra:.3}"),
                format!("{rb:.3}"),
                pct(rb / ra - 1.0),
                pct(p.b.mean_ms_per_token() / p.a.mean_ms_per_token() - 1.0),
                format!("{:.1} / {:.1}", p.a.prefill_ms, p.b.prefill_ms),
            ]
        })
        .collect();
    rows.push(vec![
        "**summary**".into(),
        format!("{} pairs", pairs.len()),
        String::new(),
        String::new(),
        format!("{} groups: {} ({}), p = {:.4}: **{}**", s.groups, pct(s.median_change), ci_words(s.ci95), s.p_value, s.verdict.words()),
        String::new(),
        String::new(),
    ]);
    let (col_a, col_b) = (format!("A {}", a.metric.unit()), format!("B {}", a.metric.unit()));
    r.add_detail_table("ab_table", &format!("Per pair: A = {name_a} (`{}`), B = {name_b} (`{}`), {}", a.a, a.b, a.metric.words()), &["pair", "order", &col_a, &col_b, "change", "change of mean ms/token", "prefill ms A / B"], rows);
    let group_rows: Vec<Vec<String>> = groups(pairs, a.metric, a.group_size())
        .iter()
        .enumerate()
        .map(|(i, g)| vec![(i + 1).to_string(), format!("{}-{}", g.first_pair, g.first_pair + g.pairs - 1), pct(g.median), pct(g.summed)])
        .collect();
    // `exec:` arms run a fresh process per run: restart groups are a server arm's.
    if a.group_size() > 1 && group_rows.len() > 1 {
        r.add_detail_table("ab_groups", &format!("Per restart group (`--respawn-every {}`: one lifetime of each arm's server process; the statistics' unit)", a.respawn_every), &["group", "pairs", "median change", "B's summed over A's"], group_rows);
    }
    let changes: Vec<(f64, f64)> = pairs.iter().enumerate().map(|(i, p)| ((i + 1) as f64, 100.0 * p.change(a.metric))).collect();
    let n = pairs.len().max(1) as f64;
    r.add_chart(
        "ab_changes",
        Chart {
            title: format!("B vs A per pair ({}: {})", s.verdict.words(), pct(s.median_change)),
            x_label: "pair".into(),
            y_label: format!("change of {} (%)", a.metric.unit()),
            log_y: false,
            series: vec![
                Series { name: "B/A - 1 per pair".into(), points: changes, colour: 0, dashed: false },
                Series { name: "median".into(), points: vec![(1.0, 100.0 * s.median_change), (n, 100.0 * s.median_change)], colour: 3, dashed: false },
                Series { name: "±threshold (band: 95% CI)".into(), points: vec![(1.0, 100.0 * s.threshold), (n, 100.0 * s.threshold)], colour: 7, dashed: true },
                Series { name: "±threshold (band: 95% CI)".into(), points: vec![(1.0, -100.0 * s.threshold), (n, -100.0 * s.threshold)], colour: 7, dashed: true },
            ],
            band: Some((100.0 * s.ci95.0, 100.0 * s.ci95.1)),
            markers: Vec::new(),
            panels: false,
        },
    );
    let quantiles = |arm: fn(&Pair) -> &RunSample| -> Vec<(f64, f64)> {
        let mut v: Vec<f64> = pairs.iter().flat_map(|p| arm(p).step_ms.iter().copied()).collect();
        if v.is_empty() {
            v = pairs.iter().map(|p| arm(p).ms_per_token()).collect();
        }
        v.sort_by(f64::total_cmp);
        let len = v.len().max(1) as f64;
        v.iter().enumerate().map(|(i, x)| (100.0 * (i as f64 + 0.5) / len, *x)).collect()
    };
    r.add_chart(
        "ab_decode_latency",
        Chart {
            title: "decode latency distribution (per token, all runs)".into(),
            x_label: "percentile".into(),
            y_label: "ms per token".into(),
            log_y: false,
            series: vec![Series { name: format!("A: {}", a.a), points: quantiles(|p| &p.a), colour: 0, dashed: false }, Series { name: format!("B: {}", a.b), points: quantiles(|p| &p.b), colour: 1, dashed: false }],
            band: None,
            markers: Vec::new(),
            panels: false,
        },
    );
    r
}
