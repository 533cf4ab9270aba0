//! What each layer of a model is: the kind of its mixing block, with that block's own
//! dimensions, and the stages it runs in order. Every interpreter (the oracle's, `cpu`'s,
//! `fixed`'s, the GPU devices') walks [`ModelSpec::layers`] and matches [`BlockKind`]
//! exhaustively, so a new kind of layer (a recurrent or latent-attention block) arrives as a
//! list of compile errors, one in each place that must learn its arithmetic.

use super::{ModelSpec, RopeSpec, Stage};
use crate::error::{OracleError, Result};
use serde::{Deserialize, Serialize};

/// The most layers a spec may declare: far beyond any model, small enough that a hostile
/// file's layer count cannot make the per-layer description a huge allocation.
pub const MAX_LAYERS: usize = 1 << 16;

/// The mixing block of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BlockKind {
    /// Softmax attention over a key/value cache (grouped-query where `n_head_kv < n_head`).
    Attention(AttentionBlock),
    /// A recurrent layer with a state per head carried from position to position ([`SsmKind`]:
    /// a Mamba-2 selective scan, or a gated DeltaNet's delta rule): a causal depthwise
    /// convolution over its input, then the recurrence, gated by SiLU of a projection and normed.
    Ssm(SsmBlock),
    /// Multi-head latent attention (DeepSeek V2/V3): keys and values are expanded from one
    /// compressed latent per position (RMS-normed) through `attn_kv_b`, beside one rotated key
    /// shared by every head; the cache holds the latent and that key.
    Mla(MlaBlock),
}

/// A latent-attention block's dimensions (GGUF `attention.q_lora_rank`, `kv_lora_rank`,
/// `key_length_mla`, `value_length_mla`, `rope.dimension_count`). Each query head is
/// `qk_nope` values that meet the expanded keys' unrotated part, then `qk_rope` rotated ones
/// that meet the shared rotated key; each value head is `v_head_dim` wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MlaBlock {
    pub n_head: usize,
    /// The query's own compression (`attn_q_a`, normed, then `attn_q_b`); 0: one `attn_q`.
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head_dim: usize,
}

impl MlaBlock {
    /// One query (and key) head's width: `qk_nope + qk_rope`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope + self.qk_rope
    }

    /// Width of the queries: `n_head * qk_head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.qk_head_dim()
    }

    /// Width of the attention output: `n_head * v_head_dim`.
    pub fn out_dim(&self) -> usize {
        self.n_head * self.v_head_dim
    }

    /// Rows of `attn_kv_a_mqa`: the latent, then the shared key's `qk_rope`.
    pub fn kv_a_dim(&self) -> usize {
        self.kv_lora_rank + self.qk_rope
    }

    /// Rows of `attn_kv_b`: per head its keys' unrotated part, then its value.
    pub fn kv_b_dim(&self) -> usize {
        self.n_head * (self.qk_nope + self.v_head_dim)
    }

    /// Checks the dimensions: heads, the latent, both query parts and the value positive, the
    /// rotated part even, and every width far from overflow.
    pub fn validate(&self) -> Result<()> {
        let ok = self.n_head > 0 && self.kv_lora_rank > 0 && self.qk_nope > 0 && self.qk_rope > 0 && self.v_head_dim > 0 && self.qk_rope.is_multiple_of(2);
        let small = [self.n_head, self.q_lora_rank, self.kv_lora_rank, self.qk_nope, self.qk_rope, self.v_head_dim].iter().all(|&v| v <= 1 << 16);
        if !ok || !small {
            return Err(OracleError::Spec(format!(
                "latent attention: {} heads, q rank {}, kv rank {}, key parts {} + {}, value {}: each must be positive (the q rank may be 0), at most 65536, the rotated part even",
                self.n_head, self.q_lora_rank, self.kv_lora_rank, self.qk_nope, self.qk_rope, self.v_head_dim
            )));
        }
        Ok(())
    }
}

