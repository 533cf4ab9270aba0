//! The one error type of the oracle. Every variant names what was wrong and where
//! (file, field, byte offset), so a user can find the broken byte without a debugger.

use std::path::PathBuf;

/// Result alias used across the oracle.
pub type Result<T, E = OracleError> = std::result::Result<T, E>;

/// Everything the oracle can refuse.
#[derive(Debug, thiserror::Error)]
pub enum OracleError {
    /// A GGUF file is malformed, truncated or hostile.
    #[error("{file}: GGUF field `{field}` at byte offset {offset}: {reason}")]
    Gguf {
        file: String,
        field: String,
        offset: u64,
        reason: String,
    },
    /// A flat model file (`flat`) is malformed, truncated or corrupt.
    #[error("{file}: flat model field `{field}` at byte offset {offset}: {reason}")]
    Flat {
        file: String,
        field: String,
        offset: u64,
        reason: String,
    },
    /// A safetensors file or its config.json is malformed or inconsistent.
    #[error("{file}: {reason}")]
    Safetensors { file: String, reason: String },
    /// A model's metadata or tensors do not describe a model the interpreter can run.
    #[error("model spec: {0}")]
    Spec(String),
    /// An op was called with shapes or parameters that do not fit together.
    #[error("shape: {0}")]
    Shape(String),
    /// A codec was handed a buffer whose length is not a whole number of blocks, or an unknown type.
    #[error("codec: {0}")]
    Codec(String),
    /// Tokenizer construction or use failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Loading would hold more memory than the machine has available (see `memory`).
    #[error("memory: {0}")]
    Memory(String),
    /// A computation produced values no result can come from (NaN logits).
    #[error("numeric: {0}")]
    Numeric(String),
    /// Reading a file failed.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl OracleError {
    /// A weight that is NaN or an infinity: a broken file, refused by every loader (a judge that
    /// loaded it would pass NaN on to every device it judges). `row_len` is the tensor's `dims[0]`.
    pub fn non_finite_weight(label: &str, name: &str, element: usize, value: f32, row_len: usize) -> Self {
        let cols = row_len.max(1);
        OracleError::Spec(format!(
            "{label}: tensor `{name}` holds {value} at element {element} (row {}, column {}); a model's weights must be finite",
            element / cols,
            element % cols
        ))
    }

    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        OracleError::Io {
            path: path.into(),
            source,
        }
    }
}
