//! The kinds of tap — the intermediate tensors an interpreter records, named as llama.cpp/GGUF
//! name them (docs/DUMP_FORMAT.md) — as one enum. A tap's name is parsed into a [`TapName`] once,
//! where it enters (an interpreter's recording, a dump), and everything after matches on the
//! kind: a new kind is a list of compile errors (its budget rule, its inputs, the op that makes
//! it), not a string some fallback arm lets through.

/// A kind of tap. The per-layer kinds are named `blk.{layer}.{name}`; the others stand alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TapKind {
    /// Token embeddings (before the first layer).
    InpEmbd,
    AttnNorm,
    /// A state-space layer's input projection: the gate z, x/B/C, the time steps (Mamba-2; a
    /// gated DeltaNet's q/k/v, z, b and a: `SsmBlock::in_dim`).
    SsmIn,
    /// x/B/C (q/k/v) after the causal convolution and SiLU.
    SsmConv,
    /// The recurrent state after each position (`[n_head, head_dim, d_state]` a position).
    SsmState,
    /// The scan's output (the state read through C, plus D x; through q).
    SsmScan,
    /// The scan's output gated by SiLU(z) and RMS-normed per group (normed per head, then gated).
    SsmNorm,
    /// The output projection: the block's contribution to the residual.
    SsmOut,
    /// Latent attention: the query's compressed form, normed (`attn_q_a`).
    AttnQA,
    AttnQ,
    AttnK,
    AttnV,
    /// Latent attention: the key/value latent, normed: what the cache holds (`attn_kv_a`).
    AttnKvA,
    AttnQNorm,
    AttnKNorm,
    AttnQRope,
    AttnKRope,
    /// The attention output gate's projection, before its sigmoid (Qwen3-Next).
    AttnGate,
    /// Attention's output before its output projection.
    AttnKqv,
    /// Attention's output times the sigmoid of its gate (Qwen3-Next).
    AttnGated,
    AttnOut,
    AttnPostNorm,
    /// The residual after attention.
    FfnInp,
    FfnNorm,
    FfnGate,
    FfnUp,
    /// The gated activation, act(gate) * up.
    FfnAct,
    /// A MoE layer's router scores.
    FfnMoeProbs,
    /// A MoE layer's chosen expert ids (discrete: compared exactly).
    FfnMoeTopk,
    FfnOut,
    FfnPostNorm,
    /// The residual after the FFN: the layer's output.
    LOut,
    /// The final norm (after the last layer).
    ResultNorm,
    /// The logits.
    ResultOutput,
}

impl TapKind {
    /// Every kind, in the order an attention layer computes them.
    pub const ALL: [TapKind; 34] = [
        TapKind::InpEmbd,
        TapKind::AttnNorm,
        TapKind::SsmIn,
        TapKind::SsmConv,
        TapKind::SsmState,
        TapKind::SsmScan,
        TapKind::SsmNorm,
        TapKind::SsmOut,
        TapKind::AttnQA,
        TapKind::AttnQ,
        TapKind::AttnK,
        TapKind::AttnV,
        TapKind::AttnKvA,
        TapKind::AttnQNorm,
        TapKind::AttnKNorm,
        TapKind::AttnQRope,
        TapKind::AttnKRope,
        TapKind::AttnGate,
        TapKind::AttnKqv,
        TapKind::AttnGated,
        TapKind::AttnOut,
        TapKind::AttnPostNorm,
        TapKind::FfnInp,
        TapKind::FfnNorm,
        TapKind::FfnGate,
        TapKind::FfnUp,
        TapKind::FfnAct,
        TapKind::FfnMoeProbs,
        TapKind::FfnMoeTopk,
        TapKind::FfnOut,
        TapKind::FfnPostNorm,
        TapKind::LOut,
        TapKind::ResultNorm,
        TapKind::ResultOutput,
    ];

