//! The parts of the bandwidth probe (`Device::bandwidth_probe`, `cargo xtask roofline`) that every
//! device shares: the weight types and row length, the activations, the weight matrices and the
//! best-of-N timing. Each device supplies only how it copies, multiplies and times.

use oracle::quant::GgmlType;

/// GEMV rows are this long (a 7B model's hidden size is 4096, its FFN width 11008; long rows keep
/// the per-row reduction a small share of the time).
pub const COLS: usize = 8192;

/// The weight types whose GEMV is measured.
pub const TYPES: [GgmlType; 7] = [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q6_K];

/// Threads per weight row a GPU probe also times besides its matmul's own choice (block size
/// permitting), so one run shows which shape reads its weights fastest.
pub const SWEEP_LANES: [u32; 6] = [8, 16, 32, 64, 128, 256];

/// Checks that a GEMV in another launch shape computed what the first did: the shapes sum each
/// row in a different order, so the results may differ by rounding only (relative 1e-4 of the
/// row's largest magnitude).
pub fn same_gemv(want: &[f32], got: &[f32], what: &str) -> Result<(), String> {
    let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs())).max(f32::MIN_POSITIVE);
    match want.iter().zip(got).position(|(a, b)| !((a - b).abs() <= 1e-4 * scale)) {
        Some(i) => Err(format!("{what}: row {i} is {} where the matmul's own shape gave {} (largest |y| {scale})", got[i], want[i])),
        None if want.len() != got.len() => Err(format!("{what}: {} rows where the matmul's own shape gave {}", got.len(), want.len())),
        None => Ok(()),
    }
}

/// The one token multiplied by every weight matrix.
pub fn activations() -> Vec<f32> {
    (0..COLS).map(|i| ((i % 7) as f32 - 3.0) * 0.25).collect()
}

/// About `bytes` of `ty` weights, `COLS` wide: one encoded row, repeated (the values do not change
/// the time, only the bytes read). Returns the row count and the packed matrix.
pub fn weights(ty: GgmlType, bytes: usize) -> Result<(usize, Vec<u8>), String> {
    let row: Vec<f32> = (0..COLS).map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0).collect();
    let row_bytes = oracle::quant::encode(ty, &row).map_err(|e| e.to_string())?;
    let rows = (bytes / row_bytes.len()).max(1);
    let mut w = with_capacity(rows * row_bytes.len(), "weight matrix")?;
    for _ in 0..rows {
        w.extend_from_slice(&row_bytes);
    }
    Ok((rows, w))
}

/// `n` copies of `v`, or an error naming the buffer when the host cannot hold it (a size asked
/// for on the command line must not abort the process).
pub fn filled<T: Clone>(v: T, n: usize, what: &str) -> Result<Vec<T>, String> {
    let mut out = with_capacity(n, what)?;
    out.resize(n, v);
    Ok(out)
}

/// An empty vector with room for `n` values, or an error naming the buffer.
fn with_capacity<T>(n: usize, what: &str) -> Result<Vec<T>, String> {
    let mut out = Vec::new();
    out.try_reserve_exact(n).map_err(|_| {
        format!("cannot allocate the {what}: {n} x {} bytes ({:.1} GiB) on the host", std::mem::size_of::<T>(), n as f64 * std::mem::size_of::<T>() as f64 / (1u64 << 30) as f64)
    })?;
    Ok(out)
}

/// Floats in a copy buffer of about `bytes` (a multiple of 4, so the copy can move 16 bytes at a time).
pub fn copy_floats(bytes: usize) -> usize {
    (bytes / 16).max(1) * 4
}

/// The best (smallest) of `reps` timings of `f` after one warm-up run; `time` measures one run
/// (device events on GPUs, the wall clock on the CPU).
pub fn best_of(reps: usize, time: &dyn Fn(&mut dyn FnMut() -> Result<(), String>) -> Result<f64, String>, f: &mut dyn FnMut() -> Result<(), String>) -> Result<f64, String> {
    f()?;
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        best = best.min(time(f)?);
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::same_gemv;

    #[test]
    fn same_gemv_allows_rounding_and_refuses_a_wrong_row() {
        let want = [1.0f32, -2.0, 3.0, 0.0];
        assert!(same_gemv(&want, &[1.0, -2.0 + 1e-5, 3.0, 1e-5], "x").is_ok());
        let e = same_gemv(&want, &[1.0, -2.0, 3.1, 0.0], "f16 GEMV").unwrap_err();
        assert!(e.contains("f16 GEMV: row 2 is 3.1"), "{e}");
        assert!(same_gemv(&want, &[1.0, f32::NAN, 3.0, 0.0], "x").unwrap_err().contains("row 1 is NaN"));
        assert!(same_gemv(&want, &want[..3], "x").unwrap_err().contains("3 rows"));
    }
}
