#!/usr/bin/env bash
# Kernel-suite identity across two builds of xtask: every case's verdict, bound and margin
# (and every metric but wall time) on cpu, fixed and gpu-emu, written by each build and
# compared case by case. What a refactoring that must not change a verdict is checked with.
#
#   tools/dev/kernels_identity.sh OLD_XTASK NEW_XTASK OUT_DIR [DEVICE ...]
#
# Exits 1 naming each case that differs (or is in one report only).
set -euo pipefail
if [ $# -lt 3 ]; then
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
old=$1 new=$2 out=$3
shift 3
devs=("$@")
if [ ${#devs[@]} -eq 0 ]; then
    devs=(cpu fixed gpu-emu)
fi
mkdir -p "$out"
status=0
for d in "${devs[@]}"; do
    for side in old new; do
        bin=$old
        [ "$side" = new ] && bin=$new
        rm -rf "$out/$side-$d"
        # Exit 1 (a failing case) is a verdict to compare like any other.
        "$bin" kernels --device "$d" --report-dir "$out/$side-$d" >"$out/$side-$d.log" 2>&1 || [ $? -eq 1 ] || {
            echo "FAILED: $side on $d (see $out/$side-$d.log)"
            exit 1
        }
    done
    python3 - "$out/old-$d/report.json" "$out/new-$d/report.json" "$d" <<'EOF' || status=1
import json, sys
def cases(p):
    out = {}
    for c in json.load(open(p))["cases"]:
        m = dict(c.get("metrics") or {})
        m.pop("wall_seconds", None)
        out[c["id"]] = (c["verdict"], c.get("tolerance"), c.get("margin"), m)
    return out
a, b, dev = cases(sys.argv[1]), cases(sys.argv[2]), sys.argv[3]
bad = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
for k in bad[:20]:
    print(f"DIFFERS on {dev}: {k}: {a.get(k)} vs {b.get(k)}")
print(f"{dev}: {len(a)} cases, {len(bad)} differ")
sys.exit(1 if bad or not a else 0)
EOF
done
exit $status
