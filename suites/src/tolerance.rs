//! Tolerances derived from a device's declared arithmetic, never tuned.
//!
//! For each op the registry names a rule; here the rule becomes a per-element bound from the
//! device's unit roundoff `u` (storage) and `ua` (accumulation), the reduction lengths, the input
//! magnitudes taken from the case itself, and — for devices that quantize activations — the exact
//! error of the declared quantizer (the suite re-quantizes the activations the declared way).
//! The bounds are first-order worst-case (Higham-style `gamma(n) = n*u / (1 - n*u)`), so a correct
//! device cannot exceed them, while bugs that change values by more than rounding do.

use crate::emulate::on_grid;
use devices::{Arithmetic, NumFormat};
use oracle::quant::decode;
use oracle::registry::{Input, Op, OpCase, Output, Tensor};

mod recurrent;
mod latent;

/// gamma(n) = n u / (1 - n u).
pub fn gamma(n: usize, u: f64) -> f64 {
    let nu = n as f64 * u;
    nu / (1.0 - nu).max(0.5)
}

/// Per-element bounds for every output of `case` (None for discrete outputs, which must match
/// exactly), and the rule in words.
pub struct Bounds {
    pub per_output: Vec<Option<Vec<f64>>>,
    pub rule: String,
    /// For a device that holds its tensors in a format coarser than f32: the oracle's outputs
    /// on the inputs rounded to that format. Its discrete outputs (ids) are as right as the
    /// reference's: a near-tie the rounding decides differently is not the device's error.
    pub stored_inputs_reference: Option<Vec<Output>>,
}

fn f32_in<'a>(case: &'a OpCase, name: &str) -> &'a Tensor {
    case.f32(name).expect("registry case has this input")
}

pub fn bounds(case: &OpCase, reference: &[Output], a: &Arithmetic) -> Bounds {
    if let Some(fp) = &a.fixed {
        return fixed_bounds(case, reference, fp);
    }
    match stored_inputs(case, a.storage) {
        Some(stored) => with_stored_inputs(case, reference, &stored, a),
        None => derived(case, reference, a),
    }
}

/// The case with its f32 inputs rounded to `storage`, when that is coarser than f32 and changes
/// any of them: what a device that holds every tensor in that format computes from.
fn stored_inputs(case: &OpCase, storage: NumFormat) -> Option<OpCase> {
    if storage.unit_roundoff() <= NumFormat::F32.unit_roundoff() {
        return None;
    }
    let mut stored = case.clone();
    let mut changed = false;
    for (_, input) in stored.inputs.iter_mut() {
        if let Input::F32(t) = input {
            for v in t.data.iter_mut() {
                let r = crate::emulate::round_to(storage, *v);
                changed |= r.to_bits() != v.to_bits();
                *v = r;
            }
        }
    }
    changed.then_some(stored)
}

/// Bounds for a device that stores its inputs in a coarser format: the exact cost of that
/// rounding (the oracle's outputs on the rounded inputs against its outputs on the given ones,
/// element by element, as the Q8 activation term is exact), plus the bounds derived on the
/// rounded inputs for what the device computes from them.
fn with_stored_inputs(case: &OpCase, reference: &[Output], stored: &OpCase, a: &Arithmetic) -> Bounds {
    let entry = oracle::registry::registry().into_iter().find(|e| e.op == case.op);
    let Some(Ok(stored_ref)) = entry.map(|e| (e.reference)(stored)) else {
        return derived(case, reference, a);
    };
    let mut b = derived(stored, &stored_ref, a);
    for ((bound, r), s) in b.per_output.iter_mut().zip(reference).zip(&stored_ref) {
        if let (Some(bound), Output::F32(r), Output::F32(s)) = (bound, r, s) {
            for ((bi, ri), si) in bound.iter_mut().zip(&r.data).zip(&s.data) {
                let d = (*ri as f64 - *si as f64).abs();
                if d.is_finite() {
                    *bi += d;
                }
            }
        }
    }
    b.rule = format!("|y - y(inputs in {:?})| + {}", a.storage, b.rule);
    b.stored_inputs_reference = Some(stored_ref);
    b
}

