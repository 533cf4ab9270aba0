#!/usr/bin/env bash
# tools/reference/write_families.sh DIR — writes DIR/{mamba2,granite-hybrid,qwen3-next,deepseek-v3}.gguf:
# random checkpoints of each family made by transformers (make_checkpoint.py) and converted by
# llama.cpp's converter (hf_to_gguf.py), as the tests judge them. Needs python3 with
# transformers, torch and gguf; exits 2, saying so, without them.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -eq 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
out=$1
python3 -c "import transformers, torch, gguf" 2> /dev/null || { echo "python3 lacks transformers, torch or gguf: the family checkpoints cannot be written" >&2; exit 2; }
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for fam in mamba2:"" granite-hybrid:"" qwen3-next:qwen2 deepseek-v3:deepseek-v3; do
    name=${fam%%:*} pre=${fam#*:}
    python3 tools/reference/make_checkpoint.py "$name" "$tmp/$name" --tokenizer > "$tmp/$name.log" 2>&1 || { cat "$tmp/$name.log" >&2; exit 1; }
    python3 tools/reference/hf_to_gguf.py "$tmp/$name" "$out/$name.gguf" ${pre:+--pre "$pre"} >> "$tmp/$name.log" 2>&1 || { cat "$tmp/$name.log" >&2; exit 1; }
    echo "$out/$name.gguf"
done
