"""`arcserve bench serve` against the tiny server: every request counted, exact token totals, sane
latencies; failures are reported with their cause."""

import asyncio
import math

from arcserve.bench.serve import report, run
from arcserve.cli import build_parser


def bench_args(server, *extra):
    return build_parser().parse_args(["bench", "serve", "--base-url", server.base, "--num-prompts", "6",
                                      "--input-len", "12", "--output-len", "5", "--vocab-size", "320",
                                      "--seed", "1", *extra])  # fmt: skip


def test_bench_client_counts_every_token(server):
    # ids up to 320 include ones the tokenizer (300) cannot spell: chunks with empty text still count
    s = asyncio.run(run(bench_args(server, "--request-rate", "inf")))
    assert s["successful_requests"] == 6 and s["failed_requests"] == 0
    assert s["total_input_tokens"] == 72 and s["total_output_tokens"] == 30
    assert 0 < s["median_ttft_ms"] < 10_000 and math.isfinite(s["median_tpot_ms"])
    assert "Successful requests:" in report(s)


def test_bench_client_reports_failures(server):
    s = asyncio.run(run(bench_args(server, "--model", "no-such-model", "--request-rate", "100")))
    assert s["successful_requests"] == 0 and s["failed_requests"] == 6
    assert any("HTTP 404" in e for e in s["errors"])
