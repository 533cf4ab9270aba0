//! The one forward interpreter: runs any `ModelSpec` (Llama, Qwen2, Qwen3, MoE) over its weights,
//! for prefill, incremental decode and append-prefill against a KV cache, recording every named
//! intermediate ("tap", llama.cpp naming) when asked.

use crate::error::{OracleError, Result};
use crate::loader::TensorSource;
use crate::ops::{self, AttentionParams, Mat, RowBuf};
use crate::real::Real;
use crate::spec::{Activation, BlockKind, ModelSpec, SsmBlock, SsmKind, Stage};
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
    /// MoE routing (tap `name`, `blk.L.ffn_moe_topk`): having scored, ranked and chosen the
    /// experts for the token at `pos` (`routing`: its chosen experts best first), the
    /// interpreter routes it to the experts this returns instead. Layer-diff uses it to follow a device's choice where the two
    /// differ only at a near tie. None keeps the interpreter's own choice.
    fn route(&mut self, _name: &str, _pos: usize, _routing: &crate::ops::Routing) -> Option<Vec<usize>> {
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

/// Columns `from..from + width` of every row of `x` (rows of `row` values).
fn columns<T: Copy>(x: &[T], row: usize, from: usize, width: usize) -> Vec<T> {
    x.chunks_exact(row).flat_map(|r| r[from..from + width].iter().copied()).collect()
}

/// A gated DeltaNet's input projections as one row a position, as the tap `ssm_in` holds it
/// ([`SsmBlock::in_dim`]): q/k/v, z, then b and a each in value-head order, from the stored b/a
/// projection's rows (per key head: its value heads' b, then their a).
fn delta_in_rows<T: Copy>(b: &SsmBlock, qkv: &[T], z: &[T], ba: &[T], m: usize) -> Vec<T> {
    let (cd, di, nh) = (b.conv_dim(), b.d_inner, b.n_head);
    let per_group = nh / b.n_group.max(1);
    let mut out = Vec::with_capacity(m * b.in_dim());
    for t in 0..m {
        out.extend_from_slice(&qkv[t * cd..(t + 1) * cd]);
        out.extend_from_slice(&z[t * di..(t + 1) * di]);
        let row = &ba[t * 2 * nh..(t + 1) * 2 * nh];
        for part in 0..2 {
            out.extend((0..nh).map(|h| row[(h / per_group) * 2 * per_group + part * per_group + h % per_group]));
        }
    }
    out
}

/// A state-space layer's state is as of position `at`; a call must continue from there (it
/// cannot be cut back as keys and values can).
fn check_ssm_position(li: usize, at: usize, start: usize) -> Result<()> {
    if at != start {
        return Err(OracleError::Shape(format!(
            "layer {li}: a state-space layer's state is as of position {at}; it cannot continue from position {start} (a recurrent state is not cut back to an earlier position: start again from an empty cache)"
        )));
    }
    Ok(())
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
    /// A state-space layer's convolution inputs of the last `d_conv - 1` positions
    /// (`[d_conv - 1, conv_dim]`, zeros before the first) and its recurrent state
    /// (`[n_head, head_dim, d_state]`), both as of position `at`: unlike keys and values they
    /// cannot be cut back to an earlier position.
    Ssm { conv: Vec<T>, state: Vec<T>, at: usize },
    /// A latent-attention layer's normed latents (`[len, kv_lora_rank]`) and shared rotated
    /// keys (`[len, qk_rope]`): what it expands its keys and values from.
    Latent { latent: Vec<T>, k_pe: Vec<T> },
}

/// Every layer's state and the positions it holds.
pub struct Cache<T> {
    pub layers: Vec<LayerState<T>>,
    pub len: usize,
}

impl<T: Real> Cache<T> {
    /// An empty state for each layer of `spec`.
    pub fn new(spec: &ModelSpec) -> Self {
        let layers = spec.layer_states(
            |_| LayerState::Kv { k: Vec::new(), v: Vec::new() },
            |b| LayerState::Ssm { conv: vec![T::default(); (b.d_conv - 1) * b.conv_dim()], state: vec![T::default(); b.state_len()], at: 0 },
            |_| LayerState::Latent { latent: Vec::new(), k_pe: Vec::new() },
        );
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

/// Layer `i`'s experts, router and shared expert (`m`'s).
fn moe_weights<T: Real>(l: &Loader<'_>, i: usize, m: &crate::spec::MoeSpec, d: usize) -> Result<Ffn<T>> {
    let n = |t: &str| format!("blk.{i}.{t}");
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
    let choice_bias = if m.choice_bias { Some(l.vec(&n("exp_probs_b.bias"), m.n_expert)?) } else { None };
    Ok(Ffn::Moe { router: l.mat(&n("ffn_gate_inp.weight"), m.n_expert, d)?, router_bias, experts, shared, shared_gate, choice_bias })
}

mod loader;
mod weights;
pub use weights::{AttnWeights, DenseFfn, Ffn, Layer, MlaWeights, Mixer, SsmWeights};
use loader::Loader;

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
                let has_ffn = s.layers[i].stages.iter().any(|st| matches!(st, Stage::DenseFfn | Stage::MoeFfn));
                let dense = s.layers[i].stages.contains(&Stage::DenseFfn);
                let ffn = match &s.moe {
                    _ if !has_ffn => None,
                    Some(m) if !dense => Some(moe_weights(&l, i, m, d)?),
                    _ => Some(Ffn::Dense(DenseFfn {
                        gate: l.mat(&n("ffn_gate.weight"), s.n_ff, d)?,
                        up: l.mat(&n("ffn_up.weight"), s.n_ff, d)?,
                        down: l.mat(&n("ffn_down.weight"), d, s.n_ff)?,
                        bias: None,
                    })),
                };
                let mixer = match s.layers[i].block {
                    BlockKind::Attention(a) => {
                        let (q_dim, kv_dim) = (a.q_dim(), a.kv_dim());
                        // With an output gate, each head's query rows then its gate's.
                        let q_rows = if s.attn_gate { 2 * q_dim } else { q_dim };
                        Mixer::Attention(AttnWeights {
                            wq: l.mat(&n("attn_q.weight"), q_rows, d)?,
                            wk: l.mat(&n("attn_k.weight"), kv_dim, d)?,
                            wv: l.mat(&n("attn_v.weight"), kv_dim, d)?,
                            wo: l.mat(&n("attn_output.weight"), d, q_dim)?,
                            bq: if s.qkv_bias { Some(l.vec(&n("attn_q.bias"), q_dim)?) } else { None },
                            bk: if s.qkv_bias { Some(l.vec(&n("attn_k.bias"), kv_dim)?) } else { None },
                            bv: if s.qkv_bias { Some(l.vec(&n("attn_v.bias"), kv_dim)?) } else { None },
                            bo: if s.out_bias { Some(l.vec(&n("attn_output.bias"), d)?) } else { None },
                            q_norm: if s.qk_norm { Some(l.vec(&n("attn_q_norm.weight"), hd)?) } else { None },
                            k_norm: if s.qk_norm { Some(l.vec(&n("attn_k_norm.weight"), hd)?) } else { None },
                            sinks: if s.attn_sinks { Some(l.vec(&n("attn_sinks.weight"), a.n_head)?) } else { None },
                        })
                    }
                    BlockKind::Mla(b) => {
                        let q_a = match b.q_lora_rank {
                            0 => None,
                            r => Some((l.mat(&n("attn_q_a.weight"), r, d)?, l.vec(&n("attn_q_a_norm.weight"), r)?)),
                        };
                        let q = match b.q_lora_rank {
                            0 => l.mat(&n("attn_q.weight"), b.q_dim(), d)?,
                            r => l.mat(&n("attn_q_b.weight"), b.q_dim(), r)?,
                        };
                        Mixer::Mla(MlaWeights {
                            q_a,
                            q,
                            kv_a: l.mat(&n("attn_kv_a_mqa.weight"), b.kv_a_dim(), d)?,
                            kv_a_norm: l.vec(&n("attn_kv_a_norm.weight"), b.kv_lora_rank)?,
                            kv_b: l.mla_kv_b(i, &b)?,
                            wo: l.mat(&n("attn_output.weight"), d, b.out_dim())?,
                        })
                    }
                    BlockKind::Ssm(b) if b.kind == SsmKind::GatedDelta => Mixer::Ssm(SsmWeights {
                        in_proj: l.mat(&n("attn_qkv.weight"), b.conv_dim(), d)?,
                        gate_proj: Some(l.mat(&n("attn_gate.weight"), b.d_inner, d)?),
                        ba_proj: Some(l.mat(&n("ssm_ba.weight"), 2 * b.n_head, d)?),
                        conv: l.shaped(&n("ssm_conv1d.weight"), &[b.d_conv, b.conv_dim()])?,
                        conv_bias: vec![T::default(); b.conv_dim()],
                        dt_bias: l.vec(&n("ssm_dt.bias"), b.n_head)?,
                        a: l.vec(&n("ssm_a"), b.n_head)?,
                        d: Vec::new(),
                        norm: l.vec(&n("ssm_norm.weight"), b.head_dim())?,
                        out: l.mat(&n("ssm_out.weight"), d, b.d_inner)?,
                    }),
                    BlockKind::Ssm(b) => Mixer::Ssm(SsmWeights {
                        in_proj: l.mat(&n("ssm_in.weight"), b.in_dim(), d)?,
                        gate_proj: None,
                        ba_proj: None,
                        conv: l.shaped(&n("ssm_conv1d.weight"), &[b.d_conv, b.conv_dim()])?,
                        conv_bias: l.vec(&n("ssm_conv1d.bias"), b.conv_dim())?,
                        dt_bias: l.vec(&n("ssm_dt.bias"), b.n_head)?,
                        a: l.vec(&n("ssm_a"), b.n_head)?,
                        d: l.vec(&n("ssm_d"), b.n_head)?,
                        norm: l.shaped(&n("ssm_norm.weight"), &[b.d_inner / b.n_group, b.n_group])?,
                        out: l.mat(&n("ssm_out.weight"), d, b.d_inner)?,
                    }),
                };
                Ok(Layer {
                    attn_norm: l.vec(&n("attn_norm.weight"), d)?,
                    mixer,
                    ffn_norm: if has_ffn { l.vec(&n("ffn_norm.weight"), d)? } else { Vec::new() },
                    post_norms: if s.post_norms {
                        Some([
                            l.vec(&n("post_attention_norm.weight"), d)?,
                            l.vec(&n("post_ffw_norm.weight"), d)?,
                        ])
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
            b += match &l.mixer {
                Mixer::Attention(w) => w.wq.n_bytes() + w.wk.n_bytes() + w.wv.n_bytes() + w.wo.n_bytes(),
                Mixer::Ssm(w) => w.in_proj.n_bytes() + w.gate_proj.as_ref().map_or(0, Mat::n_bytes) + w.ba_proj.as_ref().map_or(0, Mat::n_bytes) + w.out.n_bytes() + (w.conv.len() + w.conv_bias.len()) * sz,
                Mixer::Mla(w) => w.q_a.as_ref().map_or(0, |(a, _)| a.n_bytes()) + w.q.n_bytes() + w.kv_a.n_bytes() + w.kv_b.n_bytes() + w.wo.n_bytes(),
            };
            b += match &l.ffn {
                None => 0,
                Some(Ffn::Dense(f)) => f.gate.n_bytes() + f.up.n_bytes() + f.down.n_bytes(),
                Some(Ffn::Moe { router, experts, shared, .. }) => {
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
            // The layer's block and weights, by kind: a stage of the other kind is an error.
            let attn_parts = match (&s.layers[li].block, &layer.mixer) {
                (BlockKind::Attention(a), Mixer::Attention(w)) => Some((*a, w)),
                _ => None,
            };
            let ssm_parts = match (&s.layers[li].block, &layer.mixer) {
                (BlockKind::Ssm(b), Mixer::Ssm(w)) => Some((*b, w)),
                _ => None,
            };
            let mla_parts = match (&s.layers[li].block, &layer.mixer) {
                (BlockKind::Mla(b), Mixer::Mla(w)) => Some((*b, w)),
                _ => None,
            };
            let mut latent = Vec::new();
            let wrong_kind = |what: &str| OracleError::Spec(format!("layer {li}: {what} stage in a layer of another kind"));
            let (hd, q_dim, kv_dim) = attn_parts.map_or((0, 0, 0), |(a, _)| (a.head_dim, a.q_dim(), a.kv_dim()));
            let (mut zx, mut xbc, mut y) = (Vec::new(), Vec::new(), Vec::new());
            let mut gate = Vec::new();
            for stage in &s.layers[li].stages {
                // A latent-attention layer's own projections, rotation and attention.
                if let Some((b, w)) = mla_parts {
                    match stage {
                        Stage::QkvProj => {
                            let (q_in, q_name) = match &w.q_a {
                                Some((qa, norm)) => {
                                    let a = ops::matmul(&product_input(taps, &name("attn_q_a.weight"), qa.cols, &h), m, qa)?;
                                    let mut a = ops::rms_norm(&a, qa.rows, Some(norm), s.norm_eps)?;
                                    tap(taps, &tap_name(TapKind::AttnQA), start, m, qa.rows, &mut a);
                                    (a, "attn_q_b.weight")
                                }
                                None => (h.clone(), "attn_q.weight"),
                            };
                            q = ops::matmul(&product_input(taps, &name(q_name), w.q.cols, &q_in), m, &w.q)?;
                            tap(taps, &tap_name(TapKind::AttnQ), start, m, b.q_dim(), &mut q);
                            let kv_a = ops::matmul(&product_input(taps, &name("attn_kv_a_mqa.weight"), w.kv_a.cols, &h), m, &w.kv_a)?;
                            latent = ops::rms_norm(&columns(&kv_a, b.kv_a_dim(), 0, b.kv_lora_rank), b.kv_lora_rank, Some(&w.kv_a_norm), s.norm_eps)?;
                            k = columns(&kv_a, b.kv_a_dim(), b.kv_lora_rank, b.qk_rope);
                            tap(taps, &tap_name(TapKind::AttnKvA), start, m, b.kv_lora_rank, &mut latent);
                            tap(taps, &tap_name(TapKind::AttnK), start, m, b.qk_rope, &mut k);
                            continue;
                        }
                        Stage::Rope => {
                            ops::mla_rope_heads(&mut q, &positions, &b, &s.rope)?;
                            ops::rope(&mut k, &positions, 1, b.qk_rope, &s.rope)?;
                            tap(taps, &tap_name(TapKind::AttnQRope), start, m, b.q_dim(), &mut q);
                            tap(taps, &tap_name(TapKind::AttnKRope), start, m, b.qk_rope, &mut k);
                            continue;
                        }
                        Stage::Attention => {
                            let LayerState::Latent { latent: lc, k_pe: kc } = &mut cache.layers[li] else {
                                return Err(wrong_kind("a latent-attention"));
                            };
                            lc.truncate(start * b.kv_lora_rank);
                            kc.truncate(start * b.qk_rope);
                            lc.extend_from_slice(&latent);
                            kc.extend_from_slice(&k);
                            let (keys, values) = ops::mla_expand(lc, kc, start + m, &w.kv_b, &b)?;
                            let params = AttentionParams { n_head: b.n_head, n_head_kv: b.n_head, head_dim: b.qk_head_dim(), scale: s.attn_scale, window: None, sinks: None, softcap: None };
                            attn = ops::attention_values(&q, &positions, &keys, &values, start + m, &params, taps.attention_weights(), b.v_head_dim)?;
                            tap(taps, &tap_name(TapKind::AttnKqv), start, m, b.out_dim(), &mut attn);
                            continue;
                        }
                        Stage::AttnOutProj => {
                            attn = ops::matmul(&product_input(taps, &name("attn_output.weight"), w.wo.cols, &attn), m, &w.wo)?;
                            tap(taps, &tap_name(TapKind::AttnOut), start, m, d, &mut attn);
                            continue;
                        }
                        _ => {}
                    }
                }
                match stage {
                    Stage::AttnNorm => {
                        h = ops::rms_norm(&x, d, Some(&layer.attn_norm), s.norm_eps)?;
                        tap(taps, &tap_name(TapKind::AttnNorm), start, m, d, &mut h);
                    }
                    Stage::QkvProj => {
                        let (_, w) = attn_parts.ok_or_else(|| wrong_kind("an attention"))?;
                        // q: [m, n_head*hd], k, v: [m, n_head_kv*hd]
                        let mut qkv = products(taps, &h, m, &[(&w.wq, &name("attn_q.weight")), (&w.wk, &name("attn_k.weight")), (&w.wv, &name("attn_v.weight"))])?.into_iter();
                        (q, k, v) = (qkv.next().unwrap_or_default(), qkv.next().unwrap_or_default(), qkv.next().unwrap_or_default());
                        if s.attn_gate {
                            // Each head's query, then its gate.
                            let split = |part: usize| -> Vec<T> { q.chunks_exact(2 * hd).flat_map(|c| c[part * hd..(part + 1) * hd].iter().copied()).collect() };
                            (q, gate) = (split(0), split(1));
                            tap(taps, &tap_name(TapKind::AttnGate), start, m, q_dim, &mut gate);
                        }
                        if let (Some(bq), Some(bk), Some(bv)) = (&w.bq, &w.bk, &w.bv) {
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
                        let (_, w) = attn_parts.ok_or_else(|| wrong_kind("an attention"))?;
                        let qn = w.q_norm.as_deref().ok_or_else(|| OracleError::Spec("qk_norm without attn_q_norm".into()))?;
                        let kn = w.k_norm.as_deref().ok_or_else(|| OracleError::Spec("qk_norm without attn_k_norm".into()))?;
                        q = ops::rms_norm(&q, hd, Some(qn), s.norm_eps)?;
                        k = ops::rms_norm(&k, hd, Some(kn), s.norm_eps)?;
                        tap(taps, &tap_name(TapKind::AttnQNorm), start, m, q_dim, &mut q);
                        tap(taps, &tap_name(TapKind::AttnKNorm), start, m, kv_dim, &mut k);
                    }
                    Stage::Rope => {
                        let (a, _) = attn_parts.ok_or_else(|| wrong_kind("an attention"))?;
                        ops::rope(&mut q, &positions, a.n_head, hd, s.rope_of(&a))?;
                        ops::rope(&mut k, &positions, a.n_head_kv, hd, s.rope_of(&a))?;
                        tap(taps, &tap_name(TapKind::AttnQRope), start, m, q_dim, &mut q);
                        tap(taps, &tap_name(TapKind::AttnKRope), start, m, kv_dim, &mut k);
                    }
                    Stage::Attention => {
                        let (a, w) = attn_parts.ok_or_else(|| wrong_kind("an attention"))?;
                        // Append this call's keys/values at positions start.. (cache: [len, kv_dim]).
                        let LayerState::Kv { k: kc, v: vc } = &mut cache.layers[li] else {
                            return Err(wrong_kind("an attention"));
                        };
                        kc.truncate(start * kv_dim);
                        vc.truncate(start * kv_dim);
                        kc.extend_from_slice(&k);
                        vc.extend_from_slice(&v);
                        let sinks: Option<Vec<f64>> = w
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
                    Stage::AttnGate => {
                        if gate.len() != attn.len() {
                            return Err(OracleError::Spec(format!("layer {li}: an output-gate stage without the gate's projection")));
                        }
                        attn = attn.iter().zip(&gate).map(|(a, g)| T::from_f64(a.to_f64() / (1.0 + (-g.to_f64()).exp()))).collect();
                        tap(taps, &tap_name(TapKind::AttnGated), start, m, q_dim, &mut attn);
                    }
                    Stage::AttnOutProj => {
                        let (_, w) = attn_parts.ok_or_else(|| wrong_kind("an attention"))?;
                        attn = ops::matmul(&product_input(taps, &name("attn_output.weight"), w.wo.cols, &attn), m, &w.wo)?;
                        if let Some(bo) = &w.bo {
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
                        x = ops::add_scaled(&x, &attn, s.residual_scale.unwrap_or(1.0))?;
                        tap(taps, &tap_name(TapKind::FfnInp), start, m, d, &mut x);
                    }
                    Stage::FfnNorm => {
                        h = ops::rms_norm(&x, d, Some(&layer.ffn_norm), s.norm_eps)?;
                        tap(taps, &tap_name(TapKind::FfnNorm), start, m, d, &mut h);
                    }
                    Stage::DenseFfn => {
                        let Some(Ffn::Dense(f)) = &layer.ffn else {
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
                        x = ops::add_scaled(&x, &ffn_out, s.residual_scale.unwrap_or(1.0))?;
                        tap(taps, &tap_name(TapKind::LOut), start, m, d, &mut x);
                    }
                    Stage::MixerResidual => {
                        x = ops::add_scaled(&x, &attn, s.residual_scale.unwrap_or(1.0))?;
                        tap(taps, &tap_name(TapKind::LOut), start, m, d, &mut x);
                    }
                    Stage::SsmInProj => {
                        let (b, w) = ssm_parts.ok_or_else(|| wrong_kind("a state-space"))?;
                        zx = match (&w.gate_proj, &w.ba_proj) {
                            (Some(gp), Some(bap)) => {
                                let mut p = products(taps, &h, m, &[(&w.in_proj, &name("attn_qkv.weight")), (gp, &name("attn_gate.weight")), (bap, &name("ssm_ba.weight"))])?.into_iter();
                                let (qkv, z, ba) = (p.next().unwrap_or_default(), p.next().unwrap_or_default(), p.next().unwrap_or_default());
                                delta_in_rows(&b, &qkv, &z, &ba, m)
                            }
                            _ => ops::matmul(&product_input(taps, &name("ssm_in.weight"), w.in_proj.cols, &h), m, &w.in_proj)?,
                        };
                        tap(taps, &tap_name(TapKind::SsmIn), start, m, b.in_dim(), &mut zx);
                    }
                    Stage::SsmConv => {
                        let (b, w) = ssm_parts.ok_or_else(|| wrong_kind("a state-space"))?;
                        let LayerState::Ssm { conv, at, .. } = &mut cache.layers[li] else {
                            return Err(wrong_kind("a state-space"));
                        };
                        check_ssm_position(li, *at, start)?;
                        let cd = b.conv_dim();
                        let xin = columns(&zx, b.in_dim(), b.conv_at(), cd);
                        xbc = ops::ssm_conv(conv, &xin, m, cd, &w.conv, &w.conv_bias, b.d_conv)?;
                        // The history: the last d_conv - 1 inputs, this call's after the earlier ones.
                        let keep = conv.len();
                        let mut all = std::mem::take(conv);
                        all.extend_from_slice(&xin);
                        *conv = all.split_off(all.len() - keep);
                        tap(taps, &tap_name(TapKind::SsmConv), start, m, cd, &mut xbc);
                    }
                    Stage::SsmScan => {
                        let (b, w) = ssm_parts.ok_or_else(|| wrong_kind("a state-space"))?;
                        let LayerState::Ssm { state, at, .. } = &mut cache.layers[li] else {
                            return Err(wrong_kind("a state-space"));
                        };
                        check_ssm_position(li, *at, start)?;
                        let heads = |i: usize| columns(&zx, b.in_dim(), b.heads_at() + i * b.n_head, b.n_head);
                        let (out, mut states) = match b.kind {
                            SsmKind::Mamba2 => ops::ssm_scan(state, &ops::ScanInputs { xbc: &xbc, dt: &heads(0), dt_bias: &w.dt_bias, a: &w.a, d: &w.d }, m, &b, taps.enabled())?,
                            SsmKind::GatedDelta => ops::delta_scan(state, &ops::DeltaInputs { qkv: &xbc, b: &heads(0), a: &heads(1), dt_bias: &w.dt_bias, neg_a: &w.a }, m, &b, taps.enabled())?,
                        };
                        *at = start + m;
                        if taps.enabled() {
                            // The state after each position; a substituted value (isolated
                            // layer-diff) carries on as the state.
                            tap(taps, &tap_name(TapKind::SsmState), start, m, b.state_len(), &mut states);
                            state.copy_from_slice(&states[(m - 1) * b.state_len()..]);
                        }
                        y = out;
                        tap(taps, &tap_name(TapKind::SsmScan), start, m, b.d_inner, &mut y);
                    }
                    Stage::SsmNorm => {
                        let (b, w) = ssm_parts.ok_or_else(|| wrong_kind("a state-space"))?;
                        let z = columns(&zx, b.in_dim(), b.z_at(), b.d_inner);
                        y = match b.kind {
                            SsmKind::Mamba2 => ops::ssm_gated_norm(&y, &z, b.d_inner, b.n_group, &w.norm, s.norm_eps)?,
                            SsmKind::GatedDelta => ops::delta_gated_norm(&y, &z, b.head_dim(), &w.norm, s.norm_eps)?,
                        };
                        tap(taps, &tap_name(TapKind::SsmNorm), start, m, b.d_inner, &mut y);
                    }
                    Stage::SsmOutProj => {
                        let (_, w) = ssm_parts.ok_or_else(|| wrong_kind("a state-space"))?;
                        attn = ops::matmul(&product_input(taps, &name("ssm_out.weight"), w.out.cols, &y), m, &w.out)?;
                        tap(taps, &tap_name(TapKind::SsmOut), start, m, d, &mut attn);
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
        if let Some(c) = s.logit_scale {
            logits.iter_mut().for_each(|l| *l = T::from_f64(l.to_f64() / c));
        }
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
        let Some(Ffn::Moe { router, router_bias, experts, shared, shared_gate, choice_bias }) = &layer.ffn else {
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
            let bias: Option<Vec<f64>> = choice_bias.as_ref().map(|b| b.iter().map(|v| v.to_f64()).collect());
            let rule = ops::RouteRule { k: ms.n_expert_used, gating: ms.gating, normalize: ms.normalize_topk, choice_bias: bias.as_deref(), groups: ms.groups, scale: ms.weights_scale.unwrap_or(1.0) };
            let mut r = ops::moe_route_rule(&logits, &rule);
            if taps.enabled() {
                if let Some(forced) = taps.route(&topk_name, start + t, &r) {
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
