//! What the loaders hand out: tensors decoded to f32 or as stored, and the source they come from
//! (a GGUF file, a safetensors directory, a flat file).

use crate::error::Result;
use crate::quant::GgmlType;
use std::borrow::Cow;

/// A decoded tensor: GGML dims (`dims[0]` = row length) and f32 values.
pub struct LoadedTensor {
    pub dims: Vec<usize>,
    pub data: Vec<f32>,
}

/// A tensor as stored, not decoded: GGML dims (`dims[0]` = row length), its GGML type
/// (safetensors F32/F16/BF16 are GGML's F32/F16/BF16, rows laid out alike) and its bytes, every
/// value checked finite. For devices that keep weights packed. The bytes are the file's own,
/// except for a checkpoint's per-expert tensors, which are joined into one stacked tensor.
pub struct RawTensor<'a> {
    pub dims: Vec<usize>,
    pub ty: GgmlType,
    pub bytes: Cow<'a, [u8]>,
}

impl RawTensor<'_> {
    pub fn n_elements(&self) -> usize {
        self.dims.iter().product()
    }

    /// The tensor decoded to f32 (what `TensorSource::load` gives).
    pub fn decode(&self) -> Result<LoadedTensor> {
        Ok(LoadedTensor { dims: self.dims.clone(), data: crate::quant::decode(self.ty, &self.bytes, self.n_elements())? })
    }

    /// The bytes of each of `n` equal parts (the experts of a stacked `[cols, rows, n_expert]`
    /// tensor); an error saying why when the bytes do not split into `n` parts of whole blocks.
    pub fn parts(&self, n: usize) -> std::result::Result<std::slice::ChunksExact<'_, u8>, String> {
        let per = self.bytes.len() / n.max(1);
        if n == 0 || !self.bytes.len().is_multiple_of(n) || per == 0 || !per.is_multiple_of(self.ty.type_size()) {
            return Err(format!("{} bytes do not split into {n} parts of whole {} blocks", self.bytes.len(), self.ty.name()));
        }
        Ok(self.bytes.chunks_exact(per))
    }
}

/// Where weights come from.
pub trait TensorSource: Sync {
    /// Decodes tensor `name` (a GGUF name such as `blk.0.attn_q.weight`), or None if absent.
    fn load(&self, name: &str) -> Result<Option<LoadedTensor>>;
    /// A short label for error messages.
    fn label(&self) -> String;
    /// How many values the source holds, all tensors together (what decoding them all costs).
    fn n_elements(&self) -> Result<u64>;
    /// How many bytes its tensors take as stored (what a packed copy of them all costs).
    fn n_bytes(&self) -> Result<u64>;
    /// Tensor `name` as stored, or None if absent; refused when a value is NaN or infinite
    /// (naming the file, tensor, element, row and column, as `load` does).
    fn raw(&self, name: &str) -> Result<Option<RawTensor<'_>>>;
}
