//! How a device computes: the number formats it declares per op, fixed point, input rounding.

use crate::{KvFormat, KvTypes, NumFormat};

/// How a device computes one op: what the tolerance rule consumes.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Arithmetic {
    /// Storage type of activations and results.
    pub storage: NumFormat,
    /// Accumulator of sums and dot products.
    pub accumulate: NumFormat,
    /// Activations quantized to symmetric 8-bit blocks of this size (llama.cpp's Q8_0) before
    /// products with quantized weights.
    pub activation_q8_block: Option<usize>,
    /// The block for products with K-quant matrices (Q2_K to Q6_K, IQ4_XS, TQ1_0 and TQ2_0) where it differs from
    /// `activation_q8_block`'s: llama.cpp's CPU backend gives them Q8_K blocks of 256 and the
    /// other quantized types Q8_0/Q8_1 blocks of 32, so a file that mixes them (a K-quant file
    /// whose 576-wide rows fell back to Q5_0) rounds its products' inputs two ways. These blocks
    /// round as Q8_K does: an f32 scale, the block's signed largest value over -127
    /// ([`InputRounding::Q8K`]); `activation_q8_block`'s as Q8_0 does (an f16 scale). None: the
    /// same block, Q8_0's rule, for every quantized matrix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_q8_block_kquant: Option<usize>,
    /// Activations entering a product with an F16 or BF16 matrix rounded to that matrix's
    /// format first (llama.cpp's CPU backend multiplies in the matrix's own type there).
    #[serde(default, skip_serializing_if = "std::ops::Not::not", deserialize_with = "null_is_false")]
    pub activation_half_rounding: bool,
    /// Accuracy of exp/tanh/sin/cos, in units of the storage roundoff.
    pub transcendental_ulps: f64,
    /// Integer fixed-point arithmetic (the `fixed` device); when set, the bounds come from these
    /// quanta instead of floating-point roundoff.
    pub fixed: Option<FixedPoint>,
    /// Format of the cached keys and values when the cache rounds them (llama.cpp's default
    /// cache is f16; `--cache-type-k/-v q8_0` and the other block formats quantize each row, and
    /// then the query enters its product with the keys as Q8_0 blocks of 32, the keys' own
    /// product type); None: the cache holds what `storage` holds. Only attention reads the
    /// cache, so only its budget (and what propagates from it) grows.
    #[serde(default)]
    pub kv_cache: Option<KvFormat>,
    /// Format of the cached values where it differs from the keys' (`kv_cache`, which then
    /// holds the keys alone): llama.cpp's `--cache-type-k q8_0 --cache-type-v f16`, say. None:
    /// the values are held as the keys are. Both together: [`Arithmetic::kv_types`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_v: Option<KvFormat>,
    /// A block-quantized cache holds each head's keys and values rotated by an orthonormal
    /// Walsh-Hadamard matrix (llama.cpp's attention rotation, on by default for quantized caches
    /// of heads a multiple of 64 wide): keys and the query by the largest power of two that
    /// divides the head, values by 64, each rotated back after the attention. Rotations leave
    /// the exact scores and outputs alone; they spread an outlier across its block, so the
    /// quantization errs less. Heads not a multiple of 64 wide are not rotated, nor keys or
    /// values held in a float format (llama.cpp rotates each of the two only when its cache
    /// type is quantized).
    #[serde(default, skip_serializing_if = "std::ops::Not::not", deserialize_with = "null_is_false")]
    pub kv_cache_rotation: bool,
    /// GELU (the tanh form, Gemma's gated FFN) looked up in a table of f16 values at the input
    /// rounded to f16 (ggml's CPU backend for |x| < 10; the identity above, zero below): the
    /// activation errs by two f16 roundings, about 5e-4 relative, where f32 arithmetic errs by
    /// 1e-7. SiLU is computed in f32 there and is not affected.
    #[serde(default, skip_serializing_if = "std::ops::Not::not", deserialize_with = "null_is_false")]
    pub gelu_half_table: bool,
}

/// A flag a manifest may write as null (absent) as well as true or false.
fn null_is_false<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(<Option<bool> as serde::Deserialize>::deserialize(d)?.unwrap_or(false))
}

/// How a declared arithmetic rounds a product's input before the matrix
/// ([`Arithmetic::input_rounding`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum InputRounding {
    /// Symmetric 8-bit blocks of this many values, each block's scale its largest magnitude over
    /// 127 stored as f16 (llama.cpp's Q8_0).
    Q8(usize),
    /// Symmetric 8-bit blocks of this many values with an f32 scale: the block's signed largest
    /// value over -127, each value's multiple rounded half to even (llama.cpp's Q8_K, which its
    /// CPU backend gives K-quant products: `activation_q8_block_kquant`).
    Q8K(usize),
    /// Each value rounded to this 16-bit format (the matrix's own).
    Half(NumFormat),
}

/// A fixed-point device's formats: values are integers scaled by 2^-frac_bits.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FixedPoint {
    /// Fractional bits of activations (Q16).
    pub act_frac: u32,
    /// Fractional bits of matrix weights (Q24).
    pub weight_frac: u32,
    /// Fractional bits of norm scales (Q20).
    pub norm_frac: u32,
    /// Fractional bits of RoPE cos/sin tables (host-precomputed).
    pub table_frac: u32,
    /// Absolute error of the integer exp / sigmoid approximations on their Q16 outputs.
    pub exp_abs: f64,
    /// Group-wise INT4 weights (`fixed-int4`): values per group; each group has its own scale.
    pub int4_group: Option<usize>,
}

