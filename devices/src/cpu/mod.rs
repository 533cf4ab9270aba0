//! `cpu`: the optimized CPU engine under test. f32 storage and accumulation, multi-threaded over
//! output rows (rayon), SIMD-friendly fixed-width inner loops, and quantized weights multiplied
//! directly in their packed blocks against Q8_0-quantized activations (see `qdot`).

pub mod kernels;
pub mod kvcache;
mod ssm;
pub(crate) mod mla;
pub mod kvcodec;
pub mod model;
pub mod serve;
mod serve_faults;
pub(crate) use crate::shared::qdot;

use crate::{fail, Arithmetic, Device, DeviceError, KvTypes, Support};
use oracle::quant::GgmlType;
use oracle::registry::{Op, Input, OpCase, Output, Tensor};

#[derive(Clone, Copy, Debug, Default)]
pub struct CpuDevice {
    /// `cpu:kv-TYPE`: whole models store their cached keys and values in this format (`f16`,
    /// llama.cpp's default cache type; `q8_0`, `q4_0`, ... as its `--cache-type-k/-v` quantize
    /// them; `cpu:kv-K-V`: keys and values each in its own), declared in the models' arithmetic
    /// so the budgets and the emulation allow for it. Ops are unchanged.
    pub kv_cache: crate::KvTypes,
}

/// Rows of a weight matrix per rayon task.
const ROWS_PER_TASK: usize = 32;

/// Tokens a packed weight row is dotted with at once in a multi-token matmul.
const TOKENS_PER_DOT: usize = 4;

/// Tokens per task of a long prompt's quantized matmul ([`quantized_by_tokens`]): with AVX-512
/// Q4_1 rows are dotted with all eight at once, four registers of two tokens.
const TOKENS_PER_TASK: usize = 8;

/// Tokens from which a quantized matmul splits its work by tokens ([`quantized_by_tokens`])
/// rather than by weight rows: enough tasks of [`TOKENS_PER_TASK`] to keep every thread busy.
const TOKEN_TASKS_FROM: usize = 64;

fn out(shape: &[usize], data: Vec<f32>) -> Output {
    Output::F32(Tensor { shape: shape.to_vec(), data })
}

/// A packed weight matrix: `rows` outputs of `cols` inputs, each row `ty`-encoded.
#[derive(Clone, Copy)]
pub struct Packed<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: &'a [u8],
}

/// `y = x W^T` for `x: [m, k]` on packed weights: float types in f32, quantized types with
/// Q8_0-quantized activations and integer block dots. Split over weight rows.
pub fn matmul_packed(x: &[f32], m: usize, w: Packed) -> Vec<f32> {
    matmul_packed_strided(x, m, w.cols, w)
}

/// `matmul_packed` with the rows of `x` `x_stride` values apart (a view into a wider buffer).
pub fn matmul_packed_strided(x: &[f32], m: usize, x_stride: usize, w: Packed) -> Vec<f32> {
    use rayon::prelude::*;
    let k = w.cols;
    let xrow = |t: usize| &x[t * x_stride..t * x_stride + k];
    if !qdot::is_float(w.ty) {
        return matmul_packed_group(x, m, x_stride, &[w]).pop().unwrap_or_default();
    }
    let row_bytes = w.bytes.len() / w.rows.max(1);
    let mut y_t = vec![0.0f32; w.rows * m];
    if m == 1 && qdot::has_fused_float_dot() {
        // One token: each row is used once, so widen its weights in registers as they are used.
        y_t.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(c, o)| {
            for (dr, v) in o.iter_mut().enumerate() {
                let r = c * ROWS_PER_TASK + dr;
                *v = qdot::dot_float_row(w.ty, &w.bytes[r * row_bytes..(r + 1) * row_bytes], xrow(0));
            }
        });
    } else {
        y_t.par_chunks_mut(ROWS_PER_TASK * m).enumerate().for_each(|(c, o)| {
            let mut wr = vec![0.0f32; k];
            for (dr, orow) in o.chunks_mut(m).enumerate() {
                let r = c * ROWS_PER_TASK + dr;
                qdot::float_row(w.ty, &w.bytes[r * row_bytes..(r + 1) * row_bytes], &mut wr);
                // Four tokens per pass over the widened row, each with the bits of its own
                // `dot_f32` (products commute; the lane and summation order is dot_f32's).
                let mut t = 0;
                while t + kernels::KEYS_PER_STEP <= m {
                    let xs: [&[f32]; kernels::KEYS_PER_STEP] = std::array::from_fn(|i| xrow(t + i));
                    orow[t..t + kernels::KEYS_PER_STEP].copy_from_slice(&kernels::dot_f32_x4(&wr, &xs));
                    t += kernels::KEYS_PER_STEP;
                }
                for t in t..m {
                    orow[t] = qdot::dot_f32(xrow(t), &wr);
                }
            }
        });
    }
    kernels::transpose(&y_t, w.rows, m)
}

