"""`arcserve bench serve`: a seeded random workload against any OpenAI-compatible /v1/completions
endpoint (arcserve, vLLM, ...), Poisson arrivals or all at once, bounded concurrency; prints request
and token throughput, TTFT, TPOT and ITL (mean / median / p99) as vLLM's `bench serve` does.

Prompts are random token ids (exact input lengths); ignore_eos makes output lengths exact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np

from arcserve.argtypes import ranged


@dataclass
class Result:
    ok: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def add_args(p: argparse.ArgumentParser) -> None:
    """vLLM's `bench serve` flags for its random dataset (its names for the lengths as aliases)."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="bearer key (default: OPENAI_API_KEY, if set)")
    p.add_argument("--backend", default="openai", choices=["openai", "vllm"],
                   help="both: the /v1/completions endpoint, streamed")  # fmt: skip
    p.add_argument("--dataset-name", default="random", choices=["random"], help="random token ids (the only one)")
    p.add_argument("--num-prompts", type=ranged(int, 1), default=100)
    p.add_argument("--input-len", "--random-input-len", type=ranged(int, 1), default=256)
    p.add_argument("--output-len", "--random-output-len", type=ranged(int, 1), default=64)
    p.add_argument("--range-ratio", "--random-range-ratio", type=ranged(float, 0.0), default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")  # fmt: skip
    p.add_argument("--request-rate", type=ranged(float, 0.0), default=float("inf"),
                   help="Poisson rate (req/s); inf = all at once")  # fmt: skip
    p.add_argument("--max-concurrency", type=ranged(int, 1), default=None)
    p.add_argument("--vocab-size", type=ranged(int, 30), default=None,
                   help="token ids are drawn from [10, vocab_size - 10) (default 32000)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=ranged(float, 0.0), default=0.0)
    p.add_argument("--save-result", nargs="?", const=True, default=None,
                   help="write the figures as JSON: to the file given, else --result-filename in --result-dir")  # fmt: skip
    p.add_argument("--result-filename", default=None, help="with a bare --save-result (vLLM's)")
    p.add_argument("--result-dir", default=".", help="with a bare --save-result (vLLM's)")
    p.add_argument("--timeout", type=ranged(float, 0.0), default=600.0, help="per request, seconds")


def workload(a: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(a.seed)

    def length(n: int) -> int:
        lo, hi = max(1, int(n * (1 - a.range_ratio))), max(1, int(n * (1 + a.range_ratio)))
        return rng.randint(lo, hi)

    return [([rng.randrange(10, vocab - 10) for _ in range(length(a.input_len))], length(a.output_len))
            for _ in range(a.num_prompts)]  # fmt: skip


async def one(client, url: str, headers: dict, model: str, prompt: list[int], out_len: int, a) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": a.temperature,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    r = Result(prompt_len=len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=a.timeout) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    r.error = str(data["error"])
                    return r
                if data.get("usage"):
                    r.output_len = data["usage"]["completion_tokens"]
                # Any chunk with choices is a step's output (as vLLM's client counts): its text may
                # be empty (held back; or ids a small tokenizer of a dummy model cannot spell).
                if data.get("choices"):
                    now = time.perf_counter()
                    if r.ttft == 0.0:
                        r.ttft = now - start
                    else:
                        r.itl.append(now - last)
                    last = now
        r.latency = time.perf_counter() - start
        r.ok = r.ttft > 0
        if not r.ok:
            r.error = "the stream ended without any output"
    except Exception as e:  # a failed request is reported, not fatal
        r.error = f"{type(e).__name__}: {e}"
    return r


async def run(a: argparse.Namespace) -> dict:
    import httpx

    key = a.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=a.max_concurrency or 1000)
    async with httpx.AsyncClient(base_url=a.base_url, limits=limits) as client:
        model = a.model
        if model is None:
            model = (await client.get("/v1/models", headers=headers)).json()["data"][0]["id"]
        reqs = workload(a, a.vocab_size or 32000)
        sem = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None
        rng = np.random.default_rng(a.seed)

        async def limited(p, n):
            if sem is None:
                return await one(client, "/v1/completions", headers, model, p, n, a)
            async with sem:
                return await one(client, "/v1/completions", headers, model, p, n, a)

        tasks = []
        t0 = time.perf_counter()
        for p, n in reqs:
            tasks.append(asyncio.ensure_future(limited(p, n)))
            if a.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / a.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return summarize(results, duration, a)


def summarize(results: list[Result], duration: float, a) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda xs, q: float(np.percentile(xs, q) * 1000) if len(xs) else float("nan")  # noqa: E731
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itl = [x for r in ok for x in r.itl]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    return {
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "request_rate": a.request_rate, "max_concurrency": a.max_concurrency,
        "mean_ttft_ms": float(np.mean(ttft) * 1000) if ttft else float("nan"),
        "median_ttft_ms": ms(ttft, 50), "p99_ttft_ms": ms(ttft, 99),
        "mean_tpot_ms": float(np.mean(tpot) * 1000) if tpot else float("nan"),
        "median_tpot_ms": ms(tpot, 50), "p99_tpot_ms": ms(tpot, 99),
        "mean_itl_ms": float(np.mean(itl) * 1000) if itl else float("nan"),
        "median_itl_ms": ms(itl, 50), "p99_itl_ms": ms(itl, 99),
    }  # fmt: skip


def report(s: dict) -> str:
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    row = lambda k, v: lines.append(f"{k:<40}{v!s:<10}")  # noqa: E731
    row("Successful requests:", s["successful_requests"])
    row("Failed requests:", s["failed_requests"])
    row("Request rate (req/s):", s["request_rate"])
    row("Max concurrency:", s["max_concurrency"])
    row("Benchmark duration (s):", f"{s['duration_s']:.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")
    for title, key in [("Time to First Token", "ttft"), ("Time per Output Token (excl. 1st token)", "tpot"),
                       ("Inter-token Latency", "itl")]:  # fmt: skip
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        row(f"Mean {key.upper()} (ms):", f"{s[f'mean_{key}_ms']:.2f}")
        row(f"Median {key.upper()} (ms):", f"{s[f'median_{key}_ms']:.2f}")
        row(f"P99 {key.upper()} (ms):", f"{s[f'p99_{key}_ms']:.2f}")
    lines.append("=" * 50)
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)


def main(a: argparse.Namespace) -> int:
    import httpx

    try:
        s = asyncio.run(run(a))
    except httpx.TransportError as e:  # (the model lookup: no server there)
        raise ValueError(f"cannot reach the server at {a.base_url}: {type(e).__name__}: {e}") from None
    print(report(s))
    if a.save_result:
        path = a.save_result
        if path is True:
            name = a.result_filename or f"arcserve-bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
            path = os.path.join(a.result_dir, name)
        with open(path, "w") as f:
            json.dump(s, f, indent=2)
    return 0 if s["failed_requests"] == 0 else 1
