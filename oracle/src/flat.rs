//! The flat model format: one file a program without a GGUF parser can read with a struct cast
//! (a bare-metal kernel, an eBPF loader, a hand-written C engine). A fixed 512-byte header holds
//! every number the interpreter needs, a table of fixed 128-byte entries names each tensor (its
//! GGML type, dims, absolute offset, size and FNV-1a 64 checksum), and the tensors follow, each
//! 64-byte aligned, in the order of a forward pass. All integers and floats are little-endian.
//! `docs/FLAT_FORMAT.md` is the specification and `examples/flat_engine/touchstone_flat.h` its C
//! declaration; this module writes the format (`export`) and reads it back as a model
//! (`FlatFile`), so the oracle judges an engine on exactly the bytes the engine loaded.

use crate::error::{OracleError, Result};
use crate::gguf::Bytes;
use crate::tensor::{LoadedTensor, RawTensor, TensorSource};
use crate::quant::GgmlType;
use crate::spec::{Activation, Gating, MoeSpec, ModelSpec, RopeScaling, RopeSpec, RopeStyle};
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

pub const MAGIC: [u8; 8] = *b"TSFLAT\0\0";
pub const VERSION: u32 = 1;
pub const HEADER_SIZE: usize = 512;
pub const ENTRY_SIZE: usize = 128;
pub const ALIGN: u64 = 64;
pub const NAME_LEN: usize = 64;
/// The name of the RoPE frequency factors tensor (F32, one per rotated pair), present when
/// header flag `FLAG_FREQ_FACTORS` is set; read into the spec, not a weight.
pub const FREQ_FACTORS: &str = "rope_freqs.weight";

pub const FLAG_QK_NORM: u32 = 1;
pub const FLAG_QKV_BIAS: u32 = 2;
pub const FLAG_OUT_BIAS: u32 = 4;
pub const FLAG_TIED_OUTPUT: u32 = 8;
pub const FLAG_FREQ_FACTORS: u32 = 16;
/// Gemma's `post_attention_norm` and `post_ffw_norm` in every layer.
pub const FLAG_POST_NORMS: u32 = 32;
/// GPT-OSS's `attn_sinks` (one logit per query head) in every layer.
pub const FLAG_ATTN_SINKS: u32 = 64;
/// YaRN's correction range used as computed, not rounded out to whole dimensions (GPT-OSS).
pub const FLAG_YARN_UNTRUNCATED: u32 = 128;
const KNOWN_FLAGS: u32 = 255;
pub const MOE_NORMALIZE_TOPK: u32 = 1;
pub const MOE_SHARED_GATE: u32 = 2;
/// The router and every expert's products add biases (GPT-OSS).
pub const MOE_BIASES: u32 = 4;

/// Byte offsets of the header fields (the C struct `ts_flat_header` has the same layout).
mod off {
    pub const VERSION: usize = 8;
    pub const HEADER_SIZE: usize = 12;
    pub const FILE_SIZE: usize = 16;
    pub const TABLE_OFFSET: usize = 24;
    pub const N_TENSORS: usize = 32;
    pub const ENTRY_SIZE: usize = 36;
    pub const DATA_OFFSET: usize = 40;
    pub const ARCH: usize = 48;
    pub const N_VOCAB: usize = 64;
    pub const N_EMBD: usize = 68;
    pub const N_LAYER: usize = 72;
    pub const N_HEAD: usize = 76;
    pub const N_HEAD_KV: usize = 80;
    pub const HEAD_DIM: usize = 84;
    pub const N_FF: usize = 88;
    pub const CONTEXT_LENGTH: usize = 92;
    pub const N_ROT: usize = 96;
    pub const ROPE_STYLE: usize = 100;
    pub const ROPE_SCALING: usize = 104;
    pub const ACTIVATION: usize = 108;
    pub const FLAGS: usize = 112;
    pub const SLIDING_WINDOW: usize = 116;
    pub const N_EXPERT: usize = 120;
    pub const N_EXPERT_USED: usize = 124;
    pub const EXPERT_FFN: usize = 128;
    pub const MOE_GATING: usize = 132;
    pub const MOE_FLAGS: usize = 136;
    pub const SHARED_FFN: usize = 140;
    pub const NORM_EPS: usize = 144;
    pub const ROPE_THETA: usize = 152;
    pub const ATTN_SCALE: usize = 160;
    pub const ROPE_FACTOR: usize = 168;
    pub const YARN_BETA_FAST: usize = 176;
    pub const YARN_BETA_SLOW: usize = 184;
    pub const YARN_EXT_FACTOR: usize = 192;
    pub const ROPE_ATTN_FACTOR: usize = 200;
    pub const ROPE_ORIGINAL_CONTEXT: usize = 208;
    pub const ROPE_CONTEXT: usize = 216;
    pub const SWA_PERIOD: usize = 224;
    pub const ROPE_THETA_SWA: usize = 232;
    pub const EMBD_SCALE: usize = 240;
    pub const ATTN_SOFTCAP: usize = 248;
    pub const FINAL_SOFTCAP: usize = 256;
    /// Bytes 264..504 are reserved (zero).
    pub const RESERVED: usize = 264;
    pub const META_CHECKSUM: usize = 504;
}