/// The fewest fraction bits a fixed-point declaration may give any of its formats.
pub const MIN_FRACTION_BITS: u32 = 8;

impl Arithmetic {
    pub const F64: Arithmetic = Arithmetic { storage: NumFormat::F64, accumulate: NumFormat::F64, activation_q8_block: None, activation_q8_block_kquant: None, activation_half_rounding: false, transcendental_ulps: 1.0, fixed: None, kv_cache: None, kv_cache_v: None, kv_cache_rotation: false, gelu_half_table: false };
    pub const F32: Arithmetic = Arithmetic { storage: NumFormat::F32, accumulate: NumFormat::F32, activation_q8_block: None, activation_q8_block_kquant: None, activation_half_rounding: false, transcendental_ulps: 4.0, fixed: None, kv_cache: None, kv_cache_v: None, kv_cache_rotation: false, gelu_half_table: false };

    /// The formats the cache holds keys and values in (`kv_cache`, and `kv_cache_v` where the
    /// values' differs).
    pub fn kv_types(&self) -> KvTypes {
        KvTypes { k: self.kv_cache, v: self.kv_cache_v.or(self.kv_cache) }
    }
    /// This arithmetic with a cache of `kv`'s formats (`kv_cache_v` declared only where the
    /// values' format differs from the keys').
    pub fn with_kv(self, kv: KvTypes) -> Arithmetic {
        let v = (kv.v != kv.k).then(|| kv.v.unwrap_or(KvFormat::F32));
        Arithmetic { kv_cache: kv.k, kv_cache_v: v, ..self }
    }

    /// How the activations entering a product with a matrix stored as `ty` are rounded: Q8
    /// blocks before a quantized matrix (K-quants' own block where declared), the matrix's
    /// format before an F16/BF16 one when `activation_half_rounding`; None: they enter as held.
    pub fn input_rounding(&self, ty: oracle::quant::GgmlType) -> Option<InputRounding> {
        use oracle::quant::GgmlType::{BF16, F16, F32, IQ4_XS, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, TQ1_0, TQ2_0};
        match ty {
            F32 => None,
            F16 => self.activation_half_rounding.then_some(InputRounding::Half(NumFormat::F16)),
            BF16 => self.activation_half_rounding.then_some(InputRounding::Half(NumFormat::BF16)),
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS | TQ1_0 | TQ2_0 => match self.activation_q8_block_kquant {
                Some(b) => Some(InputRounding::Q8K(b)),
                None => self.activation_q8_block.map(InputRounding::Q8),
            },
            _ => self.activation_q8_block.map(InputRounding::Q8),
        }
    }

    /// Whether any product's input is rounded (Q8 blocks or a half-precision format).
    pub fn rounds_product_inputs(&self) -> bool {
        self.widest_q8_block().is_some() || self.activation_half_rounding
    }

    /// The widest Q8 block any product's input is rounded to: what a budget that does not know
    /// which matrices a tap's products met must allow.
    pub fn widest_q8_block(&self) -> Option<usize> {
        self.activation_q8_block.max(self.activation_q8_block_kquant)
    }

    /// Refuses a declaration outside the domain the budgets are derived for. A dump's manifest
    /// is its author's word: `transcendental_ulps: 1e300` would make every budget infinite and
    /// every tap pass. Limits: exp/sin/sqrt no worse than 2^-4 relative (16 ulps of bf16),
    /// Q8 blocks of at most 1024 values, fixed-point fractions of at most 62 bits (i64
    /// arithmetic), an exp approximation's error at most 1 in its own units, INT4 groups of
    /// 1..=4096.
    pub fn check(&self) -> Result<(), String> {
        let ulps = self.transcendental_ulps;
        if !(ulps.is_finite() && ulps >= 0.0 && ulps * self.storage.unit_roundoff() <= 0.0625) {
            let shown = if ulps.abs() < 1e9 { ulps.to_string() } else { format!("{ulps:e}") };
            return Err(format!("transcendental_ulps {shown} of {:?} storage: must be finite, >= 0 and at most 2^-4 relative", self.storage));
        }
        for (name, block) in [("activation_q8_block", self.activation_q8_block), ("activation_q8_block_kquant", self.activation_q8_block_kquant)] {
            if let Some(b) = block.filter(|b| !(1..=1024).contains(b)) {
                return Err(format!("{name} {b}: must be 1..=1024"));
            }
        }
        if let Some(fp) = &self.fixed {
            for (name, bits) in [("act_frac", fp.act_frac), ("weight_frac", fp.weight_frac), ("norm_frac", fp.norm_frac), ("table_frac", fp.table_frac)] {
                if bits > 62 {
                    return Err(format!("fixed.{name} {bits}: at most 62 fraction bits"));
                }
                // A grid coarser than 1/256 makes every bound so wide that an engine returning
                // zeros passes: no integer engine computes so coarsely and means it.
                if bits < MIN_FRACTION_BITS {
                    return Err(format!("fixed.{name} {bits}: at least {MIN_FRACTION_BITS} fraction bits (a coarser grid would let all-zero outputs pass)"));
                }
            }
            if !(fp.exp_abs.is_finite() && (0.0..=1.0).contains(&fp.exp_abs)) {
                return Err(format!("fixed.exp_abs {}: must be finite and in [0, 1]", fp.exp_abs));
            }
            if let Some(g) = fp.int4_group.filter(|g| !(1..=4096).contains(g)) {
                return Err(format!("fixed.int4_group {g}: must be 1..=4096"));
            }
        }
        Ok(())
    }
}
