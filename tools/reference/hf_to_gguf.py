#!/usr/bin/env python3
"""Convert a checkpoint directory to GGUF with llama.cpp's own converter (`convert_hf_to_gguf.py`
of the pinned llama-cpp-python sdist, unpacked by `llama_vocab.py` into
`.cache/touchstone/llama-convert`, or `$TOUCHSTONE_CACHE/llama-convert`). A development/test
peer: the GGUF is written by code Touchstone did not write, so the oracle reading it is held to
the same checkpoint's transformers forward through a second, independent path.

The converter knows a byte-level BPE tokenizer's split only by the hash of what it makes of a
fixed text, and refuses one it has not seen, as a freshly trained tokenizer is; `--pre NAME`
names the split instead (the name it would have found for the family's own tokenizer, e.g.
`gpt-4o` for GPT-OSS). A checkpoint without multi-token-prediction layers of a family whose
converter expects them (Qwen3-Next) is converted with the converter's own `--no-mtp`. Nothing
else of the converter is changed.

The converter needs torch, transformers and sentencepiece (tools/peers/requirements-torch.txt).

Usage: hf_to_gguf.py CHECKPOINT_DIR OUT.gguf [--outtype f32] [--pre NAME]
"""
import argparse
import json
import os
import pathlib
import sys


def converter_dir() -> pathlib.Path:
    cache = os.environ.get("TOUCHSTONE_CACHE")
    root = pathlib.Path(cache) if cache else pathlib.Path(__file__).resolve().parents[2] / ".cache" / "touchstone"
    return root / "llama-convert"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--outtype", default="f32", help="the converter's --outtype (default f32)")
    ap.add_argument("--pre", help="the byte-level BPE split's GGUF name, for a tokenizer the converter has not seen")
    a = ap.parse_args()
    conv = converter_dir()
    if not (conv / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"{conv}/convert_hf_to_gguf.py not found: run python3 tools/reference/llama_vocab.py first")
    sys.path.insert(0, str(conv))
    sys.path.insert(1, str(conv / "gguf-py"))
    import conversion
    import convert_hf_to_gguf as c
    if a.pre:
        conversion.TextModel.get_vocab_base_pre = lambda self, tokenizer: a.pre
    sys.argv = ["convert_hf_to_gguf.py", a.checkpoint, "--outfile", a.out, "--outtype", a.outtype]
    cfg = json.loads((pathlib.Path(a.checkpoint) / "config.json").read_text())
    if "Qwen3NextForCausalLM" in cfg.get("architectures", []) and not cfg.get("mtp_num_hidden_layers"):
        sys.argv.append("--no-mtp")
    c.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
