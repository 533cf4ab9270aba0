//! What a `deepseek2` GGUF (DeepSeek V2/V3: latent attention, group-limited routing) implies
//! beyond its keys, as llama.cpp reads it.

use super::*;

/// A `deepseek2` file's routing keys beyond the common ones.
pub(super) struct DeepseekRouting {
    pub(super) leading_dense: usize,
    pub(super) groups: Option<[usize; 2]>,
    pub(super) weights_scale: Option<f64>,
    pub(super) shared_experts: usize,
    pub(super) choice_bias: bool,
}

impl ModelSpec {
    /// What a `deepseek2` file implies beyond its keys, as llama.cpp reads it: the score scale
    /// `mscale^2 / sqrt(qk_head_dim)` with YaRN's `mscale = 1 + yarn_log_multiplier ln(factor)`,
    /// the rotation's own magnitude left at 1 (transformers' when `mscale` equals
    /// `mscale_all_dim`, as DeepSeek V3's config has them). Routing as DeepSeek V3's: the first
    /// `leading_dense_block_count` layers dense, then experts chosen from the best
    /// `expert_group_used_count` of `expert_group_count` groups, the choice biased by
    /// `exp_probs_b`, the weights scaled by `expert_weights_scale`, beside the shared experts
    /// (`expert_shared_count` of them, one FFN).
    pub(super) fn mla_from_gguf(&mut self, b: &MlaBlock, r: &DeepseekRouting, yarn_log_mul: f64) -> Result<()> {
        match &mut self.moe {
            Some(_) if r.leading_dense >= self.n_layer => self.moe = None,
            Some(m) => {
                m.groups = r.groups;
                m.weights_scale = r.weights_scale;
                m.choice_bias = r.choice_bias;
                m.first_dense = r.leading_dense;
                // The shared experts, one FFN as wide as all of them.
                m.shared_ffn = (r.shared_experts > 0).then(|| r.shared_experts * m.expert_ffn);
                m.shared_gate = false;
            }
            None => {}
        }
        let mut scale = 1.0 / (b.qk_head_dim() as f64).sqrt();
        if let RopeScaling::Yarn { factor, attn_factor, .. } = &mut self.rope.scaling {
            if *factor > 1.0 {
                scale *= (1.0 + yarn_log_mul * factor.ln()).powi(2);
                *attn_factor /= 1.0 + 0.1 * factor.ln();
            }
        }
        self.attn_scale = scale;
        Ok(())
    }

}
