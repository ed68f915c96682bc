"""Bad input: schemathesis fuzzes every operation of the server's own /openapi.json (valid and invalid
bodies, boundary values, wrong methods and media types), and explicit tests pin the input limits. No
input may cause a 5xx, a hang or a crash; every refusal is a 4xx in OpenAI's error shape
{"error": {"message", "type", "param", "code"}} whose message names the parameter.

The default run fuzzes each operation briefly, seeded and deterministic (same cases every run). The
long run, many more examples per operation, is marked slow:

    python -m pytest -m slow tests/api/test_fuzz.py

A real uvicorn server on 127.0.0.1 answers (the tiny random llama, engine in a thread): the fuzzer goes
through HTTP parsing, the middleware, the exception handlers and the engine, as clients do. Its
max_model_len is small, so that whatever the fuzzer gets accepted is short (a larger max_tokens is a
400): the worst accepted request is prompts x n x FUZZ_MAX_MODEL_LEN tokens.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from .helpers import MODEL, serve
from .test_errors import assert_error

SEED = 6
FUZZ_MAX_MODEL_LEN = 48
RESPONSE_TIME_LIMIT = 20.0  # seconds; a slower answer counts as a hang
ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health", "/ping",
          "/version", "/metrics"}  # fmt: skip
USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def fuzz_server(llama_dir):
    with serve(llama_dir, max_model_len=FUZZ_MAX_MODEL_LEN, num_kv_blocks=512) as s:
        yield s


@pytest.fixture(scope="module")
def openapi(fuzz_server) -> dict:
    r = httpx.get(f"{fuzz_server.base}/openapi.json", timeout=10)
    assert r.status_code == 200
    return r.json()


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


_ID = {"type": "integer", "minimum": 0, "maximum": 319}  # the tiny model's vocabulary
_IDS = {"type": "array", "items": _ID, "minItems": 1, "maxItems": 40}
_TEXT = {"type": "string", "minLength": 1, "maxLength": 60}
# What the server requires beyond its schema, for the fuzzer's valid cases to get past validation
# and into generation with random sampling settings (without these most are 400s: a logit_bias key
# that is no token id, a token id past the vocabulary, best_of != n, min_tokens > max_tokens...).
SEMANTICS = {
    "model": {"type": "string", "enum": [MODEL]},  # any other name only reaches the 404 check
    "prompt": {
        "anyOf": [
            _TEXT,
            {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": 4},
            _IDS,
            {"type": "array", "items": _IDS, "minItems": 1, "maxItems": 4},
        ]
    },
    "tokens": {"type": "array", "items": _ID},
    "stop_token_ids": {"type": "array", "items": _ID, "maxItems": 4},
    "allowed_token_ids": {"type": "array", "items": _ID, "minItems": 1, "maxItems": 4},
    "logit_bias": {
        "type": "object",
        "propertyNames": {"pattern": "^(?:[0-9]|[1-9][0-9]|[12][0-9][0-9]|3[01][0-9])$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "maxProperties": 4,
    },
    "stop": {"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "maxItems": 4}]},
    "top_k": {"type": "integer", "minimum": -1},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
    "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
    "min_tokens": {"type": "integer", "minimum": 0, "maximum": 1},
    "best_of": {"type": "null"},
    "suffix": {"type": "null"},
    # structured outputs and tool calls (tests of their own) and fields refused whatever their value:
    # null lets valid cases through
    **dict.fromkeys(["response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "guided_whitespace_pattern", "structured_outputs", "tools", "functions", "tool_choice",
                     "function_call", "parallel_tool_calls", "logits_processors"], {"type": "null"}),
    "bad_words": {"type": "array", "items": _TEXT, "maxItems": 4},
    "truncate_prompt_tokens": {"anyOf": [{"type": "integer", "minimum": 1}, {"const": -1}]},
    "use_beam_search": {"const": False},
    "return_tokens_as_token_ids": {"type": "boolean"},
    "chat_template_kwargs": {
        "type": "object",
        "maxProperties": 2,
        "propertyNames": {"pattern": "^x_[a-z]{1,8}$"},
    },
}


@pytest.fixture(scope="module")
def api_schema(fuzz_server, openapi):
    """The server's schema, with SEMANTICS written in (nullable fields stay nullable): its valid cases
    are then mostly accepted requests, its invalid ones still send other values and types."""
    spec = json.loads(json.dumps(openapi))
    for comp in spec["components"]["schemas"].values():
        props = comp.get("properties", {})
        for name, sem in SEMANTICS.items():
            if name in props:
                nullable = {"type": "null"} in props[name].get("anyOf", [])
                props[name] = {**(_nullable(sem) if nullable and sem != {"type": "null"} else sem),
                               **{k: v for k, v in props[name].items() if k in ("title", "default")}}  # fmt: skip
    config = schemathesis.Config.from_dict({
        "seed": SEED, "base-url": fuzz_server.base, "generation": {"deterministic": True, "database": "none"},
        # a stream is read to its end (schemathesis stops at 20 events), or for this long in all
        "request-timeout": RESPONSE_TIME_LIMIT, "max-stream-events": 1_000_000,
    })  # fmt: skip
    return schemathesis.openapi.from_dict(spec, config=config)


schema = schemathesis.pytest.from_fixture("api_schema")


# ---- checks on every response -------------------------------------------------------------------
def openai_error_shape(ctx, response, case) -> None:
    """Every 4xx is JSON in OpenAI's error shape (HEAD answers carry no body)."""
    if 400 <= response.status_code < 500 and case.method.upper() != "HEAD":
        body = response.json()
        assert set(body) == {"error"}, body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"], err
        assert isinstance(err["type"], str) and (err["param"] is None or isinstance(err["param"], str)), err


