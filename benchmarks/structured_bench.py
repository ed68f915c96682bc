"""The cost of structured outputs: the same requests with and without a constraint.

    python benchmarks/structured_bench.py [--shape qwen3-0.6b | --model DIR] [--requests 64]
                                          [--prompt-len 256] [--max-tokens 256] [--dtype bfloat16]
                                          [--kinds KIND ...]

Runs generate() over `requests` prompts of random token ids (ignore_eos, temperature 0.8, the same
seeds), unconstrained, under each constraint below, and with penalties (no constraint: rows whose
logits depend on their output so far, counted on the device), each twice after a warm-up (--kinds:
only some), and prints the
output tokens per second and the ratio to the unconstrained run. The constraints keep the grammar
engine busy for the whole answer (a JSON string the model may write without end; a regex of
words): every step computes each row's allowed tokens on the host once the previous step's tokens
are read. --shape builds a random-weight model of a real shape (GPUs); --model takes a model
folder (e.g. the demo model on the CPU).
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

from arcserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

CONSTRAINTS = {
    "json string": StructuredOutputsParams(json={"type": "object", "properties": {"text": {"type": "string"}},
                                                 "required": ["text"]}),  # fmt: skip
    "regex words": StructuredOutputsParams(regex=r"([a-z]+ )*[a-z]+\."),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--model", default=None, help="a model folder instead of a random-weight shape")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kinds", nargs="+", default=None, choices=["unconstrained", *CONSTRAINTS, "penalties"],
                    help="only these kinds (default: all)")
    ap.add_argument("--profile", default=None, choices=[*CONSTRAINTS, "penalties", "unconstrained"],
                    help="instead: one run of that kind under torch.profiler; its top host and device ops")
    a = ap.parse_args()
    if a.model:
        return bench(a, Path(a.model), "auto")
    with tempfile.TemporaryDirectory() as tmp:
        bench(a, make_shape_dirs(Path(tmp))[a.shape], "dummy")


def bench(a, model: Path, load_format: str) -> None:
    llm = LLM(model=str(model), dtype=a.dtype, load_format=load_format, max_model_len=a.prompt_len + a.max_tokens + 8)
    vocab = min(llm.llm_engine.model_config.vocab_size, len(llm.get_tokenizer()))
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(10, vocab, a.prompt_len).tolist()} for _ in range(a.requests)]

    def run(so) -> tuple[float, int]:
        extra = {"presence_penalty": 0.5, "repetition_penalty": 1.1} if so == "penalties" else {"structured_outputs": so}
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=a.max_tokens, ignore_eos=True, **extra)
                  for i in range(a.requests)]  # fmt: skip
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)

    run(None)  # warm-up (and the grammar engine's view of the tokenizer, built at the first constraint)
    run(CONSTRAINTS["regex words"])
    if a.profile:
        import torch

        kind = {"penalties": "penalties", "unconstrained": None}.get(a.profile, CONSTRAINTS.get(a.profile))
        run(kind)
        with torch.profiler.profile() as prof:
            s, n = run(kind)
        print(f"{a.profile}: {s:.3f} s, {n / s:.1f} out tok/s under the profiler")
        for key in ("self_cpu_time_total", "self_device_time_total"):
            print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))
        return
    rows = []
    for name, so in [("unconstrained", None), *CONSTRAINTS.items(), ("penalties", "penalties")]:
        if a.kinds and name not in a.kinds and name != "unconstrained":  # (the ratios' base always runs)
            continue
        for _ in range(2):
            s, n = run(so)
            rows.append((name, s, n / s))
    base = np.median([r[2] for r in rows if r[0] == "unconstrained"])
    print(f"{model.name}, {a.requests} requests x {a.prompt_len} prompt + {a.max_tokens} output tokens, {a.dtype}")
    for name, s, tps in rows:
        print(f"  {name:14s} {s:7.3f} s  {tps:9.1f} out tok/s  {tps / base:5.2f}x")


if __name__ == "__main__":
    main()
