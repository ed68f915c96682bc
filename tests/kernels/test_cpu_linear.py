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
        assert isinstance(packed, reference.EmulatedHalfWeight) and packed.shape == w.shape
        assert torch.equal(packed.half, w)  # one-row products: the checkpoint's tensor
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
