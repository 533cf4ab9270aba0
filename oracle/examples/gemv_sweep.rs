//! GEMV bandwidth sweep: the oracle's matmul (m = 1) over ~540 MB of f32 weights (the size of
//! SmolLM2 in f32), against a read-only probe over the same bytes, in one run and one thread pool.
//! `cargo run --release -p oracle --example gemv_sweep`

use oracle::ops::{matmul, Mat};
use rayon::prelude::*;
use std::time::Instant;

/// Read probe: 16 independent accumulators so the sum vectorizes.
fn sum16(c: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    for ch in c.chunks_exact(16) {
        for j in 0..16 {
            acc[j] += ch[j];
        }
    }
    acc.iter().sum()
}

fn main() {
    let (rows, cols) = (234_375usize, 576usize); // 135M weights = 540 MB
    let w = Mat::new(rows, cols, (0..rows * cols).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect()).unwrap();
    let data = w.values().expect("built from values");
    let x: Vec<f32> = (0..cols).map(|i| (i % 7) as f32 * 0.1).collect();
    let bytes = (rows * cols * 4) as f64;
    for round in 0..3 {
        let t = Instant::now();
        let y = matmul(&x, 1, &w).unwrap();
        let gemv = bytes / t.elapsed().as_secs_f64() / 1e9;
        let t = Instant::now();
        let s: f32 = data.par_chunks(1 << 16).map(sum16).sum();
        let read = bytes / t.elapsed().as_secs_f64() / 1e9;
        let t = Instant::now();
        let s2: f64 = data.par_chunks(1 << 16).map(sum_wide).sum();
        let wide = bytes / t.elapsed().as_secs_f64() / 1e9;
        std::hint::black_box((y, s, s2));
        println!("  widening read {wide:.2} GB/s");
        println!("round {round}: gemv {gemv:.2} GB/s, read probe {read:.2} GB/s, ratio {:.0}%  (path {}, {} threads)", 100.0 * gemv / read, oracle::simd::dot_path_name(), rayon::current_num_threads());
    }
}

/// Diagnostic: widen f32 -> f64 and add (no activation), to separate conversion cost from loads.
#[allow(dead_code)]
fn sum_wide(c: &[f32]) -> f64 {
    let mut acc = [0.0f64; 32];
    for ch in c.chunks_exact(32) {
        for j in 0..32 {
            acc[j] += ch[j] as f64;
        }
    }
    acc.iter().sum()
}
