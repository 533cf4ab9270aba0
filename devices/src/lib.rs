//! # devices — the backends under test
//!
//! A `Device` runs the registry's ops (and, later, whole models). It declares its arithmetic per
//! op (storage and accumulation types, activation quantization), so the kernel suite can derive
//! the bound its results must meet. Devices may use the oracle's *types* (cases, codecs' block
//! layouts, ModelSpec) but never call its op implementations to produce their results.
//!
//! Backends: `ref` (the oracle itself, for self-checks), `cpu` (an optimized engine: f32 SIMD-
//! friendly loops, Q8 activations against packed quantized weights, rayon). `fixed` (integer
//! fixed point), `external` (dumps of other engines, `external:DIR` / `exec:CMD`), and the GPU devices
//! in `gpu`: `cuda[:N]` and `rocm[:N]` (features `cuda`, `rocm`; unavailable when not compiled
//! in or when the machine has no driver) and `gpu-emu`, the same kernels run on the host.

/// How `gpu-emu`'s options are spelt (one literal for every help text and error that lists them:
/// `concat!(devices::gpu_emu_syntax!(), ...)`).
#[macro_export]
macro_rules! gpu_emu_syntax {
    () => {
        "gpu-emu[:reverse|shuffle][:THREADS][:racecheck][:fma][:ulp2|ulpN]"
    };
}

/// Every device name [`open`] reads, as help texts and errors list them: the one list
/// (`device_names_are_the_ones_open_reads` holds it to `open`, the command-line tests each
/// command's `--device` help to it).
#[macro_export]
macro_rules! device_names {
    () => {
        concat!(
            "ref (the oracle), cpu, cpu:kv-TYPE (its KV cache in f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0 or iq4_nl; cpu:kv-K-V: keys and values apart, e.g. cpu:kv-q8_0-f16), fixed, fixed-int4, ",
            $crate::gpu_emu_syntax!(),
            ", cuda[:N], rocm[:N], external:DIR (an engine's dump), exec:CMD (an engine command: dumps, op-protocol answers or ab lines), ids:CMD (an engine that prints only the ids it generates)"
        )
    };
}

pub mod cpu;
pub mod external;
pub mod fixed;
pub mod gpu;
pub mod ops_protocol;
pub mod process;
pub mod probe;
#[cfg(feature = "faults")]
pub mod faulty;
pub mod slowed;
pub mod reference;

use oracle::registry::{OpCase, Output};

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("device `{0}` is unavailable: {1}")]
    Unavailable(String, String),
    /// A name that is no device: misspelt, or from a newer version of this tool.
    #[error("unknown device `{name}`{}; the devices: {}", suggestion.as_ref().map(|s| format!(": did you mean `{s}`?")).unwrap_or_default(), device_names!())]
    Unknown { name: String, suggestion: Option<String> },
    #[error("{device}: {case}: {reason}")]
    Failed { device: String, case: String, reason: String },
    /// The device ran and its result is known to be wrong (e.g. a kernel wrote outside its
    /// output): a failure of the device, not an inability to run.
    #[error("{device}: {case}: {reason}")]
    WrongResult { device: String, case: String, reason: String },
    /// The device found at run time that it cannot run the case (an engine's own word).
    #[error("{device}: {case}: {reason}")]
    Unsupported { device: String, case: String, reason: String },
}

/// Number formats a device can declare.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NumFormat {
    F64,
    F32,
    /// IEEE half precision (10 stored mantissa bits).
    F16,
    /// bfloat16 (7 stored mantissa bits).
    BF16,
    /// Integer accumulation (exact within range).
    I32,
}

impl NumFormat {
    /// Unit roundoff (half an ulp at 1.0).
    pub fn unit_roundoff(self) -> f64 {
        match self {
            NumFormat::F64 => f64::EPSILON / 2.0,
            NumFormat::F32 => f32::EPSILON as f64 / 2.0,
            NumFormat::F16 => (-11f64).exp2(),
            NumFormat::BF16 => (-8f64).exp2(),
            NumFormat::I32 => 0.0,
        }
    }
}

/// The format a KV cache holds its keys and values in (`Arithmetic::kv_cache`, the `cpu:kv-*`
/// devices): the GGML types llama.cpp's `--cache-type-k/-v` take that this tool decodes — a float
/// format, or each cached row quantized to blocks of 32 (so a head of a multiple of 32 values is
/// whole blocks). Written as the type's name (`"f16"`, `"q8_0"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct KvFormat(oracle::quant::GgmlType);

