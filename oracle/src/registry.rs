//! Every op declared once: name, reference implementation, case generator, tolerance rule, and
//! flops/bytes counts. The kernel suite enumerates this registry; each device implements the
//! same op names. A test fails if an entry has no case or no rule, or its reference cannot run
//! every case it generates.
//!
//! Cases are small values with an identity string (`matmul(w=q4_1,k=576,n=1536,m=1,seed=0)`),
//! inputs drawn from a recorded seed (normals with outliers, large-RMS rows, -inf masks), and
//! shapes that include odd sizes and the real shapes of SmolLM2 and the synthetic models.

use crate::error::{OracleError, Result};
use crate::ops::{self, AttentionParams, Mat, SamplerConfig, SplitMix64};
use crate::quant::{decode, encode, GgmlType};
use crate::spec::{Gating, RopeScaling, RopeSpec, RopeStyle};
use std::collections::BTreeMap;

mod recurrent;
mod latent;
pub use latent::{block as mla_block, mla_attention_f64};
pub use recurrent::{delta_rule_f64, ssm_scan_f64};

/// A dense f32 tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Every op the registry declares. Its name (`Op::name`, serde, Display) is the one case ids and
/// the op protocol use; devices match on it exhaustively, so a new op is a compile error in each
/// until it is supported there or said not to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    Embed,
    RmsNorm,
    LayerNorm,
    Matmul,
    AddBias,
    Add,
    Rope,
    QkNorm,
    Attention,
    /// Attention with GPT-OSS's sinks: one more logit per head in the softmax, weighing no value.
    AttentionSinks,
    /// Attention with Gemma 2's soft-capped scores: `cap * tanh(s / cap)` before the softmax.
    AttentionSoftcap,
    Softmax,
    /// `cap * tanh(x / cap)` per element (Gemma 2's final logits).
    Softcap,
    Silu,
    GeluTanh,
    Swiglu,
    Geglu,
    /// GPT-OSS's clamped SwiGLU (`ops::swiglu_oai`).
    SwigluOai,
    MoeRoute,
    Argmax,
    TopK,
    Sample,
    /// A gated DeltaNet's delta rule over a run of positions from a given state (Qwen3-Next's
    /// linear attention): the outputs and the state after the last position.
    DeltaRule,
    /// Mamba-2's selective scan over a run of positions from a given state: the outputs and the
    /// state after the last position.
    SsmScan,
    /// Latent attention (DeepSeek MLA): rotated queries over cached latents and shared rotated
    /// keys through the expansion `attn_kv_b`, absorbed or materialized.
    MlaAttention,
}

impl Op {
    /// Every op, in registry order.
    pub const ALL: [Op; 25] = [Op::Embed, Op::RmsNorm, Op::LayerNorm, Op::Matmul, Op::AddBias, Op::Add, Op::Rope, Op::QkNorm, Op::Attention, Op::AttentionSinks, Op::AttentionSoftcap, Op::Softmax, Op::Softcap, Op::Silu, Op::GeluTanh, Op::Swiglu, Op::Geglu, Op::SwigluOai, Op::MoeRoute, Op::Argmax, Op::TopK, Op::Sample, Op::DeltaRule, Op::SsmScan, Op::MlaAttention];

    /// The op's name in case ids and the op protocol (`rms_norm`, `matmul`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Op::Embed => "embed",
            Op::RmsNorm => "rms_norm",
            Op::LayerNorm => "layer_norm",
            Op::Matmul => "matmul",
            Op::AddBias => "add_bias",
            Op::Add => "add",
            Op::Rope => "rope",
            Op::QkNorm => "qk_norm",
            Op::Attention => "attention",
            Op::AttentionSinks => "attention_sinks",
            Op::AttentionSoftcap => "attention_softcap",
            Op::Softmax => "softmax",
            Op::Softcap => "softcap",
            Op::Silu => "silu",
            Op::GeluTanh => "gelu_tanh",
            Op::Swiglu => "swiglu",
            Op::Geglu => "geglu",
            Op::SwigluOai => "swiglu_oai",
            Op::MoeRoute => "moe_route",
            Op::Argmax => "argmax",
            Op::TopK => "top_k",
            Op::Sample => "sample",
            Op::DeltaRule => "delta_rule",
            Op::SsmScan => "ssm_scan",
            Op::MlaAttention => "mla_attention",
        }
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One input of a case.
#[derive(Clone, Debug)]
pub enum Input {
    F32(Tensor),
    /// A weight matrix `[rows, cols]` encoded in a GGUF type (the device gets the packed bytes).
    Quant { ty: GgmlType, rows: usize, cols: usize, bytes: Vec<u8> },
    Ids(Vec<u32>),
}

/// One output of a reference run.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    F32(Tensor),
    /// Discrete results (ids, expert choices): must match exactly.
    Ids(Vec<u32>),
}

