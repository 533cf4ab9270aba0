//! Text <-> token ids, built with the `tokenizers` crate from a GGUF vocabulary (byte-level BPE
//! from its merges, `tokenizer.ggml.model = gpt2`; SentencePiece BPE from its scores, `llama`)
//! or from a `tokenizer.json`.

use crate::error::{OracleError, Result};
use crate::gguf::GgufFile;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::normalizers::{NormalizerWrapper, Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::{AddedToken, ModelWrapper, PostProcessorWrapper, PreTokenizedString, PreTokenizer, SplitDelimiterBehavior, TokenizerImpl};
use serde::{Serialize, Serializer};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

fn tok_err(e: impl std::fmt::Display) -> OracleError {
    OracleError::Tokenizer(e.to_string())
}

/// GPT-4-style split used by Qwen2 (and Qwen3) byte-level BPE.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The GGUF pre-tokenizer names (`tokenizer.ggml.pre`) llama.cpp runs as Llama 3's split
/// (with whole-token pre-tokens taken as is, and BOS added by default), as Qwen2's, and as
/// GPT-2's; each group is one behaviour there.
const LLAMA3_PRES: [&str; 9] = ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"];
const QWEN2_PRES: [&str; 6] = ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "megrez"];
const GPT2_PRES: [&str; 17] = [
    "gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo",
    "jais", "trillion", "granite-docling", "exaone4",
];
/// GPT-4o's split (OpenAI's o200k pattern, GPT-OSS's and Llama 4's tokenizer.json): words by
/// letter case, apostrophe endings joined to their word, digits in groups of up to three.
/// llama.cpp runs an ASCII approximation of its letter classes (any letter but a-z counts as
/// upper case, any but A-Z as lower), which splits differently where a lower-case letter meets
/// a non-ASCII upper-case one ("aÉ"); this is the tokenizer.json's own pattern.
const GPT4O_PATTERN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
);
const GPT4O_PRES: [&str; 4] = ["gpt-4o", "llama4", "kanana2", "talkie"];
/// GPT-2's split after every digit is split off alone (StarCoder, SmolLM, Command R, ...).
const DIGITS_PRES: [&str; 7] = ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"];

/// GPT-2's split as a regular expression (the byte-level pre-tokenizer's own).
const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// Falcon's: runs of punctuation first, then GPT-2's split, then digits in threes.
const FALCON_PATTERNS: [&str; 3] = [r"[\p{P}\$\+<=>\^~\|`]+", GPT2_PATTERN, "[0-9][0-9][0-9]"];
/// Qwen3.5's: Qwen2's with combining marks (`\p{M}`) kept inside words.
const QWEN35_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// DeepSeek LLM's and DeepSeek Coder's splits: regular expressions applied one after another,
/// each splitting the pieces the previous left (as their tokenizer.json and llama.cpp do).
const DEEPSEEK_LLM_PATTERNS: [&str; 6] = [
    "[\r\n]",
    "\\s?[A-Za-z\u{B5}\u{C0}-\u{D6}\u{D8}-\u{F6}\u{F8}-\u{1BA}\u{1BC}-\u{1BF}\u{1C4}-\u{293}\u{295}-\u{2AF}\u{370}-\u{373}\u{376}\u{377}\u{37B}-\u{37D}\u{37F}\u{386}\u{388}-\u{38A}\u{38C}\u{38E}-\u{3A1}\u{3A3}-\u{3F5}\u{3F7}-\u{481}\u{48A}-\u{52F}\u{531}-\u{556}\u{10A0}-\u{10C5}\u{13A0}-\u{13F5}\u{13F8}-\u{13FD}\u{1C90}-\u{1CBA}\u{1CBD}-\u{1CBF}\u{1D00}-\u{1D2B}\u{1D6B}-\u{1D77}\u{1D79}-\u{1D9A}\u{1E00}-\u{1F15}\u{1F18}-\u{1F1D}\u{1F20}-\u{1F45}\u{1F48}-\u{1F4D}\u{1F50}-\u{1F57}\u{1F59}\u{1F5B}\u{1F5D}\u{1F5F}-\u{1F7D}\u{1F80}-\u{1FB4}\u{1FB6}-\u{1FBC}\u{1FBE}\u{1FC2}-\u{1FC4}\u{1FC6}-\u{1FCC}\u{1FD0}-\u{1FD3}\u{1FD6}-\u{1FDB}\u{1FE0}-\u{1FEC}\u{1FF2}-\u{1FF4}\u{1FF6}-\u{1FFC}\u{2102}\u{2107}\u{210A}-\u{2113}\u{2115}\u{2119}-\u{211D}\u{2124}\u{2126}\u{2128}\u{212A}-\u{212D}\u{212F}-\u{2134}\u{2139}\u{213C}-\u{213F}\u{2145}-\u{2149}\u{214E}\u{2183}\u{2184}\u{2C00}-\u{2C7B}\u{2C7E}-\u{2CE4}\u{2CEB}-\u{2CEE}\u{2CF2}\u{2CF3}\u{A640}-\u{A66D}\u{A680}-\u{A69B}\u{A722}-\u{A76F}\u{A771}-\u{A787}\u{A78B}-\u{A78E}\u{AB70}-\u{ABBF}\u{FB00}-\u{FB06}\u{FB13}-\u{FB17}\u{FF21}-\u{FF3A}\u{FF41}-\u{FF5A}\u{10400}-\u{1044F}\u{104B0}-\u{104D3}\u{104D8}-\u{104FB}\u{10C80}-\u{10CB2}\u{10CC0}-\u{10CF2}\u{118A0}-\u{118DF}\u{1E900}-\u{1E943}]+",
    "\\s?[!-/:-~\u{FF01}-\u{FF0F}\u{FF1A}-\u{FF5E}\u{2018}-\u{201F}\u{3000}-\u{3002}]+",
    "\\s+$",
    "[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+",
    "\\p{N}+",
];
const DEEPSEEK_CODER_PATTERNS: [&str; 5] = [
    "[\r\n]",
    "\\s?\\p{L}+",
    "\\s?\\p{P}+",
    "[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+",
    "\\p{N}",
];

