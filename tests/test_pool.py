"""The worker pool (shoal/infra/pool.py) that the parity tests and the calibration share: results in rank
order, reports while a function runs, and a rank that fails or dies named in one error."""

from __future__ import annotations

import os

import pytest

from shoal.infra.pool import WorkerPool, report


def _rank_and_reports() -> int:
    import torch.distributed as dist

    report(f"half way on {dist.get_rank()}")
    report("done")
    return dist.get_rank()


def _fail_on_rank_1() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("broken")


def _die_on_rank_1() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)


def _crash_on_rank_1_while_rank_0_waits() -> None:
    import signal

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGABRT)  # as glibc's abort on a corrupted heap
    dist.all_reduce(torch.ones(1))


def test_results_reports_and_failures():
    heard: list[tuple[int, str]] = []
    pool = WorkerPool(2, on_report=lambda rank, message: heard.append((rank, message)))
    try:
        assert pool.run(_rank_and_reports) == [0, 1]
        assert sorted(heard) == [(0, "done"), (0, "half way on 0"), (1, "done"), (1, "half way on 1")]
        with pytest.raises(RuntimeError, match=r"(?s)_fail_on_rank_1 failed on rank 1 of 2:\n.*KeyError: 'broken'"):
            pool.run(_fail_on_rank_1)
        assert not pool.alive  # torn down: the next task gets a fresh pool
    finally:
        pool.close()
    pool = WorkerPool(2)
    try:
        with pytest.raises(RuntimeError, match="_die_on_rank_1: rank 1 of 2 exited with code 3"):
            pool.run(_die_on_rank_1)
    finally:
        pool.close()


def test_a_crashed_rank_is_named_as_the_cause_of_its_peers_failure():
    """Rank 0's error is the lost connection; the rank that died (and its signal) is the cause."""
    pool = WorkerPool(2)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)_crash_on_rank_1_while_rank_0_waits: rank 1 of 2 was killed by "
                                               r"SIGABRT(; then rank 0 failed:\n.*)?$") as caught:
            pool.run(_crash_on_rank_1_while_rank_0_waits)
        assert "exited with code" not in str(caught.value)
    finally:
        pool.close()


def _abort_on_rank_1_once(marker: str) -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()  # as glibc aborts a process whose heap it finds corrupt
    return dist.get_rank()


def _abort_on_rank_1() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.abort()


def test_the_tests_pools_rerun_a_task_once_after_a_crash_in_c(pools, tmp_path):
    """The test suite's `pools` (tests/conftest.py) run a task whose worker was killed by SIGABRT once more on a
    fresh pool; a task that crashes again fails, and a Python error is never rerun."""
    marker = tmp_path / "crashed"
    assert pools(2).run(_abort_on_rank_1_once, str(marker)) == [0, 1]
    assert marker.exists()  # the first run did crash
    with pytest.raises(RuntimeError, match="rank 1 of 2 was killed by SIGABRT"):
        pools(2).run(_abort_on_rank_1)
    with pytest.raises(RuntimeError, match="rank 1 of 2"):
        pools(2).run(_fail_on_rank_1)
