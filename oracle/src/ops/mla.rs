//! Multi-head latent attention (DeepSeek V2/V3), materialized: every cached position's latent
//! is expanded through `attn_kv_b` into each head's unrotated key part and its value; the key
//! is that part and the one rotated key all heads share. The absorbed form (the query taken
//! into the latent's space, the output out of it) is the same sum in another order; it is
//! judged against this one in the kernel suite.

use super::matmul::{matmul, Mat};
use crate::error::{OracleError, Result};
use crate::real::Real;
use crate::spec::{MlaBlock, RopeSpec};

/// The `qk_rope` values of every head's query (`[m, n_head * qk_head_dim]`, each head's
/// unrotated part first) rotated as `rope` says, the unrotated parts untouched.
pub fn mla_rope_heads<T: Real>(q: &mut [T], positions: &[usize], b: &MlaBlock, rope: &RopeSpec) -> Result<()> {
    let (hd, nope, r) = (b.qk_head_dim(), b.qk_nope, b.qk_rope);
    if q.len() != positions.len() * b.q_dim() {
        return Err(OracleError::Shape(format!("latent attention rope: {} query values for {} positions of {} heads of {hd}", q.len(), positions.len(), b.n_head)));
    }
    let mut tail: Vec<T> = q.chunks_exact(hd).flat_map(|h| h[nope..].iter().copied()).collect();
    super::rope(&mut tail, positions, b.n_head, r, rope)?;
    q.chunks_exact_mut(hd).zip(tail.chunks_exact(r)).for_each(|(h, t)| h[nope..].copy_from_slice(t));
    Ok(())
}

/// The keys and values of `kv_len` cached positions from their latents (`[kv_len,
/// kv_lora_rank]`) and shared rotated keys (`[kv_len, qk_rope]`): keys `[kv_len, n_head *
/// qk_head_dim]` (per head its expanded part, then the shared key), values `[kv_len, n_head *
/// v_head_dim]`.
pub fn mla_expand<T: Real>(latent: &[T], k_pe: &[T], kv_len: usize, kv_b: &Mat<T>, b: &MlaBlock) -> Result<(Vec<T>, Vec<T>)> {
    if latent.len() < kv_len * b.kv_lora_rank || k_pe.len() < kv_len * b.qk_rope || kv_b.rows != b.kv_b_dim() || kv_b.cols != b.kv_lora_rank {
        return Err(OracleError::Shape(format!(
            "latent attention: {} latent and {} key values for {kv_len} positions, attn_kv_b {}x{} (expected {}x{})",
            latent.len(),
            k_pe.len(),
            kv_b.rows,
            kv_b.cols,
            b.kv_b_dim(),
            b.kv_lora_rank
        )));
    }
    let kv = matmul(&latent[..kv_len * b.kv_lora_rank], kv_len, kv_b)?;
    let (nope, vd, r) = (b.qk_nope, b.v_head_dim, b.qk_rope);
    let mut k = Vec::with_capacity(kv_len * b.q_dim());
    let mut v = Vec::with_capacity(kv_len * b.out_dim());
    for (j, row) in kv.chunks_exact(b.kv_b_dim()).enumerate() {
        for head in row.chunks_exact(nope + vd) {
            k.extend_from_slice(&head[..nope]);
            k.extend_from_slice(&k_pe[j * r..(j + 1) * r]);
            v.extend_from_slice(&head[nope..]);
        }
    }
    Ok((k, v))
}
