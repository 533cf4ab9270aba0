//! The serving rung: one request judged under the conditions engines serve it in — batched with
//! others, at any row of the batch, beside neighbours of other content, reusing a cached prefix,
//! its prompt in chunks, decoded token by token, in a cache slot another request just left —
//! each condition an axis, a family of schedules (`oracle::schedule`).
//!
//! Two kinds of judgement per axis:
//! - **isolation** (`neighbours`, `slot_reuse`): what other requests hold must never change a
//!   request's numbers — its logits bit for bit equal to the same request's in the counterpart
//!   schedule;
//! - **shape** (`batch`, `chunks`, `prefix_cache`, `decode`, `mixed_lengths`): the batch, the
//!   chunking or a cache hit may change an engine's reductions. An engine that declares itself
//!   batch-invariant is held bit for bit to its own run of the request alone; one that does not,
//!   to within twice its logit budget of it at every position (each run within one budget of the
//!   oracle), with the same top-1 off near ties.
//!
//! Every schedule's every request is also held to the oracle run on that request alone: mean KLD
//! within the mean of its per-position bounds, no top-1 change off near ties (the fixed-token
//! rule). A red names the axis, the schedule, the request and the position.

use crate::fixedtoken::{agreement, position_stats};
use crate::layerdiff::Budget;
use oracle::schedule::{Prefix, Request, Schedule, Served};
use reports::{Case, Metrics, Tolerance, Verdict};
use std::collections::BTreeMap;

/// The conditions a request is served under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Axis {
    Batch,
    Neighbours,
    PrefixCache,
    Chunks,
    Decode,
    SlotReuse,
    MixedLengths,
    /// Random schedules ([`random_cases`]): everything at once.
    Random,
}

impl Axis {
    pub const ALL: [Axis; 7] = [Axis::Batch, Axis::Neighbours, Axis::PrefixCache, Axis::Chunks, Axis::Decode, Axis::SlotReuse, Axis::MixedLengths];

    pub fn name(self) -> &'static str {
        match self {
            Axis::Batch => "batch",
            Axis::Neighbours => "neighbours",
            Axis::PrefixCache => "prefix_cache",
            Axis::Chunks => "chunks",
            Axis::Decode => "decode",
            Axis::SlotReuse => "slot_reuse",
            Axis::MixedLengths => "mixed_lengths",
            Axis::Random => "random",
        }
    }

    /// Whether the axis may change nothing at all (what other requests hold), as against the
    /// shape of the computation.
    pub fn isolation(self) -> bool {
        matches!(self, Axis::Neighbours | Axis::SlotReuse)
    }
}

/// What a served request is compared with besides the oracle.
#[derive(Clone, Debug, PartialEq)]
pub enum Counterpart {
    /// The engine's own run of the request alone, whole, in a fresh slot.
    Alone,
    /// The same request (`id`) in another schedule, bit for bit.
    Other { schedule: Schedule, id: String },
}

/// One schedule of an axis, the request it judges and what that request is compared with.
#[derive(Clone, Debug, PartialEq)]
pub struct ServingCase {
    pub axis: Axis,
    /// The variant in words (`batch=4,row=3`).
    pub variant: String,
    pub schedule: Schedule,
    /// The request the axis is about.
    pub target: String,
    pub counterpart: Counterpart,
}

impl ServingCase {
    pub fn id(&self, model: &str) -> String {
        format!("serving(model={model},axis={},{})", self.axis.name(), self.variant)
    }
}

/// A deterministic stream of token ids below `n_vocab` (the sampling op's SplitMix64).
struct Ids {
    rng: oracle::ops::SplitMix64,
    n_vocab: u32,
}

impl Ids {
    fn take(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.rng.next_u64() % self.n_vocab as u64) as u32).collect()
    }
}

fn request(id: &str, tokens: Vec<u32>, arrive: usize, chunks: Vec<usize>, slot: usize) -> Request {
    Request { id: id.into(), tokens, arrive, chunks, slot, prefix: None }
}

/// `len` tokens as a prompt of `p0` in one chunk, then one token a step.
fn prompt_then_decode(len: usize, p0: usize) -> Vec<usize> {
    std::iter::once(p0.min(len)).chain(std::iter::repeat_n(1, len.saturating_sub(p0))).filter(|c| *c > 0).collect()
}

