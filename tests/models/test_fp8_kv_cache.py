"""kv_cache_dtype="fp8" / "fp8_e5m2" (vLLM's option): K and V are kept as 8-bit floats (scale 1.0).

Every path that reads the cache (whole prompts, 16-token chunks, recompute after preemption, prompts
served from the prefix cache) must read the same rounded values, so greedy tokens agree across
them exactly as they do with a full-precision cache; the cache takes half the bytes of bf16; and a
real model keeps its next-token choices on nearly every position."""

import logging

import pytest
import torch
from conftest import DEVICE
from test_oracle import SETTINGS, prompts_with_shared_prefix, run

from arcserve import LLM, SamplingParams
from arcserve.kernels import cpu_attention
from arcserve.platform import fp8_kv_cache_unsupported

CASES = [("llama", False), ("qwen3", False)] + ([("llama", True)] if DEVICE.type == "cpu" else [])


@pytest.mark.parametrize("arch,mirror", CASES)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_every_cache_path_reads_the_same_rounded_values(tiny_dirs, arch, mirror, kv_cache_dtype, monkeypatch):
    """mirror: the CPU's decode mirror serves every decode (it would from ~1,024 context tokens)."""
    if mirror:
        monkeypatch.setattr(cpu_attention, "MIN_MIRROR_CONTEXT", 1)
    prompts = prompts_with_shared_prefix(3)
    want = None
    for setting, kw in SETTINGS.items():
        llm = LLM(str(tiny_dirs[arch]), dtype="float32", kv_cache_dtype=kv_cache_dtype, **kw)
        eng = llm.llm_engine
        assert eng.runner.kv.dtype == {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
        first = run(llm, prompts)
        if DEVICE.type == "cpu" and setting != "preempt":  # (there, 112 tokens: too few for a mirror row)
            assert (eng.runner.decode_mirror.k is not None) == mirror  # laid out at its first use
        want = want or first
        assert first == want, setting
        hits = eng.scheduler.kv.prefix_hits
        assert run(llm, prompts) == want, f"{setting}, from the prefix cache"
        assert eng.scheduler.kv.prefix_hits > hits
        if setting == "preempt":
            assert eng.scheduler.num_preemptions > 0


def test_where_an_8bit_cache_cannot_run_it_is_refused_with_the_reason(llama_dir, monkeypatch):
    cuda, e4m3, e5m2 = torch.device("cuda"), torch.float8_e4m3fn, torch.float8_e5m2
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "8.9 or newer; this GPU has 8.0" in fp8_kv_cache_unsupported(cuda, e4m3, True)
    assert fp8_kv_cache_unsupported(cuda, e5m2, True) is None  # e5m2 converts on older GPUs
    assert fp8_kv_cache_unsupported(cuda, e4m3, False) is None  # torch converts it
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_kv_cache_unsupported(cuda, e4m3, True) is None
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert "ROCm" in fp8_kv_cache_unsupported(cuda, e5m2, False)
    monkeypatch.setattr(torch.version, "hip", None)
    if DEVICE.type == "cpu":  # Triton's interpreter rounds float8 wrongly: refused, nothing started
        with pytest.raises(ValueError, match="kv_cache_dtype='fp8' cannot run on cpu: Triton's interpreter"):
            LLM(str(llama_dir), kernels="triton", kv_cache_dtype="fp8")


def test_fp8_cache_holds_twice_the_tokens_of_bf16(llama_dir, caplog):
    budget = 4 << 20
    sizes = {}
    for kv in ("auto", "fp8"):
        with caplog.at_level(logging.INFO, logger="arcserve"):
            llm = LLM(str(llama_dir), dtype="bfloat16", kv_cache_memory_bytes=budget, kv_cache_dtype=kv)
        runner = llm.llm_engine.runner
        sizes[kv] = runner.kv.shape[2]
        assert runner.kv.numel() * runner.kv.element_size() <= budget
    assert sizes["fp8"] == 2 * sizes["auto"]
    assert "KV cache in float8_e4m3fn" in caplog.text


@pytest.fixture(scope="module")
def full_precision_answers(smollm2_dir):
    """SmolLM2-135M's greedy answers (64 tokens) to six chat questions with a float32 cache, as
    (prompt ids, answer ids) pairs: made once for both 8-bit formats."""
    full = LLM(str(smollm2_dir), dtype="float32", max_model_len=1024)
    tok = full.get_tokenizer()
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Why is the sky blue?",
                 "How do I boil an egg?", "Name three prime numbers.", "What is Python?"]  # fmt: skip
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q in questions]  # fmt: skip
    answers = full.generate(prompts, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    return [(list(a.prompt_token_ids), list(a.outputs[0].token_ids)) for a in answers]


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the real model is converted for the CPU test run")
@pytest.mark.parametrize("kv_cache_dtype,least", [("fp8", 0.92), ("fp8_e5m2", 0.88)])
def test_real_model_keeps_its_choices(smollm2_dir, full_precision_answers, kv_cache_dtype, least):
    """SmolLM2-135M in float32 with an 8-bit cache, fed its own full-precision greedy answers (teacher
    forcing, through prompt_logprobs): the most likely next token is the full-precision one on at
    least `least` of the answer positions (measured: see docs/BENCHMARKS.md)."""
    seqs = full_precision_answers
    small = LLM(str(smollm2_dir), dtype="float32", max_model_len=1024, kv_cache_dtype=kv_cache_dtype)
    outs = small.generate([{"prompt_token_ids": p + a} for p, a in seqs],
                          SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)  # fmt: skip
    same = total = 0
    for (p, a), o in zip(seqs, outs):
        for i, t in enumerate(a, start=len(p)):
            top = max(o.prompt_logprobs[i].items(), key=lambda kv: kv[1].logprob)[0]
            same += top == t
            total += 1
    assert total > 200
    assert same / total >= least, same / total
