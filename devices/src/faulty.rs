//! Test-only devices with one injected bug each (feature `faults`): the bug classes real engines
//! ship. The gate-sensitivity tests run the kernel suite on each and require it to go red, while
//! the correct `cpu` device stays green on the same cases. Each fault is injected by changing what
//! the correct cpu kernels are given (or, where that cannot express the bug, a small faulty kernel).

use crate::cpu::CpuDevice;
use crate::{fail, Arithmetic, Device, DeviceError, Support};
use oracle::quant::GgmlType;
use oracle::registry::{Input, Op, OpCase, Output, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// RoPE applied at position + 1.
    RopeOffByOne,
    /// Normal (adjacent-pair) RoPE where neox was asked for, and the reverse.
    RopeWrongLayout,
    /// Norm epsilon ten times too large.
    NormEpsWrong,
    /// The bias add forgotten.
    MissingBias,
    /// Weight rows read with the wrong stride (row r reads row r + 1).
    MisstridedWeight,
    /// Quantized block scale 3% off.
    QuantScaleWrong,
    /// The min/offset of Q4_1, Q5_1, Q2_K, Q4_K, Q5_K blocks ignored.
    QuantMinIgnored,
    /// Softmax without subtracting the row maximum (overflows).
    SoftmaxNoMaxSub,
    /// The causal mask off by one (a query does not see its own key).
    CausalOffByOne,
    /// Query head h uses kv head h % n_kv instead of h / (n_head / n_kv).
    GqaMappingWrong,
    /// Keys/values appended one position late.
    KvWrongPosition,
    /// A row-strided view of the activations read as if it were contiguous.
    ViewStrideIgnored,
    /// GPT-OSS's attention sinks left out of the softmax.
    SinkDropped,
    /// Gemma 2's soft-cap not applied (scores or logits passed through).
    SoftcapOff,
}

impl Fault {
    pub const ALL: [Fault; 14] = [
        Fault::RopeOffByOne,
        Fault::RopeWrongLayout,
        Fault::NormEpsWrong,
        Fault::MissingBias,
        Fault::MisstridedWeight,
        Fault::QuantScaleWrong,
        Fault::QuantMinIgnored,
        Fault::SoftmaxNoMaxSub,
        Fault::CausalOffByOne,
        Fault::GqaMappingWrong,
        Fault::KvWrongPosition,
        Fault::ViewStrideIgnored,
        Fault::SinkDropped,
        Fault::SoftcapOff,
    ];

    /// The ops the fault lives in.
    pub fn ops(self) -> &'static [Op] {
        match self {
            Fault::RopeOffByOne | Fault::RopeWrongLayout => &[Op::Rope],
            Fault::NormEpsWrong => &[Op::RmsNorm, Op::LayerNorm, Op::QkNorm],
            Fault::MissingBias => &[Op::AddBias],
            Fault::MisstridedWeight | Fault::QuantScaleWrong | Fault::QuantMinIgnored | Fault::ViewStrideIgnored => &[Op::Matmul],
            Fault::SoftmaxNoMaxSub => &[Op::Softmax],
            Fault::CausalOffByOne | Fault::GqaMappingWrong | Fault::KvWrongPosition => &[Op::Attention],
            Fault::SinkDropped => &[Op::AttentionSinks],
            Fault::SoftcapOff => &[Op::AttentionSoftcap, Op::Softcap],
        }
    }
}

pub struct FaultyDevice(pub Fault);

fn set_param(case: &mut OpCase, name: &'static str, f: impl Fn(f64) -> f64) {
    if let Some(v) = case.params.get_mut(name) {
        *v = f(*v);
    }
}

fn f32_input<'a>(case: &'a mut OpCase, name: &str) -> Option<&'a mut Tensor> {
    case.inputs.iter_mut().find(|(n, _)| *n == name).and_then(|(_, i)| if let Input::F32(t) = i { Some(t) } else { None })
}

fn ids_input<'a>(case: &'a mut OpCase, name: &str) -> Option<&'a mut Vec<u32>> {
    case.inputs.iter_mut().find(|(n, _)| *n == name).and_then(|(_, i)| if let Input::Ids(v) = i { Some(v) } else { None })
}

