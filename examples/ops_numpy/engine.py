#!/usr/bin/env python3
"""An engine's op adapter for Touchstone's op protocol (docs/OP_PROTOCOL.md), in numpy float32.

A template: copy this one file anywhere, keep the protocol code (the bottom half), and replace
the bodies in OPS with calls into your engine. It needs numpy and gguf-py (`pip install numpy
gguf`, for the GGML block decoders). Run it as

    cargo xtask kernels --device "exec:python3 path/to/engine.py"

Touchstone runs the command with TOUCHSTONE_TASK in the environment:
- `capabilities`: write $TOUCHSTONE_OUT/capabilities.json (the ops, weight types and the
  arithmetic this engine declares; bounds are derived from that declaration);
- `ops`: read $TOUCHSTONE_BATCH/cases.json and inputs.safetensors, write
  $TOUCHSTONE_OUT/results.json and outputs.safetensors.

Everything here computes in float32 (numpy's BLAS accumulates in f32), which is what
ARITHMETIC declares. Expert routing, argmax and top-k compare scores, so they are computed in
float64 to get the order right. `sample` needs Touchstone's own random stream and is reported
unsupported.

OPS_NUMPY_BF16=1 makes it an engine that stores its results in bf16: every float result rounded
to bf16 (the inputs, as given, and the arithmetic stay f32), declared as bf16 storage, so the
bounds widen to what bf16 costs; the same rounding under an f32 declaration fails.

TOUCHSTONE_EXAMPLE_BUG seeds a bug for Touchstone's own tests (each must turn cases red):
`rms_eps_x10`, `rope_pairs_swapped`, `q4_0_nibbles_swapped`, `bf16_declared_f32`.
"""
import json
import math
import os
import struct
import sys

import numpy as np

PROTOCOL, VERSION = "touchstone-ops", 1
BUG = os.environ.get("TOUCHSTONE_EXAMPLE_BUG", "")

# What this engine computes in: f32 storage and accumulation, exp/tanh/sin/cos within 4 ulps;
# with OPS_NUMPY_BF16, bf16 storage.
BF16 = os.environ.get("OPS_NUMPY_BF16") == "1" or BUG == "bf16_declared_f32"
ARITHMETIC = {"storage": "bf16" if BF16 and BUG != "bf16_declared_f32" else "f32", "accumulate": "f32", "activation_q8_block": None,
              "transcendental_ulps": 4.0, "fixed": None}

F32 = np.float32


def bf16(a):
    """float32 values rounded to the nearest bfloat16 (ties to even), kept as float32."""
    a = np.ascontiguousarray(a, dtype=F32)
    u = a.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    r = np.where(np.isfinite(a), r, a.view(np.uint32))
    return r.view(F32).reshape(a.shape)


# ----------------------------------------------------------------------------------------------
# Weights: GGML block bytes decoded by gguf-py.
# ----------------------------------------------------------------------------------------------

def weight_types():
    """The GGML types gguf-py can decode."""
    import gguf
    from gguf import quants
    names = ["f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
             "iq4_nl", "iq4_xs", "tq1_0", "tq2_0", "mxfp4", "nvfp4", "q1_0", "q2_0"]
    out = []
    for n in names:
        t = getattr(gguf.GGMLQuantizationType, n.upper(), None)
        if t is not None and (n in ("f32", "f16") or t in quants._type_traits):
            out.append(n)
    return out


def matrix(raw, dtype, shape):
    """A [rows, cols] weight from its GGML bytes."""
    import gguf
    from gguf import quants
    rows, cols = shape
    if dtype == "f32":
        return raw.view("<f4").reshape(rows, cols).astype(F32)
    if dtype == "f16":
        return raw.view("<f2").reshape(rows, cols).astype(F32)
    qtype = getattr(gguf.GGMLQuantizationType, dtype.upper())
    data = raw.reshape(rows, -1)
    if BUG == "q4_0_nibbles_swapped" and dtype == "q4_0":
        # Low and high nibbles exchanged in every block's quants (2-byte scale, 16 bytes).
        blocks = data.reshape(rows, -1, 18).copy()
        q = blocks[:, :, 2:]
        blocks[:, :, 2:] = ((q & 0x0F) << 4) | (q >> 4)
        data = blocks.reshape(rows, -1)
    return quants.dequantize(data, qtype).reshape(rows, cols).astype(F32)


