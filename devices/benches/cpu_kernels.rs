//! Criterion microbenchmarks of the `cpu` device's hot kernel: the matrix-vector product on packed
//! quantized weights (Q8_0 activations x Q4_1 / Q5_0 / Q8_0 / K-quant blocks) at SmolLM2's shapes, so a
//! kernel change can be judged before the end-to-end A/B. `cargo bench -p devices`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use devices::cpu::{matmul_packed, Packed};
use oracle::quant::{encode, GgmlType};
use std::hint::black_box;

fn vals(n: usize, seed: u32) -> Vec<f32> {
    (0..n).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / (1u32 << 24) as f32 - 0.5).collect()
}

fn gemv(c: &mut Criterion) {
    let (rows, cols) = (1536usize, 576usize);
    let x = vals(cols, 7);
    let mut g = c.benchmark_group("cpu_gemv");
    for ty in [GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::F32] {
        // K-quant super-blocks need k a multiple of 256.
        let cols = if cols % ty.block_size() == 0 { cols } else { 1536 };
        let x = if cols == x.len() { x.clone() } else { vals(cols, 7) };
        let bytes = encode(ty, &vals(rows * cols, 9)).expect("encodes");
        g.throughput(Throughput::Bytes(bytes.len() as u64));
        let w = Packed { ty, rows, cols, bytes: &bytes };
        g.bench_function(format!("{ty:?} {rows}x{cols}"), |bn| bn.iter(|| matmul_packed(black_box(&x), 1, Packed { ..w })));
    }
    g.finish();
}

criterion_group!(benches, gemv);
criterion_main!(benches);
