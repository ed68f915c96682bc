"""cpu_layer: a step decoding one sequence runs each decoder layer as one compiled call and writes
every layer's new K/V into the decode mirror and the paged cache at the step's end. It must give
the layer-by-layer path's bits (tokens, logprobs, both caches), also when a layer cannot take it
midway through a step (the layers before keep their K/V), and leave 8-bit caches layer by layer.
Every layer runs one graph: the first adds a residual of -0.0, which must change no bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_cpu_compiled import COMPILES, compiled_keys, emulated_half  # noqa: F401 (the autouse fixture)
from test_cpu_compiled import _layer as layer_weights
from tiny_models import make_model_dir

from arcserve import LLM, SamplingParams
from arcserve.engine.runner import ModelRunner
from arcserve.kernels import blocks, cpu_compiled, cpu_inductor, cpu_layer, get_ops, reference

LAYERS = 3


@pytest.fixture(scope="module")
def three_layer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("three_layers")
    return {arch: make_model_dir(root / arch, arch, seed=7, num_hidden_layers=LAYERS) for arch in ("llama", "qwen2", "qwen3")}


class Counts:
    """Calls of the whole-layer kernel (that returned a result) and of the per-layer paged-cache
    store, in the requests' steps (the engine's warm-up step at startup not counted)."""

    def __init__(self, monkeypatch) -> None:
        self.layers = self.stores = 0
        self.warming = False
        run, store, warm_up = cpu_layer._run, reference.store_kv, ModelRunner.warm_up

        def counted_run(*args):
            got = run(*args)
            self.layers += got is not None and not self.warming
            return got

        def counted_store(*args):
            self.stores += not self.warming
            return store(*args)

        def flagged_warm_up(runner):
            self.warming = True
            try:
                warm_up(runner)
            finally:
                self.warming = False

        monkeypatch.setattr(cpu_layer, "_run", counted_run)
        monkeypatch.setattr(reference, "store_kv", counted_store)
        monkeypatch.setattr(ModelRunner, "warm_up", flagged_warm_up)


def decode(model_dir, whole_layer: bool, prompt: int = 55) -> dict:
    """Two requests (`prompt` and 9 prompt tokens) decoding 100 and 12 greedy tokens with logprobs:
    the long one decodes alone after the short one finishes (to 154 positions with the default
    prompt: the one-row attention's span grows with it)."""
    with pytest.MonkeyPatch.context() as m:
        if not whole_layer:
            m.setattr(cpu_layer, "_start", lambda *args: None)
        llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=256, seed=0, num_kv_blocks=64, max_num_seqs=4)
        prompts = [{"prompt_token_ids": list(range(5, 5 + prompt))}, {"prompt_token_ids": list(range(70, 79))}]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (100, 12)]
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = llm.llm_engine.runner
    return {
        "tokens": [o.token_ids for o in outs],
        "logprobs": [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs],
        "kv": runner.kv.clone(),
        "mirror": (runner.decode_mirror.k.clone(), runner.decode_mirror.v.clone()),
    }


def assert_same(a: dict, b: dict) -> None:
    assert a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]
    assert torch.equal(a["kv"], b["kv"])  # the paged cache: every layer's K/V of every step
    assert all(torch.equal(x, y) for x, y in zip(a["mirror"], b["mirror"]))


# Steps: one prefill of both prompts, 11 decoding both, then the long request alone for the rest of
# its 100 tokens (the first came from the prefill)
BOTH = 1 + 11
ALONE = 100 - BOTH


# plain (the longer prompt), qkv bias + tied head, q/k norms
@pytest.mark.parametrize("arch,prompt", [("llama", 55), ("qwen2", 10), ("qwen3", 10)])
def test_whole_layer_steps_give_the_layer_by_layer_bits(three_layer_dirs, arch, prompt, monkeypatch):
    monkeypatch.setattr(cpu_inductor, "compiled", {})  # (not the kernels earlier tests compiled)
    want = decode(three_layer_dirs[arch], False, prompt)
    counts = Counts(monkeypatch)
    got = decode(three_layer_dirs[arch], True, prompt)
    assert_same(got, want)
    if COMPILES:
        assert not cpu_inductor.failed, cpu_inductor.failed
        assert compiled_keys(cpu_layer._layer) == 1  # one graph for every layer, the first one's included
        assert counts.layers == ALONE * LAYERS
        # no per-layer store on those steps: only the prefill steps' and the two-sequence steps'
        assert counts.stores == BOTH * LAYERS
    assert sum(want["kv"].flatten() != 0) > 0  # (the caches compared hold something)


