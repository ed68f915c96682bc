#!/usr/bin/env bash
# Serving benchmark of issue 4 on a GPU machine: `arcserve serve` of the Qwen3-0.6B shape with dummy
# weights (bf16), driven by `arcserve bench serve`: random 1024-token prompts, 256 output tokens
# (ignore_eos), 400 requests, Poisson arrivals at 32 req/s.
#   benchmarks/gpu_serve.sh [WHEELS_DIR]   # WHEELS_DIR: fastapi/uvicorn/pydantic/httpx/httptools/uvloop
#                                          # wheels for an offline machine (pip download ... -d WHEELS_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${1:-}" ]; then python3 -m pip install -q --no-index --find-links "$1" fastapi uvicorn pydantic httpx httptools uvloop; fi
export PYTHONPATH=${PYTHONPATH:-.}
PORT=8299
python3 benchmarks/model_shapes.py /tmp/arcserve-shapes >/dev/null
python3 -m arcserve.cli serve /tmp/arcserve-shapes/qwen3-0.6b --load-format dummy --dtype bfloat16 \
  --max-model-len 4096 --port $PORT --log-level warning > /tmp/arcserve-serve.log 2>&1 & PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT  # the server goes, however this script ends
healthy=0
for _ in $(seq 1 300); do
  python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" 2>/dev/null && { healthy=1; break; }
  kill -0 $PID 2>/dev/null || { cat /tmp/arcserve-serve.log; exit 1; }
  sleep 1
done
[ $healthy = 1 ] || { echo "server not healthy after 300 s"; cat /tmp/arcserve-serve.log; exit 1; }
python3 -m arcserve.cli bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts 400 --input-len 1024 \
  --output-len 256 --range-ratio 0 --request-rate 32 --vocab-size 150000 --seed 0 --save-result "${OUT:-/tmp}/serve.json"
kill $PID; wait $PID 2>/dev/null || true
trap - EXIT
