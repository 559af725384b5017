"""Peak memory of this process, per step.

On CUDA, torch's allocator statistics. On CPU torch keeps no allocator statistics and
tracemalloc does not see tensors, so we use the kernel's resident-set high-water mark:
writing "5" to /proc/self/clear_refs resets VmHWM to the current RSS (Linux), and VmHWM
read from /proc/self/status after the step is that step's peak.
"""

from __future__ import annotations

import ctypes
import functools
import resource
from pathlib import Path
from typing import Any

import torch

from shoal.infra import host_memory

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _status_mb(key: str) -> float | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def reset_peak() -> None:
    """Start a new peak-measurement window."""
    if _cuda():
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:  # not Linux, or not permitted: peak_mb then reports the lifetime peak
        pass


def peak_mb() -> float:
    """Peak memory (MiB) since the last reset_peak(): GPU allocated bytes, or CPU resident set."""
    if _cuda():
        return torch.cuda.max_memory_allocated() / 2**20
    hwm = _status_mb("VmHWM")
    if hwm is not None:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_mb() -> float:
    """Memory in use now (MiB): GPU allocated bytes, or CPU resident set."""
    if _cuda():
        return torch.cuda.memory_allocated() / 2**20
    rss = _status_mb("VmRSS")
    return rss if rss is not None else peak_mb()


def allocator_held_mb() -> float | None:
    """Memory the allocator holds freed for reuse now (MiB), a part of the resident set (or of
    CUDA's reserved memory) that no tensor owns: on CUDA torch's cached blocks (reserved minus
    allocated); on CPU glibc's free chunks over all its arenas (mallinfo2's `fordblks`: freed
    blocks kept in the heap instead of returned to the OS); under jemalloc (shoal.infra.host_memory) its resident
    pages less those allocated and its metadata. None under another allocator."""
    if _cuda():
        return (torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / 2**20
    mallinfo2 = _mallinfo2()
    if mallinfo2 is not None:
        return mallinfo2().fordblks / 2**20
    stat = _jemalloc_stat()
    if stat is None:
        return None
    return (stat("stats.resident") - stat("stats.allocated") - stat("stats.metadata")) / 2**20


@functools.cache
def _jemalloc_stat() -> Any:
    """name -> jemalloc's statistic of that name, fresh (its `epoch` advanced), or None where jemalloc is not
    the malloc in use."""
    mallctl = host_memory.mallctl()
    if mallctl is None:
        return None

    def stat(name: str) -> int:
        epoch = ctypes.c_uint64(1)
        mallctl(b"epoch", None, None, ctypes.byref(epoch), ctypes.sizeof(epoch))
        value = host_memory.mallctl_read(mallctl, name)
        if value is None:
            raise OSError(f"jemalloc has no statistic {name}")
        return value

    return stat


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _mallinfo2() -> Any:
    """glibc's mallinfo2 (2.33 and later), or None: torch exposes no CPU allocator statistics, so we
    ask the C library that holds the memory. None too where another allocator (jemalloc, mimalloc
    through LD_PRELOAD) is the process's malloc: glibc's arenas then hold nothing."""
    try:
        process, libc = ctypes.CDLL(None), ctypes.CDLL("libc.so.6")
        fn = process.mallinfo2
    except (OSError, AttributeError):
        return None
    if ctypes.cast(process.malloc, ctypes.c_void_p).value != ctypes.cast(libc.malloc, ctypes.c_void_p).value:
        return None
    fn.restype = _Mallinfo2
    return fn


class TensorPeak:
    """The peak bytes of live tensors over a window (MiB), the quantity the planner predicts.

    The resident set on CPU also holds what no tensor owns: memory the C allocator keeps after a
    free, the communication library's buffers, thread stacks. On CUDA the allocator's own peak
    is the tensor peak; on CPU torch keeps no such statistic, so this counts tensor storages with
    torch's MemTracker (torch.distributed._tools, a private module: where it is missing or fails,
    `peak_mb` stays None and only the resident figures are reported)."""

    def __init__(self, *tracked: Any) -> None:
        self.peak_mb: float | None = None
        self._tracked = tracked
        self._tracker: Any = None

    def __enter__(self) -> TensorPeak:
        if _cuda():
            torch.cuda.reset_peak_memory_stats()
            return self
        try:
            tracker = _total_tracker()
            tracker.track_external(*self._tracked)
            tracker.__enter__()
            self._tracker = tracker
        except Exception:  # a private API: any failure leaves only the resident figures
            self._tracker = None
        return self

    def __exit__(self, *exc: object) -> None:
        if _cuda():
            self.peak_mb = torch.cuda.max_memory_allocated() / 2**20
            return
        tracker = self._tracker
        if tracker is None:
            return
        try:
            tracker.__exit__(*exc)
            peak = tracker.get_tracker_snapshot("peak")
            self.peak_mb = sum(stats.get("Total", 0) for stats in peak.values()) / 2**20
        except Exception:
            self.peak_mb = None


def _total_tracker() -> Any:
    """torch's MemTracker counting the total only: its per-module statistics refuse a module that
    runs twice in a step (a pipeline stage runs once per micro-batch), and we need none of them."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class TotalOnly(MemTracker):
        def _pre_fw_hook(self, *args: Any) -> None:
            pass

        def _post_fw_hook(self, *args: Any) -> None:
            pass

        def _pre_bw_hook(self, *args: Any) -> None:
            pass

        def _post_bw_hook(self, *args: Any) -> None:
            pass

    return TotalOnly()
