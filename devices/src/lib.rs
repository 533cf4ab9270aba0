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

pub mod cpu;
pub mod external;
pub mod fixed;
pub mod gpu;
pub mod probe;
#[cfg(feature = "faults")]
pub mod faulty;
pub mod reference;

use oracle::registry::{OpCase, Output};

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("device `{0}` is unavailable: {1}")]
    Unavailable(String, String),
    #[error("{device}: {case}: {reason}")]
    Failed { device: String, case: String, reason: String },
    /// The device ran and its result is known to be wrong (e.g. a kernel wrote outside its
    /// output): a failure of the device, not an inability to run.
    #[error("{device}: {case}: {reason}")]
    WrongResult { device: String, case: String, reason: String },
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
    /// The block for products with K-quant matrices (Q4_K, Q5_K, Q6_K) where it differs from
    /// `activation_q8_block`'s: llama.cpp's CPU backend gives them Q8_K blocks of 256 and the
    /// other quantized types Q8_0/Q8_1 blocks of 32, so a file that mixes them (a K-quant file
    /// whose 576-wide rows fell back to Q5_0) rounds its products' inputs two ways. None: the
    /// same block for every quantized matrix.
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
    /// cache is f16); None: the cache holds what `storage` holds. Only attention reads the cache,
    /// so only its budget (and what propagates from it) grows.
    #[serde(default)]
    pub kv_cache: Option<NumFormat>,
}

/// A flag a manifest may write as null (absent) as well as true or false.
fn null_is_false<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(<Option<bool> as serde::Deserialize>::deserialize(d)?.unwrap_or(false))
}

/// How a declared arithmetic rounds a product's input before the matrix
/// ([`Arithmetic::input_rounding`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum InputRounding {
    /// Symmetric 8-bit blocks of this many values (llama.cpp's Q8_0 and Q8_K).
    Q8(usize),
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

impl Arithmetic {
    pub const F64: Arithmetic = Arithmetic { storage: NumFormat::F64, accumulate: NumFormat::F64, activation_q8_block: None, activation_q8_block_kquant: None, activation_half_rounding: false, transcendental_ulps: 1.0, fixed: None, kv_cache: None };
    pub const F32: Arithmetic = Arithmetic { storage: NumFormat::F32, accumulate: NumFormat::F32, activation_q8_block: None, activation_q8_block_kquant: None, activation_half_rounding: false, transcendental_ulps: 4.0, fixed: None, kv_cache: None };

    /// How the activations entering a product with a matrix stored as `ty` are rounded: Q8
    /// blocks before a quantized matrix (K-quants' own block where declared), the matrix's
    /// format before an F16/BF16 one when `activation_half_rounding`; None: they enter as held.
    pub fn input_rounding(&self, ty: oracle::quant::GgmlType) -> Option<InputRounding> {
        use oracle::quant::GgmlType::{BF16, F16, F32, Q4_K, Q5_K, Q6_K};
        match ty {
            F32 => None,
            F16 => self.activation_half_rounding.then_some(InputRounding::Half(NumFormat::F16)),
            BF16 => self.activation_half_rounding.then_some(InputRounding::Half(NumFormat::BF16)),
            Q4_K | Q5_K | Q6_K => self.activation_q8_block_kquant.or(self.activation_q8_block).map(InputRounding::Q8),
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

/// A device model's key/value cache: per layer, `[len, width]` keys and values of any element
/// type (f32 on `cpu`, Q16 integers on `fixed`).
pub struct KvStore<T> {
    pub k: Vec<Vec<T>>,
    pub v: Vec<Vec<T>>,
    /// Positions held.
    pub len: usize,
}

impl<T: Clone> KvStore<T> {
    pub fn new(n_layer: usize) -> Self {
        KvStore { k: vec![Vec::new(); n_layer], v: vec![Vec::new(); n_layer], len: 0 }
    }

    pub fn reset(&mut self) {
        self.k.iter_mut().for_each(|c| c.clear());
        self.v.iter_mut().for_each(|c| c.clear());
        self.len = 0;
    }

    /// Writes one layer's keys and values for positions `start..` (rows of `width`), dropping
    /// anything the cache held from `start` on.
    pub fn write(&mut self, layer: usize, start: usize, width: usize, k: &[T], v: &[T]) {
        for (cache, new) in [(&mut self.k[layer], k), (&mut self.v[layer], v)] {
            cache.truncate(start * width);
            cache.extend_from_slice(new);
        }
    }
}

/// Options of a device model run.
#[derive(Clone, Debug, Default)]
pub struct ModelOptions {
    /// Keep every cached key and value in f16 (the `cpu` device stores them as f16 and widens
    /// each row as attention reads it: an f16 cache's numbers and its memory).
    pub kv_f16: bool,
    /// The model file's sha256, when known: external dumps must name the same model.
    pub model_sha256: Option<String>,
}

/// A model loaded on a device: prefill/decode against the device's own KV cache, with taps.
pub trait DeviceModel: Send {
    fn spec(&self) -> &oracle::ModelSpec;
    /// The arithmetic of this model's ops (what the layer-diff and fixed-token budgets consume).
    fn arithmetic(&self) -> Arithmetic;
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

fn open_device(name: &str) -> Result<Box<dyn Device>, DeviceError> {
    let unavailable = |why: &str| Err(DeviceError::Unavailable(name.to_string(), why.to_string()));
    match name {
        "ref" => Ok(Box::new(reference::RefDevice)),
        "cpu" => Ok(Box::new(cpu::CpuDevice::default())),
        "cpu:kv-f16" => Ok(Box::new(cpu::CpuDevice { kv_f16: true })),
        "fixed" => Ok(Box::new(fixed::FixedDevice { int4: false })),
        "fixed-int4" => Ok(Box::new(fixed::FixedDevice { int4: true })),
        n if n.starts_with("gpu-emu") || n.starts_with("cuda") || n.starts_with("rocm") => gpu::open(n),
        n if n == "external:" || n == "exec:" || n == "ids:" => unavailable("give a dump directory (external:DIR) or a command (exec:CMD, ids:CMD)"),
        n if n.starts_with("external:") || n.starts_with("exec:") || n.starts_with("ids:") => match external::ExternalDevice::parse(n).expect("prefix checked") {
            Ok(d) => Ok(Box::new(d)),
            Err(why) => unavailable(&why),
        },
        _ => unavailable(concat!("unknown device (ref, cpu, cpu:kv-f16, fixed, fixed-int4, cuda[:N], rocm[:N], ", gpu_emu_syntax!(), ", external:DIR, exec:CMD, ids:CMD)")),
    }
}

pub(crate) fn fail(device: &str, case: &OpCase, reason: impl std::fmt::Display) -> DeviceError {
    DeviceError::Failed { device: device.to_string(), case: case.id.clone(), reason: reason.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(full, Arithmetic { kv_cache: Some(NumFormat::F16), activation_q8_block_kquant: Some(256), activation_half_rounding: true, ..plain });
        assert!(read(r#", "activation_half_rounding": "yes""#).unwrap_err().to_string().contains("expected a boolean"));
        let written = serde_json::to_value(plain).unwrap();
        assert!(written.get("activation_q8_block_kquant").is_none() && written.get("activation_half_rounding").is_none(), "{written}");
        assert_eq!(serde_json::from_value::<Arithmetic>(serde_json::to_value(full).unwrap()).unwrap(), full);
        // Each block is checked.
        assert!(Arithmetic { activation_q8_block_kquant: Some(0), ..plain }.check().unwrap_err().contains("activation_q8_block_kquant 0"));
    }
}
