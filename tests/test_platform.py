"""platform.py: host-side settings that change what the process does, and the device helpers benchmarks use."""

import platform
import subprocess
import sys

import pytest
from conftest import DEVICE

# A fresh interpreter allocates 16 MB with glibc's malloc, with and without the CPU engine's setting,
# and prints how many blocks malloc has mapped on their own before and after (mallinfo().hblks).
_PROBE = """
import ctypes, ctypes.util, sys
from arcserve.platform import keep_host_memory_mapped
class MallInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                            "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo.restype, libc.malloc.restype = MallInfo, ctypes.c_void_p
setting = keep_host_memory_mapped() if sys.argv[1] == "on" else None
before = libc.mallinfo().hblks
p = libc.malloc(16 << 20)
print(setting, libc.mallinfo().hblks - before)
"""


def _probe(mode: str) -> str:
    return subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True).stdout.split()


def test_keep_host_memory_mapped_serves_step_sized_buffers_from_the_heap():
    """With the CPU engine's allocator setting a 16 MB buffer (a prefill activation) comes from
    malloc's heap, which keeps freed memory for the next step, where by default it is a mapping of
    its own that the OS faults in again page by page after every free."""
    if platform.libc_ver()[0] != "glibc":  # mallopt is glibc's: elsewhere nothing changes
        from arcserve.platform import keep_host_memory_mapped

        assert keep_host_memory_mapped() is False
        return
    assert _probe("off") == ["None", "1"]
    assert _probe("on") == ["True", "0"]


@pytest.mark.gpu
def test_side_streams_and_timing_events_on_the_gpu():
    """The stream and event helpers the GPU benchmarks use: work issued on a side stream runs there
    and is ordered by wait_stream, a timing event pair measures it, the profiler sees its kernels."""
    import torch
    from torch.profiler import profile

    from arcserve.platform import (
        current_stream,
        new_stream,
        on_stream,
        profiler_activity,
        synchronize,
        timing_event,
    )

    x = torch.randn(2048, 2048, device=DEVICE)
    main, side = current_stream(DEVICE), new_stream(DEVICE)
    assert side != main
    side.wait_stream(main)
    a, b = timing_event(DEVICE), timing_event(DEVICE)
    with on_stream(side):
        assert current_stream(DEVICE) == side
        a.record()
        y = x @ x
        b.record()
    assert current_stream(DEVICE) == main
    main.wait_stream(side)
    synchronize(DEVICE)
    assert torch.allclose(y, (x.double() @ x.double()).float(), rtol=1e-3, atol=1e-2)
    assert a.elapsed_time(b) > 0
    with profile(activities=[profiler_activity(DEVICE)]) as prof:
        x @ x
        synchronize(DEVICE)
    assert any(e.device_type != torch.autograd.DeviceType.CPU for e in prof.key_averages())


def test_profiler_activity_names_no_device_kernels_on_the_cpu():
    import torch
    from torch.profiler import ProfilerActivity

    from arcserve.platform import profiler_activity

    assert profiler_activity(torch.device("cpu")) is None
    assert profiler_activity(torch.device("cuda")) == ProfilerActivity.CUDA


def test_no_matrix_product_library_to_prefer_on_the_cpu():
    import torch

    from arcserve.platform import blas_libraries, prefer_blas_library

    assert blas_libraries(torch.device("cpu")) == ()
    with pytest.raises(ValueError, match="not a matrix-product library.*choices: none"):
        prefer_blas_library(torch.device("cpu"), "default")


@pytest.mark.gpu
def test_each_preferred_matrix_product_library_multiplies_correctly():
    """The libraries blas-libs compares: each one, once preferred, gives a product within bf16's
    error of float64's and is reported as the preference; torch's own comes back after."""
    import torch

    from arcserve.platform import blas_libraries, prefer_blas_library

    libs = blas_libraries(DEVICE)
    if DEVICE.type == "cuda" and torch.version.hip is None:
        assert libs[0] == "default" and len(libs) > 1
    with pytest.raises(ValueError, match="not a matrix-product library"):
        prefer_blas_library(DEVICE, "no-such-library")
    x = torch.randn(64, 1024, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(3072, 1024, device=DEVICE, dtype=torch.bfloat16)
    ref = x.double() @ w.double().t()
    initial = None
    try:
        for lib in libs:
            before = prefer_blas_library(DEVICE, lib)
            initial = initial or before
            y = torch.nn.functional.linear(x, w)
            assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2, lib
            assert prefer_blas_library(DEVICE, lib) == lib  # (what it returns: the one preferred before)
    finally:
        if initial:
            prefer_blas_library(DEVICE, initial)
