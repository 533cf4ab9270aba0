//! The reference operators. Each is a plain function over row-major slices, generic over the
//! storage scalar (`Real`), that accumulates in f64 in a fixed order and rounds once on store.
//! Parallel loops split over independent outputs (rows, heads, tokens), never inside a reduction,
//! so results do not depend on the thread count.

pub mod act;
pub mod attention;
pub mod embed;
pub mod matmul;
pub mod mla;
pub mod moe;
pub mod norm;
pub mod rope;
pub mod sample;
pub mod ssm;
pub mod delta;

pub use act::{add, add_bias, add_scaled, geglu, gelu_tanh, silu, softmax_rows, swiglu, swiglu_oai, swiglu_oai_f64};
pub use attention::{attention, attention_values, attention_with, AttentionParams, AttentionWeights};
pub use mla::{mla_expand, mla_rope_heads};
pub use embed::embed;
pub use matmul::{matmul, matmul_many, Mat, RowBuf};
pub use moe::{moe_route, moe_route_rule, RouteRule, Routing};
pub use norm::{layer_norm, rms_norm};
pub use rope::{rope, rope_base_angle, rope_cos_sin};
pub use delta::{delta_gated_norm, delta_scan, DeltaInputs};
pub use ssm::{softplus, ssm_conv, ssm_gated_norm, ssm_scan, ScanInputs};
pub use sample::{argmax, sample, top_k, SamplerConfig, SplitMix64};

use crate::error::{OracleError, Result};

/// Checks that a buffer holds `rows x cols` values.
pub(crate) fn check_len(what: &str, len: usize, rows: usize, cols: usize) -> Result<()> {
    match rows.checked_mul(cols) {
        Some(n) if n == len => Ok(()),
        _ => Err(OracleError::Shape(format!("{what}: buffer has {len} values, expected {rows} x {cols}"))),
    }
}
