//! A state-space layer (Mamba-2 or gated DeltaNet) on a GPU device, stage by stage: the input
//! projection, the causal convolution over the inputs the cache keeps, the scan over the state
//! the cache keeps, the gated norm and the output projection. Every step of a sequence reads the
//! state its cache holds as of the sequence's first position; a serving cache keeps the state
//! after every position (a reused prefix restores it), a single sequence's only the latest.

use super::cache::{record, KvCache, LayerState, Seg};
use super::recurrent::StateIo;
use super::{DevBuf, Gpu, GpuMat};
use crate::shared::host::SsmWeights;
use oracle::spec::{SsmBlock, SsmKind};
use oracle::Tap;
use std::sync::Arc;

/// A state-space block's weights on the device (see `shared::host::SsmWeights`).
pub(super) struct GpuSsm {
    in_proj: GpuMat,
    /// A gated DeltaNet's z and b/a projections.
    gate_ba: Option<(GpuMat, GpuMat)>,
    conv: DevBuf,
    conv_bias: DevBuf,
    dt_bias: DevBuf,
    a: DevBuf,
    /// Mamba-2's skip; a gated DeltaNet has none.
    d: Option<DevBuf>,
    norm: DevBuf,
    pub out: GpuMat,
}

impl GpuSsm {
    pub(super) fn upload(g: &Arc<Gpu>, w: &SsmWeights) -> Result<GpuSsm, String> {
        let mat = |p: &crate::shared::host::PackedMat| g.upload_mat(p.ty, p.rows, p.cols, &p.bytes);
        let gate_ba = match (&w.gate_proj, &w.ba_proj) {
            (Some(z), Some(ba)) => Some((mat(z)?, mat(ba)?)),
            (None, None) => None,
            _ => return Err("a gated DeltaNet block with one of its z and b/a projections".into()),
        };
        Ok(GpuSsm {
            in_proj: mat(&w.in_proj)?,
            gate_ba,
            conv: g.upload_f32(&w.conv)?,
            conv_bias: g.upload_f32(&w.conv_bias)?,
            dt_bias: g.upload_f32(&w.dt_bias)?,
            a: g.upload_f32(&w.a)?,
            d: if w.d.is_empty() { None } else { Some(g.upload_f32(&w.d)?) },
            norm: g.upload_f32(&w.norm)?,
            out: mat(&w.out)?,
        })
    }
}

/// A buffer of position rows and where, in each row, a part starts: `(buffer, row stride, offset)`.
type Part = (usize, usize, usize);

/// One state-space layer's buffers between its stages, over the `m` rows of a step.
pub(super) struct SsmStep {
    m: usize,
    /// The projections' outputs: Mamba-2's one `[m][in_dim]`, a gated DeltaNet's q/k/v, z, b/a.
    proj: Vec<DevBuf>,
    /// Where the convolution's inputs, the gate z and the per-head inputs are in `proj`.
    conv_in: Part,
    z: Part,
    heads: Part,
    xbc: Option<DevBuf>,
    y: Option<DevBuf>,
}

fn at(bufs: &[DevBuf], (i, stride, off): Part, row: usize) -> u64 {
    bufs[i].at_f32(row * stride + off)
}

/// The cache of segment `seg`'s layer `li`: its convolution inputs and states.
fn ssm_state<'a>(caches: &'a [KvCache], seg: &Seg, li: usize) -> Result<(&'a DevBuf, &'a DevBuf, bool), String> {
    match caches[seg.cache].layers.get(li) {
        Some(LayerState::Ssm { inputs, states }) => Ok((inputs, states, caches[seg.cache].history)),
        _ => Err(format!("layer {li}: no state-space state in the cache")),
    }
}

impl SsmStep {
    /// The input projection of the normed rows `h` (`m` rows of `d`), and the tap `ssm_in`.
    pub(super) fn project(g: &Arc<Gpu>, b: &SsmBlock, w: &GpuSsm, h: u64, d: usize, m: usize, taps: &mut dyn Tap, name: &str, start: usize) -> Result<SsmStep, String> {
        match (&w.gate_ba, b.kind) {
            (None, SsmKind::Mamba2) => {
                let id = b.in_dim();
                let zx = g.alloc(4 * m * id)?;
                g.matmul(&w.in_proj, h, d, m, zx.ptr)?;
                record(taps, name, &zx, start, m, id)?;
                Ok(SsmStep { m, proj: vec![zx], conv_in: (0, id, b.conv_at()), z: (0, id, b.z_at()), heads: (0, id, b.heads_at()), xbc: None, y: None })
            }
            (Some((zp, bap)), SsmKind::GatedDelta) => {
                let (cd, di, nh) = (b.conv_dim(), b.d_inner, b.n_head);
                let (qkv, z, ba) = (g.alloc(4 * m * cd)?, g.alloc(4 * m * di)?, g.alloc(4 * m * 2 * nh)?);
                g.matmul_group(&[(&w.in_proj, qkv.ptr), (zp, z.ptr), (bap, ba.ptr)], h, d, m)?;
                if taps.enabled() {
                    let rows = crate::shared::delta_in_rows(b, &qkv.download_f32(m * cd)?, &z.download_f32(m * di)?, &ba.download_f32(m * 2 * nh)?, m);
                    taps.record(name, start, m, b.in_dim(), &rows);
                }
                Ok(SsmStep { m, proj: vec![qkv, z, ba], conv_in: (0, cd, 0), z: (1, di, 0), heads: (2, 2 * nh, 0), xbc: None, y: None })
            }
            _ => Err("the block's kind and its weights disagree".into()),
        }
    }