impl KvFormat {
    /// The formats a cache may be declared in.
    const TYPES: [oracle::quant::GgmlType; 9] = {
        use oracle::quant::GgmlType::*;
        [F32, F16, BF16, Q8_0, Q5_1, Q5_0, Q4_1, Q4_0, IQ4_NL]
    };
    /// F32: a cache that holds what an f32 engine computes.
    pub const F32: KvFormat = KvFormat(oracle::quant::GgmlType::F32);
    /// Q8_0: the format a block-quantized cache's keys take the query in.
    pub const Q8_0: KvFormat = KvFormat(oracle::quant::GgmlType::Q8_0);

    /// The formats a cache may be declared in, as written (`f32, f16, ...`).
    pub fn names() -> String {
        KvFormat::TYPES.map(|t| t.name()).join(", ")
    }

    /// The format of this name, or None when a cache cannot be declared in it.
    pub fn parse(name: &str) -> Option<KvFormat> {
        oracle::quant::GgmlType::from_name(name).filter(|t| KvFormat::TYPES.contains(t)).map(KvFormat)
    }
    pub fn ty(self) -> oracle::quant::GgmlType {
        self.0
    }
    pub fn name(self) -> &'static str {
        self.0.name()
    }
    /// The float format of a float cache; None for a block-quantized one.
    pub fn float(self) -> Option<NumFormat> {
        use oracle::quant::GgmlType::{BF16, F16, F32};
        match self.0 {
            F32 => Some(NumFormat::F32),
            F16 => Some(NumFormat::F16),
            BF16 => Some(NumFormat::BF16),
            _ => None,
        }
    }
    /// Values per block of a block-quantized cache (its rows must hold whole blocks per head).
    pub fn block(self) -> Option<usize> {
        self.float().is_none().then(|| self.0.block_size())
    }
    /// The relative size of one cached value's rounding, as the budgets take a unit roundoff:
    /// a float format's unit roundoff; for a block format, the RMS rounding error of a block
    /// (half its step, about, the step a fraction of the block's largest value: 1/127 for
    /// Q8_0, 1/8 for Q4_0 and 1/16 for Q5_0, whose scales are max/-8 and max/-16, at most
    /// 2/15 and 2/31 of it for Q4_1 and Q5_1, whose steps span max - min, and 28/127 for
    /// IQ4_NL's uneven levels) over the block's RMS value (at least max/sqrt(B)).
    pub fn rel_rounding(self) -> f64 {
        use oracle::quant::GgmlType::*;
        let step = match self.0 {
            Q8_0 => 1.0 / 127.0,
            Q5_1 => 2.0 / 31.0,
            Q5_0 => 1.0 / 16.0,
            Q4_1 => 2.0 / 15.0,
            Q4_0 => 1.0 / 8.0,
            // Its levels span -127..113 steps of max/127: half the widest gap is 12 steps, the
            // clamped end 14.
            IQ4_NL => 28.0 / 127.0,
            _ => return self.float().map_or(0.0, NumFormat::unit_roundoff),
        };
        (self.0.block_size() as f64).sqrt() * step / 2.0
    }
    /// `rows` (each `width` values, a whole number of blocks) as the cache gives them back:
    /// encoded to the format and decoded, as ggml stores a row and reads it, with the oracle's
    /// codec (this is the judge's emulation of a cache; the `cpu` device has its own,
    /// `cpu::kvcodec`). None when `width` is not a whole number of blocks.
    pub fn round_rows(self, rows: &mut [f32], width: usize) -> Option<()> {
        if width == 0 || !width.is_multiple_of(self.0.block_size()) || !rows.len().is_multiple_of(width) {
            return None;
        }
        let bytes = oracle::quant::encode(self.0, rows).ok()?;
        oracle::quant::decode_into(self.0, &bytes, rows).ok()
    }
}

/// The formats a KV cache holds its keys and values in, each None where it holds them as
/// computed (llama.cpp's `--cache-type-k` and `--cache-type-v`). Written `q8_0` when both are
/// one format, `q8_0-f16` (keys, values) when they differ: the `cpu:kv-*` devices' suffix.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvTypes {
    pub k: Option<KvFormat>,
    pub v: Option<KvFormat>,
}

impl KvTypes {
    /// Keys and values in one format.
    pub fn both(f: KvFormat) -> KvTypes {
        KvTypes { k: Some(f), v: Some(f) }
    }
    /// `TYPE` (keys and values) or `K-V`; None when either is not a cache format.
    pub fn parse(s: &str) -> Option<KvTypes> {
        match s.split_once('-') {
            None => KvFormat::parse(s).map(KvTypes::both),
            Some((k, v)) => Some(KvTypes { k: Some(KvFormat::parse(k)?), v: Some(KvFormat::parse(v)?) }),
        }
    }
    /// Neither keys nor values rounded by the cache (unset, or f32).
    pub fn is_none(&self) -> bool {
        [self.k, self.v].iter().all(|f| f.is_none_or(|f| f == KvFormat::F32))
    }
    /// The formats set: the keys', then the values' where it differs.
    pub fn formats(&self) -> impl Iterator<Item = KvFormat> {
        let v = self.v.filter(|v| Some(*v) != self.k);
        self.k.into_iter().chain(v)
    }
}

