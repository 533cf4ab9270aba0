//! The `cpu` device serving a schedule (`oracle::schedule`): every step one batch of the active
//! requests' chunks through the same products, each request attending to its own cache slot; a
//! slot emptied when a new request takes it; a reused prefix copied from the cache of the
//! request that computed it (kept after that request ends for as long as a later one reuses it),
//! a recurrent layer's state restored as of the prefix's last position from the history the
//! executor's caches keep.

use super::model::{err, CpuModel, KvCache, Seg};
pub use super::serve_faults::ServeFault;
use crate::DeviceError;
use oracle::schedule::{Schedule, Served};
use crate::shared::segment_tap::SegmentTap;
use oracle::Tap;
use std::collections::BTreeMap;

impl CpuModel {
    /// Serves `schedule`, pushing each step's wall-clock seconds to `step_seconds`.
    pub(crate) fn serve_schedule(&self, schedule: &Schedule, step_seconds: &mut Vec<f64>) -> Result<Served, DeviceError> {
        self.serve_schedule_tapped(schedule, step_seconds, None)
    }

    /// [`CpuModel::serve_schedule`], recording one request's taps (`tapped`: its id and the tap):
    /// its rows of each step's batch, at its positions.
    pub(crate) fn serve_schedule_tapped(&self, schedule: &Schedule, step_seconds: &mut Vec<f64>, mut tapped: Option<(&str, &mut dyn Tap)>) -> Result<Served, DeviceError> {
        let tapped_index = match &tapped {
            Some((id, _)) => Some(schedule.index_of(id).ok_or_else(|| err("schedule", format!("no request `{id}` to record the taps of")))?),
            None => None,
        };
        schedule.validate().map_err(|e| err("schedule", e))?;
        let n_vocab = self.spec.n_vocab;
        let fresh = || KvCache::paged(self.kv_cache, &self.spec);
        let mut slots: Vec<KvCache> = (0..schedule.slots).map(|_| fresh()).collect();
        let reused = schedule.prefix_sources();
        let mut kept: BTreeMap<usize, KvCache> = BTreeMap::new();
        let mut out: Served = BTreeMap::new();
        let fault = self.serve_fault;
        // Where a seeded fault moves a request's positions: by how much.
        let mut shift: BTreeMap<usize, isize> = BTreeMap::new();
        for step in schedule.steps() {
            let t0 = std::time::Instant::now();
            for &i in &step.arrivals {
                let r = &schedule.requests[i];
                if fault == Some(ServeFault::SlotNotCleared) && r.prefix.is_none() && slots[r.slot].len() > 0 {
                    shift.insert(i, slots[r.slot].len() as isize);
                    continue;
                }
                if fault == Some(ServeFault::PrefixOffByOne) && r.prefix.is_some() {
                    shift.insert(i, -1);
                }
                slots[r.slot] = match &r.prefix {
                    None => fresh(),
                    Some(p) => {
                        let si = schedule.index_of(&p.from).ok_or_else(|| err("schedule", format!("request `{}`: no request `{}`", r.id, p.from)))?;
                        let source = kept.get(&si).unwrap_or(&slots[schedule.requests[si].slot]);
                        let mut c = source.prefix(p.tokens, &self.spec).ok_or_else(|| err("schedule", format!("request `{}`: `{}` holds fewer than {} positions", r.id, p.from, p.tokens)))?;
                        if fault == Some(ServeFault::SsmStateNotRestored) {
                            c.forget_ssm_states();
                        }
                        c
                    }
                };
            }
            let segs: Vec<Seg> = step
                .segments
                .iter()
                .map(|g| {
                    let later_chunk = g.start > schedule.requests[g.request].first_computed();
                    let start = g.start.checked_add_signed(shift.get(&g.request).copied().unwrap_or(0)).unwrap_or(g.start);
                    Seg { cache: g.slot, start, tokens: g.tokens, fault: fault.filter(|_| later_chunk) }
                })
                .collect();
            if segs.is_empty() {
                // A step no request is active at (they arrive later).
                step_seconds.push(0.0);
                continue;
            }
            // The tapped request's rows of this step's batch, if it runs in it.
            let its_rows = tapped_index.and_then(|i| step.rows_of(i));
            let mut logits = match (&mut tapped, its_rows) {
                (Some((_, taps)), Some((rows, start))) => self.run_batch(&mut slots, &segs, &mut SegmentTap { inner: &mut **taps, rows, start }, true)?,
                _ => self.run_batch(&mut slots, &segs, &mut oracle::NoTap, true)?,
            };
            if fault == Some(ServeFault::LogitsSwapped) && segs.len() >= 2 {
                let (a, b) = ((segs[0].tokens.len() - 1) * n_vocab, (segs[0].tokens.len() + segs[1].tokens.len() - 1) * n_vocab);
                for c in 0..n_vocab {
                    logits.swap(a + c, b + c);
                }
            }
            step.deliver(schedule, &logits, n_vocab, &mut out);
            // A request that ends here and whose prefix a later one reuses: its cache is kept.
            for g in step.segments.iter().filter(|g| schedule.requests[g.request].last_step() == step.index) {
                if reused.get(&g.request).is_some_and(|last| *last > step.index) {
                    kept.insert(g.request, slots[g.slot].clone());
                }
            }
            kept.retain(|i, _| reused.get(i).is_some_and(|last| *last > step.index));
            step_seconds.push(t0.elapsed().as_secs_f64());
        }
        Ok(out)
    }
}