/// The rows of `x` (`stride` values apart, `k` used) quantized to Q8_0, token by token in
/// parallel when there are several.
fn quantize_rows(x: &[f32], m: usize, stride: usize, k: usize) -> Vec<qdot::Q8Row> {
    use rayon::prelude::*;
    let row = |t: usize| qdot::quantize_q8(&x[t * stride..t * stride + k]);
    if m == 1 {
        return vec![row(0)];
    }
    (0..m).into_par_iter().with_min_len(4).map(row).collect()
}

/// Rows `c * ROWS_PER_TASK ..` of a quantized matmul into `o` (`[rows][m]`).
fn quantized_task(w: &Packed, xq: &[qdot::Q8Row], c: usize, o: &mut [f32]) {
    let m = xq.len();
    let row_bytes = w.bytes.len() / w.rows.max(1);
    let r0 = c * ROWS_PER_TASK;
    let rows = &w.bytes[r0 * row_bytes..(r0 + o.len() / m) * row_bytes];
    // The group's activations stay in L1 while the task's rows pass.
    dot_tokens(w.ty, rows, row_bytes, xq, o, qdot::Strides { row: m, token: 1 });
}

/// The dots of `rows` with every token of `xs`, token `t`'s at `out[t * at.token..]` as `at`
/// says: in groups of [`TOKENS_PER_DOT`] (each weight block unpacked once per group), then the
/// rest one by one. Either way a token's result has the bits of its own `dot_row`.
fn dot_tokens(ty: GgmlType, rows: &[u8], row_bytes: usize, xs: &[qdot::Q8Row], out: &mut [f32], at: qdot::Strides) {
    let mut t = 0;
    while t + TOKENS_PER_DOT <= xs.len() {
        let x4: [&qdot::Q8Row; TOKENS_PER_DOT] = std::array::from_fn(|i| &xs[t + i]);
        qdot::dot_rows_block(ty, rows, row_bytes, x4, &mut out[t * at.token..], at);
        t += TOKENS_PER_DOT;
    }
    for (t, x) in xs.iter().enumerate().skip(t) {
        qdot::dot_rows_block(ty, rows, row_bytes, [x], &mut out[t * at.token..], at);
    }
}

