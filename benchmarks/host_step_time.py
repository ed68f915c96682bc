"""The host's share of a step, phase by phase (any device): where the Python time of a large decode
batch goes. On a fast GPU the host's work per step can reach the device's (H200, Qwen3-0.6B shape,
256 sequences: ~6.5 ms of host work against ~6.6 ms steps), and then it sets the pace.

Runs gpu_bench.py's throughput workload (256 requests, input and output lengths uniform in
[100, 1024], random token ids, temperature 0.6, ignore_eos; --max-out shortens it) through LLM.generate
with timers around the engine's phases, and prints, for decode-only steps in batch-size classes, the
mean milliseconds per step of each phase. `wait` is the time spent waiting for the device inside
the step's result; everything else is host work.

    python benchmarks/host_step_time.py                     # tiny Qwen3-like model (host work only)
    python benchmarks/host_step_time.py --shape qwen3-0.6b  # the real shape, dummy weights (GPU)
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import throughput_workload  # noqa: E402
from model_shapes import SHAPES, TINY, write_model_dir  # noqa: E402


def batch(out) -> int:
    """A decode-only step's batch size; -1 for a step with prompt tokens."""
    return len(out.seqs) if out.num_batched_tokens == len(out.seqs) else -1


# (class path, method, how to find the step's batch size from the call's arguments; None: the
# last one seen)
PHASES = [
    ("arcserve.engine.scheduler:Scheduler", "schedule", None),
    ("arcserve.engine.scheduler:Scheduler", "on_launched", lambda a: batch(a[1])),
    ("arcserve.engine.scheduler:Scheduler", "on_sampled", lambda a: batch(a[1])),
    ("arcserve.engine.runner:ModelRunner", "launch", lambda a: batch(a[1])),
    ("arcserve.engine.runner:ModelRunner", "_host_inputs", lambda a: batch(a[1])),
    ("arcserve.engine.runner:ModelRunner", "_logits", None),
    ("arcserve.engine.runner:StepHandle", "result", lambda a: batch(a[0].sched)),
    ("arcserve.engine.step_graphs:StepGraphs", "run", None),
    ("arcserve.engine.step_graphs:StepGraphs", "stage", None),
    ("arcserve.engine.sampler:Sampler", "__call__", None),
    ("arcserve.engine.engine:LLMEngine", "_finish", lambda a: batch(a[1].sched)),
    ("arcserve.engine.engine:LLMEngine", "step", None),
]


def instrument(log: dict) -> None:
    """Wrap each phase; calls without a batch size of their own take the last one seen."""
    import importlib

    state = {"n": 0}
    for path, name, size in PHASES:
        mod, cls = path.split(":")
        klass = getattr(importlib.import_module(mod), cls)
        orig = getattr(klass, name)

        def wrapped(*a, _orig=orig, _name=f"{cls}.{name}", _size=size, **k):
            t = time.perf_counter()
            out = _orig(*a, **k)
            dt = time.perf_counter() - t
            n = _size(a) if _size is not None else state["n"]
            if _name == "Scheduler.schedule":
                n = batch(out)
            state["n"] = n
            log[_name].append((n, dt))
            return out

        setattr(klass, name, wrapped)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=None, choices=sorted(SHAPES), help="a real shape (dummy weights); default: tiny")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--max-out", type=int, default=1024)
    p.add_argument("--device", default="auto")
    p.add_argument("--async-scheduling", choices=["on", "off"], default=None)
    a = p.parse_args()

    from arcserve import LLM, SamplingParams

    cfg = SHAPES[a.shape] if a.shape else TINY
    d = write_model_dir(Path(tempfile.mkdtemp()), cfg)
    kw = {"async_scheduling": a.async_scheduling == "on"} if a.async_scheduling else {}
    llm = LLM(model=str(d), load_format="dummy", dtype="bfloat16" if a.shape else "float32", device=a.device,
              max_model_len=4096, **kw)  # fmt: skip
    reqs, prompts = throughput_workload(a.num_requests, a.max_out, (3, min(cfg["vocab_size"], 150000)))
    params = [SamplingParams(max_tokens=o, temperature=0.6, ignore_eos=True) for _, o in reqs]
    llm.generate(prompts[:8], [SamplingParams(max_tokens=16, ignore_eos=True)] * 8, use_tqdm=False)  # warm-up

    log: dict[str, list] = collections.defaultdict(list)
    instrument(log)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - t
    eng = llm.llm_engine
    print(f"device {eng.device}, async scheduling {eng.async_scheduling}, {total:.2f} s, "
          f"{sum(o for _, o in reqs) / total:.1f} out tok/s (instrumented)")  # fmt: skip
    classes = [(200, 256), (129, 199), (65, 128), (33, 64), (1, 32)]
    names = [f"{p.split(':')[1]}.{n}" for p, n, _ in PHASES]
    print(f"{'phase (ms per call)':28s}" + "".join(f"{f'{lo}-{hi}':>10s}" for lo, hi in classes))
    for name in names:
        row = []
        for lo, hi in classes:
            v = [dt for n, dt in log[name] if lo <= n <= hi]
            row.append(f"{1e3 * sum(v) / len(v):10.3f}" if v else f"{'-':>10s}")
        print(f"{name:28s}" + "".join(row))
    # host work per step = step minus the wait for the device inside it
    row = []
    for lo, hi in classes:
        steps = [dt for n, dt in log["LLMEngine.step"] if lo <= n <= hi]
        waits = [dt for n, dt in log["StepHandle.result"] if lo <= n <= hi]
        row.append(f"{1e3 * (sum(steps) - sum(waits)) / max(len(steps), 1):10.3f}" if steps else f"{'-':>10s}")
    print(f"{'host per step (step - wait)':28s}" + "".join(row))


if __name__ == "__main__":
    main()
