//! The tensor-dump format (docs/DUMP_FORMAT.md): a directory with `manifest.json` and
//! safetensors files holding every tap and the logits of every position. The oracle writes it
//! (`cargo xtask dump`); external engines write it for Touchstone to read.
//!
//! Writes are deterministic: no timestamps, tensors in name order, fixed JSON key order, so two
//! dumps of the same run are byte-identical.

use crate::error::{OracleError, Result};
use crate::model::RecordingTap;
use serde::{Deserialize, Serialize};
use std::path::Path;

pub const FORMAT_NAME: &str = "touchstone-dump";
pub const FORMAT_VERSION: u32 = 1;
pub const TAPS_FILE: &str = "taps.safetensors";
pub const LOGITS_FILE: &str = "logits.safetensors";
pub const LOGITS_TENSOR: &str = "logits";

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TapEntry {
    pub name: String,
    /// `[n_positions, width]`.
    pub shape: Vec<usize>,
    pub dtype: String,
    pub file: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ModelInfo {
    pub name: String,
    pub sha256: String,
    pub arch: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub model: ModelInfo,
    pub device: String,
    pub precision: String,
    pub token_ids: Vec<u32>,
    /// Position of each token id (0-based).
    pub positions: Vec<usize>,
    /// Taps in execution order (empty in token-only mode).
    #[serde(default)]
    pub taps: Vec<TapEntry>,
    /// Logits of every position, `[n_positions, n_vocab]` (absent in token-only mode).
    #[serde(default)]
    pub logits: Option<TapEntry>,
    /// Token-only mode: ids the engine generated greedily after `token_ids`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generated_ids: Option<Vec<u32>>,
    /// The engine's declared arithmetic (devices::Arithmetic as JSON), which the layer-diff and
    /// fixed-token budgets consume; absent means f32 storage and f32 accumulation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arithmetic: Option<serde_json::Value>,
}

fn to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<u8>)]) -> Result<()> {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, shape, b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| OracleError::Safetensors { file: path.display().to_string(), reason: e.to_string() })
        })
        .collect::<Result<_>>()?;
    let tmp = path.with_extension("tmp");
    safetensors::serialize_to_file(views, None, &tmp)
        .map_err(|e| OracleError::Safetensors { file: path.display().to_string(), reason: e.to_string() })?;
    std::fs::rename(&tmp, path).map_err(|e| OracleError::io(path, e))
}

/// Writes a dump of `taps` (which must include `result_output`, the logits) into `dir`.
pub fn write_dump(dir: &Path, model: ModelInfo, device: &str, precision: &str, token_ids: &[u32], taps: &RecordingTap, arithmetic: Option<serde_json::Value>) -> Result<Manifest> {
    std::fs::create_dir_all(dir).map_err(|e| OracleError::io(dir, e))?;
    let n = token_ids.len();
    let mut entries = Vec::new();
    let mut tensors = Vec::new();
    for name in &taps.order {
        let (width, data) = &taps.tensors[name];
        if name == "result_output" {
            continue;
        }
        let rows = data.len() / width;
        entries.push(TapEntry { name: name.clone(), shape: vec![rows, *width], dtype: "f32".into(), file: TAPS_FILE.into() });
        tensors.push((name.clone(), vec![rows, *width], to_bytes(data)));
    }
    write_safetensors(&dir.join(TAPS_FILE), &tensors)?;
    let logits = match taps.tensors.get("result_output") {
        Some((width, data)) => {
            let rows = data.len() / width;
            write_safetensors(&dir.join(LOGITS_FILE), &[(LOGITS_TENSOR.into(), vec![rows, *width], to_bytes(data))])?;
            Some(TapEntry { name: LOGITS_TENSOR.into(), shape: vec![rows, *width], dtype: "f32".into(), file: LOGITS_FILE.into() })
        }
        None => None,
    };
    let manifest = Manifest {
        format: FORMAT_NAME.into(),
        version: FORMAT_VERSION,
        model,
        device: device.into(),
        precision: precision.into(),
        token_ids: token_ids.to_vec(),
        positions: (0..n).collect(),
        taps: entries,
        logits,
        generated_ids: None,
        arithmetic,
    };
    let json = serde_json::to_string_pretty(&manifest).expect("manifest serializes");
    let mpath = dir.join("manifest.json");
    std::fs::write(&mpath, json + "\n").map_err(|e| OracleError::io(&mpath, e))?;
    Ok(manifest)
}

