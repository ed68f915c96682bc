"""The periodic stats line (vLLM's format) from the engine's figures."""

from __future__ import annotations

import logging

import pytest

from arcserve import LLM, SamplingParams
from arcserve.engine.stat_logger import LOG_INTERVAL_ENV, StatLogger, log_interval


def figures(prompt=0, gen=0, queries=0, hits=0, preempt=0, drafts=0, drafted=0, accepted=0, running=0, waiting=0,
            usage=0.0) -> dict:  # fmt: skip
    return {"arcserve:prompt_tokens_total": prompt, "arcserve:generation_tokens_total": gen,
            "arcserve:prefix_cache_queries_total": queries, "arcserve:prefix_cache_hits_total": hits,
            "arcserve:num_preemptions_total": preempt, "arcserve:spec_decode_num_drafts_total": drafts,
            "arcserve:spec_decode_num_draft_tokens_total": drafted,
            "arcserve:spec_decode_num_accepted_tokens_total": accepted, "arcserve:num_requests_running": running,
            "arcserve:num_requests_waiting": waiting, "arcserve:kv_cache_usage_perc": usage}  # fmt: skip


def test_line_from_interval_deltas(monkeypatch, caplog):
    clock = [100.0]
    monkeypatch.setattr("arcserve.engine.stat_logger.time.monotonic", lambda: clock[0])
    seq = iter([figures(prompt=50, gen=10, queries=40, hits=16),  # at start: the baseline
                figures(prompt=250, gen=410, queries=240, hits=66, preempt=2, running=7, waiting=3, usage=0.125),
                figures(prompt=250, gen=410, queries=240, hits=66, preempt=2),  # idle, just after traffic
                figures(prompt=250, gen=410, queries=240, hits=66, preempt=2),  # idle again
                figures(prompt=250, gen=430, queries=240, hits=66, preempt=2, drafts=4, drafted=12, accepted=6)])  # fmt: skip
    stats = StatLogger(lambda: next(seq), "CPU", interval=10)
    caplog.set_level(logging.DEBUG, logger="arcserve")
    clock[0] += 4
    stats.maybe_log()  # not yet due: no line, the figures are not even read
    assert not caplog.records
    clock[0] += 6
    stats.maybe_log()
    # (200 prompt tokens - 50 served by the cache) / 10 s; 400 generated / 10 s; 50 hits of 200 lookups
    assert caplog.records[-1].getMessage() == (
        "Engine 000: Avg prompt throughput: 15.0 tokens/s, Avg generation throughput: 40.0 tokens/s, "
        "Running: 7 reqs, Waiting: 3 reqs, Preemptions: 2, CPU KV cache usage: 12.5%, Prefix cache hit rate: 25.0%")
    assert caplog.records[-1].levelno == logging.INFO
    clock[0] += 10
    line = stats.log()
    assert line.startswith("Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s")
    assert "Preemptions" not in line and "Prefix cache" not in line
    assert caplog.records[-1].levelno == logging.INFO  # the first idle line still shows (traffic just ended)
    clock[0] += 10
    stats.log()
    assert caplog.records[-1].levelno == logging.DEBUG  # an idle server stays quiet
    clock[0] += 5
    line = stats.log()
    assert line.endswith("SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 1.20 tokens/s, "
                         "Drafted throughput: 2.40 tokens/s, Accepted: 6 tokens, Drafted: 12 tokens, "
                         "Avg Draft acceptance rate: 50.0%")  # fmt: skip
    assert caplog.records[-1].getMessage() == line.split("\n")[1]


def test_interval_from_the_environment(monkeypatch):
    assert log_interval() == 10
    monkeypatch.setenv(LOG_INTERVAL_ENV, "0.5")
    assert log_interval() == 0.5
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv(LOG_INTERVAL_ENV, bad)
        with pytest.raises(ValueError, match=LOG_INTERVAL_ENV):
            log_interval()


def test_offline_llm_logs_only_when_asked(llama_dir, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="arcserve")
    quiet = LLM(str(llama_dir), dtype="float32", max_model_len=64)  # vLLM's LLM default: no stats line
    assert quiet.llm_engine.args.disable_log_stats and quiet._stats is None
    monkeypatch.setenv(LOG_INTERVAL_ENV, "0.000001")  # every step
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=64, disable_log_stats=False)
    caplog.clear()
    llm.generate(["a b c", "d e"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if "Avg generation throughput" in r.getMessage()]
    label = "CPU" if llm.llm_engine.device.type == "cpu" else "GPU"
    assert lines and all(f"{label} KV cache usage" in x for x in lines)
    assert any("Running: 2 reqs" in x for x in lines)
