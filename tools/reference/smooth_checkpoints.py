#!/usr/bin/env python3
"""Writes Llama checkpoints (config.json + model.safetensors, F32) whose weight rows are smooth:
each matrix holds scale * sin(i * k + phase) along its flattened values, k and phase drawn per
tensor. Products with such rows cancel (their terms are many times their outputs), the case
layer-diff budgets by the terms' size (docs/ACCURACY.md, "Products whose terms cancel"):

    python3 tools/reference/smooth_checkpoints.py --out /tmp/smooth --count 40
    for s in $(seq 0 39); do
        cargo xtask gate --model /tmp/smooth/m$s --device cpu --device fixed --device gpu-emu \\
            --suite layers --suite tokens --report-dir /tmp/smooth/r$s
    done

Model `m{seed}` is drawn from numpy's default_rng(seed): vocabulary 3-299, 1-3 layers, width 16-96,
1-4 heads of 4-32, GQA where the heads allow; `--qwen3`, the same as Qwen3 (QK-norm). With
`--moe mixtral`, Mixtral checkpoints instead (1-2 layers, 2-8 experts of which 1-2 are used, a
random router, smooth expert matrices); with `--moe qwen2_moe`, Qwen2-MoE ones (random attention
with biases, router and output head; smooth experts and a smooth shared expert behind its
sigmoid gate); with `--moe qwen3_moe`, Qwen3-MoE ones (QK-norm with weights drawn in
[0.5, 1.5), top-k weights renormalized, smooth experts). A development aid (numpy, tools/reference/requirements.txt), never a runtime
dependency.
"""
import argparse
import json
import os

import numpy as np

import safetensors_file


def smooth(rng, shape, scale):
    """`scale * sin(i * k + phase)` along the flattened tensor, k and phase drawn from `rng`."""
    k, phase = rng.uniform(0.01, 1.5), rng.uniform(0, 6)
    n = int(np.prod(shape))
    return (scale * np.sin(np.arange(n) * k + phase)).reshape(shape).astype(np.float32)


def smooth_matrix(rng, shape):
    """A smooth matrix of a scale drawn in [0.05, 0.5)."""
    return smooth(rng, shape, float(rng.uniform(0.05, 0.5)))


def normal(rng, shape, scale):
    return rng.normal(0, scale, shape).astype(np.float32)


def attention(n_head, n_head_kv, head_dim, hidden):
    """The attention projections of a layer: (name, shape), Hugging Face order."""
    return [
        ("self_attn.q_proj", (n_head * head_dim, hidden)),
        ("self_attn.k_proj", (n_head_kv * head_dim, hidden)),
        ("self_attn.v_proj", (n_head_kv * head_dim, hidden)),
        ("self_attn.o_proj", (hidden, n_head * head_dim)),
    ]


def mlp(n_ff, hidden, gate, up, down):
    """A gated MLP's three matrices under the given names: (name, shape)."""
    return [(gate, (n_ff, hidden)), (up, (n_ff, hidden)), (down, (hidden, n_ff))]


