#!/usr/bin/env bash
# Byte-identity of dumps across two builds of xtask: every fixture model on ref, cpu, fixed
# and gpu-emu, written by each build, compared file by file. What a refactoring that must not
# change a number is checked with.
#
#   tools/dev/dump_identity.sh OLD_XTASK NEW_XTASK OUT_DIR [MODEL ...]
#
# OLD_XTASK/NEW_XTASK: xtask binaries (e.g. one built from a worktree of the earlier commit
# with its own CARGO_TARGET_DIR). MODELS default to every synthetic and real fixture. Exits 1
# naming each dump whose bytes differ.
set -euo pipefail
if [ $# -lt 3 ]; then
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
old=$1 new=$2 out=$3
shift 3
models=("$@")
if [ ${#models[@]} -eq 0 ]; then
    models=(tiny-llama tiny-qwen3 tiny-moe tiny-gemma3 tiny-gpt-oss smollm2 gemma3)
fi
devices=(${DEVICES:-ref cpu fixed gpu-emu})
ids=1,2,3,4,5,6,7,8,9,10,11,12
mkdir -p "$out"
differ=0 compared=0
for m in "${models[@]}"; do
    for d in "${devices[@]}"; do
        for side in old new; do
            bin=$old
            [ "$side" = new ] && bin=$new
            dir="$out/$side/$m-$d"
            rm -rf "$dir"
            "$bin" dump --model "$m" --device "$d" --prompt-ids "$ids" --out "$dir" >/dev/null 2>"$out/$side-$m-$d.log" || {
                echo "FAILED: $side $m on $d (see $out/$side-$m-$d.log)"
                exit 1
            }
        done
        for f in logits.safetensors taps.safetensors manifest.json; do
            compared=$((compared + 1))
            if ! cmp -s "$out/old/$m-$d/$f" "$out/new/$m-$d/$f"; then
                echo "DIFFERS: $m on $d: $f"
                differ=$((differ + 1))
            fi
        done
        echo "identical: $m on $d"
    done
done
echo "$compared files compared, $differ differ"
[ "$differ" -eq 0 ] && [ "$compared" -gt 0 ]
