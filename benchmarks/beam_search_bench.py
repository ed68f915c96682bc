"""Beam search's cost beside sampling as many sequences (random weights of a real shape, bf16 on GPUs).

    python benchmarks/beam_search_bench.py [--shape qwen3-0.6b] [--prompts 8] [--prompt-len 256]
                                           [--beam-width 4] [--max-tokens 64]

Runs LLM.beam_search over the prompts (random token ids, ignore_eos), then generate() with
n = beam_width and the same max_tokens on the same prompts (the same number of generated tokens,
sampled, one request per prompt), each twice after a warm-up, and prints the seconds of each and
their ratio. The beam search submits every beam as a new one-token request a step, so the ratio is
the price of that (prefix-cache lookups, one scheduling round-trip per token) over decode steps.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from model_shapes import make_shape_dirs  # noqa: E402

from arcserve import LLM, BeamSearchParams, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bench(a, make_shape_dirs(Path(tmp))[a.shape])


def bench(a, model: Path) -> None:
    llm = LLM(str(model), load_format="dummy", dtype="bfloat16", max_model_len=a.prompt_len + a.max_tokens + 16)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(1000, 30000, a.prompt_len).tolist()} for _ in range(a.prompts)]
    beam = BeamSearchParams(beam_width=a.beam_width, max_tokens=a.max_tokens, ignore_eos=True)
    sample = SamplingParams(n=a.beam_width, max_tokens=a.max_tokens, ignore_eos=True, temperature=0.8, seed=0)
    runs = {"beam_search": lambda: llm.beam_search(prompts, beam),
            "generate_n": lambda: llm.generate(prompts, sample, use_tqdm=False)}  # fmt: skip
    for go in runs.values():
        go()  # warm-up (graphs, kernels)
    times = {}
    for name, go in list(runs.items()) * 2:
        t = time.perf_counter()
        go()
        times.setdefault(name, []).append(time.perf_counter() - t)
    tokens = a.prompts * a.beam_width * a.max_tokens
    print(f"{a.shape}: {a.prompts} prompts x {a.prompt_len} tokens, beam_width {a.beam_width}, max_tokens {a.max_tokens}")
    for name, ts in times.items():
        print(f"{name:12s} {' / '.join(f'{t:.3f}' for t in ts)} s   ({tokens / min(ts):,.0f} generated tok/s at best)")
    print(f"ratio beam_search / generate_n: {min(times['beam_search']) / min(times['generate_n']):.2f}")


if __name__ == "__main__":
    main()
