"""The OpenAI-compatible endpoints on a real uvicorn server, through the official `openai` client and
raw HTTP: models list, completions and chat (texts = transformers' greedy continuation), streaming =
non-streaming, n > 1, stop strings and stop tokens, logprobs (values = transformers'), exact usage,
tokenize/detokenize, health/ping/version and the Prometheus counters."""

from __future__ import annotations

import httpx
import openai
import pytest
from tiny_models import beam_reference, copy_with_bos_tokenizer, text_of

from .helpers import MODEL, serve, sse_data

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of"]
UNICODE = "Unicode: café, naïve, 東京, Привет 🙂"
GREEDY = {"temperature": 0}
NO_EOS = {"ignore_eos": True}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
# greedy answers that end with EOS (id 2) after some tokens (checked against transformers below)
EOS_PROMPT = PROMPTS[1]
EOS_MESSAGES = [{"role": "user", "content": "Tell me about dog and lazy"}]


def usage_of(u) -> tuple[int, int, int]:
    return (u.prompt_tokens, u.completion_tokens, u.total_tokens)


def collect_completion_stream(stream) -> tuple[dict, dict, object]:
    """Streamed completion chunks -> ({index: text}, {index: finish_reason}, usage)."""
    texts, finish, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == [] and usage is None
            usage = chunk.usage
        for c in chunk.choices:
            assert c.index not in finish, "text after the finish chunk"
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


def collect_chat_stream(stream) -> tuple[dict, dict, object]:
    texts, finish, usage, roles = {}, {}, None, {}
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk" and chunk.model == MODEL
        if chunk.usage is not None:
            assert chunk.choices == [] and usage is None
            usage = chunk.usage
        for c in chunk.choices:
            assert c.index not in finish, "content after the finish chunk"
            if c.delta.role is not None:
                roles[c.index] = c.delta.role
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert set(roles.values()) == {"assistant"} and set(roles) == set(texts)
    return texts, finish, usage


# ---- models, basic completions and chat -------------------------------------------------------
def test_models_list(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model" and models.data[0].owned_by == "arcserve"
    raw = httpx.get(f"{server.v1}/models", timeout=10).json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == 256


def test_completions_equal_transformers_greedy(client, hf):
    for prompt in [*PROMPTS, UNICODE]:
        ids = hf.tok.encode(prompt)
        expected = hf.greedy(ids, 20)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, extra_body=NO_EOS, **GREEDY)
        assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
        (choice,) = r.choices
        assert choice.index == 0 and choice.finish_reason == "length"
        assert choice.text == text_of(hf.tok, expected, skip_special_tokens=True)
        assert usage_of(r.usage) == (len(ids), 20, len(ids) + 20)


def test_completion_prompt_forms(client, hf):
    """A token-id prompt and a list of prompts (text and ids) answer like the single text prompts."""
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, **GREEDY, extra_body=NO_EOS)
              for p in PROMPTS]  # fmt: skip
    ids = [hf.tok.encode(p) for p in PROMPTS]
    by_ids = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=8, **GREEDY, extra_body=NO_EOS)
    assert by_ids.choices[0].text == single[0].choices[0].text
    assert usage_of(by_ids.usage) == usage_of(single[0].usage)
    for batch in (PROMPTS, ids):
        many = client.completions.create(model=MODEL, prompt=batch, max_tokens=8, **GREEDY, extra_body=NO_EOS)
        assert [c.index for c in many.choices] == [0, 1, 2]
        assert [c.text for c in many.choices] == [s.choices[0].text for s in single]
        plen = sum(len(i) for i in ids)
        assert usage_of(many.usage) == (plen, 24, plen + 24)


def test_chat_equals_transformers_greedy(client, hf):
    ids = hf.chat_ids(MESSAGES)
    expected = hf.greedy(ids, 20)
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, **GREEDY, extra_body=NO_EOS
    )
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == text_of(hf.tok, expected, skip_special_tokens=True)
    assert usage_of(r.usage) == (len(ids), 20, len(ids) + 20)
    # content given as a text part renders the same prompt (several parts: one per line, below);
    # max_completion_tokens is max_tokens' new name
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": MESSAGES[1]["content"]}]}]
    r2 = client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=20, **GREEDY,
                                        extra_body=NO_EOS)  # fmt: skip
    assert r2.choices[0].message.content == choice.message.content
    assert usage_of(r2.usage) == usage_of(r.usage)


def test_default_max_tokens_and_eos(client, hf):
    """Completions default to 16 tokens, max_tokens null included (as vLLM's server); without
    max_tokens chat runs until EOS (finish 'stop', the EOS token counted in usage but not shown)."""
    for max_tokens in (openai.NOT_GIVEN, None):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=max_tokens, extra_body=NO_EOS,
                                      **GREEDY)  # fmt: skip
        assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    for kind, ids in [("chat", hf.chat_ids(EOS_MESSAGES)), ("completion", hf.tok.encode(EOS_PROMPT))]:
        cont = hf.greedy(ids, 256 - len(ids))
        assert 2 in cont  # precondition: this prompt's greedy answer reaches EOS
        n = cont.index(2) + 1
        if kind == "chat":
            r = client.chat.completions.create(model=MODEL, messages=EOS_MESSAGES, **GREEDY)
            text = r.choices[0].message.content
        else:
            r = client.completions.create(model=MODEL, prompt=EOS_PROMPT, max_tokens=256 - len(ids), **GREEDY)
            text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] is None
        assert usage_of(r.usage) == (len(ids), n, len(ids) + n)
        assert text == text_of(hf.tok, cont[: n - 1], skip_special_tokens=True)
        # ignore_eos runs past it
        long = client.completions.create(
            model=MODEL, prompt=ids, max_tokens=n + 5, **GREEDY, extra_body=NO_EOS
        )
        assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == n + 5


