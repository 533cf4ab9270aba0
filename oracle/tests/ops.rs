//! Every reference op against values computed by hand (or, for YaRN, by an independent Python
//! transcription of llama.cpp's formula; the script is in the comment next to the numbers).

use oracle::ops::{self, AttentionParams, Mat, SamplerConfig, SplitMix64};
use oracle::spec::{Gating, RopeScaling, RopeSpec, RopeStyle};

fn close(a: &[f32], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!((*x as f64 - y).abs() <= tol * y.abs().max(1.0), "{a:?} vs {b:?}");
    }
}

#[test]
fn rms_norm_by_hand() {
    // mean(x^2) = 30/4 = 7.5, scale = 1/sqrt(7.5)
    let y = ops::rms_norm(&[1.0f32, 2.0, 3.0, 4.0], 4, Some(&[1.0, 1.0, 2.0, 0.5]), 0.0).unwrap();
    close(&y, &[0.3651483716701107, 0.7302967433402214, 2.1908902300206643, 0.7302967433402214], 1e-7);
    // Two rows are independent; eps enters under the root.
    let y = ops::rms_norm(&[3.0f32, 4.0, 0.0, 0.0], 2, None, 1.0).unwrap();
    close(&y, &[3.0 / 13.5f64.sqrt(), 4.0 / 13.5f64.sqrt(), 0.0, 0.0], 1e-7);
    assert!(ops::rms_norm(&[1.0f32, 2.0, 3.0], 2, None, 0.0).is_err());
}

#[test]
fn layer_norm_by_hand() {
    let y = ops::layer_norm(&[1.0f32, 2.0, 3.0, 4.0], 4, None, Some(&[0.5; 4]), 0.0).unwrap();
    let s = 1.25f64.sqrt();
    close(&y, &[-1.5 / s + 0.5, -0.5 / s + 0.5, 0.5 / s + 0.5, 1.5 / s + 0.5], 1e-7);
}

#[test]
fn matmul_by_hand() {
    let w = Mat::new(3, 2, vec![1.0f32, 0.0, 1.0, 1.0, 0.5, -1.0]).unwrap();
    let y = ops::matmul(&[1.0f32, 2.0, 3.0, 4.0], 2, &w).unwrap();
    assert_eq!(y, vec![1.0, 3.0, -1.5, 3.0, 7.0, -2.5]);
    assert!(ops::matmul(&[1.0f32, 2.0, 3.0], 2, &w).is_err());
}

#[test]
fn matmul_accumulates_in_f64() {
    // 2^24 + 1 - 2^24 in f32 accumulation is 0; the oracle must return 1.
    let w = Mat::new(1, 3, vec![1.0f32, 1.0, 1.0]).unwrap();
    let y = ops::matmul(&[16_777_216.0f32, 1.0, -16_777_216.0], 1, &w).unwrap();
    assert_eq!(y, vec![1.0]);
}

fn rope_spec(style: RopeStyle, scaling: RopeScaling) -> RopeSpec {
    RopeSpec { style, theta: 10_000.0, n_rot: 4, scaling, freq_factors: None, longrope_factors: None }
}

#[test]
fn rope_normal_and_neox_by_hand() {
    // head_dim 4, pos 1: pair 0 turns by 1 rad, pair 1 by 10000^(-1/2) = 0.01 rad.
    let (c1, s1, c2, s2) = (1f64.cos(), 1f64.sin(), 0.01f64.cos(), 0.01f64.sin());
    let mut x = vec![1.0f32, 0.0, 0.0, 1.0];
    ops::rope(&mut x, &[1], 1, 4, &rope_spec(RopeStyle::Normal, RopeScaling::None)).unwrap();
    close(&x, &[c1, s1, -s2, c2], 1e-7);
    let mut x = vec![1.0f32, 0.0, 0.0, 1.0];
    ops::rope(&mut x, &[1], 1, 4, &rope_spec(RopeStyle::Neox, RopeScaling::None)).unwrap();
    // neox pairs (0,2) and (1,3)
    close(&x, &[c1, -s2, s1, c2], 1e-7);
    // Position 0 is the identity.
    let mut x = vec![0.3f32, -0.7, 1.5, 2.0];
    ops::rope(&mut x, &[0], 1, 4, &rope_spec(RopeStyle::Normal, RopeScaling::None)).unwrap();
    assert_eq!(x, vec![0.3, -0.7, 1.5, 2.0]);
}