#[derive(Clone, Debug)]
pub struct OpCase {
    pub op: Op,
    pub id: String,
    pub seed: u64,
    pub inputs: Vec<(&'static str, Input)>,
    pub params: BTreeMap<&'static str, f64>,
}

impl OpCase {
    pub fn f32(&self, name: &str) -> Result<&Tensor> {
        match self.inputs.iter().find(|(n, _)| *n == name) {
            Some((_, Input::F32(t))) => Ok(t),
            _ => Err(OracleError::Shape(format!("{}: no f32 input `{name}`", self.id))),
        }
    }
    pub fn ids(&self, name: &str) -> Result<&[u32]> {
        match self.inputs.iter().find(|(n, _)| *n == name) {
            Some((_, Input::Ids(v))) => Ok(v),
            _ => Err(OracleError::Shape(format!("{}: no id input `{name}`", self.id))),
        }
    }
    /// A weight input decoded to a matrix.
    pub fn mat(&self, name: &str) -> Result<Mat<f32>> {
        match self.inputs.iter().find(|(n, _)| *n == name) {
            Some((_, Input::Quant { ty, rows, cols, bytes })) => Mat::new(*rows, *cols, decode(*ty, bytes, rows * cols)?),
            Some((_, Input::F32(t))) if t.shape.len() == 2 => Mat::new(t.shape[0], t.shape[1], t.data.clone()),
            _ => Err(OracleError::Shape(format!("{}: no matrix input `{name}`", self.id))),
        }
    }
    pub fn p(&self, name: &str) -> Result<f64> {
        self.params.get(name).copied().ok_or_else(|| OracleError::Shape(format!("{}: no parameter `{name}`", self.id)))
    }
    pub fn pu(&self, name: &str) -> Result<usize> {
        Ok(self.p(name)? as usize)
    }
}

/// How a device's result is judged; the kernel suite turns a rule into a bound using the
/// device's declared arithmetic (unit roundoff `u` of its storage/accumulation types and its
/// weight/activation codecs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToleranceRule {
    /// Discrete results: bit-for-bit / id-for-id equality.
    Exact,
    /// One rounding per element.
    Elementwise,
    /// A dot product of length K per output (plus the weight codec's own error for quantized
    /// weights).
    Dot,
    /// A reduction-normalised row (norms, softmax).
    RowReduction,
    /// Transcendental per element (rope's cos/sin, exp, tanh).
    Transcendental,
    /// A recurrence over positions: each step's roundings carried forward by a map of norm at
    /// most 1, so the state's error is the sum of the steps' own.
    Recurrence,
}

impl ToleranceRule {
    /// The kind of bound, in words. The bound itself, and its formula as reports print it, are
    /// derived per op in one place (`suites::tolerance::bounds`), from the case and the device's
    /// declared arithmetic: no formula is written here, so none can differ from the one applied.
    pub fn describe(self) -> &'static str {
        match self {
            ToleranceRule::Exact => "exact",
            ToleranceRule::Elementwise => "one rounding per element",
            ToleranceRule::Dot => "a dot product's roundings (and the weight codec's error)",
            ToleranceRule::RowReduction => "a row reduction's roundings",
            ToleranceRule::Transcendental => "a transcendental's error per element",
            ToleranceRule::Recurrence => "each step's roundings, carried through the recurrence's contraction",
        }
    }
}

pub struct OpEntry {
    pub op: Op,
    pub summary: &'static str,
    pub rule: ToleranceRule,
    /// Case generator; `base_seed` (0 = the recorded default) perturbs every input stream.
    pub cases: fn(u64) -> Vec<OpCase>,
    pub reference: fn(&OpCase) -> Result<Vec<Output>>,
    pub flops: fn(&OpCase) -> u64,
    pub bytes: fn(&OpCase) -> u64,
}

impl OpEntry {
    /// The cases whose ids `keep` accepts, the same as `cases` gives them. Matmul builds only
    /// those (its quantized weights are what takes the time: a filtered or sharded run of the
    /// kernel suite would otherwise encode all 923 cases' weights first).
    pub fn cases_where(&self, base_seed: u64, keep: &dyn Fn(&str) -> bool) -> Vec<OpCase> {
        if self.op == Op::Matmul {
            return matmul_cases_where(base_seed, keep);
        }
        (self.cases)(base_seed).into_iter().filter(|c| keep(&c.id)).collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Input generation.
// ---------------------------------------------------------------------------------------------

/// Realistic activations: normals, every 61st element an outlier x20, and one in four rows
/// scaled to a large RMS (x100), as residual streams show.
pub fn activations(rng: &mut SplitMix64, rows: usize, cols: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let row_scale = if r % 4 == 3 { 100.0 } else { 1.0 };
        for c in 0..cols {
            let x = rng.next_normal() * row_scale;
            v.push((if (r * cols + c) % 61 == 17 { x * 20.0 } else { x }) as f32);
        }
    }
    v
}

fn normals(rng: &mut SplitMix64, n: usize, sigma: f64) -> Vec<f32> {
    (0..n).map(|_| (rng.next_normal() * sigma) as f32).collect()
}

fn t(shape: &[usize], data: Vec<f32>) -> Input {
    Input::F32(Tensor { shape: shape.to_vec(), data })
}

fn case(op: Op, id: String, seed: u64, inputs: Vec<(&'static str, Input)>, params: &[(&'static str, f64)]) -> OpCase {
    OpCase { op, id, seed, inputs, params: params.iter().copied().collect() }
}

fn out(shape: &[usize], data: Vec<f32>) -> Output {
    Output::F32(Tensor { shape: shape.to_vec(), data })
}

/// Seeds per shape for the small ops.
const N_SEEDS: u64 = 10;

/// The seed of variant `i` under a base seed (0 = the recorded default streams).
fn seed_of(base: u64, i: u64) -> u64 {
    i ^ base.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}
/// Row lengths: odd sizes, the synthetic models' width, SmolLM2's width and FFN width, a 4096 row.
const WIDTHS: [usize; 8] = [5, 7, 13, 64, 256, 576, 1536, 4096];

// ---------------------------------------------------------------------------------------------
// Entries.
// ---------------------------------------------------------------------------------------------

fn embed_cases(base: u64) -> Vec<OpCase> {
    let mut v = Vec::new();
    for (vocab, d) in [(11usize, 7usize), (272, 256), (300, 64), (1000, 576)] {
        for seed in (0..N_SEEDS).map(|i| seed_of(base, i)) {
            let mut r = SplitMix64(seed ^ 0xE3BE);
            let table = normals(&mut r, vocab * d, 1.0);
            let ids: Vec<u32> = (0..5).map(|_| (r.next_u64() % vocab as u64) as u32).collect();
            v.push(case(Op::Embed, format!("embed(vocab={vocab},d={d},m=5,seed={seed})"), seed, vec![("table", t(&[vocab, d], table)), ("ids", Input::Ids(ids))], &[]));
        }
    }
    v
}

fn embed_ref(c: &OpCase) -> Result<Vec<Output>> {
    let table = c.mat("table")?;
    let ids = c.ids("ids")?;
    Ok(vec![out(&[ids.len(), table.cols], ops::embed(&table, ids)?)])
}

