//! Products whose terms cancel and attention's sensitivity: the grants a tap's budget takes from the sizes of its terms.

use super::*;
use devices::Arithmetic;
use oracle::{ModelSpec, RecordingTap};

/// How many input rows of each matrix product [`term_scales`] measures (spread evenly over the
/// positions): the scales are ratios of RMS values, steady over a few dozen rows.
pub const TERM_SAMPLE_ROWS: usize = 32;

/// A sample of the input rows of the oracle's matrix products, by the matrix's GGUF name; for a
/// MoE layer's expert matrices (`blk.L.ffn_{gate,up,down}_exps.weight`, one token at a time),
/// each row with the expert it went to.
#[derive(Default, Debug)]
pub struct ProductRows {
    pub(crate) rows: std::collections::BTreeMap<String, (usize, Vec<f32>)>,
    pub(crate) experts: std::collections::BTreeMap<String, ExpertRows>,
    /// By layer: the experts the token now computed was routed to, and how many of their
    /// products of each kind (gate, up, down) the interpreter has asked for so far.
    pub(crate) routing: std::collections::BTreeMap<usize, (Vec<usize>, [usize; 3])>,
}

/// Rows of one stacked expert matrix's products, each with its expert, sampled evenly over the
/// run: every `stride`-th row is kept, and when more than [`TERM_SAMPLE_ROWS`] are kept every
/// other one is dropped and the stride doubled (the same rows for the same run).
#[derive(Default, Debug)]
pub(crate) struct ExpertRows {
    pub(crate) width: usize,
    pub(crate) seen: usize,
    pub(crate) stride: usize,
    pub(crate) rows: Vec<(usize, Vec<f32>)>,
}

impl ProductRows {
    /// The experts a token is routed to at MoE layer tap `name` (`blk.L.ffn_moe_topk`): its
    /// expert products that follow are theirs, in this order.
    pub fn routed(&mut self, name: &str, experts: &[usize]) {
        if let Some(TapName { layer: Some(layer), kind: TapKind::FfnMoeTopk }) = TapName::parse(name) {
            self.routing.insert(layer, (experts.to_vec(), [0; 3]));
        }
    }

    /// Keeps evenly spaced rows of `data` (`[n, width]`, the input of the product with `weight`)
    /// until the product has [`TERM_SAMPLE_ROWS`]; an expert matrix's rows with their expert.
    pub fn add(&mut self, weight: &str, width: usize, data: &[f32]) {
        if let Some((layer, kind)) = expert_product(weight) {
            let Some((experts, calls)) = self.routing.get_mut(&layer) else { return };
            let Some(&expert) = experts.get(calls[kind]) else { return };
            calls[kind] += 1;
            let e = self.experts.entry(weight.to_string()).or_insert_with(|| ExpertRows { width, stride: 1, ..Default::default() });
            if e.width != width || data.len() != width {
                return;
            }
            if e.seen.is_multiple_of(e.stride) {
                e.rows.push((expert, data.to_vec()));
                if e.rows.len() > TERM_SAMPLE_ROWS {
                    let kept = std::mem::take(&mut e.rows);
                    e.rows = kept.into_iter().step_by(2).collect();
                    e.stride *= 2;
                }
            }
            e.seen += 1;
            return;
        }
        let n = data.len() / width.max(1);
        let (w, kept) = self.rows.entry(weight.to_string()).or_insert_with(|| (width, Vec::new()));
        if *w != width || n == 0 {
            return;
        }
        let take = TERM_SAMPLE_ROWS.saturating_sub(kept.len() / width).min(n);
        for i in 0..take {
            let row = i * n / take;
            kept.extend_from_slice(&data[row * width..(row + 1) * width]);
        }
    }
}

/// `blk.L.ffn_{gate,up,down}_exps.weight` -> (L, 0|1|2): a MoE layer's stacked expert matrix.
pub(crate) fn expert_product(weight: &str) -> Option<(usize, usize)> {
    let (layer, kind) = weight.strip_prefix("blk.")?.strip_suffix("_exps.weight")?.split_once('.')?;
    let kind = ["ffn_gate", "ffn_up", "ffn_down"].iter().position(|k| *k == kind)?;
    Some((layer.parse().ok()?, kind))
}

