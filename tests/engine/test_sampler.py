"""Sampler: unit tests on hand-made logits with fake requests, then end to end through LLM.generate
on a tiny random llama (seeded reproducibility, n > 1, greedy, logprobs)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from arcserve import LLM, SamplingParams
from arcserve.engine import sampler as sampler_module
from arcserve.engine.penalties import PenaltyState
from arcserve.engine.request import Request
from arcserve.engine.sampler import Sampler, apply_top_k_top_p_min_p
from arcserve.sampling_params import GREEDY_EPS

CPU = torch.device("cpu")
_ids = iter(range(10**9))


def make_req(params: SamplingParams, prompt=(5, 6, 7), output=(), seed: int | None = None) -> Request:
    req = Request(f"r{next(_ids)}", list(prompt), params, max_tokens=1000)
    req.token_ids.extend(output)  # simulated history of generated tokens
    req.seed = seed
    return req


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def draw(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    """n independent draws: one batch of n identical rows (the sampler's own seeded generator)."""
    reqs = [make_req(params) for _ in range(n)]
    return Sampler(CPU, seed)(logits_row.expand(n, -1).clone(), reqs).tokens.tolist()


# ---- greedy and the filters -----------------------------------------------------------------
def test_temperature_zero_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    reqs = [make_req(SamplingParams(temperature=0.0)) for _ in range(6)]
    assert Sampler(CPU, 0)(logits, reqs).tokens.tolist() == logits.argmax(-1).tolist()
    # Greedy rows stay argmax when sampled rows (seeded and not) share the batch.
    reqs[1] = make_req(SamplingParams(temperature=1.0))
    reqs[4] = make_req(SamplingParams(temperature=1.5), seed=3)
    out = Sampler(CPU, 1)(logits, reqs).tokens.tolist()
    for i in (0, 2, 3, 5):
        assert out[i] == logits[i].argmax().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_on_half_logits_takes_the_first_largest(dtype):
    """Half logits (a bf16/fp16 model's LM head) with repeated maxima: the first one, as torch's
    argmax in the logits' own dtype picks it, with greedy rows alone and beside sampled ones."""
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(4, 300, generator=g) * 4).round().to(dtype)  # many exact ties
    logits[2, [17, 40, 250]] = 30.0
    want = logits.argmax(-1).tolist()
    assert want[2] == 17
    reqs = [make_req(SamplingParams(temperature=0.0)) for _ in range(4)]
    assert Sampler(CPU, 0)(logits, reqs).tokens.tolist() == want
    reqs[1] = make_req(SamplingParams(temperature=0.8), seed=1)
    out = Sampler(CPU, 0)(logits, reqs).tokens.tolist()
    assert [out[i] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]


def test_temperature_below_eps_is_greedy():
    """Below GREEDY_EPS a temperature means argmax (the first of tied maxima); just above it, the
    same tied logits are sampled, so the two tied tokens both come up across seeds."""
    logits = torch.tensor([[0.0, 1.0, 1.0, -2.0]])  # an exact tie: only argmax always picks 1

    def picks(temperature):
        return {Sampler(CPU, seed)(logits, [make_req(SamplingParams(temperature=temperature))]).tokens.item()
                for seed in range(20)}  # fmt: skip

    assert picks(GREEDY_EPS / 10) == {1}
    assert picks(GREEDY_EPS * 2) == {1, 2}


def test_top_k_samples_only_the_k_largest():
    g = torch.Generator().manual_seed(1)
    row = torch.randn(40, generator=g)
    top3 = set(row.topk(3).indices.tolist())
    got = draw(row, SamplingParams(temperature=1.0, top_k=3), 3000)
    assert set(got) == top3  # only the 3 largest, and each of them does come up
    # top_k=1 is greedy whatever the temperature.
    assert set(draw(row, SamplingParams(temperature=5.0, top_k=1), 500)) == {row.argmax().item()}


def test_top_k_mask_exact():
    x = torch.tensor([[0.5, 3.0, -1.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0, 0.0]])
    out = apply_top_k_top_p_min_p(x, torch.tensor([2, 4]), None, None)
    assert torch.isfinite(out).tolist() == [
        [False, True, False, True, False],
        [True, True, True, True, False],
    ]
    kept = torch.isfinite(out)
    assert torch.equal(out[kept], x[kept])  # survivors keep their values


# Distribution over 6 tokens (shuffled so order is not the index order).
_P = {3: 0.35, 0: 0.25, 5: 0.2, 1: 0.1, 4: 0.06, 2: 0.04}
_PROBS = [_P[i] for i in range(6)]


@pytest.mark.parametrize(
    "top_p, support",
    [
        (0.3, {3}),  # 0.35 already reaches 0.3
        (0.5, {3, 0}),  # 0.35 < 0.5 <= 0.60
        (0.62, {3, 0, 5}),  # 0.60 < 0.62 <= 0.80
        (0.85, {3, 0, 5, 1}),  # 0.80 < 0.85 <= 0.90
        (0.93, {3, 0, 5, 1, 4}),  # 0.90 < 0.93 <= 0.96
        (0.99, {3, 0, 5, 1, 4, 2}),
    ],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p, support):
    row = logits_of(_PROBS)
    mask = apply_top_k_top_p_min_p(row[None], None, torch.tensor([top_p]), None)
    assert {i for i in range(6) if torch.isfinite(mask[0, i])} == support
    got = draw(row, SamplingParams(temperature=1.0, top_p=top_p), 2000)
    assert set(got) == support


