"""A step that decodes one sequence of a half model on the CPU: each decoder layer as
one compiled call (cpu_compiled's pre_attention arithmetic, the one-row attention over the decode
mirror, post_attention's arithmetic), and the step's new K/V written for every layer at once.

Between two compiled calls the CPU runs Python and small torch ops, and right after a call has
streamed megabytes of weights through the caches each of those costs several times its usual
time (measured on a 2-vCPU AVX2 EPYC: the paged-cache store of one token's K/V, a few views and two
index_copy_, ~40 us a layer; the attention call with its two mirror copies ~100 us). Here a layer
is one call: the layer's new k and v are graph outputs, its attention reads them where the mirror
does not hold them yet (cpu_compiled._attend's `new`), and after the last layer one copy per
buffer writes all layers' K/V into the decode mirror's row and the paged cache.

The paged cache stays the source of truth: it holds the step's tokens when the step ends, as on
every other path. Applies when the step's attention plan (cpu_attention._plan) has a one-row
kernel (one sequence, no sliding window), the cache keeps the model's dtype (an 8-bit cache
rounds K/V first: the layer-by-layer path) and each layer
has its products' tiled weights; otherwise the layers run through blocks.decoder_layer: a layer
without the tiled weights hands the rest of the step over (the layers already run keep their K/V:
they are written first), and a failed compile, at the first layer (all layers share one graph: the
first adds cpu_compiled.no_residual), the whole step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from arcserve.kernels import blocks, cpu_attention, cpu_compiled, cpu_inductor
from arcserve.kernels.blocks import LayerDims


def _layer(x: torch.Tensor, *t: torch.Tensor, qkv_bias: bool, qk_norm: bool,
           post_biases: tuple[bool, bool, bool], num_q: int, num_kv: int, head_dim: int, eps: float,
           scale: float) -> tuple:  # fmt: skip
    """One decoder layer for one token: t is cpu_compiled._pre's tensors, then the mirror's K, V,
    the layer's index, the context length and the span read (cpu_compiled._attend's), then
    cpu_compiled._post's weights. Returns the layer's output, the new residual, the token's k and v, and q."""
    n_pre = 1 + 2 + qkv_bias + 2 * qk_norm + 4
    q, k, v, residual = cpu_compiled._pre(x, *t[:n_pre], qkv_bias=qkv_bias, qk_norm=qk_norm,
                                          num_q=num_q, num_kv=num_kv, head_dim=head_dim, eps=eps)  # fmt: skip
    K, V, layer, length, span = t[n_pre : n_pre + 5]
    attn = cpu_compiled._attend(q, K, V, layer, length, span, k, v, scale=scale)
    out, residual = cpu_compiled._post(attn.view(1, -1), residual, *t[n_pre + 5 :], biases=post_biases, eps=eps)
    # q is an output only so that inductor stores it once: otherwise its RoPE is recomputed at every
    # position the attention reads (measured ~100 us a layer more than the three calls it replaces)
    return out, residual, k, v, q


class _Step:
    """The step's one-row plan and the K/V of the layers run so far, to be written at its end."""

    def __init__(self, plan: dict, mirror: cpu_attention.DecodeMirror, kv: torch.Tensor, slot: int) -> None:
        self.plan, self.mirror, self.kv, self.slot = plan, mirror, kv, slot
        self.attention = plan["one_row"][2]  # cpu_compiled.OneRowAttention
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.kernel: Callable | None = None  # every layer's compiled call, looked up at the first
        self.active = True

    def write(self) -> None:
        """The K/V of the layers run so far into the mirror's row (the new position) and the paged
        cache (the step's slot): one copy per buffer; then later layers run layer by layer."""
        n = len(self.k)
        if n:
            k, v = torch.cat(self.k), torch.cat(self.v)  # [layers run, kv heads, head_dim]
            k_last, v_last, _ = self.plan["one_row"]  # the mirror's new position in every layer
            k_last[:n, 0].copy_(k)
            v_last[:n, 0].copy_(v)
            block, offset = divmod(self.slot, self.kv.shape[3])
            self.kv[:n, 0, block, offset].copy_(k)
            self.kv[:n, 1, block, offset].copy_(v)
        self.k, self.v, self.active = [], [], False


def _start(meta, x: torch.Tensor, k_cache: torch.Tensor, dims: LayerDims, one_row: Callable | None) -> _Step | None:
    """At the step's first layer: a _Step where the whole-layer path applies (see the module), else None."""
    kv = meta.host.get("kv_cache")
    mirror = meta.host.get("decode_mirror")
    if one_row is None or kv is None or mirror is None or k_cache.dtype != x.dtype or not cpu_compiled._one_token(x):
        return None
    plan = cpu_attention._plan(meta, k_cache.shape[1], mirror, dims.sliding_window, one_row, x.dtype, dims.scale)
    if plan is None or plan["tok"] is not None or plan["one_row"] is None:
        return None
    return _Step(plan, mirror, kv, int(meta.slot_mapping[0]))  # (a host tensor on the CPU)


def decoder_layer(
    ops, x: torch.Tensor, residual: torch.Tensor | None, lw, layer: int, dims: LayerDims, rope: tuple,
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta, one_row: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """blocks.decoder_layer; one compiled call where the step decodes one sequence (see the module).
    one_row: cpu_compiled.decode_attention (get_ops binds it), which plans the step's attention."""
    step = _start(meta, x, k_cache, dims, one_row) if layer == 0 else meta.cache.get("cpu_layer")
    if layer == 0:
        meta.cache["cpu_layer"] = step
    if step is None or not step.active:
        return blocks.decoder_layer(ops, x, residual, lw, layer, dims, rope, k_cache, v_cache, meta)
    got = _run(step, x, residual, lw, layer, dims, rope, k_cache, v_cache)
    if got is None:  # this layer cannot: the layers run so far keep their K/V, the rest run layer by layer
        step.write()
        return blocks.decoder_layer(ops, x, residual, lw, layer, dims, rope, k_cache, v_cache, meta)
    out, residual, k, v, _ = got
    step.k.append(k)
    step.v.append(v)
    if layer == step.kv.shape[0] - 1:
        step.write()
    return out, residual


def _run(step: _Step, x, residual, lw, layer: int, dims: LayerDims, rope: tuple, k_cache, v_cache) -> tuple | None:
    """The layer's compiled call, or None if its weights lack the tiled copy or it fails to compile."""
    if not cpu_compiled._rows16(lw.qkv, lw.o, lw.gate_up, lw.down):
        return None
    step.mirror.refill(layer, k_cache, v_cache, step.plan)  # a new decoder's context, at its first step
    a = step.attention
    pre, static = cpu_compiled.pre_args(x, residual, lw, rope)
    post, biases = cpu_compiled.post_weights(lw)
    args = (*pre, a.K, a.V, step.mirror.layer_index[layer], a.length, a.span, *post)
    if step.kernel is None:  # looked up once per step
        step.kernel = cpu_inductor.kernel(
            _layer, args, a.dynamic(args), **static, post_biases=biases, num_q=dims.num_q,
            num_kv=dims.num_kv, head_dim=dims.head_dim, eps=dims.eps, scale=a.scale,
        )  # fmt: skip
        if step.kernel is None:
            return None
    return step.kernel(*args)
