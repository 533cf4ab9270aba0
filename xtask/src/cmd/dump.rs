//! `cargo xtask dump`: every tap and the logits of every position, in the dump format.

use devices::DeviceSpec;
use super::{check_ids, load_engine_on, open_device};
use crate::Exit;
use oracle::dump::{write_dump, ModelInfo};
use oracle::{Precision, RecordingTap};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct DumpArgs {
    #[arg(long, help = concat!("Model: ", fixtures::model_names!(), ", or a path to a .gguf file, a flat file (`export`) or a safetensors directory."))]
    model: String,
    /// Token ids to run, comma-separated.
    #[arg(long, conflicts_with = "prompt", required_unless_present = "prompt")]
    prompt_ids: Option<String>,
    /// Text to run instead, tokenized with the model's own tokenizer.
    #[arg(long)]
    prompt: Option<String>,
    /// Output directory (created; existing dump files are replaced).
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value = "ref", value_parser = super::device_arg, help = concat!("Device whose taps to write: ", devices::device_names!(), "."))]
    device: DeviceSpec,
    /// Oracle storage precision (`--device ref`): f32 (f64 accumulation) or f64 throughout.
    #[arg(long, default_value = "f32")]
    precision: Precision,
}

pub fn main(a: DumpArgs) -> Result<u8, Exit> {
    let (path, mut engine, tok) = load_engine_on(&a.model, open_device(&a.device)?, a.precision)?;
    let ids = super::given_prompt(a.prompt.as_deref(), a.prompt_ids.as_deref(), tok.as_ref(), &a.model, &path)?.expect("clap requires one");
    check_ids(&ids, engine.spec().n_vocab)?;
    // The recording, and its copy as written.
    super::check_recordings_fit("dump", engine.spec(), true, ids.len(), 2)?;
    let mut taps = RecordingTap::default();
    engine.prefill(&ids, &mut taps)?;
    let info = ModelInfo { name: a.model.clone(), sha256: ::fixtures::sha256_model(&path)?, arch: engine.spec().arch.to_string() };
    let precision = format!("{:?}", a.precision).to_lowercase();
    let arithmetic = serde_json::to_value(engine.arithmetic()).ok();
    let m = write_dump(&a.out, info, a.device.name(), &precision, &ids, &taps, arithmetic)?;
    eprintln!("wrote {} taps and logits [{} x {}] to {}", m.taps.len(), ids.len(), engine.spec().n_vocab, a.out.display());
    Ok(0)
}