/// Byte offsets of the f16 scale (`d`) and min (`m`, if any) fields inside one block (the
/// oracle's own table, `oracle::quant::scale_fields`).
fn scale_fields(ty: GgmlType) -> (Option<usize>, Option<usize>) {
    let f = oracle::quant::scale_fields(ty);
    (f.first().copied(), f.get(1).copied())
}

impl FaultyDevice {
    fn inject(&self, case: &OpCase) -> Result<Vec<Output>, String> {
        let mut c = case.clone();
        let cpu = CpuDevice::default();
        let run = |c: &OpCase| cpu.run_op(c).map_err(|e| e.to_string());
        match self.0 {
            Fault::RopeOffByOne => {
                if let Some(p) = ids_input(&mut c, "pos") {
                    p.iter_mut().for_each(|v| *v += 1);
                }
                run(&c)
            }
            Fault::RopeWrongLayout => {
                set_param(&mut c, "neox", |v| 1.0 - v);
                run(&c)
            }
            Fault::NormEpsWrong => {
                set_param(&mut c, "eps", |v| v * 10.0);
                run(&c)
            }
            Fault::MissingBias => {
                let a = c.f32("a").map_err(|e| e.to_string())?.clone();
                Ok(vec![Output::F32(a)])
            }
            Fault::MisstridedWeight | Fault::QuantScaleWrong | Fault::QuantMinIgnored => {
                if let Some((_, Input::Quant { ty, rows, cols, bytes })) = c.inputs.iter_mut().find(|(n, _)| *n == "w") {
                    let row_bytes = ty.bytes_for(*cols as u64).unwrap_or(0) as usize;
                    let (d_at, m_at) = scale_fields(*ty);
                    match self.0 {
                        Fault::MisstridedWeight => {
                            let orig = bytes.clone();
                            for r in 0..*rows {
                                let src = (r + 1) % *rows;
                                bytes[r * row_bytes..(r + 1) * row_bytes].copy_from_slice(&orig[src * row_bytes..(src + 1) * row_bytes]);
                            }
                        }
                        _ => {
                            let at = if self.0 == Fault::QuantScaleWrong { d_at } else { m_at };
                            if let Some(at) = at {
                                for blk in bytes.chunks_mut(ty.type_size()) {
                                    let v = half::f16::from_le_bytes([blk[at], blk[at + 1]]).to_f32();
                                    let nv = if self.0 == Fault::QuantScaleWrong { v * 1.03 } else { 0.0 };
                                    blk[at..at + 2].copy_from_slice(&half::f16::from_f32(nv).to_le_bytes());
                                }
                            }
                        }
                    }
                }
                run(&c)
            }
            Fault::ViewStrideIgnored => {
                if let Some(k) = c.params.remove("x_cols") {
                    let k = k as usize;
                    if let Some(t) = f32_input(&mut c, "x") {
                        let m = t.shape[0];
                        t.data.truncate(m * k);
                        t.shape = vec![m, k];
                    }
                }
                run(&c)
            }
            Fault::SoftmaxNoMaxSub => {
                let x = c.f32("x").map_err(|e| e.to_string())?;
                let n = x.shape[1];
                let data = x
                    .data
                    .chunks(n)
                    .flat_map(|row| {
                        let e: Vec<f32> = row.iter().map(|v| v.exp()).collect();
                        let s: f32 = e.iter().sum();
                        e.into_iter().map(move |v| v / s)
                    })
                    .collect();
                Ok(vec![Output::F32(Tensor { shape: x.shape.clone(), data })])
            }
            Fault::SinkDropped | Fault::SoftcapOff => {
                if c.op == Op::Softcap {
                    return Ok(vec![Output::F32(c.f32("x").map_err(|e| e.to_string())?.clone())]);
                }
                // Plain attention on the same inputs (the sinks input, the cap, left unread).
                c.op = Op::Attention;
                run(&c)
            }
            Fault::CausalOffByOne => {
                // Each query sees keys up to its position - 1 (position 0 keeps its only key).
                if let Some(p) = ids_input(&mut c, "pos") {
                    p.iter_mut().for_each(|v| *v = v.saturating_sub(1));
                }
                run(&c)
            }
            Fault::KvWrongPosition => {
                let nkv_hd = c.pu("n_head_kv").unwrap_or(1) * c.pu("head_dim").unwrap_or(1);
                for name in ["k", "v"] {
                    if let Some(t) = f32_input(&mut c, name) {
                        let orig = t.data.clone();
                        for j in 1..t.shape[0] {
                            t.data[j * nkv_hd..(j + 1) * nkv_hd].copy_from_slice(&orig[(j - 1) * nkv_hd..j * nkv_hd]);
                        }
                    }
                }
                run(&c)
            }
            Fault::GqaMappingWrong => {
                let (nh, nkv, hd) = (c.pu("n_head").unwrap_or(1), c.pu("n_head_kv").unwrap_or(1), c.pu("head_dim").unwrap_or(1));
                let group = nh / nkv.max(1);
                // slot(h) is the head whose correct kv head is h % nkv, so running the correct
                // kernel on permuted queries computes head h against kv head h % nkv.
                let slot = |h: usize| (h % nkv) * group + h / nkv;
                let q = c.f32("q").map_err(|e| e.to_string())?.clone();
                let m = q.shape[0];
                let mut qp = q.clone();
                for t in 0..m {
                    for h in 0..nh {
                        let (src, dst) = ((t * nh + h) * hd, (t * nh + slot(h)) * hd);
                        qp.data[dst..dst + hd].copy_from_slice(&q.data[src..src + hd]);
                    }
                }
                *f32_input(&mut c, "q").ok_or("no q")? = qp;
                let out = run(&c)?;
                let Some(Output::F32(o)) = out.into_iter().next() else { return Err("no output".into()) };
                let mut back = o.clone();
                for t in 0..m {
                    for h in 0..nh {
                        let (dst, src) = ((t * nh + h) * hd, (t * nh + slot(h)) * hd);
                        back.data[dst..dst + hd].copy_from_slice(&o.data[src..src + hd]);
                    }
                }
                Ok(vec![Output::F32(back)])
            }
        }
    }
}