# ---- streaming == non-streaming -----------------------------------------------------------------
COMPLETION_CASES = {
    "greedy": dict(prompt=PROMPTS[0], max_tokens=40, **GREEDY, extra_body=NO_EOS),
    "n3_seeded": dict(prompt=PROMPTS[1], max_tokens=24, n=3, temperature=0.9, seed=11, extra_body=NO_EOS),
    "batch": dict(prompt=PROMPTS, max_tokens=12, **GREEDY, extra_body=NO_EOS),
    "batch_n2": dict(prompt=PROMPTS[:2], max_tokens=12, n=2, temperature=1.0, seed=5, extra_body=NO_EOS),
    "echo": dict(prompt=PROMPTS[2], max_tokens=12, echo=True, **GREEDY, extra_body=NO_EOS),
    "stop": dict(prompt=PROMPTS[0], max_tokens=40, stop=[" ", "e"], **GREEDY, extra_body=NO_EOS),
    "until_eos": dict(prompt=EOS_PROMPT, max_tokens=200, **GREEDY),
    "unicode": dict(prompt=UNICODE, max_tokens=40, **GREEDY, extra_body=NO_EOS),
}
FINISH = {"stop": "stop", "until_eos": "stop"}  # the others end by length


@pytest.mark.parametrize("case", list(COMPLETION_CASES))
def test_completion_stream_equals_non_stream(client, case):
    kw = COMPLETION_CASES[case]
    full = client.completions.create(model=MODEL, **kw)
    stream = client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw)
    texts, finish, usage = collect_completion_stream(stream)
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    assert set(finish.values()) == {FINISH.get(case, "length")}
    assert usage_of(usage) == usage_of(full.usage)
    assert len(full.choices) == kw.get("n", 1) * (len(kw["prompt"]) if isinstance(kw["prompt"], list) else 1)


CHAT_CASES = {
    "greedy": dict(messages=MESSAGES, max_tokens=40, **GREEDY, extra_body=NO_EOS),
    "n2_seeded": dict(messages=MESSAGES, max_tokens=24, n=2, temperature=0.8, seed=3, extra_body=NO_EOS),
    "stop": dict(messages=MESSAGES, max_tokens=40, stop="a", **GREEDY, extra_body=NO_EOS),
    "until_eos": dict(messages=EOS_MESSAGES, **GREEDY),
    "unicode": dict(
        messages=[{"role": "user", "content": "東京 🙂 café"}], max_tokens=40, **GREEDY, extra_body=NO_EOS
    ),
}


def test_truncate_prompt_tokens(client, hf):
    """A prompt longer than max_model_len (256) is cut to its last k tokens before the length checks:
    usage, echo and the tokens are those of the cut prompt."""
    ids = [(7 * i) % 300 + 3 for i in range(300)]
    expected = hf.greedy(ids[-100:], 6)
    room = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, **GREEDY,
                                     extra_body={**NO_EOS, "truncate_prompt_tokens": -1})  # fmt: skip
    assert room.usage.prompt_tokens == 240 and room.usage.completion_tokens == 16  # room for max_tokens
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, echo=True, **GREEDY,
                                  extra_body={**NO_EOS, "truncate_prompt_tokens": 100})  # fmt: skip
    assert r.usage.prompt_tokens == 100
    assert r.choices[0].text == hf.tok.decode(ids[-100:]) + text_of(hf.tok, expected)
    conv = [{"role": "user", "content": "word " * 400}]
    r = client.chat.completions.create(model=MODEL, messages=conv, **GREEDY,
                                       extra_body={**NO_EOS, "truncate_prompt_tokens": -1})  # fmt: skip
    assert r.usage.prompt_tokens == 255 and r.usage.completion_tokens == 1  # max_model_len - 1, one token left
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=6)
    assert e.value.code == "context_length_exceeded"


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_return_token_ids(server, hf, path):
    """vLLM's return_token_ids: the prompt's token ids (completions: in each choice; chat: at the top)
    and each choice's generated ids; streamed, every chunk has its new ids (chunks are not skipped
    for tokens without text) and the prompt's come once, first."""
    chat = path == "/chat/completions"
    prompt_ids = hf.chat_ids(MESSAGES) if chat else hf.tok.encode(PROMPTS[1])
    want = hf.greedy(prompt_ids, 12)
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "n": 2, "return_token_ids": True,
            **({"messages": MESSAGES} if chat else {"prompt": PROMPTS[1]})}  # fmt: skip
    r = httpx.post(f"{server.v1}{path}", json=body, timeout=30).json()
    for c in r["choices"]:
        assert c["token_ids"] == want and (chat or c["prompt_token_ids"] == prompt_ids)
    assert not chat or r["prompt_token_ids"] == prompt_ids
    with httpx.stream("POST", f"{server.v1}{path}", json={**body, "stream": True}, timeout=30) as resp:
        events = sse_data(resp)
    got: dict = {0: [], 1: []}
    for e in events:
        for c in e["choices"]:
            got[c["index"]] += c.get("token_ids") or []
            if not chat and "prompt_token_ids" in c:
                assert c["prompt_token_ids"] == prompt_ids and not got[c["index"]][: -len(c["token_ids"]) or None]
    assert got == {0: want, 1: want}
    if chat:
        assert events[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in e for e in events[1:])
    else:
        assert sum("prompt_token_ids" in c for e in events for c in e["choices"]) == 2
    plain = httpx.post(f"{server.v1}{path}", json={**body, "return_token_ids": None}, timeout=30).json()
    assert all("token_ids" not in c for c in plain["choices"]) and "prompt_token_ids" not in plain


