//! Rotary position embedding, in both pairings (normal = adjacent pairs, neox = rotate-half),
//! with linear and YaRN frequency scaling as llama.cpp defines them.

use super::check_len;
use crate::error::{OracleError, Result};
use crate::real::Real;
use crate::spec::{RopeScaling, RopeSpec, RopeStyle};

/// YaRN's correction dimension: the rotary dimension whose wavelength spans `n_ctx_orig / beta`.
fn yarn_corr_dim(n_rot: usize, n_ctx_orig: usize, beta: f64, base: f64) -> f64 {
    n_rot as f64 * (n_ctx_orig as f64 / (beta * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
}

/// Pair `i`'s angle at `pos` before any context scaling: pos * theta^(-2i/n_rot), divided by the
/// pair's frequency factor (Llama 3.1, LongRoPE) where the model has them, as in llama.cpp.
/// Linear and YaRN scaling only lower it, so it also bounds the angle an engine forms.
pub fn rope_base_angle(spec: &RopeSpec, pos: usize, i: usize) -> f64 {
    let theta = pos as f64 * spec.theta.powf(-2.0 * i as f64 / spec.n_rot as f64);
    match spec.freq_factors.as_ref().and_then(|f| f.get(i)) {
        Some(f) => theta / *f as f64,
        None => theta,
    }
}

/// cos and sin (already multiplied by the magnitude scale) for pair `i` (0..n_rot/2) at `pos`.
pub fn rope_cos_sin(spec: &RopeSpec, pos: usize, i: usize) -> (f64, f64) {
    let theta_extrap = rope_base_angle(spec, pos, i);
    let (theta, mscale) = match spec.scaling {
        RopeScaling::None => (theta_extrap, 1.0),
        RopeScaling::Linear { factor } => (theta_extrap / factor, 1.0),
        RopeScaling::LongRope { attn_factor, .. } => (theta_extrap, attn_factor),
        RopeScaling::Yarn { factor, original_context, beta_fast, beta_slow, ext_factor, attn_factor, truncate } => {
            let freq_scale = 1.0 / factor;
            let theta_interp = freq_scale * theta_extrap;
            let (low, high) = (yarn_corr_dim(spec.n_rot, original_context, beta_fast, spec.theta), yarn_corr_dim(spec.n_rot, original_context, beta_slow, spec.theta));
            let (low, high) = if truncate { (low.floor(), high.ceil()) } else { (low, high) };
            let (low, high) = (low.max(0.0), high.min(spec.n_rot as f64 - 1.0));
            let mut mscale = attn_factor;
            let theta = if ext_factor != 0.0 {
                let y = (i as f64 - low) / (high - low).max(0.001);
                let ramp_mix = (1.0 - y.clamp(0.0, 1.0)) * ext_factor;
                mscale *= 1.0 + 0.1 * (1.0 / freq_scale).ln();
                theta_interp * (1.0 - ramp_mix) + theta_extrap * ramp_mix
            } else {
                theta_interp
            };
            (theta, mscale)
        }
    };
    (theta.cos() * mscale, theta.sin() * mscale)
}

/// Rotates `x: [m, n_head * head_dim]` in place; token `t` is at position `positions[t]`.
pub fn rope<T: Real>(x: &mut [T], positions: &[usize], n_head: usize, head_dim: usize, spec: &RopeSpec) -> Result<()> {
    check_len("rope input", x.len(), positions.len(), n_head * head_dim)?;
    if let (RopeScaling::LongRope { original_context, context, .. }, Some(&last)) = (&spec.scaling, positions.iter().max()) {
        if last >= *context {
            let which = if context > original_context { "long" } else { "short" };
            return Err(OracleError::Shape(format!(
                "rope: position {last} is past the {context}-position context this LongRoPE model is configured for (original context {original_context}, its {which} factors); an engine configured for a longer context (llama.cpp's -c) uses the long factors at every position: judge it with --context N (or TOUCHSTONE_CONTEXT=N) set to that context"
            )));
        }
    }
    let half = spec.n_rot / 2;
    for (t, &pos) in positions.iter().enumerate() {
        let cs: Vec<(f64, f64)> = (0..half).map(|i| rope_cos_sin(spec, pos, i)).collect();
        for h in 0..n_head {
            let head = &mut x[(t * n_head + h) * head_dim..(t * n_head + h + 1) * head_dim];
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = match spec.style {
                    RopeStyle::Normal => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + half),
                };
                let (x0, x1) = (head[a].to_f64(), head[b].to_f64());
                head[a] = T::from_f64(x0 * c - x1 * s);
                head[b] = T::from_f64(x0 * s + x1 * c);
            }
        }
    }
    Ok(())
}
