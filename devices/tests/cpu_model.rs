//! Whole-model runs on the cpu device against the oracle: same top-1 token at (nearly) every
//! position, close logits, and the device's own cache invariants (prefill = decode = append).
//! The formal per-tap budgets are the layer-diff gate's job; these tests catch a broken engine.

use devices::{Device, DeviceModel, ModelOptions};
use oracle::generate::AnyModel;
use oracle::{NoTap, Precision};

const TOKENS: [u32; 9] = [5, 200, 17, 3, 99, 250, 1, 42, 7];

fn cpu_model(name: &str, kv_f16: bool) -> Box<dyn DeviceModel> {
    let path = fixtures::resolve(name, true).unwrap();
    devices::cpu::CpuDevice::default().load_model(&path, &ModelOptions { kv_cache: if kv_f16 { devices::KvTypes::parse("f16").unwrap() } else { Default::default() }, ..Default::default() }).unwrap()
}

fn compare(name: &str, tokens: &[u32]) -> (f64, f64, usize) {
    let path = fixtures::resolve(name, true).unwrap();
    let (oracle, _) = AnyModel::load(&path, Precision::F32).unwrap();
    let want = oracle.prefill_logits(tokens, &mut NoTap).unwrap();
    let mut m = cpu_model(name, false);
    let got = m.forward(tokens, &mut NoTap).unwrap();
    let n = m.spec().n_vocab;
    let (mut max_abs, mut max_logit, mut same_top1) = (0.0f64, 0.0f64, 0);
    for t in 0..tokens.len() {
        let (w, g) = (&want[t * n..(t + 1) * n], &got[t * n..(t + 1) * n]);
        for (a, b) in w.iter().zip(g) {
            max_abs = max_abs.max((a - *b as f64).abs());
            max_logit = max_logit.max(a.abs());
        }
        let wt = oracle::ops::argmax(w);
        let gt = oracle::ops::argmax(g);
        same_top1 += (wt == gt) as usize;
    }
    (max_abs, max_logit, same_top1)
}

#[test]
fn cpu_model_tracks_the_oracle_on_every_synthetic_model() {
    for name in fixtures::SYNTHETIC {
        let (max_abs, max_logit, same) = compare(name, &TOKENS);
        eprintln!("{name}: max |cpu - oracle| = {max_abs:.3e} (max |logit| {max_logit:.2}), same top-1 {same}/{}", TOKENS.len());
        // Q8_0 activations cost about 1% of a logit's scale; a structural bug costs all of it.
        assert!(max_abs < 0.05 * max_logit.max(1.0), "{name}: {max_abs}");
        assert!(same >= TOKENS.len() - 1, "{name}: top-1 agrees at only {same} positions");
    }
}

#[test]
fn cpu_model_tracks_the_oracle_on_smollm2() {
    let ids = [504u32, 3575, 282, 4649, 314];
    let (max_abs, max_logit, same) = compare("smollm2", &ids);
    eprintln!("smollm2: max |cpu - oracle| = {max_abs:.3e} (max |logit| {max_logit:.2}), same top-1 {same}/5");
    assert!(max_abs < 0.05 * max_logit, "{max_abs}");
    assert_eq!(same, 5);
}