@pytest.mark.parametrize(
    "min_p, support",
    [
        (0.1, {3, 0, 5, 1, 4, 2}),  # threshold 0.035: everything
        (0.15, {3, 0, 5, 1, 4}),  # 0.0525: drops 0.04
        (0.5, {3, 0, 5}),  # 0.175: drops 0.1, 0.06, 0.04
        (0.6, {3, 0}),  # 0.21
        (0.9, {3}),  # 0.315
    ],
)
def test_min_p_drops_tokens_below_fraction_of_max(min_p, support):
    row = logits_of(_PROBS)
    mask = apply_top_k_top_p_min_p(row[None], None, None, torch.tensor([min_p]))
    assert {i for i in range(6) if torch.isfinite(mask[0, i])} == support
    got = draw(row, SamplingParams(temperature=1.0, min_p=min_p), 2000)
    assert set(got) == support


def test_min_p_before_top_p():
    """vLLM's order: min-p on the whole distribution, then top-p over what it kept (renormalised).
    min_p 0.5 keeps {3, 0, 5} (0.35, 0.25, 0.2 -> 0.44, 0.31, 0.25): top_p 0.7 then needs only {3, 0}
    (top-p first would keep {3, 0, 5}, which min-p leaves alone)."""
    row = logits_of(_PROBS)
    mask = apply_top_k_top_p_min_p(row[None], None, torch.tensor([0.7]), torch.tensor([0.5]))
    assert {i for i in range(6) if torch.isfinite(mask[0, i])} == {3, 0}


def test_filters_per_row_in_one_batch():
    """Different top_k / top_p / min_p per row of the same batch, each row gets its own."""
    row = logits_of(_PROBS)
    params = [
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, top_p=0.85),
        SamplingParams(temperature=1.0, min_p=0.5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
    ]
    n = 600
    reqs = [make_req(params[i % 5]) for i in range(5 * n)]
    toks = Sampler(CPU, 7)(row.expand(5 * n, -1).clone(), reqs).tokens.tolist()
    got = [set(toks[i::5]) for i in range(5)]
    assert got == [{3, 0}, {3, 0, 5, 1}, {3, 0, 5}, {0, 1, 2, 3, 4, 5}, {3}]


def test_logit_bias_shifts_logits():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])

    def greedy(bias):
        return Sampler(CPU, 0)(
            logits.clone(), [make_req(SamplingParams(temperature=0, logit_bias=bias))]
        ).tokens.item()

    assert greedy(None) == 2
    assert greedy({0: 2.5}) == 0  # 0 + 2.5 > 2
    assert greedy({0: 1.5}) == 2  # 0 + 1.5 < 2
    assert greedy({3: 3.5}) == 3  # -1 + 3.5 > 2
    assert greedy({3: 2.5}) == 2  # -1 + 2.5 < 2
    assert greedy({2: -1.5, 1: 0.4}) == 1  # 0.5 vs 1.4
    assert greedy({2: -100}) == 1
    assert greedy({10: 50.0}) == 2  # an id past the logits is ignored
    # Sampling: a -100 bias removes a token from the support.
    row = torch.zeros(4)
    assert set(draw(row, SamplingParams(temperature=1.0, logit_bias={1: -100.0}), 1000)) == {0, 2, 3}


def test_allowed_token_ids_only_those_are_sampled():
    g = torch.Generator().manual_seed(2)
    row = torch.randn(60, generator=g) * 2
    allowed = [3, 17, 41, 59]
    assert row.argmax().item() not in allowed
    best = max(allowed, key=lambda t: row[t].item())
    assert Sampler(CPU, 0)(row[None].clone(), [make_req(SamplingParams(temperature=0, allowed_token_ids=allowed))]).tokens.item() == best  # fmt: skip
    drawn = draw(row, SamplingParams(temperature=1.5, allowed_token_ids=allowed), 2000)
    assert set(drawn) == set(allowed)  # every allowed id is reachable at this temperature, no other
    # Per row: mixed with unrestricted, biased, top-k and seeded rows in one batch; logprobs stay raw.
    logits = row.expand(4, -1).clone()
    reqs = [make_req(SamplingParams(temperature=0)),
            make_req(SamplingParams(temperature=0, allowed_token_ids=allowed, logprobs=2,
                                    logit_bias={int(row.argmax()): 50.0, 17: 30.0})),
            make_req(SamplingParams(temperature=1.0, top_k=2, allowed_token_ids=[5, 6, 7]), seed=4),
            make_req(SamplingParams(temperature=0, allowed_token_ids=[9]))]  # fmt: skip
    out = Sampler(CPU, 0)(logits, reqs)
    # row 1: the biased disallowed argmax stays out; the biased allowed 17 wins
    assert out.tokens.tolist()[0] == row.argmax().item() and out.tokens.tolist()[1] == 17 and out.tokens.tolist()[3] == 9
    two = sorted((5, 6, 7), key=lambda t: -row[t].item())[:2]
    assert out.tokens.tolist()[2] in two
    assert out.topk_ids[0].tolist() == row.topk(2).indices.tolist()  # the raw logits' top 2, not the allowed ids'
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[1, -2])


