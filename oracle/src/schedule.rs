//! A serving schedule: the requests an engine runs together the way it serves — the step each
//! arrives at, how its tokens are split into chunks, the cache slot it gets and the earlier
//! request whose cached prefix it reuses — and what the engine gives back: the logits of every
//! position it computed, by request (docs/SERVING_PROTOCOL.md).
//!
//! Every request is teacher-forced: its whole token sequence is given, and "decode" is a chunk of
//! one token. At each step every active request feeds its next chunk; all of them form one
//! batch. A request is active from its arrival until its last chunk, after which its slot is free.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The largest schedule accepted: requests, slots, chunks in all, tokens of one request.
pub const MAX_REQUESTS: usize = 4096;
pub const MAX_SLOTS: usize = 4096;
pub const MAX_TOKENS: usize = 1 << 20;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    /// Cache slots the engine holds (a request's `slot` is below this).
    pub slots: usize,
    pub requests: Vec<Request>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// Unique within the schedule: what the engine's output names.
    pub id: String,
    pub tokens: Vec<u32>,
    /// The step the request arrives at (its first chunk runs then).
    pub arrive: usize,
    /// The lengths its computed tokens are fed in, one chunk per step: they sum to
    /// `tokens.len()` less the reused prefix.
    pub chunks: Vec<usize>,
    pub slot: usize,
    /// The first `tokens` positions come from request `from`'s cache, which has computed them
    /// by this request's arrival (its tokens there are the same): they are not computed again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<Prefix>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Prefix {
    pub from: String,
    pub tokens: usize,
}

impl Request {
    /// The first position the engine computes (after the reused prefix).
    pub fn first_computed(&self) -> usize {
        self.prefix.as_ref().map_or(0, |p| p.tokens)
    }

    /// The step of its last chunk.
    pub fn last_step(&self) -> usize {
        self.arrive + self.chunks.len().saturating_sub(1)
    }
}

/// One request's part of a step: its chunk of tokens and the positions they take.
#[derive(Clone, Debug, PartialEq)]
pub struct Segment<'a> {
    /// The request's index in the schedule.
    pub request: usize,
    pub slot: usize,
    /// Position of the chunk's first token.
    pub start: usize,
    pub tokens: &'a [u32],
}

/// What a step does besides computing: requests that arrive (with a prefix to copy first) and
/// the segments it computes, in the schedule's request order.
#[derive(Clone, Debug, PartialEq)]
pub struct Step<'a> {
    pub index: usize,
    /// Requests arriving at this step (index in the schedule).
    pub arrivals: Vec<usize>,
    pub segments: Vec<Segment<'a>>,
}

impl Step<'_> {
    /// Request `request`'s rows of this step's batch (segments in order) and the position of
    /// its first, if it runs in this step.
    pub fn rows_of(&self, request: usize) -> Option<(std::ops::Range<usize>, usize)> {
        let mut row = 0;
        for g in &self.segments {
            if g.request == request {
                return Some((row..row + g.tokens.len(), g.start));
            }
            row += g.tokens.len();
        }
        None
    }

    /// Appends each segment's rows of `logits` (the step's batch, `n_vocab` per row) to its
    /// request's answer in `out`.
    pub fn deliver(&self, schedule: &Schedule, logits: &[f32], n_vocab: usize, out: &mut Served) {
        let mut row = 0;
        for g in &self.segments {
            let n = g.tokens.len() * n_vocab;
            out.entry(schedule.requests[g.request].id.clone()).or_default().extend_from_slice(&logits[row..row + n]);
            row += n;
        }
    }
}

impl Schedule {
    /// The position of request `id` in `requests`.
    pub fn index_of(&self, id: &str) -> Option<usize> {
        self.requests.iter().position(|r| r.id == id)
    }

    /// Request `id`.
    pub fn request(&self, id: &str) -> Option<&Request> {
        self.index_of(id).map(|i| &self.requests[i])
    }

