#!/usr/bin/env python3
"""Turns what the bare-metal kernel sent over its serial ports into a Touchstone dump
(docs/DUMP_FORMAT.md): the logit frames of its second port into logits.safetensors, or, for a
generation request, the ids it printed on its first port into a token-only dump.

A frame is "TSLG" | u32 position | u32 n_vocab | n_vocab f32 | u32 FNV-1a of the values' bytes
(little-endian). Every prompt position must arrive exactly once, in order, whole and with its
checksum; anything else is an error naming the frame, and no dump is written.

Usage: serial_to_dump.py FRAMES CONSOLE OUT_DIR SHA256 PROMPT_IDS N_GENERATE ARCH
Only the standard library is used; the dump is written by examples/external_engine/touchstone_dump.py.
"""
import os
import struct
import sys
from array import array

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "external_engine"))
import touchstone_dump  # noqa: E402

# What the kernel declares: f32 values; its sums run in the x87's 64-bit mantissa, exp, sqrt,
# sin and cos are the FPU's own (within 4 f32 ulps).
ARITHMETIC = {"storage": "f32", "accumulate": "f32", "activation_q8_block": None, "transcendental_ulps": 4.0, "fixed": None}


def fail(msg):
    sys.stderr.write(f"serial_to_dump: {msg}\n")
    sys.exit(2)


def fnv1a32(data):
    h = 2166136261
    for b in data:
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h


def read_frames(path, n_prompt):
    data = open(path, "rb").read()
    rows, at, n_vocab = [], 0, None
    while at < len(data):
        if data[at:at + 4] != b"TSLG":
            fail(f"{path}: frame {len(rows)} at byte {at}: no TSLG magic")
        if at + 12 > len(data):
            fail(f"{path}: frame {len(rows)} at byte {at}: truncated header")
        pos, n = struct.unpack_from("<II", data, at + 4)
        if pos != len(rows):
            fail(f"{path}: frame {len(rows)} at byte {at}: position {pos}, expected {len(rows)}")
        if n_vocab is None:
            if not 0 < n <= 1 << 22:
                fail(f"{path}: frame 0: n_vocab {n} out of range")
            n_vocab = n
        elif n != n_vocab:
            fail(f"{path}: frame {pos}: n_vocab {n}, the first frame said {n_vocab}")
        body = data[at + 12:at + 12 + 4 * n]
        if len(body) != 4 * n or at + 16 + 4 * n > len(data):
            fail(f"{path}: frame {pos} at byte {at}: truncated values")
        (check,) = struct.unpack_from("<I", data, at + 12 + 4 * n)
        if check != fnv1a32(body):
            fail(f"{path}: frame {pos}: checksum mismatch (the serial stream is corrupt)")
        rows.append(body)
        at += 16 + 4 * n
    if len(rows) != n_prompt:
        fail(f"{path}: {len(rows)} frames for {n_prompt} prompt positions")
    return rows, n_vocab


def f32_row(data):
    """A frame's little-endian f32 values."""
    a = array("f", data)
    if sys.byteorder == "big":
        a.byteswap()
    return a


def main():
    if len(sys.argv) != 8:
        fail("usage: serial_to_dump.py FRAMES CONSOLE OUT_DIR SHA256 PROMPT_IDS N_GENERATE ARCH")
    frames, console, out, sha, prompt, n_generate, arch = sys.argv[1:]
    req = touchstone_dump.request({"TOUCHSTONE_MODEL": "flat", "TOUCHSTONE_PROMPT_IDS": prompt, "TOUCHSTONE_N_GENERATE": n_generate, "TOUCHSTONE_OUT": out, "TOUCHSTONE_MODEL_SHA256": sha})
    dump = touchstone_dump.Dump(device="baremetal", arithmetic=ARITHMETIC, request=req, arch=arch)
    if req.n_generate > 0:
        lines = [l.strip() for l in open(console, encoding="utf-8", errors="replace").read().splitlines()]
        after = lines[lines.index("generated:") + 1:] if "generated:" in lines else []
        if not after:
            fail(f"{console}: no `generated:` line followed by the ids")
        dump.generated(int(t) for t in after[0].split(",") if t)
    else:
        rows, _ = read_frames(frames, len(req.ids))
        dump.logits([f32_row(r) for r in rows])
    dump.write()

if __name__ == "__main__":
    main()