def test_allowed_token_ids_end_to_end(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64)
    allowed = [11, 42, 250]
    p = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed)
    (out,) = llm.generate([prompt(5, 7)], p, use_tqdm=False)
    assert set(out.outputs[0].token_ids) <= set(allowed) and len(out.outputs[0].token_ids) == 24
    with pytest.raises(ValueError, match=r"allowed_token_ids must hold token ids in \[0, 320\)"):
        llm.generate([prompt(5, 7)], SamplingParams(allowed_token_ids=[3, 320]), use_tqdm=False)
    # only stop tokens allowed while min_tokens masks them: refused, not sampled from an empty row
    eos = min(llm.llm_engine.eos_token_ids)
    with pytest.raises(ValueError, match="allowed_token_ids must hold a token that neither bad_words nor"):
        llm.generate([prompt(5, 7)], SamplingParams(allowed_token_ids=[eos, 7], min_tokens=2, stop_token_ids=[7]),
                     use_tqdm=False)  # fmt: skip
    ok = SamplingParams(temperature=0, allowed_token_ids=[eos, 7], min_tokens=2, max_tokens=4)
    assert llm.generate([prompt(5, 7)], ok, use_tqdm=False)[0].outputs[0].token_ids[:2] == [7, 7]
    # a one-token bad word masking the rest of them: refused too
    word = next(w for w in ("the", "a", "x", "e") if len(llm.llm_engine.bad_words_token_ids([w])[0]) == 1)
    wid = llm.llm_engine.bad_words_token_ids([word])[0][0]
    with pytest.raises(ValueError, match="neither bad_words nor"):
        llm.generate([prompt(5, 7)], SamplingParams(allowed_token_ids=[eos, wid], min_tokens=1, bad_words=[word]),
                     use_tqdm=False)  # fmt: skip
    with pytest.raises(ValueError, match="neither bad_words nor"):
        llm.generate([prompt(5, 7)], SamplingParams(allowed_token_ids=[wid], bad_words=[word]), use_tqdm=False)


def bad_words_req(seqs, output=(), temperature=0.0, spec=()):
    req = make_req(SamplingParams(temperature=temperature, bad_words=["x"]), output=output)
    req.params._bad_words_token_ids = [list(t) for t in seqs]  # as the engine tokenizes them
    req.spec_token_ids = list(spec)
    return req


def test_bad_words_ban_the_last_token_after_the_rest():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])  # greedy: 5, then 4, then 3
    pick = lambda req, offsets=None: Sampler(CPU, 0)(logits.clone(), [req], offsets).tokens.item()  # noqa: E731
    assert pick(bad_words_req([[5]])) == 4  # one-token words: always banned
    assert pick(bad_words_req([[1, 5]], output=[2])) == 5  # the output does not end with 1
    assert pick(bad_words_req([[1, 5]], output=[2, 1])) == 4
    assert pick(bad_words_req([[3, 1, 5], [4]], output=[3, 1])) == 3
    assert pick(bad_words_req([[3, 1, 5]], output=[1])) == 5  # too short a history: no match
    assert pick(bad_words_req([[0, 5]], output=[2], spec=[0, 4]), offsets=np.array([1])) == 4  # drafts count
    assert pick(bad_words_req([[0, 5]], output=[2], spec=[0, 4]), offsets=np.array([0])) == 5
    reqs = [bad_words_req([[2]], temperature=1.0) for _ in range(500)]
    out = Sampler(CPU, 1)(torch.zeros(500, 6), reqs)
    assert 2 not in out.tokens.tolist() and len(set(out.tokens.tolist())) == 5
    assert Sampler(CPU, 1).rows(reqs, 6)[2] is False  # one-token words need no history
    assert Sampler(CPU, 1).rows([*reqs, bad_words_req([[1, 5]])], 6)[2] is True


