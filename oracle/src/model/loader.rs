//! Reading a model's weights for the interpreter: each tensor checked for its shape and for
//! values that are not numbers, matrices decoded or kept packed.

use crate::error::{OracleError, Result};
use crate::loader::TensorSource;
use crate::ops::Mat;
use crate::real::Real;

pub(super) struct Loader<'a> {
    pub(super) src: &'a dyn TensorSource,
    pub(super) packed: bool,
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
    pub(super) fn get(&self, name: &str) -> Result<Option<crate::loader::LoadedTensor>> {
        let Some(t) = self.src.load(name)? else { return Ok(None) };
        if let Some(i) = t.data.iter().position(|v| !v.is_finite()) {
            return Err(OracleError::non_finite_weight(&self.src.label(), name, i, t.data[i], t.dims.first().copied().unwrap_or(1)));
        }
        Ok(Some(t))
    }

    pub(super) fn vec<T: Real>(&self, name: &str, len: usize) -> Result<Vec<T>> {
        self.opt_vec(name, len)?
            .ok_or_else(|| OracleError::Spec(format!("{}: missing tensor `{name}`", self.src.label())))
    }

    pub(super) fn opt_vec<T: Real>(&self, name: &str, len: usize) -> Result<Option<Vec<T>>> {
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

    /// A tensor of exactly GGML dims `dims` (trailing dimensions of one aside), row-major.
    pub(super) fn shaped<T: Real>(&self, name: &str, dims: &[usize]) -> Result<Vec<T>> {
        let t = self.get(name)?.ok_or_else(|| OracleError::Spec(format!("{}: missing tensor `{name}`", self.src.label())))?;
        let trim = |d: &[usize]| -> Vec<usize> {
            let mut v = d.to_vec();
            while v.len() > 1 && v.last() == Some(&1) {
                v.pop();
            }
            v
        };
        if trim(&t.dims) != trim(dims) || t.data.len() != dims.iter().product::<usize>() {
            return Err(OracleError::Spec(format!("{}: tensor `{name}` has dims {:?}, expected {dims:?}", self.src.label(), t.dims)));
        }
        Ok(t.data.into_iter().map(T::from_f32).collect())
    }

    /// A matrix with `rows` outputs of `cols` inputs (GGML dims [cols, rows]).
    pub(super) fn mat<T: Real>(&self, name: &str, rows: usize, cols: usize) -> Result<Mat<T>> {
        self.opt_mat(name, rows, cols)?
            .ok_or_else(|| OracleError::Spec(format!("{}: missing tensor `{name}`", self.src.label())))
    }

    pub(super) fn opt_mat<T: Real>(&self, name: &str, rows: usize, cols: usize) -> Result<Option<Mat<T>>> {
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
    pub(super) fn experts<T: Real>(&self, name: &str, n_expert: usize, rows: usize, cols: usize) -> Result<Vec<Mat<T>>> {
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
    pub(super) fn expert_vecs<T: Real>(&self, name: &str, n_expert: usize, len: usize) -> Result<Vec<Vec<T>>> {
        let t = self.get(name)?.ok_or_else(|| OracleError::Spec(format!("{}: missing tensor `{name}`", self.src.label())))?;
        if t.dims != [len, n_expert] {
            return Err(OracleError::Spec(format!("{}: tensor `{name}` has dims {:?}, expected [{len}, {n_expert}]", self.src.label(), t.dims)));
        }
        Ok(t.data.chunks_exact(len).map(|c| c.iter().map(|v| T::from_f32(*v)).collect()).collect())
    }

    /// Layer `li`'s latent expansion `[n_head * (qk_nope + v_head_dim), kv_lora_rank]`: stored
    /// whole (`attn_kv_b`), or as llama.cpp's converter splits it for the absorbed form, each
    /// head's key rows transposed (`attn_k_b`, GGML dims `[qk_nope, kv_lora_rank, n_head]`) and
    /// its value rows (`attn_v_b`, `[kv_lora_rank, v_head_dim, n_head]`), put back together.
    pub(super) fn mla_kv_b<T: Real>(&self, li: usize, b: &crate::spec::MlaBlock) -> Result<Mat<T>> {
        let (rows, r) = (b.kv_b_dim(), b.kv_lora_rank);
        if let Some(m) = self.opt_mat(&format!("blk.{li}.attn_kv_b.weight"), rows, r)? {
            return Ok(m);
        }
        let (nope, vd) = (b.qk_nope, b.v_head_dim);
        let k_b: Vec<T> = self.shaped(&format!("blk.{li}.attn_k_b.weight"), &[nope, r, b.n_head])?;
        let v_b: Vec<T> = self.shaped(&format!("blk.{li}.attn_v_b.weight"), &[r, vd, b.n_head])?;
        let mut kv_b = Vec::with_capacity(rows * r);
        for h in 0..b.n_head {
            for c in 0..nope {
                kv_b.extend((0..r).map(|j| k_b[(h * r + j) * nope + c]));
            }
            kv_b.extend_from_slice(&v_b[h * vd * r..(h + 1) * vd * r]);
        }
        Mat::new(rows, r, kv_b)
    }

    /// `e` (a size error of a packed matrix) as an error naming the file and tensor.
    pub(super) fn in_tensor(&self, name: &str, e: OracleError) -> OracleError {
        OracleError::Spec(format!("{}: tensor `{name}`: {e}", self.src.label()))
    }
}

