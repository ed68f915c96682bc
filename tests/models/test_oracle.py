"""Greedy tokens identical to transformers for tiny random models of every supported family,
on mixed-length prompts that share a prefix: default settings, forced chunking, forced preemption,
and a second pass served from the prefix cache.

kernels="auto" is the device's own path (torch twins on the CPU; Triton kernels and graphs on a
GPU). On the CPU the Triton kernels also run, in Triton's interpreter (kernels="triton"): each
attention program costs ~30 ms there, so CI runs two of those cases and the rest are marked slow."""

import random

import pytest
from conftest import ARCHS, DEVICE
from tiny_models import TOKENIZER_VOCAB, hf_greedy

from arcserve import LLM, SamplingParams

MAX_NEW = 24


def prompts_with_shared_prefix(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, TOKENIZER_VOCAB) for _ in range(37)]
    lengths = [1, 5, 11, 16, 27, 43]  # prompts end on and around block boundaries (37 + n)
    return [prefix + [rng.randrange(3, TOKENIZER_VOCAB) for _ in range(n)] for n in lengths] + [prefix[:16]]


@pytest.fixture(scope="module")
def expected(tiny_dirs):
    return {
        arch: hf_greedy(tiny_dirs[arch], prompts_with_shared_prefix(i), MAX_NEW) for i, arch in enumerate(ARCHS)
    }


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


SETTINGS = {
    "default": dict(),
    "chunked16": dict(max_num_batched_tokens=16),
    "preempt": dict(num_kv_blocks=14, max_model_len=112, block_size=8),
}


TRITON_IN_CI = {("llama", "default"), ("qwen3", "chunked16")}
CASES = [(arch, setting, "auto") for arch in ARCHS for setting in SETTINGS]
if DEVICE.type == "cpu":  # on a GPU, "auto" is already the Triton path
    CASES += [
        pytest.param(arch, setting, "triton", marks=[] if (arch, setting) in TRITON_IN_CI else [pytest.mark.slow])
        for arch in ("llama", "qwen3", "mistral") for setting in SETTINGS
    ]  # fmt: skip


@pytest.mark.parametrize("arch,setting,kernels", CASES)
def test_greedy_matches_transformers(tiny_dirs, expected, arch, setting, kernels):
    llm = LLM(str(tiny_dirs[arch]), dtype="float32", kernels=kernels, **SETTINGS[setting])
    # "auto" is the torch twins on the CPU and the Triton kernels on a GPU
    want_ops = "torch" if kernels == "auto" and DEVICE.type == "cpu" else "triton"
    assert llm.llm_engine.model.ops.name == want_ops
    prompts = prompts_with_shared_prefix(ARCHS.index(arch))
    assert run(llm, prompts) == expected[arch]
    sched = llm.llm_engine.scheduler
    if setting == "preempt":
        assert sched.num_preemptions > 0
    # Second pass: the shared prefix (and whole prompts) come from the prefix cache.
    hits_before = sched.kv.prefix_hits
    assert run(llm, prompts) == expected[arch]
    assert sched.kv.prefix_hits > hits_before
    assert sched.kv.usage() == 0.0  # nothing left held


def test_prefix_caching_off_matches(tiny_dirs, expected):
    llm = LLM(str(tiny_dirs["qwen3"]), dtype="float32", enable_prefix_caching=False)
    prompts = prompts_with_shared_prefix(ARCHS.index("qwen3"))
    assert run(llm, prompts) == expected["qwen3"]
    assert run(llm, prompts) == expected["qwen3"]
    assert llm.llm_engine.scheduler.kv.prefix_hits == 0