impl std::fmt::Display for KvTypes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (k, v) = (self.k.unwrap_or(KvFormat::F32), self.v.unwrap_or(KvFormat::F32));
        if k == v {
            write!(f, "{k}")
        } else {
            write!(f, "{k}-{v}")
        }
    }
}

/// The widths of the Walsh-Hadamard rotations a rotating block-quantized cache applies to a
/// head of `head_dim` values (`Arithmetic::kv_cache_rotation`): (keys and query, values); None
/// when such heads are not rotated (not a multiple of 64 wide).
pub fn kv_rotation_widths(head_dim: usize) -> Option<(usize, usize)> {
    if head_dim == 0 || !head_dim.is_multiple_of(64) {
        return None;
    }
    Some((1 << head_dim.trailing_zeros(), 64))
}

/// Rotates each run of `n` values of `x` (a power of two) by the orthonormal Walsh-Hadamard
/// matrix of that size in Sylvester order (H[i][j] = (-1)^popcount(i & j) / sqrt(n), its own
/// inverse), in f64, rounded back to f32 once.
pub fn hadamard_rotate(x: &mut [f32], n: usize) {
    if n < 2 || !n.is_power_of_two() {
        return;
    }
    let scale = 1.0 / (n as f64).sqrt();
    let mut buf = vec![0f64; n];
    for chunk in x.chunks_exact_mut(n) {
        buf.iter_mut().zip(chunk.iter()).for_each(|(b, v)| *b = *v as f64);
        let mut h = 1;
        while h < n {
            for i in (0..n).step_by(2 * h) {
                for j in i..i + h {
                    let (a, b) = (buf[j], buf[j + h]);
                    buf[j] = a + b;
                    buf[j + h] = a - b;
                }
            }
            h *= 2;
        }
        chunk.iter_mut().zip(buf.iter()).for_each(|(v, b)| *v = (b * scale) as f32);
    }
}

impl TryFrom<String> for KvFormat {
    type Error = String;
    fn try_from(s: String) -> Result<KvFormat, String> {
        KvFormat::parse(&s).ok_or_else(|| format!("kv_cache \"{s}\" is not a cache format this tool reads ({})", KvFormat::names()))
    }
}

impl From<KvFormat> for String {
    fn from(f: KvFormat) -> String {
        f.name().to_string()
    }
}

impl std::fmt::Display for KvFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

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

/// Whether a device runs a case, and if not, why (reported as `unsupported`, never as a pass).
#[derive(Clone, Debug, PartialEq)]
pub enum Support {
    Yes,
    Unsupported(String),
}

/// A backend under test.
pub trait Device: Send + Sync {
    fn name(&self) -> String;
    /// The name an external engine gives itself (its op-protocol capabilities' `name`).
    fn declared_name(&self) -> Option<String> {
        None
    }
    /// The hardware and driver behind the name, for report provenance (a GPU's model,
    /// architecture and driver version); the name where there is nothing more to say.
    fn describe(&self) -> String {
        self.name()
    }
    /// The arithmetic this device uses for `case` (the tolerance rule's input).
    fn arithmetic(&self, case: &OpCase) -> Arithmetic;
    fn supports(&self, case: &OpCase) -> Support;
    /// Runs one op case; outputs in the same order and shapes as the registry reference.
    fn run_op(&self, case: &OpCase) -> Result<Vec<Output>, DeviceError>;
    /// How many cases [`Device::run_ops`] takes at once (1: the suite calls `run_op` per case).
    fn op_batch(&self) -> usize {
        1
    }
    /// Runs several cases, each told the kind and shape of the outputs it must give; one result
    /// per case, in order. The default runs them one by one.
    fn run_ops(&self, cases: &[(&OpCase, Vec<ops_protocol::OutputSpec>)]) -> Vec<Result<Vec<Output>, DeviceError>> {
        cases.iter().map(|(c, _)| self.run_op(c)).collect()
    }
    /// Waits for queued work (a no-op on CPU devices).
    fn synchronize(&self) {}
    /// Device time of the last `run_op`'s kernels alone (GPU devices time their launches with
    /// events, leaving out host-device copies); None where only the wall clock is known.
    fn last_kernel_seconds(&self) -> Option<f64> {
        None
    }
    /// Measures copy bandwidth and GEMV (m = 1) weight bandwidth per weight type on `bytes`-sized
    /// buffers, best of `reps` timed runs each (see [`probe`]; None where not implemented).
    fn bandwidth_probe(&self, _bytes: usize, _reps: usize) -> Option<Result<BandwidthProbe, DeviceError>> {
        None
    }
    /// Loads a GGUF model to run whole forward passes on this device.
    fn load_model(&self, path: &std::path::Path, _opts: &ModelOptions) -> Result<Box<dyn DeviceModel>, DeviceError> {
        Err(DeviceError::Unavailable(self.name(), format!("{}: this device does not run whole models", path.display())))
    }
}

