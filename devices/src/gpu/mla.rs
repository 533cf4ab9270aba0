//! Latent attention (DeepSeek MLA) in a `GpuModel`, in the absorbed form (`kernels/latent.cu`):
//! the query (through its own compression where the model has one), the normed latent and the
//! shared rotated key projected; RoPE on each head's rotated part and on the shared key; each
//! segment's latents and rotated keys appended to its cache, attended to without expanding them.

use super::cache::{record, KvCache, LayerState, Seg};
use super::{Arg, DevBuf, Gpu, GpuError, GpuMat, MAX_SHARED_BYTES};
use crate::shared::host::MlaWeights;
use oracle::spec::MlaBlock;
use oracle::Tap;
use std::sync::Arc;

/// A latent-attention block's weights on the device (see `shared::host::MlaWeights`).
pub(super) struct GpuMla {
    q_a: Option<(GpuMat, DevBuf)>,
    q: GpuMat,
    kv_a: GpuMat,
    kv_a_norm: DevBuf,
    k_b: DevBuf,
    v_b: DevBuf,
    pub wo: GpuMat,
}

impl GpuMla {
    pub(super) fn upload(g: &Arc<Gpu>, w: &MlaWeights) -> Result<GpuMla, String> {
        let mat = |p: &crate::shared::host::PackedMat| g.upload_mat(p.ty, p.rows, p.cols, &p.bytes);
        Ok(GpuMla {
            q_a: match &w.q_a {
                Some((m, norm)) => Some((mat(m)?, g.upload_f32(norm)?)),
                None => None,
            },
            q: mat(&w.q)?,
            kv_a: mat(&w.kv_a)?,
            kv_a_norm: g.upload_f32(&w.kv_a_norm)?,
            k_b: g.upload_f32(&w.k_b)?,
            v_b: g.upload_f32(&w.v_b)?,
            wo: mat(&w.wo)?,
        })
    }
}

/// A step's normed latents (`[m][kv_lora_rank]`) and shared rotated keys (`[m][qk_rope]`),
/// before they go to each segment's cache.
pub(super) struct MlaStep {
    latent: DevBuf,
    kpe: DevBuf,
}

/// A step's rows and the taps they are recorded under.
pub(super) struct Rows<'a> {
    pub m: usize,
    pub start: usize,
    pub name: &'a dyn Fn(&str) -> String,
}

