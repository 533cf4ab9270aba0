//! A tap that records, of a batch's taps, one sequence's rows at its positions: how a device
//! that serves schedules records one request's taps while it runs in a batch.

use oracle::Tap;

/// Of a batch's taps (every row of the step), the rows of one segment, recorded at its positions.
pub(crate) struct SegmentTap<'a> {
    pub inner: &'a mut dyn Tap,
    /// The segment's rows in the batch.
    pub rows: std::ops::Range<usize>,
    /// The position of its first row.
    pub start: usize,
}

impl Tap for SegmentTap<'_> {
    fn enabled(&self) -> bool {
        self.inner.enabled()
    }
    fn record(&mut self, name: &str, _start: usize, n_tokens: usize, width: usize, data: &[f32]) {
        // A tap of fewer rows than the batch (the last row's logits alone) is not the segment's.
        if n_tokens >= self.rows.end {
            if let Some(mine) = data.get(self.rows.start * width..self.rows.end * width) {
                self.inner.record(name, self.start, self.rows.len(), width, mine);
            }
        }
    }
}