fn norm_cases(op: Op, base: u64) -> Vec<OpCase> {
    let mut v = Vec::new();
    for n in WIDTHS {
        for seed in (0..N_SEEDS).map(|i| seed_of(base, i)) {
            for eps in [1e-5, 1e-6] {
                let mut r = SplitMix64(seed ^ n as u64);
                let rows = 5;
                let mut x = activations(&mut r, rows, n);
                // Row 2 has a tiny RMS (1e-3), where eps matters as much as the data does.
                x[2 * n..3 * n].iter_mut().for_each(|v| *v *= 1e-3);
                let w: Vec<f32> = (0..n).map(|_| (1.0 + 0.1 * r.next_normal()) as f32).collect();
                let b = normals(&mut r, n, 0.1);
                let mut inputs = vec![("x", t(&[rows, n], x)), ("weight", t(&[n], w))];
                if op == Op::LayerNorm {
                    inputs.push(("bias", t(&[n], b)));
                }
                v.push(case(op, format!("{op}(dtype=f32,shape=[{rows},{n}],eps={eps:e},seed={seed})"), seed, inputs, &[("eps", eps)]));
            }
        }
    }
    v
}

fn rms_norm_ref(c: &OpCase) -> Result<Vec<Output>> {
    let x = c.f32("x")?;
    let n = x.shape[1];
    Ok(vec![out(&x.shape, ops::rms_norm(&x.data, n, Some(&c.f32("weight")?.data), c.p("eps")?)?)])
}

fn layer_norm_ref(c: &OpCase) -> Result<Vec<Output>> {
    let x = c.f32("x")?;
    let n = x.shape[1];
    Ok(vec![out(&x.shape, ops::layer_norm(&x.data, n, Some(&c.f32("weight")?.data), Some(&c.f32("bias")?.data), c.p("eps")?)?)])
}

fn matmul_cases(base: u64) -> Vec<OpCase> {
    matmul_cases_where(base, &|_| true)
}

/// The matmul cases whose ids `keep` accepts; the others' weights are never drawn or encoded
/// (encoding all of them takes about 10 s here; each case's inputs come from its own seed, so a
/// kept case is the same either way).
fn matmul_cases_where(base: u64, keep: &dyn Fn(&str) -> bool) -> Vec<OpCase> {
    let mut v = Vec::new();
    for ty in GgmlType::ALL {
        let bs = ty.block_size();
        // (k, n): odd, tiny-model and SmolLM2 shapes; k must be a whole number of blocks.
        let shapes: Vec<(usize, usize)> = [(7usize, 5usize), (13, 11), (32, 7), (64, 13), (256, 512), (512, 256), (576, 192), (576, 1536), (1536, 576)]
            .into_iter()
            .filter(|(k, _)| k % bs == 0)
            .collect();
        for (k, n) in shapes {
            // A variant's seed, so its weights, do not depend on m: each is drawn and encoded
            // once, with the generator's state after it (where x is drawn from).
            let mut weights: [Option<(SplitMix64, Vec<u8>)>; 4] = Default::default();
            for (m, variant) in [1usize, 3, 8].into_iter().flat_map(|m| (0..4u64).map(move |v| (m, v))) {
                let seed = seed_of(base, (k * 31 + n) as u64 * 8 + variant);
                let view_id = (m == 3 && variant == 1).then(|| format!("matmul(w={},k={k},n={n},m={m},view=row_stride_{},seed={seed})", ty.name(), k + 32));
                let id = format!("matmul(w={},k={k},n={n},m={m},seed={seed})", ty.name());
                let (keep_view, keep_plain) = (view_id.as_deref().is_some_and(keep), keep(&id));
                if !keep_view && !keep_plain {
                    continue;
                }
                let (after_w, bytes) = weights[variant as usize].get_or_insert_with(|| {
                    let mut r = SplitMix64(seed ^ ty.id() as u64);
                    let w = normals(&mut r, n * k, 1.0 / (k as f64).sqrt());
                    (r, encode(ty, &w).expect("whole blocks"))
                });
                let x = activations(&mut after_w.clone(), m, k);
                let bytes = bytes.clone();
                // One variant per shape takes x as a non-contiguous view: rows `k + 32` apart, the
                // gap filled with NaN, so a kernel that ignores the stride poisons its result.
                if let Some(view_id) = view_id.filter(|_| keep_view) {
                    let stride = k + 32;
                    let mut xv = vec![f32::NAN; m * stride];
                    for row in 0..m {
                        xv[row * stride..row * stride + k].copy_from_slice(&x[row * k..(row + 1) * k]);
                    }
                    v.push(case(
                        Op::Matmul,
                        view_id,
                        seed,
                        vec![("x", t(&[m, stride], xv)), ("w", Input::Quant { ty, rows: n, cols: k, bytes: bytes.clone() })],
                        &[("x_cols", k as f64)],
                    ));
                }
                if keep_plain {
                    v.push(case(Op::Matmul, id, seed, vec![("x", t(&[m, k], x)), ("w", Input::Quant { ty, rows: n, cols: k, bytes })], &[]));
                }
            }
        }
    }
    v
}

/// The logical `[rows, cols]` of a 2-D input that may be a row-strided view (param `x_cols`
/// smaller than the stored row length): returns (rows, cols, row stride).
pub fn view_dims(c: &OpCase, t: &Tensor) -> (usize, usize, usize) {
    let stride = t.shape[1];
    let cols = c.params.get("x_cols").map_or(stride, |v| *v as usize);
    (t.shape[0], cols, stride)
}

fn matmul_ref(c: &OpCase) -> Result<Vec<Output>> {
    let x = c.f32("x")?;
    let w = c.mat("w")?;
    let (m, k, stride) = view_dims(c, x);
    // The oracle reads the view by copying its rows: plain, and obviously right.
    let dense: Vec<f32> = (0..m).flat_map(|r| x.data[r * stride..r * stride + k].iter().copied()).collect();
    Ok(vec![out(&[m, w.rows], ops::matmul(&dense, m, &w)?)])
}