/// One weight type's GEMV in a [`BandwidthProbe`].
#[derive(Clone, Debug, serde::Serialize)]
pub struct GemvRate {
    /// The GGUF type name (`f16`, `q4_k`...).
    pub ty: String,
    /// Weight bytes one GEMV reads.
    pub weight_bytes: usize,
    /// GB/s of weights read.
    pub gbps: f64,
    /// The code that ran (a GPU's kernel and launch shape), so a figure can be traced to it.
    pub kernel: String,
    /// False for the launch shape the device's matmul uses (the one a gate judges); true for the
    /// other shapes a GPU probe also times (threads per row), so one run on a GPU shows whether
    /// another shape would read faster. Never gated.
    pub alternative: bool,
}

/// What [`Device::bandwidth_probe`] measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BandwidthProbe {
    /// Bytes each buffer held (the copy's source; each GEMV weight matrix at most).
    pub bytes: usize,
    /// Device-to-device copy, counting bytes read plus bytes written.
    pub copy_gbps: f64,
    /// Per weight type, the GEMV's weight bandwidth.
    pub gemv: Vec<GemvRate>,
    pub reps: usize,
    /// Why these figures are not the hardware's (an emulator's timings); the roofline gate is
    /// then inconclusive, never a pass.
    pub not_hardware: Option<String>,
}

/// Options of a device model run.
#[derive(Clone, Debug, Default)]
pub struct ModelOptions {
    /// Keep every cached key and value in these formats (the `cpu` device stores each row so and
    /// decodes it as attention reads it: the cache's numbers and its memory); unset: as computed.
    pub kv_cache: KvTypes,
    /// The model file's sha256, when known: external dumps must name the same model.
    pub model_sha256: Option<String>,
}

/// A model loaded on a device: prefill/decode against the device's own KV cache, with taps.
pub trait DeviceModel: Send {
    fn spec(&self) -> &oracle::ModelSpec;
    /// The arithmetic of this model's ops (what the layer-diff and fixed-token budgets consume).
    fn arithmetic(&self) -> Arithmetic;
    /// The name an external engine gives itself (its dump manifest's `device`), once it ran.
    fn declared_name(&self) -> Option<String> {
        None
    }
    /// Runs `tokens` at positions `cached()..`, appends to the cache, returns logits `[tokens, n_vocab]`.
    fn forward(&mut self, tokens: &[u32], taps: &mut dyn oracle::Tap) -> Result<Vec<f32>, DeviceError>;
    /// [`DeviceModel::forward`] returning the logits of the last token only (`[n_vocab]`): what
    /// generation needs. Devices that can skip the output head for the other positions do, as
    /// llama.cpp computes logits only for the positions a batch asks for (so prefill speeds
    /// compare); the row holds the bits `forward` gives it. This default runs `forward` and keeps
    /// its last row.
    fn forward_last(&mut self, tokens: &[u32], taps: &mut dyn oracle::Tap) -> Result<Vec<f32>, DeviceError> {
        let n_vocab = self.spec().n_vocab;
        let mut logits = self.forward(tokens, taps)?;
        Ok(logits.split_off(logits.len().saturating_sub(n_vocab)))
    }
    /// Positions in the cache.
    fn cached(&self) -> usize;
    /// Engines that generate ids themselves (token-only external engines): the greedy ids after
    /// `prompt`, or None when this engine is stepped through `forward` instead.
    fn generate_ids(&mut self, _prompt: &[u32], _max_new: usize) -> Option<Result<Vec<u32>, DeviceError>> {
        None
    }
    /// True when the engine runs one prefill per request and cannot be stepped token by token
    /// (external dumps): cache-consistency checks are then unsupported.
    fn one_shot(&self) -> bool {
        false
    }
    /// Empties the cache.
    fn reset(&mut self);
    /// Device memory held at most so far (GPU devices), if tracked.
    fn memory_peak_bytes(&self) -> Option<u64> {
        None
    }
    /// Kernel launches so far (GPU devices), if counted: the difference across a step is what
    /// the step cost in launches, which bounds a small model's decode speed long before its
    /// weight bandwidth does.
    fn kernel_launches(&self) -> Option<u64> {
        None
    }
    /// Starts timing every kernel launch (GPU devices; false: this engine has no kernels to
    /// time). Each launch then waits for its kernel, so a profiled run is never a timed one.
    fn start_kernel_profile(&mut self) -> bool {
        false
    }
    /// Stops the profile started by [`DeviceModel::start_kernel_profile`] and returns it.
    fn take_kernel_profile(&mut self) -> Option<KernelProfile> {
        None
    }
}

