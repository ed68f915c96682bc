"""Structured outputs and forced tool calls through the server: response_format, structured_outputs
and the guided_* fields give transformers' greedy tokens under the grammar (tiny_models.grammar_greedy),
streamed answers equal whole ones, and tool_choice "required" / a named function answer with
tool_calls (OpenAI's and vLLM's form). Bad constraints are 400s (test_errors.py)."""

from __future__ import annotations

import json
import re

import pytest
from tiny_models import grammar_greedy

from arcserve import StructuredOutputsParams

from .helpers import MODEL

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"], "additionalProperties": False,
}  # fmt: skip
USER = [{"role": "user", "content": "The quick brown fox?"}]
WEATHER = {"type": "function", "function": {"name": "weather", "description": "a city's weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Berlin"]}, "days": {"type": "integer", "minimum": 1,
                                                                                     "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}  # fmt: skip
CLOCK = {"type": "function", "function": {"name": "clock"}}  # no parameters: an empty object
# (a random model may write JSON's whitespace without end; vLLM's option keeps the tests' calls short)
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


def oracle(hf, llama_dir, prompt_ids: list[int], so: StructuredOutputsParams, max_tokens: int) -> list[int]:
    return grammar_greedy(hf.model, llama_dir, prompt_ids, so, max_tokens)


# (request fields, the constraint they mean)
CASES = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": True}},
     StructuredOutputsParams(json_object=True, disable_any_whitespace=True)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_regex": "[a-z]{3,6}!"}, StructuredOutputsParams(regex="[a-z]{3,6}!")),
    ({"guided_choice": ["fox", "dog", "lazy cat"]}, StructuredOutputsParams(choice=["fox", "dog", "lazy cat"])),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, StructuredOutputsParams(grammar='root ::= "yes" | "no"')),
]  # fmt: skip


@pytest.mark.parametrize("i", range(len(CASES)))
def test_constrained_answers_are_transformers_tokens_under_the_grammar(server, hf, llama_dir, i):
    fields, so = CASES[i]
    for path, body in (("/v1/completions", {"prompt": "Paris is"}), ("/v1/chat/completions", {"messages": USER})):
        r = server.post(path, json={"model": MODEL, "max_tokens": 30, "temperature": 0, "return_token_ids": True,
                                    **body, **fields})  # fmt: skip
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        got = choice["token_ids"]
        want = oracle(hf, llama_dir, out.get("prompt_token_ids") or choice["prompt_token_ids"], so, 30)
        assert got == want[: len(got)] and (choice["finish_reason"] == "length" or got == want), (path, got, want)
        text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
        if choice["finish_reason"] == "stop" and so.kind in ("json", "json_object"):
            assert isinstance(json.loads(text), dict)


def test_streamed_constrained_answers_equal_whole_ones(server, client):
    fields = {"guided_regex": "[a-z ]{2,12}[.!]", "max_tokens": 20, "temperature": 0}
    whole = client.chat.completions.create(model=MODEL, messages=USER, extra_body=fields)
    stream = client.chat.completions.create(model=MODEL, messages=USER, stream=True, extra_body=fields)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    assert re.fullmatch("[a-z ]{2,12}[.!]", text)


def test_sampled_choices_each_follow_the_constraint(client):
    r = client.completions.create(model=MODEL, prompt="Paris is", n=12, temperature=1.5, seed=5, max_tokens=10,
                                  extra_body={"guided_choice": ["fox", "dog", "lazy cat"]})  # fmt: skip
    texts = [c.text for c in r.choices]
    assert set(texts) <= {"fox", "dog", "lazy cat"} and len(set(texts)) > 1
    assert all(c.finish_reason == "stop" for c in r.choices)


def _stream_calls(stream) -> tuple[dict, dict]:
    """A streamed chat's tool_calls deltas accumulated per choice and call index; finish reasons."""
    calls: dict = {}
    reasons: dict = {}
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                call = calls.setdefault((c.index, d.index), {"id": None, "name": None, "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] = d.function.name or call["name"]
                    call["arguments"] += d.function.arguments or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return calls, reasons


def test_a_named_function_is_called(client):
    choice = {"type": "function", "function": {"name": "weather"}}
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER, CLOCK], tool_choice=choice,
                                       max_tokens=40, temperature=0, extra_body=COMPACT)  # fmt: skip
    m = r.choices[0].message
    assert m.content == "" and len(m.tool_calls) == 1 and r.choices[0].finish_reason == "stop"
    call = m.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("chatcmpl-tool-")
    assert set(args) == {"city", "days"} and args["city"] in ("Paris", "Berlin") and 1 <= args["days"] <= 7
    calls, reasons = _stream_calls(client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=40, temperature=0, stream=True,
        extra_body=COMPACT))  # fmt: skip
    assert list(calls) == [(0, 0)] and reasons == {0: "stop"}
    assert calls[0, 0]["name"] == "weather" and calls[0, 0]["arguments"] == call.function.arguments
    assert calls[0, 0]["id"].startswith("chatcmpl-tool-")


@pytest.mark.parametrize("parallel", [None, False])
def test_required_tool_calls(client, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    kw = dict(model=MODEL, messages=USER, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=80, n=4,
              temperature=1.0, seed=9, extra_body=COMPACT, **extra)  # fmt: skip
    r = client.chat.completions.create(**kw)
    seen = set()
    for c in r.choices:
        if c.finish_reason == "length":  # cut short: the text stays as content
            assert not c.message.tool_calls and c.message.content
            continue
        assert c.finish_reason == "tool_calls" and c.message.content == "" and c.message.tool_calls
        assert parallel is not False or len(c.message.tool_calls) == 1
        for call in c.message.tool_calls:
            args = json.loads(call.function.arguments)
            seen.add(call.function.name)
            if call.function.name == "weather":
                assert set(args) == {"city", "days"}
            else:
                assert call.function.name == "clock" and isinstance(args, dict)
    assert seen
    calls, reasons = _stream_calls(client.chat.completions.create(**kw, stream=True))
    for c in r.choices:  # the same seeds: the same calls, sent whole when the choice ends
        assert reasons[c.index] == c.finish_reason
        for j, call in enumerate(c.message.tool_calls or []):
            got = calls[c.index, j]
            assert (got["name"], got["arguments"]) == (call.function.name, call.function.arguments)