fn binary_cases(op: Op, base: u64) -> Vec<OpCase> {
    let mut v = Vec::new();
    for n in WIDTHS {
        for seed in (0..N_SEEDS).map(|i| seed_of(base, i)) {
            let mut r = SplitMix64(seed ^ (n as u64) << 8);
            let rows = 3;
            let a = activations(&mut r, rows, n);
            let b = if op == Op::AddBias { normals(&mut r, n, 0.5) } else { activations(&mut r, rows, n) };
            let bshape = if op == Op::AddBias { vec![n] } else { vec![rows, n] };
            v.push(case(op, format!("{op}(dtype=f32,shape=[{rows},{n}],seed={seed})"), seed, vec![("a", t(&[rows, n], a)), ("b", t(&bshape, b))], &[]));
        }
    }
    v
}

fn add_ref(c: &OpCase) -> Result<Vec<Output>> {
    let a = c.f32("a")?;
    Ok(vec![out(&a.shape, ops::add(&a.data, &c.f32("b")?.data)?)])
}

fn add_bias_ref(c: &OpCase) -> Result<Vec<Output>> {
    let a = c.f32("a")?;
    let mut y = a.data.clone();
    ops::add_bias(&mut y, &c.f32("b")?.data)?;
    Ok(vec![out(&a.shape, y)])
}

/// The RoPE configuration a `rope` case describes. Scaling codes in case params: 0 none,
/// 1 linear x4, 2 YaRN x4 over a 128-position original context, 3 Llama 3.1's per-pair
/// frequency factors (x8, low/high frequency factors 1 and 4, a 64-position original context, so
/// the cases' pairs fall in all three bands), 4 Phi-3's LongRoPE (per-pair factors rising from 1
/// to 3.5, cos and sin scaled by 1.19). Devices and the suite read a case's configuration
/// through this one function.
pub fn rope_spec_of(c: &OpCase) -> Result<RopeSpec> {
    let (theta, n_rot) = (c.p("theta")?, c.pu("n_rot")?);
    let (scaling, freq_factors) = match c.pu("scaling")? {
        0 => (RopeScaling::None, None),
        1 => (RopeScaling::Linear { factor: 4.0 }, None),
        2 => (RopeScaling::Yarn { factor: 4.0, original_context: 128, beta_fast: 32.0, beta_slow: 1.0, ext_factor: 1.0, attn_factor: 1.0, truncate: true }, None),
        3 => (RopeScaling::None, Some(crate::spec::llama3_freq_factors(theta, n_rot, 8.0, 1.0, 4.0, 64))),
        _ => (RopeScaling::LongRope { attn_factor: LONGROPE_CASE_ATTN_FACTOR, original_context: 4096, context: 4096 }, Some((0..n_rot / 2).map(|i| (1.0 + 2.5 * i as f64 / (n_rot / 2) as f64) as f32).collect())),
    };
    Ok(RopeSpec { style: if c.pu("neox")? == 1 { RopeStyle::Neox } else { RopeStyle::Normal }, theta, n_rot, scaling, freq_factors, longrope_factors: None })
}

/// The cos/sin scale of the LongRoPE rope cases (Phi-3-mini-128k's: sqrt(1 + ln 32 / ln 4096)).
pub const LONGROPE_CASE_ATTN_FACTOR: f64 = 1.190_238_071_423_808_3;

fn rope_cases(base: u64) -> Vec<OpCase> {
    let mut v = Vec::new();
    for (n_head, hd, n_rot) in [(1usize, 8usize, 8usize), (3, 64, 64), (9, 64, 64), (2, 64, 32)] {
        for neox in [0, 1] {
            for scaling in [0, 1, 2, 3, 4] {
                for (theta, variant) in [10_000.0, 1_000_000.0].into_iter().flat_map(|t| (0..3u64).map(move |v| (t, v))) {
                    let seed = seed_of(base, (n_head * 1000 + hd + neox * 7 + scaling) as u64 * 4 + variant);
                    let mut r = SplitMix64(seed);
                    let positions = [0usize, 1, 7, 300, 4095];
                    let x = activations(&mut r, positions.len(), n_head * hd);
                    let style = if neox == 1 { "neox" } else { "normal" };
                    let sc = ["none", "linear", "yarn", "llama3", "longrope"][scaling];
                    v.push(case(
                        Op::Rope,
                        format!("rope(style={style},scaling={sc},theta={theta:e},heads={n_head},head_dim={hd},n_rot={n_rot},seed={seed})"),
                        seed,
                        vec![("x", t(&[positions.len(), n_head * hd], x)), ("pos", Input::Ids(positions.iter().map(|&p| p as u32).collect()))],
                        &[("neox", neox as f64), ("scaling", scaling as f64), ("theta", theta), ("n_rot", n_rot as f64), ("n_head", n_head as f64), ("head_dim", hd as f64)],
                    ));
                }
            }
        }
    }
    v
}

fn rope_ref(c: &OpCase) -> Result<Vec<Output>> {
    let x = c.f32("x")?;
    let pos: Vec<usize> = c.ids("pos")?.iter().map(|&p| p as usize).collect();
    let mut y = x.data.clone();
    ops::rope(&mut y, &pos, c.pu("n_head")?, c.pu("head_dim")?, &rope_spec_of(c)?)?;
    Ok(vec![out(&x.shape, y)])
}