# ----------------------------------------------------------------------------------------------
# The ops. Each takes the case's params and inputs (name -> array, weights as (bytes, dtype,
# shape)) and returns its outputs in order.
# ----------------------------------------------------------------------------------------------

def rms(x, w, eps):
    if BUG == "rms_eps_x10":
        eps = eps * 10
    ms = np.mean(x * x, axis=-1, keepdims=True, dtype=F32)
    return (x / np.sqrt(ms + F32(eps))) * w


def op_embed(p, i):
    return [i["table"][i["ids"].astype(np.int64)]]


def op_rms_norm(p, i):
    return [rms(i["x"], i["weight"], p["eps"])]


def op_layer_norm(p, i):
    x = i["x"]
    mean = np.mean(x, axis=-1, keepdims=True, dtype=F32)
    d = x - mean
    var = np.mean(d * d, axis=-1, keepdims=True, dtype=F32)
    return [d / np.sqrt(var + F32(p["eps"])) * i["weight"] + i["bias"]]


def op_matmul(p, i):
    x = i["x"]
    if "x_cols" in p:
        x = x[:, : int(p["x_cols"])]
    raw, dtype, shape = i["w"]
    w = matrix(raw, dtype, shape)
    return [np.ascontiguousarray(x, dtype=F32) @ w.T]


def op_add(p, i):
    return [i["a"] + i["b"]]


# A bias row broadcasts over the rows as the residual add's operand does.
op_add_bias = op_add


def rope_angles(p, pos):
    """cos, sin [positions, n_rot/2] for the case's rope configuration."""
    n_rot, theta, scaling = int(p["n_rot"]), p["theta"], int(p["scaling"])
    half = n_rot // 2
    i = np.arange(half, dtype=np.float64)
    freq = theta ** (-2.0 * i / n_rot)
    pos = pos.astype(np.float64)[:, None]
    mscale = 1.0
    if scaling == 0:
        ang = pos * freq
    elif scaling == 1:  # linear x4
        ang = pos * freq / 4.0
    elif scaling == 2:  # YaRN x4 over a 128-position original context
        factor, orig, beta_fast, beta_slow = 4.0, 128, 32.0, 1.0
        corr = lambda beta: n_rot * math.log(orig / (beta * 2 * math.pi)) / (2 * math.log(theta))
        low, high = max(0.0, math.floor(corr(beta_fast))), min(n_rot - 1.0, math.ceil(corr(beta_slow)))
        y = (i - low) / max(0.001, high - low)
        ramp = 1.0 - np.clip(y, 0.0, 1.0)
        extrap = pos * freq
        ang = extrap / factor * (1.0 - ramp) + extrap * ramp
        mscale = 1.0 + 0.1 * math.log(factor)
    elif scaling == 3:  # Llama 3.1 frequency factors: x8, low/high 1 and 4, 64-position context
        factor, low_f, high_f, orig = 8.0, 1.0, 4.0, 64
        wavelen = 2 * math.pi / freq
        smooth = (orig / wavelen - low_f) / (high_f - low_f)
        f = np.where(wavelen < orig / high_f, 1.0, np.where(wavelen > orig / low_f, factor, 1.0 / ((1.0 - smooth) / factor + smooth)))
        ang = pos * freq / f.astype(F32).astype(np.float64)
    else:  # LongRoPE: factors 1 + 2.5 i / half, cos and sin scaled
        f = (1.0 + 2.5 * i / half).astype(F32).astype(np.float64)
        ang = pos * freq / f
        mscale = 1.1902380714238083
    return (np.cos(ang) * mscale).astype(F32), (np.sin(ang) * mscale).astype(F32)


