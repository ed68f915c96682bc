"""Graphs compiled by PyTorch's inductor for the CPU, and found again by their arguments: the
machinery under the compiled CPU kernels (cpu_compiled.py, cpu_rows_attention.py, cpu_layer.py).

`run(fn, args, dynamic, **static)` runs fn(*args, **static) through its kernel, compiled at the
first call for those shapes, dtypes and static values; `kernel(...)` gives the kernel itself (for
callers that look it up once a step). `dynamic` names the argument dimensions the kernel takes at
any size from 2 up (one kernel for every token count, mirror layout or context length).

Graphs are traced with make_fx and compiled by inductor's compile_fx directly: torch.compile's frame
guards cost ~100 us per call here, more than these kernels (and compile_fx's own wrappers ~12 us,
see _direct). Each shape compiles once per process, and the engine compiles the decode kernels at
startup (ModelRunner.warm_up: one one-token step, whose kernels serve every context length and
mirror layout, except a mirror of one row, whose kernels a later layout of more rows does not
share, then a two-row step; on a 2-vCPU AVX2 EPYC, SmolLM2-135M, ~25-28 s with an empty inductor
cache, ~7 s with it warm, most of that importing inductor). If compiling fails (no C++ compiler, an
inductor change), or this torch's inductor does not round as eager PyTorch does (rounds_as_eager:
torch 2.11), `failed` holds the error and every compiled path turns itself off with a warning:
the eager ops run. `enforce_eager=True` (`--enforce-eager`) keeps the eager ops from the
start.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from arcserve.kernels import reference

log = logging.getLogger("arcserve")

compiled: dict = {}  # (name, dtype, shapes, static values) -> compiled callable
failed: list[str] = []  # the first compile error; non-empty turns the compiled path off
# compiled also finds the symbolic-size kernels by their arguments' exact layouts, under keys that
# start with _EXACT: (_EXACT, fn, static values, each argument's (shape, strides, dtype)); at most
# _EXACT_MAX of them (row counts and mirror layouts vary over a run: past that many, they are dropped)
_EXACT = "exact layouts"
_EXACT_MAX = 8192
_exact_added = 0


def serves(dtype: torch.dtype) -> bool:
    """Whether ops in `dtype` take the compiled kernels: a half dtype (reference.compiled_half) and
    no compile has failed (asked by every compiled op: two lookups, no cache needed)."""
    return not failed and reference.compiled_half(dtype)


def run(fn: Callable, args: tuple, dynamic: dict[int, tuple[int, ...]] | None = None, **static):
    """fn(*args, **static) through its compiled kernel (kernel); None when compiling fails (the
    caller runs the eager ops)."""
    got = kernel(fn, args, dynamic, **static)
    return None if got is None else got(*args)


def kernel(fn: Callable, args: tuple, dynamic: dict[int, tuple[int, ...]] | None = None, **static) -> Callable | None:
    """The compiled kernel of fn(*args, **static), compiled on first use for these shapes,
    dtype and static values; None when compiling fails. dynamic: {argument index: its dimensions
    that the kernel takes at any size from 2 up} (see _shape_key). The key leaves strides out (a
    few us per call on the per-token path): every call site passes the same layout for the same
    shapes (contiguous tensors, rope_cos_sin's views), and the compiled code asserts it."""
    if dynamic:
        # first by the exact layouts (~2 us for five arguments, against ~8 us for the symbolic key:
        # the multi-row small ops look their kernels up at every call)
        exact = (_EXACT, fn, *static.values(), *[(a.shape, a.stride(), a.dtype) for a in args])
        got = compiled.get(exact)
        if got is not None:
            return got
        key = (fn, args[0].dtype, *static.values(), *(_shape_key(a, dynamic.get(i, ())) for i, a in enumerate(args)))
    else:  # (the per-op kernels' lookup, every call: plain shapes, ~4 us against ~15 us for ten arguments)
        key = (fn, args[0].dtype, *static.values(), *[a.shape for a in args])
    got = compiled.get(key)
    if got is None:
        if failed:
            return None
        try:
            if not rounds_as_eager():
                raise RuntimeError(f"torch {torch.__version__}'s inductor rounds half-precision values between ops "
                                   "in one go where eager PyTorch rounds after each op (torch 2.13 rounds as eager)")  # fmt: skip
            got = compiled[key] = _direct(_compile(functools.partial(fn, **static), args, dynamic or {}), args)
        except Exception as e:  # noqa: BLE001 (any compiler failure: fall back to the eager ops)
            failed.append(f"{type(e).__name__}: {e}")
            log.warning("compiling a CPU decode kernel failed (%s); running the eager ops instead", failed[0][:300])
            return None
    if dynamic:
        _remember_exact(exact, got)
    return got


@functools.cache
def rounds_as_eager() -> bool:
    """Whether this torch's inductor, with emulate_precision_casts, rounds a bf16 SiLU-mul's
    intermediate as eager PyTorch does: the compiled kernels' contract is the eager ops' bits. Not
    so under torch 2.11 (its CPU code keeps silu(x) in float32 until the product, then rounds once:
    ~27% of the values of random inputs one bf16 ulp apart); torch 2.13 rounds as eager. A compile
    error propagates (the caller's fallback handles it)."""
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    got = _compile(reference.silu_and_mul, (x,), {})(x)
    return torch.equal(got[0] if isinstance(got, (list, tuple)) else got, reference.silu_and_mul(x))


def kernels() -> set:
    """The keys of the kernels compiled so far (not the entries that find them by exact layouts)."""
    return {k for k in compiled if k[0] is not _EXACT}


def _remember_exact(exact: tuple, got: Callable) -> None:
    global _exact_added
    if _exact_added >= _EXACT_MAX:
        for k in [k for k in compiled if k[0] is _EXACT]:
            del compiled[k]
        _exact_added = 0
    compiled[exact] = got
    _exact_added += 1


def _shape_key(a: torch.Tensor, dims: tuple[int, ...]) -> tuple:
    """a's part of a kernel's key: its shape, the symbolic dimensions `dims` left out where their size
    is above 1 (tracing specializes a size of 1: such a kernel is keyed apart); with symbolic
    dimensions, a's dtype (the key holds only the first argument's otherwise) and whether a is
    contiguous too: traced contiguous, a tensor's outer stride is the
    product of its sizes, traced as a view of a larger buffer (the decode mirror's layouts in its
    arena) a symbol of its own, and the two kernels serve different tensors."""
    if not dims:
        return a.shape
    return tuple(None if n > 1 and d in dims else n for d, n in enumerate(a.shape)), a.is_contiguous(), a.dtype


def _compile(fn: Callable, args: tuple, dynamic: dict[int, tuple[int, ...]]) -> Callable:
    """fn traced (make_fx) over fake copies of args, the dimensions `dynamic` names symbolic, and
    compiled by inductor. The tracing context's shape environment lets inductor's graph cache
    (on disk, across processes) take the graphs: without one it bypassed them and every process
    generated each kernel's code anew (~2.5 s a whole-layer graph on a 2-vCPU AVX2 EPYC)."""
    import torch._inductor.inductor_prims  # noqa: F401 (registers prims.inductor_force_stride_order)
    from torch._guards import TracingContext, tracing
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())

    def fake(i: int, a: torch.Tensor) -> torch.Tensor:
        dims = dynamic.get(i, ())
        sizes = [DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(a.dim())]
        return fake_mode.from_tensor(a, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))

    fakes = [fake(i, a) for i, a in enumerate(args)]
    with fake_mode:
        gm = make_fx(fn)(*fakes)
    with inductor_config.patch(emulate_precision_casts=True), tracing(TracingContext(fake_mode)):
        return compile_fx(gm, fakes)


def _direct(wrapped: Callable, args: tuple) -> Callable:
    """The compiled module's own entry point, without the wrappers compile_fx puts around it (they
    handle autograd, input mutation and outputs aliasing inputs, none of which these graphs have;
    measured on a 2-vCPU AVX2 EPYC: ~12 us a call of the ~15 us a trivial graph takes). Used only
    when it returns what the wrapper returns for the example inputs; the wrapper otherwise."""
    inner = getattr(wrapped, "current_callable", None)
    if inner is None:
        return wrapped
    want = wrapped(*args)
    one = not isinstance(want, (list, tuple))  # a graph of one output: the wrapper unpacks it
    try:
        got = inner(list(args))  # the module's call takes a list, and clears it
    except Exception:  # noqa: BLE001 (an inductor whose entry point differs: keep its wrapper)
        return wrapped
    want = (want,) if one else want
    same = isinstance(got, (list, tuple)) and len(got) == len(want)
    if not (same and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))):
        return wrapped
    return (lambda *a: inner(list(a))[0]) if one else (lambda *a: inner(list(a)))
