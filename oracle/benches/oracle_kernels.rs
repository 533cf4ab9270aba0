//! Criterion microbenchmarks of the oracle's hot kernels: the fixed-order f64-accumulating dot
//! product and a SmolLM2-sized matrix-vector product. `cargo bench -p oracle`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;

fn vals(n: usize, seed: u32) -> Vec<f32> {
    (0..n).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / (1u32 << 24) as f32 - 0.5).collect()
}

fn dot(c: &mut Criterion) {
    let mut g = c.benchmark_group("oracle_dot_f32");
    for k in [576usize, 1536] {
        let (a, b) = (vals(k, 1), vals(k, 2));
        g.throughput(Throughput::Bytes((2 * k * 4) as u64));
        g.bench_function(format!("k={k}"), |bn| bn.iter(|| oracle::simd::dot_f32(black_box(&a), black_box(&b))));
    }
    g.finish();
}

fn gemv(c: &mut Criterion) {
    let (rows, cols) = (1536usize, 576usize);
    let w = oracle::ops::Mat::new(rows, cols, vals(rows * cols, 3)).unwrap();
    let x = vals(cols, 4);
    let mut g = c.benchmark_group("oracle_gemv_f32");
    g.throughput(Throughput::Bytes((rows * cols * 4) as u64));
    g.bench_function("1536x576", |bn| bn.iter(|| oracle::ops::matmul(black_box(&x), 1, black_box(&w)).unwrap()));
    g.finish();
}

criterion_group!(benches, dot, gemv);
criterion_main!(benches);
