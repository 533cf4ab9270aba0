//! Whole-model invariants of the GPU model code, run on `gpu-emu` (the GPU kernels on the host):
//! the same position gives the same bits whether it was reached by one prefill or token by token,
//! across a growth of the device KV cache (capacity 64, then doubled with a device copy); `reset`
//! starts over; the order in which threads and blocks run changes no bit; and bad input is an
//! error, not a crash. The per-tap accuracy budgets are the layer-diff gate's job
//! (xtask/tests/gpu.rs). Skipped, saying so, without a C++ compiler unless
//! `TOUCHSTONE_REQUIRE_GPU_EMU=1`.

use devices::{DeviceModel, ModelOptions};
use oracle::NoTap;

fn emu_model(name: &str) -> Option<Box<dyn DeviceModel>> {
    emu_model_on("gpu-emu", name)
}

fn emu_model_on(device: &str, name: &str) -> Option<Box<dyn DeviceModel>> {
    let dev = match devices::open(device) {
        Ok(d) => d,
        Err(e) => {
            assert!(std::env::var("TOUCHSTONE_REQUIRE_GPU_EMU").as_deref() != Ok("1"), "{e}");
            eprintln!("SKIPPED: {e}");
            return None;
        }
    };
    let path = fixtures::resolve(name, true).unwrap();
    Some(dev.load_model(&path, &ModelOptions::default()).unwrap())
}

#[test]
fn prefill_and_decode_give_the_same_bits_across_a_cache_growth() {
    for name in ["tiny-llama", "tiny-moe"] {
        let Some(mut a) = emu_model(name) else { return };
        let Some(mut b) = emu_model(name) else { return };
        let n_vocab = a.spec().n_vocab;
        let tokens: Vec<u32> = (0..80u32).map(|i| 1 + (i * 37) % (n_vocab as u32 - 1)).collect();
        let all = a.forward(&tokens, &mut NoTap).unwrap();
        assert_eq!(a.cached(), 80);
        // A fresh model: 50 in one prefill (capacity 64), then one at a time; at position 65 the
        // cache grows to 128 positions and its contents move by a device copy.
        let mut stepped = b.forward(&tokens[..50], &mut NoTap).unwrap();
        for t in &tokens[50..] {
            stepped.extend(b.forward(std::slice::from_ref(t), &mut NoTap).unwrap());
        }
        assert_eq!(b.cached(), 80);
        let differing = all.iter().zip(&stepped).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        assert_eq!(differing, 0, "{name}: {differing} of {} logits differ between one prefill and prefill + decode", all.len());
        assert!(all.iter().all(|v| v.is_finite()), "{name}: non-finite logits");
        // reset empties the cache; the same prefill again gives the same bits.
        a.reset();
        assert_eq!(a.cached(), 0);
        assert!(a.forward(&tokens, &mut NoTap).unwrap().iter().zip(&all).all(|(x, y)| x.to_bits() == y.to_bits()), "{name}: a second run after reset differs");
    }
}

#[test]
fn the_thread_order_changes_no_bit_of_the_logits() {
    // A GPU runs a block's threads, and a grid's blocks, in no promised order; the emulator can
    // run them forward, in reverse or shuffled (the last also checking that no two threads write
    // one shared word between barriers). A model whose kernels have no races gives the same bits
    // every way, prefill and decode.
    for name in ["tiny-llama", "tiny-qwen3", "tiny-moe"] {
        let mut runs = Vec::new();
        for device in ["gpu-emu", "gpu-emu:reverse", "gpu-emu:shuffle:racecheck"] {
            let Some(mut m) = emu_model_on(device, name) else { return };
            let n_vocab = m.spec().n_vocab as u32;
            let tokens: Vec<u32> = (0..12u32).map(|i| 1 + (i * 53) % (n_vocab - 1)).collect();
            let mut logits = m.forward(&tokens[..9], &mut NoTap).unwrap();
            for t in &tokens[9..] {
                logits.extend(m.forward(std::slice::from_ref(t), &mut NoTap).unwrap());
            }
            runs.push(logits);
        }
        for (i, other) in runs.iter().enumerate().skip(1) {
            let differing = runs[0].iter().zip(other).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
            assert_eq!(differing, 0, "{name}: schedule {i}: {differing} of {} logits differ from forward order", other.len());
        }
    }
}

