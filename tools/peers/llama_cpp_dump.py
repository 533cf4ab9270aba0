#!/usr/bin/env python3
"""llama.cpp as an `exec:` engine: its own intermediate tensors, written as a Touchstone dump.

    cargo xtask layer-diff  --device "exec:python3 tools/peers/llama_cpp_dump.py" --model smollm2
    cargo xtask fixed-token --device "exec:python3 tools/peers/llama_cpp_dump.py" --model smollm2

A development peer, never a runtime dependency: it needs the PyPI sdist `llama-cpp-python`
(`pip install llama-cpp-python`, which builds llama.cpp from source, ~12 min on 2 cores) and
numpy. It runs the ids in TOUCHSTONE_PROMPT_IDS through llama.cpp's CPU backend in one batch with
every position's logits requested, and reads each graph node the taps need through llama.cpp's
eval callback (`cb_eval`, the hook `llama-eval-callback` prints from), by the names llama.cpp's
graph gives them (`attn_norm-3`, `Qcur-3`, `l_out-3`, ...; docs/DUMP_FORMAT.md). Names llama.cpp
gives twice are told apart by the node's op: the `Qcur`/`Kcur` that ROPE computes is the rotated
one. A `deepseek2` model's graph runs latent attention absorbed: its `Qcur`/`Kcur`/`kqv_out` are
the latent space's, not the heads' Touchstone's taps hold, and are left out. With
TOUCHSTONE_N_GENERATE > 0 it generates greedily and writes a token-only dump.

It also serves the schedule task (TOUCHSTONE_TASK=schedule, docs/SERVING_PROTOCOL.md), as
llama.cpp's server does, through its multi-sequence batch API:

    cargo xtask serving --device "exec:python3 tools/peers/llama_cpp_dump.py" --model smollm2

Each cache slot is one llama.cpp sequence (`seq_id` = slot) in one context; every step is one
`llama_decode` of a batch holding every active request's chunk, each token tagged with its
request's sequence and position. A request taking a slot first removes the slot's cells
(`llama_memory_seq_rm`); a reused prefix is copied from its source's sequence
(`llama_memory_seq_cp`, which shares the cells); a finished request whose prefix a later one
reuses is copied to a spare sequence first, so its slot can be recycled. The cache is unified
(all sequences in one buffer, llama.cpp's `kv_unified`), sliding-window layers' caches full
(`swa_full`).
llama.cpp is not declared batch-invariant: its products take another kernel path for other batch
shapes, so the rung holds it to the derived bound there and to the bit elsewhere.

The dump declares llama.cpp's CPU arithmetic as far as the declaration can say it: f32
activations, Q8 blocks into every product with a quantized matrix (32 wide, the Q8_0/Q8_1 that
Q4_0..Q8_0 weights meet; 256 for K-quant, IQ4_XS and TQ matrices, whose products take Q8_K blocks:
`activation_q8_block_kquant`, declared when the file holds any), the input of a product with an
F16/BF16 matrix rounded to that format (`activation_half_rounding`: ggml multiplies in the
matrix's type there, and so the query and the attention weights enter their products with an
f16 cache as f16) and its KV cache's format (f16 by default; a block-quantized cache's keys
take the query as Q8_0 blocks). With flash attention and an f16 cache llama.cpp accumulates the
weighted values in f16 instead of rounding the weights, which the declaration does not say; the
comparison shows what that costs.

Environment (besides the protocol's): TOUCHSTONE_LLAMA_FLASH_ATTN=1 runs llama.cpp's flash
attention (off by default, as in `llama-cpp-python`); TOUCHSTONE_LLAMA_EXTRA_BUFTS=0 loads the
weights without llama.cpp's repacked/AMX buffers (its AMX matmul crashes on an AMX CPU whose
kernel does not grant the process AMX state); TOUCHSTONE_LLAMA_KV=f32|bf16|q8_0|q5_1|
q5_0|q4_1|q4_0|iq4_nl keeps both caches in that type, and TOUCHSTONE_LLAMA_KV=KEYS-VALUES (q8_0-f16)
each in its own (`--cache-type-k`, `--cache-type-v`), and declares them (`kv_cache`, and
`kv_cache_v` where the values' differs; a quantized value cache needs flash attention, as in
llama.cpp; quantized ones are declared rotated, `kv_cache_rotation`, unless
LLAMA_ATTN_ROT_DISABLE=1 turns llama.cpp's rotation off; flash attention reads an f32 cache as
f16, so that is declared); TOUCHSTONE_LLAMA_Q8_BLOCK=32|256|none declares one activation block for
every quantized matrix instead (`none`: f32 activations into every product, an understatement
the budgets must catch).
"""
import ctypes
import json
import os
import sys

