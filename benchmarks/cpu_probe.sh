#!/usr/bin/env bash
# Issue 2's CPU benchmark (arcserve only, SmolLM2-135M shape, random weights) on whatever CPU this
# is, pinned to two cores, in three variants: this CPU's own paths, the AVX2-only CPU's paths
# (--emulate-half), and a float32 decode mirror (--float32-mirror). For the GPU machines' hosts:
#   CUDA_VISIBLE_DEVICES= bash benchmarks/cpu_probe.sh [OUTDIR]
set -u
out=${1:-/tmp/cpu_probe}
mkdir -p "$out"
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Socket" ; grep -o -E "avx512f|avx512_bf16|avx512_fp16|amx_bf16|amx_tile|avx2" /proc/cpuinfo | sort | uniq -c
python3 -c "import torch; print(torch.__version__, 'mkldnn bf16:', torch.ops.mkldnn._is_mkldnn_bf16_supported())"
python3 benchmarks/model_shapes.py /tmp/shapes >/dev/null
for v in "" --emulate-half --float32-mirror; do
  echo "== variant: ${v:-native}"
  OMP_NUM_THREADS=2 timeout 190 taskset -c 0,1 python3 benchmarks/offline_throughput.py \
    --model /tmp/shapes/smollm2-135m --load-format dummy $v "${@:2}" 2>"$out/err${v}.txt" | tail -2 | head -1
  grep -i -E "warn|error|compil" "$out/err${v}.txt" | tail -3
done