def sse_events(body: bytes) -> list[dict]:
    """The JSON events of a whole event stream, which must end with data: [DONE]. Lines end at CR, LF or
    CRLF only (the SSE spec; str.splitlines, and so httpx's iter_lines, also split at U+2028, U+0085...,
    which the JSON in an event may hold unescaped)."""
    lines = [line for line in re.split(r"\r\n|\r|\n", body.decode()) if line]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    assert all(line.startswith("data: ") for line in lines), [x for x in lines if not x.startswith("data: ")]
    return [json.loads(line[6:]) for line in lines[:-1]]


def complete_stream(ctx, response, case) -> None:
    """A 200 event stream ends with data: [DONE] and carries no error event (errors after the headers
    travel in the stream, where a status check cannot see them)."""
    if response.status_code == 200 and response.headers.get("content-type", [""])[0].startswith(
        "text/event-stream"
    ):
        events = sse_events(response.content)
        assert not any("error" in e for e in events), [e for e in events if "error" in e]


CHECKS = [not_a_server_error, openai_error_shape, complete_stream]


def call_and_check(case) -> None:
    """Send the case, run CHECKS and the time bound; an accepted completion is sent again streamed (the
    fuzzer seldom sets stream: true on a request that passes validation), which must be accepted and
    complete without an error event."""
    t0 = time.monotonic()
    response = case.call(timeout=RESPONSE_TIME_LIMIT)  # a hang fails with a read timeout
    elapsed = time.monotonic() - t0
    case.validate_response(response, checks=CHECKS)
    assert elapsed < RESPONSE_TIME_LIMIT, f"{case.method} {case.path} took {elapsed:.1f} s"
    body = case.body
    if response.status_code == 200 and case.path.startswith("/v1/") and isinstance(body, dict):
        if body.get("stream") is not True:  # (prompt_logprobs are not streamed: a 400 with stream, as in vLLM)
            body = {**{k: v for k, v in body.items() if k != "prompt_logprobs"}, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            t0 = time.monotonic()
            r = httpx.post(case.operation.schema.get_base_url() + case.formatted_path, json=body,
                           timeout=RESPONSE_TIME_LIMIT)  # fmt: skip
            assert r.status_code == 200, (body, r.status_code, r.text)
            events = sse_events(r.content)
            assert not any("error" in e for e in events), (body, [e for e in events if "error" in e])
            assert "usage" in events[-1], (body, events[-1])
            assert time.monotonic() - t0 < RESPONSE_TIME_LIMIT


# ---- fuzzing ------------------------------------------------------------------------------------
def test_schema_lists_every_route(openapi):
    assert ROUTES <= set(openapi["paths"]), sorted(ROUTES - set(openapi["paths"]))


@schema.parametrize()
@settings(
    max_examples=25, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)
def test_fuzz(case):
    """Every operation: schemathesis' coverage cases (boundaries, missing and wrong-typed fields, other
    methods and media types) plus 25 generated valid and invalid bodies."""
    call_and_check(case)


@pytest.mark.slow
@schema.parametrize()
@settings(
    max_examples=1000, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)
def test_fuzz_long(case):
    """As test_fuzz with 1000 generated bodies per operation (python -m pytest -m slow tests/api/test_fuzz.py)."""
    call_and_check(case)


def test_server_sound_after_fuzzing(fuzz_server):
    """Runs after the fuzz tests in this module: the server is healthy, nothing runs or waits, no KV block is
    held, and it still serves."""
    assert httpx.get(f"{fuzz_server.base}/health", timeout=5).status_code == 200
    fuzz_server.wait_idle()
    r = fuzz_server.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3,
                                                  "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# ---- explicit limits (test_errors.py has n > 128, logprobs / top_logprobs > 20, 17 stop strings and
# 1025 prompts; here: the parameter each names, and what it does not cover) ---------------------------
def post(
    server, path: str, body, stream: bool = False, timeout: float = RESPONSE_TIME_LIMIT
) -> httpx.Response:
    if isinstance(body, dict) and path.startswith("/v1/"):
        body = {"model": MODEL, **body, **({"stream": True} if stream else {})}
    return server.post(path, json=body, timeout=timeout)


def raw_post(server, path: str, raw: str) -> httpx.Response:
    """A body as given (httpx would re-encode a dict)."""
    return server.post(path, content=raw.encode(), headers={"content-type": "application/json"},
                       timeout=RESPONSE_TIME_LIMIT)  # fmt: skip


# (path, body, param, text in the message)
LIMITS = [
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, "stop", "at most 16"),
    ("/v1/completions", {"prompt": "x", "stop": "a" * 257}, "stop", "256"),
    ("/v1/completions", {"prompt": "x", "stop": ["ok", "b" * 1000]}, "stop", "1000"),
    ("/v1/chat/completions", {"messages": USER, "stop": ["c" * 257]}, "stop", "256"),
    ("/v1/completions", {"prompt": ["x"] * 1025}, "prompt", "1024"),
    ("/v1/completions", {"prompt": ["x"] * 9, "n": 128}, "n", "113"),  # 9 x 128 > 1024 choices
    ("/v1/completions", {"prompt": [[5]] * 1024, "n": 2}, "n", "1024"),
    ("/v1/completions", {"prompt": "x", "n": 129}, "n", ""),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", ""),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 10**6}, "logprobs", ""),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 10**6}, "top_logprobs", ""),
    ("/v1/completions", {"prompt": "x", "seed": 2**63 - 1, "n": 3}, "seed", "2**63 - n"),
    ("/v1/chat/completions", {"messages": USER, "seed": 2**63 - 2, "n": 4}, "seed", "2**63 - n"),
    ("/v1/completions", {"prompt": "x", "seed": 2**63}, "seed", ""),
    ("/v1/completions", {"prompt": "x", "seed": -(2**63) - 1}, "seed", ""),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body,param,text", LIMITS, ids=[str(i) for i in range(len(LIMITS))])
def test_limits_name_their_parameter(fuzz_server, path, body, param, text, stream):
    err = assert_error(post(fuzz_server, path, body, stream), 400, "invalid_request_error", param=param)
    assert param in err["message"] and text in err["message"], err


def test_within_limits_is_served(fuzz_server):
    """The largest requests the limits allow: 8 prompts x n=128 = 1024 choices; 16 stop strings of 256
    characters; seed = 2**63 - n (regression: seed + i overflowed int64 in the sampler, a 500)."""
    r = post(fuzz_server, "/v1/completions", {"prompt": ["a", "b", "c", "d", "e", "f", "g", "h"], "n": 128,
                                              "max_tokens": 1})  # fmt: skip
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(1024))
    stops = [chr(0x4E00 + i) * 256 for i in range(16)]
    r = post(fuzz_server, "/v1/chat/completions", {"messages": USER, "stop": stops, "max_tokens": 2})
    assert r.status_code == 200, r.text
    for n in (1, 3):
        for stream in (False, True):
            r = post(fuzz_server, "/v1/completions", {"prompt": "x", "seed": 2**63 - n, "n": n, "max_tokens": 2,
                                                      "ignore_eos": True}, stream)  # fmt: skip
            assert r.status_code == 200, r.text
            if stream:
                events = sse_events(r.content)
                assert not any("error" in e for e in events), events
            else:
                assert len(r.json()["choices"]) == n
    fuzz_server.wait_idle()