def test_return_tokens_as_token_ids(server, hf):
    """vLLM's return_tokens_as_token_ids: logprobs name each token (and its alternatives) "token_id:<id>",
    streamed or not, echoed prompt included; text offsets add up those names."""
    ids = hf.tok.encode(PROMPTS[0])
    want = hf.greedy(ids, 6)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "return_tokens_as_token_ids": True}  # fmt: skip
    lp = httpx.post(f"{server.v1}/completions", json=body, timeout=30).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in want]
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(want))]
    with httpx.stream("POST", f"{server.v1}/completions", json={**body, "stream": True}, timeout=30) as r:
        streamed = [t for e in sse_data(r) for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]
    echoed = httpx.post(f"{server.v1}/completions", json={**body, "echo": True}, timeout=30).json()
    assert echoed["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids + want]
    chat = httpx.post(f"{server.v1}/chat/completions", timeout=30, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": True,
        "top_logprobs": 2, "return_tokens_as_token_ids": True}).json()  # fmt: skip
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in hf.greedy(hf.chat_ids(MESSAGES), 4)]
    assert all(c["bytes"] == list(c["token"].encode()) and len(c["top_logprobs"]) == 2 for c in content)


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_continuous_usage_stats(server, path):
    """stream_options.continuous_usage_stats (with include_usage): every chunk carries the usage so
    far, the completion count never falls and ends at the final usage chunk's; without it, only
    the final chunk has usage."""
    body = {"model": MODEL, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": True, "n": 2,
            **({"prompt": PROMPTS[0]} if path == "/completions" else {"messages": MESSAGES})}  # fmt: skip
    for continuous in (True, False):
        opts = {"include_usage": True, "continuous_usage_stats": continuous}
        with httpx.stream("POST", f"{server.v1}{path}", json={**body, "stream_options": opts}, timeout=30) as r:
            events = sse_data(r)
        final = events[-1]
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 20
        if not continuous:
            assert all("usage" not in e for e in events[:-1])
            continue
        per_choice: dict = {}
        for e in events[:-1]:  # each chunk: its choice's usage so far (vLLM's continuous usage)
            assert e["usage"]["prompt_tokens"] == final["usage"]["prompt_tokens"]
            if len(e["choices"]) == 1:
                i = e["choices"][0]["index"]
                assert e["usage"]["completion_tokens"] >= per_choice.get(i, 0)
                per_choice[i] = e["usage"]["completion_tokens"]
        assert per_choice == {0: 10, 1: 10}


def test_chat_continue_final_message(client, hf):
    """continue_final_message (with add_generation_prompt false) continues the last assistant message:
    the prompt is the conversation with that message left open (transformers' rendering)."""
    conv = [*MESSAGES, {"role": "assistant", "content": "Well, the"}]
    text = "".join(f"<s>{m['role']}\n{m['content']}</s>\n" for m in conv)[: -len("</s>\n")]
    ids = hf.tok.encode(text, add_special_tokens=False)
    expected = hf.greedy(ids, 8)
    r = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=8, **GREEDY,
                                       extra_body={**NO_EOS, "continue_final_message": True,
                                                   "add_generation_prompt": False})  # fmt: skip
    assert r.choices[0].message.content == text_of(hf.tok, expected, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=conv, max_tokens=2,
                                       extra_body={"continue_final_message": True})  # fmt: skip
    assert e.value.param == "continue_final_message"


def test_chat_echo(client, hf):
    """echo (vLLM): a continued assistant message's text comes in front of the answer, streamed or not;
    a last message of another role is not echoed."""
    conv = [*MESSAGES, {"role": "assistant", "content": "Well, the"}]
    extra = {**NO_EOS, "continue_final_message": True, "add_generation_prompt": False, "echo": True}
    r = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=8, **GREEDY, extra_body=extra)
    plain = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=8, **GREEDY,
                                           extra_body={**extra, "echo": False})  # fmt: skip
    assert r.choices[0].message.content == "Well, the" + plain.choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=8, **GREEDY, extra_body=extra,
                                            stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content
    user_last = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **GREEDY,
                                               extra_body={**NO_EOS, "echo": True})  # fmt: skip
    assert not user_last.choices[0].message.content.startswith(MESSAGES[-1]["content"])


