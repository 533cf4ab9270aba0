//! Generation on the oracle: prefill the prompt, then decode one token at a time against the
//! KV cache, greedily or with the seeded sampler. Also `AnyModel`, which hides the storage
//! precision from callers that only want f32 logits out.

use crate::error::{OracleError, Result};
use crate::loader::open_model;
use crate::model::{Model, Tap};
use crate::ops::{sample, SamplerConfig, SplitMix64};
use crate::real::Real;
use crate::spec::ModelSpec;
use crate::tokenizer::Tokenizer;
use crate::Precision;
use std::path::Path;
use std::time::Instant;

/// What a generation produced and how long it took.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Generation {
    pub prompt: Vec<u32>,
    /// Generated ids (not including the prompt).
    pub tokens: Vec<u32>,
    /// Seconds to run the prompt and produce the first token.
    pub prefill_s: f64,
    /// Seconds spent in decode steps (tokens after the first).
    pub decode_s: f64,
    pub decode_steps: usize,
    /// Seconds of each decode step (inter-token latencies), in order.
    pub step_s: Vec<f64>,
}

impl Generation {
    pub fn decode_tok_per_s(&self) -> f64 {
        if self.decode_s > 0.0 {
            self.decode_steps as f64 / self.decode_s
        } else {
            0.0
        }
    }
}

/// Generates up to `max_new` tokens after `prompt`; stops early after any id of `stop` (the
/// tokenizer's end-of-generation ids).
pub fn generate<T: Real>(
    model: &Model<T>,
    prompt: &[u32],
    max_new: usize,
    sampler: &SamplerConfig,
    seed: u64,
    stop: &[u32],
    taps: &mut dyn Tap,
) -> Result<Generation> {
    let mut cache = model.new_cache();
    generate_with(|ids| model.forward_last(ids, &mut cache, taps), prompt, max_new, sampler, seed, stop)
}

/// The generation loop over any engine: `forward_last(ids)` runs `ids` after everything run so
/// far and returns the logits of the last one. Prefill, then one decode step per token, the
/// seeded sampler, and the timings. Device runs use the same loop as the oracle.
pub fn generate_with<T: Real, E: From<OracleError>>(
    mut forward_last: impl FnMut(&[u32]) -> std::result::Result<Vec<T>, E>,
    prompt: &[u32],
    max_new: usize,
    sampler: &SamplerConfig,
    seed: u64,
    stop: &[u32],
) -> std::result::Result<Generation, E> {
    if prompt.is_empty() {
        return Err(OracleError::Shape("generate: the prompt has no tokens".into()).into());
    }
    if prompt.len() + max_new > 1 << 20 {
        return Err(OracleError::Shape("generate: prompt + new tokens exceed 2^20 positions".into()).into());
    }
    let mut rng = SplitMix64(seed);
    let mut tokens = Vec::with_capacity(max_new);
    let t0 = Instant::now();
    let logits = forward_last(prompt)?;
    if max_new == 0 {
        return Ok(Generation { prompt: prompt.to_vec(), tokens, prefill_s: t0.elapsed().as_secs_f64(), decode_s: 0.0, decode_steps: 0, step_s: Vec::new() });
    }
    let mut next = pick(&logits, sampler, &mut rng, prompt.len() - 1)?;
    tokens.push(next);
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut step_s = Vec::with_capacity(max_new);
    while tokens.len() < max_new && !stop.contains(&next) {
        let ts = Instant::now();
        let logits = forward_last(&[next])?;
        next = pick(&logits, sampler, &mut rng, prompt.len() + tokens.len() - 1)?;
        tokens.push(next);
        step_s.push(ts.elapsed().as_secs_f64());
    }
    Ok(Generation { prompt: prompt.to_vec(), tokens, prefill_s, decode_s: t1.elapsed().as_secs_f64(), decode_steps: step_s.len(), step_s })
}

/// The next token from the logits at `position`: NaN logits are an error, never a token (every
/// comparison with NaN is false, so a sampler would pick whatever it met first).
fn pick<T: Real>(logits: &[T], sampler: &SamplerConfig, rng: &mut SplitMix64, position: usize) -> std::result::Result<u32, OracleError> {
    if let Some(i) = logits.iter().position(|v| v.to_f64().is_nan()) {
        let n = logits.iter().filter(|v| v.to_f64().is_nan()).count();
        return Err(OracleError::Numeric(format!("the logits at position {position} hold NaN ({n} of {}, the first at token id {i}): no token can be chosen from them", logits.len())));
    }
    Ok(sample(logits, sampler, rng) as u32)
}

/// A model at either precision.
pub enum AnyModel {
    F32(Model<f32>),
    F64(Model<f64>),
}

