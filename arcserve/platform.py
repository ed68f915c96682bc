"""The one module that knows device vendors: device choice, memory, synchronisation, graph capture,
distributed backend names and Triton launch options.

Everything else asks this module and stays device-neutral (the same code runs on CUDA, XPU and CPU).
"""

from __future__ import annotations

import functools
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


@functools.cache
def cpu_matrix_tiles(dtype: torch.dtype) -> bool:
    """Whether the host CPU has matrix tiles for products in this half dtype (AMX: amx_bf16 for
    bf16, amx_fp16 for fp16), as torch reads the CPU's features."""
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        return bool(caps().get("amx_bf16" if dtype == torch.bfloat16 else "amx_fp16"))
    tiles = getattr(torch.cpu, "_is_amx_tile_supported", None)  # (older torch: bf16 tiles only)
    return dtype == torch.bfloat16 and tiles is not None and bool(tiles())


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


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


@functools.cache
def keep_host_memory_mapped() -> bool:
    """Have glibc's malloc keep freed memory for reuse instead of returning it to the OS at once
    (process-wide, once; a CPU engine calls it). Activations of a step are freed and allocated
    again at the next one; by default every allocation over glibc's threshold (128 KB up to 32
    MB, adjusted as it goes) is a fresh mapping, and the OS page-faults every 4 KB of it in again
    (~1.4 us a page on the 2-vCPU VM of docs/BENCHMARKS.md): a 2,048-token prefill step of
    SmolLM2 took 770 ms instead of 1,080 ms with this set. Allocations up to 32 MB then come from
    the heap, and the heap's top is trimmed only past 1 GiB of free memory. False where the C
    library is not glibc (nothing changed)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(p, v) == 1 for p, v in (
        (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20)))  # fmt: skip


# ---- Triton --------------------------------------------------------------------------------------
def triton_interpreting() -> bool:
    """True when Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1: CI, CPU debugging)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available(device: torch.device) -> bool:
    """Triton kernels can run on `device`: a GPU with a Triton backend, or the interpreter on CPU."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type in ("cuda", "xpu") or (device.type == "cpu" and triton_interpreting())


def triton_min_dot_rows(device: torch.device) -> int:
    """The fewest rows a `tl.dot` operand may have on this device's Triton backend: Intel XPU wants
    16 in every dimension; NVIDIA's (and the interpreter) take fewer, which a decode tile uses: its
    rows beyond the one token's heads are padding, and 16 of them made batch-1 decode on the H100
    1.13 -> 1.33 ms per token (docs/BENCHMARKS.md)."""
    return 16 if device.type == "xpu" else 1


def fp8_kv_cache_unsupported(device: torch.device, dtype: torch.dtype, triton: bool) -> str | None:
    """Why an 8-bit float KV cache of `dtype` cannot run on `device` (through the Triton kernels
    when `triton`), or None when it can. torch converts both formats everywhere. NVIDIA GPUs
    convert float8 e4m3 in hardware from compute capability 8.9 (Ada, Hopper), where Triton
    supports it; e5m2 also on older ones. ROCm builds are refused (untested; AMD's float8 formats
    differ). Triton's CPU interpreter rounds float8 wrongly (no carry into the exponent, 124.5 ->
    64; no subnormals), so it is refused there."""
    if device.type == "cuda" and torch.version.hip:
        return "8-bit KV caches are not supported on ROCm builds of torch (untested)"
    if not triton:
        return None
    if device.type == "cpu":
        return ("Triton's interpreter converts float8 values incorrectly (no rounding carry, no subnormals); "
                "use kernels='torch', the CPU's default")  # fmt: skip
    if device.type == "cuda" and dtype == torch.float8_e4m3fn:
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            return (f"float8 e4m3 in the Triton kernels needs compute capability 8.9 or newer; this GPU has "
                    f"{cap[0]}.{cap[1]} (fp8_e5m2, or kernels='torch', runs here)")  # fmt: skip
    return None


def triton_launch_options(device: torch.device) -> dict:
    """Backend-specific options for every Triton launch on `device`:
    - Intel XPU: large register files (grf_mode);
    - NVIDIA from Hopper on: programmatic dependent launch. A kernel is launched while the one before
      it still runs, does what needs nothing of that one's output (the GEMV streams its weights),
      then waits for it (`triton_grid_dependency`). `launch_pdl` tells the driver, `PDL` the kernel:
      every arcserve kernel takes that flag. At batch 1 a decode step is ~170 small kernels, and the
      gap between two of them is most of the time of the small ones. ARCSERVE_PDL=0 turns it off.
    Cached per device: asked at every launch, and the answer does not change within a process."""
    return _launch_options(device.type, device.index)


@functools.cache
def _launch_options(kind: str, index: int | None) -> dict:
    if triton_interpreting():
        return {}
    if kind == "xpu":
        return {"grf_mode": "large"}
    if kind == "cuda" and os.environ.get("ARCSERVE_PDL", "1") != "0":
        wait, _ = triton_grid_dependency()
        major = torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device())[0]
        if wait is not None and major >= 9:
            return {"launch_pdl": True, "PDL": True}
    return {}


@functools.cache
def triton_grid_dependency() -> tuple:
    """(wait, launch_dependents): the Triton builtins of programmatic dependent launch, for kernels
    to call where triton_launch_options gave them PDL=True; (None, None) where this Triton has none.
    wait blocks until the kernel before has finished and its writes are visible; launch_dependents
    lets the kernel after start early."""
    import triton.language as tl

    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    if cuda is None or not hasattr(cuda, "gdc_wait"):
        return None, None
    return cuda.gdc_wait, cuda.gdc_launch_dependents


@functools.cache
def compute_units(device: torch.device) -> int:
    """Streaming multiprocessors (CUDA) / Xe cores (XPU) / CPU cores: how many programs fill the device."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "xpu":
        return getattr(torch.xpu.get_device_properties(device), "gpu_subslice_count", 64)
    return os.cpu_count() or 1


