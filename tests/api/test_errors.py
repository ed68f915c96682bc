"""Errors in OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 for invalid parameters,
malformed JSON, schema violations and prompts longer than max_model_len; 401 for a missing or wrong
API key (/health and /metrics stay open); 404 for an unknown model; 503 + Retry-After when overloaded.
A user error is never a 500 and never disturbs other requests (a long stream running meanwhile)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from .helpers import API_KEY, MODEL, serve, sse_lines

USER = [{"role": "user", "content": "Hello"}]
ANY = object()  # the error names some parameter, which one is not checked

# (path, body, param, text in the message)
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "temperature": 3}, "temperature", "less than or equal to 2"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature", ""),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", ""),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p", ""),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p", ""),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n", ""),
    ("/v1/completions", {"prompt": "x", "n": 129}, "n", ""),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", ""),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens", ""),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", ""),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs", ""),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, "top_k", "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p", ""),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty", ""),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty", ""),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", ""),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens", ""),
    ("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop", "non-empty"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, ANY, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, ANY, ""),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids", ""),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [320]}, ANY, "320"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, ANY, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, ANY, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"-3": 1}}, ANY, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"400": 1}}, ANY, "400"),
    ("/v1/completions", {"prompt": "x", "seed": "abc"}, "seed", ""),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of", "best_of"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix", "suffix"),
    # structured outputs and tool calls that cannot be honoured: refused, never answered unconstrained
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "structural_tag"}}, "response_format", "structural_tag"),
    ("/v1/completions", {"prompt": "x", "response_format": "json"}, ANY, ""),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format", "json_schema.schema"),
    ("/v1/completions", {"prompt": "x", "guided_choice": []}, "guided_choice", "non-empty list"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "[0-9"}, "guided_regex", "unclosed character class"),
    ("/v1/chat/completions", {"messages": USER, "guided_json": "{bad"}, "guided_json", "not valid JSON"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format", "not valid"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": "root ::= missing"}, "guided_grammar", "missing"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "colour": 1}}, "structured_outputs",
     "colour"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": "a+"}, "structured_outputs", ""),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "response_format": {"type": "json_object"}},
     "response_format", "exactly one"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "[0-9", "structured_outputs": {"disable_any_whitespace": True}},
     "guided_regex", "unclosed character class"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_whitespace_pattern": " "},
     "guided_whitespace_pattern", "not supported"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"$defs": [1]}}}], "tool_choice": "required"}, "tools", "$defs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": {}, "whitespace_pattern": " "}},
     "structured_outputs", "whitespace_pattern"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "n": 2, "guided_choice": ["a"]}, "guided_choice",
     "use_beam_search"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice", "'auto'"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "auto"}, "tool_choice", "'auto'"),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "'g'"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": ""}}],
                              "tool_choice": "required"}, "tools", "name"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "code_interpreter"}], "tool_choice": "required"},
     "tools", "tools[0]"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "guided_regex"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required", "structured_outputs": {"regex": "a"}}, "tool_choice",
     "structured_outputs.regex"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "maybe"}, "tool_choice", "must be"),
    ("/v1/chat/completions", {"messages": USER, "functions": [{"name": "f"}]}, "functions", "legacy"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "n": 11}, "n", "at most 10"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "stream": True}, "stream", "stream"),
    ("/v1/chat/completions", {"messages": USER, "use_beam_search": True, "stream": True}, "stream", "stream"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "stop": ["a"]}, "stop", "use_beam_search"),
    ("/v1/chat/completions", {"messages": USER, "use_beam_search": True, "top_p": 0.5}, "top_p", "use_beam_search"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "prompt_logprobs": 1}, "prompt_logprobs", "prompt"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "echo": True, "logprobs": 1}, "echo", "echo"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "length_penalty": "long"}, "length_penalty", ""),
    ("/v1/completions", {"prompt": "x", "logits_processors": ["f"]}, "logits_processors", "not supported"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", ""),
    ("/v1/chat/completions", {"messages": USER, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
    ("/v1/completions", {"prompt": "x", "bad_words": [" "]}, "bad_words", "blank"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["a"] * 17}, "bad_words", "at most 16"),
    ("/v1/chat/completions", {"messages": USER, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [5, 320]}, "allowed_token_ids", "[0, 320)"),
    ("/v1/chat/completions", {"messages": USER, "allowed_token_ids": [-1]}, "allowed_token_ids", ""),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": "maybe"}}, ANY, ""),
    ("/v1/completions", {"prompt": "x", "priority": "high"}, "priority", ""),
    ("/v1/completions", {"prompt": []}, "prompt", "empty"),
    ("/v1/completions", {"prompt": ""}, ANY, "empty"),
    ("/v1/completions", {"prompt": [[]]}, ANY, "empty"),
    ("/v1/completions", {"prompt": [5, -1]}, ANY, "[0, 320)"),
    ("/v1/completions", {"prompt": [5, 320]}, ANY, "[0, 320)"),
    ("/v1/completions", {"prompt": [[5], [7, 10**20]]}, ANY, "[0, 320)"),
    ("/v1/completions", {"prompt": [1, "a"]}, ANY, ""),
    ("/v1/completions", {"prompt": {"text": "x"}}, ANY, ""),
    ("/v1/completions", {"prompt": ["x"] * 1025}, ANY, "1024"),
    ("/v1/completions", {"max_tokens": 5}, "prompt", "required"),
    ("/v1/chat/completions", {"messages": []}, "messages", ""),
    ("/v1/chat/completions", {"max_tokens": 5}, "messages", "required"),
    ("/v1/chat/completions", {"messages": "Hello"}, ANY, ""),
    ("/v1/chat/completions", {"messages": [{"role": "", "content": "x"}]}, "messages.0.role", ""),
    ("/v1/chat/completions", {"messages": [{"role": 5, "content": "x"}]}, "messages.0.role", ""),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role", ""),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", ""),  # no 'str' tag
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        ANY,
        "",
    ),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", ""),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", ""),
    ("/v1/chat/completions", {"messages": USER, "n": 0}, "n", ""),
    ("/v1/chat/completions", {"messages": USER, "temperature": 2.5}, "temperature", ""),
    ("/v1/chat/completions", {"messages": USER, "stop": [""]}, "stop", ""),
    (
        "/v1/chat/completions",
        {"messages": USER, "chat_template_kwargs": {"add_generation_prompt": True}},
        "chat_template_kwargs",
        "must not set add_generation_prompt",
    ),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
     "chat_template_kwargs", "must not set chat_template"),
    ("/tokenize", {"prompt": "x", "messages": USER}, "prompt", "exactly one"),
    ("/tokenize", {}, "prompt", "exactly one"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "[0, 320)"),
    ("/detokenize", {"tokens": "abc"}, "tokens", ""),
]

MALFORMED = [b"{", b'{"prompt": "x",}', b'{"prompt": "x"} trailing', b"\xff\xfe\x00", b"{'prompt': 'x'}"]
NOT_AN_OBJECT = [b"[1, 2]", b"null", b'"prompt"', b"42", b"", b"[" * 50_000]


def assert_error(r: httpx.Response, status: int, type_: str | None = None, code=ANY, param=ANY) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    if type_ is not None:
        assert err["type"] == type_
    if code is not ANY:
        assert err["code"] == code
    if param is not ANY:
        assert err["param"] == param, err
    return err


def check_bad_request(server, path: str, body: dict, param, text: str, stream: bool = False) -> None:
    if path.startswith("/v1/"):
        body = {"model": MODEL, **body}
        if stream:
            body["stream"] = True
    r = server.post(path, json=body, timeout=30)
    err = assert_error(r, 400, "invalid_request_error", param=param)
    if param is ANY:
        assert err["param"] is None or isinstance(err["param"], str)
    assert text in err["message"], err


# ---- 400 ------------------------------------------------------------------------------------
CASES = [(*case, False) for case in BAD_REQUESTS] + [  # (beam search never streams: its own cases say so)
    (*case, True) for case in BAD_REQUESTS if case[0].startswith("/v1/") and "use_beam_search" not in case[1]
]


@pytest.mark.parametrize("path,body,param,text,stream", CASES,
                         ids=[f"{i}{'-stream' if c[-1] else ''}" for i, c in enumerate(CASES)])  # fmt: skip
def test_invalid_parameters_are_400(server, path, body, param, text, stream):
    check_bad_request(server, path, body, param, text, stream)


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", temperature=3)
    assert e.value.status_code == 400 and e.value.param == "temperature" and e.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "", "content": "x"}])  # type: ignore
    assert e.value.param == "messages.0.role"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, stream=True, n=0)
    assert e.value.param == "n"


@pytest.mark.parametrize("raw", MALFORMED)
def test_malformed_json_is_400(server, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = server.post(path, content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400, "invalid_request_error")
        assert "JSON" in r.json()["error"]["message"] or "pars" in r.json()["error"]["message"]


@pytest.mark.parametrize("raw", NOT_AN_OBJECT, ids=["list", "null", "string", "number", "empty", "deep"])
def test_body_not_an_object_is_400(server, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert_error(server.post(path, content=raw, headers={"content-type": "application/json"}), 400,
                     "invalid_request_error")  # fmt: skip


def test_unknown_fields_are_ignored(client):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"some_vendor_field": 1})
    assert r.usage.completion_tokens <= 2


def test_unsupported_features_refused_with_their_code(client):
    """response_format types and tool choices arcserve cannot honour get code "unsupported" (the
    OpenAI client raises), while the values that ask for nothing are served: response_format text,
    no tools, tool_choice none/auto."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, response_format={"type": "structural_tag"})
    assert e.value.param == "response_format" and e.value.code == "unsupported"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, stream=True,
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])  # fmt: skip
    assert e.value.param == "tool_choice" and e.value.code == "unsupported"
    for extra in ({"response_format": {"type": "text"}}, {"tools": [], "tool_choice": "none"}, {"tool_choice": "auto"}):
        r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, temperature=0, **extra)
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 2
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"response_format": {"type": "text"}})
    assert r.usage.completion_tokens <= 2


