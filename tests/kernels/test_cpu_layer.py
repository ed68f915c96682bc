"""cpu_layer: a step decoding one sequence runs each decoder layer as one compiled call and writes
every layer's new K/V into the decode mirror and the paged cache at the step's end. It must give
the layer-by-layer path's bits (tokens, logprobs, both caches), also when a layer cannot take it
midway through a step (the layers before keep their K/V), and leave 8-bit caches layer by layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_cpu_compiled import HAVE_CXX, compiled_keys, emulated_half  # noqa: F401 (the autouse fixture)
from tiny_models import make_model_dir

from arcserve import LLM, SamplingParams
from arcserve.kernels import cpu_compiled, cpu_layer, reference

LAYERS = 3


@pytest.fixture(scope="module")
def three_layer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("three_layers")
    return {arch: make_model_dir(root / arch, arch, seed=7, num_hidden_layers=LAYERS) for arch in ("llama", "qwen2", "qwen3")}


class Counts:
    """Calls of the whole-layer kernel (that returned a result) and of the per-layer paged-cache store."""

    def __init__(self, monkeypatch) -> None:
        self.layers = self.stores = 0
        run, store = cpu_layer._run, reference.store_kv

        def counted_run(*args):
            got = run(*args)
            self.layers += got is not None
            return got

        def counted_store(*args):
            self.stores += 1
            return store(*args)

        monkeypatch.setattr(cpu_layer, "_run", counted_run)
        monkeypatch.setattr(reference, "store_kv", counted_store)


def decode(model_dir, whole_layer: bool, prompt: int = 55) -> dict:
    """Two requests (`prompt` and 9 prompt tokens) decoding 100 and 12 greedy tokens with logprobs:
    the long one decodes alone after the short one finishes (past the 128-position attention
    bucket with the default prompt)."""
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


# plain (across two attention buckets), qkv bias + tied head, q/k norms (one bucket: fewer compiles)
@pytest.mark.parametrize("arch,prompt", [("llama", 55), ("qwen2", 10), ("qwen3", 10)])
def test_whole_layer_steps_give_the_layer_by_layer_bits(three_layer_dirs, arch, prompt, monkeypatch):
    want = decode(three_layer_dirs[arch], False, prompt)
    counts = Counts(monkeypatch)
    got = decode(three_layer_dirs[arch], True, prompt)
    assert_same(got, want)
    if HAVE_CXX:
        assert not cpu_compiled._failed, cpu_compiled._failed
        assert compiled_keys(cpu_layer._layer) >= 2  # the first layer's graph and the others'
        assert counts.layers == ALONE * LAYERS
        # no per-layer store on those steps: only the prefill steps' and the two-sequence steps'
        assert counts.stores == BOTH * LAYERS
    assert sum(want["kv"].flatten() != 0) > 0  # (the caches compared hold something)


@pytest.mark.parametrize("why", ["weights", "compile"])
def test_a_layer_that_cannot_hands_the_step_to_the_layer_by_layer_path(three_layer_dirs, why, monkeypatch):
    """Layer 1 lacks its products' tiled weights, or the graph of the layers after the first fails
    to compile: layer 0 runs whole, its K/V are written, layers 1 and 2 run layer by layer."""
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
        kernel = cpu_compiled._kernel
        monkeypatch.setattr(cpu_compiled, "_kernel", lambda fn, args, layout=(), **static: (
            None if fn is cpu_layer._layer and not static["first"] else kernel(fn, args, layout, **static)))  # fmt: skip
    got = decode(model_dir, True)
    assert_same(got, want)
    if HAVE_CXX:
        assert counts.layers == ALONE  # layer 0 of each step
        assert counts.stores == BOTH * LAYERS + ALONE * (LAYERS - 1)


def test_an_8bit_cache_runs_layer_by_layer(three_layer_dirs, monkeypatch):
    """An fp8 cache rounds each token's K/V as the cache holds them: not the whole-layer path."""
    counts = Counts(monkeypatch)
    llm = LLM(str(three_layer_dirs["llama"]), dtype="bfloat16", max_model_len=256, kv_cache_dtype="fp8",
              num_kv_blocks=24, max_num_seqs=4)  # fmt: skip
    out = llm.generate({"prompt_token_ids": list(range(5, 20))}, SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert len(out.token_ids) == 8 and counts.layers == 0 and counts.stores == 8 * LAYERS
