#!/usr/bin/env python3
"""Writes a Llama/Qwen2/Qwen3/Phi-3 GGUF, dense or MoE, as a Hugging Face directory (config.json +
model.safetensors), every tensor dequantized by gguf-py and stored as F32, F16 or BF16 (rounded to
nearest even), with Q and K rows put back in Hugging Face's order (llama.cpp's converter permutes
them for its interleaved RoPE; Hugging Face checkpoints use the rotate-half layout) and a stacked
expert tensor split into one tensor per expert as checkpoints ship them (a llama with experts is
written as Mixtral, qwen2moe as Qwen2-MoE, qwen3moe as Qwen3-MoE; Phi-3's fused tensors stay fused,
as `qkv_proj` and `gate_up_proj`). For checking the devices'
safetensors path on a real model:

    python3 tools/reference/gguf_to_safetensors.py .cache/touchstone/real/smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2-bf16 --dtype bf16
    cargo xtask layer-diff --device cpu --model /tmp/smollm2-bf16

A development aid (gguf-py + numpy, tools/reference/requirements.txt), never a runtime dependency.
"""
import argparse
import json
import os

import gguf
import numpy as np

import safetensors_file


def field(r, key, default=None):
    f = r.fields.get(key)
    if f is None:
        return default
    v = f.parts[f.data[0]]
    return v.tobytes().decode() if v.dtype == np.uint8 else v.item()


