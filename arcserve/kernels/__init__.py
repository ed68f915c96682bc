"""Kernel selection. `torch` = the pure-PyTorch twins in reference.py (the CPU path)."""

from __future__ import annotations

from types import SimpleNamespace

from arcserve.kernels import reference

KERNEL_CHOICES = ("auto", "torch")


def get_ops(kernels: str, device_type: str) -> SimpleNamespace:
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {kernels!r}")
    return SimpleNamespace(
        name="torch",
        linear=reference.linear,
        pack_linear_weight=reference.pack_linear_weight,
        rms_norm=reference.rms_norm,
        fused_add_rms_norm=reference.fused_add_rms_norm,
        silu_and_mul=reference.silu_and_mul,
        rope_cos_sin=reference.rope_cos_sin,
        rotary_embedding=reference.rotary_embedding,
        store_kv=reference.store_kv,
        paged_attention=reference.paged_attention,
    )
