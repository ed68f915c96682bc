"""LLM.beam_search (vLLM's algorithm and scores) against the same search run over transformers' logits."""

import json
import shutil

import pytest
import torch
from tiny_models import beam_reference as reference
from tiny_models import hf_greedy

from arcserve import LLM, BeamSearchParams

PROMPTS = ["The quick brown fox", {"prompt_token_ids": [5, 17, 33, 101, 7]}]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def hf(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def prompt_ids(llm, p):
    return p["prompt_token_ids"] if isinstance(p, dict) else llm.get_tokenizer().encode(p)


def tokens_of(outs):
    return [[s.tokens for s in o.sequences] for o in outs]


def check(llm, hf, out, width, max_tokens, eos, penalty, max_len=256):
    tok = llm.get_tokenizer()
    for p, o in zip(PROMPTS, out):
        ids = prompt_ids(llm, p)
        want = reference(hf, ids, width, max_tokens, eos, penalty, max_len, llm.llm_engine.eos_token_ids)
        assert [s.tokens for s in o.sequences] == [w[0] for w in want]
        for s, (_, cum) in zip(o.sequences, want):
            assert s.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert s.text == tok.decode(s.tokens)  # the prompt's text too, as vLLM's
            gen = s.tokens[len(ids):]
            assert len(s.logprobs) == len(gen) and all(t in e for t, e in zip(gen, s.logprobs))
            assert s.cum_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(gen, s.logprobs)), abs=1e-5)
            stopped = gen[-1] in eos
            assert s.finish_reason == ("stop" if stopped else "length")
            assert s.stop_reason == (gen[-1] if stopped else None)
            assert stopped or len(gen) == max_tokens or len(s.tokens) == max_len


@pytest.mark.parametrize("width,penalty", [(1, 1.0), (3, 1.0), (4, 0.0), (3, 2.0)])
def test_beam_search_equals_the_reference(llm, hf, width, penalty):
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=penalty, ignore_eos=True)
    out = llm.beam_search(PROMPTS, params)
    assert [len(o.sequences) for o in out] == [width, width]
    check(llm, hf, out, width, 6, set(), penalty)
    assert not llm.llm_engine.has_unfinished_requests()


def test_width_one_is_greedy(llm, llama_dir):
    ids = [prompt_ids(llm, p) for p in PROMPTS]
    out = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=10, ignore_eos=True))
    assert [o.sequences[0].tokens for o in out] == [i + g for i, g in zip(ids, hf_greedy(llama_dir, ids, 10))]


def test_eos_finishes_beams(llm, hf, llama_dir, tmp_path):
    """An EOS id among a step's candidates finishes that beam (kept among the finished, ranked with
    the live ones at the end). The tiny model's EOS is never likely, so a copy of it names one of its
    likely tokens as a second EOS id (generation_config.json's list, which the engine reads)."""
    first = llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    n = len(prompt_ids(llm, PROMPTS[0]))
    likely = first[0].sequences[0].tokens[n + 2]  # the best beam's third token
    model = tmp_path / "eos"
    shutil.copytree(llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, likely]}))
    eos_llm = LLM(str(model), dtype="float32", max_model_len=256)
    eos = set(eos_llm.llm_engine.eos_token_ids)
    assert eos == {2, likely}
    out = eos_llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=6))
    check(eos_llm, hf, out, 3, 6, eos, 1.0)
    assert any(s.finish_reason == "stop" and s.tokens[-1] == likely for s in out[0].sequences)
    # under ignore_eos nothing finishes early, and a final EOS id still leaves the length (vLLM's score)
    kept = eos_llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True, length_penalty=2.0))
    check(eos_llm, hf, kept, 3, 6, set(), 2.0)
    assert all(s.finish_reason == "length" for o in kept for s in o.sequences)


def test_beams_stop_at_max_model_len(llama_dir, hf):
    short = LLM(str(llama_dir), dtype="float32", max_model_len=12)
    ids = PROMPTS[1]["prompt_token_ids"]
    out = short.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=2, max_tokens=20, ignore_eos=True))
    want = reference(hf, ids, 2, 20, set(), 1.0, max_len=12)
    assert [s.tokens for s in out[0].sequences] == [w[0] for w in want]
    assert all(len(s.tokens) == 12 and s.finish_reason == "length" for s in out[0].sequences)