/// `len` tokens in chunks of `size` (the last one shorter).
fn chunked(len: usize, size: usize) -> Vec<usize> {
    (0..len).step_by(size.max(1)).map(|s| size.min(len - s)).collect()
}

/// The schedules of every axis for a target sequence `seq` whose first `p0` tokens are its
/// prompt (the rest decoded one a step), neighbours drawn from `n_vocab` with `seed`; `window`:
/// the model's sliding window, where a chunk boundary is also put on its edge.
pub fn cases(seq: &[u32], p0: usize, n_vocab: usize, window: Option<usize>, seed: u64) -> Vec<ServingCase> {
    let n = seq.len();
    let p0 = p0.clamp(1, n);
    let mut ids = Ids { rng: oracle::ops::SplitMix64(seed), n_vocab: n_vocab.clamp(1, u32::MAX as usize) as u32 };
    // Neighbours of several lengths, and a second set of the same lengths and other content.
    let lens = [n / 2 + 1, n + 3, 3, 2 * n, n];
    let pool: Vec<Vec<u32>> = lens.iter().map(|l| ids.take(*l)).collect();
    let other: Vec<Vec<u32>> = lens.iter().map(|l| ids.take(*l)).collect();
    let target = || seq.to_vec();
    let decode = prompt_then_decode(n, p0);
    let mut out = Vec::new();
    let mut case = |axis: Axis, variant: String, requests: Vec<Request>, slots: usize, counterpart: Counterpart| {
        out.push(ServingCase { axis, variant, schedule: Schedule { slots, requests }, target: "target".into(), counterpart });
    };
    // Batch size and row: every request arrives at once, the neighbours each in one chunk.
    let batch = |size: usize, row: usize, pool: &[Vec<u32>]| -> Vec<Request> {
        let mut rs: Vec<Request> = (0..size - 1).map(|j| request(&format!("n{j}"), pool[j % pool.len()].clone(), 0, vec![pool[j % pool.len()].len()], 0)).collect();
        rs.insert(row, request("target", target(), 0, decode.clone(), 0));
        for (slot, r) in rs.iter_mut().enumerate() {
            r.slot = slot;
        }
        rs
    };
    for (size, row) in [(2, 1), (4, 0), (4, 3), (8, 5)] {
        case(Axis::Batch, format!("batch={size},row={row}"), batch(size, row, &pool), size, Counterpart::Alone);
    }
    // Neighbours: the same batch with the other rows' content changed.
    let base = batch(4, 1, &pool);
    case(Axis::Neighbours, "batch=4,row=1,neighbours=changed".into(), batch(4, 1, &other), 4, Counterpart::Other { schedule: Schedule { slots: 4, requests: base }, id: "target".into() });
    // Prefix cache: the target's prompt (or half of it) computed by an earlier request.
    for share in [p0, p0.div_ceil(2)] {
        if share == 0 || share >= n {
            continue;
        }
        let mut src_tokens = seq[..share].to_vec();
        src_tokens.extend(ids.take(3));
        let src = request("source", src_tokens.clone(), 0, vec![share, src_tokens.len() - share], 0);
        let rest = n - share;
        let mut t = request("target", target(), 1, prompt_then_decode(rest, p0.saturating_sub(share).max(1)), 1);
        t.prefix = Some(Prefix { from: "source".into(), tokens: share });
        case(Axis::PrefixCache, format!("hit={share}"), vec![src, t], 2, Counterpart::Alone);
    }
    // Chunked prefill: chunks of 1, a prime, a power of two, the whole; on the window's edge.
    let mut sizes = vec![1, 7, 8, n];
    if let Some(w) = window.filter(|w| *w > 1 && *w < n) {
        sizes.extend([w, w - 1]);
    }
    sizes.dedup();
    for size in sizes {
        case(Axis::Chunks, format!("chunk={size}"), vec![request("target", target(), 0, chunked(n, size), 0)], 1, Counterpart::Alone);
    }
    // Decode after a prefill of the prompt, against the whole sequence prefilled at once.
    case(Axis::Decode, format!("prompt={p0},decoded={}", n - p0), vec![request("target", target(), 0, decode.clone(), 0)], 1, Counterpart::Alone);
    // A slot left by a longer request: its old contents must not show.
    let old = pool[3].clone();
    let steps = old.len().div_ceil(5);
    let recycled = vec![request("previous", old.clone(), 0, chunked(old.len(), 5), 0), request("target", target(), steps, decode.clone(), 0)];
    case(Axis::SlotReuse, "slot=0,previous_len=".to_string() + &old.len().to_string(), recycled, 1, Counterpart::Other { schedule: Schedule { slots: 1, requests: vec![request("target", target(), 0, decode.clone(), 0)] }, id: "target".into() });
    // Very different lengths in one batch, arriving at different steps.
    let long = pool[3].clone();
    let mixed = vec![
        request("long", long.clone(), 0, chunked(long.len(), 16), 0),
        request("target", target(), 1, decode.clone(), 1),
        request("short", pool[2].clone(), 2, vec![pool[2].len()], 2),
        request("single", ids.take(1), 3, vec![1], 3),
    ];
    case(Axis::MixedLengths, format!("lengths={},{n},{},1", long.len(), pool[2].len()), mixed, 4, Counterpart::Alone);
    out
}

