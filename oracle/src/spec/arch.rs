//! The model architectures the loaders read, as a table (one row each, as `quant::TRAITS` is
//! for weight types). The architecture's names — GGUF's `general.architecture`, a checkpoint's
//! `model_type`s — are parsed here, once; everything after matches on [`Arch`] or reads its row,
//! so a new architecture is a row and a list of compile errors, not a search for strings.

use super::RopeStyle;

/// A model architecture, as GGUF names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Llama (and the checkpoints of Mistral and Mixtral, which convert to it).
    Llama,
    /// GGUF files that name themselves `mistral` or `mixtral` (older converters): read as Llama.
    Mistral,
    Mixtral,
    Qwen2,
    Qwen3,
    Qwen2Moe,
    Qwen3Moe,
    Phi3,
    Gemma2,
    Gemma3,
    GptOss,
    /// Mamba-2: state-space layers only, no feed-forward blocks.
    Mamba2,
    /// Granite 4.0-H (llama.cpp's `granitehybrid`): Mamba-2 layers beside attention layers, each
    /// followed by an FFN, and Granite's scales.
    GraniteHybrid,
    /// Qwen3-Next: gated DeltaNet layers beside gated attention layers, MoE with a gated shared
    /// expert.
    Qwen3Next,
    Deepseek2,
}

/// What an architecture is, as the loaders and the interpreters need it.
#[derive(Clone, Copy, Debug)]
pub struct ArchRow {
    pub arch: Arch,
    /// GGUF's `general.architecture` (the prefix of its metadata keys).
    pub gguf: &'static str,
    /// Transformers' `model_type`s whose checkpoints convert to it.
    pub model_types: &'static [&'static str],
    /// How a GGUF file pairs RoPE's elements (a checkpoint is always rotate-half).
    pub rope: RopeStyle,
    /// Gemma's sandwich norms, scaled embeddings and GELU; Gemma 2's soft-capping.
    pub gemma: Option<GemmaKind>,
    /// Per-head RMSNorm of Q and K (a checkpoint's; a GGUF says so by holding the tensors).
    pub qk_norm: bool,
    /// Biases on Q, K and V whatever `attention_bias` says, and none on the output (Qwen2).
    pub qkv_bias: bool,
    /// Q/K/V and gate/up stored as one fused tensor each (Phi-3).
    pub fused: bool,
    /// A MoE router's chosen weights renormalized to sum to 1 when a GGUF does not say.
    pub moe_normalize_default: bool,
    /// Granite's scales (GGUF `embedding_scale`, `attention.scale`, `residual_scale`,
    /// `logit_scale`), and RoPE only where `rope.scaling.finetuned` says so.
    pub granite: bool,
    /// Qwen3-Next's structure: its recurrent layers gated DeltaNets (`attention.recurrent_layers`,
    /// else every layer but each `full_attention_interval`-th), its attention gated, its FFN
    /// norm stored as `post_attention_norm`, and (a checkpoint's) RMSNorm weights stored less one.
    pub qwen_next: bool,
    /// Multi-head latent attention (DeepSeek V2/V3's `deepseek2`).
    pub mla: bool,
}

/// Which Gemma.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmaKind {
    Gemma2,
    Gemma3,
}