impl AnyModel {
    /// Loads a GGUF file or safetensors directory at `precision`, with its tokenizer when the
    /// file carries one.
    pub fn load(path: &Path, precision: Precision) -> Result<(AnyModel, Option<Tokenizer>)> {
        let (src, spec, tokenizer) = open_model(path)?;
        let model = match precision {
            Precision::F32 => AnyModel::F32(Model::load(spec, src.as_ref())?),
            Precision::F64 => AnyModel::F64(Model::load(spec, src.as_ref())?),
        };
        Ok((model, tokenizer))
    }

    /// How the weight matrices are held (`Decoded` or `Packed`).
    pub fn store(&self) -> crate::WeightStore {
        match self {
            AnyModel::F32(m) => m.store,
            AnyModel::F64(m) => m.store,
        }
    }

    pub fn spec(&self) -> &ModelSpec {
        match self {
            AnyModel::F32(m) => &m.spec,
            AnyModel::F64(m) => &m.spec,
        }
    }

    pub fn generate(&self, prompt: &[u32], max_new: usize, sampler: &SamplerConfig, seed: u64, stop: &[u32], taps: &mut dyn Tap) -> Result<Generation> {
        match self {
            AnyModel::F32(m) => generate(m, prompt, max_new, sampler, seed, stop, taps),
            AnyModel::F64(m) => generate(m, prompt, max_new, sampler, seed, stop, taps),
        }
    }

    /// One prefill over `tokens` from an empty cache; logits of every position as f64 `[m, n_vocab]`.
    pub fn prefill_logits(&self, tokens: &[u32], taps: &mut dyn Tap) -> Result<Vec<f64>> {
        match self {
            AnyModel::F32(m) => Ok(m.forward(tokens, &mut m.new_cache(), taps)?.into_iter().map(|v| v as f64).collect()),
            AnyModel::F64(m) => m.forward(tokens, &mut m.new_cache(), taps),
        }
    }

    /// Bytes of weights read per generated token (for bandwidth figures).
    pub fn weight_bytes_per_token(&self) -> usize {
        match self {
            AnyModel::F32(m) => m.weight_bytes_per_token(),
            AnyModel::F64(m) => m.weight_bytes_per_token(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake engine whose greedy next token after `t` is `t + 1`: generation stops after the
    /// first id of `stop` it produces (kept in the output), or at `max_new`.
    #[test]
    fn generation_stops_after_any_stop_id() {
        let next_of = |ids: &[u32]| -> Result<Vec<f32>> {
            let mut logits = vec![0.0f32; 16];
            logits[(*ids.last().unwrap() as usize + 1) % 16] = 1.0;
            Ok(logits)
        };
        let run = |stop: &[u32], max_new| generate_with(next_of, &[3], max_new, &SamplerConfig::GREEDY, 0, stop).unwrap().tokens;
        assert_eq!(run(&[], 5), [4, 5, 6, 7, 8]);
        assert_eq!(run(&[9, 6], 8), [4, 5, 6]);
        assert_eq!(run(&[4], 8), [4], "a stop id from the prefill ends it there");
        assert_eq!(run(&[12], 3), [4, 5, 6]);
    }

    /// NaN logits give no token (every comparison with NaN is false: a sampler would take the
    /// first id): the generation loop every engine runs through stops with an error naming the
    /// position, at the prefill and at a decode step.
    #[test]
    fn nan_logits_are_an_error_never_a_token() {
        let greedy = SamplerConfig::GREEDY;
        let all_nan = |_: &[u32]| -> Result<Vec<f32>> { Ok(vec![f32::NAN; 3]) };
        let e = generate_with(all_nan, &[1, 2, 3], 4, &greedy, 0, &[]).unwrap_err().to_string();
        assert!(e.contains("logits at position 2 hold NaN (3 of 3, the first at token id 0)"), "{e}");
        let mut calls = 0;
        let later = |_: &[u32]| -> Result<Vec<f32>> {
            calls += 1;
            Ok(if calls < 3 { vec![0.0, 1.0, 0.5] } else { vec![0.0, f32::NAN, 0.5] })
        };
        let e = generate_with(later, &[1, 2, 3], 8, &greedy, 0, &[]).unwrap_err().to_string();
        assert!(e.contains("logits at position 4 hold NaN (1 of 3, the first at token id 1)"), "{e}");
        let fine = |_: &[u32]| -> Result<Vec<f32>> { Ok(vec![0.0, 1.0, 0.5]) };
        assert_eq!(generate_with(fine, &[1], 3, &greedy, 0, &[]).unwrap().tokens, [1, 1, 1]);
    }
}
