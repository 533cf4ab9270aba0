#!/usr/bin/env bash
# ci/device-stage.sh — prepares, on a machine with network and no GPU, what ci/device-check.sh
# needs on a GPU machine that has a driver but no network, no Rust and no room for large
# transfers (a runner that takes at most 64 MiB per trip, the working tree included):
#
#   $STAGE/bin/xtask        release build with `cuda`, debug info stripped (~12 MB)
#   $STAGE/ptx/             the kernels compiled to PTX for $ARCH with NVRTC (no GPU needed)
#   $STAGE/smol-a/part      the SmolLM2 GGUF's first part (98 MB in all: too big for one trip)
#   $STAGE/smol-b/part      the rest (split so both trips weigh about the same)
#   $STAGE/smol-a/dest      where the joined file goes, relative to the fixture cache
#   $STAGE/families/        GGUFs of random Mamba-2, Granite 4.0-H, Qwen3-Next and DeepSeek-V3-shaped
#                           checkpoints (tools/reference/write_families.sh; a few MB), for trip 1
#
# Trip 1 carries bin, ptx and smol-a and runs everything but SmolLM2 (so its figures exist even if
# trip 2 fails); trip 2 carries smol-b and runs SmolLM2's steps. The runner drops trip 1's
# ignored folders from the repository when trip 2 arrives, so with STASH=/tmp/touchstone-stage
# device-check.sh keeps a copy of them outside it on a machine kept warm between the two, and puts
# them back. On the GPU machine, `STAGE=.device ci/device-check.sh` joins the halves into
# $STAGE/cache, where the fixture loader checks the file's sha256 before any use (a wrong or
# partial join is an error, not a model), and runs everything from the stage.
# A staged run leaves two files in $OUT, summary.txt and reports.tar.gz (every log and report),
# since such a runner brings back at most 8 files.
#
#   ci/device-stage.sh                      # STAGE=.device ARCH=sm_90 (H100/H200); sm_80 for A100
#
# The stage directory is added to .git/info/exclude (it is a build output, never committed).
set -euo pipefail
cd "$(dirname "$0")/.."

STAGE=${STAGE:-.device}
ARCH=${ARCH:-sm_90}

grep -qxF "/$STAGE/" .git/info/exclude 2> /dev/null || echo "/$STAGE/" >> .git/info/exclude
rm -rf "$STAGE"
mkdir -p "$STAGE/bin" "$STAGE/ptx" "$STAGE/smol-a" "$STAGE/smol-b" "$STAGE/families"

command -v objcopy > /dev/null || { echo "objcopy (binutils) is needed to strip the binary (58 MB with debug info, too big for one transfer)"; exit 2; }

echo "== release build with cuda"
cargo build --release -p xtask --features cuda
objcopy --strip-debug target/release/xtask "$STAGE/bin/xtask"

echo "== PTX for $ARCH (NVRTC: the CUDA toolkit, or the PyPI wheel nvidia-cuda-nvrtc-cu12)"
if [ -z "${TOUCHSTONE_NVRTC:-}" ]; then
    TOUCHSTONE_NVRTC=$(python3 -c "import nvidia.cuda_nvrtc as m, os; print(os.path.join(list(m.__path__)[0], 'lib', 'libnvrtc.so.12'))" 2> /dev/null || true)
    export TOUCHSTONE_NVRTC
fi
"$STAGE/bin/xtask" ptx --arch "$ARCH" --out "$STAGE/ptx"

echo "== the hybrid and latent-attention families (random checkpoints, converted by llama.cpp's converter)"
tools/reference/write_families.sh "$STAGE/families"

echo "== SmolLM2, in two parts"
cache=${TOUCHSTONE_CACHE:-.cache/touchstone}
"$STAGE/bin/xtask" fixtures --model smollm2
gguf=$(cd "$cache" && find real -name '*.gguf' | grep -i smollm2 | head -n 1) || true
[ -n "$gguf" ] || { echo "no SmolLM2 GGUF under $cache/real after xtask fixtures"; exit 2; }
# Split so that both trips weigh the same: trip 1 also carries the binary and the PTX.
size=$(stat -c %s "$cache/$gguf")
extra=$(du -sb "$STAGE/bin" "$STAGE/ptx" "$STAGE/families" | awk '{s += $1} END {print s}')
half=$(( (size - extra) / 2 ))
[ "$half" -gt 0 ] || half=$(( size / 2 ))
head -c "$half" "$cache/$gguf" > "$STAGE/smol-a/part"
tail -c +"$(( half + 1 ))" "$cache/$gguf" > "$STAGE/smol-b/part"
echo "$gguf" > "$STAGE/smol-a/dest"
cmp <(cat "$STAGE/smol-a/part" "$STAGE/smol-b/part") "$cache/$gguf"

tree=$(git ls-files -z | du -cb --files0-from=- | tail -n 1 | cut -f1)
trip1=$(( tree + $(du -sb "$STAGE/bin" "$STAGE/ptx" "$STAGE/families" "$STAGE/smol-a" | awk '{s += $1} END {print s}') ))
trip2=$(( tree + $(du -sb "$STAGE/smol-b" | cut -f1) ))
echo "== staged under $STAGE: trip 1 (tree + bin + ptx + smol-a) $(( trip1 >> 20 )) MiB, trip 2 (tree + smol-b) $(( trip2 >> 20 )) MiB"
echo "   trip 1: carry $STAGE/bin $STAGE/ptx $STAGE/families $STAGE/smol-a; command:"
echo "     STASH=/tmp/touchstone-stage STAGE=$STAGE STEPS='kernels models families roofline' MODELS='tiny-llama tiny-qwen3 tiny-moe' ci/device-check.sh"
echo "   trip 2 (at once: the machine stays warm only ~30 s; trip 1's parts come back from /tmp/touchstone-stage there; on a fresh machine it finds no binary and says so): carry $STAGE/smol-b; command:"
echo "     STASH=/tmp/touchstone-stage STAGE=$STAGE STEPS='models bench' MODELS=smollm2 ci/device-check.sh"
