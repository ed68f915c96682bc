"""Structured outputs (engine/structured.py): greedy tokens against transformers' logits masked by an
independent llguidance matcher at every step (tiny_models.grammar_greedy), validity of sampled outputs, the same tokens through
every engine path (overlapped steps, preemption, prefix cache, speculation), and bad input."""

from __future__ import annotations

import json
import re

import pytest
import torch
from tiny_models import grammar_greedy

from arcserve import LLM, SamplingParams, StructuredOutputsParams
from arcserve.engine.structured import _no_additional_properties

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tag": {"enum": ["fox", "dog", "cat"]}},
    "required": ["ok", "n", "tag"], "additionalProperties": False,
}  # fmt: skip
CONSTRAINTS = {
    "regex": StructuredOutputsParams(regex=r"[a-z]{2,5}( [0-9]{1,3})?"),
    "choice": StructuredOutputsParams(choice=["Paris", "Berlin", "the capital"]),
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "json_text": StructuredOutputsParams(json=json.dumps(SCHEMA)),  # whitespace allowed: may run to max_tokens
    "gbnf": StructuredOutputsParams(grammar='root ::= "add(" num ", " num ")"\nnum ::= [0-9] | [1-9] [0-9]'),
    "lark": StructuredOutputsParams(grammar='start: ("yes" | "no") "!"?'),
    "json_object": StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
}
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(60, 80))]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=str(llama_dir), dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def valid(kind: str, text: str) -> bool:
    so = CONSTRAINTS[kind]
    if kind == "regex":
        return re.fullmatch(so.regex, text) is not None
    if kind == "choice":
        return text in so.choice
    if kind in ("json", "json_text"):
        v = json.loads(text)
        return set(v) == {"ok", "n", "tag"} and isinstance(v["ok"], bool) and 0 <= v["n"] <= 99 and v["tag"] in ("fox", "dog", "cat")
    if kind == "gbnf":
        return re.fullmatch(r"add\((0|[1-9][0-9]?), (0|[1-9][0-9]?)\)", text) is not None
    if kind == "lark":
        return re.fullmatch(r"(yes|no)!?", text) is not None
    return isinstance(json.loads(text), dict)


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_tokens_are_transformers_logits_under_the_grammar(llm, hf_model, llama_dir, kind):
    so = CONSTRAINTS[kind]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=40, structured_outputs=so), use_tqdm=False)  # fmt: skip
    finished = 0
    for p, out in zip(PROMPTS, outs):
        o = out.outputs[0]
        want = grammar_greedy(hf_model, llama_dir, p, so, 40)
        got = list(o.token_ids)
        assert got == want[: len(got)] and (o.finish_reason == "length" or got == want), (kind, got, want)
        if o.finish_reason == "stop":  # ended by EOS, which the grammar allows only where the text is complete
            assert valid(kind, o.text), (kind, o.text)
            finished += 1
    if kind != "json_text":  # the bounded constraints complete within 40 tokens (JSON's whitespace may not)
        assert finished == len(PROMPTS)


def test_sampled_outputs_follow_the_grammar_and_seeds_reproduce(llm):
    kinds = ["regex", "choice", "json", "gbnf", "lark"]  # (bounded: any JSON object may run to max_tokens)
    params = [SamplingParams(temperature=1.0, n=6, seed=11 + i, max_tokens=60, structured_outputs=CONSTRAINTS[k])
              for i, k in enumerate(kinds)]  # fmt: skip
    prompts = [{"prompt_token_ids": PROMPTS[i % 3]} for i in range(len(kinds))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    texts = set()
    for kind, out in zip(kinds, outs):
        for o in out.outputs:
            assert o.finish_reason == "stop", (kind, o.text)
            assert valid(kind, o.text), (kind, o.text)
            texts.add((kind, o.text))
    assert len(texts) > 2 * len(kinds)  # sampling, not one answer per constraint
    again = llm.generate(prompts[:2], params[:2], use_tqdm=False)
    assert [[o.text for o in a.outputs] for a in again] == [[o.text for o in b.outputs] for b in outs[:2]]


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(llm):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], plain, use_tqdm=False)
    mixed = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS for _ in range(2)],
        [plain, SamplingParams(temperature=0, max_tokens=24, structured_outputs=CONSTRAINTS["regex"])] * 3,
        use_tqdm=False,
    )  # fmt: skip
    assert [o.outputs[0].token_ids for o in mixed[0::2]] == [o.outputs[0].token_ids for o in alone]
    assert all(valid("regex", o.outputs[0].text) for o in mixed[1::2])


