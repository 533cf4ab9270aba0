#!/usr/bin/env python3
"""Small random checkpoints written by Hugging Face transformers itself
(`<Arch>ForCausalLM(<Arch>Config(...)).save_pretrained`), for the tests that hold Touchstone's
checkpoint reading to transformers' own float64 forward (`hf_f64.py`). A development/test peer,
never a runtime dependency.

- gemma3: six layers (five windowed, window 4, then one global), GQA 4:2, heads of 32, tied
  embeddings, norm weights drawn around 0 as a trained Gemma's are (the model multiplies by 1 + w).
- gemma2: four layers alternating windowed (window 4) and global, otherwise as gemma3, with the
  soft-caps of the attention scores and the logits lowered to 5 and 3 so that tanh bends a share
  of them, as Gemma 2's 50 and 30 do on a trained model's large values, and a query scale of
  1/sqrt(24), not 1/sqrt(head_dim), as Gemma 2 27B's.
- gpt-oss: four layers alternating windowed (window 4) and global, GQA 4:2 with query heads wider
  than the model (4 x 32 over 64), eight experts of 48 with two chosen per token, YaRN RoPE with
  its correction range untruncated (as GPT-OSS's configs say), attention sinks; gate/up biases of
  sd 4, so that the clamped SwiGLU clamps a share of its inputs as on a trained model's outliers.

Usage: make_checkpoint.py {gemma2,gemma3,gpt-oss} OUT_DIR [--seed N]
"""
import argparse

import torch


def gemma(t, two):
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=256, sliding_window=4, rms_norm_eps=1e-6, tie_word_embeddings=True)
    if two:
        # A query scale apart from 1/sqrt(head_dim), as Gemma 2 27B's (n_embd / n_head).
        model = t.Gemma2ForCausalLM(t.Gemma2Config(num_hidden_layers=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                                   query_pre_attn_scalar=24, **common))
    else:
        model = t.Gemma3ForCausalLM(t.Gemma3TextConfig(num_hidden_layers=6, rope_theta=1e6, rope_local_base_freq=10000.0,
                                                       query_pre_attn_scalar=32, **common))
    model = model.to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, (1.0 if two else 0.5) / p.shape[-1] ** 0.5)
    return model


def gpt_oss(t):
    rope = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 32, "rope_theta": 150000.0}
    cfg = t.GptOssConfig(vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=256, sliding_window=4, num_local_experts=8,
                         num_experts_per_tok=2, rope_parameters=rope, layer_types=["sliding_attention", "full_attention"] * 2,
                         rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = t.GptOssForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif name.endswith("gate_up_proj_bias"):
                p.normal_(0.0, 4.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("gate_up_proj") or name.endswith("down_proj"):
                p.normal_(0.0, 0.5 / p.shape[-2] ** 0.5)  # x @ W: the input dimension is the second to last
            else:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arch", choices=["gemma2", "gemma3", "gpt-oss"])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    import transformers as t
    torch.manual_seed(a.seed)
    model = gpt_oss(t) if a.arch == "gpt-oss" else gemma(t, a.arch == "gemma2")
    model.save_pretrained(a.out, safe_serialization=True)


if __name__ == "__main__":
    main()