fn qk_norm_cases(base: u64) -> Vec<OpCase> {
    let mut v = Vec::new();
    for (n_head, hd) in [(1usize, 8usize), (4, 64), (16, 128)] {
        for seed in (0..N_SEEDS).map(|i| seed_of(base, i)) {
            let mut r = SplitMix64(seed ^ 0x9E ^ (n_head * hd) as u64);
            let x = activations(&mut r, 3, n_head * hd);
            let w: Vec<f32> = (0..hd).map(|_| (1.0 + 0.2 * r.next_normal()) as f32).collect();
            v.push(case(
                Op::QkNorm,
                format!("qk_norm(dtype=f32,tokens=3,heads={n_head},head_dim={hd},eps=1e-6,seed={seed})"),
                seed,
                vec![("x", t(&[3, n_head * hd], x)), ("weight", t(&[hd], w))],
                &[("eps", 1e-6), ("head_dim", hd as f64)],
            ));
        }
    }
    v
}

fn qk_norm_ref(c: &OpCase) -> Result<Vec<Output>> {
    let x = c.f32("x")?;
    Ok(vec![out(&x.shape, ops::rms_norm(&x.data, c.pu("head_dim")?, Some(&c.f32("weight")?.data), c.p("eps")?)?)])
}

fn attention_cases(base: u64) -> Vec<OpCase> {
    // (n_head, n_kv, head_dim, cache length, queries, window): MHA, GQA (SmolLM2 9/3), MQA, window.
    let shapes = [(4usize, 4usize, 8usize, 5usize, 1usize, 0usize), (9, 3, 64, 37, 1, 0), (9, 3, 64, 11, 11, 0), (4, 1, 64, 13, 4, 0), (4, 2, 64, 40, 3, 8), (2, 2, 7, 7, 7, 0), (8, 8, 32, 17, 2, 0), (6, 2, 128, 9, 9, 4)];
    attention_variant_cases(Op::Attention, base, &shapes)
}

/// The shapes of the sink and soft-cap variants: MHA, GQA over a prompt, GQA with a window
/// (GPT-OSS alternates windowed and full layers), a few queries over a longer cache.
const ATTENTION_VARIANT_SHAPES: [(usize, usize, usize, usize, usize, usize); 4] = [(4, 4, 8, 5, 1, 0), (9, 3, 64, 11, 11, 0), (4, 2, 64, 40, 3, 8), (8, 8, 32, 17, 2, 0)];

/// Soft-caps of the `attention_softcap` cases: small against the scores (the queries are scaled
/// up) so that a share of them bends or saturates, where a missing cap is plain to see.
const ATTENTION_SOFTCAPS: [f64; 2] = [2.0, 8.0];

/// Cases of `op` (attention or one of its variants) over `shapes`. Sinks: a normal logit per
/// head, head 0's raised to take most of the weight and head 1's lowered to take almost none.
fn attention_variant_cases(op: Op, base: u64, shapes: &[(usize, usize, usize, usize, usize, usize)]) -> Vec<OpCase> {
    let caps: &[f64] = if op == Op::AttentionSoftcap { &ATTENTION_SOFTCAPS } else { &[0.0] };
    let mut v = Vec::new();
    for &(nh, nkv, hd, kv_len, m, window) in shapes {
        for &cap in caps {
            for seed in (0..N_SEEDS).map(|i| seed_of(base, i)) {
                // Plain attention keeps its streams; a variant's differ from them.
                let salt = if op == Op::Attention { 0 } else { (op as u64) << 40 ^ (cap as u64) << 48 };
                let mut r = SplitMix64(seed ^ (nh * 100 + kv_len) as u64 ^ salt);
                let mut q = activations(&mut r, m, nh * hd);
                if op == Op::AttentionSoftcap {
                    q.iter_mut().for_each(|x| *x *= 4.0);
                }
                let k = normals(&mut r, kv_len * nkv * hd, 1.0);
                let vv = normals(&mut r, kv_len * nkv * hd, 1.0);
                let pos: Vec<u32> = (kv_len - m..kv_len).map(|p| p as u32).collect();
                let mut inputs = vec![("q", t(&[m, nh * hd], q)), ("k", t(&[kv_len, nkv * hd], k)), ("v", t(&[kv_len, nkv * hd], vv)), ("pos", Input::Ids(pos))];
                let mut params = vec![("n_head", nh as f64), ("n_head_kv", nkv as f64), ("head_dim", hd as f64), ("window", window as f64)];
                let mut extra = String::new();
                match op {
                    Op::AttentionSinks => {
                        let mut sinks = normals(&mut r, nh, 2.0);
                        sinks[0] += 6.0;
                        if nh > 1 {
                            sinks[1] -= 30.0;
                        }
                        inputs.push(("sinks", t(&[nh], sinks)));
                    }
                    Op::AttentionSoftcap => {
                        params.push(("cap", cap));
                        extra = format!(",cap={cap}");
                    }
                    _ => {}
                }
                v.push(case(op, format!("{op}(heads={nh},kv_heads={nkv},head_dim={hd},kv_len={kv_len},m={m},window={window}{extra},seed={seed})"), seed, inputs, &params));
            }
        }
    }
    v
}

/// Attention and its variants: the sinks come from the `sinks` input and the soft-cap from the
/// `cap` parameter where the case has them.
fn attention_ref(c: &OpCase) -> Result<Vec<Output>> {
    let q = c.f32("q")?;
    let k = c.f32("k")?;
    let hd = c.pu("head_dim")?;
    let sinks: Option<Vec<f64>> = match c.op {
        Op::AttentionSinks => Some(c.f32("sinks")?.data.iter().map(|v| *v as f64).collect()),
        _ => None,
    };
    let p = AttentionParams {
        n_head: c.pu("n_head")?,
        n_head_kv: c.pu("n_head_kv")?,
        head_dim: hd,
        scale: 1.0 / (hd as f64).sqrt(),
        window: Some(c.pu("window")?).filter(|w| *w > 0),
        sinks: sinks.as_deref(),
        softcap: if c.op == Op::AttentionSoftcap { Some(c.p("cap")?) } else { None },
    };
    let pos: Vec<usize> = c.ids("pos")?.iter().map(|&x| x as usize).collect();
    Ok(vec![out(&q.shape, ops::attention(&q.data, &pos, &k.data, &c.f32("v")?.data, k.shape[0], &p)?)])
}