def test_bad_words_end_to_end(llama_dir):
    """No bad word's token sequence appears in the output (greedy, overlapped steps or not); the
    words are tokenized alone and after a space."""
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64)
    tok = llm.get_tokenizer()
    p = prompt(11, 8)
    free = llm.generate([p], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    toks = free.outputs[0].token_ids
    # a word the free output holds as two or three tokens (whose tokenization gives back those
    # tokens), so that its ban depends on the output so far, plus a one-token word
    multi = next(w for n in (2, 3) for i in range(1, len(toks) - n) if (w := tok.decode(toks[i : i + n]).strip())
                 and any(s == toks[i : i + n] for s in llm.llm_engine.bad_words_token_ids([w])))  # fmt: skip
    assert max(len(s) for s in llm.llm_engine.bad_words_token_ids([multi])) > 1
    words = [multi] + [w for w in [tok.decode(toks[8:9]).strip()] if w]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=words)
    out = llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
    seqs = llm.llm_engine.bad_words_token_ids(words)
    assert out != toks
    for seq in seqs:
        assert not any(out[i : i + len(seq)] == seq for i in range(len(out) - len(seq) + 1)), (seq, out)
    # Overlapped steps (the next step scheduled before this one's tokens are read): the same tokens,
    # since a multi-token bad word makes the engine read each step's tokens first.
    overlapped = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64, async_scheduling=True)
    assert overlapped.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids == out
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    eos, stop_id = 2, 5
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0, 3.0, 8.0]])  # eos, then stop_id, then token 4

    def params(**kw):
        p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop_id], **kw)
        p._eos_token_ids = frozenset({eos})
        return p

    for n_out in range(5):
        req = make_req(params(), output=[7] * n_out)
        tok = Sampler(CPU, 0)(logits.clone(), [req]).tokens.item()
        assert tok == (4 if n_out < 3 else eos), n_out
    # ignore_eos: EOS stops nothing, yet min_tokens still masks it (vLLM: all_stop_token_ids hold EOS).
    req = make_req(params(ignore_eos=True), output=[7])
    assert Sampler(CPU, 0)(logits.clone(), [req]).tokens.item() == 4
    req = make_req(params(ignore_eos=True), output=[7] * 3)
    assert Sampler(CPU, 0)(logits.clone(), [req]).tokens.item() == eos
    # Sampling rows are masked too: EOS and the stop id never come up before min_tokens.
    p = params()
    p.temperature = 1.0
    reqs = [make_req(p, output=[7, 7]) for _ in range(500)]
    toks = set(Sampler(CPU, 0)(logits.expand(500, -1).clone(), reqs).tokens.tolist())
    assert eos not in toks and stop_id not in toks and toks
    # Masking must not touch the caller's logits (logprobs come from them).
    before = logits.clone()
    Sampler(CPU, 0)(logits, [make_req(params())])
    assert torch.equal(logits, before)


# ---- penalties ----------------------------------------------------------------------------
_BASE = [1.5, -0.5, 2.0, -1.0, 0.8, 3.0, -2.0, 0.25]
_PROMPT = [0, 1, 1]  # prompt-only tokens: 0 and 1
_OUTPUT = [2, 3, 3, 4, 2, 3]  # counts: 2 -> 2, 3 -> 3, 4 -> 1


def penalized(**kw) -> list[float]:
    logits = torch.tensor([_BASE, _BASE])
    reqs = [
        make_req(SamplingParams(**kw), prompt=_PROMPT, output=_OUTPUT),
        make_req(SamplingParams(), prompt=_PROMPT, output=_OUTPUT),
    ]
    PenaltyState(CPU, len(_BASE)).apply(logits, reqs, [0], [len(_OUTPUT)], None)
    assert logits[1].tolist() == pytest.approx(_BASE)  # rows not listed are untouched
    return logits[0].tolist()


def test_the_penalty_table_grows_keeping_the_slots_it_has():
    """A table made without a size starts at 8 slots and doubles when a step needs more; the slots
    filled before keep their counts (not filled again), so every row is penalized as it is alone."""
    V, kw = len(_BASE), dict(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3)
    want = penalized(**kw)
    state = PenaltyState(CPU, V)
    assert state.counts.shape == (8, V)
    reqs = [make_req(SamplingParams(**kw), prompt=_PROMPT, output=_OUTPUT) for _ in range(11)]
    for n in (8, 11):  # the first 8 fill the table; then 3 more make it grow
        logits = torch.tensor([_BASE] * n)
        state.apply(logits, reqs[:n], list(range(n)), [len(_OUTPUT)] * n, None)
        assert all(row == pytest.approx(want) for row in logits.tolist())
    assert state.counts.shape == state.prompt.shape == (16, V) and state.params.shape == (16, 3)
    assert state.counted[:11].tolist() == [len(_OUTPUT)] * 11 and sorted(state.free) == list(range(11, 16))


def test_repetition_penalty_over_prompt_and_output():
    r = 1.7
    expected = list(_BASE)
    for t in {0, 1, 2, 3, 4}:  # seen in the prompt or output
        expected[t] = _BASE[t] / r if _BASE[t] > 0 else _BASE[t] * r
    assert penalized(repetition_penalty=r) == pytest.approx(expected, abs=1e-6)
    # A penalty below 1 rewards repetition the same way.
    r = 0.5
    expected = [(b / r if b > 0 else b * r) if t <= 4 else b for t, b in enumerate(_BASE)]
    assert penalized(repetition_penalty=r) == pytest.approx(expected, abs=1e-6)


def test_frequency_penalty_counts_output_tokens_only():
    f = 0.4
    counts = {2: 2, 3: 3, 4: 1}
    expected = [b - f * counts.get(t, 0) for t, b in enumerate(_BASE)]
    assert penalized(frequency_penalty=f) == pytest.approx(expected, abs=1e-6)
    f = -0.7  # negative: encourages repetition
    expected = [b - f * counts.get(t, 0) for t, b in enumerate(_BASE)]
    assert penalized(frequency_penalty=f) == pytest.approx(expected, abs=1e-6)


def test_presence_penalty_once_per_output_token():
    p = 0.9
    expected = [b - p if t in (2, 3, 4) else b for t, b in enumerate(_BASE)]
    assert penalized(presence_penalty=p) == pytest.approx(expected, abs=1e-6)


def test_penalties_combined():
    r, f, p = 1.3, 0.25, 0.5
    counts = {2: 2, 3: 3, 4: 1}
    expected = []
    for t, b in enumerate(_BASE):
        if t <= 4:
            b = b / r if b > 0 else b * r
        b -= f * counts.get(t, 0) + (p if t in counts else 0.0)
        expected.append(b)
    assert penalized(repetition_penalty=r, frequency_penalty=f, presence_penalty=p) == pytest.approx(
        expected, abs=1e-6
    )


