//! The declared arithmetic of a device, emulated on the oracle: what an honest engine of that
//! arithmetic computes, as the reference the fixed-token gate (`kld_vs_emulation`) and layer-diff
//! (each tap's `emulated` error) hold a device to.

use oracle::loader::{LoadedTensor, RawTensor, TensorSource};
use oracle::Tap;

/// How many times the emulated arithmetic's error a device may reach by default: its mean KLD
/// (fixed-token's `kld_vs_emulation`) and its propagated error at each tap (layer-diff's
/// `emulated_departure`). Honest engines (llama.cpp among them) measure up to 1.28x (KLD) and
/// 1.23x (a tap) on the fixtures and SmolLM2 (docs/ACCURACY.md); `--emulation-factor` sets it
/// per run.
pub const EMULATION_FACTOR: f64 = 4.0;

/// The emulated arithmetic's relative propagated error from which layer-diff holds a tap to it
/// (`emulated_departure`): under it the emulated roundings have barely reached the tap, and
/// the f32 noise of the device's own order of sums (1e-6 and less) would weigh in the ratio.
pub const EMULATED_FLOOR: f64 = 1e-4;

/// Over how many elements the device's and the emulation's errors over a tap's bulk (its
/// massive values left out, `layerdiff::bulk_errors`) must be spread (`layerdiff::BulkErrors::spread`) for
/// layer-diff to hold the one to the other there: the ratio of two errors that each sit in k
/// elements scatters as sqrt(F(k, k)) does — past 4x with probability 0.16 for k = 1, 6e-7 for
/// k = 16. SmolLM2's massive activation (22,500 at position 0, dimension 507, in every residual
/// from layer 11 on) holds a whole tap's errors in 1-2 elements: there llama.cpp with an f32
/// cache, an honest engine, measured 4.09x over the whole tap, with an f16 cache 0.24x
/// (docs/ACCURACY.md); over the bulk the errors sit in hundreds of elements.
pub const EMULATED_MIN_SPREAD: f64 = 16.0;

/// The oracle re-run with a declared arithmetic's roundings where it declares them, so its logits
/// are what an honest engine of that arithmetic computes (up to the order of its sums): a tap
/// that substitutes, after each op, the value rounded as the engine would hold it —
/// activations entering a product with a quantized matrix rounded to symmetric 8-bit blocks
/// (llama.cpp's Q8_0: scale max|x|/127 stored as f16) when `activation_q8_block` says so (the
/// block of a K-quant matrix's products `activation_q8_block_kquant`'s where declared), at
/// [`oracle::Tap::product_input`] (inside MoE experts too; inputs of f32/f16/bf16 matrices, such
/// as a MoE router's, unrounded, as declared — or, under `activation_half_rounding`, those of
/// f16/bf16 matrices in that format, and with a rounding cache the query and the attention
/// weights in the cache's), cached keys and values
/// rounded to the cache's format, and every value to a 16-bit storage format. For fixed-point
/// arithmetic every tap's value lands on the activation grid (Q16), and the weights are those the
/// engine holds ([`EmulatedArithmetic::load_model`]).
#[derive(Debug)]
pub struct EmulatedArithmetic {
    /// Fixed-point formats: every tap on the activation grid, weights rounded at load.
    fixed: Option<devices::FixedPoint>,
    /// The model's file (fixed point loads its weights anew from it).
    path: std::path::PathBuf,
    /// The matrices whose products take rounded inputs (GGUF names), each with its rounding
    /// (by its stored type: `devices::Arithmetic::input_rounding`).
    inputs: std::collections::BTreeMap<String, devices::InputRounding>,
    /// The cache's formats for keys and values, each None where it holds them as computed.
    kv: devices::KvTypes,
    storage: Option<devices::NumFormat>,
    pending: Option<Vec<f32>>,
    /// The attention weights as the engine computes them where it rounds them: on a fixed-point
    /// grid, or in the format of an F16/BF16 cache it multiplies in that type.
    weights: Option<SoftmaxRule>,
    /// The attention's query rounded so before its product with the cached keys: to the format
    /// of an F16/BF16 cache multiplied in its own type (`activation_half_rounding`), to Q8_0
    /// blocks before a block-quantized cache's keys.
    query: Option<devices::InputRounding>,
    /// The Walsh-Hadamard widths (keys and query, values) of a rotating block-quantized cache
    /// (`kv_cache_rotation`): each value rounded in the rotated basis and rotated back.
    rotation: Option<(usize, usize)>,
    /// Each tap's value as the engine shows it (on its grid or in its storage format; before a
    /// cache's rounding), when [`EmulatedArithmetic::recording`] asked for it.
    pub recorded: Option<oracle::RecordingTap>,
    /// GELU from an f16 table (`gelu_half_table`, on a GELU model): the last `ffn_gate` and
    /// `ffn_up` values recorded, from which the `ffn_act` tap is recomputed as the table gives it.
    gelu_table: Option<(Vec<f32>, Vec<f32>)>,
}

/// GELU (tanh form) as an f16 table gives it: the input rounded to f16, GELU of that rounded to
/// f16; at or past 10 in magnitude the identity or zero, as ggml's CPU backend does.
pub fn gelu_f16_table(x: f32) -> f32 {
    if x <= -10.0 {
        return 0.0;
    }
    if x >= 10.0 {
        return x;
    }
    let g = oracle::ops::gelu_tanh(round_to(devices::NumFormat::F16, x) as f64);
    round_to(devices::NumFormat::F16, g as f32)
}

/// `x` on the grid of `frac` fractional bits, rounded to nearest with ties away from zero (as a
/// fixed-point engine converts a value to its integer); not-a-number and infinities unchanged.
pub fn on_grid(x: f64, frac: u32) -> f64 {
    let s = (1u64 << frac) as f64;
    if x.is_finite() {
        (x * s).round() / s
    } else {
        x
    }
}