/// Soft-cap cases: values spread to twice the cap (a share saturates), and each row's first
/// eight on the edges: zero, the cap itself, far past it, and tiny values.
fn softcap_cases(base: u64) -> Vec<OpCase> {
    let mut v = Vec::new();
    for cap in [30.0f64, 5.0] {
        for n in [8usize, 64, 1536] {
            for seed in (0..N_SEEDS).map(|i| seed_of(base, i)) {
                let mut r = SplitMix64(seed ^ 0x5C4 ^ n as u64 ^ (cap as u64) << 32);
                let mut x = normals(&mut r, 2 * n, 2.0 * cap);
                let edges = [0.0f32, cap as f32, -(cap as f32), 1000.0, -1000.0, 1e-6, -3e-4, 0.5];
                for row in 0..2 {
                    x[row * n..row * n + 8].copy_from_slice(&edges);
                }
                v.push(case(Op::Softcap, format!("softcap(dtype=f32,shape=[2,{n}],cap={cap},seed={seed})"), seed, vec![("x", t(&[2, n], x))], &[("cap", cap)]));
            }
        }
    }
    v
}

fn softcap_ref(c: &OpCase) -> Result<Vec<Output>> {
    let x = c.f32("x")?;
    let cap = c.p("cap")?;
    Ok(vec![out(&x.shape, x.data.iter().map(|v| (cap * (*v as f64 / cap).tanh()) as f32).collect())])
}

fn softmax_cases(base: u64) -> Vec<OpCase> {
    let mut v = Vec::new();
    for n in WIDTHS {
        for seed in (0..N_SEEDS).map(|i| seed_of(base, i)) {
            let mut r = SplitMix64(seed ^ 0x50F ^ n as u64);
            let mut x = normals(&mut r, 4 * n, 3.0);
            // Row 1 has large logits (overflows exp without max subtraction); row 2 is half masked.
            x[n..2 * n].iter_mut().for_each(|v| *v += 1000.0);
            x[2 * n + n / 2 + 1..3 * n].iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
            v.push(case(Op::Softmax, format!("softmax(dtype=f32,shape=[4,{n}],seed={seed})"), seed, vec![("x", t(&[4, n], x))], &[]));
        }
    }
    v
}

fn softmax_ref(c: &OpCase) -> Result<Vec<Output>> {
    let x = c.f32("x")?;
    Ok(vec![out(&x.shape, ops::softmax_rows(&x.data, x.shape[1])?)])
}

fn unary_cases(op: Op, base: u64) -> Vec<OpCase> {
    let mut v = Vec::new();
    for n in [7usize, 64, 1536] {
        for seed in (0..N_SEEDS).map(|i| seed_of(base, i)) {
            let mut r = SplitMix64(seed ^ 0xAC7 ^ n as u64);
            let gate = activations(&mut r, 2, n);
            let up = activations(&mut r, 2, n);
            v.push(case(op, format!("{op}(dtype=f32,shape=[2,{n}],seed={seed})"), seed, vec![("gate", t(&[2, n], gate)), ("up", t(&[2, n], up))], &[]));
        }
    }
    v
}

fn silu_ref(c: &OpCase) -> Result<Vec<Output>> {
    let g = c.f32("gate")?;
    Ok(vec![out(&g.shape, g.data.iter().map(|x| ops::silu(*x as f64) as f32).collect())])
}
fn gelu_ref(c: &OpCase) -> Result<Vec<Output>> {
    let g = c.f32("gate")?;
    Ok(vec![out(&g.shape, g.data.iter().map(|x| ops::gelu_tanh(*x as f64) as f32).collect())])
}
fn swiglu_ref(c: &OpCase) -> Result<Vec<Output>> {
    let g = c.f32("gate")?;
    Ok(vec![out(&g.shape, ops::swiglu(&g.data, &c.f32("up")?.data)?)])
}
fn swiglu_oai_ref(c: &OpCase) -> Result<Vec<Output>> {
    let g = c.f32("gate")?;
    Ok(vec![out(&g.shape, ops::swiglu_oai(&g.data, &c.f32("up")?.data)?)])
}

/// Gate and up values four times the activations' spread, so that a share of both lies past
/// the clamp (|x| > 7), and every row's first eight pairs on and around its edges.
fn swiglu_oai_cases(base: u64) -> Vec<OpCase> {
    let edges = [7.0f32, -7.0, 7.0001, -7.0001, 6.9999, 50.0, -50.0, 0.0];
    let mut v = Vec::new();
    for n in [8usize, 64, 1536] {
        for seed in (0..N_SEEDS).map(|i| seed_of(base, i)) {
            let mut r = SplitMix64(seed ^ 0x0A1 ^ n as u64);
            let mut gate: Vec<f32> = activations(&mut r, 2, n).iter().map(|x| 4.0 * x).collect();
            let mut up: Vec<f32> = activations(&mut r, 2, n).iter().map(|x| 4.0 * x).collect();
            for row in 0..2 {
                for (i, e) in edges.iter().enumerate() {
                    gate[row * n + i] = *e;
                    up[row * n + (i + 3 + row) % 8] = *e;
                }
            }
            v.push(case(Op::SwigluOai, format!("swiglu_oai(dtype=f32,shape=[2,{n}],seed={seed})"), seed, vec![("gate", t(&[2, n], gate)), ("up", t(&[2, n], up))], &[]));
        }
    }
    v
}

fn geglu_ref(c: &OpCase) -> Result<Vec<Output>> {
    let g = c.f32("gate")?;
    Ok(vec![out(&g.shape, ops::geglu(&g.data, &c.f32("up")?.data)?)])
}

