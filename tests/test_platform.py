"""Host-side settings of platform.py that change what the process does."""

import platform
import subprocess
import sys

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