#[test]
fn rope_linear_scaling_divides_positions() {
    let mut x = vec![1.0f32, 0.0, 1.0, 0.0];
    ops::rope(&mut x, &[2], 1, 4, &rope_spec(RopeStyle::Normal, RopeScaling::Linear { factor: 2.0 })).unwrap();
    close(&x, &[1f64.cos(), 1f64.sin(), 0.01f64.cos(), 0.01f64.sin()], 1e-7);
}

/// A LongRoPE model rotates at most the positions of the context it is configured for (by
/// default its original context, with the short factors), and refuses those past it, saying why,
/// instead of rotating them with factors no engine uses there.
#[test]
fn longrope_refuses_positions_past_its_configured_context() {
    let spec = RopeSpec { freq_factors: Some(vec![1.0, 2.0]), ..rope_spec(RopeStyle::Normal, RopeScaling::LongRope { attn_factor: 1.25, original_context: 8, context: 8 }) };
    let mut x = vec![1.0f32, 0.0, 1.0, 0.0];
    ops::rope(&mut x, &[7], 1, 4, &spec).unwrap();
    // Pair 0 at position 7 turns by 7 rad (factor 1), every cos/sin scaled by 1.25.
    assert!((x[0] as f64 - 1.25 * 7f64.cos()).abs() < 1e-6, "{x:?}");
    let mut x = vec![1.0f32, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0];
    let e = ops::rope(&mut x, &[3, 8], 1, 4, &spec).unwrap_err().to_string();
    assert!(e.contains("position 8 is past the 8-position context") && e.contains("short factors") && e.contains("--context"), "{e}");
    assert_eq!(x, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0], "nothing rotated");
    // Configured for 16 positions (with the long factors in `freq_factors`): 15 is rotated, 16 not.
    let long = RopeSpec { freq_factors: Some(vec![3.0, 5.0]), scaling: RopeScaling::LongRope { attn_factor: 1.25, original_context: 8, context: 16 }, ..spec };
    let mut x = vec![1.0f32, 0.0, 1.0, 0.0];
    ops::rope(&mut x, &[15], 1, 4, &long).unwrap();
    assert!((x[0] as f64 - 1.25 * 5f64.cos()).abs() < 1e-6 && (x[1] as f64 - 1.25 * 5f64.sin()).abs() < 1e-6, "pair 0 turns by 15/3 rad: {x:?}");
    let e = ops::rope(&mut [0.0f32; 4], &[16], 1, 4, &long).unwrap_err().to_string();
    assert!(e.contains("16-position context") && e.contains("long factors"), "{e}");
}

#[test]
fn rope_yarn_matches_llama_cpp_formula() {
    // Independent transcription of ggml's rope_yarn / ggml_rope_yarn_corr_dims in Python:
    //   corr(n, ctx, beta, base) = n*log(ctx/(beta*2*pi))/(2*log(base)); low=max(0,floor(corr(32)))
    //   high=min(n-1,ceil(corr(1))); ramp=1-clamp((i0/2-low)/max(0.001,high-low),0,1)
    //   theta=ti*(1-ramp)+te*ramp; mscale=1+0.1*log(factor)
    // with head_dim 8, base 1e4, factor 4, original context 64, pos 7 gives (cos*m, sin*m):
    let expected = [
        (0.8584152987464743, 0.7480642804323084),
        (1.0313861235817978, 0.48241025783415803),
        (1.1384550879291635, 0.01992499809051102),
        (1.13862769258611, 0.0019926004961391144),
    ];
    let spec = RopeSpec {
        style: RopeStyle::Normal,
        theta: 10_000.0,
        n_rot: 8,
        scaling: RopeScaling::Yarn { factor: 4.0, original_context: 64, beta_fast: 32.0, beta_slow: 1.0, ext_factor: 1.0, attn_factor: 1.0, truncate: true },
        freq_factors: None,
        longrope_factors: None,
    };
    for (i, (c, s)) in expected.iter().enumerate() {
        let (oc, os) = ops::rope_cos_sin(&spec, 7, i);
        assert!((oc - c).abs() < 1e-12 && (os - s).abs() < 1e-12, "pair {i}: ({oc}, {os}) vs ({c}, {s})");
    }
}