/// Writes a dump from an engine written in Rust, as `touchstone_dump.py` and `touchstone_dump.h`
/// do from Python and C (examples/): the request from the environment Touchstone sets for an
/// `exec:` engine, the taps as the engine gives them, the manifest last.
///
/// ```no_run
/// # fn forward(_: &[u32]) -> (Vec<(String, usize, Vec<f32>)>, usize, Vec<f32>) { unimplemented!() }
/// let mut dump = oracle::dump::DumpWriter::from_env("my-engine", "llama")?;
/// let (taps, n_vocab, logits) = forward(dump.token_ids());
/// for (name, width, rows) in &taps {
///     dump.tap(name, *width, rows)?; // [n_positions, width], row-major
/// }
/// dump.logits(n_vocab, &logits)?;
/// dump.finish()?;
/// # Ok::<(), oracle::OracleError>(())
/// ```
pub struct DumpWriter {
    dir: std::path::PathBuf,
    model: ModelInfo,
    device: String,
    precision: String,
    token_ids: Vec<u32>,
    taps: RecordingTap,
    generated: Option<Vec<u32>>,
    arithmetic: Option<serde_json::Value>,
}

impl DumpWriter {
    /// A dump of `token_ids` into `dir` (created if missing), of the model `model` names.
    pub fn new(dir: &Path, model: ModelInfo, device: &str, token_ids: &[u32]) -> DumpWriter {
        DumpWriter { dir: dir.to_path_buf(), model, device: device.into(), precision: "f32".into(), token_ids: token_ids.to_vec(), taps: RecordingTap::default(), generated: None, arithmetic: None }
    }

    /// The request Touchstone passes an `exec:` engine: `TOUCHSTONE_OUT`, `TOUCHSTONE_MODEL`,
    /// `TOUCHSTONE_MODEL_SHA256`, `TOUCHSTONE_PROMPT_IDS` (`TOUCHSTONE_N_GENERATE` is the
    /// engine's to read: [`DumpWriter::n_generate`]).
    pub fn from_env(device: &str, arch: &str) -> Result<DumpWriter> {
        let var = |k: &str| std::env::var(k).map_err(|_| OracleError::Safetensors { file: k.into(), reason: "not set: run this engine through Touchstone (--device \"exec:CMD\")".into() });
        let model = var("TOUCHSTONE_MODEL")?;
        let name = Path::new(&model).file_name().map_or(model.clone(), |n| n.to_string_lossy().into_owned());
        let ids = var("TOUCHSTONE_PROMPT_IDS")?;
        let token_ids = ids
            .split(',')
            .filter(|t| !t.trim().is_empty())
            .map(|t| t.trim().parse::<u32>().map_err(|e| OracleError::Safetensors { file: "TOUCHSTONE_PROMPT_IDS".into(), reason: format!("`{t}`: {e}") }))
            .collect::<Result<Vec<u32>>>()?;
        let info = ModelInfo { name, sha256: var("TOUCHSTONE_MODEL_SHA256")?, arch: arch.into() };
        Ok(DumpWriter::new(Path::new(&var("TOUCHSTONE_OUT")?), info, device, &token_ids))
    }

    /// The ids of the request, one position each.
    pub fn token_ids(&self) -> &[u32] {
        &self.token_ids
    }