def op_rope(p, i):
    x = i["x"].copy()
    n_head, hd, n_rot = int(p["n_head"]), int(p["head_dim"]), int(p["n_rot"])
    neox = int(p["neox"]) == 1
    if BUG == "rope_pairs_swapped":
        neox = not neox
    cos, sin = rope_angles(p, i["pos"])
    h = x.reshape(x.shape[0], n_head, hd)
    half = n_rot // 2
    if neox:
        a, b = h[:, :, :half].copy(), h[:, :, half:n_rot].copy()
    else:
        a, b = h[:, :, 0:n_rot:2].copy(), h[:, :, 1:n_rot:2].copy()
    c, s = cos[:, None, :], sin[:, None, :]
    ra, rb = a * c - b * s, a * s + b * c
    if neox:
        h[:, :, :half], h[:, :, half:n_rot] = ra, rb
    else:
        h[:, :, 0:n_rot:2], h[:, :, 1:n_rot:2] = ra, rb
    return [h.reshape(x.shape)]


def op_qk_norm(p, i):
    x = i["x"]
    hd = int(p["head_dim"])
    return [rms(x.reshape(x.shape[0], -1, hd), i["weight"], p["eps"]).reshape(x.shape)]


def softmax(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True, dtype=F32)


def attention(p, i, sinks=None, cap=None):
    """Causal GQA attention; `cap` soft-caps the scaled scores, `sinks` adds one logit per head
    to its softmax (its weight goes to no value)."""
    q, k, v, pos = i["q"], i["k"], i["v"], i["pos"].astype(np.int64)
    nh, nkv, hd, window = int(p["n_head"]), int(p["n_head_kv"]), int(p["head_dim"]), int(p["window"])
    m, kv_len = q.shape[0], k.shape[0]
    qh = q.reshape(m, nh, hd).transpose(1, 0, 2)
    kh = np.repeat(k.reshape(kv_len, nkv, hd).transpose(1, 0, 2), nh // nkv, axis=0)
    vh = np.repeat(v.reshape(kv_len, nkv, hd).transpose(1, 0, 2), nh // nkv, axis=0)
    scores = (qh @ kh.transpose(0, 2, 1)) * F32(1.0 / math.sqrt(hd))
    if cap is not None:
        scores = softcap(scores, cap)
    j = np.arange(kv_len)[None, :]
    seen = j <= pos[:, None]
    if window > 0:
        seen &= j > pos[:, None] - window
    scores = np.where(seen[None], scores, F32(-np.inf))
    if sinks is not None:
        sink_col = np.broadcast_to(sinks.astype(F32)[:, None, None], (nh, m, 1))
        probs = softmax(np.concatenate([scores, sink_col], axis=2))[:, :, :kv_len]
    else:
        probs = softmax(scores)
    out = probs @ vh
    return [out.transpose(1, 0, 2).reshape(m, nh * hd)]


def softcap(x, cap):
    c = F32(cap)
    return c * np.tanh(x / c)


def op_attention(p, i):
    return attention(p, i)


def op_attention_sinks(p, i):
    return attention(p, i, sinks=i["sinks"])


def op_attention_softcap(p, i):
    return attention(p, i, cap=p["cap"])


def op_softcap(p, i):
    return [softcap(i["x"], p["cap"])]


def op_softmax(p, i):
    return [softmax(i["x"])]


def sigmoid(x):
    return F32(1) / (F32(1) + np.exp(-x))


def gelu_tanh(x):
    return F32(0.5) * x * (F32(1) + np.tanh(F32(math.sqrt(2 / math.pi)) * (x + F32(0.044715) * x * x * x)))


def op_silu(p, i):
    return [i["gate"] * sigmoid(i["gate"])]


def op_gelu_tanh(p, i):
    return [gelu_tanh(i["gate"])]


def op_swiglu(p, i):
    return [i["gate"] * sigmoid(i["gate"]) * i["up"]]


def op_geglu(p, i):
    return [gelu_tanh(i["gate"]) * i["up"]]


def op_swiglu_oai(p, i):
    g = np.minimum(i["gate"], np.float32(7.0))
    u = np.clip(i["up"], np.float32(-7.0), np.float32(7.0))
    return [g * sigmoid(np.float32(1.702) * g) * (u + np.float32(1.0))]


def top_k(scores, k):
    """Indices of the k largest per row, best first, the lower index first on ties."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def op_moe_route(p, i):
    logits = i["logits"].astype(np.float64)
    k = int(p["k"])
    if int(p["sigmoid"]) == 1:
        scores = 1.0 / (1.0 + np.exp(-logits))
    else:
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        scores = e / e.sum(axis=-1, keepdims=True)
    ids = top_k(scores, k)
    w = np.take_along_axis(scores, ids, axis=-1)
    if int(p["normalize"]) == 1:
        w = w / w.sum(axis=-1, keepdims=True)
    return [ids.reshape(-1).astype(np.uint32), w.astype(F32)]


def op_argmax(p, i):
    return [np.argmax(i["x"], axis=-1).astype(np.uint32)]


def op_top_k(p, i):
    return [top_k(i["x"].astype(np.float64), int(p["k"])).reshape(-1).astype(np.uint32)]


OPS = {name[3:]: f for name, f in globals().items() if name.startswith("op_")}


# ----------------------------------------------------------------------------------------------
# The protocol: keep this part as it is.
# ----------------------------------------------------------------------------------------------

ST_DTYPES = {"F32": "<f4", "F16": "<f2", "U32": "<u4", "I32": "<i4", "I64": "<i8", "U8": "u1"}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[base + a : base + b], dtype=ST_DTYPES[t["dtype"]]).reshape(t["shape"])
    return out


def write_safetensors(path, tensors):
    """tensors: list of (name, array of float32 or uint32)."""
    header, offset, blobs = {}, 0, []
    for name, arr in tensors:
        kind = "U32" if arr.dtype.kind in "ui" else "F32"
        data = np.ascontiguousarray(arr, dtype=ST_DTYPES[kind]).tobytes()
        header[name] = {"dtype": kind, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)


def capabilities(out):
    caps = {"protocol": PROTOCOL, "version": VERSION, "name": "numpy-bf16" if BF16 else "numpy-f32", "ops": sorted(OPS), "weight_types": weight_types(), "arithmetic": ARITHMETIC}
    with open(os.path.join(out, "capabilities.json"), "w") as f:
        json.dump(caps, f)


def run_batch(batch, out):
    with open(os.path.join(batch, "cases.json")) as f:
        request = json.load(f)
    if request.get("protocol") != PROTOCOL or request.get("version") != VERSION:
        sys.exit(f"cases.json: protocol {request.get('protocol')} v{request.get('version')}, not {PROTOCOL} v{VERSION}")
    inputs = read_safetensors(os.path.join(batch, "inputs.safetensors"))
    results, tensors = {}, []
    for case in request["cases"]:
        op = OPS.get(case["op"])
        if op is None:
            results[case["id"]] = {"status": "unsupported", "reason": f"op {case['op']} is not implemented here"}
            continue
        args = {}
        for inp in case["inputs"]:
            arr = inputs[inp["tensor"]]
            if inp["dtype"] == "f32":
                args[inp["name"]] = arr.astype(F32).reshape(inp["shape"])
            elif inp["dtype"] == "u32":
                args[inp["name"]] = arr.reshape(inp["shape"])
            else:  # "ggml": a weight matrix as its GGML blocks
                args[inp["name"]] = (arr, inp["ggml_type"], inp["shape"])
        try:
            with np.errstate(all="ignore"):
                outs = op(case["params"], args)
        except Exception as e:  # a case this engine cannot compute is its error, not the batch's
            results[case["id"]] = {"status": "error", "message": f"{type(e).__name__}: {e}"}
            continue
        for spec, arr in zip(case["outputs"], outs):
            arr = np.asarray(arr).reshape(spec["shape"])
            tensors.append((spec["tensor"], bf16(arr) if BF16 and arr.dtype == F32 else arr))
        results[case["id"]] = {"status": "done"}
    write_safetensors(os.path.join(out, "outputs.safetensors"), tensors)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"results": results}, f)


def main():
    task, out = os.environ.get("TOUCHSTONE_TASK"), os.environ.get("TOUCHSTONE_OUT")
    if task == "capabilities":
        capabilities(out)
    elif task == "ops":
        run_batch(os.environ["TOUCHSTONE_BATCH"], out)
    else:
        sys.exit(f"TOUCHSTONE_TASK={task!r}: this engine answers `capabilities` and `ops` (docs/OP_PROTOCOL.md)")


if __name__ == "__main__":
    main()