#[test]
fn llama3_frequency_factors_match_hugging_face_and_divide_the_angle() {
    // Hugging Face's `_compute_llama3_parameters` transcribed in numpy (f64) for Llama 3.1's
    // parameters (theta 5e5, head_dim 128, factor 8, low 1, high 4, original context 8192):
    // inv_freq / inv_freq_llama for pairs 28..36; pairs up to 28 keep their frequency, 35 on are
    // slowed 8 times.
    let want = [1.0, 1.207483871283662, 1.5534146285049255, 2.026313205905055, 2.694529687894733, 3.6842525277457185, 5.257326588708467, 8.0];
    let f = oracle::spec::llama3_freq_factors(500_000.0, 128, 8.0, 1.0, 4.0, 8192);
    assert_eq!(f.len(), 64);
    assert!(f[..28].iter().all(|&v| v == 1.0) && f[35..].iter().all(|&v| v == 8.0), "{f:?}");
    for (i, w) in (28..36).zip(want) {
        assert!((f[i] as f64 - w).abs() <= 1e-6 * w, "pair {i}: {} vs {w}", f[i]);
    }
    // A factor divides the pair's angle before any scaling: factor 2 on pair 0 at position 2 is
    // the unfactored angle at position 1.
    let spec = RopeSpec { freq_factors: Some(vec![2.0, 1.0]), ..rope_spec(RopeStyle::Normal, RopeScaling::None) };
    let (c, s) = ops::rope_cos_sin(&spec, 2, 0);
    assert!((c - 1f64.cos()).abs() < 1e-15 && (s - 1f64.sin()).abs() < 1e-15, "({c}, {s})");
    assert_eq!(ops::rope_cos_sin(&spec, 2, 1), ops::rope_cos_sin(&rope_spec(RopeStyle::Normal, RopeScaling::None), 2, 1));
}

#[test]
fn attention_by_hand() {
    let p = AttentionParams { n_head: 1, n_head_kv: 1, head_dim: 2, scale: 1.0, window: None, sinks: None, softcap: None };
    let k = [1.0f32, 0.0, 0.0, 1.0];
    let v = [1.0f32, 2.0, 3.0, 4.0];
    // Query at position 1 sees both keys: scores [1, 0] -> p = [e/(e+1), 1/(e+1)].
    let e = std::f64::consts::E;
    let (p0, p1) = (e / (e + 1.0), 1.0 / (e + 1.0));
    let y = ops::attention(&[1.0f32, 0.0], &[1], &k, &v, 2, &p).unwrap();
    close(&y, &[p0 + 3.0 * p1, 2.0 * p0 + 4.0 * p1], 1e-7);
    // Causal: a query at position 0 sees only key 0.
    let y = ops::attention(&[1.0f32, 0.0], &[0], &k, &v, 2, &p).unwrap();
    assert_eq!(y, vec![1.0, 2.0]);
    // Sliding window of 1: position 1 sees only itself.
    let pw = AttentionParams { window: Some(1), ..p };
    let y = ops::attention(&[1.0f32, 0.0], &[1], &k, &v, 2, &pw).unwrap();
    assert_eq!(y, vec![3.0, 4.0]);
    // GQA: two query heads share one kv head.
    let pg = AttentionParams { n_head: 2, ..p };
    let y = ops::attention(&[1.0f32, 0.0, 0.0, 1.0], &[1], &k, &v, 2, &pg).unwrap();
    close(&y, &[p0 + 3.0 * p1, 2.0 * p0 + 4.0 * p1, p1 + 3.0 * p0, 2.0 * p1 + 4.0 * p0], 1e-7);
    // A query position with no key in the cache is an error, not garbage.
    assert!(ops::attention(&[1.0f32, 0.0], &[2], &k, &v, 2, &p).is_err());
}

/// A sink is one more logit in each head's softmax whose weight goes to no value (GPT-OSS):
/// worked by hand, per head, and a sink of -inf is no sink.
#[test]
fn attention_sinks_by_hand() {
    let sinks = [0.5f64, f64::NEG_INFINITY];
    let p = AttentionParams { n_head: 2, n_head_kv: 1, head_dim: 2, scale: 1.0, window: None, sinks: Some(&sinks), softcap: None };
    let k = [1.0f32, 0.0, 0.0, 1.0];
    let v = [1.0f32, 2.0, 3.0, 4.0];
    // Head 0 (query [1, 0]): scores [1, 0] and the sink 0.5; head 1 (query [0, 1]): [0, 1], no sink.
    let (e1, e0, es) = (1f64.exp(), 1.0, 0.5f64.exp());
    let z = e1 + e0 + es;
    let (h1p0, h1p1) = (1.0 / (1.0 + e1), e1 / (1.0 + e1));
    let y = ops::attention(&[1.0f32, 0.0, 0.0, 1.0], &[1], &k, &v, 2, &p).unwrap();
    close(&y, &[(e1 * 1.0 + e0 * 3.0) / z, (e1 * 2.0 + e0 * 4.0) / z, h1p0 + 3.0 * h1p1, 2.0 * h1p0 + 4.0 * h1p1], 1e-7);
    // One sink per query head, or an error.
    let bad = AttentionParams { sinks: Some(&sinks[..1]), ..p };
    assert!(ops::attention(&[1.0f32, 0.0, 0.0, 1.0], &[1], &k, &v, 2, &bad).unwrap_err().to_string().contains("sink"));
}