def test_chat_text_parts_one_per_line(server):
    """Text parts of a message are joined with newlines, as vLLM renders them."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Translate this:"}, {"type": "text", "text": "Bonjour"}]}]
    joined = [{"role": "user", "content": "Translate this:\nBonjour"}]
    ids = [server.post("/tokenize", json={"model": MODEL, "messages": m}).json()["tokens"] for m in (parts, joined)]
    assert ids[0] == ids[1]


TOOL_TEMPLATE = (
    "{% for t in tools or [] %}<tool {{ t.function.name }}>{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.reasoning_content or '' }}|{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}"
)


def test_chat_history_with_tools_and_reasoning_renders_as_vllm(llama_dir):
    """An assistant's tool calls reach the template with their JSON arguments as a mapping (not JSON
    text; text that is no JSON object: {}), and its reasoning (reasoning_content) too; tools are
    rendered when tool_choice is "none" ("auto" refused: no tool-call parser); /tokenize takes
    chat_template_kwargs and tools as a chat request does; text-like parts (refusal, input_text)
    are text; an image part is a clear 400."""
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}},
             {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{bad"}}]  # fmt: skip
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "reasoning_content": "think", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "a", "content": [{"type": "input_text", "text": "20C"}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with serve(llama_dir, app_kw={"chat_template": TOOL_TEMPLATE}) as s:
        want = '<tool f><nothink><user>|hi<assistant>think|f{"city": "Paris"}g{}<tool>|20C<assistant>|no'
        body = {"model": MODEL, "messages": messages, "tools": tools, "chat_template_kwargs": {"enable_thinking": False}}
        ids = s.post("/tokenize", json={**body, "add_generation_prompt": False}).json()["tokens"]
        assert s.post("/detokenize", json={"tokens": ids}).json()["prompt"] == want
        chat = s.post("/v1/chat/completions", json={**body, "tool_choice": "none", "max_tokens": 1})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] >= len(ids)
        refused = s.post("/v1/chat/completions", json={**body, "max_tokens": 1})  # tool_choice "auto"
        assert refused.status_code == 400 and "or 'none'" in refused.json()["error"]["message"]
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
        r = s.post("/v1/chat/completions", json={"model": MODEL, "messages": image, "max_tokens": 1})
        assert r.status_code == 400 and "takes no images or audio" in r.json()["error"]["message"]


def test_template_kwargs_defaults_and_reasoning_effort(llama_dir, capsys):
    """--default-chat-template-kwargs (vLLM's) under each request's chat_template_kwargs; a
    reasoning_effort reaches the template and turns thinking off for "none" (on otherwise) unless
    the request's kwargs say, as vLLM does; the flag takes a JSON object only."""
    from arcserve.cli import build_parser

    template = ("{{ reasoning_effort | default('-') }}{% if enable_thinking is defined and not enable_thinking %}"
                "<nothink>{% endif %}{{ messages[0].content }}")  # fmt: skip
    with serve(llama_dir, app_kw={"chat_template": template, "default_chat_template_kwargs": {"enable_thinking": False}}) as s:
        def rendered(**extra) -> str:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
            ids = s.post("/tokenize", json=body).json()["tokens"]
            return s.post("/detokenize", json={"tokens": ids}).json()["prompt"]

        assert rendered() == "-<nothink>hi"
        assert rendered(chat_template_kwargs={"enable_thinking": True}) == "-hi"
        assert rendered(reasoning_effort="high") == "highhi"
        assert rendered(reasoning_effort="none") == "none<nothink>hi"
        assert rendered(reasoning_effort="low", chat_template_kwargs={"enable_thinking": False}) == "low<nothink>hi"
        r = s.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 1, "reasoning_effort": "none"})  # fmt: skip
        assert r.status_code == 200
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--default-chat-template-kwargs", "[1]"])
    assert "must be a dict" in capsys.readouterr().err
    ns = build_parser().parse_args(["serve", "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    assert ns.default_chat_template_kwargs == {"enable_thinking": False}


def test_developer_role_renders_as_system(server):
    """A "developer" message (OpenAI's newer name for "system") renders as a system message where the
    chat template does not name the role, as vLLM's server renders it."""
    def ids(role: str) -> list[int]:
        messages = [{"role": role, "content": "Be terse."}, {"role": "user", "content": "Hi"}]
        return server.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]

    assert ids("developer") == ids("system")


def test_response_role(llama_dir):
    """vLLM's --response-role: answers after a generation prompt carry it (streamed too); a continued
    last message keeps that message's role, and echo repeats the message with the answer's role."""
    msgs = [{"role": "user", "content": "hi"}]
    with serve(llama_dir, app_kw={"response_role": "bot"}) as s:
        body = {"model": MODEL, "messages": msgs, "max_tokens": 2}
        assert s.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["role"] == "bot"
        first = sse_data(s.post("/v1/chat/completions", json={**body, "stream": True}))[0]
        assert first["choices"][0]["delta"]["role"] == "bot"
        cont = {**body, "add_generation_prompt": False, "continue_final_message": True, "echo": True}
        msg = s.post("/v1/chat/completions", json=cont).json()["choices"][0]["message"]
        assert msg["role"] == "user" and msg["content"].startswith("hi")
        echo = {**body, "messages": msgs + [{"role": "bot", "content": "Hello"}], "echo": True}
        assert s.post("/v1/chat/completions", json=echo).json()["choices"][0]["message"]["content"].startswith("Hello")


def test_chat_text_parts_as_the_template_reads_them(llama_dir):
    """A template that loops over a message's content gets the text parts as parts (vLLM's
    --chat-template-content-format auto); "string" joins them for it, "openai" passes them on."""
    from arcserve.api.server import read_chat_template

    looping = read_chat_template("{% for m in messages %}[{% for p in m['content'] %}({{ p.text }}){% endfor %}]"
                                 "{% endfor %}")  # fmt: skip
    printing = read_chat_template("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Translate"}, {"type": "text", "text": "Bonjour"}]}]

    def rendered(s) -> list[int]:
        return s.post("/tokenize", json={"model": MODEL, "messages": parts}).json()["tokens"]

    def text_ids(s, text: str) -> list[int]:
        return s.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}).json()["tokens"]

    with serve(llama_dir, app_kw={"chat_template": looping}) as s:
        assert rendered(s) == text_ids(s, "[(Translate)(Bonjour)]")
        plain = s.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert plain.json()["tokens"] == text_ids(s, "[(hi)]")  # a string as one text part
    with serve(llama_dir, app_kw={"chat_template": printing, "chat_template_content_format": "string"}) as s:
        assert rendered(s) == text_ids(s, "[Translate\nBonjour]")
    with serve(llama_dir, app_kw={"chat_template": printing, "chat_template_content_format": "openai"}) as s:
        parts_repr = str([{"type": "text", "text": "Translate"}, {"type": "text", "text": "Bonjour"}])
        assert rendered(s) == text_ids(s, f"[{parts_repr}]")


def test_request_chat_template_needs_trust(server, llama_dir):
    """A chat_template in the request is a 400 unless the server trusts request templates; then it
    renders the prompt (vLLM's --trust-request-chat-template)."""
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template": template}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    with serve(llama_dir, app_kw={"trust_request_chat_template": True}) as trusting:
        r = trusting.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
        want = trusting.post("/tokenize", json={"model": MODEL, "prompt": "[hi]", "add_special_tokens": False})
        assert r.json()["usage"]["prompt_tokens"] == want.json()["count"]


def test_tool_call_history_reaches_the_template(llama_dir):
    """An assistant's earlier tool calls and the tool's answer (history: tools themselves are refused)
    reach the chat template, the call's JSON arguments as a mapping (vLLM parses them so)."""
    from arcserve.api.server import read_chat_template

    template = read_chat_template("{% for m in messages %}{% if m.tool_calls %}CALL {{ m.tool_calls[0].function.name }}"
                                  "({{ m.tool_calls[0].function.arguments.city }}){% elif m.role == 'tool' %}"
                                  "RESULT {{ m.tool_call_id }}={{ m.content }}{% else %}{{ m.content }}{% endif %};"
                                  "{% endfor %}")  # fmt: skip
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    with serve(llama_dir, app_kw={"chat_template": template}) as s:
        got = s.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
        want = s.post("/tokenize", json={"model": MODEL, "add_special_tokens": False,
                                         "prompt": "weather?;CALL get_weather(Paris);RESULT c1=sunny;"}).json()["tokens"]  # fmt: skip
    assert got == want


def test_generation_config_caps_max_tokens(llama_dir, tmp_path):
    """The model's generation_config max_new_tokens caps every request's max_tokens, as in vLLM's server."""
    import json
    import shutil

    d = tmp_path / "capped"
    shutil.copytree(llama_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 4}))
    with serve(d) as s:
        client = s.client()
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=NO_EOS)
        comp = client.completions.create(model=MODEL, prompt="x", max_tokens=50, extra_body=NO_EOS)
        assert chat.usage.completion_tokens == comp.usage.completion_tokens == 4


@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_chat_stream_equals_non_stream(client, case):
    kw = CHAT_CASES[case]
    full = client.chat.completions.create(model=MODEL, **kw)
    stream = client.chat.completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True}, **kw
    )
    texts, finish, usage = collect_chat_stream(stream)
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    assert set(finish.values()) == {FINISH.get(case, "length")}
    assert usage_of(usage) == usage_of(full.usage)
    assert len(full.choices) == kw.get("n", 1)


