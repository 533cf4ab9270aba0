//! Text <-> token ids, built with the `tokenizers` crate from a GGUF vocabulary and merges
//! (byte-level BPE, `tokenizer.ggml.model = gpt2`) or from a `tokenizer.json`.

use crate::error::{OracleError, Result};
use crate::gguf::GgufFile;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

fn tok_err(e: impl std::fmt::Display) -> OracleError {
    OracleError::Tokenizer(e.to_string())
}

/// GPT-4-style split used by Qwen2 (and Qwen3) byte-level BPE.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama-3 split (digits in groups of up to three).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
}

impl Tokenizer {
    /// Builds the tokenizer stored in a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(g: &GgufFile) -> Result<Tokenizer> {
        let model = g.field("tokenizer.ggml.model", |v| v.as_str(), "a string").map_err(tok_err)?.unwrap_or("");
        if model != "gpt2" {
            return Err(tok_err(format!("{}: `tokenizer.ggml.model` `{model}` is not supported (byte-level BPE `gpt2` is)", g.path)));
        }
        let tokens = g
            .field("tokenizer.ggml.tokens", |v| v.as_array(), "an array")
            .map_err(tok_err)?
            .ok_or_else(|| tok_err(format!("{}: no `tokenizer.ggml.tokens`", g.path)))?;
        let mut vocab = tokenizers::models::bpe::Vocab::default();
        for (i, t) in tokens.iter().enumerate() {
            let s = t.as_str().ok_or_else(|| tok_err(format!("{}: tokenizer.ggml.tokens[{i}] is not a string", g.path)))?;
            vocab.insert(s.to_string(), i as u32);
        }
        let mut merges = Vec::new();
        if let Some(ms) = g.field("tokenizer.ggml.merges", |v| v.as_array(), "an array").map_err(tok_err)? {
            for (i, m) in ms.iter().enumerate() {
                let s = m.as_str().unwrap_or("");
                let (a, b) = s
                    .split_once(' ')
                    .ok_or_else(|| tok_err(format!("{}: tokenizer.ggml.merges[{i}] `{s}` is not two tokens", g.path)))?;
                merges.push((a.to_string(), b.to_string()));
            }
        }
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(tok_err)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre = g.field("tokenizer.ggml.pre", |v| v.as_str(), "a string").map_err(tok_err)?.unwrap_or("default");
        let byte_level = |use_regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
        let split = |pat: &str| -> Result<PreTokenizerWrapper> {
            Ok(PreTokenizerWrapper::Split(
                Split::new(SplitPattern::Regex(pat.to_string()), SplitDelimiterBehavior::Isolated, false).map_err(tok_err)?,
            ))
        };
        let pre_tok = match pre {
            "default" | "gpt2" | "gpt-2" => Sequence::new(vec![byte_level(true)]),
            "smollm" => Sequence::new(vec![PreTokenizerWrapper::Digits(Digits::new(true)), byte_level(true)]),
            "qwen2" => Sequence::new(vec![split(QWEN2_PATTERN)?, byte_level(false)]),
            "llama-bpe" | "llama3" => Sequence::new(vec![split(LLAMA3_PATTERN)?, byte_level(false)]),
            other => return Err(tok_err(format!("{}: tokenizer.ggml.pre `{other}` is not supported (default, gpt2, smollm, qwen2, llama-bpe)", g.path))),
        };
        inner.with_pre_tokenizer(Some(pre_tok));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        // Control tokens (type 3) are matched whole, never split by BPE.
        if let Some(types) = g.field("tokenizer.ggml.token_type", |v| v.as_array(), "an array").map_err(tok_err)? {
            let specials: Vec<AddedToken> = types
                .iter()
                .enumerate()
                .filter(|(_, t)| t.as_u64() == Some(3))
                .filter_map(|(i, _)| tokens.get(i).and_then(|t| t.as_str()))
                .map(|s| AddedToken::from(s.to_string(), true))
                .collect();
            inner.add_special_tokens(specials).map_err(tok_err)?;
        }
        // A special id outside the vocabulary is an error: an end-of-text id that no token has
        // would let generation run on silently.
        let id = |k: &str| -> Result<Option<u32>> {
            match g.field(k, |v| v.as_u64(), "an unsigned integer").map_err(tok_err)? {
                Some(i) if i >= tokens.len() as u64 => Err(tok_err(format!("{}: {k} is {i}, outside the vocabulary of {} tokens", g.path, tokens.len()))),
                i => Ok(i.map(|i| i as u32)),
            }
        };
        Ok(Tokenizer {
            inner,
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            add_bos: g.field("tokenizer.ggml.add_bos_token", |v| v.as_bool(), "true or false").map_err(tok_err)?.unwrap_or(false),
        })
    }

    /// Loads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: &std::path::Path) -> Result<Tokenizer> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| tok_err(format!("{}: {e}", path.display())))?;
        Ok(Tokenizer { inner, bos: None, eos: None, add_bos: false })
    }

    /// Token ids of `text` (with BOS first when the model asks for it).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(tok_err)?;
        let mut ids = Vec::new();
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(tok_err)
    }

    /// Writes the tokenizer as a Hugging Face `tokenizer.json`.
    pub fn save(&self, path: &std::path::Path) -> Result<()> {
        self.inner.save(path, false).map_err(|e| tok_err(format!("{}: {e}", path.display())))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
