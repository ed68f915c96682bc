"""cpu_compiled: one-token kernels compiled by inductor for half models on CPUs that emulate half
products. The small-op groups must give the eager ops' exact bits, the one-token product the
float32 product rounded once (within an ulp: the summation order differs), and a failed compile
must fall back to the eager ops. Without a C++ compiler on the machine, or under an inductor that
does not round as eager PyTorch does (torch 2.11), the fallback is what runs (COMPILES)."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from arcserve import LLM, SamplingParams
from arcserve.kernels import (
    blocks,
    cpu_attention,
    cpu_compiled,
    cpu_inductor,
    cpu_layer,
    cpu_rows_attention,
    get_ops,
    reference,
)


def _compiles() -> bool:
    """Whether the compiled kernels run here: a C++ compiler (what inductor compiles its CPU kernels
    with) and an inductor that rounds as eager PyTorch does (cpu_inductor.rounds_as_eager: torch
    2.13's does, 2.11's does not); elsewhere every compiled path falls back to the eager ops."""
    try:
        return shutil.which("g++") is not None and cpu_inductor.rounds_as_eager()
    except Exception:  # noqa: BLE001 (a compile that fails: the fallback runs, as without a compiler)
        return False


COMPILES = _compiles()
NATIVE_BF16 = reference.native_half_matmul(torch.bfloat16)  # this CPU's (read before the fixture patches it)


@pytest.fixture(autouse=True)
def emulated_half(monkeypatch):
    """Every test runs as on an AVX2-only CPU (no native half products), with a clean failure state."""
    monkeypatch.setattr(reference, "native_half_matmul", lambda dtype: False)
    failed = list(cpu_inductor.failed)
    cpu_inductor.failed.clear()
    yield
    cpu_inductor.failed[:] = failed


def compiled_keys(fn) -> int:
    return sum(1 for k in cpu_inductor.compiled if k[0] is fn)


def check_compiled(fn) -> None:
    """With a compiler the kernel must have compiled; without, the eager ops ran after a failure."""
    if COMPILES:
        assert not cpu_inductor.failed, cpu_inductor.failed
        assert compiled_keys(fn) > 0
    else:
        assert cpu_inductor.failed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norms_and_silu_mul_give_the_eager_bits(dtype):
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(1, 96, generator=g) * 3).to(dtype), torch.randn(1, 96, generator=g).to(dtype)
    w = (1 + torch.randn(96, generator=g) / 4).to(dtype)
    h, res = cpu_compiled.fused_add_rms_norm(x, r, w, 1e-6)
    h0, res0 = reference.fused_add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, h0) and torch.equal(res, res0)
    h, res = cpu_compiled.fused_add_rms_norm(x, None, w, 1e-6)  # the first layer, no residual yet: the reference op
    assert torch.equal(h, reference.rms_norm(x, w, 1e-6)) and res is x
    check_compiled(reference.fused_add_rms_norm)
    # plain (unprepared) weights keep torch's product: only the compiled small ops differ in path
    wl = (torch.randn(48, 96, generator=g) / 8).to(dtype)
    y, res = cpu_compiled.add_rms_norm_linear(x, r, w, 1e-6, wl)
    y0, res0 = reference.add_rms_norm_linear(x, r, w, 1e-6, wl)
    assert torch.equal(y, y0) and torch.equal(res, res0)
    gu = (torch.randn(1, 192, generator=g) * 2).to(dtype)
    assert torch.equal(cpu_compiled.silu_mul_linear(gu, wl), reference.silu_mul_linear(gu, wl))
    check_compiled(reference.silu_and_mul)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_prepare_gives_the_eager_bits(qk_norm):
    g = torch.Generator().manual_seed(1)
    nq, nkv, d, dtype = 6, 2, 32, torch.bfloat16
    qkv = torch.randn(1, nq + 2 * nkv, d, generator=g).to(dtype)
    norms = (1 + torch.randn(2, d, generator=g) / 4).to(dtype) if qk_norm else (None, None)
    cos_sin = torch.randn(64, d, generator=g)  # any table: the ops must agree on it
    rope = reference.rope_cos_sin(cos_sin, torch.tensor([37]), dtype)
    caches = [torch.zeros(4, 16, nkv, d, dtype=dtype) for _ in range(4)]
    slots = torch.tensor([21])
    got = cpu_compiled.qkv_prepare(qkv, nq, norms[0], norms[1], 1e-6, rope, caches[0], caches[1], slots)
    want = reference.qkv_prepare(qkv, nq, norms[0], norms[1], 1e-6, rope, caches[2], caches[3], slots)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].view(-1, nkv, d)[21].abs().sum() > 0  # K landed in its slot
    check_compiled(cpu_compiled._norm_rope)


def test_small_ops_of_many_tokens_run_one_kernel_for_every_count(monkeypatch):
    """Steps of many tokens (prefill chunks, decode batches) take the small-op groups compiled too:
    one kernel per group for every token count from 2 up (beside the one-token kernels), giving
    the eager ops' bits at these sizes, and found again by the exact layouts without a compile."""
    monkeypatch.setattr(cpu_inductor, "compiled", {})
    g = torch.Generator().manual_seed(2)
    nq, nkv, d, dtype = 6, 2, 32, torch.bfloat16
    w = (1 + torch.randn(96, generator=g) / 4).to(dtype)
    norms = (1 + torch.randn(2, d, generator=g) / 4).to(dtype)
    cos_sin = torch.randn(512, d, generator=g)
    for t in (1, 2, 7, 37, 7):
        x, r = (torch.randn(t, 96, generator=g) * 3).to(dtype), torch.randn(t, 96, generator=g).to(dtype)
        for a, b in zip(cpu_compiled.fused_add_rms_norm(x, r, w, 1e-6), reference.fused_add_rms_norm(x, r, w, 1e-6)):
            assert torch.equal(a, b)
        gu = (torch.randn(t, 192, generator=g) * 2).to(dtype)
        wl = (torch.randn(48, 96, generator=g) / 8).to(dtype)
        assert torch.equal(cpu_compiled.silu_mul_linear(gu, wl), reference.silu_mul_linear(gu, wl))
        qkv = torch.randn(t, nq + 2 * nkv, d, generator=g).to(dtype)
        rope = reference.rope_cos_sin(cos_sin, torch.randint(0, 512, (t,), generator=g), dtype)
        caches = [torch.zeros(8, 16, nkv, d, dtype=dtype) for _ in range(4)]
        slots = torch.randperm(128, generator=g)[:t]
        got = cpu_compiled.qkv_prepare(qkv, nq, *norms, 1e-6, rope, caches[0], caches[1], slots)
        want = reference.qkv_prepare(qkv, nq, *norms, 1e-6, rope, caches[2], caches[3], slots)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    if COMPILES:
        for fn in (reference.fused_add_rms_norm, reference.silu_and_mul, cpu_compiled._norm_rope):
            assert compiled_keys(fn) == 2, fn  # one token; every other count
        layouts = len(cpu_inductor.compiled)
        x, r = torch.randn(7, 96, generator=g).to(dtype), torch.randn(7, 96, generator=g).to(dtype)
        cpu_compiled.fused_add_rms_norm(x, r, w, 1e-6)  # a count seen before: its entry found
        assert len(cpu_inductor.compiled) == layouts
    else:
        assert cpu_inductor.failed


