//! What the suites found, as typed values: a case's metrics ([`Metrics`]), layer-diff's first
//! divergence and the other sections of its report, fixed-token's token statistics. The suites
//! fill these; only this crate turns them into report.json's JSON (and from there into Markdown,
//! JUnit and CSV), and a command reads a suite's result from these types, never back out of the
//! JSON by key. The JSON shapes are docs/REPORT_SCHEMA.md's.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeMap;

/// A case's measurements, by name (report.json's `metrics` of a case). Values are given typed
/// ([`Metrics::set`]) and become JSON here; reading goes through the map it derefs to.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Metrics(serde_json::Map<String, serde_json::Value>);

impl Metrics {
    pub fn new() -> Metrics {
        Metrics::default()
    }

    /// Sets `key` to `value` (a value that has no JSON form, as a map with keys that are not
    /// strings, is recorded as null; non-finite numbers are null, as JSON has none).
    pub fn set(&mut self, key: impl Into<String>, value: impl Serialize) -> &mut Metrics {
        self.0.insert(key.into(), serde_json::to_value(value).unwrap_or(serde_json::Value::Null));
        self
    }

    /// [`Metrics::set`], by value: `Metrics::new().with("flips", 0).with("positions", 7)`.
    pub fn with(mut self, key: impl Into<String>, value: impl Serialize) -> Metrics {
        self.set(key, value);
        self
    }

    /// Sets `key` unless it is set already.
    pub fn set_default(&mut self, key: &str, value: impl Serialize) {
        if !self.0.contains_key(key) {
            self.set(key, value);
        }
    }

    /// Every metric from `other`, replacing those of the same name.
    pub fn extend(&mut self, other: Metrics) {
        self.0.extend(other.0);
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// A metric as a number (None where absent, null or not a number).
    pub fn f64(&self, key: &str) -> Option<f64> {
        self.0.get(key).and_then(|v| v.as_f64())
    }

    /// A metric as a boolean (None where absent or not a boolean).
    pub fn bool(&self, key: &str) -> Option<bool> {
        self.0.get(key).and_then(|v| v.as_bool())
    }

    /// A metric as a string (None where absent or not a string).
    pub fn str(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.as_str())
    }
}

impl std::ops::Deref for Metrics {
    type Target = serde_json::Map<String, serde_json::Value>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

/// Which of layer-diff's two comparisons a tap's case or its first divergence holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// The device's taps against the oracle's own forward pass (error accumulated with depth).
    Propagated,
    /// Against the oracle re-run on the device's values (each op's own error).
    Isolated,
}

impl Mode {
    /// The name report.json and case ids give it.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Propagated => "propagated",
            Mode::Isolated => "isolated",
        }
    }
}

/// layer-diff's `first_divergence`: the first tap, in execution order, over its budget.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FirstDivergence {
    pub tap: String,
    pub layer: Option<usize>,
    pub kind: String,
    pub compared: Mode,
    pub rms_err: Option<f64>,
    pub bound: Option<f64>,
    pub worst_position: Option<usize>,
    /// The first position whose own error is over the op's budget at that position: where an
    /// error grows step by step (a recurrent state held too coarsely), the step it crossed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_over_position: Option<usize>,
    /// Expert-id taps: positions whose chosen experts differ.
    pub id_mismatches: Option<usize>,
    /// The op that makes the tap, in words.
    pub op: String,
    /// The taps that op reads, among those compared (within their budgets, as this is the first).
    pub inputs: Vec<String>,
    /// The kernel suite's `--filter` for that op, where the suite has it.
    pub kernel_filter: Option<String>,
}

impl FirstDivergence {
    /// `blk.3.ffn_out (isolated): RMS error 2.2e-4, 369x its budget of 6.1e-7, largest at
    /// position 0; made by ... from ... (within their budgets)`.
    pub fn describe(&self) -> String {
        let mut s = format!("{} ({})", self.tap, self.compared.name());
        if let (Some(e), Some(b)) = (self.rms_err, self.bound) {
            let times = match e / b {
                _ if b <= 0.0 => "above".to_string(),
                r if r >= 100.0 => format!("{r:.0}x"),
                r => format!("{r:.2}x"),
            };
            let at = self.worst_position.map_or("-".to_string(), |p| p.to_string());
            s += &format!(": RMS error {e:.3e}, {times} its budget of {b:.3e}, largest at position {at}");
            if let Some(p) = self.first_over_position {
                s += &format!(", first over its budget at position {p}");
            }
        }
        if let Some(n) = self.id_mismatches.filter(|n| *n > 0) {
            s += &format!("; {n} expert ids differ");
        }
        s += &format!("; made by {}", self.op);
        if !self.inputs.is_empty() {
            s += &format!(" from {} (within their budgets)", self.inputs.join(", "));
        }
        s
    }
}

