//! Serving bugs the `faults` feature seeds into the `cpu` device's schedule executor
//! (`devices::faulty::ServeFault`), and where the executor's batch applies them: RoPE's
//! positions, a segment's attention mask and window, the batch's attention output.

use super::kernels::AttnCfg;
use std::borrow::Cow;

/// Serving bugs, seeded into the executor by the `faults` feature (`devices::faulty`) to show
/// the serving rung catches each: the bugs engines' reports name most.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServeFault {
    /// A request's rows see a neighbour in the batch: the first row of every request after the
    /// first attends to the previous request's last row as to one more key of equal weight.
    MaskLeak,
    /// A slot taken by a new request keeps the last request's cache, the new request's
    /// positions continuing after it.
    SlotNotCleared,
    /// A reused prefix's first computed position taken one early.
    PrefixOffByOne,
    /// RoPE's positions restarted at 0 in every chunk after a request's first.
    RopeRestartsAtChunk,
    /// No causal mask inside a chunk after a request's first: each row sees the chunk's keys.
    NoCausalMaskInChunk,
    /// The sliding window one position wider in chunks after a request's first.
    WindowEdgeAtChunk,
    /// The last logits of the batch's first two requests written to each other.
    LogitsSwapped,
    /// A batch of four requests or more takes a coarser attention path (its output rounded to
    /// bf16) that the engine does not declare.
    BatchPathRounds,
    /// A reused prefix's keys and values copied, its recurrent layers' state and convolution
    /// history left at zero (the state not restored on a cache hit).
    SsmStateNotRestored,
}

impl ServeFault {
    pub const ALL: [ServeFault; 9] = [
        ServeFault::MaskLeak,
        ServeFault::SlotNotCleared,
        ServeFault::PrefixOffByOne,
        ServeFault::RopeRestartsAtChunk,
        ServeFault::NoCausalMaskInChunk,
        ServeFault::WindowEdgeAtChunk,
        ServeFault::LogitsSwapped,
        ServeFault::BatchPathRounds,
        ServeFault::SsmStateNotRestored,
    ];
}

/// A batch's segment as the faults see it: its first position, its rows and its fault.
pub(crate) type SegView = (usize, usize, Option<ServeFault>);

/// The positions RoPE rotates each row by: the rows' own, except in a segment seeded with
/// [`ServeFault::RopeRestartsAtChunk`].
pub(crate) fn rope_positions<'a>(segs: &[SegView], pos: &'a [usize]) -> Cow<'a, [usize]> {
    if !segs.iter().any(|g| g.2 == Some(ServeFault::RopeRestartsAtChunk)) {
        return Cow::Borrowed(pos);
    }
    let mut out = Vec::with_capacity(pos.len());
    for &(start, rows, fault) in segs {
        let restart = fault == Some(ServeFault::RopeRestartsAtChunk);
        out.extend((0..rows).map(|i| if restart { i } else { start + i }));
    }
    Cow::Owned(out)
}

/// A segment's query positions and attention options: its own, except where a seeded fault
/// changes the mask ([`ServeFault::NoCausalMaskInChunk`]) or the window.
pub(crate) fn attention_view<'a, 'c>(fault: Option<ServeFault>, pos: &'a [usize], cfg: &AttnCfg<'c>) -> (Cow<'a, [usize]>, AttnCfg<'c>) {
    let mut view = AttnCfg { ..*cfg };
    match fault {
        Some(ServeFault::NoCausalMaskInChunk) => return (Cow::Owned(vec![*pos.last().unwrap_or(&0); pos.len()]), view),
        Some(ServeFault::WindowEdgeAtChunk) if view.window > 0 => view.window += 1,
        _ => {}
    }
    (Cow::Borrowed(pos), view)
}

/// The seeded faults that act on a whole batch's attention output (`attn`, rows of `width`).
pub(crate) fn batch_faults(fault: Option<ServeFault>, segs: &[SegView], attn: &mut [f32], width: usize) {
    match fault {
        Some(ServeFault::MaskLeak) => {
            let mut r0 = 0;
            for w in segs.windows(2) {
                let (prev_last, first) = (r0 + w[0].1 - 1, r0 + w[0].1);
                let n = (w[1].0 + 1) as f32;
                for c in 0..width {
                    attn[first * width + c] = (attn[first * width + c] * n + attn[prev_last * width + c]) / (n + 1.0);
                }
                r0 = first;
            }
        }
        Some(ServeFault::BatchPathRounds) if segs.len() >= 4 => attn.iter_mut().for_each(|v| *v = half::bf16::from_f32(*v).to_f32()),
        _ => {}
    }
}