#[test]
fn cpu_cache_paths_are_bit_identical_and_f16_kv_is_close() {
    for name in fixtures::SYNTHETIC {
        let mut m = cpu_model(name, false);
        let prefill = m.forward(&TOKENS, &mut NoTap).unwrap();
        m.reset();
        let mut decode = Vec::new();
        for t in TOKENS {
            decode.extend(m.forward(&[t], &mut NoTap).unwrap());
        }
        assert_eq!(m.cached(), TOKENS.len());
        m.reset();
        let mut append = m.forward(&TOKENS[..5], &mut NoTap).unwrap();
        append.extend(m.forward(&TOKENS[5..], &mut NoTap).unwrap());
        assert!(prefill.iter().zip(&decode).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: decode differs");
        assert!(prefill.iter().zip(&append).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: append differs");
        let mut h = cpu_model(name, true);
        let half = h.forward(&TOKENS, &mut NoTap).unwrap();
        let d = prefill.iter().zip(&half).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        let scale = prefill.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        // f16 storage of K/V (2^-11 relative per value) must move the logits less than Q8_0
        // activations move them away from the oracle (the 5% bound above), and must move them.
        assert!(d > 0.0 && d < 0.05 * scale, "{name}: f16 KV moved logits by {d}");
    }
}

#[test]
fn cpu_model_taps_have_the_oracle_names() {
    let mut m = cpu_model("tiny-moe", false);
    let mut taps = oracle::RecordingTap::default();
    m.forward(&TOKENS, &mut taps).unwrap();
    let path = fixtures::resolve("tiny-moe", true).unwrap();
    let (o, _) = AnyModel::load(&path, Precision::F32).unwrap();
    let mut want = oracle::RecordingTap::default();
    o.prefill_logits(&TOKENS, &mut want).unwrap();
    assert_eq!(taps.order, want.order);
    for (name, (w, data)) in &want.tensors {
        assert_eq!(taps.tensors[name].0, *w, "{name}");
        assert_eq!(taps.tensors[name].1.len(), data.len(), "{name}");
    }
}


#[test]
fn fixed_model_tracks_the_oracle_and_int4_drifts_further() {
    let ids = [504u32, 3575, 282, 4649, 314];
    let path = fixtures::resolve("smollm2", true).unwrap();
    let (oracle, _) = AnyModel::load(&path, Precision::F32).unwrap();
    let want = oracle.prefill_logits(&ids, &mut NoTap).unwrap();
    let n = 49152;
    let last = &want[4 * n..];
    let mut errs = Vec::new();
    for int4 in [false, true] {
        let mut m = devices::fixed::FixedDevice { int4 }.load_model(&path, &ModelOptions::default()).unwrap();
        let got = m.forward(&ids, &mut NoTap).unwrap();
        let g = &got[4 * n..];
        let mae = last.iter().zip(g).map(|(a, b)| (a - *b as f64).abs()).sum::<f64>() / n as f64;
        eprintln!("fixed (int4: {int4}): mean |logit - oracle| = {mae:.4}, top-1 {} vs oracle {}", oracle::ops::argmax(g), oracle::ops::argmax(last));
        errs.push(mae);
        if !int4 {
            assert_eq!(oracle::ops::argmax(g), oracle::ops::argmax(last), "Q16/Q24 must keep the oracle's next token");
        }
    }
    assert!(errs[0] < 0.05, "Q16/Q24 mean logit error {}", errs[0]);
    assert!(errs[1] > 5.0 * errs[0], "INT4 weights should cost far more than Q24: {errs:?}");
    // An f16 KV cache it does not have is refused, not silently ignored.
    let e = devices::fixed::FixedDevice { int4: false }.load_model(&path, &ModelOptions { kv_cache: devices::KvTypes::parse("f16").unwrap(), ..Default::default() }).err().unwrap().to_string();
    assert!(e.contains("f16 KV cache is not implemented"), "{e}");
}

/// The schedule executor's paged caches (16-position pages, a reused prefix sharing its source's
/// full pages) give a request the bits of the one-sequence cache: a long request in uneven
/// chunks, and a second one reusing 37 of its positions (two shared pages and a copied partial
/// one) beside a third, each against `forward` on the same tokens alone.
#[test]
fn paged_schedule_caches_give_the_bits_of_the_one_sequence_cache() {
    use oracle::schedule::{Prefix, Request, Schedule};
    for (name, kv) in [("tiny-llama", "f32"), ("tiny-gemma3", "f16"), ("tiny-qwen3", "q8_0")] {
        let path = fixtures::resolve(name, true).unwrap();
        let opts = ModelOptions { kv_cache: devices::KvTypes::parse(kv).unwrap(), ..Default::default() };
        let mut m = devices::cpu::CpuDevice::default().load_model(&path, &opts).unwrap();
        let n_vocab = m.spec().n_vocab as u32;
        let long: Vec<u32> = (0..70u32).map(|i| (i * 7919 + 11) % n_vocab).collect();
        let mut reuse = long[..37].to_vec();
        reuse.extend([3, 9, 27, 81]);
        let other: Vec<u32> = (0..20u32).map(|i| (i * 31 + 5) % n_vocab).collect();
        let schedule = Schedule {
            slots: 3,
            requests: vec![
                Request { id: "long".into(), tokens: long.clone(), arrive: 0, chunks: vec![5, 17, 16, 1, 31], slot: 0, prefix: None },
                Request { id: "reuse".into(), tokens: reuse.clone(), arrive: 3, chunks: vec![2, 1, 1], slot: 1, prefix: Some(Prefix { from: "long".into(), tokens: 37 }) },
                Request { id: "other".into(), tokens: other.clone(), arrive: 1, chunks: vec![20], slot: 2, prefix: None },
            ],
        };
        let served = m.serve(&schedule).expect("cpu serves").unwrap();
        for (id, tokens, first) in [("long", &long, 0), ("reuse", &reuse, 37), ("other", &other, 0)] {
            m.reset();
            let alone = m.forward(tokens, &mut NoTap).unwrap();
            let want: Vec<u32> = alone[first * n_vocab as usize..].iter().map(|v| v.to_bits()).collect();
            let got: Vec<u32> = served[id].iter().map(|v| v.to_bits()).collect();
            assert!(got == want, "{name} kv {kv}: request {id} differs from its run alone");
        }
    }
}