/// `n` random schedules (seeded): up to six requests each, drawn from `pool` (so some share a
/// prefix), arriving at steps 0-5 in chunks of random sizes, in slots taken as they free, a third
/// of the later ones reusing a prefix an earlier one has computed. The judged request is the last
/// to arrive, against its own run alone (axis `random`, an isolation of nothing: a shape axis).
pub fn random_cases(pool: &[Vec<u32>], n: usize, seed: u64) -> Vec<ServingCase> {
    let mut ids = Ids { rng: oracle::ops::SplitMix64(seed ^ 0x5eed), n_vocab: u32::MAX };
    let mut draw = |below: usize| (ids.take(1)[0] as usize) % below.max(1);
    let mut out = Vec::with_capacity(n);
    for k in 0..n {
        let n_req = 1 + draw(6);
        let mut requests: Vec<Request> = Vec::new();
        let mut free_at: Vec<usize> = Vec::new();
        for j in 0..n_req {
            let tokens = pool[draw(pool.len())].clone();
            let mut arrive = draw(6);
            // A prefix of an earlier request with the same tokens, computed by the arrival.
            let mut prefix = None;
            if j > 0 && draw(3) == 0 {
                if let Some(src) = requests.iter().rev().find(|r| r.tokens == tokens) {
                    arrive = arrive.max(src.arrive + 1);
                    let done = (arrive - src.arrive).min(src.chunks.len());
                    let computed = src.first_computed() + src.chunks[..done].iter().sum::<usize>();
                    let share = computed.min(tokens.len() - 1);
                    if share > 0 {
                        prefix = Some(Prefix { from: src.id.clone(), tokens: 1 + draw(share) });
                    }
                }
            }
            let first = prefix.as_ref().map_or(0, |p| p.tokens);
            let size = [1, 2, 3, 5, 8, tokens.len()][draw(6)];
            let chunks = chunked(tokens.len() - first, size);
            let slot = match free_at.iter().position(|f| *f <= arrive) {
                Some(s) => s,
                None => {
                    free_at.push(0);
                    free_at.len() - 1
                }
            };
            free_at[slot] = arrive + chunks.len();
            requests.push(Request { id: format!("r{j}"), tokens, arrive, chunks, slot, prefix });
        }
        let target = requests.iter().max_by_key(|r| r.arrive).map(|r| r.id.clone()).unwrap_or_default();
        let variant = format!("schedule={k},requests={n_req}");
        out.push(ServingCase { axis: Axis::Random, variant, schedule: Schedule { slots: free_at.len(), requests }, target, counterpart: Counterpart::Alone });
    }
    out
}

/// A request's logits at the positions it computed, as `[positions, n_vocab]`, with the first.
fn computed<'a>(served: &'a Served, schedule: &Schedule, id: &str) -> Option<(usize, &'a [f32])> {
    let r = schedule.request(id)?;
    Some((r.first_computed(), served.get(id)?.as_slice()))
}