/// The tap a matrix product's output is recorded as, for the products whose every output is
/// one dot product with one matrix (not a MoE's experts, whose outputs are mixed, or its router,
/// whose scores pass through a softmax before the tap).
pub fn product_tap(weight: &str) -> Option<TapName> {
    let stem = weight.strip_suffix(".weight")?;
    if stem == "output" || stem == "token_embd" {
        return Some(TapName::model(TapKind::ResultOutput));
    }
    // GGUF's names of the matrices (the parsing edge of weight names), to the taps they make.
    let (layer, matrix) = stem.strip_prefix("blk.")?.split_once('.')?;
    let kind = match matrix {
        "attn_q" => TapKind::AttnQ,
        "attn_k" => TapKind::AttnK,
        "attn_v" => TapKind::AttnV,
        "ffn_gate" => TapKind::FfnGate,
        "ffn_up" => TapKind::FfnUp,
        "attn_output" => TapKind::AttnOut,
        "ffn_down" => TapKind::FfnOut,
        _ => return None,
    };
    Some(TapName::layer(layer.parse().ok()?, kind))
}

/// The scale of a matrix product's terms beside that of its outputs, over a sample of input
/// rows `a` and every output `j`: `term_rms` = RMS of `sqrt(sum_i (a_i w_ji)^2)`, `output_rms` =
/// RMS of `sum_i a_i w_ji + b_j`. The roundings in a dot product (its inputs', its weights',
/// its accumulation's) are each relative to a term, so their sum grows like `term_rms`; the
/// budgets' statistical rule reads it off the output's RMS, which is the same where the terms'
/// signs are random (0.98 on random weights) and smaller where they cancel: a checkpoint whose
/// weight rows are smooth (sin(i k)) gave 19.9 for `attn_out`, where an honest f32 engine then
/// measured 1.1x its budget. [`diff_with_terms`] grants the difference.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct TermScale {
    pub term_rms: f64,
    pub output_rms: f64,
}

/// [`TermScale`] of every product in `products` that a tap records, from the matrices (and
/// biases) in `weights`, in f64. Each output row's sums are taken in a fixed order, so the
/// scales are the same bits for any thread count.
pub fn term_scales(products: &ProductRows, weights: &dyn oracle::loader::TensorSource) -> oracle::Result<std::collections::BTreeMap<String, TermScale>> {
    let mut out = std::collections::BTreeMap::new();
    for (weight, (width, rows)) in &products.rows {
        let Some(tap) = product_tap(weight) else { continue };
        let Some((t, o, n)) = product_sums(weights, weight, *width, rows)? else { continue };
        out.insert(tap.to_string(), TermScale { term_rms: (t / n).sqrt(), output_rms: (o / n).sqrt() });
    }
    Ok(out)
}

/// [`term_sums`] of the product of the sampled input `rows` (of `width`) with the 2-D matrix
/// `weight` as stored in `weights` (and its bias, if it has one); None where there is no such
/// matrix of rows of `width`, no row sampled, or a bias of another length.
pub(crate) fn product_sums(weights: &dyn oracle::loader::TensorSource, weight: &str, width: usize, rows: &[f32]) -> oracle::Result<Option<(f64, f64, f64)>> {
    if rows.is_empty() {
        return Ok(None);
    }
    let Some(w) = weights.raw(weight)? else { return Ok(None) };
    let Some(row_bytes) = row_bytes(&w, width) else { return Ok(None) };
    let bias = weights.load(&weight.replace(".weight", ".bias"))?.map(|b| b.data);
    if bias.as_ref().is_some_and(|b| b.len() != w.bytes.len() / row_bytes) {
        return Ok(None);
    }
    term_sums(w.ty, &w.bytes, row_bytes, width, rows, bias.as_deref()).map(Some)
}

