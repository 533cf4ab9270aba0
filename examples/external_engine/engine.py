#!/usr/bin/env python3
"""A tiny external engine that speaks Touchstone's dump protocol (docs/DUMP_FORMAT.md).

It stands for "your engine": a numpy float64 Llama forward pass (tools/reference/llama_f64.py,
weights decoded by gguf-py) that writes a dump Touchstone can judge. Run it through the `exec:`
device:

    cargo xtask layer-diff  --device "exec:python3 examples/external_engine/engine.py" --model tiny-llama
    cargo xtask fixed-token --device "exec:python3 examples/external_engine/engine.py" --model tiny-llama

Touchstone passes the request in the environment: TOUCHSTONE_MODEL (GGUF path),
TOUCHSTONE_PROMPT_IDS (comma-separated ids), TOUCHSTONE_N_GENERATE (greedy tokens wanted, 0 for one
prefill) and TOUCHSTONE_OUT (directory to write). With TOUCHSTONE_N_GENERATE > 0 it writes a
token-only dump (`generated_ids`, no tensors); otherwise taps and logits of every position.
The safetensors writer below is the whole format: 8-byte header length, JSON header, raw data.
"""
import hashlib
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "reference"))
import llama_f64  # noqa: E402


def write_safetensors(path, tensors):
    """tensors: list of (name, float32 array [rows, cols])."""
    header, offset, blobs = {}, 0, []
    for name, arr in tensors:
        data = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the header is padded to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    model, out = os.environ["TOUCHSTONE_MODEL"], os.environ["TOUCHSTONE_OUT"]
    ids = [int(t) for t in os.environ["TOUCHSTONE_PROMPT_IDS"].split(",")]
    n_generate = int(os.environ.get("TOUCHSTONE_N_GENERATE", "0"))
    cfg, w = llama_f64.load(model)
    manifest = {
        "format": "touchstone-dump",
        "version": 1,
        "model": {"name": os.path.basename(model), "sha256": sha256(model), "arch": "llama"},
        "device": "example-numpy-f64",
        "precision": "f64",
        "token_ids": ids,
        "positions": list(range(len(ids))),
        "taps": [],
        "logits": None,
        # What the budgets consume: values are stored as f32, so judge them as f32 arithmetic.
        "arithmetic": {"storage": "f32", "accumulate": "f32", "activation_q8_block": None, "transcendental_ulps": 4.0, "fixed": None},
    }
    if n_generate > 0:
        seq = list(ids)
        for _ in range(n_generate):
            seq.append(int(np.argmax(llama_f64.forward(cfg, w, seq)[-1])))
        manifest["generated_ids"] = seq[len(ids):]
    else:
        taps = {}
        logits = llama_f64.forward(cfg, w, ids, taps)
        write_safetensors(os.path.join(out, "taps.safetensors"), list(taps.items()))
        write_safetensors(os.path.join(out, "logits.safetensors"), [("logits", logits)])
        manifest["taps"] = [{"name": k, "shape": list(v.shape), "dtype": "f32", "file": "taps.safetensors"} for k, v in taps.items()]
        manifest["logits"] = {"name": "logits", "shape": list(logits.shape), "dtype": "f32", "file": "logits.safetensors"}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)


if __name__ == "__main__":
    main()
