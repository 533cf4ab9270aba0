//! The launches of the recurrent layers' kernels (`kernels/recurrent.cu`): the convolution's
//! history, the convolution, Mamba-2's scan, a gated DeltaNet's delta rule and their gated norms.

use super::{Arg, Gpu, GpuError};
use oracle::spec::{SsmBlock, SsmKind};

/// Where a scan reads the state before its first position and writes the state after each.
#[derive(Clone, Copy)]
pub(super) struct StateIo {
    /// The state before the first position (`state_len` floats).
    pub from: u64,
    /// Where the state after position 0 goes; position t's at `to + 4 * t * stride`.
    pub to: u64,
    /// Floats between two positions' states (0: every position's over the same floats, which
    /// may be `from`'s: the state updated in place).
    pub stride: usize,
}

impl Gpu {
    /// `y[t * ystride + yoff..][..c] = x[t * xstride + xoff..][..c]` for `m` rows (each side
    /// `(pointer, stride, offset)`, in floats).
    pub fn copy_cols(&self, (x, xstride, xoff): (u64, usize, usize), (y, ystride, yoff): (u64, usize, usize), m: usize, c: usize) -> Result<(), GpuError> {
        self.launch_flat(
            "ts_copy_cols",
            m * c,
            &[Arg::Ptr(x), Arg::I64(xstride as i64), Arg::I64(xoff as i64), Arg::Ptr(y), Arg::I64(ystride as i64), Arg::I64(yoff as i64), Arg::I64(m as i64), Arg::I32(c as i32)],
        )
    }

    /// The causal convolution of positions `start..start + m` (width `k`, `c` channels) over the
    /// inputs `hist` holds for positions `0..start + m`, plus bias, then SiLU, into `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_silu(&self, hist: u64, w: u64, bias: u64, out: u64, start: usize, m: usize, c: usize, k: usize) -> Result<(), GpuError> {
        if k == 0 {
            return Err("conv_silu: a convolution of width 0".to_string().into());
        }
        self.launch_flat("ts_conv_silu", m * c, &[Arg::Ptr(hist), Arg::Ptr(w), Arg::Ptr(bias), Arg::Ptr(out), Arg::I32(start as i32), Arg::I32(m as i32), Arg::I32(c as i32), Arg::I32(k as i32)])
    }

    /// The scan of block `b` over `m` positions of convolved rows `xbc` (`conv_dim` wide),
    /// reading and writing states as `io` says, outputs into `y` (`[m][d_inner]`). `heads`: the
    /// per-head inputs — Mamba-2's time steps (head h at `heads + 4 * (t * stride + h)`), or a
    /// gated DeltaNet's b/a rows as stored (`2 * n_head` each, stride ignored).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn scan(&self, b: &SsmBlock, xbc: u64, (heads, stride): (u64, usize), [dt_bias, a, d]: [u64; 3], io: StateIo, y: u64, m: usize) -> Result<(), GpuError> {
        let (nh, hd, ds, ng) = (b.n_head, b.head_dim(), b.d_state, b.n_group);
        if nh == 0 || ng == 0 || !nh.is_multiple_of(ng) {
            return Err(format!("scan: {nh} heads in {ng} groups").into());
        }
        let state = [Arg::Ptr(io.from), Arg::Ptr(io.to), Arg::I64(io.stride as i64), Arg::Ptr(y)];
        let shape = [Arg::I32(m as i32), Arg::I32(nh as i32), Arg::I32(hd as i32), Arg::I32(ds as i32), Arg::I32(ng as i32)];
        let args: Vec<Arg> = match b.kind {
            SsmKind::Mamba2 => [Arg::Ptr(xbc), Arg::Ptr(heads), Arg::I64(stride as i64), Arg::Ptr(dt_bias), Arg::Ptr(a), Arg::Ptr(d)].into_iter().chain(state).chain(shape).collect(),
            SsmKind::GatedDelta => [Arg::Ptr(xbc), Arg::Ptr(heads), Arg::Ptr(dt_bias), Arg::Ptr(a)].into_iter().chain(state).chain(shape).collect(),
        };
        let kernel = match b.kind {
            SsmKind::Mamba2 => "ts_ssm_scan",
            SsmKind::GatedDelta => "ts_delta_scan",
        };
        self.launch_flat(kernel, nh * hd, &args)
    }

    /// The gated norm after block `b`'s scan over `m` rows of `y` (`d_inner`), the gate at
    /// `z + 4 * t * z_stride`, into `out`: Mamba-2's (y silu(z), normed per group) or a gated
    /// DeltaNet's (y normed per head, then times silu(z)).
    #[allow(clippy::too_many_arguments)]
    pub fn gated_norm(&self, b: &SsmBlock, y: u64, (z, z_stride): (u64, usize), w: u64, out: u64, m: usize, eps: f32) -> Result<(), GpuError> {
        let (gs, mode) = match b.kind {
            SsmKind::Mamba2 => (b.d_inner / b.n_group.max(1), 0),
            SsmKind::GatedDelta => (b.head_dim(), 1),
        };
        if gs == 0 || !b.d_inner.is_multiple_of(gs) {
            return Err(format!("gated_norm: groups of {gs} over {}", b.d_inner).into());
        }
        self.launch_rows(
            "ts_gated_norm",
            m * (b.d_inner / gs),
            &[Arg::Ptr(y), Arg::Ptr(z), Arg::I64(z_stride as i64), Arg::Ptr(w), Arg::Ptr(out), Arg::I32(b.d_inner as i32), Arg::I32(gs as i32), Arg::F32(eps), Arg::I32(mode)],
        )
    }
}
