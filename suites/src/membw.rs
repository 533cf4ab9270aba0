//! A STREAM-style memory-bandwidth probe, run on the same rayon pool (same thread count) as the
//! code it is compared with, over buffers far larger than the last-level cache.

use rayon::prelude::*;
use std::time::Instant;

#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Bandwidth {
    /// Best read-only pass (sum of f32), GB/s (1e9 bytes/s).
    pub read_gbps: f64,
    /// Best copy pass, counting bytes read + bytes written, GB/s.
    pub copy_gbps: f64,
    pub buffer_bytes: usize,
    pub threads: usize,
}

/// Sums a slice with 16 independent f32 accumulators (vectorizes without target flags).
fn sum_f32(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for j in 0..16 {
            acc[j] += c[j];
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// Measures read and copy bandwidth over `bytes`-sized buffers, best of `reps` passes.
pub fn probe(bytes: usize, reps: usize) -> Bandwidth {
    let n = bytes / 4;
    let src: Vec<f32> = (0..n).into_par_iter().map(|i| (i % 7) as f32).collect();
    let mut dst = vec![0.0f32; n];
    let chunk = (n / (rayon::current_num_threads() * 8)).max(1 << 16);
    let mut best_read = f64::INFINITY;
    let mut best_copy = f64::INFINITY;
    let mut sink = 0.0f32;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        sink += src.par_chunks(chunk).map(sum_f32).sum::<f32>();
        best_read = best_read.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        dst.par_chunks_mut(chunk).zip(src.par_chunks(chunk)).for_each(|(d, s)| d.copy_from_slice(s));
        best_copy = best_copy.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box((sink, &dst));
    Bandwidth {
        read_gbps: (n * 4) as f64 / best_read / 1e9,
        copy_gbps: (2 * n * 4) as f64 / best_copy / 1e9,
        buffer_bytes: n * 4,
        threads: rayon::current_num_threads(),
    }
}
