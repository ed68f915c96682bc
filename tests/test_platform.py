"""Host-side settings of platform.py that change what the process does."""

import ctypes
import ctypes.util
import platform

import torch

from arcserve.platform import keep_host_memory_mapped


class _MallInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def test_keep_host_memory_mapped_serves_step_sized_buffers_from_the_heap():
    """After the CPU engine's allocator setting, a 16 MB buffer (a prefill activation) comes from
    malloc's heap, reused after a free, not from a fresh mapping that the OS must fault in page by
    page; buffers over 32 MB still get their own mapping."""
    if platform.libc_ver()[0] != "glibc":  # mallopt is glibc's: elsewhere nothing changes
        assert keep_host_memory_mapped() is False
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo.restype = _MallInfo
    assert keep_host_memory_mapped() is True
    before = libc.mallinfo().hblks
    a = torch.empty(16 << 20, dtype=torch.uint8)
    assert libc.mallinfo().hblks == before
    b = torch.empty(256 << 20, dtype=torch.uint8)
    assert libc.mallinfo().hblks == before + 1
    del a, b
