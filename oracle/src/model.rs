//! The one forward interpreter: runs any `ModelSpec` (Llama, Qwen2, Qwen3, MoE) over its weights,
//! for prefill, incremental decode and append-prefill against a KV cache, recording every named
//! intermediate ("tap", llama.cpp naming) when asked.

use crate::error::{OracleError, Result};
use crate::loader::TensorSource;
use crate::ops::{self, AttentionParams, Mat, RowBuf};
use crate::real::Real;
use crate::spec::{Activation, BlockKind, ModelSpec, Stage};
use crate::taps::{TapKind, TapName};
use rayon::prelude::*;

/// Receives named intermediates. `data` is `[n_tokens, width]` for tokens at `start_pos..`.
pub trait Tap {
    /// Whether the interpreter should build tap buffers at all.
    fn enabled(&self) -> bool {
        true
    }
    fn record(&mut self, name: &str, start_pos: usize, n_tokens: usize, width: usize, data: &[f32]);
    /// An engine gave a tap of no kind this tool knows (`EngineTap::Other`): its name, kept so
    /// that it is reported as not judged.
    fn other(&mut self, _name: &str) {}
    /// Isolated layer-diff: after recording `name`, the interpreter continues from the value this
    /// returns instead of its own (`[n_tokens, width]`, e.g. a device's value of the same tap), so
    /// the next op is judged on the device's inputs and its error is its own. None keeps the
    /// interpreter's value. Only the oracle's interpreter consults it.
    fn substitute(&mut self, _name: &str, _start_pos: usize, _n_tokens: usize, _width: usize) -> Option<Vec<f32>> {
        None
    }
    /// MoE routing (tap `name`, `blk.L.ffn_moe_topk`): having scored the experts (`probs`) and
    /// chosen `chosen` (best first) for the token at `pos`, the interpreter routes it to the
    /// experts this returns instead. Layer-diff uses it to follow a device's choice where the two
    /// differ only at a near tie. None keeps the interpreter's own choice.
    fn route(&mut self, _name: &str, _pos: usize, _probs: &[f64], _chosen: &[usize]) -> Option<Vec<usize>> {
        None
    }
    /// The input of a matrix product (`[n, width]`, `weight` the matrix's GGUF name, e.g.
    /// `blk.0.attn_q.weight`; a MoE expert's `blk.L.ffn_gate_exps.weight`, one token at a time):
    /// the interpreter multiplies what this returns instead, if anything. Never recorded: the
    /// emulation of a declared arithmetic rounds here what the engine rounds before a product
    /// with a quantized matrix.
    fn product_input(&mut self, _weight: &str, _width: usize, _data: &[f32]) -> Option<Vec<f32>> {
        None
    }
    /// The rule that computes attention weights from scores in place of the softmax
    /// ([`crate::ops::AttentionWeights`]), if any: the emulation of a fixed-point arithmetic
    /// computes them on its grid, as the engine does where no tap shows it.
    fn attention_weights(&self) -> Option<&crate::ops::AttentionWeights> {
        None
    }
}

/// A tap that records nothing.
pub struct NoTap;
impl Tap for NoTap {
    fn enabled(&self) -> bool {
        false
    }
    fn record(&mut self, _: &str, _: usize, _: usize, _: usize, _: &[f32]) {}
}

/// Records every tap, appending positions across calls (prefill then decode steps).
#[derive(Default, Debug, Clone)]
pub struct RecordingTap {
    /// name -> (width, values for positions 0.. in order)
    pub tensors: std::collections::BTreeMap<String, (usize, Vec<f32>)>,
    /// Names in first-recorded order (execution order).
    pub order: Vec<String>,
    /// The names of taps of no kind this tool knows, as an engine's dump gave them.
    pub others: Vec<String>,
}

impl Tap for RecordingTap {
    fn record(&mut self, name: &str, start_pos: usize, n_tokens: usize, width: usize, data: &[f32]) {
        let entry = self.tensors.entry(name.to_string()).or_insert_with(|| {
            self.order.push(name.to_string());
            (width, Vec::new())
        });
        // Positions are recorded in order; a replay of earlier positions overwrites them.
        let start = start_pos * width;
        entry.1.truncate(start);
        entry.1.resize(start, f32::NAN);
        entry.1.extend_from_slice(&data[..n_tokens * width]);
    }
    fn other(&mut self, name: &str) {
        if !self.others.iter().any(|n| n == name) {
            self.others.push(name.to_string());
        }
    }
}

/// Records `data` under `name` and, when the tap substitutes a value (isolated layer-diff),
/// replaces `data` with it.
fn tap<T: Real>(t: &mut dyn Tap, name: &str, start: usize, n: usize, width: usize, data: &mut [T]) {
    if t.enabled() {
        let v: Vec<f32> = data.iter().map(|x| x.to_f32()).collect();
        t.record(name, start, n, width, &v);
        if let Some(sub) = t.substitute(name, start, n, width) {
            if sub.len() == data.len() {
                data.iter_mut().zip(&sub).for_each(|(d, s)| *d = T::from_f32(*s));
            }
        }
    }
}