#[test]
fn bad_tokens_are_errors_and_leave_the_cache_as_it_was() {
    let Some(mut m) = emu_model("tiny-qwen3") else { return };
    m.forward(&[1, 2, 3], &mut NoTap).unwrap();
    let n_vocab = m.spec().n_vocab as u32;
    let e = m.forward(&[4, n_vocab], &mut NoTap).unwrap_err().to_string();
    assert!(e.contains("outside the vocabulary") && e.starts_with("gpu-emu"), "{e}");
    assert!(m.forward(&[], &mut NoTap).is_err());
    assert_eq!(m.cached(), 3);
    assert!(m.memory_peak_bytes().unwrap() > 0);
}

/// Every launch is counted: each decode step of a dense model costs the same number of launches,
/// at least one per layer, and a step that is refused (a token outside the vocabulary) none.
#[test]
fn kernel_launches_are_counted_per_step() {
    let Some(mut m) = emu_model("tiny-llama") else { return };
    let n_layer = m.spec().n_layer as u64;
    let count = |m: &mut Box<dyn DeviceModel>, ids: &[u32]| {
        let before = m.kernel_launches().unwrap();
        let ok = m.forward(ids, &mut NoTap).is_ok();
        (ok, m.kernel_launches().unwrap() - before)
    };
    let (_, prefill) = count(&mut m, &[1, 2, 3, 4]);
    let steps: Vec<u64> = (5..9).map(|t| count(&mut m, &[t]).1).collect();
    assert!(prefill > n_layer && steps.iter().all(|s| *s == steps[0] && *s > n_layer), "prefill {prefill}, steps {steps:?}");
    let n_vocab = m.spec().n_vocab as u32;
    assert_eq!(count(&mut m, &[n_vocab]), (false, 0));
}

/// A kernel profile times every launch of the steps it covers and only those: its launches add up
/// to the launch counter's, per kernel, and a profiled step computes the same bits as one that
/// is not. Profiles of a prefix subtract out (`minus`), leaving the kernels of the later steps.
#[test]
fn a_kernel_profile_covers_exactly_the_launches_it_ran() {
    let Some(mut m) = emu_model("tiny-llama") else { return };
    let Some(mut plain) = emu_model("tiny-llama") else { return };
    assert!(m.start_kernel_profile());
    let before = m.kernel_launches().unwrap();
    let a = m.forward(&[1, 2, 3], &mut NoTap).unwrap();
    let first = m.take_kernel_profile().unwrap();
    assert_eq!(first.launches(), m.kernel_launches().unwrap() - before);
    assert!(first.kernels.iter().all(|k| k.launches > 0 && k.seconds > 0.0), "{first:?}");
    assert!(first.kernels.iter().any(|k| k.kernel == "ts_matmul_q") && first.kernels.iter().any(|k| k.kernel == "ts_attention"), "{first:?}");
    assert!(first.not_hardware.as_deref().is_some_and(|w| w.contains("say nothing about a GPU")), "{first:?}");
    assert_eq!(bits(&a), bits(&plain.forward(&[1, 2, 3], &mut NoTap).unwrap()));

    // Stopped: the next step is not in any profile.
    m.forward(&[4], &mut NoTap).unwrap();
    assert!(m.start_kernel_profile());
    let mid = m.kernel_launches().unwrap();
    m.forward(&[5], &mut NoTap).unwrap();
    m.forward(&[6], &mut NoTap).unwrap();
    let two = m.take_kernel_profile().unwrap();
    assert_eq!(two.launches(), m.kernel_launches().unwrap() - mid);
    assert!(two.launches() > 0 && two.launches() % 2 == 0, "{two:?}");
    // The two steps minus a profile of one of them: the other step's launches, per kernel.
    assert!(m.start_kernel_profile());
    m.forward(&[7], &mut NoTap).unwrap();
    let one = m.take_kernel_profile().unwrap();
    let rest = two.minus(&one);
    assert_eq!(rest.launches(), one.launches());
    for k in &rest.kernels {
        assert_eq!(Some(k.launches), one.kernels.iter().find(|o| o.kernel == k.kernel).map(|o| o.launches), "{k:?}");
    }
}

