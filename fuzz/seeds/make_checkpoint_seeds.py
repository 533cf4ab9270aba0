#!/usr/bin/env python3
"""Seeds for the `checkpoint` fuzz target: small valid Hugging Face checkpoints (Llama, Qwen2 with
biases, Qwen3 with QK-norm; F32, F16 and BF16 tensors), each with a byte-level BPE tokenizer.json
and a chat template, packed as the target reads them: three little-endian u16 lengths, then
config.json, tokenizer.json and tokenizer_config.json, then model.safetensors.

Usage: make_checkpoint_seeds.py OUT_DIR   (numpy only; the safetensors file is written by hand)
"""
import json
import struct
import sys
from pathlib import Path

import numpy as np


def safetensors_bytes(tensors):
    header, blobs, at = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        raw = {"F32": arr.astype(np.float32).tobytes(), "F16": arr.astype(np.float16).tobytes(),
               "BF16": (arr.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()}[dtype]
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def tokenizer_json(vocab_size):
    chars = [chr(c) for c in range(ord("a"), ord("a") + vocab_size - 4)]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({"ab": len(vocab), "<|im_start|>": len(vocab) + 1, "<|im_end|>": len(vocab) + 2, "Ġ": len(vocab) + 3})
    return {
        "version": "1.0",
        "added_tokens": [{"id": vocab["<|im_start|>"], "content": "<|im_start|>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": ["a b"]},
    }


def checkpoint(arch, dtype, seed):
    rng = np.random.default_rng(seed)
    d, n_head, n_kv, hd, ff, vocab = 32, 2, 1, 16, 64, 24
    config = {"architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
              "model_type": arch, "hidden_size": d, "num_hidden_layers": 1, "num_attention_heads": n_head,
              "num_key_value_heads": n_kv, "head_dim": hd, "intermediate_size": ff, "vocab_size": vocab,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": seed % 2 == 0,
              "hidden_act": "silu"}
    w = lambda *s: (dtype, rng.standard_normal(s) / np.sqrt(s[-1]))
    ones = lambda n: ("F32", 1 + 0.1 * rng.standard_normal(n))
    t = {"model.embed_tokens.weight": w(vocab, d), "model.norm.weight": ones(d)}
    if seed % 2:
        t["lm_head.weight"] = w(vocab, d)
    p = "model.layers.0."
    t.update({p + "input_layernorm.weight": ones(d), p + "post_attention_layernorm.weight": ones(d),
              p + "self_attn.q_proj.weight": w(n_head * hd, d), p + "self_attn.k_proj.weight": w(n_kv * hd, d),
              p + "self_attn.v_proj.weight": w(n_kv * hd, d), p + "self_attn.o_proj.weight": w(d, n_head * hd),
              p + "mlp.gate_proj.weight": w(ff, d), p + "mlp.up_proj.weight": w(ff, d), p + "mlp.down_proj.weight": w(d, ff)})
    if arch == "qwen2":
        for n, rows in (("q", n_head * hd), ("k", n_kv * hd), ("v", n_kv * hd)):
            t[p + f"self_attn.{n}_proj.bias"] = ("F32", 0.1 * rng.standard_normal(rows))
    if arch == "qwen3":
        t[p + "self_attn.q_norm.weight"] = ones(hd)
        t[p + "self_attn.k_norm.weight"] = ones(hd)
    tok_config = {"chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
                  "eos_token": "<|im_end|>"}
    parts = [json.dumps(config).encode(), json.dumps(tokenizer_json(vocab)).encode(), json.dumps(tok_config).encode()]
    return struct.pack("<HHH", *(len(p) for p in parts)) + b"".join(parts) + safetensors_bytes(t)


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for i, (arch, dtype) in enumerate([("llama", "F32"), ("qwen2", "F16"), ("qwen3", "BF16"), ("llama", "BF16"), ("qwen2", "F32"), ("qwen3", "F16")]):
        (out / f"{arch}-{dtype.lower()}-{i}").write_bytes(checkpoint(arch, dtype, i))
    print(f"wrote 6 seeds to {out}")


if __name__ == "__main__":
    main()
