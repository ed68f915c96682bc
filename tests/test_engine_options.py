"""Engine options of the GPU path that also mean something (or fail clearly) on the CPU."""

import pytest
import torch

from arcserve import LLM, EngineArgs, SamplingParams
from arcserve.kernels import resolve_kernels


@pytest.mark.parametrize("bad", [dict(gpu_memory_utilization=0), dict(gpu_memory_utilization=1.5),
                                 dict(load_format="pt")])  # fmt: skip
def test_bad_engine_options_name_the_option(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        EngineArgs(**bad)


def test_kernel_choice(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_kernels("auto", cpu) == "torch"
    with pytest.raises(ValueError, match="kernels must be one of"):
        resolve_kernels("cuda", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_kernels("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_kernels("triton", cpu) == "triton"


def test_dummy_weights_need_only_config_and_tokenizer(tmp_path, llama_dir):
    import shutil

    for f in llama_dir.iterdir():  # everything but the weights
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, tmp_path / f.name)
    with pytest.raises(FileNotFoundError, match="has no weights"):
        LLM(str(tmp_path), dtype="float32")
    llm = LLM(str(tmp_path), dtype="float32", load_format="dummy", seed=3)
    w = llm.llm_engine.model.layers[0].qkv
    assert w.abs().max() <= 1e-3 and w.std() > 1e-4  # random, in vLLM's dummy range
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    again = LLM(str(tmp_path), dtype="float32", load_format="dummy", seed=3).llm_engine.model.layers[0].qkv
    assert torch.equal(w, again)  # seeded


def test_cli_engine_flags_map_onto_engine_args():
    import argparse

    from arcserve.cli import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    a = engine_args_from(p.parse_args(["m", "--no-async-scheduling", "--enforce-eager", "--load-format", "dummy",
                                       "--kernels", "triton", "--gpu-memory-utilization", "0.5"]))  # fmt: skip
    assert (a.model, a.async_scheduling, a.enforce_eager, a.load_format, a.kernels) == ("m", False, True, "dummy", "triton")
    assert a.gpu_memory_utilization == 0.5
    assert engine_args_from(p.parse_args(["m", "--async-scheduling"])).async_scheduling is True
    assert engine_args_from(p.parse_args(["m"])).async_scheduling is None  # the device decides


def test_cpu_default_budget_is_shared_with_the_decode_mirror(llama_dir, monkeypatch):
    """On the CPU the default KV budget holds the paged cache and the decode mirror, half each, and the
    mirror's arena is written at startup (no growth maps fresh pages mid-run); a budget or block
    count given by the user is the paged cache's alone and the mirror maps its pages as it grows."""
    from arcserve.engine import engine as engine_mod
    from arcserve.engine.runner import kv_cache_bytes_per_block

    budget = 1 << 20
    monkeypatch.setattr(engine_mod, "_CPU_KV_DEFAULT", budget)
    llm = LLM(model=str(llama_dir), max_model_len=256, max_num_seqs=64)
    eng = llm.llm_engine
    per_block = kv_cache_bytes_per_block(eng.model, eng.args.block_size)
    assert eng.kv.pool.num_blocks == (budget // 2) // per_block
    mirror = eng.runner.decode_mirror
    k, v = mirror.arena
    assert k.numel() * k.element_size() + v.numel() * v.element_size() == budget - budget // 2
    assert mirror.max_bytes == budget - budget // 2
    out = llm.generate("hello there", SamplingParams(temperature=0, max_tokens=8))[0]
    assert len(out.outputs[0].token_ids) == 8

    own = LLM(model=str(llama_dir), max_model_len=256, max_num_seqs=64, kv_cache_memory_bytes=budget)
    assert own.llm_engine.kv.pool.num_blocks == budget // per_block
    assert own.llm_engine.runner.decode_mirror.arena is None  # made, lazily mapped, at its first growth
