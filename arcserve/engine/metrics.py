"""Engine figures in one place: counters, gauges and histograms that LLMEngine updates as it works.

The Prometheus endpoint (api/metrics.py) and LLM.get_metrics() both read from here, so the two
always agree. Updated by the engine thread; read by others under the lock.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from dataclasses import dataclass, field

from arcserve.engine.speculative import SpecFigures


def one_two_five(limit: int) -> list[float]:
    out, m = [], 1
    while True:
        for f in (1, 2, 5):
            if f * m > limit:
                return [float(x) for x in out]
            out.append(f * m)
        m *= 10


TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
LATENCY_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
STEP_TOKEN_BUCKETS = [float(1 << i) for i in range(13)]  # 1, 2, 4, ... 4096


@dataclass
class Histogram:
    buckets: list[float]
    counts: list[int] = field(default_factory=list)  # per bucket (not cumulative), + the +Inf bucket
    count: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)
        self.labels = [*map(str, self.buckets), "+Inf"]

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.count += 1
        self.sum += v

    def observe_many(self, vs: list[float]) -> None:
        # A plain loop: a numpy pass costs ~12 us however few the values (1-8 per step at small
        # batches) and breaks even only near 256.
        counts, buckets = self.counts, self.buckets
        for v in vs:
            counts[bisect.bisect_left(buckets, v)] += 1
        self.count += len(vs)
        self.sum += sum(vs)

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for le, c in zip(self.labels, self.counts):
            total += c
            out.append((le, total))
        return out


class EngineMetrics:
    def __init__(self, max_model_len: int) -> None:
        self.lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = defaultdict(int)  # finished_reason -> count
        self.spec = SpecFigures()
        tokens = one_two_five(max_model_len)
        self.hist = {
            "time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "inter_token_latency_seconds": Histogram(ITL_BUCKETS),
            "e2e_request_latency_seconds": Histogram(LATENCY_BUCKETS),
            "request_queue_time_seconds": Histogram(LATENCY_BUCKETS),
            "request_prompt_tokens": Histogram(tokens),
            "request_generation_tokens": Histogram(tokens),
            "step_generated_tokens": Histogram(STEP_TOKEN_BUCKETS),
        }

    def on_tokens(self, ttfts: list[float], prompt_tokens: int, itls: list[float]) -> None:
        """One step's generated tokens: the times to first token of sequences that got their first
        (whose prompts, `prompt_tokens` in all, are then done) and the other tokens' inter-token
        latencies. One lock per step, not per token. A step that generated tokens also counts in
        step_generated_tokens: how wide decoding was batched (its count is the number of such steps)."""
        new = len(ttfts) + len(itls)
        with self.lock:
            self.generation_tokens += new
            if new:
                self.hist["step_generated_tokens"].observe(new)
            self.prompt_tokens += prompt_tokens
            self.hist["time_to_first_token_seconds"].observe_many(ttfts)
            self.hist["inter_token_latency_seconds"].observe_many(itls)

    def on_spec(self, counts: list[tuple[int, int]]) -> None:
        """One step's verifications: (drafts, accepted drafts) per speculating request."""
        with self.lock:
            for proposed, accepted in counts:
                self.spec.record(proposed, accepted)

    def on_finish(self, reason: str, num_prompt: int, num_generated: int, e2e: float, queue: float | None) -> None:
        with self.lock:
            self.success[reason] += 1
            self.hist["e2e_request_latency_seconds"].observe(e2e)
            if queue is not None:
                self.hist["request_queue_time_seconds"].observe(queue)
            self.hist["request_prompt_tokens"].observe(num_prompt)
            self.hist["request_generation_tokens"].observe(num_generated)
