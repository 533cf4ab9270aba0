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

mod arithmetic;
pub mod case_file;
pub mod cpu;
pub mod external;
pub mod fixed;
mod format;
pub mod gpu;
mod kv;
mod open;
pub mod ops_protocol;
pub mod process;
pub mod probe;
#[cfg(feature = "faults")]
pub mod faulty;
pub mod op_model;
pub mod slowed;
pub mod reference;
pub mod shared;

use oracle::registry::{OpCase, Output};

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("device `{0}` is unavailable: {1}")]
    Unavailable(String, String),
    /// A name that is no device: misspelt, or from a newer version of this tool.
    #[error("unknown device `{name}`{}; the devices: {}", suggestion.as_ref().map(|s| format!(": did you mean `{s}`?")).unwrap_or_default(), device_names!())]
    Unknown { name: String, suggestion: Option<String> },
    /// A device's name read as one but not well formed (an unknown KV cache format, a bad
    /// `+slow=`, an engine prefix with nothing after it): an error in the arguments.
    #[error("device `{name}`: {why}")]
    Malformed { name: String, why: String },
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

pub use arithmetic::*;
pub use format::*;
pub use kv::*;
pub use open::*;

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
    /// Runs a serving schedule (`oracle::schedule`): its requests batched step by step, with
    /// their prompts in chunks, reused prefixes and recycled cache slots, as the engine serves;
    /// the logits of every position each request computed. None: the engine does not serve
    /// schedules (the serving rung reports it unsupported).
    fn serve(&mut self, _schedule: &oracle::schedule::Schedule) -> Option<Result<oracle::schedule::Served, DeviceError>> {
        None
    }
    /// [`DeviceModel::serve`], with the wall-clock seconds of each step of the schedule pushed to
    /// `step_seconds` (index = step; 0 for a step no request runs at): what `bench --batch`
    /// times. The default serves and times nothing (`step_seconds` stays empty).
    fn serve_timed(&mut self, schedule: &oracle::schedule::Schedule, _step_seconds: &mut Vec<f64>) -> Option<Result<oracle::schedule::Served, DeviceError>> {
        self.serve(schedule)
    }
    /// [`DeviceModel::serve`], recording request `request`'s taps as it is served (its rows of
    /// each step's batch, at its positions): where a red serving case's request first departs
    /// from its run alone. None: the engine does not record taps while it serves.
    fn serve_tapped(&mut self, _schedule: &oracle::schedule::Schedule, _request: &str, _taps: &mut dyn oracle::Tap) -> Option<Result<oracle::schedule::Served, DeviceError>> {
        None
    }
    /// Whether the engine declares its numbers independent of the batch: a request's logits the
    /// same bits whatever it is batched with, however its prompt is chunked, cached prefix or
    /// not. The serving rung then holds it bit for bit; otherwise within twice its logit budget.
    fn batch_invariant(&self) -> bool {
        false
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

    /// A name read as a device but not well formed is an error in the arguments (never taken
    /// for a device that is merely unavailable here), saying what is wrong.
    #[test]
    fn a_malformed_device_name_says_what_is_wrong() {
        for (name, why) in [("cpu:kv-q9", "unknown KV cache format"), ("cpu+slow=x", "a percentage from 0 to 1000"), ("exec:", "give a dump directory"), ("fixed+slow=2000", "a percentage")] {
            match name.parse::<DeviceSpec>() {
                Err(DeviceError::Malformed { name: n, why: w }) => assert!(n == name && w.contains(why), "{name}: {w}"),
                other => panic!("{name}: {other:?}"),
            }
        }
        let spec: DeviceSpec = "cpu:kv-q8_0+slow=5".parse().unwrap();
        assert!(matches!(spec.kind(), DeviceKind::Slowed { base, .. } if *base.kind() == DeviceKind::Cpu(KvTypes::parse("q8_0").unwrap())));
        assert_eq!(spec.to_string(), "cpu:kv-q8_0+slow=5");
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