/// FNV-1a 64 (what the table's checksums are): a few lines in any language.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv1a64_from(FNV_OFFSET, bytes)
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv1a64_from(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Whether the file at `path` starts with the flat format's magic (false when unreadable).
pub fn is_flat(path: &Path) -> bool {
    use std::io::Read;
    let mut m = [0u8; 8];
    crate::files::not_regular(path).is_none() && std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut m)).is_ok() && m == MAGIC
}

/// One tensor of the table.
#[derive(Clone, Debug, PartialEq)]
pub struct FlatTensor {
    pub name: String,
    pub ty: GgmlType,
    pub dims: Vec<u64>,
    pub offset: u64,
    pub n_bytes: u64,
    pub checksum: u64,
}

/// A flat model file, memory-mapped and checked: a `TensorSource` like a GGUF file.
pub struct FlatFile {
    pub path: String,
    bytes: Bytes,
    pub tensors: Vec<FlatTensor>,
    index: HashMap<String, usize>,
    /// Whether tensor `i`'s checksum was verified (each is, on its first use).
    verified: Vec<AtomicBool>,
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}
fn f64_at(b: &[u8], o: usize) -> f64 {
    f64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}

impl FlatFile {
    /// Opens and checks a flat model file; returns it with the model's spec.
    pub fn open(path: impl AsRef<Path>) -> Result<(FlatFile, ModelSpec)> {
        let path = path.as_ref();
        let file = crate::files::open(path)?;
        // SAFETY: read-only map; as for GGUF, a file truncated under us by another process is the
        // one case a memory map cannot defend against.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| OracleError::io(path, e))?;
        Self::parse(path.display().to_string(), Bytes::Mapped(map))
    }

    /// Parses a flat image held in memory (tests).
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<(FlatFile, ModelSpec)> {
        Self::parse(name.to_string(), Bytes::Owned(bytes))
    }

