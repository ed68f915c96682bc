"""One-token (batch-1 decode) CPU kernels compiled by PyTorch's inductor, for bf16/fp16 models on
CPUs without native half-precision products (AVX2-only; see reference.EmulatedHalfWeight).

There, a one-token decode step is ~120 matrix-vector products plus ~1,000 small ops, and torch
runs both through generic paths (measured on a 2-vCPU AVX2 AMD EPYC, docs/BENCHMARKS.md):
- torch's bf16 matrix-vector product reads weights at ~12 GB/s; the same product compiled over the
  weights in a [N/16, K, 16] layout (`rows16`: 16 outputs side by side per input feature, summed
  down the K axis in float32 vectors, no horizontal sums) takes ~10-15% less;
- the small ops between products (residual add + RMSNorm, SiLU-mul, q/k norm + RoPE) cost 3-5x
  their arithmetic each (after a product has streamed megabytes through the caches); one compiled
  kernel per group replaces ~5-10 eager ops.

Rounding: the small-op groups are compiled with inductor's `emulate_precision_casts`, so they round
where eager PyTorch rounds (the same bits as reference.py's ops); products accumulate in float32 and
round once to the activations' dtype, as torch's do (the summation order differs).

Graphs are traced with make_fx and compiled by inductor's compile_fx directly: torch.compile's frame
guards cost ~100 us per call here, more than these kernels. Each shape compiles once per process
(~1-2 s the first time on a machine; inductor caches the result on disk). If compiling fails (no C++
compiler, an inductor change), the compiled path turns itself off with a warning and the eager ops
run. `enforce_eager=True` (`--enforce-eager`) keeps the eager ops from the start.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from arcserve.kernels import reference
from arcserve.kernels.reference import EmulatedHalfWeight

log = logging.getLogger("arcserve")

TILE = 16  # outputs side by side in the rows16 layout: two float32 AVX2 vectors
_compiled: dict = {}  # key -> compiled callable
_failed: list[str] = []  # the first compile error; non-empty turns the compiled path off


@functools.cache
def _emulated(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16) and not reference.native_half_matmul(dtype)


def _one_token(x: torch.Tensor) -> bool:
    return x.shape[0] == 1 and not _failed and _emulated(x.dtype)


def _compile(name: str, fn: Callable, args: tuple, static: tuple = ()) -> Callable | None:
    """fn over the tensors `args` (fixed shapes, strides, dtypes; `static` = the other values fn
    closes over), compiled once; None once compiling has failed."""
    key = (name, static, *((a.shape, a.stride(), a.dtype) for a in args))
    got = _compiled.get(key)
    if got is None and not _failed:
        try:
            from torch._inductor import config as inductor_config
            from torch._inductor.compile_fx import compile_fx
            from torch.fx.experimental.proxy_tensor import make_fx

            if not _compiled:
                log.info("compiling the CPU decode kernels (once per shape; inductor caches them on disk)")
            with inductor_config.patch(emulate_precision_casts=True):
                got = compile_fx(make_fx(fn)(*args), list(args))
            _compiled[key] = got
        except Exception as e:  # noqa: BLE001 (any compiler failure: fall back to the eager ops)
            _failed.append(f"{type(e).__name__}: {e}")
            log.warning("compiling a CPU decode kernel failed (%s); running the eager ops instead", _failed[0][:300])
            return None
    return got


def _gemv(x: torch.Tensor, rows16: torch.Tensor, *bias: torch.Tensor) -> tuple[torch.Tensor]:
    """x [1, K] @ W.T with W as rows16 [N/16, K, 16]: float32 sums, one rounding."""
    y = (rows16.float() * x.float().view(1, -1, 1)).sum(1).reshape(1, -1)
    if bias:
        y = y + bias[0].float()
    return (y.to(x.dtype),)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | EmulatedHalfWeight:
    """reference.pack_linear_weight, plus the rows16 layout of emulated half weights for one-token
    products (while the host keeps FLOAT_COPY_RESERVE of its memory available)."""
    packed = reference.pack_linear_weight(weight)
    if not isinstance(packed, EmulatedHalfWeight) or packed.batched is None:
        return packed
    n, k = packed.half.shape
    available, total = reference.host_memory()
    if n % TILE or available - 2 * packed.half.numel() < reference.FLOAT_COPY_RESERVE * total:
        return packed
    rows16 = packed.half.view(n // TILE, TILE, k).transpose(1, 2).contiguous()
    return EmulatedHalfWeight(packed.half, packed.batched, rows16)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, EmulatedHalfWeight) and weight.rows16 is not None and x.dim() == 2 and _one_token(x):
        args = (x, weight.rows16) + (() if bias is None else (bias,))
        fn = _compile("linear", _gemv, args)
        if fn is not None:
            return fn(*args)[0]
    return reference.linear(x, weight, bias)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple:
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple:
    return (reference.rms_norm(x, weight, eps),)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if _one_token(x):
        if residual is None:
            fn = _compile("rms_norm", functools.partial(_rms_norm, eps=eps), (x, weight), (eps,))
            if fn is not None:
                return fn(x, weight)[0], x
        else:
            fn = _compile("add_rms_norm", functools.partial(_add_rms_norm, eps=eps), (x, residual, weight), (eps,))
            if fn is not None:
                h, residual = fn(x, residual, weight)
                return h, residual
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def add_rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    h, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(h, weight, bias), residual


def _silu_and_mul(x: torch.Tensor) -> tuple[torch.Tensor]:
    return (reference.silu_and_mul(x),)


def silu_mul_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if _one_token(x):
        fn = _compile("silu_and_mul", _silu_and_mul, (x,))
        if fn is not None:
            return linear(fn(x)[0], weight, bias)
    return reference.silu_mul_linear(x, weight, bias)


def qkv_prepare(qkv: torch.Tensor, num_q: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                eps: float, rope: tuple, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                neox: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """reference.qkv_prepare; for one token, q/k norm and RoPE run as one compiled kernel."""
    if _one_token(qkv):
        nkv = (qkv.shape[1] - num_q) // 2
        norms = () if q_norm is None else (q_norm, k_norm)

        def prepare(qkv, *t):
            qn, kn = t[:-4] if norms else (None, None)
            qk = qkv[:, : num_q + nkv]
            if qn is not None:
                qk = torch.cat((reference.rms_norm(qk[:, :num_q], qn, eps), reference.rms_norm(qk[:, num_q:], kn, eps)), 1)
            qk = reference.rotary_embedding(qk, tuple(t[-4:]), neox)
            return qk[:, :num_q].contiguous(), qk[:, num_q:].contiguous()

        args = (qkv, *norms, *rope)
        fn = _compile("qkv_prepare", prepare, args, (num_q, eps, neox))
        if fn is not None:
            q, k = fn(*args)
            v = qkv[:, num_q + nkv :]
            reference.store_kv(k, v, k_cache, v_cache, slots)
            return q, k, v
    return reference.qkv_prepare(qkv, num_q, q_norm, k_norm, eps, rope, k_cache, v_cache, slots, neox)
