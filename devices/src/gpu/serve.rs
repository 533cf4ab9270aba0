//! A GPU device (or the emulator) serving a schedule (`oracle::schedule`): every step one batch
//! of the active requests' chunks through the device's products, each request attending to its
//! own slot's device-resident cache; a slot emptied when a new request takes it; a reused prefix
//! copied on the device from the cache of the request that computed it (kept, moved out of its
//! slot, after that request ends for as long as a later one reuses it).

use super::cache::{KvCache, Seg};
use super::model::GpuModel;
use crate::shared::segment_tap::SegmentTap;
use oracle::schedule::{Schedule, Served};
use oracle::Tap;
use std::collections::BTreeMap;

impl GpuModel {
    /// Serves `schedule`, pushing each step's wall-clock seconds (to the logits on the host) to
    /// `step_seconds`.
    /// With `tapped` (a request's id and a tap), that request's taps are recorded as it runs:
    /// its rows of each step's batch, at its positions.
    pub(super) fn serve_schedule(&self, schedule: &Schedule, step_seconds: &mut Vec<f64>, mut tapped: Option<(&str, &mut dyn Tap)>) -> Result<Served, String> {
        schedule.validate().map_err(|e| format!("schedule: {e}"))?;
        let tapped_index = match &tapped {
            Some((id, _)) => Some(schedule.index_of(id).ok_or_else(|| format!("schedule: no request `{id}` to record the taps of"))?),
            None => None,
        };
        let n_vocab = self.spec.n_vocab;
        let mut slots: Vec<KvCache> = (0..schedule.slots).map(|_| KvCache::serving()).collect();
        let reused = schedule.prefix_sources();
        let mut kept: BTreeMap<usize, KvCache> = BTreeMap::new();
        let mut out = Served::new();
        for step in schedule.steps() {
            let t0 = std::time::Instant::now();
            for &i in &step.arrivals {
                let r = &schedule.requests[i];
                slots[r.slot] = match &r.prefix {
                    None => KvCache::serving(),
                    Some(p) => {
                        let si = schedule.index_of(&p.from).ok_or_else(|| format!("schedule: request `{}`: no request `{}`", r.id, p.from))?;
                        let source = kept.get(&si).unwrap_or(&slots[schedule.requests[si].slot]);
                        source.prefix(&self.gpu, &self.spec, p.tokens).map_err(|e| format!("request `{}`: {e}", r.id))?
                    }
                };
            }
            let segs: Vec<Seg> = step.segments.iter().map(|g| Seg { cache: g.slot, start: g.start, tokens: g.tokens }).collect();
            if segs.is_empty() {
                // A step no request is active at (they arrive later).
                step_seconds.push(0.0);
                continue;
            }
            let its_rows = tapped_index.and_then(|i| step.rows_of(i));
            let logits = match (&mut tapped, its_rows) {
                (Some((_, taps)), Some((rows, start))) => self.run_batch(&mut slots, &segs, &mut SegmentTap { inner: &mut **taps, rows, start }, true)?,
                _ => self.run_batch(&mut slots, &segs, &mut oracle::NoTap, true)?,
            };
            step.deliver(schedule, &logits, n_vocab, &mut out);
            // A request that ends here and whose prefix a later one reuses: its cache is kept.
            for g in step.segments.iter().filter(|g| schedule.requests[g.request].last_step() == step.index) {
                if reused.get(&g.request).is_some_and(|last| *last > step.index) {
                    kept.insert(g.request, std::mem::replace(&mut slots[g.slot], KvCache::empty()));
                }
            }
            kept.retain(|i, _| reused.get(i).is_some_and(|last| *last > step.index));
            step_seconds.push(t0.elapsed().as_secs_f64());
        }
        Ok(out)
    }
}
