#!/usr/bin/env python3
"""Small GGUF seeds for the `gguf` fuzz target (a few KiB each, so libFuzzer runs fast): a
one-layer Llama with a 64-token BPE or SentencePiece vocabulary, with F32, F16 and Q8_0 weights.
Written with gguf-py, llama.cpp's own writer.

    python3 fuzz/seeds/make_gguf_seeds.py fuzz/corpus/gguf
"""
import os
import sys

import numpy as np
import gguf


def write(path, model, ty):
    w = gguf.GGUFWriter(path, "llama")
    d, ff, n_vocab = 32, 64, 64
    w.add_context_length(64)
    w.add_embedding_length(d)
    w.add_block_count(1)
    w.add_feed_forward_length(ff)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model(model)
    if model == "gpt2":
        tokens = [bytes([0x61 + i % 26]) * (1 + i // 26) for i in range(n_vocab - 2)] + [b"<s>", b"</s>"]
        w.add_token_list(tokens)
        w.add_token_merges(["a a", "b b", "aa a", "c c"])
        w.add_token_types([1] * (n_vocab - 2) + [3, 3])
        w.add_tokenizer_pre("default")
    else:
        tokens = [b"<unk>", b"<s>", b"</s>"] + [("\u2581" + chr(0x61 + i % 26) * (1 + i // 26)).encode() for i in range(n_vocab - 3)]
        w.add_token_list(tokens)
        w.add_token_scores([float(-i) for i in range(n_vocab)])
        w.add_token_types([2, 3, 3] + [1] * (n_vocab - 3))
    w.add_bos_token_id(n_vocab - 2 if model == "gpt2" else 1)
    w.add_eos_token_id(n_vocab - 1 if model == "gpt2" else 2)
    rng = np.random.default_rng(len(path))
    shapes = {"token_embd.weight": (n_vocab, d), "output_norm.weight": (d,), "blk.0.attn_norm.weight": (d,), "blk.0.ffn_norm.weight": (d,),
              "blk.0.attn_q.weight": (d, d), "blk.0.attn_k.weight": (d // 2, d), "blk.0.attn_v.weight": (d // 2, d), "blk.0.attn_output.weight": (d, d),
              "blk.0.ffn_gate.weight": (ff, d), "blk.0.ffn_up.weight": (ff, d), "blk.0.ffn_down.weight": (d, ff)}
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 2 and ty == "q8_0":
            w.add_tensor(name, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif len(shape) == 2 and ty == "f16":
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "fuzz/corpus/gguf"
    os.makedirs(out, exist_ok=True)
    for model in ["gpt2", "llama"]:
        for ty in ["f32", "f16", "q8_0"]:
            write(os.path.join(out, f"seed-{model}-{ty}.gguf"), model, ty)
    print(f"seeds in {out}")


if __name__ == "__main__":
    main()
