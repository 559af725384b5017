"""Shared fixtures: one long-lived gloo worker pool per world size for the whole session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

_POOLS: dict = {}


@pytest.fixture(scope="session")
def pools():
    """pools(n) -> a WorkerPool of n gloo processes, started once and restarted if a test broke it."""
    from shoal.pool import WorkerPool

    def get(n: int) -> WorkerPool:
        pool = _POOLS.get(n)
        if pool is None or not pool.alive:
            pool = _POOLS[n] = WorkerPool(n)
        return pool

    yield get
    for pool in _POOLS.values():
        pool.close()
