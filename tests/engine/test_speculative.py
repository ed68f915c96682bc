"""Speculative decoding: configuration, prompt lookup, the acceptance rule (statistically, on hand-made
distributions), the draft-length rule, and whole engines whose output must not change with speculation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import DEVICE

from arcserve import LLM, SamplingParams
from arcserve.config import EngineArgs, SpeculativeConfig
from arcserve.engine.ngram import NgramProposer, find_drafts
from arcserve.engine.request import Request
from arcserve.engine.sampler import Sampler
from arcserve.engine.speculative import DraftLength, accept

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

# Statistical checks reject at a false-alarm rate of 1e-4 each (Wilson-Hilferty chi-square quantile).
ALPHA_Z = 3.719  # standard normal quantile of 1 - 1e-4


def chi2_critical(df: int, z: float = ALPHA_Z) -> float:
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_goodness(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom, pooling cells expected below 5 into one."""
    n = counts.sum()
    exp = probs * n
    small = exp < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
        if exp[-1] == 0:
            assert counts[-1] == 0, "tokens drawn where the distribution has no mass"
            counts, exp = counts[:-1], exp[:-1]
    return float(((counts - exp) ** 2 / exp).sum()), len(exp) - 1


# ---- configuration ------------------------------------------------------------------------------


def test_config_shapes_and_errors():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 1, 1)
    c = SpeculativeConfig.parse({"model": "/some/dir", "num_speculative_tokens": 5})
    assert (c.method, c.model) == ("draft_model", "/some/dir")
    assert SpeculativeConfig.parse(None) is None
    bad = [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "positive"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "exceeds"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown keys"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ("{not json", "JSON"),
        ([1, 2], "dict"),
    ]
    for spec, msg in bad:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.parse(spec)
    assert EngineArgs(speculative_config=NGRAM).speculative_config.prompt_lookup_max == 4


def test_draft_with_another_vocabulary_is_refused(tmp_path, llama_dir):
    from tiny_models import make_model_dir

    other = make_model_dir(tmp_path / "other", "llama", vocab_size=400)
    with pytest.raises(ValueError, match="vocabulary of 400 tokens"):
        LLM(str(llama_dir), speculative_config={"model": str(other), "num_speculative_tokens": 2})
    same_size = make_model_dir(tmp_path / "meta", "llama", tokenizer="metaspace")
    with pytest.raises(ValueError, match="another tokenizer"):
        LLM(str(llama_dir), speculative_config={"model": str(same_size), "num_speculative_tokens": 2})


def test_draft_positions_checked_like_the_target(tmp_path, llama_dir, monkeypatch):
    """A draft trained for fewer positions than max_model_len is refused as the target would be (its
    linear RoPE factor counts), and let through by ARCSERVE_ALLOW_LONG_MAX_MODEL_LEN=1."""
    import json
    import shutil

    target = tmp_path / "target"
    shutil.copytree(llama_dir, target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["max_position_embeddings"] = 1024
    (target / "config.json").write_text(json.dumps(cfg))
    spec = {"model": str(llama_dir), "num_speculative_tokens": 2}  # 512 positions
    with pytest.raises(ValueError, match="longer than the 512 positions the draft model"):
        LLM(str(target), max_model_len=1024, num_kv_blocks=128, speculative_config=spec)
    scaled = tmp_path / "scaled_draft"
    shutil.copytree(llama_dir, scaled)
    cfg = json.loads((scaled / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (scaled / "config.json").write_text(json.dumps(cfg))
    LLM(str(target), max_model_len=1024, num_kv_blocks=128, speculative_config={**spec, "model": str(scaled)})
    monkeypatch.setenv("ARCSERVE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    llm = LLM(str(target), max_model_len=1024, num_kv_blocks=128, speculative_config=spec)
    out = llm.generate([[5] * 600], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


# ---- prompt lookup ------------------------------------------------------------------------------


def test_find_drafts_longest_and_most_recent_match():
    t = np.array([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3], dtype=np.int64)
    # suffix (2, 3): most recent earlier occurrence at index 6 -> 7, 8, 5, 2
    assert find_drafts(t, 2, 4, 4).tolist() == [7, 8, 5, 2]
    # the longer suffix (5, 2, 3) does not occur earlier; (1, 2, 3) style longer match wins when present
    t2 = np.array([4, 1, 2, 3, 6, 0, 2, 3, 5, 4, 1, 2, 3], dtype=np.int64)
    assert find_drafts(t2, 2, 4, 3).tolist() == [6, 0, 2]  # (4, 1, 2, 3) matched, not the later (2, 3)
    assert find_drafts(t2, 2, 2, 3).tolist() == [5, 4, 1]  # only bigrams: the most recent (2, 3)
    assert find_drafts(np.array([1, 2, 3, 4], dtype=np.int64), 1, 3, 4).tolist() == []
    assert find_drafts(np.array([5], dtype=np.int64), 1, 3, 4).tolist() == []
    # drafts stop at the end of the context
    assert find_drafts(np.array([7, 8, 7], dtype=np.int64), 1, 2, 5).tolist() == [8, 7]
    # periodic text: the most recent occurrence has too few tokens after it, the earliest has k
    assert find_drafts(np.array([4, 4, 4, 4, 4, 4], dtype=np.int64), 2, 2, 3).tolist() == [4, 4, 4]
    t3 = np.array([1, 2, 5, 6, 7, 8, 1, 2, 9, 1, 2], dtype=np.int64)
    assert find_drafts(t3, 2, 2, 3).tolist() == [9, 1, 2]  # the latest with 3 tokens after it
    assert find_drafts(t3, 2, 2, 4).tolist() == [5, 6, 7, 8]  # only the earliest has 4


def test_ngram_proposer_follows_growing_requests():
    p = NgramProposer(1, 3)
    r = Request("a", [1, 2, 3, 1, 2], SamplingParams(), 100)
    p.propose([(r, 2)], [r])
    assert r.spec_token_ids == [3, 1]
    r.token_ids += [3, 4, 1, 2, 3]
    p.propose([(r, 3)], [r])
    assert r.spec_token_ids == [4, 1, 2]  # (1, 2, 3) last seen before 4
    p.propose([], [])
    assert p._tokens == {}  # forgotten once not running


# ---- acceptance ---------------------------------------------------------------------------------


def test_accept_rule():
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # first mismatch ends it
    assert accept([5, 6, 7], [1, 6, 7, 8]) == [1]  # all rejected: the target's own token
    assert accept([], [4]) == [4]


def _verify_samples(probs_rows: list[list[float]], drafts: list[int], n: int, temperature: float = 1.0):
    """n seeded requests, each verifying `drafts` against target rows with these probabilities
    through the real sampler; returns each request's accepted tokens."""
    logits_rows = torch.tensor(np.log(np.maximum(np.array(probs_rows, dtype=np.float64), 1e-300)), dtype=torch.float32)
    logits_rows[torch.tensor(probs_rows) == 0] = float("-inf")
    s = len(drafts)
    reqs, rows = [], []
    for i in range(n):
        r = Request(str(i), [1, 2, 3], SamplingParams(temperature=temperature, seed=1000 + i), 100)
        r.seed = 1000 + i
        r.spec_token_ids = list(drafts)
        reqs += [r] * (s + 1)
        rows.append(logits_rows)
    logits = torch.cat(rows)
    offsets = np.tile(np.arange(s + 1), n)
    toks = Sampler(torch.device("cpu"), 0)(logits, reqs, offsets).tokens.tolist()
    return [accept(drafts, toks[i * (s + 1) : (i + 1) * (s + 1)]) for i in range(n)]


def test_rejection_sampling_keeps_target_distribution():
    """Drafts accepted with probability p(draft), rejected ones resampled from p without the draft,
    bonus token from the last row: every output position follows the target's distribution."""
    p0 = [0.5, 0.3, 0.15, 0.05]
    p1 = [0.1, 0.6, 0.2, 0.1]
    p2 = [0.25, 0.25, 0.25, 0.25]
    n = 6000
    out = _verify_samples([p0, p1, p2], drafts=[1, 1], n=n)
    first = np.bincount([o[0] for o in out], minlength=4)
    stat, df = chi2_goodness(first, np.array(p0))
    assert stat < chi2_critical(df), (first, stat)
    # the draft at position 0 is accepted with probability p0[1] = 0.3
    acc = sum(len(o) > 1 for o in out)
    assert abs(acc / n - 0.3) < ALPHA_Z * math.sqrt(0.3 * 0.7 / n)
    # given the first draft accepted, the second token follows p1
    second = np.bincount([o[1] for o in out if len(o) > 1], minlength=4)
    stat, df = chi2_goodness(second, np.array(p1))
    assert stat < chi2_critical(df), (second, stat)
    # bonus token (both drafts accepted) follows p2
    bonus = np.bincount([o[2] for o in out if len(o) == 3], minlength=4)
    assert bonus.sum() > 500
    stat, df = chi2_goodness(bonus, np.array(p2))
    assert stat < chi2_critical(df), (bonus, stat)


def test_rejection_sampling_all_rejected_and_all_accepted():
    # drafts the target gives no mass: always rejected, the token comes from p0 (never the draft)
    p0 = [0.0, 0.7, 0.2, 0.1]
    out = _verify_samples([p0, [0.25] * 4], drafts=[0], n=3000)
    assert all(len(o) == 1 and o[0] != 0 for o in out)
    counts = np.bincount([o[0] for o in out], minlength=4)
    stat, df = chi2_goodness(counts, np.array(p0))
    assert stat < chi2_critical(df), counts
    # drafts the target is sure of: always accepted, plus the bonus token
    sure = [0.0, 0.0, 1.0, 0.0]
    out = _verify_samples([sure, sure, [0.0, 0.5, 0.0, 0.5]], drafts=[2, 2], n=2000)
    assert all(o[:2] == [2, 2] and o[2] in (1, 3) for o in out)
    # greedy rows: accepted while the draft is the argmax
    out = _verify_samples([[0.1, 0.6, 0.3, 0.0], [0.5, 0.2, 0.2, 0.1]], drafts=[1], n=3, temperature=0.0)
    assert out == [[1, 0]] * 3
    out = _verify_samples([[0.1, 0.6, 0.3, 0.0], [0.5, 0.2, 0.2, 0.1]], drafts=[2], n=3, temperature=0.0)
    assert out == [[1]] * 3


def test_draft_length_rule_pauses_and_recovers():
    rule = DraftLength(5)
    r = Request("a", [1], SamplingParams(), 1000)

    def k():
        return rule.state(r).k if rule.tick(r) else 0

    assert k() == 5
    rule.update(r, 5, 1)
    assert k() == 2  # accepted + 1
    rule.update(r, 2, 2)
    assert k() == 4  # all accepted: doubled
    rule.update(r, 4, 4)
    assert k() == 5  # up to num_speculative_tokens
    # two misses in a row (a rejected proposal, a lookup that found nothing): a pause of 8 steps,
    # then one draft
    rule.update(r, 3, 0)
    rule.update(r, 0, 0)
    assert [k() for _ in range(9)] == [0] * 8 + [1]
    rule.update(r, 1, 0)  # the retry failed: the pause doubles
    assert [k() for _ in range(17)] == [0] * 16 + [1]
    rule.update(r, 1, 1)  # accepted: speculation is back, pauses reset
    assert k() == 2
    rule.update(r, 2, 0)
    rule.update(r, 1, 0)
    assert [k() for _ in range(9)] == [0] * 8 + [1]  # a pause of 8 again
    # with nothing ever accepted, few steps carry drafts
    r2 = Request("b", [1], SamplingParams(), 1000)
    spec_steps = 0
    for _ in range(1000):
        if rule.tick(r2):
            spec_steps += 1
            rule.update(r2, rule.state(r2).k, 0)
    assert spec_steps <= 2 + 4 + 1000 // 64 + 1


# ---- engines: output unchanged by speculation -----------------------------------------------------


COPY_PROMPT = (
    "# file: a.py\n"
    "def merge_sorted(a, b):\n"
    '    """Merge two sorted lists into one sorted list."""\n'
    "    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
    "        else:\n            out.append(b[j])\n            j += 1\n"
    "    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n\n"
    "# file: b.py (a copy of a.py)\n"
)


def _tokens(outs):
    return [[o.token_ids for o in r.outputs] for r in outs]


def test_ngram_on_smollm2_copying_code(smollm2_dir):
    prompts = [COPY_PROMPT, "Copy this list: red, green, blue, red, green, blue, red,"]
    p = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    base = LLM(str(smollm2_dir), max_model_len=1024, num_kv_blocks=128).generate(prompts, p, use_tqdm=False)
    llm = LLM(str(smollm2_dir), max_model_len=1024, num_kv_blocks=128, speculative_config=NGRAM)
    spec = llm.generate(prompts, p, use_tqdm=False)
    assert _tokens(spec) == _tokens(base)
    assert [r.outputs[0].text for r in spec] == [r.outputs[0].text for r in base]
    m = llm.get_metrics()
    drafts, accepted = m["arcserve:spec_decode_num_drafts_total"], m["arcserve:spec_decode_num_accepted_tokens_total"]
    assert accepted / drafts > 1.5, m  # a copy: long accepted runs (mean acceptance length > 2.5)
    assert sum(m["arcserve:spec_decode_num_accepted_tokens_per_pos"].values()) == accepted


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    from tiny_models import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("draft") / "d", "llama", seed=11, num_hidden_layers=1)


def _mixed_prompts():
    rng = np.random.default_rng(0)
    prompts = []
    for i in range(10):
        if i % 2:  # repetitive: prompt lookup finds drafts
            unit = rng.integers(3, 300, size=int(rng.integers(3, 8))).tolist()
            prompts.append({"prompt_token_ids": unit * int(rng.integers(3, 12))})
        else:
            prompts.append({"prompt_token_ids": rng.integers(3, 300, size=int(rng.integers(5, 90))).tolist()})
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(8, 48, 10)]
    return prompts, params


@pytest.mark.parametrize("method", ["ngram", "draft_self", "draft_random", "ngram_async", "draft_random_async",
                                    "draft_self_fp8"])  # fmt: skip
def test_greedy_output_unchanged_in_mixed_batches(llama_dir, random_draft, method):
    """Speculating requests beside others in prefill (a small token budget chunks the prompts); with
    overlapped steps too, which speculate on the steps where requests are due to (engine.step).
    _fp8: target and draft over 8-bit KV caches (the draft's cache follows the target's)."""
    prompts, params = _mixed_prompts()
    kw = dict(max_num_batched_tokens=48, max_num_seqs=6)
    if method.endswith("_fp8"):
        method = method.removesuffix("_fp8")
        kw["kv_cache_dtype"] = "fp8"
    base = LLM(str(llama_dir), **kw).generate(prompts, params, use_tqdm=False)
    if method.endswith("_async"):
        method = method.removesuffix("_async")
        kw["async_scheduling"] = True
    spec = {"ngram": NGRAM, "draft_self": {"model": str(llama_dir), "num_speculative_tokens": 3},
            "draft_random": {"model": str(random_draft), "num_speculative_tokens": 3}}[method]  # fmt: skip
    llm = LLM(str(llama_dir), speculative_config=spec, **kw)
    if "kv_cache_dtype" in kw:
        assert llm.llm_engine.proposer.runner.kv.dtype == llm.llm_engine.runner.kv.dtype == torch.float8_e4m3fn
    out = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(out) == _tokens(base)
    m = llm.get_metrics()
    rate = m["arcserve:spec_decode_num_accepted_tokens_total"] / m["arcserve:spec_decode_num_draft_tokens_total"]
    if method == "draft_self":
        assert rate > 0.9, m
    elif method == "draft_random":
        assert rate < 0.5, m
    else:  # a random tiny model rarely repeats itself: drafts are made, few accepted (SmolLM2 test above)
        assert m["arcserve:spec_decode_num_drafts_total"] > 0
    assert m["arcserve:num_requests_running"] == m["arcserve:num_requests_waiting"] == 0
    assert m["arcserve:kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("method", ["ngram", "draft_self"])
def test_first_token_with_drafts(llama_dir, method):
    """A chunk that leaves exactly one prompt token: the request decodes next and speculates, so its
    first token comes with drafts (that step crashed reading the request's previous token time)."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6, 7]}, {"prompt_token_ids": [8, 9, 10, 8, 9, 10, 8, 9, 8]}]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(max_num_batched_tokens=8, max_num_seqs=2)
    base = LLM(str(llama_dir), **kw).generate(prompts, params, use_tqdm=False)
    spec = {**NGRAM, "prompt_lookup_min": 1} if method == "ngram" else {"model": str(llama_dir), "num_speculative_tokens": 3}
    llm = LLM(str(llama_dir), speculative_config=spec, **kw)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == _tokens(base)
    m = llm.get_metrics()
    assert m["arcserve:spec_decode_num_drafts_total"] > 0
    assert m["arcserve:time_to_first_token_seconds"]["count"] == 2
    _assert_token_counts(m, 32)  # the drafts accepted with a first token count too


def _assert_token_counts(m: dict, n: int) -> None:
    """Every generated token counted once: in the total, and as a first token or an inter-token gap."""
    assert m["arcserve:generation_tokens_total"] == n == m["arcserve:request_generation_tokens"]["sum"]
    assert m["arcserve:time_to_first_token_seconds"]["count"] + m["arcserve:inter_token_latency_seconds"]["count"] == n


def test_drafts_accepted_with_the_first_token_are_counted(llama_dir):
    """A 2-token request and a 31-token prompt in a 32-token budget: the prompt's last token comes
    with drafts (the target as its own draft accepts them), so its first step yields 4 tokens."""
    prompts = [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": list(range(40, 71))}]
    params = [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]  # fmt: skip
    base = LLM(str(llama_dir), max_num_batched_tokens=32).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(llama_dir), max_num_batched_tokens=32,
              speculative_config={"model": str(llama_dir), "num_speculative_tokens": 3})  # fmt: skip
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == _tokens(base)
    _assert_token_counts(llm.get_metrics(), 13)


def test_stop_string_among_accepted_drafts_counts_what_is_kept(llama_dir):
    """A stop string inside a step's accepted tokens drops the tokens after it: they are not counted."""
    prompts = [{"prompt_token_ids": [11, 42, 97, 13, 200, 5, 77]}]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["he"])
    base = LLM(str(llama_dir)).generate(prompts, params, use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "stop"  # precondition: the greedy answer reaches the stop string
    llm = LLM(str(llama_dir), speculative_config={"model": str(llama_dir), "num_speculative_tokens": 3})
    got = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == base.token_ids and got.text == base.text
    _assert_token_counts(llm.get_metrics(), len(base.token_ids))


@pytest.mark.parametrize("method", ["ngram", "draft_self"])
def test_greedy_output_unchanged_under_preemption(llama_dir, method):
    prompts, params = _mixed_prompts()
    kw = dict(num_kv_blocks=16, block_size=8, max_model_len=128, max_num_seqs=8)
    base = LLM(str(llama_dir), **kw).generate(prompts, params, use_tqdm=False)
    spec = NGRAM if method == "ngram" else {"model": str(llama_dir), "num_speculative_tokens": 3}
    llm = LLM(str(llama_dir), speculative_config=spec, **kw)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(out) == _tokens(base)
    m = llm.get_metrics()
    assert m["arcserve:num_preemptions_total"] > 0
    assert m["arcserve:spec_decode_num_drafts_total"] > 0
    assert m["arcserve:kv_cache_usage_perc"] == 0


def test_seeded_sampling_with_every_parameter_unchanged(llama_dir):
    """Prompt lookup and argmax drafts verify by sampling every position with its own seeded number:
    a seeded request gets exactly the tokens, logprobs, stops and text it gets without speculation."""
    prompts, _ = _mixed_prompts()
    prompts = prompts[:6]
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=40, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, top_k=20, min_p=0.05, seed=2, max_tokens=30, repetition_penalty=1.3,
                       frequency_penalty=0.2, presence_penalty=0.1),
        SamplingParams(temperature=0.7, seed=3, max_tokens=35, min_tokens=20, n=2),
        SamplingParams(temperature=0, max_tokens=40, logit_bias={7: 3.0}, logprobs=0),
        SamplingParams(temperature=1.2, seed=5, max_tokens=30, stop_token_ids=[17, 18, 19]),
        SamplingParams(temperature=0.5, seed=6, max_tokens=45),
    ]  # fmt: skip
    base_llm = LLM(str(llama_dir))
    base = base_llm.generate(prompts, params, use_tqdm=False)
    # stop strings cut in the middle of a step's accepted tokens: taken from the plain output
    for i in (0, 5):
        text = base[i].outputs[0].text
        params[i].stop = [text[len(text) // 2 : len(text) // 2 + 3]]
    base = base_llm.generate(prompts, params, use_tqdm=False)
    unigrams = dict(NGRAM, prompt_lookup_min=1)  # a random model's text has few longer repeats
    for spec in (unigrams, {"model": str(llama_dir), "num_speculative_tokens": 4}):
        llm = LLM(str(llama_dir), speculative_config=spec)
        out = llm.generate(prompts, params, use_tqdm=False)
        assert _tokens(out) == _tokens(base)
        for a, b in zip(out, base):
            for x, y in zip(a.outputs, b.outputs):
                assert (x.text, x.finish_reason, x.stop_reason) == (y.text, y.finish_reason, y.stop_reason)
                if y.logprobs is not None:
                    assert len(x.logprobs) == len(y.logprobs)
                    for ex, ey in zip(x.logprobs, y.logprobs):
                        assert ex.keys() == ey.keys()
                        for t in ey:
                            assert ex[t].logprob == pytest.approx(ey[t].logprob, abs=1e-4)
                            assert ex[t].rank == ey[t].rank
                    assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-3)
        assert base[0].outputs[0].finish_reason == "stop"  # the stop string did cut it
        m = llm.get_metrics()
        assert m["arcserve:spec_decode_num_drafts_total"] > 0
        if "model" in spec:  # the target as its own draft: sampled tokens often are its argmax
            assert m["arcserve:spec_decode_num_accepted_tokens_total"] > 0


def test_unseeded_sampling_distribution_unchanged(llama_dir):
    """Unseeded requests draw from the engine's generator, so runs with and without speculation
    differ token by token: their token distributions must agree (two-sample chi-square test,
    false-alarm rate 1e-4 per position)."""
    prompt = {"prompt_token_ids": [5, 9, 14, 5, 9, 14, 5, 9]}
    p = SamplingParams(temperature=0.6, max_tokens=3, ignore_eos=True, n=600)
    base = LLM(str(llama_dir), seed=1).generate(prompt, p, use_tqdm=False)[0]
    llm = LLM(str(llama_dir), seed=2, speculative_config={"model": str(llama_dir), "num_speculative_tokens": 2})
    spec = llm.generate(prompt, p, use_tqdm=False)[0]
    assert llm.get_metrics()["arcserve:spec_decode_num_accepted_tokens_total"] > 100
    for pos in range(3):
        a = np.bincount([o.token_ids[pos] for o in base.outputs], minlength=320)
        b = np.bincount([o.token_ids[pos] for o in spec.outputs], minlength=320)
        keep = (a + b) >= 10  # pool rare tokens into one cell
        a = np.append(a[keep], a[~keep].sum())
        b = np.append(b[keep], b[~keep].sum())
        if a[-1] + b[-1] == 0:
            a, b = a[:-1], b[:-1]
        tot = a + b
        exp_a, exp_b = tot * a.sum() / tot.sum(), tot * b.sum() / tot.sum()
        stat = float((((a - exp_a) ** 2) / exp_a + ((b - exp_b) ** 2) / exp_b).sum())
        df = len(tot) - 1
        assert df >= 1
        assert stat < chi2_critical(df), (pos, stat, df)


def test_metrics_exported(llama_dir):
    from prometheus_client import generate_latest

    from arcserve.api.metrics import make_registry

    llm = LLM(str(llama_dir), speculative_config={"model": str(llama_dir), "num_speculative_tokens": 2})
    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    m = llm.get_metrics()
    assert m["arcserve:spec_decode_num_drafts_total"] >= 3
    assert m["arcserve:spec_decode_num_draft_tokens_total"] >= m["arcserve:spec_decode_num_accepted_tokens_total"] > 0
    text = generate_latest(make_registry(llm.get_metrics, "tiny")).decode()
    n = m["arcserve:spec_decode_num_accepted_tokens_total"]
    assert f'arcserve:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {float(n)}' in text
    assert 'arcserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in text
    assert "arcserve:spec_decode_num_drafts_total" in text


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the decode mirror is the CPU's (GPU runners have none)")
def test_draft_mirror_rows_follow_rejections(llama_dir):
    """CPU decode mirror of the draft model: a row kept from one step to the next must hold what the
    paged cache holds. A draft's rejected tokens were left in its row when the catch-up step that
    rewrote them ran below the mirror's context threshold (drafts then attended to stale K/V)."""
    import random

    from arcserve.kernels import reference

    rng = random.Random(0)
    lens = [rng.randint(330, 420) for _ in range(3)]  # three prompts: together past the mirror's threshold
    prompts = [{"prompt_token_ids": [rng.randint(3, 299) for _ in range(n)]} for n in lens]
    bias = {rng.randint(3, 299): 1.5 for _ in range(15)}  # request 0's drafts are partly rejected
    params = [SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, logit_bias=bias if i == 0 else None)
              for i in range(3)]  # fmt: skip
    llm = LLM(str(llama_dir), max_model_len=512, speculative_config={"model": str(llama_dir), "num_speculative_tokens": 4})
    runner = llm.llm_engine.proposer.runner
    mirror, checked, stale = runner.decode_mirror, [0], []
    plan = mirror.plan

    def checked_plan(ids, lens, tables, bs):
        held = dict(zip(mirror.ids, mirror.lens.tolist()))
        got = plan(ids, lens, tables, bs)
        for i, (sid, n) in enumerate(zip(ids.tolist(), lens.tolist())):
            if got is not None and held.get(sid, -9) + 1 == n:  # kept: positions [0, n - 1) come from the row
                paged = reference._gather(runner.kv_caches[0][0], tables[i : i + 1, : -(-(n - 1) // bs)].long(),
                                          mirror.k.dtype)[0, :, : n - 1]  # fmt: skip
                row = mirror.k[0, mirror.ids.index(sid), :, : n - 1]
                checked[0] += 1
                if not torch.equal(paged, row):
                    stale.append((sid, n))
        return got

    mirror.plan = checked_plan
    llm.generate(prompts, params, use_tqdm=False)
    assert checked[0] > 40 and stale == []