@pytest.mark.parametrize("nested", [False, True])
def test_huge_token_id_prompt(fuzz_server, nested):
    """A 200,000-id prompt (1.4 MB of JSON) is refused quickly as longer than max_model_len."""
    ids = [5] * 200_000
    t0 = time.monotonic()
    r = post(fuzz_server, "/v1/completions", {"prompt": [[5], ids] if nested else ids})
    err = assert_error(r, 400, "invalid_request_error", code="context_length_exceeded", param="prompt")
    assert "200000" in err["message"] and str(FUZZ_MAX_MODEL_LEN) in err["message"]
    assert time.monotonic() - t0 < 10
    fuzz_server.wait_idle()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_long_prompt_does_not_stall_others(fuzz_server, path):
    """A 1 MiB prompt takes the tokenizer a second or more, in a worker thread: /health keeps answering
    meanwhile (regression: the event loop tokenized it, and every other request waited)."""
    text = "x " * (1 << 19)
    body = {"messages": [{"role": "user", "content": text}]} if "chat" in path else {"prompt": text}
    done: dict = {}

    def big() -> None:
        t0 = time.monotonic()
        done["r"] = post(fuzz_server, path, body, timeout=120)
        done["s"] = time.monotonic() - t0

    thread = threading.Thread(target=big)
    thread.start()
    waits = []
    while thread.is_alive():
        t0 = time.monotonic()
        assert httpx.get(f"{fuzz_server.base}/health", timeout=60).status_code == 200
        waits.append(time.monotonic() - t0)
        time.sleep(0.02)
    thread.join()
    if path == "/tokenize":  # counting tokens has no length limit
        assert done["r"].status_code == 200 and done["r"].json()["count"] > 1 << 18
    else:
        assert_error(done["r"], 400, "invalid_request_error", code="context_length_exceeded")
    if done["s"] > 0.5:  # (a machine fast enough to tokenize it at once proves nothing either way)
        assert max(waits) < done["s"] / 2, (max(waits), done["s"])