/// Checks an engine's answer to a schedule: every request present with exactly its computed
/// positions' logits, all finite. Err names the request and position.
pub fn check_served(schedule: &Schedule, served: &Served, n_vocab: usize) -> Result<(), String> {
    if let Some(id) = served.keys().find(|id| !schedule.requests.iter().any(|r| &r.id == *id)) {
        return Err(format!("logits for request `{id}`, which is not in the schedule"));
    }
    for r in &schedule.requests {
        let want = (r.tokens.len() - r.first_computed()) * n_vocab;
        let Some(got) = served.get(&r.id) else { return Err(format!("request `{}`: no logits", r.id)) };
        if got.len() != want {
            return Err(format!("request `{}`: {} logits, expected {} positions x {n_vocab}", r.id, got.len(), r.tokens.len() - r.first_computed()));
        }
        if let Some(i) = got.iter().position(|v| !v.is_finite()) {
            return Err(format!("request `{}` position {}: a non-finite logit", r.id, r.first_computed() + i / n_vocab.max(1)));
        }
    }
    Ok(())
}

/// Judges a served target against its counterpart's logits over the same positions (`first`
/// on): bit for bit (`exact`), else within twice the logit budget at every position with the same
/// top-1 off near ties (the oracle's logits give the margins).
#[allow(clippy::too_many_arguments)]
fn against_counterpart(id: String, device: &str, c: &ServingCase, got: &[f32], reference: &[f32], first: usize, oracle: &[f64], n_vocab: usize, budget: &Budget, exact: bool) -> Case {
    let what = match &c.counterpart {
        Counterpart::Alone => "its own run of the request alone",
        Counterpart::Other { .. } => "the same request in the counterpart schedule",
    };
    let metrics = Metrics::new().with("axis", c.axis.name()).with("request", &c.target).with("positions", got.len() / n_vocab.max(1));
    if exact || c.axis.isolation() {
        let diff = got.iter().zip(reference).position(|(a, b)| a.to_bits() != b.to_bits());
        let message = diff.map(|i| {
            let pos = first + i / n_vocab;
            format!("axis {}: request `{}` position {pos}: logit {} is {} in {what}, {} served ({})", c.axis.name(), c.target, i % n_vocab, reference[i], got[i], c.variant)
        });
        let rule = if c.axis.isolation() { "bit-identical: other requests' content never changes a request's numbers" } else { "bit-identical: the engine declares itself batch-invariant" };
        return Case { id, device: device.into(), verdict: if diff.is_none() { Verdict::Pass } else { Verdict::Fail }, metrics: metrics.with("first_difference", diff.map(|i| first + i / n_vocab)), tolerance: Tolerance { rule: rule.into(), bound: 0.0 }, margin: if diff.is_none() { 0.0 } else { -1.0 }, message };
    }
    let identical = got.len() == reference.len() && got.iter().zip(reference).all(|(a, b)| a.to_bits() == b.to_bits());
    let stats = position_stats(&oracle[first * n_vocab..], reference, n_vocab, budget);
    let agreed = agreement(got, reference, &stats, n_vocab);
    let worst = (agreed.worst_ratio, first + agreed.worst_at);
    let flips: Vec<usize> = agreed.argmax_differences.iter().map(|k| first + k).collect();
    let pass = worst.0 <= 1.0 && flips.is_empty();
    let message = (!pass).then(|| match flips.first() {
        Some(p) => format!("axis {}: request `{}` position {p}: another top-1 than {what}, off a near tie ({})", c.axis.name(), c.target, c.variant),
        None => format!("axis {}: request `{}` position {}: RMS difference {:.2}x twice the logit budget from {what} ({})", c.axis.name(), c.target, worst.1, worst.0, c.variant),
    });
    Case {
        id,
        device: device.into(),
        verdict: if pass { Verdict::Pass } else { Verdict::Fail },
        metrics: metrics.with("bit_identical", identical).with("worst_rms_over_bound", worst.0).with("worst_position", worst.1).with("argmax_differences", flips.len()),
        tolerance: Tolerance { rule: format!("RMS difference to {what} <= 2*delta per position, same top-1 off near ties"), bound: 1.0 },
        margin: 1.0 - worst.0,
        message,
    }
}

