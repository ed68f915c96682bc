"""Kernel selection: `torch` = the pure-PyTorch twins in reference.py (the CPU path); `triton` = the
Triton kernels (GPUs, or the CPU under TRITON_INTERPRET=1); `auto` = Triton on GPUs, torch on CPU.
Matmuls are PyTorch's (cuBLAS / oneDNN / ...) in both."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from arcserve.kernels import cpu_attention, reference
from arcserve.platform import triton_available

KERNEL_CHOICES = ("auto", "torch", "triton")


def resolve_kernels(kernels: str, device: torch.device) -> str:
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {kernels!r}")
    if kernels == "auto":
        return "triton" if device.type != "cpu" and triton_available(device) else "torch"
    if kernels == "triton" and not triton_available(device):
        raise ValueError(
            f"kernels='triton' cannot run on {device.type}: Triton needs a GPU, or TRITON_INTERPRET=1 "
            "to run its kernels on the CPU (slow; for tests), and the triton package"
        )
    return kernels


def get_ops(kernels: str, device: torch.device) -> SimpleNamespace:
    name = resolve_kernels(kernels, device)
    common = dict(linear=reference.linear, pack_linear_weight=reference.pack_linear_weight)
    if name == "triton":
        from arcserve.kernels import triton_attention, triton_ops

        return SimpleNamespace(
            name="triton",
            **common,
            rms_norm=triton_ops.rms_norm,
            fused_add_rms_norm=triton_ops.fused_add_rms_norm,
            silu_and_mul=triton_ops.silu_and_mul,
            rope_cos_sin=triton_ops.rope_cos_sin,
            rotary_embedding=triton_ops.rotary_embedding,
            store_kv=triton_ops.store_kv,
            qkv_prepare=triton_ops.qkv_prepare,
            paged_attention=triton_attention.paged_attention,
            prepare_attention=triton_attention.prepare,
            make_decode_mirror=None,
        )
    cpu = device.type == "cpu"
    return SimpleNamespace(
        name="torch",
        **common,
        rms_norm=reference.rms_norm,
        fused_add_rms_norm=reference.fused_add_rms_norm,
        silu_and_mul=reference.silu_and_mul,
        rope_cos_sin=reference.rope_cos_sin,
        rotary_embedding=reference.rotary_embedding,
        store_kv=reference.store_kv,
        qkv_prepare=reference.qkv_prepare,
        # CPU decode attention reads a dense mirror of the decoding sequences' KV (cpu_attention.py).
        paged_attention=cpu_attention.paged_attention if cpu else reference.paged_attention,
        prepare_attention=None,
        make_decode_mirror=cpu_attention.DecodeMirror if cpu else None,
    )
