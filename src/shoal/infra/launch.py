"""Start worker processes through torch's elastic launcher (what `torchrun` runs), or join
the world `torchrun` already started.

shoal writes no launcher or rendezvous of its own: `launch(fn, arg, nproc=N)` is
`torch.distributed.launcher.api.elastic_launch` on this machine with a c10d rendezvous on a
free localhost port. A failed worker fails the run, or with `max_restarts` every worker is
restarted (the trainer then resumes from its newest good checkpoint).

SIGTERM and SIGINT to this process are forwarded to the workers by a handler of our own, and the
launcher keeps waiting: the workers finish their step, write a checkpoint and return normally.
(torch's agent would forward them too, but then stops reading the workers' return values, which
the workers wait to hand over: both would wait until its shutdown timeout.) A second signal, more
than a second later, kills the workers and raises Stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
CPU_NPROC = 2
"""Local processes on a machine without GPUs: enough to exercise every collective."""
START_METHOD: Final = "spawn"
"""How shoal starts worker processes (`launch`, and shoal.infra.pool's pool): a fresh interpreter each,
never a fork, which would copy this process's threads and CUDA state into the child."""


class WorkerFailed(RuntimeError):
    """A worker process failed at run time; the message names the rank and its error."""


class Stopped(RuntimeError):
    """This process got SIGTERM or SIGINT twice: the workers were killed."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


def under_torchrun() -> bool:
    """True when this process is one rank of a world torchrun (or another launcher) started."""
    return all(name in os.environ for name in TORCHRUN_VARS)


def resolve_device(requested: str) -> str:
    """"cpu" or "cuda" for a config's `device` (auto: cuda when torch sees a GPU)."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no GPU on this machine (torch.cuda.is_available() is False); "
                         "valid: auto, cpu")
    return requested


def default_nproc(device: str) -> int:
    """Local processes when --nproc is left out: one per visible GPU, or CPU_NPROC on the CPU."""
    if device == "cuda":
        import torch

        return torch.cuda.device_count()
    return CPU_NPROC


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no socket holds now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(fn: Callable[[Any], Any], arg: Any, *, nproc: int, max_restarts: int = 0) -> dict[int, Any]:
    """Run `fn(arg)` on `nproc` local workers; their return values by global rank.

    Raises WorkerFailed naming the first rank that failed (after `max_restarts` restarts) and
    the last line of its error, or Stopped after a second SIGTERM/SIGINT to this process.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from shoal.infra.world import threads_per_rank

    # Each worker reads this before torch sizes its thread pools (torchrun sets it to 1).
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        rdzv_backend="c10d", rdzv_endpoint=f"localhost:{free_port()}",
        run_id=f"shoal-{os.getpid()}", max_restarts=max_restarts, start_method=START_METHOD,
        signals_to_handle="SIGHUP,SIGQUIT",  # SIGTERM and SIGINT: _forward_stop_signals
    )
    try:
        with _forward_stop_signals(), _report_store() as reports:
            return elastic_launch(config, fn)(arg)
    except ChildFailedError as exc:
        from shoal.infra.watchdog import last_words

        rank, failure = _cause(exc.failures)
        # A worker killed by a signal left no words of its own: its watchdog's last report says where it was.
        where = last_words(reports, config.run_id, rank, max_restarts) if failure.exitcode < 0 else None
        # The others' own errors say what they were doing when the first one failed (a pipeline
        # stage and micro-batch, a collective): those with a message, not the ones shut down.
        others = [f"rank {r}: {last_line(f.message, f.exitcode)}" for r, f in sorted(exc.failures.items())
                  if r != rank and f.exitcode > 0 and last_line(f.message, f.exitcode) != f"exit code {f.exitcode}"]
        then = f"; then {'; '.join(others[:3])}" if others else ""
        was = f"; it {where}" if where else ""
        last = last_line(failure.message, failure.exitcode)
        raise WorkerFailed(f"rank {rank} of {nproc} failed: {last}{was}{then}") \
            from None


def _cause(failures: dict[int, Any]) -> tuple[int, Any]:
    """The failure that caused the others: the first recorded, passing over ranks whose collective
    lost a peer (watchdog.PeerGone), which can be recorded a moment before the peer's own error."""
    def order(item: tuple[int, Any]) -> tuple[bool, float]:
        _, failure = item
        return "PeerGone" in last_line(failure.message, failure.exitcode), failure.timestamp

    return min(failures.items(), key=order)


@contextlib.contextmanager
def _report_store() -> Iterator[Any]:
    """A store served by this process for the workers' watchdog reports (shoal/infra/watchdog.py):
    the agent's store is gone by the time a failure reaches us, this one is still here to say
    where a dead worker was."""
    import torch.distributed as dist

    from shoal.infra.watchdog import REPORTS_ENV

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    previous = os.environ.get(REPORTS_ENV)
    os.environ[REPORTS_ENV] = f"127.0.0.1:{port}"  # the spawned workers inherit it
    try:
        yield store
    finally:
        if previous is None:
            os.environ.pop(REPORTS_ENV, None)
        else:
            os.environ[REPORTS_ENV] = previous


@contextlib.contextmanager
def _forward_stop_signals() -> Iterator[None]:
    """While the workers run: the first SIGTERM/SIGINT is passed on to them, a second kills them."""
    import multiprocessing

    first: list[float] = []

    def forward(signum: int, frame: object) -> None:
        workers = multiprocessing.active_children()  # torch starts them with multiprocessing (spawn)
        if not first:
            first.append(time.monotonic())
            for proc in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)  # type: ignore[arg-type]  # a started child has a pid
        elif time.monotonic() - first[0] > 1.0:  # one Ctrl-C may arrive twice (terminal, then forwarded)
            for proc in workers:
                proc.kill()
            raise Stopped(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def last_line(message: Any, exitcode: int) -> str:
    """The last line of a worker's recorded error (the exception), or its exit code."""
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = [line.strip() for line in str(message or "").splitlines() if line.strip()]
    if not lines or lines[-1].startswith("To enable traceback"):
        return f"exit code {exitcode}" + (f" (killed by signal {-exitcode})" if exitcode < 0 else "")
    return lines[-1]