/// The bytes of one row of `width` values of matrix `w`, if `w` is a matrix of such rows.
pub(crate) fn row_bytes(w: &oracle::loader::RawTensor<'_>, width: usize) -> Option<usize> {
    let row_bytes = (width / w.ty.block_size().max(1)) * w.ty.type_size();
    (w.dims.first() == Some(&width) && width.is_multiple_of(w.ty.block_size()) && row_bytes > 0 && w.bytes.len().is_multiple_of(row_bytes)).then_some(row_bytes)
}

/// Over the input rows `rows` (of `width`) and every output row of the matrix stored in `bytes`
/// (`ty`, rows of `row_bytes`; `bias` per output): (sum of `sum_i (a_i w_ji)^2`, sum of
/// `(a.w_j + b_j)^2`, how many outputs), in f64, in a fixed order (the same bits for any thread
/// count). The matrix is decoded 64 rows at a time (a model's output head decoded whole would
/// take gigabytes beside a model held packed).
pub(crate) fn term_sums(ty: oracle::quant::GgmlType, bytes: &[u8], row_bytes: usize, width: usize, rows: &[f32], bias: Option<&[f32]>) -> oracle::Result<(f64, f64, f64)> {
    use rayon::prelude::*;
    const ROWS_PER_BLOCK: usize = 64;
    let per_block: Vec<oracle::Result<(f64, f64)>> = bytes
        .par_chunks(row_bytes * ROWS_PER_BLOCK)
        .enumerate()
        .map(|(block, bytes)| {
            let values = oracle::quant::decode(ty, bytes, bytes.len() / row_bytes * width)?;
            Ok(values.chunks_exact(width).enumerate().fold((0.0, 0.0), |(t, o), (i, wj)| {
                let b = bias.map_or(0.0, |b| b[block * ROWS_PER_BLOCK + i] as f64);
                rows.chunks_exact(width).fold((t, o), |(t, o), a| {
                    let (mut sq, mut dot) = (0.0f64, 0.0f64);
                    for (x, y) in a.iter().zip(wj) {
                        let term = *x as f64 * *y as f64;
                        sq += term * term;
                        dot += term;
                    }
                    (t + sq, o + (dot + b) * (dot + b))
                })
            }))
        })
        .collect();
    let (mut t, mut o) = (0.0, 0.0);
    for r in per_block {
        let (bt, bo) = r?;
        t += bt;
        o += bo;
    }
    Ok((t, o, (bytes.len() / row_bytes * (rows.len() / width.max(1))) as f64))
}

/// For each MoE layer whose expert products were sampled, by its `blk.L.ffn_out` tap: how many
/// times the outputs' RMS the products' rounding errors may reach there, `1 + excess`, where a
/// product's excess is `term_rms / output_rms - 1` (0 where its terms do not cancel; pooled
/// over the experts' sampled rows, [`term_sums`]) and the block's is that of its gate or up
/// product (whichever is larger) plus its down product's — each passed on to the output
/// unmagnified, as the depth model of [`propagated_budget`] has it and as the dense taps carry
/// their grants (`carry_through_ops`) — or the shared expert's, if larger. The experts have no
/// taps of their own, so the layer's `ffn_out` compared in isolation holds all their errors.
pub fn moe_term_ratios(products: &ProductRows, weights: &dyn oracle::loader::TensorSource) -> oracle::Result<std::collections::BTreeMap<String, f64>> {
    let excess = |t: f64, o: f64| if o > 0.0 { ((t / o).sqrt() - 1.0).max(0.0) } else { 0.0 };
    let mut per_layer: std::collections::BTreeMap<usize, ([f64; 3], [f64; 3])> = Default::default();
    for (weight, e) in &products.experts {
        let (Some((layer, kind)), Some(w)) = (expert_product(weight), weights.raw(weight)?) else { continue };
        let (Some(row_bytes), Some(&n_out)) = (row_bytes(&w, e.width), w.dims.get(1)) else { continue };
        let block = n_out * row_bytes;
        let (mut t, mut o) = (0.0, 0.0);
        let mut by_expert: std::collections::BTreeMap<usize, Vec<f32>> = Default::default();
        for (expert, row) in &e.rows {
            by_expert.entry(*expert).or_default().extend_from_slice(row);
        }
        for (expert, rows) in by_expert {
            let Some(bytes) = w.bytes.get(expert * block..(expert + 1) * block) else { continue };
            let (bt, bo, _) = term_sums(w.ty, bytes, row_bytes, e.width, &rows, None)?;
            t += bt;
            o += bo;
        }
        per_layer.entry(layer).or_default().0[kind] = excess(t, o);
    }
    // The shared expert's products (2-D matrices, every token).
    for (layer, (_, shared)) in per_layer.iter_mut() {
        for (kind, p) in ["gate", "up", "down"].iter().enumerate() {
            let weight = format!("blk.{layer}.ffn_{p}_shexp.weight");
            let Some((width, rows)) = products.rows.get(&weight) else { continue };
            if let Some((t, o, _)) = product_sums(weights, &weight, *width, rows)? {
                shared[kind] = excess(t, o);
            }
        }
    }
    let block = |r: [f64; 3]| r[0].max(r[1]) + r[2];
    Ok(per_layer.into_iter().map(|(layer, (experts, shared))| (TapName::layer(layer, TapKind::FfnOut).to_string(), 1.0 + block(experts).max(block(shared)))).collect())
}