    /// The name: `attn_norm`, `l_out`, ... (a per-layer kind's name after `blk.{layer}.`).
    pub const fn name(self) -> &'static str {
        match self {
            TapKind::InpEmbd => "inp_embd",
            TapKind::AttnNorm => "attn_norm",
            TapKind::AttnQ => "attn_q",
            TapKind::AttnK => "attn_k",
            TapKind::AttnV => "attn_v",
            TapKind::AttnQA => "attn_q_a",
            TapKind::AttnKvA => "attn_kv_a",
            TapKind::AttnQNorm => "attn_q_norm",
            TapKind::AttnKNorm => "attn_k_norm",
            TapKind::AttnQRope => "attn_q_rope",
            TapKind::AttnKRope => "attn_k_rope",
            TapKind::AttnKqv => "attn_kqv",
            TapKind::AttnGate => "attn_gate",
            TapKind::AttnGated => "attn_gated",
            TapKind::AttnOut => "attn_out",
            TapKind::AttnPostNorm => "attn_post_norm",
            TapKind::FfnInp => "ffn_inp",
            TapKind::FfnNorm => "ffn_norm",
            TapKind::FfnGate => "ffn_gate",
            TapKind::FfnUp => "ffn_up",
            TapKind::FfnAct => "ffn_act",
            TapKind::FfnMoeProbs => "ffn_moe_probs",
            TapKind::FfnMoeTopk => "ffn_moe_topk",
            TapKind::FfnOut => "ffn_out",
            TapKind::FfnPostNorm => "ffn_post_norm",
            TapKind::LOut => "l_out",
            TapKind::ResultNorm => "result_norm",
            TapKind::ResultOutput => "result_output",
            TapKind::SsmIn => "ssm_in",
            TapKind::SsmConv => "ssm_conv",
            TapKind::SsmState => "ssm_state",
            TapKind::SsmScan => "ssm_scan",
            TapKind::SsmNorm => "ssm_norm",
            TapKind::SsmOut => "ssm_out",
        }
    }

    /// Whether the kind is one per layer (`blk.{layer}.{name}`).
    pub const fn per_layer(self) -> bool {
        !matches!(self, TapKind::InpEmbd | TapKind::ResultNorm | TapKind::ResultOutput)
    }

    /// The kind named `name` (`attn_norm`), if any.
    pub fn parse(name: &str) -> Option<TapKind> {
        TapKind::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// As its name (`"attn_norm"`), as report.json has always had it.
impl serde::Serialize for TapKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl std::fmt::Display for TapKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A tap's name, parsed: its layer (None for the kinds that stand alone) and its kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TapName {
    pub layer: Option<usize>,
    pub kind: TapKind,
}

impl TapName {
    /// Layer `layer`'s tap of a per-layer kind.
    pub const fn layer(layer: usize, kind: TapKind) -> TapName {
        TapName { layer: Some(layer), kind }
    }

    /// A kind that stands alone (`inp_embd`, `result_norm`, `result_output`).
    pub const fn model(kind: TapKind) -> TapName {
        TapName { layer: None, kind }
    }

    /// `blk.3.attn_norm` -> layer 3's `AttnNorm`, `result_norm` -> `ResultNorm`; None for a name
    /// that is not a tap of a known kind, or a per-layer kind without its layer (or the other way).
    pub fn parse(name: &str) -> Option<TapName> {
        match name.strip_prefix("blk.").and_then(|rest| rest.split_once('.')) {
            Some((layer, kind)) => {
                let kind = TapKind::parse(kind).filter(|k| k.per_layer())?;
                Some(TapName::layer(layer.parse().ok()?, kind))
            }
            None => TapKind::parse(name).filter(|k| !k.per_layer()).map(TapName::model),
        }
    }
}

impl std::fmt::Display for TapName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.layer {
            Some(i) => write!(f, "blk.{i}.{}", self.kind.name()),
            None => f.write_str(self.kind.name()),
        }
    }
}

/// A tap name as an engine's dump gives it (after the dump format's llama.cpp aliases), parsed
/// once where the dump is read: a tap of a kind this tool knows, or a name of no such kind, kept
/// as given, recorded apart ([`crate::Tap::other`]) and reported as not judged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineTap {
    Known(TapName),
    Other(String),
}

impl EngineTap {
    pub fn parse(name: &str) -> EngineTap {
        match TapName::parse(name) {
            Some(t) => EngineTap::Known(t),
            None => EngineTap::Other(name.to_string()),
        }
    }
}

impl std::fmt::Display for EngineTap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EngineTap::Known(t) => t.fmt(f),
            EngineTap::Other(n) => f.write_str(n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kind's name parses back to it, in and out of a layer as the kind is; other names do
    /// not parse.
    #[test]
    fn tap_names_round_trip() {
        for k in TapKind::ALL {
            let name = if k.per_layer() { TapName::layer(7, k) } else { TapName::model(k) };
            assert_eq!(TapName::parse(&name.to_string()), Some(name), "{name}");
            assert_eq!(TapKind::parse(k.name()), Some(k));
        }
        for bad in ["blk.x.attn_norm", "blk.1.result_norm", "attn_norm", "blk.1.attn_nrom", "blk.1", "", "l_out-3"] {
            assert_eq!(TapName::parse(bad), None, "{bad}");
            assert_eq!(EngineTap::parse(bad), EngineTap::Other(bad.to_string()), "{bad}");
        }
        assert_eq!(EngineTap::parse("blk.2.l_out"), EngineTap::Known(TapName::layer(2, TapKind::LOut)));
    }
}