def test_sampled_candidates_and_prefix_cache_hits(llm):
    """temperature > 0: a step's candidates are the 2 x width most likely tokens plus the sampled one
    (so 2w or 2w + 1 of them), every beam's token among its step's candidates. Every step after the
    first finds the beams' full KV blocks in the prefix cache."""
    width, steps = 2, 24
    hits = llm.get_metrics()["arcserve:prefix_cache_hits_total"]
    out = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=steps, temperature=1.5, ignore_eos=True))
    for p, o in zip(PROMPTS, out):
        n = len(prompt_ids(llm, p))
        for s in o.sequences:
            gen = s.tokens[n:]
            assert len(gen) == steps and all(t in e for t, e in zip(gen, s.logprobs))
            assert all(len(e) in (2 * width, 2 * width + 1) for e in s.logprobs)
        assert len({tuple(s.tokens) for s in o.sequences}) == width
    hit = llm.get_metrics()["arcserve:prefix_cache_hits_total"] - hits
    # at least the prompts' full 16-token blocks, for every live beam of every step after the first
    assert hit >= (steps - 1) * width * sum(len(prompt_ids(llm, p)) // 16 * 16 for p in PROMPTS)


def test_concurrency_limit_and_progress_bar_give_the_same_beams(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    together = llm.beam_search(PROMPTS, params)
    one_by_one = llm.beam_search(PROMPTS, params, use_tqdm=True, concurrency_limit=1)
    assert tokens_of(together) == tokens_of(one_by_one)
    single = llm.beam_search(PROMPTS[0], params)  # one prompt, not in a list
    assert [s.tokens for s in single[0].sequences] == [s.tokens for s in together[0].sequences]
    assert llm.beam_search([], params) == []


@pytest.mark.parametrize("kwargs,match", [
    (dict(beam_width=0, max_tokens=4), "beam_width must be"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature must be"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty must be"),
])  # fmt: skip
def test_bad_params_name_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_bad_requests_leave_nothing_behind(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="beam_width must be at most 10"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=11, max_tokens=4))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([PROMPTS[0], {"prompt_token_ids": [5] * 300}], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        llm.beam_search([""], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search(PROMPTS, {"beam_width": 2})
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=4), concurrency_limit=0)
    assert not engine.has_unfinished_requests()
    wide = LLM(llm.llm_engine.args.model, dtype="float32", max_model_len=256, max_logprobs=-1)
    assert len(wide.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=12, max_tokens=2))[0].sequences) == 12


def test_request_output_is_the_servers_answer(llm):
    """The server's form of a search (vLLM's online one): generated tokens only, best first; an
    ending EOS id left out of the tokens, text and logprobs (and named as stop_reason) unless
    include_stop_str_in_output."""
    from arcserve.beam_search import BeamSearchOutput, BeamSearchSequence, request_output
    from arcserve.outputs import Logprob

    tok = llm.get_tokenizer()
    prompt = [5, 6, 7]
    lp = [{t: Logprob(-0.5, 1)} for t in (40, 41, 2)]
    out = BeamSearchOutput([BeamSearchSequence(prompt + [40, 41, 2], lp, -1.5, finish_reason="stop", stop_reason=2),
                            BeamSearchSequence(prompt + [42, 43, 44], lp, -2.0, finish_reason="length")])  # fmt: skip
    for keep in (False, True):
        params = BeamSearchParams(beam_width=2, max_tokens=3, include_stop_str_in_output=keep)
        got = request_output(out, prompt, "p", params, tok)
        assert got.prompt_token_ids == prompt and got.finished and [o.index for o in got.outputs] == [0, 1]
        stop, length = got.outputs
        assert stop.token_ids == ([40, 41, 2] if keep else [40, 41]) and len(stop.logprobs) == len(stop.token_ids)
        assert stop.finish_reason == "stop" and stop.stop_reason == 2 and stop.cumulative_logprob == -1.5
        assert stop.text == tok.decode(stop.token_ids, skip_special_tokens=True)
        assert length.token_ids == [42, 43, 44] and length.finish_reason == "length" and length.stop_reason is None


def test_request_output_keeps_a_sentencepiece_texts_leading_space(tmp_path):
    """A Metaspace (SentencePiece) decoder drops a text's leading space: the answer's text is decoded
    after the prompt's last tokens, so " is the capital" keeps its space, as the engine's texts do."""
    from tiny_models import make_tokenizer

    from arcserve.beam_search import BeamSearchOutput, BeamSearchSequence, request_output

    tok = make_tokenizer(tmp_path, "sp")
    ids = tok.encode("Paris is the capital", add_special_tokens=False)
    prompt, gen = ids[:2], ids[2:]
    assert not tok.decode(gen).startswith(" ")  # (the decoder's own reading of the answer alone)
    out = BeamSearchOutput([BeamSearchSequence(prompt + gen, [], -1.0, finish_reason="length")])
    got = request_output(out, prompt, None, BeamSearchParams(beam_width=1, max_tokens=len(gen)), tok)
    text = got.outputs[0].text
    assert text.startswith(" ") and tok.decode(prompt) + text == tok.decode(ids)
    assert got.outputs[0].logprobs == []