# ---- prompts longer than max_model_len ------------------------------------------------------
def long_text(hf, min_tokens: int) -> tuple[str, int]:
    text = "The quick brown fox jumps over the lazy dog. "
    while len(hf.tok.encode(text)) < min_tokens:
        text += text
    return text, len(hf.tok.encode(text))


def assert_too_long(r: httpx.Response, *numbers: int) -> None:
    err = assert_error(r, 400, "invalid_request_error", code="context_length_exceeded")
    for n in numbers:
        assert str(n) in err["message"], (n, err["message"])


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_max_model_len(server, hf, stream):
    text, n = long_text(hf, 300)
    base = {"model": MODEL, "stream": stream}
    assert_too_long(server.post("/v1/completions", json={**base, "prompt": text}), 256, n)
    assert_too_long(server.post("/v1/completions", json={**base, "prompt": text, "max_tokens": None}), 256, n)
    ids = [5] * 256  # exactly max_model_len: no room for one generated token
    assert_too_long(server.post("/v1/completions", json={**base, "prompt": ids, "max_tokens": None}), 256)
    messages = [{"role": "user", "content": text}]
    chat_len = len(hf.chat_ids(messages))
    assert_too_long(server.post("/v1/chat/completions", json={**base, "messages": messages}), 256, chat_len)
    # max_tokens over max_model_len, whatever the prompt
    for path, body in [("/v1/completions", {"prompt": "Paris is"}), ("/v1/chat/completions", {"messages": USER})]:
        assert_too_long(server.post(path, json={**base, **body, "max_tokens": 257}), 256, 257)
    chat = {**base, "messages": USER, "max_completion_tokens": 300}
    assert_too_long(server.post("/v1/chat/completions", json=chat), 256, 300)
    # one prompt of a batch too long: the whole request is refused and nothing is left running
    assert_too_long(server.post("/v1/completions", json={**base, "prompt": ["Paris is", text]}), 256, n)
    server.wait_idle()


