//! `cargo xtask dump`: every tap and the logits of every position, in the dump format.

use super::{check_device, check_ids, load_model, parse_ids};
use crate::Exit;
use oracle::dump::{write_dump, ModelInfo};
use oracle::{Precision, RecordingTap};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct DumpArgs {
    /// Model name or path (see `run --help`).
    #[arg(long)]
    model: String,
    /// Token ids to run, comma-separated.
    #[arg(long)]
    prompt_ids: String,
    /// Output directory (created; existing dump files are replaced).
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value = "ref")]
    device: String,
    #[arg(long, default_value = "f32")]
    precision: Precision,
}

pub fn main(a: DumpArgs) -> Result<u8, Exit> {
    check_device(&a.device)?;
    let ids = parse_ids(&a.prompt_ids)?;
    let (path, model, _) = load_model(&a.model, a.precision)?;
    check_ids(&ids, model.spec().n_vocab)?;
    let mut taps = RecordingTap::default();
    if a.device == "ref" {
        model.prefill_logits(&ids, &mut taps)?;
    } else {
        let dev = devices::open(&a.device).map_err(|e| Exit { code: 2, message: e.to_string() })?;
        let mut dm = dev.load_model(&path, &devices::ModelOptions::default()).map_err(|e| Exit { code: 2, message: e.to_string() })?;
        dm.forward(&ids, &mut taps).map_err(|e| Exit { code: 2, message: e.to_string() })?;
    }
    let info = ModelInfo { name: a.model.clone(), sha256: ::fixtures::sha256_model(&path)?, arch: model.spec().arch.clone() };
    let precision = format!("{:?}", a.precision).to_lowercase();
    let m = write_dump(&a.out, info, &a.device, &precision, &ids, &taps)?;
    eprintln!("wrote {} taps and logits [{} x {}] to {}", m.taps.len(), ids.len(), model.spec().n_vocab, a.out.display());
    Ok(0)
}
