"""Hang detection: a rank that waits too long stops the run, naming who stopped answering and where.

Two parts, from one setting (`hang_timeout`):
- Every process group's collectives time out (torch's own per-group timeout, set here), so a
  rank waiting for a frozen or dead peer gets an error after `timeout` seconds instead of gloo's
  30 minutes. On NCCL the same timeout makes torch's NCCL watchdog abort the process.
- Every rank runs a daemon thread that adds one to its counter in a key-value store and writes
  where the rank is: at once when the loop enters a phase (a step, evaluation, a checkpoint
  write), and every beat (0.25 s, longer in large worlds to spare the store). Where the rank is
  within a step (forward, backward, optimizer; under pp its stage and micro-batch) is what the
  main thread reports itself as it moves on (`in_step`, shoal.runtime.Runtime.step_words): the
  beat thread reads no other thread's stack. When a collective fails, `diagnose` reads every
  counter twice, a few beats apart: a counter that did not move belongs to a rank that stopped
  answering, and its last report says where it was then (within a beat of when it stopped); the
  failing rank names the collective it waited in from the error's own traceback.

The store is a client of the TCPStore torch's launcher already runs (MASTER_ADDR/MASTER_PORT;
torchrun and `shoal train` both set them): a second connection, so the thread never shares one
with the main thread's collectives. torch has no cross-rank "who is stuck" report for gloo (its
flight recorder covers NCCL only), hence this small module.

The timeout is long while a run starts (loading, compiling) and during checkpoints and
evaluation, and short once steps run: `hang_timeout` seconds, or with 0 (auto) ten times the
slowest step seen, at least FLOOR_S.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

BEAT_S = 0.25
"""Seconds between a rank's reports in worlds of up to 25 ranks; larger worlds beat world/100
seconds apart (at most 5), so that the store sees at most ~200 reports a second."""
STALE_BEATS = 12
"""A counter that did not move for this many beats (3 s or more) belongs to a rank that stopped."""
PEER_EXIT_S = 1.0
"""How long a rank whose peer's connection closed waits before failing itself (see `diagnose`)."""
FLOOR_S = 30.0
"""The automatic timeout once steps run: at least this, or ten times the slowest step."""
SLOW_S = 600.0
"""Start-up (loading, compiling the first steps), checkpoints and evaluation get at least this."""
WARM_STEPS = 2
"""Steps of each invocation that still count as start-up (the first compiles)."""


class HangError(RuntimeError):
    """A collective timed out or lost its peer; the message names the ranks and where they were."""


class PeerGone(HangError):
    """A collective failed because a peer's connection closed: that peer's own failure is the cause,
    and the launcher names it first whichever of the two was recorded first."""


