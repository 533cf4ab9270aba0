#!/usr/bin/env python3
"""Fetch llama.cpp's tokenizer test vectors (a test peer, never a runtime dependency).

llama.cpp keeps, for several vocabularies, a vocabulary-only GGUF (`ggml-vocab-NAME.gguf`), the
texts its tokenizer test feeds it (`.inp`, separated by `__ggml_vocab_test__` lines) and the ids
llama.cpp produces for each (`.out`, one line per text). The PyPI source distribution of
llama-cpp-python vendors them; this script downloads that sdist with `pip download` (pinned
version and sha256), and unpacks only those files into DEST (default:
`$TOUCHSTONE_CACHE/llama-vocab`, else `.cache/touchstone/llama-vocab`). Nothing is built.

It also unpacks llama.cpp's checkpoint converter (`convert_hf_to_gguf.py` with the `gguf-py`
it imports and its `conversion` package) into `llama-convert/` beside DEST, for `hf_to_gguf.py`.

The oracle's tokenizer test (`oracle/tests/llama_vocab.rs`) compares its ids with them; it
skips, saying so, when DEST holds no vocabulary, unless TOUCHSTONE_REQUIRE_LLAMA_VOCAB=1.

    python3 tools/reference/llama_vocab.py [DEST]
"""
import hashlib
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# The vocabularies whose tokenizer kinds the oracle builds (SentencePiece `llama`; Gemma 4's
# `gemma4`; byte-level BPE with the gpt2, llama-bpe, qwen2, qwen35, deepseek-llm, deepseek-coder,
# falcon, mpt, starcoder, refact and command-r pre-tokenizers).
VOCABS = ["gemma-4", "llama-spm", "phi-3", "gpt-2", "llama-bpe", "qwen2", "deepseek-llm", "deepseek-coder",
          "qwen35", "falcon", "mpt", "starcoder", "refact", "command-r"]


def default_dest() -> pathlib.Path:
    cache = os.environ.get("TOUCHSTONE_CACHE")
    root = pathlib.Path(cache) if cache else pathlib.Path(__file__).resolve().parents[2] / ".cache" / "touchstone"
    return root / "llama-vocab"


def converter_dest(dest: pathlib.Path) -> pathlib.Path:
    return dest.parent / "llama-convert"


def converter_file(name: str) -> str | None:
    """The path under llama-convert/ of an sdist member that belongs to the converter, else None."""
    _, sep, rest = name.partition("/vendor/llama.cpp/")
    if sep and (rest == "convert_hf_to_gguf.py" or rest.startswith(("gguf-py/gguf/", "conversion/"))):
        return rest
    return None


def wanted(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return any(base in (f"ggml-vocab-{v}.gguf", f"ggml-vocab-{v}.gguf.inp", f"ggml-vocab-{v}.gguf.out") for v in VOCABS)


def main() -> int:
    dest = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else default_dest()
    stamp = dest / f"{PACKAGE}-{VERSION}.ok"
    have = all((dest / f"ggml-vocab-{v}.gguf{ext}").exists() for v in VOCABS for ext in ("", ".inp", ".out"))
    have = have and (converter_dest(dest) / "convert_hf_to_gguf.py").exists()
    if stamp.exists() and have:
        print(f"llama.cpp vocabularies already in {dest}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        print(f"fetching {PACKAGE}=={VERSION} (source distribution) with pip download ...", flush=True)
        # Only llama-cpp-python itself as source (its build requirements come as wheels, for the
        # metadata step); it is never built.
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
             "--no-binary", PACKAGE, "-d", tmp, f"{PACKAGE}=={VERSION}"],
            check=True,
        )
        sdists = list(pathlib.Path(tmp).glob("*.tar.gz"))
        if len(sdists) != 1:
            sys.exit(f"pip download gave {[p.name for p in pathlib.Path(tmp).iterdir()]}, not one .tar.gz")
        digest = hashlib.sha256(sdists[0].read_bytes()).hexdigest()
        if digest != SHA256:
            sys.exit(f"{sdists[0]}: sha256 {digest}, expected {SHA256}")
        dest.mkdir(parents=True, exist_ok=True)
        n = 0
        with tarfile.open(sdists[0]) as tar:
            for m in tar.getmembers():
                if m.isfile() and "/vendor/llama.cpp/models/" in m.name and wanted(m.name):
                    data = tar.extractfile(m).read()
                    (dest / m.name.rsplit("/", 1)[-1]).write_bytes(data)
                    n += 1
                elif m.isfile() and (rel := converter_file(m.name)):
                    out = converter_dest(dest) / rel
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(tar.extractfile(m).read())
        if n != 3 * len(VOCABS):
            sys.exit(f"{sdists[0]}: found {n} of the {3 * len(VOCABS)} vocabulary files")
    stamp.write_text(f"{SHA256}\n")
    print(f"{n} files ({', '.join(VOCABS)}) in {dest}; llama.cpp's converter in {converter_dest(dest)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
