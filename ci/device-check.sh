#!/usr/bin/env bash
# ci/device-check.sh — the GPU check, as ONE script: build with `cuda` (unless given a binary),
# then on $DEVICE (default cuda:0) run the kernel suite, layer-diff and fixed-token on the three
# synthetic models, SmolLM2 and the hybrid and latent-attention families (Mamba-2, Granite 4.0-H,
# Qwen3-Next, DeepSeek V3), the SmolLM2 decode benchmark and the GEMV roofline, writing every
# report and log under $OUT. Budget: under 8 minutes on an H200 (each step has its own timeout).
#
#   OUT=/tmp/gpu ci/device-check.sh                 # on a GPU runner with network (builds, fetches)
#   TOUCHSTONE_BIN=target/release/xtask TOUCHSTONE_PTX_CACHE=target/ptx \
#   TOUCHSTONE_CACHE=device-fixtures OUT=... ci/device-check.sh    # on a machine without network
#
# Offline use: build the binary elsewhere (`cargo build --release -p xtask --features cuda`;
# `objcopy --strip-debug` takes it from about 58 MB to 12 MB for the trip), precompile the
# kernels for the GPU's architecture (`cargo xtask ptx --arch sm_90 --out DIR`, which needs only
# NVRTC, not a GPU) and bring the fixture cache (`cargo xtask fixtures` fills
# .cache/touchstone; TOUCHSTONE_CACHE points at a copy). A step that cannot run (no SmolLM2, no
# driver) exits 2 and is listed as such; nothing is reported green that did not run.
#
# Staged use (a GPU runner with no network that takes at most 64 MiB per transfer): ci/device-stage.sh
# prepares $STAGE (default .device) here — binary, PTX, SmolLM2 in two halves for two transfers — and
# `STAGE=.device ci/device-check.sh` there joins the halves into $STAGE/cache (the loader checks
# its sha256) and takes TOUCHSTONE_BIN, TOUCHSTONE_PTX_CACHE and TOUCHSTONE_CACHE from the stage.
# Such a runner replaced the ignored stage folder between the two transfers on an H200 machine
# (2026-12-04): with STASH=DIR (outside the repository, e.g. /tmp/touchstone-stage) the first
# transfer's parts are also copied to DIR and the second run takes them from there.
#
# SANITIZE=1 adds compute-sanitizer's memcheck and racecheck over one shard of eight of the
# kernel suite (the GPU's own check of what gpu-emu approximates: out-of-bounds accesses and
# shared-memory races). Off by default: it is slow, and some GPU runners refuse it (then the
# step says it could not run).
#
# STEPS picks among "kernels models families bench roofline" (default all; the fixtures of the
# models and bench model are checked first; `families` runs layer-diff and fixed-token on the
# GGUFs of random Mamba-2, Granite 4.0-H, Qwen3-Next and DeepSeek-V3-shaped checkpoints in
# $FAMILIES — default $STAGE/families, staged by ci/device-stage.sh — or, where that is unset and
# python3 has transformers, writes them first with tools/reference) and "threads" (opt-in: the oracle's and the `cpu` device's
# prefill and decode on the bench model at 1, 2, 4, 8 and 16 threads, about two minutes of CPU). DEVICE, MODELS, BENCH_MODEL and ROOFLINE_MIB override the defaults (e.g. DEVICE=gpu-emu
# MODELS=tiny-llama BENCH_MODEL=tiny-llama ROOFLINE_MIB=1 rehearses the script on a CPU; it then
# ends with exit 3, the roofline being inconclusive on an emulator's timings).
#
# PACK=1 (the default when STAGE is set) leaves only two files in $OUT, summary.txt and
# reports.tar.gz (every log and report, refreshed after each step, so a run cut short still
# returns what it finished), for a runner that brings back at most 8 files from $OUT; the steps
# then write under a temporary folder.
#
# Exit status: 0 all steps passed, 1 a gate failed, 2 a step could not run (1 wins over 2).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-target/touchstone/device-check}
DEVICE=${DEVICE:-cuda:0}
MODELS=${MODELS:-"tiny-llama tiny-qwen3 tiny-moe smollm2"}
BENCH_MODEL=${BENCH_MODEL:-smollm2}
ROOFLINE_MIB=${ROOFLINE_MIB:-256}
STEPS=${STEPS:-"kernels models families bench roofline"}
for s in $STEPS; do
    case $s in
        kernels | models | families | bench | roofline | threads) ;;
        *) echo "STEPS: unknown step \`$s' (kernels, models, families, bench, roofline, threads)" >&2; exit 2 ;;
    esac
