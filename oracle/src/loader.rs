//! Model files -> (ModelSpec, named f32 tensors). GGUF files are read by our own reader;
//! safetensors directories (`config.json` + `*.safetensors`) by the `safetensors` crate, with
//! Hugging Face tensor names mapped to the GGUF names the interpreter uses.

use crate::error::{OracleError, Result};
use crate::gguf::GgufFile;
use crate::spec::ModelSpec;
use crate::tokenizer::Tokenizer;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A decoded tensor: GGML dims (`dims[0]` = row length) and f32 values.
pub struct LoadedTensor {
    pub dims: Vec<usize>,
    pub data: Vec<f32>,
}

/// Where weights come from.
pub trait TensorSource: Sync {
    /// Decodes tensor `name` (a GGUF name such as `blk.0.attn_q.weight`), or None if absent.
    fn load(&self, name: &str) -> Result<Option<LoadedTensor>>;
    /// A short label for error messages.
    fn label(&self) -> String;
}

impl TensorSource for GgufFile {
    fn load(&self, name: &str) -> Result<Option<LoadedTensor>> {
        let Some(info) = self.tensor(name) else { return Ok(None) };
        let data = self.tensor_f32(info).map_err(|e| OracleError::Gguf {
            file: self.path.clone(),
            field: format!("tensor `{name}`"),
            offset: info.file_offset,
            reason: e.to_string(),
        })?;
        Ok(Some(LoadedTensor {
            dims: info.dims.iter().map(|&d| d as usize).collect(),
            data,
        }))
    }

    fn label(&self) -> String {
        self.path.clone()
    }
}

/// A safetensors model directory.
pub struct SafetensorsDir {
    pub dir: PathBuf,
    maps: Vec<(PathBuf, memmap2::Mmap)>,
    /// GGUF name -> (file index, HF name)
    index: HashMap<String, (usize, String)>,
}

/// Maps a Hugging Face tensor name to its GGUF name.
pub fn hf_to_gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let mapped = match tail {
        "input_layernorm.weight" => "attn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{mapped}"))
}

impl SafetensorsDir {
    pub fn open(dir: &Path) -> Result<(SafetensorsDir, ModelSpec)> {
        let cfg_path = dir.join("config.json");
        if !cfg_path.is_file() {
            return Err(OracleError::Safetensors {
                file: dir.display().to_string(),
                reason: "a directory is read as a safetensors model, which needs config.json and *.safetensors files; this one has no config.json".into(),
            });
        }
        let cfg_text = std::fs::read_to_string(&cfg_path).map_err(|e| OracleError::io(&cfg_path, e))?;
        let cfg: serde_json::Value = serde_json::from_str(&cfg_text).map_err(|e| OracleError::Safetensors {
            file: cfg_path.display().to_string(),
            reason: format!("not valid JSON: {e}"),
        })?;
        let spec = ModelSpec::from_hf_config(&cfg, &cfg_path.display().to_string())?;
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| OracleError::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(OracleError::Safetensors { file: dir.display().to_string(), reason: "no *.safetensors files".into() });
        }
        let mut maps = Vec::new();
        let mut index = HashMap::new();
        for (fi, path) in files.into_iter().enumerate() {
            let f = std::fs::File::open(&path).map_err(|e| OracleError::io(&path, e))?;
            // SAFETY: read-only map of a file we do not modify.
            let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| OracleError::io(&path, e))?;
            let st = safetensors::SafeTensors::deserialize(&map).map_err(|e| OracleError::Safetensors {
                file: path.display().to_string(),
                reason: e.to_string(),
            })?;
            for name in st.names() {
                if let Some(g) = hf_to_gguf_name(name) {
                    index.insert(g, (fi, name.to_string()));
                }
            }
            maps.push((path, map));
        }
        Ok((SafetensorsDir { dir: dir.to_path_buf(), maps, index }, spec))
    }
}

impl TensorSource for SafetensorsDir {
    fn load(&self, name: &str) -> Result<Option<LoadedTensor>> {
        let Some((fi, hf)) = self.index.get(name) else { return Ok(None) };
        let (path, map) = &self.maps[*fi];
        let err = |reason: String| OracleError::Safetensors { file: path.display().to_string(), reason };
        let st = safetensors::SafeTensors::deserialize(map).map_err(|e| err(e.to_string()))?;
        let view = st.tensor(hf).map_err(|e| err(e.to_string()))?;
        let bytes = view.data();
        let data: Vec<f32> = match view.dtype() {
            safetensors::Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            safetensors::Dtype::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            safetensors::Dtype::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            other => return Err(err(format!("tensor `{hf}` has dtype {other:?}; f32, f16 and bf16 are read"))),
        };
        // Torch order [out, in] -> GGML order [in, out].
        let dims: Vec<usize> = view.shape().iter().rev().copied().collect();
        Ok(Some(LoadedTensor { dims, data }))
    }

    fn label(&self) -> String {
        self.dir.display().to_string()
    }
}

/// The tokenizer a GGUF file carries in its metadata, if any.
fn gguf_tokenizer(g: &GgufFile) -> Result<Option<Tokenizer>> {
    match g.get("tokenizer.ggml.model") {
        Some(_) => Ok(Some(Tokenizer::from_gguf(g)?)),
        None => Ok(None),
    }
}

/// The `tokenizer.json` beside a safetensors model, if any.
fn dir_tokenizer(dir: &Path) -> Result<Option<Tokenizer>> {
    let tj = dir.join("tokenizer.json");
    if tj.exists() {
        Ok(Some(Tokenizer::from_file(&tj)?))
    } else {
        Ok(None)
    }
}

/// Opens a model: a `.gguf` file or a safetensors directory, with its tokenizer when it has one.
pub fn open_model(path: &Path) -> Result<(Box<dyn TensorSource>, ModelSpec, Option<Tokenizer>)> {
    if path.is_dir() {
        let (dir, spec) = SafetensorsDir::open(path)?;
        Ok((Box::new(dir), spec, dir_tokenizer(path)?))
    } else {
        let g = GgufFile::open(path)?;
        let spec = ModelSpec::from_gguf(&g)?;
        let tokenizer = gguf_tokenizer(&g)?;
        Ok((Box::new(g), spec, tokenizer))
    }
}

/// Only the tokenizer of a model (for device runs, which load their own weights).
pub fn open_tokenizer(path: &Path) -> Result<Option<Tokenizer>> {
    if path.is_dir() {
        dir_tokenizer(path)
    } else {
        gguf_tokenizer(&GgufFile::open(path)?)
    }
}
