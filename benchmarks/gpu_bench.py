"""GPU benchmarks of issue 4 (random weights of real shapes, bf16, ignore_eos; say so with results):

  throughput  Qwen3-0.6B shape, 256 requests, input/output lengths uniform in [100, 1024], random
              token ids, temperature 0.6 -> output tok/s (--repetition-penalty, --frequency-penalty,
              --presence-penalty: the same requests with penalties)
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
import cProfile
import gc
import json
import pstats
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_shapes import make_shape_dirs  # noqa: E402

from arcserve.config import KV_CACHE_DTYPES  # noqa: E402


def engine(a, model: Path, **kw):
    if a.engine == "vllm":
        from vllm import LLM, SamplingParams
    else:
        from arcserve import LLM, SamplingParams
    kw["enforce_eager"] = a.enforce_eager
    if a.async_scheduling is not None:
        kw["async_scheduling"] = a.async_scheduling == "on"
    if a.kv_cache_dtype != "auto":
        kw["kv_cache_dtype"] = a.kv_cache_dtype
    if a.block_size:
        kw["block_size"] = a.block_size
    if a.gpu_memory_utilization:
        kw["gpu_memory_utilization"] = a.gpu_memory_utilization
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


def throughput_workload(num: int = 256, max_out: int = 1024, ids: tuple[int, int] = (1000, 150000)):
    """The throughput benchmark's requests: [(input len, output len)] uniform in [100, 1024] (outputs
    up to max_out) and their prompts of random token ids in [ids[0], ids[1])."""
    rng = random.Random(0)
    reqs = [(rng.randint(100, 1024), rng.randint(100, max_out)) for _ in range(num)]
    prompts = [{"prompt_token_ids": [rng.randrange(*ids) for _ in range(i)]} for i, _ in reqs]
    return reqs, prompts


def bench_throughput(a, dirs) -> dict:
    reqs, prompts = throughput_workload()
    kw = {"max_num_batched_tokens": a.max_num_batched_tokens} if a.max_num_batched_tokens else {}
    llm, SP = engine(a, dirs["qwen3-0.6b"], max_model_len=4096, **kw)
    pen = dict(repetition_penalty=a.repetition_penalty, frequency_penalty=a.frequency_penalty,
               presence_penalty=a.presence_penalty)  # (the workload's own: none)
    params = [SP(max_tokens=o, temperature=0.6, ignore_eos=True, **pen) for _, o in reqs]
    llm.generate(prompts[:8], [SP(max_tokens=16, ignore_eos=True)] * 8, use_tqdm=False)  # warm-up
    steps = record_steps(a.profile_steps) if a.timeline else None
    prof = cProfile.Profile() if a.cprofile else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(o for _, o in reqs)
    r = {"bench": "throughput", "elapsed_s": round(dt, 2), "output_tok_s": round(out_tokens / dt, 1),
         "total_tok_s": round((out_tokens + sum(i for i, _ in reqs)) / dt, 1)}  # fmt: skip
    if steps is not None:
        cfg = json.loads((dirs["qwen3-0.6b"] / "config.json").read_text())
        kv_elem = 1 if a.kv_cache_dtype.startswith("fp8") else 2
        r["timeline"] = timeline_table(steps, t, cfg, copy_bandwidth(), a.timeline, kv_elem)
    return r


def record_steps(profile: str | None = None) -> StepLog:
    """Wrap StepHandle.result to log each step as its tokens are read: (wait start, wait end,
    sequences, batched tokens, decode sequences, context tokens read). In steady state the gap
    between successive ends is the step's device time when the host keeps up (wait > 0).
    profile="A:B" prints the device time per kernel of steps A to B (torch.profiler)."""
    import torch

    from arcserve.engine import runner
    from arcserve.platform import profiler_activity, resolve_device

    steps, orig = StepLog(), runner.StepHandle.result
    lo, hi = map(int, profile.split(":")) if profile else (-1, -1)
    acts = [torch.profiler.ProfilerActivity.CPU, profiler_activity(resolve_device("auto"))]
    prof = torch.profiler.profile(activities=acts)

    def result(self):
        if len(steps) == lo:
            prof.start()
        elif len(steps) == hi:
            prof.stop()
            print(f"steps {lo}-{hi}, batch {steps[lo][2]}-{steps[hi - 1][2]}, context tokens "
                  f"{steps[lo][5]}-{steps[hi - 1][5]}")  # fmt: skip
            print(prof.key_averages().table(sort_by="device_time_total", row_limit=30, max_name_column_width=70))
        t0 = time.perf_counter()
        out = orig(self)
        seqs = self.sched.seqs
        dec = sum(1 for s in seqs if s.num_new_tokens == 1)
        ctx = sum(s.start_pos + s.num_new_tokens for s in seqs)
        steps.append((t0, time.perf_counter(), len(seqs), self.sched.num_batched_tokens, dec, ctx))
        return out

    runner.StepHandle.result = result

    def gc_timer(phase, info, t=[0.0]):  # noqa: B006 (the start time, between the two phases)
        if phase == "start":
            t[0] = time.perf_counter()
        elif info["generation"] == 2:
            steps.gc.append((t[0], time.perf_counter()))

    gc.callbacks.append(gc_timer)
    return steps


class StepLog(list):
    """The steps, the full garbage collections (start, end) during them, and samples of the main
    thread's stack every 2 ms (time, innermost frames) to tell where the host spent a slow step."""

    def __init__(self) -> None:
        super().__init__()
        self.gc: list = []
        self.stacks: list = []
        main, self.running = threading.main_thread().ident, True

        def sample() -> None:
            while self.running:
                frame = sys._current_frames().get(main)
                where = []
                while frame is not None and len(where) < 16:
                    where.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}")
                    frame = frame.f_back
                self.stacks.append((time.perf_counter(), " < ".join(where)))
                time.sleep(0.002)

        threading.Thread(target=sample, daemon=True).start()

    def host_bound(self, start: float, min_ms: float = 15.0) -> None:
        """Where the host was during steps that took over min_ms without waiting for the device."""
        self.running = False
        spans, prev = [], start
        for t0, t1, *_ in self:
            if (t1 - prev) * 1e3 > min_ms and (t1 - t0) < 1e-3:
                spans.append((prev, t1))
            prev = t1
        counts: dict[str, int] = {}
        compiles: dict[str, int] = {}
        for t, where in self.stacks:
            frames = where.split(" < ")
            if any(a <= t <= b for a, b in spans):
                key = " < ".join(frames[:6])
                counts[key] = counts.get(key, 0) + 1
            if any(f.startswith("compiler.py") for f in frames):  # a Triton compile, from where
                key = " < ".join([f for f in frames if not f.startswith(("compiler.py", "jit.py"))][:4])
                compiles[key] = compiles.get(key, 0) + 1
        for where, n in compiles.items():
            print(f"Triton compiling during the run: ~{2 * n} ms at {where}")
        print(f"host-bound steps over {min_ms} ms: {len(spans)}, {sum(b - a for a, b in spans) * 1e3:.0f} ms; "
              f"stack samples (2 ms apart) there:")  # fmt: skip
        for where, n in sorted(counts.items(), key=lambda kv: -kv[1])[:12]:
            print(f"{n:5d}  {where}")