def unpermute(w, n_head):
    # Inverse of llama.cpp's permute: rows (head, pair, half) -> (head, half, pair).
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_bytes(a, dtype):
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "f32":
        return a.tobytes()
    if dtype == "f16":
        return a.astype(np.float16).tobytes()
    bits = a.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", choices=["f32", "f16", "bf16"], default="bf16")
    a = ap.parse_args()
    r = gguf.GGUFReader(a.gguf)
    arch = field(r, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3"):
        raise SystemExit(f"{a.gguf}: architecture {arch!r}; this writes llama, qwen2, qwen3, qwen2moe, qwen3moe and phi3 models")
    n_expert = field(r, f"{arch}.expert_count", 0)
    mixtral = arch == "llama" and n_expert > 0
    if field(r, f"{arch}.expert_gating_func", 1) != 1:
        raise SystemExit(f"{a.gguf}: sigmoid expert gating has no Hugging Face config here")
    n_head = field(r, f"{arch}.attention.head_count")
    n_head_kv = field(r, f"{arch}.attention.head_count_kv", n_head)
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    layer = {
        "attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
        "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
        "attn_output.weight": "self_attn.o_proj.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
        "ffn_gate_inp.weight": "block_sparse_moe.gate.weight" if mixtral else "mlp.gate.weight",
        "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight", "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight", "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    }
    if arch == "phi3":
        # Phi-3 keeps Q/K/V in one tensor and gate/up in another (GGUF's ffn_up, gate rows first).
        layer.update({"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"})
    # Stacked experts -> one tensor per expert ({e} is the expert index).
    experts = {
        "ffn_gate_exps.weight": "block_sparse_moe.experts.{e}.w1.weight" if mixtral else "mlp.experts.{e}.gate_proj.weight",
        "ffn_up_exps.weight": "block_sparse_moe.experts.{e}.w3.weight" if mixtral else "mlp.experts.{e}.up_proj.weight",
        "ffn_down_exps.weight": "block_sparse_moe.experts.{e}.w2.weight" if mixtral else "mlp.experts.{e}.down_proj.weight",
    }
    tensors = []
    longrope = {}
    for t in r.tensors:
        if t.name in ("rope_factors_short.weight", "rope_factors_long.weight"):
            # Phi-3's LongRoPE factors live in config.json.
            longrope[t.name.split("_")[2].split(".")[0]] = [float(x) for x in gguf.quants.dequantize(t.data, t.tensor_type)]
            continue
        if t.name in names:
            hf = names[t.name]
        else:
            _, i, tail = t.name.split(".", 2)
            if tail not in layer and tail not in experts:
                raise SystemExit(f"{a.gguf}: tensor {t.name} has no Hugging Face name here")
            hf = f"model.layers.{i}.{layer.get(tail, experts.get(tail))}"
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = [int(d) for d in reversed(t.shape)]  # torch order
        w = w.reshape(shape)
        if tail_of(t.name) in experts:
            for e in range(shape[0]):
                tensors.append((hf.format(e=e), shape[1:], to_bytes(w[e], a.dtype)))
            continue
        if arch == "llama" and tail_of(t.name) in ("attn_q.weight", "attn_q.bias"):
            w = unpermute(w, n_head)
        if arch == "llama" and tail_of(t.name) in ("attn_k.weight", "attn_k.bias"):
            w = unpermute(w, n_head_kv)
        tensors.append((hf, shape, to_bytes(w, a.dtype)))
    os.makedirs(a.out_dir, exist_ok=True)
    safetensors_file.write(os.path.join(a.out_dir, "model.safetensors"), [(hf, a.dtype.upper(), shape, b) for hf, shape, b in tensors])
    model_type = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}.get(arch, "mixtral" if mixtral else arch)
    cfg = {
        "model_type": model_type, "hidden_size": field(r, f"{arch}.embedding_length"), "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv, "intermediate_size": field(r, f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(r, f"{arch}.block_count"), "vocab_size": [t for t in r.tensors if t.name == "token_embd.weight"][0].shape[1].item(),
        "rms_norm_eps": field(r, f"{arch}.attention.layer_norm_rms_epsilon"), "rope_theta": field(r, f"{arch}.rope.freq_base", 10000.0),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in r.tensors),
        "max_position_embeddings": field(r, f"{arch}.context_length"), "hidden_act": "silu",
        "sliding_window": field(r, f"{arch}.attention.sliding_window"),
        "head_dim": field(r, f"{arch}.attention.key_length", field(r, f"{arch}.embedding_length") // n_head),
    }
    if n_expert:
        cfg["num_experts_per_tok"] = field(r, f"{arch}.expert_used_count")
        expert_ff = field(r, f"{arch}.expert_feed_forward_length", cfg["intermediate_size"])
        if mixtral:
            cfg.update(num_local_experts=n_expert, intermediate_size=expert_ff)
        else:
            norm = field(r, f"{arch}.expert_weights_norm", arch == "qwen3moe")
            cfg.update(num_experts=n_expert, moe_intermediate_size=expert_ff, norm_topk_prob=bool(norm))
            if arch == "qwen2moe":
                cfg["shared_expert_intermediate_size"] = field(r, f"{arch}.expert_shared_feed_forward_length")
    scaling = field(r, f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": field(r, f"{arch}.rope.scaling.factor")}
    elif scaling == "yarn":
        cfg["rope_scaling"] = {"rope_type": "yarn", "factor": field(r, f"{arch}.rope.scaling.factor"),
                               "original_max_position_embeddings": field(r, f"{arch}.rope.scaling.original_context_length")}
    elif scaling != "none":
        raise SystemExit(f"{a.gguf}: rope scaling {scaling!r} has no Hugging Face config here")
    if longrope:
        cfg["rope_scaling"] = {"rope_type": "longrope", "short_factor": longrope["short"], "long_factor": longrope["long"],
                               "attention_factor": field(r, f"{arch}.rope.scaling.attn_factor", 1.0)}
        cfg["original_max_position_embeddings"] = cfg["max_position_embeddings"]
    with open(os.path.join(a.out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    print(f"{a.out_dir}: {len(tensors)} tensors as {a.dtype}, {sum(len(b) for _, _, b in tensors) / 2**20:.1f} MiB")


def tail_of(name):
    return name.split(".", 2)[2] if name.startswith("blk.") else name


if __name__ == "__main__":
    main()
