#!/bin/sh
# The `exec:` entry of the eBPF engine: builds forward.bpf.o (clang, BPF target) and the loader
# (cc + libbpf) once into $TOUCHSTONE_ENGINE_BUILD (default target/ebpf_engine), turns a GGUF
# model into the flat f32 file the engine reads (`cargo xtask export`, or $TOUCHSTONE_XTASK,
# once per model), and runs the forward pass in the kernel. Needs root (bpf()), clang and
# libbpf-dev. Usage:
#   cargo xtask fixed-token --device "exec:examples/ebpf_engine/run.sh" --model tiny-llama
# TOUCHSTONE_EBPF_SEEDED_BUG=1 builds it with one wrong shift in its Q16 multiply (tests).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
build=${TOUCHSTONE_ENGINE_BUILD:-$here/../../target/ebpf_engine}
mkdir -p "$build"
flavour=""
defs=""
if [ "${TOUCHSTONE_EBPF_SEEDED_BUG:-0}" = 1 ]; then flavour="-seeded-bug"; defs="-DSEEDED_BUG"; fi
obj=$build/forward$flavour.bpf.o
bin=$build/loader
arch_inc=/usr/include/$(uname -m)-linux-gnu
if [ ! -f "$obj" ] || [ "$here/forward.bpf.c" -nt "$obj" ] || [ "$here/forward.h" -nt "$obj" ]; then
    clang -O2 -g -target bpf -I"$arch_inc" -Wall -Werror $defs -c "$here/forward.bpf.c" -o "$obj.tmp.$$"
    mv "$obj.tmp.$$" "$obj"
fi
if [ ! -x "$bin" ] || [ "$here/loader.c" -nt "$bin" ] || [ "$here/forward.h" -nt "$bin" ] || [ "$here/../flat_engine/touchstone_dump.h" -nt "$bin" ]; then
    ${CC:-cc} -O2 -std=c11 -Wall -Wextra -Werror -o "$bin.tmp.$$" "$here/loader.c" -lbpf -lm
    mv "$bin.tmp.$$" "$bin"
fi
# Touchstone passes the model's sha256; computed here when run by hand.
if [ -z "${TOUCHSTONE_MODEL_SHA256:-}" ]; then
    TOUCHSTONE_MODEL_SHA256=$(sha256sum "$TOUCHSTONE_MODEL" | cut -d' ' -f1)
    export TOUCHSTONE_MODEL_SHA256
fi
# A flat file is read as it is; any other model is exported to f32 once.
if [ "$(head -c 6 "$TOUCHSTONE_MODEL")" != TSFLAT ]; then
    flat=$build/$TOUCHSTONE_MODEL_SHA256.flat
    if [ ! -f "$flat" ]; then
        ${TOUCHSTONE_XTASK:-cargo xtask} export --model "$TOUCHSTONE_MODEL" --type f32 --out "$flat.tmp.$$" > /dev/null
        mv "$flat.tmp.$$" "$flat"
    fi
    TOUCHSTONE_MODEL=$flat
    export TOUCHSTONE_MODEL
fi
exec "$bin" "$obj"