import numpy as np

import llama_cpp
from llama_cpp import _ggml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "external_engine"))
from touchstone_dump import sha256_of_model as sha256, write_safetensors  # noqa: E402


class GgmlTensor(ctypes.Structure):
    """`struct ggml_tensor` of the ggml llama-cpp-python 0.3.x vendors (ggml.h; GGML_MAX_SRC 10)."""
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


if not llama_cpp.__version__.startswith("0.3."):
    # The struct above is ggml's as llama-cpp-python 0.3.x vendors it; another layout would be
    # read as garbage.
    sys.exit(f"llama-cpp-python {llama_cpp.__version__}: this peer reads ggml tensors as 0.3.x lays them out (pip install 'llama-cpp-python==0.3.36')")

ggml = _ggml.libggml
ggml.ggml_op_desc.argtypes, ggml.ggml_op_desc.restype = [ctypes.c_void_p], ctypes.c_char_p
ggml.ggml_nbytes.argtypes, ggml.ggml_nbytes.restype = [ctypes.c_void_p], ctypes.c_size_t
ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
ggml.ggml_backend_tensor_get.restype = None
GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_I32 = 0, 1, 26
# The cache types llama.cpp takes (`--cache-type-k/-v`) that a dump can declare, by GGML id.
CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q5_1": 7, "q5_0": 6, "q4_1": 3, "q4_0": 2, "iq4_nl": 20}

# llama.cpp's graph name (before "-{layer}") -> our tap (after "blk.{layer}."), for the node
# that is not a ROPE; and for ROPE nodes of that name.
LAYER_TAPS = {
    "attn_norm": "attn_norm", "Qcur": "attn_q", "Kcur": "attn_k", "Vcur": "attn_v",
    "Qcur_normed": "attn_q_norm", "Kcur_normed": "attn_k_norm", "kqv_out": "attn_kqv",
    "attn_out": "attn_out", "ffn_inp": "ffn_inp", "ffn_norm": "ffn_norm", "ffn_gate": "ffn_gate",
    "ffn_up": "ffn_up", "ffn_swiglu": "ffn_act", "ffn_geglu": "ffn_act", "ffn_out": "ffn_out",
    "l_out": "l_out", "ffn_moe_probs": "ffn_moe_probs", "ffn_moe_topk": "ffn_moe_topk",
    # Gemma 3: the norms of the attention and FFN outputs, and the attention residual's sum.
    "attn_post_norm": "attn_post_norm", "ffn_post_norm": "ffn_post_norm", "sa_out": "ffn_inp",
}
ROPE_TAPS = {"Qcur": "attn_q_rope", "Kcur": "attn_k_rope"}
# Gemma scales the embeddings after the lookup (`inp_scaled`, computed after `inp_embd`, so the
# last node of the name wins): what enters the first layer, as Touchstone's `inp_embd` holds.
GLOBAL_TAPS = {"inp_embd": "inp_embd", "embd": "inp_embd", "inp_scaled": "inp_embd", "result_norm": "result_norm"}


def tap_name(node_name, op, weight, second=""):
    """Our tap name for a llama.cpp graph node, or None for a node no tap shows. `weight`: the
    name of the node's first source (a product's matrix, by its GGUF name); `second`: its second."""
    if op == "MUL_MAT" and weight.startswith("blk.") and weight.endswith(".attn_output.weight"):
        # Some graphs (Qwen2-MoE, Qwen3) name no node `attn_out`: the output projection is it.
        return f"blk.{weight.split('.')[1]}.attn_out"
    if op == "MUL_MAT" and weight == "attn_inp_v_rot" and second.startswith("kqv_out-"):
        # A quantized value cache holds Hadamard-rotated values (llama.cpp's attention
        # rotation): `kqv_out` is the output in the rotated basis, this product turns it back.
        return f"blk.{second.split('-')[1].split(' ')[0]}.attn_kqv"
    if node_name in GLOBAL_TAPS:
        return GLOBAL_TAPS[node_name]
    base, _, layer = node_name.rpartition("-")
    if not layer.isdigit():
        return None
    table = ROPE_TAPS if op == "ROPE" and base in ROPE_TAPS else LAYER_TAPS
    return f"blk.{layer}.{table[base]}" if base in table else None