    fn parse(path: String, bytes: Bytes) -> Result<(FlatFile, ModelSpec)> {
        let b = bytes.as_slice();
        let err = |field: &str, offset: usize, reason: String| OracleError::Flat { file: path.clone(), field: field.to_string(), offset: offset as u64, reason };
        if b.len() < HEADER_SIZE {
            return Err(err("header", 0, format!("truncated: the header is {HEADER_SIZE} bytes, the file {}", b.len())));
        }
        if b[..8] != MAGIC {
            return Err(err("magic", 0, format!("expected {:?}, found {:?}", String::from_utf8_lossy(&MAGIC), String::from_utf8_lossy(&b[..8]))));
        }
        let h = &b[..HEADER_SIZE];
        let version = u32_at(h, off::VERSION);
        if version != VERSION {
            return Err(err("version", off::VERSION, format!("version {version}; this reader reads version {VERSION}")));
        }
        let expect = |field: &str, o: usize, got: u64, want: u64| if got == want { Ok(()) } else { Err(err(field, o, format!("is {got}, expected {want}"))) };
        expect("header_size", off::HEADER_SIZE, u32_at(h, off::HEADER_SIZE) as u64, HEADER_SIZE as u64)?;
        expect("file_size", off::FILE_SIZE, u64_at(h, off::FILE_SIZE), b.len() as u64)?;
        expect("table_offset", off::TABLE_OFFSET, u64_at(h, off::TABLE_OFFSET), HEADER_SIZE as u64)?;
        expect("entry_size", off::ENTRY_SIZE, u32_at(h, off::ENTRY_SIZE) as u64, ENTRY_SIZE as u64)?;
        if let Some(i) = h[off::RESERVED..off::META_CHECKSUM].iter().position(|&x| x != 0) {
            return Err(err("reserved", off::RESERVED + i, "reserved header bytes must be zero".into()));
        }
        let n_tensors = u32_at(h, off::N_TENSORS) as usize;
        let table_end = HEADER_SIZE as u64 + n_tensors as u64 * ENTRY_SIZE as u64;
        if table_end > b.len() as u64 {
            return Err(err("n_tensors", off::N_TENSORS, format!("{n_tensors} table entries need {table_end} bytes, the file has {}", b.len())));
        }
        let table_end = table_end as usize;
        let data_offset = u64_at(h, off::DATA_OFFSET);
        if data_offset < table_end as u64 || data_offset > b.len() as u64 || !data_offset.is_multiple_of(ALIGN) {
            return Err(err("data_offset", off::DATA_OFFSET, format!("{data_offset} is not a multiple of {ALIGN} between the table's end ({table_end}) and the file's end ({})", b.len())));
        }
        let sum = fnv1a64_from(fnv1a64(&h[..off::META_CHECKSUM]), &b[HEADER_SIZE..table_end]);
        let stored = u64_at(h, off::META_CHECKSUM);
        if sum != stored {
            return Err(err("meta_checksum", off::META_CHECKSUM, format!("the header and table hash to {sum:#018x}, the file says {stored:#018x}: the file is corrupt")));
        }

        let mut tensors = Vec::with_capacity(n_tensors);
        let mut index = HashMap::with_capacity(n_tensors);
        let mut end_of_previous = data_offset;
        for i in 0..n_tensors {
            let at = HEADER_SIZE + i * ENTRY_SIZE;
            let e = &b[at..at + ENTRY_SIZE];
            let field = |f: &str| format!("tensor[{i}].{f}");
            let raw_name = &e[..NAME_LEN];
            let len = raw_name.iter().position(|&c| c == 0).ok_or_else(|| err(&field("name"), at, format!("no NUL within {NAME_LEN} bytes")))?;
            if raw_name[len..].iter().any(|&c| c != 0) || len == 0 {
                return Err(err(&field("name"), at, "empty, or bytes after its NUL are not zero".into()));
            }
            let name = std::str::from_utf8(&raw_name[..len]).map_err(|e| err(&field("name"), at, format!("not UTF-8: {e}")))?.to_string();
            let field = |f: &str| format!("tensor `{name}`.{f}");
            let type_id = u32_at(e, 64);
            let ty = GgmlType::from_id(type_id).ok_or_else(|| err(&field("type"), at + 64, format!("unknown GGML type id {type_id}")))?;
            let n_dims = u32_at(e, 68) as usize;
            if !(1..=4).contains(&n_dims) {
                return Err(err(&field("n_dims"), at + 68, format!("{n_dims}, expected 1 to 4")));
            }
            let all_dims: Vec<u64> = (0..4).map(|d| u64_at(e, 72 + 8 * d)).collect();
            if let Some(d) = all_dims[n_dims..].iter().position(|&d| d != 1) {
                return Err(err(&field("dims"), at + 72 + 8 * (n_dims + d), format!("dims beyond n_dims {n_dims} must be 1, found {}", all_dims[n_dims + d])));
            }
            let dims = all_dims[..n_dims].to_vec();
            if !dims[0].is_multiple_of(ty.block_size() as u64) {
                return Err(err(&field("dims"), at + 72, format!("row length {} is not a multiple of the {} block size {}", dims[0], ty.name(), ty.block_size())));
            }
            let n_elements = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).filter(|&n| n > 0);
            let need = n_elements.and_then(|n| ty.bytes_for(n));
            let (offset, n_bytes) = (u64_at(e, 104), u64_at(e, 112));
            match need {
                Some(need) if need == n_bytes => {}
                _ => return Err(err(&field("n_bytes"), at + 112, format!("{n_bytes}, but dims {dims:?} of {} take {}", ty.name(), need.map_or("an impossible size".into(), |n| format!("{n} bytes"))))),
            }
            if !offset.is_multiple_of(ALIGN) || offset < end_of_previous || offset.checked_add(n_bytes).is_none_or(|end| end > b.len() as u64) {
                return Err(err(
                    &field("offset"),
                    at + 104,
                    format!("{offset} (+{n_bytes} bytes) must be a multiple of {ALIGN}, at or after {end_of_previous} (the data start or the previous tensor's end) and end within the file ({} bytes)", b.len()),
                ));
            }
            end_of_previous = offset + n_bytes;
            if index.insert(name.clone(), i).is_some() {
                return Err(err(&field("name"), at, "appears twice in the table".into()));
            }
            tensors.push(FlatTensor { name, ty, dims, offset, n_bytes, checksum: u64_at(e, 120) });
        }
        let verified = tensors.iter().map(|_| AtomicBool::new(false)).collect();
        let flat = FlatFile { path, bytes, tensors, index, verified };
        let spec = flat.spec()?;
        Ok((flat, spec))
    }

    fn err(&self, field: &str, offset: u64, reason: String) -> OracleError {
        OracleError::Flat { file: self.path.clone(), field: field.to_string(), offset, reason }
    }

    /// The model's spec from the header (and the frequency factors tensor), checked against the
    /// table: every weight the spec reads present, no other.
    fn spec(&self) -> Result<ModelSpec> {
        let h = &self.bytes.as_slice()[..HEADER_SIZE];
        let u = |o: usize| u32_at(h, o) as usize;
        let bad = |field: &str, o: usize, why: String| self.err(field, o as u64, why);
        let arch_raw = &h[off::ARCH..off::ARCH + 16];
        let arch_len = arch_raw.iter().position(|&c| c == 0).unwrap_or(16);
        let arch_name = std::str::from_utf8(&arch_raw[..arch_len]).map_err(|e| bad("arch", off::ARCH, format!("not UTF-8: {e}")))?;
        let arch = crate::spec::Arch::from_gguf(arch_name).ok_or_else(|| bad("arch", off::ARCH, format!("architecture `{arch_name}` is not one of {}", crate::spec::Arch::gguf_names())))?;
        let flags = u32_at(h, off::FLAGS);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(bad("flags", off::FLAGS, format!("{flags:#x} has bits this reader does not know (known: {KNOWN_FLAGS:#x})")));
        }
        let style = match u32_at(h, off::ROPE_STYLE) {
            0 => RopeStyle::Normal,
            1 => RopeStyle::Neox,
            v => return Err(bad("rope_style", off::ROPE_STYLE, format!("{v}, expected 0 (adjacent pairs) or 1 (rotate-half)"))),
        };
        let factor = f64_at(h, off::ROPE_FACTOR);
        let attn_factor = f64_at(h, off::ROPE_ATTN_FACTOR);
        // Read only by the scalings that use it (YaRN, LongRoPE).
        let original_context = || usize::try_from(u64_at(h, off::ROPE_ORIGINAL_CONTEXT)).map_err(|_| bad("rope_original_context", off::ROPE_ORIGINAL_CONTEXT, "too large".into()));
        let scaling = match u32_at(h, off::ROPE_SCALING) {
            0 => RopeScaling::None,
            1 => RopeScaling::Linear { factor },
            2 => RopeScaling::Yarn {
                factor,
                original_context: original_context()?,
                beta_fast: f64_at(h, off::YARN_BETA_FAST),
                beta_slow: f64_at(h, off::YARN_BETA_SLOW),
                ext_factor: f64_at(h, off::YARN_EXT_FACTOR),
                attn_factor,
                truncate: flags & FLAG_YARN_UNTRUNCATED == 0,
            },
            3 => {
                let original_context = original_context()?;
                // The context the file's factors were exported for; 0 (files written before the
                // field): the original context, whose short factors they then are.
                let context = match u64_at(h, off::ROPE_CONTEXT) {
                    0 => original_context,
                    c => usize::try_from(c).map_err(|_| bad("rope_context", off::ROPE_CONTEXT, "too large".into()))?,
                };
                RopeScaling::LongRope { attn_factor, original_context, context }
            }
            v => return Err(bad("rope_scaling", off::ROPE_SCALING, format!("{v}, expected 0 none, 1 linear, 2 yarn or 3 longrope"))),
        };
        let activation = match u32_at(h, off::ACTIVATION) {
            0 => Activation::Silu,
            1 => Activation::GeluTanh,
            2 => Activation::SwigluOai,
            v => {
                return Err(bad(
                    "activation",
                    off::ACTIVATION,
                    format!(
                        "{v}, expected 0 (SiLU), 1 (GELU, tanh) or 2 (GPT-OSS's clamped SwiGLU)"
                    ),
                ))
            }
        };
        let moe = match u(off::N_EXPERT) {
            0 => None,
            n_expert => {
                let moe_flags = u32_at(h, off::MOE_FLAGS);
                if moe_flags & !(MOE_NORMALIZE_TOPK | MOE_SHARED_GATE | MOE_BIASES) != 0 {
                    return Err(bad("moe_flags", off::MOE_FLAGS, format!("{moe_flags:#x} has unknown bits")));
                }
                Some(MoeSpec {
                    n_expert,
                    n_expert_used: u(off::N_EXPERT_USED),
                    expert_ffn: u(off::EXPERT_FFN),
                    gating: match u32_at(h, off::MOE_GATING) {
                        0 => Gating::Softmax,
                        1 => Gating::Sigmoid,
                        v => return Err(bad("moe_gating", off::MOE_GATING, format!("{v}, expected 0 (softmax) or 1 (sigmoid)"))),
                    },
                    normalize_topk: moe_flags & MOE_NORMALIZE_TOPK != 0,
                    shared_ffn: Some(u(off::SHARED_FFN)).filter(|&n| n > 0),
                    shared_gate: moe_flags & MOE_SHARED_GATE != 0,
                    biases: moe_flags & MOE_BIASES != 0,
                    groups: None,
                    choice_bias: false,
                    weights_scale: None,
                    first_dense: 0,
                })
            }
        };
        let freq_factors = if flags & FLAG_FREQ_FACTORS != 0 {
            let i = *self.index.get(FREQ_FACTORS).ok_or_else(|| bad("flags", off::FLAGS, format!("say RoPE frequency factors, but there is no tensor `{FREQ_FACTORS}`")))?;
            let t = &self.tensors[i];
            if t.ty != GgmlType::F32 || t.dims.len() != 1 {
                return Err(self.err(&format!("tensor `{FREQ_FACTORS}`"), t.offset, format!("is {} {:?}, expected one row of f32", t.ty.name(), t.dims)));
            }
            let bytes = self.checked_bytes(i)?;
            Some(bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect())
        } else {
            None
        };
        let mut spec = ModelSpec {
            arch,
            n_vocab: u(off::N_VOCAB),
            n_embd: u(off::N_EMBD),
            n_layer: u(off::N_LAYER),
            n_head: u(off::N_HEAD),
            n_head_kv: u(off::N_HEAD_KV),
            head_dim: u(off::HEAD_DIM),
            n_ff: u(off::N_FF),
            norm_eps: f64_at(h, off::NORM_EPS),
            rope: RopeSpec { style, theta: f64_at(h, off::ROPE_THETA), n_rot: u(off::N_ROT), scaling, freq_factors, longrope_factors: None },
            qk_norm: flags & FLAG_QK_NORM != 0,
            qkv_bias: flags & FLAG_QKV_BIAS != 0,
            out_bias: flags & FLAG_OUT_BIAS != 0,
            tied_output: flags & FLAG_TIED_OUTPUT != 0,
            activation,
            moe,
            sliding_window: Some(u(off::SLIDING_WINDOW)).filter(|&n| n > 0),
            swa_period: u(off::SWA_PERIOD),
            rope_swa: None,
            embd_scale: Some(f64_at(h, off::EMBD_SCALE)).filter(|v| *v != 0.0),
            attn_softcap: Some(f64_at(h, off::ATTN_SOFTCAP)).filter(|v| *v != 0.0),
            final_softcap: Some(f64_at(h, off::FINAL_SOFTCAP)).filter(|v| *v != 0.0),
            post_norms: flags & FLAG_POST_NORMS != 0,
            attn_sinks: flags & FLAG_ATTN_SINKS != 0,
            fused: false,
            context_length: u(off::CONTEXT_LENGTH),
            attn_scale: f64_at(h, off::ATTN_SCALE),
            residual_scale: None,
            logit_scale: None,
            no_rope: false,
            attn_gate: false,
            ssm: None,
            mla: None,
            layers: Vec::new(),
        };
        let theta_swa = f64_at(h, off::ROPE_THETA_SWA);
        if theta_swa != 0.0 {
            // The windowed layers' RoPE: the same rotation, its own base, unscaled (Gemma 3's local layers).
            spec.rope_swa = Some(spec.rope.with_base(theta_swa));
        }
        // The table holds exactly the weights this spec reads (and the factors it declared). Every
        // layer has several tensors, so a layer count beyond the table's length is refused before
        // the layers are described or their names listed (a hostile count would size both).
        if spec.n_layer > self.tensors.len() {
            return Err(bad(
                "n_layer",
                off::N_LAYER,
                format!(
                    "{} layers, but the table holds {} tensors",
                    spec.n_layer,
                    self.tensors.len()
                ),
            ));
        }
        spec.derive_layers(None)
            .map_err(|e| OracleError::Spec(format!("{}: {e}", self.path)))?;
        spec.set_context(crate::spec::configured_context()?)
            .map_err(|e| OracleError::Spec(format!("{}: {e}", self.path)))?;
        spec.validate()
            .map_err(|e| OracleError::Spec(format!("{}: {e}", self.path)))?;
        if !(spec.attn_scale.is_finite() && spec.attn_scale > 0.0) {
            return Err(bad(
                "attn_scale",
                off::ATTN_SCALE,
                format!("{} is not a finite positive number", spec.attn_scale),
            ));
        }
        let names = spec.tensor_names();
        if let Some(missing) = names.iter().find(|n| !self.index.contains_key(n.as_str())) {
            return Err(bad("n_tensors", off::N_TENSORS, format!("the table has no tensor `{missing}`, which a {} model with this header reads", spec.arch)));
        }
        let mut expected: std::collections::HashSet<&str> = names.iter().map(String::as_str).collect();
        if flags & FLAG_FREQ_FACTORS != 0 {
            expected.insert(FREQ_FACTORS);
        }
        if let Some(t) = self.tensors.iter().find(|t| !expected.contains(t.name.as_str())) {
            return Err(bad("n_tensors", off::N_TENSORS, format!("tensor `{}` would not be read by a {} model with this header; a file whose weights would be ignored is refused", t.name, spec.arch)));
        }
        let te = &self.tensors[self.index["token_embd.weight"]];
        if te.dims != [spec.n_embd as u64, spec.n_vocab as u64] {
            return Err(self.err("tensor `token_embd.weight`.dims", te.offset, format!("{:?}, but the header says n_embd {} and n_vocab {}", te.dims, spec.n_embd, spec.n_vocab)));
        }
        Ok(spec)
    }

    /// Tensor `i`'s bytes, its checksum verified on first use.
    fn checked_bytes(&self, i: usize) -> Result<&[u8]> {
        let t = &self.tensors[i];
        let bytes = &self.bytes.as_slice()[t.offset as usize..(t.offset + t.n_bytes) as usize];
        if !self.verified[i].load(Ordering::Relaxed) {
            let sum = fnv1a64(bytes);
            if sum != t.checksum {
                return Err(self.err(&format!("tensor `{}`", t.name), t.offset, format!("its {} bytes hash to {sum:#018x}, the table says {:#018x}: the file is corrupt", t.n_bytes, t.checksum)));
            }
            self.verified[i].store(true, Ordering::Relaxed);
        }
        Ok(bytes)
    }
}

