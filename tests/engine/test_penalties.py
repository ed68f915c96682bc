"""Repetition, frequency and presence penalties through the engine (engine/penalties.py: each
request's token counts kept on the device and brought up to date from the sampled tokens): greedy
tokens against transformers' logits penalized from the definitions at every step
(tiny_models.penalized_greedy), through every engine path, and slots reused as requests end."""

from __future__ import annotations

import pytest
import torch
from tiny_models import penalized_greedy

from arcserve import LLM, SamplingParams
from arcserve.engine.penalties import PenaltyState

# (repetition, frequency, presence): each penalty alone, both signs, and together
PENALTIES = [(1.3, 0.0, 0.0), (0.8, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, -0.3, 0.0), (1.0, 0.0, 2.0), (1.2, 0.2, 0.3)]
PROMPTS = [[5, 6, 7, 8, 9] * 3, [40, 41, 42] * 4, list(range(60, 72)) * 2, [11, 12] * 6]
MAX_TOKENS = 24


def params(rep: float, freq: float, pres: float) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=rep,
                          frequency_penalty=freq, presence_penalty=pres)  # fmt: skip


def workload() -> tuple[list[dict], list[SamplingParams], list[tuple]]:
    """Every penalty setting on two prompts, and plain greedy requests beside them."""
    cases = [(PROMPTS[(i + j) % len(PROMPTS)], pen) for i, pen in enumerate(PENALTIES) for j in (0, 1)]
    cases += [(p, (1.0, 0.0, 0.0)) for p in PROMPTS[:2]]
    return [{"prompt_token_ids": p} for p, _ in cases], [params(*pen) for _, pen in cases], cases


@pytest.fixture(scope="module")
def oracle(llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    _, _, cases = workload()
    return [penalized_greedy(model, p, MAX_TOKENS, *pen) for p, pen in cases]


def test_the_oracle_is_not_plain_greedy(oracle):
    """The penalties change what the tiny model says (else the comparisons below prove little)."""
    _, _, cases = workload()
    plain = {tuple(p): out for (p, pen), out in zip(cases, oracle) if pen == (1.0, 0.0, 0.0)}
    changed = [out != plain[tuple(p)] for (p, pen), out in zip(cases, oracle) if tuple(p) in plain and pen != (1.0, 0.0, 0.0)]
    assert len(changed) >= 4 and all(changed)


@pytest.mark.parametrize("engine_kw", [
    {},
    {"async_scheduling": True},
    {"num_kv_blocks": 40, "block_size": 4, "max_num_batched_tokens": 16, "max_model_len": 128},  # chunks, preemption
    {"num_kv_blocks": 40, "block_size": 4, "max_num_batched_tokens": 16, "max_model_len": 128, "async_scheduling": True},
    {"speculative_config": "draft"},
    {"speculative_config": "draft", "async_scheduling": True},
    {"enable_prefix_caching": True, "second_pass": True},
    {"kernels": "triton"},  # (the Triton kernel; in CI under the interpreter)
], ids=["plain", "overlapped", "preempted", "preempted-overlapped", "speculating", "speculating-overlapped", "prefix-cached", "triton"])  # fmt: skip
def test_penalized_greedy_tokens_equal_the_oracle(llama_dir, oracle, engine_kw):
    prompts, sps, _ = workload()
    if engine_kw.get("kernels") == "triton":  # (slow under the interpreter: one request per penalty kind)
        pick = [0, 4, 8, 10, 12]
        prompts, sps, oracle = [prompts[i] for i in pick], [sps[i] for i in pick], [oracle[i] for i in pick]
    kw = dict(engine_kw)
    if kw.get("speculative_config") == "draft":  # the model drafts for itself: its plain argmax
        kw["speculative_config"] = {"model": str(llama_dir), "num_speculative_tokens": 3}
    runs = 2 if kw.pop("second_pass", False) else 1
    llm = LLM(model=str(llama_dir), dtype="float32", **{"max_model_len": 256, **kw})
    for _ in range(runs):  # (a second pass: the prompts' blocks come from the prefix cache)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
        assert got == oracle
    stats = llm.llm_engine.scheduler.stats()
    if "num_kv_blocks" in kw:
        assert stats.num_preemptions > 0
    if runs == 2:
        assert stats.prefix_cache_hits > 0
    if "speculative_config" in kw:  # drafts were accepted (and rejected) for penalized requests, not only plain ones
        penalized = [i for i, sp in enumerate(sps) if sp.needs_penalties]
        spec = llm.llm_engine.metrics.spec
        drafted, accepted = spec.num_draft_tokens, spec.num_accepted_tokens
        got = [o.outputs[0].token_ids for o in llm.generate([prompts[i] for i in penalized],
                                                            [sps[i] for i in penalized], use_tqdm=False)]  # fmt: skip
        assert got == [oracle[i] for i in penalized]
        assert spec.num_draft_tokens - drafted > spec.num_accepted_tokens - accepted > 0


def test_slots_are_reused_as_requests_end(llama_dir, oracle):
    """Three requests at a time, twelve penalized ones in all: finished requests' slots (their
    counts reset) serve the later ones, and the device's table keeps its size, max_num_seqs."""
    prompts, sps, _ = workload()
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_seqs=3)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
    assert got == oracle
    state = llm.llm_engine.runner.sampler.penalties
    assert len(state.owner) == 3 < sum(sp.needs_penalties for sp in sps)  # one slot per running request
    # again in reverse order: every slot now holds an earlier request's counts
    got = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], sps[::-1], use_tqdm=False)]
    assert got == oracle[::-1] and len(state.owner) == 3