/// Bounds derived for a device that computes from the case's inputs as they are.
fn derived(case: &OpCase, reference: &[Output], a: &Arithmetic) -> Bounds {
    let u = a.storage.unit_roundoff();
    // Reductions run in the declared accumulator: a bf16 engine that sums in f32 (as PyTorch's
    // CPU kernels and tensor cores do) is held to f32 sums; what it stores in bf16 (its inputs,
    // its weights once decoded, its results) has its own terms.
    let ua = a.accumulate.unit_roundoff();
    let ulps = a.transcendental_ulps;
    let y = |i: usize| match &reference[i] {
        Output::F32(t) => t.data.iter().map(|v| *v as f64).collect::<Vec<f64>>(),
        Output::Ids(_) => Vec::new(),
    };
    let tiny = f32::MIN_POSITIVE as f64;
    // A value copied through (an embedding row, the dimensions RoPE leaves alone) is exact in
    // f32 and rounded once on store in a coarser storage format (bf16, f16).
    let stored = |v: f64| if u > NumFormat::F32.unit_roundoff() { u * v.abs() } else { 0.0 };
    let discrete_or = |f: &dyn Fn(usize) -> Vec<f64>| -> Vec<Option<Vec<f64>>> {
        reference.iter().enumerate().map(|(i, o)| matches!(o, Output::F32(_)).then(|| f(i))).collect()
    };
    match case.op {
        Op::Embed => Bounds { per_output: vec![Some(y(0).iter().map(|v| stored(*v)).collect())], rule: if stored(1.0) > 0.0 { "a copy rounded once on store: u*|y|".into() } else { "exact copy".into() }, stored_inputs_reference: None },
        Op::Matmul => {
            let x = f32_in(case, "x");
            let Some((_, Input::Quant { ty, rows, cols, bytes })) = case.inputs.iter().find(|(n, _)| *n == "w") else {
                return Bounds { per_output: vec![None], rule: "matmul without a packed weight".into(), stored_inputs_reference: None };
            };
            let w = decode(*ty, bytes, rows * cols).expect("registry weights decode");
            let (m, k, stride) = oracle::registry::view_dims(case, x);
            let dense: Vec<f32> = (0..m).flat_map(|r| x.data[r * stride..r * stride + k].iter().copied()).collect();
            let x = &Tensor { shape: vec![m, k], data: dense };
            // The values the device multiplies with: rounded as it declares for this matrix's
            // type (Q8 blocks, llama.cpp's Q8_0: scale amax/127 stored as f16; or the matrix's
            // own 16-bit format).
            let rounding = a.input_rounding(*ty);
            let mut xq = x.data.clone();
            if let Some(how) = rounding {
                crate::emulate::round_input(&mut xq, k, how);
            }
            let xq: Vec<f64> = xq.iter().map(|v| *v as f64).collect();
            let g = gamma(k + 4, ua);
            // A device that holds its tensors in a coarser format holds the decoded weights in it.
            let stored_w = stored(1.0);
            let mut b = vec![0.0; m * rows];
            for t in 0..m {
                for r in 0..*rows {
                    let (mut d, mut s) = (0.0f64, 0.0f64);
                    for j in 0..k {
                        let wj = w[r * k + j] as f64;
                        d += wj * (x.data[t * k + j] as f64 - xq[t * k + j]);
                        s += (wj * xq[t * k + j]).abs();
                    }
                    b[t * rows + r] = d.abs() + g * s + u * (d.abs() + s) + stored_w * s + tiny;
                }
            }
            let act = match rounding {
                Some(devices::InputRounding::Q8(b)) => format!("|sum w*(x - q8(x))| (Q8 blocks of {b}) + "),
                Some(devices::InputRounding::Q8K(b)) => format!("|sum w*(x - q8(x))| (Q8_K blocks of {b}) + "),
                Some(devices::InputRounding::Half(f)) => format!("|sum w*(x - {f:?}(x))| + "),
                None => String::new(),
            };
            let w_rule = if stored_w > 0.0 { " + u*sum|w*x| (weights stored)" } else { "" };
            Bounds { per_output: vec![Some(b)], rule: format!("{act}gamma(K+4)*sum|w*x| + u*|y|{w_rule}, K={k}"), stored_inputs_reference: None }
        }
        Op::Add | Op::AddBias => Bounds { per_output: vec![Some(y(0).iter().map(|v| 2.0 * u * v.abs() + tiny).collect())], rule: "2u*|y|".into(), stored_inputs_reference: None },
        Op::RmsNorm | Op::QkNorm => {
            let n = if case.op == Op::QkNorm { case.pu("head_dim").unwrap_or(1) } else { f32_in(case, "x").shape[1] };
            let rel = gamma(n, ua) / 2.0 + 6.0 * u;
            Bounds { per_output: vec![Some(y(0).iter().map(|v| rel * v.abs() + tiny).collect())], rule: format!("(gamma(n)/2 + 6u)*|y|, n={n}"), stored_inputs_reference: None }
        }
        Op::LayerNorm => {
            let x = f32_in(case, "x");
            let (w, bias) = (&f32_in(case, "weight").data, &f32_in(case, "bias").data);
            let n = x.shape[1];
            let yy = y(0);
            let mut b = Vec::with_capacity(yy.len());
            for (r, row) in x.data.chunks(n).enumerate() {
                let mean = row.iter().map(|v| *v as f64).sum::<f64>() / n as f64;
                let var = row.iter().map(|v| (*v as f64 - mean).powi(2)).sum::<f64>() / n as f64;
                let s = 1.0 / (var + case.p("eps").unwrap_or(0.0)).sqrt();
                let dmean = gamma(n, ua) * row.iter().map(|v| v.abs() as f64).sum::<f64>() / n as f64;
                for i in 0..n {
                    let c = row[i] as f64 - mean;
                    let core = c * s * w[i] as f64;
                    b.push((dmean + u * c.abs()) * s * (w[i] as f64).abs() + (gamma(n, ua) / 2.0 + 6.0 * u) * core.abs() + u * (yy[r * n + i] - bias[i] as f64).abs() + u * yy[r * n + i].abs() + tiny);
                }
            }
            Bounds { per_output: vec![Some(b)], rule: format!("(|dmean| + u|x-mean|)*s*|w| + (gamma(n)/2+6u)*|core| + 2u|y|, n={n}"), stored_inputs_reference: None }
        }
        Op::Softmax => {
            let x = f32_in(case, "x");
            let n = x.shape[1];
            let yy = y(0);
            let mut b = Vec::with_capacity(yy.len());
            for (r, row) in x.data.chunks(n).enumerate() {
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                for i in 0..n {
                    let spread = if row[i].is_finite() { (row[i] as f64 - max).abs() } else { 0.0 };
                    b.push(yy[r * n + i] * (gamma(n + 3, ua) + ulps * u + u * spread) + tiny);
                }
            }
            Bounds { per_output: vec![Some(b)], rule: format!("y*(gamma(n+3) + ulps*u + u*|x-max|), n={n}"), stored_inputs_reference: None }
        }
        // The clamps are exact (comparisons); the sigmoid's argument 1.702 g is rounded, which
        // moves it by up to 1.702 |g| u; then the exp (ulps), the add, divide and two multiplies.
        Op::SwigluOai => {
            let (lim, alpha) = (oracle::spec::OAI_SWIGLU_LIMIT, oracle::spec::OAI_SWIGLU_ALPHA);
            let (g, up) = (&f32_in(case, "gate").data, &f32_in(case, "up").data);
            let yy = y(0);
            let b = (0..g.len())
                .map(|i| {
                    let gc = (g[i] as f64).min(lim);
                    let uc = (up[i] as f64).clamp(-lim, lim) + 1.0;
                    (ulps + 5.0 + alpha * gc.abs()) * u * gc.abs() * uc.abs() + 3.0 * u * yy[i].abs() + tiny
                })
                .collect();
            Bounds { per_output: vec![Some(b)], rule: "clamped SwiGLU: (ulps+5+1.702|g'|)*u*|g'|*|u'+1| + 3u*|y|, g'=min(g,7), u'=clamp(up,-7,7)".into(), stored_inputs_reference: None }
        }
        Op::Silu | Op::GeluTanh | Op::Swiglu | Op::Geglu => {
            let g = &f32_in(case, "gate").data;
            let up: Vec<f64> = if case.op == Op::Swiglu || case.op == Op::Geglu { f32_in(case, "up").data.iter().map(|v| *v as f64).collect() } else { vec![1.0; g.len()] };
            let gelu = case.op == Op::GeluTanh || case.op == Op::Geglu;
            let yy = y(0);
            let b = (0..g.len())
                .map(|i| {
                    let x = g[i] as f64;
                    let f_err = if gelu {
                        let inner = 0.8 * x.abs() + 0.036 * x.abs().powi(3);
                        0.5 * x.abs() * (ulps + 4.0) * u * (1.0 + inner)
                    } else {
                        (ulps + 3.0) * u * x.abs()
                    };
                    f_err * up[i].abs() + 3.0 * u * yy[i].abs() + tiny
                })
                .collect();
            Bounds { per_output: vec![Some(b)], rule: "activation: (ulps+4)*u*|x|*(1+|inner|)*|up| + 3u*|y|".into(), stored_inputs_reference: None }
        }
        Op::Rope => {
            let x = f32_in(case, "x");
            let hd = case.pu("head_dim").unwrap_or(1);
            let n_rot = case.pu("n_rot").unwrap_or(hd);
            let neox = case.pu("neox").unwrap_or(0) == 1;
            let mscale = match case.pu("scaling").unwrap_or(0) {
                2 => 1.0 + 0.1 * 4f64.ln(),
                4 => oracle::registry::LONGROPE_CASE_ATTN_FACTOR,
                _ => 1.0,
            };
            let yy = y(0);
            // The angle of pair `pair` at the case's token `t`, before any context scaling (which
            // only lowers it): an engine that forms it in its storage format (ggml: the
            // position times theta_scale^pair, by repeated multiplication) rotates by an angle
            // off by up to (pair + 2) u times it, which grows with the position.
            let (spec, pos) = (oracle::registry::rope_spec_of(case).ok(), case.ids("pos").unwrap_or(&[]));
            let row = x.shape.get(1).copied().unwrap_or(1).max(1);
            let angle = |t: usize, pair: usize| -> f64 {
                let (Some(spec), Some(&p)) = (&spec, pos.get(t)) else { return 0.0 };
                oracle::ops::rope_base_angle(spec, p as usize, pair).abs()
            };
            let b = (0..x.data.len())
                .map(|i| {
                    let (head0, j) = (i - i % hd, i % hd);
                    if j >= n_rot {
                        return tiny.max(stored(x.data[i] as f64));
                    }
                    let partner = if neox { if j < n_rot / 2 { j + n_rot / 2 } else { j - n_rot / 2 } } else { j ^ 1 };
                    let pair = if neox { j % (n_rot / 2).max(1) } else { j / 2 };
                    let mag = (x.data[i] as f64).abs() + (x.data[head0 + partner] as f64).abs();
                    let angle_err = (pair + 2) as f64 * u * angle(i / row, pair);
                    (4.0 * u + angle_err) * mscale * mag + u * yy[i].abs() + tiny
                })
                .collect();
            Bounds { per_output: vec![Some(b)], rule: "(4u + (pair+2)*u*angle)*mscale*(|x_a|+|x_b|) + u*|y|".into(), stored_inputs_reference: None }
        }
        Op::Attention | Op::AttentionSinks | Op::AttentionSoftcap => attention_bounds(case, &y(0), u, ua, ulps),
        Op::DeltaRule => recurrent::delta_rule_bounds(case, u, ua, ulps),
        Op::MlaAttention => latent::mla_attention_bounds(case, &y(0), u, ua, ulps),
        Op::SsmScan => recurrent::ssm_scan_bounds(case, u, ua, ulps),
        // cap * tanh(x / cap): the division (or a product with 1/cap, one rounding more) moves
        // the tanh's argument by 2u|x/cap|, which the slope sech^2 carries to the output; then
        // the tanh's own error (`ulps` ulps: up to 2*ulps*u relative at the foot of a binade)
        // and the product's rounding, and the reference's own f32 rounding, relative to |y|.
        Op::Softcap => {
            let x = &f32_in(case, "x").data;
            let cap = case.p("cap").unwrap_or(1.0);
            let yy = y(0);
            let b = (0..x.len())
                .map(|i| {
                    let xi = x[i] as f64;
                    let sech2 = 1.0 - (xi / cap).tanh().powi(2);
                    2.0 * u * xi.abs() * sech2 + (2.0 * ulps + 3.0) * u * yy[i].abs() + tiny
                })
                .collect();
            Bounds { per_output: vec![Some(b)], rule: format!("2u*|x|*sech^2(x/c) + (2*ulps+3)*u*|y|, c={cap}"), stored_inputs_reference: None }
        }
        Op::MoeRoute => {
            let n = f32_in(case, "logits").shape[1];
            Bounds {
                per_output: discrete_or(&|i| y(i).iter().map(|v| v.abs() * (gamma(2 * n + 4, ua) + 2.0 * ulps * u) + tiny).collect()),
                rule: format!("expert ids exact; weights |y|*(gamma(2n+4) + 2*ulps*u), n={n}"),
                stored_inputs_reference: None,
            }
        }
        // Ids, compared exactly (the registry's rule for each: `Exact`).
        Op::Argmax | Op::TopK | Op::Sample => Bounds { per_output: discrete_or(&|i| vec![0.0; y(i).len()]), rule: "exact".into(), stored_inputs_reference: None },
    }
}

