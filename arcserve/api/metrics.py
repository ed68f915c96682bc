"""Prometheus exposition of the engine's figures (read from LLMEngine.get_metrics())."""

from __future__ import annotations

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

_GAUGES = {
    "arcserve:num_requests_running": "Requests running (scheduled on the model).",
    "arcserve:num_requests_waiting": "Requests waiting to be scheduled.",
    "arcserve:kv_cache_usage_perc": "Fraction of KV cache blocks held by requests (0-1).",
}
_COUNTERS = {
    "arcserve:prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache.",
    "arcserve:prefix_cache_hits_total": "Prompt tokens served by the prefix cache.",
    "arcserve:prompt_tokens_total": "Prompt tokens prefilled.",
    "arcserve:generation_tokens_total": "Tokens generated.",
    "arcserve:num_preemptions_total": "Preemptions (requests recomputed after their blocks were taken).",
    "arcserve:spec_decode_num_drafts_total": "Speculative decoding: verifications of a request with drafts.",
    "arcserve:spec_decode_num_draft_tokens_total": "Speculative decoding: draft tokens proposed.",
    "arcserve:spec_decode_num_accepted_tokens_total": "Speculative decoding: draft tokens accepted.",
}
_HISTOGRAMS = {
    "arcserve:time_to_first_token_seconds": "Time from arrival to first token.",
    "arcserve:inter_token_latency_seconds": "Time between consecutive tokens of a sequence.",
    "arcserve:e2e_request_latency_seconds": "Time from arrival to finish.",
    "arcserve:request_queue_time_seconds": "Time from arrival to first scheduling.",
    "arcserve:request_prompt_tokens": "Prompt length of finished sequences.",
    "arcserve:request_generation_tokens": "Generated length of finished sequences.",
    "arcserve:step_generated_tokens": "Tokens generated per engine step that generated any (batch width).",
}
FINISH_REASONS = ("stop", "length", "abort")


class EngineCollector:
    def __init__(self, get_metrics, model_name: str) -> None:
        self.get_metrics, self.model_name = get_metrics, model_name

    def collect(self):
        m = self.get_metrics()
        labels = ["model_name"]
        for name, doc in _GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.model_name], m[name])
            yield g
        for name, doc in _COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self.model_name], m[name])
            yield c
        c = CounterMetricFamily("arcserve:request_success_total", "Finished sequences by finish reason.",
                                labels=["model_name", "finished_reason"])  # fmt: skip
        for reason in FINISH_REASONS:
            c.add_metric([self.model_name, reason], m["arcserve:request_success_total"].get(reason, 0))
        yield c
        c = CounterMetricFamily("arcserve:spec_decode_num_accepted_tokens_per_pos",
                                "Speculative decoding: draft tokens accepted, by position in the draft.",
                                labels=["model_name", "position"])  # fmt: skip
        for pos, n in m["arcserve:spec_decode_num_accepted_tokens_per_pos"].items():
            c.add_metric([self.model_name, str(pos)], n)
        yield c
        for name, doc in _HISTOGRAMS.items():
            h = m[name]
            fam = HistogramMetricFamily(name, doc, labels=labels)
            fam.add_metric([self.model_name], buckets=h["buckets"], sum_value=h["sum"])
            yield fam


def make_registry(get_metrics, model_name: str) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(get_metrics, model_name))
    return reg