/// The quantized matmuls of a long prompt, one task per group of [`TOKENS_PER_TASK`] tokens
/// over every row of every matrix: each output is written `[m][rows]` as it is computed (no
/// transpose), and a kernel lays out its tokens' activations once for all the rows. The
/// weights (a layer's matrices are hundreds of kilobytes) stream from each core's L2.
/// Every dot has the bits of the row's one-token dot, as [`quantized_task`]'s do.
fn quantized_by_tokens(ws: &[Packed], xq: &[qdot::Q8Row]) -> Vec<Vec<f32>> {
    use rayon::prelude::*;
    let m = xq.len();
    let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| vec![0.0f32; w.rows * m]).collect();
    // Per group, its slice of every output (`[tokens][rows]`), in the order of `ws`.
    let mut groups: Vec<Vec<&mut [f32]>> = (0..m.div_ceil(TOKENS_PER_TASK)).map(|_| Vec::with_capacity(ws.len())).collect();
    for (y, w) in ys.iter_mut().zip(ws) {
        for (g, o) in y.chunks_mut(TOKENS_PER_TASK * w.rows).enumerate() {
            groups[g].push(o);
        }
    }
    groups.into_par_iter().enumerate().for_each(|(g, outs)| {
        let xs = &xq[g * TOKENS_PER_TASK..m.min((g + 1) * TOKENS_PER_TASK)];
        for (w, o) in ws.iter().zip(outs) {
            let row_bytes = w.bytes.len() / w.rows;
            let at = qdot::Strides { row: 1, token: w.rows };
            if let Ok(x8) = <&[qdot::Q8Row; TOKENS_PER_TASK]>::try_from(xs) {
                qdot::dot_rows_block(w.ty, w.bytes, row_bytes, x8.each_ref(), o, at);
            } else {
                dot_tokens(w.ty, w.bytes, row_bytes, xs, o, at); // the last group, short
            }
        }
    });
    ys
}

/// [`matmul_packed`] of the same `x` by several matrices (Q, K, V; gate, up): when all are
/// quantized, `x` is quantized once and all their rows go through one parallel loop (one
/// fork-join instead of one per matrix). Each output holds the bits of its own call.
/// `x`'s rows are `x_stride` values apart.
pub fn matmul_packed_group(x: &[f32], m: usize, x_stride: usize, ws: &[Packed]) -> Vec<Vec<f32>> {
    use rayon::prelude::*;
    if m == 0 {
        return ws.iter().map(|_| Vec::new()).collect();
    }
    if ws.iter().any(|w| qdot::is_float(w.ty) || w.cols != ws[0].cols) {
        return ws.iter().map(|w| matmul_packed_strided(x, m, x_stride, *w)).collect();
    }
    let xq = quantize_rows(x, m, x_stride, ws[0].cols);
    if m >= TOKEN_TASKS_FROM && ws.iter().all(|w| w.rows > 0) {
        return quantized_by_tokens(ws, &xq);
    }
    let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| vec![0.0f32; w.rows * m]).collect();
    let tasks: Vec<(usize, usize, &mut [f32])> =
        ys.iter_mut().enumerate().flat_map(|(i, y)| y.chunks_mut(ROWS_PER_TASK * m).enumerate().map(move |(c, o)| (i, c, o))).collect();
    tasks.into_par_iter().for_each(|(i, c, o)| quantized_task(&ws[i], &xq, c, o));
    ys.iter().zip(ws).map(|(y, w)| kernels::transpose(y, w.rows, m)).collect()
}

impl CpuDevice {
    /// The matmul of `x: [m, k]` with a weight input, packed or float.
    pub fn matmul(case: &OpCase, x: &Tensor, w: &Input) -> Result<Vec<f32>, String> {
        match w {
            Input::Quant { ty, rows, cols, bytes } => {
                let (m, k, stride) = oracle::registry::view_dims(case, x);
                if *cols != k || stride < k || x.data.len() < m * stride || ty.bytes_for((*rows * *cols) as u64) != Some(bytes.len() as u64) {
                    return Err(format!("weight [{rows}, {cols}] {} does not fit x [{m}, {k}] (row stride {stride})", ty.name()));
                }
                Ok(matmul_packed_strided(&x.data, m, stride, Packed { ty: *ty, rows: *rows, cols: *cols, bytes }))
            }
            _ => Err(format!("{}: matmul weight must be a packed input", case.id)),
        }
    }

