#!/usr/bin/env python3
"""PyTorch's CPU kernels judged op by op through Touchstone's op protocol (docs/OP_PROTOCOL.md).

One standalone file: each case runs through the library's own kernels (`torch.nn.functional`'s
rms_norm, layer_norm, linear, scaled_dot_product_attention, silu, gelu, softmax; torch.sort,
argmax, embedding), so what is judged is the arithmetic a PyTorch engine runs on a CPU. GGML
weight blocks are decoded by gguf-py (PyTorch has no GGML types); F32/F16/BF16 matrices are read
by torch itself. It needs torch, numpy and gguf (`pip install torch numpy gguf`). Run it as

    cargo xtask kernels --device "exec:python3 examples/ops_torch/engine.py"

Two modes:
- f32 (default): every tensor float32; declared as f32 storage and accumulation.
- OPS_TORCH_DTYPE=bf16: a bfloat16 engine. Every float input is cast to bf16 on entry, the
  weights after decoding too, the op runs on bf16 tensors (PyTorch's CPU kernels accumulate
  those in f32) and returns bf16. Declared as bf16 storage with f32 accumulation, so the bounds
  cover what holding every tensor in bf16 costs (the inputs' own rounding included).

Expert routing and top-k use a stable sort (lower index first on ties, as the protocol asks).
`sample` needs Touchstone's own random stream and is reported unsupported. `delta_rule` (a gated
DeltaNet's recurrence) runs transformers' chunked form where transformers is installed;
`mla_attention` (DeepSeek's latent attention) the absorbed form. TORCH_THREADS sets
torch's thread count (default: torch's own).

TOUCHSTONE_EXAMPLE_BUG seeds a bug for Touchstone's own tests (each must turn cases red):
`rms_eps_x10`, `rope_pairs_swapped`, `q4_0_nibbles_swapped`, `bf16_declared_f32` (the bf16
mode's arithmetic, declared as f32), `delta_chunk_term_dropped` (the delta rule run chunk by
chunk, each chunk's state carried without its last position's term), `mla_scale_of_cached_row`
(latent attention's scores scaled by the cached row's width instead of the query head's).
"""
import json
import math
import os
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

PROTOCOL, VERSION = "touchstone-ops", 1
BUG = os.environ.get("TOUCHSTONE_EXAMPLE_BUG", "")
BF16 = os.environ.get("OPS_TORCH_DTYPE", "f32") == "bf16" or BUG == "bf16_declared_f32"
DT = torch.bfloat16 if BF16 else torch.float32
ARITHMETIC = {"storage": "bf16" if BF16 and BUG != "bf16_declared_f32" else "f32", "accumulate": "f32",
              "activation_q8_block": None, "transcendental_ulps": 4.0, "fixed": None}
if os.environ.get("TORCH_THREADS"):
    torch.set_num_threads(int(os.environ["TORCH_THREADS"]))

# ----------------------------------------------------------------------------------------------
# Weights: F32/F16/BF16 read by torch; quantized GGML blocks decoded by gguf-py.
# ----------------------------------------------------------------------------------------------

TORCH_DENSE = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def weight_types():
    import gguf
    from gguf import quants
    names = ["f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
             "iq4_nl", "iq4_xs", "tq1_0", "tq2_0", "mxfp4", "nvfp4", "q1_0", "q2_0"]
    out = []
    for n in names:
        t = getattr(gguf.GGMLQuantizationType, n.upper(), None)
        if n in TORCH_DENSE or (t is not None and t in quants._type_traits):
            out.append(n)
    return out


def matrix(raw, dtype, shape):
    """A [rows, cols] weight from its GGML bytes, as a float32 tensor."""
    rows, cols = shape
    if dtype in TORCH_DENSE:
        return torch.frombuffer(bytearray(raw.tobytes()), dtype=TORCH_DENSE[dtype]).reshape(rows, cols).float()
    import gguf
    from gguf import quants
    qtype = getattr(gguf.GGMLQuantizationType, dtype.upper())
    data = raw.reshape(rows, -1)
    if BUG == "q4_0_nibbles_swapped" and dtype == "q4_0":
        # Low and high nibbles exchanged in every block's quants (2-byte scale, 16 bytes).
        blocks = data.reshape(rows, -1, 18).copy()
        q = blocks[:, :, 2:]
        blocks[:, :, 2:] = ((q & 0x0F) << 4) | (q >> 4)
        data = blocks.reshape(rows, -1)
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(data, qtype).reshape(rows, cols), dtype=np.float32))


# ----------------------------------------------------------------------------------------------
# The ops. Each takes the case's params and inputs (name -> tensor in DT, ids as int64, weights
# as (bytes, dtype, shape)) and returns its outputs in order.
# ----------------------------------------------------------------------------------------------

def rms(x, w, eps):
    if BUG == "rms_eps_x10":
        eps = eps * 10
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def op_embed(p, i):
    return [F.embedding(i["ids"], i["table"])]


def op_rms_norm(p, i):
    return [rms(i["x"], i["weight"], p["eps"])]