def test_raw_sse_stream(server):
    """Raw HTTP: text/event-stream, data: lines ending in [DONE], no usage chunk unless asked for."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{server.v1}/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_data(r)
    assert events and all(e["object"] == "text_completion" and "usage" not in e for e in events)
    assert len({e["id"] for e in events}) == 1
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    full = server.post("/v1/completions", json={**body, "stream": False}).json()
    assert "".join(e["choices"][0]["text"] for e in events) == full["choices"][0]["text"]


def test_stream_stop_string_spanning_tokens(client):
    """A longer stop string that several tokens build up is held back while streaming, never leaked."""
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=40, **GREEDY)
    base = client.completions.create(**kw, extra_body=NO_EOS).choices[0].text
    at = next(i for i in range(len(base) // 3, len(base) - 5) if "\ufffd" not in base[i : i + 5])
    stop = base[at : at + 5]
    first = base.find(stop)
    for include in (False, True):
        extra = {**NO_EOS, "include_stop_str_in_output": include}
        full = client.completions.create(**kw, stop=[stop], extra_body=extra).choices[0]
        assert full.text == base[: first + (len(stop) if include else 0)] and full.finish_reason == "stop"
        texts, finish, _ = collect_completion_stream(client.completions.create(**kw, stop=[stop], stream=True,
                                                                               extra_body=extra))  # fmt: skip
        assert texts == {0: full.text} and finish == {0: "stop"}


# ---- n > 1 ----------------------------------------------------------------------------------------
def test_n_choices(client):
    one = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=16, **GREEDY, extra_body=NO_EOS
    )
    greedy3 = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, n=3, **GREEDY,
                                        extra_body=NO_EOS)  # fmt: skip
    assert [c.index for c in greedy3.choices] == [0, 1, 2]
    assert [c.text for c in greedy3.choices] == [one.choices[0].text] * 3
    assert usage_of(greedy3.usage) == (one.usage.prompt_tokens, 48, one.usage.prompt_tokens + 48)
    kw = dict(
        model=MODEL, prompt=PROMPTS[1], max_tokens=16, n=4, temperature=1.0, seed=123, extra_body=NO_EOS
    )
    sampled = client.completions.create(**kw)
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3]
    assert len({c.text for c in sampled.choices}) > 1  # each choice samples with its own seed
    assert [c.text for c in client.completions.create(**kw).choices] == [c.text for c in sampled.choices]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, n=3, temperature=1.0,
                                          seed=9, extra_body=NO_EOS)  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1, 2] and chat.usage.completion_tokens == 30


# ---- stop strings and stop tokens -----------------------------------------------------------------
def test_stop_strings(client, hf):
    prompt = PROMPTS[0]
    ids = hf.tok.encode(prompt)
    cont = hf.greedy(ids, 40)
    base = text_of(hf.tok, cont, skip_special_tokens=True)
    # a 2-character stop string that first occurs well inside the text
    at = next(
        i
        for i in range(4, len(base) - 2)
        if "\ufffd" not in base[i : i + 2] and base.find(base[i : i + 2]) == i
    )
    stop = base[at : at + 2]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=40, **GREEDY, extra_body=NO_EOS)
    r = client.completions.create(stop=stop, **kw)
    c = r.choices[0]
    assert c.text == base[:at] and c.finish_reason == "stop"
    assert c.model_extra["stop_reason"] == stop
    # the tokens generated up to (and including) the one that completed the stop string
    n = next(k for k in range(1, 41) if stop in hf.tok.decode(cont[:k], skip_special_tokens=True))
    assert r.usage.completion_tokens == n
    inc = client.completions.create(stop=[stop], extra_body={**NO_EOS, "include_stop_str_in_output": True},
                                    **{k: v for k, v in kw.items() if k != "extra_body"})  # fmt: skip
    assert inc.choices[0].text == base[: at + 2]
    # of several stop strings the earliest match wins; an absent one changes nothing
    later = base[at + 4 : at + 6]
    assert client.completions.create(stop=[later, stop], **kw).choices[0].text == base[:at]
    absent = client.completions.create(stop=["\u2603\u2603"], **kw).choices[0]
    assert absent.text == base and absent.finish_reason == "length"
    # chat: same rule
    chat_ids = hf.chat_ids(MESSAGES)
    chat_base = text_of(hf.tok, hf.greedy(chat_ids, 30), skip_special_tokens=True)
    cat = next(
        i
        for i in range(3, len(chat_base) - 1)
        if chat_base[i].isalnum() and chat_base.find(chat_base[i]) == i
    )
    rc = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, stop=[chat_base[cat]],
                                        **GREEDY, extra_body=NO_EOS)  # fmt: skip
    assert rc.choices[0].message.content == chat_base[:cat] and rc.choices[0].finish_reason == "stop"


def test_stop_token_ids(client, hf):
    ids = hf.tok.encode(PROMPTS[1])
    cont = hf.greedy(ids, 30)
    tok = cont[6]
    n = cont.index(tok) + 1
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=30, **GREEDY,
                                  extra_body={**NO_EOS, "stop_token_ids": [tok]})  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == tok
    assert r.usage.completion_tokens == n
    # as in vLLM, the stop token counts as generated but its text stays out (unless asked for)
    assert c.text == text_of(hf.tok, cont[: n - 1], skip_special_tokens=True)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=30, **GREEDY,
                                  extra_body={**NO_EOS, "stop_token_ids": [tok], "include_stop_str_in_output": True})  # fmt: skip
    assert r.choices[0].text == text_of(hf.tok, cont[:n], skip_special_tokens=True)


# ---- logprobs ---------------------------------------------------------------------------------
def test_prompt_logprobs_equal_transformers(server, hf):
    """vLLM's prompt_logprobs extra: per prompt token (None for the first) the token's own logprob and
    rank plus the k most likely, equal to transformers'; with echo + logprobs of another k both hold;
    chat puts them at the top level; with stream it is a 400, as in vLLM."""
    ids = hf.tok.encode(PROMPTS[2])
    ref = hf.logprobs(ids[:1], ids[1:])  # the logits at positions 0..n-2 predict tokens 1..n-1
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    for extra in ({}, {"echo": True, "logprobs": 4}):
        choice = server.post("/v1/completions", json={**body, **extra}).json()["choices"][0]
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for i, entry in enumerate(plp[1:]):
            tid, row = ids[i + 1], ref[i]
            top2 = row.topk(2).indices.tolist()
            assert set(map(int, entry)) == {tid, *top2}
            assert abs(entry[str(tid)]["logprob"] - row[tid].item()) < 1e-4
            assert entry[str(tid)]["rank"] == int((row > row[tid]).sum()) + 1
            assert entry[str(top2[0])]["rank"] == 1 and entry[str(tid)]["decoded_token"] == hf.tok.decode([tid])
        if extra:
            assert len(choice["logprobs"]["tokens"]) == len(ids) + 2  # echo: prompt and output tokens
    chat = server.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                                                     "prompt_logprobs": 0}).json()  # fmt: skip
    chat_ids = hf.chat_ids(MESSAGES)
    assert len(chat["prompt_logprobs"]) == len(chat_ids) and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    r = server.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_completion_logprobs_equal_transformers(client, hf):
    prompt, k, n = PROMPTS[2], 3, 12
    ids = hf.tok.encode(prompt)
    cont = hf.greedy(ids, n)
    ref = hf.logprobs(ids, cont)
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=n, logprobs=k, **GREEDY, extra_body=NO_EOS
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert r.usage.completion_tokens == n
    for i, tid in enumerate(cont):
        assert lp.tokens[i] == hf.tok.decode([tid])
        assert lp.token_logprobs[i] == pytest.approx(ref[i, tid].item(), abs=1e-4)
        top_vals = ref[i].topk(k).values.tolist()
        # greedy: the chosen token is the most likely one
        assert lp.token_logprobs[i] == pytest.approx(top_vals[0], abs=1e-4)
        got = sorted(lp.top_logprobs[i].values(), reverse=True)
        assert 1 <= len(got) <= k  # tokens that decode alike share one key
        for v in got:
            assert any(v == pytest.approx(t, abs=1e-4) for t in top_vals)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # the same numbers when streamed
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, logprobs=k, stream=True, **GREEDY,
                                       extra_body=NO_EOS)  # fmt: skip
    toks, vals, tops = [], [], []
    for chunk in stream:
        for c in chunk.choices:
            if c.logprobs is not None:
                toks += c.logprobs.tokens
                vals += c.logprobs.token_logprobs
                tops += c.logprobs.top_logprobs
    assert toks == lp.tokens and tops == lp.top_logprobs
    assert vals == pytest.approx(lp.token_logprobs, abs=1e-6)
    # without logprobs there are none
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=2).choices[0].logprobs is None


def test_chat_logprobs_equal_transformers(client, hf):
    k, n = 2, 10
    ids = hf.chat_ids(MESSAGES)
    cont = hf.greedy(ids, n)
    ref = hf.logprobs(ids, cont)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=n, logprobs=True, top_logprobs=k,
                                       **GREEDY, extra_body=NO_EOS)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == n == r.usage.completion_tokens
    for i, (item, tid) in enumerate(zip(content, cont)):
        assert item.token == hf.tok.decode([tid]) and item.bytes == list(item.token.encode())
        assert item.logprob == pytest.approx(ref[i, tid].item(), abs=1e-4)
        top = ref[i].topk(k)
        assert len(item.top_logprobs) == k
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert [t.token for t in item.top_logprobs] == [hf.tok.decode([t]) for t in top.indices.tolist()]
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=n, logprobs=True,
                                            top_logprobs=k, stream=True, **GREEDY, extra_body=NO_EOS)  # fmt: skip
    streamed = [x for ch in stream for c in ch.choices if c.logprobs is not None for x in c.logprobs.content]
    assert [(x.token, x.top_logprobs) for x in streamed] == [(x.token, x.top_logprobs) for x in content]
    # logprobs=true alone: the chosen tokens' logprobs, no alternatives
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, **GREEDY)
    assert [x.top_logprobs for x in r.choices[0].logprobs.content] == [[]] * len(
        r.choices[0].logprobs.content
    )
    assert (
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3).choices[0].logprobs
        is None
    )


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_text_offsets_equal_non_streamed(client, echo):
    """logprobs.text_offset of a streamed completion must be the same as the non-streamed one (the
    offset of each token in the completion text; with echo, in the prompt + completion: the first
    generated token's offset was shifted by the prompt's length twice when streamed)."""
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, logprobs=1, echo=echo, **GREEDY, extra_body=NO_EOS)
    full = client.completions.create(**kw).choices[0]
    lp = full.logprobs
    # non-streamed: the offsets add up the token strings, which spell the text (less the U+FFFD of
    # bytes the last tokens left short of a character: as in vLLM, they stay out of the text)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert "".join(lp.tokens).rstrip("\ufffd") == full.text
    assert all(full.text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens) if o < len(full.text))
    streamed = [o for ch in client.completions.create(stream=True, **kw) for c in ch.choices if c.logprobs
                for o in c.logprobs.text_offset]  # fmt: skip
    assert streamed == lp.text_offset


def test_legacy_top_logprobs_hold_the_chosen_token(client, hf):
    """OpenAI's legacy format: up to logprobs + 1 entries, the chosen token always among them."""
    for k in (0, 1):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, logprobs=k, echo=True,
                                      temperature=1.5, seed=3, extra_body=NO_EOS)  # fmt: skip
        lp = r.choices[0].logprobs
        for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:]):  # (the prompt's first token has none)
            assert tok in top and len(top) <= k + 1


