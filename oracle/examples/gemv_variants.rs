//! Variants of the decode GEMV loop, timed against each other: what the oracle's choices (prefetch
//! distance and hint, register width, how row groups are handed to rayon) were measured with.
//! Every variant reads the same ~540 MB f32 matrix (SmolLM2's size, the oracle's huge-page store)
//! and runs once per round, all interleaved; medians over the rounds. Needs AVX-512F.
//! `cargo run --release -p oracle --example gemv_variants [ROUNDS]`

#[cfg(target_arch = "x86_64")]
mod variants {
    use oracle::ops::{matmul, Mat};
    use rayon::prelude::*;
    use std::arch::x86_64::*;
    use std::time::Instant;

    const K: usize = 576;
    const ROWS_PER_TASK: usize = 16;

    /// One row's dot in 512-bit registers, prefetching `PF` bytes ahead with hint `H` (none when
    /// `PF` is 0).
    #[target_feature(enable = "avx512f")]
    unsafe fn dot_zmm<const PF: usize, const H: i32>(x: &[f64], w: &[f32]) -> f64 {
        let (px, pw) = (x.as_ptr(), w.as_ptr());
        let mut acc = [_mm512_setzero_pd(); 4];
        let mut i = 0;
        while i + 32 <= K {
            if PF > 0 {
                let ahead = pw.wrapping_add(i).cast::<i8>().wrapping_add(PF);
                _mm_prefetch::<H>(ahead);
                _mm_prefetch::<H>(ahead.wrapping_add(64));
            }
            for (q, a) in acc.iter_mut().enumerate() {
                let wv = _mm512_cvtps_pd(_mm256_loadu_ps(pw.add(i + 8 * q)));
                *a = _mm512_fmadd_pd(_mm512_loadu_pd(px.add(i + 8 * q)), wv, *a);
            }
            i += 32;
        }
        _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(acc[0], acc[2]), _mm512_add_pd(acc[1], acc[3])))
    }

    /// The same in 256-bit registers, prefetching 1,024 bytes ahead.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_ymm(x: &[f64], w: &[f32]) -> f64 {
        let (px, pw) = (x.as_ptr(), w.as_ptr());
        let mut acc = [_mm256_setzero_pd(); 8];
        let mut i = 0;
        while i + 32 <= K {
            let ahead = pw.wrapping_add(i).cast::<i8>().wrapping_add(1024);
            _mm_prefetch::<_MM_HINT_T0>(ahead);
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64));
            for (q, a) in acc.iter_mut().enumerate() {
                let wv = _mm256_cvtps_pd(_mm_loadu_ps(pw.add(i + 4 * q)));
                *a = _mm256_fmadd_pd(_mm256_loadu_pd(px.add(i + 4 * q)), wv, *a);
            }
            i += 32;
        }
        let mut lanes = [0.0f64; 32];
        for (q, a) in acc.iter().enumerate() {
            _mm256_storeu_pd(lanes.as_mut_ptr().add(4 * q), *a);
        }
        lanes.iter().sum()
    }

    type Dot = unsafe fn(&[f64], &[f32]) -> f64;

    /// Groups of `ROWS_PER_TASK` rows through `par_chunks_mut` (what `matmul_many` does).
    fn nested(w: &[f32], x: &[f64], y: &mut [f32], dot: Dot) {
        y.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(c, ys)| {
            for (dr, o) in ys.iter_mut().enumerate() {
                let r = c * ROWS_PER_TASK + dr;
                // SAFETY: main checked avx512f (which implies avx2 and fma on every CPU that has it).
                *o = unsafe { dot(x, &w[r * K..(r + 1) * K]) } as f32;
            }
        });
    }

    /// The same groups collected into a `Vec` of tasks first, then `into_par_iter`.
    fn flat(w: &[f32], x: &[f64], y: &mut [f32], dot: Dot) {
        let tasks: Vec<(usize, &mut [f32])> = y.chunks_mut(ROWS_PER_TASK).enumerate().map(|(c, o)| (c * ROWS_PER_TASK, o)).collect();
        tasks.into_par_iter().for_each(|(r0, ys)| {
            for (dr, o) in ys.iter_mut().enumerate() {
                let r = r0 + dr;
                // SAFETY: as in `nested`.
                *o = unsafe { dot(x, &w[r * K..(r + 1) * K]) } as f32;
            }
        });
    }

    pub fn run(rounds: usize) {
        if !is_x86_feature_detected!("avx512f") || !is_x86_feature_detected!("fma") {
            println!("gemv_variants: this CPU lacks AVX-512F; nothing to measure");
            return;
        }
        let rows = 234_375usize;
        let mat = Mat::new(rows, K, (0..rows * K).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect()).expect("sizes agree");
        let w = mat.values().expect("built from values");
        let x32: Vec<f32> = (0..K).map(|i| (i % 7) as f32 * 0.1).collect();
        let x: Vec<f64> = x32.iter().map(|&v| v as f64).collect();
        let mut y = vec![0.0f32; rows];
        let variants: Vec<(&str, Box<dyn Fn(&mut [f32])>)> = vec![
            ("oracle matmul (as shipped)", Box::new(|_| drop(std::hint::black_box(matmul(&x32, 1, &mat))))),
            ("no prefetch", Box::new(|y| nested(w, &x, y, dot_zmm::<0, _MM_HINT_T0>))),
            ("prefetch 768 B", Box::new(|y| nested(w, &x, y, dot_zmm::<768, _MM_HINT_T0>))),
            ("prefetch 1,024 B", Box::new(|y| nested(w, &x, y, dot_zmm::<1024, _MM_HINT_T0>))),
            ("prefetch 1,536 B", Box::new(|y| nested(w, &x, y, dot_zmm::<1536, _MM_HINT_T0>))),
            ("prefetch 2,048 B", Box::new(|y| nested(w, &x, y, dot_zmm::<2048, _MM_HINT_T0>))),
            ("prefetch 4,096 B", Box::new(|y| nested(w, &x, y, dot_zmm::<4096, _MM_HINT_T0>))),
            ("prefetch 1,536 B to L2 only", Box::new(|y| nested(w, &x, y, dot_zmm::<1536, _MM_HINT_T1>))),
            ("prefetch 1,536 B non-temporal", Box::new(|y| nested(w, &x, y, dot_zmm::<1536, _MM_HINT_NTA>))),
            ("256-bit, prefetch 1,024 B", Box::new(|y| nested(w, &x, y, dot_ymm))),
            ("prefetch 1,536 B, flat Vec of tasks", Box::new(|y| flat(w, &x, y, dot_zmm::<1536, _MM_HINT_T0>))),
        ];
        let bytes = (rows * K * 4) as f64;
        let mut gbps: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
        for round in 0..rounds {
            for (v, (_, f)) in variants.iter().enumerate() {
                let t = Instant::now();
                f(&mut y);
                gbps[v].push(bytes / t.elapsed().as_secs_f64() / 1e9);
                std::hint::black_box(&y);
            }
            eprint!("\rround {}/{rounds}", round + 1);
        }
        eprintln!();
        println!("{} rounds, {} threads; GB/s of weights read (median, lowest quarter, best):", rounds, rayon::current_num_threads());
        for ((name, _), mut g) in variants.iter().zip(gbps) {
            g.sort_by(f64::total_cmp);
            println!("  {name:38} {:6.1} {:6.1} {:6.1}", g[g.len() / 2], g[g.len() / 4], g[g.len() - 1]);
        }
    }
}

fn main() {
    let rounds = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(15usize).max(1);
    #[cfg(target_arch = "x86_64")]
    variants::run(rounds);
    #[cfg(not(target_arch = "x86_64"))]
    println!("gemv_variants: x86-64 only (AVX-512F); {rounds} rounds not run");
}