/// Every request of a served schedule against the oracle run on that request alone
/// (`oracle_of`: its logits over all its positions): mean KLD within the mean of its bounds and
/// no top-1 change off a near tie, per request; the worst one named.
fn against_oracle(id: String, device: &str, c: &ServingCase, served: &Served, oracle_of: &dyn Fn(&[u32]) -> Option<OracleRun>, n_vocab: usize, budget: &Budget) -> Case {
    let mut worst: Option<(f64, String, usize)> = None;
    let mut failure: Option<String> = None;
    let mut judged = 0;
    for r in &c.schedule.requests {
        let (Some((first, got)), Some(o)) = (computed(served, &c.schedule, &r.id), oracle_of(&r.tokens)) else { continue };
        judged += 1;
        let mut stats = position_stats(&o.logits[first * n_vocab..], got, n_vocab, budget);
        for (s, &flip) in stats.iter_mut().zip(o.routing_differs.iter().skip(first)) {
            s.near_tie |= flip;
        }
        let kld = stats.iter().map(|s| s.kld).sum::<f64>() / stats.len().max(1) as f64;
        let bound = stats.iter().map(|s| s.kld_bound).sum::<f64>() / stats.len().max(1) as f64;
        let ratio = if bound > 0.0 { kld / bound } else if kld > 0.0 { f64::INFINITY } else { 0.0 };
        let flip = stats.iter().find(|s| s.top1_oracle != s.top1_device && !s.near_tie).map(|s| first + s.pos);
        if worst.as_ref().is_none_or(|w| ratio > w.0 || ratio.is_nan()) {
            worst = Some((ratio, r.id.clone(), stats.iter().max_by(|a, b| a.kld.total_cmp(&b.kld)).map_or(first, |s| first + s.pos)));
        }
        if failure.is_none() {
            if let Some(p) = flip {
                failure = Some(format!("axis {}: request `{}` position {p}: another top-1 than the oracle's, off a near tie ({})", c.axis.name(), r.id, c.variant));
            } else if !(kld <= bound) {
                failure = Some(format!("axis {}: request `{}`: mean KLD {kld:.3e} from the oracle over its bound {bound:.3e} ({})", c.axis.name(), r.id, c.variant));
            }
        }
    }
    let (ratio, request, position) = worst.unwrap_or((f64::NAN, String::new(), 0));
    let verdict = if judged == 0 { Verdict::Error } else if failure.is_none() { Verdict::Pass } else { Verdict::Fail };
    Case {
        id,
        device: device.into(),
        verdict,
        metrics: Metrics::new().with("axis", c.axis.name()).with("requests", judged).with("worst_kld_over_bound", ratio).with("worst_request", request).with("worst_position", position),
        tolerance: Tolerance { rule: "each request against the oracle on it alone: mean KLD <= mean of 0.5*delta^2, same top-1 off near ties".into(), bound: 1.0 },
        margin: 1.0 - ratio,
        message: if judged == 0 { Some("no request was judged".into()) } else { failure },
    }
}

/// The oracle on one request alone: its logits at every position, and where the engine's own
/// run of it chose other MoE experts than the oracle (a top-1 change there is a near tie: the
/// engine's inputs differ from the oracle's by its permitted error, so a router near tie may
/// flip; layer-diff gates the router itself).
#[derive(Clone, Debug)]
pub struct OracleRun {
    pub logits: std::sync::Arc<Vec<f64>>,
    pub routing_differs: Vec<bool>,
}

/// What a serving run needs from the engine: its answer to a schedule (None: it serves none).
pub type Serve<'a> = dyn FnMut(&Schedule) -> Option<Result<Served, String>> + 'a;

/// The id of a request run alone (the counterpart [`Counterpart::Alone`]).
const ALONE: &str = "alone";

/// An engine's answers for one case: to its schedule and to its counterpart (Err: why there is
/// none, an engine error or an answer that does not fit the schedule).
pub struct Answer {
    pub served: Result<Served, String>,
    pub reference: Result<Served, String>,
}

