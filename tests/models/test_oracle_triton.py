"""The whole engine through the Triton kernels (`kernels="triton"`) gives transformers' greedy
tokens: on the GPU when there is one, else on the CPU in Triton's interpreter (CI). The interpreter
runs each program of a launch in Python (~30 ms per attention program), so CI runs two cases of
the matrix and the rest is marked slow there (`pytest -m slow`)."""

import pytest
from conftest import ARCHS, DEVICE
from test_oracle import expected, prompts_with_shared_prefix, run  # noqa: F401 F811 (fixture)

from arcserve import LLM

SETTINGS = {
    "default": {},
    "chunked16": {"max_num_batched_tokens": 16},
    "preempt": {"num_kv_blocks": 14, "max_model_len": 112, "block_size": 8},
}
IN_CI = {("llama", "default"), ("qwen3", "chunked16")}
CASES = [
    pytest.param(arch, setting, marks=[] if DEVICE.type != "cpu" or (arch, setting) in IN_CI else [pytest.mark.slow])
    for arch in ("llama", "qwen3", "mistral")
    for setting in SETTINGS
]


@pytest.mark.parametrize("arch,setting", CASES)
def test_triton_engine_greedy_matches_transformers(tiny_dirs, expected, arch, setting):  # noqa: F811
    llm = LLM(str(tiny_dirs[arch]), dtype="float32", kernels="triton", device=DEVICE.type, **SETTINGS[setting])
    assert llm.llm_engine.model.ops.name == "triton"
    prompts = prompts_with_shared_prefix(ARCHS.index(arch))
    assert run(llm, prompts) == expected[arch]
    sched = llm.llm_engine.scheduler
    if setting == "preempt":
        assert sched.num_preemptions > 0
    hits = sched.kv.prefix_hits
    assert run(llm, prompts) == expected[arch]  # second pass from the prefix cache
    assert sched.kv.prefix_hits > hits