/// Llama-3 split (digits in groups of up to three).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The same call on either kind of [`Inner`] (two types with the same methods).
macro_rules! on_inner {
    ($inner:expr, $t:ident => $call:expr) => {
        match $inner {
            Inner::Gguf($t) => $call,
            Inner::Json($t) => $call,
        }
    };
}

pub struct Tokenizer {
    inner: Inner,
    pub bos: Option<u32>,
    /// The ids that end a generation: a GGUF's end-of-sequence, end-of-turn and end-of-message
    /// ids (as llama.cpp stops at each); a checkpoint's `eos_token_id`, one id or a list, from
    /// `generation_config.json`, else `config.json`.
    pub eos: Vec<u32>,
    /// Whether `encode` puts `bos` first itself (a GGUF's `add_bos_token`); a `tokenizer.json`
    /// adds its own special tokens, as its post-processor says.
    pub add_bos: bool,
}

impl Tokenizer {
    /// Builds the tokenizer stored in a GGUF file's `tokenizer.ggml.*` metadata: byte-level BPE
    /// (`gpt2`) from its merges, or SentencePiece BPE (`llama`: Llama 2, Mistral, Phi-3) from its
    /// token scores.
    pub fn from_gguf(g: &GgufFile) -> Result<Tokenizer> {
        let model = g.field("tokenizer.ggml.model", |v| v.as_str(), "a string").map_err(tok_err)?.unwrap_or("");
        if !matches!(model, "gpt2" | "llama" | "gemma4") {
            return Err(tok_err(format!(
                "{}: `tokenizer.ggml.model` `{model}` is not supported (byte-level BPE `gpt2`, SentencePiece `llama` and Gemma 4's `gemma4` are)",
                g.path
            )));
        }
        let tokens = g
            .field("tokenizer.ggml.tokens", |v| v.as_array(), "an array")
            .map_err(tok_err)?
            .ok_or_else(|| tok_err(format!("{}: no `tokenizer.ggml.tokens`", g.path)))?;
        let tokens: Vec<&str> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| t.as_str().ok_or_else(|| tok_err(format!("{}: tokenizer.ggml.tokens[{i}] is not a string", g.path))))
            .collect::<Result<_>>()?;
        let types = g.field("tokenizer.ggml.token_type", |v| v.as_array(), "an array").map_err(tok_err)?.unwrap_or(&[]);
        // A special id outside the vocabulary is an error: an end-of-text id that no token has
        // would let generation run on silently.
        let id = |k: &str| -> Result<Option<u32>> {
            match g.field(k, |v| v.as_u64(), "an unsigned integer").map_err(tok_err)? {
                Some(i) if i >= tokens.len() as u64 => Err(tok_err(format!("{}: {k} is {i}, outside the vocabulary of {} tokens", g.path, tokens.len()))),
                i => Ok(i.map(|i| i as u32)),
            }
        };
        // Where a SentencePiece vocabulary does not name them, llama.cpp takes unknown 0, BOS 1
        // and EOS 2 (as Llama 2's vocabulary has them).
        let id_or = |k: &str, spm_default: u32| -> Result<Option<u32>> {
            Ok(id(k)?.or(Some(spm_default).filter(|&d| model == "llama" && (d as usize) < tokens.len())))
        };
        let pre = g.field("tokenizer.ggml.pre", |v| v.as_str(), "a string").map_err(tok_err)?.unwrap_or("default");
        let mut inner = match model {
            "gpt2" => byte_level_bpe(g, &tokens, pre)?,
            "gemma4" => gemma4_bpe(g, &tokens)?,
            _ => sentencepiece_bpe(g, &tokens, types, id_or("tokenizer.ggml.unknown_token_id", 0)?)?,
        };
        // The tokens of one type, each matched whole in the raw text, never split by BPE.
        let of_type = |ty: u64, special: bool| -> Vec<AddedToken> {
            types.iter().zip(&tokens).filter(|(t, _)| t.as_u64() == Some(ty)).map(|(_, s)| AddedToken::from(s.to_string(), special).normalized(false)).collect()
        };
        // Control tokens (type 3), and user-defined ones (type 4: MPT's runs of spaces, Command
        // R's turn markers), which llama.cpp matches whole even where it parses no special tokens.
        inner.add_special_tokens(of_type(3, true)).map_err(tok_err)?;
        inner.add_tokens(of_type(4, false)).map_err(tok_err)?;
        Ok(Tokenizer {
            inner: Inner::Gguf(inner),
            bos: id_or("tokenizer.ggml.bos_token_id", 1)?,
            eos: {
                let mut eos: Vec<u32> = id_or("tokenizer.ggml.eos_token_id", 2)?.into_iter().collect();
                for k in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
                    eos.extend(id(k)?.filter(|i| !eos.contains(i)));
                }
                eos
            },
            // Absent, llama.cpp adds BOS for SentencePiece vocabularies and Llama 3's, not for
            // other BPE ones; for Gemma 4 always, whatever the file says.
            add_bos: model == "gemma4"
                || g.field("tokenizer.ggml.add_bos_token", |v| v.as_bool(), "true or false").map_err(tok_err)?.unwrap_or(model == "llama" || LLAMA3_PRES.contains(&pre)),
        })
    }

    /// Loads the Hugging Face `tokenizer.json` of a checkpoint directory, with its special ids
    /// from `generation_config.json` (when present) and `config.json`: `bos_token_id`, and
    /// `eos_token_id` as one id or a list (Llama 3 Instruct stops at three). An id that is not a
    /// non-negative integer, or lies outside the vocabulary, is an error naming file and key.
    pub fn from_checkpoint(dir: &std::path::Path) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        let text = crate::files::read_to_string(&path).map_err(|e| tok_err(e.to_string()))?;
        // The tokenizers crate panics on a merge whose result is no token and longer than every
        // token (it copies into a buffer of the longest token's size before looking it up), and
        // on a `decoder` that is not JSON (it parses that field on its own, with `expect`): the
        // file is read as JSON here first, and its merges checked.
        let v = serde_json::from_str::<serde_json::Value>(&text).map_err(|e| tok_err(format!("{}: not JSON: {e}", path.display())))?;
        {
            let model = &v["model"];
            if let (Some(vocab), Some(merges)) = (model["vocab"].as_object(), model["merges"].as_array()) {
                let prefix = model["continuing_subword_prefix"].as_str().unwrap_or("");
                let pairs = merges.iter().map(|m| match m {
                    serde_json::Value::String(s) => s.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())),
                    serde_json::Value::Array(ab) if ab.len() == 2 => Some((ab[0].as_str()?.to_string(), ab[1].as_str()?.to_string())),
                    _ => None,
                });
                check_merges(pairs, |t| vocab.contains_key(t), prefix).map_err(|e| tok_err(format!("{}: model.{e}", path.display())))?;
            }
        }
        let mut inner = std::panic::catch_unwind(|| <tokenizers::Tokenizer as std::str::FromStr>::from_str(&text))
            .map_err(|_| tok_err(format!("{}: the tokenizers crate panicked reading it (a malformed tokenizer.json)", path.display())))?
            .map_err(|e| tok_err(format!("{}: {e}", path.display())))?;
        // The tokenizers crate's BPE keeps each model's cached words in a map per thread that it
        // never frees, not even when the model is dropped: with the cache off, a process that
        // builds many tokenizers (a fuzzing campaign, a long test run) does not grow with each.
        let mut model = inner.get_model().clone();
        model.resize_cache(0);
        inner.with_model(model);
        let n_vocab = inner.get_vocab_size(true) as u64;
        let (mut bos, mut eos) = (None, None);
        for name in ["generation_config.json", "config.json"] {
            let file = dir.join(name);
            if !file.exists() {
                continue;
            }
            let text = crate::files::read_to_string(&file).map_err(|e| tok_err(e.to_string()))?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| tok_err(format!("{}: {e}", file.display())))?;
            let ids = |key: &str| -> Result<Option<Vec<u32>>> {
                let bad = |what: &str| tok_err(format!("{}: `{key}` {what}", file.display()));
                let one = |x: &serde_json::Value| match x.as_u64() {
                    Some(i) if i < n_vocab => Ok(i as u32),
                    Some(i) => Err(bad(&format!("is {i}, outside the vocabulary of {n_vocab} tokens"))),
                    None => Err(bad(&format!("is {x}, not a token id or a list of them"))),
                };
                match v.get(key) {
                    None | Some(serde_json::Value::Null) => Ok(None),
                    Some(serde_json::Value::Array(xs)) => xs.iter().map(one).collect::<Result<Vec<_>>>().map(Some),
                    Some(x) => one(x).map(|i| Some(vec![i])),
                }
            };
            // generation_config.json comes first and wins.
            if bos.is_none() {
                bos = ids("bos_token_id")?.and_then(|b| b.first().copied());
            }
            if eos.is_none() {
                eos = ids("eos_token_id")?;
            }
        }
        Ok(Tokenizer { inner: Inner::Json(inner), bos, eos: eos.unwrap_or_default(), add_bos: false })
    }

    /// Token ids of `text` (with BOS first when the model asks for it).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        // With the special tokens a tokenizer.json's post-processor adds (none for a GGUF's).
        let enc = on_inner!(&self.inner, t => t.encode(text, true)).map_err(tok_err)?;
        let mut ids = Vec::new();
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        on_inner!(&self.inner, t => t.decode(ids, false)).map_err(tok_err)
    }

    /// Writes the tokenizer as a Hugging Face `tokenizer.json`.
    pub fn save(&self, path: &std::path::Path) -> Result<()> {
        on_inner!(&self.inner, t => t.save(path, false)).map_err(|e| tok_err(format!("{}: {e}", path.display())))
    }

    /// The vocabulary's string for an id (`Ġ`/`▁` for spaces, `<0x0A>` for a byte token).
    pub fn piece(&self, id: u32) -> Option<String> {
        on_inner!(&self.inner, t => t.id_to_token(id))
    }

    pub fn vocab_size(&self) -> usize {
        on_inner!(&self.inner, t => t.get_vocab_size(true))
    }
}

