//! `cargo xtask run`: generation on the oracle.

use devices::DeviceSpec;
use super::{check_ids, load_engine_on, open_device};
use crate::Exit;
use oracle::ops::SamplerConfig;
use oracle::Precision;

#[derive(clap::Args)]
pub struct RunArgs {
    #[arg(long, help = concat!("Model: ", fixtures::model_names!(), ", or a path to a .gguf file, a flat file (`export`) or a safetensors directory."))]
    model: String,
    /// Prompt text (tokenized with the model's own tokenizer).
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids, e.g. 504,3575,282.
    #[arg(long)]
    prompt_ids: Option<String>,
    /// Number of tokens to generate.
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    #[arg(long, default_value = "ref", value_parser = super::device_arg, help = concat!("Device to run on: ", devices::device_names!(), "."))]
    device: DeviceSpec,
    /// Print one JSON object: {"tokens", "text", "decode_tok_per_s", ...}.
    #[arg(long)]
    json: bool,
    /// Oracle storage precision: f32 (f64 accumulation) or f64 throughout.
    #[arg(long, default_value = "f32")]
    precision: Precision,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f64,
    /// Keep the k most likely tokens when sampling (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f64,
    /// Seed of the sampler's RNG.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating after the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// Send --prompt as a user message through the model's own chat template (a GGUF's
    /// `tokenizer.chat_template`, a checkpoint's tokenizer_config.json), as an instruct model
    /// expects; prints the reply alone.
    #[arg(long, requires = "prompt")]
    chat: bool,
    /// With --chat: a system message first.
    #[arg(long, requires = "chat")]
    system: Option<String>,
}

pub fn main(a: RunArgs) -> Result<u8, Exit> {
    let opened = open_device(&a.device)?;
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        return Err(Exit::new(2, format!("--temperature {} must be a finite number >= 0 (0: greedy)", a.temperature)));
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        return Err(Exit::new(2, format!("--top-p {} must be in (0, 1] (1: no nucleus cut)", a.top_p)));
    }
    // Greedy decoding takes the most likely token: the sampler's settings would change nothing.
    let sampling: Vec<String> = [(a.top_k != 0).then(|| format!("--top-k {}", a.top_k)), (a.top_p != 1.0).then(|| format!("--top-p {}", a.top_p)), (a.seed != 0).then(|| format!("--seed {}", a.seed))].into_iter().flatten().collect();
    if a.temperature == 0.0 && !sampling.is_empty() {
        return Err(Exit::new(2, format!("{}: sampling settings, but --temperature is 0 (greedy: the most likely token each step); give --temperature above 0 to sample", sampling.join(", "))));
    }
    let (path, mut engine, tok) = load_engine_on(&a.model, opened, a.precision)?;
    let chat_prompt = match (&a.prompt, &tok) {
        (Some(text), Some(t)) if a.chat => {
            let template = oracle::loader::chat_template(&path)?.ok_or_else(|| Exit::new(2, format!("model `{}` has no chat template; run without --chat", a.model)))?;
            let mut messages = Vec::new();
            if let Some(system) = &a.system {
                messages.push(("system", system.as_str()));
            }
            messages.push(("user", text.as_str()));
            Some(super::chat::render(&template, &messages, t)?)
        }
        (_, None) if a.chat => return Err(Exit::new(2, super::no_tokenizer(&a.model, &path))),
        _ => None,
    };
    let prompt = match (&chat_prompt, &tok) {
        (Some(rendered), Some(t)) => super::chat::encode(rendered, t)?,
        _ => super::given_prompt(a.prompt.as_deref(), a.prompt_ids.as_deref(), tok.as_ref(), &a.model, &path)?.expect("clap requires one"),
    };
    check_ids(&prompt, engine.spec().n_vocab)?;
    super::check_kv_fits("run", engine.spec(), prompt.len().saturating_add(a.max_new_tokens))?;
    let stop = match &tok {
        Some(t) if !a.ignore_eos => t.eos.as_slice(),
        _ => &[],
    };
    let sampler = SamplerConfig { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p };
    let g = engine.generate(&prompt, a.max_new_tokens, &sampler, a.seed, stop)?;
    let text = match &tok {
        Some(t) => Some(t.decode(&g.tokens)?),
        None => None,
    };
    if a.json {
        let v = serde_json::json!({
            "tokens": g.tokens,
            "text": text,
            "prompt_ids": g.prompt,
            "chat_prompt": chat_prompt,
            // null, not 0, when generation ended before a decode step (nothing was timed).
            "decode_tok_per_s": (g.decode_steps > 0).then(|| g.decode_tok_per_s()),
            "prefill_s": g.prefill_s,
            "decode_steps": g.decode_steps,
            "device": a.device.name(),
            "precision": format!("{:?}", a.precision).to_lowercase(),
            "threads": rayon::current_num_threads(),
        });
        outln!("{v}");
    } else {
        match (&tok, &text) {
            (Some(_), Some(text)) if chat_prompt.is_some() => outln!("{text}"),
            (Some(t), Some(text)) => outln!("{}{}", t.decode(&g.prompt)?, text),
            _ => outln!("{:?}", g.tokens),
        }
        let decode = if g.decode_steps > 0 { format!("decode {:.1} tok/s", g.decode_tok_per_s()) } else { "no decode step".into() };
        eprintln!(
            "\n[{} prompt tokens, {} generated; prefill {:.1} ms; {decode} on {} threads ({})]",
            g.prompt.len(),
            g.tokens.len(),
            g.prefill_s * 1e3,
            rayon::current_num_threads(),
            a.device
        );
    }
    Ok(0)
}
