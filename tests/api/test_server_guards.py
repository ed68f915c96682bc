"""Server guards (issue 6): request body limit, API key on every model endpoint (and on /metrics when
asked), CORS off by default and configurable, fault isolation over HTTP, graceful shutdown on SIGTERM."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from .helpers import API_KEY, MODEL, cli_server, serve, sse_lines

PARAMS = {"model": MODEL, "max_tokens": 4, "temperature": 0}


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err["message"]


def test_request_body_limit(llama_dir):
    with serve(llama_dir, app_kw={"max_body_bytes": 4096}) as s:
        big = {**PARAMS, "prompt": "word " * 2000}  # ~10 KB of JSON
        assert "limit is 4096 bytes" in _error(s.post("/v1/completions", json=big), 413, "request_too_large")

        def chunks(body: bytes):  # no Content-Length: a chunked upload, counted as it arrives
            for i in range(0, len(body), 1000):
                yield body[i : i + 1000]

        r = s.post("/v1/completions", content=chunks(json.dumps(big).encode()), headers={"Content-Type": "application/json"})
        _error(r, 413, "request_too_large")
        small = json.dumps({**PARAMS, "prompt": "Hello"}).encode()
        r = s.post("/v1/completions", content=chunks(small), headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        s.wait_idle()


def test_api_key_guards_every_model_endpoint_and_metrics_when_asked(llama_dir):
    with serve(llama_dir, api_key=API_KEY, app_kw={"metrics_require_key": True}) as s:
        paths = json.loads(httpx.get(f"{s.base}/openapi.json", timeout=10).text)["paths"]
        model_paths = [(p, m) for p, ops in paths.items() for m in ops if p not in ("/health", "/ping", "/version")]
        assert {p for p, _ in model_paths} >= {"/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
                                               "/detokenize", "/metrics"}  # fmt: skip
        for path, method in model_paths:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
                r = httpx.request(method, f"{s.base}{path}", headers=headers, json={}, timeout=10)
                _error(r, 401, "invalid_api_key")
        assert httpx.get(f"{s.base}/health", timeout=10).status_code == 200  # liveness stays open
        r = httpx.get(f"{s.base}/metrics", headers=s.headers(), timeout=10)
        assert r.status_code == 200 and "arcserve:num_requests_running" in r.text


def test_cors_is_off_by_default(server):
    pre = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(f"{server.v1}/completions", headers=pre, timeout=10)
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{server.v1}/models", headers={"Origin": "https://evil.example"}, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_when_configured(llama_dir):
    from arcserve.api.server import _list_flag

    assert _list_flag('["https://a.example", "https://b.example"]') == ["https://a.example", "https://b.example"]
    assert _list_flag("https://a.example, https://b.example") == ["https://a.example", "https://b.example"]
    with pytest.raises(ValueError):
        _list_flag('[1, 2]')
    cors = {"allow_origins": ["https://a.example"], "allow_methods": ["GET", "POST"],
            "allow_headers": ["Authorization", "Content-Type"], "allow_credentials": False}  # fmt: skip
    with serve(llama_dir, api_key=API_KEY, app_kw={"cors": cors}) as s:
        pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
        ok = httpx.options(f"{s.v1}/completions", headers={"Origin": "https://a.example", **pre}, timeout=10)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://a.example"
        bad = httpx.options(f"{s.v1}/completions", headers={"Origin": "https://evil.example", **pre}, timeout=10)
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
        r = s.post("/v1/completions", json={**PARAMS, "prompt": "Hi"}, headers={"Origin": "https://a.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://a.example"


FAULT = 7  # prompts holding this token id make their engine step raise (ARCSERVE_FAULT_TOKEN)


@pytest.mark.parametrize("process", [False, True])
def test_a_fault_in_a_step_fails_only_its_request(llama_dir, monkeypatch, process):
    """max_num_seqs 1: the healthy request and the faulty one never share a step. The faulty one gets
    a clear 500 (streamed: an error event, then [DONE]); the other finishes with its own output;
    nothing stays held and the server serves on."""
    monkeypatch.setenv("ARCSERVE_FAULT_TOKEN", str(FAULT))
    with serve(llama_dir, process=process, max_num_seqs=1) as s:
        healthy = {**PARAMS, "prompt": [11, 12, 13], "max_tokens": 24, "ignore_eos": True}
        alone = s.post("/v1/completions", json=healthy).json()["choices"][0]["text"]
        results = {}

        def run(key, body):
            results[key] = s.post("/v1/completions", json=body, timeout=60)

        threads = [threading.Thread(target=run, args=("healthy", healthy)),
                   threading.Thread(target=run, args=("faulty", {**PARAMS, "prompt": [40, FAULT, 41]}))]  # fmt: skip
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=60)
        assert results["healthy"].status_code == 200 and results["healthy"].json()["choices"][0]["text"] == alone
        msg = _error(results["faulty"], 500, "internal_error")
        assert "generation failed" in msg and "injected fault" in msg and "other requests are unaffected" in msg
        with httpx.stream("POST", f"{s.v1}/completions", json={**PARAMS, "prompt": [FAULT], "stream": True},
                          timeout=60) as r:  # fmt: skip
            assert r.status_code == 200
            events = sse_lines(r.iter_lines())
        assert events[-1]["error"]["code"] == "internal_error" and "injected fault" in events[-1]["error"]["message"]
        s.wait_idle()
        assert s.post("/v1/completions", json=healthy).json()["choices"][0]["text"] == alone
        assert httpx.get(f"{s.base}/health", timeout=10).status_code == 200


def test_sigterm_drains_then_stops_the_rest_and_exits_0(llama_dir, tmp_path):
    """SIGTERM: the listening socket closes, a short request in flight finishes whole, a long one is
    stopped at --shutdown-timeout with a 503 error event (then [DONE]), and the process exits 0."""
    log = tmp_path / "serve.log"
    flags = ("--max-model-len", "16384", "--num-kv-blocks", "1100", "--log-level", "info", "--served-model-name", MODEL,
             "--shutdown-timeout", "5")  # fmt: skip
    results: dict = {}
    # a long request needs more positions than the tiny model's 512 (the model's outputs do not matter)
    with cli_server(llama_dir, log, *flags, env={"ARCSERVE_ALLOW_LONG_MAX_MODEL_LEN": "1"}) as (proc, base):

        started = {"short": threading.Event(), "long": threading.Event()}

        def stream(key, max_tokens):
            body = {**PARAMS, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                    "stream": True}  # fmt: skip

            def lines(r):  # tells the test when the first event arrives
                for line in r.iter_lines():
                    started[key].set()
                    yield line

            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                results[key] = (r.status_code, sse_lines(lines(r), limit=100_000))

        short = threading.Thread(target=stream, args=("short", 32))
        long = threading.Thread(target=stream, args=("long", 16000))  # far longer than the timeout
        long.start()
        short.start()
        # both admitted and streaming (a fixed sleep raced the short one's admission on a slow VM)
        assert started["long"].wait(30) and started["short"].wait(30)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no new connections
            httpx.get(f"{base}/health", timeout=2)
        short.join(timeout=30)
        long.join(timeout=30)
        rc = proc.wait(timeout=30)
        took = time.monotonic() - t0
    text = log.read_text(errors="replace")
    assert rc == 0, (rc, text)
    assert "Traceback" not in text, text
    code, events = results["short"]
    assert code == 200 and events[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events) > 0
    code, events = results["long"]
    assert code == 200 and events[-1]["error"]["code"] == "server_shutting_down", events[-1]
    assert not any(e.get("choices") and e["choices"][0]["finish_reason"] for e in events)  # cut, not finished
    assert 5 <= took < 5 + 10, took  # stopped at the timeout, exited soon after
    assert "Shutdown timeout: stopped 1 unfinished request(s)" in text


def test_chat_templates_cannot_read_other_files(llama_dir, tmp_path):
    """A template renders in a sandbox without a loader: include/import of any path fails with a 400
    and nothing of the file reaches the client; a request cannot swap the template."""
    from arcserve.api.server import read_chat_template

    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT")
    for tpl in ('{% include "' + str(secret) + '" %}', '{% import "' + str(secret) + '" as s %}{{ s }}'):
        path = tmp_path / "t.jinja"
        path.write_text(tpl)
        with serve(llama_dir, app_kw={"chat_template": read_chat_template(str(path))}) as s:
            for route, body in (("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
                                ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})):  # fmt: skip
                r = s.post(route, json=body)
                assert "could not apply the chat template" in _error(r, 400, "invalid_value")
                assert "TOP-SECRET" not in r.text
    bad = tmp_path / "bad.json"
    for content in ("[1, 2]", "{not json", '{"chat_template": 3}'):
        bad.write_text(content)
        with pytest.raises(ValueError, match="chat-template"):
            read_chat_template(str(bad))
    with pytest.raises(FileNotFoundError):
        read_chat_template(str(tmp_path))  # a folder is no template file


def test_a_request_that_could_never_be_admitted_is_400_not_503(llama_dir):
    with serve(llama_dir, max_waiting_requests=2, max_num_seqs=2) as s:
        r = s.post("/v1/completions", json={**PARAMS, "prompt": ["a", "b", "c"], "n": 2})  # 6 > 2 + 2
        assert "max_num_seqs + max_waiting_requests" in _error(r, 400, "invalid_value")
        r = s.post("/v1/completions", json={**PARAMS, "prompt": ["a", "b"], "n": 2})  # 4 fits
        assert r.status_code == 200 and len(r.json()["choices"]) == 4


def test_a_dead_engine_thread_fails_open_streams_fast(llama_dir):
    """A fault outside any step (here: the engine thread's loop itself) must not leave clients
    waiting: open requests fail within seconds, /health turns 503, new requests are refused."""
    with serve(llama_dir) as s:
        def broken():  # step_isolated isolates an Exception; this one escapes to the thread's guard
            raise KeyboardInterrupt

        s.front.engine.step = broken
        t0 = time.monotonic()
        r = s.post("/v1/completions", json={**PARAMS, "prompt": "Hello", "max_tokens": 8}, timeout=30)
        assert time.monotonic() - t0 < 5
        assert "engine stopped" in _error(r, 500, "internal_error")
        assert httpx.get(f"{s.base}/health", timeout=10).status_code == 503
        assert "engine stopped" in _error(s.post("/v1/completions", json={**PARAMS, "prompt": "Hi"}), 500, "internal_error")