impl Device for FaultyDevice {
    fn name(&self) -> String {
        format!("faulty:{:?}", self.0)
    }
    fn arithmetic(&self, case: &OpCase) -> Arithmetic {
        CpuDevice::default().arithmetic(case)
    }
    fn supports(&self, case: &OpCase) -> Support {
        CpuDevice::default().supports(case)
    }
    fn run_op(&self, case: &OpCase) -> Result<Vec<Output>, DeviceError> {
        if !self.0.ops().contains(&case.op) {
            return CpuDevice::default().run_op(case);
        }
        self.inject(case).map_err(|r| fail(&self.name(), case, r))
    }
    /// Its whole model composed of its own ops (`op_model`), the fault in every call of its op.
    fn load_model(&self, path: &std::path::Path, _opts: &crate::ModelOptions) -> Result<Box<dyn crate::DeviceModel>, DeviceError> {
        Ok(Box::new(crate::op_model::OpModel::load(std::sync::Arc::new(FaultyDevice(self.0)), path)?))
    }
}

/// Bugs in a whole model's wiring rather than in one kernel (Gemma 3's, GPT-OSS's): the `cpu`
/// device's model with its spec or weights changed after loading, while it reports the file's
/// spec to the suites.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFault {
    /// The windowed layers rotate with the global RoPE base instead of their own.
    LocalRopeBaseGlobal,
    /// The norms of the attention and FFN outputs skipped.
    PostNormsDropped,
    /// The embeddings not multiplied by sqrt(n_embd).
    EmbeddingScaleDropped,
    /// GPT-OSS's attention sinks left out of the softmax.
    SinksDropped,
    /// GPT-OSS's experts run a plain SwiGLU (silu(gate) * up) instead of the clamped one.
    PlainSwiglu,
    /// YaRN's correction range rounded out to whole dimensions where GPT-OSS uses it as computed.
    YarnTruncated,
    /// Gemma 2's soft-capping of the attention scores and the logits left out.
    SoftcapDropped,
    /// A state-space layer's recurrent state kept in bf16 between positions (f32 asked).
    SsmStateBf16,
    /// The state-space convolution's window one position off (each kernel tap reads the input
    /// one position later: the newest input is read by the second-to-last tap, not the last).
    SsmConvShifted,
    /// The decay gate's sign flipped: `exp(-dt A)` for `exp(dt A)` (the state grows).
    SsmDecaySign,
    /// Granite's residual branches added unscaled (`residual_multiplier` ignored).
    ResidualScaleDropped,
    /// Qwen3-Next's attention output gate never applied (the gate projected, then dropped).
    AttnGateDropped,
    /// RoPE over the whole head where the model rotates only a share of it (Qwen3-Next's
    /// quarter).
    RopeWholeHead,
    /// Latent attention's absorbed form scaling its scores by the cached row's width
    /// (`1/sqrt(kv_lora_rank + qk_rope)`) instead of the query head's.
    MlaAbsorbedScale,
    /// Latent attention's RoPE applied to the first `qk_rope` values of each query head (the
    /// unrotated part) instead of the last.
    MlaRopeSliceSwapped,
    /// DeepSeek V3's routing without its group limit: the experts chosen from every group.
    ExpertGroupsIgnored,
}

