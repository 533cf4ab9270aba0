//! Error statistics of a tap: RMS and largest errors, and the bulk of its values apart from massive activations.


/// Error statistics of one tap over all its positions.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct ErrStats {
    pub max_abs: f64,
    pub rms_err: f64,
    pub rms_ref: f64,
    pub cosine: f64,
    /// Positions where one side is finite and the other is not.
    pub nonfinite: usize,
    /// Position of the largest absolute error.
    pub worst_pos: usize,
}

impl ErrStats {
    pub fn rel(&self) -> f64 {
        if self.rms_ref > 0.0 { self.rms_err / self.rms_ref } else { self.rms_err }
    }
}

pub fn err_stats(device: &[f32], reference: &[f32], width: usize) -> ErrStats {
    let (mut se, mut sr, mut sd, mut dot, mut max_abs, mut worst, mut nonfinite) = (0.0, 0.0, 0.0, 0.0, 0.0f64, 0usize, 0usize);
    for (i, (&x, &r)) in device.iter().zip(reference).enumerate() {
        if !x.is_finite() || !r.is_finite() {
            if x.is_finite() != r.is_finite() || (x.is_nan() != r.is_nan()) {
                nonfinite += 1;
            }
            continue;
        }
        let (x, r) = (x as f64, r as f64);
        let e = (x - r).abs();
        if e > max_abs {
            max_abs = e;
            worst = i / width.max(1);
        }
        se += e * e;
        sr += r * r;
        sd += x * x;
        dot += x * r;
    }
    let n = device.len().max(1) as f64;
    let cosine = if sr > 0.0 && sd > 0.0 { dot / (sr.sqrt() * sd.sqrt()) } else if sr == sd { 1.0 } else { 0.0 };
    ErrStats { max_abs, rms_err: (se / n).sqrt(), rms_ref: (sr / n).sqrt(), cosine, nonfinite, worst_pos: worst }
}

/// A tap's value is massive when its magnitude exceeds this many times the tap's median
/// magnitude (its mean where the median is 0): SmolLM2's 22,500 against a median under 1. On
/// SmolLM2 at most 2.4% of a tap's values are (`blk.11.ffn_out`), on the synthetic models none.
pub const MASSIVE: f64 = 64.0;

/// The device's and the emulation's errors over a tap's bulk — its values without the massive
/// ones ([`MASSIVE`]), whose error is a sample of a few roundings — as relative RMS errors of
/// the bulk, with the number of massive values left out and over how many elements the two
/// errors together sit: (sum w)^2 / sum w^2, w each element's two squared errors summed — 1
/// when one element holds all of it, n when n hold equal parts, 0 without error.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct BulkErrors {
    pub device_rel: f64,
    pub emulated_rel: f64,
    pub massive: usize,
    pub spread: f64,
}

/// [`BulkErrors`] of `device` and `emulated` against `reference` (same lengths; elements not
/// finite on any side are left out, as `err_stats` counts them apart).
pub fn bulk_errors(device: &[f32], emulated: &[f32], reference: &[f32]) -> BulkErrors {
    let finite = |i: usize| device[i].is_finite() && emulated[i].is_finite() && reference[i].is_finite();
    let n = reference.len().min(device.len()).min(emulated.len());
    let mut magnitudes: Vec<f32> = (0..n).filter(|i| finite(*i)).map(|i| reference[i].abs()).collect();
    if magnitudes.is_empty() {
        return BulkErrors::default();
    }
    let mid = magnitudes.len() / 2;
    let median = *magnitudes.select_nth_unstable_by(mid, f32::total_cmp).1 as f64;
    let typical = if median > 0.0 { median } else { magnitudes.iter().map(|m| *m as f64).sum::<f64>() / magnitudes.len() as f64 };
    // Sums of the squared errors, of the squared values, and of the pooled weights' squares
    // (the spread's denominator), in one pass: no copy of a tap as large as the logits.
    let (mut sd, mut se, mut sr, mut sw2, mut massive) = (0.0, 0.0, 0.0, 0.0, 0usize);
    for i in (0..n).filter(|i| finite(*i)) {
        let r = reference[i] as f64;
        if r.abs() > MASSIVE * typical {
            massive += 1;
            continue;
        }
        let (d, e) = ((device[i] as f64 - r).powi(2), (emulated[i] as f64 - r).powi(2));
        (sd, se, sr, sw2) = (sd + d, se + e, sr + r * r, sw2 + (d + e) * (d + e));
    }
    let rel = |x: f64| if sr > 0.0 { (x / sr).sqrt() } else { x.sqrt() };
    let spread = if sw2 > 0.0 && (sd + se).is_finite() { (sd + se) * (sd + se) / sw2 } else { 0.0 };
    BulkErrors { device_rel: rel(sd), emulated_rel: rel(se), massive, spread }
}