def node_rows(t, n_tokens):
    """The node's values as [n_tokens, width] f32, whatever its strides (views included)."""
    t = t.contents
    # I32: the chosen experts' ids (`ffn_moe_topk`), written as f32 as the format says.
    dtype = {GGML_TYPE_F32: np.float32, GGML_TYPE_F16: np.float16, GGML_TYPE_I32: np.int32}.get(t.type)
    if dtype is None:
        return None
    extent = ggml.ggml_nbytes(ctypes.addressof(t))
    raw = (ctypes.c_uint8 * extent)()
    ggml.ggml_backend_tensor_get(ctypes.addressof(t), raw, 0, extent)
    shape = tuple(reversed(list(t.ne)))
    strides = tuple(reversed(list(t.nb)))
    base = np.frombuffer(raw, dtype=dtype, count=extent // np.dtype(dtype).itemsize)
    values = np.lib.stride_tricks.as_strided(base, shape=shape, strides=strides, writeable=False)
    values = np.array(values, dtype=np.float32)
    if values.size % n_tokens:
        return None
    return values.reshape(n_tokens, -1)


def tensor_types(path):
    """The GGML type id of every tensor in a GGUF file, read from its tensor infos (gguf-py's
    reader refuses ids newer than its own enum, Q2_0's among them)."""
    import struct
    with open(path, "rb") as f:
        def unpack(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))
        magic, _version, n_tensors, n_kv = unpack("4sIQQ")
        if magic != b"GGUF":
            sys.exit(f"{path}: not a GGUF file")
        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

        def skip(vtype):
            if vtype == 8:  # string
                f.seek(unpack("Q")[0], 1)
            elif vtype == 9:  # array: element type, count, elements
                etype, count = unpack("IQ")
                if etype in sizes:
                    f.seek(sizes[etype] * count, 1)
                else:
                    for _ in range(count):
                        skip(etype)
            else:
                f.seek(sizes[vtype], 1)
        for _ in range(n_kv):
            f.seek(unpack("Q")[0], 1)  # key
            skip(unpack("I")[0])
        types = []
        for _ in range(n_tensors):
            f.seek(unpack("Q")[0], 1)  # name
            n_dims = unpack("I")[0]
            f.seek(8 * n_dims, 1)
            types.append(unpack("I")[0])
            f.seek(8, 1)  # offset
        return types


def kquant_file(path):
    """Whether the GGUF holds matrices whose products take Q8_K blocks of 256 (K-quants, IQ4_XS,
    TQ1_0, TQ2_0: ggml's CPU `vec_dot_type` for them)."""
    q8_k = {10, 11, 12, 13, 14, 23, 34, 35}  # Q2_K..Q6_K, IQ4_XS, TQ1_0, TQ2_0
    return any(t in q8_k for t in tensor_types(path))