def test_exact_layout_entries_are_bounded(monkeypatch):
    """The entries that find symbolic-size kernels by their arguments' exact layouts are dropped
    past _EXACT_MAX (the kernels stay)."""
    monkeypatch.setattr(cpu_inductor, "compiled", {})
    monkeypatch.setattr(cpu_inductor, "_EXACT_MAX", 3)
    monkeypatch.setattr(cpu_inductor, "_exact_added", 0)
    w = torch.ones(16, dtype=torch.bfloat16)
    for t in range(2, 9):
        x = torch.randn(t, 16).to(torch.bfloat16)
        cpu_compiled.fused_add_rms_norm(x, x, w, 1e-6)
    exact = [k for k in cpu_inductor.compiled if k[0] is cpu_inductor._EXACT]
    if COMPILES:
        assert 1 <= len(exact) <= 3 and len(cpu_inductor.kernels()) == 1
        assert exact[-1][3][0] == (8, 16)  # the latest layout is kept (x, after _EXACT, fn and eps)
    else:
        assert not exact and cpu_inductor.failed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, tile", [(80, 16), (96, 32)])  # the widest tile that divides the outputs
def test_one_token_product_over_rows16(dtype, n, tile):
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(n, 96, generator=g) / 8).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    packed = cpu_compiled.pack_linear_weight(w)
    assert torch.equal(packed.half, w)
    # rows16[i, k, j] is W[tile i + j, k]
    assert torch.equal(packed.rows16, w.view(n // tile, tile, 96).transpose(1, 2))
    for bias in (None, b):
        x = torch.randn(1, 96, generator=g).to(dtype)
        got = cpu_compiled.linear(x, packed, bias)
        want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        assert got.dtype == dtype and got.shape == (1, n)
        # float32 sums in another order, rounded once: within one unit of the last place
        ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
        assert ((got.float() - want).abs() <= want.abs() * ulp + 1e-6).all()
    check_compiled(cpu_compiled._gemv)
    x = torch.randn(5, 96, generator=g).to(dtype)  # more rows: the reference path, same bits
    assert torch.equal(cpu_compiled.linear(x, packed, b), reference.linear(x, packed, b))


def test_rows16_only_for_whole_tiles_and_half_weights():
    assert cpu_compiled.pack_linear_weight(torch.randn(8, 4).bfloat16()).rows16 is None  # 8 outputs: no tile
    w = torch.randn(32, 8)
    assert cpu_compiled.pack_linear_weight(w) is w  # float32 weights: untouched


def test_a_failed_compile_falls_back_to_the_eager_ops(monkeypatch, caplog):
    import torch._inductor.compile_fx as cfx

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(cfx, "compile_fx", broken)
    monkeypatch.setattr(cpu_inductor, "rounds_as_eager", lambda: True)  # (a compile that fails, whatever the torch)
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(1, 40, generator=g).bfloat16(), torch.randn(1, 40, generator=g).bfloat16()
    w = torch.randn(40, generator=g).bfloat16()
    with caplog.at_level(logging.WARNING, logger="arcserve"):
        h, res = cpu_compiled.fused_add_rms_norm(x, r, w, 0.123)  # an eps no test compiled before
    h0, res0 = reference.fused_add_rms_norm(x, r, w, 0.123)
    assert torch.equal(h, h0) and torch.equal(res, res0)
    assert "no C++ compiler here" in caplog.text and cpu_inductor.failed
    # from then on, no more attempts: the eager ops run directly
    monkeypatch.setattr(cfx, "compile_fx", lambda *a, **k: pytest.fail("compiled again after a failure"))
    h, res = cpu_compiled.fused_add_rms_norm(x, r, w, 0.456)
    assert torch.equal(h, reference.fused_add_rms_norm(x, r, w, 0.456)[0])


def test_an_inductor_that_rounds_otherwise_falls_back_to_the_eager_ops(monkeypatch, caplog):
    """Where inductor would not give the eager ops' bits (rounds_as_eager false, as under torch
    2.11), nothing is compiled: the first kernel asked for records why, warns, and the eager ops run."""
    monkeypatch.setattr(cpu_inductor, "rounds_as_eager", lambda: False)
    monkeypatch.setattr(cpu_inductor, "compiled", {})
    g = torch.Generator().manual_seed(5)
    gu, wl = torch.randn(1, 64, generator=g).bfloat16(), torch.randn(24, 32, generator=g).bfloat16()
    with caplog.at_level(logging.WARNING, logger="arcserve"):
        assert torch.equal(cpu_compiled.silu_mul_linear(gu, wl), reference.silu_mul_linear(gu, wl))
    assert "rounds as eager" in caplog.text and "rounds half-precision values" in cpu_inductor.failed[0]
    assert not cpu_inductor.kernels() and cpu_inductor.kernel(reference.silu_and_mul, (gu,)) is None


def test_enforce_eager_keeps_the_eager_ops():
    ops = get_ops("torch", torch.device("cpu"), compiled=False)
    assert ops.linear is reference.linear and ops.qkv_prepare is reference.qkv_prepare
    assert ops.paged_attention is cpu_attention.paged_attention  # SDPA over the mirror
    ops = get_ops("torch", torch.device("cpu"))
    assert ops.linear is cpu_compiled.linear and ops.add_rms_norm_linear is cpu_compiled.add_rms_norm_linear
    assert ops.paged_attention.keywords == {"one_row": cpu_compiled.decode_attention,
                                            "rows": cpu_rows_attention.decode_attention}  # fmt: skip
    # a step decoding one sequence: whole layers (cpu_layer), planned by the same one-row attention
    assert ops.decoder_layer.func is cpu_layer.decoder_layer
    assert ops.decoder_layer.keywords == {"one_row": cpu_compiled.decode_attention}
    assert get_ops("torch", torch.device("cpu"), compiled=False).decoder_layer.func is blocks.decoder_layer


@pytest.mark.parametrize("native", [False, "products", "tiles"] if NATIVE_BF16 else [False])
def test_engine_decodes_the_same_tokens_compiled_and_eager(llama_dir, monkeypatch, native):
    """A bf16 model decoding one request: the compiled one-token path gives the eager path's tokens.
    native: as on a CPU with native bf16 products (where this CPU has them), without matrix tiles
    ("products": AVX-512-BF16 without AMX, e.g. AMD Zen 4) or with them ("tiles": AMX, which takes
    the same compiled tier): oneDNN's packed bf16 weights serve every other row count, beside the
    rows16 copies, and the decode mirror keeps bf16; else the float32 copies and float32 mirror of
    an AVX2-only CPU."""
    monkeypatch.setattr(cpu_inductor, "compiled", {})  # (not the kernels earlier tests compiled)
    if native:
        monkeypatch.setattr(reference, "native_half_matmul", lambda dtype: True)
        monkeypatch.setattr(reference, "cpu_matrix_tiles", lambda dtype: native == "tiles")
    prompt = {"prompt_token_ids": [5, 17, 33, 101, 7, 64, 250, 12, 3]}
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = LLM(str(llama_dir), dtype="bfloat16", max_model_len=128, enforce_eager=True)
    want = eager.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert not cpu_inductor.compiled  # (enforce_eager: nothing compiled)
    fast = LLM(str(llama_dir), dtype="bfloat16", max_model_len=128)
    gate_up = fast.llm_engine.model.layers[0].gate_up
    assert isinstance(gate_up, reference.EmulatedHalfWeight) and gate_up.rows16 is not None
    assert (gate_up.half is None) == bool(native) and gate_up.batched.dtype == (torch.bfloat16 if native else torch.float32)
    mirror = fast.llm_engine.runner.decode_mirror
    assert mirror.dtype == (torch.bfloat16 if native else torch.float32) and mirror.min_context == 0
    assert mirror.gqa_form == (native == "tiles")  # (SDPA's form where the kernels leave it a batch)
    whole = []  # layers the request's steps ran as one compiled call (not the startup warm-up's)
    run = cpu_layer._run
    monkeypatch.setattr(cpu_layer, "_run", lambda *args: whole.append(run(*args)) or whole[-1])
    got = fast.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    if COMPILES:  # the one-token steps took the compiled layers (tests/kernels/test_cpu_layer.py) and LM head
        assert compiled_keys(cpu_compiled._gemv) and not cpu_inductor.failed
        layers = len(fast.llm_engine.model.layers)
        assert sum(w is not None for w in whole) == (len(want) - 1) * layers  # every decode step's every layer


def _layer(g, dtype, hidden, inter, nq, nkv, d, bias: bool, qk_norm: bool):
    from arcserve.models.decoder import LayerWeights

    def w(n, k):
        return cpu_compiled.pack_linear_weight((torch.randn(n, k, generator=g) / 8).to(dtype))

    def vec(n):
        return (1 + torch.randn(n, generator=g) / 4).to(dtype)

    qkv_n = (nq + 2 * nkv) * d
    return LayerWeights(
        input_norm=vec(hidden), qkv=w(qkv_n, hidden), qkv_bias=vec(qkv_n) if bias else None,
        o=w(hidden, nq * d), o_bias=vec(hidden) if bias else None,
        q_norm=vec(d) if qk_norm else None, k_norm=vec(d) if qk_norm else None, post_norm=vec(hidden),
        gate_up=w(2 * inter, hidden), gate_up_bias=vec(2 * inter) if bias else None,
        down=w(hidden, inter), down_bias=vec(hidden) if bias else None,
    )  # fmt: skip


@pytest.mark.parametrize("bias,qk_norm,first", [(False, False, False), (True, False, True), (False, True, False)])
def test_layer_halves_in_one_call_give_the_per_op_bits(bias, qk_norm, first):
    """pre_attention / post_attention for one token as one compiled call each: the same bits as the
    one-token ops called one by one (which test_one_token_product_over_rows16 and the tests above
    tie to the eager ops), the K/V store included."""
    g = torch.Generator().manual_seed(4)
    eps = 3e-6  # a value no other test compiles with: this test's calls compile their own kernels
    dtype, hidden, inter, nq, nkv, d = torch.bfloat16, 64, 96, 4, 2, 16
    lw = _layer(g, dtype, hidden, inter, nq, nkv, d, bias, qk_norm)
    ops = get_ops("torch", torch.device("cpu"))
    x = (torch.randn(1, hidden, generator=g) * 2).to(dtype)
    residual = None if first else torch.randn(1, hidden, generator=g).to(dtype)
    rope = reference.rope_cos_sin(torch.randn(64, d, generator=g), torch.tensor([29]), dtype)
    caches = [torch.zeros(3, 8, nkv, d, dtype=dtype) for _ in range(4)]
    slots = torch.tensor([13])
    before = compiled_keys(cpu_compiled._pre)
    got = ops.pre_attention(x, residual, lw, eps, rope, nq, nkv, d, caches[0], caches[1], slots)
    want = blocks.pre_attention(ops, x, residual, lw, eps, rope, nq, nkv, d, caches[2], caches[3], slots)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(a, b)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[1].view(-1, nkv, d)[13].abs().sum() > 0  # V landed in its slot
    attn = got[0].reshape(1, nq * d)
    out = ops.post_attention(attn, got[3], lw, eps)
    ref = blocks.post_attention(ops, attn, got[3], lw, eps)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    # and close to the eager ops (the products sum in another order)
    eager = get_ops("torch", torch.device("cpu"), compiled=False)
    e = eager.post_attention(attn, got[3], lw, eps)
    assert torch.equal(out[1], e[1]) and torch.allclose(out[0].float(), e[0].float(), rtol=0.05, atol=0.05)
    if COMPILES:
        assert compiled_keys(cpu_compiled._pre) > before and compiled_keys(cpu_compiled._post) > 0
    # more tokens: the ops one by one, which are the eager ops there
    a5, r5 = torch.randn(5, nq * d, generator=g).to(dtype), torch.randn(5, hidden, generator=g).to(dtype)
    got5, want5 = ops.post_attention(a5, r5, lw, eps), eager.post_attention(a5, r5, lw, eps)
    assert got5[0].shape == (5, hidden) and torch.equal(got5[0], want5[0]) and torch.equal(got5[1], want5[1])


def _mirror_rows(kvh, d, cap, length, g):
    """K, V [1, kvh, cap, d] float32 holding bf16 values up to `length`, zeros after (as the mirror)."""
    K, V = torch.zeros(1, kvh, cap, d), torch.zeros(1, kvh, cap, d)
    K[:, :, :length] = (torch.randn(1, kvh, length, d, generator=g) * 2).bfloat16().float()
    V[:, :, :length] = torch.randn(1, kvh, length, d, generator=g).bfloat16().float()
    return K, V


@pytest.mark.parametrize("dtype,heads,kvh", [(torch.bfloat16, 6, 2), (torch.float16, 4, 4)])
def test_one_token_attention_matches_sdpa(dtype, heads, kvh):
    """decode_attention at any context length and any layout of the mirror's buffers, from a kernel
    per kind of layout: SDPA's result within the output dtype's rounding, for lengths at and around multiples
    of its span step and up to a capacity that is not one; None (the caller's SDPA) where it does
    not apply."""
    g = torch.Generator().manual_seed(5)
    d = 16
    tol = dict(rtol=8e-3, atol=8e-3) if dtype == torch.bfloat16 else dict(rtol=1e-3, atol=1e-3)
    before = compiled_keys(cpu_compiled._attend)
    # the mirror's layouts: [layers, rows, kv heads, capacity, hd] views of the start of each layer's
    # arena, which the first fills (contiguous) and the others do not; one of a single row
    n = 6 * kvh * 1152 * d
    layouts = [(6, 1152), (2, 1100), (5, 1152), (3, 1100), (1, 1100)]
    for i, length in enumerate((1, 15, 16, 17, 37, 127, 128, 129, 300, 513, 1024, 1090, 1099, 1100)):
        rows, cap = layouts[i % len(layouts)]
        K, V = _mirror_rows(kvh, d, cap, length, g)
        q = (torch.randn(1, heads, d, generator=g) * 2).to(dtype)
        # the row as layer 2 of 3 (other layers, other rows: noise)
        Ks, Vs = (torch.randn(3, n, generator=g)[:, : rows * kvh * cap * d].view(3, rows, kvh, cap, d) for _ in "kv")
        Ks[2, 0], Vs[2, 0] = K[0], V[0]
        run = cpu_compiled.decode_attention(Ks, Vs, length, dtype, 0.3)  # the step's kernel
        got = run(q, torch.tensor([2]))
        want = F.scaled_dot_product_attention(
            q.float().view(1, kvh, heads // kvh, d), K[:, :, :length], V[:, :, :length], scale=0.3
        ).view(1, heads, d)  # fmt: skip
        if not COMPILES:
            assert got is None and cpu_inductor.failed
            return
        assert got.shape == (1, heads, d) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, **tol)
    check_compiled(cpu_compiled._attend)
    # span, rows and capacity symbolic: one kernel for the contiguous layout, one for the views, one
    # for the single row
    assert compiled_keys(cpu_compiled._attend) == before + 3
    K, V = _mirror_rows(kvh, d, cap, 9, g)
    assert cpu_compiled.decode_attention(K[None], V[None], 9, torch.float32, 0.3) is None  # float32 queries


@pytest.mark.parametrize("cache", [None, torch.float8_e4m3fn])
def test_mirror_single_decoder_through_the_compiled_attention(cache):
    """One sequence decoding past the first bucket through cpu_attention with the compiled one-row
    kernel (some steps beside another sequence's prefill chunk): every step within bf16 rounding of
    the reference, and the mirror holds exactly what the SDPA path's mirror holds."""
    from test_cpu_attention import BS, make_meta

    g = torch.Generator().manual_seed(6)
    kvh, heads, d, layers, nb, dtype = 2, 6, 8, 2, 120, torch.bfloat16
    kc = [torch.randn(nb, BS, kvh, d, generator=g).to(cache or dtype) for _ in range(layers)]
    vc = [torch.randn(nb, BS, kvh, d, generator=g).to(cache or dtype) for _ in range(layers)]
    mirrors = [cpu_attention.DecodeMirror(layers, kvh, d, dtype, torch.device("cpu"), 1 << 24) for _ in range(2)]
    tables = {0: list(range(0, 60)), 1: list(range(60, 120))}
    done = {0: 0, 1: 0}
    planned, ran = [], []  # the length of each step that asked for the kernel; each layer's outcome

    def one_row(K, V, length, q_dtype, scale):
        planned.append(length)
        run = cpu_compiled.decode_attention(K, V, length, q_dtype, scale)
        if run is None:
            return None

        def counted(q, layer):
            out = run(q, layer)
            ran.append(out is not None)
            return out

        return counted

    for step in range(150):
        batch = [(0, done[0], 5 if step == 0 else 1)]
        if step % 40 == 20:  # the other sequence's prefill chunk in the same step
            batch.append((1, done[1], 3))
        metas = [make_meta(batch, tables, m) for m in (*mirrors, None)]
        slots = metas[0].slot_mapping
        qsl = metas[0].host["query_start_loc"]
        T = int(qsl[-1])
        for layer in range(layers):
            q, k, v = (torch.randn(T, n, d, generator=g).to(dtype) for n in (heads, kvh, kvh))
            reference.store_kv(k, v, kc[layer], vc[layer], slots)
            fast = cpu_attention.paged_attention(q, k, v, kc[layer], vc[layer], metas[0], 0.3, None, layer, one_row)
            sdpa = cpu_attention.paged_attention(q, k, v, kc[layer], vc[layer], metas[1], 0.3, None, layer)
            k, v = reference.kv_round_trip(k, kc[layer].dtype), reference.kv_round_trip(v, vc[layer].dtype)
            ref = reference.paged_attention(*[t.float() for t in (q, k, v, kc[layer], vc[layer])], metas[2], 0.3)
            torch.testing.assert_close(fast.float(), ref, rtol=8e-3, atol=8e-3)
            torch.testing.assert_close(fast.float(), sdpa.float(), rtol=8e-3, atol=8e-3)
        for sid, s, n in batch:
            done[sid] = s + n
    assert done[0] == 154 and np.array_equal(mirrors[0].lens, mirrors[1].lens)
    n = int(mirrors[0].lens[0])
    assert torch.equal(mirrors[0].k[:, :1, :, :n], mirrors[1].k[:, :1, :, :n])
    assert torch.equal(mirrors[0].v[:, :1, :, :n], mirrors[1].v[:, :1, :, :n])
    # every one-row step (all but the prefill) asked for the kernel once; it ran on every layer
    # where it compiled (without a compiler: the first step's layers failed, later steps asked in vain)
    assert planned == list(range(6, 155))
    if COMPILES:
        assert ran == [True] * (len(planned) * layers)
    else:
        assert ran == [False] * layers and cpu_inductor.failed


def test_compiled_kernels_skip_inductors_wrapper_where_it_gives_the_same():
    """_direct calls the compiled module's own entry point when, on the example inputs, it gives
    what inductor's wrapper gives (tensors, views of inputs, one output unpacked as the wrapper
    unpacks it); the wrapper otherwise."""
    x = torch.randn(1, 24).bfloat16()
    if not COMPILES:  # no compiled kernels at all: the callers run the eager ops
        assert cpu_inductor.run(lambda t: t + 1, (x,)) is None and cpu_inductor.failed
        return

    def fresh(t):
        return t * 2, (t + 1).float()

    def aliasing(t):
        return t.view(4, 6), t * 3

    for fn in (fresh, aliasing):
        got = cpu_inductor.run(fn, (x,))
        assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(got, fn(x)))
        assert getattr(cpu_inductor.compiled[(fn, x.dtype, x.shape)], "current_callable", None) is None
    one = cpu_inductor.run(lambda t: t - 1, (x,))
    assert isinstance(one, torch.Tensor) and torch.equal(one, x - 1)

    def wrapper(t):
        return t + 1

    assert cpu_inductor._direct(wrapper, (x,)) is wrapper  # no entry point to call
    wrapper.current_callable = lambda args: [args[0] + 2]  # an entry point that disagrees
    assert cpu_inductor._direct(wrapper, (x,)) is wrapper
    wrapper.current_callable = lambda args: [args.pop(0) + 1]  # agrees (and clears its list, as inductor's)
    direct = cpu_inductor._direct(wrapper, (x,))
    assert direct is not wrapper and torch.equal(direct(x), x + 1)