/// The geometry of an attention case, read once for both bound derivations.
struct AttnGeometry {
    nh: usize,
    nkv: usize,
    hd: usize,
    /// (query row, head, kv head, first key, last key) for every output head.
    rows: Vec<(usize, usize, usize, usize, usize)>,
}

impl AttnGeometry {
    fn of(case: &OpCase) -> AttnGeometry {
        let nh = case.pu("n_head").unwrap_or(1);
        let nkv = case.pu("n_head_kv").unwrap_or(1);
        let hd = case.pu("head_dim").unwrap_or(1);
        let window = case.pu("window").unwrap_or(0);
        let mut rows = Vec::new();
        for (t, &p) in case.ids("pos").unwrap_or(&[]).iter().enumerate() {
            let p = p as usize;
            let first = if window > 0 { (p + 1).saturating_sub(window) } else { 0 };
            rows.extend((0..nh).map(|h| (t, h, h / (nh / nkv), first, p)));
        }
        AttnGeometry { nh, nkv, hd, rows }
    }
}

/// The soft-cap of an `attention_softcap` case, and the sink logits of an `attention_sinks`
/// case (as f64), where the case has them.
fn attention_extras(case: &OpCase) -> (Option<f64>, Option<Vec<f64>>) {
    let cap = (case.op == Op::AttentionSoftcap).then(|| case.p("cap").unwrap_or(0.0)).filter(|c| *c > 0.0);
    let sinks = (case.op == Op::AttentionSinks).then(|| case.f32("sinks").map(|t| t.data.iter().map(|v| *v as f64).collect())).and_then(|r| r.ok());
    (cap, sinks)
}