/// Which feed-forward block `dense_ffn` computes: a dense layer's (its intermediates recorded as
/// taps `blk.L.ffn_gate|up|act`, tokens from `start`), a MoE expert's or the shared expert's (no
/// taps); the suffix of its matrices' names.
#[derive(Clone, Copy)]
enum FfnKind {
    Layer { start: usize },
    Expert,
    Shared,
}

/// `x` (rows of `width`) as the input of the product with `weight`: what
/// [`Tap::product_input`] returns, else `x` itself.
fn product_input<'a, T: Real>(taps: &mut dyn Tap, weight: &str, width: usize, x: &'a [T]) -> std::borrow::Cow<'a, [T]> {
    if taps.enabled() {
        let v: Vec<f32> = x.iter().map(|a| a.to_f32()).collect();
        if let Some(sub) = taps.product_input(weight, width, &v).filter(|s| s.len() == x.len()) {
            return sub.iter().map(|a| T::from_f32(*a)).collect::<Vec<T>>().into();
        }
    }
    x.into()
}

/// `x` (`[m, cols]`) times each matrix of `mats` (with its GGUF name), each input first offered
/// to [`Tap::product_input`]; one pass over `x` when none is replaced.
fn products<T: Real>(taps: &mut dyn Tap, x: &[T], m: usize, mats: &[(&Mat<T>, &str)]) -> Result<Vec<Vec<T>>> {
    let inputs: Vec<std::borrow::Cow<'_, [T]>> = mats.iter().map(|(w, n)| product_input(taps, n, w.cols, x)).collect();
    if inputs.iter().all(|i| matches!(i, std::borrow::Cow::Borrowed(_))) {
        return ops::matmul_many(x, m, &mats.iter().map(|(w, _)| *w).collect::<Vec<_>>());
    }
    mats.iter().zip(&inputs).map(|((w, _), i)| ops::matmul(i, m, w)).collect()
}

pub struct DenseFfn<T> {
    pub gate: Mat<T>,
    pub up: Mat<T>,
    pub down: Mat<T>,
    /// Biases of the gate, up and down products (GPT-OSS's experts).
    pub bias: Option<[Vec<T>; 3]>,
}

pub enum Ffn<T> {
    Dense(DenseFfn<T>),
    Moe {
        router: Mat<T>,
        /// The router's bias (GPT-OSS).
        router_bias: Option<Vec<T>>,
        experts: Vec<DenseFfn<T>>,
        shared: Option<DenseFfn<T>>,
        shared_gate: Option<Mat<T>>,
    },
}

pub struct Layer<T> {
    pub attn_norm: Vec<T>,
    pub wq: Mat<T>,
    pub wk: Mat<T>,
    pub wv: Mat<T>,
    pub wo: Mat<T>,
    pub bq: Option<Vec<T>>,
    pub bk: Option<Vec<T>>,
    pub bv: Option<Vec<T>>,
    pub bo: Option<Vec<T>>,
    pub q_norm: Option<Vec<T>>,
    pub k_norm: Option<Vec<T>>,
    pub ffn_norm: Vec<T>,
    /// Gemma's norms of the attention and FFN outputs (`post_attention_norm`, `post_ffw_norm`).
    pub post_norms: Option<[Vec<T>; 2]>,
    /// One sink logit per query head (GPT-OSS).
    pub sinks: Option<Vec<T>>,
    pub ffn: Ffn<T>,
}

/// A loaded model: spec + weights, vectors decoded to the storage scalar `T`, matrices decoded
/// or packed (`store`).
pub struct Model<T> {
    pub spec: ModelSpec,
    /// How the matrices are held: `Decoded` or `Packed` (never `Auto`).
    pub store: WeightStore,
    pub tok_embd: Mat<T>,
    pub output_norm: Vec<T>,
    /// None when the output projection is tied to the embedding.
    pub output: Option<Mat<T>>,
    pub layers: Vec<Layer<T>>,
}

/// What one layer keeps from one call to the next, by the kind of its block.
pub enum LayerState<T> {
    /// An attention layer's keys and values: `[len, kv_dim]` each.
    Kv { k: Vec<T>, v: Vec<T> },
}

/// Every layer's state and the positions it holds.
pub struct Cache<T> {
    pub layers: Vec<LayerState<T>>,
    pub len: usize,
}

impl<T: Real> Cache<T> {
    /// An empty state for each layer of `spec`.
    pub fn new(spec: &ModelSpec) -> Self {
        let layers = spec.layer_states(|_| LayerState::Kv { k: Vec::new(), v: Vec::new() });
        Cache { layers, len: 0 }
    }
}

/// How the oracle holds its weight matrices. Either way every matrix row is the same values and
/// every result the same bits (a test loads each model both ways and compares); only memory and
/// time differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightStore {
    /// Every matrix decoded to the storage scalar once, at load: the fastest, and what a model
    /// costs as f32 (four bytes a weight; eight with `--precision f64`).
    Decoded,
    /// Matrices kept as the file stores them (a Q4 weight takes about half a byte) and each row
    /// decoded when a product uses it: slower, but a model whose f32 copy the machine cannot hold
    /// can still be judged.
    Packed,
    /// Decoded when the decoded copy fits the memory available, packed otherwise (the default).
    Auto,
}