/// A tokenizer as built: from a GGUF's metadata, with its pre-tokenizer shared
/// ([`SharedPre`]), or as a `tokenizer.json` describes it.
enum Inner {
    Gguf(GgufTokenizer),
    Json(tokenizers::Tokenizer),
}

type GgufTokenizer = TokenizerImpl<ModelWrapper, NormalizerWrapper, SharedPre, PostProcessorWrapper, DecoderWrapper>;

/// A GGUF tokenizer's pre-tokenizer, built once per process and shared by every tokenizer that
/// splits the same way: the splits are regular expressions of a fixed set (one per
/// `tokenizer.ggml.pre` family), and compiling one takes longer than building the rest of a
/// small vocabulary's tokenizer. It splits as the pre-tokenizer it holds and is written out as it.
#[derive(Clone)]
struct SharedPre(Arc<Sequence>);

impl PreTokenizer for SharedPre {
    fn pre_tokenize(&self, pretokenized: &mut PreTokenizedString) -> tokenizers::Result<()> {
        self.0.pre_tokenize(pretokenized)
    }
}

impl Serialize for SharedPre {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

/// The shared pre-tokenizer of `split`, built the first time it is asked for.
fn shared_pre(split: PreSplit) -> std::result::Result<SharedPre, String> {
    static BUILT: OnceLock<Mutex<HashMap<PreSplit, Arc<Sequence>>>> = OnceLock::new();
    // A panic elsewhere while the lock was held leaves the map as it was: whole entries only.
    let mut built = BUILT.get_or_init(Default::default).lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(pre) = built.get(&split) {
        return Ok(SharedPre(Arc::clone(pre)));
    }
    let pre = Arc::new(split_sequence(split)?);
    built.insert(split, Arc::clone(&pre));
    Ok(SharedPre(pre))
}

/// The split a byte-level BPE pre-tokenizer name stands for (and Gemma 4's, into lines).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum PreSplit {
    /// Gemma 4's: lines and runs of newlines (`tokenizer.ggml.model = gemma4`, no name).
    Lines,
    Gpt2,
    Digits,
    Falcon,
    Qwen2,
    Qwen35,
    Llama3,
    Gpt4o,
    DeepSeekLlm,
    DeepSeekCoder,
}