def op_layer_norm(p, i):
    x = i["x"]
    return [F.layer_norm(x, (x.shape[-1],), i["weight"], i["bias"], p["eps"])]


def op_matmul(p, i):
    x = i["x"]
    if "x_cols" in p:
        x = x[:, : int(p["x_cols"])]
    raw, dtype, shape = i["w"]
    return [F.linear(x.contiguous(), matrix(raw, dtype, shape).to(DT))]


def op_add(p, i):
    return [torch.add(i["a"], i["b"])]


op_add_bias = op_add


def rope_angles(p, pos):
    """cos, sin [positions, n_rot/2] in float32 for the case's rope configuration."""
    n_rot, theta, scaling = int(p["n_rot"]), p["theta"], int(p["scaling"])
    half = n_rot // 2
    i = torch.arange(half, dtype=torch.float64)
    freq = theta ** (-2.0 * i / n_rot)
    pos = pos.to(torch.float64)[:, None]
    mscale = 1.0
    if scaling == 0:
        ang = pos * freq
    elif scaling == 1:  # linear x4
        ang = pos * freq / 4.0
    elif scaling == 2:  # YaRN x4 over a 128-position original context
        factor, orig, beta_fast, beta_slow = 4.0, 128, 32.0, 1.0
        corr = lambda beta: n_rot * math.log(orig / (beta * 2 * math.pi)) / (2 * math.log(theta))
        low, high = max(0.0, math.floor(corr(beta_fast))), min(n_rot - 1.0, math.ceil(corr(beta_slow)))
        ramp = 1.0 - torch.clamp((i - low) / max(0.001, high - low), 0.0, 1.0)
        extrap = pos * freq
        ang = extrap / factor * (1.0 - ramp) + extrap * ramp
        mscale = 1.0 + 0.1 * math.log(factor)
    elif scaling == 3:  # Llama 3.1 frequency factors: x8, low/high 1 and 4, 64-position context
        factor, low_f, high_f, orig = 8.0, 1.0, 4.0, 64
        wavelen = 2 * math.pi / freq
        smooth = (orig / wavelen - low_f) / (high_f - low_f)
        f = torch.where(wavelen < orig / high_f, 1.0, torch.where(wavelen > orig / low_f, factor, 1.0 / ((1.0 - smooth) / factor + smooth)))
        ang = pos * freq / f.float().double()
    else:  # LongRoPE: factors 1 + 2.5 i / half, cos and sin scaled
        ang = pos * freq / (1.0 + 2.5 * i / half).float().double()
        mscale = 1.1902380714238083
    return (torch.cos(ang) * mscale).float(), (torch.sin(ang) * mscale).float()


def op_rope(p, i):
    x = i["x"]
    n_head, hd, n_rot = int(p["n_head"]), int(p["head_dim"]), int(p["n_rot"])
    neox = int(p["neox"]) == 1
    if BUG == "rope_pairs_swapped":
        neox = not neox
    cos, sin = rope_angles(p, i["pos"])
    # As a PyTorch model does: the angles formed in f32, then held in the activations' type.
    c, s = cos[:, None, :].to(DT), sin[:, None, :].to(DT)
    h = x.reshape(x.shape[0], n_head, hd).clone()
    half = n_rot // 2
    if neox:
        a, b = h[:, :, :half], h[:, :, half:n_rot]
    else:
        a, b = h[:, :, 0:n_rot:2], h[:, :, 1:n_rot:2]
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


def op_attention(p, i):
    q, k, v, pos = i["q"], i["k"], i["v"], i["pos"]
    nh, nkv, hd, window = int(p["n_head"]), int(p["n_head_kv"]), int(p["head_dim"]), int(p["window"])
    m, kv_len = q.shape[0], k.shape[0]
    qh = q.reshape(m, nh, hd).transpose(0, 1)
    kh = k.reshape(kv_len, nkv, hd).transpose(0, 1)
    vh = v.reshape(kv_len, nkv, hd).transpose(0, 1)
    j = torch.arange(kv_len)[None, :]
    seen = j <= pos[:, None]
    if window > 0:
        seen &= j > pos[:, None] - window
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seen, scale=1.0 / math.sqrt(hd), enable_gqa=nh != nkv)
    return [out.transpose(0, 1).reshape(m, nh * hd)]


def op_mla_attention(p, i):
    """Latent attention (DeepSeek MLA) in the absorbed form engines run: each head's unrotated
    query taken into the latent's space through its key rows of `kv_b`, scored against the cached
    latents (its rotated part against the shared rotated keys), the weighted latents taken out
    through its value rows. Keys and values are never expanded."""
    nh, nope, rope, r, vd = (int(p[k]) for k in ("n_head", "qk_nope", "qk_rope", "kv_lora_rank", "v_head_dim"))
    scale = float(p["scale"])
    if BUG == "mla_scale_of_cached_row":
        # The scale of the row the query meets in the cache (latent + rotated key).
        scale *= math.sqrt(nope + rope) / math.sqrt(r + rope)
    q = i["q"].reshape(-1, nh, nope + rope)
    lat, kpe, pos = i["latent"], i["k_pe"], i["pos"]
    kv_b = i["kv_b"].reshape(nh, nope + vd, r)
    q_abs = torch.einsum("mhc,hcr->mhr", q[..., :nope], kv_b[:, :nope])
    scores = (torch.einsum("mhr,jr->mhj", q_abs, lat) + torch.einsum("mhe,je->mhj", q[..., nope:], kpe)) * scale
    seen = torch.arange(lat.shape[0])[None, None, :] <= pos[:, None, None]
    weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    ctx = torch.einsum("mhj,jr->mhr", weights, lat)
    return [torch.einsum("mhr,hvr->mhv", ctx, kv_b[:, nope:]).reshape(q.shape[0], nh * vd)]