/// The absolute RMS allowance for the cancelling terms of the product behind tap `kind`: its
/// op's relative budget over the excess of the terms' RMS over the outputs' (0 where they do not
/// cancel); None for a kind without a budget rule.
pub fn cancellation_grant(kind: TapKind, scale: &TermScale, arith: &Arithmetic, dims: &Dims) -> Option<f64> {
    Some(local_budget(kind, arith, dims)?.rel * (scale.term_rms - scale.output_rms).max(0.0))
}

/// For each layer's `attn_kqv`: `C_STAT` times the attention output's error that the declared
/// roundings of its scores, keys, values and weights produce on the inputs the device gave it
/// (its `attn_q_rope`/`attn_k_rope`/`attn_v` taps, or the nearest earlier ones; where it gave none,
/// the oracle's values from `fallback`), as an absolute RMS ([`crate::attention_terms`]). The
/// dims model's cache term assumes scores made of unit terms; real models' are not (key biases,
/// sinks, massive activations), and there the declared arithmetic errs beyond it.
pub fn attention_allowances(spec: &ModelSpec, device: &RecordingTap, fallback: &RecordingTap, arith: &Arithmetic, n_pos: usize) -> std::collections::BTreeMap<String, f64> {
    let mut out = std::collections::BTreeMap::new();
    let Some(roundings) = crate::attention_terms::Roundings::of(arith, spec.head_dim) else {
        return out;
    };
    // Without the sinks (the model's weights, not at hand): a sink only takes weight from the
    // keys, so the output it leaves, and the error the roundings make in it, are smaller.
    let params = |layer: usize| {
        let a = spec.attention(layer)?;
        Some(oracle::ops::AttentionParams {
            n_head: a.n_head,
            n_head_kv: a.n_head_kv,
            head_dim: a.head_dim,
            scale: spec.attn_scale,
            window: a.window,
            sinks: None,
            softcap: spec.attn_softcap,
        })
    };
    let get = |layer: usize, kinds: &[TapKind]| {
        kinds.iter().map(|k| TapName::layer(layer, *k).to_string()).find_map(|n| device.tensors.get(&n).or_else(|| fallback.tensors.get(&n))).map(|(_, v)| v.as_slice())
    };
    for layer in 0..spec.n_layer {
        let (Some(q), Some(k), Some(v)) = (get(layer, &[TapKind::AttnQRope, TapKind::AttnQNorm, TapKind::AttnQ]), get(layer, &[TapKind::AttnKRope, TapKind::AttnKNorm, TapKind::AttnK]), get(layer, &[TapKind::AttnV]))
        else {
            continue;
        };
        let Some(params) = params(layer) else { continue };
        if let Some(s) = crate::attention_terms::sensitivity(q, k, v, n_pos, &params, &roundings) {
            out.insert(TapName::layer(layer, TapKind::AttnKqv).to_string(), C_STAT * s);
        }
    }
    out
}
