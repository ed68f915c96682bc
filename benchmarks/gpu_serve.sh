#!/usr/bin/env bash
# Serving benchmark of issue 4 on a GPU machine: a server of the Qwen3-0.6B shape with dummy weights
# (bf16, max_model_len 4096), driven by `arcserve bench serve`: random 1024-token prompts, 256 output
# tokens (ignore_eos), 400 requests, Poisson arrivals at 32 req/s.
#   benchmarks/gpu_serve.sh [WHEELS_DIR] [arcserve|vllm ...]
#     WHEELS_DIR: fastapi/uvicorn/pydantic/httpx/httptools/uvloop wheels for an offline machine
#                 (pip download ... -d WHEELS_DIR; "" to skip)
#     engines, one after the other (default: arcserve); vllm = vLLM's OpenAI server from /root/vsite
#                 (../shared/peers/vllm-h100: install.sh), with the same client and workload
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${1:-}" ]; then python3 -m pip install -q --no-index --find-links "$1" fastapi uvicorn pydantic httpx httptools uvloop; fi
shift $(( $# >= 1 ? 1 : 0 ))
ENGINES=("${@:-arcserve}")
export PYTHONPATH=${PYTHONPATH:-.}
PORT=8299
MODEL=/tmp/arcserve-shapes/qwen3-0.6b
SERVER_ARGS=(--load-format dummy --dtype bfloat16 --max-model-len 4096 --port $PORT)  # the same for both
python3 benchmarks/model_shapes.py /tmp/arcserve-shapes >/dev/null
run=0
for engine in "${ENGINES[@]}"; do
  run=$((run + 1))
  case $engine in
    arcserve) python3 -m arcserve.cli serve $MODEL "${SERVER_ARGS[@]}" --log-level warning \
                > /tmp/serve-$engine.log 2>&1 & PID=$! ;;
    vllm) PYTHONPATH=/root/vsite HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
            python3 -m vllm.entrypoints.cli.main serve $MODEL "${SERVER_ARGS[@]}" > /tmp/serve-$engine.log 2>&1 & PID=$! ;;
    *) echo "unknown engine $engine (arcserve or vllm)"; exit 2 ;;
  esac
  trap 'kill $PID 2>/dev/null || true' EXIT  # the server goes, however this script ends
  healthy=0
  for _ in $(seq 1 400); do
    python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" 2>/dev/null && { healthy=1; break; }
    kill -0 $PID 2>/dev/null || { tail -50 /tmp/serve-$engine.log; exit 1; }
    sleep 1
  done
  [ $healthy = 1 ] || { echo "$engine not healthy after 400 s"; tail -50 /tmp/serve-$engine.log; exit 1; }
  echo "== $run: $engine"
  python3 -m arcserve.cli bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts 400 --input-len 1024 \
    --output-len 256 --range-ratio 0 --request-rate 32 --vocab-size 150000 --seed 0 \
    --save-result "${OUT:-/tmp}/serve-$run-$engine.json"
  kill $PID; wait $PID 2>/dev/null || true
  trap - EXIT
done
