"""What the first request to use a feature costs on a fresh engine (Qwen3-0.6B shape, dummy weights,
bf16, graphs as shipped): torch kernels load at their first launch (lazily, on CUDA), so the first
step that takes a new path can stall every running request. For each feature, one request of 64
prompt tokens and 8 output tokens runs twice with fresh prompts; the first time minus the second is
that feature's first-use cost. Features run in the order listed, after two plain warm-up requests,
so each row counts only what the rows above it have not loaded.

    PYTHONPATH=. python3 benchmarks/gpu_first_use.py [--model qwen3-0.6b | --model-dir DIR]

(--model-dir: a real model folder with its weights, e.g. the demo model's, on any device.)
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_shapes import make_shape_dirs  # noqa: E402

from arcserve import LLM, SamplingParams  # noqa: E402

FEATURES = {
    "plain greedy": {},
    "temperature, top-p, top-k": {"temperature": 0.8, "top_p": 0.9, "top_k": 50},
    "min-p": {"temperature": 0.8, "min_p": 0.1},
    "seed": {"temperature": 0.8, "seed": 1},
    "penalties": {"repetition_penalty": 1.1, "frequency_penalty": 0.1, "presence_penalty": 0.1},
    "logit_bias": {"logit_bias": {100: 5.0, 200: -5.0}},
    "allowed_token_ids": {"allowed_token_ids": list(range(1000, 1100))},
    "logprobs": {"logprobs": 5},
    "prompt_logprobs": {"prompt_logprobs": 2},
    "n=2": {"n": 2, "temperature": 0.8},
    "stop strings": {"stop": ["zzzz"]},
    "min_tokens": {"min_tokens": 4},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", help="a shape of model_shapes.py, dummy weights")
    p.add_argument("--model-dir", default=None, help="a model folder with weights instead")
    a = p.parse_args()
    if a.model_dir:
        llm = LLM(model=a.model_dir, dtype="bfloat16", max_model_len=4096)
    else:
        d = make_shape_dirs(tempfile.mkdtemp())[a.model]
        llm = LLM(model=str(d), load_format="dummy", dtype="bfloat16", max_model_len=4096)
    rng = random.Random(0)

    def prompt(n: int = 64) -> dict:
        return {"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(n)]}

    def timed(sp: SamplingParams, pr: dict | None = None) -> float:
        t = time.perf_counter()
        llm.generate(pr or prompt(), sp, use_tqdm=False)
        return (time.perf_counter() - t) * 1e3

    for _ in range(2):
        timed(SamplingParams(max_tokens=8, ignore_eos=True))
    rows = []
    for name, kw in FEATURES.items():
        first, second = (timed(SamplingParams(max_tokens=8, ignore_eos=True, **kw)) for _ in range(2))
        rows.append((name, first, second))
    hits = []  # a cached prefix: the prompt once to fill the cache, then again (timed)
    for _ in range(2):
        pr = prompt(512)
        timed(SamplingParams(max_tokens=8, ignore_eos=True), pr)
        hits.append(timed(SamplingParams(max_tokens=8, ignore_eos=True), pr))
    rows.append(("cached prefix (512 tokens)", *hits))
    print(f"{'feature':28s} {'first ms':>9s} {'second ms':>10s} {'first use costs':>16s}")
    for name, first, second in rows:
        print(f"{name:28s} {first:9.2f} {second:10.2f} {first - second:13.2f} ms")


if __name__ == "__main__":
    main()