def test_penalties_in_sampler_change_the_choice():
    logits = torch.tensor([[0.0, 2.0, 1.8, 0.0]])
    p = SamplingParams(temperature=0, presence_penalty=0.5)
    req = make_req(p, prompt=[0], output=[1])
    assert Sampler(CPU, 0)(logits.clone(), [req]).tokens.item() == 2  # 2.0 - 0.5 < 1.8
    # A prompt-only token is not hit by presence/frequency penalties.
    req = make_req(SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0), prompt=[1])
    assert Sampler(CPU, 0)(logits.clone(), [req]).tokens.item() == 1


@pytest.mark.parametrize("kernels", ["torch", "triton"])  # (Triton: in CI under the interpreter)
def test_warm_up_leaves_no_trace(kernels):
    """Sampler.warm_up (at startup on GPUs) launches the sampling and penalty kernels, samples
    batches through the filters and logprobs, and makes the penalties' table: afterwards the table
    is all zeros, every slot free, and penalized, plain and unseeded filtered sampling draw exactly
    what a sampler without the warm-up draws (its generator is where it was)."""
    from conftest import DEVICE

    from arcserve.kernels import get_ops

    dev = DEVICE if kernels == "triton" else CPU  # (Triton: a GPU's compiled kernels where there is one)
    ops = get_ops(kernels, dev)
    V = 300
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, V, generator=g).to(dev)
    pen = SamplingParams(temperature=0.9, repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.6)
    reqs = [make_req(pen, prompt=[3, 9, 9], output=[7, 7, 2], seed=1), make_req(SamplingParams(temperature=0.7), seed=2),
            make_req(pen, prompt=[7], output=[3], seed=3), make_req(SamplingParams(temperature=0, presence_penalty=2.0),
                                                                     prompt=[1], output=[int(logits[3].argmax())]),
            make_req(SamplingParams(temperature=1.5, top_p=0.99))]  # fmt: skip (unseeded: the generator's draw)
    warm = Sampler(dev, 0, ops.sample_from_cdf, ops.apply_penalties, penalty_slots=4)
    calls = {"filters": 0, "topk": 0}
    filters, topk = sampler_module.apply_top_k_top_p_min_p, torch.Tensor.topk

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)

        return wrapper

    with pytest.MonkeyPatch.context() as mp:  # (the warm-up samples through the filters and logprobs)
        mp.setattr(sampler_module, "apply_top_k_top_p_min_p", counted("filters", filters))
        mp.setattr(torch.Tensor, "topk", counted("topk", topk))
        warm.warm_up(V, torch.bfloat16)
    assert calls["filters"] >= 4 and calls["topk"] >= 2, calls
    t = warm.penalties
    assert t is not None and len(t.owner) == 4 and sorted(t.free) == [0, 1, 2, 3]
    assert not t.counts.any() and not t.prompt.any() and not t.params.any() and not t.counted.any()
    cold = Sampler(dev, 0, ops.sample_from_cdf, ops.apply_penalties, penalty_slots=4)
    got, want = warm(logits.clone(), reqs).tokens.tolist(), cold(logits.clone(), reqs).tokens.tolist()
    assert got == want and got[3] != int(logits[3].argmax())  # (the last row's penalty moved it)


@pytest.mark.parametrize("vocab", [1, 2, 3])
def test_warm_up_takes_tiny_vocabularies(vocab):
    """The warm-up's logprobs and filters fit any vocabulary a model can have (top-k larger than
    the vocabulary is off, as for a request)."""
    Sampler(CPU, 0).warm_up(vocab, torch.bfloat16)


# ---- seeds and the sampled distribution ------------------------------------------------------
def test_seeded_request_same_tokens_alone_and_in_any_batch():
    V, steps = 64, 60
    g = torch.Generator().manual_seed(11)
    step_logits = [torch.randn(V, generator=g) * 2 for _ in range(steps)]
    target = SamplingParams(temperature=0.9, top_p=0.95)

    def run_alone() -> list[int]:
        req = make_req(target, seed=1234)
        sampler = Sampler(CPU, 0)
        for s in range(steps):
            req.token_ids.append(sampler(step_logits[s][None].clone(), [req]).tokens.item())
        return req.output_token_ids

    def run_batched(sampler_seed: int) -> list[int]:
        req = make_req(target, seed=1234)
        mates = [
            make_req(SamplingParams(temperature=1.0), seed=1234),  # same seed, other params
            make_req(SamplingParams(temperature=1.0, top_k=5)),
            make_req(SamplingParams(temperature=0.0)),
            make_req(SamplingParams(temperature=0.7, min_p=0.1, presence_penalty=0.5), seed=99),
            make_req(SamplingParams(temperature=1.2, logit_bias={3: 5.0}, repetition_penalty=1.2)),
        ]
        sampler = Sampler(CPU, sampler_seed)
        rng = random.Random(sampler_seed)
        for s in range(steps):
            batch = [req] + rng.sample(mates, rng.randrange(len(mates) + 1))
            rng.shuffle(batch)
            logits = torch.randn(len(batch), V, generator=g) * 2
            logits[batch.index(req)] = step_logits[s]
            toks = sampler(logits, batch).tokens.tolist()
            for r, t in zip(batch, toks):
                r.token_ids.append(t)
        return req.output_token_ids

    alone = run_alone()
    assert len(set(alone)) > 10  # really sampled, not a constant
    assert run_alone() == alone
    for sampler_seed in (1, 2, 3):
        assert run_batched(sampler_seed) == alone
    # Another seed gives another sequence.
    other = make_req(target, seed=4321)
    sampler = Sampler(CPU, 0)
    for s in range(steps):
        other.token_ids.append(sampler(step_logits[s][None].clone(), [other]).tokens.item())
    assert other.output_token_ids != alone


