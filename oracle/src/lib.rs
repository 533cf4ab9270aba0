//! # oracle — Touchstone's judge
//!
//! A CPU reference of every LLM operator and of full models, loaded from real GGUF and
//! safetensors files. It is simpler, more precise (f32 storage, f64 accumulation, or f64
//! throughout with `Precision::F64`) and more deterministic (fixed reduction order, bit-identical
//! for any thread count) than anything it judges. It depends on no other workspace crate.
//!
//! Map: `quant` (codecs), `gguf` (reader/writer), `loader` (files -> tensors), `spec` (ModelSpec),
//! `ops` (reference operators), `memory` (what a loader may hold), `model` (the one forward interpreter), `tokenizer`, `registry`
//! (every op declared once), `generate` (greedy/sampled generation).

pub mod dump;
pub mod error;
pub mod files;
pub mod flat;
pub mod generate;
pub mod gguf;
pub mod hugebuf;
pub mod loader;
pub mod memory;
pub mod model;
pub mod ops;
pub mod quant;
pub mod real;
pub mod registry;
pub mod schedule;
pub mod simd;
pub mod spec;
pub mod tensor;
pub mod taps;
pub mod tokenizer;

pub use error::{OracleError, Result};
pub use model::{Cache, LayerState, Model, NoTap, RecordingTap, Tap, WeightStore, WEIGHTS_ENV};
pub use real::Real;
pub use spec::ModelSpec;

/// Storage precision of the oracle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// f32 storage, f64 accumulation: the normal judge.
    F32,
    /// f64 storage and accumulation: measures the oracle's own rounding error.
    F64,
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(Precision::F32),
            "f64" => Ok(Precision::F64),
            o => Err(format!("precision `{o}`: expected f32 or f64")),
        }
    }
}
