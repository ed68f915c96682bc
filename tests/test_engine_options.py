"""Engine options of the GPU path that also mean something (or fail clearly) on the CPU."""

import pytest
import torch

from arcserve import LLM, EngineArgs, SamplingParams
from arcserve.kernels import resolve_kernels


@pytest.mark.parametrize("bad", [dict(gpu_memory_utilization=0), dict(gpu_memory_utilization=1.5),
                                 dict(load_format="pt"), dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="fp16")])  # fmt: skip
def test_bad_engine_options_name_the_option(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        EngineArgs(**bad)


def test_kernel_choice(monkeypatch):
    # Triton first imported under the suite's TRITON_INTERPRET=1: the kernels decorated after it
    # follow what it read then (imported first below, under 0, it left the later kernel tests of a
    # run that started with this file calling compiled kernels in the interpreter)
    import triton  # noqa: F401

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
                                       "--kernels", "triton", "--gpu-memory-utilization", "0.5",
                                       "--kv-cache-dtype", "fp8_e5m2"]))  # fmt: skip
    assert (a.model, a.async_scheduling, a.enforce_eager, a.load_format, a.kernels) == ("m", False, True, "dummy", "triton")
    assert a.gpu_memory_utilization == 0.5 and a.kv_cache_dtype == "fp8_e5m2"
    assert engine_args_from(p.parse_args(["m"])).kv_cache_dtype == "auto"
    assert engine_args_from(p.parse_args(["m", "--async-scheduling"])).async_scheduling is True
    assert engine_args_from(p.parse_args(["m"])).async_scheduling is None  # the device decides
    a = engine_args_from(p.parse_args(["m", "--override-generation-config", '{"temperature": 0.5}']))
    assert a.override_generation_config == {"temperature": 0.5}
    assert engine_args_from(p.parse_args(["m"])).override_generation_config == {}
    assert engine_args_from(p.parse_args(["m"])).max_logprobs == 20  # vLLM's default
    assert engine_args_from(p.parse_args(["m", "--max-logprobs", "-1"])).max_logprobs == -1
    with pytest.raises(ValueError, match="max_logprobs must be"):
        engine_args_from(p.parse_args(["m", "--max-logprobs", "-2"]))
    with pytest.raises(ValueError, match="max_logprobs must be"):
        EngineArgs(max_logprobs=True)
    for bad in ("{temperature: 0.5}", "[1]"):
        with pytest.raises(ValueError, match="override_generation_config"):
            engine_args_from(p.parse_args(["m", "--override-generation-config", bad]))


def test_cli_takes_vllms_spellings(capsys):
    """vLLM's flag spellings: dtype half/float, readable integers (4k = 4,000, 4K = 4,096), -1 or
    auto for the model's own length, --num-gpu-blocks-override, --model as a flag."""
    import argparse

    from arcserve.cli import add_engine_args, build_parser, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    a = engine_args_from(p.parse_args(["m", "--dtype", "half", "--max-model-len", "4k", "--kv-cache-memory-bytes", "2G",
                                       "--max-num-batched-tokens", "0.5K", "--num-gpu-blocks-override", "77"]))  # fmt: skip
    assert (a.dtype, a.max_model_len, a.kv_cache_memory_bytes, a.max_num_batched_tokens, a.num_kv_blocks) == (
        "half", 4000, 2 << 30, 512, 77)  # fmt: skip
    assert engine_args_from(p.parse_args(["m", "--dtype", "float", "--max-model-len", "4K"])).max_model_len == 4096
    for auto in ("-1", "auto"):
        assert engine_args_from(p.parse_args(["m", "--max-model-len", auto])).max_model_len is None
    for bad in ("4x", "1.5", "k", "0.3k5"):
        with pytest.raises(SystemExit):
            p.parse_args(["m", "--max-model-len", bad])
        assert "not an integer" in capsys.readouterr().err
    from arcserve.cli import main

    with pytest.raises(SystemExit):  # two different models
        main(["generate", "a", "--model", "b", "--prompt", "x"])
    assert "two models given" in capsys.readouterr().err
    ns = build_parser().parse_args(["serve", "--model", "m", "--served-model-name", "x", "y"])
    assert ns.model_flag == "m" and ns.model is None and ns.served_model_name == ["x", "y"]
    a = engine_args_from(p.parse_args(["m", "--trust-remote-code", "-tp", "1"]))
    assert a.trust_remote_code is True and a.tensor_parallel_size == 1