/// Attention and its variants. A score `s` off by `ds` from its dot product's roundings is, once
/// soft-capped to `c tanh(s/c)`, off by `sech^2(s/c) (ds + 2u|s|)` (the division) plus the
/// tanh's error and the product's rounding `(2 ulps + 2) u |s'|`; a sink is one more logit, exact, in
/// every head's normaliser.
fn attention_bounds(case: &OpCase, yy: &[f64], u: f64, ua: f64, ulps: f64) -> Bounds {
    let (q, k, v) = (f32_in(case, "q"), f32_in(case, "k"), f32_in(case, "v"));
    let g = AttnGeometry::of(case);
    let (nh, nkv, hd) = (g.nh, g.nkv, g.hd);
    let scale = 1.0 / (hd as f64).sqrt();
    let (cap, sinks) = attention_extras(case);
    let mut b = vec![0.0; yy.len()];
    for &(t, h, kvh, first, p) in &g.rows {
        let qh = &q.data[(t * nh + h) * hd..(t * nh + h + 1) * hd];
        let mut s = Vec::new();
        let mut s_err = Vec::new();
        for j in first..=p {
            let kj = &k.data[(j * nkv + kvh) * hd..(j * nkv + kvh + 1) * hd];
            let raw = qh.iter().zip(kj).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale;
            let err = gamma(hd + 2, ua) * scale * qh.iter().zip(kj).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum::<f64>();
            match cap {
                Some(c) => {
                    let capped = c * (raw / c).tanh();
                    let sech2 = 1.0 - (raw / c).tanh().powi(2);
                    s.push(capped);
                    s_err.push(sech2 * (err + 2.0 * u * raw.abs()) + (2.0 * ulps + 2.0) * u * capped.abs());
                }
                None => {
                    s.push(raw);
                    s_err.push(err);
                }
            }
        }
        let n_keys = s.len();
        if let Some(sk) = &sinks {
            s.push(sk.get(h).copied().unwrap_or(0.0));
            s_err.push(0.0);
        }
        let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|v| (v - max).exp()).collect();
        let z: f64 = e.iter().sum();
        let len = s.len();
        let max_err = s_err.iter().copied().fold(0.0, f64::max);
        for d in 0..hd {
            let mut acc = 0.0;
            for (jj, j) in (first..=p).enumerate().take(n_keys) {
                let pj = e[jj] / z;
                let eta = 2.0 * max_err + u * (s[jj] - max).abs() + gamma(len + 4, ua) + ulps * u;
                acc += pj * (v.data[(j * nkv + kvh) * hd + d] as f64).abs() * (eta + gamma(len + 1, ua));
            }
            let i = (t * nh + h) * hd + d;
            b[i] = acc + u * yy[i].abs() + f32::MIN_POSITIVE as f64;
        }
    }
    let base = "sum_j p_j|v_j|*(2*max|ds| + u|s-max| + gamma(L+4) + ulps*u + gamma(L+1)) + u|y|";
    let rule = match (cap, &sinks) {
        (Some(c), _) => format!("{base}; s = c*tanh(s0/c), ds = sech^2(s0/c)*(ds0 + 2u|s0|) + (2*ulps+2)*u*|s|, c={c}"),
        (None, Some(_)) => format!("{base}; L counts the sink logit"),
        _ => base.into(),
    };
    Bounds { per_output: vec![Some(b)], rule, stored_inputs_reference: None }
}

// ---------------------------------------------------------------------------------------------
// Fixed-point devices.
// ---------------------------------------------------------------------------------------------

/// The error of `fixed`'s integer soft-cap of `x` (`devices::fixed::SoftcapQ`): `2/c` in Q30
/// moves the sigmoid's argument by `|x| 2^-31`, its rounding by h; sigmoid's slope (at most 1/4)
/// and its own error, times `2c`; the cap in Q16 and the product's rounding, h each.
fn softcap_error(x: f64, c: f64, h: f64, eps_e: f64) -> f64 {
    let dz = h + x.abs() * 2f64.powi(-31);
    c * (dz / 2.0 + 2.0 * eps_e) + 2.0 * h
}

