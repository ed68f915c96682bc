#!/bin/bash
# A/B on the lent GPU: this tree against an older commit's arcserve/ and benchmarks/, run alternately
# in one call so both share a machine (run-to-run spread on one H200 is ~0.5%; between leases more).
#
#   here:        benchmarks/gpu_ab.sh prepare REV
#                  -> REV's arcserve/ and benchmarks/ in .ab/base (git-ignored; carry ".ab" with the call)
#   on the GPU:  benchmarks/gpu_ab.sh run [PAIRS] [PART ...]
#                  -> PAIRS rounds (default 2) of each gpu_bench.py PART (default throughput), this tree
#                     first, then the base; one line per run with its headline figure
set -euo pipefail
cd "$(dirname "$0")/.."

headline() {  # the RESULT line's figure: out tok/s, ms per token or TTFT
    python3 -c '
import json, sys
lines = [l for l in sys.stdin if l.startswith("RESULT ")]
if not lines:
    sys.exit("no RESULT line")
r = json.loads(lines[-1][7:])
keys = ("output_tok_s", "ms_per_token", "cold_ms", "cached_ms")
print(", ".join(f"{k} {r[k]}" for k in keys if k in r) or json.dumps(r))'
}

case "${1:-}" in
prepare)
    rev=${2:?usage: benchmarks/gpu_ab.sh prepare REV}
    rm -rf .ab/base && mkdir -p .ab/base
    git archive "$rev" arcserve benchmarks | tar -x -C .ab/base
    git rev-parse "$rev" > .ab/base/REV
    echo "base $(cat .ab/base/REV) in .ab/base; carry \".ab\" with the device call"
    ;;
run)
    [ -f .ab/base/REV ] || { echo "no .ab/base: run 'benchmarks/gpu_ab.sh prepare REV' here first, carry .ab" >&2; exit 2; }
    pairs=${2:-2}
    parts=("${@:3}")
    [ ${#parts[@]} -gt 0 ] || parts=(throughput)
    base=$(cut -c1-7 .ab/base/REV)
    for part in "${parts[@]}"; do
        for i in $(seq "$pairs"); do
            echo "$part $i this tree: $(PYTHONPATH=$PWD python3 benchmarks/gpu_bench.py "$part" 2>&1 | headline)"
            echo "$part $i $base:   $(cd .ab/base && PYTHONPATH=$PWD python3 benchmarks/gpu_bench.py "$part" 2>&1 | headline)"
        done
    done
    ;;
*)
    echo "usage: benchmarks/gpu_ab.sh prepare REV | run [PAIRS] [PART ...]" >&2
    exit 2
    ;;
esac
