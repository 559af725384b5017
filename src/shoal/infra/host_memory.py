"""The C allocator of CPU workers: jemalloc where a libjemalloc is found, glibc's malloc otherwise.

On CPUs host memory is the device memory, and torch allocates a tensor with the C library's malloc. glibc's
keeps freed tensors in its heap and fragments it, so a rank's resident peak rises above the live tensors the
planner predicts; returning every tensor to the kernel instead (a fixed 64 KiB mmap threshold) ends that but
faults in fresh pages on each allocation. jemalloc reuses freed memory by size class; kept for reuse
(KEEP_FREED) rather than returned to the kernel, it runs at glibc's speed with lower resident peaks, near the
planner's prediction (bench/cpu_allocator.py and bench/memory_model.py measure both; docs/measurements.md).
torch's own CPU launcher (torch.backends.xeon.run_cpu) preloads jemalloc or tcmalloc the same way, through
LD_PRELOAD, so only processes started after the choice get it: the workers `shoal train` launches. Under
torchrun the user preloads it (README).

SHOAL_ALLOCATOR=glibc keeps glibc's malloc; a LD_PRELOAD of the user's own is left alone; `make setup` puts
Debian's libjemalloc2 in the environment's lib folder where apt can fetch it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHOICES = ("auto", "jemalloc", "glibc")
NAMES = ("libjemalloc.so.2", "libjemalloc.so")
NOT_FOUND = "looked for libjemalloc.so.2 in the environment's lib folder and the system's; `make setup` fetches it"


def search_path() -> list[Path]:
    """Where a libjemalloc is looked for: this environment's lib folder first (where `make setup` puts
    one), then the system's."""
    prefixes = [sys.prefix, os.environ.get("VIRTUAL_ENV", ""), os.environ.get("CONDA_PREFIX", "")]
    found = [Path(p) / "lib" for p in prefixes if p]
    return [*found, *map(Path, ("/usr/local/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
                                "/usr/lib64", "/usr/lib"))]


def find_jemalloc() -> str | None:
    """The path of a libjemalloc shared library, or None."""
    for folder in search_path():
        for name in NAMES:
            if (folder / name).is_file():
                return str(folder / name)
    return None


def choice() -> str:
    """SHOAL_ALLOCATOR (auto, jemalloc or glibc); ValueError naming the valid ones."""
    value = os.environ.get("SHOAL_ALLOCATOR", "auto")
    if value not in CHOICES:
        raise ValueError(f"SHOAL_ALLOCATOR={value!r} is not an allocator; valid: {', '.join(CHOICES)}")
    return value


KEEP_FREED = "dirty_decay_ms:-1"
"""jemalloc's MALLOC_CONF for CPU workers: keep freed pages for reuse instead of returning them to the kernel (its
default decay time, 10 s, returns most of a step's freed pages within the step; jemalloc's TUNING.md: the decay
times trade memory for CPU). A training step frees and reallocates the same sizes every step, so returned pages
are only faulted in again: kept, a step runs faster at the same resident peak, and the peak does not depend on
how much an earlier step returned (bench/cpu_allocator.py, bench/memory_model.py; docs/measurements.md). Blocks
of 8 MiB and more are still returned at once (return_large_blocks)."""


def worker_env(device: str) -> dict[str, str]:
    """What to add to the environment of CPU workers about to start: LD_PRELOAD of jemalloc, with KEEP_FREED
    unless the user set MALLOC_CONF (jemalloc's background thread, which torch's launcher turns on, slows a
    one-process run: bench/cpu_allocator.py's jemalloc-bg), or nothing (GPU workers,
    SHOAL_ALLOCATOR=glibc, the user's own LD_PRELOAD, no jemalloc found). ValueError for SHOAL_ALLOCATOR=jemalloc
    where none is found."""
    wanted = choice()
    if device != "cpu" or wanted == "glibc" or os.environ.get("LD_PRELOAD"):
        return {}
    path = find_jemalloc()
    if path is None:
        if wanted == "jemalloc":
            raise ValueError(f"SHOAL_ALLOCATOR=jemalloc: no libjemalloc found ({NOT_FOUND}); valid: auto, glibc")
        return {}
    return {"LD_PRELOAD": path, **({} if "MALLOC_CONF" in os.environ else {"MALLOC_CONF": KEEP_FREED})}


@contextlib.contextmanager
def for_workers(device: str) -> Iterator[None]:
    """While open, processes started from this one get `worker_env(device)` (os.environ restored after)."""
    env = worker_env(device)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def describe() -> str:
    """This process's C allocator in words (a worker's start-up line)."""
    preload = os.environ.get("LD_PRELOAD", "")
    if "jemalloc" in preload:
        conf = os.environ.get("MALLOC_CONF")
        return f"jemalloc ({preload}{f'; MALLOC_CONF={conf}' if conf else ''})"
    if preload:
        return f"as preloaded: {preload}"
    why = "SHOAL_ALLOCATOR=glibc" if os.environ.get("SHOAL_ALLOCATOR") == "glibc" else "no libjemalloc found"
    return f"glibc's malloc ({why}: freed tensors stay in its heap, see README)"


def mallctl() -> Any:
    """jemalloc's mallctl(name, oldp, oldlenp, newp, newlen) in this process, or None where jemalloc is not the
    malloc in use: torch keeps no CPU allocator statistics or settings, so shoal asks the allocator."""
    try:
        fn = ctypes.CDLL(None).mallctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


def mallctl_read(fn: Any, name: str, kind: Any = ctypes.c_size_t) -> Any:
    """jemalloc's `name` read through `fn` (mallctl()) as a `kind` (a ctypes type), or None where it has none."""
    value, size = kind(0), ctypes.c_size_t(ctypes.sizeof(kind))
    return value.value if fn(name.encode(), ctypes.byref(value), ctypes.byref(size), None, 0) == 0 else None


def return_large_blocks() -> bool:
    """In a process on jemalloc that keeps freed pages (decay time -1, KEEP_FREED): have jemalloc's arena for
    blocks of its oversize threshold (8 MiB) and more return them to the kernel as soon as they are freed,
    which jemalloc itself does only when the decay time is positive (arena.c, arena_create_huge_arena: "less
    immediate reuse is expected for huge allocations"). Kept, the set-up copies of a large model's tables
    would stay resident through every step (bench/memory_model.py's 512M model shows it). MALLOC_CONF cannot
    say it (the arena takes the default decay time), so it is set here through mallctl, on the arena a first
    such block lands in. True where it was set."""
    fn = mallctl()
    if fn is None or mallctl_read(fn, "opt.dirty_decay_ms", ctypes.c_ssize_t) != -1:
        return False
    threshold = mallctl_read(fn, "opt.oversize_threshold")
    if not threshold:  # no such arena
        return False
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block = ctypes.c_void_p(libc.malloc(threshold))
    arena, size = ctypes.c_uint(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_uint))
    found = fn(b"arenas.lookup", ctypes.byref(arena), ctypes.byref(size), ctypes.byref(block), ctypes.sizeof(block))
    libc.free(block)
    if found != 0:
        return False
    now = ctypes.c_ssize_t(0)
    return all(fn(f"arena.{arena.value}.{kind}_decay_ms".encode(), None, None, ctypes.byref(now),
                  ctypes.sizeof(now)) == 0 for kind in ("dirty", "muzzy"))
