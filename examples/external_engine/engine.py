#!/usr/bin/env python3
"""An engine that speaks Touchstone's dump protocol (docs/DUMP_FORMAT.md): a template.

It needs numpy and gguf: `pip install -r requirements.txt` (the file beside this one).

It stands for "your engine": a numpy float64 Llama (or Mamba-2, Granite 4.0-H, Qwen3-Next, DeepSeek V3) forward pass over a GGUF file
(weights decoded by gguf-py) that writes every tap Touchstone knows and the logits. Copy this folder (engine.py,
touchstone_dump.py, requirements.txt) anywhere and gate it from there:

    cargo xtask gate        --device "exec:python3 engine.py" --model tiny-llama --name my-engine
    cargo xtask layer-diff  --device "exec:python3 engine.py" --model tiny-llama
    cargo xtask fixed-token --device "exec:python3 engine.py" --model tiny-llama

To adapt it to your engine: keep `main()` and touchstone_dump.py; replace `forward()` with a call into
your engine that fills `taps` with what it computed (name -> [positions, width] array; the names
are in docs/DUMP_FORMAT.md: `inp_embd`, `blk.N.attn_norm`, ..., `blk.N.l_out`, `result_norm`),
and say in ARITHMETIC how it computes (storage and accumulation formats, Q8 activation blocks):
the budgets are derived from that declaration. Dump at least every `blk.N.l_out` and the logits
(the default `--require-taps layers`); every tap lets a failure name its op.

Touchstone passes the request in the environment: TOUCHSTONE_MODEL (model path),
TOUCHSTONE_PROMPT_IDS (comma-separated ids), TOUCHSTONE_N_GENERATE (greedy tokens wanted, 0 for one
prefill), TOUCHSTONE_OUT (directory to write) and TOUCHSTONE_MODEL_SHA256; touchstone_dump.py reads
them and writes the dump. With TOUCHSTONE_N_GENERATE > 0 it writes a
token-only dump (`generated_ids`, no tensors); otherwise taps and logits of every position. With
TOUCHSTONE_TASK=schedule it serves a schedule of many requests (docs/SERVING_PROTOCOL.md, through
touchstone_serving.py: `cargo xtask serving --device "exec:python3 engine.py" --model tiny-llama`).
With any other TOUCHSTONE_TASK, Touchstone asks for the op protocol (docs/OP_PROTOCOL.md), which
this engine does not speak: it exits non-zero and its ops are reported unsupported.
"""
import os
import sys

import touchstone_dump

try:
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
except ImportError as e:
    sys.exit(f"engine.py needs numpy and gguf ({e}): pip install -r requirements.txt, the file beside engine.py")

# Touchstone's own tests seed bugs through this. Mamba-2 models: `ssm_state_bf16` (the state
# rounded to bf16 after each position), `ssm_conv_shifted` (the convolution's window one position
# off), `ssm_decay_sign` (exp(-dt A) for exp(dt A)). DeepSeek models: `mla_absorbed_scale` (the
# absorbed scores scaled by the cached row's width), `mla_rope_slice_swapped` (RoPE on each query
# head's first dimensions, not its last), `expert_groups_ignored` (experts from every group).
# Granite 4.0-H models: `residual_scale_dropped` (branches added unscaled), and the Mamba-2 ones.
# Qwen3-Next models: the Mamba-2 ones in its gated DeltaNet layers, `attn_gate_dropped` (the
# attention's output gate never applied), `rope_whole_head` (RoPE over whole heads, not a quarter).
BUG = os.environ.get("TOUCHSTONE_EXAMPLE_BUG", "")

# How this engine computes, as the budgets see it: values stored as f32 in the dump.
ARITHMETIC = {"storage": "f32", "accumulate": "f32", "activation_q8_block": None, "transcendental_ulps": 4.0, "fixed": None}


# ----------------------------------------------------------------------------------------------
# The engine: replace this part with yours.
# ----------------------------------------------------------------------------------------------