/// Which recurrence a state-space layer runs. Both read the same GGUF keys (`ssm.*`) and share
/// the state's shape, `n_head x head_dim x d_state`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SsmKind {
    /// Mamba-2: the convolution runs over x, B and C; the state decays by `exp(dt A)` and takes
    /// `dt x B`, the output reads it through C plus `D x`; the norm is of the gated output.
    #[default]
    Mamba2,
    /// Gated DeltaNet (Qwen3-Next's linear attention): the convolution runs over q, k and v;
    /// q and k are L2-normed (q then scaled by `1/sqrt(d_state)`), the state decays by
    /// `exp(A softplus(a + dt_bias))` and takes the delta rule's correction
    /// `k (v - S k) sigmoid(b)`, the output reads it through q; the norm is of the output,
    /// then gated.
    GatedDelta,
}

/// A state-space layer's dimensions (GGUF `ssm.inner_size`, `ssm.state_size`, `ssm.group_count`,
/// `ssm.time_step_rank` (its head count), `ssm.conv_kernel`). For a gated DeltaNet: the value
/// width (`n_head` value heads of `head_dim`), the key head width, the key head count (each
/// serving `n_head / n_group` value heads) and the value head count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SsmBlock {
    pub d_inner: usize,
    pub d_state: usize,
    pub n_group: usize,
    pub n_head: usize,
    pub d_conv: usize,
    #[serde(default)]
    pub kind: SsmKind,
}

impl SsmBlock {
    /// Width of one head's slice of the inner activations: `d_inner / n_head`.
    pub fn head_dim(&self) -> usize {
        self.d_inner / self.n_head.max(1)
    }

    /// Width of the convolved activations: x, then B and C (`n_group * d_state` each); for a
    /// gated DeltaNet q and k (`n_group * d_state` each), then v (`d_inner`).
    pub fn conv_dim(&self) -> usize {
        self.d_inner + 2 * self.n_group * self.d_state
    }

    /// Width of the input projection's output, as the tap `ssm_in` holds it. Mamba-2: the gate
    /// z, the convolved x/B/C, then one time step per head. Gated DeltaNet: the convolved
    /// q/k/v, the gate z, then b and a (one of each per value head, in head order).
    pub fn in_dim(&self) -> usize {
        self.d_inner + self.conv_dim() + self.n_head * if self.kind == SsmKind::GatedDelta { 2 } else { 1 }
    }

    /// Where, in a row of [`SsmBlock::in_dim`], the convolution's input starts.
    pub fn conv_at(&self) -> usize {
        match self.kind {
            SsmKind::Mamba2 => self.d_inner,
            SsmKind::GatedDelta => 0,
        }
    }

    /// Where, in a row of [`SsmBlock::in_dim`], the gate z (`d_inner` values) starts.
    pub fn z_at(&self) -> usize {
        match self.kind {
            SsmKind::Mamba2 => 0,
            SsmKind::GatedDelta => self.conv_dim(),
        }
    }

    /// Where, in a row of [`SsmBlock::in_dim`], the per-head values start: Mamba-2's time steps,
    /// a gated DeltaNet's b (then its a).
    pub fn heads_at(&self) -> usize {
        self.d_inner + self.conv_dim()
    }

    /// Values of the recurrent state: `n_head * head_dim * d_state`.
    pub fn state_len(&self) -> usize {
        self.d_inner * self.d_state
    }

    /// Checks the dimensions fit together: every one positive, heads and groups dividing the
    /// inner width evenly, heads grouped evenly.
    pub fn validate(&self) -> Result<()> {
        let ok = self.d_inner > 0
            && self.d_state > 0
            && self.n_group > 0
            && self.n_head > 0
            && self.d_conv > 0
            && self.d_inner.is_multiple_of(self.n_head)
            && self.n_head.is_multiple_of(self.n_group);
        if !ok {
            return Err(OracleError::Spec(format!(
                "state-space layer: inner width {}, state {}, {} groups, {} heads, convolution {}: each must be positive, the heads must divide the inner width and the groups the heads",
                self.d_inner, self.d_state, self.n_group, self.n_head, self.d_conv
            )));
        }
        // Every width the interpreters allocate by stays far from overflow.
        if self.d_inner.checked_mul(self.d_state).is_none_or(|n| n > 1 << 32) || self.d_conv > 1 << 12 {
            return Err(OracleError::Spec(format!("state-space layer: a state of {} x {} or a convolution of {} is beyond any model", self.d_inner, self.d_state, self.d_conv)));
        }
        Ok(())
    }
}

