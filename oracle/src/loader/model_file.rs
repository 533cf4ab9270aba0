//! A model as the user names it, opened once: a `.gguf` file (parsed once, its metadata giving
//! the spec, the tokenizer and the chat template), a flat model file (`export`), or a safetensors
//! directory (`config.json`, `*.safetensors`, `tokenizer.json`, `tokenizer_config.json`).
//! Everything a command needs of a model (weights, spec, tokenizer, chat template) comes from one
//! [`ModelFile`]; the free functions are shorthands for a command that needs one thing only.

use super::{unfused, SafetensorsDir};
use crate::error::{OracleError, Result};
use crate::gguf::GgufFile;
use crate::spec::ModelSpec;
use crate::tensor::TensorSource;
use crate::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

/// Why a flat model file has no tokenizer.
const FLAT_NO_TOKENIZER: &str = "a flat model file carries no tokenizer (`cargo xtask tokenize` on the model it was exported from gives the ids)";

/// One model, opened once. A GGUF file is mapped and its header parsed here; a flat file and a
/// checkpoint's weights are opened when the weights are taken ([`ModelFile::into_model`],
/// [`ModelFile::into_weights`]), so a checkpoint directory without `config.json` still gives its
/// tokenizer and chat template.
pub struct ModelFile {
    path: PathBuf,
    kind: Kind,
}

enum Kind {
    Gguf(GgufFile),
    Flat,
    Dir,
}

impl ModelFile {
    /// Opens `path`: a flat model file (by its magic), a directory (a checkpoint), else a GGUF file.
    pub fn open(path: &Path) -> Result<ModelFile> {
        let kind = if crate::flat::is_flat(path) {
            Kind::Flat
        } else if path.is_dir() {
            Kind::Dir
        } else {
            Kind::Gguf(GgufFile::open(path)?)
        };
        Ok(ModelFile { path: path.to_path_buf(), kind })
    }

    /// The tokenizer the model carries, if this tool builds it. A GGUF tokenizer of a kind or a
    /// pre-tokenizer this reader does not build (`tokenizer::gguf_gap` says which) is no
    /// tokenizer: the model still runs on token ids, and a command given text says why it needs
    /// ids ([`ModelFile::tokenizer_gap`]). A malformed tokenizer of a built kind, or a model name
    /// that is not a string, is an error.
    pub fn tokenizer(&self) -> Result<Option<Tokenizer>> {
        match &self.kind {
            Kind::Flat => Ok(None),
            Kind::Dir => dir_tokenizer(&self.path),
            Kind::Gguf(g) => gguf_tokenizer(g),
        }
    }

    /// Why the model has no tokenizer this tool builds (for a command given text), or None when it has one.
    pub fn tokenizer_gap(&self) -> Result<Option<String>> {
        match &self.kind {
            Kind::Flat => Ok(Some(FLAT_NO_TOKENIZER.to_string())),
            Kind::Dir => Ok((!self.path.join("tokenizer.json").exists()).then(|| "its directory has no tokenizer.json".to_string())),
            Kind::Gguf(g) => crate::tokenizer::gguf_gap(g),
        }
    }