def test_max_logprobs_sets_the_servers_limit(llama_dir, hf):
    """max_logprobs (the server's --max-logprobs; the flag's parsing: test_engine_options.py): counts
    up to it pass, above it a 400 naming the parameter and the limit; -1 (the whole vocabulary) only
    where the limit covers the vocabulary."""
    vocab = hf.model.config.vocab_size
    with serve(llama_dir, max_logprobs=30) as s:
        c = s.client()
        r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=25)
        assert [len(x.top_logprobs) for x in r.choices[0].logprobs.content] == [25, 25]
        r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, logprobs=30, echo=True, **GREEDY,
                                 extra_body={"return_tokens_as_token_ids": True})  # (no two tokens share a key)
        lp = r.choices[0].logprobs
        assert all(tok in top and len(top) in (30, 31) for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
        for path, body, param in (
            ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 31}, "top_logprobs"),
            ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
            ("/v1/completions", {"prompt": "x", "logprobs": 31}, "logprobs"),
            ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ):
            r = s.post(path, json={"model": MODEL, "max_tokens": 2, **body})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and "at most 30" in err["message"], err
        assert s.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}).status_code == 200
    with serve(llama_dir, max_logprobs=-1) as s:
        r = s.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, logprobs=True,
                                               top_logprobs=-1, **GREEDY)  # fmt: skip
        for item in r.choices[0].logprobs.content:
            assert len(item.top_logprobs) == vocab and item.top_logprobs[0].logprob == item.logprob
        r = s.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1,
                                            "prompt_logprobs": -1})  # fmt: skip
        assert r.status_code == 200, r.text
        assert all(len(e) == vocab for e in r.json()["choices"][0]["prompt_logprobs"][1:])