/// Runs every case's schedule and counterpart on the engine (`serve`), each answer checked
/// against its schedule ([`check_served`]); the engine's run of a request alone is asked once
/// per token sequence. None when the engine serves no schedule.
pub fn serve_all(cases: &[ServingCase], serve: &mut Serve, n_vocab: usize) -> Option<Vec<Answer>> {
    let mut alone: BTreeMap<Vec<u32>, Result<Served, String>> = BTreeMap::new();
    // None only before the engine has answered any schedule: after that, no answer is an error.
    let mut answered = false;
    let mut answer = |schedule: &Schedule| -> Option<Result<Served, String>> {
        let served = match serve(schedule) {
            Some(s) => s,
            None if answered => Err("the engine answered earlier schedules but not this one".into()),
            None => return None,
        };
        answered = true;
        Some(served.and_then(|s| check_served(schedule, &s, n_vocab).map(|_| s)))
    };
    let mut out = Vec::with_capacity(cases.len());
    for c in cases {
        let served = answer(&c.schedule)?;
        let target = c.schedule.request(&c.target).expect("the target is in its schedule");
        let reference = match &c.counterpart {
            Counterpart::Alone => match alone.get(&target.tokens) {
                Some(s) => s.clone(),
                None => {
                    let solo = Schedule { slots: 1, requests: vec![request(ALONE, target.tokens.clone(), 0, vec![target.tokens.len()], 0)] };
                    let s = answer(&solo)?;
                    alone.insert(target.tokens.clone(), s.clone());
                    s
                }
            },
            Counterpart::Other { schedule, .. } => answer(schedule)?,
        };
        out.push(Answer { served, reference });
    }
    Some(out)
}

/// The case of an engine that serves no schedule: unsupported, never a pass.
pub fn unsupported(model: &str, device: &str, why: &str) -> Case {
    Case { id: format!("serving(model={model})"), device: device.into(), verdict: Verdict::Unsupported, metrics: Metrics::new(), tolerance: Tolerance { rule: "serves schedules".into(), bound: 0.0 }, margin: 0.0, message: Some(why.into()) }
}

/// Judges every case's answers: against its counterpart (isolation or shape, [`Axis`]) and
/// every request against the oracle (`oracle_of`: the oracle on a token sequence alone).
/// `batch_invariant`: the engine's declaration (shape axes then bit for bit).
#[allow(clippy::too_many_arguments)]
pub fn judge(cases: &[ServingCase], answers: &[Answer], oracle_of: &dyn Fn(&[u32]) -> Option<OracleRun>, n_vocab: usize, budget: &Budget, batch_invariant: bool, model: &str, device: &str) -> Vec<Case> {
    let error = |id: String, why: String| Case { id, device: device.into(), verdict: Verdict::Error, metrics: Metrics::new(), tolerance: Tolerance { rule: "a valid answer to the schedule".into(), bound: 0.0 }, margin: 0.0, message: Some(why) };
    let mut out = Vec::new();
    for (c, a) in cases.iter().zip(answers) {
        let id = c.id(model);
        let (served, reference) = match (&a.served, &a.reference) {
            (Ok(s), Ok(r)) => (s, r),
            (Err(why), _) => {
                let mut e = error(id, why.clone());
                e.metrics.set("schedule", &c.schedule);
                out.push(e);
                continue;
            }
            (_, Err(why)) => {
                out.push(error(id, format!("its counterpart: {why}")));
                continue;
            }
        };
        let target = c.schedule.request(&c.target).expect("the target is in its schedule");
        let (got, want, first) = target_logits(c, served, reference, n_vocab);
        let Some(o) = oracle_of(&target.tokens) else {
            out.push(error(id, format!("no oracle logits for request `{}`", c.target)));
            continue;
        };
        let mut pair = [against_counterpart(id.clone(), device, c, got, want, first, &o.logits, n_vocab, budget, batch_invariant), against_oracle(format!("{id}:vs_oracle"), device, c, served, oracle_of, n_vocab, budget)];
        // A red case carries the schedule that shows it (and its counterpart's), to rerun.
        for case in pair.iter_mut().filter(|k| k.verdict != Verdict::Pass) {
            case.metrics.set("schedule", &c.schedule);
            if let Counterpart::Other { schedule, .. } = &c.counterpart {
                case.metrics.set("counterpart_schedule", schedule);
            }
        }
        out.extend(pair);
    }
    out
}

