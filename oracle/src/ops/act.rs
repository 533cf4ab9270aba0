//! Element-wise ops: activations, gated units, bias and residual adds, row softmax.

use super::check_len;
use crate::error::{OracleError, Result};
use crate::real::Real;

/// SiLU: x * sigmoid(x), computed in f64.
#[inline]
pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
#[inline]
pub fn gelu_tanh(x: f64) -> f64 {
    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

fn gated<T: Real>(gate: &[T], up: &[T], f: fn(f64) -> f64) -> Result<Vec<T>> {
    if gate.len() != up.len() {
        return Err(OracleError::Shape(format!("gated unit: gate has {} values, up has {}", gate.len(), up.len())));
    }
    Ok(gate.iter().zip(up).map(|(g, u)| T::from_f64(f(g.to_f64()) * u.to_f64())).collect())
}

/// SwiGLU: silu(gate) * up, rounded once.
pub fn swiglu<T: Real>(gate: &[T], up: &[T]) -> Result<Vec<T>> {
    gated(gate, up, silu)
}

/// GeGLU: gelu_tanh(gate) * up, rounded once.
pub fn geglu<T: Real>(gate: &[T], up: &[T]) -> Result<Vec<T>> {
    gated(gate, up, gelu_tanh)
}

/// GPT-OSS's clamped SwiGLU of one gate and up value ([`crate::spec::Activation::SwigluOai`]),
/// in f64: `min(g, L) * sigmoid(A * min(g, L)) * (clamp(u, -L, L) + 1)`.
#[inline]
pub fn swiglu_oai_f64(g: f64, u: f64) -> f64 {
    use crate::spec::{OAI_SWIGLU_ALPHA, OAI_SWIGLU_LIMIT};
    let g = g.min(OAI_SWIGLU_LIMIT);
    let u = u.clamp(-OAI_SWIGLU_LIMIT, OAI_SWIGLU_LIMIT);
    g / (1.0 + (-OAI_SWIGLU_ALPHA * g).exp()) * (u + 1.0)
}

/// GPT-OSS's clamped SwiGLU ([`swiglu_oai_f64`]) of `gate` and `up`, rounded once.
pub fn swiglu_oai<T: Real>(gate: &[T], up: &[T]) -> Result<Vec<T>> {
    if gate.len() != up.len() {
        return Err(OracleError::Shape(format!("clamped SwiGLU: gate has {} values, up has {}", gate.len(), up.len())));
    }
    Ok(gate.iter().zip(up).map(|(g, u)| T::from_f64(swiglu_oai_f64(g.to_f64(), u.to_f64()))).collect())
}

/// Adds `bias: [n]` to every row of `x: [rows, n]`.
pub fn add_bias<T: Real>(x: &mut [T], bias: &[T]) -> Result<()> {
    let n = bias.len();
    if n == 0 || !x.len().is_multiple_of(n) {
        return Err(OracleError::Shape(format!("bias of {n} values does not divide a buffer of {}", x.len())));
    }
    for row in x.chunks_mut(n) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v = T::from_f64(v.to_f64() + b.to_f64());
        }
    }
    Ok(())
}

/// Residual add: `a + b` element-wise.
pub fn add<T: Real>(a: &[T], b: &[T]) -> Result<Vec<T>> {
    if a.len() != b.len() {
        return Err(OracleError::Shape(format!("add: {} values vs {}", a.len(), b.len())));
    }
    Ok(a.iter().zip(b).map(|(x, y)| T::from_f64(x.to_f64() + y.to_f64())).collect())
}

/// `a + s b`, each element rounded once (Granite's residual branches, scaled before the add;
/// `s` 1 is [`add`]).
pub fn add_scaled<T: Real>(a: &[T], b: &[T], s: f64) -> Result<Vec<T>> {
    if a.len() != b.len() {
        return Err(OracleError::Shape(format!("add: {} values vs {}", a.len(), b.len())));
    }
    Ok(a.iter().zip(b).map(|(x, y)| T::from_f64(x.to_f64() + s * y.to_f64())).collect())
}

/// Softmax over each row of `x: [rows, n]`, max-subtracted, in f64. A row that is all -inf
/// (fully masked) yields NaN, which callers must not produce.
pub fn softmax_rows<T: Real>(x: &[T], n: usize) -> Result<Vec<T>> {
    let rows = x.len().checked_div(n).unwrap_or(0);
    check_len("softmax input", x.len(), rows, n)?;
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(n.max(1)) {
        let p = softmax_f64(&row.iter().map(|v| v.to_f64()).collect::<Vec<_>>());
        out.extend(p.into_iter().map(T::from_f64));
    }
    Ok(out)
}

/// Softmax of f64 values, summed in index order.
pub fn softmax_f64(x: &[f64]) -> Vec<f64> {
    let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = x.iter().map(|v| (v - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|v| v / sum).collect()
}