@pytest.mark.parametrize("engine_kw", [
    {"async_scheduling": True},
    {"num_kv_blocks": 40, "block_size": 4, "max_num_batched_tokens": 16, "max_model_len": 128},  # chunks, preemption
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}},
    {"enable_prefix_caching": True, "second_pass": True},
], ids=["overlapped", "preempted", "speculating", "prefix-cached"])  # fmt: skip
def test_every_engine_path_gives_the_same_constrained_tokens(llm, llama_dir, engine_kw):
    kinds = ["regex", "json", "gbnf", "json_text"]
    # (prompts that repeat themselves: prompt lookup finds drafts in them)
    prompts = [{"prompt_token_ids": PROMPTS[i % 3] * 4} for i in range(len(kinds) + 2)]
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=CONSTRAINTS[k]) for k in kinds]
    # sampled (its seed hashed with each token's position) and held off EOS by min_tokens
    params.append(SamplingParams(temperature=1.0, seed=7, min_tokens=6, max_tokens=30, structured_outputs=CONSTRAINTS["gbnf"]))
    params.append(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))  # an unconstrained one beside
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    kw = dict(engine_kw)
    second = kw.pop("second_pass", False)
    other = LLM(model=str(llama_dir), dtype="float32", **{"max_model_len": 256, **kw})
    runs = 2 if second else 1
    for _ in range(runs):
        got = [o.outputs[0].token_ids for o in other.generate(prompts, params, use_tqdm=False)]
        assert got == want
    if "num_kv_blocks" in kw:
        assert other.llm_engine.scheduler.stats().num_preemptions > 0
    if second:
        assert other.llm_engine.scheduler.stats().prefix_cache_hits > 0
    if "speculative_config" in kw:  # the unconstrained request did speculate
        assert other.llm_engine.metrics.spec.num_drafts > 0


def test_the_grammar_wins_over_masks_that_leave_it_nothing(llm):
    """min_tokens masks EOS, which is all a finished choice allows; allowed_token_ids and bad_words may
    exclude every token the grammar allows: the grammar's tokens are sampled (and the output is valid)."""
    so = StructuredOutputsParams(choice=["Paris"])
    tok = llm.get_tokenizer()
    for extra in ({"min_tokens": 20}, {"allowed_token_ids": [3, 4]}, {"bad_words": ["Paris"]}):
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=30,
                           structured_outputs=so, **extra), use_tqdm=False)[0].outputs[0]  # fmt: skip
        assert (out.text, out.finish_reason) == ("Paris", "stop"), extra
        ids = list(out.token_ids)  # one EOS ends it, min_tokens or not
        assert ids[-1] == 2 and ids.count(2) == 1 and tok.decode(ids[:-1]) == "Paris", (extra, ids)


def test_n_sequences_each_follow_the_grammar_on_their_own(llm):
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(
        temperature=1.5, n=8, seed=3, max_tokens=20, structured_outputs=CONSTRAINTS["choice"]), use_tqdm=False)[0]  # fmt: skip
    assert all(o.text in CONSTRAINTS["choice"].choice and o.finish_reason == "stop" for o in out.outputs)
    assert len({o.text for o in out.outputs}) > 1


def test_chat_with_a_json_schema(llm):
    out = llm.chat([{"role": "user", "content": "a fox?"}],
                   SamplingParams(temperature=0, max_tokens=40, structured_outputs=CONSTRAINTS["json"]), use_tqdm=False)  # fmt: skip
    assert valid("json", out[0].outputs[0].text)


def test_constraints_are_checked_when_made_and_when_added(llm):
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar and json_object; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"exactly one .* got \['regex', 'choice'\]"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice must be a non-empty list of non-empty strings"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="json_object must be true"):
        StructuredOutputsParams(json_object=False)
    with pytest.raises(ValueError, match="whitespace_pattern is not supported"):
        StructuredOutputsParams(json={}, whitespace_pattern=r"\s*")
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"  # vLLM's dict form
    bad = {
        "regex": (StructuredOutputsParams(regex="[0-9"), r"(?s)structured_outputs.regex is not valid: .*unclosed character class"),
        "json": (StructuredOutputsParams(json="{bad"), "structured_outputs.json is not valid JSON"),
        "schema": (StructuredOutputsParams(json={"type": "nonsense"}), "structured_outputs.json is not valid"),
        "gbnf": (StructuredOutputsParams(grammar="root ::= missing"), "structured_outputs.grammar is not valid"),
        "lark": (StructuredOutputsParams(grammar="start: ("), "structured_outputs.grammar is not valid"),
    }  # fmt: skip
    for so, match in bad.values():
        with pytest.raises(ValueError, match=match):
            llm.generate(["hi"], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(["hi"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)  # the engine serves on
    assert len(out[0].outputs[0].token_ids) == 3


def test_disable_additional_properties_closes_objects_that_do_not_say():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "array", "items": {"properties": {"d": {}}}}},
              "$defs": {"e": {"properties": {"f": {}}, "additionalProperties": True}}}  # fmt: skip
    got = _no_additional_properties(json.loads(json.dumps(schema)))
    assert got["additionalProperties"] is False
    assert got["properties"]["a"]["additionalProperties"] is False
    assert got["properties"]["c"]["items"]["additionalProperties"] is False
    assert got["$defs"]["e"]["additionalProperties"] is True  # (what a schema says stays)
    assert "additionalProperties" not in got["properties"]["a"]["properties"]["b"]  # not an object schema