def timeline_table(steps: list, start: float, cfg: dict, bw: float, path: str, kv_elem: int = 2) -> list:
    """Group the steps (mixed, then decode by batch size) with their time and their floor: KV bytes
    read (every context token's K and V in every layer, kv_elem bytes each) plus the weights, over
    copy bandwidth."""
    kv_tok = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * kv_elem
    w = weight_bytes(cfg)
    Path(path).write_text(json.dumps({"start": start, "steps": steps, "gc": steps.gc}))
    steps.host_bound(start)
    import torch

    mem = getattr(torch, torch.accelerator.current_accelerator().type).memory_stats()  # the caching allocator's
    print("allocator: " + ", ".join(f"{k} {mem.get(k)}" for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")))
    if steps.gc:
        print(f"full garbage collections: {len(steps.gc)}, {sum(b - a for a, b in steps.gc) * 1e3:.1f} ms")
    groups: dict[str, list] = {}
    prev = start
    for t0, t1, n, tok, dec, ctx in steps:
        key = "mixed" if tok > n else f"decode <={1 << (n - 1).bit_length():4d}"
        g = groups.setdefault(key, [0, 0.0, 0.0, 0.0, 0])
        g[0] += 1
        g[1] += t1 - prev
        g[2] += t1 - t0
        g[3] += (ctx * kv_tok + w) / bw
        g[4] += dec
        prev = t1
    rows = []
    for key, (cnt, took, wait, floor, dec) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        rows.append({"steps": key, "count": cnt, "ms": round(took * 1e3, 1), "wait_ms": round(wait * 1e3, 1),
                     "floor_ms": round(floor * 1e3, 1), "tokens": dec})  # fmt: skip
        print(f"{key:>14} {cnt:5d} steps {took * 1e3:9.1f} ms (waited {wait * 1e3:8.1f}) floor {floor * 1e3:8.1f} ms"
              f" decode tokens {dec}")  # fmt: skip
    return rows


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
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="the KV cache's element type (both engines take vLLM's names)")
    p.add_argument("--block-size", type=int, default=None, help="KV-cache block size (default: the engine's)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="(default: the engine's)")
    p.add_argument("--models", default="/tmp/arcserve-shapes")
    p.add_argument("--out", default=None, help="append the JSON result lines to this file")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="throughput: the per-step token budget")
    p.add_argument("--profile-steps", default=None, help="throughput with --timeline: A:B profiles steps A to B")
    p.add_argument("--cprofile", action="store_true", help="throughput: host profile of the run (slows it)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="throughput: every request's (default none)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="throughput: every request's (default none)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="throughput: every request's (default none)")
    p.add_argument("--timeline", default=None, help="throughput: write each step's timing to this JSON file "
                   "and print the steps grouped by kind against their KV-read floor")
    a = p.parse_args()
    dirs = make_shape_dirs(a.models)
    parts = {"all": ["decode-qwen3-0.6b", "decode-llama-3.1-8b", "prefix", "throughput"],
             "decode": ["decode-qwen3-0.6b", "decode-llama-3.1-8b"]}.get(a.which)  # fmt: skip
    if parts:  # one process each, so no engine's memory stays behind for the next
        flags = [x for x in sys.argv[1:] if x != a.which]  # every option as given, to each part
        failed = [part for part in parts if subprocess.run([sys.executable, __file__, part, *flags]).returncode]
        if failed:  # the other parts still ran; their results stand
            sys.exit(f"failed: {', '.join(failed)}")
        return
    if a.which.startswith("decode-"):
        r = bench_decode(a, dirs, a.which.removeprefix("decode-"))
    else:
        r = {"prefix": bench_prefix, "throughput": bench_throughput}[a.which](a, dirs)
    r.update(engine=a.engine, enforce_eager=a.enforce_eager, async_scheduling=a.async_scheduling or "default",
             kv_cache_dtype=a.kv_cache_dtype, block_size=a.block_size or "default")
    if (a.repetition_penalty, a.frequency_penalty, a.presence_penalty) != (1.0, 0.0, 0.0):
        r.update(penalties=[a.repetition_penalty, a.frequency_penalty, a.presence_penalty])
    print("RESULT " + json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