impl MlaStep {
    /// The query into `q` (`[m][n_head * qk_head_dim]`), the latent (normed) and the shared key
    /// from the normed rows `h` (`[m][d]`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn project(g: &Arc<Gpu>, b: &MlaBlock, w: &GpuMla, h: u64, d: usize, q: &DevBuf, eps: f32, rows: &Rows, taps: &mut dyn Tap) -> Result<MlaStep, String> {
        let (m, start, name) = (rows.m, rows.start, rows.name);
        let (r, rr) = (b.kv_lora_rank, b.qk_rope);
        match &w.q_a {
            Some((qa, norm)) => {
                let a = g.alloc(4 * m * qa.rows)?;
                g.matmul(qa, h, d, m, a.ptr)?;
                g.rms_norm(a.ptr, norm.ptr, a.ptr, m, qa.rows, eps)?;
                record(taps, &name("attn_q_a"), &a, start, m, qa.rows)?;
                g.matmul(&w.q, a.ptr, qa.rows, m, q.ptr)?;
            }
            None => g.matmul(&w.q, h, d, m, q.ptr)?,
        }
        record(taps, &name("attn_q"), q, start, m, b.q_dim())?;
        let kv_a = g.alloc(4 * m * (r + rr))?;
        g.matmul(&w.kv_a, h, d, m, kv_a.ptr)?;
        let (latent, kpe) = (g.alloc(4 * m * r)?, g.alloc(4 * m * rr)?);
        g.copy_cols((kv_a.ptr, r + rr, 0), (latent.ptr, r, 0), m, r)?;
        g.copy_cols((kv_a.ptr, r + rr, r), (kpe.ptr, rr, 0), m, rr)?;
        g.rms_norm(latent.ptr, w.kv_a_norm.ptr, latent.ptr, m, r, eps)?;
        record(taps, &name("attn_kv_a"), &latent, start, m, r)?;
        record(taps, &name("attn_k"), &kpe, start, m, rr)?;
        Ok(MlaStep { latent, kpe })
    }

    /// RoPE (`table`, `n_rot` of the rotated part, pairs as `neox` says) on the last `qk_rope`
    /// values of each query head and on the shared key.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rope(&self, g: &Arc<Gpu>, b: &MlaBlock, q: &DevBuf, table: &DevBuf, n_rot: usize, neox: bool, rows: &Rows, taps: &mut dyn Tap) -> Result<(), String> {
        let (m, nh, nope, rr) = (rows.m, b.n_head, b.qk_nope, b.qk_rope);
        let hd = b.qk_head_dim();
        let tails = g.alloc(4 * m * nh * rr)?;
        g.copy_cols((q.ptr, hd, nope), (tails.ptr, rr, 0), m * nh, rr)?;
        g.rope_pair((tails.ptr, nh), (self.kpe.ptr, 1), table, m, rr, n_rot, neox)?;
        g.copy_cols((tails.ptr, rr, 0), (q.ptr, hd, nope), m * nh, rr)?;
        record(taps, &(rows.name)("attn_q_rope"), q, rows.start, m, b.q_dim())?;
        record(taps, &(rows.name)("attn_k_rope"), &self.kpe, rows.start, m, rr)
    }

    /// Each segment's latents and rotated keys appended to its cache, then its queries (`q`,
    /// positions `pos`: device u32s) attending to its cache into `out` (`[m][n_head *
    /// v_head_dim]`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend(&self, g: &Arc<Gpu>, b: &MlaBlock, w: &GpuMla, li: usize, caches: &[KvCache], segs: &[Seg], (q, pos, out): (u64, u64, u64), scale: f32) -> Result<(), String> {
        let (r, rr) = (b.kv_lora_rank, b.qk_rope);
        let mut r0 = 0;
        for seg in segs {
            let n = seg.tokens.len();
            let Some(LayerState::Latent { latent, kpe }) = caches[seg.cache].layers.get(li) else {
                return Err(format!("layer {li}: no latent cache"));
            };
            g.copy(self.latent.at_f32(r0 * r), latent.at_f32(seg.start * r), n * r)?;
            g.copy(self.kpe.at_f32(r0 * rr), kpe.at_f32(seg.start * rr), n * rr)?;
            let at = |buf: u64, floats: usize| buf + 4 * floats as u64;
            g.mla_attention(b, (at(q, r0 * b.q_dim()), at(pos, r0)), (latent.ptr, kpe.ptr), (w.k_b.ptr, w.v_b.ptr), at(out, r0 * b.out_dim()), n, seg.start + n, scale)?;
            r0 += n;
        }
        Ok(())
    }
}

impl Gpu {
    /// Latent attention of `m` queries (`(q, pos)`) over a cache of `kv_len` positions
    /// (`(latent, kpe)`) through the expansion's key and value rows (`(k_b, v_b)`) into `out`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mla_attention(&self, b: &MlaBlock, (q, pos): (u64, u64), (latent, kpe): (u64, u64), (k_b, v_b): (u64, u64), out: u64, m: usize, kv_len: usize, scale: f32) -> Result<(), GpuError> {
        let bs = self.bs() as usize;
        let shared = 4 * (bs + 2 * b.kv_lora_rank + kv_len);
        if shared > MAX_SHARED_BYTES {
            return Err(format!("latent attention over {kv_len} cached positions and a latent of {} needs {shared} bytes of shared memory (at most {MAX_SHARED_BYTES})", b.kv_lora_rank).into());
        }
        self.launch(
            "ts_mla_attention",
            [b.n_head as u32, m as u32, 1],
            [bs as u32, 1, 1],
            shared as u32,
            &[
                Arg::Ptr(q),
                Arg::Ptr(pos),
                Arg::Ptr(latent),
                Arg::Ptr(kpe),
                Arg::Ptr(k_b),
                Arg::Ptr(v_b),
                Arg::Ptr(out),
                Arg::I32(b.n_head as i32),
                Arg::I32(b.qk_nope as i32),
                Arg::I32(b.qk_rope as i32),
                Arg::I32(b.kv_lora_rank as i32),
                Arg::I32(b.v_head_dim as i32),
                Arg::F32(scale),
            ],
        )
    }
}