/// Environment variable choosing the oracle's `WeightStore`: `decoded`, `packed` or `auto`.
pub const WEIGHTS_ENV: &str = "TOUCHSTONE_ORACLE_WEIGHTS";

impl WeightStore {
    /// The store `TOUCHSTONE_ORACLE_WEIGHTS` names (Auto when it is unset).
    pub fn from_env() -> Result<WeightStore> {
        match std::env::var(WEIGHTS_ENV) {
            Err(_) => Ok(WeightStore::Auto),
            Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
                "auto" | "" => Ok(WeightStore::Auto),
                "decoded" => Ok(WeightStore::Decoded),
                "packed" => Ok(WeightStore::Packed),
                _ => Err(OracleError::Spec(format!("{WEIGHTS_ENV}={v:?}: expected `decoded`, `packed` or `auto`"))),
            },
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightStore::Decoded => "decoded",
            WeightStore::Packed => "packed",
            WeightStore::Auto => "auto",
        }
    }
}

struct Loader<'a> {
    src: &'a dyn TensorSource,
    packed: bool,
}

/// A stored tensor's GGML dims as a matrix's (rows, cols): [cols, rows], or [cols] for a single
/// row (GGUF writers drop trailing dimensions of one: llama.cpp writes Qwen2-MoE's shared-expert
/// gate, a [1, n_embd] matrix, as [n_embd]), with any further dimensions of one.
fn matrix_dims(dims: &[usize]) -> Option<(usize, usize)> {
    let (&cols, rest) = dims.split_first()?;
    let rows = rest.first().copied().unwrap_or(1);
    rest.iter().skip(1).all(|d| *d == 1).then_some((rows, cols))
}

impl Loader<'_> {
    /// Tensor `name`, refused when it holds NaN or an infinity: a weight that is not a number is a
    /// broken file, and a judge that loaded it would pass on NaN to every device it judges.
    fn get(&self, name: &str) -> Result<Option<crate::loader::LoadedTensor>> {
        let Some(t) = self.src.load(name)? else { return Ok(None) };
        if let Some(i) = t.data.iter().position(|v| !v.is_finite()) {
            return Err(OracleError::non_finite_weight(&self.src.label(), name, i, t.data[i], t.dims.first().copied().unwrap_or(1)));
        }
        Ok(Some(t))
    }

    fn vec<T: Real>(&self, name: &str, len: usize) -> Result<Vec<T>> {
        self.opt_vec(name, len)?
            .ok_or_else(|| OracleError::Spec(format!("{}: missing tensor `{name}`", self.src.label())))
    }

    fn opt_vec<T: Real>(&self, name: &str, len: usize) -> Result<Option<Vec<T>>> {
        let Some(t) = self.get(name)? else { return Ok(None) };
        if t.data.len() != len {
            return Err(OracleError::Spec(format!("{}: tensor `{name}` has {} values (dims {:?}), expected {len}", self.src.label(), t.data.len(), t.dims)));
        }
        // A vector (a norm's scales, a bias) has one dimension besides any of size one: a matrix
        // of the right element count is another tensor, not this one.
        if t.dims.iter().filter(|d| **d != 1).count() > 1 {
            return Err(OracleError::Spec(format!("{}: tensor `{name}` has dims {:?}, expected a vector of {len}", self.src.label(), t.dims)));
        }
        Ok(Some(t.data.into_iter().map(T::from_f32).collect()))
    }

    /// A matrix with `rows` outputs of `cols` inputs (GGML dims [cols, rows]).
    fn mat<T: Real>(&self, name: &str, rows: usize, cols: usize) -> Result<Mat<T>> {
        self.opt_mat(name, rows, cols)?
            .ok_or_else(|| OracleError::Spec(format!("{}: missing tensor `{name}`", self.src.label())))
    }

    fn opt_mat<T: Real>(&self, name: &str, rows: usize, cols: usize) -> Result<Option<Mat<T>>> {
        let wrong = |dims: &[usize]| OracleError::Spec(format!("{}: tensor `{name}` has dims {dims:?}, expected [{cols}, {rows}]", self.src.label()));
        if self.packed {
            let Some(t) = self.src.raw(name)? else { return Ok(None) };
            if matrix_dims(&t.dims) != Some((rows, cols)) || t.n_elements() != rows * cols {
                return Err(wrong(&t.dims));
            }
            return Mat::packed(rows, cols, t.ty, t.bytes.to_vec()).map(Some).map_err(|e| self.in_tensor(name, e));
        }
        let Some(t) = self.get(name)? else { return Ok(None) };
        if matrix_dims(&t.dims) != Some((rows, cols)) || t.data.len() != rows * cols {
            return Err(wrong(&t.dims));
        }
        Ok(Some(Mat::new(rows, cols, t.data.into_iter().map(T::from_f32).collect())?))
    }

    /// Splits a 3-D expert tensor (GGML dims [cols, rows, n_expert]) into one matrix per expert.
    fn experts<T: Real>(&self, name: &str, n_expert: usize, rows: usize, cols: usize) -> Result<Vec<Mat<T>>> {
        let missing = || OracleError::Spec(format!("{}: missing tensor `{name}`", self.src.label()));
        let wrong = |dims: &[usize]| OracleError::Spec(format!("{}: tensor `{name}` has dims {dims:?}, expected [{cols}, {rows}, {n_expert}]", self.src.label()));
        if self.packed {
            let t = self.src.raw(name)?.ok_or_else(missing)?;
            if t.dims != [cols, rows, n_expert] {
                return Err(wrong(&t.dims));
            }
            let parts = t.parts(n_expert).map_err(|e| self.in_tensor(name, OracleError::Spec(e)))?;
            return parts.map(|c| Mat::packed(rows, cols, t.ty, c.to_vec()).map_err(|e| self.in_tensor(name, e))).collect();
        }
        let t = self.get(name)?.ok_or_else(missing)?;
        if t.dims != [cols, rows, n_expert] {
            return Err(wrong(&t.dims));
        }
        t.data.chunks_exact(rows * cols).map(|c| Mat::new(rows, cols, c.iter().map(|v| T::from_f32(*v)).collect())).collect()
    }

    /// Splits a per-expert bias (GGML dims [len, n_expert]) into one vector per expert.
    fn expert_vecs<T: Real>(&self, name: &str, n_expert: usize, len: usize) -> Result<Vec<Vec<T>>> {
        let t = self.get(name)?.ok_or_else(|| OracleError::Spec(format!("{}: missing tensor `{name}`", self.src.label())))?;
        if t.dims != [len, n_expert] {
            return Err(OracleError::Spec(format!("{}: tensor `{name}` has dims {:?}, expected [{len}, {n_expert}]", self.src.label(), t.dims)));
        }
        Ok(t.data.chunks_exact(len).map(|c| c.iter().map(|v| T::from_f32(*v)).collect()).collect())
    }

    /// `e` (a size error of a packed matrix) as an error naming the file and tensor.
    fn in_tensor(&self, name: &str, e: OracleError) -> OracleError {
        OracleError::Spec(format!("{}: tensor `{name}`: {e}", self.src.label()))
    }
}