/// A fixed-point engine's matrix `w` (rows of `cols` values) as it holds it: every value on the
/// weight grid, or, with INT4 groups (and `cols` a multiple of the group), each group of a row as
/// q * s with s = amax/7 on the weight grid and q = round(w/s) in -7..=7 (the `fixed-int4`
/// device's conversion; a row length that is not a multiple stays on the grid, as there).
pub fn fixed_point_matrix(w: &[f32], cols: usize, fp: &devices::FixedPoint) -> Vec<f64> {
    match fp.int4_group.filter(|g| *g > 0 && cols.is_multiple_of(*g)) {
        None => w.iter().map(|v| on_grid(*v as f64, fp.weight_frac)).collect(),
        Some(g) => w
            .chunks(g)
            .flat_map(|grp| {
                let amax = grp.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
                let s = on_grid(amax / 7.0, fp.weight_frac);
                grp.iter().map(move |v| if s > 0.0 { (*v as f64 / s).round().clamp(-7.0, 7.0) * s } else { 0.0 })
            })
            .collect(),
    }
}

/// A model's tensors as a fixed-point engine holds them ([`fixed_point_matrix`] for matrices,
/// norm scales on the norm grid, biases and the embedding table on the activation grid), served
/// decoded (as F32 when asked for packed bytes). With `head_from_embd`, `output.weight` is the
/// embedding table rounded as a matrix: a tied model's engine holds the table twice, as
/// activations to look up and as weights to multiply.
struct FixedPointWeights {
    inner: Box<dyn TensorSource>,
    fp: devices::FixedPoint,
    head_from_embd: Option<u64>,
}

impl FixedPointWeights {
    fn rounded(&self, name: &str) -> oracle::Result<Option<LoadedTensor>> {
        let from = if name == "output.weight" && self.head_from_embd.is_some() { "token_embd.weight" } else { name };
        let Some(mut t) = self.inner.load(from)? else { return Ok(None) };
        let grid = |t: &mut LoadedTensor, frac| t.data.iter_mut().for_each(|v| *v = on_grid(*v as f64, frac) as f32);
        if name == "token_embd.weight" {
            grid(&mut t, self.fp.act_frac);
        } else if t.dims.len() >= 2 {
            t.data = fixed_point_matrix(&t.data, t.dims[0], &self.fp).into_iter().map(|v| v as f32).collect();
        } else if name.ends_with("_norm.weight") {
            grid(&mut t, self.fp.norm_frac);
        } else if name.ends_with(".bias") {
            grid(&mut t, self.fp.act_frac);
        }
        Ok(Some(t))
    }
}

impl TensorSource for FixedPointWeights {
    fn load(&self, name: &str) -> oracle::Result<Option<LoadedTensor>> {
        self.rounded(name)
    }
    fn label(&self) -> String {
        self.inner.label()
    }
    fn n_elements(&self) -> oracle::Result<u64> {
        Ok(self.inner.n_elements()?.saturating_add(self.head_from_embd.unwrap_or(0)))
    }
    fn n_bytes(&self) -> oracle::Result<u64> {
        Ok(self.n_elements()?.saturating_mul(4))
    }
    fn raw(&self, name: &str) -> oracle::Result<Option<RawTensor<'_>>> {
        Ok(self.rounded(name)?.map(|t| RawTensor { dims: t.dims, ty: oracle::quant::GgmlType::F32, bytes: t.data.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>().into() }))
    }
}

/// The matrices of the model at `path` (GGUF names; every product's weight) with the type each
/// is stored in: what decides how a declared arithmetic rounds each product's input.
pub fn matrix_types(path: &std::path::Path) -> oracle::Result<std::collections::BTreeMap<String, oracle::quant::GgmlType>> {
    let (src, spec) = oracle::loader::open_weights(path)?;
    let per_layer = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp"];
    let names = (0..spec.n_layer).flat_map(|l| per_layer.iter().map(move |t| format!("blk.{l}.{t}.weight"))).chain(["output.weight".to_string(), "token_embd.weight".to_string()]);
    let mut out = std::collections::BTreeMap::new();
    for n in names {
        if let Some(t) = src.raw(&n)? {
            out.insert(n, t.ty);
        }
    }
    Ok(out)
}

