"""CPU linear layers: half-precision weights are prepared once for the CPU's fastest product —
oneDNN's blocked layout where the CPU multiplies bf16/fp16 natively; else (AVX2-only CPUs emulate
half products several times slower) the half tensor for one-row products and a float32 copy for
more rows, whose products are rounded to the activations' dtype. Either way the layer computes
x @ W.T + b of the checkpoint's weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from arcserve.kernels import reference

# The float32 branch runs everywhere; the oneDNN branch where this CPU has the native product.
CASES = [(dtype, native) for dtype in (torch.bfloat16, torch.float16)
         for native in (False, True) if not native or reference.native_half_matmul(dtype)]  # fmt: skip


@pytest.mark.parametrize("dtype,native", CASES)
def test_prepared_half_weights_compute_the_same_product(monkeypatch, native, dtype):
    monkeypatch.setattr(reference, "native_half_matmul", lambda _dtype: native)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=g) / 8).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    packed = reference.pack_linear_weight(w)
    if native:
        assert packed.is_mkldnn
    else:
        assert isinstance(packed, reference.EmulatedHalfWeight)
        assert torch.equal(packed.half, w)  # one-row products: the checkpoint's tensor (shape and values)
        batched = packed.batched.to_dense() if packed.batched.is_mkldnn else packed.batched
        assert torch.equal(batched, w.float())  # more rows: its exact float32 copy
    for rows in (1, 7, 64):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        got = reference.linear(x, packed, b)
        assert got.dtype == dtype and got.shape == (rows, 96)
        want = F.linear(x.float(), w.float(), b.float())  # the exact product, rounded once below
        assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2)
        if not native and rows > 1:  # float32 arithmetic, one rounding: exactly the rounded product
            assert torch.equal(got, want.to(dtype))


def test_float32_weights_are_left_alone():
    w = torch.randn(8, 4)
    assert reference.pack_linear_weight(w) is w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_host_memory_keeps_the_half_weights_alone(monkeypatch, dtype):
    """Without native half products and without room for a float32 copy (FLOAT_COPY_RESERVE of the
    host's memory must stay available), a layer keeps its half weights and multiplies every row
    count with them: the same product, rounded once."""
    monkeypatch.setattr(reference, "native_half_matmul", lambda _dtype: False)
    monkeypatch.setattr(reference, "host_memory", lambda: (10 << 20, 100 << 20))  # 10% available
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(40, 32, generator=g) / 8).to(dtype)
    packed = reference.pack_linear_weight(w)
    assert isinstance(packed, reference.EmulatedHalfWeight) and packed.batched is None
    assert torch.equal(packed.half, w)
    for rows in (1, 5):
        x = torch.randn(rows, 32, generator=g).to(dtype)
        got = reference.linear(x, packed)
        assert got.dtype == dtype
        assert torch.allclose(got.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(reference, "host_memory", lambda: (90 << 20, 100 << 20))  # room again
    assert reference.pack_linear_weight(w).batched is not None