# ---- synchronisation, memory statistics, graphs ----------------------------------------------
def _backend(device: torch.device):
    """torch.cuda or torch.xpu for a GPU device (None on CPU)."""
    return {"cuda": torch.cuda, "xpu": getattr(torch, "xpu", None)}.get(device.type)


def synchronize(device: torch.device) -> None:
    b = _backend(device)
    if b is not None:
        b.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    b = _backend(device)
    if b is not None:
        b.empty_cache()
        b.reset_peak_memory_stats(device)


def memory_allocated(device: torch.device) -> tuple[int, int]:
    """(bytes allocated now, peak since reset_peak_memory) by torch on `device`; (0, 0) on CPU."""
    b = _backend(device)
    if b is None:
        return 0, 0
    return b.memory_allocated(device), b.max_memory_allocated(device)


def empty_cache(device: torch.device) -> None:
    b = _backend(device)
    if b is not None:
        b.empty_cache()


def graphs_supported(device: torch.device) -> bool:
    """Graph capture of decode steps: CUDA graphs; XPU graphs where the installed torch has them."""
    if device.type == "cuda":
        return True
    return device.type == "xpu" and hasattr(torch.xpu, "XPUGraph")


def new_graph(device: torch.device):
    return torch.cuda.CUDAGraph() if device.type == "cuda" else torch.xpu.XPUGraph()


def graph_pool(device: torch.device):
    return torch.cuda.graph_pool_handle() if device.type == "cuda" else torch.xpu.graph_pool_handle()


def capture(graph, device: torch.device, pool):
    """Context manager that records the work issued inside it into `graph` (on a side stream)."""
    return torch.cuda.graph(graph, pool=pool) if device.type == "cuda" else torch.xpu.graph(graph, pool=pool)


def pin_memory_available(device: torch.device) -> bool:
    return device.type in ("cuda", "xpu")


def distributed_backend(device: torch.device) -> str:
    return {"cuda": "nccl", "xpu": "xccl"}.get(device.type, "gloo")


def to_device(array, device: torch.device) -> torch.Tensor:
    """A host array (numpy or CPU tensor) on `device` without blocking the host: through pinned memory
    and an asynchronous copy on GPUs (torch's pinned-memory cache keeps the staging buffer until the
    copy has run), as is on the CPU. A plain `.to(device)` from pageable memory waits for the device
    to go idle, which would undo overlapped steps."""
    t = torch.from_numpy(array) if not isinstance(array, torch.Tensor) else array
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def to_host_async(t: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor to (pinned) host memory; valid after the step's event (new_event)."""
    return t if t.device.type == "cpu" else t.to("cpu", non_blocking=True)


def new_stream(device: torch.device):
    """A side stream on a GPU device (benchmarks that run work side by side)."""
    return _backend(device).Stream(device)


def current_stream(device: torch.device):
    return _backend(device).current_stream(device)


def on_stream(stream):
    """Context manager: the work issued inside it goes to `stream`."""
    return _backend(stream.device).stream(stream)


def timing_event(device: torch.device):
    """An unrecorded event that can time device work (`a.record()`, ..., `a.elapsed_time(b)` in ms)."""
    return _backend(device).Event(enable_timing=True)


def profiler_activity(device: torch.device):
    """torch.profiler's activity that records `device`'s kernels."""
    from torch.profiler import ProfilerActivity

    return {"cuda": ProfilerActivity.CUDA, "xpu": getattr(ProfilerActivity, "XPU", None)}.get(device.type)


def blas_libraries(device: torch.device) -> tuple[str, ...]:
    """The matrix-product libraries torch can be told to prefer for `device`'s products ("default":
    torch's heuristic between the others), for benchmarks that compare them; () where this module
    offers no choice (CPUs, XPUs; ROCm's are not listed)."""
    if device.type == "cuda" and torch.version.hip is None:
        return ("default", "cublas", "cublaslt")
    return ()


def prefer_blas_library(device: torch.device, name: str) -> str:
    """Make torch prefer `name` (one of blas_libraries(device)) for the process's products on that
    kind of device; returns the name preferred before, to restore it with."""
    if name not in blas_libraries(device):
        raise ValueError(f"{name!r} is not a matrix-product library torch can prefer on {device} "
                         f"(choices: {', '.join(blas_libraries(device)) or 'none'})")  # fmt: skip
    before = torch.backends.cuda.preferred_blas_library().name.lower()
    torch.backends.cuda.preferred_blas_library(name)
    return before


def new_event(device: torch.device):
    """An event recorded on the device's current stream now (None on the CPU, where work is done when
    issued). wait_event(event) blocks the host until the device has passed it."""
    b = _backend(device)
    if b is None:
        return None
    e = b.Event()
    e.record()
    return e


def wait_event(event) -> None:
    if event is not None:
        event.synchronize()