    /// Each segment's convolution inputs appended to its cache, then the convolution over them.
    pub(super) fn convolve(&mut self, g: &Arc<Gpu>, b: &SsmBlock, w: &GpuSsm, li: usize, caches: &[KvCache], segs: &[Seg]) -> Result<&DevBuf, String> {
        let cd = b.conv_dim();
        let xbc = g.alloc(4 * self.m * cd)?;
        let mut r0 = 0;
        for seg in segs {
            let n = seg.tokens.len();
            let (inputs, _, _) = ssm_state(caches, seg, li)?;
            g.copy_cols((at(&self.proj, self.conv_in, r0), self.conv_in.1, 0), (inputs.at_f32(seg.start * cd), cd, 0), n, cd)?;
            g.conv_silu(inputs.ptr, w.conv.ptr, w.conv_bias.ptr, xbc.at_f32(r0 * cd), seg.start, n, cd, b.d_conv)?;
            r0 += n;
        }
        Ok(self.xbc.insert(xbc))
    }

    /// Each segment's scan from the state its cache holds, the states after each position kept
    /// as its cache keeps them. The states of every row go to the tap `state_tap` when taps are
    /// on. Returns the outputs (`[m][d_inner]`).
    pub(super) fn scan(&mut self, g: &Arc<Gpu>, b: &SsmBlock, w: &GpuSsm, li: usize, caches: &[KvCache], segs: &[Seg], taps: &mut dyn Tap, state_tap: &str, start: usize) -> Result<&DevBuf, String> {
        let (cd, sl, m) = (b.conv_dim(), b.state_len(), self.m);
        let xbc = self.xbc.as_ref().ok_or("scan before the convolution")?;
        let y = g.alloc(4 * m * b.d_inner)?;
        let kept = if taps.enabled() { Some(g.alloc(4 * m * sl)?) } else { None };
        let zeros = if segs.iter().any(|s| s.start == 0) { Some(g.upload_f32(&vec![0.0; sl])?) } else { None };
        let d = w.d.as_ref().map_or(0, |d| d.ptr);
        let mut r0 = 0;
        for seg in segs {
            let n = seg.tokens.len();
            let (_, states, history) = ssm_state(caches, seg, li)?;
            let from = match (&zeros, seg.start, history) {
                (Some(z), 0, _) => z.ptr,
                (_, s, true) => states.at_f32((s - 1) * sl),
                (_, _, false) => states.ptr,
            };
            let io = match (&kept, history) {
                (Some(k), _) => StateIo { from, to: k.at_f32(r0 * sl), stride: sl },
                (None, true) => StateIo { from, to: states.at_f32(seg.start * sl), stride: sl },
                (None, false) => StateIo { from, to: states.ptr, stride: 0 },
            };
            let heads = (at(&self.proj, self.heads, r0), self.heads.1);
            g.scan(b, xbc.at_f32(r0 * cd), heads, [w.dt_bias.ptr, w.a.ptr, d], io, y.at_f32(r0 * b.d_inner), n)?;
            match (&kept, history) {
                (Some(k), true) => g.copy(k.at_f32(r0 * sl), states.at_f32(seg.start * sl), n * sl)?,
                (Some(k), false) => g.copy(k.at_f32((r0 + n - 1) * sl), states.ptr, sl)?,
                (None, _) => {}
            }
            r0 += n;
        }
        if let Some(k) = &kept {
            record(taps, state_tap, k, start, m, sl)?;
        }
        Ok(self.y.insert(y))
    }

    /// The gated norm of the scan's outputs (`[m][d_inner]`).
    pub(super) fn norm(&self, g: &Arc<Gpu>, b: &SsmBlock, w: &GpuSsm, eps: f32) -> Result<DevBuf, String> {
        let y = self.y.as_ref().ok_or("gated norm before the scan")?;
        let out = g.alloc(4 * self.m * b.d_inner)?;
        g.gated_norm(b, y.ptr, (at(&self.proj, self.z, 0), self.z.1), w.norm.ptr, out.ptr, self.m, eps)?;
        Ok(out)
    }
}
