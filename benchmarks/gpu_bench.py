"""GPU benchmarks of issue 4 (random weights of real shapes, bf16, ignore_eos; say so with results):

  throughput  Qwen3-0.6B shape, 256 requests, input/output lengths uniform in [100, 1024], random
              token ids, temperature 0.6 -> output tok/s
  decode      batch-1 decode ms/token after warm-up (Qwen3-0.6B and Llama-3.1-8B shapes) beside the
              floor: weight bytes over the measured device copy bandwidth
  prefix      TTFT of a prompt whose 4,096-token prefix is cached, against the same prompt cold

    python benchmarks/gpu_bench.py [throughput|decode|decode-qwen3-0.6b|decode-llama-3.1-8b|prefix|all]
                                   [--enforce-eager]
                                   [--async-scheduling on|off] [--out FILE]

Model folders come from benchmarks/model_shapes.py (config.json + a small tokenizer), loaded with
load_format="dummy". The same script drives vLLM with --engine vllm (same LLM/SamplingParams API).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_shapes import make_shape_dirs  # noqa: E402


def engine(a, model: Path, **kw):
    if a.engine == "vllm":
        from vllm import LLM, SamplingParams
    else:
        from arcserve import LLM, SamplingParams
    kw["enforce_eager"] = a.enforce_eager
    if a.async_scheduling is not None:
        kw["async_scheduling"] = a.async_scheduling == "on"
    llm = LLM(model=str(model), load_format="dummy", dtype="bfloat16", seed=0, **kw)
    return llm, SamplingParams


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    import torch

    dev = torch.device(torch.accelerator.current_accelerator().type)
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    times = []
    for _ in range(23):
        torch.accelerator.synchronize()
        t = time.perf_counter()
        y.copy_(x)
        torch.accelerator.synchronize()
        times.append(time.perf_counter() - t)
    times = sorted(times[3:])
    return 2 * x.numel() / times[len(times) // 2]


def weight_bytes(cfg: dict) -> int:
    h, inter, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    # embedding rows are gathered, not read; the LM head is read once per step
    return 2 * (layers * per_layer + v * h)


def bench_throughput(a, dirs) -> dict:
    rng = random.Random(0)
    reqs = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(256)]
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 150000) for _ in range(i)]} for i, _ in reqs]
    llm, SP = engine(a, dirs["qwen3-0.6b"], max_model_len=4096)
    params = [SP(max_tokens=o, temperature=0.6, ignore_eos=True) for _, o in reqs]
    llm.generate(prompts[:8], [SP(max_tokens=16, ignore_eos=True)] * 8, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(o for _, o in reqs)
    return {"bench": "throughput", "elapsed_s": round(dt, 2), "output_tok_s": round(out_tokens / dt, 1),
            "total_tok_s": round((out_tokens + sum(i for i, _ in reqs)) / dt, 1)}  # fmt: skip


def bench_decode(a, dirs, name: str) -> dict:
    bw = copy_bandwidth()
    cfg = json.loads((dirs[name] / "config.json").read_text())
    llm, SP = engine(a, dirs[name], max_model_len=4096)
    prompt = {"prompt_token_ids": list(range(1000, 1032))}
    llm.generate(prompt, SP(max_tokens=64, ignore_eos=True), use_tqdm=False)  # warm-up
    took = []
    for n in (64, 320):  # the difference removes prefill and first-token costs
        t = time.perf_counter()
        llm.generate(prompt, SP(max_tokens=n, ignore_eos=True, temperature=0), use_tqdm=False)
        took.append(time.perf_counter() - t)
    ms = (took[1] - took[0]) / 256 * 1e3
    floor = weight_bytes(cfg) / bw * 1e3  # as the issue counts it: weight bytes over copy bandwidth (r+w)
    return {"bench": "decode", "model": name, "ms_per_token": round(ms, 3), "floor_ms": round(floor, 3),
            "copy_bw_TBps": round(bw / 1e12, 2)}  # fmt: skip


def bench_prefix(a, dirs) -> dict:
    rng = random.Random(1)
    llm, SP = engine(a, dirs["qwen3-0.6b"], max_model_len=8192, max_num_batched_tokens=8192)
    sp = SP(max_tokens=1, ignore_eos=True, temperature=0)

    def prompt(prefix):
        return {"prompt_token_ids": prefix + [rng.randrange(1000, 150000) for _ in range(32)]}

    def ttft(p, cached: int = 0) -> float:
        t = time.perf_counter()
        out = llm.generate(p, sp, use_tqdm=False)[0]
        dt = time.perf_counter() - t
        assert (out.num_cached_tokens or 0) >= cached, f"{out.num_cached_tokens} tokens from the cache, not {cached}"
        return dt

    for _ in range(3):  # warm-up, with prefixes never used again
        ttft(prompt([rng.randrange(1000, 150000) for _ in range(4096)]))
    cold, cached = [], []
    for _ in range(5):
        prefix = [rng.randrange(1000, 150000) for _ in range(4096)]
        cold.append(ttft(prompt(prefix)))  # nothing of it cached yet
        cached.append(ttft(prompt(prefix), cached=4096))  # the 4,096-token prefix is cached now
    cold.sort(), cached.sort()
    return {"bench": "prefix", "cold_ms": round(cold[2] * 1e3, 2), "cached_ms": round(cached[2] * 1e3, 2),
            "speedup": round(cold[2] / cached[2], 2)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", nargs="?", default="all",
                   choices=["all", "throughput", "decode", "decode-qwen3-0.6b", "decode-llama-3.1-8b", "prefix"])
    p.add_argument("--engine", default="arcserve", choices=["arcserve", "vllm"])
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--async-scheduling", choices=["on", "off"], default=None,
                   help="overlapped steps (default: the engine's own default, on for GPUs)")
    p.add_argument("--models", default="/tmp/arcserve-shapes")
    p.add_argument("--out", default=None, help="append the JSON result lines to this file")
    a = p.parse_args()
    dirs = make_shape_dirs(a.models)
    parts = {"all": ["decode-qwen3-0.6b", "decode-llama-3.1-8b", "prefix", "throughput"],
             "decode": ["decode-qwen3-0.6b", "decode-llama-3.1-8b"]}.get(a.which)  # fmt: skip
    if parts:  # one process each, so no engine's memory stays behind for the next
        flags = ["--engine", a.engine, "--models", a.models] + ["--enforce-eager"] * a.enforce_eager
        flags += ["--async-scheduling", a.async_scheduling] if a.async_scheduling else []
        flags += ["--out", a.out] if a.out else []
        failed = [part for part in parts if subprocess.run([sys.executable, __file__, part, *flags]).returncode]
        if failed:  # the other parts still ran; their results stand
            sys.exit(f"failed: {', '.join(failed)}")
        return
    if a.which.startswith("decode-"):
        r = bench_decode(a, dirs, a.which.removeprefix("decode-"))
    else:
        r = {"prefix": bench_prefix, "throughput": bench_throughput}[a.which](a, dirs)
    r.update(engine=a.engine, enforce_eager=a.enforce_eager, async_scheduling=a.async_scheduling or "default")
    print("RESULT " + json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
