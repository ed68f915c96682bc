"""Kernel selection: `torch` = the pure-PyTorch twins in reference.py (the CPU path); `triton` = the
Triton kernels (GPUs, or the CPU under TRITON_INTERPRET=1); `auto` = Triton on GPUs, torch on CPU.
Matmuls are PyTorch's (cuBLAS / oneDNN / ...) in both, except one-row products with small matrices (decode at
batch 1), which the Triton path runs as a matrix-vector kernel with the norm or SiLU-mul before it
fused in (triton_linear.py). The namespace holds what the model calls."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from arcserve.kernels import blocks, cpu_attention, cpu_compiled, cpu_layer, cpu_rows_attention, reference
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


def get_ops(kernels: str, device: torch.device, compiled: bool = True) -> SimpleNamespace:
    """compiled=False (enforce_eager) keeps the CPU's one-token steps on eager ops (cpu_compiled.py)."""
    name = resolve_kernels(kernels, device)
    cpu = device.type == "cpu"
    ops = dict(
        name=name,
        linear=reference.linear,
        pack_linear_weight=reference.pack_linear_weight,
        fused_add_rms_norm=reference.fused_add_rms_norm,
        add_rms_norm_linear=reference.add_rms_norm_linear,
        silu_mul_linear=reference.silu_mul_linear,
        rope_cos_sin=reference.rope_cos_sin,
        qkv_prepare=reference.qkv_prepare,
        sample_from_cdf=reference.sample_from_cdf,
        apply_penalties=reference.apply_penalties,
        # CPU decode attention reads a dense mirror of the decoding sequences' KV (cpu_attention.py).
        paged_attention=cpu_attention.paged_attention if cpu else reference.paged_attention,
        make_decode_mirror=cpu_attention.DecodeMirror if cpu else None,
        # the context length of a one-token step to run at startup, or None (ModelRunner.warm_up)
        warm_up_length=lambda dtype, max_model_len: None,
    )
    composed = dict(pre_attention=blocks.pre_attention, post_attention=blocks.post_attention,
                    decoder_layer=blocks.decoder_layer)  # fmt: skip
    if cpu and name == "torch" and compiled:
        # one-token steps of half models (reference.compiled_half), and their decode
        # attention over many rows: compiled kernels
        ops.update(
            linear=cpu_compiled.linear,
            pack_linear_weight=cpu_compiled.pack_linear_weight,
            fused_add_rms_norm=cpu_compiled.fused_add_rms_norm,
            add_rms_norm_linear=cpu_compiled.add_rms_norm_linear,
            silu_mul_linear=cpu_compiled.silu_mul_linear,
            qkv_prepare=cpu_compiled.qkv_prepare,
            warm_up_length=cpu_compiled.warm_up_length,
            paged_attention=functools.partial(cpu_attention.paged_attention, one_row=cpu_compiled.decode_attention,
                                              rows=cpu_rows_attention.decode_attention),
        )
        composed = dict(pre_attention=cpu_compiled.pre_attention, post_attention=cpu_compiled.post_attention,
                        decoder_layer=functools.partial(cpu_layer.decoder_layer, one_row=cpu_compiled.decode_attention))  # fmt: skip
    if name == "triton":
        from arcserve.kernels import triton_attention, triton_linear, triton_ops, triton_sampling

        ops.update(
            linear=triton_linear.linear,
            fused_add_rms_norm=triton_ops.fused_add_rms_norm,
            add_rms_norm_linear=triton_linear.add_rms_norm_linear,
            silu_mul_linear=triton_linear.silu_mul_linear,
            rope_cos_sin=triton_ops.rope_cos_sin,
            qkv_prepare=triton_ops.qkv_prepare,
            sample_from_cdf=triton_sampling.sample_from_cdf,
            apply_penalties=triton_sampling.apply_penalties,
            paged_attention=triton_attention.paged_attention,
            make_decode_mirror=None,
            pack_linear_weight=lambda weight: weight,  # Triton kernels read the checkpoint's layout
        )
    ns = SimpleNamespace(**ops)
    for key, fn in composed.items():  # a layer and its halves around attention, over the ops chosen above
        setattr(ns, key, functools.partial(fn, ns))
    return ns
