"""The engine in its own process (as `arcserve serve` runs it): same answers as in-process, errors
from the engine side reach the client as 400s, startup errors reach the caller, shutdown is clean."""

from __future__ import annotations

import pytest

from arcserve import EngineArgs
from arcserve.engine.core_process import AsyncLLMProcess

from .helpers import MODEL, serve


def test_same_answers_as_in_process(server, llama_dir):
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "logprobs": 2, "n": 2, "seed": 3}  # fmt: skip
    ref = server.post("/v1/completions", json=body).json()
    with serve(llama_dir, process=True) as p:
        got = p.post("/v1/completions", json=body).json()
        assert [c["text"] for c in got["choices"]] == [c["text"] for c in ref["choices"]]
        assert got["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
            ref["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5
        )
        assert got["usage"] == ref["usage"]
        bad = p.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 300})
        assert bad.status_code == 400 and "max_model_len" in bad.json()["error"]["message"]
        p.wait_idle()  # raises unless nothing runs, waits or holds KV blocks
        assert p.front.proc.is_alive()
    assert not p.front.proc.is_alive()  # shut down with the server


def test_startup_errors_reach_the_caller(llama_dir):
    with pytest.raises(ValueError, match="largest max_model_len that fits is 64"):
        AsyncLLMProcess(EngineArgs(model=str(llama_dir), num_kv_blocks=4, max_model_len=128))