fn moe_cases(base: u64) -> Vec<OpCase> {
    let mut v = Vec::new();
    for (n_expert, k) in [(4usize, 2usize), (8, 2), (60, 4), (128, 8)] {
        for gating in [0, 1] {
            for (norm, variant) in [0, 1].into_iter().flat_map(|n| (0..8u64).map(move |v| (n, v))) {
                let seed = seed_of(base, (n_expert * 10 + k + gating * 3 + norm) as u64 * 8 + variant);
                let mut r = SplitMix64(seed);
                let logits = normals(&mut r, 5 * n_expert, 2.0);
                let g = if gating == 0 { "softmax" } else { "sigmoid" };
                v.push(case(
                    Op::MoeRoute,
                    format!("moe_route(experts={n_expert},k={k},gating={g},normalize={norm},seed={seed})"),
                    seed,
                    vec![("logits", t(&[5, n_expert], logits))],
                    &[("k", k as f64), ("sigmoid", gating as f64), ("normalize", norm as f64)],
                ));
            }
        }
    }
    v
}

fn moe_ref(c: &OpCase) -> Result<Vec<Output>> {
    let l = c.f32("logits")?;
    let (rows, n) = (l.shape[0], l.shape[1]);
    let gating = if c.pu("sigmoid")? == 1 { Gating::Sigmoid } else { Gating::Softmax };
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    for row in l.data.chunks(n) {
        let logits: Vec<f64> = row.iter().map(|v| *v as f64).collect();
        let r = ops::moe_route(&logits, c.pu("k")?, gating, c.pu("normalize")? == 1);
        ids.extend(r.experts.iter().map(|e| *e as u32));
        weights.extend(r.weights.iter().map(|w| *w as f32));
    }
    let k = c.pu("k")?;
    Ok(vec![Output::Ids(ids), out(&[rows, k], weights)])
}

fn select_cases(op: Op, base: u64) -> Vec<OpCase> {
    let mut v = Vec::new();
    for n in [5usize, 272, 1000, 49152] {
        for seed in (0..N_SEEDS).map(|i| seed_of(base, i)) {
            let mut r = SplitMix64(seed ^ 0x5E1 ^ n as u64);
            let mut x = normals(&mut r, 3 * n, 4.0);
            // Row 2 has an exact tie for the maximum: the lower index must win.
            let m = x[2 * n..].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            x[2 * n + n / 3] = m + 1.0;
            x[2 * n + n / 2] = m + 1.0;
            v.push(case(op, format!("{op}(dtype=f32,shape=[3,{n}],seed={seed})"), seed, vec![("x", t(&[3, n], x))], &[("k", 5.0), ("temperature", 0.8), ("top_p", 0.9)]));
        }
    }
    v
}

fn argmax_ref(c: &OpCase) -> Result<Vec<Output>> {
    let x = c.f32("x")?;
    Ok(vec![Output::Ids(x.data.chunks(x.shape[1]).map(|r| ops::argmax(r) as u32).collect())])
}

fn top_k_ref(c: &OpCase) -> Result<Vec<Output>> {
    let x = c.f32("x")?;
    let k = c.pu("k")?;
    Ok(vec![Output::Ids(x.data.chunks(x.shape[1]).flat_map(|r| ops::top_k(r, k).into_iter().map(|i| i as u32)).collect())])
}

fn sample_ref(c: &OpCase) -> Result<Vec<Output>> {
    let x = c.f32("x")?;
    let cfg = SamplerConfig { temperature: c.p("temperature")?, top_k: c.pu("k")?, top_p: c.p("top_p")? };
    let mut rng = SplitMix64(c.seed);
    Ok(vec![Output::Ids(x.data.chunks(x.shape[1]).map(|r| ops::sample(r, &cfg, &mut rng) as u32).collect())])
}

// Flops and bytes (f32 activations; weights at their encoded size).
fn n_f32(c: &OpCase) -> u64 {
    c.inputs
        .iter()
        .map(|(_, i)| match i {
            Input::F32(t) => t.data.len() as u64 * 4,
            Input::Quant { bytes, .. } => bytes.len() as u64,
            Input::Ids(v) => v.len() as u64 * 4,
        })
        .sum()
}
fn elems(c: &OpCase) -> u64 {
    c.inputs.iter().map(|(_, i)| if let Input::F32(t) = i { t.data.len() as u64 } else { 0 }).max().unwrap_or(0)
}
fn matmul_flops(c: &OpCase) -> u64 {
    match (c.f32("x"), c.inputs.iter().find(|(n, _)| *n == "w")) {
        (Ok(x), Some((_, Input::Quant { rows, cols, .. }))) => 2 * (x.shape[0] * rows * cols) as u64,
        _ => 0,
    }
}
fn attention_flops(c: &OpCase) -> u64 {
    let g = |n: &str| c.pu(n).unwrap_or(0) as u64;
    let m = c.f32("q").map(|q| q.shape[0] as u64).unwrap_or(0);
    let kv = c.f32("k").map(|k| k.shape[0] as u64).unwrap_or(0);
    4 * m * g("n_head") * kv * g("head_dim")
}
fn per_elem_flops(c: &OpCase) -> u64 {
    4 * elems(c)
}

