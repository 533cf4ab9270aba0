#!/usr/bin/env python3
"""A small random Gemma 3 checkpoint written by Hugging Face transformers itself
(`Gemma3ForCausalLM(Gemma3TextConfig(...)).save_pretrained`): six layers (five windowed, window 4,
then one global), GQA 4:2, heads of 32, tied embeddings, norm weights drawn around 0 as a trained
Gemma's are (the model multiplies by 1 + w). A development/test peer, never a runtime dependency.

Usage: make_gemma3_checkpoint.py OUT_DIR [--seed N]
"""
import argparse

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(a.seed)
    cfg = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, max_position_embeddings=256, sliding_window=4, query_pre_attn_scalar=32,
                           rope_theta=1e6, rope_local_base_freq=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    model = Gemma3ForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
    model.save_pretrained(a.out, safe_serialization=True)


if __name__ == "__main__":
    main()