fn pre_split(pre: &str) -> std::result::Result<PreSplit, String> {
    match pre {
        p if p == "default" || GPT2_PRES.contains(&p) => Ok(PreSplit::Gpt2),
        p if DIGITS_PRES.contains(&p) => Ok(PreSplit::Digits),
        "falcon" => Ok(PreSplit::Falcon),
        p if QWEN2_PRES.contains(&p) => Ok(PreSplit::Qwen2),
        "qwen35" => Ok(PreSplit::Qwen35),
        p if LLAMA3_PRES.contains(&p) => Ok(PreSplit::Llama3),
        p if GPT4O_PRES.contains(&p) => Ok(PreSplit::Gpt4o),
        "deepseek-llm" => Ok(PreSplit::DeepSeekLlm),
        "deepseek-coder" => Ok(PreSplit::DeepSeekCoder),
        other => Err(format!(
            "tokenizer.ggml.pre `{other}` is not supported (default, falcon, qwen35, deepseek-llm, deepseek-coder, {}, {}, {}, {}, {})",
            GPT2_PRES.join(", "),
            DIGITS_PRES.join(", "),
            QWEN2_PRES.join(", "),
            LLAMA3_PRES.join(", "),
            GPT4O_PRES.join(", ")
        )),
    }
}

/// Why this tool builds no tokenizer from a GGUF's metadata — none stored, a kind other than
/// `gpt2` and `llama`, a pre-tokenizer it does not know — or None when it builds one (which may
/// still fail on malformed metadata). Such a model runs on token ids.
pub fn gguf_gap(g: &GgufFile) -> Result<Option<String>> {
    let model = g.field("tokenizer.ggml.model", |v| v.as_str(), "a string").map_err(tok_err)?;
    let pre = g.field("tokenizer.ggml.pre", |v| v.as_str(), "a string").map_err(tok_err)?.unwrap_or("default");
    Ok(match model {
        None => Some("it stores no tokenizer (`tokenizer.ggml.model`)".into()),
        Some("gpt2") => pre_split(pre).err(),
        Some("llama" | "gemma4") => None,
        Some(other) => Some(format!("its tokenizer kind `{other}` is not one this tool builds (byte-level BPE `gpt2`, SentencePiece `llama`, Gemma 4's `gemma4`)")),
    })
}

/// Byte-level BPE (`gpt2`) from a GGUF's vocabulary and merges, split as `pre` (its
/// `tokenizer.ggml.pre`) names.
fn byte_level_bpe(g: &GgufFile, tokens: &[&str], pre: &str) -> Result<GgufTokenizer> {
    let vocab = vocab_of(tokens);
    let merges = gguf_merges(g, &vocab)?;
    // Llama 3 takes a pre-token that is a whole token as is, before any merge (as llama.cpp and
    // its tokenizer.json do): "Việt" is one token there, not the three its merges reach.
    let whole_words = LLAMA3_PRES.contains(&pre);
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).ignore_merges(whole_words).cache_capacity(0).build().map_err(tok_err)?;
    let mut inner = GgufTokenizer::new(bpe.into());
    let pre_tok = pre_tokenizer(pre).map_err(|e| tok_err(format!("{}: {e}", g.path)))?;
    inner.with_pre_tokenizer(Some(pre_tok));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(inner)
}

/// A GGUF's BPE merges (`tokenizer.ggml.merges`), each two tokens split at the first space after
/// the first character, as llama.cpp splits them (Gemma 4's tokens of tabs and newlines hold a
/// space in their merges, never as their first character).
fn gguf_merges(g: &GgufFile, vocab: &tokenizers::models::bpe::Vocab) -> Result<Vec<(String, String)>> {
    let mut merges = Vec::new();
    if let Some(ms) = g.field("tokenizer.ggml.merges", |v| v.as_array(), "an array").map_err(tok_err)? {
        for (i, m) in ms.iter().enumerate() {
            let s = m.as_str().ok_or_else(|| tok_err(format!("{}: tokenizer.ggml.merges[{i}] is not a string", g.path)))?;
            let first = s.chars().next().map_or(0, char::len_utf8);
            let (a, b) = s[first..]
                .find(' ')
                .map(|at| (&s[..first + at], &s[first + at + 1..]))
                .ok_or_else(|| tok_err(format!("{}: tokenizer.ggml.merges[{i}] `{s}` is not two tokens", g.path)))?;
            merges.push((a.to_string(), b.to_string()));
        }
    }
    check_merges(merges.iter().map(|(a, b)| Some((a.clone(), b.clone()))), |t| vocab.contains_key(t), "").map_err(|e| tok_err(format!("{}: tokenizer.ggml.{e}", g.path)))?;
    Ok(merges)
}

/// Every BPE merge (a, b) must make a token (`a` followed by `b` less its first `prefix`-length
/// bytes, the continuing-subword prefix, as the tokenizers crate cuts it): the crate refuses one
/// that does not only after copying it into a buffer sized by the longest token, which panics
/// when it is longer (and cuts a `b` shorter than the prefix with an underflow). Malformed
/// entries (None) are left for the crate to refuse. Err names the merge: `merges[i] ...`.
fn check_merges(merges: impl Iterator<Item = Option<(String, String)>>, is_token: impl Fn(&str) -> bool, prefix: &str) -> std::result::Result<(), String> {
    for (i, m) in merges.enumerate() {
        let Some((a, b)) = m else { continue };
        if !(is_token(&a) && is_token(&b)) {
            continue;
        }
        let Some(tail) = b.get(prefix.len()..) else {
            return Err(format!("merges[{i}] `{a} {b}`: `{b}` has no whole characters after its first {} bytes, which the merge cuts as the continuing-subword prefix `{prefix}`", prefix.len()));
        };
        let made = format!("{a}{tail}");
        if !is_token(&made) {
            return Err(format!("merges[{i}] `{a} {b}` makes `{made}`, which is not a token of the vocabulary"));
        }
    }
    Ok(())
}

/// A vocabulary's tokens and their ids (positions).
fn vocab_of(tokens: &[&str]) -> tokenizers::models::bpe::Vocab {
    tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect()
}