def test_beam_search_over_the_api_equals_the_reference(client, hf):
    """use_beam_search (vLLM's; n is the beam width): the choices are the n best sequences of the same
    search over transformers' logits, best first, generated tokens only; two prompts in one request
    each get theirs; chat the same over the chat prompt."""
    ids = [hf.tok.encode(p) for p in PROMPTS[:2]]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=3, max_tokens=5, temperature=0,
                                  extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert [c.index for c in r.choices] == list(range(6)) and r.usage.completion_tokens == 30
    for i, p in enumerate(ids):
        want = beam_reference(hf.model, p, 3, 5, set(), 1.0)
        got = r.choices[3 * i : 3 * i + 3]
        assert [c.token_ids for c in got] == [w[0][len(p) :] for w in want]
        assert [c.text for c in got] == [hf.tok.decode(c.token_ids) for c in got]
        assert all(c.finish_reason == "length" for c in got)
    chat_ids = hf.chat_ids(MESSAGES)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2,
                                       extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True,
                                                   "length_penalty": 0.5})  # fmt: skip
    want = beam_reference(hf.model, chat_ids, 2, 4, set(), 0.5)
    assert [c.token_ids for c in r.choices] == [w[0][len(chat_ids) :] for w in want]
    for c, (_, cum) in zip(r.choices, want):
        assert sum(x.logprob for x in c.logprobs.content) == pytest.approx(cum, abs=1e-4)
    # logprobs only when asked for
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=2,
                                       extra_body={"use_beam_search": True})  # fmt: skip
    assert [c.logprobs for c in r.choices] == [None, None]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=2, max_tokens=2, extra_body={"use_beam_search": True})
    assert [c.logprobs for c in r.choices] == [None, None]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=2, max_tokens=2, logprobs=0,
                                  extra_body={"use_beam_search": True})  # fmt: skip
    assert all(len(c.logprobs.tokens) == 2 for c in r.choices)


def test_echo_without_generation(client, hf):
    """echo with max_tokens 0 scores the prompt: its text and logprobs, nothing generated (vLLM);
    max_tokens 0 without echo stays a 400."""
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == PROMPTS[0] and r.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == len(hf.tok.encode(PROMPTS[0])) and c.logprobs.token_logprobs[0] is None
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=0, echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == PROMPTS[0]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=0)


def test_nulls_mean_the_defaults(server):
    """Fields OpenAI's spec lets clients send as null: null is the default, not a 400; model "" is
    the served model (vLLM)."""
    body = {"model": "", "prompt": "x", "max_tokens": 2, "n": None, "presence_penalty": None,
            "frequency_penalty": None, "stream": None, "echo": None, "logprobs": None, "ignore_eos": None}  # fmt: skip
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["model"] == MODEL
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": None,
            "n": None, "stream": None}  # fmt: skip
    assert server.post("/v1/chat/completions", json=chat).status_code == 200


def test_refused_like_vllm(server):
    """stream_options without stream, and a priority on a first-come-first-served server, are 400s."""
    r = server.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    r = server.post("/v1/completions", json={"model": MODEL, "prompt": "x", "priority": 3})
    assert r.status_code == 400 and "scheduling_policy='priority'" in r.json()["error"]["message"]


def test_sampling_extras(client, hf):
    """logit_bias forces a token; top_k=1 at temperature 1 is greedy; a seed makes sampling repeatable."""
    forced = client.completions.create(model=MODEL, prompt="x", max_tokens=5, logit_bias={"57": 100},
                                       temperature=0.7, seed=1, extra_body=NO_EOS)  # fmt: skip
    assert forced.choices[0].text == hf.tok.decode([57] * 5)
    greedy = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, **GREEDY, extra_body=NO_EOS
    )
    top1 = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0,
                                     extra_body={**NO_EOS, "top_k": 1})  # fmt: skip
    assert top1.choices[0].text == greedy.choices[0].text
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, extra_body=NO_EOS)
    a, b = (client.completions.create(seed=42, **kw).choices[0].text for _ in range(2))
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert a == b and len(others | {a}) > 1
    # min_tokens keeps generating past EOS
    ids = hf.tok.encode(EOS_PROMPT)
    n_eos = hf.greedy(ids, 100).index(2) + 1
    r = client.completions.create(model=MODEL, prompt=EOS_PROMPT, max_tokens=n_eos + 10, **GREEDY,
                                  extra_body={"min_tokens": n_eos + 5})  # fmt: skip
    assert r.usage.completion_tokens >= n_eos + 5


# ---- usage -------------------------------------------------------------------------------------
def test_usage_exact_for_stops_and_eos(client, hf):
    """completion_tokens counts every generated token (also one that completes a stop string or EOS),
    prompt_tokens counts the tokenized prompt (chat: the rendered template)."""
    for prompt in PROMPTS:
        ids = hf.tok.encode(prompt)
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=64, logprobs=0, stop=["e"], **GREEDY
        )
        # the oracle's count: up to the token whose text completes the stop string, or EOS, else 64
        cont = hf.greedy(ids, 64)
        hit = next((k for k in range(1, len(cont) + 1)
                    if cont[k - 1] == 2 or "e" in text_of(hf.tok, cont[:k], skip_special_tokens=True)), None)  # fmt: skip
        n = hit or 64
        assert r.choices[0].finish_reason == ("length" if hit is None else "stop")
        assert usage_of(r.usage) == (len(ids), n, len(ids) + n)
        assert len(r.choices[0].logprobs.tokens) == n
        assert r.choices[0].text == text_of(hf.tok, cont[:n], skip_special_tokens=True).split("e")[0]
    # a greedy answer that ends with EOS: the EOS token counts
    ids = hf.tok.encode(EOS_PROMPT)
    n = hf.greedy(ids, 100).index(2) + 1
    r = client.completions.create(model=MODEL, prompt=EOS_PROMPT, max_tokens=100, **GREEDY)
    assert r.choices[0].finish_reason == "stop" and usage_of(r.usage) == (len(ids), n, len(ids) + n)


