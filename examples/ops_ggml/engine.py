#!/usr/bin/env python3
"""ggml's own CPU kernels judged op by op through Touchstone's op protocol (docs/OP_PROTOCOL.md).

One standalone file: Python's ctypes over ggml's C API (ggml.h, ggml-cpu.h), numpy for the
buffers. Each case is one small ggml graph (ggml_mul_mat on the case's GGML blocks as they are,
ggml_rms_norm, ggml_rope_ext, ggml_soft_max_ext, ggml_swiglu_split, ...) computed on ggml's CPU
backend, so what is judged is the arithmetic of the library llama.cpp runs on a CPU. It needs
ggml's shared libraries: GGML_LIB_DIR (default .cache/touchstone/ggml/lib beside this
repository's root), built by tools/peers/build_ggml.py from the llama-cpp-python sdist.

    cargo xtask kernels --device "exec:python3 examples/ops_ggml/engine.py"

The arithmetic it declares is ggml's CPU arithmetic as far as the declaration can say it: f32
activations and accumulation, the input of a product with a quantized matrix rounded to Q8
blocks first (32 wide, the Q8_0/Q8_1 ggml's vec_dot takes for Q4_0..Q8_0, IQ4_NL, MXFP4 and
NVFP4; 256 for the K-quants, IQ4_XS and TQ types, which take Q8_K), and to the matrix's own
format before an F16/BF16 matrix; its GELU in f16 (a table of f16 values at the input rounded to
f16). What the declaration cannot say (Q8_1's block sums held in f16 for Q4_1/Q5_1 products,
the last index taken on ties) the suite finds.

GGML_THREADS (default 2) threads per graph. TOUCHSTONE_EXAMPLE_BUG seeds a bug for Touchstone's
own tests: `rms_eps_x10` (RMSNorm's eps ten times the case's), `gelu_declared_f32` (GELU declared
as computed in f32).
"""
import ctypes
import json
import math
import os
import struct
import sys

import numpy as np

PROTOCOL, VERSION = "touchstone-ops", 1
BUG = os.environ.get("TOUCHSTONE_EXAMPLE_BUG", "")
THREADS = int(os.environ.get("GGML_THREADS", "2"))

BASE = {"storage": "f32", "accumulate": "f32", "activation_q8_block": None, "transcendental_ulps": 4.0, "fixed": None}
MATMUL = dict(BASE, activation_q8_block=32, activation_q8_block_kquant=256, activation_half_rounding=True)

TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q2_k": 10, "q3_k": 11, "q4_k": 12, "q5_k": 13,
         "q6_k": 14, "iq4_nl": 20, "iq4_xs": 23, "bf16": 30, "tq1_0": 34, "tq2_0": 35, "mxfp4": 39, "nvfp4": 40, "q1_0": 41, "q2_0": 42}
F32, I32 = 0, 26
ROPE_NEOX = 2

