//! `reduce`: from a layer-diff's first divergence to the smallest kernel case that still fails on
//! the device alone.
//!
//! The op that makes the diverging tap is rebuilt as a kernel case (a [`Recipe`]): its inputs are
//! the values of the taps it reads (the oracle's, or the device's), its weights are read from the
//! model file as stored. A recipe is trusted only where it reproduces the tap: the oracle's op run
//! on the oracle's own input taps must give the oracle's tap (within [`REPRODUCES`]); a tap whose
//! op the kernel suite cannot express on this model (a scale, a bias, a norm offset the op does
//! not take) is said so, never turned into a case. The case is then cut down — positions, then a
//! product's output rows — keeping each cut only while the device still fails it ([`shrink`]).

use devices::Device;
use oracle::quant::GgmlType;
use oracle::registry::{Input, Op, OpCase, Output, Tensor};
use oracle::spec::{Activation, ModelSpec, RopeScaling, RopeStyle};
use oracle::taps::{TapKind, TapName};
use oracle::tensor::TensorSource;
use oracle::RecordingTap;
use reports::Verdict;

/// How close the oracle's op on its own input taps must come to its own tap (relative RMS) for
/// the recipe to stand for the tap.
pub const REPRODUCES: f64 = 1e-6;

/// A weight matrix as the file stores it.
#[derive(Clone)]
pub struct Packed {
    pub name: String,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: Vec<u8>,
}