def test_vllm_constructor_arguments(tiny_dirs, monkeypatch):
    """LLM() takes vLLM's trust_remote_code (handed to the tokenizer: model code is never run) and
    tensor_parallel_size (1; more is refused: one device per model). The Qwen3 folder's tokenizer is
    one that AutoTokenizer picks (hf_files.generic_tokenizer_class leaves it to AutoTokenizer)."""
    import transformers

    seen = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path, **kw: seen.append(kw.get("trust_remote_code")) or real(path, **kw))  # fmt: skip
    folder = str(tiny_dirs["qwen3"])
    llm = LLM(folder, dtype="float32", trust_remote_code=True, tensor_parallel_size=1, max_model_len=64)
    assert seen == [True] and llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        EngineArgs(model=folder, tensor_parallel_size=2)


def test_cpu_default_budget_is_shared_with_the_decode_mirror(llama_dir, monkeypatch, caplog):
    """On the CPU the default KV budget holds the paged cache and the decode mirror: the mirror up to
    half, no more than it can use (max_num_seqs rows of max_model_len tokens) and never so much that
    one max_model_len sequence no longer fits the paged cache; its arena is written at startup (torch's
    allocator, not a lazily mapped region), so no growth maps fresh pages mid-run. A budget given by
    the user is the paged cache's alone, and the mirror maps its pages as it grows. With an 8-bit
    paged cache, both still hold as many tokens."""
    from arcserve.engine import kv_budget
    from arcserve.engine.kv_budget import kv_cache_bytes_per_block

    def start(budget, **kw):
        monkeypatch.setattr(kv_budget, "CPU_KV_DEFAULT", budget)
        llm = LLM(model=str(llama_dir), device="cpu", **kw)
        out = llm.generate("hello there", SamplingParams(temperature=0, max_tokens=4))[0]
        assert len(out.outputs[0].token_ids) == 4
        eng = llm.llm_engine
        per_block = kv_cache_bytes_per_block(eng.model, eng.args.block_size)
        mirror = eng.runner.decode_mirror
        # (each layer's arena holds one element of slack beyond what the layouts use: not counted)
        arena = 0 if mirror.arena is None else sum((a.numel() - a.shape[0]) * a.element_size() for a in mirror.arena)
        return eng, per_block, mirror, arena

    budget = 1 << 20
    eng, per_block, mirror, arena = start(budget, max_model_len=256, max_num_seqs=64)
    assert per_block == 2 * 2 * 2 * 16 * 4 * eng.args.block_size  # K and V x layers x KV heads x head_dim x bytes
    assert eng.kv.pool.num_blocks == (budget // 2) // per_block and arena == budget - budget // 2
    assert all(a.untyped_storage().resizable() for a in mirror.arena)  # torch.zeros, not a mapping
    # a small max_num_seqs caps the mirror at what it can use, and the startup line says so
    caplog.clear()
    with caplog.at_level("INFO", logger="arcserve"):
        eng, per_block, mirror, arena = start(budget, max_model_len=128, max_num_seqs=2)
    m = eng.model.cfg
    assert (m.num_layers, m.num_kv_heads, m.head_dim, eng.model.dtype) == (2, 2, 16, torch.float32)
    most = 2 * 2 * 2 * 2 * 128 * 16 * 4  # K and V x layers x rows x KV heads x 128 tokens x head_dim x bytes
    assert arena == most < budget // 2
    assert f"decode mirror: {most / 2**20:.1f} MiB" in caplog.text
    # a budget of 1.5 sequences: the paged cache keeps one whole sequence, the mirror gets the rest
    one_seq = 256 // eng.args.block_size * per_block
    eng, per_block, mirror, arena = start(one_seq * 3 // 2, max_model_len=256, max_num_seqs=64)
    assert eng.kv.pool.num_blocks == 256 // eng.args.block_size and arena == one_seq * 3 // 2 - one_seq

    # an 8-bit paged cache beside the float32 mirror of this float32 model: shares that hold as many
    # tokens each (4 bytes a value in the mirror, 1 in the cache: the mirror 4/5 of the budget)
    eng8, per8, _, arena8 = start(budget, max_model_len=256, max_num_seqs=64, kv_cache_dtype="fp8")
    share = budget * 4 // 5
    assert share - 16 < arena8 <= share  # (the arena rounds to whole K/V elements of every layer)
    assert eng8.kv.pool.num_blocks == (budget - share) // per8 and per8 * 4 == per_block

    own = LLM(model=str(llama_dir), device="cpu", max_model_len=256, max_num_seqs=64, kv_cache_memory_bytes=budget)
    assert own.llm_engine.kv.pool.num_blocks == budget // per_block
    assert own.llm_engine.runner.decode_mirror.arena is None  # made, lazily mapped, at its first growth
    # a budget given by the user: the mirror may take the paged cache's tokens in the model's dtype
    own8 = LLM(model=str(llama_dir), device="cpu", max_model_len=256, max_num_seqs=64, kv_cache_memory_bytes=budget,
               kv_cache_dtype="fp8")  # fmt: skip
    assert own8.llm_engine.runner.decode_mirror.max_bytes == 4 * own8.llm_engine.runner.kv.numel()
