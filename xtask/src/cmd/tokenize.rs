//! `cargo xtask tokenize`: a model's tokenizer alone (text to ids, or ids to text), to check what
//! an engine's tokenizer gives against the ids the oracle runs on. Loads no weights.

use super::{parse_ids, resolve_model};
use crate::Exit;
use std::io::Read;

#[derive(clap::Args)]
pub struct TokenizeArgs {
    #[arg(long, help = concat!("Model: ", fixtures::model_names!(), ", or a path to a .gguf file or a safetensors directory (a flat file carries no tokenizer)."))]
    model: String,
    /// Text to tokenize; `-` reads it from stdin (all of it, newlines kept).
    #[arg(long, conflicts_with = "ids", required_unless_present = "ids")]
    text: Option<String>,
    /// Comma-separated token ids to decode to text instead, e.g. 504,3575,282.
    #[arg(long)]
    ids: Option<String>,
    /// Leave out the BOS id the model's tokenizer puts first (when it does).
    #[arg(long)]
    no_bos: bool,
    /// Print one JSON object: {"ids", "pieces", "text"} (the pieces are the vocabulary's strings).
    #[arg(long)]
    json: bool,
}

pub fn main(a: TokenizeArgs) -> Result<u8, Exit> {
    let path = resolve_model(&a.model)?;
    let tok = oracle::loader::open_tokenizer(&path)?.ok_or_else(|| Exit::new(2, super::no_tokenizer(&a.model, &path)))?;
    let (ids, text) = match (&a.text, &a.ids) {
        (Some(t), None) => {
            let text = if t == "-" {
                let mut s = String::new();
                std::io::stdin().read_to_string(&mut s).map_err(|e| Exit::new(2, format!("reading the text from stdin: {e}")))?;
                s
            } else {
                t.clone()
            };
            let mut ids = tok.encode(&text)?;
            if a.no_bos && tok.bos.is_some() && ids.first() == tok.bos.as_ref() {
                ids.remove(0);
            }
            (ids, text)
        }
        (None, Some(ids)) => {
            let ids = parse_ids("--ids", ids)?;
            super::check_ids(&ids, tok.vocab_size())?;
            let text = tok.decode(&ids)?;
            (ids, text)
        }
        _ => unreachable!("clap requires exactly one"),
    };
    if a.json {
        let pieces: Vec<Option<String>> = ids.iter().map(|&i| tok.piece(i)).collect();
        outln!("{}", serde_json::json!({ "ids": ids, "pieces": pieces, "text": text, "n_tokens": ids.len() }));
    } else if a.ids.is_some() {
        outln!("{text}");
    } else {
        outln!("{}", ids.iter().map(u32::to_string).collect::<Vec<_>>().join(","));
        eprintln!("[{} tokens]", ids.len());
    }
    Ok(0)
}
