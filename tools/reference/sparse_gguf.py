#!/usr/bin/env python3
"""Writes a Llama-shaped GGUF whose tensor data is a hole: a file that claims a large model
(e.g. the shape of a 70B one) but takes no disk, for checking how loaders meet a model larger
than the machine (they must refuse it at once, naming the file and both sizes, not be killed by
the OOM killer). Weights are Q4_0 blocks of zeros (norms F32 zeros); no tokenizer.

    python3 tools/reference/sparse_gguf.py /tmp/big.gguf --n-embd 8192 --n-layer 80 --n-ff 28672 --vocab 32000
    cargo xtask dump --model /tmp/big.gguf --prompt-ids 1,2,3 --out /tmp/big-dump --device ref   # exit 2

With --random SEED the data is written instead: Q4_0 blocks of uniform nibbles 1..15 (weights
d * (q - 8), d set so each weight has standard deviation 1/sqrt(row length)), norms 1.0: a model
of that shape whose numbers mean nothing but do not vanish, for running the gates at full size
(it takes the disk the shape claims).

Needs gguf-py (tools/reference/requirements.txt) and a file system with sparse files.
A development aid, never a runtime dependency.
"""
import argparse

import gguf
import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--n-embd", type=int, default=8192)
    ap.add_argument("--n-layer", type=int, default=80)
    ap.add_argument("--n-ff", type=int, default=28672)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--n-head-kv", type=int, default=8)
    ap.add_argument("--random", type=int, metavar="SEED", help="write random weights instead of a hole")
    a = ap.parse_args()
    head_dim = 128
    w = gguf.GGUFWriter(a.out, "llama")
    w.add_context_length(4096)
    w.add_embedding_length(a.n_embd)
    w.add_block_count(a.n_layer)
    w.add_feed_forward_length(a.n_ff)
    w.add_head_count(a.n_embd // head_dim)
    w.add_head_count_kv(a.n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(a.vocab)
    q4, f32 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.F32

    def matrix(name, rows, cols):
        # Q4_0: 18 bytes per 32 values; gguf-py takes a quantized tensor's shape in bytes.
        nbytes = rows * cols // 32 * 18
        w.add_tensor_info(name, [rows, cols // 32 * 18], np.dtype(np.uint8), nbytes, raw_dtype=q4)

    def vector(name, n):
        w.add_tensor_info(name, [n], np.dtype(np.float32), 4 * n, raw_dtype=f32)

    kv = a.n_head_kv * head_dim
    matrix("token_embd.weight", a.vocab, a.n_embd)
    vector("output_norm.weight", a.n_embd)
    matrix("output.weight", a.vocab, a.n_embd)
    for i in range(a.n_layer):
        vector(f"blk.{i}.attn_norm.weight", a.n_embd)
        vector(f"blk.{i}.ffn_norm.weight", a.n_embd)
        matrix(f"blk.{i}.attn_q.weight", a.n_embd, a.n_embd)
        matrix(f"blk.{i}.attn_k.weight", kv, a.n_embd)
        matrix(f"blk.{i}.attn_v.weight", kv, a.n_embd)
        matrix(f"blk.{i}.attn_output.weight", a.n_embd, a.n_embd)
        matrix(f"blk.{i}.ffn_gate.weight", a.n_ff, a.n_embd)
        matrix(f"blk.{i}.ffn_up.weight", a.n_ff, a.n_embd)
        matrix(f"blk.{i}.ffn_down.weight", a.n_embd, a.n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0] if isinstance(w.fout, list) else w.fout
    f.flush()
    # The data section: each tensor at the next multiple of the alignment, all of it a hole.
    align = 32
    end = -(-f.tell() // align) * align
    tensors = w.tensors[0] if isinstance(w.tensors, list) else w.tensors
    if a.random is not None:
        write_random(f, end, tensors, align, np.random.default_rng(a.random))
    for ti in tensors.values():
        end += -(-ti.nbytes // align) * align
    f.truncate(end)
    f.close()
    print(f"{a.out}: {end / 2**30:.1f} GiB" + (" of random weights" if a.random is not None else " claimed, none of it on disk"))


def write_random(f, at, tensors, align, rng):
    """Writes every tensor's data from offset `at`, in order, each at the next aligned offset."""
    f.seek(at)
    for ti in tensors.values():
        if len(ti.shape) == 1:  # a norm (F32): ones
            data = np.ones(ti.nbytes // 4, dtype=np.float32).tobytes()
        else:  # Q4_0 (gguf-py keeps the shape in values: rows, cols)
            rows, cols = ti.shape
            d = np.float16(1.0 / (np.sqrt(224.0 / 12.0) * np.sqrt(cols)))  # std of q - 8 on 1..15
            blocks = np.empty((rows * cols // 32, 18), dtype=np.uint8)
            lo = rng.integers(1, 16, size=(blocks.shape[0], 16), dtype=np.uint8)
            hi = rng.integers(1, 16, size=(blocks.shape[0], 16), dtype=np.uint8)
            blocks[:, 2:] = lo | (hi << 4)
            blocks[:, :2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
            data = blocks.tobytes()
        f.write(data)
        f.write(b"\0" * (-len(data) % align))


if __name__ == "__main__":
    main()
