"""Pure-PyTorch kernels: the CPU path, and the twin every Triton kernel is tested against.

Shapes: tokens are flattened (T = all scheduled tokens of the step); q is [T, num_heads, head_dim],
k/v are [T, num_kv_heads, head_dim]; a layer's KV cache is k_cache/v_cache of shape
[num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x; return (rms_norm(residual), residual). With residual None, x starts it."""
    residual = x if residual is None else x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, neox: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_sin: [max_pos, rot_dim] float32, cos in the first half, sin in the second."""
    cs = cos_sin[positions]
    half = cs.shape[-1] // 2
    cos = cs[:, None, :half].to(q.dtype)
    sin = cs[:, None, half:].to(q.dtype)
    return _rotate(q, cos, sin, neox), _rotate(k, cos, sin, neox)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    if neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:  # GPT-J: interleaved pairs
        x1, x2 = x[..., 0::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if neox:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write each token's K/V to its slot (block * block_size + offset) in the paged cache."""
    nb, bs = k_cache.shape[:2]
    k_cache.view(nb * bs, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(nb * bs, *v_cache.shape[2:]).index_copy_(0, slots, v)


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer (built once per step by the runner)."""

    query_start_loc: torch.Tensor  # [B + 1] int32, offsets of each sequence's tokens in the batch
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64
    max_query_len: int
    max_seq_len: int
    # Host copies (numpy) for backends that plan on the host, and derived tensors they cache.
    host: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)


def _plan(meta: AttentionMetadata, block_size: int) -> dict:
    """Gather indices for the torch backend, computed once per step and reused by all layers."""
    if "plan" in meta.cache:
        return meta.cache["plan"]
    qsl = meta.host["query_start_loc"]
    seq_lens = meta.host["seq_lens"]
    bt = meta.block_tables
    dev = bt.device
    q_lens = qsl[1:] - qsl[:-1]
    dec = [i for i in range(len(seq_lens)) if q_lens[i] == 1]
    plan: dict = {"decode": None, "prefill": []}
    if dec:
        idx = torch.tensor(dec, device=dev)
        max_len = int(seq_lens[dec].max())
        pos = torch.arange(max_len, device=dev)
        lens = torch.as_tensor(seq_lens[dec], device=dev)
        blocks = bt[idx][:, : -(-max_len // block_size)]
        slots = (blocks[:, pos // block_size] * block_size + pos % block_size).long()
        mask = pos[None, :] < lens[:, None]
        plan["decode"] = (torch.as_tensor(qsl[dec], device=dev).long(), slots, mask, lens)
    for i in range(len(seq_lens)):
        if q_lens[i] == 1:
            continue
        n, ctx = int(q_lens[i]), int(seq_lens[i])
        pos = torch.arange(ctx, device=dev)
        slots = (bt[i, pos // block_size] * block_size + pos % block_size).long()
        plan["prefill"].append((int(qsl[i]), n, ctx, slots))
    meta.cache["plan"] = plan
    return plan


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of every scheduled token over its sequence's cached context (which already
    holds this step's K/V). Returns [T, num_heads, head_dim]."""
    nb, bs, nkv, hd = k_cache.shape
    kf = k_cache.view(nb * bs, nkv, hd)
    vf = v_cache.view(nb * bs, nkv, hd)
    plan = _plan(meta, bs)
    out = torch.empty_like(q)
    gqa = q.shape[1] != nkv
    if plan["decode"] is not None:
        tok, slots, mask, lens = plan["decode"]
        if sliding_window is not None:
            pos = torch.arange(slots.shape[1], device=q.device)
            mask = mask & (pos[None, :] > lens[:, None] - 1 - sliding_window)
        qd = q[tok].unsqueeze(2)  # [B, H, 1, D]
        kd = kf[slots].transpose(1, 2)  # [B, KVH, L, D]
        vd = vf[slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=gqa
        )
        out[tok] = o.squeeze(2)
    for start, n, ctx, slots in plan["prefill"]:
        qp = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        kp = kf[slots].transpose(0, 1).unsqueeze(0)
        vp = vf[slots].transpose(0, 1).unsqueeze(0)
        if ctx == n and sliding_window is None:
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            kpos = torch.arange(ctx, device=q.device)[None, :]
            mask = kpos <= qpos
            if sliding_window is not None:
                mask = mask & (kpos > qpos - sliding_window)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start : start + n] = o[0].transpose(0, 1)
    return out