# ----------------------------------------------------------------------------------------------
# ggml through ctypes.
# ----------------------------------------------------------------------------------------------


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def load():
    root = os.path.dirname(os.path.abspath(__file__))
    lib_dir = os.environ.get("GGML_LIB_DIR") or os.path.join(root, "..", "..", ".cache", "touchstone", "ggml", "lib")
    try:
        base = ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(os.path.join(lib_dir, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        sys.exit(f"ggml's libraries are not in {lib_dir} ({e}); build them with tools/peers/build_ggml.py or set GGML_LIB_DIR")
    P, T, I, F = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    i64, sz = ctypes.c_int64, ctypes.c_size_t
    sig = {
        "ggml_init": (P, [InitParams]), "ggml_free": (None, [P]), "ggml_new_tensor_1d": (T, [P, I, i64]),
        "ggml_new_tensor_2d": (T, [P, I, i64, i64]), "ggml_new_tensor_3d": (T, [P, I, i64, i64, i64]),
        "ggml_get_data": (P, [T]), "ggml_nbytes": (sz, [T]), "ggml_mul_mat": (T, [P, T, T]), "ggml_rms_norm": (T, [P, T, F]),
        "ggml_norm": (T, [P, T, F]), "ggml_mul": (T, [P, T, T]), "ggml_add": (T, [P, T, T]), "ggml_div": (T, [P, T, T]),
        "ggml_get_rows": (T, [P, T, T]), "ggml_soft_max": (T, [P, T]), "ggml_soft_max_ext": (T, [P, T, T, F, F]),
        "ggml_silu": (T, [P, T]), "ggml_gelu": (T, [P, T]), "ggml_sigmoid": (T, [P, T]), "ggml_swiglu_split": (T, [P, T, T]),
        "ggml_geglu_split": (T, [P, T, T]), "ggml_argmax": (T, [P, T]), "ggml_argsort_top_k": (T, [P, T, I]),
        "ggml_sum_rows": (T, [P, T]), "ggml_cont": (T, [P, T]), "ggml_reshape_2d": (T, [P, T, i64, i64]),
        "ggml_reshape_3d": (T, [P, T, i64, i64, i64]), "ggml_permute": (T, [P, T, I, I, I, I]), "ggml_view_2d": (T, [P, T, i64, i64, sz, sz]),
        "ggml_rope_ext": (T, [P, T, T, T, I, I, I, F, F, F, F, F, F]), "ggml_new_graph": (P, [P]), "ggml_build_forward_expand": (None, [P, T]),
    }
    for name, (res, args) in sig.items():
        f = getattr(base, name)
        f.restype, f.argtypes = res, args
    cpu.ggml_graph_compute_with_ctx.restype = I
    cpu.ggml_graph_compute_with_ctx.argtypes = [P, P, I]
    cpu.ggml_cpu_init.restype, cpu.ggml_cpu_init.argtypes = None, []
    cpu.ggml_cpu_init()
    return base, cpu


class Graph:
    """One case's ggml context: tensors in, one graph, arrays out."""

    def __init__(self, lib, mem):
        self.g, self.cpu = lib
        self.ctx = self.g.ggml_init(InitParams(mem, None, False))
        if not self.ctx:
            raise MemoryError(f"ggml_init of {mem} bytes failed")

    def __getattr__(self, op):
        f = getattr(self.g, "ggml_" + op)
        return lambda *a: f(self.ctx, *a)

    def tensor(self, arr, ty=F32):
        """A ggml tensor holding `arr` (numpy shape reversed: ne0 is the last axis)."""
        arr = np.ascontiguousarray(arr)
        ne = list(reversed(arr.shape)) if arr.ndim else [1]
        t = [None, self.g.ggml_new_tensor_1d, self.g.ggml_new_tensor_2d, self.g.ggml_new_tensor_3d][len(ne)](self.ctx, ty, *ne)
        self.fill(t, arr)
        return t

    def weight(self, raw, ty, rows, cols):
        t = self.g.ggml_new_tensor_2d(self.ctx, TYPES[ty], cols, rows)
        self.fill(t, raw)
        return t

    def fill(self, t, arr):
        n = self.g.ggml_nbytes(t)
        if n != arr.nbytes:
            raise ValueError(f"{arr.nbytes} bytes for a tensor of {n}")
        ctypes.memmove(self.g.ggml_get_data(t), arr.ctypes.data, n)

    def compute(self, *outs, dtypes=None):
        outs = [self.cont(o) for o in outs]
        gf = self.g.ggml_new_graph(self.ctx)
        for o in outs:
            self.g.ggml_build_forward_expand(gf, o)
        if self.cpu.ggml_graph_compute_with_ctx(self.ctx, gf, THREADS) != 0:
            raise RuntimeError("ggml_graph_compute failed")
        res = []
        for o, dt in zip(outs, dtypes or ["<f4"] * len(outs)):
            n = self.g.ggml_nbytes(o)
            res.append(np.frombuffer((ctypes.c_char * n).from_address(self.g.ggml_get_data(o)), dtype=dt).copy())
        return res

    def close(self):
        self.g.ggml_free(self.ctx)


# ----------------------------------------------------------------------------------------------
# The ops: each builds its graph and returns its outputs (flat; reshaped by the protocol code).
# ----------------------------------------------------------------------------------------------

def op_embed(g, p, i):
    return g.compute(g.get_rows(g.tensor(i["table"]), g.tensor(i["ids"].astype(np.int32), I32)))


def op_rms_norm(g, p, i):
    eps = p["eps"] * (10 if BUG == "rms_eps_x10" else 1)
    return g.compute(g.mul(g.rms_norm(g.tensor(i["x"]), eps), g.tensor(i["weight"])))


def op_layer_norm(g, p, i):
    return g.compute(g.add(g.mul(g.norm(g.tensor(i["x"]), p["eps"]), g.tensor(i["weight"])), g.tensor(i["bias"])))


def op_matmul(g, p, i):
    x = i["x"]
    raw, ty, (rows, cols) = i["w"]
    w = g.weight(raw, ty, rows, cols)
    xt = g.tensor(x)
    if "x_cols" in p:  # a row-strided view: the first x_cols values of each row
        xt = g.view_2d(xt, int(p["x_cols"]), x.shape[0], x.shape[1] * 4, 0)
    return g.compute(g.mul_mat(w, xt))


def op_add(g, p, i):
    return g.compute(g.add(g.tensor(i["a"]), g.tensor(i["b"])))


# A bias row broadcasts over the rows as the residual add's operand does.
op_add_bias = op_add


def op_rope(g, p, i):
    x = i["x"]
    nh, hd, n_rot, theta, scaling = int(p["n_head"]), int(p["head_dim"]), int(p["n_rot"]), p["theta"], int(p["scaling"])
    mode = ROPE_NEOX if int(p["neox"]) == 1 else 0
    xt = g.reshape_3d(g.tensor(x), hd, nh, x.shape[0])
    pos = g.tensor(i["pos"].astype(np.int32), I32)
    half = n_rot // 2
    idx = np.arange(half, dtype=np.float64)
    factors, n_ctx, freq_scale, ext, attn, beta_fast, beta_slow = None, 0, 1.0, 0.0, 1.0, 0.0, 0.0
    if scaling == 1:
        freq_scale = 0.25
    elif scaling == 2:
        n_ctx, freq_scale, ext, beta_fast, beta_slow = 128, 0.25, 1.0, 32.0, 1.0
    elif scaling == 3:  # Llama 3.1's factors, as llama.cpp's converter writes them to rope_freqs
        factor, low_f, high_f, orig = 8.0, 1.0, 4.0, 64
        wavelen = 2 * math.pi / theta ** (-2.0 * idx / n_rot)
        smooth = (orig / wavelen - low_f) / (high_f - low_f)
        factors = np.where(wavelen < orig / high_f, 1.0, np.where(wavelen > orig / low_f, factor, 1.0 / ((1.0 - smooth) / factor + smooth)))
    elif scaling == 4:
        factors, attn = 1.0 + 2.5 * idx / half, 1.1902380714238083
    c = g.tensor(factors.astype(np.float32)) if factors is not None else None
    return g.compute(g.rope_ext(xt, pos, c, n_rot, mode, n_ctx, theta, freq_scale, ext, attn, beta_fast, beta_slow))


def op_qk_norm(g, p, i):
    x = i["x"]
    hd = int(p["head_dim"])
    xt = g.reshape_2d(g.tensor(x), hd, x.size // hd)
    return g.compute(g.mul(g.rms_norm(xt, p["eps"]), g.tensor(i["weight"])))


def op_attention(g, p, i):
    q, k, v, pos = i["q"], i["k"], i["v"], i["pos"].astype(np.int64)
    nh, nkv, hd, window = int(p["n_head"]), int(p["n_head_kv"]), int(p["head_dim"]), int(p["window"])
    m, kv = q.shape[0], k.shape[0]
    qt = g.cont(g.permute(g.reshape_3d(g.tensor(q), hd, nh, m), 0, 2, 1, 3))  # [hd, m, nh]
    kt = g.cont(g.permute(g.reshape_3d(g.tensor(k), hd, nkv, kv), 0, 2, 1, 3))  # [hd, kv, nkv]
    vt = g.cont(g.permute(g.reshape_3d(g.tensor(v), hd, nkv, kv), 1, 2, 0, 3))  # [kv, hd, nkv]
    j = np.arange(kv)[None, :]
    seen = j <= pos[:, None]
    if window > 0:
        seen &= j > pos[:, None] - window
    mask = g.tensor(np.where(seen, 0.0, -np.inf).astype(np.float32))  # [kv, m]
    kq = g.soft_max_ext(g.mul_mat(kt, qt), mask, 1.0 / math.sqrt(hd), 0.0)  # [kv, m, nh]
    out = g.permute(g.mul_mat(vt, kq), 0, 2, 1, 3)  # [hd, m, nh] -> [hd, nh, m]
    return g.compute(out)


def op_softmax(g, p, i):
    return g.compute(g.soft_max(g.tensor(i["x"])))


def op_silu(g, p, i):
    return g.compute(g.silu(g.tensor(i["gate"])))


def op_gelu_tanh(g, p, i):
    return g.compute(g.gelu(g.tensor(i["gate"])))


def op_swiglu(g, p, i):
    return g.compute(g.swiglu_split(g.tensor(i["gate"]), g.tensor(i["up"])))


def op_geglu(g, p, i):
    return g.compute(g.geglu_split(g.tensor(i["gate"]), g.tensor(i["up"])))


def op_moe_route(g, p, i):
    logits = i["logits"]
    m, n, k = logits.shape[0], logits.shape[1], int(p["k"])
    lt = g.tensor(logits)
    probs = g.sigmoid(lt) if int(p["sigmoid"]) == 1 else g.soft_max(lt)
    ids = g.argsort_top_k(probs, k)  # [k, m]
    w = g.reshape_2d(g.get_rows(g.reshape_3d(probs, 1, n, m), ids), k, m)
    if int(p["normalize"]) == 1:
        w = g.div(w, g.sum_rows(w))
    return g.compute(ids, w, dtypes=["<i4", "<f4"])


def op_argmax(g, p, i):
    return g.compute(g.argmax(g.tensor(i["x"])), dtypes=["<i4"])


def op_top_k(g, p, i):
    return g.compute(g.argsort_top_k(g.tensor(i["x"]), int(p["k"])), dtypes=["<i4"])


OPS = {name[3:]: f for name, f in globals().items() if name.startswith("op_")}
# ggml's CPU GELU reads a table of f16 values at the input rounded to f16 (GGML_GELU_FP16).
GELU = dict(BASE, storage="f16")
ARITHMETIC_BY_OP = {"matmul": MATMUL, "gelu_tanh": GELU, "geglu": GELU}
if BUG == "gelu_declared_f32":
    ARITHMETIC_BY_OP = {"matmul": MATMUL}

# ----------------------------------------------------------------------------------------------
# The protocol.
# ----------------------------------------------------------------------------------------------

ST_DTYPES = {"F32": "<f4", "F16": "<f2", "U32": "<u4", "I32": "<i4", "I64": "<i8", "U8": "u1"}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, t in header.items():
        if name != "__metadata__":
            a, b = t["data_offsets"]
            out[name] = np.frombuffer(data[8 + n + a : 8 + n + b], dtype=ST_DTYPES[t["dtype"]]).reshape(t["shape"])
    return out


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name, arr in tensors:
        kind = {"f": "F32", "i": "I32", "u": "U32"}[arr.dtype.kind]
        data = np.ascontiguousarray(arr, dtype=ST_DTYPES[kind]).tobytes()
        header[name] = {"dtype": kind, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def run_batch(lib, batch, out):
    with open(os.path.join(batch, "cases.json")) as f:
        request = json.load(f)
    if request.get("protocol") != PROTOCOL or request.get("version") != VERSION:
        sys.exit(f"cases.json: protocol {request.get('protocol')} v{request.get('version')}, not {PROTOCOL} v{VERSION}")
    inputs = read_safetensors(os.path.join(batch, "inputs.safetensors"))
    results, tensors = {}, []
    for case in request["cases"]:
        op = OPS.get(case["op"])
        if op is None:
            results[case["id"]] = {"status": "unsupported", "reason": f"no ggml graph for op {case['op']} here"}
            continue
        args, size = {}, 0
        for inp in case["inputs"]:
            arr = inputs[inp["tensor"]]
            size += arr.nbytes
            if inp["dtype"] == "f32":
                args[inp["name"]] = arr.reshape(inp["shape"])
            elif inp["dtype"] == "u32":
                args[inp["name"]] = arr
            else:
                args[inp["name"]] = (arr, inp["ggml_type"], inp["shape"])
        g = Graph(lib, (64 << 20) + 16 * size)
        try:
            outs = op(g, case["params"], args)
        except Exception as e:
            results[case["id"]] = {"status": "error", "message": f"{type(e).__name__}: {e}"}
            continue
        finally:
            g.close()
        for spec, arr in zip(case["outputs"], outs):
            tensors.append((spec["tensor"], arr.reshape(spec["shape"])))
        results[case["id"]] = {"status": "done"}
    write_safetensors(os.path.join(out, "outputs.safetensors"), tensors)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"results": results}, f)


def main():
    task, out = os.environ.get("TOUCHSTONE_TASK"), os.environ.get("TOUCHSTONE_OUT")
    lib = load()
    if task == "capabilities":
        caps = {"protocol": PROTOCOL, "version": VERSION, "name": "ggml-cpu", "ops": sorted(OPS), "weight_types": sorted(TYPES),
                "arithmetic": BASE, "arithmetic_by_op": ARITHMETIC_BY_OP}
        with open(os.path.join(out, "capabilities.json"), "w") as f:
            json.dump(caps, f)
    elif task == "ops":
        run_batch(lib, os.environ["TOUCHSTONE_BATCH"], out)
    else:
        sys.exit(f"TOUCHSTONE_TASK={task!r}: this engine answers `capabilities` and `ops` (docs/OP_PROTOCOL.md)")


if __name__ == "__main__":
    main()