def test_n_sequences_count_their_own_tokens(llama_dir):
    """n > 1: each sequence's penalties count its own output, so a seeded sequence samples as it does
    alone (n = 1 with the same per-sequence seed)."""
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256)
    sp = dict(temperature=1.0, max_tokens=20, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5)
    many = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(n=4, seed=9, **sp), use_tqdm=False)[0]
    alone = [llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(seed=9 + i, **sp),
                          use_tqdm=False)[0].outputs[0].token_ids for i in range(4)]  # fmt: skip
    assert [o.token_ids for o in many.outputs] == alone and len({tuple(a) for a in alone}) == 4


@pytest.mark.parametrize("engine_kw", [
    {"num_kv_blocks": 32, "block_size": 4, "max_num_batched_tokens": 16, "max_model_len": 128, "max_num_seqs": 3,
     "async_scheduling": True},
    {"speculative_config": "draft", "async_scheduling": True, "max_num_seqs": 3},
], ids=["overlapped-preempted-reused", "speculating-overlapped-reused"])  # fmt: skip
def test_each_sampling_sees_exactly_its_request_history(llama_dir, engine_kw, monkeypatch):
    """Whatever the path (tokens pending on the device, preemptions, drafts accepted and rejected,
    slots reused, stop strings ending requests, n > 1), every penalized row samples over its slot's
    prompt flags, penalties and counts of exactly the output its request had before the step (read
    back once the run is over, when the host holds every token)."""
    seen = []
    orig = PenaltyState._slots

    def recording(self, reqs, before):
        slots = orig(self, reqs, before)
        for req, n, s in zip(reqs, before, slots):
            seen.append((req, n, self.counts[s].cpu().clone(), self.prompt[s].cpu().clone(), self.params[s].tolist()))
        return slots

    monkeypatch.setattr(PenaltyState, "_slots", recording)
    kw = dict(engine_kw)
    if kw.get("speculative_config") == "draft":
        kw["speculative_config"] = {"model": str(llama_dir), "num_speculative_tokens": 3}
    llm = LLM(model=str(llama_dir), dtype="float32", **{"max_model_len": 256, **kw})
    prompts, sps, _ = workload()
    sps = [sp.clone() for sp in sps]
    for i, sp in enumerate(sps):
        sp.temperature, sp.seed, sp.max_tokens = 1.0, i, 60  # sampled: the outputs wander
        if i % 3 == 0:
            sp.stop = ["e", "a"]  # ends some requests early (one step late when steps overlap)
    sps[1].n = 2
    outs = llm.generate(prompts, sps, use_tqdm=False)
    assert any(c.finish_reason == "stop" for o in outs for c in o.outputs)
    assert len({id(r) for r, *_ in seen}) > 10 and len(seen) > 100
    for req, n, counts, prompt, params in seen:
        out = req.token_ids[req.num_prompt_tokens : req.num_prompt_tokens + n]
        assert req.num_output_tokens >= n
        assert torch.equal(counts, torch.bincount(torch.tensor(out, dtype=torch.long), minlength=len(counts)).float())
        assert torch.equal(prompt, torch.bincount(torch.tensor(req.prompt_token_ids), minlength=len(prompt)) > 0)
        p = req.params
        assert params == pytest.approx([p.repetition_penalty, p.frequency_penalty, p.presence_penalty])
    if "num_kv_blocks" in kw:
        assert llm.llm_engine.scheduler.stats().num_preemptions > 0
    else:
        spec = llm.llm_engine.metrics.spec
        assert spec.num_draft_tokens > spec.num_accepted_tokens > 0


@pytest.mark.gpu
def test_no_sampling_kernel_compiles_after_startup(llama_dir):
    """On a GPU the sampler's Triton kernels compile at startup (Sampler.warm_up): sampled,
    filtered and penalized requests then launch only kernels compiled before them (a compile at
    the first such request, ~30 ms or far more with a cold cache, stalls every running request)."""
    from arcserve.kernels import triton_sampling as ts

    def compiled() -> int:
        return sum(len(c[0]) for k in (ts._sample_kernel, ts._penalties_kernel) for c in k.device_caches.values())

    llm = LLM(model=str(llama_dir), dtype="bfloat16", max_model_len=256)
    assert llm.llm_engine.runner.sampler.penalties is not None  # (the table, made at startup)
    before = compiled()
    assert before >= 3  # sampling over bf16 and float32 logits, penalties
    sps = [SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=1),
           SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_tokens=12, ignore_eos=True),
           params(1.2, 0.2, 0.3), SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, presence_penalty=0.5)]  # fmt: skip
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sps, use_tqdm=False)
    assert compiled() == before