/// GPT-OSS's clamped SwiGLU: the gate clamped above only, up both ways, then `+ 1` on up.
#[test]
fn clamped_swiglu_by_hand() {
    let f = |g: f64, u: f64| g / (1.0 + (-1.702 * g).exp()) * (u + 1.0);
    for (g, u, want) in [(0.5, 0.25, f(0.5, 0.25)), (9.0, 1.0, f(7.0, 1.0)), (-9.0, 1.0, f(-9.0, 1.0)), (1.0, 12.0, f(1.0, 7.0)), (1.0, -12.0, f(1.0, -7.0))] {
        assert_eq!(ops::swiglu_oai_f64(g, u), want, "g {g} u {u}");
    }
    assert_eq!(ops::swiglu_oai(&[9.0f32], &[1.0f32]).unwrap(), vec![f(7.0, 1.0) as f32]);
}

#[test]
fn attention_scores_do_not_overflow() {
    // Scores of 1e4 would overflow exp() without the max subtraction.
    let p = AttentionParams { n_head: 1, n_head_kv: 1, head_dim: 1, scale: 1.0, window: None, sinks: None, softcap: None };
    let y = ops::attention(&[100.0f32], &[1], &[100.0f32, 99.0], &[1.0f32, 2.0], 2, &p).unwrap();
    let e = (-100.0f64).exp();
    close(&y, &[(1.0 + 2.0 * e) / (1.0 + e)], 1e-7);
}

