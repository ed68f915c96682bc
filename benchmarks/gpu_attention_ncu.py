"""One decode-attention launch for Nsight Compute to read: Qwen3-0.6B heads (16 q, 8 KV, 128 wide),
a bf16 cache, `batch` sequences of 200-2,048 tokens (the shipped tile plan, printed). Three launches
run before the graph timing; profile the third:

    ncu --clock-control none -k regex:_attn_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --section SchedulerStats \\
        python3 benchmarks/gpu_attention_ncu.py 256

(`--clock-control none`: the lent machines' clocks stay as they are.) The graph timing it prints is
for runs without ncu: under ncu it can be far off (24 sequences: 103.9 us printed, 46.3 us in ncu's
own reading, 36.3 us from `gpu_kernels.py attention-splits`). Session 42's readings are in
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

import gpu_kernels  # noqa: E402


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    lens = np.random.default_rng(0).integers(200, 2049, batch)
    plan, fn = gpu_kernels.varied_decode_attention(lens, 16, 8, 128)
    print(batch, {k: v for k, v in plan.items() if k not in ("tile_seq", "tile_q")}, flush=True)
    with torch.inference_mode():
        for _ in range(3):
            fn()
        gpu_kernels.synchronize(gpu_kernels.DEV)
        print(f"{gpu_kernels.graph_time([fn]):.1f} us a launch (graph replays)", flush=True)


if __name__ == "__main__":
    main()