def test_seeded_numbers_are_uniform_and_keyed_by_seed_and_position():
    from arcserve.engine.sampler import seeded_uniform

    pos = np.arange(200_000)
    u = seeded_uniform(np.full(pos.shape, 7), pos)
    assert u.min() >= 0 and u.max() < 1
    counts = np.histogram(u, bins=10, range=(0, 1))[0]
    assert chi_square(counts.tolist(), [0.1] * 10) < 27.877  # 9 degrees of freedom, p = 0.001
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01  # successive positions uncorrelated
    v = seeded_uniform(np.full(pos.shape, 8), pos)
    assert abs(np.corrcoef(u, v)[0, 1]) < 0.01  # neighbouring seeds too
    assert (seeded_uniform(np.full(pos.shape, 7), pos) == u).all()
    ext = seeded_uniform(np.array([-(2**63), 2**63 - 1]), np.array([0, 0]))  # extreme seeds: no overflow
    assert ext.tolist() != [u[0], u[0]] and ((ext >= 0) & (ext < 1)).all() and ext[0] != ext[1]


def test_pending_tokens_count_for_the_sampled_position():
    """With overlapped steps a request samples while its previous token is still on the device:
    its position (seed stream, min_tokens) counts that token."""
    row = torch.randn(50, generator=torch.Generator().manual_seed(3))
    a = make_req(SamplingParams(temperature=1.0), output=[1, 2, 3], seed=5)
    b = make_req(SamplingParams(temperature=1.0), output=[1, 2], seed=5)
    b.num_pending = 1
    draws_a, draws_b = [], []
    for _ in range(30):
        draws_a.append(Sampler(CPU, 0)(row[None].clone(), [a]).tokens.item())
        draws_b.append(Sampler(CPU, 1)(row[None].clone(), [b]).tokens.item())
        a.token_ids.append(draws_a[-1])
        b.token_ids.append(draws_b[-1])
    assert draws_a == draws_b and len(set(draws_a)) > 5
    # min_tokens: 2 outputs + 1 pending = 3 sampled; min_tokens=3 no longer masks EOS.
    logits = torch.tensor([[0.0, 5.0, 0.0]])
    p = SamplingParams(temperature=0, min_tokens=3)
    p._eos_token_ids = frozenset({1})
    c = make_req(p, output=[0, 0])
    assert Sampler(CPU, 0)(logits.clone(), [c]).tokens.item() != 1
    c.num_pending = 1
    assert Sampler(CPU, 0)(logits.clone(), [c]).tokens.item() == 1


CHI2_DF3_P001 = 16.266  # chi-square critical value, 3 degrees of freedom, false-alarm rate 0.001


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


def test_sampled_frequencies_match_distribution():
    probs = [0.1, 0.2, 0.3, 0.4]
    row = logits_of(probs)
    n = 4000
    # (a) one seeded request drawing n times, one token per step (its number is a function of the
    # seed and of how many tokens it has sampled, so the history grows as in the engine)
    req = make_req(SamplingParams(temperature=1.0), seed=2024)
    sampler = Sampler(CPU, 0)
    for _ in range(n):
        req.token_ids.append(sampler(row[None].clone(), [req]).tokens.item())
    seq = req.output_token_ids
    # (b) n unseeded rows in one batch, from the sampler's generator
    batch = draw(row, SamplingParams(temperature=1.0), n, seed=2024)
    for toks in (seq, batch):
        counts = [toks.count(i) for i in range(4)]
        assert chi_square(counts, probs) < CHI2_DF3_P001, counts
    # Temperature reshapes the distribution: p ** (1 / T), renormalized.
    T = 2.0
    sharp = [p ** (1 / T) for p in probs]
    sharp = [p / sum(sharp) for p in sharp]
    toks = draw(row, SamplingParams(temperature=T), n, seed=7)
    counts = [toks.count(i) for i in range(4)]
    assert chi_square(counts, sharp) < CHI2_DF3_P001, counts
    assert chi_square(counts, probs) > CHI2_DF3_P001  # and is not the T=1 distribution