impl<T: Real> Model<T> {
    /// Loads every weight of `spec` from `src` into storage type `T`, held as
    /// `TOUCHSTONE_ORACLE_WEIGHTS` says (decoded when it fits, by default).
    pub fn load(spec: ModelSpec, src: &dyn TensorSource) -> Result<Model<T>> {
        Self::load_with(spec, src, WeightStore::from_env()?)
    }

    /// Loads every weight of `spec` from `src`, matrices held as `store` says; vectors (norms,
    /// biases) are always decoded to `T`. Refused up front when the machine cannot hold them.
    pub fn load_with(spec: ModelSpec, src: &dyn TensorSource, store: WeightStore) -> Result<Model<T>> {
        spec.validate()?;
        let decoded = src.n_elements()?.saturating_mul(std::mem::size_of::<T>() as u64);
        let store = match store {
            WeightStore::Auto => match crate::memory::available()? {
                Some((avail, _)) if decoded > avail => WeightStore::Packed,
                _ => WeightStore::Decoded,
            },
            s => s,
        };
        let label = src.label();
        match store {
            WeightStore::Packed => {
                let what = format!("holding the weights packed as stored (decoded as {} they would take {})", T::NAME, crate::memory::human(decoded));
                crate::memory::check_fits(&label, &what, src.n_bytes()?)?
            }
            _ => {
                let packed = crate::memory::human(src.n_bytes()?);
                let what = format!("holding the weights as {} ({WEIGHTS_ENV}=packed would hold them in {packed}, decoding rows as they are used)", T::NAME);
                crate::memory::check_fits(&label, &what, decoded)?
            }
        }
        let l = Loader { src, packed: store == WeightStore::Packed };
        let s = &spec;
        let (d, hd) = (s.n_embd, s.head_dim);
        let tok_embd = l.mat("token_embd.weight", s.n_vocab, d)?;
        let output_norm = l.vec("output_norm.weight", d)?;
        let output = if s.tied_output { None } else { Some(l.mat("output.weight", s.n_vocab, d)?) };
        crate::loader::check_layers_backed(src, s.n_layer)?;
        let layers = (0..s.n_layer)
            .into_par_iter()
            .map(|i| -> Result<Layer<T>> {
                let n = |t: &str| format!("blk.{i}.{t}");
                let BlockKind::Attention(a) = s.layers[i].block;
                let (q_dim, kv_dim) = (a.q_dim(), a.kv_dim());
                let ffn = match &s.moe {
                    None => Ffn::Dense(DenseFfn {
                        gate: l.mat(&n("ffn_gate.weight"), s.n_ff, d)?,
                        up: l.mat(&n("ffn_up.weight"), s.n_ff, d)?,
                        down: l.mat(&n("ffn_down.weight"), d, s.n_ff)?,
                        bias: None,
                    }),
                    Some(m) => {
                        let gates = l.experts(&n("ffn_gate_exps.weight"), m.n_expert, m.expert_ffn, d)?;
                        let ups = l.experts(&n("ffn_up_exps.weight"), m.n_expert, m.expert_ffn, d)?;
                        let downs = l.experts(&n("ffn_down_exps.weight"), m.n_expert, d, m.expert_ffn)?;
                        let mut biases: Vec<Option<[Vec<T>; 3]>> = match m.biases {
                            true => {
                                let g = l.expert_vecs(&n("ffn_gate_exps.bias"), m.n_expert, m.expert_ffn)?;
                                let u = l.expert_vecs(&n("ffn_up_exps.bias"), m.n_expert, m.expert_ffn)?;
                                let dn = l.expert_vecs(&n("ffn_down_exps.bias"), m.n_expert, d)?;
                                g.into_iter().zip(u).zip(dn).map(|((g, u), dn)| Some([g, u, dn])).collect()
                            }
                            false => Vec::new(),
                        };
                        biases.resize_with(m.n_expert, || None);
                        let experts = gates.into_iter().zip(ups).zip(downs).zip(biases).map(|(((gate, up), down), bias)| DenseFfn { gate, up, down, bias }).collect();
                        let shared = match m.shared_ffn {
                            Some(f) => Some(DenseFfn {
                                gate: l.mat(&n("ffn_gate_shexp.weight"), f, d)?,
                                up: l.mat(&n("ffn_up_shexp.weight"), f, d)?,
                                down: l.mat(&n("ffn_down_shexp.weight"), d, f)?,
                                bias: None,
                            }),
                            None => None,
                        };
                        let shared_gate = if m.shared_gate { Some(l.mat(&n("ffn_gate_inp_shexp.weight"), 1, d)?) } else { None };
                        let router_bias = if m.biases { Some(l.vec(&n("ffn_gate_inp.bias"), m.n_expert)?) } else { None };
                        Ffn::Moe { router: l.mat(&n("ffn_gate_inp.weight"), m.n_expert, d)?, router_bias, experts, shared, shared_gate }
                    }
                };
                Ok(Layer {
                    attn_norm: l.vec(&n("attn_norm.weight"), d)?,
                    wq: l.mat(&n("attn_q.weight"), q_dim, d)?,
                    wk: l.mat(&n("attn_k.weight"), kv_dim, d)?,
                    wv: l.mat(&n("attn_v.weight"), kv_dim, d)?,
                    wo: l.mat(&n("attn_output.weight"), d, q_dim)?,
                    bq: if s.qkv_bias { Some(l.vec(&n("attn_q.bias"), q_dim)?) } else { None },
                    bk: if s.qkv_bias { Some(l.vec(&n("attn_k.bias"), kv_dim)?) } else { None },
                    bv: if s.qkv_bias { Some(l.vec(&n("attn_v.bias"), kv_dim)?) } else { None },
                    bo: if s.out_bias { Some(l.vec(&n("attn_output.bias"), d)?) } else { None },
                    q_norm: if s.qk_norm { Some(l.vec(&n("attn_q_norm.weight"), hd)?) } else { None },
                    k_norm: if s.qk_norm { Some(l.vec(&n("attn_k_norm.weight"), hd)?) } else { None },
                    ffn_norm: l.vec(&n("ffn_norm.weight"), d)?,
                    post_norms: if s.post_norms {
                        Some([
                            l.vec(&n("post_attention_norm.weight"), d)?,
                            l.vec(&n("post_ffw_norm.weight"), d)?,
                        ])
                    } else {
                        None
                    },
                    sinks: if s.attn_sinks {
                        Some(l.vec(&n("attn_sinks.weight"), a.n_head)?)
                    } else {
                        None
                    },
                    ffn,
                })
            })
            // Every layer's result, then the first error in layer order: the same message
            // whichever thread finished first.
            .collect::<Vec<Result<Layer<T>>>>()
            .into_iter()
            .collect::<Result<Vec<_>>>()?;
        Ok(Model { spec, store, tok_embd, output_norm, output, layers })
    }