def save(directory, tensors, model_type, hidden, n_ff, n_head, n_head_kv, head_dim, n_layer, n_vocab, rms_norm_eps, **extra):
    """Writes `tensors` (F32) and a config.json of the given type and dimensions (and `extra`)."""
    os.makedirs(directory, exist_ok=True)
    safetensors_file.write(os.path.join(directory, "model.safetensors"), [(name, "F32", a.shape, np.ascontiguousarray(a, dtype="<f4").tobytes()) for name, a in tensors.items()])
    config = {
        "model_type": model_type, "hidden_size": hidden, "intermediate_size": n_ff, "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv, "num_hidden_layers": n_layer, "vocab_size": n_vocab, "rms_norm_eps": rms_norm_eps,
        "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": False, "hidden_act": "silu",
        "head_dim": head_dim, **extra,
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


def checkpoint(directory, seed, qwen3=False):
    rng = np.random.default_rng(seed)
    n_vocab = int(rng.integers(3, 300))
    n_head = int(rng.choice([1, 2, 4]))
    head_dim = int(rng.choice([4, 8, 16, 32]))
    n_head_kv = int(rng.choice([n for n in (1, 2, 4) if n_head % n == 0]))
    hidden = int(rng.choice([16, 32, 64, 96]))
    n_ff = int(rng.choice([8, 32, 100]))
    n_layer = int(rng.integers(1, 4))
    ones = np.ones(hidden, np.float32)
    tensors = {"model.embed_tokens.weight": smooth(rng, (n_vocab, hidden), 1.0), "model.norm.weight": ones, "lm_head.weight": smooth(rng, (n_vocab, hidden), 1.0)}
    for layer in range(n_layer):
        prefix = f"model.layers.{layer}."
        for name, shape in attention(n_head, n_head_kv, head_dim, hidden) + mlp(n_ff, hidden, "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            tensors[prefix + name + ".weight"] = smooth_matrix(rng, shape)
        if qwen3:
            tensors[prefix + "self_attn.q_norm.weight"] = np.ones(head_dim, np.float32)
            tensors[prefix + "self_attn.k_norm.weight"] = np.ones(head_dim, np.float32)
        tensors[prefix + "input_layernorm.weight"] = ones
        tensors[prefix + "post_attention_layernorm.weight"] = ones
    save(directory, tensors, "qwen3" if qwen3 else "llama", hidden, n_ff, n_head, n_head_kv, head_dim, n_layer, n_vocab, 1e-5)


def moe_dims(rng):
    """The dimensions the MoE checkpoints draw, in this order (vocabulary, heads, head size, KV
    heads, width, expert FFN width)."""
    n_vocab = int(rng.integers(3, 300))
    n_head = int(rng.choice([1, 2, 4]))
    head_dim = int(rng.choice([8, 16, 32]))
    n_head_kv = int(rng.choice([n for n in (1, 2, 4) if n_head % n == 0]))
    hidden = int(rng.choice([16, 32, 64]))
    n_ff = int(rng.choice([8, 32, 64]))
    return n_vocab, n_head, head_dim, n_head_kv, hidden, n_ff


def experts_drawn(rng):
    """How many experts, and how many of them each token uses."""
    n_expert = int(rng.choice([2, 4, 8]))
    return n_expert, int(rng.integers(1, min(n_expert, 2) + 1))


def smooth_moe_checkpoint(directory, seed, model_type, router, experts, expert_names, rms_norm_eps, config, qk_norm=False):
    """Mixtral and Qwen3-MoE checkpoints: smooth embeddings, head, attention and experts (the
    `expert_names` gate, up and down matrices under `experts`), a random `router`; with `qk_norm`,
    QK-norm weights drawn in [0.5, 1.5). `config(n_ff, n_expert, n_used)` gives the type's own
    config.json keys."""
    rng = np.random.default_rng(seed)
    n_vocab, n_head, head_dim, n_head_kv, hidden, n_ff = moe_dims(rng)
    n_layer = int(rng.integers(1, 3))
    n_expert, n_used = experts_drawn(rng)
    ones = np.ones(hidden, np.float32)
    tensors = {"model.embed_tokens.weight": smooth(rng, (n_vocab, hidden), 1.0), "model.norm.weight": ones, "lm_head.weight": smooth(rng, (n_vocab, hidden), 1.0)}
    for layer in range(n_layer):
        prefix = f"model.layers.{layer}."
        for name, shape in attention(n_head, n_head_kv, head_dim, hidden):
            tensors[prefix + name + ".weight"] = smooth_matrix(rng, shape)
        if qk_norm:
            for b in ("q", "k"):
                tensors[prefix + f"self_attn.{b}_norm.weight"] = rng.uniform(0.5, 1.5, head_dim).astype(np.float32)
        tensors[prefix + router] = normal(rng, (n_expert, hidden), 0.5)
        for e in range(n_expert):
            for w, shape in mlp(n_ff, hidden, *expert_names):
                tensors[prefix + f"{experts}.{e}.{w}.weight"] = smooth_matrix(rng, shape)
        tensors[prefix + "input_layernorm.weight"] = ones
        tensors[prefix + "post_attention_layernorm.weight"] = ones
    save(directory, tensors, model_type, hidden, n_ff, n_head, n_head_kv, head_dim, n_layer, n_vocab, rms_norm_eps, **config(n_ff, n_expert, n_used))


def moe_checkpoint(directory, seed):
    smooth_moe_checkpoint(directory, seed, "mixtral", "block_sparse_moe.gate.weight", "block_sparse_moe.experts", ("w1", "w3", "w2"), 1e-5,
                          lambda n_ff, n_expert, n_used: dict(num_local_experts=n_expert, num_experts_per_tok=n_used, sliding_window=None))


def qwen2_moe_checkpoint(directory, seed):
    rng = np.random.default_rng(seed)
    n_vocab, n_head, head_dim, n_head_kv, hidden, n_ff = moe_dims(rng)
    n_shared = int(rng.choice([8, 32, 64]))
    n_layer = int(rng.integers(1, 3))
    n_expert, n_used = experts_drawn(rng)
    ones = np.ones(hidden, np.float32)
    tensors = {"model.embed_tokens.weight": normal(rng, (n_vocab, hidden), 1.0), "model.norm.weight": ones, "lm_head.weight": normal(rng, (n_vocab, hidden), 0.3)}
    for layer in range(n_layer):
        prefix = f"model.layers.{layer}."
        for name, shape in attention(n_head, n_head_kv, head_dim, hidden):
            tensors[prefix + name + ".weight"] = normal(rng, shape, 0.3)
        for b, n in [("q", n_head * head_dim), ("k", n_head_kv * head_dim), ("v", n_head_kv * head_dim)]:
            tensors[prefix + f"self_attn.{b}_proj.bias"] = normal(rng, (n,), 0.1)
        tensors[prefix + "mlp.gate.weight"] = normal(rng, (n_expert, hidden), 0.5)
        for e in range(n_expert):
            for w, shape in mlp(n_ff, hidden, "gate_proj", "up_proj", "down_proj"):
                tensors[prefix + f"mlp.experts.{e}.{w}.weight"] = smooth_matrix(rng, shape)
        for w, shape in mlp(n_shared, hidden, "gate_proj", "up_proj", "down_proj"):
            tensors[prefix + f"mlp.shared_expert.{w}.weight"] = smooth_matrix(rng, shape)
        tensors[prefix + "mlp.shared_expert_gate.weight"] = normal(rng, (1, hidden), 0.5)
        tensors[prefix + "input_layernorm.weight"] = ones
        tensors[prefix + "post_attention_layernorm.weight"] = ones
    save(directory, tensors, "qwen2_moe", hidden, n_ff, n_head, n_head_kv, head_dim, n_layer, n_vocab, 1e-6,
         moe_intermediate_size=n_ff, shared_expert_intermediate_size=n_shared, num_experts=n_expert, num_experts_per_tok=n_used,
         norm_topk_prob=False, decoder_sparse_step=1)


def qwen3_moe_checkpoint(directory, seed):
    smooth_moe_checkpoint(directory, seed, "qwen3_moe", "mlp.gate.weight", "mlp.experts", ("gate_proj", "up_proj", "down_proj"), 1e-6,
                          lambda n_ff, n_expert, n_used: dict(moe_intermediate_size=n_ff, num_experts=n_expert, num_experts_per_tok=n_used,
                                                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
                          qk_norm=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory that receives m0, m1, ...")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--count", type=int, default=40, help="how many checkpoints (seeds 0..count-1)")
    which.add_argument("--seed", type=int, help="only the checkpoint of this seed (m{seed})")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--moe", choices=["mixtral", "qwen2_moe", "qwen3_moe"], help="MoE checkpoints (smooth experts) of this type instead of Llama ones")
    kind.add_argument("--qwen3", action="store_true", help="Qwen3 checkpoints: the Llama ones with QK-norm (unit weights)")
    args = parser.parse_args()
    seeds = [args.seed] if args.seed is not None else range(args.count)
    write = {None: checkpoint, "mixtral": moe_checkpoint, "qwen2_moe": qwen2_moe_checkpoint, "qwen3_moe": qwen3_moe_checkpoint}[args.moe]
    if args.qwen3:
        write = lambda directory, seed: checkpoint(directory, seed, qwen3=True)
    for seed in seeds:
        write(os.path.join(args.out, f"m{seed}"), seed)
    print(f"wrote {len(seeds)} checkpoint(s) under {args.out}")


if __name__ == "__main__":
    main()