/// One value rounded to a 16-bit format (`F16`, `BF16`); others unchanged.
pub fn round_to(f: devices::NumFormat, x: f32) -> f32 {
    match f {
        devices::NumFormat::F16 => half::f16::from_f32(x).to_f32(),
        devices::NumFormat::BF16 => half::bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// `x` (rows of `width`) rounded to symmetric 8-bit blocks of `block` values along each row, as
/// llama.cpp's Q8_0 quantizes activations: d = max|x|/127, q = round(x/d), value q * f16(d).
pub fn round_q8_blocks(x: &mut [f32], width: usize, block: usize) {
    for row in x.chunks_mut(width.max(1)) {
        for b in row.chunks_mut(block.max(1)) {
            let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let d16 = half::f16::from_f32(d).to_f32();
            for v in b.iter_mut() {
                *v = (*v * id).round() * d16;
            }
        }
    }
}

/// `x` (rows of `width`) in llama.cpp's Q8_K blocks of `block` values, decoded: each block's scale
/// is its signed largest value over -127, kept in f32 (so that value becomes exactly -127 steps),
/// each value's multiple of it rounded half to even (`nearest_int`) and clamped at 127; an
/// all-zero block stays zero. Against Q8_0's f16 scale this removes a rounding shared by the whole
/// block (up to 2^-11 of every value in it), which a Q2_K matrix's min term, a sum over the
/// block's activations, turns into a coherent error.
pub fn round_q8k_blocks(x: &mut [f32], width: usize, block: usize) {
    for row in x.chunks_mut(width.max(1)) {
        for b in row.chunks_mut(block.max(1)) {
            let max = b.iter().fold(0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
            if max == 0.0 {
                b.iter_mut().for_each(|v| *v = 0.0);
                continue;
            }
            let iscale = -127.0 / max;
            let d = 1.0 / iscale;
            for v in b.iter_mut() {
                // Clamped by comparison, not `min`, so a NaN stays NaN.
                let q = (iscale * *v).round_ties_even();
                *v = if q > 127.0 { 127.0 } else { q } * d;
            }
        }
    }
}

/// `x` (rows of `width`) as a product's input rounded by `how`: Q8_0 or Q8_K blocks, or a 16-bit
/// format.
pub fn round_input(x: &mut [f32], width: usize, how: devices::InputRounding) {
    match how {
        devices::InputRounding::Q8(block) => round_q8_blocks(x, width, block),
        devices::InputRounding::Q8K(block) => round_q8k_blocks(x, width, block),
        devices::InputRounding::Half(f) => x.iter_mut().for_each(|v| *v = round_to(f, *v)),
    }
}

impl EmulatedArithmetic {
    /// The emulation of `arith`, or why there is none: nothing declared to round (f32 storage,
    /// no quantized activations, no rounding cache: the worst-case bound is already sharp
    /// there). Fixed-point arithmetic is emulated by its grids, the attention's scores, exps
    /// and weights included ([`SoftmaxRule::grid`]); the integer approximations of exp, sigmoid and
    /// the inverse square root keep the oracle's precision. On MoE models the experts' product inputs are
    /// rounded as the others are ([`oracle::Tap::product_input`]).
    pub fn new(arith: &devices::Arithmetic, path: &std::path::Path) -> Result<EmulatedArithmetic, String> {
        use devices::NumFormat::{BF16, F16};
        let none = EmulatedArithmetic { fixed: None, path: path.to_path_buf(), inputs: Default::default(), kv: Default::default(), storage: None, pending: None, weights: None, query: None, rotation: None, recorded: None, gelu_table: None };
        if let Some(fp) = arith.fixed {
            return Ok(EmulatedArithmetic { fixed: Some(fp), weights: Some(SoftmaxRule::grid(fp.act_frac)), ..none });
        }
        let storage = matches!(arith.storage, F16 | BF16).then_some(arith.storage);
        let rounds = |f: Option<devices::KvFormat>| f.filter(|f| *f != devices::KvFormat::F32);
        let kv = devices::KvTypes { k: rounds(arith.kv_types().k), v: rounds(arith.kv_types().v) };
        let mut rotation = None;
        if kv.formats().any(|f| f.block().is_some()) {
            let (_, spec) = oracle::loader::open_weights(path).map_err(|e| format!("the model could not be read: {e}"))?;
            for f in kv.formats() {
                if let Some(b) = f.block().filter(|b| !spec.head_dim.is_multiple_of(*b)) {
                    return Err(format!("a {f} KV cache quantizes each head in blocks of {b}; this model's heads are {} wide", spec.head_dim));
                }
            }
            // Only the side held in blocks is rotated (llama.cpp's rule).
            let blocks = |f: Option<devices::KvFormat>| f.is_some_and(|f| f.block().is_some());
            rotation = devices::kv_rotation_widths(spec.head_dim).filter(|_| arith.kv_cache_rotation).map(|(k, v)| (if blocks(kv.k) { k } else { 0 }, if blocks(kv.v) { v } else { 0 }));
        }
        let gelu_table = if arith.gelu_half_table {
            let (_, spec) = oracle::loader::open_weights(path).map_err(|e| format!("the model could not be read: {e}"))?;
            (spec.activation == oracle::spec::Activation::GeluTanh).then(Default::default)
        } else {
            None
        };
        if !arith.rounds_product_inputs() && kv.is_none() && storage.is_none() && gelu_table.is_none() {
            return Err("nothing in the declared arithmetic rounds beyond f32".into());
        }
        let inputs: std::collections::BTreeMap<String, devices::InputRounding> = if arith.rounds_product_inputs() {
            matrix_types(path).map_err(|e| format!("the model's matrix types could not be read: {e}"))?.into_iter().filter_map(|(name, ty)| Some((name, arith.input_rounding(ty)?))).collect()
        } else {
            Default::default()
        };
        if inputs.is_empty() && kv.is_none() && storage.is_none() && gelu_table.is_none() {
            return Err("nothing in the declared arithmetic rounds on this model: its Q8 activations meet no quantized matrix (nor its half-precision rounding an F16/BF16 one)".into());
        }
        // A float cache that rounds, multiplied in its own type: the query enters its product
        // with the keys, and the attention weights theirs with the values, in that format too
        // (llama.cpp without flash attention). Keys in a block format take the query as Q8_0
        // blocks of 32; values in one are decoded to f32 for the weighted sum (llama.cpp's flash
        // attention, which such a value cache needs), so the weights stay as computed.
        let half = |f: Option<devices::KvFormat>| f.and_then(|f| f.float()).filter(|_| arith.activation_half_rounding);
        let query = match kv.k.and_then(|f| f.block()) {
            Some(_) => Some(devices::InputRounding::Q8(32)),
            None => half(kv.k).map(devices::InputRounding::Half),
        };
        let weights = half(kv.v).map(SoftmaxRule::rounded_to);
        Ok(EmulatedArithmetic { kv, storage, inputs, query, weights, rotation, gelu_table, ..none })
    }

    /// The oracle this emulation runs, when it is not the caller's: for fixed-point arithmetic
    /// the model loaded anew with its weights as the engine holds them (decoded f32;
    /// refused, as any load, when the machine cannot hold it). None: the engine computes with the
    /// file's own weights, so the caller's oracle serves.
    pub fn load_model(&self) -> oracle::Result<Option<oracle::generate::AnyModel>> {
        let Some(fp) = self.fixed else { return Ok(None) };
        let (inner, mut spec) = oracle::loader::open_weights(&self.path)?;
        let head_from_embd = spec.tied_output.then(|| (spec.n_vocab as u64).saturating_mul(spec.n_embd as u64));
        spec.tied_output = false;
        let src = FixedPointWeights { inner, fp, head_from_embd };
        Ok(Some(oracle::generate::AnyModel::F32(oracle::Model::load_with(spec, &src, oracle::WeightStore::Decoded)?)))
    }

    /// The same emulation, also recording every tap (layer-diff compares them with the oracle's).
    pub fn recording(self) -> EmulatedArithmetic {
        EmulatedArithmetic { recorded: Some(oracle::RecordingTap::default()), ..self }
    }
}

impl Tap for EmulatedArithmetic {
    fn record(&mut self, name: &str, start_pos: usize, n_tokens: usize, width: usize, data: &[f32]) {
        // The value as the engine holds it (its storage format or fixed-point grid) is what it
        // shows as this tap; its cache may round it once more for the attention that reads it.
        let mut held = self.held(data);
        if let Some((gate, up)) = &mut self.gelu_table {
            let v = held.as_deref().unwrap_or(data);
            if name.ends_with(".ffn_gate") {
                *gate = v.to_vec();
            } else if name.ends_with(".ffn_up") {
                *up = v.to_vec();
            } else if name.ends_with(".ffn_act") && gate.len() == v.len() && up.len() == v.len() {
                held = Some(gate.iter().zip(up.iter()).map(|(g, u)| gelu_f16_table(*g) * u).collect());
            }
        }
        if let Some(r) = &mut self.recorded {
            r.record(name, start_pos, n_tokens, width, held.as_deref().unwrap_or(data));
        }
        let (key, value) = (name.ends_with(".attn_k_rope"), name.ends_with(".attn_v"));
        let query = self.query.filter(|_| name.ends_with(".attn_q_rope"));
        // A rotating cache rounds in the rotated basis (the query in the keys'); rotating back
        // leaves the scores and outputs the engine computes in that basis.
        let rotate = self.rotation.map(|(k, v)| if value { v } else { k }).unwrap_or(0);
        let cached = if key { self.kv.k } else if value { self.kv.v } else { None };
        let how: Option<Box<dyn Fn(&mut [f32])>> = match (cached, query) {
            // A width of whole blocks was checked when the emulation was made.
            (Some(f), _) => Some(Box::new(move |v: &mut [f32]| _ = f.round_rows(v, width))),
            (None, Some(how)) => Some(Box::new(move |v: &mut [f32]| round_input(v, width, how))),
            (None, None) => None,
        };
        self.pending = match how {
            Some(how) => {
                let mut v = held.unwrap_or_else(|| data.to_vec());
                devices::hadamard_rotate(&mut v, rotate);
                how(&mut v);
                devices::hadamard_rotate(&mut v, rotate);
                Some(v)
            }
            None => held,
        };
    }
    fn substitute(&mut self, _name: &str, _start_pos: usize, _n_tokens: usize, _width: usize) -> Option<Vec<f32>> {
        self.pending.take()
    }
    fn attention_weights(&self) -> Option<&oracle::ops::AttentionWeights> {
        self.weights.as_ref().map(|w| &*w.0)
    }
    fn product_input(&mut self, weight: &str, width: usize, data: &[f32]) -> Option<Vec<f32>> {
        let mut v = data.to_vec();
        round_input(&mut v, width, *self.inputs.get(weight)?);
        Some(v)
    }
}

impl EmulatedArithmetic {
    /// A tap's value `data` as the engine holds it (on the fixed-point activation grid, in its
    /// 16-bit storage format), or None where the declared arithmetic holds it as computed.
    fn held(&self, data: &[f32]) -> Option<Vec<f32>> {
        if let Some(fp) = self.fixed {
            return Some(data.iter().map(|x| on_grid(*x as f64, fp.act_frac) as f32).collect());
        }
        self.storage.map(|f| data.iter().map(|x| round_to(f, *x)).collect())
    }
}

/// The declared arithmetic as a device: every tap of the oracle run over `ids` with `arith`'s
/// roundings emulated, as an honest engine of that arithmetic would dump them. Judged by
/// layer-diff against the declaration's own budgets it must pass at every tap: a tap over budget
/// there is a budget below what the declared arithmetic itself produces (the self-consistency
/// invariant of docs/ARCHITECTURE.md). Ok(None) where the declaration rounds nothing the
/// emulation can apply.
pub fn emulated_taps(oracle_model: &oracle::generate::AnyModel, path: &std::path::Path, ids: &[u32], arith: &devices::Arithmetic) -> Result<Option<oracle::RecordingTap>, String> {
    let Ok(emu) = EmulatedArithmetic::new(arith, path) else { return Ok(None) };
    let own = emu.load_model().map_err(|e| format!("the emulated weights could not be loaded: {e}"))?;
    let mut emu = emu.recording();
    own.as_ref().unwrap_or(oracle_model).prefill_logits(ids, &mut emu).map_err(|e| e.to_string())?;
    Ok(emu.recorded)
}

/// How an engine turns a query head's scaled scores into attention weights where it rounds
/// them (through `oracle::Tap::attention_weights`).
pub struct SoftmaxRule(Box<oracle::ops::AttentionWeights>, &'static str);

impl SoftmaxRule {
    /// A fixed-point engine's, on its activation grid of `frac` fractional bits: each scaled
    /// score on the grid, exp(score - max) on the grid, their exact sum, and each weight
    /// (exp / sum) on the grid — what no tap shows and the engine rounds all the same. The
    /// integer exp's own approximation (under 1e-7 before its rounding) is not emulated.
    pub fn grid(frac: u32) -> SoftmaxRule {
        let quantum = 1.0 / (1u64 << frac) as f64;
        SoftmaxRule(
            Box::new(move |scores: &[f64]| {
                let s: Vec<f64> = scores.iter().map(|x| on_grid(*x, frac)).collect();
                let max = s.iter().fold(f64::NEG_INFINITY, |m, x| m.max(*x));
                let e: Vec<f64> = s.iter().map(|x| on_grid((x - max).exp(), frac)).collect();
                // An integer sum of at least one quantum (every exp rounded to 0 cannot be).
                let sum = e.iter().sum::<f64>().max(quantum);
                e.iter().map(|x| on_grid(x / sum, frac)).collect()
            }),
            "grid",
        )
    }

    /// The softmax with each weight rounded to a 16-bit format: an engine that multiplies the
    /// weights with an F16/BF16 cache of values in the cache's type.
    pub fn rounded_to(f: devices::NumFormat) -> SoftmaxRule {
        SoftmaxRule(Box::new(move |scores: &[f64]| oracle::ops::act::softmax_f64(scores).into_iter().map(|p| round_to(f, p as f32) as f64).collect()), "rounded")
    }
}

impl std::fmt::Debug for SoftmaxRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SoftmaxRule({})", self.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Q8 rounding equals llama.cpp's Q8_0 as the oracle's codec (checked against gguf-py)
    /// encodes and decodes it, row by row.
    /// The f16 GELU table: within two f16 roundings of GELU where GELU is not tiny, the identity
    /// from 10 up and zero from -10 down, and an f16 value everywhere below 10.
    #[test]
    fn the_f16_gelu_table_rounds_its_input_and_its_result() {
        let gelu = oracle::ops::gelu_tanh;
        let u = devices::NumFormat::F16.unit_roundoff();
        let mut off = 0usize;
        for i in -2000..2000 {
            let x = i as f32 * 0.0049;
            let t = gelu_f16_table(x);
            assert_eq!(t, round_to(devices::NumFormat::F16, t), "{x}: {t} is not an f16 value");
            let exact = gelu(x as f64);
            if exact.abs() > 0.05 {
                assert!((t as f64 - exact).abs() <= 3.0 * u * exact.abs(), "{x}: {t} vs {exact}");
            }
            off += (t as f64 != exact) as usize;
        }
        assert!(off > 3000, "the table rounds: {off} of 4000 values differ from GELU");
        assert_eq!((gelu_f16_table(10.0), gelu_f16_table(12.345), gelu_f16_table(-10.0)), (10.0, 12.345, 0.0));
    }

    #[test]
    fn q8_rounding_is_q8_0() {
        let x: Vec<f32> = (0..128).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013 + if i == 70 { 3.0 } else { 0.0 }).collect();
        let mut got = x.clone();
        round_q8_blocks(&mut got, 64, 32);
        let want = oracle::quant::decode(oracle::quant::GgmlType::Q8_0, &oracle::quant::encode(oracle::quant::GgmlType::Q8_0, &x).unwrap(), x.len()).unwrap();
        assert_eq!(got, want);
        assert_ne!(got, x, "it rounds");
    }

    /// The emulation rounds where the arithmetic says and nowhere else, and says why it does not
    /// apply to plain f32 arithmetic (fixed point: every tap on its grid).
    #[test]
    fn the_emulated_arithmetic_rounds_where_declared() {
        let x: Vec<f32> = (0..64).map(|i| 0.1 + i as f32 * 0.0123).collect();
        let nowhere = std::path::Path::new("/nonexistent/model.gguf");
        // Q8 activations: the input of a product with a quantized matrix, nothing else.
        let q8 = devices::Arithmetic { activation_q8_block: Some(32), ..devices::Arithmetic::F32 };
        assert!(EmulatedArithmetic::new(&q8, nowhere).unwrap_err().contains("matrix types could not be read"));
        let inputs = [("blk.0.attn_q.weight".to_string(), devices::InputRounding::Q8(32))].into_iter().collect();
        let mut emu = EmulatedArithmetic { fixed: None, path: nowhere.into(), inputs, kv: Default::default(), rotation: None, storage: None, pending: None, weights: None, query: None, recorded: None, gelu_table: None };
        let sub = emu.product_input("blk.0.attn_q.weight", 64, &x).expect("a quantized matrix's input is rounded");
        assert!(sub != x && sub.iter().zip(&x).all(|(a, b)| (a - b).abs() <= 0.9 / 127.0 * 0.5 + 1e-6));
        assert!(emu.product_input("blk.0.ffn_gate_inp.weight", 64, &x).is_none(), "a float matrix's is not");
        emu.record("blk.0.attn_norm", 0, 1, 64, &x);
        assert!(emu.substitute("blk.0.attn_norm", 0, 1, 64).is_none(), "nor is the tap");
        let kv = devices::Arithmetic { kv_cache: devices::KvFormat::parse("f16"), ..devices::Arithmetic::F32 };
        let mut emu = EmulatedArithmetic::new(&kv, nowhere).unwrap().recording();
        emu.record("blk.1.attn_v", 0, 1, 64, &x);
        assert_eq!(emu.substitute("blk.1.attn_v", 0, 1, 64).unwrap(), x.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect::<Vec<_>>());
        assert_eq!(emu.recorded.as_ref().unwrap().tensors["blk.1.attn_v"].1, x, "shown as computed, rounded only in the cache");
        emu.record("blk.1.attn_norm", 0, 1, 64, &x);
        assert!(emu.substitute("blk.1.attn_norm", 0, 1, 64).is_none());
        emu.record("blk.1.attn_q_rope", 0, 1, 64, &x);
        assert!(emu.substitute("blk.1.attn_q_rope", 0, 1, 64).is_none() && emu.attention_weights().is_none(), "a cache alone rounds what it holds");
        assert!(EmulatedArithmetic::new(&devices::Arithmetic::F32, nowhere).unwrap_err().contains("nothing"));
        // Fixed point: every tap on the activation grid, the residual stream too.
        let point = devices::fixed::FixedDevice { int4: false }.point();
        let mut emu = EmulatedArithmetic::new(&devices::Arithmetic { fixed: Some(point), ..devices::Arithmetic::F32 }, nowhere).unwrap().recording();
        emu.record("blk.0.ffn_inp", 0, 1, 64, &x);
        let sub = emu.substitute("blk.0.ffn_inp", 0, 1, 64).expect("every tap is rounded");
        assert!(sub.iter().zip(&x).all(|(s, v)| *s as f64 == devices::fixed::to_q(*v as f64, 16) as f64 / 65536.0), "{sub:?}");
        assert_eq!(emu.recorded.as_ref().unwrap().tensors["blk.0.ffn_inp"].1, sub, "shown as the engine holds it");
    }

    /// A block-quantized cache: the cached keys and values come back as the format decodes
    /// them, the query enters the keys' product as Q8_0 blocks, and a rotating cache rounds in
    /// the Hadamard basis — which spreads an outlier (less error than rounding it as it is) and
    /// leaves the scores what the engine computes there, Q8_0(Hq) . Q8_0(Hk). A head of less
    /// than whole blocks is refused.
    #[test]
    fn a_block_quantized_cache_rounds_keys_values_and_query_in_its_basis() {
        let q4 = devices::KvFormat::parse("q4_0").unwrap();
        let base = EmulatedArithmetic { fixed: None, path: "nowhere".into(), inputs: Default::default(), kv: devices::KvTypes::both(q4), rotation: None, storage: None, pending: None, weights: None, query: Some(devices::InputRounding::Q8(32)), recorded: None, gelu_table: None };
        // Small values and one outlier in a head of 64.
        let x: Vec<f32> = (0..64).map(|i| if i == 5 { 100.0 } else { ((i * 29 % 17) as f32 - 8.0) / 8.0 }).collect();
        let through = |emu: &mut EmulatedArithmetic, tap: &str, v: &[f32]| {
            emu.record(tap, 0, 1, 64, v);
            emu.substitute(tap, 0, 1, 64).unwrap()
        };
        let mut plain = EmulatedArithmetic { ..base };
        let mut expect = x.clone();
        q4.round_rows(&mut expect, 64).unwrap();
        assert_eq!(through(&mut plain, "blk.0.attn_k_rope", &x), expect);
        assert_eq!(through(&mut plain, "blk.0.attn_v", &x), expect);
        let mut q8 = x.clone();
        round_q8_blocks(&mut q8, 64, 32);
        assert_eq!(through(&mut plain, "blk.0.attn_q_rope", &x), q8);
        plain.record("blk.0.attn_q", 0, 1, 64, &x);
        assert!(plain.substitute("blk.0.attn_q", 0, 1, 64).is_none(), "only the query entering the keys' product");

        // Rotating a Q8_0 cache: the outlier's step no longer swamps its block's small values.
        let q8kv = devices::KvFormat::parse("q8_0").unwrap();
        let mut rotating = EmulatedArithmetic { rotation: devices::kv_rotation_widths(64), ..EmulatedArithmetic { kv: devices::KvTypes::both(q8kv), ..plain } };
        let k = through(&mut rotating, "blk.0.attn_k_rope", &x);
        let mut as_it_is = x.clone();
        q8kv.round_rows(&mut as_it_is, 64).unwrap();
        let err = |v: &[f32]| v.iter().zip(&x).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>().sqrt();
        assert!(err(&k) < 0.5 * err(&as_it_is), "rotated {} vs as it is {}", err(&k), err(&as_it_is));
        let q = through(&mut rotating, "blk.0.attn_q_rope", &x);
        let (mut hq, mut hk) = (x.clone(), x.clone());
        devices::hadamard_rotate(&mut hq, 64);
        devices::hadamard_rotate(&mut hk, 64);
        round_q8_blocks(&mut hq, 64, 32);
        q8kv.round_rows(&mut hk, 64).unwrap();
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>();
        let (emulated, engine) = (dot(&q, &k), dot(&hq, &hk));
        assert!((emulated - engine).abs() <= 1e-5 * engine.abs(), "{emulated} vs {engine}");

    }

    /// Q8 activations round the inputs of products with quantized matrices and no others (on a
    /// model whose matrices are all f32/f16/bf16 they round nothing, and the emulation says so
    /// instead of holding a device to the oracle itself); K-quants take their own block where
    /// one is declared, and F16/BF16 matrices their own format under `activation_half_rounding`.
    #[test]
    fn q8_activations_round_only_before_quantized_matrices() {
        use oracle::gguf::{GgufWriter, Value};
        use oracle::quant::{encode, GgmlType};
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, types: &[(&str, GgmlType)]| {
            let mut w = GgufWriter::new();
            w.meta("general.architecture", Value::String("llama".into()));
            for (k, v) in [("context_length", 64), ("embedding_length", 32), ("block_count", 1), ("feed_forward_length", 64), ("attention.head_count", 2), ("attention.head_count_kv", 2), ("vocab_size", 40)] {
                w.meta(&format!("llama.{k}"), Value::U32(v));
            }
            w.meta("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
            w.tensor("token_embd.weight", &[32, 40], GgmlType::F32, encode(GgmlType::F32, &[0.5f32; 32 * 40]).unwrap());
            w.tensor("blk.0.attn_norm.weight", &[32], GgmlType::F32, encode(GgmlType::F32, &[1.0f32; 32]).unwrap());
            for (t, ty) in types {
                // Rows of one block where a block is wider than 32 (K-quants: 256).
                let cols = ty.block_size().max(32);
                w.tensor(t, &[cols as u64, 32], *ty, encode(*ty, &vec![0.5f32; cols * 32]).unwrap());
            }
            let path = dir.path().join(name);
            w.write_to(&path).unwrap();
            path
        };
        let mixed = write("mixed.gguf", &[("blk.0.attn_q.weight", GgmlType::Q4_0), ("blk.0.attn_k.weight", GgmlType::F16), ("blk.0.ffn_down.weight", GgmlType::Q8_0), ("output.weight", GgmlType::BF16)]);
        let got: Vec<(String, GgmlType)> = matrix_types(&mixed).unwrap().into_iter().collect();
        assert_eq!(got, [("blk.0.attn_k.weight".into(), GgmlType::F16), ("blk.0.attn_q.weight".into(), GgmlType::Q4_0), ("blk.0.ffn_down.weight".into(), GgmlType::Q8_0), ("output.weight".into(), GgmlType::BF16), ("token_embd.weight".into(), GgmlType::F32)]);
        let q8 = devices::Arithmetic { activation_q8_block: Some(32), ..devices::Arithmetic::F32 };
        let mut emu = EmulatedArithmetic::new(&q8, &mixed).unwrap();
        let y: Vec<f32> = (0..32).map(|i| 1.0 + i as f32 * 0.001234567).collect();
        for (matrix, rounded) in [("blk.0.attn_q.weight", true), ("blk.0.ffn_down.weight", true), ("blk.0.attn_k.weight", false), ("output.weight", false), ("token_embd.weight", false)] {
            assert_eq!(emu.product_input(matrix, 32, &y).is_some(), rounded, "{matrix}");
        }
        // llama.cpp multiplies an F16/BF16 matrix in its own type: the input rounded to it.
        let half = devices::Arithmetic { activation_half_rounding: true, ..q8 };
        let mut emu = EmulatedArithmetic::new(&half, &mixed).unwrap();
        let as_f16: Vec<f32> = y.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect();
        let as_bf16: Vec<f32> = y.iter().map(|v| half::bf16::from_f32(*v).to_f32()).collect();
        assert!(as_f16 != y && as_bf16 != as_f16);
        assert_eq!(emu.product_input("blk.0.attn_k.weight", 32, &y).unwrap(), as_f16);
        assert_eq!(emu.product_input("output.weight", 32, &y).unwrap(), as_bf16);
        assert!(emu.product_input("token_embd.weight", 32, &y).is_none(), "an f32 matrix's input enters as computed");
        let float = write("float.gguf", &[("blk.0.attn_q.weight", GgmlType::F32), ("output.weight", GgmlType::F16)]);
        assert!(EmulatedArithmetic::new(&q8, &float).unwrap_err().contains("meet no quantized matrix"));
        let kv = devices::Arithmetic { kv_cache: devices::KvFormat::parse("f16"), ..q8 };
        assert!(EmulatedArithmetic::new(&kv, &float).is_ok(), "the cache still rounds");
        // A block-quantized cache of heads 16 wide (this model's) cannot be: refused, naming it.
        let blocks = devices::Arithmetic { kv_cache: devices::KvFormat::parse("q4_0"), ..q8 };
        assert!(EmulatedArithmetic::new(&blocks, &float).unwrap_err().contains("heads are 16 wide"));
        assert!(EmulatedArithmetic::new(&devices::Arithmetic { activation_half_rounding: true, ..q8 }, &float).is_ok(), "the F16 head's input rounds");
        // An f16 cache multiplied in its own type (llama.cpp without flash attention): the query
        // and the attention weights enter its products as f16.
        let mut emu = EmulatedArithmetic::new(&devices::Arithmetic { activation_half_rounding: true, ..kv }, &float).unwrap();
        emu.record("blk.1.attn_q_rope", 0, 1, 32, &y);
        assert_eq!(emu.substitute("blk.1.attn_q_rope", 0, 1, 32).unwrap(), y.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect::<Vec<_>>());
        let scores = [0.3, -1.25, 2.0, 0.7];
        let weights = emu.attention_weights().expect("the weights are rounded")(&scores);
        let exact = oracle::ops::act::softmax_f64(&scores);
        assert!(weights.iter().zip(&exact).all(|(w, p)| *w == half::f16::from_f64(*p).to_f64() && (w - p).abs() <= p * 4.9e-4), "{weights:?} {exact:?}");
        assert!(weights != exact);

        // llama.cpp's two blocks: Q8_0's 32 before Q4_0..Q8_0 matrices, Q8_K's 256 before
        // K-quants; each product's input rounded with its matrix's block.
        let kmix = write("kmix.gguf", &[("blk.0.attn_q.weight", GgmlType::Q4_0), ("blk.0.ffn_down.weight", GgmlType::Q4_K), ("output.weight", GgmlType::F16)]);
        let x: Vec<f32> = (0..256).map(|i| ((i * 37 % 101) as f32 - 50.0) * if i % 64 == 0 { 3.0 } else { 0.01 }).collect();
        let rounded = |b| {
            let mut v = x.clone();
            round_q8_blocks(&mut v, 256, b);
            v
        };
        assert_ne!(rounded(32), rounded(256), "the two blocks round this input otherwise");
        // K-quant blocks round as Q8_K: an f32 scale, the signed largest value at exactly -127.
        let mut k256 = x.clone();
        round_q8k_blocks(&mut k256, 256, 256);
        let at = (0..256).max_by(|a, b| x[*a].abs().total_cmp(&x[*b].abs())).unwrap();
        let (kept, q8_0) = (k256[at], rounded(256)[at]);
        assert!((kept - x[at]).abs() <= 2.0 * f32::EPSILON * x[at].abs(), "Q8_K keeps the block's largest value but for f32 rounding: {kept} vs {}", x[at]);
        assert!((q8_0 - x[at]).abs() > 1e-4 * x[at].abs(), "Q8_0's f16 scale moves it: {q8_0} vs {}", x[at]);
        let mut nan = x.clone();
        nan[5] = f32::NAN;
        round_q8k_blocks(&mut nan, 256, 256);
        assert!(nan[5].is_nan() && nan.iter().filter(|v| v.is_nan()).count() == 1, "a NaN input stays NaN, alone");
        let two = devices::Arithmetic { activation_q8_block_kquant: Some(256), ..q8 };
        let mut emu = EmulatedArithmetic::new(&two, &kmix).unwrap();
        assert_eq!(emu.product_input("blk.0.attn_q.weight", 256, &x).unwrap(), rounded(32));
        assert_eq!(emu.product_input("blk.0.ffn_down.weight", 256, &x).unwrap(), k256);
        assert!(emu.product_input("output.weight", 256, &x).is_none());
        // One block declared: it serves the K-quants too.
        let mut one = EmulatedArithmetic::new(&q8, &kmix).unwrap();
        assert_eq!(one.product_input("blk.0.ffn_down.weight", 256, &x).unwrap(), rounded(32));
        // Only the K-quants' block declared: the other matrices' inputs enter as computed.
        let k_only = devices::Arithmetic { activation_q8_block_kquant: Some(256), ..devices::Arithmetic::F32 };
        let mut k = EmulatedArithmetic::new(&k_only, &kmix).unwrap();
        assert!(k.product_input("blk.0.attn_q.weight", 256, &x).is_none());
        assert_eq!(k.product_input("blk.0.ffn_down.weight", 256, &x).unwrap(), k256);
        assert!(EmulatedArithmetic::new(&k_only, &mixed).unwrap_err().contains("meet no quantized matrix"));
    }

    /// The grid softmax is the integer device's softmax (its integer exp, exact sum and Q16
    /// division) up to that exp's own approximation: at most one quantum apart, and equal almost
    /// everywhere, over rows of scores from near ties to a 30-unit spread.
    #[test]
    fn grid_softmax_is_the_integer_devices_softmax() {
        let rule = SoftmaxRule::grid(16);
        let (mut entries, mut equal) = (0, 0);
        for row in 0..200u64 {
            let spread = 0.01 + (row % 20) as f64 * 1.5;
            let scores_q: Vec<i64> = (0..(1 + row % 37)).map(|j| ((((row * 7919 + j * 104729) % 1000) as f64 / 1000.0 - 0.5) * spread * 65536.0).round() as i64).collect();
            let device = devices::fixed::softmax_q(&scores_q);
            let scores: Vec<f64> = scores_q.iter().map(|q| *q as f64 / 65536.0).collect();
            let emulated = (rule.0)(&scores);
            for (d, e) in device.iter().zip(&emulated) {
                let d = *d as f64 / 65536.0;
                assert!((d - e).abs() <= 1.0 / 65536.0 + 1e-12, "row {row}: device {d}, emulated {e}");
                entries += 1;
                equal += (d == *e) as usize;
            }
        }
        assert!(equal as f64 >= 0.99 * entries as f64, "{equal} of {entries} weights equal");
    }

    /// The emulated fixed-point weights are the `fixed` and `fixed-int4` devices' own conversion
    /// (`devices::fixed::convert_weights`), value for value: Q24, INT4 groups with a Q24 scale,
    /// and Q24 for a row length that is not a multiple of the group.
    #[test]
    fn fixed_point_weights_are_the_devices_conversion() {
        use devices::fixed::{convert_weights, FixedWeights, IntValues};
        let (rows, cols) = (3, 64);
        let w: Vec<f32> = (0..rows * cols).map(|i| (((i * 7919) % 211) as f32 - 105.0) * 3.1e-3 * if i % 17 == 0 { 9.0 } else { 1.0 }).collect();
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let q24 = |v: i64| v as f64 / (1u64 << 24) as f64;
        for int4 in [false, true] {
            let fp = devices::fixed::FixedDevice { int4 }.point();
            let want: Vec<f64> = match convert_weights(oracle::quant::GgmlType::F32, rows, cols, &bytes, int4) {
                FixedWeights::Q24 { w: IntValues::Narrow(v), .. } => v.iter().map(|x| q24(*x as i64)).collect(),
                FixedWeights::Q24 { w: IntValues::Wide(v), .. } => v.iter().map(|x| q24(*x)).collect(),
                FixedWeights::Int4 { q, scale, .. } => q.iter().enumerate().map(|(i, x)| *x as f64 * q24(scale[i / 32])).collect(),
            };
            let got = fixed_point_matrix(&w, cols, &fp);
            assert_eq!(got, want, "int4 {int4}");
            assert!(got.iter().zip(&w).any(|(g, v)| *g != *v as f64), "it rounds");
        }
        let int4 = devices::fixed::FixedDevice { int4: true }.point();
        assert_eq!(fixed_point_matrix(&w[..60], 30, &int4), fixed_point_matrix(&w[..60], 30, &devices::fixed::FixedDevice { int4: false }.point()));
    }
}
