"""cpu_rows_attention: decode attention of many mirror rows compiled by inductor (half models on
the CPU). It must give SDPA's result over the same rows within the output
dtype's rounding, at every row count, length, sliding window and layout of the mirror, from one
kernel per model shape; the engine must compile it at startup. Without a C++ compiler on the
machine, the fallback (SDPA) is what runs. Tests of the kernel inside the mirror over changing
batches: tests/kernels/test_cpu_attention.py (the "rows" cases)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_cpu_compiled import COMPILES, compiled_keys, emulated_half  # noqa: F401 (autouse: as on an AVX2-only CPU)

from arcserve import LLM, SamplingParams
from arcserve.kernels import cpu_attention, cpu_inductor, cpu_rows_attention, reference

KERNEL = cpu_rows_attention._attend


def _mirror(layers, rows, kvh, cap, d, g, dtype=torch.float32):
    """K, V [layers, rows, kvh, cap, d] in `dtype` holding bf16 values: views of the start of each
    layer's storage (one element more than the layout), as the mirror's arena gives them."""
    n = rows * kvh * cap * d
    K, V = ((torch.randn(layers, n + 1, generator=g) * s).bfloat16().to(dtype) for s in (2, 1))
    return K[:, :n].view(layers, rows, kvh, cap, d), V[:, :n].view(layers, rows, kvh, cap, d)


def _sdpa(q, K, V, lens, window, scale):
    """What the mirror runs without the kernel: SDPA's rows form over rows 0..n-1, padded to the longest."""
    n, heads, d = q.shape
    kvh, width = K.shape[1], int(lens.max())
    mask = reference.decode_mask(lens, width, window, torch.float32)
    K, V = K.float(), V.float()
    o = F.scaled_dot_product_attention(q.float().view(n, kvh, heads // kvh, d), K[:n, :, :width], V[:n, :, :width],
                                       attn_mask=mask, scale=scale)  # fmt: skip
    return o.view(n, heads, d)


@pytest.mark.parametrize("dtype,heads,kvh,d,half", [(torch.bfloat16, 6, 2, 16, False), (torch.float16, 4, 4, 32, False),
                                                    (torch.bfloat16, 6, 2, 16, True)])  # fmt: skip
def test_rows_attention_matches_sdpa(dtype, heads, kvh, d, half):
    """Row counts from 2, lengths from 1 to the capacity (inside, at and around block bounds),
    windows, layouts of several row counts and capacities: SDPA's result within the output dtype's
    rounding, from one kernel per window value (rows, layout and blocks read are symbolic); over a
    float32 mirror (CPUs without native half products) or a half one (`half`: with them)."""
    g = torch.Generator().manual_seed(7)
    tol = dict(rtol=8e-3, atol=8e-3) if dtype == torch.bfloat16 else dict(rtol=1e-3, atol=1e-3)
    before = compiled_keys(KERNEL)
    layouts = [(9, 256), (2, 128), (17, 384), (5, 128)]
    cases = [
        (2, None, [1, 1]), (2, None, [16, 17]), (3, None, [15, 32, 33]), (5, 3, [1, 7, 16, 40, 100]),
        (9, None, [128, 5, 64, 3, 127, 99, 1, 16, 70]), (4, 40, [200, 39, 41, 256]),
        (17, None, [int(x) for x in torch.randint(1, 385, (17,), generator=g)]), (5, 3, [128, 128, 2, 9, 31]),
    ]  # fmt: skip
    for i, (n, window, lens) in enumerate(cases):
        rows, cap = next((r, c) for r, c in layouts[i % 4 :] + layouts if r >= n and c >= max(lens))
        K, V = _mirror(3, rows, kvh, cap, d, g, dtype if half else torch.float32)
        lens = torch.tensor(lens)
        q = (torch.randn(n, heads, d, generator=g) * 2).to(dtype)
        run = cpu_rows_attention.decode_attention(K, V, lens, int(lens.max()), heads, dtype, 0.3, window)
        assert run is not None
        got = run(q, torch.tensor([1]))  # layer 1 of 3
        if not COMPILES:
            assert got is None and cpu_inductor.failed
            return
        assert got.shape == (n, heads, d) and got.dtype == dtype
        torch.testing.assert_close(got.float(), _sdpa(q, K[1], V[1], lens, window, 0.3), **tol)
    assert not cpu_inductor.failed
    assert compiled_keys(KERNEL) == before + 3  # one kernel per window: none, 3 and 40


def test_rows_attention_keys_by_window_value():
    """A sliding window is a static value of the kernel: each value compiles its own (a model has
    one); everything else reuses it."""
    g = torch.Generator().manual_seed(8)
    K, V = _mirror(2, 4, 2, 128, 16, g)
    q = torch.randn(3, 4, 16, generator=g).bfloat16()
    lens = torch.tensor([20, 90, 128])
    before = compiled_keys(KERNEL)
    for window in (None, 11, 11, 12, None):
        run = cpu_rows_attention.decode_attention(K, V, lens, 128, 4, torch.bfloat16, 0.25, window)
        if not COMPILES:  # the first call records the failure; from then on SDPA takes the step
            assert run is None or run(q, torch.tensor([0])) is None
            continue
        got = run(q, torch.tensor([0]))
        torch.testing.assert_close(got.float(), _sdpa(q, K[0], V[0], lens, window, 0.25), rtol=8e-3, atol=8e-3)
    if COMPILES:
        assert compiled_keys(KERNEL) == before + 3
    else:
        assert cpu_inductor.failed


def test_rows_attention_applies_where_its_sums_fit():
    """None (the caller runs SDPA), nothing compiled, for float32 queries, one row, a head size not a
    multiple of the lanes, more query heads a KV head than the sums fit, query heads that do not
    group evenly on the KV heads."""
    g = torch.Generator().manual_seed(9)
    lens = torch.tensor([5, 9])
    K, V = _mirror(1, 2, 2, 128, 16, g)
    assert cpu_rows_attention.decode_attention(K, V, lens, 9, 4, torch.float32, 0.3, None) is None
    assert cpu_rows_attention.decode_attention(K, V, lens[:1], 5, 4, torch.bfloat16, 0.3, None) is None
    K8, V8 = _mirror(1, 2, 2, 128, 8, g)
    assert cpu_rows_attention.decode_attention(K8, V8, lens, 9, 4, torch.bfloat16, 0.3, None) is None
    before = cpu_inductor.kernels()
    wide = (cpu_rows_attention.MAX_SUMS + 1) * 2  # query heads: (MAX_SUMS + 1) a KV head of one 16-lane sum
    assert cpu_rows_attention.decode_attention(K, V, lens, 9, wide, torch.bfloat16, 0.3, None) is None
    assert cpu_rows_attention.decode_attention(K, V, lens, 9, 5, torch.bfloat16, 0.3, None) is None  # 5 on 2 KV heads
    assert cpu_inductor.kernels() == before


def test_engine_compiles_the_rows_kernel_at_startup(llama_dir, monkeypatch):
    """A bf16 model decoding several requests at once: the startup's warm-up compiles the kernel,
    the batch compiles nothing more, and its greedy tokens are the eager path's (SDPA)."""
    monkeypatch.setattr(cpu_inductor, "compiled", {})  # (not the kernels earlier tests compiled)
    prompts = [{"prompt_token_ids": [5 + i, 17, 33, 101, 7, 64, 250, 12, 3][: 9 - 2 * i]} for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eager = LLM(str(llama_dir), dtype="bfloat16", max_model_len=128, enforce_eager=True)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, greedy, use_tqdm=False)]
    fast = LLM(str(llama_dir), dtype="bfloat16", max_model_len=128)
    if COMPILES:
        assert compiled_keys(KERNEL) == 1 and not cpu_inductor.failed
    startup = cpu_inductor.kernels()
    calls = []
    monkeypatch.setattr(cpu_rows_attention.RowsAttention, "__call__",
                        lambda self, *a, call=cpu_rows_attention.RowsAttention.__call__: calls.append(call(self, *a)) or calls[-1])  # fmt: skip
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, greedy, use_tqdm=False)]
    assert got == want
    assert cpu_inductor.kernels() == startup  # nothing compiled while the requests ran
    if COMPILES:
        assert len(calls) > 10 * len(fast.llm_engine.model.layers)  # the batch's decode steps took it
        assert all(c is not None for c in calls)
    else:  # the startup's compile failed: SDPA takes the steps
        assert cpu_inductor.failed and all(c is None for c in calls)


