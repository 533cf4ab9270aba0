//! Two reports of the same suites, case by case (`cargo xtask report compare BASE NEW`): what
//! got worse since a baseline run (the last good commit), beyond what each case's own bound says.
//! A case's measured error is `bound - margin`. A regression is a case that passed and no longer
//! does, a case of the baseline that is gone, or one whose measured error grew more than `factor`
//! times and to more than `floor` of its bound (a growth among errors far below the bound is
//! reported as a change, not a regression). Improvements are listed too.

use crate::{Case, Report, Verdict};
use std::collections::HashMap;

/// How one case changed.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// Passed in the baseline, now fails, errs or is unsupported.
    NoLongerPasses { was: Verdict, now: Verdict },
    /// In the baseline, not in this run.
    Missing,
    /// Measured error grew by `ratio` (> factor) to more than `floor` of the bound.
    Grew { base: f64, now: f64, bound: f64, ratio: f64 },
    /// Measured error grew by more than `factor`, but stays under `floor` of the bound.
    GrewWithinFloor { base: f64, now: f64, bound: f64, ratio: f64 },
    /// Did not pass in the baseline, passes now.
    NowPasses { was: Verdict },
    /// Measured error shrank by more than `factor`.
    Shrank { base: f64, now: f64, ratio: f64 },
    /// Only in this run.
    New,
}

impl Change {
    pub fn is_regression(&self) -> bool {
        matches!(self, Change::NoLongerPasses { .. } | Change::Missing | Change::Grew { .. })
    }
}

/// The comparison: every case that changed (id, device, change), and how many were matched.
#[derive(Clone, Debug, Default)]
pub struct Comparison {
    pub matched: usize,
    pub changes: Vec<(String, String, Change)>,
}

impl Comparison {
    pub fn regressions(&self) -> impl Iterator<Item = &(String, String, Change)> {
        self.changes.iter().filter(|c| c.2.is_regression())
    }
}

/// A case's measured error (`bound - margin`), when both are finite.
fn measured(c: &Case) -> Option<f64> {
    let m = c.tolerance.bound - c.margin;
    (m.is_finite() && c.tolerance.bound.is_finite()).then_some(m.max(0.0))
}

/// Each case keyed by id, device and which occurrence of that pair it is (a report may hold the
/// same pair more than once: `gate` judges the oracle's golden once per device).
fn keyed(r: &Report) -> Vec<((String, String, usize), &Case)> {
    let mut seen: HashMap<(&str, &str), usize> = HashMap::new();
    r.cases
        .iter()
        .map(|c| {
            let n = seen.entry((c.id.as_str(), c.device.as_str())).or_insert(0);
            *n += 1;
            ((c.id.clone(), c.device.clone(), *n - 1), c)
        })
        .collect()
}