    /// Checks the schedule can be run: ids unique, chunks that cover the tokens, slots in range
    /// and never held by two live requests, prefixes of an earlier request that has computed
    /// them by the arrival and shares those tokens. Err names the request and field.
    pub fn validate(&self) -> Result<(), String> {
        if self.slots == 0 || self.slots > MAX_SLOTS {
            return Err(format!("slots: {} (1 to {MAX_SLOTS})", self.slots));
        }
        if self.requests.is_empty() || self.requests.len() > MAX_REQUESTS {
            return Err(format!("requests: {} (1 to {MAX_REQUESTS})", self.requests.len()));
        }
        let mut index = BTreeMap::new();
        for (i, r) in self.requests.iter().enumerate() {
            let at = |field: &str, why: String| format!("request `{}` {field}: {why}", r.id);
            if index.insert(r.id.as_str(), i).is_some() {
                return Err(at("id", "given twice".into()));
            }
            if r.tokens.is_empty() || r.tokens.len() > MAX_TOKENS {
                return Err(at("tokens", format!("{} (1 to {MAX_TOKENS})", r.tokens.len())));
            }
            if r.slot >= self.slots {
                return Err(at("slot", format!("{} (the schedule has {} slots)", r.slot, self.slots)));
            }
            let first = r.first_computed();
            if first >= r.tokens.len() {
                return Err(at("prefix", format!("reuses {first} of its {} tokens: at least the last must be computed", r.tokens.len())));
            }
            if r.chunks.is_empty() || r.chunks.contains(&0) || r.chunks.iter().try_fold(0usize, |s, c| s.checked_add(*c)) != Some(r.tokens.len() - first) {
                return Err(at("chunks", format!("{:?} must be lengths of at least 1 that sum to the {} tokens it computes", r.chunks, r.tokens.len() - first)));
            }
            if r.arrive > MAX_TOKENS {
                return Err(at("arrive", format!("step {} (at most {MAX_TOKENS})", r.arrive)));
            }
            if let Some(p) = &r.prefix {
                let Some(&si) = index.get(p.from.as_str()).filter(|si| **si != i) else {
                    return Err(at("prefix.from", format!("`{}` is not an earlier request of the schedule", p.from)));
                };
                let src = &self.requests[si];
                if p.tokens == 0 || p.tokens > src.tokens.len() || src.tokens[..p.tokens] != r.tokens[..p.tokens] {
                    return Err(at("prefix", format!("its first {} tokens are not the first tokens of `{}`", p.tokens, src.id)));
                }
                if computed_by(src, r.arrive) < p.tokens {
                    return Err(at("prefix", format!("`{}` has computed {} of those {} positions by step {}", src.id, computed_by(src, r.arrive), p.tokens, r.arrive)));
                }
            }
        }
        // No slot held by two requests at one step.
        let mut holder: BTreeMap<(usize, usize), &str> = BTreeMap::new();
        for r in &self.requests {
            for step in r.arrive..=r.last_step() {
                if let Some(other) = holder.insert((r.slot, step), &r.id) {
                    return Err(format!("request `{}` slot: slot {} is held by `{other}` at step {step}", r.id, r.slot));
                }
            }
        }
        Ok(())
    }

    /// The steps in order, each with its arrivals and segments (a valid schedule: `validate`).
    pub fn steps(&self) -> Vec<Step<'_>> {
        let last = self.requests.iter().map(Request::last_step).max().unwrap_or(0);
        (0..=last)
            .map(|index| {
                let arrivals = (0..self.requests.len()).filter(|&i| self.requests[i].arrive == index).collect();
                let segments = self
                    .requests
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| r.arrive <= index && index <= r.last_step())
                    .map(|(request, r)| {
                        let k = index - r.arrive;
                        let start = r.first_computed() + r.chunks[..k].iter().sum::<usize>();
                        Segment { request, slot: r.slot, start, tokens: &r.tokens[start..start + r.chunks[k]] }
                    })
                    .collect();
                Step { index, arrivals, segments }
            })
            .collect()
    }

    /// Requests whose cached positions a later request reuses: (index, the last step a reuse
    /// arrives at), so an engine keeps them past their own last step.
    pub fn prefix_sources(&self) -> BTreeMap<usize, usize> {
        let mut out = BTreeMap::new();
        for r in &self.requests {
            if let Some(p) = &r.prefix {
                if let Some(si) = self.index_of(&p.from) {
                    let e = out.entry(si).or_insert(r.arrive);
                    *e = (*e).max(r.arrive);
                }
            }
        }
        out
    }
}