def test_the_one_token_kernels_compile_at_startup(three_layer_dirs, monkeypatch):
    """The engine runs a one-token step at startup (ModelRunner.warm_up): a request that then
    decodes alone, its context growing from 10 to 110 positions, compiles nothing more, nor does
    one decoding alone after four sequences made the decode mirror grow into another layout; and
    the warm-up leaves nothing behind: the tokens, logprobs and both caches of an engine that
    skipped it."""
    monkeypatch.setattr(cpu_inductor, "compiled", {})  # (not the kernels earlier tests compiled)
    model_dir = three_layer_dirs["qwen3"]
    llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=256, seed=0, num_kv_blocks=64, max_num_seqs=4)
    kernels = cpu_inductor.kernels()
    runner = llm.llm_engine.runner
    assert not runner.kv.any() and not runner.decode_mirror.ids  # the warm-up's K/V zeroed, its row dropped
    assert not any(a.any() for a in runner.decode_mirror.arena)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    llm.generate({"prompt_token_ids": list(range(5, 15))}, params, use_tqdm=False)
    layout = runner.decode_mirror.k.shape  # (its budget, the paged cache's 1,024 tokens: 2 rows of 256)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 30, 40, 90)]
    llm.generate([{"prompt_token_ids": list(range(5 + i, 15 + i))} for i in range(4)], params, use_tqdm=False)
    assert runner.decode_mirror.k.shape != layout  # 4 rows: it grew (the last request then decoded alone)
    if COMPILES:
        assert compiled_keys(cpu_layer._layer) == 1  # one graph for every layer, the first one's included
        assert cpu_inductor.kernels() == kernels
    else:
        assert not cpu_inductor.compiled and cpu_inductor.failed
    want = decode(model_dir, True, prompt=10)
    monkeypatch.setattr(ModelRunner, "warm_up", lambda runner: None)
    assert_same(decode(model_dir, True, prompt=10), want)


@pytest.mark.parametrize("why", ["weights", "compile"])
def test_a_layer_that_cannot_hands_the_step_to_the_layer_by_layer_path(three_layer_dirs, why, monkeypatch):
    """Layer 1 lacks its products' tiled weights: layer 0 runs whole, its K/V are written, layers 1
    and 2 run layer by layer. Or the layers' graph fails to compile: every layer runs layer by layer."""
    model_dir = three_layer_dirs["llama"]
    want = decode(model_dir, False)
    counts = Counts(monkeypatch)
    if why == "weights":
        make = LLM.__init__

        def without_tiles(self, *args, **kw):
            make(self, *args, **kw)
            lw = self.llm_engine.model.layers[1]
            lw.o = dataclasses.replace(lw.o, rows16=None)

        monkeypatch.setattr(LLM, "__init__", without_tiles)
    else:
        kernel = cpu_inductor.kernel
        monkeypatch.setattr(cpu_inductor, "kernel", lambda fn, args, dynamic=None, **static: (
            None if fn is cpu_layer._layer else kernel(fn, args, dynamic, **static)))  # fmt: skip
    got = decode(model_dir, True)
    assert_same(got, want)
    if COMPILES:
        whole = 1 if why == "weights" else 0  # layer 0 of each step, or none
        assert counts.layers == ALONE * whole
        assert counts.stores == BOTH * LAYERS + ALONE * (LAYERS - whole)


def test_an_8bit_cache_runs_layer_by_layer(three_layer_dirs, monkeypatch):
    """An fp8 cache rounds each token's K/V as the cache holds them: not the whole-layer path."""
    counts = Counts(monkeypatch)
    llm = LLM(str(three_layer_dirs["llama"]), dtype="bfloat16", max_model_len=256, kv_cache_dtype="fp8",
              num_kv_blocks=24, max_num_seqs=4)  # fmt: skip
    out = llm.generate({"prompt_token_ids": list(range(5, 20))}, SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert len(out.token_ids) == 8 and counts.layers == 0 and counts.stores == 8 * LAYERS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_first_layers_residual_changes_no_bit(dtype, monkeypatch):
    """The first layer (no residual yet) adds cpu_compiled.no_residual(x) so that it runs the other
    layers' kernels: through the compiled pre half, q, k, v and the new residual keep the bits of
    the path without the add (the one-token ops one by one, the residual norm the reference's),
    and the residual is x's bits: -0.0, subnormals, the largest values and infinities included (a
    residual of +0.0 would turn -0.0 into +0.0)."""
    monkeypatch.setattr(cpu_inductor, "compiled", {})  # (not the kernels earlier tests compiled)
    g = torch.Generator().manual_seed(11)
    hidden, nq, nkv, d = 64, 4, 2, 16
    lw = layer_weights(g, dtype, hidden, 96, nq, nkv, d, bias=False, qk_norm=True)
    ops = get_ops("torch", torch.device("cpu"))
    fi = torch.finfo(dtype)
    finite = torch.randn(1, hidden, generator=g).to(dtype)
    finite[0, :10] = torch.tensor([0.0, -0.0, fi.tiny / 4, -fi.tiny / 4, fi.max, -fi.max, fi.tiny, -0.0, 1, -1]).to(dtype)
    infinite = finite.clone()
    infinite[0, 10], infinite[0, 11] = float("inf"), -float("inf")
    rope = reference.rope_cos_sin(torch.randn(64, d, generator=g), torch.tensor([7]), dtype)
    caches = [torch.zeros(3, 8, nkv, d, dtype=dtype) for _ in range(4)]

    def bits(t):
        return t.contiguous().view(torch.int16)

    for x in (finite, infinite):
        zero = cpu_compiled.no_residual(x)
        assert torch.equal(bits(reference.fused_add_rms_norm(x, zero, lw.input_norm, 1e-6)[1]), bits(x))
        got = ops.pre_attention(x, None, lw, 1e-6, rope, nq, nkv, d, caches[0], caches[1], torch.tensor([5]))
        want = blocks.pre_attention(ops, x, None, lw, 1e-6, rope, nq, nkv, d, caches[2], caches[3], torch.tensor([5]))
        assert torch.equal(bits(got[3]), bits(x))
        for a, b in zip(got, want):
            assert torch.equal(bits(a), bits(b))
    if COMPILES:
        assert not cpu_inductor.failed and compiled_keys(cpu_compiled._pre) == 1  # (the compiled pre half ran)
