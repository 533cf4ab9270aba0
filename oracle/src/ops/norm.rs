//! RMSNorm and LayerNorm over the last dimension.

use super::check_len;
use crate::error::Result;
use crate::real::{sum_f64_lanes, Real};
use rayon::prelude::*;

/// RMSNorm: `y = x / sqrt(mean(x^2) + eps) * weight`, with `x: [rows, n]`, `weight: [n]` (or none).
/// The mean is accumulated in f64 in the fixed lane order; each output is rounded once.
pub fn rms_norm<T: Real>(x: &[T], n: usize, weight: Option<&[T]>, eps: f64) -> Result<Vec<T>> {
    let rows = x.len().checked_div(n).unwrap_or(0);
    check_len("rms_norm input", x.len(), rows, n)?;
    if let Some(w) = weight {
        check_len("rms_norm weight", w.len(), 1, n)?;
    }
    let mut out = vec![T::default(); x.len()];
    out.par_chunks_mut(n.max(1)).zip(x.par_chunks(n.max(1))).for_each(|(y, row)| {
        let mean_sq = sum_f64_lanes(row.iter().map(|v| v.to_f64() * v.to_f64())) / n as f64;
        let scale = 1.0 / (mean_sq + eps).sqrt();
        for i in 0..n {
            let w = weight.map_or(1.0, |w| w[i].to_f64());
            y[i] = T::from_f64(row[i].to_f64() * scale * w);
        }
    });
    Ok(out)
}

/// LayerNorm: `y = (x - mean) / sqrt(var + eps) * weight + bias` over rows of length `n`.
pub fn layer_norm<T: Real>(x: &[T], n: usize, weight: Option<&[T]>, bias: Option<&[T]>, eps: f64) -> Result<Vec<T>> {
    let rows = x.len().checked_div(n).unwrap_or(0);
    check_len("layer_norm input", x.len(), rows, n)?;
    for (name, v) in [("weight", weight), ("bias", bias)] {
        if let Some(v) = v {
            check_len(&format!("layer_norm {name}"), v.len(), 1, n)?;
        }
    }
    let mut out = vec![T::default(); x.len()];
    out.par_chunks_mut(n.max(1)).zip(x.par_chunks(n.max(1))).for_each(|(y, row)| {
        let mean = sum_f64_lanes(row.iter().map(|v| v.to_f64())) / n as f64;
        let var = sum_f64_lanes(row.iter().map(|v| (v.to_f64() - mean).powi(2))) / n as f64;
        let scale = 1.0 / (var + eps).sqrt();
        for i in 0..n {
            let w = weight.map_or(1.0, |w| w[i].to_f64());
            let b = bias.map_or(0.0, |b| b[i].to_f64());
            y[i] = T::from_f64((row[i].to_f64() - mean) * scale * w + b);
        }
    });
    Ok(out)
}
