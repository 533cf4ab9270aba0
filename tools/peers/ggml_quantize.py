#!/usr/bin/env python3
"""ggml's reference quantizer (its type traits' `from_float_ref`, what ggml's CPU backend writes a
KV cache row with for most types) as a peer for Touchstone's tests: reads little-endian f32 values
from IN, writes the encoded bytes of TYPE to OUT.

    python3 tools/peers/ggml_quantize.py TYPE IN OUT

The libraries come from tools/peers/build_ggml.py (.cache/touchstone/ggml/lib) or GGML_LIB_DIR.
Exit 3 when they are missing (the caller skips)."""
import ctypes
import os
import sys

TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}


class Traits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in TYPES:
        sys.exit(f"usage: ggml_quantize.py {{{','.join(TYPES)}}} IN OUT")
    root = os.path.dirname(os.path.abspath(__file__))
    lib_dir = os.environ.get("GGML_LIB_DIR") or os.path.join(root, "..", "..", ".cache", "touchstone", "ggml", "lib")
    try:
        base = ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        print(f"ggml's libraries are not in {lib_dir} ({e})", file=sys.stderr)
        sys.exit(3)
    base.ggml_get_type_traits.restype = ctypes.POINTER(Traits)
    base.ggml_get_type_traits.argtypes = [ctypes.c_int]
    traits = base.ggml_get_type_traits(TYPES[sys.argv[1]]).contents
    data = open(sys.argv[2], "rb").read()
    n = len(data) // 4
    if n % traits.blck_size:
        sys.exit(f"{n} values are not whole blocks of {traits.blck_size}")
    src = (ctypes.c_float * n).from_buffer_copy(data)
    dst = (ctypes.c_uint8 * (n // traits.blck_size * traits.type_size))()
    quantize = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(traits.from_float_ref)
    quantize(ctypes.addressof(src), ctypes.addressof(dst), n)
    open(sys.argv[3], "wb").write(bytes(dst))


if __name__ == "__main__":
    main()