/// Bounds for an integer fixed-point device. Its arithmetic is fully declared (Q formats, round to
/// nearest, exact integer sums), so the suite predicts in f64 what the device must compute from
/// the quantized inputs, and the bound is |prediction - oracle| (the cost of the formats
/// themselves) plus the device's own roundings and its declared exp/sigmoid error.
pub fn fixed_bounds(case: &OpCase, reference: &[Output], fp: &devices::FixedPoint) -> Bounds {
    let h = 0.5 / (1u64 << fp.act_frac) as f64; // half an activation quantum
    let q = 2.0 * h;
    let eps_e = fp.exp_abs;
    let xq = |t: &Tensor| -> Vec<f64> { t.data.iter().map(|v| if v.is_finite() { on_grid(*v as f64, fp.act_frac) } else { f64::NEG_INFINITY }).collect() };
    let y: Vec<f64> = match reference.first() {
        Some(Output::F32(t)) => t.data.iter().map(|v| *v as f64).collect(),
        _ => Vec::new(),
    };
    let tiny = 1e-12;
    // Both results cross an f32 boundary: the oracle stores f32, the device returns its Q16
    // values as f32. Each costs half an f32 ulp of |y|.
    let one = |b: Vec<f64>, rule: &str| Bounds {
        per_output: vec![Some(b.iter().zip(&y).map(|(bi, yi)| bi + 2f64.powi(-23) * yi.abs()).collect())],
        rule: format!("{rule} + 2^-23*|y|"),
        stored_inputs_reference: None,
    };
    match case.op {
        Op::Embed => one(vec![h + tiny; y.len()], "fixed: h (Q16 rounding of the table)"),
        Op::Add | Op::AddBias => one(vec![2.0 * h + tiny; y.len()], "fixed: 2h (both inputs rounded to Q16)"),
        Op::Matmul => {
            let x = f32_in(case, "x");
            let Some((_, Input::Quant { ty, rows, cols, bytes })) = case.inputs.iter().find(|(n, _)| *n == "w") else {
                return Bounds { per_output: vec![None], rule: "matmul without a packed weight".into(), stored_inputs_reference: None };
            };
            let w = decode(*ty, bytes, rows * cols).expect("registry weights decode");
            let k = *cols;
            let (m0, _, stride) = oracle::registry::view_dims(case, x);
            let dense: Vec<f32> = (0..m0).flat_map(|r| x.data[r * stride..r * stride + k].iter().copied()).collect();
            let x = &Tensor { shape: vec![m0, k], data: dense };
            // The device's weights: Q24 values, or INT4 groups with a Q24 scale.
            let wd = crate::emulate::fixed_point_matrix(&w, k, fp);
            let xs = xq(x);
            let m = x.shape[0];
            let mut b = vec![0.0; m * rows];
            for t in 0..m {
                for r in 0..*rows {
                    let (mut pred, mut mag) = (0.0f64, 0.0f64);
                    for j in 0..k {
                        pred += xs[t * k + j] * wd[r * k + j];
                        mag += (xs[t * k + j] * w[r * k + j] as f64).abs();
                    }
                    // 2^-22 * sum|x w|: the device decodes packed blocks with its own reader
                    // (f32 operation order may differ by an ulp from the oracle's decoder).
                    b[t * rows + r] = (pred - y[t * rows + r]).abs() + h + mag * 2f64.powi(-22) + tiny;
                }
            }
            let wf = if fp.int4_group.is_some() { "INT4 groups" } else { "Q24" };
            one(b, &format!("fixed: |sum q16(x)*{wf}(w) - y| + h + 2^-22*sum|xw|, K={k}"))
        }
        Op::RmsNorm | Op::QkNorm => {
            let x = f32_in(case, "x");
            let n = if case.op == Op::QkNorm { case.pu("head_dim").unwrap_or(1) } else { x.shape[1] };
            let w: Vec<f64> = f32_in(case, "weight").data.iter().map(|v| on_grid(*v as f64, fp.norm_frac)).collect();
            let eps = case.p("eps").unwrap_or(0.0);
            let xs = xq(x);
            let mut b = Vec::with_capacity(xs.len());
            for (ri, row) in xs.chunks(n).enumerate() {
                let ms = row.iter().map(|v| v * v).sum::<f64>() / n as f64 + eps;
                let s = 1.0 / ms.sqrt();
                // Integer sqrt / reciprocal of Q32 values: relative error about 2^-32 / ms.
                let rel = 2f64.powi(-26) + 2f64.powi(-31) / ms;
                for (i, v) in row.iter().enumerate() {
                    let pred = v * s * w[i % w.len()];
                    b.push((pred - y[ri * n + i]).abs() + h + pred.abs() * rel + tiny);
                }
            }
            one(b, "fixed: |q16(x)*s*q20(w) - y| + h + |pred|*(2^-26 + 2^-31/ms)")
        }
        Op::Rope => {
            let x = f32_in(case, "x");
            let hd = case.pu("head_dim").unwrap_or(1);
            let n_head = case.pu("n_head").unwrap_or(1);
            let neox = case.pu("neox").unwrap_or(0) == 1;
            let Ok(spec) = oracle::registry::rope_spec_of(case) else {
                return Bounds { per_output: vec![None], rule: "rope case without a configuration".into(), stored_inputs_reference: None };
            };
            let pos = case.ids("pos").unwrap_or(&[]);
            let xs = xq(x);
            let mut b = vec![h + tiny; xs.len()];
            let half = spec.n_rot / 2;
            for (t, &p) in pos.iter().enumerate() {
                for i in 0..half {
                    let (c, s) = oracle::ops::rope_cos_sin(&spec, p as usize, i);
                    let (c, s) = (on_grid(c, fp.table_frac), on_grid(s, fp.table_frac));
                    for hh in 0..n_head {
                        let base = (t * n_head + hh) * hd;
                        let (a, bb) = if neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
                        let (x0, x1) = (xs[base + a], xs[base + bb]);
                        let slack = (x0.abs() + x1.abs()) * 2f64.powi(-(fp.table_frac as i32)) + tiny;
                        b[base + a] = ((x0 * c - x1 * s) - y[base + a]).abs() + h + slack;
                        b[base + bb] = ((x0 * s + x1 * c) - y[base + bb]).abs() + h + slack;
                    }
                }
            }
            one(b, "fixed: |rope(q16(x), q30 tables) - y| + h + (|x0|+|x1|)*2^-30")
        }
        Op::Softmax => {
            let x = f32_in(case, "x");
            let n = x.shape[1];
            let xs = xq(x);
            let mut b = Vec::with_capacity(xs.len());
            for (ri, row) in xs.chunks(n).enumerate() {
                let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = row.iter().map(|v| (v - max).exp()).collect();
                let z: f64 = e.iter().sum();
                let live = row.iter().filter(|v| v.is_finite()).count() as f64;
                for (i, ei) in e.iter().enumerate() {
                    let p = ei / z;
                    b.push((p - y[ri * n + i]).abs() + eps_e * (1.0 + p * live) / (1.0 - eps_e) + h + tiny);
                }
            }
            one(b, "fixed: |softmax(q16(x)) - y| + eps_exp*(1 + p*n) + h")
        }
        Op::Silu | Op::Swiglu => {
            let g = xq(f32_in(case, "gate"));
            let up: Vec<f64> = if case.op == Op::Swiglu { xq(f32_in(case, "up")) } else { vec![1.0; g.len()] };
            let b = (0..g.len())
                .map(|i| {
                    let s = g[i] / (1.0 + (-g[i]).exp());
                    let silu_err = g[i].abs() * (eps_e + q) + h;
                    let extra = if case.op == Op::Swiglu { silu_err * up[i].abs() + h } else { silu_err };
                    (s * up[i] - y[i]).abs() + extra + tiny
                })
                .collect();
            one(b, "fixed: |silu(q16(g))*q16(u) - y| + |g|*(eps_exp + q)*|u| + 2h")
        }
        Op::Attention | Op::AttentionSinks | Op::AttentionSoftcap => {
            let (qt, kt, vt) = (f32_in(case, "q"), f32_in(case, "k"), f32_in(case, "v"));
            let (qs, ks, vs) = (xq(qt), xq(kt), xq(vt));
            let g = AttnGeometry::of(case);
            let (nh, nkv, hd) = (g.nh, g.nkv, g.hd);
            let scale = on_grid(1.0 / (hd as f64).sqrt(), 30);
            let (cap, _) = attention_extras(case);
            let sinks = if case.op == Op::AttentionSinks { case.f32("sinks").ok().map(xq) } else { None };
            let mut b = vec![0.0; y.len()];
            for &(t, hh, kvh, first, p) in &g.rows {
                let qh = &qs[(t * nh + hh) * hd..(t * nh + hh + 1) * hd];
                let raw: Vec<f64> = (first..=p).map(|j| qh.iter().zip(&ks[(j * nkv + kvh) * hd..(j * nkv + kvh + 1) * hd]).map(|(a, b)| a * b).sum::<f64>() * scale).collect();
                // Each score's error: its Q16 rounding h, and with a soft-cap the integer
                // soft-cap's own (`softcap_error`), the slope of tanh carrying the rest.
                let delta = raw.iter().map(|r| cap.map_or(h, |c| h + softcap_error(*r, c, h, eps_e))).fold(h, f64::max);
                let mut sc: Vec<f64> = raw.iter().map(|r| cap.map_or(*r, |c| c * (r / c).tanh())).collect();
                let n_keys = sc.len();
                if let Some(sk) = &sinks {
                    sc.push(sk.get(hh).copied().unwrap_or(0.0));
                }
                let max = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|v| (v - max).exp()).collect();
                let z: f64 = e.iter().sum();
                let len = sc.len() as f64;
                for d in 0..hd {
                    let (mut pred, mut err) = (0.0, 0.0);
                    for (jj, j) in (first..=p).enumerate().take(n_keys) {
                        let pj = e[jj] / z;
                        let vj = vs[(j * nkv + kvh) * hd + d];
                        pred += pj * vj;
                        // score errors of delta (2 delta after the max subtraction) move p by
                        // 4 delta p; the integer exp and the Q16 division add eps_exp*(1 + p*L) + h.
                        err += vj.abs() * (pj * 4.0 * delta + eps_e * (1.0 + pj * len) / (1.0 - eps_e) + h);
                    }
                    let i = (t * nh + hh) * hd + d;
                    b[i] = (pred - y[i]).abs() + err + h + tiny;
                }
            }
            let extra = match (cap, &sinks) {
                (Some(c), _) => format!("; delta = h + softcap error, c={c}"),
                (None, Some(_)) => "; L counts the sink logit".into(),
                _ => String::new(),
            };
            one(b, &format!("fixed: |attn(q16 inputs) - y| + sum_j |v_j|*(4*delta*p_j + eps_exp*(1+p_j*L) + h) + h{extra}"))
        }
        Op::Softcap => {
            let x = xq(f32_in(case, "x"));
            let c = case.p("cap").unwrap_or(1.0);
            let b = (0..x.len()).map(|i| (c * (x[i] / c).tanh() - y[i]).abs() + softcap_error(x[i], c, h, eps_e) + tiny).collect();
            one(b, &format!("fixed: |c*tanh(q16(x)/c) - y| + c*(dz/2 + 2*eps_exp) + 2h, dz = h + |x|*2^-31, c={c}"))
        }
        // x * sigmoid(z), z = 2 sqrt(2/pi) (x + 0.044715 x^3) from Q30 constants (each off by
        // 2^-31), the cube and z floored to Q16 (2^-16 each): dz, carried by sigmoid's slope
        // (at most 1/4), the sigmoid's own error, the product's rounding.
        Op::GeluTanh | Op::Geglu => {
            let g = xq(f32_in(case, "gate"));
            let up = if case.op == Op::Geglu { xq(f32_in(case, "up")) } else { vec![1.0; g.len()] };
            let b = (0..g.len())
                .map(|i| {
                    let x = g[i];
                    let gelu = 0.5 * x * (1.0 + (0.797_884_560_802_865_4 * (x + 0.044_715 * x.powi(3))).tanh());
                    let dz = (x.abs() + x.abs().powi(3)) * 2f64.powi(-31) + 1.1 * 2f64.powi(-16);
                    let gelu_err = x.abs() * (dz / 4.0 + eps_e) + h;
                    let extra = if case.op == Op::Geglu { gelu_err * up[i].abs() + h } else { gelu_err };
                    (gelu * up[i] - y[i]).abs() + extra + tiny
                })
                .collect();
            one(b, "fixed: |gelu(q16(g))*q16(u) - y| + (|g|*(dz/4 + eps_exp) + h)*|u| + h, dz = (|g|+|g|^3)*2^-31 + 1.1*2^-16")
        }
        // min(g,7) * sigmoid(1.702 min(g,7)) * (clamp(u,-7,7) + 1): 1.702 in Q16 (off by at most
        // 2^-17) and the product rounded (h) move the sigmoid's argument; then as GELU above.
        Op::SwigluOai => {
            let (lim, alpha) = (oracle::spec::OAI_SWIGLU_LIMIT, oracle::spec::OAI_SWIGLU_ALPHA);
            let (g, up) = (xq(f32_in(case, "gate")), xq(f32_in(case, "up")));
            let b = (0..g.len())
                .map(|i| {
                    let (gc, uc) = (g[i].min(lim), up[i].clamp(-lim, lim) + 1.0);
                    let pred = gc / (1.0 + (-alpha * gc).exp()) * uc;
                    let dz = gc.abs() * 2f64.powi(-17) + h;
                    let a_err = gc.abs() * (dz / 4.0 + eps_e) + h;
                    (pred - y[i]).abs() + a_err * uc.abs() + h + tiny
                })
                .collect();
            one(b, "fixed: |swiglu_oai(q16 inputs) - y| + (|g'|*(dz/4 + eps_exp) + h)*|u'+1| + h, dz = |g'|*2^-17 + h")
        }
        // Argmax compares integers: exact. The others have no integer kernel (the device says
        // unsupported); exact stands for "nothing to allow".
        // Expert ids exact; each weight: its score from the Q16 logits (the integer softmax's
        // error as `softmax` above, the sigmoid's eps_exp), divided where normalised by the
        // chosen scores' sum (each score's error, and the sum's, carried through the quotient).
        Op::MoeRoute => {
            let l = f32_in(case, "logits");
            let n = l.shape[1];
            let (k, sigmoid, normalize) = (case.pu("k").unwrap_or(1), case.pu("sigmoid").unwrap_or(0) == 1, case.pu("normalize").unwrap_or(0) == 1);
            let ids: &[u32] = match reference.first() {
                Some(Output::Ids(v)) => v,
                _ => &[],
            };
            let wy: Vec<f64> = match reference.get(1) {
                Some(Output::F32(t)) => t.data.iter().map(|v| *v as f64).collect(),
                _ => Vec::new(),
            };
            let mut b = Vec::with_capacity(wy.len());
            for (r, row) in xq(l).chunks(n).enumerate() {
                let (p, err): (Vec<f64>, Vec<f64>) = if sigmoid {
                    row.iter().map(|x| (1.0 / (1.0 + (-x).exp()), eps_e + h)).unzip()
                } else {
                    let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = row.iter().map(|x| (x - max).exp()).collect();
                    let z: f64 = e.iter().sum();
                    e.iter().map(|v| (v / z, eps_e * (1.0 + v / z * n as f64) / (1.0 - eps_e) + h)).unzip()
                };
                let chosen: Vec<usize> = (0..k).map(|j| ids.get(r * k + j).map_or(0, |e| (*e as usize).min(n - 1))).collect();
                let sum: f64 = chosen.iter().map(|e| p[*e]).sum();
                let sum_err: f64 = chosen.iter().map(|e| err[*e]).sum();
                for (j, e) in chosen.iter().enumerate() {
                    let (pred, e_err) = if normalize { (p[*e] / sum, (err[*e] + p[*e] / sum * sum_err) / (sum - sum_err).max(f64::MIN_POSITIVE) + h) } else { (p[*e], err[*e]) };
                    b.push((pred - wy.get(r * k + j).copied().unwrap_or(0.0)).abs() + e_err + tiny + 2f64.powi(-23) * pred.abs());
                }
            }
            Bounds {
                per_output: vec![None, Some(b)],
                rule: format!("fixed: expert ids exact; weights |w(q16 logits) - y| + eps (softmax: eps_exp*(1+p*n) + h; sigmoid: eps_exp + h), through the renormalisation, n={n}"),
                stored_inputs_reference: None,
            }
        }
        Op::Argmax | Op::LayerNorm | Op::TopK | Op::Sample | Op::DeltaRule | Op::SsmScan | Op::MlaAttention => {
            Bounds { per_output: reference.iter().map(|o| matches!(o, Output::F32(_)).then(|| vec![0.0; y.len()])).collect(), rule: "exact".into(), stored_inputs_reference: None }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every op of the registry has its bound derived here, with the formula printed beside the
    /// value it computes (the `rule` text comes from the same arm as the bound): none falls to
    /// the default, an op the registry calls exact is held to zero, and the others are not.
    #[test]
    fn the_reports_list_of_kernel_ops_is_the_registrys() {
        let names: Vec<&str> = Op::ALL.iter().map(|o| o.name()).collect();
        assert_eq!(names, reports::KERNEL_OPS, "reports::KERNEL_OPS (JUnit's `ops` rung) must name every op of oracle::registry::Op");
        let registered: Vec<Op> = oracle::registry::registry().iter().map(|e| e.op).collect();
        assert_eq!(registered, Op::ALL, "one registry entry per op, in Op::ALL's order");
    }

    #[test]
    fn every_registry_op_has_its_own_derived_bound() {
        for e in oracle::registry::registry() {
            let taken = std::cell::Cell::new(0);
            let cases = e.cases_where(0, &|_| {
                taken.set(taken.get() + 1);
                taken.get() <= 3
            });
            assert!(!cases.is_empty(), "{}: no cases", e.op);
            for c in &cases {
                let reference = (e.reference)(c).unwrap();
                let b = bounds(c, &reference, &Arithmetic::F32);
                assert!(!b.rule.is_empty() && !b.rule.starts_with("no rule for"), "{}: {}", c.id, b.rule);
                let values: Vec<f64> = b.per_output.iter().flatten().flatten().copied().collect();
                if e.rule == oracle::registry::ToleranceRule::Exact {
                    assert!(values.iter().all(|v| *v == 0.0), "{}: exact in the registry, bound {}", c.id, b.rule);
                } else if !values.is_empty() {
                    assert!(values.iter().any(|v| *v > 0.0), "{}: {:?} in the registry, a zero bound ({})", c.id, e.rule, b.rule);
                }
            }
        }
    }

    /// A device that feeds a K-quant matrix Q8 blocks of 256 (llama.cpp's Q8_K), its other
    /// quantized matrices blocks of 32 and an F16/BF16 matrix its input in that format is held
    /// to a bound that covers each: the bound rounds the case's input as its weight type takes
    /// it, and a declaration of blocks of 32 alone covers neither the coarser blocks nor the
    /// half-precision inputs.
    #[test]
    fn matmul_bounds_round_the_input_as_the_weight_type_takes_it() {
        use devices::{InputRounding, NumFormat};
        use oracle::quant::GgmlType;
        let entry = oracle::registry::registry().into_iter().find(|e| e.op == Op::Matmul).unwrap();
        let types = ["q4_k", "q4_0", "bf16", "f16"];
        let cases = entry.cases_where(0, &|id: &str| types.iter().any(|t| id.starts_with(&format!("matmul(w={t},k=512,n=256,m=3,seed="))));
        assert_eq!(cases.len(), 16, "four seeds of each type");
        let declared = Arithmetic { activation_q8_block: Some(32), activation_q8_block_kquant: Some(256), activation_half_rounding: true, ..Arithmetic::F32 };
        let mut uncovered_by_32 = std::collections::BTreeMap::new();
        for case in &cases {
            let reference = (entry.reference)(case).unwrap();
            let Some((_, Input::Quant { ty, rows, cols, bytes })) = case.inputs.iter().find(|(n, _)| *n == "w") else { unreachable!() };
            let how = match ty {
                GgmlType::Q4_K => InputRounding::Q8K(256),
                GgmlType::BF16 => InputRounding::Half(NumFormat::BF16),
                GgmlType::F16 => InputRounding::Half(NumFormat::F16),
                _ => InputRounding::Q8(32),
            };
            // The device: the input rounded as its type takes it, the product in f64.
            let w = decode(*ty, bytes, rows * cols).unwrap();
            let mut x = f32_in(case, "x").data.clone();
            crate::emulate::round_input(&mut x, *cols, how);
            let got: Vec<f64> = x.chunks(*cols).flat_map(|xr| w.chunks(*cols).map(move |wr| wr.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>())).collect();
            let Output::F32(y) = &reference[0] else { unreachable!() };
            let err: Vec<f64> = got.iter().zip(&y.data).map(|(g, r)| (g - *r as f64).abs()).collect();
            let b = bounds(case, &reference, &declared);
            assert!(err.iter().zip(b.per_output[0].as_ref().unwrap()).all(|(e, b)| e <= b), "{}: the declared rounding's bound covers the device", case.id);
            let named = match how {
                InputRounding::Q8(block) => format!("Q8 blocks of {block}"),
                InputRounding::Q8K(block) => format!("Q8_K blocks of {block}"),
                InputRounding::Half(f) => format!("{f:?}(x)"),
            };
            assert!(b.rule.contains(&named), "{}: {}", case.id, b.rule);
            let narrow = bounds(case, &reference, &Arithmetic { activation_q8_block: Some(32), ..Arithmetic::F32 }).per_output[0].clone().unwrap();
            *uncovered_by_32.entry(ty.name()).or_insert(0) += usize::from(err.iter().zip(&narrow).any(|(e, b)| e > b));
        }
        let want: std::collections::BTreeMap<&str, usize> = [("bf16", 4), ("f16", 4), ("q4_0", 0), ("q4_k", 4)].into_iter().collect();
        assert_eq!(uncovered_by_32, want, "blocks of 32 declared: the coarser roundings fall outside, blocks of 32 inside");
    }

    /// An engine that forms RoPE angles in f32 as ggml does (theta_scale = base^(-2/n_rot) in
    /// f32; the angle starts at the position and is multiplied by theta_scale pair after pair)
    /// passes the kernel cases' bound at every position, 4,095 included, where that rounding
    /// alone is past the bound of a rotation by an exact angle; a rotation by the next position's
    /// angle still fails it.
    #[test]
    fn rope_bounds_allow_angles_formed_in_f32_and_not_a_wrong_position() {
        let entry = oracle::registry::registry().into_iter().find(|e| e.op == Op::Rope).unwrap();
        let cases = entry.cases_where(0, &|id: &str| id.contains("scaling=none"));
        assert_eq!(cases.len(), 48);
        let u = f32::EPSILON as f64 / 2.0;
        let (mut needed_the_angle, mut off_by_one_caught) = (0, 0);
        for case in &cases {
            let reference = (entry.reference)(case).unwrap();
            let Output::F32(y) = &reference[0] else { unreachable!() };
            let x = f32_in(case, "x");
            let (hd, n_rot, n_head, neox) = (case.pu("head_dim").unwrap(), case.pu("n_rot").unwrap(), case.pu("n_head").unwrap(), case.pu("neox").unwrap() == 1);
            let theta = case.params["theta"];
            let pos = case.ids("pos").unwrap();
            let theta_scale = (theta as f32).powf(-2.0 / n_rot as f32);
            let rotate = |f32_angles: bool, shift: u32| -> Vec<f64> {
                let mut out: Vec<f64> = x.data.iter().map(|v| *v as f64).collect();
                for (t, &p) in pos.iter().enumerate() {
                    for h in 0..n_head {
                        let mut angle = (p + shift) as f32;
                        for pair in 0..n_rot / 2 {
                            let exact = (p + shift) as f64 * theta.powf(-2.0 * pair as f64 / n_rot as f64);
                            let (c, s) = if f32_angles { (angle.cos() as f64, angle.sin() as f64) } else { (exact.cos(), exact.sin()) };
                            let (a, b) = if neox { (pair, pair + n_rot / 2) } else { (2 * pair, 2 * pair + 1) };
                            let base = t * n_head * hd + h * hd;
                            let (xa, xb) = (x.data[base + a] as f64, x.data[base + b] as f64);
                            out[base + a] = xa * c - xb * s;
                            out[base + b] = xa * s + xb * c;
                            angle *= theta_scale;
                        }
                    }
                }
                out
            };
            let bound = bounds(case, &reference, &Arithmetic::F32).per_output[0].clone().unwrap();
            let err = |got: &[f64]| got.iter().zip(&y.data).map(|(g, r)| (g - *r as f64).abs()).collect::<Vec<f64>>();
            let f32_angles = err(&rotate(true, 0));
            assert!(f32_angles.iter().zip(&bound).all(|(e, b)| e <= b), "{}: f32 angles within the bound", case.id);
            // The bound of a rotation by an exact angle (the angle's term left out).
            let exact_only = |i: usize| {
                let (head0, j) = (i - i % hd, i % hd);
                let partner = if neox { if j < n_rot / 2 { j + n_rot / 2 } else { j - n_rot / 2 } } else { j ^ 1 };
                4.0 * u * ((x.data[i] as f64).abs() + (x.data[head0 + partner] as f64).abs()) + u * (y.data[i] as f64).abs()
            };
            needed_the_angle += usize::from(f32_angles.iter().enumerate().any(|(i, e)| i % hd < n_rot && *e > exact_only(i) + f32::MIN_POSITIVE as f64));
            off_by_one_caught += usize::from(err(&rotate(false, 1)).iter().zip(&bound).any(|(e, b)| e > b));
        }
        assert_eq!(needed_the_angle, cases.len(), "the f32 angle's error passes an exact angle's bound in every case");
        assert_eq!(off_by_one_caught, cases.len(), "the next position's angle fails every case");
    }

    /// A device that holds every tensor in bf16 (its inputs rounded on entry, each result
    /// rounded on store) passes every `add`, `softmax` and `argmax` case under a bf16 declaration,
    /// where the inputs' rounding alone is past most of the bounds of a device that computes
    /// from the inputs as given; a bf16 `add` that scales one operand by 1.05 still fails.
    #[test]
    fn bounds_of_a_bf16_device_cover_its_inputs_held_in_bf16() {
        let bf16 = |v: f32| half::bf16::from_f32(v).to_f32();
        let declared = Arithmetic { storage: NumFormat::BF16, ..Arithmetic::F32 };
        let (mut cases_seen, mut past_unrounded, mut wrong_caught) = (0, 0, 0);
        for op in [Op::Add, Op::Softmax, Op::Argmax] {
            let entry = oracle::registry::registry().into_iter().find(|e| e.op == op).unwrap();
            for case in entry.cases_where(0, &|_: &str| true) {
                let reference = (entry.reference)(&case).unwrap();
                let stored = stored_inputs(&case, NumFormat::BF16).expect("random inputs are not all bf16 values");
                // The device: the oracle's arithmetic on the bf16 inputs, each result rounded to bf16.
                let got = (entry.reference)(&stored).unwrap();
                let b = bounds(&case, &reference, &declared);
                assert!(b.rule.starts_with("|y - y(inputs in BF16)| + "), "{}", b.rule);
                let unrounded = derived(&case, &reference, &declared);
                match (&reference[0], &got[0]) {
                    (Output::F32(r), Output::F32(g)) => {
                        let bound = b.per_output[0].as_ref().unwrap();
                        let plain = unrounded.per_output[0].as_ref().unwrap();
                        let err: Vec<f64> = r.data.iter().zip(&g.data).map(|(r, g)| if r.is_finite() { (*r as f64 - bf16(*g) as f64).abs() } else { 0.0 }).collect();
                        assert!(err.iter().zip(bound).all(|(e, b)| e <= b), "{}: a bf16 device within its bound", case.id);
                        past_unrounded += usize::from(err.iter().zip(plain).any(|(e, b)| e > b));
                        if op == Op::Add {
                            // A bf16 device that scales `b` by 1.05.
                            let (Some(Input::F32(a)), Some(Input::F32(bb))) = (stored.inputs.first().map(|i| &i.1), stored.inputs.get(1).map(|i| &i.1)) else { unreachable!() };
                            let wrong = a.data.iter().zip(&bb.data).map(|(a, b)| bf16(a + b * 1.05) as f64);
                            wrong_caught += usize::from(wrong.zip(&r.data).zip(bound).any(|((w, r), b)| (w - *r as f64).abs() > *b));
                        }
                    }
                    (Output::Ids(r), Output::Ids(g)) => {
                        let alt = b.stored_inputs_reference.as_ref().unwrap();
                        assert!(r == g || alt[0] == Output::Ids(g.clone()), "{}: the rounded inputs' ids count", case.id);
                    }
                    _ => unreachable!(),
                }
                cases_seen += 1;
            }
        }
        assert!(cases_seen >= 200, "{cases_seen}");
        assert!(past_unrounded * 2 > 160, "the inputs' rounding is past most bounds that leave it out: {past_unrounded}");
        assert!(wrong_caught * 2 > 80, "b x 1.05 fails most add cases: {wrong_caught}");
    }
}