    /// Bytes of weights read to produce one token's logits (all matrices + norms, one embedding row).
    pub fn weight_bytes_per_token(&self) -> usize {
        let sz = std::mem::size_of::<T>();
        let mut b = self.output.as_ref().unwrap_or(&self.tok_embd).n_bytes() + self.spec.n_embd * sz * 2;
        for l in &self.layers {
            b += l.wq.n_bytes() + l.wk.n_bytes() + l.wv.n_bytes() + l.wo.n_bytes();
            b += match &l.ffn {
                Ffn::Dense(f) => f.gate.n_bytes() + f.up.n_bytes() + f.down.n_bytes(),
                Ffn::Moe { router, experts, shared, .. } => {
                    let k = self.spec.moe.as_ref().map_or(0, |m| m.n_expert_used);
                    let e = experts.first().map_or(0, |f| f.gate.n_bytes() + f.up.n_bytes() + f.down.n_bytes());
                    router.n_bytes() + k * e + shared.as_ref().map_or(0, |f| f.gate.n_bytes() + f.up.n_bytes() + f.down.n_bytes())
                }
            };
        }
        b
    }

    pub fn new_cache(&self) -> Cache<T> {
        Cache::new(&self.spec)
    }

    /// Runs `tokens` at positions `cache.len ..`, appends their keys/values to the cache, and
    /// returns the logits of every token: `[tokens.len(), n_vocab]`.
    pub fn forward(&self, tokens: &[u32], cache: &mut Cache<T>, taps: &mut dyn Tap) -> Result<Vec<T>> {
        self.forward_impl(tokens, cache, taps, true)
    }