/// The GPU kernels on the emulator at the GPUs' block size, threads shuffled and shared-memory
/// races checked, or None (saying SKIPPED) where gpu-emu cannot run.
fn emu_gpu() -> Option<std::sync::Arc<devices::gpu::Gpu>> {
    match devices::gpu::emu::EmuBackend::open("shuffle:256:racecheck:fma") {
        Ok(b) => Some(devices::gpu::Gpu::new(Box::new(b))),
        Err(e) => {
            assert!(std::env::var("TOUCHSTONE_REQUIRE_GPU_EMU").as_deref() != Ok("1") || e.contains("lacks"), "{e}");
            eprintln!("SKIPPED: {e}");
            None
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn a_residual_add_fused_into_the_norm_gives_the_bits_of_two_launches() {
    let Some(g) = emu_gpu() else { return };
    let (rows, n) = (3, 576);
    let value = |i: usize, s: usize| ((i * 7919 + s) % 1013) as f32 / 97.0 - 5.0;
    let (x0, r, w): (Vec<f32>, Vec<f32>, Vec<f32>) = ((0..rows * n).map(|i| value(i, 1)).collect(), (0..rows * n).map(|i| value(i, 2)).collect(), (0..n).map(|i| value(i, 3) / 5.0).collect());
    let (rb, wb) = (g.upload_f32(&r).unwrap(), g.upload_f32(&w).unwrap());
    // Two launches: x = x + r, then y = norm(x) * w.
    let (xa, ya) = (g.upload_f32(&x0).unwrap(), g.upload_f32(&vec![f32::NAN; rows * n]).unwrap());
    g.add(xa.ptr, rb.ptr, xa.ptr, rows * n, rows * n).unwrap();
    g.rms_norm(xa.ptr, wb.ptr, ya.ptr, rows, n, 1e-5).unwrap();
    // One launch.
    let (xb, yb) = (g.upload_f32(&x0).unwrap(), g.upload_f32(&vec![f32::NAN; rows * n]).unwrap());
    let before = g.launches();
    g.add_rms_norm(xb.ptr, rb.ptr, wb.ptr, yb.ptr, rows, n, 1e-5).unwrap();
    assert_eq!(g.launches() - before, 1);
    assert!(bits(&xb.download_f32(rows * n).unwrap()) == bits(&xa.download_f32(rows * n).unwrap()), "the fused launch leaves another residual");
    assert!(bits(&yb.download_f32(rows * n).unwrap()) == bits(&ya.download_f32(rows * n).unwrap()), "the fused launch normalizes to other bits");
}

#[test]
fn q_and_k_normalized_by_one_launch_get_the_bits_of_two() {
    let Some(g) = emu_gpu() else { return };
    let (tokens, hd) = (3, 64);
    let (q0, k0): (Vec<f32>, Vec<f32>) = ((0..tokens * 4 * hd).map(|i| (i % 29) as f32 / 7.0 - 2.0).collect(), (0..tokens * 2 * hd).map(|i| (i % 31) as f32 / 9.0 - 1.5).collect());
    let (qw, kw) = (g.upload_f32(&(0..hd).map(|i| 0.5 + i as f32 / 64.0).collect::<Vec<_>>()).unwrap(), g.upload_f32(&(0..hd).map(|i| 1.5 - i as f32 / 64.0).collect::<Vec<_>>()).unwrap());
    let (qa, ka) = (g.upload_f32(&q0).unwrap(), g.upload_f32(&k0).unwrap());
    g.rms_norm(qa.ptr, qw.ptr, qa.ptr, tokens * 4, hd, 1e-6).unwrap();
    g.rms_norm(ka.ptr, kw.ptr, ka.ptr, tokens * 2, hd, 1e-6).unwrap();
    let (qb, kb) = (g.upload_f32(&q0).unwrap(), g.upload_f32(&k0).unwrap());
    let before = g.launches();
    g.rms_norm_pair((qb.ptr, qw.ptr, qb.ptr, tokens * 4), (kb.ptr, kw.ptr, kb.ptr, tokens * 2), hd, 1e-6).unwrap();
    assert_eq!(g.launches() - before, 1);
    assert!(bits(&qb.download_f32(q0.len()).unwrap()) == bits(&qa.download_f32(q0.len()).unwrap()), "Q differs");
    assert!(bits(&kb.download_f32(k0.len()).unwrap()) == bits(&ka.download_f32(k0.len()).unwrap()), "K differs");
}

#[test]
fn q_and_k_rotated_by_one_launch_get_the_bits_of_two() {
    let Some(g) = emu_gpu() else { return };
    let (tokens, hd, n_rot) = (3, 64, 48);
    let spec = oracle::spec::RopeSpec { style: oracle::spec::RopeStyle::Neox, theta: 10_000.0, n_rot, scaling: oracle::spec::RopeScaling::None, freq_factors: None, longrope_factors: None };
    let table = g.upload_f32(&devices::gpu::rope_table(&spec, 5..5 + tokens)).unwrap();
    let (q0, k0): (Vec<f32>, Vec<f32>) = ((0..tokens * 4 * hd).map(|i| (i % 29) as f32 / 7.0 - 2.0).collect(), (0..tokens * 2 * hd).map(|i| (i % 31) as f32 / 9.0 - 1.5).collect());
    for neox in [false, true] {
        let (qa, ka) = (g.upload_f32(&q0).unwrap(), g.upload_f32(&k0).unwrap());
        g.rope(qa.ptr, &table, tokens, 4, hd, n_rot, neox).unwrap();
        g.rope(ka.ptr, &table, tokens, 2, hd, n_rot, neox).unwrap();
        let (qb, kb) = (g.upload_f32(&q0).unwrap(), g.upload_f32(&k0).unwrap());
        let before = g.launches();
        g.rope_pair((qb.ptr, 4), (kb.ptr, 2), &table, tokens, hd, n_rot, neox).unwrap();
        assert_eq!(g.launches() - before, 1);
        assert!(bits(&qb.download_f32(q0.len()).unwrap()) == bits(&qa.download_f32(q0.len()).unwrap()), "neox {neox}: Q differs");
        assert!(bits(&kb.download_f32(k0.len()).unwrap()) == bits(&ka.download_f32(k0.len()).unwrap()), "neox {neox}: K differs");
        assert!(bits(&kb.download_f32(k0.len()).unwrap()) != bits(&k0), "neox {neox}: K was not rotated");
    }
}

#[test]
fn one_launch_for_several_matrices_gives_the_bits_of_one_launch_each() {
    // Q, K and V (or gate and up) multiply the same x: matmul_group runs them as one launch when
    // their plans share a kernel, and each output must hold exactly the bits of its own launch.
    use oracle::quant::GgmlType::{self, *};
    let Some(g) = emu_gpu() else { return };
    let cols = 576;
    let value = |i: usize| ((i * 7919 % 1013) as f32 - 506.0) / 512.0;
    let mat = |ty: GgmlType, rows: usize, seed: usize| {
        let w: Vec<f32> = (0..rows * cols).map(|i| value(i + seed)).collect();
        g.upload_mat(ty, rows, cols, &oracle::quant::encode(ty, &w).unwrap()).unwrap()
    };
    // (matrices, launches per 8 tokens): one packed family with three types; two float types
    // (16-byte loads); a packed and a float matrix, which take separate launches.
    let groups = [(vec![mat(Q4_1, 192, 1), mat(Q8_0, 64, 2), mat(Q5_0, 72, 3)], 1), (vec![mat(F16, 40, 4), mat(F32, 24, 5)], 1), (vec![mat(Q4_1, 24, 6), mat(F16, 16, 7)], 2)];
    for m in [1usize, 3, 11] {
        let x = g.upload_f32(&(0..m * cols).map(|i| value(3 * i)).collect::<Vec<_>>()).unwrap();
        for (mats, per_8_tokens) in &groups {
            let apart: Vec<Vec<u32>> = mats
                .iter()
                .map(|w| {
                    let y = g.alloc(4 * m * w.rows).unwrap();
                    g.matmul(w, x.ptr, cols, m, y.ptr).unwrap();
                    bits(&y.download_f32(m * w.rows).unwrap())
                })
                .collect();
            // NaN until written (the pool hands back the buffers the single launches just used).
            let ys: Vec<_> = mats.iter().map(|w| g.upload_f32(&vec![f32::NAN; m * w.rows]).unwrap()).collect();
            let group: Vec<_> = mats.iter().zip(&ys).map(|(w, y)| (w, y.ptr)).collect();
            let before = g.launches();
            g.matmul_group(&group, x.ptr, cols, m).unwrap();
            assert_eq!(g.launches() - before, (per_8_tokens * m.div_ceil(8)) as u64, "{m} tokens, {:?}", mats.iter().map(|w| w.ty).collect::<Vec<_>>());
            for ((w, y), want) in mats.iter().zip(&ys).zip(&apart) {
                let got = bits(&y.download_f32(m * w.rows).unwrap());
                assert!(got == *want, "{:?}, {m} tokens: the grouped launch differs from its own launch", w.ty);
            }
        }
    }
}

/// The embedding lookup of a model (`ts_get_rows`) on packed tables of every weight type: the
/// rows it decodes are the oracle codec's, bit for bit with IEEE arithmetic, and within an ulp or
/// so of them where the GPU contracts `q * d + m` into one fused multiply-add. (The kernel suite's
/// `embed` cases use f32 tables; the models' tables are Q8_0.)
#[test]
fn embedding_rows_of_every_weight_type_are_the_codecs_rows() {
    use oracle::quant::{decode, encode, GgmlType};
    let Some(fma) = emu_gpu() else { return };
    let plain = devices::gpu::Gpu::new(Box::new(devices::gpu::emu::EmuBackend::open("reverse:256").unwrap()));
    let (vocab, cols) = (37, 512);
    let mut r = oracle::ops::SplitMix64(5);
    let table: Vec<f32> = (0..vocab * cols).map(|_| (r.next_normal() * 0.7) as f32).collect();
    let ids: Vec<u32> = vec![36, 0, 5, 5, 17, 1];
    for ty in GgmlType::ALL {
        let bytes = encode(ty, &table).unwrap();
        let all = decode(ty, &bytes, vocab * cols).unwrap();
        let want: Vec<f32> = ids.iter().flat_map(|&i| all[i as usize * cols..(i as usize + 1) * cols].to_vec()).collect();
        for (g, exact) in [(&plain, true), (&fma, false)] {
            let w = g.upload_mat(ty, vocab, cols, &bytes).unwrap();
            let (ib, out) = (g.upload_u32(&ids).unwrap(), g.upload_f32(&vec![f32::NAN; ids.len() * cols]).unwrap());
            g.get_rows(&w, ib.ptr, ids.len(), out.ptr).unwrap();
            let got = out.download_f32(ids.len() * cols).unwrap();
            if exact {
                let first = bits(&got).iter().zip(bits(&want)).position(|(a, b)| *a != b);
                assert_eq!(first, None, "{}: first differing value at {first:?}", ty.name());
            } else {
                let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs() / b.abs().max(1e-30)).fold(0.0f32, f32::max);
                assert!(worst <= 2.0 * f32::EPSILON, "{}: relative error {worst}", ty.name());
            }
        }
    }
}

/// The GPU schedule executor (batches of segments, each attending to its own slot's device cache,
/// a reused prefix copied on the device, a finished request's cache kept for a later reuse) gives
/// every request the bits of `forward` on the same tokens alone; the threads' order changes none.
#[test]
fn served_requests_get_the_bits_of_their_run_alone() {
    use oracle::schedule::{Prefix, Request, Schedule};
    for (device, name) in [("gpu-emu", "tiny-gpt-oss"), ("gpu-emu:shuffle:racecheck", "tiny-llama")] {
        let Some(mut m) = emu_model_on(device, name) else { return };
        let n_vocab = m.spec().n_vocab as u32;
        let long: Vec<u32> = (0..40u32).map(|i| (i * 7919 + 11) % n_vocab).collect();
        let mut reuse = long[..23].to_vec();
        reuse.extend([3, 9, 27]);
        let other: Vec<u32> = (0..12u32).map(|i| (i * 31 + 5) % n_vocab).collect();
        let schedule = Schedule {
            slots: 2,
            requests: vec![
                Request { id: "long".into(), tokens: long.clone(), arrive: 0, chunks: vec![5, 17, 1, 17], slot: 0, prefix: None },
                Request { id: "other".into(), tokens: other.clone(), arrive: 1, chunks: vec![4, 8], slot: 1, prefix: None },
                // Arrives after `long` ended, in its slot: its prefix comes from the kept cache.
                Request { id: "reuse".into(), tokens: reuse.clone(), arrive: 5, chunks: vec![2, 1], slot: 0, prefix: Some(Prefix { from: "long".into(), tokens: 23 }) },
            ],
        };
        let served = m.serve(&schedule).expect("GPU devices serve").unwrap();
        assert!(m.batch_invariant());
        for (id, tokens, first) in [("long", &long, 0), ("reuse", &reuse, 23), ("other", &other, 0)] {
            m.reset();
            let alone = m.forward(tokens, &mut NoTap).unwrap();
            let want: Vec<u32> = alone[first * n_vocab as usize..].iter().map(|v| v.to_bits()).collect();
            let got: Vec<u32> = served[id].iter().map(|v| v.to_bits()).collect();
            assert!(got == want, "{device} {name}: request {id} differs from its run alone");
            // Its taps, recorded as it is served in its batches, are those of its run alone.
            let mut served_taps = oracle::RecordingTap::default();
            m.serve_tapped(&schedule, id, &mut served_taps).expect("GPU devices record taps while serving").unwrap();
            let mut alone_taps = oracle::RecordingTap::default();
            m.reset();
            m.forward(tokens, &mut alone_taps).unwrap();
            assert!(served_taps.order.len() >= 10, "{device} {name} {id}: {} taps", served_taps.order.len());
            for tap in &served_taps.order {
                let ((w, a), (_, b)) = (&served_taps.tensors[tap], &alone_taps.tensors[tap]);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert!(bits(&a[first * w..]) == bits(&b[first * w..]), "{device} {name}: request {id}'s tap {tap} served differs from alone");
            }
        }
    }
}
