"""Where a single request's decode step goes on the CPU (arcserve only): one request of 32 random
prompt tokens decoding 128 tokens, with wall-clock timers around the engine step, the model's
forward, its whole-layer calls (a lone sequence's layers, cpu_layer), the LM head and the sampler; and
the startup's compiles (cpu_inductor._compile, each traced graph) with inductor's cache counters.

    python benchmarks/cpu_single_breakdown.py --model DIR [--load-format dummy] [--dtype bfloat16] [--tiles 64 32 16]

Prints ms per decode step of each part (medians over the 127 decode steps of the second of two
runs) and the startup's compile times.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_step_timeline import add_timer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--tiles", type=int, nargs="+", default=None, help="cpu_compiled.TILES to try")
    a = p.parse_args()

    t0 = time.perf_counter()
    from arcserve.kernels import cpu_compiled, cpu_inductor, cpu_layer

    if a.tiles:
        cpu_compiled.TILES = tuple(a.tiles)

    compiles = []
    compile_fn = cpu_inductor._compile

    def timed_compile(fn, args, dynamic):
        t = time.perf_counter()
        got = compile_fn(fn, args, dynamic)
        compiles.append((getattr(fn, "func", fn).__name__, round(time.perf_counter() - t, 2)))
        return got

    cpu_inductor._compile = timed_compile
    from arcserve import LLM, SamplingParams
    from arcserve.engine.engine import LLMEngine
    from arcserve.engine.sampler import Sampler
    from arcserve.models.decoder import DecoderModel

    t_import = time.perf_counter() - t0
    kw = {} if a.load_format == "auto" else {"load_format": a.load_format}
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=2048, seed=0, **kw)
    startup = time.perf_counter() - t0
    from torch._dynamo.utils import counters

    print(f"startup {startup:.1f} s (arcserve import {t_import:.1f} s); compiles: {compiles}")
    print("inductor counters:", dict(counters["inductor"]))

    spans = collections.defaultdict(float)

    for owner, name, label in [(LLMEngine, "step", "engine step"), (DecoderModel, "forward", "model forward"),
                               (DecoderModel, "logits", "final norm + LM head"),
                               (cpu_layer, "_run", "whole-layer calls"), (Sampler, "__call__", "sampler")]:  # fmt: skip
        add_timer(spans, owner, name, label)

    rng = random.Random(1)
    prompt = {"prompt_token_ids": [rng.randrange(100, 300) for _ in range(32)]}
    params = SamplingParams(temperature=0.6, max_tokens=a.tokens, ignore_eos=True)
    eng = llm.llm_engine
    per_step = collections.defaultdict(list)
    for run in range(2):
        per_step.clear()
        eng.add_request(f"breakdown-{run}", prompt, params)
        steps = 0
        while eng.has_unfinished_requests():
            spans.clear()
            eng.step()
            steps += 1
            if steps > 1:  # decode steps only
                for k, v in spans.items():
                    per_step[k].append(v * 1e3)
    for k, v in per_step.items():
        print(f"{k:>22}: {statistics.median(v):7.2f} ms per decode step")


if __name__ == "__main__":
    main()