    /// Like `forward` but computes logits only for the last token: `[n_vocab]`.
    pub fn forward_last(&self, tokens: &[u32], cache: &mut Cache<T>, taps: &mut dyn Tap) -> Result<Vec<T>> {
        self.forward_impl(tokens, cache, taps, false)
    }

    fn forward_impl(&self, tokens: &[u32], cache: &mut Cache<T>, taps: &mut dyn Tap, all_logits: bool) -> Result<Vec<T>> {
        // Called from outside the thread pool, every parallel op of the step would hand its work
        // to the pool and wait to be woken (two wake-ups per op, some 150 per decode step on
        // SmolLM2). Untapped, the whole step runs on one of the pool's threads instead, which
        // does its share of each op and wakes only the others. The results are the same bits.
        if !taps.enabled() && rayon::current_thread_index().is_none() {
            return rayon::scope(|_| self.forward_steps(tokens, cache, &mut NoTap, all_logits));
        }
        self.forward_steps(tokens, cache, taps, all_logits)
    }

    fn forward_steps(&self, tokens: &[u32], cache: &mut Cache<T>, taps: &mut dyn Tap, all_logits: bool) -> Result<Vec<T>> {
        let s = &self.spec;
        let m = tokens.len();
        if m == 0 {
            return Err(OracleError::Shape("forward: no tokens".into()));
        }
        let start = cache.len;
        let positions: Vec<usize> = (start..start + m).collect();
        let d = s.n_embd;

        // x: [m, d]
        let mut x = ops::embed(&self.tok_embd, tokens)?;
        if let Some(scale) = s.embd_scale {
            x.iter_mut().for_each(|v| *v = T::from_f64(v.to_f64() * scale));
        }
        tap(taps, &TapName::model(TapKind::InpEmbd).to_string(), start, m, d, &mut x);

        for (li, layer) in self.layers.iter().enumerate() {
            let name = |t: &str| format!("blk.{li}.{t}");
            let tap_name = |k: TapKind| TapName::layer(li, k).to_string();
            let mut h = Vec::new(); // normed input of the current sub-block
            let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
            let mut attn = Vec::new();
            let mut ffn_out = Vec::new();
            let BlockKind::Attention(a) = s.layers[li].block;
            let (hd, q_dim, kv_dim) = (a.head_dim, a.q_dim(), a.kv_dim());
            for stage in &s.layers[li].stages {
                match stage {
                    Stage::AttnNorm => {
                        h = ops::rms_norm(&x, d, Some(&layer.attn_norm), s.norm_eps)?;
                        tap(taps, &tap_name(TapKind::AttnNorm), start, m, d, &mut h);
                    }
                    Stage::QkvProj => {
                        // q: [m, n_head*hd], k, v: [m, n_head_kv*hd]
                        let mut qkv = products(taps, &h, m, &[(&layer.wq, &name("attn_q.weight")), (&layer.wk, &name("attn_k.weight")), (&layer.wv, &name("attn_v.weight"))])?.into_iter();
                        (q, k, v) = (qkv.next().unwrap_or_default(), qkv.next().unwrap_or_default(), qkv.next().unwrap_or_default());
                        if let (Some(bq), Some(bk), Some(bv)) = (&layer.bq, &layer.bk, &layer.bv) {
                            ops::add_bias(&mut q, bq)?;
                            ops::add_bias(&mut k, bk)?;
                            ops::add_bias(&mut v, bv)?;
                        }
                        tap(taps, &tap_name(TapKind::AttnQ), start, m, q_dim, &mut q);
                        tap(taps, &tap_name(TapKind::AttnK), start, m, kv_dim, &mut k);
                        tap(taps, &tap_name(TapKind::AttnV), start, m, kv_dim, &mut v);
                    }
                    Stage::QkNorm => {
                        // Per-head RMSNorm over head_dim (Qwen3).
                        let qn = layer.q_norm.as_deref().ok_or_else(|| OracleError::Spec("qk_norm without attn_q_norm".into()))?;
                        let kn = layer.k_norm.as_deref().ok_or_else(|| OracleError::Spec("qk_norm without attn_k_norm".into()))?;
                        q = ops::rms_norm(&q, hd, Some(qn), s.norm_eps)?;
                        k = ops::rms_norm(&k, hd, Some(kn), s.norm_eps)?;
                        tap(taps, &tap_name(TapKind::AttnQNorm), start, m, q_dim, &mut q);
                        tap(taps, &tap_name(TapKind::AttnKNorm), start, m, kv_dim, &mut k);
                    }
                    Stage::Rope => {
                        ops::rope(&mut q, &positions, a.n_head, hd, s.rope_of(&a))?;
                        ops::rope(&mut k, &positions, a.n_head_kv, hd, s.rope_of(&a))?;
                        tap(taps, &tap_name(TapKind::AttnQRope), start, m, q_dim, &mut q);
                        tap(taps, &tap_name(TapKind::AttnKRope), start, m, kv_dim, &mut k);
                    }
                    Stage::Attention => {
                        // Append this call's keys/values at positions start.. (cache: [len, kv_dim]).
                        let LayerState::Kv { k: kc, v: vc } = &mut cache.layers[li];
                        kc.truncate(start * kv_dim);
                        vc.truncate(start * kv_dim);
                        kc.extend_from_slice(&k);
                        vc.extend_from_slice(&v);
                        let sinks: Option<Vec<f64>> = layer
                            .sinks
                            .as_ref()
                            .map(|v| v.iter().map(|x| x.to_f64()).collect());
                        let params = AttentionParams {
                            n_head: a.n_head,
                            n_head_kv: a.n_head_kv,
                            head_dim: hd,
                            scale: s.attn_scale,
                            window: a.window,
                            sinks: sinks.as_deref(),
                            softcap: s.attn_softcap,
                        };
                        attn = ops::attention_with(
                            &q,
                            &positions,
                            kc,
                            vc,
                            start + m,
                            &params,
                            taps.attention_weights(),
                        )?;
                        tap(
                            taps,
                            &tap_name(TapKind::AttnKqv),
                            start,
                            m,
                            q_dim,
                            &mut attn,
                        );
                    }
                    Stage::AttnOutProj => {
                        attn = ops::matmul(&product_input(taps, &name("attn_output.weight"), layer.wo.cols, &attn), m, &layer.wo)?;
                        if let Some(bo) = &layer.bo {
                            ops::add_bias(&mut attn, bo)?;
                        }
                        tap(taps, &tap_name(TapKind::AttnOut), start, m, d, &mut attn);
                    }
                    Stage::AttnPostNorm => {
                        let w = layer.post_norms.as_ref().ok_or_else(|| OracleError::Spec("post-norm stage without post_attention_norm".into()))?;
                        attn = ops::rms_norm(&attn, d, Some(&w[0]), s.norm_eps)?;
                        tap(taps, &tap_name(TapKind::AttnPostNorm), start, m, d, &mut attn);
                    }
                    Stage::FfnPostNorm => {
                        let w = layer.post_norms.as_ref().ok_or_else(|| OracleError::Spec("post-norm stage without post_ffw_norm".into()))?;
                        ffn_out = ops::rms_norm(&ffn_out, d, Some(&w[1]), s.norm_eps)?;
                        tap(taps, &tap_name(TapKind::FfnPostNorm), start, m, d, &mut ffn_out);
                    }
                    Stage::AttnResidual => {
                        x = ops::add(&x, &attn)?;
                        tap(taps, &tap_name(TapKind::FfnInp), start, m, d, &mut x);
                    }
                    Stage::FfnNorm => {
                        h = ops::rms_norm(&x, d, Some(&layer.ffn_norm), s.norm_eps)?;
                        tap(taps, &tap_name(TapKind::FfnNorm), start, m, d, &mut h);
                    }
                    Stage::DenseFfn => {
                        let Ffn::Dense(f) = &layer.ffn else {
                            return Err(OracleError::Spec(format!("layer {li}: dense FFN stage but MoE weights")));
                        };
                        ffn_out = self.dense_ffn(f, &h, m, taps, li, FfnKind::Layer { start })?;
                        tap(taps, &tap_name(TapKind::FfnOut), start, m, d, &mut ffn_out);
                    }
                    Stage::MoeFfn => {
                        ffn_out = self.moe_ffn(layer, &h, m, taps, li, start)?;
                        tap(taps, &tap_name(TapKind::FfnOut), start, m, d, &mut ffn_out);
                    }
                    Stage::FfnResidual => {
                        x = ops::add(&x, &ffn_out)?;
                        tap(taps, &tap_name(TapKind::LOut), start, m, d, &mut x);
                    }
                }
            }
        }
        cache.len = start + m;

        // Only the rows whose logits are wanted go through the final norm and output head.
        let (rows, row0) = if all_logits { (m, 0) } else { (1, m - 1) };
        let xs = &x[row0 * d..];
        let mut normed = ops::rms_norm(xs, d, Some(&self.output_norm), s.norm_eps)?;
        tap(taps, &TapName::model(TapKind::ResultNorm).to_string(), start + row0, rows, d, &mut normed);
        let (head, head_name) = match &self.output {
            Some(o) => (o, "output.weight"),
            None => (&self.tok_embd, "token_embd.weight"),
        };
        let mut logits = ops::matmul(&product_input(taps, head_name, d, &normed), rows, head)?;
        if let Some(c) = s.final_softcap {
            logits.iter_mut().for_each(|l| *l = T::from_f64(c * (l.to_f64() / c).tanh()));
        }
        tap(taps, &TapName::model(TapKind::ResultOutput).to_string(), start + row0, rows, s.n_vocab, &mut logits);
        Ok(logits)
    }

