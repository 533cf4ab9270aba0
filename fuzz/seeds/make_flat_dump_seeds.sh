#!/bin/sh
# Seeds for the `flat` and `dump` fuzz targets, written by Touchstone's own writers from the small
# GGUF seeds (make_gguf_seeds.py, gguf-py): each GGUF exported as flat files (as stored, Q8_0,
# Q4_K), and the dump of one (its manifest prefixed by an even byte, each tap file by an odd one,
# as the `dump` target splits its input).
#
#     sh fuzz/seeds/make_flat_dump_seeds.sh            (from the repository root)
#     XTASK=target/release/xtask sh fuzz/seeds/make_flat_dump_seeds.sh
set -e
XTASK=${XTASK:-"cargo xtask"}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 fuzz/seeds/make_gguf_seeds.py "$tmp/gguf"
mkdir -p fuzz/corpus/flat fuzz/corpus/dump
for g in "$tmp"/gguf/*; do
    for ty in keep q8_0 q4_k; do
        $XTASK export --model "$g" --out "fuzz/corpus/flat/$(basename "$g" .gguf)-$ty.flat" --type "$ty" > /dev/null
    done
done
g=$(ls "$tmp"/gguf/* | head -n 1)
$XTASK dump --model "$g" --prompt-ids 1,2,3 --out "$tmp/dump" > /dev/null
{ printf '\000'; cat "$tmp/dump/manifest.json"; } > fuzz/corpus/dump/manifest
for f in "$tmp"/dump/*.safetensors; do
    { printf '\001'; cat "$f"; } > "fuzz/corpus/dump/$(basename "$f")"
done
ls fuzz/corpus/flat fuzz/corpus/dump | wc -l