    fn run(case: &OpCase) -> Result<Vec<Output>, String> {
        let e = |r: oracle::OracleError| r.to_string();
        Ok(match case.op {
            Op::Embed => {
                let t = case.f32("table").map_err(e)?;
                let ids = case.ids("ids").map_err(e)?;
                vec![out(&[ids.len(), t.shape[1]], kernels::embed(t, ids)?)]
            }
            Op::RmsNorm | Op::LayerNorm | Op::QkNorm => {
                let x = case.f32("x").map_err(e)?;
                let w = &case.f32("weight").map_err(e)?.data;
                let eps = case.p("eps").map_err(e)? as f32;
                let n = if case.op == Op::QkNorm { case.pu("head_dim").map_err(e)? } else { x.shape[1] };
                let y = if case.op == Op::LayerNorm {
                    kernels::layer_norm(&x.data, n, w, &case.f32("bias").map_err(e)?.data, eps)
                } else {
                    kernels::rms_norm(&x.data, n, w, eps)
                };
                vec![out(&x.shape, y)]
            }
            Op::Matmul => {
                let x = case.f32("x").map_err(e)?;
                let (_, w) = case.inputs.iter().find(|(n, _)| *n == "w").ok_or("no weight")?;
                let rows = if let Input::Quant { rows, .. } = w { *rows } else { 0 };
                vec![out(&[x.shape[0], rows], Self::matmul(case, x, w)?)]
            }
            Op::Add | Op::AddBias => {
                let a = case.f32("a").map_err(e)?;
                let b = &case.f32("b").map_err(e)?.data;
                vec![out(&a.shape, kernels::add_broadcast(&a.data, b))]
            }
            Op::Rope => {
                let x = case.f32("x").map_err(e)?;
                let pos: Vec<usize> = case.ids("pos").map_err(e)?.iter().map(|&p| p as usize).collect();
                let mut y = x.data.clone();
                let p = |n: &str| case.p(n).map_err(e);
                let spec = oracle::registry::rope_spec_of(case).map_err(e)?;
                kernels::rope(&mut y, &pos, p("n_head")? as usize, p("head_dim")? as usize, &spec);
                vec![out(&x.shape, y)]
            }
            Op::Attention | Op::AttentionSinks | Op::AttentionSoftcap => {
                let (q, k, v) = (case.f32("q").map_err(e)?, case.f32("k").map_err(e)?, case.f32("v").map_err(e)?);
                let pos: Vec<usize> = case.ids("pos").map_err(e)?.iter().map(|&p| p as usize).collect();
                let p = |n: &str| case.pu(n).map_err(e);
                let sinks = if case.op == Op::AttentionSinks { Some(&case.f32("sinks").map_err(e)?.data[..]) } else { None };
                let softcap = if case.op == Op::AttentionSoftcap { case.p("cap").map_err(e)? as f32 } else { 0.0 };
                let hd = p("head_dim")?;
                let a = kernels::AttnCfg { n_head: p("n_head")?, n_head_kv: p("n_head_kv")?, head_dim: hd, window: p("window")?, sinks, softcap, scale: 1.0 / (hd as f32).sqrt() };
                vec![out(&q.shape, kernels::attention(&q.data, &pos, &k.data, &v.data, k.shape[0], &a)?)]
            }
            Op::Softmax => {
                let x = case.f32("x").map_err(e)?;
                vec![out(&x.shape, x.data.chunks(x.shape[1]).flat_map(kernels::softmax).collect())]
            }
            Op::Softcap => {
                let x = case.f32("x").map_err(e)?;
                let c = case.p("cap").map_err(e)? as f32;
                vec![out(&x.shape, x.data.iter().map(|v| kernels::softcap(*v, c)).collect())]
            }
            Op::Silu | Op::GeluTanh => {
                let g = case.f32("gate").map_err(e)?;
                let f = if case.op == Op::Silu { kernels::silu } else { kernels::gelu_tanh };
                vec![out(&g.shape, g.data.iter().map(|v| f(*v)).collect())]
            }
            Op::Swiglu | Op::Geglu => {
                let g = case.f32("gate").map_err(e)?;
                let u = &case.f32("up").map_err(e)?.data;
                let f = if case.op == Op::Swiglu { kernels::silu } else { kernels::gelu_tanh };
                vec![out(&g.shape, g.data.iter().zip(u).map(|(a, b)| f(*a) * b).collect())]
            }
            Op::SwigluOai => {
                let g = case.f32("gate").map_err(e)?;
                let u = &case.f32("up").map_err(e)?.data;
                vec![out(&g.shape, g.data.iter().zip(u).map(|(a, b)| kernels::swiglu_oai(*a, *b)).collect())]
            }
            Op::MoeRoute => {
                let l = case.f32("logits").map_err(e)?;
                let k = case.pu("k").map_err(e)?;
                let (ids, w) = kernels::moe_route(&l.data, l.shape[1], k, case.pu("sigmoid").map_err(e)? == 1, case.pu("normalize").map_err(e)? == 1);
                vec![Output::Ids(ids), out(&[l.shape[0], k], w)]
            }
            Op::Argmax => {
                let x = case.f32("x").map_err(e)?;
                vec![Output::Ids(x.data.chunks(x.shape[1]).map(|r| kernels::argmax(r) as u32).collect())]
            }
            Op::TopK => {
                let x = case.f32("x").map_err(e)?;
                let k = case.pu("k").map_err(e)?;
                vec![Output::Ids(x.data.chunks(x.shape[1]).flat_map(|r| kernels::top_k(r, k)).collect())]
            }
            Op::MlaAttention => {
                let b = oracle::spec::MlaBlock { n_head: case.pu("n_head").map_err(e)?, q_lora_rank: 0, kv_lora_rank: case.pu("kv_lora_rank").map_err(e)?, qk_nope: case.pu("qk_nope").map_err(e)?, qk_rope: case.pu("qk_rope").map_err(e)?, v_head_dim: case.pu("v_head_dim").map_err(e)? };
                b.validate().map_err(e)?;
                let kv_b = &case.f32("kv_b").map_err(e)?.data;
                if kv_b.len() != b.kv_b_dim() * b.kv_lora_rank {
                    return Err(format!("mla_attention: kv_b holds {} values, expected {} x {}", kv_b.len(), b.kv_b_dim(), b.kv_lora_rank));
                }
                let pos: Vec<usize> = case.ids("pos").map_err(e)?.iter().map(|&p| p as usize).collect();
                let (latent, k_pe) = (&case.f32("latent").map_err(e)?.data, &case.f32("k_pe").map_err(e)?.data);
                let (k_b, v_b) = crate::shared::host::split_kv_b(kv_b, &b);
                let y = mla::attend_absorbed(&case.f32("q").map_err(e)?.data, &pos, (latent, k_pe), (&k_b, &v_b), &b, case.p("scale").map_err(e)? as f32)?;
                vec![out(&[pos.len(), b.out_dim()], y)]
            }
            Op::DeltaRule => {
                let (nk, nv, dk, dv) = (case.pu("n_k_head").map_err(e)?, case.pu("n_v_head").map_err(e)?, case.pu("d_k").map_err(e)?, case.pu("d_v").map_err(e)?);
                let blk = oracle::spec::SsmBlock { d_inner: nv * dv, d_state: dk, n_group: nk, n_head: nv, d_conv: 1, kind: oracle::spec::SsmKind::GatedDelta };
                blk.validate().map_err(e)?;
                let f = |n: &str| case.f32(n).map_err(e);
                let (q, k, v) = (f("q")?, f("k")?, f("v")?);
                let m = q.shape[0];
                let (kd, vd) = (nk * dk, nv * dv);
                if q.data.len() != m * kd || k.data.len() != m * kd || v.data.len() != m * vd {
                    return Err(format!("{}: q, k, v of {m} rows are not {kd}, {kd} and {vd} wide", case.id));
                }
                let qkv = crate::shared::join_rows(m, &[(&q.data, kd), (&k.data, kd), (&v.data, vd)]);
                let mut state = f("state")?.data.clone();
                if state.len() != blk.state_len() {
                    return Err(format!("{}: a state of {} values for {} heads of {dv} x {dk}", case.id, state.len(), nv));
                }
                let (y, _) = ssm::delta_scan(&mut state, &qkv, &f("b")?.data, &f("a")?.data, m, &blk, &f("dt_bias")?.data, &f("neg_a")?.data, false, None);
                vec![out(&[m, vd], y), out(&[nv, dv, dk], state)]
            }
            Op::SsmScan => {
                let (nh, ng, hd, ds) = (case.pu("n_head").map_err(e)?, case.pu("n_group").map_err(e)?, case.pu("head_dim").map_err(e)?, case.pu("d_state").map_err(e)?);
                let blk = oracle::spec::SsmBlock { d_inner: nh * hd, d_state: ds, n_group: ng, n_head: nh, d_conv: 1, kind: oracle::spec::SsmKind::Mamba2 };
                blk.validate().map_err(e)?;
                let f = |n: &str| case.f32(n).map_err(e);
                let (x, b, c) = (f("x")?, f("b")?, f("c")?);
                let m = x.shape[0];
                let (xd, bd) = (nh * hd, ng * ds);
                if x.data.len() != m * xd || b.data.len() != m * bd || c.data.len() != m * bd {
                    return Err(format!("{}: x, B, C of {m} rows are not {xd}, {bd} and {bd} wide", case.id));
                }
                let xbc = crate::shared::join_rows(m, &[(&x.data, xd), (&b.data, bd), (&c.data, bd)]);
                let mut state = f("state")?.data.clone();
                if state.len() != blk.state_len() {
                    return Err(format!("{}: a state of {} values for {nh} heads of {hd} x {ds}", case.id, state.len()));
                }
                let (y, _) = ssm::scan(&mut state, &xbc, &f("dt")?.data, m, &blk, &f("dt_bias")?.data, &f("neg_a")?.data, &f("d")?.data, false, None);
                vec![out(&[m, xd], y), out(&[nh, hd, ds], state)]
            }
            Op::Sample => {
                let x = case.f32("x").map_err(e)?;
                let mut rng = oracle::ops::SplitMix64(case.seed);
                let (t, k, p) = (case.p("temperature").map_err(e)?, case.pu("k").map_err(e)?, case.p("top_p").map_err(e)?);
                vec![Output::Ids(x.data.chunks(x.shape[1]).map(|r| kernels::sample(r, t, k, p, &mut rng)).collect())]
            }
        })
    }
}

