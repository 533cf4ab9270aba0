//! Token embedding lookup: copies row `id` of the table for each token.

use super::{Mat, RowBuf};
use crate::error::{OracleError, Result};
use crate::real::Real;

/// `table: [n_vocab, n_embd]`, `ids: [m]` -> `[m, n_embd]`.
pub fn embed<T: Real>(table: &Mat<T>, ids: &[u32]) -> Result<Vec<T>> {
    let mut out = Vec::with_capacity(ids.len() * table.cols);
    let mut buf = RowBuf::default();
    for (pos, &id) in ids.iter().enumerate() {
        if id as usize >= table.rows {
            return Err(OracleError::Shape(format!("token id {id} at position {pos} is outside the vocabulary of {} tokens", table.rows)));
        }
        out.extend_from_slice(table.row(id as usize, &mut buf));
    }
    Ok(out)
}