def test_inverse_cdf_ends_and_negligible_tokens():
    """reference.sample_from_cdf: u = 0 gives the first token with mass, u -> 1 the last; tokens at
    -inf never come up, nor tokens under ~e^-79 of the row's most likely one (flushed to zero mass:
    exp() of inputs with denormal results is ~90x slower on x86 CPUs). A wide row (spread over
    hundreds of logits, most of its vocabulary below the flush) still samples its distribution."""
    from arcserve.kernels.reference import sample_from_cdf

    x = torch.tensor([[-90.0, 0.0, float("-inf"), -1.0, -85.0],   # tiny, top, filtered, kept, tiny
                      [float("-inf"), -79.0, 0.0, -100.0, float("-inf")]])  # fmt: skip
    ones = torch.ones(2)
    assert sample_from_cdf(x, ones, torch.zeros(2)).tolist() == [1, 1]
    assert sample_from_cdf(x, ones, torch.full((2,), 1 - 2**-24)).tolist() == [3, 2]
    # inv_temp scales before the flush: at temperature 2 the -90 logit is e^-45 of the top, kept
    assert sample_from_cdf(x, torch.tensor([0.5, 1.0]), torch.zeros(2)).tolist() == [0, 1]
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(8, 50_000, generator=gen) * 40  # ~97% of each row under e^-80 of its top
    u = torch.rand(8, generator=gen)
    got = sample_from_cdf(wide.bfloat16(), ones.repeat(4), u)
    cdf = wide.bfloat16().double().softmax(-1).cumsum(-1)
    lo = torch.where(got > 0, cdf.gather(1, (got - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    hi = cdf.gather(1, got[:, None])[:, 0]
    assert ((lo <= u.double() + 1e-6) & (u.double() <= hi + 1e-6)).all(), (got, u)


# ---- logprobs -----------------------------------------------------------------------------
def test_logprobs_come_from_raw_logits():
    g = torch.Generator().manual_seed(5)
    V = 30
    logits = torch.randn(4, V, generator=g) * 2
    raw = logits.clone()
    second = logits[0].topk(2).indices[1].item()
    reqs = [
        # greedy, but a bias makes the second-best token win: its rank is 2 under the raw logits
        make_req(SamplingParams(temperature=0, logprobs=5, logit_bias={second: 50.0})),
        make_req(SamplingParams(temperature=1.0)),  # no logprobs
        make_req(SamplingParams(temperature=0.5, logprobs=2, repetition_penalty=1.8, top_k=3), output=[1, 2]),
        make_req(SamplingParams(temperature=2.0, logprobs=0, presence_penalty=1.0), seed=3),
    ]
    out = Sampler(CPU, 0)(logits, reqs)
    assert torch.equal(logits, raw)
    assert out.logprob_rows == [0, 2, 3]
    lsm = raw.log_softmax(-1)
    rows = torch.tensor(out.logprob_rows)
    toks = out.tokens[rows]
    assert out.tokens[0].item() == second
    torch.testing.assert_close(out.token_logprob, lsm[rows, toks])
    ranks = [int((lsm[r] > lsm[r, t]).sum()) + 1 for r, t in zip(rows.tolist(), toks.tolist())]
    assert out.token_rank.tolist() == ranks
    assert ranks[0] == 2
    # top-k over the widest request (5), from the raw distribution
    assert out.topk_ids.shape == (3, 5)
    ref = lsm[rows].topk(5, dim=-1)
    assert out.topk_ids.tolist() == ref.indices.tolist()
    torch.testing.assert_close(out.topk_logprobs, ref.values)


# ---- end to end through LLM ---------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(llama_dir):
    # A small KV cache (the default allocates up to 4 GiB on CPU, which is slow to zero).
    return LLM(str(llama_dir), dtype="float32", num_kv_blocks=128)


def prompt(seed: int, n: int) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(3, 300) for _ in range(n)]}


def gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


MAX_NEW = 20


def test_seeded_same_alone_and_in_batch(llm):
    target = SamplingParams(seed=123, temperature=0.8, max_tokens=MAX_NEW, ignore_eos=True)
    p = prompt(0, 9)
    alone = gen(llm, [p], target)[0].outputs[0].token_ids
    assert len(alone) == MAX_NEW
    prompts = [prompt(1, 5), prompt(2, 17), p, prompt(3, 3), prompt(4, 30), prompt(5, 12)]
    params = [
        SamplingParams(temperature=1.0, max_tokens=MAX_NEW + 5),
        SamplingParams(temperature=0, max_tokens=7),
        target,
        SamplingParams(seed=123, temperature=1.0, top_p=0.9, max_tokens=MAX_NEW),
        SamplingParams(temperature=0.6, top_k=10, presence_penalty=0.5, logprobs=2, max_tokens=12),
        SamplingParams(seed=5, temperature=1.3, min_p=0.05, n=2, max_tokens=MAX_NEW),
    ]
    batched = gen(llm, prompts, params)
    assert batched[2].outputs[0].token_ids == alone
    # and again, with the target last and the batch in another order
    batched = gen(llm, prompts[::-1], params[::-1])
    assert batched[3].outputs[0].token_ids == alone
    # The seed matters: another seed gives other tokens.
    other = SamplingParams(seed=124, temperature=0.8, max_tokens=MAX_NEW, ignore_eos=True)
    assert gen(llm, [p], other)[0].outputs[0].token_ids != alone


def test_n_with_seed_reproducible(llm, llama_dir):
    sp = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True)
    p = prompt(10, 8)
    first = gen(llm, [p], sp)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    seqs = [o.token_ids for o in first.outputs]
    assert all(len(s) == MAX_NEW for s in seqs)
    assert len({tuple(s) for s in seqs}) == 3  # the three samples differ
    again = gen(llm, [p, prompt(11, 4)], [sp, SamplingParams(temperature=1.0, max_tokens=5)])[0]
    assert [o.token_ids for o in again.outputs] == seqs
    assert [o.index for o in again.outputs] == [0, 1, 2]
    # A fresh engine with another engine-wide seed gives the same samples too.
    fresh = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64, seed=99)
    assert [o.token_ids for o in gen(fresh, [p], sp)[0].outputs] == seqs


