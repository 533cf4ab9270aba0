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
        self.layers = shapes
            .into_iter()
            .map(|sh| {
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
        Ok(())
    }

    /// The stages of an attention block with this model's flags, in order.
    fn block_stages(&self) -> Vec<Stage> {
        let mut s = vec![Stage::AttnNorm, Stage::QkvProj];
        if self.qk_norm {
            s.push(Stage::QkNorm);
        }
        s.extend([Stage::Rope, Stage::Attention, Stage::AttnOutProj]);
        if self.post_norms {
            s.push(Stage::AttnPostNorm);
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
    pub fn layer_states<S>(&self, attention: impl Fn(&AttentionBlock) -> S) -> Vec<S> {
        self.layers
            .iter()
            .map(|l| match &l.block {
                BlockKind::Attention(a) => attention(a),
            })
            .collect()
    }

    /// Layer `li`'s attention block.
    pub fn attention(&self, li: usize) -> &AttentionBlock {
        match &self.layers[li].block {
            BlockKind::Attention(a) => a,
        }
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
        }
    }
}
