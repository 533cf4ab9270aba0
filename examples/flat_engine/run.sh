#!/bin/sh
# The `exec:` entry of the C flat-file engine: builds engine.c once (with cc, into
# $TOUCHSTONE_ENGINE_BUILD or target/flat_engine) and runs it; the model's sha256 (what a dump
# manifest names) is Touchstone's TOUCHSTONE_MODEL_SHA256, or computed here when run by hand. Usage:
#   cargo xtask fixed-token --device "exec:sh examples/flat_engine/run.sh" --model tiny.flat
set -eu
here=$(cd "$(dirname "$0")" && pwd)
build=${TOUCHSTONE_ENGINE_BUILD:-$here/../../target/flat_engine}
mkdir -p "$build"
bin=$build/flat_engine
if [ ! -x "$bin" ] || [ "$here/engine.c" -nt "$bin" ] || [ "$here/touchstone_flat.h" -nt "$bin" ] || [ "$here/touchstone_dump.h" -nt "$bin" ]; then
    ${CC:-cc} -O2 -std=c11 -Wall -Wextra -Werror -o "$bin.tmp.$$" "$here/engine.c" -lm
    mv "$bin.tmp.$$" "$bin"
fi
if [ -z "${TOUCHSTONE_MODEL_SHA256:-}" ]; then
    TOUCHSTONE_MODEL_SHA256=$(sha256sum "$TOUCHSTONE_MODEL" | cut -d' ' -f1)
    export TOUCHSTONE_MODEL_SHA256
fi
exec "$bin"
