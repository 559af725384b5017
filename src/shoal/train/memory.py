"""Peak memory of this process, per step.

On CUDA, torch's allocator statistics. On CPU torch keeps no allocator statistics and
tracemalloc does not see tensors, so we use the kernel's resident-set high-water mark:
writing "5" to /proc/self/clear_refs resets VmHWM to the current RSS (Linux), and VmHWM
read from /proc/self/status after the step is that step's peak.
"""

from __future__ import annotations

import resource
from pathlib import Path

import torch

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
