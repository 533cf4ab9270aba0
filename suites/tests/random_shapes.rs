//! The proptest layer of the kernel gate: shapes drawn at random (not just the registry's list),
//! inputs from a drawn seed, run on the cpu and fixed devices and on the GPU kernels through the
//! emulator (`gpu-emu:shuffle:256:racecheck:fma`: the GPUs' block size and contraction, threads in
//! a shuffled order, shared-memory races checked; skipped, saying so, where the emulator cannot
//! build, unless `TOUCHSTONE_REQUIRE_GPU_EMU=1`); every case must pass its derived bound.
//! proptest shrinks a failure to the smallest shape that still fails.

use devices::Device;
use oracle::ops::SplitMix64;
use oracle::quant::{encode, GgmlType};
use oracle::registry::{activations, Input, Op, OpCase, Tensor};
use proptest::prelude::*;
use reports::Verdict;
use suites::kernels::run_case;

fn t(shape: &[usize], data: Vec<f32>) -> Input {
    Input::F32(Tensor { shape: shape.to_vec(), data })
}

/// The GPU kernels on the emulator, opened once per test binary (None, saying SKIPPED, where it
/// cannot build).
fn gpu_emu() -> Option<&'static dyn Device> {
    static GPU: std::sync::OnceLock<Option<Box<dyn Device>>> = std::sync::OnceLock::new();
    GPU.get_or_init(|| match devices::open("gpu-emu:shuffle:256:racecheck:fma") {
        Ok(d) => Some(d),
        Err(e) => {
            assert!(std::env::var("TOUCHSTONE_REQUIRE_GPU_EMU").as_deref() != Ok("1"), "{e}");
            eprintln!("SKIPPED on gpu-emu: {e}");
            None
        }
    })
    .as_deref()
}

fn check(case: OpCase) -> Result<(), TestCaseError> {
    let (cpu, fixed) = (devices::cpu::CpuDevice::default(), devices::fixed::FixedDevice { int4: false });
    let mut devs: Vec<&dyn Device> = vec![&cpu, &fixed];
    devs.extend(gpu_emu());
    for dev in devs {
        let r = run_case(dev, &case, false);
        prop_assert!(matches!(r.verdict, Verdict::Pass | Verdict::Unsupported), "{} on {}: {:?} {:?}", case.id, dev.name(), r.verdict, r.message);
    }
    Ok(())
}

fn mk(op: Op, seed: u64, inputs: Vec<(&'static str, Input)>, params: &[(&'static str, f64)]) -> OpCase {
    OpCase { op, id: format!("{op}(random,seed={seed})"), seed, inputs, params: params.iter().copied().collect() }
}

/// -0.0 equals +0.0: ranked by index like any other tie (the cpu device's top_k once ranked +0.0
/// first, found by `argmax_and_top_k_random_shapes`).
#[test]
fn signed_zeros_tie_and_the_lower_index_ranks_first() {
    let x = vec![0.0f32, -0.0, 0.0, -1.0, -0.0, -0.0, 0.0];
    let params = [("k", 5.0), ("temperature", 0.8), ("top_p", 0.9)];
    for op in [Op::Argmax, Op::TopK, Op::Sample] {
        check(mk(op, 7, vec![("x", t(&[1, x.len()], x.clone()))], &params)).unwrap();
    }
    assert_eq!(oracle::ops::top_k(&x, 5), [0, 1, 2, 4, 5]);
}