def test_prompt_at_the_limit_is_served(client):
    """A prompt that leaves room for fewer tokens than max_tokens asks for is served up to the
    context's end (finish_reason "length"), as vLLM's server does; completions' null max_tokens is
    the default 16."""
    for plen, max_tokens, expect in [(255, None, 1), (255, 1, 1), (250, 6, 6), (200, None, 16), (250, 16, 6),
                                     (250, 256, 6), (100, 200, 156)]:  # fmt: skip
        r = client.completions.create(model=MODEL, prompt=[7] * plen, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
        assert r.usage.prompt_tokens == plen and r.usage.completion_tokens == expect
        assert r.choices[0].finish_reason == "length"
    for max_tokens in (250, 256):  # chat too
        r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=max_tokens, temperature=0,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        assert r.usage.total_tokens == 256 and r.choices[0].finish_reason == "length"


def test_openai_client_context_length_error(client, hf):
    text, _ = long_text(hf, 300)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}])
    assert e.value.code == "context_length_exceeded"


# ---- 404 / 405 ------------------------------------------------------------------------------
def test_unknown_model_is_404(server, client):
    for path, body in [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": USER}),
                       ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})]:  # fmt: skip
        for stream in (False, True) if path.startswith("/v1/") else (False,):
            r = server.post(path, json={**body, "model": "gpt-4", "stream": stream})
            err = assert_error(r, 404, "not_found_error", code="model_not_found", param="model")
            assert "gpt-4" in err["message"] and MODEL in err["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=USER)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")