impl TensorSource for FlatFile {
    fn load(&self, name: &str) -> Result<Option<LoadedTensor>> {
        self.raw(name)?.map(|t| t.decode()).transpose()
    }

    fn label(&self) -> String {
        self.path.clone()
    }

    fn n_elements(&self) -> Result<u64> {
        Ok(self.tensors.iter().fold(0u64, |n, t| n.saturating_add(t.dims.iter().product())))
    }

    fn n_bytes(&self) -> Result<u64> {
        Ok(self.tensors.iter().fold(0u64, |n, t| n.saturating_add(t.n_bytes)))
    }

    fn raw(&self, name: &str) -> Result<Option<RawTensor<'_>>> {
        let Some(&i) = self.index.get(name) else { return Ok(None) };
        let t = &self.tensors[i];
        let bytes = crate::quant::finite_weight(&self.path, name, t.ty, self.checked_bytes(i)?, t.dims[0] as usize)?;
        Ok(Some(RawTensor { dims: t.dims.iter().map(|&d| d as usize).collect(), ty: t.ty, bytes: Cow::Borrowed(bytes) }))
    }
}

/// What `export` writes a tensor as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Every tensor as the source stores it.
    Keep,
    /// Matrices as this type (decoded and re-encoded with the reference encoders); vectors (norm
    /// weights, biases), MoE routers and matrices whose rows are not whole blocks of it as F32,
    /// as llama.cpp's quantizer does.
    To(GgmlType),
}

