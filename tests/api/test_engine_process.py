"""The engine in its own process (as `arcserve serve` runs it): same answers as in-process, errors
from the engine side reach the client as 400s, startup errors reach the caller, shutdown is clean."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import defaultdict

import httpx
import pytest

from arcserve import EngineArgs
from arcserve.engine.core_process import AsyncLLMProcess

from .helpers import MODEL, serve, sse_data, sse_lines

# A request that is still generating when the tests below break the engine under it.
LONG = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


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


def test_outputs_cross_the_pipe_without_prompts(server, llama_dir):
    """The engine process sends each step's outputs without the prompt and its token ids (the
    server process tokenized them and restores them): answers that use the prompt (echo, prompt
    logprobs, usage), streamed and whole, for one prompt and several, equal the in-process server's,
    and the server process keeps no prompt once the requests are over, finished or abandoned."""
    body = {"model": MODEL, "prompt": ["The quick brown fox", "Hello there"], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 1, "n": 2}  # fmt: skip
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}

    def split(x, floats: list):  # (structure without ids, times and floats; the floats in order)
        if isinstance(x, dict):
            return {k: split(v, floats) for k, v in x.items() if k not in ("id", "created")}
        if isinstance(x, list):
            return [split(v, floats) for v in x]
        if isinstance(x, float):
            floats.append(x)
            return "<float>"
        return x

    def whole(r: httpx.Response) -> tuple:
        floats: list[float] = []
        return split(r.json(), floats), floats

    def events(r: httpx.Response) -> tuple:  # per choice: its chunks joined (chunking varies with timing)
        choices: dict[int, dict] = {}
        usage = None
        for ev in sse_data(r):
            usage = ev.get("usage") or usage
            for c in ev["choices"]:
                acc = choices.setdefault(c["index"], {"text": "", "logprobs": defaultdict(list)})
                acc["text"] += c["text"]
                acc["finish_reason"] = c["finish_reason"] or acc.get("finish_reason")
                for k, v in (c["logprobs"] or {}).items():
                    acc["logprobs"][k] += v
        floats: list[float] = []
        return split({"choices": choices, "usage": usage}, floats), floats

    def same(got: tuple, ref: tuple) -> bool:  # logprobs: one compute thread there, several here
        return got[0] == ref[0] and got[1] == pytest.approx(ref[1], abs=1e-4)

    ref_whole = whole(server.post("/v1/completions", json=body))
    ref_stream = events(server.post("/v1/completions", json=streamed))
    assert ref_whole[0]["usage"]["prompt_tokens"] > 0 and ref_whole[0]["choices"][0]["text"].startswith("The quick")
    with serve(llama_dir, process=True) as p:
        assert same(whole(p.post("/v1/completions", json=body)), ref_whole)
        assert same(events(p.post("/v1/completions", json=streamed)), ref_stream)
        with httpx.stream("POST", f"{p.base}/v1/completions", json={**streamed, "max_tokens": 200}) as r:
            next(r.iter_lines())  # leave after the first chunk: the request is abandoned
        p.wait_idle()
        assert p.front._streams == {}  # the registry that holds each open request's prompt


def test_an_engine_process_killed_mid_stream_fails_open_streams_fast(llama_dir):
    """The engine process dies (killed, out of memory) while requests stream: each open stream ends
    at once with an error event and [DONE], a whole answer waiting gets a 500, /health turns 503,
    and new requests are refused with a clear error; the server process itself stays up."""
    with serve(llama_dir, process=True, max_model_len=256) as p:
        results: dict[str, object] = {}

        def whole():
            results["whole"] = p.post("/v1/completions", json=LONG, timeout=30)

        waiter = threading.Thread(target=whole)
        waiter.start()
        with httpx.stream("POST", f"{p.base}/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            first = next(x for x in lines if x)
            deadline = time.monotonic() + 20
            while p.front._num_running() < 2:  # both in the engine (its figures come with every step)
                assert time.monotonic() < deadline, "the two requests never ran together"
                time.sleep(0.005)
            t0 = time.monotonic()
            os.kill(p.front.proc.pid, signal.SIGKILL)
            rest = sse_lines(lines)  # (asserts that [DONE] came)
            ended = time.monotonic() - t0
        waiter.join(timeout=30)
        assert first.startswith("data: ")
        err = rest[-1]["error"]
        assert "engine stopped" in err["message"] and err["code"] == "internal_error", err
        assert ended < 5, ended  # the reader thread notices within its 0.5 s poll
        whole_r = results["whole"]
        assert whole_r.status_code == 500 and "engine stopped" in whole_r.json()["error"]["message"]
        assert httpx.get(f"{p.base}/health", timeout=10).status_code == 503
        again = p.post("/v1/completions", json={**LONG, "max_tokens": 2})
        assert again.status_code == 500 and "engine stopped" in again.json()["error"]["message"]
        assert p.front._streams == {}


def test_a_failing_output_reader_fails_every_stream_and_stops_the_engine(llama_dir):
    """If the server's thread that reads the engine process's outputs fails (a bug there, not in
    the engine), every open stream gets the error at once and the engine process is stopped (left
    running, it would block writing outputs no one reads); the server answers 503 on /health."""
    with serve(llama_dir, process=True) as p:
        real = p.front._deliver_all
        broken = threading.Event()

        def deliver_all(items):  # fails once when asked (then _die's own delivery works)
            if broken.is_set():
                broken.clear()
                raise RuntimeError("reader bug")
            real(items)

        p.front._deliver_all = deliver_all
        with httpx.stream("POST", f"{p.base}/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            assert next(x for x in lines if x).startswith("data: ")
            broken.set()
            rest = sse_lines(lines)
        assert "reader bug" in rest[-1]["error"]["message"]
        p.front.proc.join(timeout=10)
        assert not p.front.proc.is_alive()
        assert httpx.get(f"{p.base}/health", timeout=10).status_code == 503
