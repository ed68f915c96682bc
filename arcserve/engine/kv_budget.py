"""How much memory the KV cache gets at startup: the paged cache's block count and, on the CPU with
the default budget, the decode mirror's share (kernels/cpu_attention.py); on GPUs after a profile
step's peak activations (profile_peak_activations)."""

from __future__ import annotations

import logging

import torch

from arcserve.config import EngineArgs
from arcserve.engine.penalties import PenaltyState
from arcserve.engine.runner import scratch_meta
from arcserve.models.decoder import DecoderModel
from arcserve.platform import empty_cache, memory_allocated, memory_info, reset_peak_memory, synchronize

logger = logging.getLogger("arcserve")

CPU_KV_DEFAULT = 4 << 30  # the CPU's default budget, capped at 30% of the free memory


def plan_kv_cache(args: EngineArgs, model: DecoderModel, draft_model: DecoderModel | None, max_model_len: int,
                  max_num_batched_tokens: int) -> tuple[int, int | None]:  # fmt: skip
    """The paged cache's blocks, and the bytes the CPU's decode mirror gets from the default budget
    (None: the mirror sizes itself, see ModelRunner). Logs the capacity; raises ValueError when one
    max_model_len sequence does not fit."""
    a, device = args, model.device
    mirror_bytes = None
    seq_blocks = -(-max_model_len // a.block_size)  # one max_model_len sequence
    per_block = kv_cache_bytes_per_block(model, a.block_size)
    if draft_model is not None:  # the draft's cache has as many blocks as the target's
        per_block += kv_cache_bytes_per_block(draft_model, a.block_size)
    if a.num_kv_blocks is not None:
        num_blocks = a.num_kv_blocks
    else:
        budget = a.kv_cache_memory_bytes
        if budget is None and device.type != "cpu":
            budget = _gpu_budget(a, model, max_model_len, max_num_batched_tokens)
        elif budget is None:
            free, _ = memory_info(device)
            budget = min(CPU_KV_DEFAULT, int(free * 0.3))
            mirror = model.ops.make_decode_mirror
            if mirror is not None:
                # A share for the decode mirror, written at startup like the paged cache: the
                # 64-request benchmark took 248,605 page faults mid-run without, 34,810 with, and ran
                # 4% faster on a 2-vCPU VM (docs/BENCHMARKS.md). The share lets both hold as many
                # tokens (half the budget when they store a token in as many bytes; two thirds for
                # an 8-bit paged cache beside a bf16 mirror). No more than the mirror can use, and
                # never so much that one max_model_len sequence no longer fits the paged cache.
                cfg = model.cfg
                most = mirror.largest_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype,
                                            a.max_num_seqs, max_model_len)  # fmt: skip
                # bytes of 128 tokens (the mirror's growth grain) in the mirror and in the paged cache
                m = mirror.largest_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype, 1, 128)
                c = kv_cache_bytes_per_block(model, 128)
                share = budget * m // (m + c)
                mirror_bytes = max(0, min(share, most, budget - seq_blocks * per_block))
                budget -= mirror_bytes
        num_blocks = max(0, budget) // per_block
        if a.kv_cache_memory_bytes is None:  # no use for more than every sequence at full length
            num_blocks = min(num_blocks, a.max_num_seqs * seq_blocks)
    tokens = num_blocks * a.block_size
    if tokens < max_model_len:
        raise ValueError(
            f"The KV cache holds {num_blocks} blocks = {tokens} tokens, too few for one sequence "
            f"of max_model_len {max_model_len}. The largest max_model_len that fits is "
            f"{tokens}: lower max_model_len or give the KV cache more memory/blocks."
        )
    logger.info(
        "KV cache: %d blocks = %d tokens; max concurrency at max_model_len %d: %.2f%s",
        num_blocks, tokens, max_model_len, tokens / max_model_len,
        "" if mirror_bytes is None else f"; decode mirror: {mirror_bytes / 2**20:.1f} MiB",
    )  # fmt: skip
    return num_blocks, mirror_bytes


def _gpu_budget(a: EngineArgs, model: DecoderModel, max_model_len: int, max_num_batched_tokens: int) -> int:
    """gpu_memory_utilization of the device's memory, minus what is in use now (weights, context,
    other processes), the peak activations of a profile step at max_num_batched_tokens and the
    penalties' table (made at the first penalized request: PenaltyState)."""
    free, total = memory_info(model.device)
    used = total - free
    activations = profile_peak_activations(model, max_num_batched_tokens, max_model_len, a.max_num_seqs, a.block_size)
    activations += PenaltyState.table_bytes(a.max_num_seqs, model.cfg.vocab_size)
    budget = int(total * a.gpu_memory_utilization) - used - activations
    logger.info(
        "Memory: %.2f GiB of %.2f GiB in use after loading; peak activations and the penalties' table "
        "%.2f GiB; KV cache budget %.2f GiB (gpu_memory_utilization %.2f)", used / 2**30, total / 2**30,
        activations / 2**30, budget / 2**30, a.gpu_memory_utilization,
    )  # fmt: skip
    if budget <= 0:
        raise ValueError(
            f"No device memory left for the KV cache: {used / 2**30:.2f} GiB in use after loading and "
            f"{activations / 2**30:.2f} GiB of activations exceed gpu_memory_utilization "
            f"{a.gpu_memory_utilization} of {total / 2**30:.2f} GiB; raise gpu_memory_utilization "
            "or lower max_num_batched_tokens"
        )
    return budget


def kv_cache_bytes_per_block(model: DecoderModel, block_size: int) -> int:
    cfg = model.cfg
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * model.kv_cache_dtype.itemsize


@torch.inference_mode()
def profile_peak_activations(model: DecoderModel, num_tokens: int, max_model_len: int, max_num_seqs: int,
                             block_size: int) -> int:  # fmt: skip
    """Peak bytes of activations of the largest step (num_tokens of prefill, logits and a top-p sort
    for up to max_num_seqs rows), measured by running it on a scratch KV cache; 0 on CPU."""
    dev = model.device
    if dev.type == "cpu":
        return 0
    lens = [max_model_len] * (num_tokens // max_model_len) + ([num_tokens % max_model_len] if num_tokens % max_model_len else [])
    cfg = model.cfg
    nb = sum(-(-n // block_size) for n in lens)
    reset_peak_memory(dev)
    before = memory_allocated(dev)[0]
    kv = torch.zeros(cfg.num_layers, 2, nb, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=model.kv_cache_dtype,
                     device=dev)  # fmt: skip
    kv_bytes = kv.numel() * kv.element_size()
    meta = scratch_meta(lens, block_size, dev)
    ids = torch.randint(0, cfg.vocab_size, (num_tokens,), device=dev)
    positions = torch.cat([torch.arange(n, device=dev) for n in lens])
    hidden = model.forward(ids, positions, meta, [(kv[i, 0], kv[i, 1]) for i in range(cfg.num_layers)])
    rows = min(max_num_seqs, num_tokens)
    logits = model.logits(hidden[-rows:])
    logits.float().softmax(-1).sort(dim=-1, descending=True)[0].cumsum(-1)  # the sampler's largest path
    synchronize(dev)
    peak = memory_allocated(dev)[1]
    del kv, hidden, logits
    empty_cache(dev)
    return max(0, peak - before - kv_bytes)
