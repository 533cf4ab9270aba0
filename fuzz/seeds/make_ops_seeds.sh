#!/bin/sh
# Seeds for the `ops` fuzz target: the numpy template's capabilities.json (behind a 0 byte), and
# the valid results.json and outputs.safetensors the target builds for its batch (behind 1 and 2),
# written by the target itself on one empty input.
#
#     sh fuzz/seeds/make_ops_seeds.sh            (from the repository root; cargo-fuzz, nightly)
set -e
mkdir -p fuzz/corpus/ops
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
TOUCHSTONE_TASK=capabilities TOUCHSTONE_OUT="$tmp" python3 examples/ops_numpy/engine.py
{ printf '\000'; cat "$tmp/capabilities.json"; } > fuzz/corpus/ops/capabilities
printf '' > "$tmp/empty"
(cd fuzz && TOUCHSTONE_FUZZ_OPS_SEEDS="$PWD/corpus/ops" cargo +nightly fuzz run ops "$tmp/empty" > /dev/null 2>&1)
ls fuzz/corpus/ops