    fn dense_ffn(&self, f: &DenseFfn<T>, h: &[T], m: usize, taps: &mut dyn Tap, li: usize, kind: FfnKind) -> Result<Vec<T>> {
        let suffix = match kind {
            FfnKind::Layer { .. } => "",
            FfnKind::Expert => "_exps",
            FfnKind::Shared => "_shexp",
        };
        let weight = |p: &str| format!("blk.{li}.ffn_{p}{suffix}.weight");
        let mut gate_up = products(taps, h, m, &[(&f.gate, &weight("gate")), (&f.up, &weight("up"))])?.into_iter();
        let (mut gate, mut up) = (gate_up.next().unwrap_or_default(), gate_up.next().unwrap_or_default());
        if let Some([bg, bu, _]) = &f.bias {
            ops::add_bias(&mut gate, bg)?;
            ops::add_bias(&mut up, bu)?;
        }
        let w = f.gate.rows;
        if let FfnKind::Layer { start } = kind {
            tap(taps, &TapName::layer(li, TapKind::FfnGate).to_string(), start, m, w, &mut gate);
            tap(taps, &TapName::layer(li, TapKind::FfnUp).to_string(), start, m, w, &mut up);
        }
        let mut act = match self.spec.activation {
            Activation::Silu => ops::swiglu(&gate, &up)?,
            Activation::GeluTanh => ops::geglu(&gate, &up)?,
            Activation::SwigluOai => ops::swiglu_oai(&gate, &up)?,
        };
        if let FfnKind::Layer { start } = kind {
            tap(taps, &TapName::layer(li, TapKind::FfnAct).to_string(), start, m, w, &mut act);
        }
        let mut down = ops::matmul(&product_input(taps, &weight("down"), f.down.cols, &act), m, &f.down)?;
        if let Some([_, _, bd]) = &f.bias {
            ops::add_bias(&mut down, bd)?;
        }
        Ok(down)
    }