/// One tensor `export` wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct Exported {
    pub name: String,
    pub from: GgmlType,
    pub to: GgmlType,
    pub dims: Vec<u64>,
    pub n_bytes: u64,
}

/// The type a tensor is written as.
fn target_type(target: Target, name: &str, from: GgmlType, dims: &[usize]) -> GgmlType {
    match target {
        Target::Keep => from,
        Target::To(ty) => {
            let router = name.contains("ffn_gate_inp");
            if dims.len() >= 2 && !router && dims[0].is_multiple_of(ty.block_size()) {
                ty
            } else {
                GgmlType::F32
            }
        }
    }
}

fn header_bytes(spec: &ModelSpec, path: &Path) -> Result<[u8; HEADER_SIZE]> {
    let mut h = [0u8; HEADER_SIZE];
    let unfit = |what: &str| OracleError::Spec(format!("{}: {what} does not fit the flat format", path.display()));
    let put32 = |h: &mut [u8; HEADER_SIZE], o: usize, v: usize, what: &str| -> Result<()> {
        h[o..o + 4].copy_from_slice(&u32::try_from(v).map_err(|_| unfit(what))?.to_le_bytes());
        Ok(())
    };
    h[..8].copy_from_slice(&MAGIC);
    if !spec.layers_follow_scalars() {
        return Err(unfit("per-layer head counts or window pattern (the header holds one head count pair and a window period)"));
    }
    if spec.ssm.is_some() {
        return Err(unfit("a state-space (Mamba-2) layer"));
    }
    if spec.mla.is_some() {
        return Err(unfit("a latent-attention (DeepSeek MLA) layer"));
    }
    if spec.residual_scale.is_some() || spec.logit_scale.is_some() || spec.no_rope || spec.attn_gate {
        return Err(unfit("Granite's residual or logit scale, attention without RoPE, or an attention output gate"));
    }
    let arch = spec.arch.gguf_name();
    if arch.len() > 15 {
        return Err(unfit(&format!("architecture name `{arch}` (15 bytes at most)")));
    }
    h[off::ARCH..off::ARCH + arch.len()].copy_from_slice(arch.as_bytes());
    if let Some(r) = &spec.rope_swa {
        if r.scaling != RopeScaling::None || r.freq_factors.is_some() || r.style != spec.rope.style || r.n_rot != spec.rope.n_rot {
            return Err(unfit("a windowed layers' RoPE other than the global one with its own base"));
        }
    }
    for (o, v, what) in [
        (off::VERSION, VERSION as usize, "version"),
        (off::HEADER_SIZE, HEADER_SIZE, "header size"),
        (off::ENTRY_SIZE, ENTRY_SIZE, "entry size"),
        (off::N_VOCAB, spec.n_vocab, "n_vocab"),
        (off::N_EMBD, spec.n_embd, "n_embd"),
        (off::N_LAYER, spec.n_layer, "n_layer"),
        (off::N_HEAD, spec.n_head, "n_head"),
        (off::N_HEAD_KV, spec.n_head_kv, "n_head_kv"),
        (off::HEAD_DIM, spec.head_dim, "head_dim"),
        (off::N_FF, spec.n_ff, "n_ff"),
        (off::CONTEXT_LENGTH, spec.context_length, "context length"),
        (off::N_ROT, spec.rope.n_rot, "n_rot"),
        (off::ROPE_STYLE, (spec.rope.style == RopeStyle::Neox) as usize, "rope style"),
        (
            off::ACTIVATION,
            match spec.activation {
                Activation::Silu => 0,
                Activation::GeluTanh => 1,
                Activation::SwigluOai => 2,
            },
            "activation",
        ),
        (off::SLIDING_WINDOW, spec.sliding_window.unwrap_or(0), "sliding window"),
        (off::SWA_PERIOD, spec.swa_period, "sliding-window period"),
    ] {
        put32(&mut h, o, v, what)?;
    }
    let flags = [
        (spec.qk_norm, FLAG_QK_NORM),
        (spec.qkv_bias, FLAG_QKV_BIAS),
        (spec.out_bias, FLAG_OUT_BIAS),
        (spec.tied_output, FLAG_TIED_OUTPUT),
        (spec.rope.freq_factors.is_some(), FLAG_FREQ_FACTORS),
        (spec.post_norms, FLAG_POST_NORMS),
        (spec.attn_sinks, FLAG_ATTN_SINKS),
        (matches!(spec.rope.scaling, RopeScaling::Yarn { truncate: false, .. }), FLAG_YARN_UNTRUNCATED),
    ]
    .iter()
    .filter(|(on, _)| *on)
    .fold(0u32, |f, (_, bit)| f | bit);
    h[off::FLAGS..off::FLAGS + 4].copy_from_slice(&flags.to_le_bytes());
    if let Some(m) = &spec.moe {
        put32(&mut h, off::N_EXPERT, m.n_expert, "n_expert")?;
        put32(&mut h, off::N_EXPERT_USED, m.n_expert_used, "n_expert_used")?;
        put32(&mut h, off::EXPERT_FFN, m.expert_ffn, "expert_ffn")?;
        put32(&mut h, off::MOE_GATING, (m.gating == Gating::Sigmoid) as usize, "gating")?;
        put32(&mut h, off::MOE_FLAGS, (m.normalize_topk as usize) | ((m.shared_gate as usize) << 1) | ((m.biases as usize) << 2), "moe flags")?;
        put32(&mut h, off::SHARED_FFN, m.shared_ffn.unwrap_or(0), "shared_ffn")?;
    }
    let f64s = |h: &mut [u8; HEADER_SIZE], o: usize, v: f64| h[o..o + 8].copy_from_slice(&v.to_le_bytes());
    let u64s = |h: &mut [u8; HEADER_SIZE], o: usize, v: u64| h[o..o + 8].copy_from_slice(&v.to_le_bytes());
    f64s(&mut h, off::NORM_EPS, spec.norm_eps);
    f64s(&mut h, off::ROPE_THETA, spec.rope.theta);
    f64s(&mut h, off::ATTN_SCALE, spec.attn_scale);
    f64s(&mut h, off::ROPE_THETA_SWA, spec.rope_swa.as_ref().map_or(0.0, |r| r.theta));
    f64s(&mut h, off::EMBD_SCALE, spec.embd_scale.unwrap_or(0.0));
    f64s(&mut h, off::ATTN_SOFTCAP, spec.attn_softcap.unwrap_or(0.0));
    f64s(&mut h, off::FINAL_SOFTCAP, spec.final_softcap.unwrap_or(0.0));
    let code = match spec.rope.scaling {
        RopeScaling::None => 0,
        RopeScaling::Linear { factor } => {
            f64s(&mut h, off::ROPE_FACTOR, factor);
            1
        }
        RopeScaling::Yarn { factor, original_context, beta_fast, beta_slow, ext_factor, attn_factor, .. } => {
            f64s(&mut h, off::ROPE_FACTOR, factor);
            f64s(&mut h, off::YARN_BETA_FAST, beta_fast);
            f64s(&mut h, off::YARN_BETA_SLOW, beta_slow);
            f64s(&mut h, off::YARN_EXT_FACTOR, ext_factor);
            f64s(&mut h, off::ROPE_ATTN_FACTOR, attn_factor);
            u64s(&mut h, off::ROPE_ORIGINAL_CONTEXT, original_context as u64);
            2
        }
        RopeScaling::LongRope { attn_factor, original_context, context } => {
            f64s(&mut h, off::ROPE_ATTN_FACTOR, attn_factor);
            u64s(&mut h, off::ROPE_ORIGINAL_CONTEXT, original_context as u64);
            u64s(&mut h, off::ROPE_CONTEXT, context as u64);
            3
        }
    };
    h[off::ROPE_SCALING..off::ROPE_SCALING + 4].copy_from_slice(&(code as u32).to_le_bytes());
    Ok(h)
}