/// A weights rule replaces the softmax: the softmax itself as a rule gives the same bits, equal
/// weights average the values, and a rule that returns another number of weights is an error.
#[test]
fn attention_weights_rule_replaces_the_softmax() {
    let p = AttentionParams { n_head: 1, n_head_kv: 1, head_dim: 2, scale: 0.7, window: None, sinks: None, softcap: None };
    let (q, k, v) = ([0.3f32, -1.2], [1.0f32, 0.5, -0.25, 2.0, 0.75, -1.0], [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let own = ops::attention(&q, &[2], &k, &v, 3, &p).unwrap();
    let softmax = |s: &[f64]| {
        let max = s.iter().fold(f64::NEG_INFINITY, |m, x| m.max(*x));
        let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        e.iter().map(|x| x / sum).collect::<Vec<f64>>()
    };
    assert_eq!(ops::attention_with(&q, &[2], &k, &v, 3, &p, Some(&softmax)).unwrap(), own);
    let equal = |s: &[f64]| vec![1.0 / s.len() as f64; s.len()];
    assert_eq!(ops::attention_with(&q, &[2], &k, &v, 3, &p, Some(&equal)).unwrap(), vec![3.0, 4.0]);
    let short = |s: &[f64]| vec![1.0; s.len() - 1];
    let e = ops::attention_with(&q, &[2], &k, &v, 3, &p, Some(&short)).unwrap_err().to_string();
    assert!(e.contains("another number of weights"), "{e}");
}

#[test]
fn softmax_and_activations_by_hand() {
    let y = ops::softmax_rows(&[1.0f32, 2.0, 3.0], 3).unwrap();
    close(&y, &[0.09003057317038046, 0.24472847105479767, 0.6652409557748219], 1e-7);
    let y = ops::softmax_rows(&[0.0f32, f32::NEG_INFINITY], 2).unwrap();
    assert_eq!(y, vec![1.0, 0.0]);
    assert!((ops::silu(1.0) - 0.7310585786300049).abs() < 1e-15);
    assert_eq!(ops::silu(0.0), 0.0);
    assert!((ops::gelu_tanh(1.0) - 0.8411919906082768).abs() < 1e-15);
    close(&ops::swiglu(&[1.0f32], &[2.0]).unwrap(), &[1.4621171572600098], 1e-7);
    close(&ops::geglu(&[1.0f32], &[2.0]).unwrap(), &[1.6823839812165536], 1e-7);
    let mut x = vec![1.0f32, 2.0, 3.0, 4.0];
    ops::add_bias(&mut x, &[0.5, -1.0]).unwrap();
    assert_eq!(x, vec![1.5, 1.0, 3.5, 3.0]);
    assert_eq!(ops::add(&[1.0f32, 2.0], &[0.25, 0.5]).unwrap(), vec![1.25, 2.5]);
}

#[test]
fn embed_by_hand() {
    let t = Mat::new(3, 2, vec![0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
    assert_eq!(ops::embed(&t, &[2, 0]).unwrap(), vec![4.0, 5.0, 0.0, 1.0]);
    let e = ops::embed(&t, &[3]).unwrap_err().to_string();
    assert!(e.contains("token id 3"), "{e}");
}

#[test]
fn moe_routing_by_hand() {
    let logits = [1.0, 3.0, 2.0, 3.0];
    // Softmax, top-2, renormalised: experts 1 and 3 tie; the lower id comes first.
    let r = ops::moe_route(&logits, 2, Gating::Softmax, true);
    assert_eq!(r.experts, vec![1, 3]);
    assert!((r.weights[0] - 0.5).abs() < 1e-15 && (r.weights[1] - 0.5).abs() < 1e-15);
    let e = std::f64::consts::E;
    let z = e + e.powi(3) * 2.0 + e * e;
    let r = ops::moe_route(&logits, 2, Gating::Softmax, false);
    assert!((r.weights[0] - e.powi(3) / z).abs() < 1e-15);
    let r = ops::moe_route(&[0.0, -1.0, 2.0], 1, Gating::Sigmoid, false);
    assert_eq!(r.experts, vec![2]);
    assert!((r.weights[0] - 1.0 / (1.0 + (-2.0f64).exp())).abs() < 1e-15);
}

#[test]
fn selection_by_hand() {
    assert_eq!(ops::argmax(&[1.0f32, 3.0, 3.0, -1.0]), 1);
    assert_eq!(ops::argmax(&[f32::NAN, 0.5]), 1);
    assert_eq!(ops::top_k(&[0.1f32, 0.9, 0.5, 0.9], 3), vec![1, 3, 2]);
    let greedy = SamplerConfig { temperature: 0.0, top_k: 0, top_p: 1.0 };
    assert_eq!(ops::sample(&[0.0f32, 5.0, 1.0], &greedy, &mut SplitMix64(1)), 1);
    // top_k = 1 is greedy whatever the temperature.
    let k1 = SamplerConfig { temperature: 5.0, top_k: 1, top_p: 1.0 };
    assert_eq!(ops::sample(&[0.0f32, 5.0, 1.0], &k1, &mut SplitMix64(1)), 1);
    // top_p just above the top token's probability keeps two tokens; never the third.
    let cfg = SamplerConfig { temperature: 1.0, top_k: 0, top_p: 0.75 };
    let logits = [2.0f32, 1.0, -10.0];
    let mut rng = SplitMix64(3);
    let draws: Vec<usize> = (0..400).map(|_| ops::sample(&logits, &cfg, &mut rng)).collect();
    assert!(draws.iter().all(|&d| d < 2));
    let ones = draws.iter().filter(|&&d| d == 1).count() as f64 / 400.0;
    // p(1 | kept {0,1}) = 1/(1+e) = 0.269; 400 draws: 4 sigma = 0.09.
    assert!((ones - 0.2689).abs() < 0.09, "{ones}");
    // Same seed, same stream.
    let a: Vec<usize> = (0..50).map({ let mut r = SplitMix64(9); move |_| ops::sample(&logits, &cfg, &mut r) }).collect();
    let b: Vec<usize> = (0..50).map({ let mut r = SplitMix64(9); move |_| ops::sample(&logits, &cfg, &mut r) }).collect();
    assert_eq!(a, b);
}

#[test]
fn splitmix_is_the_published_sequence() {
    // SplitMix64 with seed 1234567: first outputs from the reference C implementation (Vigna).
    let mut r = SplitMix64(1234567);
    assert_eq!(r.next_u64(), 6457827717110365317);
    assert_eq!(r.next_u64(), 3203168211198807973);
}
