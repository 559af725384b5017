"""Shared fixtures: one long-lived gloo worker pool per world size for the whole session."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

_POOLS: dict = {}
_RERUNS: list[str] = []

CRASH = re.compile(r"rank \d+ of \d+ was killed by SIG(ABRT|SEGV|BUS)")
"""A worker process killed by the C library or the kernel, not failed by Python: shoal's code is Python, so this
is a crash inside torch's C++ (such as glibc's "malloc(): unaligned tcache chunk detected" in a gloo worker, rare and
not reproducible alone). A task that dies so is run once more on a fresh pool; the rerun must pass by itself, and the
session's summary lists every rerun, so the crash stays visible."""


class _Pools:
    """pools(n).run(fn, ...): `WorkerPool.run` on the session's pool of n processes, once more on a fresh pool
    where a worker crashed in C (CRASH)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> list[Any]:
        try:
            return _pool(self.n).run(fn, *args, **kwargs)
        except RuntimeError as exc:
            crash = CRASH.search(str(exc))
            if crash is None:
                raise
            _RERUNS.append(f"{os.environ.get('PYTEST_CURRENT_TEST', fn.__name__)}: {crash.group(0)}")
            return _pool(self.n).run(fn, *args, **kwargs)


def _pool(n: int) -> Any:
    """The session's WorkerPool of n gloo processes, started once and restarted if a task broke it."""
    from shoal.infra.pool import WorkerPool

    pool = _POOLS.get(n)
    if pool is None or not pool.alive:
        pool = _POOLS[n] = WorkerPool(n)
    return pool


@pytest.fixture(scope="session")
def pools():
    """pools(n) -> the session's pool of n gloo processes (see _Pools)."""
    yield _Pools
    for pool in _POOLS.values():
        pool.close()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Every task rerun after a worker's C-level crash, named (see CRASH)."""
    if _RERUNS:
        terminalreporter.section("tasks rerun after a worker crashed in C", sep="!", red=True, bold=True)
        for line in _RERUNS:
            terminalreporter.line(line, red=True, bold=True)
        terminalreporter.line(f"{len(_RERUNS)} task(s) passed only on a fresh pool: a crash in C happened (its signal "
                              "above); bench/soak.py --tests counts them", red=True, bold=True)
