"""`arcserve bench serve` against the tiny server: every request counted, exact token totals, sane
latencies; failures are reported with their cause."""

import asyncio
import json
import math

import pytest

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


def test_bench_client_takes_vllm_flags_and_refuses_bad_ones(server, tmp_path, capsys):
    """vLLM's names for the random dataset's lengths, a bare --save-result with --result-dir /
    --result-filename; no server at the address is a one-line error, a count < 1 a usage error."""
    from arcserve.cli import main

    flags = ["bench", "serve", "--base-url", server.base, "--dataset-name", "random", "--backend", "vllm",
             "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "3", "--random-range-ratio",
             "0", "--vocab-size", "320", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]  # fmt: skip
    assert main(flags) == 0
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["successful_requests"] == 2 and saved["total_input_tokens"] == 16 and saved["total_output_tokens"] == 6
    capsys.readouterr()
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the server at http://127.0.0.1:9" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--num-prompts", "-3"])
    assert "must be a number >= 1" in capsys.readouterr().err
