#!/usr/bin/env bash
# Serving benchmark, arcserve vs vLLM's OpenAI server, same model, same workload, one after the other.
#   benchmarks/serve_compare.sh MODEL_DIR [VLLM_PYTHON] [-- extra `arcserve bench serve` flags]
# Defaults: bf16, max_model_len 2048, 64 prompts of 256 tokens, 64 output tokens, 2 req/s Poisson,
# max concurrency 16, seed 0. Results land in ./serve-arcserve.json and ./serve-vllm.json.
set -euo pipefail
MODEL=${1:?model folder}; VLLM_PY=${2:-}
shift $(( $# >= 2 ? 2 : $# )); [ "${1:-}" = "--" ] && shift
PORT=8199
WORKLOAD=(--num-prompts 64 --input-len 256 --output-len 64 --request-rate 2 --max-concurrency 16 --seed 0 "$@")

wait_up() {
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    kill -0 "$1" 2>/dev/null || { echo "server exited" >&2; return 1; }
    sleep 1
  done
  echo "server did not come up" >&2; return 1
}

run() {  # name, command...
  local name=$1; shift
  "$@" >"serve-$name.log" 2>&1 & local pid=$!
  wait_up $pid
  arcserve bench serve --base-url "http://127.0.0.1:$PORT" "${WORKLOAD[@]}" --save-result "serve-$name.json" | tee "bench-$name.txt"
  kill $pid; wait $pid 2>/dev/null || true
}

run arcserve arcserve serve "$MODEL" --port $PORT --dtype bfloat16 --max-model-len 2048 --log-level warning
if [ -n "$VLLM_PY" ]; then
  run vllm env HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 "$VLLM_PY" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL" --dtype bfloat16 --max-model-len 2048 --host 127.0.0.1 --port $PORT
fi