/// Compares `new` with `base` case by case (matched on id, device and occurrence).
pub fn compare(base: &Report, new: &Report, factor: f64, floor: f64) -> Comparison {
    let (base, new) = (keyed(base), keyed(new));
    let now: HashMap<&(String, String, usize), &Case> = new.iter().map(|(k, c)| (k, *c)).collect();
    let was: HashMap<&(String, String, usize), &Case> = base.iter().map(|(k, c)| (k, *c)).collect();
    let mut out = Comparison::default();
    for (k, b) in &base {
        let k0 = (k.0.clone(), k.1.clone());
        let Some(n) = now.get(k) else {
            out.changes.push((k0.0, k0.1, Change::Missing));
            continue;
        };
        out.matched += 1;
        let change = if b.verdict == Verdict::Pass && n.verdict != Verdict::Pass {
            Some(Change::NoLongerPasses { was: b.verdict, now: n.verdict })
        } else if b.verdict != Verdict::Pass && n.verdict == Verdict::Pass {
            Some(Change::NowPasses { was: b.verdict })
        } else if let (Some(mb), Some(mn)) = (measured(b), measured(n)) {
            let bound = n.tolerance.bound;
            if mn > factor * mb {
                let ratio = if mb > 0.0 { mn / mb } else { f64::INFINITY };
                Some(if mn > floor * bound { Change::Grew { base: mb, now: mn, bound, ratio } } else { Change::GrewWithinFloor { base: mb, now: mn, bound, ratio } })
            } else if mb > factor * mn {
                Some(Change::Shrank { base: mb, now: mn, ratio: if mn > 0.0 { mb / mn } else { f64::INFINITY } })
            } else {
                None
            }
        } else {
            None
        };
        if let Some(c) = change {
            out.changes.push((k0.0, k0.1, c));
        }
    }
    for (k, n) in &new {
        if !was.contains_key(k) {
            out.changes.push((n.id.clone(), n.device.clone(), Change::New));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Provenance, Tolerance};

    fn case(id: &str, verdict: Verdict, bound: f64, measured: f64) -> Case {
        Case { id: id.into(), device: "cpu".into(), verdict, metrics: Default::default(), tolerance: Tolerance { rule: "r".into(), bound }, margin: bound - measured, message: None }
    }

    fn report(cases: Vec<Case>) -> Report {
        Report::new("kernels", Provenance::collect(1), cases)
    }

    #[test]
    fn each_kind_of_change_is_found_and_only_regressions_count() {
        let base = report(vec![
            case("same", Verdict::Pass, 1.0, 0.1),
            case("grew", Verdict::Pass, 1.0, 0.01),
            case("grew_tiny", Verdict::Pass, 1.0, 1e-6),
            case("fails", Verdict::Pass, 1.0, 0.5),
            case("gone", Verdict::Pass, 1.0, 0.1),
            case("fixed", Verdict::Fail, 1.0, 2.0),
            case("shrank", Verdict::Pass, 1.0, 0.5),
        ]);
        let new = report(vec![
            case("same", Verdict::Pass, 1.0, 0.12),
            case("grew", Verdict::Pass, 1.0, 0.3),
            case("grew_tiny", Verdict::Pass, 1.0, 1e-4),
            case("fails", Verdict::Fail, 1.0, 1.5),
            case("fixed", Verdict::Pass, 1.0, 0.5),
            case("shrank", Verdict::Pass, 1.0, 0.05),
            case("added", Verdict::Pass, 1.0, 0.1),
        ]);
        let c = compare(&base, &new, 2.0, 0.01);
        assert_eq!(c.matched, 6);
        let of = |id: &str| c.changes.iter().find(|x| x.0 == id).map(|x| x.2.clone());
        assert_eq!(of("same"), None);
        assert!(matches!(of("grew"), Some(Change::Grew { ratio, .. }) if (ratio - 30.0).abs() < 1e-9));
        assert!(matches!(of("grew_tiny"), Some(Change::GrewWithinFloor { .. })));
        assert_eq!(of("fails"), Some(Change::NoLongerPasses { was: Verdict::Pass, now: Verdict::Fail }));
        assert_eq!(of("gone"), Some(Change::Missing));
        assert_eq!(of("fixed"), Some(Change::NowPasses { was: Verdict::Fail }));
        assert!(matches!(of("shrank"), Some(Change::Shrank { .. })));
        assert_eq!(of("added"), Some(Change::New));
        let mut reg: Vec<&str> = c.regressions().map(|x| x.0.as_str()).collect();
        reg.sort();
        assert_eq!(reg, ["fails", "gone", "grew"]);
        assert_eq!(compare(&base, &base, 2.0, 0.01).changes, vec![]);
    }

    /// A pair (id, device) that occurs twice is matched occurrence by occurrence.
    #[test]
    fn repeated_cases_are_matched_in_order() {
        let base = report(vec![case("golden", Verdict::Pass, 1.0, 0.0), case("golden", Verdict::Pass, 1.0, 0.0)]);
        let new = report(vec![case("golden", Verdict::Pass, 1.0, 0.0), case("golden", Verdict::Fail, 1.0, 2.0)]);
        let c = compare(&base, &new, 2.0, 0.01);
        assert_eq!(c.matched, 2);
        assert_eq!(c.changes, vec![("golden".to_string(), "cpu".to_string(), Change::NoLongerPasses { was: Verdict::Pass, now: Verdict::Fail })]);
        assert_eq!(compare(&base, &report(vec![case("golden", Verdict::Pass, 1.0, 0.0)]), 2.0, 0.01).changes.len(), 1, "the second is missing");
    }
}
