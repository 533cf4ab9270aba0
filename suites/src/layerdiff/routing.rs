//! MoE routing: following a device's expert choice where it differs from the oracle's only at a near tie, and the isolated re-run's tap.

use super::*;
use devices::Arithmetic;
use oracle::{RecordingTap, Tap};

/// One token whose experts the oracle took from the device instead of choosing its own: the two
/// choices differ only at a near tie (see [`follow_at_near_tie`]).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct RoutingFollow {
    /// The `blk.L.ffn_moe_topk` tap.
    pub tap: String,
    pub position: usize,
    /// The oracle's choice and the device's, best first.
    pub oracle: Vec<usize>,
    pub device: Vec<usize>,
    /// How far apart (in the oracle's scores) the experts the two choices swap are, and how far
    /// apart they may be for the device's error to explain the swap: its recorded scores' error
    /// in those two experts (or, without recorded scores, what its score budget allows).
    pub margin: f64,
    pub tolerance: f64,
    /// `propagated` (the oracle's own run), `isolated` (its re-run on the device's inputs) or
    /// `teacher-forced` (fixed-token's re-run).
    pub run: &'static str,
}

/// Whether the oracle should take the device's expert choice `device` instead of its own
/// (`routing`: its scores, what its choice ranks — the scores plus any choice bias, DeepSeek
/// V3's — and its experts best first) for one token: when they differ only at a near tie. Let d
/// be the expert the device dropped with the highest rank and t the one it took with the lowest;
/// the choices are `margin = choice[d] - choice[t]` apart (at least 0), plus, where t's group was
/// not kept, how far that group fell short — or, where less, how far d's group stood above the
/// best group left out (the device may have left d's whole group out). A device that ranks its own scores correctly can only
/// have swapped them if its scores of d and t are off by at least that much together (a bias is
/// the same on both sides; two groups' scores by at most four times its largest error), so where
/// the device recorded its scores (`device_probs`, the `ffn_moe_probs` row) the swap is followed
/// when the margin is within their observed error (plus f32 rounding): then a top-k or group bug still shows as a mismatch, and the scores' error
/// is judged by their own tap. Without recorded scores, the scores' `budget` (an RMS bound, so
/// one score may be off by sqrt(n) times it and a pair by sqrt(2n)) sets the tolerance. Returns
/// (margin, tolerance) when it should follow.
pub fn follow_at_near_tie(routing: &oracle::ops::Routing, device: &[usize], device_probs: Option<&[f32]>, budget: Option<Budget>) -> Option<(f64, f64)> {
    let (probs, choice, oracle) = (&routing.probs, &routing.choice, &routing.experts);
    if choice.len() != probs.len() {
        return None;
    }
    let pick = |ids: &[usize], other: &[usize], best: bool| {
        let outside = ids.iter().copied().filter(|e| !other.contains(e));
        if best { outside.max_by(|&a, &b| choice[a].total_cmp(&choice[b])) } else { outside.min_by(|&a, &b| choice[a].total_cmp(&choice[b])) }
    };
    // The same set (or nothing comparable): nothing to follow.
    let (d, t) = (pick(oracle, device, true)?, pick(device, oracle, false)?);
    // Taken by rank (t's group let in, if it was not kept), or d's whole group left out.
    let by_rank = (choice[d] - choice[t]).max(0.0) + routing.shortfall.get(t).copied().unwrap_or(0.0);
    let by_group = routing.surplus.get(d).copied().filter(|s| *s > 0.0).unwrap_or(f64::INFINITY);
    let margin = by_rank.min(by_group);
    let groups_moved = by_group < by_rank || routing.shortfall.get(t).is_some_and(|s| *s > 0.0);
    let tolerance = match device_probs.filter(|dp| dp.len() == probs.len()) {
        Some(dp) => {
            let err = |e: usize| (dp[e] as f64 - probs[e]).abs();
            let mut observed = err(d) + err(t);
            if groups_moved {
                // A group's score (its two best) moves by at most twice its largest error: the
                // gap between two groups by at most four times the largest of any expert.
                observed += 4.0 * (0..probs.len()).map(err).fold(0.0, f64::max);
            }
            observed + 4.0 * f32::EPSILON as f64 * choice[d].abs().max(choice[t].abs())
        }
        None => {
            let rms = (probs.iter().map(|p| p * p).sum::<f64>() / probs.len().max(1) as f64).sqrt();
            (2.0 * probs.len() as f64).sqrt() * budget?.bound(rms)
        }
    };
    (margin <= tolerance).then_some((margin, tolerance))
}

impl std::fmt::Display for RoutingFollow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} position {} ({} run): the oracle chose experts {:?}, the device {:?}, {:.2e} apart where its score error allows {:.2e}: a near tie, so the oracle followed the device",
            self.tap, self.position, self.run, self.oracle, self.device, self.margin, self.tolerance
        )
    }
}

/// The oracle's side of routing MoE tokens (`Tap::route`) against a device's recorded taps, for
/// any oracle run that follows the device: each token goes to the device's experts (its
/// `ffn_moe_topk` row, with its scores from the layer's `ffn_moe_probs` when it recorded them)
/// when [`follow_at_near_tie`] says the two choices differ only at a near tie (`budget_of` gives a
/// layer's score budget for devices that did not record their scores), and is listed in
/// `follows`; otherwise the oracle keeps its own choice (same experts, no valid device choice, or
/// no near tie).
pub struct RoutingFollower<'a> {
    pub device: &'a RecordingTap,
    pub budget_of: Box<dyn Fn(Option<usize>) -> Option<Budget> + 'a>,
    /// Which oracle run this is, for the report (`propagated`, `isolated`, `teacher-forced`).
    pub run: &'static str,
    pub follows: Vec<RoutingFollow>,
}

