"""The one module that knows device vendors: device choice, memory, synchronisation.

Everything else asks this module and stays device-neutral (the same code runs on CUDA, XPU and CPU).
"""

from __future__ import annotations

import os

import torch

DEVICE_CHOICES = ("auto", "cuda", "xpu", "cpu")


def _has_xpu() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def resolve_device(name: str = "auto") -> torch.device:
    """auto prefers cuda, then xpu, then cpu."""
    if name not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {name!r}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _has_xpu():
            return torch.device("xpu")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    if name == "xpu" and not _has_xpu():
        raise ValueError("device 'xpu' was asked for but torch sees no XPU device")
    return torch.device(name)


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory."""
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, val = line.split(":", 1)
                info[key] = int(val.split()[0]) * 1024
        return info.get("MemAvailable", info["MemFree"]), info["MemTotal"]
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total // 2, total


def memory_info(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes on `device`."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    if device.type == "xpu":
        return torch.xpu.mem_get_info(device)
    return host_memory()


def cpu_threads_for_engine() -> int:
    """Compute threads for a CPU engine process beside the (light) HTTP server process: all cores,
    unless OMP_NUM_THREADS says otherwise. Measured on 2 cores: 2 threads gave TTFT/TPOT p50
    177/60 ms against 243-299/95-105 ms with one core left to the server (docs/BENCHMARKS.md)."""
    if "OMP_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, os.cpu_count() or 1)