/// Positions request `r` has computed before step `step` runs.
fn computed_by(r: &Request, step: usize) -> usize {
    let done = step.saturating_sub(r.arrive).min(r.chunks.len());
    r.first_computed() + r.chunks[..done].iter().sum::<usize>()
}

/// What an engine gave back for a schedule: per request id, the logits of the positions it
/// computed (`first_computed..tokens.len()`), `[positions, n_vocab]` row-major.
pub type Served = BTreeMap<String, Vec<f32>>;

#[cfg(test)]
mod tests {
    use super::*;

    fn req(id: &str, tokens: &[u32], arrive: usize, chunks: &[usize], slot: usize) -> Request {
        Request { id: id.into(), tokens: tokens.to_vec(), arrive, chunks: chunks.to_vec(), slot, prefix: None }
    }

    #[test]
    fn steps_batch_the_active_requests_chunk_by_chunk() {
        let mut b = req("b", &[1, 2, 3, 9], 1, &[1, 1], 1);
        b.prefix = Some(Prefix { from: "a".into(), tokens: 2 });
        let s = Schedule { slots: 2, requests: vec![req("a", &[1, 2, 3, 4, 5], 0, &[3, 1, 1], 0), b] };
        s.validate().unwrap();
        let steps = s.steps();
        assert_eq!(steps.len(), 3);
        assert_eq!(steps[1].arrivals, vec![1]);
        let segs: Vec<(usize, usize, Vec<u32>)> = steps[1].segments.iter().map(|g| (g.request, g.start, g.tokens.to_vec())).collect();
        assert_eq!(segs, vec![(0, 3, vec![4]), (1, 2, vec![3])]);
        assert_eq!(s.prefix_sources(), BTreeMap::from([(0, 1)]));
    }

    #[test]
    fn invalid_schedules_are_refused_naming_request_and_field() {
        let ok = |r: Vec<Request>| Schedule { slots: 2, requests: r }.validate();
        assert!(ok(vec![req("a", &[1, 2], 0, &[1], 0)]).unwrap_err().contains("`a` chunks"));
        assert!(ok(vec![req("a", &[1, 2], 0, &[2], 2)]).unwrap_err().contains("`a` slot"));
        assert!(ok(vec![req("a", &[1, 2], 0, &[2], 0), req("a", &[1], 0, &[1], 1)]).unwrap_err().contains("`a` id"));
        assert!(ok(vec![req("a", &[1, 2], 0, &[1, 1], 0), req("b", &[3], 1, &[1], 0)]).unwrap_err().contains("slot 0 is held by `a` at step 1"));
        let mut b = req("b", &[1, 2, 7], 0, &[1], 1);
        b.prefix = Some(Prefix { from: "a".into(), tokens: 2 });
        assert!(ok(vec![req("a", &[1, 2], 0, &[2], 0), b.clone()]).unwrap_err().contains("has computed 0 of those 2 positions by step 0"));
        b.arrive = 1;
        assert_eq!(ok(vec![req("a", &[1, 2], 0, &[2], 0), b.clone()]), Ok(()));
        b.tokens[1] = 5;
        assert!(ok(vec![req("a", &[1, 2], 0, &[2], 0), b]).unwrap_err().contains("not the first tokens of `a`"));
        assert!(Schedule { slots: 0, requests: vec![] }.validate().is_err());
    }
}