fn entry_bytes(t: &FlatTensor) -> [u8; ENTRY_SIZE] {
    let mut e = [0u8; ENTRY_SIZE];
    e[..t.name.len()].copy_from_slice(t.name.as_bytes());
    e[64..68].copy_from_slice(&t.ty.id().to_le_bytes());
    e[68..72].copy_from_slice(&(t.dims.len() as u32).to_le_bytes());
    for d in 0..4 {
        e[72 + 8 * d..80 + 8 * d].copy_from_slice(&t.dims.get(d).copied().unwrap_or(1).to_le_bytes());
    }
    e[104..112].copy_from_slice(&t.offset.to_le_bytes());
    e[112..120].copy_from_slice(&t.n_bytes.to_le_bytes());
    e[120..128].copy_from_slice(&t.checksum.to_le_bytes());
    e
}

/// Writes the model (`spec` and the weights of `source`, as the loaders hand them out: fused
/// tensors split) as a flat file at `path`, each tensor as `target` says. The file is written
/// beside `path` and renamed into place when whole; it is then read back, and its spec must equal
/// the source's (a field the format cannot carry is an error, never dropped). `progress` is told
/// (tensors done, tensors in all, name) as it goes.
pub fn export(path: &Path, spec: &ModelSpec, source: &dyn TensorSource, target: Target, progress: &mut dyn FnMut(usize, usize, &str)) -> Result<Vec<Exported>> {
    let header = header_bytes(spec, path)?;
    let mut names = spec.tensor_names();
    if spec.rope.freq_factors.is_some() {
        names.insert(1, FREQ_FACTORS.to_string());
    }
    if let Some(long) = names.iter().find(|n| n.len() >= NAME_LEN) {
        return Err(OracleError::Spec(format!("{}: tensor name `{long}` is longer than {} bytes", path.display(), NAME_LEN - 1)));
    }
    let table_end = (HEADER_SIZE + names.len() * ENTRY_SIZE) as u64;
    let data_offset = table_end.div_ceil(ALIGN) * ALIGN;
    let part = path.with_file_name(format!("{}.part", path.file_name().and_then(|n| n.to_str()).unwrap_or("model.flat")));
    let io = |e: std::io::Error| OracleError::io(&part, e);
    let result = (|| -> Result<Vec<Exported>> {
        let mut file = std::io::BufWriter::new(std::fs::File::create(&part).map_err(io)?);
        file.write_all(&vec![0u8; data_offset as usize]).map_err(io)?;
        let (mut pos, mut table, mut exported) = (data_offset, Vec::with_capacity(names.len()), Vec::with_capacity(names.len()));
        for (k, name) in names.iter().enumerate() {
            progress(k, names.len(), name);
            let padded = pos.div_ceil(ALIGN) * ALIGN;
            file.write_all(&vec![0u8; (padded - pos) as usize]).map_err(io)?;
            // Written as it is hashed; a converted tensor a few rows at a time, so no more than
            // about 4 MiB of it is held decoded.
            let (mut sum, mut n_bytes) = (FNV_OFFSET, 0u64);
            let mut emit = |chunk: &[u8]| -> Result<()> {
                file.write_all(chunk).map_err(io)?;
                sum = fnv1a64_from(sum, chunk);
                n_bytes += chunk.len() as u64;
                Ok(())
            };
            let (from, to, dims) = if name == FREQ_FACTORS {
                let f = spec.rope.freq_factors.as_deref().unwrap_or_default();
                emit(&f.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
                (GgmlType::F32, GgmlType::F32, vec![f.len()])
            } else {
                let raw = source.raw(name)?.ok_or_else(|| OracleError::Spec(format!("{}: missing tensor `{name}`", source.label())))?;
                let to = target_type(target, name, raw.ty, &raw.dims);
                if to == raw.ty {
                    emit(&raw.bytes)?;
                } else {
                    let row = raw.dims[0].max(1);
                    let row_bytes = raw.ty.bytes_for(row as u64).filter(|&b| b > 0).ok_or_else(|| OracleError::Spec(format!("{}: tensor `{name}` rows of {row} are not whole {} blocks", source.label(), raw.ty.name())))? as usize;
                    let rows = ((1 << 20) / row).max(1);
                    for chunk in raw.bytes.chunks(row_bytes * rows) {
                        let values = crate::quant::decode(raw.ty, chunk, chunk.len() / row_bytes * row)?;
                        emit(&crate::quant::encode(to, &values)?)?;
                    }
                }
                (raw.ty, to, raw.dims)
            };
            let t = FlatTensor { name: name.clone(), ty: to, dims: dims.iter().map(|&d| d as u64).collect(), offset: padded, n_bytes, checksum: sum };
            pos = padded + n_bytes;
            exported.push(Exported { name: name.clone(), from, to, dims: t.dims.clone(), n_bytes: t.n_bytes });
            table.push(t);
        }
        progress(names.len(), names.len(), "");
        let mut header = header;
        header[off::FILE_SIZE..off::FILE_SIZE + 8].copy_from_slice(&pos.to_le_bytes());
        header[off::TABLE_OFFSET..off::TABLE_OFFSET + 8].copy_from_slice(&(HEADER_SIZE as u64).to_le_bytes());
        header[off::N_TENSORS..off::N_TENSORS + 4].copy_from_slice(&(table.len() as u32).to_le_bytes());
        header[off::DATA_OFFSET..off::DATA_OFFSET + 8].copy_from_slice(&data_offset.to_le_bytes());
        let entries: Vec<u8> = table.iter().flat_map(entry_bytes).collect();
        let sum = fnv1a64_from(fnv1a64(&header[..off::META_CHECKSUM]), &entries);
        header[off::META_CHECKSUM..].copy_from_slice(&sum.to_le_bytes());
        let mut file = file.into_inner().map_err(|e| io(e.into_error()))?;
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(&header).map_err(io)?;
        file.write_all(&entries).map_err(io)?;
        file.sync_all().map_err(io)?;
        let (_, back) = FlatFile::open(&part)?;
        let mut want = spec.clone();
        want.fused = false;
        // LongRoPE: the factors of the configured context only.
        want.rope.longrope_factors = None;
        if back != want {
            return Err(OracleError::Spec(format!("{}: the model's spec does not survive the flat format (read back: {back:?}; source: {want:?})", path.display())));
        }
        Ok(exported)
    })();
    match result {
        Ok(exported) => {
            std::fs::rename(&part, path).map_err(|e| OracleError::io(path, e))?;
            Ok(exported)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&part);
            Err(e)
        }
    }
}