def load(path):
    r = GGUFReader(path)
    field = lambda key: r.fields[key].contents()
    arch = field("general.architecture")
    if arch in ("mamba2", "granitehybrid"):
        cfg = {"arch": arch, "n_layer": int(field(f"{arch}.block_count")), "eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon"))}
        for k in ("inner_size", "state_size", "group_count", "time_step_rank", "conv_kernel"):
            cfg[k] = int(field(f"{arch}.ssm.{k}"))
        if arch == "granitehybrid":
            # Granite 4.0-H: Mamba-2 layers (no key/value heads) and attention layers without
            # RoPE, each followed by an FFN; embeddings, scores, residual branches and logits scaled.
            kv = field("granitehybrid.attention.head_count_kv")
            cfg.update({"n_head": int(field("granitehybrid.attention.head_count")), "n_head_kv": [int(v) for v in (kv if isinstance(kv, list) else [kv] * cfg["n_layer"])]})
            for k in ("embedding_scale", "residual_scale", "logit_scale", "attention.scale"):
                cfg[k] = float(field(f"granitehybrid.{k}"))
    elif arch == "llama":
        cfg = {
            "arch": arch,
            "n_layer": int(field("llama.block_count")),
            "n_head": int(field("llama.attention.head_count")),
            "n_head_kv": int(field("llama.attention.head_count_kv")),
            "eps": float(field("llama.attention.layer_norm_rms_epsilon")),
            "theta": float(field("llama.rope.freq_base")),
        }
    elif arch == "qwen3next":
        qn = lambda k, default=None: field(f"qwen3next.{k}") if f"qwen3next.{k}" in r.fields else default
        cfg = {"arch": arch, "n_layer": int(qn("block_count")), "n_head": int(qn("attention.head_count")), "n_head_kv": int(qn("attention.head_count_kv")),
               "eps": float(qn("attention.layer_norm_rms_epsilon")), "theta": float(qn("rope.freq_base")), "n_rot": int(qn("rope.dimension_count")),
               "recurrent": [bool(v) for v in qn("attention.recurrent_layers")], "n_used": int(qn("expert_used_count")),
               "norm_w": bool(qn("expert_weights_norm", True))}
        for k in ("inner_size", "state_size", "group_count", "time_step_rank", "conv_kernel"):
            cfg[k] = int(field(f"qwen3next.ssm.{k}"))
    elif arch == "deepseek2":
        ds = lambda k, default=None: field(f"deepseek2.{k}") if f"deepseek2.{k}" in r.fields else default
        cfg = {"arch": arch, "n_layer": int(ds("block_count")), "n_head": int(ds("attention.head_count")), "eps": float(ds("attention.layer_norm_rms_epsilon")),
               "theta": float(ds("rope.freq_base")), "q_lora": int(ds("attention.q_lora_rank", 0)), "kv_lora": int(ds("attention.kv_lora_rank")),
               "rope": int(ds("rope.dimension_count")), "key": int(ds("attention.key_length_mla")), "value": int(ds("attention.value_length_mla")),
               "yarn": (float(ds("rope.scaling.factor", 1.0)), int(ds("rope.scaling.original_context_length", 0)), float(ds("rope.scaling.yarn_beta_fast", 32.0)),
                        float(ds("rope.scaling.yarn_beta_slow", 1.0)), float(ds("rope.scaling.yarn_log_multiplier", 0.0))) if ds("rope.scaling.type") == "yarn" else None,
               "dense": int(ds("leading_dense_block_count", 0)), "n_used": int(ds("expert_used_count", 0)), "groups": (int(ds("expert_group_count", 1)), int(ds("expert_group_used_count", 1))),
               "norm_w": bool(ds("expert_weights_norm", False)), "scale_w": float(ds("expert_weights_scale", 1.0))}
    else:
        sys.exit(f"{path}: architecture {arch} is none of llama, mamba2, granitehybrid, qwen3next, deepseek2 (this example runs those)")
    # gguf-py gives each tensor in numpy order ([rows, cols]).
    w = {t.name: dequantize(t.data, t.tensor_type).astype(np.float64).reshape([int(d) for d in reversed(t.shape)]) for t in r.tensors}
    return cfg, w


def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x, theta):
    """Llama's "normal" RoPE over [n, heads, head_dim]: adjacent pairs (2i, 2i+1) rotated."""
    n, hd = x.shape[0], x.shape[-1]
    ang = np.arange(n, dtype=np.float64)[:, None] * theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return out