done
[ -n "${STEPS// /}" ] || { echo "STEPS is empty: nothing would be checked" >&2; exit 2; }
PACK=${PACK:-$([ -n "${STAGE:-}" ] && echo 1 || echo 0)}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
if [ "$PACK" = 1 ]; then
    WORK=$(mktemp -d)  # the steps' logs and reports, packed into $OUT/reports.tar.gz
    # However the script ends, the archive holds everything, the summary included.
    trap 'cp "$SUMMARY" "$WORK/summary.txt"; pack; rm -rf "$WORK"' EXIT
else
    WORK=$OUT
fi
: > "$SUMMARY"
started=$(date +%s)
worst=0
ran=()  # this run's step logs (the headline figures come from these alone, not from older runs in $WORK)

note() { echo "$*" | tee -a "$SUMMARY"; }

# Packs $WORK into $OUT/reports.tar.gz (PACK=1), replacing the previous archive whole.
pack() {
    [ "$PACK" = 1 ] || return 0
    tar -czf "$OUT/reports.tar.gz.part" -C "$WORK" . && mv "$OUT/reports.tar.gz.part" "$OUT/reports.tar.gz"
}

# step NAME TIMEOUT_S COMMAND... : runs one step, its output in $WORK/NAME.log, its status in the summary.
step() {
    local name=$1 limit=$2
    shift 2
    local t0=$(date +%s)
    ran+=("$WORK/$name.log")
    timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
    local rc=$?
    local verdict
    case $rc in
        0) verdict=pass ;;
        1) verdict=FAIL ;;
        3) verdict=inconclusive ;;
        124) verdict="TIMEOUT after ${limit}s"; rc=2 ;;
        *) verdict="could not run (exit $rc)"; rc=2 ;;
    esac
    note "$(printf '%-28s %-26s %4ss' "$name" "$verdict" $(( $(date +%s) - t0 )))"
    if [ $rc -ne 0 ]; then
        tail -n 3 "$WORK/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
    fi
    pack
    if [ $rc -eq 1 ] || { [ $rc -ne 0 ] && [ $worst -eq 0 ]; }; then worst=$rc; fi
    [ $rc -eq 3 ] && [ $worst -eq 0 ] && worst=3
    return 0
}

note "== Touchstone device check on $DEVICE ($(date -u +%FT%TZ))"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null || echo "nvidia-smi not available"; } | tee "$WORK/gpu.txt" | tee -a "$SUMMARY"

if [ -n "${STAGE:-}" ]; then
    # With STASH set: a runner that replaces the repository's ignored folders on every transfer
    # loses the first transfer's parts before the second arrives, so they are kept outside it, in
    # $STASH, and put back for the second.
    if [ -n "${STASH:-}" ]; then
        for part in bin ptx smol-a; do
            if [ -e "$STAGE/$part" ]; then
                mkdir -p "$STASH" && rm -rf "${STASH:?}/$part" && cp -r "$STAGE/$part" "$STASH/"
            elif [ -e "$STASH/$part" ]; then
                mkdir -p "$STAGE" && cp -r "$STASH/$part" "$STAGE/"
                note "$STAGE/$part: restored from $STASH (brought by an earlier transfer to this machine)"
            fi
        done
    fi
    export TOUCHSTONE_BIN=$STAGE/bin/xtask TOUCHSTONE_PTX_CACHE=$STAGE/ptx TOUCHSTONE_CACHE=$STAGE/cache
    if [ -f "$STAGE/smol-a/dest" ]; then
        dest=$TOUCHSTONE_CACHE/$(cat "$STAGE/smol-a/dest")
        mkdir -p "$(dirname "$dest")"
        if [ -f "$STAGE/smol-b/part" ]; then
            cat "$STAGE/smol-a/part" "$STAGE/smol-b/part" > "$dest"
            note "joined SmolLM2 from $STAGE/smol-{a,b} ($(stat -c %s "$dest") bytes; its sha256 is checked when loaded)"
        else
            note "$STAGE/smol-b/part is missing (the second transfer): the SmolLM2 steps will not run"
        fi
    fi
fi

BIN=${TOUCHSTONE_BIN:-}
if [ -z "$BIN" ]; then
    step build 420 cargo build --release -p xtask --features cuda
    BIN=target/release/xtask