/// An attention block's dimensions and reach. A model may give its layers different head
/// counts (GGUF: `attention.head_count` / `head_count_kv` as one value per layer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttentionBlock {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// The sliding window: None sees every earlier position.
    pub window: Option<usize>,
    /// Rotates with the windowed layers' RoPE ([`ModelSpec::rope_swa`]) rather than `rope`.
    pub local_rope: bool,
}

impl AttentionBlock {
    /// Width of the queries (and of the attention output): `n_head * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Width of the keys and of the values: `n_head_kv * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}

/// One layer: its block and the stages it runs, in order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerSpec {
    pub block: BlockKind,
    pub stages: Vec<Stage>,
}

impl ModelSpec {
    /// Derives every layer's description from the model's flags and dimensions: the block (its
    /// head counts and whether it attends through the sliding window as `shapes` gives them per
    /// layer, else the model's `n_head`/`n_head_kv` and window period), its RoPE and its stages.
    /// Called again after a flag changes; `shapes` None then keeps what the layers already have.
    pub fn derive_layers(&mut self, shapes: Option<&[LayerShape]>) -> Result<()> {
        if self.n_layer > MAX_LAYERS {
            return Err(OracleError::Spec(format!(
                "{} layers: more than the {MAX_LAYERS} a model may have",
                self.n_layer
            )));
        }
        let shapes: Vec<LayerShape> = match shapes {
            Some(h) if h.len() != self.n_layer => {
                return Err(OracleError::Spec(format!(
                    "{} per-layer shapes for {} layers",
                    h.len(),
                    self.n_layer
                )));
            }
            Some(h) => h.to_vec(),
            None if self.layers.len() == self.n_layer => {
                self.layers.iter().map(|l| l.block.shape()).collect()
            }
            None => (0..self.n_layer).map(|li| self.scalar_shape(li)).collect(),
        };
        let stages = self.block_stages();
        let ssm_stages = self.ssm_stages();
        self.layers = shapes
            .into_iter()
            .map(|sh| {
                // A layer without key/value heads in a model with state-space dimensions is a
                // state-space layer (llama.cpp's hybrids give such layers `head_count_kv` 0).
                if let (0, Some(ssm)) = (sh.n_head_kv, self.ssm) {
                    return LayerSpec {
                        block: BlockKind::Ssm(ssm),
                        stages: ssm_stages.clone(),
                    };
                }
                if let Some(mla) = self.mla {
                    return LayerSpec {
                        block: BlockKind::Mla(MlaBlock { n_head: sh.n_head, ..mla }),
                        stages: stages.clone(),
                    };
                }
                let windowed = sh.windowed && self.sliding_window.is_some();
                let block = AttentionBlock {
                    n_head: sh.n_head,
                    n_head_kv: sh.n_head_kv,
                    head_dim: self.head_dim,
                    window: self.sliding_window.filter(|_| windowed),
                    local_rope: windowed && self.rope_swa.is_some(),
                };
                LayerSpec {
                    block: BlockKind::Attention(block),
                    stages: stages.clone(),
                }
            })
            .collect();
        // DeepSeek's first layers: a dense FFN in place of the experts.
        let first_dense = self.moe.as_ref().map_or(0, |m| m.first_dense);
        for l in self.layers.iter_mut().take(first_dense) {
            l.stages.iter_mut().filter(|s| **s == Stage::MoeFfn).for_each(|s| *s = Stage::DenseFfn);
        }
        Ok(())
    }

