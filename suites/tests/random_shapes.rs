//! The proptest layer of the kernel gate: shapes drawn at random (not just the registry's list),
//! inputs from a drawn seed, run on the cpu and fixed devices; every case must pass its derived
//! bound. proptest shrinks a failure to the smallest shape that still fails.

use devices::Device;
use oracle::ops::SplitMix64;
use oracle::quant::{encode, GgmlType};
use oracle::registry::{activations, Input, OpCase, Tensor};
use proptest::prelude::*;
use reports::Verdict;
use suites::kernels::run_case;

fn t(shape: &[usize], data: Vec<f32>) -> Input {
    Input::F32(Tensor { shape: shape.to_vec(), data })
}

fn check(case: OpCase) -> Result<(), TestCaseError> {
    for dev in [Box::new(devices::cpu::CpuDevice) as Box<dyn Device>, Box::new(devices::fixed::FixedDevice { int4: false })] {
        let r = run_case(dev.as_ref(), &case, false);
        prop_assert!(matches!(r.verdict, Verdict::Pass | Verdict::Unsupported), "{} on {}: {:?} {:?}", case.id, dev.name(), r.verdict, r.message);
    }
    Ok(())
}

fn mk(op: &'static str, seed: u64, inputs: Vec<(&'static str, Input)>, params: &[(&'static str, f64)]) -> OpCase {
    OpCase { op, id: format!("{op}(random,seed={seed})"), seed, inputs, params: params.iter().copied().collect() }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn matmul_random_shapes(m in 1usize..6, n in 1usize..40, kb in 1usize..12, ty_i in 0usize..11, seed in any::<u64>()) {
        let ty = GgmlType::ALL[ty_i];
        let k = kb * if ty.block_size() == 256 { 256 } else { 32 };
        let mut r = SplitMix64(seed);
        let w: Vec<f32> = (0..n * k).map(|_| (r.next_normal() / (k as f64).sqrt()) as f32).collect();
        let x = activations(&mut r, m, k);
        let bytes = encode(ty, &w).unwrap();
        check(mk("matmul", seed, vec![("x", t(&[m, k], x)), ("w", Input::Quant { ty, rows: n, cols: k, bytes })], &[]))?;
    }

    #[test]
    fn rms_norm_random_shapes(rows in 1usize..6, n in 1usize..700, seed in any::<u64>()) {
        let mut r = SplitMix64(seed);
        let x = activations(&mut r, rows, n);
        let w: Vec<f32> = (0..n).map(|_| (1.0 + 0.1 * r.next_normal()) as f32).collect();
        check(mk("rms_norm", seed, vec![("x", t(&[rows, n], x)), ("weight", t(&[n], w))], &[("eps", 1e-5)]))?;
    }

    #[test]
    fn softmax_random_shapes(rows in 1usize..5, n in 1usize..500, seed in any::<u64>()) {
        let mut r = SplitMix64(seed);
        let x: Vec<f32> = (0..rows * n).map(|_| (r.next_normal() * 4.0) as f32).collect();
        check(mk("softmax", seed, vec![("x", t(&[rows, n], x))], &[]))?;
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
            "attention",
            seed,
            vec![("q", t(&[m, nh * hd], q)), ("k", t(&[kv_len, nkv * hd], k)), ("v", t(&[kv_len, nkv * hd], v)), ("pos", Input::Ids(pos))],
            &[("n_head", nh as f64), ("n_head_kv", nkv as f64), ("head_dim", hd as f64), ("window", 0.0)],
        ))?;
    }
}
