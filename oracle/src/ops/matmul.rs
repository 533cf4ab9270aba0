//! Matrix products `y = x W^T` with weights stored as rows (GGML layout: one output per row).

use super::check_len;
use crate::error::{OracleError, Result};
use crate::hugebuf::HugeBuf;
use crate::quant::{self, GgmlType};
use crate::real::Real;
use rayon::prelude::*;

/// A row-major matrix: `rows` outputs, each a row of `cols` weights, held either as values of the
/// storage scalar or packed as the model file stores them (a GGML type's bytes, decoded one row at
/// a time when it is used). A packed row decodes to exactly the values the decoded copy holds, so
/// every result is the same bits either way; packed weights trade decoding work for memory (a
/// Q4 model packed takes about an eighth of its f32 copy).
#[derive(Debug)]
pub struct Mat<T> {
    pub rows: usize,
    pub cols: usize,
    store: Store<T>,
}

/// Both kinds in `HugeBuf`s: a matrix of a megabyte or more on huge pages where the OS allows.
#[derive(Debug)]
enum Store<T> {
    Values(HugeBuf<T>),
    Packed { ty: GgmlType, row_bytes: usize, bytes: HugeBuf<u8> },
}

impl<T: Copy> Clone for Mat<T> {
    fn clone(&self) -> Mat<T> {
        let store = match &self.store {
            Store::Values(v) => Store::Values(v.clone()),
            Store::Packed { ty, row_bytes, bytes } => Store::Packed { ty: *ty, row_bytes: *row_bytes, bytes: bytes.clone() },
        };
        Mat { rows: self.rows, cols: self.cols, store }
    }
}

/// Scratch for the rows of packed matrices, reused from row to row by one thread.
#[derive(Default)]
pub struct RowBuf<T> {
    f: Vec<f32>,
    v: Vec<T>,
}

impl<T: Real> Mat<T> {
    pub fn new(rows: usize, cols: usize, data: Vec<T>) -> Result<Mat<T>> {
        check_len("matrix", data.len(), rows, cols)?;
        Ok(Mat { rows, cols, store: Store::Values(HugeBuf::from_vec(data)) })
    }

    /// A matrix kept as stored: `bytes` holds `rows` rows of `cols` values of type `ty`.
    pub fn packed(rows: usize, cols: usize, ty: GgmlType, bytes: Vec<u8>) -> Result<Mat<T>> {
        let row_bytes = ty.bytes_for(cols as u64).ok_or_else(|| {
            OracleError::Shape(format!("matrix: a row of {cols} values is not a whole number of {} blocks ({} values each)", ty.name(), ty.block_size()))
        })? as usize;
        if row_bytes.checked_mul(rows) != Some(bytes.len()) {
            return Err(OracleError::Shape(format!("matrix: {rows} rows of {cols} {} values take {row_bytes} bytes each, got {} bytes", ty.name(), bytes.len())));
        }
        Ok(Mat { rows, cols, store: Store::Packed { ty, row_bytes, bytes: HugeBuf::from_vec(bytes) } })
    }

    /// Whether the weights are held as stored and decoded row by row.
    pub fn is_packed(&self) -> bool {
        matches!(self.store, Store::Packed { .. })
    }

    /// All the values, row after row; None when the matrix is packed.
    pub fn values(&self) -> Option<&[T]> {
        match &self.store {
            Store::Values(data) => Some(data),
            Store::Packed { .. } => None,
        }
    }

    /// Row `r` as values: a slice of the matrix, or of `buf` where it was decoded.
    #[inline]
    pub fn row<'a>(&'a self, r: usize, buf: &'a mut RowBuf<T>) -> &'a [T] {
        match &self.store {
            Store::Values(data) => &data[r * self.cols..(r + 1) * self.cols],
            Store::Packed { ty, row_bytes, bytes } => {
                buf.f.resize(self.cols, 0.0);
                // The sizes were checked when the matrix was made, so this decode cannot fail.
                quant::decode_into(*ty, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut buf.f).expect("row sizes checked at construction");
                T::from_f32_row(&buf.f, &mut buf.v)
            }
        }
    }

    /// Bytes of storage (for bandwidth figures).
    pub fn n_bytes(&self) -> usize {
        match &self.store {
            Store::Values(data) => data.len() * std::mem::size_of::<T>(),
            Store::Packed { bytes, .. } => bytes.len(),
        }
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
    // Nested parallel iterators (one fork-join tree over every matrix's row groups): a flat Vec
    // of (matrix, first row, output) tasks fed to `into_par_iter` streamed a SmolLM2-sized GEMV
    // at 22.8 against 24.8 GB/s (2-thread Intel Xeon VM; `--example gemv_variants`).
    ws.par_iter().zip(outs.par_iter_mut()).for_each(|(w, out)| {
        out.par_chunks_mut(ROWS_PER_TASK * m).enumerate().for_each_init(RowBuf::default, |buf, (chunk, out)| {
            let r0 = chunk * ROWS_PER_TASK;
            for (dr, out_row) in out.chunks_mut(m).enumerate() {
                let wr = w.row(r0 + dr, buf);
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
