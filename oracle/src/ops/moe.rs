//! Mixture-of-experts routing: scores (softmax or sigmoid) over the router logits, top-k
//! selection (ties go to the lower expert id), optional renormalisation of the chosen weights.

use crate::spec::Gating;

/// The routing decision for one token.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// Score of every expert: `[n_expert]`.
    pub probs: Vec<f64>,
    /// What the choice ranks: the scores plus the choice bias where the model has one (else the
    /// scores).
    pub choice: Vec<f64>,
    /// Under a group limit, how far each expert's group fell short of being kept (the lowest
    /// kept group's score less its own group's; 0 in a kept group); empty without groups.
    pub shortfall: Vec<f64>,
    /// Under a group limit, how far each expert's kept group stood above the best dropped one
    /// (infinite where none was dropped; 0 in a dropped group); empty without groups.
    pub surplus: Vec<f64>,
    /// Chosen expert ids, best first.
    pub experts: Vec<usize>,
    /// Weight of each chosen expert.
    pub weights: Vec<f64>,
    /// What the chosen experts' scores are multiplied by after any renormalization.
    pub scale: f64,
}

/// Routes one token from its router logits.
pub fn moe_route(logits: &[f64], k: usize, gating: Gating, normalize: bool) -> Routing {
    moe_route_rule(logits, &RouteRule { k, gating, normalize, choice_bias: None, groups: None, scale: 1.0 })
}

/// How a model routes: `k` experts by `gating`'s scores (plus `choice_bias` for the choice
/// only), from the best `groups[1]` of `groups[0]` groups where given (each ranked by the sum of
/// its two best biased scores, ties to the lower group), the chosen scores renormalized
/// (`normalize`) and multiplied by `scale`.
#[derive(Clone, Copy, Debug)]
pub struct RouteRule<'a> {
    pub k: usize,
    pub gating: Gating,
    pub normalize: bool,
    pub choice_bias: Option<&'a [f64]>,
    pub groups: Option<[usize; 2]>,
    pub scale: f64,
}

/// Routes one token from its router logits as `rule` says.
pub fn moe_route_rule(logits: &[f64], rule: &RouteRule) -> Routing {
    let probs: Vec<f64> = match rule.gating {
        Gating::Softmax => super::act::softmax_f64(logits),
        Gating::Sigmoid => logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect(),
    };
    let ranked: Vec<f64> = match rule.choice_bias {
        Some(b) => probs.iter().zip(b).map(|(p, b)| p + b).collect(),
        None => probs.clone(),
    };
    let mut choice = ranked.clone();
    let (mut shortfall, mut surplus) = (Vec::new(), Vec::new());
    if let Some([n_group, keep]) = rule.groups.filter(|[g, _]| *g > 0 && choice.len().is_multiple_of(*g)) {
        let per = choice.len() / n_group;
        let group_score: Vec<f64> = choice.chunks(per).map(|g| super::sample::top_k_f64(g, 2).iter().map(|&i| g[i]).sum()).collect();
        let kept = super::sample::top_k_f64(&group_score, keep);
        let lowest_kept = kept.iter().map(|&g| group_score[g]).fold(f64::INFINITY, f64::min);
        let best_dropped = (0..n_group).filter(|g| !kept.contains(g)).map(|g| group_score[g]).fold(f64::NEG_INFINITY, f64::max);
        (shortfall, surplus) = (vec![0.0; choice.len()], vec![0.0; choice.len()]);
        for (gi, g) in choice.chunks_mut(per).enumerate() {
            let at = gi * per..(gi + 1) * per;
            if kept.contains(&gi) {
                surplus[at].iter_mut().for_each(|v| *v = group_score[gi] - best_dropped);
            } else {
                g.iter_mut().for_each(|v| *v = f64::NEG_INFINITY);
                shortfall[at].iter_mut().for_each(|v| *v = lowest_kept - group_score[gi]);
            }
        }
    }
    let experts = super::sample::top_k_f64(&choice, rule.k);
    let weights = weights_of(&probs, &experts, rule.normalize, rule.scale);
    Routing { probs, choice: ranked, shortfall, surplus, experts, weights, scale: rule.scale }
}

fn weights_of(probs: &[f64], experts: &[usize], normalize: bool, scale: f64) -> Vec<f64> {
    let mut weights: Vec<f64> = experts.iter().map(|&e| probs[e]).collect();
    if normalize {
        let sum: f64 = weights.iter().sum();
        if sum > 0.0 {
            weights.iter_mut().for_each(|w| *w /= sum);
        }
    }
    weights.iter_mut().for_each(|w| *w *= scale);
    weights
}

impl Routing {
    /// The same scores routed to `experts` instead (another engine's choice, weighted as this
    /// routing weighs its own), or why `experts` is not a choice of `self.experts.len()` distinct
    /// experts.
    pub fn with_experts(self, experts: Vec<usize>, normalize: bool) -> Result<Routing, String> {
        let n = self.probs.len();
        let mut sorted = experts.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if experts.len() != self.experts.len() || sorted.len() != experts.len() || sorted.last().is_some_and(|&e| e >= n) {
            return Err(format!("{experts:?} is not a choice of {} distinct experts of {n}", self.experts.len()));
        }
        let weights = weights_of(&self.probs, &experts, normalize, self.scale);
        Ok(Routing { probs: self.probs, choice: self.choice, shortfall: self.shortfall, surplus: self.surplus, experts, weights, scale: self.scale })
    }
}
