"""Start worker processes through torch's elastic launcher (what `torchrun` runs), or join
the world `torchrun` already started.

shoal writes no launcher or rendezvous of its own: `launch(fn, arg, nproc=N)` is
`torch.distributed.launcher.api.elastic_launch` on this machine with a c10d rendezvous on a
free localhost port and no restarts (a failed worker fails the run; resume from a checkpoint).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
CPU_NPROC = 2
"""Local processes on a machine without GPUs: enough to exercise every collective."""


class WorkerFailed(RuntimeError):
    """A worker process failed at run time; the message names the rank and its error."""


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
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(fn: Callable[[Any], Any], arg: Any, *, nproc: int) -> dict[int, Any]:
    """Run `fn(arg)` on `nproc` local workers; their return values by global rank.

    Raises WorkerFailed naming the first rank that failed and the last line of its error.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from shoal.world import threads_per_rank

    # Each worker reads this before torch sizes its thread pools (torchrun sets it to 1).
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        rdzv_backend="c10d", rdzv_endpoint=f"localhost:{free_port()}",
        run_id=f"shoal-{os.getpid()}", max_restarts=0, start_method="spawn",
    )
    try:
        return elastic_launch(config, fn)(arg)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise WorkerFailed(f"rank {rank} of {nproc} failed: {last_line(failure.message, failure.exitcode)}") from None


def last_line(message: Any, exitcode: int) -> str:
    """The last line of a worker's recorded error (the exception), or its exit code."""
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = [line.strip() for line in str(message or "").splitlines() if line.strip()]
    if not lines or lines[-1].startswith("To enable traceback"):
        return f"exit code {exitcode}" + (f" (killed by signal {-exitcode})" if exitcode < 0 else "")
    return lines[-1]