def op_delta_rule(p, i):
    """The delta rule through transformers' own chunked form (Qwen3-Next's
    `torch_chunk_gated_delta_rule`, chunks of 16: a run crosses chunk boundaries) where
    transformers is installed; the op is left out otherwise."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    nk, nv, dk, dv = (int(p[k]) for k in ("n_k_head", "n_v_head", "d_k", "d_v"))
    m = i["q"].shape[0]
    q, k = (i[n].reshape(1, m, nk, dk) for n in ("q", "k"))
    v = i["v"].reshape(1, m, nv, dv)
    g = (i["neg_a"] * F.softplus(i["a"] + i["dt_bias"])).reshape(1, m, nv)
    beta = torch.sigmoid(i["b"]).reshape(1, m, nv)
    state = i["state"].reshape(1, nv, dv, dk).transpose(-1, -2)

    def rule(s, e, state):
        return torch_chunk_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], chunk_size=16, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)

    if BUG != "delta_chunk_term_dropped":
        y, last = rule(0, m, state)
    else:
        # Chunk by chunk, each chunk starting from the state before the previous chunk's last
        # position: the boundary position's term is dropped from what is carried.
        ys, last = [], state
        for s in range(0, m, 16):
            e = min(s + 16, m)
            y_c, full = rule(s, e, last)
            ys.append(y_c)
            last = rule(s, e - 1, last)[1] if e - 1 > s and e < m else full
        y = torch.cat(ys, dim=1)
    return [y.reshape(m, nv * dv).to(DT), last.transpose(-1, -2).reshape(nv, dv, dk).to(DT)]


try:
    import transformers  # noqa: F401
except ImportError:
    del op_delta_rule


def op_softmax(p, i):
    return [torch.softmax(i["x"], dim=-1)]


def op_silu(p, i):
    return [F.silu(i["gate"])]


def op_gelu_tanh(p, i):
    return [F.gelu(i["gate"], approximate="tanh")]


def op_swiglu(p, i):
    return [F.silu(i["gate"]) * i["up"]]


def op_geglu(p, i):
    return [F.gelu(i["gate"], approximate="tanh") * i["up"]]


def top_k(scores, k):
    """Indices of the k largest per row, best first, the lower index first on ties."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def op_moe_route(p, i):
    # Routing scores in f32 whatever the activations' type, as PyTorch MoE models compute them.
    logits = i["logits"].float()
    k = int(p["k"])
    scores = torch.sigmoid(logits) if int(p["sigmoid"]) == 1 else torch.softmax(logits, dim=-1)
    ids = top_k(scores, k)
    w = torch.gather(scores, -1, ids)
    if int(p["normalize"]) == 1:
        w = w / w.sum(dim=-1, keepdim=True)
    return [ids.reshape(-1), w.to(DT)]


def op_argmax(p, i):
    return [torch.argmax(i["x"], dim=-1)]


def op_top_k(p, i):
    return [top_k(i["x"], int(p["k"])).reshape(-1)]


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
    name = "torch-bf16" if BF16 else "torch-f32"
    caps = {"protocol": PROTOCOL, "version": VERSION, "name": name, "ops": sorted(OPS), "weight_types": weight_types(), "arithmetic": ARITHMETIC}
    with open(os.path.join(out, "capabilities.json"), "w") as f:
        json.dump(caps, f)


def to_numpy(t):
    """An output tensor as numpy: floats as float32 (bf16 values are exact in f32), ids as uint32."""
    t = t.detach()
    if t.is_floating_point():
        return t.float().numpy()
    return t.to(torch.int64).numpy().astype(np.uint32)


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
                args[inp["name"]] = torch.from_numpy(arr.astype(np.float32).reshape(inp["shape"])).to(DT)
            elif inp["dtype"] == "u32":
                args[inp["name"]] = torch.from_numpy(arr.astype(np.int64).reshape(inp["shape"]))
            else:  # "ggml": a weight matrix as its GGML blocks
                args[inp["name"]] = (arr, inp["ggml_type"], inp["shape"])
        try:
            with torch.no_grad():
                outs = [to_numpy(t) for t in op(case["params"], args)]
        except Exception as e:  # a case this engine cannot compute is its error, not the batch's
            results[case["id"]] = {"status": "error", "message": f"{type(e).__name__}: {e}"}
            continue
        for spec, arr in zip(case["outputs"], outs):
            tensors.append((spec["tensor"], arr.reshape(spec["shape"])))
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