def serve(schedule, model, cparams, out, arithmetic):
    """Runs a schedule (docs/SERVING_PROTOCOL.md) through llama.cpp's multi-sequence batches and
    writes served.safetensors: the logits of every position each request computed."""
    reqs = schedule["requests"]
    index = {r["id"]: i for i, r in enumerate(reqs)}
    reused_until = {}
    for r in reqs:
        if r.get("prefix"):
            src = index[r["prefix"]["from"]]
            reused_until[src] = max(reused_until.get(src, 0), r["arrive"])
    n_slots = schedule["slots"]
    # One sequence per slot, and a spare one per request whose cache outlives it.
    n_seq = n_slots + len(reused_until)
    if n_seq > llama_cpp.llama_max_parallel_sequences():
        sys.exit(f"schedule: {n_slots} slots and {len(reused_until)} kept prefixes need {n_seq} sequences; llama.cpp holds at most {llama_cpp.llama_max_parallel_sequences()}")
    longest = max(len(r["tokens"]) for r in reqs)
    most = max(sum(r["chunks"][t - r["arrive"]] for r in reqs if r["arrive"] <= t < r["arrive"] + len(r["chunks"])) for t in range(max(r["arrive"] + len(r["chunks"]) for r in reqs)))
    cparams.n_seq_max = n_seq
    # One buffer for every sequence (a prefix copied between sequences shares its cells); a
    # sliding-window layer's cache keeps every position (`swa_full`, which llama.cpp's server
    # needs to reuse a prefix on such models).
    cparams.kv_unified = True
    cparams.swa_full = True
    cparams.n_ctx = max(256, (longest + 8) * n_seq)
    # Every step one batch, every position's logits out.
    cparams.n_batch = cparams.n_ubatch = cparams.n_outputs_max = max(most, n_seq)
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        sys.exit("llama.cpp could not create a context")
    mem = llama_cpp.llama_get_memory(ctx)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    kept, spare = {}, list(range(n_slots, n_seq))
    computed = [0] * len(reqs)
    logits = {r["id"]: [] for r in reqs}
    for t in range(max(r["arrive"] + len(r["chunks"]) for r in reqs)):
        for i, r in enumerate(reqs):
            if r["arrive"] != t:
                continue
            seq = r["slot"]
            p = r.get("prefix")
            if p:
                src = index[p["from"]]
                source = kept[src] if src in kept else reqs[src]["slot"]
                if source != seq:
                    llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
                    llama_cpp.llama_memory_seq_cp(mem, source, seq, 0, p["tokens"])
                else:
                    llama_cpp.llama_memory_seq_rm(mem, seq, p["tokens"], -1)
                computed[i] = p["tokens"]
            else:
                llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
        active = [i for i, r in enumerate(reqs) if r["arrive"] <= t < r["arrive"] + len(r["chunks"])]
        if active:
            entries = []
            for i in active:
                n = reqs[i]["chunks"][t - reqs[i]["arrive"]]
                entries += [(i, reqs[i]["tokens"][k], k, reqs[i]["slot"]) for k in range(computed[i], computed[i] + n)]
                computed[i] += n
            batch = llama_cpp.llama_batch_init(len(entries), 0, 1)
            for j, (_, tok, pos, seq) in enumerate(entries):
                batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = tok, pos, 1, 1
                batch.seq_id[j][0] = seq
            batch.n_tokens = len(entries)
            rc = llama_cpp.llama_decode(ctx, batch)
            llama_cpp.llama_batch_free(batch)
            if rc != 0:
                sys.exit(f"step {t}: llama_decode returned {rc}")
            for j, (i, _, _, _) in enumerate(entries):
                logits[reqs[i]["id"]].append(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, j), shape=(n_vocab,)).copy())
        for i in active:
            if t == reqs[i]["arrive"] + len(reqs[i]["chunks"]) - 1 and reused_until.get(i, -1) > t:
                kept[i] = spare.pop()
                llama_cpp.llama_memory_seq_rm(mem, kept[i], -1, -1)
                llama_cpp.llama_memory_seq_cp(mem, reqs[i]["slot"], kept[i], -1, -1)
        for i in [i for i in kept if reused_until[i] <= t]:
            llama_cpp.llama_memory_seq_rm(mem, kept[i], -1, -1)
            spare.append(kept.pop(i))
    llama_cpp.llama_free(ctx)
    tensors = [(r["id"], np.array(logits[r["id"]], dtype=np.float32).reshape(-1, n_vocab)) for r in reqs]
    write_safetensors(os.path.join(out, "served.safetensors"), tensors, {"batch_invariant": "false", "arithmetic": json.dumps(arithmetic)})


