//! Mixture-of-experts routing: scores (softmax or sigmoid) over the router logits, top-k
//! selection (ties go to the lower expert id), optional renormalisation of the chosen weights.

use crate::spec::Gating;

/// The routing decision for one token.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// Score of every expert: `[n_expert]`.
    pub probs: Vec<f64>,
    /// Chosen expert ids, best first.
    pub experts: Vec<usize>,
    /// Weight of each chosen expert.
    pub weights: Vec<f64>,
}

/// Routes one token from its router logits.
pub fn moe_route(logits: &[f64], k: usize, gating: Gating, normalize: bool) -> Routing {
    let probs: Vec<f64> = match gating {
        Gating::Softmax => super::act::softmax_f64(logits),
        Gating::Sigmoid => logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect(),
    };
    let experts = super::sample::top_k_f64(&probs, k);
    let weights = weights_of(&probs, &experts, normalize);
    Routing { probs, experts, weights }
}

fn weights_of(probs: &[f64], experts: &[usize], normalize: bool) -> Vec<f64> {
    let mut weights: Vec<f64> = experts.iter().map(|&e| probs[e]).collect();
    if normalize {
        let sum: f64 = weights.iter().sum();
        if sum > 0.0 {
            weights.iter_mut().for_each(|w| *w /= sum);
        }
    }
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
        let weights = weights_of(&self.probs, &experts, normalize);
        Ok(Routing { probs: self.probs, experts, weights })
    }
}