def test_a_failed_compile_falls_back_to_sdpa_within_the_step(monkeypatch):
    """The many-rows kernel failing to compile at a step's first layer: that step and the next
    run SDPA over the mirror (the plan leaves SDPA's mask out while the kernel is planned; the
    failing step makes it), within bf16 rounding of the reference, sliding window included."""
    from test_cpu_attention import BS, make_meta

    kernel = cpu_inductor.kernel
    failed = []

    def broken(fn, args, dynamic=None, **static):
        if fn is KERNEL:
            failed.append(fn)
            return None
        return kernel(fn, args, dynamic, **static)

    monkeypatch.setattr(cpu_inductor, "kernel", broken)
    g = torch.Generator().manual_seed(10)
    kvh, heads, d, layers, nb, dtype, window = 2, 6, 16, 2, 40, torch.bfloat16, 5
    kc = [torch.randn(nb, BS, kvh, d, generator=g).to(dtype) for _ in range(layers)]
    vc = [torch.randn(nb, BS, kvh, d, generator=g).to(dtype) for _ in range(layers)]
    mirror = cpu_attention.DecodeMirror(layers, kvh, d, dtype, torch.device("cpu"), 1 << 24)
    tables = {0: list(range(0, 20)), 1: list(range(20, 40))}
    for step, batch in enumerate(([(0, 0, 9), (1, 0, 6)], [(0, 9, 1), (1, 6, 1)], [(0, 10, 1), (1, 7, 1)])):
        meta, ref_meta = make_meta(batch, tables, mirror), make_meta(batch, tables, None)
        T = int(meta.host["query_start_loc"][-1])
        for layer in range(layers):
            q, k, v = (torch.randn(T, n, d, generator=g).to(dtype) for n in (heads, kvh, kvh))
            reference.store_kv(k, v, kc[layer], vc[layer], meta.slot_mapping)
            got = cpu_attention.paged_attention(
                q, k, v, kc[layer], vc[layer], meta, 0.3, window, layer, rows=cpu_rows_attention.decode_attention)
            want = reference.paged_attention(*[t.float() for t in (q, k, v, kc[layer], vc[layer])], ref_meta, 0.3, window)
            torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3)
        if step:  # the decode steps planned the kernel, which failed at their first layer only
            assert meta.cache["mirror_plan"]["rows"] is None and meta.cache["mirror_plan"]["mask"] is not None
    assert len(failed) == 2