impl Device for CpuDevice {
    fn name(&self) -> String {
        match self.kv_cache == KvTypes::default() {
            true => "cpu".into(),
            false => format!("cpu:kv-{}", self.kv_cache),
        }
    }
    fn describe(&self) -> String {
        let f32 = |f: Option<crate::KvFormat>| f.unwrap_or(crate::KvFormat::F32);
        let kv = match self.kv_cache {
            c if c == KvTypes::default() => String::new(),
            KvTypes { k, v } if k == v => format!(", {} KV cache", f32(k)),
            KvTypes { k, v } => format!(", {} key / {} value cache", f32(k), f32(v)),
        };
        format!("{}: f32, Q8_0 activations x packed weights{kv}, {}, {} rayon threads", self.name(), qdot::path_name(), rayon::current_num_threads())
    }
    fn arithmetic(&self, case: &OpCase) -> Arithmetic {
        let quantized_weight = case.inputs.iter().any(|(_, i)| matches!(i, Input::Quant { ty, .. } if !qdot::is_float(*ty)));
        Arithmetic { activation_q8_block: (case.op == Op::Matmul && quantized_weight).then_some(32), ..Arithmetic::F32 }
    }
    /// Every op: `run_op` matches them all (a new op does not compile until it has a kernel).
    fn supports(&self, _case: &OpCase) -> Support {
        Support::Yes
    }
    fn run_op(&self, case: &OpCase) -> Result<Vec<Output>, DeviceError> {
        Self::run(case).map_err(|r| fail("cpu", case, r))
    }
    fn load_model(&self, path: &std::path::Path, opts: &crate::ModelOptions) -> Result<Box<dyn crate::DeviceModel>, DeviceError> {
        let kv_cache = if self.kv_cache == KvTypes::default() { opts.kv_cache } else { self.kv_cache };
        let opts = crate::ModelOptions { kv_cache, ..opts.clone() };
        // The loader's errors are this device's (`cpu:kv-TYPE` too).
        let model = model::CpuModel::load(path, &opts).map_err(|e| match e {
            DeviceError::Failed { case, reason, .. } => DeviceError::Failed { device: self.name(), case, reason },
            other => other,
        })?;
        Ok(Box::new(model))
    }
    fn bandwidth_probe(&self, bytes: usize, reps: usize) -> Option<Result<crate::BandwidthProbe, DeviceError>> {
        Some(probe(bytes, reps).map_err(|reason| DeviceError::Failed { device: "cpu".into(), case: "bandwidth probe".into(), reason }))
    }
}