# ---- unicode ------------------------------------------------------------------------------------
SURROGATES = [  # (path, body, param) -- regression: prompts and /tokenize answered 500 (TypeError)
    ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "a\udfffb"]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": "\ud800"}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["ok", "\ud800"]}, "stop"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["ok", "\ud800"]}, "bad_words"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udbff"}]}]},
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x", "name": "\ud800"}]},
        "messages.0.name",
    ),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
]


@pytest.mark.parametrize("path,body,param", SURROGATES, ids=[str(i) for i in range(len(SURROGATES))])
def test_lone_surrogates_are_400(fuzz_server, path, body, param):
    """Valid JSON, invalid Unicode: no Python client sends it (UTF-8 cannot encode it), the JSON is raw."""
    body = {"model": MODEL, **body} if path.startswith("/v1/") else body
    raw = json.dumps(body)  # ASCII: the surrogate is spelled \\udXXX
    assert "\\ud" in raw
    err = assert_error(raw_post(fuzz_server, path, raw), 400, "invalid_request_error", param=param)
    assert "Unicode" in err["message"] and param.split(".")[-1] in err["message"], err


JUNK = [
    "\x00\x01\x1f\x7f",  # control characters and NUL
    "\ufeff\u200b\u200d\u2028\u2029",  # BOM, zero-width, line and paragraph separators
    "e\u0301\u0301\u0301 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u202e",  # combining marks, RTL
    "\U0001f600\U0001f468\u200d\U0001f469\u200d\U0001f467 \U00010000\U0010fffd",  # astral, ZWJ sequences
    "\ufffe\uffff\ue000\U000f0000",  # noncharacters, private use
    '\\u0000 \\" {} [] \\',  # escapes as text
]


