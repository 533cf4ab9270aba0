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
    Ok(matmul_many(x, m, &[w])?.pop().expect("one output per matrix"))
}

/// Several products of the same input (Q/K/V, gate/up) in one parallel pass: one fork-join
/// instead of one per matrix. Each output is exactly what `matmul` returns for that matrix.
pub fn matmul_many<T: Real>(x: &[T], m: usize, ws: &[&Mat<T>]) -> Result<Vec<Vec<T>>> {
    let k = ws.first().map_or(0, |w| w.cols);
    for w in ws {
        if w.cols != k || x.len() != m * k {
            return Err(OracleError::Shape(format!("matmul: x has {} values, expected {m} x {}", x.len(), w.cols)));
        }
    }
    // y_t: [n, m] per matrix, so that each task owns a contiguous slice; transposed when m > 1.
    let mut outs: Vec<Vec<T>> = ws.iter().map(|w| vec![T::default(); w.rows * m]).collect();
    if m == 0 || k == 0 {
        return Ok(outs);
    }
    // The activations are widened to f64 once (exact), so the per-row kernels only widen weights.
    let xw: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
    let xrow = |t: usize| &xw[t * k..(t + 1) * k];
    let mut tasks: Vec<(&Mat<T>, usize, &mut [T])> = Vec::new();
    for (w, out) in ws.iter().zip(outs.iter_mut()) {
        for (chunk, o) in out.chunks_mut(ROWS_PER_TASK * m).enumerate() {
            tasks.push((w, chunk * ROWS_PER_TASK, o));
        }
    }
    tasks.into_par_iter().for_each(|(w, r0, out)| {
        for (dr, out_row) in out.chunks_mut(m).enumerate() {
            let wr = w.row(r0 + dr);
            // Four tokens per pass over the row; each result is bit-identical to a single dot.
            let mut t = 0;
            while t + 4 <= m {
                let d = T::dot4_wide([xrow(t), xrow(t + 1), xrow(t + 2), xrow(t + 3)], wr);
                for j in 0..4 {
                    out_row[t + j] = T::from_f64(d[j]);
                }
                t += 4;
            }
            for t in t..m {
                out_row[t] = T::from_f64(T::dot_wide(xrow(t), wr));
            }
        }
    });
    if m == 1 {
        return Ok(outs);
    }
    Ok(ws
        .iter()
        .zip(outs)
        .map(|(w, y_t)| {
            let n = w.rows;
            let mut y = vec![T::default(); m * n];
            for r in 0..n {
                for t in 0..m {
                    y[t * n + r] = y_t[r * m + t];
                }
            }
            y
        })
        .collect())
}
