#!/usr/bin/env python3
"""An independent f64 reference forward pass for Llama- and Gemma 3-architecture GGUF models.

Weights are decoded by gguf-py (llama.cpp's own Python package: `gguf.quants.dequantize`), not by
Touchstone's codecs; the forward pass is a plain numpy transcription of the Llama maths in float64
(no KV cache: every step recomputes the whole sequence). Gemma 3 (`gemma3`) follows Google's
published model: embeddings times sqrt(n_embd), per-head RMSNorm of queries and keys, RMSNorm of the
attention and FFN outputs before each residual add (the GGUF stores the norm weights with Gemma's
+1 already added), GELU (tanh) gated FFN, rotate-half RoPE, and five sliding-window layers (RoPE
base 10,000) to every global one (the file's base). Touchstone's tests compare the oracle with this
script's output; it is a development/test peer, never a runtime dependency.

Usage: llama_f64.py MODEL.gguf --prompt-ids 504,3575,282,4649,314 --greedy 32 --out ref.json
"""
import argparse
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def field(reader, key):
    f = reader.fields[key]
    return f.contents()


def load(path):
    r = GGUFReader(path)
    arch = field(r, "general.architecture")
    if arch not in ("llama", "gemma3"):
        sys.exit(f"{path}: architecture {arch} is neither llama nor gemma3")

    def get(key, default=None):
        return field(r, f"{arch}.{key}") if f"{arch}.{key}" in r.fields else default
    cfg = {
        "arch": arch,
        "n_embd": int(get("embedding_length")),
        "n_layer": int(get("block_count")),
        "n_head": int(get("attention.head_count")),
        "n_head_kv": int(get("attention.head_count_kv")),
        "eps": float(get("attention.layer_norm_rms_epsilon")),
        "theta": float(get("rope.freq_base")),
        "head_dim": int(get("attention.key_length", 0)) or None,
        "window": int(get("attention.sliding_window", 0)),
    }
    w = {}
    for t in r.tensors:
        # gguf-py returns the array in numpy order: shape reversed from GGML dims, i.e. [rows, cols].
        w[t.name] = dequantize(t.data, t.tensor_type).astype(np.float64).reshape([int(d) for d in reversed(t.shape)])
    return cfg, w


def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_normal(x, positions, theta):
    # x: [n_tok, n_head, head_dim]; llama.cpp "normal" RoPE rotates adjacent pairs (2i, 2i+1).
    hd = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)  # [hd/2]
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]  # [n_tok, hd/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def rope_neox(x, positions, theta):
    # Rotate-half RoPE (Hugging Face's layout): pairs (i, i + hd/2).
    hd = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x0, x1 = x[..., : hd // 2], x[..., hd // 2:]
    return np.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def forward(cfg, w, ids, taps=None, last_only=False):
    """Logits [n, vocab] of every position (of the last only with `last_only`); `taps`, when a
    dict, receives inp_embd, blk.{i}.attn_norm, blk.{i}.ffn_inp, blk.{i}.l_out and result_norm
    ([n, width] each)."""
    taps = {} if taps is None else taps
    n = len(ids)
    gemma = cfg["arch"] == "gemma3"
    d, nh, nkv = cfg["n_embd"], cfg["n_head"], cfg["n_head_kv"]
    hd = cfg["head_dim"] or d // nh
    x = w["token_embd.weight"][ids]  # [n, d]
    if gemma:
        x = x * np.sqrt(d)
    taps["inp_embd"] = x
    pos = list(range(n))
    causal = np.triu(np.full((n, n), -np.inf), k=1)
    # Gemma 3: keys more than `window` positions back are hidden on the local layers.
    far = np.tril(np.full((n, n), -np.inf), k=-cfg["window"]) if cfg["window"] else np.zeros((n, n))
    for i in range(cfg["n_layer"]):
        p = f"blk.{i}."
        local = gemma and cfg["window"] and (i + 1) % 6 != 0
        h = rms_norm(x, w[p + "attn_norm.weight"], cfg["eps"])
        taps[p + "attn_norm"] = h
        q = (h @ w[p + "attn_q.weight"].T).reshape(n, nh, hd)
        k = (h @ w[p + "attn_k.weight"].T).reshape(n, nkv, hd)
        v = (h @ w[p + "attn_v.weight"].T).reshape(n, nkv, hd)
        if gemma:
            q = rms_norm(q, w[p + "attn_q_norm.weight"], cfg["eps"])
            k = rms_norm(k, w[p + "attn_k_norm.weight"], cfg["eps"])
            theta = 10_000.0 if local else cfg["theta"]
            q, k = rope_neox(q, pos, theta), rope_neox(k, pos, theta)
        else:
            q, k = rope_normal(q, pos, cfg["theta"]), rope_normal(k, pos, cfg["theta"])
        group = nh // nkv
        k = np.repeat(k, group, axis=1)
        v = np.repeat(v, group, axis=1)
        mask = causal + far if local else causal
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask[None]
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(n, nh * hd)
        attn = attn @ w[p + "attn_output.weight"].T
        if gemma:
            attn = rms_norm(attn, w[p + "post_attention_norm.weight"], cfg["eps"])
        x = x + attn
        taps[p + "ffn_inp"] = x
        h = rms_norm(x, w[p + "ffn_norm.weight"], cfg["eps"])
        g = h @ w[p + "ffn_gate.weight"].T
        u = h @ w[p + "ffn_up.weight"].T
        act = gelu_tanh(g) if gemma else g / (1.0 + np.exp(-g))
        out = (act * u) @ w[p + "ffn_down.weight"].T
        if gemma:
            out = rms_norm(out, w[p + "post_ffw_norm.weight"], cfg["eps"])
        x = x + out
        taps[p + "l_out"] = x
    x = rms_norm(x, w["output_norm.weight"], cfg["eps"])
    taps["result_norm"] = x
    head = w.get("output.weight", w["token_embd.weight"])
    return (x[-1:] if last_only else x) @ head.T  # [n, vocab]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--greedy", type=int, default=32)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cfg, w = load(a.model)
    ids = [int(t) for t in a.prompt_ids.split(",")]
    logits = forward(cfg, w, ids)
    last = logits[-1]
    top5 = [int(i) for i in np.argsort(-last, kind="stable")[:5]]
    seq = list(ids)
    greedy = []
    step_logits = last
    for _ in range(a.greedy):
        nxt = int(np.argmax(step_logits))
        greedy.append(nxt)
        seq.append(nxt)
        step_logits = forward(cfg, w, seq, last_only=True)[-1]
    json.dump({"prompt_ids": ids, "last_logits": [float(v) for v in last], "top5": top5, "greedy": greedy}, open(a.out, "w"))


if __name__ == "__main__":
    main()
