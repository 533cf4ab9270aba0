#!/bin/sh
# The `ids:` and `exec:` entry of the bare-metal kernel: builds kernel.elf once (clang for i386,
# GNU ld) into $TOUCHSTONE_ENGINE_BUILD (default target/baremetal), turns a GGUF model into the
# flat f32 file the kernel reads (`cargo xtask export`, or $TOUCHSTONE_XTASK, once per model),
# boots it under QEMU's software emulation (no KVM needed) with the model as its boot module and
# the prompt on its command line, and reads its serial ports:
#   cargo xtask fixed-token --device "ids:examples/baremetal/run.sh" --model tiny-llama
#   cargo xtask fixed-token --device "exec:examples/baremetal/run.sh" --model tiny-llama
# As `ids:` it prints the generated ids (the kernel's console line); as `exec:` it also writes a
# dump: the ids for a generation request, else every prompt position's logits, streamed by the
# kernel as frames over its second serial port (serial_to_dump.py). Needs clang, ld (binutils),
# qemu-system-x86 and python3. TOUCHSTONE_BAREMETAL_SEEDED_BUG=1 builds the kernel with an
# off-by-one RoPE position in its queries (tests).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
build=${TOUCHSTONE_ENGINE_BUILD:-$here/../../target/baremetal}
mkdir -p "$build"
flavour=""
defs=""
if [ "${TOUCHSTONE_BAREMETAL_SEEDED_BUG:-0}" = 1 ]; then flavour="-seeded-bug"; defs="-DSEEDED_BUG"; fi
kernel=$build/kernel$flavour.elf
if [ ! -f "$kernel" ] || [ "$here/kernel.c" -nt "$kernel" ] || [ "$here/link.ld" -nt "$kernel" ] || [ "$here/../flat_engine/touchstone_flat.h" -nt "$kernel" ]; then
    clang --target=i386-unknown-none-elf -ffreestanding -fno-pic -fno-stack-protector -mno-sse -mno-mmx -O2 -std=c11 \
        -Wall -Wextra -Werror $defs -c "$here/kernel.c" -o "$kernel.o.$$"
    ld -m elf_i386 -T "$here/link.ld" -nostdlib -o "$kernel.tmp.$$" "$kernel.o.$$"
    rm -f "$kernel.o.$$"
    mv "$kernel.tmp.$$" "$kernel"
fi
sha=$(sha256sum "$TOUCHSTONE_MODEL" | cut -d' ' -f1)
model=$TOUCHSTONE_MODEL
# A flat file is booted as it is; any other model is exported to f32 once.
if [ "$(head -c 6 "$model")" != TSFLAT ]; then
    model=$build/$sha.flat
    if [ ! -f "$model" ]; then
        ${TOUCHSTONE_XTASK:-cargo xtask} export --model "$TOUCHSTONE_MODEL" --type f32 --out "$model.tmp.$$" > /dev/null
        mv "$model.tmp.$$" "$model"
    fi
fi
arch=$(dd if="$model" bs=1 skip=48 count=16 2> /dev/null | tr -d '\000')
n_generate=${TOUCHSTONE_N_GENERATE:-0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
logits=""
if [ "$n_generate" -eq 0 ]; then logits="logits=1"; fi
# Memory: the module, then the cache and activations above it (32-bit, so under 3 GiB).
mib=$(( $(wc -c < "$model") / 1048576 + 128 ))
if [ "$mib" -gt 3072 ]; then echo "baremetal: $model is too large for a 32-bit kernel" >&2; exit 2; fi
status=0
qemu-system-x86_64 -accel tcg -m "$mib" -display none -no-reboot -monitor none -nic none \
    -kernel "$kernel" -initrd "$model" -append "ids=$TOUCHSTONE_PROMPT_IDS gen=$n_generate $logits" \
    -serial "file:$work/console.txt" -serial "file:$work/frames.bin" \
    -device isa-debug-exit,iobase=0xf4,iosize=0x04 || status=$?
# The kernel ends by writing 0 (done) or 1 (error) to the exit port: QEMU exits 1 or 3.
if [ "$status" -ne 1 ]; then
    echo "baremetal: the kernel did not finish (QEMU exit status $status); its console:" >&2
    tail -n 20 "$work/console.txt" >&2 2> /dev/null || true
    exit 2
fi
python3 "$here/serial_to_dump.py" "$work/frames.bin" "$work/console.txt" "$TOUCHSTONE_OUT" "$sha" "$TOUCHSTONE_PROMPT_IDS" "$n_generate" "$arch"
if [ "$n_generate" -gt 0 ]; then
    sed -n '/^generated:/{n;p;}' "$work/console.txt" | tr -d '\r'
fi