/// The op behind a tap, as a kernel case over some of its positions (and, for a product, some of
/// its output rows).
#[derive(Clone)]
pub struct Recipe {
    pub op: Op,
    pub tap: TapName,
    /// Inputs read from taps: (input name, tap name, width).
    pub from_taps: Vec<(&'static str, String, usize)>,
    /// Inputs that are the model's (a norm's weight).
    pub fixed: Vec<(&'static str, Input)>,
    /// A product's weight (matmul).
    pub weight: Option<Packed>,
    pub params: Vec<(&'static str, f64)>,
    /// The rows the case's queries attend to are every position up to theirs (attention): the
    /// key/value inputs keep positions 0..=max, the queries and `pos` the chosen ones.
    pub causal: bool,
    /// The positions the taps hold.
    pub positions: usize,
    /// Heads a case may be cut to (attention: query heads, key/value heads, head width; RoPE:
    /// heads, the same count, width): one key/value head's group of queries.
    pub heads: Option<(usize, usize, usize)>,
    /// Inputs that are a column range of a tap: (input name, tap name, width, columns).
    pub columns: Vec<(&'static str, String, usize, (usize, usize))>,
    /// A recurrent op's state before the cut's first position: the state tap (its row at the
    /// position before; zeros before position 0) and the input's shape.
    pub state: Option<(String, Vec<usize>)>,
    /// Which of the op's outputs the tap is (a scan's outputs, or its state after the cut's last
    /// position: then the tap's row there).
    pub output: usize,
}

/// What a case is cut to: positions, and a product's output rows.
#[derive(Clone, Debug, PartialEq)]
pub struct Cut {
    pub rows: Vec<usize>,
    pub out_rows: Option<(usize, usize)>,
    /// One key/value head (its group of query heads) of an attention or RoPE case.
    pub kv_head: Option<usize>,
}

impl Cut {
    pub fn describe(&self) -> String {
        let rows = match self.rows.as_slice() {
            [r] => format!("position {r}"),
            r if r.len() > 1 && r.windows(2).all(|w| w[1] == w[0] + 1) => format!("positions {}..={}", r[0], r[r.len() - 1]),
            r => format!("{} positions", r.len()),
        };
        let heads = self.kv_head.map(|h| format!(", head group {h}")).unwrap_or_default();
        match self.out_rows {
            Some((a, b)) => format!("{rows}{heads}, output rows {a}..{b}"),
            None => rows + &heads,
        }
    }
}

fn tap_name(layer: Option<usize>, kind: TapKind) -> String {
    match layer {
        Some(l) => TapName::layer(l, kind).to_string(),
        None => TapName::model(kind).to_string(),
    }
}

/// The tap that feeds layer `li`'s residual stream: the previous layer's output, or the
/// embeddings.
fn stream_into(li: usize) -> String {
    if li == 0 {
        tap_name(None, TapKind::InpEmbd)
    } else {
        tap_name(Some(li - 1), TapKind::LOut)
    }
}

impl Recipe {
    /// The recipe for `tap`, or why the kernel suite has no case for it on this model.
    pub fn for_tap(tap: TapName, spec: &ModelSpec, src: &dyn TensorSource, taps: &RecordingTap) -> Result<Recipe, String> {
        let has = |k: TapKind| taps.tensors.contains_key(&tap_name(tap.layer, k));
        let at = |k: TapKind| tap_name(tap.layer, k);
        let width = |name: &str| taps.tensors.get(name).map(|t| t.0).ok_or_else(|| format!("the oracle recorded no tap `{name}`"));
        let positions = taps.tensors.get(&tap.to_string()).map(|(w, v)| v.len() / (*w).max(1)).ok_or_else(|| format!("no tap `{tap}` in the oracle's run"))?;
        let weight_name = |suffix: &str| match tap.layer {
            Some(l) => format!("blk.{l}.{suffix}"),
            None => suffix.to_string(),
        };
        let vector = |name: &str| -> Result<Input, String> {
            let t = src.load(name).map_err(|e| e.to_string())?.ok_or_else(|| format!("the model has no `{name}`"))?;
            Ok(Input::F32(Tensor { shape: vec![t.data.len()], data: t.data }))
        };
        let packed = |name: &str| -> Result<Packed, String> {
            let r = src.raw(name).map_err(|e| e.to_string())?.ok_or_else(|| format!("the model has no `{name}`"))?;
            let (cols, rows) = match r.dims.as_slice() {
                [c, r] => (*c, *r),
                d => return Err(format!("`{name}` has dims {d:?}, not a matrix")),
            };
            Ok(Packed { name: name.to_string(), ty: r.ty, rows, cols, bytes: r.bytes.into_owned() })
        };
        let one = |input: &'static str, name: String| -> Result<Vec<(&'static str, String, usize)>, String> { Ok(vec![(input, name.clone(), width(&name)?)]) };
        let base = Recipe { op: Op::Add, tap, from_taps: Vec::new(), fixed: Vec::new(), weight: None, params: Vec::new(), causal: false, positions, heads: None, columns: Vec::new(), state: None, output: 0 };
        let li = tap.layer.unwrap_or(0);
        let eps = ("eps", spec.norm_eps);
        Ok(match tap.kind {
            TapKind::AttnNorm => Recipe { op: Op::RmsNorm, from_taps: one("x", stream_into(li))?, fixed: vec![("weight", vector(&weight_name("attn_norm.weight"))?)], params: vec![eps], ..base },
            TapKind::FfnNorm => Recipe { op: Op::RmsNorm, from_taps: one("x", at(TapKind::FfnInp))?, fixed: vec![("weight", vector(&weight_name("ffn_norm.weight"))?)], params: vec![eps], ..base },
            TapKind::ResultNorm => Recipe { op: Op::RmsNorm, from_taps: one("x", tap_name(Some(spec.n_layer - 1), TapKind::LOut))?, fixed: vec![("weight", vector("output_norm.weight")?)], params: vec![eps], ..base },
            TapKind::FfnAct => {
                let op = match spec.activation {
                    Activation::Silu => Op::Swiglu,
                    Activation::GeluTanh => Op::Geglu,
                    Activation::SwigluOai => Op::SwigluOai,
                };
                let (g, u) = (at(TapKind::FfnGate), at(TapKind::FfnUp));
                Recipe { op, from_taps: vec![("gate", g.clone(), width(&g)?), ("up", u.clone(), width(&u)?)], ..base }
            }
            TapKind::FfnInp | TapKind::LOut => {
                let (a, b) = match tap.kind {
                    TapKind::FfnInp => (stream_into(li), if has(TapKind::AttnPostNorm) { at(TapKind::AttnPostNorm) } else { at(TapKind::AttnOut) }),
                    _ => (at(TapKind::FfnInp), if has(TapKind::FfnPostNorm) { at(TapKind::FfnPostNorm) } else { at(TapKind::FfnOut) }),
                };
                Recipe { op: Op::Add, from_taps: vec![("a", a.clone(), width(&a)?), ("b", b.clone(), width(&b)?)], ..base }
            }
            TapKind::AttnQ | TapKind::AttnK | TapKind::AttnV | TapKind::AttnOut | TapKind::FfnGate | TapKind::FfnUp | TapKind::FfnOut | TapKind::ResultOutput => {
                let (x, w) = match tap.kind {
                    TapKind::AttnQ => (at(TapKind::AttnNorm), weight_name("attn_q.weight")),
                    TapKind::AttnK => (at(TapKind::AttnNorm), weight_name("attn_k.weight")),
                    TapKind::AttnV => (at(TapKind::AttnNorm), weight_name("attn_v.weight")),
                    TapKind::AttnOut => (if has(TapKind::AttnGated) { at(TapKind::AttnGated) } else { at(TapKind::AttnKqv) }, weight_name("attn_output.weight")),
                    TapKind::FfnGate => (at(TapKind::FfnNorm), weight_name("ffn_gate.weight")),
                    TapKind::FfnUp => (at(TapKind::FfnNorm), weight_name("ffn_up.weight")),
                    TapKind::FfnOut => (at(TapKind::FfnAct), weight_name("ffn_down.weight")),
                    _ => (tap_name(None, TapKind::ResultNorm), if src.raw("output.weight").map_err(|e| e.to_string())?.is_some() { "output.weight".into() } else { "token_embd.weight".into() }),
                };
                Recipe { op: Op::Matmul, from_taps: one("x", x)?, weight: Some(packed(&w)?), ..base }
            }
            TapKind::AttnQRope | TapKind::AttnKRope => {
                let r = &spec.rope;
                if r.scaling != RopeScaling::None || r.freq_factors.is_some() || spec.rope_swa.is_some() {
                    return Err("the kernel suite's `rope` takes no scaling of this model's kind".into());
                }
                let (n_head, hd) = match spec.layers.get(li).map(|l| l.block) {
                    Some(oracle::spec::BlockKind::Attention(a)) => (if tap.kind == TapKind::AttnQRope { a.n_head } else { a.n_head_kv }, a.head_dim),
                    _ => return Err(format!("layer {li} is not a grouped-query attention layer")),
                };
                let (normed, raw) = if tap.kind == TapKind::AttnQRope { (TapKind::AttnQNorm, TapKind::AttnQ) } else { (TapKind::AttnKNorm, TapKind::AttnK) };
                let x = if has(normed) { at(normed) } else { at(raw) };
                let params = vec![("neox", (r.style == RopeStyle::Neox) as u8 as f64), ("scaling", 0.0), ("theta", r.theta), ("n_rot", r.n_rot as f64), ("n_head", n_head as f64), ("head_dim", hd as f64)];
                Recipe { op: Op::Rope, from_taps: one("x", x)?, params, heads: Some((n_head, n_head, hd)), ..base }
            }
            TapKind::AttnKqv => {
                let a = match spec.layers.get(li).map(|l| l.block) {
                    Some(oracle::spec::BlockKind::Attention(a)) => a,
                    _ => return Err(format!("layer {li} is not a grouped-query attention layer")),
                };
                let q = if has(TapKind::AttnQRope) { at(TapKind::AttnQRope) } else { at(TapKind::AttnQ) };
                let k = if has(TapKind::AttnKRope) { at(TapKind::AttnKRope) } else { at(TapKind::AttnK) };
                let v = at(TapKind::AttnV);
                let params = vec![("n_head", a.n_head as f64), ("n_head_kv", a.n_head_kv as f64), ("head_dim", a.head_dim as f64), ("window", a.window.unwrap_or(0) as f64)];
                Recipe { op: Op::Attention, from_taps: vec![("q", q.clone(), width(&q)?), ("k", k.clone(), width(&k)?), ("v", v.clone(), width(&v)?)], params, causal: true, heads: Some((a.n_head, a.n_head_kv, a.head_dim)), ..base }
            }
            TapKind::SsmState | TapKind::SsmScan => {
                let b = match spec.layers.get(li).map(|l| l.block) {
                    Some(oracle::spec::BlockKind::Ssm(b)) => b,
                    _ => return Err(format!("layer {li} is not a state-space layer")),
                };
                let (conv, inp) = (at(TapKind::SsmConv), at(TapKind::SsmIn));
                let (cw, iw) = (width(&conv)?, width(&inp)?);
                let (nh, ng, hd, ds) = (b.n_head, b.n_group, b.head_dim(), b.d_state);
                let heads = |i: usize| (b.heads_at() + i * nh, b.heads_at() + (i + 1) * nh);
                let output = (tap.kind == TapKind::SsmState) as usize;
                let state = Some((at(TapKind::SsmState), vec![nh, hd, ds]));
                let vecs = |names: &[(&'static str, &str)]| -> Result<Vec<(&'static str, Input)>, String> { names.iter().map(|(i, n)| Ok((*i, vector(&weight_name(n))?))).collect() };
                match b.kind {
                    oracle::spec::SsmKind::Mamba2 => {
                        let bc = ng * ds;
                        let columns = vec![("x", conv.clone(), cw, (0, b.d_inner)), ("b", conv.clone(), cw, (b.d_inner, b.d_inner + bc)), ("c", conv, cw, (b.d_inner + bc, b.d_inner + 2 * bc)), ("dt", inp, iw, heads(0))];
                        let params = vec![("n_head", nh as f64), ("n_group", ng as f64), ("head_dim", hd as f64), ("d_state", ds as f64)];
                        Recipe { op: Op::SsmScan, columns, fixed: vecs(&[("dt_bias", "ssm_dt.bias"), ("neg_a", "ssm_a"), ("d", "ssm_d")])?, params, state, output, ..base }
                    }
                    oracle::spec::SsmKind::GatedDelta => {
                        let kd = ng * ds;
                        let columns = vec![("q", conv.clone(), cw, (0, kd)), ("k", conv.clone(), cw, (kd, 2 * kd)), ("v", conv, cw, (2 * kd, 2 * kd + b.d_inner)), ("b", inp.clone(), iw, heads(0)), ("a", inp, iw, heads(1))];
                        let params = vec![("n_k_head", ng as f64), ("n_v_head", nh as f64), ("d_k", ds as f64), ("d_v", hd as f64)];
                        Recipe { op: Op::DeltaRule, columns, fixed: vecs(&[("dt_bias", "ssm_dt.bias"), ("neg_a", "ssm_a")])?, params, state, output, ..base }
                    }
                }
            }
            k => return Err(format!("the kernel suite has no one-op case for `{}` taps yet", k.name())),
        })
    }

    /// The full cut: every position, every output row.
    pub fn full(&self) -> Cut {
        Cut { rows: (0..self.positions).collect(), out_rows: self.weight.as_ref().map(|w| (0, w.rows)), kv_head: None }
    }

    /// The kernel case over `cut`, its inputs from `taps`.
    pub fn case(&self, taps: &RecordingTap, cut: &Cut, inputs_from: &str) -> Result<OpCase, String> {
        let mut inputs = Vec::new();
        let kv_len = cut.rows.iter().max().map_or(0, |r| r + 1);
        for (input, name, w) in &self.from_taps {
            let (_, data) = taps.tensors.get(name).ok_or_else(|| format!("no tap `{name}` in the {inputs_from}'s run"))?;
            let rows: Vec<usize> = if self.causal && *input != "q" { (0..kv_len).collect() } else { cut.rows.clone() };
            if rows.iter().any(|r| (r + 1) * w > data.len()) {
                return Err(format!("tap `{name}` of the {inputs_from} holds {} positions", data.len() / w.max(&1)));
            }
            // One head group: the query heads of key/value head g, or g's keys and values.
            let (c0, c1) = match (cut.kv_head, self.heads) {
                (Some(g), Some((_, _, hd))) if *input == "k" || *input == "v" => (g * hd, (g + 1) * hd),
                (Some(g), Some((nh, nkv, hd))) => {
                    let per = nh / nkv.max(1);
                    (g * per * hd, (g + 1) * per * hd)
                }
                _ => (0, *w),
            };
            let vals: Vec<f32> = rows.iter().flat_map(|r| data[r * w + c0..r * w + c1].iter().copied()).collect();
            inputs.push((*input, Input::F32(Tensor { shape: vec![rows.len(), c1 - c0], data: vals })));
        }
        for (input, name, w, (c0, c1)) in &self.columns {
            let (_, data) = taps.tensors.get(name).ok_or_else(|| format!("no tap `{name}` in the {inputs_from}'s run"))?;
            if cut.rows.iter().any(|r| (r + 1) * w > data.len()) || c1 > w {
                return Err(format!("tap `{name}` of the {inputs_from} holds {} positions of {w}", data.len() / w.max(&1)));
            }
            let vals: Vec<f32> = cut.rows.iter().flat_map(|r| data[r * w + c0..r * w + c1].iter().copied()).collect();
            inputs.push((*input, Input::F32(Tensor { shape: vec![cut.rows.len(), c1 - c0], data: vals })));
        }
        if let Some((name, shape)) = &self.state {
            let n: usize = shape.iter().product();
            let data = match cut.rows.first().copied().unwrap_or(0) {
                0 => vec![0.0; n],
                r => {
                    let (w, data) = taps.tensors.get(name).ok_or_else(|| format!("no tap `{name}` in the {inputs_from}'s run"))?;
                    data.get((r - 1) * w..(r - 1) * w + n).filter(|_| *w == n).ok_or_else(|| format!("tap `{name}` of the {inputs_from} holds no state of {n} at position {}", r - 1))?.to_vec()
                }
            };
            inputs.push(("state", Input::F32(Tensor { shape: shape.clone(), data })));
        }
        inputs.extend(self.fixed.iter().cloned());
        if let Some(p) = &self.weight {
            let (a, b) = cut.out_rows.unwrap_or((0, p.rows));
            let rb = p.bytes.len() / p.rows.max(1);
            inputs.push(("w", Input::Quant { ty: p.ty, rows: b - a, cols: p.cols, bytes: p.bytes[a * rb..b * rb].to_vec() }));
        }
        if matches!(self.op, Op::Rope | Op::Attention) {
            inputs.push(("pos", Input::Ids(cut.rows.iter().map(|&r| r as u32).collect())));
        }
        // In the order the op's form in the registry has them (a written case is read back so).
        let order = input_order(self.op);
        inputs.sort_by_key(|(n, _)| order.iter().position(|o| o == n).unwrap_or(usize::MAX));
        let mut params: std::collections::BTreeMap<&'static str, f64> = self.params.iter().copied().collect();
        if let (Some(_), Some((nh, nkv, _))) = (cut.kv_head, self.heads) {
            params.insert("n_head", (nh / nkv.max(1)) as f64);
            if params.contains_key("n_head_kv") {
                params.insert("n_head_kv", 1.0);
            }
        }
        let width = match &inputs.first() {
            Some((_, Input::F32(t))) => t.shape.get(1).copied().unwrap_or(0),
            _ => 0,
        };
        let shape = format!("{}x{width}", cut.rows.len());
        let id = format!(
            "{}(from={},inputs={inputs_from},rows={shape}{}{},first={},seed=0)",
            self.op.name(),
            self.tap,
            cut.out_rows.map(|(a, b)| format!(",out={a}..{b}")).unwrap_or_default(),
            cut.kv_head.map(|h| format!(",heads={h}")).unwrap_or_default(),
            cut.rows.first().copied().unwrap_or(0)
        );
        Ok(OpCase { op: self.op, id, seed: 0, inputs, params })
    }

    /// The tap's own values over `cut` (its output rows), as a recorded run holds them; a
    /// recurrent state's at the cut's last position only.
    pub fn tap_values(&self, taps: &RecordingTap, cut: &Cut) -> Option<Vec<f32>> {
        let (w, data) = taps.tensors.get(&self.tap.to_string())?;
        let (a, b) = cut.out_rows.unwrap_or((0, *w));
        let rows = if self.state.is_some() && self.output == 1 { cut.rows.last().map(|r| vec![*r]).unwrap_or_default() } else { cut.rows.clone() };
        Some(rows.iter().flat_map(|r| data[r * w + a..r * w + b].iter().copied()).collect())
    }
}

/// The names of `op`'s inputs in the order its cases in the registry give them.
fn input_order(op: Op) -> &'static [&'static str] {
    static ORDER: std::sync::OnceLock<std::collections::BTreeMap<Op, Vec<&'static str>>> = std::sync::OnceLock::new();
    ORDER
        .get_or_init(|| oracle::registry::registry().into_iter().filter_map(|e| Some((e.op, (e.cases)(0).into_iter().next()?.inputs.iter().map(|(n, _)| *n).collect()))).collect())
        .get(&op)
        .map_or(&[], Vec::as_slice)
}

/// Relative RMS of `a` against `b`.
pub fn rel_rms(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        num += (*x as f64 - *y as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    (num / den.max(1e-300)).sqrt()
}

/// Whether `recipe`, run by the oracle on the oracle's own input taps, gives the oracle's tap.
pub fn reproduces(recipe: &Recipe, oracle_taps: &RecordingTap) -> Result<f64, String> {
    let cut = recipe.full();
    let case = recipe.case(oracle_taps, &cut, "oracle")?;
    let out = crate::kernels::reference(&case)?;
    let Some(Output::F32(t)) = out.get(recipe.output) else { return Err("the op gives ids, not values".into()) };
    let tap = recipe.tap_values(oracle_taps, &cut).ok_or("no tap values")?;
    if t.data.len() != tap.len() {
        return Err(format!("the op gives {} values, the tap holds {}", t.data.len(), tap.len()));
    }
    Ok(rel_rms(&t.data, &tap))
}

/// One step of a reduction: the cut tried and the device's verdict on it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Step {
    pub cut: String,
    pub values: usize,
    pub verdict: Verdict,
}

/// The case over `cut` judged on `device`.
pub fn judge(device: &dyn Device, recipe: &Recipe, taps: &RecordingTap, cut: &Cut, inputs_from: &str) -> Result<(OpCase, reports::Case), String> {
    let case = recipe.case(taps, cut, inputs_from)?;
    let judged = crate::kernels::run_case(device, &case, false);
    Ok((case, judged))
}

/// The input values a case holds (a packed weight's as its elements).
pub fn values_of(case: &OpCase) -> usize {
    case.inputs
        .iter()
        .map(|(_, i)| match i {
            Input::F32(t) => t.data.len(),
            Input::Ids(v) => v.len(),
            Input::Quant { rows, cols, .. } => rows * cols,
        })
        .sum()
}

/// The smallest cut of `start` (judged failing: its case and the device's verdict) that still
/// fails on `device`: positions first (the worst single position, then halves), one key/value
/// head group, then a product's output rows (halves). Every cut tried after `start` is a step.
/// Returns the cut, its case and the device's verdict on it.
#[allow(clippy::type_complexity)]
pub fn shrink(device: &dyn Device, recipe: &Recipe, taps: &RecordingTap, start: (Cut, OpCase, reports::Case), worst_row: Option<usize>, inputs_from: &str, steps: &mut Vec<Step>) -> Result<(Cut, OpCase, reports::Case), String> {
    let try_cut = |cut: &Cut, steps: &mut Vec<Step>| -> Result<Option<(OpCase, reports::Case)>, String> {
        let (case, judged) = judge(device, recipe, taps, cut, inputs_from)?;
        steps.push(Step { cut: cut.describe(), values: values_of(&case), verdict: judged.verdict });
        Ok((judged.verdict == Verdict::Fail).then_some((case, judged)))
    };
    let (mut best, first_case, first_judged) = start;
    let mut case = (first_case, first_judged);
    // Positions: the worst alone, else halves while one fails.
    if let Some(r) = worst_row.filter(|r| best.rows.contains(r) && best.rows.len() > 1) {
        let one = Cut { rows: vec![r], ..best.clone() };
        if let Some(c) = try_cut(&one, steps)? {
            (best, case) = (one, c);
        }
    }
    // Attention: an earlier position attends to fewer keys; the earliest that fails alone (a
    // recurrence: the earliest position whose step fails from the state before it).
    if (recipe.causal || recipe.state.is_some()) && best.rows.len() == 1 {
        for r in 0..best.rows[0] {
            let one = Cut { rows: vec![r], ..best.clone() };
            if let Some(c) = try_cut(&one, steps)? {
                (best, case) = (one, c);
                break;
            }
        }
    }
    while best.rows.len() > 1 {
        let mid = best.rows.len() / 2;
        let halves = [best.rows[..mid].to_vec(), best.rows[mid..].to_vec()];
        let mut cut_down = false;
        for h in halves {
            let half = Cut { rows: h, ..best.clone() };
            if let Some(c) = try_cut(&half, steps)? {
                (best, case, cut_down) = (half, c, true);
                break;
            }
        }
        if !cut_down {
            break;
        }
    }
    // One key/value head's group of heads, the first that fails.
    if let Some((_, nkv, _)) = recipe.heads.filter(|(nh, _, _)| *nh > 1) {
        for g in 0..nkv {
            let group = Cut { kv_head: Some(g), ..best.clone() };
            if let Some(c) = try_cut(&group, steps)? {
                (best, case) = (group, c);
                break;
            }
        }
    }
    // A product's output rows: halves while one fails.
    while let Some((a, b)) = best.out_rows.filter(|(a, b)| b - a > 1) {
        let mid = a + (b - a) / 2;
        let mut cut_down = false;
        for r in [(a, mid), (mid, b)] {
            let half = Cut { out_rows: Some(r), ..best.clone() };
            if let Some(c) = try_cut(&half, steps)? {
                (best, case, cut_down) = (half, c, true);
                break;
            }
        }
        if !cut_down {
            break;
        }
    }
    Ok((best, case.0, case.1))
}

/// The position whose values differ most between two runs of `tap` (relative to the tap's scale).
pub fn worst_row(tap: &str, a: &RecordingTap, b: &RecordingTap) -> Option<usize> {
    let ((w, x), (_, y)) = (a.tensors.get(tap)?, b.tensors.get(tap)?);
    let rows = x.len().min(y.len()) / (*w).max(1);
    (0..rows).max_by(|&i, &j| {
        let e = |r: usize| x[r * w..(r + 1) * w].iter().zip(&y[r * w..(r + 1) * w]).map(|(p, q)| (*p as f64 - *q as f64).powi(2)).sum::<f64>();
        e(i).partial_cmp(&e(j)).unwrap_or(std::cmp::Ordering::Equal)
    })
}

/// A reduction: the steps tried, and the smallest failing case with the device's verdict on it
/// and whose input values it holds (`oracle` or `device`); None where the op passes alone on
/// both (the bug needs context: a cache, a batch, the layers before).
pub struct Reduction {
    pub steps: Vec<Step>,
    pub reduced: Option<(OpCase, reports::Case, &'static str)>,
}

/// Reduces the first divergence at `tap` to the smallest kernel case `device` still fails: the
/// recipe built and checked against the oracle's own run, the case tried with the oracle's
/// input values, then the device's, and cut down from the first that fails. Err: why no case can
/// stand for the tap (no recipe, a recipe that does not reproduce it, a device that runs no such
/// case).
pub fn reduce(device: &dyn Device, tap: TapName, spec: &ModelSpec, src: &dyn TensorSource, oracle_taps: &RecordingTap, device_taps: &RecordingTap) -> Result<Reduction, String> {
    let recipe = Recipe::for_tap(tap, spec, src, oracle_taps)?;
    let off = reproduces(&recipe, oracle_taps)?;
    if off > REPRODUCES {
        return Err(format!("the kernel suite's `{}` on the oracle's own inputs is {off:.1e} (relative RMS) from its `{tap}`: the op the suite has is not the one this model runs there", recipe.op.name()));
    }
    let worst = worst_row(&tap.to_string(), oracle_taps, device_taps);
    let mut steps = Vec::new();
    for (inputs_from, taps) in [("oracle", oracle_taps), ("device", device_taps)] {
        let full = recipe.full();
        let (case, judged) = judge(device, &recipe, taps, &full, inputs_from)?;
        if judged.verdict == Verdict::Unsupported {
            return Err(format!("{} does not run `{}` cases: {}", device.name(), recipe.op.name(), judged.message.unwrap_or_default()));
        }
        if judged.verdict != Verdict::Fail {
            steps.push(Step { cut: format!("{} (inputs: the {inputs_from}'s)", full.describe()), values: values_of(&case), verdict: judged.verdict });
            continue;
        }
        steps.push(Step { cut: full.describe(), values: values_of(&case), verdict: judged.verdict });
        let (_, case, judged) = shrink(device, &recipe, taps, (full, case, judged), worst, inputs_from, &mut steps)?;
        return Ok(Reduction { steps, reduced: Some((case, judged, inputs_from)) });
    }
    Ok(Reduction { steps, reduced: None })
}
