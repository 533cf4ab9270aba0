"""Writes a safetensors file by hand (an 8-byte little-endian header length, a JSON header padded
with spaces to a multiple of 8, the tensors' bytes), so the reference tools need no safetensors
package. Shared by gguf_to_safetensors.py and smooth_checkpoints.py.
"""
import json
import struct


def write(path, tensors):
    """`tensors`: (name, safetensors dtype such as "F32", shape, little-endian bytes), in file order."""
    header, offset = {}, 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, _, _, data in tensors:
            f.write(data)