def test_unknown_route_and_method(server):
    assert_error(httpx.get(f"{server.base}/v1/nothing", timeout=5), 404)
    assert_error(httpx.post(f"{server.base}/v1/engines/x/completions", json={}, timeout=5), 404)
    assert_error(httpx.get(f"{server.v1}/completions", timeout=5), 405)


# ---- 401 ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(llama_dir):
    with serve(llama_dir, api_key=API_KEY) as s:
        yield s


def test_api_key_required(keyed):
    good = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    wrong_headers = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"},
                     {"Authorization": API_KEY}, {"Authorization": "Bearer"}, {"Authorization": f"Bearer {API_KEY}x"},
                     {"X-API-Key": API_KEY}]  # fmt: skip
    for headers in wrong_headers:
        for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/completions", good),
                                   ("POST", "/v1/chat/completions", {"model": MODEL, "messages": USER}),
                                   ("POST", "/tokenize", {"prompt": "x"}),
                                   ("POST", "/v1/completions", {"prompt": 5})]:  # fmt: skip
            r = httpx.request(method, keyed.base + path, json=body, headers=headers, timeout=10)
            assert_error(r, 401, "authentication_error", code="invalid_api_key")
    for scheme in ("Bearer", "bearer"):
        r = httpx.post(f"{keyed.v1}/completions", json=good, headers={"Authorization": f"{scheme} {API_KEY}"},
                       timeout=30)  # fmt: skip
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_several_api_keys():
    """--api-key k1 k2 (vLLM's): any of the keys opens the API, nothing else does."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from arcserve.api.middleware import APIKeyMiddleware

    app = APIKeyMiddleware(Starlette(routes=[Route("/v1/models", lambda _: PlainTextResponse("ok"))]), ["k1", "k2"])
    with TestClient(app) as c:
        codes = [c.get("/v1/models", headers={"Authorization": f"Bearer {k}"}).status_code for k in ("k1", "k2", "k", "")]
    assert codes == [200, 200, 401, 401]


def test_open_paths_without_key(keyed):
    for path in ("/health", "/metrics", "/ping", "/version"):
        assert httpx.get(keyed.base + path, timeout=10).status_code == 200, path
    assert "arcserve:num_requests_running" in httpx.get(f"{keyed.base}/metrics", timeout=10).text


def test_openai_client_with_and_without_key(keyed):
    with pytest.raises(openai.AuthenticationError) as e:
        keyed.client(api_key="wrong").models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        keyed.client(api_key="wrong").chat.completions.create(model=MODEL, messages=USER, stream=True)
    c = keyed.client()
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


# ---- 503 ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small(llama_dir):
    """One sequence at a time and at most 2 waiting: the rest is refused with 503."""
    with serve(llama_dir, max_waiting_requests=2, max_num_seqs=1) as s:
        yield s


def test_overload_is_503_with_retry_after(small):
    body = {
        "model": MODEL,
        "prompt": "The quick brown fox",
        "max_tokens": 48,
        "temperature": 0,
        "ignore_eos": True,
    }
    solo = small.post("/v1/completions", json=body).json()["choices"][0]["text"]
    small.wait_idle()
    n = 12
    barrier = threading.Barrier(n)

    def one(i: int) -> httpx.Response:
        barrier.wait(timeout=10)
        return small.post("/v1/completions", json={**body, "stream": i % 2 == 1}, timeout=60)

    with ThreadPoolExecutor(n) as ex:
        results = list(ex.map(one, range(n)))
    refused = [r for r in results if r.status_code == 503]
    served = [r for r in results if r.status_code == 200]
    assert len(refused) + len(served) == n, [r.status_code for r in results]
    assert refused and served
    for r in refused:
        err = assert_error(r, 503, "service_unavailable", code="overloaded")
        assert "overloaded" in err["message"].lower()
        assert int(r.headers["retry-after"]) >= 1
    for i, r in enumerate(results):
        if r.status_code != 200:
            continue
        if i % 2:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            assert "".join(e["choices"][0]["text"] for e in events) == solo
        else:
            assert r.json()["choices"][0]["text"] == solo and r.json()["usage"]["completion_tokens"] == 48
    # overload passes: nothing is left behind and the next request is served
    small.wait_idle()
    assert small.post("/v1/completions", json=body).json()["choices"][0]["text"] == solo


def test_openai_client_sees_503(small):
    c = small.client()
    n = 8
    barrier = threading.Barrier(n)

    def one(_i: int):
        barrier.wait(timeout=10)
        try:
            return c.completions.create(model=MODEL, prompt="x", max_tokens=48, temperature=0,
                                        extra_body={"ignore_eos": True})  # fmt: skip
        except openai.APIStatusError as e:
            return e

    with ThreadPoolExecutor(n) as ex:
        results = list(ex.map(one, range(n)))
    errors = [r for r in results if isinstance(r, Exception)]
    assert errors and len(errors) < n
    for e in errors:
        assert isinstance(e, openai.InternalServerError) and e.status_code == 503 and e.code == "overloaded"
        assert e.response.headers["retry-after"] == "1"
    assert all(r.usage.completion_tokens == 48 for r in results if not isinstance(r, Exception))
    small.wait_idle()


@pytest.fixture(scope="module")
def no_queue(llama_dir):
    """max_waiting_requests=0: requests that would have to wait are refused, the others run."""
    with serve(llama_dir, max_waiting_requests=0, max_num_seqs=1) as s:
        yield s


def test_max_waiting_requests_zero_still_serves(no_queue):
    """503 means more than max_waiting_requests are waiting; an idle server with max_waiting_requests=0
    has nobody waiting and must serve a lone request, and a burst gets some answers and some 503s."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    no_queue.wait_idle()
    r = no_queue.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    n = 6
    barrier = threading.Barrier(n)

    def one(_i: int) -> httpx.Response:
        barrier.wait(timeout=10)
        return no_queue.post("/v1/completions", json=body)

    with ThreadPoolExecutor(n) as ex:
        codes = sorted(r.status_code for r in ex.map(one, range(n)))
    assert codes[0] == 200 and codes[-1] == 503, codes
    no_queue.wait_idle()