def test_greedy_paths_agree(llm):
    prompts = [prompt(20, 6), prompt(21, 13)]
    ref = [
        o.outputs[0].token_ids
        for o in gen(llm, prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    ]
    for sp in (
        SamplingParams(temperature=1e-6, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=MAX_NEW, ignore_eos=True),
    ):
        assert [o.outputs[0].token_ids for o in gen(llm, prompts, sp)] == ref
    # temperature 1 without top_k does sample (differs from greedy somewhere)
    sp = SamplingParams(temperature=1.0, seed=0, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in gen(llm, prompts, sp)] != ref


def reference_logprobs(llama_dir, prompt_ids, out_ids) -> torch.Tensor:
    """log_softmax of transformers' logits at each generated position: [len(out_ids), V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + out_ids])).logits[0]
    return logits[len(prompt_ids) - 1 : -1].log_softmax(-1)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_end_to_end(llm, llama_dir, temperature):
    p = prompt(30, 10)
    sp = SamplingParams(temperature=temperature, seed=42, logprobs=3, max_tokens=12, ignore_eos=True)
    o = gen(llm, [p], sp)[0].outputs[0]
    assert len(o.logprobs) == len(o.token_ids) == 12
    ref = reference_logprobs(llama_dir, p["prompt_token_ids"], o.token_ids)
    tok = llm.get_tokenizer()
    total = 0.0
    for step, (t, d) in enumerate(zip(o.token_ids, o.logprobs)):
        assert t in d
        assert all(lp.logprob <= 0 for lp in d.values())
        top = ref[step].topk(3)
        assert set(top.indices.tolist()) <= set(d)
        assert len(d) == (3 if t in top.indices.tolist() else 4)
        for rank, (tid, val) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert d[tid].rank == rank
            assert d[tid].logprob == pytest.approx(val, abs=1e-4)
        # the sampled token: raw model logprob (not temperature-scaled) and its rank
        assert d[t].logprob == pytest.approx(ref[step, t].item(), abs=1e-4)
        assert d[t].rank == int((ref[step] > ref[step, t]).sum()) + 1
        assert d[t].decoded_token == tok.decode([t])
        if temperature == 0:
            assert d[t].rank == 1
            assert d[t].logprob == max(lp.logprob for lp in d.values())
        total += d[t].logprob
    assert o.cumulative_logprob == pytest.approx(total, abs=1e-4)
    if temperature > 0:
        assert any(d[t].rank > 1 for t, d in zip(o.token_ids, o.logprobs))  # sampled off the argmax


def test_min_tokens_end_to_end_eos_and_stop_ids(llm):
    eos = 2  # the tiny model's eos_token_id
    p = prompt(40, 7)
    forced = SamplingParams(temperature=0, logit_bias={eos: 100.0}, max_tokens=20)
    o = gen(llm, [p], forced)[0].outputs[0]
    assert o.token_ids == [eos] and o.finish_reason == "stop"
    o = gen(llm, [p], SamplingParams(temperature=0, logit_bias={eos: 100.0}, min_tokens=5, max_tokens=20))
    o = o[0].outputs[0]
    assert len(o.token_ids) == 6 and o.token_ids[-1] == eos and eos not in o.token_ids[:-1]
    assert o.finish_reason == "stop"
    sp = SamplingParams(temperature=0.9, seed=1, logit_bias={17: 100.0}, stop_token_ids=[17], min_tokens=4)
    o = gen(llm, [p], sp)[0].outputs[0]
    assert o.token_ids[-1] == 17 and 17 not in o.token_ids[:-1] and len(o.token_ids) == 5
    assert (o.finish_reason, o.stop_reason) == ("stop", 17)
    # ignore_eos: EOS does not stop the sequence, yet min_tokens still holds it off (vLLM's rule)
    sp = SamplingParams(temperature=0, logit_bias={eos: 100.0}, min_tokens=3, max_tokens=6, ignore_eos=True)
    o = gen(llm, [p], sp)[0].outputs[0]
    assert eos not in o.token_ids[:3] and o.token_ids[3:] == [eos] * 3 and o.finish_reason == "length"


def test_min_tokens_holds_off_stop_strings(llm):
    """As in vLLM (issue #21987, fixed by PR #22014): no stop, string or token, ends a sequence
    before min_tokens tokens have been generated."""
    p = prompt(41, 9)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    text = gen(llm, [p], greedy)[0].outputs[0].text
    stop = text.strip()[:2]
    assert len(stop) == 2
    early = gen(llm, [p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))[0]
    assert len(early.outputs[0].token_ids) < 8 and early.outputs[0].stop_reason == stop  # precondition
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], min_tokens=8)
    out = gen(llm, [p], sp)[0].outputs[0]
    assert len(out.token_ids) >= 8, (out.token_ids, out.text, out.stop_reason)