    /// `TOUCHSTONE_N_GENERATE`: greedy ids wanted after the request's (0: taps and logits).
    pub fn n_generate() -> usize {
        std::env::var("TOUCHSTONE_N_GENERATE").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0)
    }

    /// The declared arithmetic, as docs/DUMP_FORMAT.md gives it (absent: f32 storage and
    /// accumulation); the precision field (default `f32`).
    pub fn arithmetic(&mut self, arithmetic: serde_json::Value, precision: &str) -> &mut Self {
        self.arithmetic = Some(arithmetic);
        self.precision = precision.into();
        self
    }

    fn check_rows(&self, name: &str, width: usize, rows: &[f32]) -> Result<()> {
        let n = self.token_ids.len();
        if width == 0 || rows.len() != n * width {
            return Err(OracleError::Safetensors { file: self.dir.display().to_string(), reason: format!("{name}: {} values for {n} positions of width {width}", rows.len()) });
        }
        if self.taps.tensors.contains_key(name) {
            return Err(OracleError::Safetensors { file: self.dir.display().to_string(), reason: format!("{name} given twice") });
        }
        Ok(())
    }

    /// One tap: `[n_positions, width]` row-major, a row per position of the request.
    pub fn tap(&mut self, name: &str, width: usize, rows: &[f32]) -> Result<()> {
        if name == "result_output" {
            return self.logits(width, rows);
        }
        self.check_rows(name, width, rows)?;
        crate::model::Tap::record(&mut self.taps, name, 0, self.token_ids.len(), width, rows);
        Ok(())
    }

    /// The logits of every position: `[n_positions, n_vocab]` row-major.
    pub fn logits(&mut self, n_vocab: usize, rows: &[f32]) -> Result<()> {
        self.check_rows("result_output", n_vocab, rows)?;
        crate::model::Tap::record(&mut self.taps, "result_output", 0, self.token_ids.len(), n_vocab, rows);
        Ok(())
    }

    /// A token-only dump: the ids generated greedily after the request's.
    pub fn generated(&mut self, ids: &[u32]) {
        self.generated = Some(ids.to_vec());
    }

    /// Writes the tensors and, last, manifest.json.
    pub fn finish(self) -> Result<Manifest> {
        let Some(generated) = self.generated else {
            if !self.taps.tensors.contains_key("result_output") {
                return Err(OracleError::Safetensors { file: self.dir.display().to_string(), reason: "nothing to write: give the logits (or, asked to generate, the generated ids)".into() });
            }
            return write_dump(&self.dir, self.model, &self.device, &self.precision, &self.token_ids, &self.taps, self.arithmetic);
        };
        std::fs::create_dir_all(&self.dir).map_err(|e| OracleError::io(&self.dir, e))?;
        let n = self.token_ids.len();
        let manifest = Manifest { format: FORMAT_NAME.into(), version: FORMAT_VERSION, model: self.model, device: self.device, precision: self.precision, token_ids: self.token_ids, positions: (0..n).collect(), taps: Vec::new(), logits: None, generated_ids: Some(generated), arithmetic: self.arithmetic };
        let mpath = self.dir.join("manifest.json");
        std::fs::write(&mpath, serde_json::to_string_pretty(&manifest).expect("manifest serializes") + "\n").map_err(|e| OracleError::io(&mpath, e))?;
        Ok(manifest)
    }
}

/// The largest manifest.json read: a manifest of a million positions' ids and a thousand taps
/// is under 16 MiB; a larger file is an engine's mistake, not something to load.
pub const MANIFEST_LIMIT: u64 = 64 << 20;

/// Reads a dump's manifest, checking its format and version.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let p = dir.join("manifest.json");
    let mut f = crate::files::open_written(dir, "manifest.json")?;
    let size = f.metadata().map_err(|e| OracleError::io(&p, e))?.len();
    if size > MANIFEST_LIMIT {
        return Err(OracleError::Safetensors { file: p.display().to_string(), reason: format!("{size} bytes, more than a manifest holds (at most {} MiB)", MANIFEST_LIMIT >> 20) });
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut f, &mut text).map_err(|e| OracleError::io(&p, e))?;
    let m: Manifest = serde_json::from_str(&text).map_err(|e| OracleError::Safetensors { file: p.display().to_string(), reason: format!("invalid manifest: {e}") })?;
    if m.format != FORMAT_NAME || m.version != FORMAT_VERSION {
        return Err(OracleError::Safetensors {
            file: p.display().to_string(),
            reason: format!("format {} v{} is not {FORMAT_NAME} v{FORMAT_VERSION}", m.format, m.version),
        });
    }
    Ok(m)
}

