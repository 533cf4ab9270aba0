//! Tap coverage: which of the oracle's taps a device gave, by kind, and the rule that requires
//! some of them (`--require-taps`). A tap the device did not give is reported as missing, never
//! as a pass; without a rule, an engine that dumps only its logits would pass layer-diff with
//! every layer unjudged. The gate case `layer_diff(model=M,gate=tap_coverage)` fails when a
//! required tap is missing.

use crate::layerdiff::TapDiff;
use oracle::taps::TapKind;
use reports::{Case, Tolerance, Verdict};
use reports::findings::{Given, TapCoverage};
use reports::Metrics;

/// The rule `--require-taps layers` names: every layer's output and the logits. An engine that
/// dumps them is judged layer by layer (the first divergence names a layer, if not the op); one
/// that dumps less fails.
pub const LAYERS: &str = "l_out,result_output";

/// The rule when none is given: `layers`. An engine that dumps only its logits fails unless
/// the user says `--require-taps none`.
pub const DEFAULT: &str = "layers";

/// Which taps must be given.
#[derive(Clone, Debug, PartialEq)]
pub enum RequiredTaps {
    /// Every tap the oracle records.
    All,
    /// Every tap of these kinds (`l_out`, `attn_out`, ...; `result_output` for the logits).
    Kinds(Vec<TapKind>),
    /// At least this fraction of the oracle's taps, in (0, 1].
    Fraction(f64),
    /// Nothing required (`none`): coverage is reported, not gated.
    Nothing,
}

impl std::str::FromStr for RequiredTaps {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        match s {
            "layers" => return LAYERS.parse(),
            "all" => return Ok(RequiredTaps::All),
            "none" => return Ok(RequiredTaps::Nothing),
            _ => {}
        }
        if let Ok(f) = s.parse::<f64>() {
            return if f > 0.0 && f <= 1.0 { Ok(RequiredTaps::Fraction(f)) } else { Err(format!("--require-taps {s}: a fraction must be in (0, 1]")) };
        }
        s.split(',')
            .map(|k| {
                TapKind::parse(k.trim()).ok_or_else(|| {
                    let all: Vec<&str> = TapKind::ALL.iter().map(|k| k.name()).collect();
                    format!("--require-taps: no tap kind `{}` (all, layers, none, a fraction such as 0.9, or a comma list of: {})", k.trim(), all.join(", "))
                })
            })
            .collect::<Result<Vec<TapKind>, String>>()
            .map(RequiredTaps::Kinds)
    }
}

/// Per kind, (taps given, taps the oracle has), in the oracle's order of first appearance.
pub fn by_kind(taps: &[TapDiff]) -> Vec<(TapKind, usize, usize)> {
    let mut out: Vec<(TapKind, usize, usize)> = Vec::new();
    for t in taps {
        let i = match out.iter().position(|(k, _, _)| *k == t.kind) {
            Some(i) => i,
            None => {
                out.push((t.kind, 0, 0));
                out.len() - 1
            }
        };
        out[i].2 += 1;
        out[i].1 += usize::from(!t.missing);
    }
    out
}

/// The `tap_coverage` report section: per kind, given and expected, and the totals.
pub fn section(taps: &[TapDiff], rule: &RequiredTaps) -> TapCoverage {
    let by_kind = by_kind(taps).into_iter().map(|(k, given, expected)| (k.name().to_string(), Given { given, expected })).collect();
    TapCoverage { given: taps.iter().filter(|t| !t.missing).count(), expected: taps.len(), by_kind, required: format!("{rule:?}") }
}

/// The coverage gate: fails when a required tap is missing (naming how many of each kind), and
/// when the oracle has no tap at all to require. None under [`RequiredTaps::Nothing`].
pub fn case(taps: &[TapDiff], rule: &RequiredTaps, model: &str, device: &str) -> Option<Case> {
    let given = taps.iter().filter(|t| !t.missing).count();
    let fraction = if taps.is_empty() { 0.0 } else { given as f64 / taps.len() as f64 };
    let (rule_text, bound, missing): (String, f64, Vec<String>) = match rule {
        RequiredTaps::Nothing => return None,
        RequiredTaps::All => ("every tap given".into(), 1.0, missing_kinds(taps, |_| true)),
        RequiredTaps::Kinds(kinds) => (format!("every tap of kinds {} given", kinds.iter().map(|k| k.name()).collect::<Vec<_>>().join(", ")), 1.0, missing_kinds(taps, |k| kinds.contains(&k))),
        RequiredTaps::Fraction(f) => (format!("at least {:.0}% of the taps given", f * 100.0), *f, if fraction + 1e-12 >= *f { Vec::new() } else { vec![format!("{} of {} taps given", given, taps.len())] }),
    };
    let required_present = match rule {
        RequiredTaps::Kinds(kinds) => taps.iter().any(|t| kinds.contains(&t.kind)),
        _ => true,
    };
    let pass = !taps.is_empty() && required_present && missing.is_empty();
    let message = if taps.is_empty() {
        Some("the oracle recorded no tap".to_string())
    } else if !required_present {
        Some("this model has no tap of the required kinds".to_string())
    } else if !missing.is_empty() {
        Some(format!("missing: {} (give them in the dump, or choose what to require with --require-taps)", missing.join(", ")))
    } else {
        None
    };
    let metrics = Metrics::new().with("taps_given", given).with("taps_expected", taps.len()).with("fraction_given", fraction);
    Some(Case {
        id: format!("layer_diff(model={model},gate=tap_coverage)"),
        device: device.to_string(),
        verdict: if pass { Verdict::Pass } else { Verdict::Fail },
        metrics,
        tolerance: Tolerance { rule: rule_text, bound },
        margin: fraction - bound,
        message,
    })
}

