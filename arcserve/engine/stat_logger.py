"""vLLM's periodic stats line, from the engine's figures (LLMEngine.get_metrics()).

Every `interval` seconds (vLLM's 10 s; ARCSERVE_LOG_STATS_INTERVAL) while the engine works:

    Engine 000: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s,
    Running: 12 reqs, Waiting: 0 reqs, CPU KV cache usage: 7.3%, Prefix cache hit rate: 41.0%

with "Preemptions: N" when some happened in the interval, and a speculative-decoding line when
drafts were verified. Prompt throughput counts the prompt tokens computed in the interval (those of
prompts that finished, less what the prefix cache served); the hit rate is over the interval's
lookups. Logged at INFO while there is traffic (or just was), DEBUG when idle, as vLLM does. The
server logs it unless --disable-log-stats; the offline LLM only with disable_log_stats=False.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger("arcserve")

LOG_INTERVAL_ENV = "ARCSERVE_LOG_STATS_INTERVAL"  # seconds between lines (vLLM's VLLM_LOG_STATS_INTERVAL)


def log_interval() -> float:
    raw = os.environ.get(LOG_INTERVAL_ENV, "10")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{LOG_INTERVAL_ENV} must be a number of seconds > 0, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{LOG_INTERVAL_ENV} must be a number of seconds > 0, got {raw!r}")
    return value

_COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
             "prefix_cache_hits_total", "num_preemptions_total", "spec_decode_num_drafts_total",
             "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total")  # fmt: skip


def device_label(device) -> str:
    """Where the KV cache lives, as the line names it: "CPU", or "GPU" for any accelerator."""
    return "CPU" if device.type == "cpu" else "GPU"


class StatLogger:
    def __init__(self, get_metrics: Callable[[], dict], device_label: str, interval: float | None = None) -> None:
        """device_label: the KV cache's place in the line (device_label()); interval: seconds between
        lines (default: ARCSERVE_LOG_STATS_INTERVAL, else 10)."""
        self.get_metrics, self.label = get_metrics, device_label
        self.interval = log_interval() if interval is None else interval
        self.last_time = time.monotonic()
        self.last = self._counters(get_metrics())
        self.was_busy = False

    @staticmethod
    def _counters(m: dict) -> dict[str, float]:
        return {k: m.get(f"arcserve:{k}", 0) for k in _COUNTERS}

    def maybe_log(self) -> None:
        """log() when an interval has passed since the last line (cheap to call every step)."""
        if time.monotonic() - self.last_time >= self.interval:
            self.log()

    def log(self) -> str:
        """Log the line for the interval since the last call; returns it."""
        now = time.monotonic()
        m = self.get_metrics()
        cur = self._counters(m)
        d = {k: cur[k] - self.last[k] for k in _COUNTERS}
        dt = max(now - self.last_time, 1e-9)
        self.last, self.last_time = cur, now
        computed = max(0, d["prompt_tokens_total"] - d["prefix_cache_hits_total"])
        prompt_tps, gen_tps = computed / dt, d["generation_tokens_total"] / dt
        busy = bool(prompt_tps or gen_tps)
        level = logging.INFO if busy or self.was_busy else logging.DEBUG  # quiet on an idle server
        self.was_busy = busy
        parts = [f"Avg prompt throughput: {prompt_tps:.1f} tokens/s",
                 f"Avg generation throughput: {gen_tps:.1f} tokens/s",
                 f"Running: {m.get('arcserve:num_requests_running', 0)} reqs",
                 f"Waiting: {m.get('arcserve:num_requests_waiting', 0)} reqs"]  # fmt: skip
        if d["num_preemptions_total"]:
            parts.append(f"Preemptions: {int(d['num_preemptions_total'])}")
        parts.append(f"{self.label} KV cache usage: {100 * m.get('arcserve:kv_cache_usage_perc', 0.0):.1f}%")
        if d["prefix_cache_queries_total"]:
            parts.append(f"Prefix cache hit rate: {100 * d['prefix_cache_hits_total'] / d['prefix_cache_queries_total']:.1f}%")
        line = "Engine 000: " + ", ".join(parts)
        log.log(level, "%s", line)
        if d["spec_decode_num_drafts_total"]:
            drafted, accepted = d["spec_decode_num_draft_tokens_total"], d["spec_decode_num_accepted_tokens_total"]
            spec = (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / d['spec_decode_num_drafts_total']:.2f}, "
                    f"Accepted throughput: {accepted / dt:.2f} tokens/s, Drafted throughput: {drafted / dt:.2f} tokens/s, "
                    f"Accepted: {int(accepted)} tokens, Drafted: {int(drafted)} tokens, "
                    f"Avg Draft acceptance rate: {100 * accepted / max(drafted, 1):.1f}%")  # fmt: skip
            log.log(level, "%s", spec)
            line += "\n" + spec
        return line