    /// The stages of an attention block with this model's flags, in order.
    fn block_stages(&self) -> Vec<Stage> {
        let mut s = vec![Stage::AttnNorm, Stage::QkvProj];
        if self.qk_norm {
            s.push(Stage::QkNorm);
        }
        if !self.no_rope {
            s.push(Stage::Rope);
        }
        s.push(Stage::Attention);
        if self.attn_gate {
            s.push(Stage::AttnGate);
        }
        s.push(Stage::AttnOutProj);
        if self.post_norms {
            s.push(Stage::AttnPostNorm);
        }
        self.ffn_stages(s)
    }

    /// The stages of a state-space block, then the FFN's if the model has one.
    fn ssm_stages(&self) -> Vec<Stage> {
        let s = vec![Stage::AttnNorm, Stage::SsmInProj, Stage::SsmConv, Stage::SsmScan, Stage::SsmNorm, Stage::SsmOutProj];
        self.ffn_stages(s)
    }

    /// `s` followed by the residual add and the feed-forward block's stages, or, in a model
    /// without feed-forward blocks (`n_ff` 0 and no experts: Mamba-2), the residual add that ends
    /// the layer.
    fn ffn_stages(&self, mut s: Vec<Stage>) -> Vec<Stage> {
        if self.n_ff == 0 && self.moe.is_none() {
            s.push(Stage::MixerResidual);
            return s;
        }
        s.extend([Stage::AttnResidual, Stage::FfnNorm]);
        s.push(if self.moe.is_some() {
            Stage::MoeFfn
        } else {
            Stage::DenseFfn
        });
        if self.post_norms {
            s.push(Stage::FfnPostNorm);
        }
        s.push(Stage::FfnResidual);
        s
    }

    /// One state per layer, each made by the constructor for its block's kind. Every
    /// interpreter's cache is built through this, so a new kind of block is a new argument each
    /// of them must supply.
    pub fn layer_states<S>(&self, attention: impl Fn(&AttentionBlock) -> S, ssm: impl Fn(&SsmBlock) -> S, mla: impl Fn(&MlaBlock) -> S) -> Vec<S> {
        self.layers
            .iter()
            .map(|l| match &l.block {
                BlockKind::Attention(a) => attention(a),
                BlockKind::Ssm(b) => ssm(b),
                BlockKind::Mla(b) => mla(b),
            })
            .collect()
    }

    /// Layer `li`'s attention block, None for a layer of another kind.
    pub fn attention(&self, li: usize) -> Option<&AttentionBlock> {
        match &self.layers[li].block {
            BlockKind::Attention(a) => Some(a),
            BlockKind::Ssm(_) | BlockKind::Mla(_) => None,
        }
    }

    /// Whether any layer attends (a pure state-space model has no heads at all).
    pub fn has_attention(&self) -> bool {
        self.layers.iter().any(|l| matches!(l.block, BlockKind::Attention(_) | BlockKind::Mla(_)))
    }

    /// Whether any layer is a latent-attention layer.
    pub fn has_mla(&self) -> bool {
        self.layers.iter().any(|l| matches!(l.block, BlockKind::Mla(_)))
    }

    /// Whether any layer is a state-space layer.
    pub fn has_ssm(&self) -> bool {
        self.layers.iter().any(|l| matches!(l.block, BlockKind::Ssm(_)))
    }

    /// The RoPE an attention block rotates with.
    pub fn rope_of(&self, a: &AttentionBlock) -> &RopeSpec {
        match &self.rope_swa {
            Some(r) if a.local_rope => r,
            _ => &self.rope,
        }
    }

    /// Layer `li`'s shape as the model's scalars give it: `n_head`/`n_head_kv`, and the window
    /// on every layer but each `swa_period`-th (all of them for a period of 0).
    pub fn scalar_shape(&self, li: usize) -> LayerShape {
        let windowed = self.sliding_window.is_some()
            && (self.swa_period == 0 || !(li + 1).is_multiple_of(self.swa_period));
        LayerShape {
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            windowed,
        }
    }