/// SentencePiece-style pieces: spaces become `▁` before the model sees the text.
fn escape_spaces() -> Result<NormalizerWrapper> {
    Ok(NormalizerWrapper::Replace(Replace::new(" ", "\u{2581}").map_err(tok_err)?))
}

/// And back: `▁` to spaces, `<0xXX>` tokens to their bytes, the pieces joined.
fn unescape_spaces() -> Result<Vec<DecoderWrapper>> {
    Ok(vec![DecoderWrapper::Replace(Replace::new("\u{2581}", " ").map_err(tok_err)?), DecoderWrapper::ByteFallback(ByteFallback::new()), DecoderWrapper::Fuse(Fuse::new())])
}

/// Gemma 4's BPE (`tokenizer.ggml.model = gemma4`) as llama.cpp runs it: SentencePiece-style
/// pieces (spaces become `▁`, no space prefix) merged by the GGUF's merges over raw UTF-8, the
/// text split only into lines and runs of newlines (a run that is itself a token taken whole);
/// a piece no token covers becomes its bytes' `<0xXX>` tokens.
fn gemma4_bpe(g: &GgufFile, tokens: &[&str]) -> Result<GgufTokenizer> {
    let vocab = vocab_of(tokens);
    let merges = gguf_merges(g, &vocab)?;
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true).cache_capacity(0).build().map_err(tok_err)?;
    let mut inner = GgufTokenizer::new(bpe.into());
    inner.with_normalizer(Some(escape_spaces()?)).map_err(tok_err)?;
    inner.with_pre_tokenizer(Some(shared_pre(PreSplit::Lines).map_err(tok_err)?));
    inner.with_decoder(Some(DecoderSequence::new(unescape_spaces()?)));
    Ok(inner)
}

/// The pre-tokenizer a byte-level BPE pre-tokenizer name (`tokenizer.ggml.pre`) stands for:
/// the split into pre-tokens, then the byte-to-character map.
fn pre_tokenizer(pre: &str) -> std::result::Result<SharedPre, String> {
    shared_pre(pre_split(pre)?)
}

/// The pre-tokenizer of a split, compiled.
fn split_sequence(split_kind: PreSplit) -> std::result::Result<Sequence, String> {
    let byte_level = |use_regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    let split = |pat: &str| -> std::result::Result<PreTokenizerWrapper, String> {
        Ok(PreTokenizerWrapper::Split(
            Split::new(SplitPattern::Regex(pat.to_string()), SplitDelimiterBehavior::Isolated, false).map_err(|e| e.to_string())?,
        ))
    };
    Ok(match split_kind {
        PreSplit::Gpt2 => Sequence::new(vec![byte_level(true)]),
        PreSplit::Digits => Sequence::new(vec![PreTokenizerWrapper::Digits(Digits::new(true)), byte_level(true)]),
        PreSplit::Qwen2 => Sequence::new(vec![split(QWEN2_PATTERN)?, byte_level(false)]),
        PreSplit::Qwen35 => Sequence::new(vec![split(QWEN35_PATTERN)?, byte_level(false)]),
        PreSplit::Llama3 => Sequence::new(vec![split(LLAMA3_PATTERN)?, byte_level(false)]),
        PreSplit::Gpt4o => Sequence::new(vec![split(GPT4O_PATTERN)?, byte_level(false)]),
        PreSplit::DeepSeekLlm | PreSplit::DeepSeekCoder | PreSplit::Falcon => {
            let patterns: &[&str] = match split_kind {
                PreSplit::DeepSeekLlm => &DEEPSEEK_LLM_PATTERNS,
                PreSplit::DeepSeekCoder => &DEEPSEEK_CODER_PATTERNS,
                _ => &FALCON_PATTERNS,
            };
            let mut steps = patterns.iter().map(|p| split(p)).collect::<std::result::Result<Vec<_>, _>>()?;
            steps.push(byte_level(false));
            Sequence::new(steps)
        }
        PreSplit::Lines => Sequence::new(vec![split("[^\n]+|[\n]+")?]),
    })
}