def test_tokenize_detokenize(server, hf):
    r = server.post("/tokenize", json={"model": MODEL, "prompt": PROMPTS[0]}).json()
    assert (
        r["tokens"] == hf.tok.encode(PROMPTS[0])
        and r["count"] == len(r["tokens"])
        and r["max_model_len"] == 256
    )
    chat = server.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == hf.chat_ids(MESSAGES)
    back = server.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == PROMPTS[0]


@pytest.fixture(scope="module")
def bos_server(llama_dir, tmp_path_factory):
    """The tiny llama with a tokenizer that puts a BOS in front of what it encodes (Llama-style)."""
    d = copy_with_bos_tokenizer(llama_dir, tmp_path_factory.mktemp("bos") / "llama")
    with serve(d) as s:
        yield s


def test_add_special_tokens_field(bos_server, hf):
    """vLLM's request field: text prompts get the tokenizer's special tokens (a BOS) unless false; chat
    prompts only the template's, unless true."""
    client, tok = bos_server.client(), bos_server.tokenizer
    plain, special = tok.encode(PROMPTS[0], add_special_tokens=False), tok.encode(PROMPTS[0])
    assert special == [1] + plain  # precondition: this tokenizer adds a BOS
    for flag, ids in ((None, special), (True, special), (False, plain)):
        extra = {} if flag is None else {"add_special_tokens": flag}
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, extra_body=extra)
        assert r.usage.prompt_tokens == len(ids) and r.choices[0].text == text_of(tok, hf.greedy(ids, 4))
        body = {"prompt": PROMPTS[0], **extra}
        assert bos_server.post("/tokenize", json=body).json()["tokens"] == ids
    templated = hf.chat_ids(MESSAGES)
    for flag, ids in ((None, templated), (False, templated), (True, [1] + templated)):
        extra = {} if flag is None else {"add_special_tokens": flag}
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                           extra_body=extra)  # fmt: skip
        assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == text_of(tok, hf.greedy(ids, 4))
        assert bos_server.post("/tokenize", json={"messages": MESSAGES, **extra}).json()["tokens"] == ids


# ---- health and metrics -------------------------------------------------------------------------
def test_health_ping_version(server):
    assert httpx.get(f"{server.base}/health", timeout=5).status_code == 200
    assert httpx.get(f"{server.base}/ping", timeout=5).status_code == 200
    assert httpx.post(f"{server.base}/ping", timeout=5).status_code == 200
    import arcserve

    assert httpx.get(f"{server.base}/version", timeout=5).json() == {"version": arcserve.__version__}


def test_metrics_count_requests_and_tokens(server, client, hf):
    server.wait_idle()
    before = server.metrics()
    key = (("model_name", MODEL),)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=7, **GREEDY, extra_body=NO_EOS)
    after = server.wait_idle()
    assert (
        after[("arcserve:generation_tokens_total", key)] - before[("arcserve:generation_tokens_total", key)]
        == 7
    )
    assert (after[("arcserve:prompt_tokens_total", key)] - before[("arcserve:prompt_tokens_total", key)]
            == r.usage.prompt_tokens == len(hf.tok.encode(PROMPTS[1])))  # fmt: skip
    ok = ("arcserve:request_success_total", (("finished_reason", "length"), ("model_name", MODEL)))
    assert after[ok] - before[ok] == 1
    e2e = ("arcserve:e2e_request_latency_seconds_count", key)
    assert after[e2e] - before[e2e] == 1
    text = httpx.get(f"{server.base}/metrics", timeout=5)
    assert text.headers["content-type"].startswith("text/plain")


def test_echo_with_logprobs_gives_prompt_logprobs(client, server, hf):
    """echo + logprobs: the prompt tokens' logprobs (first one null) equal transformers', then the
    completion's; streamed the same as non-streamed."""
    import torch

    prompt, k, n = PROMPTS[2], 2, 4
    ids = hf.tok.encode(prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, logprobs=k, echo=True, **GREEDY,
                                  extra_body=NO_EOS)  # fmt: skip
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + n and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        ref = hf.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for p in range(1, len(ids)):
        assert lp.tokens[p] == hf.tok.decode([ids[p]])
        assert lp.token_logprobs[p] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        assert max(lp.top_logprobs[p].values()) == pytest.approx(ref[p - 1].max().item(), abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, logprobs=k, echo=True,
                                            stream=True, **GREEDY, extra_body=NO_EOS))  # fmt: skip
    streamed = [x for c in chunks for ch in c.choices if ch.logprobs for x in ch.logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    assert "".join(ch.text for c in chunks for ch in c.choices) == r.choices[0].text


def test_streamed_echo_logprobs_of_a_choice_that_starts_a_step_later(llama_dir):
    """n = 2 with echo + logprobs under a 16-token budget: the second choice's prompt is computed a
    step after the first's, so its first tokens come in a later delta than the one that carried the
    prompt's logprobs; its echoed prompt logprobs must still be those of the non-streamed answer."""
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 3)
    with serve(llama_dir, max_num_batched_tokens=16) as s:
        c = openai.OpenAI(base_url=s.v1, api_key="x", max_retries=0)
        kw = dict(model=MODEL, prompt=prompt, max_tokens=4, n=2, logprobs=1, echo=True, **GREEDY, extra_body=NO_EOS)
        full = {ch.index: ch.logprobs for ch in c.completions.create(**kw).choices}
        first: dict[int, list] = {}
        for chunk in c.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                if ch.logprobs and ch.index not in first:
                    first[ch.index] = ch.logprobs.token_logprobs
    for i in (0, 1):
        n_prompt = len(full[i].token_logprobs) - 4
        assert n_prompt > 16 and full[i].token_logprobs[1:n_prompt] == first[i][1:n_prompt]
        assert None not in first[i][1:n_prompt]
