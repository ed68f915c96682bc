"""The offline API end to end on tiny models: prompts forms, params, stops, outputs, bad input."""

import json
import math
import shutil

import pytest
import torch
from tiny_models import text_of

from arcserve import LLM, EngineArgs, LLMEngine, RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", max_model_len=256)


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_prompt_forms_and_order(llm):
    tok = llm.get_tokenizer()
    texts = ["The quick brown fox", "def add(a, b):", "Paris is"]
    by_text = llm.generate(texts, greedy(), use_tqdm=False)
    assert [o.prompt for o in by_text] == texts
    single = llm.generate(texts[1], greedy(), use_tqdm=False)
    assert single[0].outputs[0].token_ids == by_text[1].outputs[0].token_ids
    ids = [{"prompt_token_ids": tok.encode(t)} for t in texts]
    by_ids = llm.generate(ids, greedy(), use_tqdm=False)
    for a, b in zip(by_text, by_ids):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == text_of(tok, a.outputs[0].token_ids, skip_special_tokens=True)
        assert a.outputs[0].finish_reason == "length" and len(a.outputs[0].token_ids) == 12
    m = by_text[0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_sampling_params_list_per_prompt(llm):
    outs = llm.generate(["a", "b"], [greedy(3), greedy(5)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    with pytest.raises(ValueError, match="2 prompts"):
        llm.generate(["a", "b"], [greedy(3)] * 3, use_tqdm=False)


def test_n_outputs(llm):
    out = llm.generate("Paris", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # different seeds per child
    again = llm.generate("Paris", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8), use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in again.outputs]


def test_stop_strings_trimmed_or_included(llm):
    base = llm.generate("The quick", greedy(30), use_tqdm=False)[0].outputs[0].text
    assert len(base) > 6
    stop = base[3:6]
    first = base.find(stop)
    out = llm.generate("The quick", greedy(30, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == base[:first] and out.finish_reason == "stop" and out.stop_reason == stop
    inc = llm.generate("The quick", greedy(30, stop=stop, include_stop_str_in_output=True), use_tqdm=False)
    assert inc[0].outputs[0].text == base[: first + len(stop)]


def test_stop_token_ids_min_tokens_ignore_eos(llm):
    base = llm.generate("Berlin", greedy(20), use_tqdm=False)[0].outputs[0].token_ids
    tok = llm.get_tokenizer()
    target = next(t for t in base[4:] if "\ufffd" not in tok.decode([t]))  # a token with text of its own
    n = base.index(target) + 1
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE):  # lazy and per-token text
        out = llm.generate("Berlin", greedy(20, stop_token_ids=[target], output_kind=kind), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == base[:n]
        assert out.finish_reason == "stop" and out.stop_reason == target
        # as in vLLM: the stop token is generated (token_ids, usage) but its text stays out...
        assert out.text == text_of(tok, base[: n - 1], skip_special_tokens=True)
        # ...unless include_stop_str_in_output
        inc = llm.generate("Berlin", greedy(20, stop_token_ids=[target], include_stop_str_in_output=True,
                                            output_kind=kind), use_tqdm=False)[0].outputs[0]  # fmt: skip
        assert inc.text == text_of(tok, base[:n], skip_special_tokens=True) != out.text
    # min_tokens: the stop token cannot end the sequence before min_tokens tokens.
    mt = llm.generate("Berlin", greedy(20, stop_token_ids=[target], min_tokens=10), use_tqdm=False)
    assert len(mt[0].outputs[0].token_ids) >= 10
    # EOS: push it with logit_bias; it stops at once unless ignore_eos.
    eos = llm.get_tokenizer().eos_token_id
    forced = greedy(6, logit_bias={eos: 100.0})
    assert llm.generate("x", forced, use_tqdm=False)[0].outputs[0].token_ids == [eos]
    shown = greedy(6, logit_bias={eos: 100.0}, skip_special_tokens=False)
    assert llm.generate("x", shown, use_tqdm=False)[0].outputs[0].text == ""  # EOS's text too (vLLM)
    ign = llm.generate("x", greedy(6, logit_bias={eos: 100.0}, ignore_eos=True), use_tqdm=False)[0]
    assert ign.outputs[0].token_ids == [eos] * 6 and ign.outputs[0].finish_reason == "length"


def test_ids_past_tokenizer_vocab_decode_to_nothing(llm):
    tok = llm.get_tokenizer()
    pad_id = llm.llm_engine.model_config.vocab_size - 1
    assert pad_id >= len(tok)
    out = llm.generate("Paris", greedy(4, logit_bias={pad_id: 100.0}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [pad_id] * 4 and out.text == ""


def test_logprobs(llm):
    out = llm.generate("Paris", greedy(5, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, entries in zip(out.token_ids, out.logprobs):
        assert tok in entries and entries[tok].rank == 1
        assert len(entries) == 3 and all(e.logprob <= 0 for e in entries.values())
        assert sorted(e.rank for e in entries.values()) == [1, 2, 3]
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_chat_template(llm):
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = llm.chat(conv, greedy(4), use_tqdm=False)[0]
    assert out.prompt == "<s>system\nbe brief</s>\n<s>user\nhi</s>\n<s>assistant\n"
    two = llm.chat([conv, conv[1:]], greedy(4), use_tqdm=False)
    assert two[0].outputs[0].token_ids == out.outputs[0].token_ids and len(two) == 2


def test_developer_messages_reach_a_template_without_the_role_as_system(llm):
    """OpenAI's "developer" role, for a template that does not name it: the messages become system
    ones, all system messages merged into one in front (a blank line between their texts), as
    vLLM renders them; a template that names the role gets the messages as they are."""
    user = {"role": "user", "content": "hi"}
    as_system = llm.chat([{"role": "system", "content": "be brief"}, user], greedy(2), use_tqdm=False)[0].prompt
    got = llm.chat([{"role": "developer", "content": "be brief"}, user], greedy(2), use_tqdm=False)[0].prompt
    assert got == as_system == "<s>system\nbe brief</s>\n<s>user\nhi</s>\n<s>assistant\n"
    later = [{"role": "system", "content": "one"}, user, {"role": "developer", "content": [{"type": "text", "text": "two"}]}]
    assert llm.chat(later, greedy(2), use_tqdm=False)[0].prompt == "<s>system\none\n\ntwo</s>\n<s>user\nhi</s>\n<s>assistant\n"
    # no developer message: several system messages stay where they are
    two_sys = [{"role": "system", "content": "one"}, user, {"role": "system", "content": "two"}]
    assert llm.chat(two_sys, greedy(2), use_tqdm=False)[0].prompt.count("<s>system") == 2
    knows = "{% for m in messages %}{% if m.role == 'developer' %}D:{% endif %}{{ m.content }};{% endfor %}"
    out = llm.chat([{"role": "developer", "content": "x"}, user], greedy(2), use_tqdm=False, chat_template=knows)
    assert out[0].prompt == "D:x;hi;"


def test_chat_content_parts_tools_and_formats(llm):
    """Content reaches the template as vLLM's chat_template_content_format says: "string" joins text
    parts one per line (empty ones left out), "openai" gives parts (a string as one part); "auto"
    reads the template for a loop over a message's content; tool results are always text; tools
    reach the template."""
    parts = [{"type": "text", "text": "be"}, {"type": "text", "text": ""}, {"type": "text", "text": "brief"}]
    conv = [{"role": "user", "content": parts}]
    joined = llm.chat(conv, greedy(2), use_tqdm=False)[0]
    assert joined.prompt == "<s>user\nbe\nbrief</s>\n<s>assistant\n"
    looping = "{% for m in messages %}[{% for p in m['content'] %}({{ p.text }}){% endfor %}]{% endfor %}"
    for fmt in ("auto", "openai"):
        out = llm.chat(conv + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": None}], greedy(2),
                       use_tqdm=False, chat_template=looping, chat_template_content_format=fmt)  # fmt: skip
        assert out[0].prompt == "[(be)()(brief)][(ok)][]"
    printing = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    conv2 = conv + [{"role": "user"}, {"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    out = llm.chat(conv2, greedy(2), use_tqdm=False, chat_template=printing, chat_template_content_format="string")
    assert out[0].prompt == "[be\nbrief][][a\nb]"
    out = llm.chat(conv2, greedy(2), use_tqdm=False, chat_template=printing, chat_template_content_format="openai")
    assert out[0].prompt == f"[{parts}][[]][a\nb]"  # parts as they are; a tool result as text
    assert llm.chat(conv, greedy(2), use_tqdm=False, chat_template_content_format="string")[0].prompt == joined.prompt
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0]['content'] }}"
    out = llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False, chat_template=with_tools,
                   tools=tools)[0]  # fmt: skip
    assert out.prompt == "get_weather;hi"
    with pytest.raises(ValueError, match="text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], greedy(2))
    # an assistant's tool calls: JSON arguments reach the template as a mapping ({} for text that is no
    # JSON object), as vLLM passes them
    calls = [{"function": {"name": "f", "arguments": '{"x": 1}'}}, {"function": {"name": "g", "arguments": "[1]"}}]
    args = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }};{% endfor %}{% endfor %}"
    out = llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls}], greedy(2),
                   use_tqdm=False, chat_template=args, add_generation_prompt=False)  # fmt: skip
    assert out[0].prompt == '{"x": 1};{};'
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(conv, greedy(2), chat_template_content_format="json")
    with pytest.raises(ValueError, match="needs a 'role'"):
        llm.chat([{"content": "hi"}], greedy(2))


def test_content_format_detection():
    """"openai" exactly when the template loops over a message's content (directly, through a variable
    set from it, or a macro parameter that receives it); a loop over anything else is no sign."""
    from arcserve.engine.chat_content import detect_content_format as detect

    each = "{% for m in messages %}BODY{% endfor %}"
    openai = ["{% for p in m['content'] %}{{ p.text }}{% endfor %}",
              "{% for p in m.content if p.type == 'text' %}{{ p.text }}{% endfor %}",
              "{% set c = m.content %}{% for p in c %}{{ p.text }}{% endfor %}",
              "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{% endfor %}{% endif %}"]
    string = ["{{ m['content'] }}", "{% for line in m['content'].split('\\n') %}{{ line }}{% endfor %}",
              "{% for t in tools %}{% for p in t.content %}{% endfor %}{% endfor %}",
              "{% generation %}{{ m.content }}{% endgeneration %}"]  # fmt: skip
    for body in openai:
        assert detect(each.replace("BODY", body)) == "openai", body
    for body in string:
        assert detect(each.replace("BODY", body)) == "string", body
    macro = "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    assert detect(macro + "{% for m in messages[1:] %}{{ show(m.content) }}{% endfor %}") == "openai"
    assert detect(macro + "{% for m in messages %}{{ show(m.role) }}{% endfor %}") == "string"
    assert detect("{{ not closed") == "string"


def test_vllm_call_forms(llm, llama_dir, tmp_path):
    """vLLM's generate/chat keywords: one priority for all prompts, a progress-bar factory,
    tokenization_kwargs, lora_request (refused: no adapters)."""
    import numpy as np
    from tiny_models import copy_with_bos_tokenizer
    from tqdm import tqdm as tqdm_off

    made = []

    def bar(**kw):
        from tqdm import tqdm

        made.append(kw["total"])
        return tqdm(**{**kw, "disable": True})

    outs = llm.generate(["a", "b"], greedy(2), use_tqdm=bar, priority=0)
    assert made == [2] and len(outs) == 2
    assert len(llm.generate(["a", "b"], greedy(2), use_tqdm=lambda **kw: tqdm_off(**kw, disable=True))) == 2
    assert len(llm.generate(["a", "b"], greedy(2), use_tqdm=False, priority=np.int64(0))) == 2  # one for all
    with pytest.raises(ValueError, match="Got 3 priority for 2 prompts"):
        llm.generate(["a", "b"], greedy(2), priority=[0, 0, 0])
    with pytest.raises(TypeError):  # keyword-only after sampling_params, as vLLM's
        llm.generate(["a"], greedy(2), False)
    with pytest.raises(ValueError, match="LoRA"):
        llm.generate("a", greedy(2), lora_request=object())
    with pytest.raises(ValueError, match="tokenization_kwargs takes add_special_tokens"):
        llm.generate("a", greedy(2), tokenization_kwargs={"truncation": True})
    bos = LLM(str(copy_with_bos_tokenizer(llama_dir, tmp_path / "bos")), dtype="float32", max_model_len=64,
              scheduling_policy="priority")  # fmt: skip
    tok = bos.get_tokenizer()
    plain = tok.encode("Paris is", add_special_tokens=False)
    assert bos.generate("Paris is", greedy(2), use_tqdm=False)[0].prompt_token_ids == [1] + plain
    out = bos.generate("Paris is", greedy(2), use_tqdm=False, tokenization_kwargs={"add_special_tokens": False})[0]
    assert out.prompt_token_ids == plain
    conv = [{"role": "user", "content": "hi"}]
    templated = bos.chat(conv, greedy(2), use_tqdm=False)[0].prompt_token_ids
    assert templated[0] == 1 and templated[1] != 1  # the template's <s> only
    both = bos.chat(conv, greedy(2), use_tqdm=False, tokenization_kwargs={"add_special_tokens": True})[0]
    assert both.prompt_token_ids == [1] + templated
    # priority reaches the scheduler: with one sequence at a time, the urgent prompt finishes first
    one = LLM(str(llama_dir), dtype="float32", max_model_len=64, max_num_seqs=1, scheduling_policy="priority")
    outs = one.chat([conv, conv], greedy(3), use_tqdm=False, priority=[5, -5])
    assert outs[1].metrics.finished_time < outs[0].metrics.finished_time


def test_reset_prefix_cache(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=128, block_size=4)
    ids = {"prompt_token_ids": [(5 * i) % 250 + 3 for i in range(40)]}
    first = llm.generate(ids, greedy(2), use_tqdm=False)[0]
    again = llm.generate(ids, greedy(2), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 36
    engine = llm.llm_engine
    engine.add_request("waiting", "x", greedy(2))  # waiting: holds no blocks yet
    assert not engine.kv.blocks and llm.reset_prefix_cache() is True  # (vLLM's rule: blocks in use count)
    engine.step()
    assert engine.kv.blocks and llm.reset_prefix_cache() is False  # a request holds blocks: nothing forgotten
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.generate(ids, greedy(2), use_tqdm=False)[0].num_cached_tokens == 0  # the first reset took it
    assert llm.generate(ids, greedy(2), use_tqdm=False)[0].num_cached_tokens == 36
    assert llm.reset_prefix_cache() is True
    cold = llm.generate(ids, greedy(2), use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.generate(ids, greedy(2), use_tqdm=False)[0].num_cached_tokens == 36  # cached again
    # reset_running_requests: the running request's blocks are forgotten too
    engine.add_request("running", ids, greedy(4))
    engine.step()
    assert llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.generate(ids, greedy(2), use_tqdm=False)[0].num_cached_tokens == 0


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = [(7 * i) % 300 + 3 for i in range(300)]  # longer than max_model_len 256
    out = llm.generate({"prompt_token_ids": ids}, greedy(5, truncate_prompt_tokens=40), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-40:]
    plain = llm.generate({"prompt_token_ids": ids[-40:]}, greedy(5), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    most = llm.generate({"prompt_token_ids": ids}, greedy(1, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert most.prompt_token_ids == ids[-255:]  # max_model_len - 1: room for one generated token
    room = llm.generate({"prompt_token_ids": ids}, greedy(6, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert room.prompt_token_ids == ids[-250:] and len(room.outputs[0].token_ids) == 6  # room for max_tokens
    short = llm.generate({"prompt_token_ids": ids[:10]}, greedy(2, truncate_prompt_tokens=40), use_tqdm=False)[0]
    assert short.prompt_token_ids == ids[:10]
    text = llm.generate("The quick brown fox jumps", greedy(2, truncate_prompt_tokens=2), use_tqdm=False)[0]
    assert len(text.prompt_token_ids) == 2 and text.prompt == llm.get_tokenizer().decode(text.prompt_token_ids)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="300 tokens but max_model_len is 256"):
        llm.generate({"prompt_token_ids": ids}, greedy(2), use_tqdm=False)


def test_truncation_keeps_the_tokenizers_bos_in_front():
    """A text prompt tokenized with a BOS keeps it when cut (the tokenizer's own left truncation
    keeps its special tokens, as vLLM does); token-id prompts are cut as given."""
    from arcserve.engine.inputs import InputProcessor

    class Tok:  # words -> ids 10, 11, ...; BOS = 1 in front when special tokens are added
        def encode(self, text, add_special_tokens=True):
            return ([1] if add_special_tokens else []) + [10 + i for i, _ in enumerate(text.split())]

        def decode(self, ids):
            return " ".join(f"w{t}" for t in ids)

    stub = type("Stub", (), {"tokenizer": Tok(), "max_model_len": 100})()
    text = "a b c d e f"
    ids = Tok().encode(text)
    cut = InputProcessor.truncate_prompt(stub, text, ids, 3, None, True)
    assert cut == ("w14 w15", [1, 14, 15])
    assert InputProcessor.truncate_prompt(stub, text, ids, 3, None, False) == ("w13 w14 w15", [13, 14, 15])
    assert InputProcessor.truncate_prompt(stub, text, ids, 10, None, True) == (text, ids)


def test_chat_continue_final_message(llm):
    """The last (assistant) message stays open: no end-of-turn after it, no new assistant header; the
    continuation is what plain generation from that text gives."""
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, the"}]
    out = llm.chat(conv, greedy(6), use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt == "<s>user\nhi</s>\n<s>assistant\nSure, the"
    plain = llm.generate({"prompt_token_ids": out.prompt_token_ids}, greedy(6), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="continue_final_message must come with add_generation_prompt=false"):
        llm.chat(conv, greedy(2), use_tqdm=False, continue_final_message=True)


def test_engine_api_stream_and_abort(llama_dir):
    engine = LLMEngine(EngineArgs(model=str(llama_dir), dtype="float32", max_model_len=128))
    engine.add_request("a", "The quick", greedy(10, output_kind=RequestOutputKind.DELTA))
    engine.add_request("b", "Paris", greedy(50))
    engine.add_request("c", "def", greedy(10))
    engine.add_request("d", "The quick", greedy(4, prompt_logprobs=2, output_kind=RequestOutputKind.DELTA))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", "again", greedy(3))
    deltas, seen_b, plp = [], 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "a":
                deltas.append(out.outputs[0])
            if out.request_id == "d":
                plp.append(out.prompt_logprobs)
            if out.request_id == "b":
                seen_b += 1
                if seen_b == 3:
                    engine.abort_request("b")
    assert seen_b == 3 and engine.get_num_unfinished_requests() == 0
    # deltas carry the prompt's logprobs once, in the first output (as vLLM's)
    assert len(plp) == 4 and len(plp[0]) == len(engine.tokenizer.encode("The quick")) and plp[1:] == [None] * 3
    assert sum(len(d.token_ids) for d in deltas) == 10 and deltas[-1].finish_reason == "length"
    full = LLM.from_engine_args(EngineArgs(model=str(llama_dir), dtype="float32", max_model_len=128))
    ref = full.generate("The quick", greedy(10), use_tqdm=False)[0].outputs[0]
    assert "".join(d.text for d in deltas) == ref.text
    assert engine.scheduler.kv.usage() == 0.0 and not engine.scheduler.running


BAD = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),  # (NaN sampled one token over and over)
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=0), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(n=0), r"\bn must be"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(logprobs=-2), "logprobs"),
    (dict(prompt_logprobs=1.5), "prompt_logprobs"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(stop=[""]), "stop"),
    (dict(stop=["x"], detokenize=False), "stop strings need detokenize"),  # never looked for otherwise
    (dict(seed=2**63), "seed"),
    (dict(seed=2**63 - 2, n=3), "seed"),  # sequence 2 would sample with seed 2**63: past int64
]


@pytest.mark.parametrize("kwargs,name", BAD)
def test_bad_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_vllm_ranges_accepted():
    assert SamplingParams(repetition_penalty=2.5).repetition_penalty == 2.5  # vLLM: any finite value > 0


def test_vllm_readings_of_logprobs_flags_and_seed(llm):
    """As vLLM reads them: logprobs=True / prompt_logprobs=True are one top logprob (False: none),
    and seed=-1 is no seed (it crashed the step before: torch.topk took k=True)."""
    sp = SamplingParams(logprobs=True, prompt_logprobs=True, seed=-1, max_tokens=3, temperature=0)
    assert (sp.logprobs, sp.prompt_logprobs, sp.seed) == (1, 1, None)
    assert SamplingParams(logprobs=False, prompt_logprobs=False).logprobs is None
    out = llm.generate("The quick", sp, use_tqdm=False)[0]
    assert all(len(lp) == 1 for lp in out.outputs[0].logprobs)  # the greedy token is the top one
    assert out.prompt_logprobs[0] is None and all(p for p in out.prompt_logprobs[1:])


def test_max_logprobs_limits_requests_and_minus_one_is_the_whole_vocabulary(llm, llama_dir):
    """vLLM's max_logprobs (default 20): a request asking for more is refused naming the limit, and
    leaves nothing behind; -1 is the whole vocabulary, which passes only where the limit covers it
    (max_logprobs=-1: none); a count past the vocabulary gives the whole vocabulary."""
    assert SamplingParams(logprobs=50).logprobs == 50 and SamplingParams(prompt_logprobs=-1).prompt_logprobs == -1
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    for kw, name in ((dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs")):
        with pytest.raises(ValueError, match=f"{name} must be at most 20, this engine's max_logprobs"):
            llm.generate(["Paris", "The quick"], [greedy(2), greedy(2, **kw)], use_tqdm=False)
        assert not engine.has_unfinished_requests()
    narrow = llm.generate("Paris is", greedy(3, logprobs=20), use_tqdm=False)[0].outputs[0]
    assert [len(e) for e in narrow.logprobs] == [20] * 3
    wide = LLM(str(llama_dir), dtype="float32", max_model_len=256, max_logprobs=-1)
    out = wide.generate("Paris is", greedy(3, logprobs=-1, prompt_logprobs=-1), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == narrow.token_ids
    for tok, entries, top in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, narrow.logprobs):
        assert set(entries) == set(range(vocab)) and entries[tok].rank == 1
        assert math.fsum(math.exp(e.logprob) for e in entries.values()) == pytest.approx(1.0, abs=1e-4)
        for t, e in top.items():  # the narrow request's top 20: the same tokens, values and ranks
            assert entries[t].rank == e.rank and entries[t].logprob == pytest.approx(e.logprob, abs=1e-5)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert all(set(e) == set(range(vocab)) for e in out.prompt_logprobs[1:])
    past = wide.generate("Paris", greedy(1, logprobs=10 * vocab), use_tqdm=False)[0].outputs[0].logprobs[0]
    assert set(past) == set(range(vocab))
    # one step, rows of different counts: each row gets its own (the wide row's do not leak over)
    both = wide.generate(["Paris is", "The quick"], [greedy(3, logprobs=-1), greedy(3, logprobs=2)], use_tqdm=False)
    assert [len(e) for e in both[0].outputs[0].logprobs] == [vocab] * 3
    assert [len(e) for e in both[1].outputs[0].logprobs] == [2] * 3


def test_one_list_of_token_ids_is_one_prompt(llm):
    """A flat list of token ids is one prompt (vLLM's reading), not one prompt per id."""
    ids = [5, 17, 33, 101]
    got = llm.generate(ids, greedy(3), use_tqdm=False)
    assert len(got) == 1 and got[0].prompt_token_ids == ids
    want = llm.generate({"prompt_token_ids": ids}, greedy(3), use_tqdm=False)[0].outputs[0].token_ids
    assert got[0].outputs[0].token_ids == want
    assert len(llm.generate([ids, ids], greedy(2), use_tqdm=False)) == 2  # a list of lists: one each


def test_bad_prompts_leave_nothing_behind(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"300 tokens.*max_model_len is 256"):
        llm.generate(["fine", {"prompt_token_ids": [5] * 300}], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="Token ids"):
        llm.generate({"prompt_token_ids": [1, 10**6]}, greedy(), use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine.scheduler.num_waiting == 0
    assert engine.scheduler.kv.usage() == 0.0
    assert llm.generate("fine", greedy(3), use_tqdm=False)[0].outputs[0].finish_reason == "length"
    with pytest.raises(TypeError, match="unknown arguments"):
        LLM("x", max_num_seq=3)


def test_kv_cache_too_small_for_max_model_len(llama_dir):
    with pytest.raises(ValueError, match="largest max_model_len that fits is 64"):
        LLM(str(llama_dir), num_kv_blocks=4, max_model_len=128)


def test_max_model_len_past_the_trained_positions(tmp_path, llama_dir, monkeypatch):
    """Refused (the tiny llama has 512 positions) unless ARCSERVE_ALLOW_LONG_MAX_MODEL_LEN=1, which
    serves it with a warning; linear RoPE scaling extends the trained length by its factor."""
    with pytest.raises(ValueError, match="max_model_len 600 is longer than the 512 positions.*ALLOW_LONG"):
        LLM(str(llama_dir), max_model_len=600, num_kv_blocks=64)
    monkeypatch.setenv("ARCSERVE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    out = LLM(str(llama_dir), max_model_len=600, num_kv_blocks=64).generate([[5] * 550], greedy(8))
    assert len(out[0].outputs[0].token_ids) == 8
    monkeypatch.delenv("ARCSERVE_ALLOW_LONG_MAX_MODEL_LEN")
    scaled = tmp_path / "linear_rope"
    shutil.copytree(llama_dir, scaled)
    cfg = json.loads((scaled / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (scaled / "config.json").write_text(json.dumps(cfg))
    assert LLM(str(scaled), max_model_len=1024, num_kv_blocks=64).llm_engine.max_model_len == 1024
    with pytest.raises(ValueError, match="1025 is longer than the 1024 positions"):
        LLM(str(scaled), max_model_len=1025, num_kv_blocks=80)
    # a config.json that states no length: max_model_len's default is 2,048, a longer one is not refused
    unknown = tmp_path / "no_length"
    shutil.copytree(llama_dir, unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    del cfg["max_position_embeddings"]
    (unknown / "config.json").write_text(json.dumps(cfg))
    assert LLM(str(unknown), num_kv_blocks=160).llm_engine.max_model_len == 2048
    assert LLM(str(unknown), max_model_len=2500, num_kv_blocks=160).llm_engine.max_model_len == 2500


def test_loading_errors_name_what_is_missing(tmp_path, llama_dir):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path / "empty"))
    bad = tmp_path / "bad_arch"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(bad))
    noweights = tmp_path / "no_weights"
    shutil.copytree(llama_dir, noweights)
    (noweights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        LLM(str(noweights))


def test_sharded_checkpoint_and_dtypes(tmp_path, llama_dir):
    from tiny_models import make_model_dir

    sharded = make_model_dir(tmp_path / "sharded", "llama", seed=0, shard=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    a = LLM(str(sharded), dtype="float32", max_model_len=128)
    b = LLM(str(llama_dir), dtype="float32", max_model_len=128)
    p = "The quick brown"
    assert a.generate(p, greedy(), use_tqdm=False)[0].outputs[0].token_ids == (
        b.generate(p, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    )
    for dtype, expect in [("bfloat16", torch.bfloat16), ("float16", torch.float16), ("auto", torch.float32)]:
        llm = LLM(str(llama_dir), dtype=dtype, max_model_len=64)
        assert llm.llm_engine.model.dtype == expect
        assert len(llm.generate(p, greedy(4), use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_generation_config_defaults(tmp_path, llama_dir):
    d = tmp_path / "gen"
    shutil.copytree(llama_dir, d)
    (d / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 7], "temperature": 0.3, "top_p": 0.8, "top_k": 20,
                    "presence_penalty": 0.5, "frequency_penalty": -0.25})  # fmt: skip
    )
    llm = LLM(str(d), max_model_len=64)
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.3, 0.8, 20)
    assert (sp.presence_penalty, sp.frequency_penalty) == (0.5, -0.25)  # (vLLM reads them too)
    assert llm.llm_engine.eos_token_ids == {2, 7}
    out = llm.generate("x", greedy(6, logit_bias={7: 100.0}), use_tqdm=False)[0].outputs[0]
    # generation_config's extra EOS id stops as vLLM's stop_token_ids do: reported as the stop_reason
    assert out.token_ids == [7] and (out.finish_reason, out.stop_reason) == ("stop", 7)
    out = llm.generate("x", greedy(6, logit_bias={2: 100.0}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [2] and (out.finish_reason, out.stop_reason) == ("stop", None)  # the tokenizer's
    out = llm.generate("x", greedy(3, logit_bias={7: 100.0}, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [7, 7, 7] and (out.finish_reason, out.stop_reason) == ("length", None)
    # generation_config="vllm": SamplingParams' own defaults, the model's EOS ids all the same (as vLLM)
    plain = LLM(str(d), max_model_len=64, generation_config="vllm")
    sp = plain.get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.top_k) == (1.0, 1.0, -1) and plain.llm_engine.eos_token_ids == {2, 7}
    assert (sp.presence_penalty, sp.frequency_penalty) == (0.0, 0.0)
    out = plain.generate("x", greedy(6, logit_bias={7: 100.0}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [7] and out.stop_reason == 7
    # override_generation_config (vLLM's): keys over the file's, under "vllm" too; other keys ignored
    over = LLM(str(d), max_model_len=64, override_generation_config={"temperature": 0.7, "max_new_tokens": 5,
                                                                     "do_sample": True})  # fmt: skip
    sp = over.get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (0.7, 0.8, 20, 5)
    assert len(over.generate("x", use_tqdm=False)[0].outputs[0].token_ids) <= 5  # the defaults serve generate
    sp = LLM(str(d), max_model_len=64, generation_config="vllm",
             override_generation_config='{"top_p": 0.5}').get_default_sampling_params()  # fmt: skip
    assert (sp.temperature, sp.top_p, sp.top_k) == (1.0, 0.5, -1)
    with pytest.raises(ValueError, match="generation config's sampling defaults.*temperature"):
        LLM(str(d), max_model_len=64, override_generation_config={"temperature": -1})


def test_get_metrics_counts_exactly(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=128)
    outs = llm.generate(["The quick", "Paris is", "def"], [greedy(5), greedy(7), greedy(3)], use_tqdm=False)
    m = llm.get_metrics()
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    assert gen == 15
    assert m["arcserve:generation_tokens_total"] == gen
    assert m["arcserve:prompt_tokens_total"] == prompt
    assert m["arcserve:request_success_total"] == {"length": 3}
    assert m["arcserve:num_requests_running"] == 0 and m["arcserve:kv_cache_usage_perc"] == 0.0
    assert m["arcserve:time_to_first_token_seconds"]["count"] == 3
    assert m["arcserve:inter_token_latency_seconds"]["count"] == gen - 3
    assert m["arcserve:request_generation_tokens"]["sum"] == gen
    assert m["arcserve:e2e_request_latency_seconds"]["buckets"][-1] == ("+Inf", 3)
    # A second identical request hits the prefix cache for the full blocks of the first.
    long = "The quick brown fox jumps over the lazy dog again and again and again"
    llm.generate(long, greedy(2), use_tqdm=False)
    llm.generate(long, greedy(2), use_tqdm=False)
    m2 = llm.get_metrics()
    assert m2["arcserve:prefix_cache_hits_total"] > m["arcserve:prefix_cache_hits_total"]
    assert m2["arcserve:prefix_cache_queries_total"] > m2["arcserve:prefix_cache_hits_total"]


def test_a_failing_step_fails_only_its_requests(llama_dir, monkeypatch):
    from arcserve.engine.async_engine import step_isolated

    engine = LLMEngine(EngineArgs(model=str(llama_dir), dtype="float32", max_model_len=128))
    engine.add_request("a", "The quick", greedy(5))
    engine.add_request("b", "Paris", greedy(5))
    real = engine.runner.launch

    def broken(*args, **kw):  # (overlapped steps, the GPU default, pass defer_history too)
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.runner, "launch", broken)
    outs, failed, err = step_isolated(engine)
    assert outs == [] and sorted(failed) == ["a", "b"] and "injected" in repr(err)
    assert not engine.has_unfinished_requests() and engine.scheduler.kv.usage() == 0.0
    assert engine.get_metrics()["arcserve:request_success_total"] == {"abort": 2}
    monkeypatch.setattr(engine.runner, "launch", real)
    engine.add_request("c", "The quick", greedy(5))
    done = []
    while engine.has_unfinished_requests():
        outs, failed, _ = step_isolated(engine)
        assert failed == []
        done += [o for o in outs if o.finished]
    assert [o.request_id for o in done] == ["c"] and len(done[0].outputs[0].token_ids) == 5


def test_sequence_ids_of_n_collide_with_a_live_request(llama_dir):
    """n > 1 names its sequences "0_<id>", "1_<id>", ...: a request whose id is taken that way is
    refused before anything changes (it corrupted both requests and never finished), either way round."""
    engine = LLMEngine(EngineArgs(model=str(llama_dir), dtype="float32", max_model_len=64))
    engine.add_request("0_a", [5, 6, 7], greedy(4))
    with pytest.raises(ValueError, match="sequence id '0_a' is already in use"):
        engine.add_request("a", [5, 6, 7], SamplingParams(n=2, temperature=0, max_tokens=4))
    engine.add_request("b", [5, 6, 7], SamplingParams(n=2, temperature=0, max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("1_b", [5, 6, 7], greedy(4))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(done) == ["0_a", "b"] and len(done["b"].outputs) == 2
    assert engine.scheduler.kv.usage() == 0.0


def test_priority_needs_the_priority_policy(llm):
    """A priority on a first-come-first-served engine would be ignored: refused, as vLLM does."""
    with pytest.raises(ValueError, match="priority 2 needs a policy that reads it, e.g. scheduling_policy='priority'"):
        llm.generate("x", greedy(2), priority=[2], use_tqdm=False)
    assert llm.generate("x", greedy(2), priority=[0], use_tqdm=False)[0].outputs[0].token_ids


def test_llm_engine_as_vllm_drives_it(llm, llama_dir):
    """vLLM's LLMEngine surface: from_engine_args, get_tokenizer, add_request(request_id, prompt,
    params, arrival_time, lora_request, tokenization_kwargs, trace_headers, priority) returning the
    id; what vLLM refuses (a request_id that is not a str) or a caller gets wrong (params as a dict,
    an output_kind or arrival_time of the wrong kind, float token ids, a None prompt) is refused
    before anything changes, and the engine serves on."""
    engine = llm.llm_engine
    assert engine.get_tokenizer() is engine.tokenizer
    assert engine.add_request("v", "The quick", greedy(3), 1.5e9, None, {"add_special_tokens": False},
                              {"traceparent": "x"}, 0) == "v"  # fmt: skip
    bad = [
        (dict(request_id=7), TypeError, "request_id must be a string"),
        (dict(params={"max_tokens": 3}), ValueError, "params must be a SamplingParams"),
        (dict(output_kind="delta"), ValueError, "output_kind must be a RequestOutputKind"),
        (dict(arrival_time="now"), ValueError, "arrival_time must be a time.time\\(\\) number"),
        (dict(prompt={"prompt_token_ids": [1.7, 5.2]}), ValueError, "prompt_token_ids must be a list of integer"),
        (dict(prompt={"prompt": None}), ValueError, "prompt must be a string"),
        (dict(lora_request=object()), ValueError, "LoRA adapters are not supported"),
    ]
    for change, kind, message in bad:
        kw = {"request_id": "bad", "prompt": "x", "params": greedy(2), **change}
        with pytest.raises(kind, match=message):
            engine.add_request(**kw)
        assert engine.get_num_unfinished_requests() == 1
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["v"] and len(done[0].outputs[0].token_ids) == 3
    assert done[0].metrics.arrival_time == 1.5e9  # (an arrival_time given is kept, 0 too: not "now")
    for bad_kw, message in [(dict(max_num_seqs=True), "max_num_seqs must be a positive integer"),
                            (dict(enable_prefix_caching="no"), "enable_prefix_caching must be True or False"),
                            (dict(seed=-1), "seed must be an integer in"), (dict(seed="x"), "seed must be")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=str(llama_dir), **bad_kw)
    for kw, message in [(dict(stop=5), "stop must be a string or a list"), (dict(stop_token_ids=[1.5]), "stop_token_ids"),
                        (dict(output_kind="delta"), "output_kind must be")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kw)
    small = LLMEngine.from_engine_args(
        EngineArgs(model=str(llama_dir), dtype="float32", max_model_len=64, async_scheduling=True)
    )
    assert isinstance(small, LLMEngine) and small.add_request("a", [5, 6], greedy(1), arrival_time=0) == "a"
    outs = []
    while small.has_unfinished_requests():  # (overlapped steps, a GPU's default, answer a step late)
        outs += small.step()
    assert [o.metrics.arrival_time for o in outs] == [0.0]