/// A case's judged request: its served logits, its counterpart's over the same positions, and
/// the first position they cover (answers checked by [`serve_all`]).
fn target_logits<'a>(c: &ServingCase, served: &'a Served, reference: &'a Served, n_vocab: usize) -> (&'a [f32], &'a [f32], usize) {
    let first = c.schedule.request(&c.target).map_or(0, |r| r.first_computed());
    let got = served.get(&c.target).map_or(&[][..], |v| v.as_slice());
    let want: &[f32] = match &c.counterpart {
        Counterpart::Alone => reference.get(ALONE).and_then(|v| v.get(first * n_vocab..)).unwrap_or_default(),
        Counterpart::Other { schedule, id } => {
            let other_first = schedule.request(id).map_or(0, |r| r.first_computed());
            reference.get(id).and_then(|v| v.get((first - other_first.min(first)) * n_vocab..)).unwrap_or_default()
        }
    };
    (got, want, first)
}

/// Whether a case's judged request got other bits than its counterpart where the rule is bit for
/// bit (an isolation axis, or an engine declared batch-invariant): a case whose taps say where.
pub fn differs_bitwise(c: &ServingCase, a: &Answer, n_vocab: usize, batch_invariant: bool) -> bool {
    let (Ok(served), Ok(reference)) = (&a.served, &a.reference) else { return false };
    if !(batch_invariant || c.axis.isolation()) {
        return false;
    }
    let (got, want, _) = target_logits(c, served, reference, n_vocab);
    got.len() != want.len() || got.iter().zip(want).any(|(x, y)| x.to_bits() != y.to_bits())
}

/// The first tap, in execution order, whose values differ in their bits between a request's
/// served run (`served`, its positions from `first` on) and its counterpart's run (`reference`,
/// the same positions): its name and that position. Taps are taken in the model's execution
/// order (the embedding, layer by layer in stage order, the final norm and logits), whatever
/// order an engine wrote them in; names of no known kind last. None when every tap agrees (the
/// difference arises after the last tap).
pub fn first_differing_tap(served: &oracle::RecordingTap, reference: &oracle::RecordingTap, first: usize) -> Option<(String, usize)> {
    use oracle::taps::{TapKind, TapName};
    let order = |n: &str| match TapName::parse(n) {
        Some(TapName { layer: Some(l), kind }) => (1, l, kind),
        Some(TapName { layer: None, kind: TapKind::InpEmbd }) => (0, 0, TapKind::InpEmbd),
        Some(TapName { layer: None, kind }) => (2, 0, kind),
        None => (3, 0, TapKind::InpEmbd),
    };
    let mut names: Vec<&String> = served.order.iter().filter(|n| reference.tensors.contains_key(*n)).collect();
    names.sort_by_key(|n| order(n));
    for name in names {
        let ((w, a), (w2, b)) = (&served.tensors[name], &reference.tensors[name]);
        if w != w2 || *w == 0 {
            continue;
        }
        let rows = (a.len() / w).min(b.len() / w);
        if let Some(p) = (first..rows).find(|p| a[p * w..(p + 1) * w].iter().zip(&b[p * w..(p + 1) * w]).any(|(x, y)| x.to_bits() != y.to_bits())) {
            return Some((name.clone(), p));
        }
    }
    None
}

/// The columns of [`axis_rows`].
pub const AXIS_COLUMNS: [&str; 6] = ["axis", "schedules", "against its counterpart", "closest approach", "against the oracle", "closest approach to the oracle's bound"];

