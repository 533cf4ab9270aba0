//! The interpreter's weights, per layer and by the kind of each layer's block.

use crate::ops::Mat;

pub struct DenseFfn<T> {
    pub gate: Mat<T>,
    pub up: Mat<T>,
    pub down: Mat<T>,
    /// Biases of the gate, up and down products (GPT-OSS's experts).
    pub bias: Option<[Vec<T>; 3]>,
}

pub enum Ffn<T> {
    Dense(DenseFfn<T>),
    Moe {
        router: Mat<T>,
        /// The router's bias (GPT-OSS).
        router_bias: Option<Vec<T>>,
        experts: Vec<DenseFfn<T>>,
        shared: Option<DenseFfn<T>>,
        shared_gate: Option<Mat<T>>,
        /// The bias added to the scores for the choice only (DeepSeek V3's `exp_probs_b`).
        choice_bias: Option<Vec<T>>,
    },
}

/// An attention block's weights.
pub struct AttnWeights<T> {
    pub wq: Mat<T>,
    pub wk: Mat<T>,
    pub wv: Mat<T>,
    pub wo: Mat<T>,
    pub bq: Option<Vec<T>>,
    pub bk: Option<Vec<T>>,
    pub bv: Option<Vec<T>>,
    pub bo: Option<Vec<T>>,
    pub q_norm: Option<Vec<T>>,
    pub k_norm: Option<Vec<T>>,
    /// One sink logit per query head (GPT-OSS).
    pub sinks: Option<Vec<T>>,
}

/// A state-space block's weights (GGUF `blk.N.ssm_*`; a gated DeltaNet's projections
/// `attn_qkv`, `attn_gate`, `ssm_ba`).
pub struct SsmWeights<T> {
    /// Mamba-2: `[in_dim, n_embd]`: z, x/B/C, dt. Gated DeltaNet: `[conv_dim, n_embd]`, q/k/v.
    pub in_proj: Mat<T>,
    /// Gated DeltaNet: the gate z's projection, `[d_inner, n_embd]`, and b's and a's,
    /// `[2 n_head, n_embd]` (interleaved per key head, as stored).
    pub gate_proj: Option<Mat<T>>,
    pub ba_proj: Option<Mat<T>>,
    /// The convolution's kernel, `[conv_dim, d_conv]`, and bias, `[conv_dim]` (zeros for a gated
    /// DeltaNet, which has none).
    pub conv: Vec<T>,
    pub conv_bias: Vec<T>,
    /// Per head: the time steps' bias, A (`-exp(A_log)`) and D (Mamba-2; empty for a gated
    /// DeltaNet).
    pub dt_bias: Vec<T>,
    pub a: Vec<T>,
    pub d: Vec<T>,
    /// The gated norm's scales: `[d_inner]` (group after group); a gated DeltaNet's one head's,
    /// `[head_dim]`.
    pub norm: Vec<T>,
    /// `[n_embd, d_inner]`.
    pub out: Mat<T>,
}

/// A latent-attention block's weights (GGUF `blk.N.attn_q_a`, `attn_q_a_norm`, `attn_q_b` or
/// `attn_q`, `attn_kv_a_mqa`, `attn_kv_a_norm`, `attn_kv_b` (or its split `attn_k_b`/`attn_v_b`),
/// `attn_output`).
pub struct MlaWeights<T> {
    /// The query's compression, `[q_lora_rank, n_embd]`, and its norm; None without one.
    pub q_a: Option<(Mat<T>, Vec<T>)>,
    /// `[n_head * qk_head_dim, q_lora_rank or n_embd]`.
    pub q: Mat<T>,
    /// `[kv_lora_rank + qk_rope, n_embd]`: the latent, then the shared key.
    pub kv_a: Mat<T>,
    pub kv_a_norm: Vec<T>,
    /// `[n_head * (qk_nope + v_head_dim), kv_lora_rank]`: per head its key rows, then its value's.
    pub kv_b: Mat<T>,
    /// `[n_embd, n_head * v_head_dim]`.
    pub wo: Mat<T>,
}

/// A layer's mixing block's weights, by the kind of its block.
pub enum Mixer<T> {
    Attention(AttnWeights<T>),
    Ssm(SsmWeights<T>),
    Mla(MlaWeights<T>),
}

pub struct Layer<T> {
    /// The norm before the mixing block (`attn_norm`, whatever the block's kind).
    pub attn_norm: Vec<T>,
    pub mixer: Mixer<T>,
    /// Empty when the model has no feed-forward blocks (Mamba-2).
    pub ffn_norm: Vec<T>,
    /// Gemma's norms of the attention and FFN outputs (`post_attention_norm`, `post_ffw_norm`).
    pub post_norms: Option<[Vec<T>; 2]>,
    /// None when the model has no feed-forward blocks.
    pub ffn: Option<Ffn<T>>,
}