def rope_yarn(x, cfg):
    """DeepSeek's RoPE over [n, heads, n_rot]: adjacent pairs, YaRN's frequencies (llama.cpp's
    ramp between interpolated and extrapolated angles) at magnitude 1."""
    n, nr = x.shape[0], x.shape[-1]
    base = cfg["theta"] ** (-np.arange(0, nr, 2, dtype=np.float64) / nr)
    if cfg["yarn"] is not None and cfg["yarn"][0] > 1.0:
        factor, orig, fast, slow, _ = cfg["yarn"]
        corr = lambda beta: nr * np.log(orig / (beta * 2 * np.pi)) / (2 * np.log(cfg["theta"]))
        low, high = max(np.floor(corr(fast)), 0.0), min(np.ceil(corr(slow)), nr - 1.0)
        keep = 1.0 - np.clip((np.arange(nr // 2) - low) / max(high - low, 0.001), 0.0, 1.0)
        base = base / factor * (1.0 - keep) + base * keep
    ang = np.arange(n, dtype=np.float64)[:, None] * base[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return out


def mla_attention(cfg, w, p, h, taps):
    """DeepSeek's latent attention in the absorbed form: each head's unrotated query taken into
    the latent's space through its key rows, scored against the normed latents (its rotated part
    against the one shared rotated key), the weighted latents out through its value rows."""
    n, nh, r, nr = h.shape[0], cfg["n_head"], cfg["kv_lora"], cfg["rope"]
    nope, vd = cfg["key"] - nr, cfg["value"]
    if cfg["q_lora"]:
        qa = taps[p + "attn_q_a"] = rms_norm(h @ w[p + "attn_q_a.weight"].T, w[p + "attn_q_a_norm.weight"], cfg["eps"])
        q = taps[p + "attn_q"] = qa @ w[p + "attn_q_b.weight"].T
    else:
        q = taps[p + "attn_q"] = h @ w[p + "attn_q.weight"].T
    kv = h @ w[p + "attn_kv_a_mqa.weight"].T
    lat = taps[p + "attn_kv_a"] = rms_norm(kv[:, :r], w[p + "attn_kv_a_norm.weight"], cfg["eps"])
    k_pe = taps[p + "attn_k"] = kv[:, r:]
    q = q.reshape(n, nh, nope + nr).copy()
    at = 0 if BUG == "mla_rope_slice_swapped" else nope
    q[..., at:at + nr] = rope_yarn(q[..., at:at + nr], cfg)
    k_pe = rope_yarn(k_pe[:, None, :], cfg)[:, 0]
    taps[p + "attn_q_rope"], taps[p + "attn_k_rope"] = q.reshape(n, -1), k_pe
    # The expansion as the converter splits it: per head its key rows transposed, its value rows.
    k_b, v_b = w[p + "attn_k_b.weight"], w[p + "attn_v_b.weight"]  # [heads, r, nope], [heads, vd, r]
    yarn = cfg["yarn"]
    mscale = 1.0 + yarn[4] * np.log(yarn[0]) if yarn is not None and yarn[0] > 1.0 else 1.0
    scale = mscale * mscale / np.sqrt((r + nr) if BUG == "mla_absorbed_scale" else (nope + nr))
    q_abs = np.einsum("nhc,hrc->nhr", q[..., :nope], k_b)
    scores = (np.einsum("nhr,jr->hnj", q_abs, lat) + np.einsum("nhe,je->hnj", q[..., nope:], k_pe)) * scale
    scores += np.triu(np.full((n, n), -np.inf), k=1)[None]
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    ctx = np.einsum("hnj,jr->nhr", probs, lat)
    kqv = taps[p + "attn_kqv"] = np.einsum("nhr,hvr->nhv", ctx, v_b).reshape(n, nh * vd)
    return kqv @ w[p + "attn_output.weight"].T


def swiglu_ffn(w, p, suffix, h):
    g, u = h @ w[f"{p}ffn_gate{suffix}.weight"].T, h @ w[f"{p}ffn_up{suffix}.weight"].T
    return g, u, g / (1.0 + np.exp(-g)) * u


def deepseek_moe(cfg, w, p, h, taps):
    """DeepSeek V3's experts: sigmoid scores, the choice biased by `exp_probs_b` and limited to
    the best groups (each ranked by its two best scores), the chosen weights renormalized and
    scaled, beside the shared experts."""
    n, k = h.shape[0], cfg["n_used"]
    probs = taps[p + "ffn_moe_probs"] = 1.0 / (1.0 + np.exp(-(h @ w[p + "ffn_gate_inp.weight"].T)))
    choice = probs + w[p + "exp_probs_b.bias"].reshape(-1)
    n_group, keep = cfg["groups"]
    if n_group > 1 and BUG != "expert_groups_ignored":
        grouped = choice.reshape(n, n_group, -1)
        best = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)
        kept = np.argsort(-best, axis=-1, kind="stable")[:, :keep]
        mask = np.zeros((n, n_group), dtype=bool)
        np.put_along_axis(mask, kept, True, axis=-1)
        choice = np.where(mask[:, :, None], grouped, -np.inf).reshape(n, -1)
    chosen = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    taps[p + "ffn_moe_topk"] = chosen.astype(np.float64)
    weights = np.take_along_axis(probs, chosen, axis=-1)
    if cfg["norm_w"]:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    weights = weights * cfg["scale_w"]
    out = np.zeros_like(h)
    for t in range(n):
        for e, wt in zip(chosen[t], weights[t]):
            g, u = w[p + "ffn_gate_exps.weight"][e] @ h[t], w[p + "ffn_up_exps.weight"][e] @ h[t]
            out[t] += wt * (w[p + "ffn_down_exps.weight"][e] @ (g / (1.0 + np.exp(-g)) * u))
    return out + swiglu_ffn(w, p, "_shexp", h)[2] @ w[p + "ffn_down_shexp.weight"].T


def deepseek_layer(cfg, w, i, x, taps):
    p = f"blk.{i}."
    h = taps[p + "attn_norm"] = rms_norm(x, w[p + "attn_norm.weight"], cfg["eps"])
    attn = taps[p + "attn_out"] = mla_attention(cfg, w, p, h, taps)
    x = taps[p + "ffn_inp"] = x + attn
    h = taps[p + "ffn_norm"] = rms_norm(x, w[p + "ffn_norm.weight"], cfg["eps"])
    if i < cfg["dense"]:
        taps[p + "ffn_gate"], taps[p + "ffn_up"], act = swiglu_ffn(w, p, "", h)
        taps[p + "ffn_act"] = act
        ffn = act @ w[p + "ffn_down.weight"].T
    else:
        ffn = deepseek_moe(cfg, w, p, h, taps)
    taps[p + "ffn_out"] = ffn
    return x + ffn


def gated_deltanet(cfg, w, p, h, taps):
    """Qwen3-Next's linear attention over every position: q/k/v (each key head's q, then each
    key head's k, then each value head's v), the causal convolution and SiLU, q and k L2-normed
    (q over sqrt(d_k)), the decay exp(A softplus(a + dt_bias)) and the delta rule one position
    after another, the norm per value head, then the gate SiLU(z), the output projection."""
    n, di, dk, nk, nv, kc = h.shape[0], cfg["inner_size"], cfg["state_size"], cfg["group_count"], cfg["time_step_rank"], cfg["conv_kernel"]
    dv, cd, per = di // nv, di + 2 * nk * dk, nv // nk
    qkv = h @ w[p + "attn_qkv.weight"].T
    z = h @ w[p + "attn_gate.weight"].T
    ba = (h @ w[p + "ssm_ba.weight"].T).reshape(n, nk, 2, per)  # per key head: its value heads' b, then their a
    b, a = ba[:, :, 0].reshape(n, nv), ba[:, :, 1].reshape(n, nv)
    taps[p + "ssm_in"] = np.concatenate([qkv, z, b, a], axis=1)
    kernel = w[p + "ssm_conv1d.weight"].reshape(cd, kc)
    if BUG == "ssm_conv_shifted":
        kernel = np.concatenate([kernel[:, 1:], np.zeros((cd, 1))], axis=1)
    padded = np.concatenate([np.zeros((kc - 1, cd)), qkv])
    conv = sum(kernel[:, j] * padded[j:j + n] for j in range(kc))
    conv = taps[p + "ssm_conv"] = conv / (1.0 + np.exp(-conv))
    l2 = lambda x: x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)
    q = l2(conv[:, :nk * dk].reshape(n, nk, dk)) / np.sqrt(dk)
    k = l2(conv[:, nk * dk:2 * nk * dk].reshape(n, nk, dk))
    v = conv[:, 2 * nk * dk:].reshape(n, nv, dv)
    group = np.arange(nv) // per
    beta = 1.0 / (1.0 + np.exp(-b))
    neg_a = w[p + "ssm_a"].reshape(-1) * (-1.0 if BUG == "ssm_decay_sign" else 1.0)
    decay = np.exp(neg_a * np.logaddexp(0.0, a + w[p + "ssm_dt.bias"].reshape(-1)))
    state, states, y = np.zeros((nv, dv, dk)), [], np.empty((n, nv, dv))
    for t in range(n):
        state = decay[t][:, None, None] * state
        kt = k[t][group]  # [nv, dk]
        delta = beta[t][:, None] * (v[t] - np.einsum("hpn,hn->hp", state, kt))
        state = state + delta[:, :, None] * kt[:, None, :]
        if BUG == "ssm_state_bf16":
            state = bf16(state)
        states.append(state.reshape(-1))
        y[t] = np.einsum("hpn,hn->hp", state, q[t][group])
    taps[p + "ssm_state"] = np.array(states)
    taps[p + "ssm_scan"] = y.reshape(n, di)
    y = y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + cfg["eps"]) * w[p + "ssm_norm.weight"].reshape(-1)
    y = taps[p + "ssm_norm"] = y.reshape(n, di) * (z / (1.0 + np.exp(-z)))
    out = taps[p + "ssm_out"] = y @ w[p + "ssm_out.weight"].T
    return out


def rope_neox(x, theta, n_rot):
    """RoPE over the first `n_rot` dimensions of each head of [n, heads, head_dim], pairs
    (i, i + n_rot / 2) (rotate-half)."""
    n, half = x.shape[0], n_rot // 2
    ang = np.arange(n, dtype=np.float64)[:, None] * theta ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    x0, x1 = x[..., :half], x[..., half:n_rot]
    out[..., :half], out[..., half:n_rot] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    return out


def gated_attention(cfg, w, p, h, taps):
    """Qwen3-Next's attention: each head's query then its output gate from `attn_q`, q and k
    RMS-normed per head, RoPE on a share of each head, the output times sigmoid(gate)."""
    n, nh, nkv = h.shape[0], cfg["n_head"], cfg["n_head_kv"]
    qg = (h @ w[p + "attn_q.weight"].T).reshape(n, nh, 2, -1)
    hd = qg.shape[-1]
    q, gate = qg[:, :, 0], qg[:, :, 1].reshape(n, nh * hd)
    taps[p + "attn_gate"] = gate
    taps[p + "attn_q"] = q.reshape(n, -1)
    k = taps[p + "attn_k"] = h @ w[p + "attn_k.weight"].T
    v = taps[p + "attn_v"] = h @ w[p + "attn_v.weight"].T
    q = rms_norm(q, w[p + "attn_q_norm.weight"], cfg["eps"])
    k = rms_norm(k.reshape(n, nkv, hd), w[p + "attn_k_norm.weight"], cfg["eps"])
    taps[p + "attn_q_norm"], taps[p + "attn_k_norm"] = q.reshape(n, -1), k.reshape(n, -1)
    n_rot = hd if BUG == "rope_whole_head" else cfg["n_rot"]
    q, k = rope_neox(q, cfg["theta"], n_rot), rope_neox(k, cfg["theta"], n_rot)
    taps[p + "attn_q_rope"], taps[p + "attn_k_rope"] = q.reshape(n, -1), k.reshape(n, -1)
    k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v.reshape(n, nkv, hd), nh // nkv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + np.triu(np.full((n, n), -np.inf), k=1)[None]
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    kqv = taps[p + "attn_kqv"] = np.einsum("hqk,khd->qhd", probs, v).reshape(n, nh * hd)
    if BUG != "attn_gate_dropped":
        kqv = taps[p + "attn_gated"] = kqv / (1.0 + np.exp(-gate))
    return kqv @ w[p + "attn_output.weight"].T


def qwen_moe(cfg, w, p, h, taps):
    """Softmax routing to the top experts, their shares renormalized, beside a shared expert
    scaled by the sigmoid of its own gate."""
    n, k = h.shape[0], cfg["n_used"]
    logits = h @ w[p + "ffn_gate_inp.weight"].T
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = taps[p + "ffn_moe_probs"] = probs / probs.sum(axis=-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    taps[p + "ffn_moe_topk"] = chosen.astype(np.float64)
    weights = np.take_along_axis(probs, chosen, axis=-1)
    if cfg["norm_w"]:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    out = np.zeros_like(h)
    for t in range(n):
        for e, wt in zip(chosen[t], weights[t]):
            g, u = w[p + "ffn_gate_exps.weight"][e] @ h[t], w[p + "ffn_up_exps.weight"][e] @ h[t]
            out[t] += wt * (w[p + "ffn_down_exps.weight"][e] @ (g / (1.0 + np.exp(-g)) * u))
    shared_gate = 1.0 / (1.0 + np.exp(-(h @ w[p + "ffn_gate_inp_shexp.weight"].reshape(-1))))
    return out + shared_gate[:, None] * (swiglu_ffn(w, p, "_shexp", h)[2] @ w[p + "ffn_down_shexp.weight"].T)


def qwen_next_layer(cfg, w, i, x, taps):
    p = f"blk.{i}."
    h = taps[p + "attn_norm"] = rms_norm(x, w[p + "attn_norm.weight"], cfg["eps"])
    if cfg["recurrent"][i]:
        mix = gated_deltanet(cfg, w, p, h, taps)
    else:
        mix = taps[p + "attn_out"] = gated_attention(cfg, w, p, h, taps)
    x = taps[p + "ffn_inp"] = x + mix
    h = taps[p + "ffn_norm"] = rms_norm(x, w[p + "post_attention_norm.weight"], cfg["eps"])
    ffn = taps[p + "ffn_out"] = qwen_moe(cfg, w, p, h, taps)
    return x + ffn


def bf16(x):
    """x rounded to bfloat16 (nearest, ties to even), as float64."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def mamba2_layer(cfg, w, p, x, taps):
    """A Mamba-2 layer: its mixer, then the residual add."""
    h = taps[p + "attn_norm"] = rms_norm(x, w[p + "attn_norm.weight"], cfg["eps"])
    return x + mamba2_mixer(cfg, w, p, h, taps)


def granite_layer(cfg, w, i, x, taps):
    """A Granite 4.0-H layer: a Mamba-2 mixer (no key/value heads) or attention without RoPE,
    then the FFN, each branch scaled before its residual add."""
    p, rs = f"blk.{i}.", (1.0 if BUG == "residual_scale_dropped" else cfg["residual_scale"])
    h = taps[p + "attn_norm"] = rms_norm(x, w[p + "attn_norm.weight"], cfg["eps"])
    if cfg["n_head_kv"][i] == 0:
        mix = mamba2_mixer(cfg, w, p, h, taps)
    else:
        mix = taps[p + "attn_out"] = attention(w, p, h, taps, cfg["n_head"], cfg["n_head_kv"][i], None, cfg["attention.scale"])
    x = taps[p + "ffn_inp"] = x + rs * mix
    h = taps[p + "ffn_norm"] = rms_norm(x, w[p + "ffn_norm.weight"], cfg["eps"])
    taps[p + "ffn_gate"], taps[p + "ffn_up"], act = swiglu_ffn(w, p, "", h)
    taps[p + "ffn_act"] = act
    ffn = taps[p + "ffn_out"] = act @ w[p + "ffn_down.weight"].T
    return x + rs * ffn


def attention(w, p, h, taps, nh, nkv, theta, scale=None):
    """Causal grouped-query attention over every position (RoPE with base `theta`, none for
    None), through the output projection."""
    n = h.shape[0]
    q = taps[p + "attn_q"] = h @ w[p + "attn_q.weight"].T
    k = taps[p + "attn_k"] = h @ w[p + "attn_k.weight"].T
    v = taps[p + "attn_v"] = h @ w[p + "attn_v.weight"].T
    hd = q.shape[1] // nh
    q, k = q.reshape(n, nh, hd), k.reshape(n, nkv, hd)
    if theta is not None:
        q, k = rope(q, theta), rope(k, theta)
        taps[p + "attn_q_rope"], taps[p + "attn_k_rope"] = q.reshape(n, -1), k.reshape(n, -1)
    k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v.reshape(n, nkv, hd), nh // nkv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * (scale if scale is not None else 1.0 / np.sqrt(hd)) + np.triu(np.full((n, n), -np.inf), k=1)[None]
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    kqv = taps[p + "attn_kqv"] = np.einsum("hqk,khd->qhd", probs, v).reshape(n, nh * hd)
    return kqv @ w[p + "attn_output.weight"].T


def mamba2_mixer(cfg, w, p, h, taps):
    """A Mamba-2 mixer over every position: the input projection, the causal convolution and
    SiLU, the selective scan one position after another, the gated norm, the output projection."""
    n, di, ds, ng, nh, kc = h.shape[0], cfg["inner_size"], cfg["state_size"], cfg["group_count"], cfg["time_step_rank"], cfg["conv_kernel"]
    hd, cd = di // nh, di + 2 * ng * ds
    zx = taps[p + "ssm_in"] = h @ w[p + "ssm_in.weight"].T
    z, xbc, dt = zx[:, :di], zx[:, di:di + cd], zx[:, di + cd:]
    kernel = w[p + "ssm_conv1d.weight"].reshape(cd, kc)
    if BUG == "ssm_conv_shifted":  # each tap takes the next one's weight: the window one position off
        kernel = np.concatenate([kernel[:, 1:], np.zeros((cd, 1))], axis=1)
    padded = np.concatenate([np.zeros((kc - 1, cd)), xbc])
    conv = sum(kernel[:, j] * padded[j:j + n] for j in range(kc)) + w[p + "ssm_conv1d.bias"].reshape(-1)
    conv = taps[p + "ssm_conv"] = conv / (1.0 + np.exp(-conv))
    xs, bs, cs = conv[:, :di].reshape(n, nh, hd), conv[:, di:di + ng * ds].reshape(n, ng, ds), conv[:, di + ng * ds:].reshape(n, ng, ds)
    a = w[p + "ssm_a"].reshape(-1) * (-1.0 if BUG == "ssm_decay_sign" else 1.0)
    step = np.logaddexp(0.0, dt + w[p + "ssm_dt.bias"].reshape(-1))  # softplus
    group = np.arange(nh) // (nh // ng)
    state, states, y = np.zeros((nh, hd, ds)), [], np.empty((n, nh, hd))
    for t in range(n):
        state = np.exp(step[t] * a)[:, None, None] * state + (step[t][:, None] * xs[t])[:, :, None] * bs[t][group][:, None, :]
        if BUG == "ssm_state_bf16":
            state = bf16(state)
        states.append(state.reshape(-1))
        y[t] = np.einsum("hpn,hn->hp", state, cs[t][group]) + w[p + "ssm_d"].reshape(-1)[:, None] * xs[t]
    taps[p + "ssm_state"] = np.array(states)
    y = taps[p + "ssm_scan"] = y.reshape(n, di)
    v = (y * z / (1.0 + np.exp(-z))).reshape(n, ng, di // ng)
    v = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + cfg["eps"])
    y = taps[p + "ssm_norm"] = (v * w[p + "ssm_norm.weight"].reshape(ng, di // ng)).reshape(n, di)
    out = taps[p + "ssm_out"] = y @ w[p + "ssm_out.weight"].T
    return out


def forward(cfg, w, ids, taps):
    """Logits [n, vocab] of every position; every tap into `taps` ([n, width] each)."""
    if cfg["arch"] in ("mamba2", "granitehybrid", "qwen3next", "deepseek2"):
        x = taps["inp_embd"] = w["token_embd.weight"][ids] * cfg.get("embedding_scale", 1.0)
        for i in range(cfg["n_layer"]):
            if cfg["arch"] == "mamba2":
                x = mamba2_layer(cfg, w, f"blk.{i}.", x, taps)
            else:
                x = {"granitehybrid": granite_layer, "qwen3next": qwen_next_layer, "deepseek2": deepseek_layer}[cfg["arch"]](cfg, w, i, x, taps)
            taps[f"blk.{i}.l_out"] = x
        x = taps["result_norm"] = rms_norm(x, w["output_norm.weight"], cfg["eps"])
        return x @ w.get("output.weight", w["token_embd.weight"]).T / cfg.get("logit_scale", 1.0)
    x = taps["inp_embd"] = w["token_embd.weight"][ids]
    for i in range(cfg["n_layer"]):
        p = f"blk.{i}."
        h = taps[p + "attn_norm"] = rms_norm(x, w[p + "attn_norm.weight"], cfg["eps"])
        attn = taps[p + "attn_out"] = attention(w, p, h, taps, cfg["n_head"], cfg["n_head_kv"], cfg["theta"])
        x = taps[p + "ffn_inp"] = x + attn
        h = taps[p + "ffn_norm"] = rms_norm(x, w[p + "ffn_norm.weight"], cfg["eps"])
        g = taps[p + "ffn_gate"] = h @ w[p + "ffn_gate.weight"].T
        u = taps[p + "ffn_up"] = h @ w[p + "ffn_up.weight"].T
        act = taps[p + "ffn_act"] = g / (1.0 + np.exp(-g)) * u
        ffn = taps[p + "ffn_out"] = act @ w[p + "ffn_down.weight"].T
        x = x + ffn
        taps[p + "l_out"] = x
    x = taps["result_norm"] = rms_norm(x, w["output_norm.weight"], cfg["eps"])
    return x @ w.get("output.weight", w["token_embd.weight"]).T


# ----------------------------------------------------------------------------------------------
# The request and the dump: touchstone_dump.py (beside this file) reads one and writes the other.
# ----------------------------------------------------------------------------------------------

def serve_schedule(model):
    """The schedule task (touchstone_serving.py): this engine's cache is the list of token ids it
    holds, and each chunk's logits are the last rows of a forward pass over the whole list."""
    import touchstone_serving
    cfg, w = load(model)

    # Per cache, the taps of the positions each step computed (its last rows), for the request
    # Touchstone asks the taps of.
    computed_taps = {}

    def keep(cache, taps, n):
        held = computed_taps.setdefault(id(cache), {})
        for name, rows in taps.items():
            held.setdefault(name, []).extend(rows[-n:])

    def step(batch):
        out = []
        for cache, ids in batch:
            cache.extend(ids)
            taps = {}
            out.append(forward(cfg, w, cache, taps)[-len(ids):])
            keep(cache, taps, len(ids))
        return out

    def taps_of(cache):
        return {name: np.array(rows) for name, rows in computed_taps.get(id(cache), {}).items()}

    # Each request is computed alone, the same way whatever is beside it: batch-invariant.
    touchstone_serving.serve(empty=list, prefix=lambda cache, n: list(cache[:n]), step=step, batch_invariant=True, taps_of=taps_of)


def main():
    if os.environ.get("TOUCHSTONE_TASK") == "schedule":
        return serve_schedule(os.environ["TOUCHSTONE_MODEL"])
    req = touchstone_dump.request()
    if req.task:
        sys.exit(f"TOUCHSTONE_TASK={req.task}: this engine speaks the dump protocol and the schedule task, not the op protocol")
    cfg, w = load(req.model)
    dump = touchstone_dump.Dump(device="example-numpy-f64", arithmetic=ARITHMETIC, precision="f64")
    if req.n_generate > 0:
        seq = list(req.ids)
        for _ in range(req.n_generate):
            seq.append(int(np.argmax(forward(cfg, w, seq, {})[-1])))
        dump.generated(seq[len(req.ids):])
    else:
        taps = {}
        logits = forward(cfg, w, req.ids, taps)
        for name, rows in taps.items():
            dump.tap(name, rows)
        dump.logits(logits)
    dump.write()


if __name__ == "__main__":
    main()