/// Per axis, what the judged cases (from [`judge`]) show: how many schedules gave the target
/// bit-identical numbers to its counterpart, how many differed within the bound (an engine not
/// declared batch-invariant on a shape axis) and how many failed; the worst RMS difference over
/// its bound; then the requests against the oracle alone, and the worst KLD over its bound.
pub fn axis_rows(judged: &[Case]) -> Vec<Vec<String>> {
    let mut axes: Vec<&str> = Vec::new();
    for c in judged {
        if let Some(a) = c.metrics.str("axis").filter(|a| !axes.contains(a)) {
            axes.push(a);
        }
    }
    let show = |w: f64| if w == 0.0 { "0".to_string() } else if w.abs() < 0.01 { format!("{w:.1e}") } else { format!("{w:.3}") };
    let worst = |v: &mut dyn Iterator<Item = f64>| v.fold(None, |w: Option<f64>, x| Some(w.map_or(x, |w| if x > w || x.is_nan() { x } else { w }))).map_or("-".to_string(), show);
    axes.iter()
        .map(|axis| {
            let of: Vec<&Case> = judged.iter().filter(|c| c.metrics.str("axis") == Some(axis)).collect();
            let (oracle, counterpart): (Vec<&Case>, Vec<&Case>) = of.iter().partition(|c| c.id.ends_with(":vs_oracle"));
            let identical = counterpart.iter().filter(|c| c.verdict == Verdict::Pass && (c.tolerance.bound == 0.0 || c.metrics.bool("bit_identical") == Some(true))).count();
            let within = counterpart.iter().filter(|c| c.verdict == Verdict::Pass).count() - identical;
            let outside = counterpart.len() - identical - within;
            let oracle_pass = oracle.iter().filter(|c| c.verdict == Verdict::Pass).count();
            vec![
                axis.to_string(),
                counterpart.len().max(oracle.len()).to_string(),
                format!("{identical} bit-identical, {within} within the bound, {outside} outside"),
                worst(&mut counterpart.iter().filter_map(|c| c.metrics.f64("worst_rms_over_bound"))),
                format!("{oracle_pass} of {} pass", oracle.len()),
                worst(&mut oracle.iter().filter_map(|c| c.metrics.f64("worst_kld_over_bound"))),
            ]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_axis_has_a_valid_schedule_with_its_target() {
        let seq: Vec<u32> = (0..20).map(|i| (i * 37 % 50) as u32).collect();
        let cases = cases(&seq, 12, 50, Some(4), 7);
        for axis in Axis::ALL {
            assert!(cases.iter().any(|c| c.axis == axis), "{axis:?}");
        }
        for c in &cases {
            c.schedule.validate().unwrap_or_else(|e| panic!("{}: {e}", c.variant));
            let t = c.schedule.request(&c.target).unwrap();
            assert_eq!(t.tokens, seq, "{}", c.variant);
            if let Counterpart::Other { schedule, id } = &c.counterpart {
                schedule.validate().unwrap();
                assert!(schedule.requests.iter().any(|r| &r.id == id));
            }
        }
        assert!(cases.iter().any(|c| c.variant == "chunk=4"), "a chunk boundary on the window's edge");
    }

    #[test]
    fn random_schedules_are_valid_and_reuse_slots_and_prefixes() {
        let pool: Vec<Vec<u32>> = (0..3).map(|p| (0..12 + p).map(|i| (i * 13 + p) as u32 % 40).collect()).collect();
        let cases = random_cases(&pool, 200, 9);
        for c in &cases {
            c.schedule.validate().unwrap_or_else(|e| panic!("{}: {e}", c.variant));
            assert!(c.schedule.requests.iter().any(|r| r.id == c.target));
        }
        assert!(cases.iter().any(|c| c.schedule.requests.iter().any(|r| r.prefix.is_some())), "some reuse a prefix");
        assert!(cases.iter().any(|c| c.schedule.slots < c.schedule.requests.len()), "some recycle a slot");
    }

    #[test]
    fn an_answer_with_a_missing_or_foreign_request_or_a_nan_is_refused_by_name() {
        let s = Schedule { slots: 1, requests: vec![request("a", vec![1, 2], 0, vec![2], 0)] };
        let ok: Served = BTreeMap::from([("a".to_string(), vec![0.0; 6])]);
        assert_eq!(check_served(&s, &ok, 3), Ok(()));
        assert!(check_served(&s, &BTreeMap::new(), 3).unwrap_err().contains("request `a`: no logits"));
        let mut extra = ok.clone();
        extra.insert("z".into(), vec![]);
        assert!(check_served(&s, &extra, 3).unwrap_err().contains("`z`, which is not in the schedule"));
        let mut nan = ok.clone();
        nan.get_mut("a").unwrap()[4] = f32::NAN;
        assert!(check_served(&s, &nan, 3).unwrap_err().contains("request `a` position 1"));
        assert!(check_served(&s, &BTreeMap::from([("a".to_string(), vec![0.0; 5])]), 3).unwrap_err().contains("expected 2 positions x 3"));
    }
}