impl ModelFault {
    /// Gemma 3's wiring bugs.
    pub const GEMMA: [ModelFault; 3] = [ModelFault::LocalRopeBaseGlobal, ModelFault::PostNormsDropped, ModelFault::EmbeddingScaleDropped];
    /// GPT-OSS's.
    pub const GPT_OSS: [ModelFault; 3] = [ModelFault::SinksDropped, ModelFault::PlainSwiglu, ModelFault::YarnTruncated];
    /// Mamba-2's.
    pub const MAMBA2: [ModelFault; 3] = [ModelFault::SsmStateBf16, ModelFault::SsmConvShifted, ModelFault::SsmDecaySign];
    /// Qwen3-Next's beyond its recurrent layers' (those of [`ModelFault::MAMBA2`]).
    pub const QWEN3_NEXT: [ModelFault; 2] = [ModelFault::AttnGateDropped, ModelFault::RopeWholeHead];
    /// DeepSeek V3's latent attention's.
    pub const MLA: [ModelFault; 3] = [ModelFault::MlaAbsorbedScale, ModelFault::MlaRopeSliceSwapped, ModelFault::ExpertGroupsIgnored];

    /// The tap kind where the bug first shows (isolated comparison): an engine that skips the
    /// post-norms records none, so the first tap off is the residual sum they feed.
    pub fn first_tap(self) -> &'static str {
        match self {
            ModelFault::LocalRopeBaseGlobal => "attn_q_rope",
            ModelFault::PostNormsDropped => "ffn_inp",
            ModelFault::EmbeddingScaleDropped => "inp_embd",
            ModelFault::SinksDropped => "attn_kqv",
            // The experts' activations have no taps: their sum is the first one off.
            ModelFault::PlainSwiglu => "ffn_out",
            ModelFault::YarnTruncated => "attn_q_rope",
            ModelFault::SoftcapDropped => "attn_kqv",
            ModelFault::SsmStateBf16 | ModelFault::SsmDecaySign => "ssm_state",
            ModelFault::SsmConvShifted => "ssm_conv",
            ModelFault::ResidualScaleDropped => "ffn_inp",
            // An engine that skips the gate records no gated output: the projection of the
            // ungated one is the first tap off.
            ModelFault::AttnGateDropped => "attn_out",
            ModelFault::RopeWholeHead => "attn_q_rope",
            ModelFault::MlaAbsorbedScale => "attn_kqv",
            ModelFault::MlaRopeSliceSwapped => "attn_q_rope",
            ModelFault::ExpertGroupsIgnored => "ffn_moe_topk",
        }
    }

    /// The `cpu` device's model of `path` with this bug.
    pub fn load(self, path: &std::path::Path) -> Result<Box<dyn crate::DeviceModel>, DeviceError> {
        let mut inner = crate::cpu::model::CpuModel::load(path, &crate::ModelOptions::default())?;
        let spec = inner.spec.clone();
        match self {
            ModelFault::LocalRopeBaseGlobal => inner.spec.rope_swa = None,
            ModelFault::PostNormsDropped => {
                inner.spec.post_norms = false;
                inner
                    .spec
                    .derive_layers(None)
                    .map_err(|e| DeviceError::Failed {
                        device: "cpu".into(),
                        case: "model".into(),
                        reason: e.to_string(),
                    })?;
            }
            ModelFault::EmbeddingScaleDropped => inner.spec.embd_scale = None,
            ModelFault::SinksDropped => inner.layers.iter_mut().for_each(|l| {
                if let crate::shared::host::Mixer::Attention(a) = &mut l.mixer {
                    a.sinks = None;
                }
            }),
            ModelFault::PlainSwiglu => inner.spec.activation = oracle::spec::Activation::Silu,
            ModelFault::YarnTruncated => {
                if let oracle::spec::RopeScaling::Yarn { truncate, .. } = &mut inner.spec.rope.scaling {
                    *truncate = true;
                }
            }
            ModelFault::SoftcapDropped => (inner.spec.attn_softcap, inner.spec.final_softcap) = (None, None),
            ModelFault::ResidualScaleDropped => inner.spec.residual_scale = None,
            ModelFault::AttnGateDropped => inner.spec.layers.iter_mut().for_each(|l| l.stages.retain(|s| *s != oracle::spec::Stage::AttnGate)),
            ModelFault::RopeWholeHead => inner.spec.rope.n_rot = inner.spec.head_dim,
            ModelFault::SsmStateBf16 => inner.ssm_state_rounding = Some(|v| half::bf16::from_f32(v).to_f32()),
            ModelFault::MlaAbsorbedScale => inner.mla_fault = crate::cpu::mla::MlaFault::ScaleOfCachedRow,
            ModelFault::MlaRopeSliceSwapped => inner.mla_fault = crate::cpu::mla::MlaFault::RopeOnUnrotated,
            ModelFault::ExpertGroupsIgnored => {
                if let Some(m) = &mut inner.spec.moe {
                    m.groups = None;
                }
            }
            ModelFault::SsmConvShifted | ModelFault::SsmDecaySign => {
                let k = spec.ssm.map_or(1, |b| b.d_conv);
                for l in &mut inner.layers {
                    let crate::shared::host::Mixer::Ssm(w) = &mut l.mixer else { continue };
                    if self == ModelFault::SsmDecaySign {
                        w.a.iter_mut().for_each(|a| *a = -*a);
                    } else {
                        // Each channel's taps moved one place: tap k takes tap k + 1's weight,
                        // the last none, so each weight meets the input one position older
                        // than it should and the newest input is not read.
                        for taps in w.conv.chunks_exact_mut(k) {
                            taps.rotate_left(1);
                            taps[k - 1] = 0.0;
                        }
                    }
                }
            }
        }
        Ok(Box::new(FaultyModel { inner, spec }))
    }
}

struct FaultyModel {
    inner: crate::cpu::model::CpuModel,
    /// The file's spec, as a correct engine would report it.
    spec: oracle::ModelSpec,
}

impl crate::DeviceModel for FaultyModel {
    fn spec(&self) -> &oracle::ModelSpec {
        &self.spec
    }
    fn arithmetic(&self) -> Arithmetic {
        self.inner.arithmetic()
    }
    fn forward(&mut self, tokens: &[u32], taps: &mut dyn oracle::Tap) -> Result<Vec<f32>, DeviceError> {
        self.inner.forward(tokens, taps)
    }
    fn cached(&self) -> usize {
        self.inner.cached()
    }
    fn reset(&mut self) {
        self.inner.reset()
    }
}

pub use crate::cpu::serve::ServeFault;

/// The `cpu` device's model of `path` with serving bug `fault` in its schedule executor (its
/// one-request runs unchanged).
pub fn serving_model(fault: ServeFault, path: &std::path::Path) -> Result<Box<dyn crate::DeviceModel>, DeviceError> {
    let mut m = crate::cpu::model::CpuModel::load(path, &crate::ModelOptions::default())?;
    m.serve_fault = Some(fault);
    Ok(Box::new(m))
}