/// One tensor of a dump file, widened to f32.
#[derive(Clone, Debug)]
pub struct DumpTensor {
    pub name: String,
    pub shape: Vec<usize>,
    /// What the file stores: `f32`, `f16` or `bf16`.
    pub dtype: &'static str,
    pub values: Vec<f32>,
}

/// Reads every tensor of `dir/file` (a plain file name inside the dump directory) as f32
/// (f16/bf16 widened), in file order.
pub fn read_tensors(dir: &Path, file: &str) -> Result<Vec<DumpTensor>> {
    read_tensors_where(dir, file, &|_| true)
}

/// The tensors of `dir/file` whose names `keep` accepts, as [`read_tensors`]. The file is
/// mapped, not read: an engine's file may hold far more than the tensors wanted (every node of
/// its graph), and only those are copied out.
pub fn read_tensors_where(dir: &Path, file: &str, keep: &dyn Fn(&str) -> bool) -> Result<Vec<DumpTensor>> {
    let p = dir.join(file);
    let err = |r: String| OracleError::Safetensors { file: p.display().to_string(), reason: r };
    if file.is_empty() || file.contains('/') || file.contains('\\') || file == ".." || file == "." {
        return Err(err("a dump's tensor file must be a plain file name inside the dump directory".into()));
    }
    let f = crate::files::open_written(dir, file)?;
    // SAFETY: read-only; a file truncated under us by another process is the one case a map
    // cannot defend against (as for the GGUF reader).
    let bytes = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| OracleError::io(&p, e))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| err(e.to_string()))?;
    let mut out = Vec::new();
    for (name, v) in st.tensors().into_iter().filter(|(n, _)| keep(n)) {
        let d = v.data();
        let (dtype, values) = match v.dtype() {
            safetensors::Dtype::F32 => ("f32", d.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
            safetensors::Dtype::F16 => ("f16", d.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()),
            safetensors::Dtype::BF16 => ("bf16", d.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()),
            other => return Err(err(format!("{name}: dtype {other:?} (f32, f16, bf16 allowed)"))),
        };
        out.push(DumpTensor { name, shape: v.shape().to_vec(), dtype, values });
    }
    Ok(out)
}

/// Reads tensor `name` from `dir/file`: (shape, values).
pub fn read_tensor(dir: &Path, file: &str, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
    // The predicate keeps this one name: the first tensor read, if any, is it.
    read_tensors_where(dir, file, &|n| n == name)?
        .into_iter()
        .next()
        .map(|t| (t.shape, t.values))
        .ok_or_else(|| OracleError::Safetensors { file: dir.join(file).display().to_string(), reason: format!("no tensor `{name}`") })
}

/// llama.cpp eval-callback names (`attn_norm-3`, `l_out-3`, `result_output`, ...) -> ours
/// (`blk.3.attn_norm`, ...); our own names pass through. docs/DUMP_FORMAT.md has the table.
pub fn canonical_tap_name(name: &str) -> String {
    if let Some((base, layer)) = name.rsplit_once('-') {
        if let Ok(i) = layer.parse::<usize>() {
            let ours = match base {
                "attn_norm" => Some("attn_norm"),
                "Qcur" => Some("attn_q"),
                "Kcur" => Some("attn_k"),
                "Vcur" => Some("attn_v"),
                "Qcur_normed" => Some("attn_q_norm"),
                "Kcur_normed" => Some("attn_k_norm"),
                "Qcur_rope" => Some("attn_q_rope"),
                "Kcur_rope" => Some("attn_k_rope"),
                "kqv_out" => Some("attn_kqv"),
                "attn_out" => Some("attn_out"),
                "ffn_inp" => Some("ffn_inp"),
                "ffn_norm" => Some("ffn_norm"),
                "ffn_gate" => Some("ffn_gate"),
                "ffn_up" => Some("ffn_up"),
                "ffn_swiglu" | "ffn_geglu" => Some("ffn_act"),
                "ffn_out" => Some("ffn_out"),
                "ffn_moe_probs" => Some("ffn_moe_probs"),
                "ffn_moe_topk" => Some("ffn_moe_topk"),
                "l_out" => Some("l_out"),
                _ => None,
            };
            if let Some(o) = ours {
                return format!("blk.{i}.{o}");
            }
        }
    }
    name.to_string()
}
