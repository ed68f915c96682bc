"""Where the offline benchmark's time goes, step by step (CPU or GPU, arcserve only).

Runs offline_throughput.py's workload (same seed and lengths) through LLMEngine.step() and prints:
steps grouped by kind (mixed = prefill chunks in the step; decN = decode-only with up to N
sequences) with their time, the slowest steps, and wall-clock timers around the model's op groups
(add + RMSNorm + product, attention, ...), the forward pass and the sampler. The timers wrap the ops
from outside, so each includes the Python call it wraps; on a GPU they measure launch time only.

    python benchmarks/cpu_step_timeline.py --model ~/.cache/arcserve/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_throughput import workload, workload_args  # noqa: E402

OPS = ("decoder_layer", "pre_attention", "post_attention", "add_rms_norm_linear", "qkv_prepare", "paged_attention",
       "linear", "silu_mul_linear", "fused_add_rms_norm")


def add_timer(totals: dict[str, float], obj, name: str, key: str, calls: dict[str, int] | None = None):
    """Wrap obj.name so that each call adds its wall seconds to totals[key] (a defaultdict) and, when
    given, one to calls[key]; returns the original (to put back)."""
    fn = getattr(obj, name)

    def wrapper(*args, **kw):
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            totals[key] += time.perf_counter() - t
            if calls is not None:
                calls[key] += 1

    setattr(obj, name, wrapper)
    return fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(p)
    p.add_argument("--slowest", type=int, default=8, help="list this many slowest steps")
    a = p.parse_args()

    from arcserve import LLM, SamplingParams

    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, seed=0)
    eng = llm.llm_engine
    reqs = workload(a.seed, a.num_requests, a.min_len, a.max_len, llm.get_tokenizer().vocab_size)

    def params(olen: int) -> SamplingParams:
        return SamplingParams(temperature=0.6, max_tokens=olen, ignore_eos=True)

    warm = reqs[:4]
    llm.generate([{"prompt_token_ids": q} for q, _ in warm], [params(16)] * len(warm), use_tqdm=False)  # warm-up

    timers: dict[str, float] = collections.defaultdict(float)

    def timed(obj, name: str, key: str) -> None:
        add_timer(timers, obj, name, key)

    for name in OPS:
        timed(eng.model.ops, name, name)
    timed(eng.model, "forward", "[forward]")
    timed(eng.runner, "sample", "[sampler]")  # (ModelRunner.sample: the sampler's call, its copies issued)
    scheduled = []
    timed(eng, "_schedule", "[schedule]")
    schedule = eng._schedule

    def keep(*args, **kw):
        out = schedule(*args, **kw)
        scheduled.append(out)
        return out

    eng._schedule = keep
    for i, (q, o) in enumerate(reqs):
        eng.add_request(str(i), {"prompt_token_ids": q}, params(o))
    steps = []
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        n = len(scheduled)
        eng.step()
        steps.append((time.perf_counter() - t, scheduled[n] if len(scheduled) > n else None))
    total = time.perf_counter() - t0

    kinds: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0])
    for dt, s in steps:
        if s is None:
            continue
        n = len(s.seqs)
        kind = "mixed" if s.num_batched_tokens > n else f"dec{-(-n // 8) * 8}"
        kinds[kind][0] += 1
        kinds[kind][1] += dt
        kinds[kind][2] += sum(q.start_pos + q.num_new_tokens for q in s.seqs)
    out_tokens = sum(o for _, o in reqs)
    print(f"{len(reqs)} requests, {out_tokens} output tokens: {total:.2f} s, {out_tokens / total:.1f} out tok/s, "
          f"{len(steps)} steps")  # fmt: skip
    print(f"{'steps':>8} {'count':>6} {'time s':>8} {'ms/step':>8} {'context/step':>13}")
    for kind in sorted(kinds, key=lambda k: (k != "mixed", len(k), k)):
        c, t, ctx = kinds[kind]
        print(f"{kind:>8} {c:6d} {t:8.2f} {t / c * 1e3:8.1f} {ctx / c:13.0f}")
    print("slowest steps (index: ms, sequences, tokens):")
    slow = sorted(range(len(steps)), key=lambda i: -steps[i][0])[: a.slowest]
    for i in sorted(slow):
        dt, s = steps[i]
        print(f"  {i}: {dt * 1e3:.1f} ms, {len(s.seqs) if s else 0} seqs, {s.num_batched_tokens if s else 0} tokens")
    print("timers (s over the run; op groups nest inside [forward], the ops of a layer half inside its half)")
    for key, v in sorted(timers.items(), key=lambda kv: -kv[1]):
        print(f"  {key:22s} {v:7.2f}")


if __name__ == "__main__":
    main()