/// Copy bandwidth (rayon over chunks, as the GEMV is) and GEMV weight bandwidth per type, each the
/// best of `reps` wall-clock runs, all in one run so the ratios are like for like.
fn probe(bytes: usize, reps: usize) -> Result<crate::BandwidthProbe, String> {
    use crate::probe;
    use rayon::prelude::*;
    let wall = |f: &mut dyn FnMut() -> Result<(), String>| -> Result<f64, String> {
        let t = std::time::Instant::now();
        f()?;
        Ok(t.elapsed().as_secs_f64())
    };
    let n = probe::copy_floats(bytes);
    let (src, mut dst) = (probe::filled(1.0f32, n, "copy source")?, probe::filled(0.0f32, n, "copy destination")?);
    let t = probe::best_of(reps, &wall, &mut || {
        dst.par_chunks_mut(1 << 16).zip(src.par_chunks(1 << 16)).for_each(|(d, s)| d.copy_from_slice(s));
        Ok(())
    })?;
    let copy_gbps = 2.0 * (4 * n) as f64 / t / 1e9;
    drop((src, dst));
    let x = probe::activations();
    let mut gemv = Vec::new();
    for ty in probe::TYPES {
        let (rows, w) = probe::weights(ty, bytes)?;
        let packed = Packed { ty, rows, cols: probe::COLS, bytes: &w };
        let t = probe::best_of(reps, &wall, &mut || {
            std::hint::black_box(matmul_packed(&x, 1, packed));
            Ok(())
        })?;
        let kernel = format!("matmul_packed over {} rayon threads", rayon::current_num_threads());
        gemv.push(crate::GemvRate { ty: ty.name().to_string(), weight_bytes: w.len(), gbps: w.len() as f64 / t / 1e9, kernel, alternative: false });
    }
    Ok(crate::BandwidthProbe { bytes, copy_gbps, gemv, reps, not_hardware: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Matrices multiplied as a group (one quantization of `x`, one parallel loop; a float
    /// member sends the group down the one-by-one path) give each the bits of its own call.
    #[test]
    fn a_group_of_matmuls_gives_each_the_bits_of_its_own() {
        let val = |i: usize, salt: usize| (((i * 2654435761 + salt * 40503) % 10007) as f32 / 10007.0 - 0.5) * 2.0;
        let (k, m) = (256usize, 5usize); // 5 tokens: one group of four, then one alone
        let x: Vec<f32> = (0..m * k).map(|i| val(i, 1)).collect();
        let mats: Vec<(GgmlType, usize, Vec<u8>)> = [(GgmlType::Q4_1, 70), (GgmlType::Q4_K, 33), (GgmlType::Q8_0, 40), (GgmlType::F16, 9)]
            .into_iter()
            .enumerate()
            .map(|(s, (ty, rows))| (ty, rows, oracle::quant::encode(ty, &(0..rows * k).map(|i| val(i, s + 2)).collect::<Vec<_>>()).expect("encodes")))
            .collect();
        let packed: Vec<Packed> = mats.iter().map(|(ty, rows, b)| Packed { ty: *ty, rows: *rows, cols: k, bytes: b }).collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for group in [&packed[..3], &packed[..]] {
            let together = matmul_packed_group(&x, m, k, group);
            assert_eq!(together.len(), group.len());
            for (w, y) in group.iter().zip(&together) {
                assert_eq!(bits(y), bits(&matmul_packed(&x, m, *w)), "{:?} in a group of {}", w.ty, group.len());
                assert!(y.iter().any(|v| *v != 0.0));
            }
        }
    }

    /// A long prompt's quantized matmul (split by tokens, written token by token) gives every
    /// token and row the bits of that row's one-token dot, with a short last group and in a
    /// group of matrices.
    #[test]
    fn a_long_prompt_gives_every_dot_the_bits_of_its_own() {
        let val = |i: usize, salt: usize| (((i * 2654435761 + salt * 40503) % 10007) as f32 / 10007.0 - 0.5) * 2.0;
        let m = TOKEN_TASKS_FROM + 7; // a last group of seven: four together, then three alone
        for (ty, k, rows) in [(GgmlType::Q4_1, 256, 37), (GgmlType::Q8_0, 64, 9), (GgmlType::Q4_K, 256, 5)] {
            let x: Vec<f32> = (0..m * k).map(|i| val(i, 1)).collect();
            let w = oracle::quant::encode(ty, &(0..rows * k).map(|i| val(i, 3)).collect::<Vec<_>>()).expect("encodes");
            let packed = Packed { ty, rows, cols: k, bytes: &w };
            let alone = matmul_packed(&x, m, packed);
            let grouped = matmul_packed_group(&x, m, k, &[packed, packed]);
            let row_bytes = w.len() / rows;
            for t in 0..m {
                let xq = qdot::quantize_q8(&x[t * k..(t + 1) * k]);
                for r in 0..rows {
                    let want = qdot::dot_row(ty, &w[r * row_bytes..(r + 1) * row_bytes], &xq).to_bits();
                    for (how, y) in [("alone", &alone), ("first of a group", &grouped[0]), ("second of a group", &grouped[1])] {
                        assert_eq!(y[t * rows + r].to_bits(), want, "{ty:?} {how}: token {t} row {r}");
                    }
                }
            }
        }
    }

    /// Float weights with several tokens (four per pass over a widened row, then the rest one by
    /// one) give each token the bits of `dot_f32` of its row and the widened weight row.
    #[test]
    fn float_weights_give_every_token_the_bits_of_its_own_dot() {
        let val = |i: usize, salt: usize| (((i * 2654435761 + salt * 40503) % 10007) as f32 / 10007.0 - 0.5) * 2.0;
        for (ty, k, rows) in [(GgmlType::F32, 576, 21), (GgmlType::F16, 67, 5), (GgmlType::BF16, 256, 18)] {
            let w = oracle::quant::encode(ty, &(0..rows * k).map(|i| val(i, 7)).collect::<Vec<_>>()).expect("encodes");
            let mut wr = vec![0.0f32; k];
            for m in [2usize, 4, 5, 9] {
                let x: Vec<f32> = (0..m * k).map(|i| val(i, m)).collect();
                let y = matmul_packed(&x, m, Packed { ty, rows, cols: k, bytes: &w });
                for r in 0..rows {
                    qdot::float_row(ty, &w[r * w.len() / rows..(r + 1) * w.len() / rows], &mut wr);
                    for t in 0..m {
                        let want = qdot::dot_f32(&x[t * k..(t + 1) * k], &wr);
                        assert_eq!(y[t * rows + r].to_bits(), want.to_bits(), "{ty:?} k={k} m={m} row {r} token {t}");
                    }
                }
            }
        }
    }
}