/// The registry: every op the oracle defines.
pub fn registry() -> Vec<OpEntry> {
    vec![
        OpEntry { op: Op::Embed, summary: "token embedding lookup", rule: ToleranceRule::Exact, cases: embed_cases, reference: embed_ref, flops: |_| 0, bytes: n_f32 },
        OpEntry { op: Op::RmsNorm, summary: "x / sqrt(mean(x^2) + eps) * w", rule: ToleranceRule::RowReduction, cases: |b| norm_cases(Op::RmsNorm, b), reference: rms_norm_ref, flops: per_elem_flops, bytes: n_f32 },
        OpEntry { op: Op::LayerNorm, summary: "(x - mean) / sqrt(var + eps) * w + b", rule: ToleranceRule::RowReduction, cases: |b| norm_cases(Op::LayerNorm, b), reference: layer_norm_ref, flops: per_elem_flops, bytes: n_f32 },
        OpEntry { op: Op::Matmul, summary: "y = x W^T, W in any GGUF type", rule: ToleranceRule::Dot, cases: matmul_cases, reference: matmul_ref, flops: matmul_flops, bytes: n_f32 },
        OpEntry { op: Op::AddBias, summary: "x + b per row", rule: ToleranceRule::Elementwise, cases: |b| binary_cases(Op::AddBias, b), reference: add_bias_ref, flops: elems, bytes: n_f32 },
        OpEntry { op: Op::Add, summary: "residual add", rule: ToleranceRule::Elementwise, cases: |b| binary_cases(Op::Add, b), reference: add_ref, flops: elems, bytes: n_f32 },
        OpEntry { op: Op::Rope, summary: "rotary embedding, normal/neox, none/linear/yarn/llama3 factors/longrope", rule: ToleranceRule::Transcendental, cases: rope_cases, reference: rope_ref, flops: per_elem_flops, bytes: n_f32 },
        OpEntry { op: Op::QkNorm, summary: "per-head RMSNorm over head_dim (Qwen3)", rule: ToleranceRule::RowReduction, cases: qk_norm_cases, reference: qk_norm_ref, flops: per_elem_flops, bytes: n_f32 },
        OpEntry { op: Op::Attention, summary: "causal GQA attention over a KV cache, optional window", rule: ToleranceRule::Dot, cases: attention_cases, reference: attention_ref, flops: attention_flops, bytes: n_f32 },
        OpEntry { op: Op::AttentionSinks, summary: "attention with a sink logit per head joining the softmax (GPT-OSS)", rule: ToleranceRule::Dot, cases: |b| attention_variant_cases(Op::AttentionSinks, b, &ATTENTION_VARIANT_SHAPES), reference: attention_ref, flops: attention_flops, bytes: n_f32 },
        OpEntry { op: Op::AttentionSoftcap, summary: "attention with scores soft-capped, cap * tanh(s / cap) (Gemma 2)", rule: ToleranceRule::Dot, cases: |b| attention_variant_cases(Op::AttentionSoftcap, b, &ATTENTION_VARIANT_SHAPES), reference: attention_ref, flops: attention_flops, bytes: n_f32 },
        OpEntry { op: Op::Softmax, summary: "row softmax, max-subtracted", rule: ToleranceRule::RowReduction, cases: softmax_cases, reference: softmax_ref, flops: per_elem_flops, bytes: n_f32 },
        OpEntry { op: Op::Softcap, summary: "cap * tanh(x / cap) (Gemma 2's final logits)", rule: ToleranceRule::Transcendental, cases: softcap_cases, reference: softcap_ref, flops: per_elem_flops, bytes: n_f32 },
        OpEntry { op: Op::Silu, summary: "x * sigmoid(x)", rule: ToleranceRule::Transcendental, cases: |b| unary_cases(Op::Silu, b), reference: silu_ref, flops: per_elem_flops, bytes: n_f32 },
        OpEntry { op: Op::GeluTanh, summary: "GELU, tanh approximation", rule: ToleranceRule::Transcendental, cases: |b| unary_cases(Op::GeluTanh, b), reference: gelu_ref, flops: per_elem_flops, bytes: n_f32 },
        OpEntry { op: Op::Swiglu, summary: "silu(gate) * up", rule: ToleranceRule::Transcendental, cases: |b| unary_cases(Op::Swiglu, b), reference: swiglu_ref, flops: per_elem_flops, bytes: n_f32 },
        OpEntry { op: Op::Geglu, summary: "gelu_tanh(gate) * up", rule: ToleranceRule::Transcendental, cases: |b| unary_cases(Op::Geglu, b), reference: geglu_ref, flops: per_elem_flops, bytes: n_f32 },
        OpEntry { op: Op::SwigluOai, summary: "GPT-OSS: min(g,7) * sigmoid(1.702 min(g,7)) * (clamp(up,-7,7) + 1)", rule: ToleranceRule::Transcendental, cases: swiglu_oai_cases, reference: swiglu_oai_ref, flops: per_elem_flops, bytes: n_f32 },
        OpEntry { op: Op::MoeRoute, summary: "softmax/sigmoid scores, top-k experts (ids exact), optional renorm", rule: ToleranceRule::RowReduction, cases: moe_cases, reference: moe_ref, flops: per_elem_flops, bytes: n_f32 },
        OpEntry { op: Op::Argmax, summary: "index of the largest logit, lowest on ties", rule: ToleranceRule::Exact, cases: |b| select_cases(Op::Argmax, b), reference: argmax_ref, flops: elems, bytes: n_f32 },
        OpEntry { op: Op::TopK, summary: "k largest indices, best first", rule: ToleranceRule::Exact, cases: |b| select_cases(Op::TopK, b), reference: top_k_ref, flops: elems, bytes: n_f32 },
        OpEntry { op: Op::Sample, summary: "temperature/top-k/top-p sampling, seeded", rule: ToleranceRule::Exact, cases: |b| select_cases(Op::Sample, b), reference: sample_ref, flops: per_elem_flops, bytes: n_f32 },
        OpEntry { op: Op::DeltaRule, summary: "gated DeltaNet: L2-normed q/k, decay exp(A softplus(a + dt_bias)), state += k (v - S k) sigmoid(b), y = S q / sqrt(d_k)", rule: ToleranceRule::Recurrence, cases: recurrent::delta_rule_cases, reference: recurrent::delta_rule_ref, flops: recurrent::recurrence_flops, bytes: n_f32 },
        OpEntry { op: Op::SsmScan, summary: "Mamba-2: dt = softplus(dt + dt_bias), state = exp(dt A) state + dt x B, y = state C + D x", rule: ToleranceRule::Recurrence, cases: recurrent::ssm_scan_cases, reference: recurrent::ssm_scan_ref, flops: recurrent::recurrence_flops, bytes: n_f32 },
        OpEntry { op: Op::MlaAttention, summary: "DeepSeek MLA: softmax(scale (q_nope (W_k latent) + q_rope k_pe)) (W_v latent), absorbed or materialized", rule: ToleranceRule::Dot, cases: latent::mla_attention_cases, reference: latent::mla_attention_ref, flops: latent::mla_attention_flops, bytes: n_f32 },
    ]
}
