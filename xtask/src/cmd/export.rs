//! `cargo xtask export`: a model as one flat file (docs/FLAT_FORMAT.md) for engines without a
//! GGUF parser (a bare-metal kernel loading a raw module, an eBPF loader, a hand-written C engine).
//! Every command reads the flat file back as a model, so the oracle judges such an engine on
//! exactly the bytes it loaded.

use super::resolve_model;
use crate::Exit;
use oracle::flat::{self, Target};
use oracle::quant::GgmlType;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct ExportArgs {
    #[arg(long, help = concat!("Model: ", fixtures::model_names!(), ", or a path to a .gguf file, a flat file (`export`) or a safetensors directory."))]
    model: String,
    /// The flat file to write (written beside it as FILE.part, renamed when whole and read back).
    #[arg(long)]
    out: PathBuf,
    /// What to write the weights as: `keep` (each tensor as the model stores it), or a GGML type
    /// (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl,
    /// iq4_xs, tq1_0, tq2_0, mxfp4, nvfp4, q1_0, q2_0) for the matrices, with
    /// norm weights, biases and MoE routers as f32 (as llama.cpp's quantizer does).
    #[arg(long = "type", default_value = "keep", value_parser = parse_target)]
    target: Target,
    /// Print one JSON object (file, bytes, per-tensor types) instead of the summary.
    #[arg(long)]
    json: bool,
}

fn parse_target(s: &str) -> Result<Target, String> {
    if s == "keep" {
        return Ok(Target::Keep);
    }
    GgmlType::from_name(s).map(Target::To).ok_or_else(|| format!("`{s}`: expected keep or one of {}", GgmlType::ALL.iter().map(|t| t.name()).collect::<Vec<_>>().join(", ")))
}

pub fn main(a: ExportArgs) -> Result<u8, Exit> {
    let path = resolve_model(&a.model)?;
    let (source, spec) = oracle::loader::open_weights(&path)?;
    if a.out.is_dir() {
        return Err(Exit::new(2, format!("--out {}: is a directory; give the file to write", a.out.display())));
    }
    let pb = super::progress(0, "export");
    let exported = flat::export(&a.out, &spec, source.as_ref(), a.target, &mut |done, total, name| {
        pb.set_length(total as u64);
        pb.set_position(done as u64);
        pb.set_message(format!("export {name}"));
    })?;
    pb.finish_and_clear();
    let bytes = std::fs::metadata(&a.out).map(|m| m.len()).map_err(|e| super::io_exit(&a.out, e))?;
    let mut by_type: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for t in &exported {
        let label = if t.from == t.to { t.to.name().to_string() } else { format!("{} (from {})", t.to.name(), t.from.name()) };
        let e = by_type.entry(label).or_default();
        e.0 += 1;
        e.1 += t.n_bytes;
    }
    if a.json {
        let tensors: Vec<_> = exported.iter().map(|t| serde_json::json!({ "name": t.name, "type": t.to.name(), "from": t.from.name(), "dims": t.dims, "bytes": t.n_bytes })).collect();
        outln!("{}", serde_json::json!({ "file": a.out.display().to_string(), "bytes": bytes, "model": a.model, "arch": spec.arch, "n_layer": spec.n_layer, "tensors": tensors }));
    } else {
        outln!("wrote {} ({} bytes): {} {} model, {} layers, {} tensors", a.out.display(), bytes, a.model, spec.arch, spec.n_layer, exported.len());
        for (label, (n, b)) in &by_type {
            outln!("  {n:>4} x {label:<20} {b:>14} bytes");
        }
        outln!("read back: header, table and spec checked; run it with --model {}", a.out.display());
    }
    Ok(0)
}
