"""The C allocator of CPU workers: jemalloc where a libjemalloc is found, glibc's malloc otherwise.

On CPUs host memory is the device memory, and torch allocates a tensor with the C library's malloc. glibc's
keeps freed tensors in its heap and fragments it: `small`'s resident peak ran 4-31% above the planner's
prediction, 114-464 MB a rank held freed (bench/memory_model.py). Returning every tensor to the kernel instead
(a fixed 64 KiB mmap threshold) ends that but costs 40% of the speed, each allocation faulting in fresh pages.
jemalloc reuses freed memory by size class: `small`'s resident peaks came 13-20% lower and within -4% to +17% of
the planner's, at 5-11% of the speed (bench/cpu_allocator.py). torch's own CPU launcher
(torch.backends.xeon.run_cpu) preloads jemalloc or tcmalloc the same way, through LD_PRELOAD, so only processes
started after the choice get it: the workers `shoal train` launches. Under torchrun the user preloads it
(README).

SHOAL_ALLOCATOR=glibc keeps glibc's malloc; a LD_PRELOAD of the user's own is left alone; `make setup` puts
Debian's libjemalloc2 in the environment's lib folder where apt can fetch it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

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


def worker_env(device: str) -> dict[str, str]:
    """What to add to the environment of CPU workers about to start: LD_PRELOAD of jemalloc (at its own defaults,
    or the user's MALLOC_CONF; its background thread, which torch's launcher turns on, cost a one-process run
    a tenth of its speed here, bench/cpu_allocator.py), or nothing (GPU workers, SHOAL_ALLOCATOR=glibc, the
    user's own LD_PRELOAD, no jemalloc found). ValueError for SHOAL_ALLOCATOR=jemalloc where none is found."""
    wanted = choice()
    if device != "cpu" or wanted == "glibc" or os.environ.get("LD_PRELOAD"):
        return {}
    path = find_jemalloc()
    if path is None:
        if wanted == "jemalloc":
            raise ValueError(f"SHOAL_ALLOCATOR=jemalloc: no libjemalloc found ({NOT_FOUND}); valid: auto, glibc")
        return {}
    return {"LD_PRELOAD": path}


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
        return f"jemalloc ({preload})"
    if preload:
        return f"as preloaded: {preload}"
    why = "SHOAL_ALLOCATOR=glibc" if os.environ.get("SHOAL_ALLOCATOR") == "glibc" else "no libjemalloc found"
    return f"glibc's malloc ({why}: freed tensors stay in its heap, see README)"
