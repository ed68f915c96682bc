"""Offline throughput and single-request decode speed, arcserve vs vLLM, side by side.

Workload (fixed seed): N requests with input and output lengths uniform in [lo, hi], random token ids,
ignore_eos, temperature 0.6; plus one request decoding 128 tokens after a 32-token prompt (median of
three runs).

    python benchmarks/offline_throughput.py --model DIR                 # arcserve only
    python benchmarks/offline_throughput.py --model DIR --vllm-python /path/to/venv/bin/python
    python benchmarks/offline_throughput.py --model DIR --vllm-python PY --single-only --rounds 3

Each engine runs in its own subprocess (one after the other, never at the same time); this file
imports neither engine at the top so the vLLM venv can run it too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time


def workload(seed: int, n: int, lo: int, hi: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen, olen = rng.randint(lo, hi), rng.randint(lo, hi)
        reqs.append(([rng.randrange(100, vocab - 100) for _ in range(plen)], olen))
    return reqs


def run_engine(a: argparse.Namespace) -> dict:
    if a.engine == "vllm":
        from vllm import LLM, SamplingParams

        kw = dict(enforce_eager=a.vllm_eager)
    else:
        import torch

        from arcserve import LLM, SamplingParams
        from arcserve.kernels import cpu_attention, reference

        kw = dict(max_num_batched_tokens=a.max_num_batched_tokens) if a.max_num_batched_tokens else {}
        if a.emulate_half:  # the AVX2-only CPU's paths on any CPU (compiled one-token steps, float32 copies)
            reference.native_half_matmul = lambda dtype: False
        if a.float32_mirror:  # only the decode mirror in float32, the products as this CPU chooses
            cpu_attention.mirror_dtype = lambda dtype: torch.float32
    if a.load_format != "auto":
        kw["load_format"] = a.load_format
    t0 = time.perf_counter()
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, seed=0, **kw)
    startup = time.perf_counter() - t0
    vocab = llm.get_tokenizer().vocab_size
    reqs = workload(a.seed, a.num_requests, a.min_len, a.max_len, vocab)

    def params(olen: int) -> SamplingParams:
        return SamplingParams(temperature=0.6, max_tokens=olen, ignore_eos=True)

    # Warm-up (both engines): a few requests of the same kind.
    llm.generate([{"prompt_token_ids": p} for p, _ in reqs[:4]], [params(16)] * 4, use_tqdm=False)

    result = {"engine": a.engine, "startup_s": round(startup, 1)}
    if not a.single_only:
        prompts = [{"prompt_token_ids": p} for p, _ in reqs]
        t = time.perf_counter()
        outs = llm.generate(prompts, [params(o) for _, o in reqs], use_tqdm=False)
        elapsed = time.perf_counter() - t
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert out_tokens == sum(o for _, o in reqs), "every request must produce exactly max_tokens"
        in_tokens = sum(len(p) for p, _ in reqs)
        result.update(
            requests=len(reqs), input_tokens=in_tokens, output_tokens=out_tokens, elapsed_s=round(elapsed, 2),
            output_tok_s=round(out_tokens / elapsed, 1), total_tok_s=round((in_tokens + out_tokens) / elapsed, 1),
        )  # fmt: skip

    rng = random.Random(a.seed + 1)
    single = {"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(32)]}
    llm.generate(single, params(16), use_tqdm=False)
    took = []
    for _ in range(3):  # the median of three: a shared VM's speed drifts by 10-40% within minutes
        t = time.perf_counter()
        o = llm.generate(single, params(128), use_tqdm=False)[0]
        took.append(time.perf_counter() - t)
        assert len(o.outputs[0].token_ids) == 128
    single_s = sorted(took)[1]
    result.update(single_tok_s=round(128 / single_s, 1), single_ms_per_tok=round(single_s / 128 * 1000, 2))
    return result


def workload_args(p: argparse.ArgumentParser) -> None:
    """The model and workload flags (also benchmarks/cpu_step_timeline.py's)."""
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(p)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="arcserve only")
    p.add_argument("--load-format", default="auto", help="dummy: random weights from config.json (both engines)")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vLLM: run it too")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager=True")
    p.add_argument("--single-only", action="store_true", help="only the single-request decode")
    p.add_argument("--emulate-half", action="store_true",
                   help="arcserve on a CPU with native half products: take the paths of CPUs without (AVX2-only)")
    p.add_argument("--float32-mirror", action="store_true",
                   help="arcserve: keep the CPU decode mirror in float32 whatever this CPU multiplies natively")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the engines this many times, alternating (arcserve, vLLM, arcserve, ...): "
                        "on a VM whose speed drifts, compare the medians")  # fmt: skip
    p.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.engine:  # child process
        print("RESULT " + json.dumps(run_engine(a)), flush=True)
        return
    results = []
    runs = [("arcserve", sys.executable)] + ([("vllm", a.vllm_python)] if a.vllm_python else [])
    for engine, python in runs * a.rounds:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        cmd = [python, os.path.abspath(__file__), *sys.argv[1:], "--engine", engine]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if r.returncode != 0 or line is None:
            print(f"{engine} failed (rc {r.returncode}):\n{r.stderr[-3000:]}", file=sys.stderr)
            sys.exit(1)
        results.append(json.loads(line[7:]))
    keys = ["engine", "startup_s", "elapsed_s", "output_tok_s", "total_tok_s", "single_tok_s", "single_ms_per_tok"]
    keys = [k for k in keys if k in results[0]]
    print(" | ".join(f"{k:>17}" for k in keys))
    for res in results:
        print(" | ".join(f"{res[k]!s:>17}" for k in keys))
    if a.vllm_python:
        def median(engine: str, key: str) -> float:
            return statistics.median(r[key] for r in results if r["engine"] == engine)

        ratios = [(k, name) for k, name in (("output_tok_s", "throughput"), ("single_tok_s", "single decode")) if k in keys]
        print("arcserve/vllm" + (f" (medians of {a.rounds} rounds)" if a.rounds > 1 else "") + ": " + ", ".join(
            f"{name} {median('arcserve', k) / median('vllm', k):.2f}x" for k, name in ratios))  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