/// SentencePiece BPE (`llama`) from a GGUF's vocabulary and token scores, as llama.cpp runs it:
/// spaces become `▁` (one more before the text unless `add_space_prefix` is false), then the
/// adjacent pair whose joined piece is a token with the highest score is merged, again and
/// again; a character no token covers becomes its UTF-8 bytes' `<0xXX>` tokens. As BPE merges:
/// every way to split each token into two tokens, ranked by the whole token's score.
fn sentencepiece_bpe(g: &GgufFile, tokens: &[&str], types: &[crate::gguf::Value], unk: Option<u32>) -> Result<GgufTokenizer> {
    let scores = g.field("tokenizer.ggml.scores", |v| v.as_array(), "an array").map_err(tok_err)?.unwrap_or(&[]);
    if !scores.is_empty() && scores.len() != tokens.len() {
        return Err(tok_err(format!("{}: tokenizer.ggml.scores has {} entries for {} tokens", g.path, scores.len(), tokens.len())));
    }
    let score = |i: usize| -> Result<f64> {
        match scores.get(i) {
            None => Ok(0.0),
            Some(v) => v.as_f64().filter(|s| s.is_finite()).ok_or_else(|| tok_err(format!("{}: tokenizer.ggml.scores[{i}] is {v:?}, not a finite number", g.path))),
        }
    };
    let vocab = vocab_of(tokens);
    // Byte tokens (type 6) stand for bytes, never for their text `<0x41>`.
    let is_byte = |i: usize| types.get(i).and_then(|t| t.as_u64()) == Some(6);
    let mut ranked = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        if is_byte(i) {
            continue;
        }
        for (at, _) in t.char_indices().skip(1) {
            let (a, b) = t.split_at(at);
            if let (Some(&ia), Some(&ib)) = (vocab.get(a), vocab.get(b)) {
                if !is_byte(ia as usize) && !is_byte(ib as usize) {
                    ranked.push((score(i)?, i, at, a, b));
                }
            }
        }
    }
    // Highest score first; ties in token and then split order, so the ranks are deterministic.
    ranked.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
    let merges = ranked.into_iter().map(|(_, _, _, a, b)| (a.to_string(), b.to_string())).collect();
    let mut bpe = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true).fuse_unk(true).cache_capacity(0);
    if let Some(u) = unk {
        bpe = bpe.unk_token(tokens[u as usize].to_string());
    }
    let mut inner = GgufTokenizer::new(bpe.build().map_err(tok_err)?.into());
    let space_prefix = g.field("tokenizer.ggml.add_space_prefix", |v| v.as_bool(), "true or false").map_err(tok_err)?.unwrap_or(true);
    let escape = escape_spaces()?;
    let mut decoders = unescape_spaces()?;
    if space_prefix {
        inner
            .with_normalizer(Some(NormalizerSequence::new(vec![NormalizerWrapper::Prepend(Prepend::new("\u{2581}".into())), escape])))
            .map_err(tok_err)?;
        decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    } else {
        inner.with_normalizer(Some(escape)).map_err(tok_err)?;
    }
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgufWriter, Value};

    /// A SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, two byte tokens, and pieces with scores.
    fn spm(scores: &[(&str, f32)], extra: &[(&str, Value)]) -> Result<Tokenizer> {
        let mut tokens = vec![("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3), ("<0xC3>", 0.0, 6), ("<0xA9>", 0.0, 6)];
        tokens.extend(scores.iter().map(|&(t, s)| (t, s, 1)));
        let mut meta = vec![
            ("tokenizer.ggml.model", Value::String("llama".into())),
            ("tokenizer.ggml.tokens", Value::Array(tokens.iter().map(|t| Value::String(t.0.into())).collect())),
            ("tokenizer.ggml.scores", Value::Array(tokens.iter().map(|t| Value::F32(t.1)).collect())),
            ("tokenizer.ggml.token_type", Value::Array(tokens.iter().map(|t| Value::I32(t.2)).collect())),
            ("tokenizer.ggml.unknown_token_id", Value::U32(0)),
            ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ];
        for (k, v) in extra {
            meta.retain(|m| m.0 != *k);
            meta.push((k, v.clone()));
        }
        let mut w = GgufWriter::new();
        for (k, v) in meta {
            w.meta(k, v);
        }
        Tokenizer::from_gguf(&GgufFile::from_bytes("spm.gguf", w.to_bytes())?)
    }

    const PIECES: [(&str, f32); 8] = [("\u{2581}", -1.0), ("a", -2.0), ("b", -2.0), ("c", -2.0), ("ab", -3.0), ("bc", -4.0), ("\u{2581}a", -5.0), ("\u{2581}bc", -6.0)];

    fn id(tok: &Tokenizer, piece: &str) -> u32 {
        let Inner::Gguf(t) = &tok.inner else { panic!("a GGUF tokenizer") };
        t.token_to_id(piece).unwrap()
    }

    #[test]
    fn sentencepiece_merges_the_highest_scored_pair_first() {
        let tok = spm(&PIECES, &[]).unwrap();
        // "▁abc": `ab` (-3) beats `bc` (-4) and `▁a` (-5); then nothing joins.
        let ids = |v: &[&str]| v.iter().map(|p| id(&tok, p)).collect::<Vec<_>>();
        assert_eq!(tok.encode("abc").unwrap(), [&[1][..], &ids(&["\u{2581}", "ab", "c"])].concat(), "BOS first by default");
        // With `bc` scored above `ab`, the text goes the other way: `bc`, then `▁a`.
        let mut swapped = PIECES;
        swapped[5].1 = -2.5;
        let tok2 = spm(&swapped, &[]).unwrap();
        assert_eq!(tok2.encode("abc").unwrap()[1..], [id(&tok2, "\u{2581}a"), id(&tok2, "bc")]);
        // A space is `▁`; a character no piece covers is its UTF-8 bytes; decoding gives the text back.
        let enc = tok.encode("a bc é").unwrap();
        assert_eq!(enc[1..], ids(&["\u{2581}a", "\u{2581}bc", "\u{2581}", "<0xC3>", "<0xA9>"]));
        assert_eq!(tok.decode(&enc[1..]).unwrap(), "a bc é");
        assert!(tok.encode("").unwrap() == [1], "no prefix on empty text");
    }

    /// A checkpoint's tokenizer.json adds the specials its post-processor names; its stop ids come
    /// from generation_config.json (a list) before config.json; bad ids are errors naming the file.
    #[test]
    fn a_checkpoint_tokenizer_takes_its_specials_and_stop_ids_from_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let tj = dir.path().join("tokenizer.json");
        spm(&PIECES, &[]).unwrap().save(&tj).unwrap();
        let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&tj).unwrap()).unwrap();
        json["post_processor"] = serde_json::json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        });
        std::fs::write(&tj, json.to_string()).unwrap();
        let write = |name: &str, v: serde_json::Value| std::fs::write(dir.path().join(name), v.to_string()).unwrap();
        write("config.json", serde_json::json!({"bos_token_id": 1, "eos_token_id": 2}));
        let tok = Tokenizer::from_checkpoint(dir.path()).unwrap();
        let abc = tok.encode("abc").unwrap();
        assert_eq!((abc[0], abc.len(), tok.bos, tok.eos.as_slice()), (1, 4, Some(1), &[2][..]), "BOS by the post-processor, once");
        write("generation_config.json", serde_json::json!({"eos_token_id": [2, 9]}));
        assert_eq!(Tokenizer::from_checkpoint(dir.path()).unwrap().eos, [2, 9]);
        for (bad, says) in [(serde_json::json!("2"), "is \"2\", not a token id"), (serde_json::json!([2, 99]), "is 99, outside the vocabulary of 13")] {
            write("generation_config.json", serde_json::json!({"eos_token_id": bad}));
            let e = Tokenizer::from_checkpoint(dir.path()).err().expect("refused").to_string();
            assert!(e.contains("generation_config.json: `eos_token_id`") && e.contains(says), "{e}");
        }
    }

    #[test]
    fn sentencepiece_options_and_bad_scores() {
        let no_prefix = spm(&PIECES, &[("tokenizer.ggml.add_space_prefix", Value::Bool(false)), ("tokenizer.ggml.add_bos_token", Value::Bool(false))]).unwrap();
        assert_eq!(no_prefix.encode("abc").unwrap(), [id(&no_prefix, "ab"), id(&no_prefix, "c")]);
        assert_eq!(no_prefix.decode(&no_prefix.encode(" a").unwrap()).unwrap(), " a");
        let mut nan = PIECES;
        nan[4].1 = f32::NAN;
        let e = spm(&nan, &[]).err().expect("a NaN score is an error").to_string();
        assert!(e.contains("tokenizer.ggml.scores[9]") && e.contains("finite"), "{e}");
        let e = spm(&PIECES, &[("tokenizer.ggml.scores", Value::Array(vec![Value::F32(0.0)]))]).err().unwrap().to_string();
        assert!(e.contains("1 entries for 13 tokens"), "{e}");
        let e = spm(&PIECES, &[("tokenizer.ggml.model", Value::String("t5".into()))]).err().unwrap().to_string();
        assert!(e.contains("`t5` is not supported"), "{e}");
    }

    /// The pre-tokens a byte-level pre-tokenizer name splits `text` into (in byte-level characters).
    fn pre_tokens(pre: &str, text: &str) -> Vec<String> {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let mut s = PreTokenizedString::from(text);
        pre_tokenizer(pre).unwrap().pre_tokenize(&mut s).unwrap();
        s.get_splits(OffsetReferential::Original, OffsetType::Char).into_iter().map(|(t, _, _)| t.to_string()).collect()
    }

    #[test]
    fn pre_tokenizer_names_split_as_llama_cpp_runs_them() {
        // Qwen3.5 keeps a combining mark in its word; Qwen2 splits it off (its test vectors alone
        // do not tell the two apart).
        // (U+0301 is the bytes CC 81, `Ìģ` in byte-level characters.)
        let decomposed = "cafe\u{301} ok";
        assert_eq!(pre_tokens("qwen35", decomposed), ["cafe\u{cc}\u{123}", "Ġok"]);
        assert_eq!(pre_tokens("qwen2", decomposed), ["cafe", "\u{cc}\u{123}", "Ġok"]);
        // Falcon: punctuation runs alone, then GPT-2's split, then digits in threes.
        assert_eq!(pre_tokens("falcon", "a+=b 12345"), ["a", "+=", "b", "Ġ", "123", "45"]);
        // StarCoder, Command R, ...: every digit alone; MPT and OLMo: GPT-2's split.
        assert_eq!(pre_tokens("command-r", "x 123"), ["x", "Ġ", "1", "2", "3"]);
        assert_eq!(pre_tokens("mpt", "x 123"), ["x", "Ġ123"]);
        // GPT-4o / GPT-OSS: words by case, "'t" kept, digits in threes, "/" before a word joins
        // it; a non-ASCII capital starts a word ("aÉb" is "a" + "Éb"; llama.cpp's approximation
        // would keep "aÉb" whole). Expected: what a tokenizer.json with this pattern splits.
        assert_eq!(pre_tokens("gpt-4o", "HelloWorld don't 12345"), ["Hello", "World", "Ġdon't", "Ġ", "123", "45"]);
        assert_eq!(pre_tokens("gpt-4o", "aÉb CAFÉs\n\n x/y"), ["a", "Ãīb", "ĠCAFÃīs", "ĊĊ", "Ġx", "/y"]);
        let e = pre_tokenizer("tekken").err().unwrap();
        assert!(e.contains("`tekken` is not supported") && e.contains("falcon"), "{e}");
    }

    #[test]
    fn a_split_is_compiled_once_and_written_out_as_itself() {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        // Two names of one family share one compiled pre-tokenizer; another family has its own.
        let (qwen2, r1, llama3) = (pre_tokenizer("qwen2").unwrap(), pre_tokenizer("deepseek-r1-qwen").unwrap(), pre_tokenizer("llama3").unwrap());
        assert!(Arc::ptr_eq(&qwen2.0, &r1.0) && !Arc::ptr_eq(&qwen2.0, &llama3.0));
        // Written out (`save`), it is the pre-tokenizer it holds, and read back it splits alike.
        let json = serde_json::to_value(&llama3).unwrap();
        assert_eq!(json, serde_json::to_value(&*llama3.0).unwrap());
        let back: PreTokenizerWrapper = serde_json::from_value(json).unwrap();
        let text = "Hello world's 12345\n\n  x";
        let mut s = PreTokenizedString::from(text);
        back.pre_tokenize(&mut s).unwrap();
        let splits: Vec<String> = s.get_splits(OffsetReferential::Original, OffsetType::Char).into_iter().map(|(t, _, _)| t.to_string()).collect();
        assert_eq!(splits, pre_tokens("llama3", text));
        assert_eq!(splits[..4], ["Hello", "Ġworld", "'s", "Ġ"]);
    }

    #[test]
    fn user_defined_tokens_are_matched_whole() {
        // PIECES and one user-defined token (type 4).
        let with_user = |token: &'static str| {
            let mut pieces = PIECES.to_vec();
            pieces.push((token, 0.0));
            let mut types: Vec<Value> = [2, 3, 3, 6, 6].into_iter().map(Value::I32).collect();
            types.extend(PIECES.iter().map(|_| Value::I32(1)));
            types.push(Value::I32(4));
            spm(&pieces, &[("tokenizer.ggml.token_type", Value::Array(types)), ("tokenizer.ggml.add_bos_token", Value::Bool(false))]).unwrap()
        };
        // As llama.cpp: the text after a token matched whole gets its own space prefix.
        let tok = with_user("<x>");
        let ids = tok.encode("ab<x>c").unwrap();
        assert_eq!(ids, ["\u{2581}", "ab", "<x>", "\u{2581}", "c"].map(|p| id(&tok, p)));
        assert_eq!(tok.decode(&ids).unwrap(), "ab<x> c");
        // An empty one (a malformed vocabulary) matches nothing, and panics nothing.
        let odd = with_user("");
        assert_eq!(odd.encode("ab").unwrap(), ["\u{2581}", "ab"].map(|p| id(&odd, p)));
    }

    #[test]
    fn gemma4_merges_pieces_with_escaped_spaces_and_always_adds_bos() {
        let tokens = ["<pad>", "<eos>", "<bos>", "<0xC3>", "<0xA9>", "\u{2581}", "a", "b", "ab", "\u{2581}ab", "\n", "\n\n"];
        let types = [3, 3, 3, 6, 6, 1, 1, 1, 1, 1, 1, 1];
        let mut w = GgufWriter::new();
        w.meta("tokenizer.ggml.model", Value::String("gemma4".into()));
        w.meta("tokenizer.ggml.tokens", Value::Array(tokens.iter().map(|t| Value::String(t.to_string())).collect()));
        w.meta("tokenizer.ggml.token_type", Value::Array(types.iter().map(|&t| Value::I32(t)).collect()));
        w.meta("tokenizer.ggml.merges", Value::Array(["a b", "\u{2581} ab", "\n \n"].iter().map(|m| Value::String(m.to_string())).collect()));
        w.meta("tokenizer.ggml.bos_token_id", Value::U32(2));
        // llama.cpp adds BOS for Gemma 4 even where the file says not to.
        w.meta("tokenizer.ggml.add_bos_token", Value::Bool(false));
        let tok = Tokenizer::from_gguf(&GgufFile::from_bytes("gemma4.gguf", w.to_bytes()).unwrap()).unwrap();
        let text = " ab\n\n\u{e9}";
        let ids = tok.encode(text).unwrap();
        assert_eq!(ids, [2, 9, 11, 3, 4], "BOS, `▁ab` (no space prefix), one newline token, é as its two bytes");
        assert_eq!(tok.decode(&ids[1..]).unwrap(), text);
    }

    /// A merge whose result is no token and longer than every token (the tokenizers crate
    /// panicked on it, copying it into a buffer sized by the longest token) is an error naming
    /// the merge, from a GGUF's metadata and from a checkpoint's tokenizer.json.
    #[test]
    fn a_merge_that_makes_no_token_is_an_error_not_a_panic() {
        for model in ["gpt2", "gemma4"] {
            let mut w = GgufWriter::new();
            w.meta("tokenizer.ggml.model", Value::String(model.into()));
            w.meta("tokenizer.ggml.tokens", Value::Array(["a", "b"].iter().map(|t| Value::String(t.to_string())).collect()));
            w.meta("tokenizer.ggml.merges", Value::Array(vec![Value::String("a b".into())]));
            let e = Tokenizer::from_gguf(&GgufFile::from_bytes("m.gguf", w.to_bytes()).unwrap()).err().unwrap_or_else(|| panic!("{model}: accepted")).to_string();
            assert!(e.contains("m.gguf: tokenizer.ggml.merges[0] `a b` makes `ab`, which is not a token of the vocabulary"), "{model}: {e}");
        }
        let dir = tempfile::tempdir().unwrap();
        for merges in [r#"["a b"]"#, r#"[["a", "b"]]"#] {
            std::fs::write(dir.path().join("tokenizer.json"), format!(r#"{{"model": {{"type": "BPE", "vocab": {{"a": 0, "b": 1}}, "merges": {merges}}}}}"#)).unwrap();
            let e = Tokenizer::from_checkpoint(dir.path()).err().expect("accepted").to_string();
            assert!(e.contains("tokenizer.json: model.merges[0] `a b` makes `ab`, which is not a token of the vocabulary"), "{e}");
        }
        // With a continuing-subword prefix the crate cuts the second token's first bytes: one
        // shorter than the prefix is refused too, and a well-formed merge loads.
        let with_prefix = |merge: &str| format!(r###"{{"model": {{"type": "BPE", "vocab": {{"a": 0, "b": 1, "##b": 2, "ab": 3}}, "merges": ["{merge}"], "continuing_subword_prefix": "##"}}}}"###);
        std::fs::write(dir.path().join("tokenizer.json"), with_prefix("a b")).unwrap();
        let e = Tokenizer::from_checkpoint(dir.path()).err().expect("accepted").to_string();
        assert!(e.contains("model.merges[0] `a b`: `b` has no whole characters after its first 2 bytes, which the merge cuts as the continuing-subword prefix `##`"), "{e}");
        std::fs::write(dir.path().join("tokenizer.json"), with_prefix("a ##b")).unwrap();
        Tokenizer::from_checkpoint(dir.path()).unwrap();
        // A decoder holding a control character inside a string (not JSON): the crate parsed
        // that field on its own and panicked (found by the `checkpoint` fuzz target).
        std::fs::write(dir.path().join("tokenizer.json"), "{\"decoder\": {\"type\": \"Byte\u{c}Level\"}, \"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}}").unwrap();
        let e = Tokenizer::from_checkpoint(dir.path()).err().expect("accepted").to_string();
        assert!(e.contains("tokenizer.json: not JSON: control character"), "{e}");
    }

    /// A SentencePiece vocabulary that names no unknown, BOS or EOS id gets llama.cpp's 0, 1
    /// and 2: text no piece or byte token covers becomes the unknown token (it was dropped
    /// without a word), and BOS is added.
    #[test]
    fn sentencepiece_special_ids_default_as_in_llama_cpp() {
        let tokens = [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("\u{2581}", 1), ("a", 1), ("\u{2581}a", 1)];
        let mut w = GgufWriter::new();
        w.meta("tokenizer.ggml.model", Value::String("llama".into()));
        w.meta("tokenizer.ggml.tokens", Value::Array(tokens.iter().map(|t| Value::String(t.0.into())).collect()));
        w.meta("tokenizer.ggml.scores", Value::Array(tokens.iter().map(|t| Value::F32(-(t.0.len() as f32))).collect()));
        w.meta("tokenizer.ggml.token_type", Value::Array(tokens.iter().map(|t| Value::I32(t.1)).collect()));
        let tok = Tokenizer::from_gguf(&GgufFile::from_bytes("spm.gguf", w.to_bytes()).unwrap()).unwrap();
        assert_eq!((tok.bos, tok.eos.as_slice()), (Some(1), &[2][..]));
        assert_eq!(tok.encode("a z").unwrap(), [1, 5, 3, 0], "BOS, `▁a`, `▁`, and `z` (no piece, no byte token) as <unk>");
    }
}
