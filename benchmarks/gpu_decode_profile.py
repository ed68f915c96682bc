"""Where a batch-1 decode step's device time goes, per kernel, for a model shape (dummy weights,
bf16, decode graphs and overlapped steps as shipped): the device-time sum per kernel name over
`--tokens` decode steps, against the wall time per token and the weight-streaming floor.

    PYTHONPATH=. python3 benchmarks/gpu_decode_profile.py [--model llama-3.1-8b] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import copy_bandwidth, weight_bytes  # noqa: E402
from model_shapes import make_shape_dirs  # noqa: E402

from arcserve import LLM, SamplingParams  # noqa: E402
from arcserve.platform import profiler_activity  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args()
    d = make_shape_dirs(tempfile.mkdtemp())[a.model]
    cfg = json.loads((d / "config.json").read_text())
    llm = LLM(model=str(d), load_format="dummy", dtype="bfloat16", max_model_len=4096)
    prompt = {"prompt_token_ids": list(range(1000, 1032))}
    sp = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=0)
    llm.generate(prompt, sp, use_tqdm=False)  # warm-up (graphs, compilation)
    t = time.perf_counter()
    llm.generate(prompt, sp, use_tqdm=False)
    wall = (time.perf_counter() - t) / a.tokens * 1e3
    with profile(activities=[profiler_activity(llm.llm_engine.device)]) as prof:
        llm.generate(prompt, sp, use_tqdm=False)
    # the profiler's per-name sums, kernels only (host ops carry their kernels' time too)
    kernels = [e for e in prof.key_averages() if e.device_type != torch.autograd.DeviceType.CPU]
    per = {e.key: (e.device_time_total, e.count) for e in kernels}
    total = sum(us for us, _ in per.values()) / a.tokens / 1e3
    floor = weight_bytes(cfg) / copy_bandwidth() * 1e3
    print(f"{a.model}: {wall:.3f} ms per token (wall, unprofiled), kernels {total:.3f} ms per token, floor {floor:.3f} ms")
    print(f"{'kernel':70s} {'us/token':>9s} {'calls/token':>11s} {'us/call':>8s}")
    for name, (us, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"{name[:70]:70s} {us / a.tokens:9.1f} {n / a.tokens:11.1f} {us / n:8.2f}")


if __name__ == "__main__":
    main()
