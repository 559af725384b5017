"""A pool of gloo processes that run functions on every rank: the parity tests' worker pool and
the planner's calibration (shoal.calibration.calibrate) both run their work on one.

`WorkerPool(n)` starts n processes once (by shoal.infra.launch.START_METHOD, as `launch` starts its
workers; one thread each; one process group reused by every function run on it), runs picklable
functions on all ranks and returns each rank's result. It does not start them through `launch`: torch's
elastic launcher runs one function to its end, and a pool's workers wait for the next one.
A failure on any rank, a rank that dies, or a silence past the timeout tears the pool down and
raises an error naming the rank, so one broken task cannot wedge the next. A rank that dies makes
its peers fail too ("Connection reset by peer"), often before its death is seen: the pool waits a
moment after an error and names a dead rank, with its signal, as the cause. A worker that dies of
a fatal signal (a crash in C code) prints every thread's Python stack first (faulthandler).

A function can `report(message)` as it goes: the pool hands each report to its `on_report`
callback (progress).

The processes meet through a FileStore in a temporary folder rather than a TCP port (`launch`'s
free_port), so two pools (a calibration beside a test run) cannot race for the same port.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shoal.infra.launch import START_METHOD
from shoal.infra.world import use_threads

DEATH_WAIT_S = 1.0
"""After a rank's error, how long the pool watches for a peer's death that caused it."""

_reports: Any = None
"""In a worker: the queue that `report` puts on (None elsewhere)."""


def report(message: Any) -> None:
    """From a function running on a pool: hand `message` (picklable) to the pool's `on_report`.
    Does nothing outside a pool."""
    if _reports is not None:
        _reports.put(("report", dist.get_rank(), message))


def _worker_main(rank: int, world_size: int, store_path: str, tasks: Any, results: Any) -> None:
    global _reports
    use_threads(1)
    faulthandler.enable(all_threads=True)  # a crash in C code (SIGSEGV, SIGABRT) says where Python was
    _reports = results
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put(("result", rank, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 (report everything, the parent decides)
            results.put(("error", rank, traceback.format_exc()))
    dist.destroy_process_group()


class WorkerPool:
    """n long-lived gloo processes that run functions on every rank."""

    def __init__(self, world_size: int, *, timeout_s: float = 300.0,
                 on_report: Callable[[int, Any], None] | None = None) -> None:
        """`timeout_s`: the longest a run may go without a result or a report from any rank.
        `on_report(rank, message)`: called in this process for every `report` of a running function."""
        self.world_size, self.timeout_s = world_size, timeout_s
        self._on_report = on_report
        ctx = torch.multiprocessing.get_context(START_METHOD)
        self._dir = tempfile.mkdtemp(prefix="shoal-pool-")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        store = os.path.join(self._dir, "store")
        self._procs = [
            ctx.Process(target=_worker_main, args=(r, world_size, store, self._tasks[r], self._results), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """fn(*args, **kwargs) on every rank; the results in rank order."""
        if not self.alive:
            raise RuntimeError(f"the {self.world_size}-process worker pool is not running (an earlier task broke it)")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(out) < self.world_size:
            try:
                kind, rank, payload = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    if dead:
                        raise RuntimeError(f"{fn.__name__}: rank {dead[0][0]} of {self.world_size} "
                                           f"{_exit_words(dead[0][1])}") from None
                    missing = sorted(set(range(self.world_size)) - set(out))
                    raise TimeoutError(f"{fn.__name__}: rank(s) {missing} gave no answer in "
                                       f"{self.timeout_s:.0f} s") from None
                continue
            deadline = time.monotonic() + self.timeout_s
            if kind == "report":
                if self._on_report is not None:
                    self._on_report(rank, payload)
                continue
            if kind == "error":
                dead = self._dead_within(DEATH_WAIT_S)
                self.close()
                if dead:  # the error is most likely this death seen from a peer
                    died, code = dead[0]
                    raise RuntimeError(f"{fn.__name__}: rank {died} of {self.world_size} {_exit_words(code)}; "
                                       f"then rank {rank} failed:\n{payload}")
                raise RuntimeError(f"{fn.__name__} failed on rank {rank} of {self.world_size}:\n{payload}")
            out[rank] = payload
        return [out[r] for r in range(self.world_size)]

    def _dead_within(self, seconds: float) -> list[tuple[int, int | None]]:
        """The ranks (and exit codes) that are dead now or die within `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)

    def close(self) -> None:
        for p, q in zip(self._procs, self._tasks):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(self._dir, ignore_errors=True)


def _exit_words(code: int | None) -> str:
    """'exited with code 3', or 'was killed by SIGABRT' for a negative (signal) exit code."""
    names = {s.value: s.name for s in signal.Signals}
    if code is not None and -code in names:
        return f"was killed by {names[-code]}"
    return f"exited with code {code}"