/// `--against`'s `first_difference`: the first tap where two devices differ at all.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FirstDifference {
    pub tap: String,
    pub rms_err: Option<f64>,
    pub worst_position: Option<usize>,
}

/// A tap and a ratio, as the emulated-arithmetic section names its extremes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Departure {
    pub tap: String,
    pub propagated_over_emulated: f64,
}

/// The tap whose propagated budget the declared arithmetic emulated uses most.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TightestBudget {
    pub tap: String,
    pub budget_use: f64,
}

/// Whether a gate was held in a run, and why not.
#[derive(Clone, Debug, PartialEq)]
pub enum Gate {
    /// The gate ran: its case is in the report.
    Held,
    /// It did not apply, for this reason (no case).
    NotApplicable(String),
}

/// layer-diff's `emulated_arithmetic` section: the device's declared arithmetic run on the
/// oracle, or why it could not be.
#[derive(Clone, Debug, PartialEq)]
pub enum Emulation {
    Applied {
        largest_departure: Option<Departure>,
        tightest_budget: Option<TightestBudget>,
        factor: f64,
        floor: f64,
        min_spread: f64,
        /// The `emulated_departure` gate.
        gate: Gate,
    },
    NotApplicable(String),
}

/// [`Emulation`] as report.json has it: `applied: true` with its fields and, where the gate did
/// not apply, `gate` saying why; or `not_applicable`.
#[derive(Serialize, Deserialize)]
struct EmulationJson {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    applied: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    not_applicable: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    largest_departure: Option<Option<Departure>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tightest_budget: Option<Option<TightestBudget>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    floor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    min_spread: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gate: Option<String>,
}

impl Serialize for Emulation {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let json = match self {
            Emulation::NotApplicable(why) => EmulationJson { applied: None, not_applicable: Some(why.clone()), largest_departure: None, tightest_budget: None, factor: None, floor: None, min_spread: None, gate: None },
            Emulation::Applied { largest_departure, tightest_budget, factor, floor, min_spread, gate } => EmulationJson {
                applied: Some(true),
                not_applicable: None,
                largest_departure: Some(largest_departure.clone()),
                tightest_budget: Some(tightest_budget.clone()),
                factor: Some(*factor),
                floor: Some(*floor),
                min_spread: Some(*min_spread),
                gate: match gate {
                    Gate::Held => None,
                    Gate::NotApplicable(why) => Some(why.clone()),
                },
            },
        };
        json.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Emulation {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Emulation, D::Error> {
        let j = EmulationJson::deserialize(d)?;
        Ok(match (j.applied, j.not_applicable) {
            (_, Some(why)) => Emulation::NotApplicable(why),
            _ => Emulation::Applied {
                largest_departure: j.largest_departure.flatten(),
                tightest_budget: j.tightest_budget.flatten(),
                factor: j.factor.unwrap_or(f64::NAN),
                floor: j.floor.unwrap_or(f64::NAN),
                min_spread: j.min_spread.unwrap_or(f64::NAN),
                gate: j.gate.map_or(Gate::Held, Gate::NotApplicable),
            },
        })
    }
}

/// `--against` on a MoE model: the first position where the two devices took other experts,
/// each as the oracle routed as it was at a near tie.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoutingSplit {
    pub tap: String,
    pub position: usize,
    /// Each device's experts there, by device name.
    #[serde(flatten)]
    pub choices: BTreeMap<String, Vec<usize>>,
}

/// The `tap_coverage` section: taps given and expected, by kind and in all.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TapCoverage {
    pub given: usize,
    pub expected: usize,
    pub by_kind: BTreeMap<String, Given>,
    /// The rule the coverage gate holds, as parsed from `--require-taps`.
    pub required: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Given {
    pub given: usize,
    pub expected: usize,
}

