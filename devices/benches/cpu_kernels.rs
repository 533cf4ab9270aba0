//! Criterion microbenchmarks of the `cpu` device's hot kernel: the matrix-vector product on packed
//! quantized weights (Q8_0 activations x Q4_1 / Q5_0 / Q8_0 / K-quant blocks) at SmolLM2's shapes, so a
//! kernel change can be judged before the end-to-end A/B; and the same products for a 32-token
//! prefill (`cpu_gemm`); and attention for one decode step after 1,000 positions over 30 layers'
//! caches (more than the last-level cache holds, as in a real step), f32 and f16
//! (`cpu_attention_decode`). `cargo bench -p devices`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use devices::cpu::{matmul_packed, Packed};
use oracle::quant::{encode, GgmlType};
use std::hint::black_box;

fn vals(n: usize, seed: u32) -> Vec<f32> {
    (0..n).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / (1u32 << 24) as f32 - 0.5).collect()
}

/// `tokens` activation rows times a 1536-row weight matrix of each type (576 columns, 1536 for the
/// K-quants, whose super-blocks need a multiple of 256), as group `name`.
fn products(c: &mut Criterion, name: &str, tokens: usize, types: &[GgmlType]) {
    let rows = 1536usize;
    let mut g = c.benchmark_group(name);
    for &ty in types {
        let cols = if 576 % ty.block_size() == 0 { 576 } else { 1536 };
        let x = vals(tokens * cols, 7);
        let bytes = encode(ty, &vals(rows * cols, 9)).expect("encodes");
        g.throughput(Throughput::Bytes(bytes.len() as u64));
        let w = Packed { ty, rows, cols, bytes: &bytes };
        g.bench_function(format!("{ty:?} {rows}x{cols}"), |bn| bn.iter(|| matmul_packed(black_box(&x), tokens, Packed { ..w })));
    }
    g.finish();
}

fn gemv(c: &mut Criterion) {
    products(c, "cpu_gemv", 1, &[GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::F32]);
}

fn gemm(c: &mut Criterion) {
    products(c, "cpu_gemm_32_tokens", 32, &[GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K]);
}

/// SmolLM2's attention shape (9 query heads, 3 KV heads of 64), one query at position 999 of 30
/// layers' caches: the attention of one decode step.
fn attention_decode(c: &mut Criterion) {
    use devices::cpu::kernels::{attention, AttnCfg, KvValue};
    fn run<T: KvValue>(g: &mut criterion::BenchmarkGroup<criterion::measurement::WallTime>, name: &str, conv: fn(f32) -> T) {
        let (layers, len, cfg) = (30, 1000, AttnCfg { n_head: 9, n_head_kv: 3, head_dim: 64, window: 0, sinks: None, softcap: 0.0, scale: 0.125 });
        let width = cfg.n_head_kv * cfg.head_dim;
        let caches: Vec<(Vec<T>, Vec<T>)> = (0..layers)
            .map(|l| (vals(len * width, 2 * l as u32).into_iter().map(conv).collect(), vals(len * width, 2 * l as u32 + 1).into_iter().map(conv).collect()))
            .collect();
        let q = vals(cfg.n_head * cfg.head_dim, 3);
        g.throughput(Throughput::Bytes((layers * 2 * len * width * std::mem::size_of::<T>()) as u64));
        g.bench_function(format!("{name} 30 layers x 1000 positions"), |bn| {
            bn.iter(|| {
                for (k, v) in &caches {
                    black_box(attention(black_box(&q), &[len - 1], k, v, len, &cfg).expect("shapes"));
                }
            })
        });
    }
    let mut g = c.benchmark_group("cpu_attention_decode");
    run::<f32>(&mut g, "f32 cache", |x| x);
    run::<half::f16>(&mut g, "f16 cache", half::f16::from_f32);
    g.finish();
}

criterion_group!(benches, gemv, gemm, attention_decode);
criterion_main!(benches);