impl<'a> RoutingFollower<'a> {
    pub fn new(device: &'a RecordingTap, budget_of: Box<dyn Fn(Option<usize>) -> Option<Budget> + 'a>, run: &'static str) -> Self {
        RoutingFollower { device, budget_of, run, follows: Vec::new() }
    }

    /// A follower for a propagated run (the oracle's own, or the emulated arithmetic's): a near
    /// tie is judged by the propagated budget of the expert scores.
    pub fn propagated(device: &'a RecordingTap, arith: &'a Arithmetic, dims: &'a Dims, run: &'static str) -> Self {
        Self::new(device, Box::new(move |layer| propagated_budget(TapKind::FfnMoeProbs, layer, arith, dims)), run)
    }

    /// `Tap::route` for the run this follower serves.
    pub fn route(&mut self, name: &str, pos: usize, routing: &oracle::ops::Routing) -> Option<Vec<usize>> {
        let (probs, chosen) = (&routing.probs, &routing.experts);
        let (w, data) = self.device.tensors.get(name)?;
        let row = data.get(pos * w..(pos + 1) * w).filter(|_| *w == chosen.len())?;
        // The device's ids, if they are a valid choice (else the mismatch is reported as such).
        let ids: Vec<usize> = row.iter().map(|&v| (v >= 0.0 && v.fract() == 0.0 && (v as usize) < probs.len()).then_some(v as usize)).collect::<Option<_>>()?;
        let tap = TapName::parse(name);
        let scores = tap.filter(|t| t.kind == TapKind::FfnMoeTopk).map(|t| TapName { kind: TapKind::FfnMoeProbs, ..t }.to_string());
        let device_probs = scores.and_then(|n| self.device.tensors.get(&n)).and_then(|(w, v)| v.get(pos * w..(pos + 1) * w));
        let (margin, tolerance) = follow_at_near_tie(routing, &ids, device_probs, (self.budget_of)(tap.and_then(|t| t.layer)))?;
        self.follows.push(RoutingFollow { tap: name.to_string(), position: pos, oracle: chosen.to_vec(), device: ids.clone(), margin, tolerance, run: self.run });
        Some(ids)
    }
}

/// The oracle's tap for layer-diff's two runs: records every tap; in the isolated run
/// (`substitute_values`) hands the interpreter the device's value of each tap; in both, follows
/// the device's MoE routing at near ties (`routing`).
pub struct Rerun<'a> {
    pub routing: RoutingFollower<'a>,
    pub substitute_values: bool,
    pub recorded: RecordingTap,
    /// Where given, a sample of every matrix product's input rows ([`term_scales`]).
    pub products: Option<ProductRows>,
}

impl Tap for Rerun<'_> {
    fn record(&mut self, name: &str, start_pos: usize, n_tokens: usize, width: usize, data: &[f32]) {
        self.recorded.record(name, start_pos, n_tokens, width, data);
    }
    fn substitute(&mut self, name: &str, start_pos: usize, n_tokens: usize, width: usize) -> Option<Vec<f32>> {
        if !self.substitute_values {
            return None;
        }
        let (w, data) = self.routing.device.tensors.get(name)?;
        let range = start_pos * width..(start_pos + n_tokens) * width;
        (*w == width && data.len() >= range.end).then(|| data[range].to_vec())
    }
    fn route(&mut self, name: &str, pos: usize, routing: &oracle::ops::Routing) -> Option<Vec<usize>> {
        let forced = self.routing.route(name, pos, routing);
        if let Some(p) = &mut self.products {
            p.routed(name, forced.as_deref().unwrap_or(&routing.experts));
        }
        forced
    }
    fn product_input(&mut self, weight: &str, width: usize, data: &[f32]) -> Option<Vec<f32>> {
        if let Some(p) = &mut self.products {
            p.add(weight, width, data);
        }
        None
    }
}

/// An emulated run that routes each MoE token as the device did where the two choices differ
/// only at a near tie (as the oracle's own re-runs do, `routing`): the emulation and the device
/// then take the same experts, and their errors measure the same computation.
pub struct Following<'a> {
    pub emu: crate::emulate::EmulatedArithmetic,
    pub routing: RoutingFollower<'a>,
}

impl oracle::Tap for Following<'_> {
    fn record(&mut self, name: &str, start_pos: usize, n_tokens: usize, width: usize, data: &[f32]) {
        self.emu.record(name, start_pos, n_tokens, width, data);
    }
    fn substitute(&mut self, name: &str, start_pos: usize, n_tokens: usize, width: usize) -> Option<Vec<f32>> {
        self.emu.substitute(name, start_pos, n_tokens, width)
    }
    fn product_input(&mut self, weight: &str, width: usize, data: &[f32]) -> Option<Vec<f32>> {
        self.emu.product_input(weight, width, data)
    }
    fn route(&mut self, name: &str, pos: usize, routing: &oracle::ops::Routing) -> Option<Vec<usize>> {
        self.routing.route(name, pos, routing)
    }
    fn attention_weights(&self) -> Option<&oracle::ops::AttentionWeights> {
        self.emu.attention_weights()
    }
}