/// `N of M kind` for every kind that `required` selects and that has a missing tap.
fn missing_kinds(taps: &[TapDiff], required: impl Fn(TapKind) -> bool) -> Vec<String> {
    by_kind(taps).into_iter().filter(|(k, given, of)| required(*k) && given < of).map(|(k, given, of)| format!("{} of {of} {k}", of - given)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use oracle::taps::TapName;

    fn tap(name: &str, missing: bool) -> TapDiff {
        TapDiff { missing, ..TapDiff::uncompared(TapName::parse(name).unwrap()) }
    }

    /// Two layers' taps, of which `given` are given.
    fn model(given: &dyn Fn(&str) -> bool) -> Vec<TapDiff> {
        let mut names = vec!["inp_embd".to_string()];
        for i in 0..2 {
            names.extend(["attn_norm", "attn_kqv", "attn_out", "ffn_inp", "ffn_out", "l_out"].map(|k| format!("blk.{i}.{k}")));
        }
        names.extend(["result_norm".to_string(), "result_output".to_string()]);
        names.iter().map(|n| tap(n, !given(n))).collect()
    }

    #[test]
    fn an_engine_that_dumps_only_its_logits_fails_the_default_rule() {
        let rule: RequiredTaps = DEFAULT.parse().unwrap();
        let logits_only = model(&|n| n == "result_output" || n == "inp_embd");
        let c = case(&logits_only, &rule, "m", "d").unwrap();
        assert_eq!(c.verdict, Verdict::Fail);
        assert!(c.message.as_deref().unwrap().contains("2 of 2 l_out"), "{:?}", c.message);
        let layers = model(&|n| n.ends_with("l_out") || n == "result_output");
        assert_eq!(case(&layers, &rule, "m", "d").unwrap().verdict, Verdict::Pass);
        assert_eq!(case(&layers, &RequiredTaps::All, "m", "d").unwrap().verdict, Verdict::Fail);
        assert_eq!(case(&layers, &RequiredTaps::Fraction(0.2), "m", "d").unwrap().verdict, Verdict::Pass);
        assert_eq!(case(&layers, &RequiredTaps::Fraction(0.25), "m", "d").unwrap().verdict, Verdict::Fail);
        assert_eq!(case(&model(&|_| true), &RequiredTaps::All, "m", "d").unwrap().verdict, Verdict::Pass);
        assert!(case(&logits_only, &RequiredTaps::Nothing, "m", "d").is_none());
        // No tap to require is not a pass.
        assert_eq!(case(&[], &RequiredTaps::All, "m", "d").unwrap().verdict, Verdict::Fail);
        let by = by_kind(&layers);
        assert_eq!(by.iter().find(|(k, _, _)| *k == TapKind::LOut), Some(&(TapKind::LOut, 2, 2)));
        assert_eq!(by.iter().find(|(k, _, _)| *k == TapKind::AttnOut), Some(&(TapKind::AttnOut, 0, 2)));
    }

    #[test]
    fn parses_rules_and_refuses_unknown_kinds_and_bad_fractions() {
        assert_eq!("all".parse::<RequiredTaps>(), Ok(RequiredTaps::All));
        assert_eq!("0.5".parse::<RequiredTaps>(), Ok(RequiredTaps::Fraction(0.5)));
        assert_eq!("layers".parse::<RequiredTaps>(), Ok(RequiredTaps::Kinds(vec![TapKind::LOut, TapKind::ResultOutput])));
        assert_eq!(DEFAULT.parse::<RequiredTaps>(), "layers".parse::<RequiredTaps>());
        assert_eq!("none".parse::<RequiredTaps>(), Ok(RequiredTaps::Nothing));
        assert!("1.5".parse::<RequiredTaps>().unwrap_err().contains("(0, 1]"));
        assert!("l_out,blk_out".parse::<RequiredTaps>().unwrap_err().contains("no tap kind `blk_out`"));
    }
}