    fn moe_ffn(&self, layer: &Layer<T>, h: &[T], m: usize, taps: &mut dyn Tap, li: usize, start: usize) -> Result<Vec<T>> {
        let Ffn::Moe { router, router_bias, experts, shared, shared_gate } = &layer.ffn else {
            return Err(OracleError::Spec(format!("layer {li}: MoE stage but dense weights")));
        };
        let ms = self.spec.moe.as_ref().ok_or_else(|| OracleError::Spec("MoE stage without MoE spec".into()))?;
        let d = self.spec.n_embd;
        let mut out = vec![T::default(); m * d];
        let mut probs_tap = Vec::with_capacity(m * ms.n_expert);
        let mut topk_tap = Vec::with_capacity(m * ms.n_expert_used);
        let topk_name = TapName::layer(li, TapKind::FfnMoeTopk).to_string();
        let mut buf = RowBuf::default();
        for t in 0..m {
            let ht = &h[t * d..(t + 1) * d];
            // Router logits stay in f64: the expert choice is a discrete result and must not be
            // decided by a rounding of the oracle's own.
            let hr = product_input(taps, &format!("blk.{li}.ffn_gate_inp.weight"), d, ht);
            let mut logits: Vec<f64> = (0..router.rows).map(|e| T::dot(&hr, router.row(e, &mut buf))).collect();
            if let Some(b) = router_bias {
                logits.iter_mut().zip(b).for_each(|(l, b)| *l += b.to_f64());
            }
            let mut r = ops::moe_route(&logits, ms.n_expert_used, ms.gating, ms.normalize_topk);
            if taps.enabled() {
                if let Some(forced) = taps.route(&topk_name, start + t, &r.probs, &r.experts) {
                    r = r.with_experts(forced, ms.normalize_topk).map_err(|e| OracleError::Shape(format!("{topk_name} at position {}: {e}", start + t)))?;
                }
            }
            probs_tap.extend(r.probs.iter().map(|p| *p as f32));
            topk_tap.extend(r.experts.iter().map(|e| *e as f32));
            let mut acc = vec![0.0f64; d];
            for (&e, &w) in r.experts.iter().zip(&r.weights) {
                let y = self.dense_ffn(&experts[e], ht, 1, taps, li, FfnKind::Expert)?;
                for i in 0..d {
                    acc[i] += w * y[i].to_f64();
                }
            }
            if let Some(sf) = shared {
                let y = self.dense_ffn(sf, ht, 1, taps, li, FfnKind::Shared)?;
                let g = match shared_gate {
                    Some(gm) => 1.0 / (1.0 + (-T::dot(&product_input(taps, &format!("blk.{li}.ffn_gate_inp_shexp.weight"), d, ht), gm.row(0, &mut buf))).exp()),
                    None => 1.0,
                };
                for i in 0..d {
                    acc[i] += g * y[i].to_f64();
                }
            }
            for i in 0..d {
                out[t * d + i] = T::from_f64(acc[i]);
            }
        }
        if taps.enabled() {
            taps.record(&TapName::layer(li, TapKind::FfnMoeProbs).to_string(), start, m, ms.n_expert, &probs_tap);
            taps.record(&topk_name, start, m, ms.n_expert_used, &topk_tap);
        }
        Ok(out)
    }
}