# ---- user errors never disturb others ----------------------------------------------------------
def test_bad_requests_during_a_long_stream(server):
    """Every kind of bad request, each sent while a long stream is running: all 4xx (never 500), and the
    stream completes with exactly its solo greedy text."""
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 230, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    bad: list = [(p, b) for p, b, _, _ in BAD_REQUESTS] + [("raw", m) for m in MALFORMED + NOT_AN_OBJECT]
    bad += [("/v1/completions", {"model": "nope", "prompt": "x"}), ("get", "/v1/completions")]
    events = []
    with httpx.Client(timeout=60) as hc, hc.stream("POST", f"{server.v1}/completions", json=body) as stream:
        assert stream.status_code == 200
        lines = (line for line in stream.iter_lines() if line)

        def next_event():
            line = next(lines)
            assert line.startswith("data: {"), line  # neither [DONE] nor anything else yet
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            events.append(ev)
            return ev

        next_event()
        for path, b in bad:
            if path == "raw":
                r = server.post("/v1/completions", content=b, headers={"content-type": "application/json"})
            elif path == "get":
                r = httpx.get(server.base + b, timeout=10)
            else:
                r = server.post(path, json={"model": MODEL, **b} if path.startswith("/v1/") else b)
            assert 400 <= r.status_code < 500, (path, b, r.status_code, r.text)
            # the stream is still going: its next event is an ordinary (unfinished) chunk
            ev = next_event()
            assert ev["choices"] and ev["choices"][0]["finish_reason"] is None
        events += sse_lines(lines)
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert events[-1]["usage"]["completion_tokens"] == 230
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    solo = server.post("/v1/completions", json={**body, "stream": False, "stream_options": None}).json()
    solo = solo["choices"][0]["text"]
    assert "".join(texts) == solo
    assert httpx.get(f"{server.base}/health", timeout=5).status_code == 200
    server.wait_idle()


def test_no_state_left_by_errors(server):
    """After all the refused requests nothing runs, waits or holds KV blocks, and no abort is counted
    for a request that never started."""
    before = server.wait_idle()
    for path, body, _, _ in BAD_REQUESTS:
        batch = (
            isinstance(body.get("prompt"), list) and body["prompt"] and isinstance(body["prompt"][0], list)
        )
        if path.startswith("/v1/") and not batch:  # (a batch may start its good prompts before refusing)
            assert server.post(path, json={"model": MODEL, **body}).status_code == 400
    after = server.wait_idle()
    for reason in ("stop", "length", "abort"):
        key = ("arcserve:request_success_total", (("finished_reason", reason), ("model_name", MODEL)))
        assert after[key] == before[key], reason
