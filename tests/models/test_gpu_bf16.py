"""On the GPU: bf16 runs (Triton kernels, step graphs) agree with transformers in bf16 on most
positions. bf16 rounding differs between any two implementations, so greedy paths may part after a
near tie; the agreement rate (positions before the first divergence over all positions) is printed."""

import pytest
import torch
from conftest import DEVICE
from test_oracle import prompts_with_shared_prefix

from arcserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_agrees_with_transformers_bf16(tiny_dirs, arch):
    from transformers import AutoModelForCausalLM

    prompts = prompts_with_shared_prefix(3)
    new = 24
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.bfloat16).to(DEVICE)
    hf.generation_config.eos_token_id = None
    want = []
    for p in prompts:
        ids = torch.tensor([p], device=DEVICE)
        g = hf.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
        want.append(g[0, len(p) :].tolist())
    llm = LLM(str(tiny_dirs[arch]), dtype="bfloat16")
    assert llm.llm_engine.runner.graphs is not None  # steps replay captured graphs
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)  # fmt: skip
    agree = 0
    for o, w in zip(outs, want):
        got = o.outputs[0].token_ids
        n = next((i for i, (a, b) in enumerate(zip(got, w)) if a != b), new)
        agree += n
    rate = agree / (new * len(prompts))
    print(f"\nbf16 agreement with transformers ({arch}): {rate:.3f}")
    assert rate > 0.5