/// A number that report.json may hold as null (JSON has no infinity or NaN): read back as NaN.
fn nullable<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// fixed-token's `token_stats` of a run with logits: what llama.cpp's `--kl-divergence` prints,
/// and each position's figures.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenStats {
    pub positions: usize,
    pub kld: KldSummary,
    #[serde(deserialize_with = "nullable")]
    pub kld_bound_mean: f64,
    pub same_top1: SameTop1,
    #[serde(deserialize_with = "nullable")]
    pub top5_overlap_mean: f64,
    pub dp: Quantiles,
    pub near_ties: usize,
    #[serde(deserialize_with = "nullable")]
    pub max_abs_logit: f64,
    #[serde(deserialize_with = "nullable")]
    pub mean_abs_logit: f64,
    pub same_top5: usize,
    pub per_position: Vec<PositionFigures>,
    /// MoE: positions where the device's run chose other experts than the oracle's.
    #[serde(default)]
    pub routing_flips: usize,
    /// MoE: near ties at which the oracle followed the device's choice.
    #[serde(default)]
    pub routing_followed: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KldSummary {
    #[serde(deserialize_with = "nullable")]
    pub mean: f64,
    #[serde(deserialize_with = "nullable")]
    pub median: f64,
    #[serde(deserialize_with = "nullable")]
    pub p99: f64,
    pub max: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SameTop1 {
    pub count: usize,
    #[serde(deserialize_with = "nullable")]
    pub rate: f64,
    pub ci95: [f64; 2],
}

/// The change in the oracle's top token's probability, by percentile.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Quantiles {
    #[serde(deserialize_with = "nullable")]
    pub p1: f64,
    #[serde(deserialize_with = "nullable")]
    pub p5: f64,
    #[serde(deserialize_with = "nullable")]
    pub median: f64,
    #[serde(deserialize_with = "nullable")]
    pub p95: f64,
    #[serde(deserialize_with = "nullable")]
    pub p99: f64,
}

/// One position of [`TokenStats::per_position`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PositionFigures {
    pub pos: usize,
    #[serde(deserialize_with = "nullable")]
    pub kld: f64,
    #[serde(deserialize_with = "nullable")]
    pub kld_bound: f64,
    pub top1_oracle: u32,
    pub top1_device: u32,
    #[serde(deserialize_with = "nullable")]
    pub margin: f64,
    pub near_tie: bool,
    #[serde(deserialize_with = "nullable")]
    pub dp: f64,
}

/// fixed-token's `token_stats`: the statistics of a run with logits, or the ids a token-only
/// engine generated.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenFindings {
    Logits(TokenStats),
    TokenOnly { token_only: bool, generated: Vec<u32> },
}

impl TokenFindings {
    /// The statistics of a run with logits (None for a token-only one).
    pub fn stats(&self) -> Option<&TokenStats> {
        match self {
            TokenFindings::Logits(s) => Some(s),
            TokenFindings::TokenOnly { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emulation_keeps_its_json_shape_both_ways() {
        let applied = Emulation::Applied { largest_departure: None, tightest_budget: Some(TightestBudget { tap: "l_out-1".into(), budget_use: 0.5 }), factor: 4.0, floor: 1e-5, min_spread: 64.0, gate: Gate::NotApplicable("why".into()) };
        let v = serde_json::to_value(&applied).unwrap();
        assert_eq!(v, serde_json::json!({ "applied": true, "largest_departure": null, "tightest_budget": { "tap": "l_out-1", "budget_use": 0.5 }, "factor": 4.0, "floor": 1e-5, "min_spread": 64.0, "gate": "why" }));
        assert_eq!(serde_json::from_value::<Emulation>(v).unwrap(), applied);
        let not = Emulation::NotApplicable("no emulation of q8 activations".into());
        let v = serde_json::to_value(&not).unwrap();
        assert_eq!(v, serde_json::json!({ "not_applicable": "no emulation of q8 activations" }));
        assert_eq!(serde_json::from_value::<Emulation>(v).unwrap(), not);
    }

    #[test]
    fn metrics_hold_typed_values_and_null_for_non_finite() {
        let m = Metrics::new().with("n", 3usize).with("ratio", f64::INFINITY).with("ids", [1u32, 2]).with("tap", "blk.0.l_out");
        assert_eq!(serde_json::to_value(&m).unwrap(), serde_json::json!({ "n": 3, "ratio": null, "ids": [1, 2], "tap": "blk.0.l_out" }));
        assert_eq!((m.f64("n"), m.f64("ratio"), m.str("tap")), (Some(3.0), None, Some("blk.0.l_out")));
    }

    #[test]
    fn a_routing_split_names_each_device_at_the_top_level() {
        let s = RoutingSplit { tap: "blk.1.ffn_moe_topk".into(), position: 4, choices: BTreeMap::from([("cpu".to_string(), vec![0, 2]), ("fixed".to_string(), vec![0, 3])]) };
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v, serde_json::json!({ "tap": "blk.1.ffn_moe_topk", "position": 4, "cpu": [0, 2], "fixed": [0, 3] }));
        assert_eq!(serde_json::from_value::<RoutingSplit>(v).unwrap(), s);
    }

    #[test]
    fn token_stats_read_back_with_null_numbers() {
        let t = TokenFindings::TokenOnly { token_only: true, generated: vec![5, 6] };
        assert_eq!(serde_json::from_value::<TokenFindings>(serde_json::to_value(&t).unwrap()).unwrap(), t);
        let kld = serde_json::from_value::<KldSummary>(serde_json::json!({ "mean": null, "median": 0.0, "p99": 0.0, "max": null })).unwrap();
        assert!(kld.mean.is_nan() && kld.max.is_none());
    }
}
