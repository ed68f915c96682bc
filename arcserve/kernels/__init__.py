"""Kernel selection. `torch` = the pure-PyTorch twins in reference.py (the CPU path)."""

from __future__ import annotations

from types import SimpleNamespace

from arcserve.kernels import cpu_attention, reference

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
        # CPU decode attention reads a dense mirror of the decoding sequences' KV (cpu_attention.py).
        paged_attention=cpu_attention.paged_attention if device_type == "cpu" else reference.paged_attention,
        make_decode_mirror=cpu_attention.DecodeMirror if device_type == "cpu" else None,
    )