def main():
    model_path, out = os.environ["TOUCHSTONE_MODEL"], os.environ["TOUCHSTONE_OUT"]
    task = os.environ.get("TOUCHSTONE_TASK", "dump")
    if task not in ("dump", "schedule"):
        sys.exit(f"TOUCHSTONE_TASK={task}: this peer runs `dump` and `schedule`")
    ids = [int(t) for t in os.environ.get("TOUCHSTONE_PROMPT_IDS", "0").split(",")] if task == "dump" else [0]
    n_generate = int(os.environ.get("TOUCHSTONE_N_GENERATE", "0"))
    threads = int(os.environ.get("RAYON_NUM_THREADS", "2"))
    flash = os.environ.get("TOUCHSTONE_LLAMA_FLASH_ATTN", "0") == "1"
    kv = os.environ.get("TOUCHSTONE_LLAMA_KV", "f16")
    kv_k, _, kv_v = kv.partition("-")
    kv_v = kv_v or kv_k
    if kv_k not in CACHE_TYPES or kv_v not in CACHE_TYPES:
        sys.exit(f"TOUCHSTONE_LLAMA_KV={kv}: TYPE or KEYS-VALUES (e.g. q8_0-f16), each one of {', '.join(CACHE_TYPES)}")
    quantized = [t not in ("f32", "f16", "bf16") for t in (kv_k, kv_v)]
    if quantized[1] and not flash:
        sys.exit(f"TOUCHSTONE_LLAMA_KV={kv}: llama.cpp quantizes the value cache only under flash attention (TOUCHSTONE_LLAMA_FLASH_ATTN=1)")
    # Flash attention reads an f32 cache as f16 (llama.cpp casts it); a quantized cache holds
    # Hadamard-rotated keys (values) unless LLAMA_ATTN_ROT_DISABLE is set (llama.cpp's rule; a
    # cache held in a float format is not rotated, as the declaration's rotation says).
    declared_k, declared_v = ("f16" if flash and t == "f32" else t for t in (kv_k, kv_v))
    rotated = any(quantized) and not int(os.environ.get("LLAMA_ATTN_ROT_DISABLE", "0") or "0")
    n_ctx = max(64, len(ids) + n_generate + 8)
    q8 = os.environ.get("TOUCHSTONE_LLAMA_Q8_BLOCK", "file")
    if q8 not in ("file", "32", "256", "none"):
        sys.exit(f"TOUCHSTONE_LLAMA_Q8_BLOCK={q8}: 32, 256 or none")
    q8_block = 32 if q8 == "file" else None if q8 == "none" else int(q8)
    q8_block_kquant = 256 if q8 == "file" and kquant_file(model_path) else None

    # The prompt runs as one batch (n_batch = n_ubatch = its length): one graph, each tap once.
    taps, order = {}, []  # name -> [n_tokens, width], in the order llama.cpp computed them
    n_batch_tokens = [0]

    def on_node(tensor_p, ask, _user):
        t = ctypes.cast(tensor_p, ctypes.POINTER(GgmlTensor))
        src0, src1 = t.contents.src[0], t.contents.src[1]
        weight, second = (ctypes.cast(p, ctypes.POINTER(GgmlTensor)).contents.name.decode(errors="replace") if p else "" for p in (src0, src1))
        name = tap_name(t.contents.name.decode(errors="replace"), ggml.ggml_op_desc(tensor_p).decode(), weight, second)
        if ask:
            return name is not None
        rows = node_rows(t, n_batch_tokens[0])
        if name is not None and rows is not None:
            if name not in taps:
                order.append(name)
            # The last node of a name wins (llama.cpp gives a projection's reshaped view the
            # projection's name: the same values).
            taps[name] = rows
        return True

    callback = llama_cpp.ggml_backend_sched_eval_callback(on_node)

    llama_cpp.llama_backend_init()
    # llama.cpp's log goes nowhere (the callback is kept alive: ctypes would free it).
    quiet = llama_cpp.llama_log_callback(lambda level, text, user: None)
    llama_cpp.llama_log_set(quiet, None)
    mparams = llama_cpp.llama_model_default_params()
    # TOUCHSTONE_LLAMA_EXTRA_BUFTS=0: no repacked or AMX weight buffers (llama.cpp's AMX matmul
    # crashes where the kernel does not grant the process AMX state, as in some VMs).
    mparams.use_extra_bufts = os.environ.get("TOUCHSTONE_LLAMA_EXTRA_BUFTS", "1") != "0"
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), mparams)
    if not model:
        sys.exit(f"{model_path}: llama.cpp could not load it")
    arch_buf = ctypes.create_string_buffer(64)
    llama_cpp.llama_model_meta_val_str(model, b"general.architecture", arch_buf, len(arch_buf))
    if arch_buf.value == b"deepseek2":
        # Latent attention runs absorbed: its `Qcur`/`Kcur`/`kqv_out` hold the latent space's
        # queries, keys and outputs, not the heads' that Touchstone's taps hold.
        for base in ("Qcur", "Kcur", "Vcur", "kqv_out"):
            LAYER_TAPS.pop(base, None)
            ROPE_TAPS.pop(base, None)
    if arch_buf.value == b"gpt-oss":
        # GPT-OSS's graph names its FFN norm `attn_post_norm` and its experts' sum `ffn_moe_out`;
        # its `ffn_moe_probs` are the router's logits (it gates by a softmax over the chosen
        # experts' logits), not the scores Touchstone's tap holds.
        LAYER_TAPS.update({"attn_post_norm": "ffn_norm", "ffn_moe_out": "ffn_out"})
        del LAYER_TAPS["ffn_moe_probs"]
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = cparams.n_ubatch = max(len(ids), 1)
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cparams.type_k, cparams.type_v = CACHE_TYPES[kv_k], CACHE_TYPES[kv_v]
    arithmetic = {"storage": "f32", "accumulate": "f32", "activation_q8_block": q8_block,
                  "activation_q8_block_kquant": q8_block_kquant, "activation_half_rounding": q8 != "none",
                  "gelu_half_table": True,
                  "transcendental_ulps": 4.0, "fixed": None, "kv_cache": declared_k,
                  "kv_cache_rotation": rotated}
    if declared_v != declared_k:
        arithmetic["kv_cache_v"] = declared_v
    if task == "schedule":
        with open(os.environ["TOUCHSTONE_SCHEDULE"]) as f:
            serve(json.load(f), model, cparams, out, arithmetic)
        llama_cpp.llama_model_free(model)
        return
    if n_generate == 0:
        cparams.cb_eval = callback
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        sys.exit("llama.cpp could not create a context")
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))

    def decode(tokens, start, all_logits):
        batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
        for i, tok in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, start + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if all_logits or i == len(tokens) - 1 else 0
        batch.n_tokens = len(tokens)
        n_batch_tokens[0] = len(tokens)
        rc = llama_cpp.llama_decode(ctx, batch)
        llama_cpp.llama_batch_free(batch)
        if rc != 0:
            sys.exit(f"llama_decode returned {rc}")
        rows = range(len(tokens)) if all_logits else [len(tokens) - 1]
        return np.array([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,)) for i in rows], dtype=np.float32)

    arch = "llama"
    manifest = {
        "format": "touchstone-dump",
        "version": 1,
        "model": {"name": os.path.basename(model_path), "sha256": sha256(model_path), "arch": arch},
        "device": f"llama.cpp {llama_cpp.__version__} cpu{' flash-attn' if flash else ''} kv-{kv}",
        "precision": "f32",
        "token_ids": ids,
        "positions": list(range(len(ids))),
        "taps": [],
        "logits": None,
        "arithmetic": arithmetic,
    }
    if n_generate > 0:
        logits, seq = decode(ids, 0, False), []
        while True:
            seq.append(int(np.argmax(logits[-1])))
            if len(seq) == n_generate:
                break
            logits = decode([seq[-1]], len(ids) + len(seq) - 1, False)
        manifest["generated_ids"] = seq
    else:
        logits = decode(ids, 0, True)
        tensors = [(name, taps[name]) for name in order]
        write_safetensors(os.path.join(out, "taps.safetensors"), tensors)
        write_safetensors(os.path.join(out, "logits.safetensors"), [("logits", logits)])
        manifest["taps"] = [{"name": k, "shape": list(v.shape), "dtype": "f32", "file": "taps.safetensors"} for k, v in tensors]
        manifest["logits"] = {"name": "logits", "shape": list(logits.shape), "dtype": "f32", "file": "logits.safetensors"}
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)


if __name__ == "__main__":
    main()