const fn row(arch: Arch, gguf: &'static str, model_types: &'static [&'static str], rope: RopeStyle) -> ArchRow {
    ArchRow { arch, gguf, model_types, rope, gemma: None, qk_norm: false, qkv_bias: false, fused: false, moe_normalize_default: false, granite: false, qwen_next: false, mla: false }
}

/// Every architecture, one row each.
pub const ARCHES: [ArchRow; 15] = [
    ArchRow { moe_normalize_default: true, ..row(Arch::Llama, "llama", &["llama", "mistral", "mixtral"], RopeStyle::Normal) },
    row(Arch::Mistral, "mistral", &[], RopeStyle::Normal),
    ArchRow { moe_normalize_default: true, ..row(Arch::Mixtral, "mixtral", &[], RopeStyle::Normal) },
    ArchRow { qkv_bias: true, ..row(Arch::Qwen2, "qwen2", &["qwen2"], RopeStyle::Neox) },
    ArchRow { qk_norm: true, ..row(Arch::Qwen3, "qwen3", &["qwen3"], RopeStyle::Neox) },
    ArchRow { qkv_bias: true, ..row(Arch::Qwen2Moe, "qwen2moe", &["qwen2_moe"], RopeStyle::Neox) },
    ArchRow { qk_norm: true, moe_normalize_default: true, ..row(Arch::Qwen3Moe, "qwen3moe", &["qwen3_moe"], RopeStyle::Neox) },
    ArchRow { fused: true, ..row(Arch::Phi3, "phi3", &["phi3"], RopeStyle::Neox) },
    ArchRow { gemma: Some(GemmaKind::Gemma2), ..row(Arch::Gemma2, "gemma2", &["gemma2"], RopeStyle::Neox) },
    ArchRow { gemma: Some(GemmaKind::Gemma3), qk_norm: true, ..row(Arch::Gemma3, "gemma3", &["gemma3_text"], RopeStyle::Neox) },
    ArchRow { moe_normalize_default: true, ..row(Arch::GptOss, "gpt-oss", &["gpt_oss"], RopeStyle::Neox) },
    row(Arch::Mamba2, "mamba2", &["mamba2"], RopeStyle::Normal),
    ArchRow { granite: true, moe_normalize_default: true, ..row(Arch::GraniteHybrid, "granitehybrid", &["granitemoehybrid"], RopeStyle::Normal) },
    ArchRow { qk_norm: true, qwen_next: true, moe_normalize_default: true, ..row(Arch::Qwen3Next, "qwen3next", &["qwen3_next"], RopeStyle::Neox) },
    ArchRow { mla: true, ..row(Arch::Deepseek2, "deepseek2", &["deepseek_v3"], RopeStyle::Normal) },
];

impl Arch {
    /// Its row of [`ARCHES`].
    pub fn row(self) -> &'static ArchRow {
        ARCHES.iter().find(|r| r.arch == self).expect("every Arch has a row (arch_table_rows test)")
    }

    /// GGUF's name of it.
    pub fn gguf_name(self) -> &'static str {
        self.row().gguf
    }

    /// The architecture of a GGUF `general.architecture`, if one this tool reads.
    pub fn from_gguf(name: &str) -> Option<Arch> {
        ARCHES.iter().find(|r| r.gguf == name).map(|r| r.arch)
    }

    /// The architecture a Transformers `model_type` converts to, if one this tool reads.
    pub fn from_model_type(model_type: &str) -> Option<Arch> {
        ARCHES.iter().find(|r| r.model_types.contains(&model_type)).map(|r| r.arch)
    }

    /// The GGUF names read, for an error's list.
    pub fn gguf_names() -> String {
        ARCHES.iter().map(|r| r.gguf).collect::<Vec<_>>().join(", ")
    }

    /// The `model_type`s read, for an error's list.
    pub fn model_type_names() -> String {
        ARCHES.iter().flat_map(|r| r.model_types.iter().copied()).collect::<Vec<_>>().join(", ")
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.gguf_name())
    }
}

/// As its GGUF name (`"gpt-oss"`), as a spec has always been written.
impl serde::Serialize for Arch {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.gguf_name())
    }
}

impl<'de> serde::Deserialize<'de> for Arch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Arch, D::Error> {
        let name = String::deserialize(d)?;
        Arch::from_gguf(&name).ok_or_else(|| serde::de::Error::custom(format!("architecture `{name}` is not one of {}", Arch::gguf_names())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One row per architecture, its names parsing back to it; no name read as two.
    #[test]
    fn arch_table_rows() {
        for r in ARCHES {
            assert_eq!(r.arch.row().gguf, r.gguf);
            assert_eq!(Arch::from_gguf(r.gguf), Some(r.arch));
            for t in r.model_types {
                assert_eq!(Arch::from_model_type(t), Some(r.arch), "{t}");
            }
        }
        let mut names: Vec<&str> = ARCHES.iter().map(|r| r.gguf).collect();
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), n, "a GGUF name read as two architectures");
        assert_eq!(Arch::from_gguf("bert"), None);
        let mut types: Vec<&str> = ARCHES.iter().flat_map(|r| r.model_types.iter().copied()).collect();
        let n = types.len();
        types.sort();
        types.dedup();
        assert_eq!(types.len(), n, "a model_type read as two architectures");
    }
}