fi
if [ ! -x "$BIN" ]; then
    if [ -n "${STAGE:-}" ]; then
        note "no xtask binary at $BIN: this machine does not hold the first transfer (a fresh machine?); send $STAGE/bin, $STAGE/ptx and $STAGE/smol-a again, then $STAGE/smol-b at once"
    else
        note "no xtask binary at $BIN"
    fi
    exit 2
fi

wanted() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
needed=""
wanted models && needed="$MODELS"
{ wanted bench || wanted threads; } && case " $needed " in *" $BENCH_MODEL "*) ;; *) needed="$needed $BENCH_MODEL" ;; esac
for m in $needed; do
    step "fixtures-$m" 120 "$BIN" fixtures --model "$m"
done
if wanted kernels; then
    step kernels 240 "$BIN" kernels --device "$DEVICE" --report-dir "$WORK/kernels"
    if [ "${SANITIZE:-0}" = 1 ]; then
        for tool in memcheck racecheck; do
            step "sanitize-$tool" 180 compute-sanitizer --tool "$tool" --error-exitcode 1 --print-limit 20 \
                "$BIN" kernels --device "$DEVICE" --shard 1/8 --report-dir "$WORK/sanitize-$tool"
        done
    fi
fi
if wanted models; then
    for m in $MODELS; do
        step "layer-diff-$m" 180 "$BIN" layer-diff --device "$DEVICE" --model "$m" --report-dir "$WORK/layer-diff-$m"
        step "fixed-token-$m" 240 "$BIN" fixed-token --device "$DEVICE" --model "$m" --report-dir "$WORK/fixed-token-$m"
    done
fi
if wanted families; then
    FAMILIES=${FAMILIES:-${STAGE:+$STAGE/families}}
    if [ -z "$FAMILIES" ]; then
        FAMILIES=$WORK/families
        step families-write 300 tools/reference/write_families.sh "$FAMILIES"
    fi
    found=0
    for f in "$FAMILIES"/*.gguf; do
        [ -f "$f" ] || continue
        found=1
        fam=$(basename "$f" .gguf)
        # 20 positions over the checkpoints' 300-token vocabulary, as the tests' prompts.
        ids=$(seq 0 19 | awk '{printf "%s%d", (NR > 1 ? "," : ""), ($1 * 37 + 11) % 300}')
        step "layer-diff-$fam" 180 "$BIN" layer-diff --device "$DEVICE" --model "$f" --prompt-ids "$ids" --report-dir "$WORK/layer-diff-$fam"
        step "fixed-token-$fam" 180 "$BIN" fixed-token --device "$DEVICE" --model "$f" --prompt-ids "$ids" --report-dir "$WORK/fixed-token-$fam"
    done
    [ $found = 1 ] || step families-found 5 sh -c "echo 'no *.gguf in $FAMILIES'; exit 2"
fi
if wanted bench; then
    step "bench-$BENCH_MODEL" 120 "$BIN" bench --device "$DEVICE" --model "$BENCH_MODEL" --prompt-len 32 --gen-len 128 --reps 5 --report-dir "$WORK/bench-$BENCH_MODEL"
fi
if wanted threads; then
    for d in ref cpu; do
        for t in 1 2 4 8 16; do
            step "threads-$d-$t" 120 env RAYON_NUM_THREADS=$t "$BIN" bench --device "$d" --model "$BENCH_MODEL" --prompt-len 16 --gen-len 32 --reps 3 --report-dir "$WORK/threads-$d-$t"
        done
    done
fi
if wanted roofline; then
    step roofline 120 "$BIN" roofline --device "$DEVICE" --mib "$ROOFLINE_MIB" --report-dir "$WORK/roofline"
fi

if [ ${#ran[@]} -eq 0 ]; then
    note "no step ran (STEPS=\"$STEPS\", MODELS=\"$MODELS\"): nothing was checked"
    exit 2
fi
note "== headline figures"
grep -H -E 'executed,|first divergence|gates:|decode  \(|device memory peak|kernel launches|decode kernels|^  ts_|copy .* GB/s|gemv ' "${ran[@]}" 2>/dev/null | sed "s|^$WORK/||; s|\.log:|: |; s/^/  /" | tee -a "$SUMMARY"
where=$OUT
[ "$PACK" = 1 ] && where=$OUT/reports.tar.gz
note "== done in $(( $(date +%s) - started ))s, exit $worst; logs and reports in $where"
exit $worst