@pytest.mark.parametrize("text", JUNK, ids=[str(i) for i in range(len(JUNK))])
def test_unicode_junk_is_served(fuzz_server, text):
    """Odd but valid Unicode is text like any other: prompts, chat, stop strings, tokenize round trip."""
    body = {"prompt": text, "max_tokens": 3, "stop": [text[:5]], "echo": True, "logprobs": 2}
    for stream in (False, True):
        r = post(fuzz_server, "/v1/completions", body, stream)
        assert r.status_code == 200, r.text
        if stream:
            events = sse_events(r.content)
            assert not any("error" in e for e in events), events
            assert "".join(e["choices"][0]["text"] for e in events).startswith(text)
        else:
            assert r.json()["choices"][0]["text"].startswith(text)
    r = post(fuzz_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": text, "name": text}],
                                                   "max_tokens": 2})  # fmt: skip
    assert r.status_code == 200, r.text
    tokens = post(fuzz_server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert post(fuzz_server, "/detokenize", {"tokens": tokens}).json()["prompt"] == text


def test_stream_events_stay_one_line_for_splitlines_clients(fuzz_server):
    """U+2028, U+2029 and U+0085 in streamed text go out as JSON escapes, so a client that splits the
    stream with str.splitlines() still reads each event as one JSON line."""
    text = "a\u2028b\u2029c\x85d"
    r = post(fuzz_server, "/v1/completions", {"prompt": text, "max_tokens": 2, "echo": True}, True)
    assert r.status_code == 200, r.text
    lines = [ln for ln in r.content.decode().splitlines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events).startswith(text)


# ---- nesting and types --------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [100, 900, 100_000])
@pytest.mark.parametrize("where", ["user", "prompt", "messages", "extra"])
def test_deeply_nested_json_is_400(fuzz_server, depth, where):
    """Nesting in a typed field is a type error naming it; nesting past the JSON parser's recursion limit
    anywhere (even in an ignored field) is a 400 parse error; never a 500 or a dead server."""
    head, tail = {
        "user": ('{"model": "tiny", "prompt": "x", "user": ', "}"),
        "prompt": ('{"model": "tiny", "prompt": ', "}"),
        "messages": ('{"model": "tiny", "messages": [{"role": "user", "content": ', "}]}"),
        "extra": ('{"model": "tiny", "prompt": "x", "max_tokens": 1, "vendor_extra": ', "}"),
    }[where]
    raw = head + "[" * depth + "]" * depth + tail
    path = "/v1/chat/completions" if where == "messages" else "/v1/completions"
    r = raw_post(fuzz_server, path, raw)
    if where == "extra" and depth < 1000:  # unknown fields are ignored
        assert r.status_code == 200, r.text
        return
    err = assert_error(r, 400, "invalid_request_error")
    if depth < 1000:
        assert err["param"] is not None and err["param"].startswith(where), err
    assert httpx.get(f"{fuzz_server.base}/health", timeout=5).status_code == 200


# (path, body, param the error names) -- wrong JSON types that test_errors.py does not try
WRONG_TYPES = [
    ("/v1/completions", {"prompt": None}, "prompt"),
    ("/v1/completions", {"prompt": True}, "prompt"),
    ("/v1/completions", {"prompt": 1.5}, "prompt"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),  # was taken for token ids [1, 0]
    ("/v1/completions", {"prompt": [1, 2.5]}, "prompt"),
    ("/v1/completions", {"prompt": [["a"]]}, "prompt"),
    ("/v1/completions", {"prompt": [[1], "a"]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 1.5}, "n"),
    ("/v1/completions", {"prompt": "x", "n": [1]}, "n"),
    ("/v1/completions", {"prompt": "x", "echo": 5}, "echo"),
    ("/v1/completions", {"prompt": "x", "stream": [True]}, "stream"),
    ("/v1/completions", {"prompt": "x", "logprobs": "many"}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": [5]}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": {"a": 1}}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [None]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": "1"}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [True]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": [1]}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": "x"}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "top_k": 1.5}, "top_k"),
    ("/v1/completions", {"prompt": "x", "model": 5}, "model"),
    ("/v1/completions", {"prompt": "x", "user": 5}, "user"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [[]]}, "messages.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages.0.name"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": 5}, "logprobs"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": "x"}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": "x"}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": USER, "stream_options": 5}, "stream_options"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": USER, "add_generation_prompt": "maybe"}, "add_generation_prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": "x"}, "messages"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": [1]}, "add_special_tokens"),
    ("/detokenize", {"tokens": [1.5]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": None}, "tokens"),
    ("/detokenize", {"tokens": {"0": 1}}, "tokens"),
]


@pytest.mark.parametrize("path,body,param", WRONG_TYPES, ids=[str(i) for i in range(len(WRONG_TYPES))])
def test_wrong_types_are_400(fuzz_server, path, body, param):
    err = assert_error(post(fuzz_server, path, body), 400, "invalid_request_error")
    assert err["param"] is not None and err["param"].startswith(param), err
    assert param.split(".")[0] in err["message"], err