    /// The model's chat template (Jinja source), if it has one: a GGUF's
    /// `tokenizer.chat_template`; a checkpoint's `chat_template.jinja`, else
    /// `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates, of
    /// which `default`).
    pub fn chat_template(&self) -> Result<Option<String>> {
        let dir = match &self.kind {
            Kind::Flat => return Ok(None),
            Kind::Gguf(g) => {
                return Ok(g.field("tokenizer.chat_template", |v| v.as_str(), "a string").map_err(|e| OracleError::Tokenizer(e.to_string()))?.map(str::to_string))
            }
            Kind::Dir => &self.path,
        };
        let tok_err = |file: &Path, why: String| OracleError::Tokenizer(format!("{}: {why}", file.display()));
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            return crate::files::read_to_string(&jinja).map(Some);
        }
        let cfg = dir.join("tokenizer_config.json");
        if !cfg.is_file() {
            return Ok(None);
        }
        let text = crate::files::read_to_string(&cfg)?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| tok_err(&cfg, format!("not valid JSON: {e}")))?;
        match v.get("chat_template") {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(t)) => Ok(Some(t.clone())),
            Some(serde_json::Value::Array(named)) => Ok(named
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template").and_then(|t| t.as_str()))
                .map(str::to_string)),
            Some(other) => Err(tok_err(&cfg, format!("`chat_template` is {other}, expected a string or a list of named templates"))),
        }
    }

    /// The weights and the spec, with the tokenizer. A checkpoint's tokenizer may hold fewer
    /// tokens than its embedding has rows (checkpoints pad the embedding for alignment: Qwen2's
    /// config `vocab_size` 151,936 over 151,665 tokens), never more (ids past the rows).
    pub fn into_model(self) -> Result<(Box<dyn TensorSource>, ModelSpec, Option<Tokenizer>)> {
        match self.kind {
            Kind::Flat => {
                let (flat, spec) = crate::flat::FlatFile::open(&self.path)?;
                Ok((Box::new(flat), spec, None))
            }
            Kind::Dir => {
                let (dir, spec) = SafetensorsDir::open(&self.path)?;
                let tokenizer = dir_tokenizer(&self.path)?;
                if let Some(t) = tokenizer.as_ref().filter(|t| t.vocab_size() > spec.n_vocab) {
                    return Err(OracleError::Spec(format!(
                        "{}: tokenizer.json holds {} tokens but config.json's vocab_size is {}: ids past the embedding's rows",
                        self.path.display(),
                        t.vocab_size(),
                        spec.n_vocab
                    )));
                }
                Ok((unfused(Box::new(dir), &spec), spec, tokenizer))
            }
            Kind::Gguf(g) => {
                let spec = ModelSpec::from_gguf(&g)?;
                let tokenizer = gguf_tokenizer(&g)?;
                Ok((unfused(Box::new(g), &spec), spec, tokenizer))
            }
        }
    }

    /// The weights and the spec without the tokenizer (for device loaders), every layer the spec
    /// counts backed by a tensor.
    pub fn into_weights(self) -> Result<(Box<dyn TensorSource>, ModelSpec)> {
        match self.kind {
            Kind::Flat => {
                let (flat, spec) = crate::flat::FlatFile::open(&self.path)?;
                check_layers_backed(&flat, spec.n_layer)?;
                Ok((Box::new(flat), spec))
            }
            Kind::Dir => {
                let (dir, spec) = SafetensorsDir::open(&self.path)?;
                let src = unfused(Box::new(dir), &spec);
                check_layers_backed(src.as_ref(), spec.n_layer)?;
                Ok((src, spec))
            }
            // A GGUF's layer count is checked with its other metadata in `ModelSpec::from_gguf`.
            Kind::Gguf(g) => {
                let spec = ModelSpec::from_gguf(&g)?;
                Ok((unfused(Box::new(g), &spec), spec))
            }
        }
    }
}

fn gguf_tokenizer(g: &GgufFile) -> Result<Option<Tokenizer>> {
    match crate::tokenizer::gguf_gap(g)? {
        Some(_) => Ok(None),
        None => Ok(Some(Tokenizer::from_gguf(g)?)),
    }
}

/// The `tokenizer.json` beside a safetensors model, if any.
fn dir_tokenizer(dir: &Path) -> Result<Option<Tokenizer>> {
    if dir.join("tokenizer.json").exists() {
        Ok(Some(Tokenizer::from_checkpoint(dir)?))
    } else {
        Ok(None)
    }
}

/// The layer count every loader sizes its layers by must be backed by the files: a config
/// claiming 10^9 layers over one is this error, naming the layer it lacks, not a huge allocation
/// (and, where layers load in parallel, not an error about whichever layer failed first).
pub fn check_layers_backed(src: &dyn TensorSource, n_layer: usize) -> Result<()> {
    let last = format!("blk.{}.attn_norm.weight", n_layer.saturating_sub(1));
    if src.raw(&last)?.is_none() {
        return Err(OracleError::Spec(format!("{}: the model has {n_layer} layers but no tensor `{last}`", src.label())));
    }
    Ok(())
}

/// Opens a model with its tokenizer when it has one ([`ModelFile::into_model`]).
pub fn open_model(path: &Path) -> Result<(Box<dyn TensorSource>, ModelSpec, Option<Tokenizer>)> {
    ModelFile::open(path)?.into_model()
}

/// Opens a model's weights and spec without its tokenizer ([`ModelFile::into_weights`]).
pub fn open_weights(path: &Path) -> Result<(Box<dyn TensorSource>, ModelSpec)> {
    ModelFile::open(path)?.into_weights()
}

/// Only the tokenizer of a model (for device runs, which load their own weights).
pub fn open_tokenizer(path: &Path) -> Result<Option<Tokenizer>> {
    ModelFile::open(path)?.tokenizer()
}

/// Why a model has no tokenizer this tool builds ([`ModelFile::tokenizer_gap`]).
pub fn tokenizer_gap(path: &Path) -> Result<Option<String>> {
    ModelFile::open(path)?.tokenizer_gap()
}

/// A model's chat template, if it has one ([`ModelFile::chat_template`]).
pub fn chat_template(path: &Path) -> Result<Option<String>> {
    ModelFile::open(path)?.chat_template()
}
