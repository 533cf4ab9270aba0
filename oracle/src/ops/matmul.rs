//! Matrix products `y = x W^T` with weights stored as rows (GGML layout: one output per row).

use super::check_len;
use crate::error::{OracleError, Result};
use crate::real::Real;
use rayon::prelude::*;

/// A row-major matrix: `rows` outputs, each a row of `cols` weights.
#[derive(Clone, Debug, Default)]
pub struct Mat<T> {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<T>,
}

impl<T: Real> Mat<T> {
    pub fn new(rows: usize, cols: usize, data: Vec<T>) -> Result<Mat<T>> {
        check_len("matrix", data.len(), rows, cols)?;
        Ok(Mat { rows, cols, data })
    }

    #[inline]
    pub fn row(&self, r: usize) -> &[T] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Bytes of storage (for bandwidth figures).
    pub fn n_bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<T>()
    }
}

/// Rows of W handed to one rayon task. Large enough to amortise scheduling, small enough to
/// balance 2..64 threads on the smallest projection of the tiny models.
const ROWS_PER_TASK: usize = 16;

/// `x: [m, k]`, `w: [n, k]` -> `y: [m, n]` with `y[t][r] = sum_i x[t][i] * w[r][i]`,
/// accumulated in f64 (fixed lane order) and rounded once.
///
/// Work is split over rows of W; for each row all `m` tokens are done while the row is in cache,
/// which keeps prefill close to one pass over the weights.
pub fn matmul<T: Real>(x: &[T], m: usize, w: &Mat<T>) -> Result<Vec<T>> {
    let (n, k) = (w.rows, w.cols);
    if x.len() != m * k {
        return Err(OracleError::Shape(format!("matmul: x has {} values, expected {m} x {k}", x.len())));
    }
    // y_t: [n, m] so that each task owns a contiguous slice; transposed at the end when m > 1.
    let mut y_t = vec![T::default(); n * m];
    if m == 0 || n == 0 {
        return Ok(y_t);
    }
    y_t.par_chunks_mut(ROWS_PER_TASK * m).enumerate().for_each(|(chunk, out)| {
        let r0 = chunk * ROWS_PER_TASK;
        for (dr, out_row) in out.chunks_mut(m).enumerate() {
            let wr = w.row(r0 + dr);
            for (t, o) in out_row.iter_mut().enumerate() {
                *o = T::from_f64(T::dot(&x[t * k..(t + 1) * k], wr));
            }
        }
    });
    if m == 1 {
        return Ok(y_t);
    }
    let mut y = vec![T::default(); m * n];
    for r in 0..n {
        for t in 0..m {
            y[t * n + r] = y_t[r * m + t];
        }
    }
    Ok(y)
}