/// One kernel's share of a profiled run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct KernelTime {
    pub kernel: String,
    pub launches: u64,
    /// Summed over its launches, each timed alone (device events on GPUs).
    pub seconds: f64,
}

/// Per kernel, the launches and time of a profiled run, by kernel name.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct KernelProfile {
    pub kernels: Vec<KernelTime>,
    /// Why the times are not a GPU's (the emulator's host timings); None on GPUs.
    pub not_hardware: Option<String>,
}

impl KernelProfile {
    pub fn seconds(&self) -> f64 {
        self.kernels.iter().map(|k| k.seconds).sum()
    }
    pub fn launches(&self) -> u64 {
        self.kernels.iter().map(|k| k.launches).sum()
    }
    /// What `self` has beyond `earlier` (a profile of a longer run minus one of its prefix), per
    /// kernel; kernels with nothing beyond are dropped.
    pub fn minus(&self, earlier: &KernelProfile) -> KernelProfile {
        let kernels = self
            .kernels
            .iter()
            .filter_map(|k| {
                let e = earlier.kernels.iter().find(|e| e.kernel == k.kernel);
                let launches = k.launches.saturating_sub(e.map_or(0, |e| e.launches));
                (launches > 0).then(|| KernelTime { kernel: k.kernel.clone(), launches, seconds: (k.seconds - e.map_or(0.0, |e| e.seconds)).max(0.0) })
            })
            .collect();
        KernelProfile { kernels, not_hardware: self.not_hardware.clone() }
    }
}

/// Opens a device by name, or says why it is unavailable. Every device opened is remembered with
/// its description (see [`opened`]).
pub fn open(name: &str) -> Result<Box<dyn Device>, DeviceError> {
    let d = open_device(name)?;
    OPENED.lock().unwrap_or_else(|e| e.into_inner()).insert(d.name(), d.describe());
    Ok(d)
}

static OPENED: std::sync::Mutex<std::collections::BTreeMap<String, String>> = std::sync::Mutex::new(std::collections::BTreeMap::new());