class Watchdog:
    """One rank's reports, its process groups' timeouts, and the diagnosis when a collective fails."""

    def __init__(self, *, timeout_s: float = 0.0) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.fixed = timeout_s  # 0: automatic
        self.slowest_step = 0.0
        self.phase, self.step, self.warm_from, self.since = "start-up", 0, 0, time.monotonic()
        self._store = _store(self.world)
        self.beat_s = min(5.0, max(BEAT_S, self.world / 100))
        self._stop, self._moved = threading.Event(), threading.Event()
        self._last_where = "start-up"
        self.in_step: Callable[[], str] = lambda: "forward"
        """Where the main thread is within a step, in words, as it reports it (read on every beat: cheap)."""
        self.detail: Callable[[], str | None] = lambda: None
        """More words on where the main thread is in an evaluation (a pipeline stage and micro-batch), or None."""
        self._set_timeout(max(self.fixed, SLOW_S))
        self._thread = threading.Thread(target=self._beat, name="shoal-watchdog", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- what the loop tells it
    def at(self, phase: str, step: int) -> None:
        """The main thread enters `phase` ("step", "evaluation", "checkpoint write", ...) at `step`."""
        self.phase, self.step, self.since = phase, step, time.monotonic()
        self._moved.set()  # the thread reports at once, not at its next beat
        slow = phase != "step" or step < self.warm_from + WARM_STEPS
        wanted = max(self.timeout_s, SLOW_S) if slow else self.timeout_s
        if wanted != self._current:
            self._set_timeout(wanted)

    def started(self, step: int) -> None:
        """Training starts (or resumes) at `step`: its first WARM_STEPS steps still count as start-up.
        The process groups of the model's mesh exist by now: they get the timeout too."""
        self.warm_from, self.step = step, step
        self._set_timeout(self._current)

    def step_took(self, seconds: float) -> None:
        """A measured step time; the automatic timeout follows the slowest."""
        self.slowest_step = max(self.slowest_step, seconds)

    @property
    def timeout_s(self) -> float:
        return self.fixed or max(FLOOR_S, 10 * self.slowest_step)

    def close(self) -> None:
        """Stop the thread and wait for it: a daemon thread still inside the store's C++ client
        when the interpreter exits can crash the process (SIGSEGV at exit)."""
        self._stop.set()
        self._moved.set()
        self._thread.join(timeout=10)

    # ---------------------------------------------------------------- the diagnosis
    def diagnose(self, error: BaseException, waited_s: float) -> HangError:
        """After a failed collective: which ranks stopped answering, and where each rank was."""
        collective = _collective(_traceback_stack(error))
        where = f"{self._last_where} ({collective})" if collective else self._last_where
        mine = f"rank {self.rank} waited {waited_s:.0f} s in {where} at step {self.step}"
        limit = f"(--hang-timeout {self._current:g})"
        if self._store is not None and self._store.check(["hang"]):
            # Another rank found who stopped and woke them: its words, and its report first.
            time.sleep(1.0)
            return HangError(self._store.get("hang").decode())
        if self._store is None or not _timed_out(error):
            # A peer's connection closed: it died of its own error (a failing rank keeps its group
            # open until it exits, shoal/train/worker.py), which the launcher names first; a
            # short wait lets that exit be seen before this one.
            time.sleep(PEER_EXIT_S)
            return PeerGone(f"{mine} {limit}: {_first_line(error)}")
        before = self._counters()
        time.sleep(STALE_BEATS * self.beat_s)
        after = self._counters()
        reports = self._reports()
        silent = [r for r in range(self.world) if r != self.rank and after[r] == before[r]]
        if silent:
            named = "; ".join(f"rank {r} {_report_words(reports.get(r))}" for r in silent)
            message = f"rank(s) {', '.join(map(str, silent))} stopped answering: {named}; {mine} {limit}"
            self._store.set("hang", message)
            self._wake_stopped(silent, reports)
            return HangError(message)
        others = "; ".join(f"rank {r} {_report_words(reports.get(r))}" for r in range(self.world) if r != self.rank)
        return HangError(f"a collective failed though every rank answers: {mine}; {others} {limit}: "
                         f"{_first_line(error)}")

    # ---------------------------------------------------------------- internals
    def _set_timeout(self, seconds: float) -> None:
        """Every process group of this rank (the mesh's too) times out after `seconds`. torch
        offers no public way to change a live group's timeout: `_set_pg_timeout` (private, in
        torch since 2.3) over the groups torch tracks is the one way, short of new groups."""
        self._current = seconds
        for group in list(c10d._world.pg_map):
            try:
                c10d._set_pg_timeout(timedelta(seconds=seconds), group)
            except (ValueError, AssertionError, RuntimeError, AttributeError):  # not in it, or no setter
                pass

    def _beat(self) -> None:
        host, pid = socket.gethostname(), os.getpid()
        while not self._stop.is_set():
            self._moved.clear()
            self._last_where = self._where()
            if self._store is not None:
                report = {"where": self._last_where, "step": self.step, "t": time.time(), "host": host, "pid": pid}
                try:
                    self._store.set(f"at/{self.rank}", json.dumps(report))
                    self._store.add(f"beat/{self.rank}", 1)
                except Exception:  # the store's server is gone: the run is ending anyway
                    return
            # At most ten reports a beat however often the rank moves (pokes), one at least.
            gap = self.beat_s / 10
            if not self._stop.wait(gap):
                self._moved.wait(self.beat_s - gap)

    def poke(self) -> None:
        """The rank moved on within a step (a pipeline action): report soon, not at the next beat,
        so that a rank that dies says which stage and micro-batch it was in."""
        self._moved.set()

    def _where(self) -> str:
        """The phase, within a step as the main thread reports it (`in_step`), in an evaluation with its detail."""
        if self.phase == "step":
            return self.in_step()
        detail = self.detail() if self.phase == "evaluation" else None
        return f"{self.phase}, {detail}" if detail else self.phase

    def _counters(self) -> list[int]:
        assert self._store is not None
        return [int(self._store.add(f"beat/{r}", 0)) for r in range(self.world)]

    def _reports(self) -> dict[int, dict[str, Any]]:
        assert self._store is not None
        found = {}
        for r in range(self.world):
            try:
                if self._store.check([f"at/{r}"]):
                    found[r] = json.loads(self._store.get(f"at/{r}"))
            except Exception:
                pass
        return found

    def _wake_stopped(self, ranks: list[int], reports: dict[int, dict[str, Any]]) -> None:
        """A silent rank on this machine that is stopped (SIGSTOP, Ctrl-Z) cannot act on the
        launcher's SIGTERM, which then waits 30 s before SIGKILL: continue it so that it can."""
        if self.rank != min(set(range(self.world)) - set(ranks)):
            return
        for r in ranks:
            report = reports.get(r) or {}
            if report.get("host") == socket.gethostname() and _stopped(int(report.get("pid", 0))):
                os.kill(int(report["pid"]), signal.SIGCONT)


REPORTS_ENV = "SHOAL_REPORTS"
"""host:port of a store `shoal train`'s own launcher serves for the reports (infra/launch.py), so that
it can say where a worker was when it died; under torchrun the agent's store (MASTER_ADDR)."""


def _store(world: int) -> Any:
    """A second client of the launcher's TCPStore under this run's prefix; None alone or without one."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if os.environ.get(REPORTS_ENV):
        addr, _, port = os.environ[REPORTS_ENV].rpartition(":")
    if world == 1 or not addr or not port:
        return None
    store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=30))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted run starts fresh counters
    return dist.PrefixStore(_prefix(os.environ.get("TORCHELASTIC_RUN_ID", ""), int(attempt)), store)


def _prefix(run_id: str, attempt: int) -> str:
    return f"shoal-watchdog/{run_id}/{attempt}/"


def last_words(store: Any, run_id: str, rank: int, attempts: int) -> str | None:
    """Where `rank` last reported it was (the newest attempt that has a report), in words; for the
    launcher after a worker died."""
    for attempt in range(attempts, -1, -1):
        reports, key = dist.PrefixStore(_prefix(run_id, attempt), store), f"at/{rank}"
        try:
            if reports.check([key]):
                report = json.loads(reports.get(key))
                return f"last reported step {report['step']}, {report['where']}"
        except Exception:  # the store is gone or the report unreadable: nothing to add
            return None
    return None


Stack = list[tuple[str, str]]
"""A stack as (file, function) pairs, innermost first."""


def _traceback_stack(error: BaseException) -> Stack:
    """The frames `error` passed through, innermost first (where the main thread waited when it failed)."""
    stack: Stack = []
    tb = error.__traceback__
    while tb is not None:
        stack.append((tb.tb_frame.f_code.co_filename, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    return stack[::-1]


def _collective(stack: Stack) -> str | None:
    """The innermost public torch.distributed function on the stack (all_reduce, reduce_scatter_tensor, ...)."""
    for path, name in stack:
        if path.endswith("distributed_c10d.py") and not name.startswith("_") and name != "wrapper":
            return name
    return None


def _report_words(report: dict[str, Any] | None) -> str:
    if not report:
        return "never reported"
    ago = max(0.0, time.time() - float(report["t"]))
    return (f"(pid {report['pid']} on {report['host']}) last reported {ago:.0f} s ago: step {report['step']}, "
            f"{report['where']}")


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _timed_out(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