    /// Whether every layer has the same head counts.
    pub fn uniform_heads(&self) -> bool {
        self.layers
            .iter()
            .all(|l| l.block.heads() == (self.n_head, self.n_head_kv))
    }

    /// Whether every layer is as the model's scalars describe it (what a flat file's header
    /// can hold): no per-layer head counts, no window pattern other than the period.
    pub fn layers_follow_scalars(&self) -> bool {
        self.layers
            .iter()
            .enumerate()
            .all(|(li, l)| l.block.shape() == self.scalar_shape(li))
    }

    /// Checks every layer's block against the model: head counts positive and grouped evenly,
    /// and the model's `n_head`/`n_head_kv` the widest layer's.
    pub(super) fn validate_layers(&self) -> Result<()> {
        if self.layers.len() != self.n_layer {
            return Err(OracleError::Spec(format!(
                "{} layer descriptions for {} layers",
                self.layers.len(),
                self.n_layer
            )));
        }
        for (li, l) in self.layers.iter().enumerate() {
            match &l.block {
                BlockKind::Attention(a) => {
                    if a.n_head == 0 || a.n_head_kv == 0 || !a.n_head.is_multiple_of(a.n_head_kv) {
                        return Err(OracleError::Spec(format!("layer {li}: {} query heads over {} key/value heads (each must be a positive multiple of the other)", a.n_head, a.n_head_kv)));
                    }
                    if a.head_dim != self.head_dim
                        || a.n_head > self.n_head
                        || a.n_head_kv > self.n_head_kv
                    {
                        return Err(OracleError::Spec(format!(
                            "layer {li}: heads {}x{} ({} kv) beyond the model's {}x{} ({} kv)",
                            a.n_head,
                            a.head_dim,
                            a.n_head_kv,
                            self.n_head,
                            self.head_dim,
                            self.n_head_kv
                        )));
                    }
                }
                BlockKind::Ssm(b) => {
                    b.validate().map_err(|e| OracleError::Spec(format!("layer {li}: {e}")))?;
                    if self.ssm != Some(*b) {
                        return Err(OracleError::Spec(format!("layer {li}: state-space dimensions other than the model's")));
                    }
                }
                BlockKind::Mla(b) => {
                    b.validate().map_err(|e| OracleError::Spec(format!("layer {li}: {e}")))?;
                    if self.mla.is_none_or(|m| MlaBlock { n_head: b.n_head, ..m } != *b) || b.n_head > self.n_head || b.qk_head_dim() != self.head_dim {
                        return Err(OracleError::Spec(format!("layer {li}: latent-attention dimensions other than the model's")));
                    }
                }
            }
        }
        Ok(())
    }
}

/// What a file may say of each layer beyond the model's scalars: its head counts (GGUF's
/// per-layer `attention.head_count`/`head_count_kv`) and whether it attends through the sliding
/// window (`attention.sliding_window_pattern`, a checkpoint's `layer_types`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub windowed: bool,
}

impl BlockKind {
    /// The (query, key/value) head counts of the block.
    pub fn heads(&self) -> (usize, usize) {
        match self {
            BlockKind::Attention(a) => (a.n_head, a.n_head_kv),
            BlockKind::Ssm(_) => (0, 0),
            // Every head reads the one latent, expanded to keys and values of its own.
            BlockKind::Mla(b) => (b.n_head, b.n_head),
        }
    }

    /// The block's shape, as [`ModelSpec::derive_layers`] takes it back.
    pub fn shape(&self) -> LayerShape {
        match self {
            BlockKind::Attention(a) => LayerShape {
                n_head: a.n_head,
                n_head_kv: a.n_head_kv,
                windowed: a.window.is_some(),
            },
            BlockKind::Ssm(_) => LayerShape {
                n_head: 0,
                n_head_kv: 0,
                windowed: false,
            },
            BlockKind::Mla(b) => LayerShape {
                n_head: b.n_head,
                n_head_kv: b.n_head,
                windowed: false,
            },
        }
    }
}