proptest! {
    // A fixed seed unless PROPTEST_RNG_SEED is set: CI draws the same shapes on every commit.
    #![proptest_config(ProptestConfig {
        cases: 48,
        failure_persistence: None,
        rng_seed: if std::env::var_os("PROPTEST_RNG_SEED").is_some() { ProptestConfig::default().rng_seed } else { proptest::test_runner::RngSeed::Fixed(0x05ee_d0f5_a9e5) },
        ..ProptestConfig::default()
    })]

    #[test]
    fn matmul_random_shapes(m in 1usize..6, n in 1usize..40, kb in 1usize..12, ty_i in 0usize..11, seed in any::<u64>()) {
        let ty = GgmlType::ALL[ty_i];
        let k = kb * if ty.block_size() == 256 { 256 } else { 32 };
        let mut r = SplitMix64(seed);
        let w: Vec<f32> = (0..n * k).map(|_| (r.next_normal() / (k as f64).sqrt()) as f32).collect();
        let x = activations(&mut r, m, k);
        let bytes = encode(ty, &w).unwrap();
        check(mk(Op::Matmul, seed, vec![("x", t(&[m, k], x)), ("w", Input::Quant { ty, rows: n, cols: k, bytes })], &[]))?;
    }

    #[test]
    fn rms_norm_random_shapes(rows in 1usize..6, n in 1usize..700, seed in any::<u64>()) {
        let mut r = SplitMix64(seed);
        let x = activations(&mut r, rows, n);
        let w: Vec<f32> = (0..n).map(|_| (1.0 + 0.1 * r.next_normal()) as f32).collect();
        check(mk(Op::RmsNorm, seed, vec![("x", t(&[rows, n], x)), ("weight", t(&[n], w))], &[("eps", 1e-5)]))?;
    }

    #[test]
    fn softmax_random_shapes(rows in 1usize..5, n in 1usize..500, seed in any::<u64>()) {
        let mut r = SplitMix64(seed);
        let x: Vec<f32> = (0..rows * n).map(|_| (r.next_normal() * 4.0) as f32).collect();
        check(mk(Op::Softmax, seed, vec![("x", t(&[rows, n], x))], &[]))?;
    }

    #[test]
    fn attention_random_shapes(nkv in 1usize..4, group in 1usize..4, hd_half in 1usize..40, kv_len in 1usize..40, m_frac in 0.0f64..1.0, seed in any::<u64>()) {
        let (nh, hd) = (nkv * group, 2 * hd_half);
        let m = ((kv_len as f64 * m_frac) as usize).clamp(1, kv_len);
        let mut r = SplitMix64(seed);
        let q = activations(&mut r, m, nh * hd);
        let k: Vec<f32> = (0..kv_len * nkv * hd).map(|_| r.next_normal() as f32).collect();
        let v: Vec<f32> = (0..kv_len * nkv * hd).map(|_| r.next_normal() as f32).collect();
        let pos: Vec<u32> = (kv_len - m..kv_len).map(|p| p as u32).collect();
        check(mk(
            Op::Attention,
            seed,
            vec![("q", t(&[m, nh * hd], q)), ("k", t(&[kv_len, nkv * hd], k)), ("v", t(&[kv_len, nkv * hd], v)), ("pos", Input::Ids(pos))],
            &[("n_head", nh as f64), ("n_head_kv", nkv as f64), ("head_dim", hd as f64), ("window", 0.0)],
        ))?;
    }

    #[test]
    fn rope_random_shapes(n_head in 1usize..6, hd_half in 1usize..48, rot_frac in 0.0f64..1.0, neox in 0usize..2, scaling in 0usize..3, n_pos in 1usize..6, seed in any::<u64>()) {
        let hd = 2 * hd_half;
        let n_rot = 2 * ((hd_half as f64 * rot_frac) as usize).clamp(1, hd_half);
        let mut r = SplitMix64(seed);
        let pos: Vec<u32> = (0..n_pos).map(|_| (r.next_u64() % 8192) as u32).collect();
        let x = activations(&mut r, n_pos, n_head * hd);
        check(mk(
            Op::Rope,
            seed,
            vec![("x", t(&[n_pos, n_head * hd], x)), ("pos", Input::Ids(pos))],
            &[("neox", neox as f64), ("scaling", scaling as f64), ("theta", 10_000.0), ("n_rot", n_rot as f64), ("n_head", n_head as f64), ("head_dim", hd as f64)],
        ))?;
    }

    #[test]
    fn qk_norm_random_shapes(tokens in 1usize..5, n_head in 1usize..9, hd in 1usize..160, seed in any::<u64>()) {
        let mut r = SplitMix64(seed);
        let x = activations(&mut r, tokens, n_head * hd);
        let w: Vec<f32> = (0..hd).map(|_| (1.0 + 0.2 * r.next_normal()) as f32).collect();
        check(mk(Op::QkNorm, seed, vec![("x", t(&[tokens, n_head * hd], x)), ("weight", t(&[hd], w))], &[("eps", 1e-6), ("head_dim", hd as f64)]))?;
    }

    #[test]
    fn glu_random_shapes(rows in 1usize..4, n in 1usize..2000, geglu in any::<bool>(), seed in any::<u64>()) {
        let mut r = SplitMix64(seed);
        let (gate, up) = (activations(&mut r, rows, n), activations(&mut r, rows, n));
        check(mk(if geglu { Op::Geglu } else { Op::Swiglu }, seed, vec![("gate", t(&[rows, n], gate)), ("up", t(&[rows, n], up))], &[]))?;
    }

    #[test]
    fn moe_route_random_shapes(rows in 1usize..5, n_expert in 1usize..130, k_frac in 0.0f64..1.0, sigmoid in 0usize..2, normalize in 0usize..2, seed in any::<u64>()) {
        let k = ((n_expert.min(8) as f64 * k_frac) as usize).clamp(1, n_expert.min(8));
        let mut r = SplitMix64(seed);
        let logits: Vec<f32> = (0..rows * n_expert).map(|_| (r.next_normal() * 2.0) as f32).collect();
        check(mk(Op::MoeRoute, seed, vec![("logits", t(&[rows, n_expert], logits))], &[("k", k as f64), ("sigmoid", sigmoid as f64), ("normalize", normalize as f64)]))?;
    }

    #[test]
    fn argmax_and_top_k_random_shapes(rows in 1usize..4, n in 1usize..3000, k in 1usize..65, ties in 0usize..4, seed in any::<u64>()) {
        let mut r = SplitMix64(seed);
        // Values on a coarse grid, so exact ties (the lower index must win) are common.
        let mut x: Vec<f32> = (0..rows * n).map(|_| (r.next_normal() * 4.0).round() as f32 / 4.0).collect();
        for _ in 0..ties {
            let (a, b) = ((r.next_u64() as usize) % x.len(), (r.next_u64() as usize) % x.len());
            x[b] = x[a];
        }
        let params = [("k", k.min(n) as f64), ("temperature", 0.8), ("top_p", 0.9)];
        check(mk(Op::Argmax, seed, vec![("x", t(&[rows, n], x.clone()))], &params))?;
        check(mk(Op::TopK, seed, vec![("x", t(&[rows, n], x.clone()))], &params))?;
        check(mk(Op::Sample, seed, vec![("x", t(&[rows, n], x))], &params))?;
    }
}