/// The devices this process opened: name -> description (for report provenance).
pub fn opened() -> std::collections::BTreeMap<String, String> {
    OPENED.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The built-in devices named by one word, and the prefixes of the others (parameterised
/// built-ins and external engines), as [`open`] reads them.
pub const BUILTIN_NAMES: [&str; 4] = ["ref", "cpu", "fixed", "fixed-int4"];
pub const DEVICE_PREFIXES: [&str; 7] = ["cpu:", "gpu-emu", "cuda", "rocm", "exec:", "external:", "ids:"];

/// Whether `name` reads as one of [`open`]'s device names: a name an external engine gives
/// itself that does is labelled apart from the device it would be taken for.
pub fn is_device_name(name: &str) -> bool {
    BUILTIN_NAMES.contains(&name) || DEVICE_PREFIXES.iter().any(|p| name.starts_with(p))
}

fn open_device(name: &str) -> Result<Box<dyn Device>, DeviceError> {
    let unavailable = |why: &str| Err(DeviceError::Unavailable(name.to_string(), why.to_string()));
    // Command lines of external engines may hold anything; only built-in devices take +slow=.
    if !name.starts_with("exec:") && !name.starts_with("ids:") && !name.starts_with("external:") {
        match slowed::parse(name) {
            Some(Ok((base, fraction))) => return Ok(Box::new(slowed::SlowedDevice { inner: open_device(base)?, fraction })),
            Some(Err(why)) => return unavailable(&why),
            None => {}
        }
    }
    match name {
        "ref" => Ok(Box::new(reference::RefDevice)),
        "cpu" => Ok(Box::new(cpu::CpuDevice::default())),
        n if n.starts_with("cpu:kv-") => match KvTypes::parse(&n["cpu:kv-".len()..]) {
            Some(kv) => Ok(Box::new(cpu::CpuDevice { kv_cache: kv })),
            None => unavailable(&format!("unknown KV cache format (cpu:kv-TYPE, or cpu:kv-K-V for keys and values apart, takes {})", KvFormat::names())),
        },
        "fixed" => Ok(Box::new(fixed::FixedDevice { int4: false })),
        "fixed-int4" => Ok(Box::new(fixed::FixedDevice { int4: true })),
        n if n.starts_with("gpu-emu") || n.starts_with("cuda") || n.starts_with("rocm") => gpu::open(n),
        n if n == "external:" || n == "exec:" || n == "ids:" => unavailable("give a dump directory (external:DIR) or a command (exec:CMD, ids:CMD)"),
        n if n.starts_with("external:") || n.starts_with("exec:") || n.starts_with("ids:") => match external::ExternalDevice::parse(n).expect("prefix checked") {
            Ok(d) => Ok(Box::new(d)),
            Err(why) => unavailable(&why),
        },
        _ => Err(DeviceError::Unknown { name: name.to_string(), suggestion: suggest_device(name) }),
    }
}

/// The device name nearest a misspelt one (`cpuu`, `fxied`, `exec python3 e.py`, `cpu:kv-f61`),
/// when one is near enough to be what was meant.
fn suggest_device(name: &str) -> Option<String> {
    let kv = KvFormat::names().split(", ").map(|f| format!("cpu:kv-{f}")).collect::<Vec<_>>();
    let candidates = BUILTIN_NAMES.iter().map(|s| s.to_string()).chain(kv).chain(["gpu-emu", "cuda:0", "rocm:0"].map(String::from));
    // An engine command without its colon (`exec python3 engine.py`).
    for p in ["exec", "ids", "external"] {
        if let Some(rest) = name.strip_prefix(p).filter(|r| r.starts_with([' ', '='])) {
            return Some(format!("{p}:{}", rest[1..].trim_start()));
        }
    }
    let lower = name.to_lowercase();
    candidates.map(|c| (strsim::damerau_levenshtein(&lower, &c), c)).filter(|(d, c)| *d <= 2.max(c.len() / 4) && *d < c.len()).min_by_key(|(d, _)| *d).map(|(_, c)| c)
}

pub(crate) fn fail(device: &str, case: &OpCase, reason: impl std::fmt::Display) -> DeviceError {
    DeviceError::Failed { device: device.to_string(), case: case.id.clone(), reason: reason.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A misspelt device is unknown, with the name that was meant where one is near.
    #[test]
    fn a_misspelt_device_gets_a_suggestion() {
        for (typo, meant) in [("cpuu", Some("cpu")), ("CPU", Some("cpu")), ("fxied", Some("fixed")), ("fixed_int4", Some("fixed-int4")), ("exec python3 engine.py", Some("exec:python3 engine.py")), ("llama.cpp", None), ("x", None)] {
            let e = open(typo).err().unwrap_or_else(|| panic!("{typo} opened"));
            let text = e.to_string();
            match meant {
                Some(m) => assert!(text.starts_with(&format!("unknown device `{typo}`: did you mean `{m}`?")), "{typo}: {text}"),
                None => assert!(text.starts_with(&format!("unknown device `{typo}`; the devices: ")), "{typo}: {text}"),
            }
        }
    }

    /// The one list of device names is the one `open` reads: every built-in name opens, and a
    /// name outside the list and its prefixes is an unknown device; the list help texts give
    /// names every name and prefix, and every KV cache format.
    #[test]
    fn device_names_are_the_ones_open_reads() {
        let listed: Vec<&str> = device_names!().split([',', ' ', '(', ')', ';']).collect();
        for n in BUILTIN_NAMES.iter().chain(&["cuda[:N]", "rocm[:N]", "cpu:kv-TYPE", "external:DIR", "exec:CMD", "ids:CMD", gpu_emu_syntax!()]) {
            assert!(listed.contains(n), "{n} is not in device_names!()");
        }
        for p in DEVICE_PREFIXES {
            assert!(listed.iter().any(|l| l.starts_with(p)), "no name in device_names!() starts with {p}");
        }
        for f in KvFormat::names().split(", ") {
            assert!(listed.contains(&f), "KV cache format {f} is not in device_names!()");
        }
        for n in BUILTIN_NAMES {
            assert!(open(n).is_ok(), "{n}");
            assert!(is_device_name(n));
        }
        for n in ["cpu:kv-f16", "gpu-emu", "exec:true", "external:/nowhere"] {
            assert!(is_device_name(n), "{n}");
            assert!(!matches!(open(n), Err(DeviceError::Unknown { .. })), "{n}");
        }
        assert!(!is_device_name("llama.cpp"));
        assert!(matches!(open("llama.cpp"), Err(DeviceError::Unknown { suggestion: None, .. })));
    }

    /// Each cache format gives back what its codec decodes, within its step; the budgets' size
    /// of a rounding orders the formats as their steps do; rows of part blocks are refused.
    #[test]
    fn cache_formats_round_rows_as_their_codec_does() {
        let x: Vec<f32> = (0..128).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let mut last = 0.0;
        for (name, step) in [("f32", 0.0), ("f16", 2f32.powi(-10)), ("bf16", 2f32.powi(-7)), ("q8_0", 1.0 / 127.0), ("q5_0", 1.0 / 16.0), ("q5_1", 2.0 / 31.0), ("q4_0", 1.0 / 8.0), ("q4_1", 2.0 / 15.0), ("iq4_nl", 28.0 / 127.0)] {
            let f = KvFormat::parse(name).unwrap();
            assert_eq!(f.to_string(), name);
            let mut r = x.clone();
            f.round_rows(&mut r, 64).unwrap();
            let worst = r.iter().zip(&x).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            // One full step at a symmetric format's clamped end; half a step elsewhere.
            assert!(worst <= step * amax * 1.01 + 1e-6, "{name}: {worst} off, step {}", step * amax);
            assert!(f.rel_rounding() >= last, "{name}");
            last = f.rel_rounding();
            assert_eq!(f.block().is_some(), name.contains('q'));
        }
        assert!(KvFormat::parse("q4_0").unwrap().round_rows(&mut x.clone(), 48).is_none(), "rows of part blocks");
        assert!(KvFormat::parse("q4_k").is_none() && KvFormat::parse("iq4_xs").is_none());
    }

    /// A cache's formats as the `cpu:kv-*` devices and llama.cpp's `--cache-type-k/-v` say them:
    /// one for both, or keys then values; set into a declaration and read back.
    #[test]
    fn kv_cache_types_parse_print_and_declare_keys_and_values_apart() {
        let q8 = KvFormat::Q8_0;
        let f16 = KvFormat::parse("f16").unwrap();
        assert_eq!(KvTypes::parse("q8_0"), Some(KvTypes::both(q8)));
        assert_eq!(KvTypes::parse("q8_0-f16"), Some(KvTypes { k: Some(q8), v: Some(f16) }));
        for bad in ["q8_0-", "-f16", "q8_0-f16-f16", "q4_k-f16", "f16-q4_k", ""] {
            assert_eq!(KvTypes::parse(bad), None, "{bad}");
        }
        for s in ["q8_0", "q8_0-f16", "f32-q4_0", "iq4_nl-q5_1"] {
            let t = KvTypes::parse(s).unwrap();
            assert_eq!(t.to_string(), s);
            assert_eq!(Arithmetic::F32.with_kv(t).kv_types(), t, "{s}");
        }
        assert_eq!(KvTypes::parse("f16-f16").unwrap().to_string(), "f16");
        assert_eq!(KvTypes::parse("q8_0-f16").unwrap().formats().collect::<Vec<_>>(), [q8, f16]);
        assert_eq!(KvTypes::both(q8).formats().collect::<Vec<_>>(), [q8]);
        // An f32 cache rounds nothing; values in f32 behind q8_0 keys are declared so.
        assert!(KvTypes::parse("f32").unwrap().is_none() && KvTypes::default().is_none() && !KvTypes::parse("f32-f16").unwrap().is_none());
        let keys_only = Arithmetic::F32.with_kv(KvTypes { k: Some(q8), v: None });
        assert_eq!((keys_only.kv_cache, keys_only.kv_cache_v), (Some(q8), Some(KvFormat::F32)));
        // The device names.
        for name in ["cpu:kv-q8_0-f16", "cpu:kv-q4_0", "cpu:kv-f16-q8_0"] {
            assert_eq!(open(name).unwrap().name(), name);
        }
        assert!(open("cpu:kv-q8_0-q4_k").is_err_and(|e| e.to_string().contains("cpu:kv-K-V")));
    }

    /// The Walsh-Hadamard rotation is orthonormal and its own inverse, Sylvester-ordered (its
    /// first row all 1/sqrt(n)); the rotation widths follow llama.cpp's rule.
    #[test]
    fn hadamard_rotations_are_orthonormal_involutions() {
        let x: Vec<f32> = (0..128).map(|i| ((i * 53 % 97) as f32 - 48.0) / 5.0).collect();
        let mut y = x.clone();
        hadamard_rotate(&mut y, 64);
        let norm = |v: &[f32]| v.iter().map(|a| (*a as f64).powi(2)).sum::<f64>();
        assert!((norm(&y) - norm(&x)).abs() <= 1e-6 * norm(&x) && y != x);
        let mut e0 = vec![0f32; 64];
        e0[0] = 1.0;
        hadamard_rotate(&mut e0, 64);
        assert!(e0.iter().all(|v| *v == 0.125));
        hadamard_rotate(&mut y, 64);
        assert!(y.iter().zip(&x).all(|(a, b)| (a - b).abs() <= 1e-5 * b.abs().max(1.0)));
        assert_eq!(kv_rotation_widths(64), Some((64, 64)));
        assert_eq!(kv_rotation_widths(128), Some((128, 64)));
        assert_eq!(kv_rotation_widths(192), Some((64, 64)));
        assert_eq!(kv_rotation_widths(96), None);
        assert_eq!(kv_rotation_widths(0), None);
    }

    /// A manifest's declaration as JSON: the optional fields may be absent or null; a field of
    /// the wrong type is an error, not a default; what is written back leaves out what was not
    /// declared.
    #[test]
    fn a_declared_arithmetic_reads_absent_and_null_optional_fields_as_undeclared() {
        let base = r#""storage": "f32", "accumulate": "f32", "activation_q8_block": 32, "transcendental_ulps": 4.0, "fixed": null"#;
        let read = |extra: &str| serde_json::from_str::<Arithmetic>(&format!("{{{base}{extra}}}"));
        let plain = Arithmetic { activation_q8_block: Some(32), ..Arithmetic::F32 };
        assert_eq!(read("").unwrap(), plain);
        assert_eq!(read(r#", "kv_cache": null, "activation_q8_block_kquant": null, "activation_half_rounding": null"#).unwrap(), plain);
        let full = read(r#", "kv_cache": "f16", "activation_q8_block_kquant": 256, "activation_half_rounding": true"#).unwrap();
        assert_eq!(full, Arithmetic { kv_cache: KvFormat::parse("f16"), activation_q8_block_kquant: Some(256), activation_half_rounding: true, ..plain });
        assert!(read(r#", "activation_half_rounding": "yes""#).unwrap_err().to_string().contains("expected a boolean"));
        let written = serde_json::to_value(plain).unwrap();
        assert!(written.get("activation_q8_block_kquant").is_none() && written.get("activation_half_rounding").is_none(), "{written}");
        assert_eq!(serde_json::from_value::<Arithmetic>(serde_json::to_value(full).unwrap()).unwrap(), full);
        // A quantized cache and its rotation; a cache type this tool cannot decode is an error
        // naming it and what it takes.
        let q8 = read(r#", "kv_cache": "q8_0", "kv_cache_rotation": true"#).unwrap();
        assert_eq!((q8.kv_cache.map(KvFormat::ty), q8.kv_cache_rotation), (Some(oracle::quant::GgmlType::Q8_0), true));
        assert_eq!(serde_json::to_value(q8).unwrap()["kv_cache"], "q8_0");
        assert!(!read(r#", "kv_cache_rotation": null"#).unwrap().kv_cache_rotation);
        let e = read(r#", "kv_cache": "iq4_xs""#).unwrap_err().to_string();
        assert!(e.contains("iq4_xs") && e.contains("f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl"), "{e}");
        assert!(read(r#", "kv_cache": "q4_k""#).is_err(), "a K-quant is no cache type");
        // Keys and values apart (`kv_cache_v`); written only where the values' format differs.
        let split = read(r#", "kv_cache": "q8_0", "kv_cache_v": "f16""#).unwrap();
        assert_eq!(split.kv_types(), KvTypes::parse("q8_0-f16").unwrap());
        assert_eq!(serde_json::to_value(split).unwrap()["kv_cache_v"], "f16");
        assert!(serde_json::to_value(q8).unwrap().get("kv_cache_v").is_none());
        assert_eq!(q8.kv_types(), KvTypes::both(KvFormat::Q8_0), "the values as the keys when not said");
        assert!(read(r#", "kv_cache_v": "q4_k""#).unwrap_err().to_string().contains("q4_k"));
        // Each block is checked.
        assert!(Arithmetic { activation_q8_block_kquant: Some(0), ..plain }.check().unwrap_err().contains("activation_q8_block_kquant 0"));
        // A fixed-point declaration with no fraction bits is refused; the `fixed` devices' own pass.
        let fixed = crate::fixed::FixedDevice { int4: false }.point();
        assert!(Arithmetic { fixed: Some(fixed), ..plain }.check().is_ok());
        let coarse = FixedPoint { act_frac: 0, ..fixed };
        assert!(Arithmetic { fixed: Some(coarse), ..plain }.check().unwrap_err().contains("fixed.act_frac 0: at least 8 fraction bits"));
    }
}
