"""One-token (batch-1 decode) CPU kernels compiled by PyTorch's inductor, for bf16/fp16 models
(reference.compiled_half): on AVX2-only CPUs, where torch emulates half products
(reference.EmulatedHalfWeight), and on CPUs with native half products, where a lone sequence
decoded faster through these kernels than through oneDNN's bf16 products and the eager ops: 2.4x
on a Zen 4 (AVX-512-BF16, docs/BENCHMARKS.md, session 36), 1.3-1.9x on an AMX Xeon (session 39).

There, a one-token decode step is ~120 matrix-vector products plus ~1,000 small ops, and torch
runs both through generic paths (measured on a 2-vCPU AVX2 AMD EPYC, docs/BENCHMARKS.md):
- torch's bf16 matrix-vector product reads weights at ~12 GB/s; the same product compiled over the
  weights in a [N/T, K, T] layout (`rows16`: T = 32 outputs side by side per input feature, or 16
  where 32 does not divide N, summed down the K axis in float32 vectors, no horizontal sums)
  takes ~10-15% less. The sums are latency-bound (each vector sum waits on its last add), so a
  32-wide tile keeps four going where 16 kept two: one-token decode ~8% faster than 16-wide. The
  product's input is stored (float32) before the loop: left to inductor, the input's producer (the
  RMSNorm before qkv and gate_up, square root and roundings included) was inlined into every
  tile's K loop, ~10% of a one-token step;
- the small ops between products (residual add + RMSNorm, SiLU-mul, q/k norm + RoPE) cost 3-5x
  their arithmetic each (after a product has streamed megabytes through the caches); compiled
  kernels replace them, and each half of a decoder layer around attention (kernels/blocks.py:
  pre_attention, post_attention) runs as one compiled call with its products. The per-group
  kernels below serve the final norm, the LM head, and layers whose weights have no rows16 copy,
  and steps of many tokens (prefill chunks, decode batches), where the groups run between oneDNN's
  products: there each group's token count is a symbolic size, one kernel for every count from 2
  up (measured on a 2-vCPU Zen 4 EPYC, SmolLM2-135M, medians of interleaved runs: 64-sequence
  decode steps 127.3 -> 117.5 ms, 2,048-token prefill steps 1,682 -> 1,570 ms; docs/BENCHMARKS.md,
  session 38). Their lookup is by the arguments' exact layouts first (cpu_inductor._EXACT: ~2 us a call
  against ~8 for the symbolic key);
- a single sequence's attention over its decode-mirror row (decode_attention) costs SDPA's
  fixed ~60-90 us a call at any short context; one compiled graph replaces it, the positions it
  reads a symbolic size, so the same kernel serves every context length.

Rounding: the small-op groups are compiled with inductor's `emulate_precision_casts`, so they round
where eager PyTorch rounds (where this torch's inductor does so: cpu_inductor.rounds_as_eager; the
same bits as reference.py's ops, at the token counts of the tests;
at thousands of tokens torch's RMSNorm sums in another order, and a few values of a 2,048-token
norm came out one bf16 ulp apart); products accumulate in float32 and
round once to the activations' dtype, as torch's do (the summation order differs); attention
sums in float32 and rounds once, as SDPA over a float32 mirror does (its order differs too).

The compiling and the lookup of the kernels: cpu_inductor.py (compiled at startup by
ModelRunner.warm_up; a failed compile turns the compiled path off and the eager ops run;
`enforce_eager=True`, `--enforce-eager`, keeps the eager ops from the start).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from arcserve.kernels import blocks, cpu_inductor, reference
from arcserve.kernels.reference import EmulatedHalfWeight

TILES = (32, 16)  # outputs side by side in the rows16 layout, widest that divides N first


def _one_token(x: torch.Tensor) -> bool:
    return x.shape[0] == 1 and cpu_inductor.serves(x.dtype)


def _rows(x: torch.Tensor, *more: int) -> dict[int, tuple[int, ...]] | None:
    """cpu_inductor.kernel's `dynamic` for a small-op group whose arguments 0 and `more` have x's rows (tokens):
    None (plain shapes: a kernel specialized to one row) for one token, else those arguments' rows
    symbolic (one kernel for every count from 2 up: the steps of many tokens)."""
    return None if x.shape[0] == 1 else {i: (0,) for i in (0, *more)}


def _gemv(x: torch.Tensor, rows16: torch.Tensor, *bias: torch.Tensor) -> torch.Tensor:
    """x [1, K] @ W.T with W as rows16 [N/T, K, T]: float32 sums, one rounding. Each 16 columns of a
    tile is its own sum (one loop over K keeps T/16 pairs of vector sums going)."""
    # stored before the loop: inductor otherwise recomputes x's producer (an RMSNorm's scaling, its
    # square root included) at every step of every tile's K loop
    xf = torch.ops.prims.inductor_force_stride_order(x.float(), (x.shape[1], 1)).view(1, -1, 1)
    parts = [(rows16[:, :, j : j + 16].float() * xf).sum(1) for j in range(0, rows16.shape[2], 16)]
    y = (parts[0] if len(parts) == 1 else torch.stack(parts, 1)).reshape(1, -1)
    if bias:
        y = y + bias[0].float()
    return y.to(x.dtype)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | EmulatedHalfWeight:
    """reference.pack_linear_weight, plus the rows16 layout of half weights for one-token products
    where they run compiled (reference.compiled_half; while the host can spare the memory:
    reference.host_can_spare). On a CPU with native half products, oneDNN's packed tensor serves
    every other row count (EmulatedHalfWeight with `half` None)."""
    packed = reference.pack_linear_weight(weight)
    if weight.device.type != "cpu" or not reference.compiled_half(weight.dtype):
        return packed
    native = not isinstance(packed, EmulatedHalfWeight)
    if not native and packed.batched is None:
        return packed
    n, k = weight.shape
    tile = next((t for t in TILES if n % t == 0), None)
    if tile is None or not reference.host_can_spare(2 * weight.numel()):
        return packed
    rows16 = weight.contiguous().view(n // tile, tile, k).transpose(1, 2).contiguous()
    return EmulatedHalfWeight(None, packed, rows16) if native else dataclasses.replace(packed, rows16=rows16)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, EmulatedHalfWeight) and weight.rows16 is not None and x.dim() == 2 and _one_token(x):
        y = cpu_inductor.run(_gemv, (x, weight.rows16) if bias is None else (x, weight.rows16, bias))
        if y is not None:
            return y
    return reference.linear(x, weight, bias)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # the first layer's norm (no residual yet) is one op: left to the reference
    if residual is not None and cpu_inductor.serves(x.dtype):
        got = cpu_inductor.run(reference.fused_add_rms_norm, (x, residual, weight), _rows(x, 1), eps=eps)
        if got is not None:
            return got[0], got[1]
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def add_rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    h, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(h, weight, bias), residual


def silu_mul_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    h = cpu_inductor.run(reference.silu_and_mul, (x,), _rows(x)) if cpu_inductor.serves(x.dtype) else None
    return reference.silu_mul_linear(x, weight, bias) if h is None else linear(h, weight, bias)


def _norm_rope(qkv: torch.Tensor, *t: torch.Tensor, num_q: int, eps: float, neox: bool) -> tuple:
    """q and k of qkv [T, heads, head_dim], per-head RMSNorm'd (when t starts with the two norm
    weights) and rotated (t ends with rope_cos_sin's four tensors), each contiguous."""
    nkv = (qkv.shape[1] - num_q) // 2
    qk = qkv[:, : num_q + nkv]
    if len(t) == 6:
        qk = torch.cat((reference.rms_norm(qk[:, :num_q], t[0], eps), reference.rms_norm(qk[:, num_q:], t[1], eps)), 1)
    qk = reference.rotary_embedding(qk, t[-4:], neox)
    return qk[:, :num_q].contiguous(), qk[:, num_q:].contiguous()


def qkv_prepare(qkv: torch.Tensor, num_q: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                eps: float, rope: tuple, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                neox: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """reference.qkv_prepare, q/k norm and RoPE as one compiled kernel (any token count)."""
    if cpu_inductor.serves(qkv.dtype):
        norms = () if q_norm is None else (q_norm, k_norm)
        rows = _rows(qkv, *range(1 + len(norms), 1 + len(norms) + len(rope)))  # (qkv and the rope tensors)
        got = cpu_inductor.run(_norm_rope, (qkv, *norms, *rope), rows, num_q=num_q, eps=eps, neox=neox)
        if got is not None:
            q, k = got
            v = qkv[:, q.shape[1] + k.shape[1] :]
            reference.store_kv(k, v, k_cache, v_cache, slots)
            return q, k, v
    return reference.qkv_prepare(qkv, num_q, q_norm, k_norm, eps, rope, k_cache, v_cache, slots, neox)


def _rows16(*weights) -> bool:
    return all(isinstance(w, EmulatedHalfWeight) and w.rows16 is not None for w in weights)


def _present(*tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in tensors if t is not None)


def _pre(x, residual, *t, qkv_bias: bool, qk_norm: bool, num_q: int, num_kv: int, head_dim: int, eps: float) -> tuple:
    """blocks.pre_attention's arithmetic for one token (the paged-cache store stays outside): t is
    (input norm, qkv rows16, qkv bias if qkv_bias, q and k norms if qk_norm, rope_cos_sin's four
    tensors)."""
    h, residual = reference.fused_add_rms_norm(x, residual, t[0], eps)
    qkv = _gemv(h, t[1], *t[2 : 2 + qkv_bias]).view(1, num_q + 2 * num_kv, head_dim)
    q, k = _norm_rope(qkv, *t[2 + qkv_bias :], num_q=num_q, eps=eps, neox=True)  # the decoder's families are NeoX
    return q, k, qkv[:, num_q + num_kv :].contiguous(), residual


def no_residual(x: torch.Tensor) -> torch.Tensor:
    """The residual the first layer (which has none yet) adds: -0.0, which leaves every value of x
    and the sign of every zero as they are (x + -0.0 == x; +0.0 would turn -0.0 into +0.0), so the
    first layer runs the others' kernels (kernels of its own were one more compile at startup,
    docs/BENCHMARKS.md, session 29)."""
    return torch.full_like(x, -0.0)


def pre_args(x, residual, lw, rope) -> tuple[tuple, dict]:
    """_pre's tensors for layer weights `lw` (the first layer's residual: no_residual) and its
    static values but the shapes and eps (also cpu_layer._layer's, under the same names)."""
    norms = () if lw.q_norm is None else (lw.q_norm, lw.k_norm)
    residual = no_residual(x) if residual is None else residual
    args = (x, residual, lw.input_norm, lw.qkv.rows16, *_present(lw.qkv_bias), *norms, *rope)
    return args, dict(qkv_bias=lw.qkv_bias is not None, qk_norm=bool(norms))


def pre_attention(ops, x, residual, lw, eps, rope, num_q, num_kv, head_dim, k_cache, v_cache, slots):
    """blocks.pre_attention; for one token, everything but the K/V store runs as one compiled call."""
    if _one_token(x) and _rows16(lw.qkv):
        args, static = pre_args(x, residual, lw, rope)
        got = cpu_inductor.run(_pre, args, num_q=num_q, num_kv=num_kv, head_dim=head_dim, eps=eps, **static)
        if got is not None:
            q, k, v, residual = got
            reference.store_kv(k, v, k_cache, v_cache, slots)
            return q, k, v, residual
    return blocks.pre_attention(ops, x, residual, lw, eps, rope, num_q, num_kv, head_dim, k_cache, v_cache, slots)


def _post(attn, residual, o, *t, biases: tuple[bool, bool, bool], eps: float) -> tuple:
    """blocks.post_attention's arithmetic for one token: t is (o bias?, post norm, gate_up rows16,
    gate_up bias?, down rows16, down bias?), each bias present where `biases` says."""
    t = list(t)
    take = lambda present: (t.pop(0),) if present else ()  # noqa: E731
    x = _gemv(attn, o, *take(biases[0]))
    h, residual = reference.fused_add_rms_norm(x, residual, t.pop(0), eps)
    gate_up = _gemv(h, t.pop(0), *take(biases[1]))
    return _gemv(reference.silu_and_mul(gate_up), t.pop(0), *take(biases[2])), residual


def post_weights(lw) -> tuple[tuple, tuple[bool, bool, bool]]:
    """_post's weight tensors for layer weights `lw` and its `biases` (also cpu_layer's)."""
    weights = (lw.o.rows16, *_present(lw.o_bias), lw.post_norm, lw.gate_up.rows16, *_present(lw.gate_up_bias),
               lw.down.rows16, *_present(lw.down_bias))  # fmt: skip
    return weights, tuple(b is not None for b in (lw.o_bias, lw.gate_up_bias, lw.down_bias))


def post_attention(ops, attn, residual, lw, eps):
    """blocks.post_attention; for one token, one compiled call."""
    if _one_token(attn) and _rows16(lw.o, lw.gate_up, lw.down):
        weights, biases = post_weights(lw)
        got = cpu_inductor.run(_post, (attn, residual, *weights), biases=biases, eps=eps)
        if got is not None:
            return got[0], got[1]
    return blocks.post_attention(ops, attn, residual, lw, eps)


def _attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, layer: torch.Tensor, length: torch.Tensor,
            span: torch.Tensor, *new: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """q [1, heads, hd] over the first `length` positions of row 0 of layer `layer` (a 1-element
    index) of K, V [layers, rows, kv heads, capacity, hd] (float32 or q's dtype), span.shape[0] positions read
    (compiled with that size symbolic: one kernel for every context), query heads grouped on their
    KV head as SDPA's GQA does; the result in q's dtype. `new`, when given, is the step's k and v
    ([1, kv heads, hd]): they stand in for position length - 1 (the row holds them only after the
    step, cpu_layer.py)."""
    kvh, hd, width = K.shape[2], K.shape[4], span.shape[0]
    k, v = K[layer][0, 0, :, :width], V[layer][0, 0, :, :width]  # [kvh, width, hd]
    pos = torch.arange(width)
    if new:
        last = (pos == length - 1)[None, :, None]
        k = torch.where(last, new[0].float().view(kvh, 1, hd), k)
        v = torch.where(last, new[1].float().view(kvh, 1, hd), v)
    qf = q.float().view(kvh, -1, hd)
    s = (qf[:, :, None, :] * k[:, None]).sum(-1) * scale  # [kvh, group, width]
    s = torch.where(pos < length, s, float("-inf"))
    o = (torch.softmax(s, -1)[..., None] * v[:, None]).sum(-2)  # [kvh, group, hd]
    return o.reshape(1, -1, hd).to(q.dtype)


SPAN_STEP = 16  # the one-row attention reads the context rounded up to this many positions


class OneRowAttention:
    """A step's attention for one decoding sequence over the first `length` positions of row 0 of
    the KV buffers K, V [layers, rows, kv heads, capacity, hd] (cpu_attention.DecodeMirror's),
    read over the length rounded up to SPAN_STEP (`span`'s size: the kernels take it as a symbolic
    size, so one kernel serves every context): `self(q, layer)` runs it as one compiled call
    (q [1, heads, hd]; layer a 1-element int64 tensor, picked inside the graph so the caller makes
    no views per layer), or returns None if the kernel fails to compile. cpu_layer.py compiles the
    same attention into a whole layer's graph from these fields."""

    def __init__(self, K: torch.Tensor, V: torch.Tensor, length: int, scale: float) -> None:
        self.K, self.V, self.scale = K, V, scale
        self.length = torch.tensor(length)
        self.span = torch.empty(min(-(-length // SPAN_STEP) * SPAN_STEP, K.shape[3]), dtype=torch.uint8)
        self._kernel: Callable | None = None

    def dynamic(self, args: tuple) -> dict[int, tuple[int, ...]]:
        """cpu_inductor.kernel's `dynamic` for a graph over `args` that include K, V and span, wherever they sit:
        K and V's rows and capacity (the mirror's layout changes as it grows), the span's size."""
        dims = {id(self.K): (1, 3), id(self.V): (1, 3), id(self.span): (0,)}
        got = {i: dims[id(a)] for i, a in enumerate(args) if id(a) in dims}
        assert len(got) == 3, "K, V and span must be among the arguments themselves (not views or copies)"
        return got

    def __call__(self, q: torch.Tensor, layer: torch.Tensor) -> torch.Tensor | None:
        args = (q, self.K, self.V, layer, self.length, self.span)
        if self._kernel is None:  # looked up at the step's first layer
            self._kernel = cpu_inductor.kernel(_attend, args, self.dynamic(args), scale=self.scale)
            if self._kernel is None:
                return None
        return self._kernel(*args)


def warm_up_length(dtype: torch.dtype, max_model_len: int) -> int | None:
    """The context length of a one-token step that compiles every one-token kernel a model in `dtype`
    uses (they take any context), or None where the compiled path does not apply. The engine runs
    it at startup (ModelRunner.warm_up): compiled at their first use instead, the first lone
    decoding request of a process waited for them (measured on a 2-vCPU AVX2 EPYC, SmolLM2-135M:
    13-36 s, and 5-13 s more at each longer context bucket of the kernels before they took any
    length; docs/BENCHMARKS.md, session 28)."""
    if not cpu_inductor.serves(dtype):
        return None
    return min(SPAN_STEP, max_model_len)


def decode_attention(K: torch.Tensor, V: torch.Tensor, length: int, dtype: torch.dtype,
                     scale: float) -> OneRowAttention | None:  # fmt: skip
    """For a step decoding one sequence over the first `length` positions of row 0 of the KV
    buffers K, V (cpu_attention.DecodeMirror's: float32, or the queries' `dtype`): the step's attention
    (OneRowAttention), decided here once per step, in place of SDPA. None where it does not apply
    (the caller runs SDPA): not a half model (reference.compiled_half)."""
    if not cpu_inductor.serves(dtype) or K.dtype not in (torch.float32, dtype):
        return None
    return OneRowAttention(K, V, length, scale)
