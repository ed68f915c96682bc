"""Speculative decoding at batch 1 on the GPU: tokens/s with and without speculation (issue 5).

    PYTHONPATH=. python benchmarks/spec_bench.py ngram --smollm2 DIR    # SmolLM2 folder (real weights)
    PYTHONPATH=. python benchmarks/spec_bench.py ngram --smollm2 DIR --no-miss --k 5 8 10 16
    PYTHONPATH=. python benchmarks/spec_bench.py ngram --smollm2 DIR --load-format dummy --k 10 --phases --graphs
    PYTHONPATH=. python benchmarks/spec_bench.py draft --tail-scale 1 8 16

ngram       SmolLM2-135M-Instruct (real weights) on a copy-heavy prompt (a code file, then "a copy of"
            it), greedy, prompt lookup k=5 (n-grams 2..4; --k: other draft lengths).
ngram-miss  Qwen3-0.6B shape with random weights and an untied LM head (its text follows no lookup);
            the prompt repeats a few tokens, so lookups find n-grams that the model never continues.
draft       Qwen3-4B shape target (36 layers, untied LM head), random weights; the draft is the
            target's first 2 layers (dummy weights are seeded per tensor name, so a 2-layer config of the
            same shape is exactly the target truncated: ~0.9B parameters with embeddings and head).
            Random weights barely move the residual stream, so the truncation agrees with the target
            almost always; the target's layers past the second get their output projections (o_proj,
            down_proj) multiplied by --tail-scale, which makes them matter and sets how often the draft
            agrees. The target's speed does not depend on the values of its weights: this measures
            real-shape costs at the acceptance rates reported.
draft-miss  the same target with a Qwen3-0.6B-shaped random draft: nothing accepted.

Every row: 256 generated tokens after a warm-up, median of 3 runs, tokens/s = 256 / time (prefill of
the short prompt included). --profile prints the kernel time table of the speculating SmolLM2 run;
--phases the host time per step phase and the device time per step kind (no profiler); --graphs the
back-to-back replay time and kernels of the decode-1, mixed-8 and mixed-16 graphs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))  # conftest, which test_speculative imports
sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "engine"))
from cpu_step_timeline import add_timer  # noqa: E402
from model_shapes import SHAPES, write_tokenizer  # noqa: E402
from test_speculative import COPY_PROMPT as COPY  # noqa: E402  (the copy-heavy prompt the CPU test uses)

from arcserve import LLM, SamplingParams  # noqa: E402
from arcserve.platform import profiler_activity, synchronize, timing_event  # noqa: E402

N = 256
QWEN3_4B = dict(SHAPES["qwen3-0.6b"], hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)  # fmt: skip
UNTIED_06B = dict(SHAPES["qwen3-0.6b"], tie_word_embeddings=False)



def shape_dir(root: Path, name: str, cfg: dict) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    if not (d / "tokenizer.json").exists():
        write_tokenizer(d)
    return d


def run(llm: LLM, prompt, label: str, profile: bool = False) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    llm.generate(prompt, sp, use_tqdm=False)  # warm-up (compiles, graph pools)
    if profile:
        import torch
        from torch.profiler import ProfilerActivity

        acts = [ProfilerActivity.CPU, profiler_activity(llm.llm_engine.device)]
        with torch.profiler.profile(activities=acts) as prof:
            llm.generate(prompt, sp, use_tqdm=False)
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=18), flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
    m0 = llm.get_metrics()
    took = []
    for _ in range(3):
        t = time.perf_counter()
        out = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
        took.append(time.perf_counter() - t)
        assert len(out.token_ids) == N
    m1 = llm.get_metrics()
    drafts = m1["arcserve:spec_decode_num_drafts_total"] - m0["arcserve:spec_decode_num_drafts_total"]
    acc = m1["arcserve:spec_decode_num_accepted_tokens_total"] - m0["arcserve:spec_decode_num_accepted_tokens_total"]
    dt = m1["arcserve:spec_decode_num_draft_tokens_total"] - m0["arcserve:spec_decode_num_draft_tokens_total"]
    row = {"case": label, "tok_per_s": round(N / statistics.median(took), 1),
           "mean_acceptance_length": round(1 + acc / drafts, 2) if drafts else None,
           "accepted_of_drafted": f"{acc}/{dt}", "verifications": drafts, "tokens": out.token_ids[:12]}  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def phases(llm: LLM, prompt, label: str) -> None:
    """Host time per phase of a step (wall clock, summed over one 256-token run) and device time
    per step kind (events around the forward and around logits + sampling), without a profiler
    (whose tracing slows graph launches)."""
    import collections

    from arcserve.engine import runner as runner_mod

    eng = llm.llm_engine
    host = collections.Counter()
    calls = collections.Counter()
    pairs = []

    def timed(obj, name, key):
        return add_timer(host, obj, name, key, calls)

    originals = [(eng, "_finish", timed(eng, "_finish", "finish (read + outputs)")),
                 (eng, "_propose", timed(eng, "_propose", "propose")),
                 (eng.scheduler, "schedule", timed(eng.scheduler, "schedule", "schedule")),
                 (eng.runner, "launch", timed(eng.runner, "launch", "launch (all)")),
                 (eng.runner, "_host_inputs", timed(eng.runner, "_host_inputs", "launch: host inputs")),
                 (eng.runner, "sample", timed(eng.runner, "sample", "launch: sample (host)")),
                 (runner_mod, "wait_event", timed(runner_mod, "wait_event", "finish: wait for device"))]
    g = eng.runner.graphs
    run0 = g.run

    def run(key, h, last):
        a, b = timing_event(eng.device), timing_event(eng.device)
        a.record()
        t = time.perf_counter()
        out = run0(key, h, last)
        host["launch: graph fill + replay"] += time.perf_counter() - t
        calls["launch: graph fill + replay"] += 1
        b.record()
        pairs.append((f"{key[0]}-{key[1]}", a, b))
        return out

    g.run = run
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompt, sp, use_tqdm=False)
    wall = time.perf_counter() - t
    synchronize(eng.device)
    g.run = run0
    for obj, name, f in originals:
        setattr(obj, name, f)
    dev = collections.defaultdict(list)
    for k, a, b in pairs:
        dev[k].append(a.elapsed_time(b) * 1000)
    print(f"== phases: {label}: {wall * 1e3:.1f} ms for {N} tokens, {calls['launch (all)']} steps", flush=True)
    for k in sorted(host, key=lambda k: -host[k]):
        print(f"  host {k:34s} {host[k] * 1e3:8.2f} ms  {calls[k]:4d} calls  {host[k] / calls[k] * 1e6:7.1f} us/call")
    for k, v in sorted(dev.items()):
        print(f"  device forward {k:12s} {len(v):4d} steps  median {statistics.median(v):7.1f} us")


def graph_kernels(llm: LLM, keys) -> None:
    """Device time of each captured graph replayed back to back (its inputs as the last step left
    them), and its kernels by device time."""
    import torch

    dev = llm.llm_engine.device
    g = llm.llm_engine.runner.graphs
    for key in keys:
        if key not in g.graphs:
            continue
        graph = g.graphs[key][0]
        for _ in range(5):
            graph.replay()
        synchronize(dev)
        a, b = timing_event(dev), timing_event(dev)
        a.record()
        for _ in range(50):
            graph.replay()
        b.record()
        synchronize(dev)
        print(f"== graph {key}: {a.elapsed_time(b) / 50 * 1000:.1f} us per replay (50 back to back)", flush=True)
        with torch.profiler.profile(activities=[profiler_activity(dev)]) as prof:
            for _ in range(10):
                graph.replay()
            synchronize(dev)
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14), flush=True)


def scale_tail(llm: LLM, keep: int, s: float) -> None:
    for lw in llm.llm_engine.model.layers[keep:]:
        lw.o.mul_(s)
        lw.down.mul_(s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("which", choices=["ngram", "draft", "all"])
    ap.add_argument("--smollm2", help="SmolLM2-135M-Instruct folder (arcserve.models.demo.demo_model_dir())")
    ap.add_argument("--root", default="/tmp/arcserve-spec")
    ap.add_argument("--tail-scale", type=float, nargs="+", default=[1.0])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--phases", action="store_true", help="host time per step phase, device time per step kind")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights in the --smollm2 folder's shape")
    ap.add_argument("--no-miss", action="store_true", help="ngram: skip the random-weight ngram-miss rows")
    ap.add_argument("--graphs", action="store_true", help="device time and kernels of the captured graphs used")
    ap.add_argument("--gemv-rows", type=int, help="experiment: rows up to which linear() takes the gemv kernel")
    ap.add_argument("--k", type=int, nargs="+", default=[5], help="n-gram draft lengths to run")
    a = ap.parse_args()
    root = Path(a.root)
    if a.gemv_rows:
        from arcserve.kernels import triton_linear

        triton_linear.MAX_ROWS = a.gemv_rows
    kw = dict(max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=2048, num_kv_blocks=1024)
    ngram = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if a.which in ("ngram", "all"):
        if a.smollm2:
            for spec in [None] + [dict(ngram, num_speculative_tokens=k) for k in a.k]:
                llm = LLM(a.smollm2, dtype="bfloat16", speculative_config=spec, load_format=a.load_format, **kw)
                k = spec["num_speculative_tokens"] if spec else 0
                label = f"ngram smollm2 spec k={k}" if spec else "ngram smollm2 no spec"
                run(llm, COPY, label, a.profile and spec is not None)
                if a.phases:
                    phases(llm, COPY, label)
                if a.graphs:
                    graph_kernels(llm, [("decode", 1), ("mixed", 8), ("mixed", 16)] if k == a.k[-1] else [])
                del llm
        q06 = shape_dir(root, "qwen3-0.6b-untied", UNTIED_06B)
        prompt = {"prompt_token_ids": list(range(1000, 1016)) * 4}
        for spec in (None, ngram) if not a.no_miss else ():
            llm = LLM(str(q06), load_format="dummy", dtype="bfloat16", speculative_config=spec, **kw)
            run(llm, prompt, f"ngram-miss qwen3-0.6b {'spec' if spec else 'no spec'}")
            del llm
    if a.which in ("draft", "all"):
        target = shape_dir(root, "qwen3-4b", QWEN3_4B)
        trunc = shape_dir(root, "qwen3-4b-first2", dict(QWEN3_4B, num_hidden_layers=2))
        q06 = shape_dir(root, "qwen3-0.6b", SHAPES["qwen3-0.6b"])
        prompt = {"prompt_token_ids": list(range(1000, 1032))}
        base = LLM(str(target), load_format="dummy", dtype="bfloat16", **kw)
        spec = LLM(str(target), load_format="dummy", dtype="bfloat16",
                   speculative_config={"model": str(trunc), "num_speculative_tokens": 4}, **kw)  # fmt: skip
        run(base, prompt, "draft-target qwen3-4b no spec")
        done = 1.0
        for s in a.tail_scale:
            scale_tail(base, 2, s / done)
            scale_tail(spec, 2, s / done)
            done = s
            if s != 1.0:
                run(base, prompt, f"draft-target qwen3-4b no spec, tail scale {s}")
            run(spec, prompt, f"draft qwen3-4b + first-2-layers draft k=4, tail scale {s}")
        del spec
        miss = LLM(str(target), load_format="dummy", dtype="bfloat16",
                   speculative_config={"model": str(q06), "num_speculative_tokens": 4}, **kw)  # fmt: skip
        run(miss, prompt, "draft-miss qwen3-4b + qwen3-0.6b random draft k=4")


if __name__ == "__main__":
    main()
