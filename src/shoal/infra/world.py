"""The default process group as a whole: agree on a value, agree on an error, share the cores.

Each helper also works with no process group (one process), so callers need no `if distributed:`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def distributed() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's `value` (any picklable object) on every rank."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def first_error(error: str | None) -> str | None:
    """The lowest rank's error (None: no error) on every rank, so that all stop or none does."""
    if world_size() == 1:
        return error
    errors: list[str | None] = [None] * world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


def threads_per_rank(local_world: int) -> int:
    """Cores this process may use, shared evenly by the `local_world` ranks on this machine."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_world))


def use_threads(num: int) -> None:
    """Run this worker's torch operations on `num` threads (torch's intra-op pool), and give the
    processes it starts OMP_NUM_THREADS=`num` unless the variable is set already."""
    os.environ.setdefault("OMP_NUM_THREADS", str(num))
    torch.set_num_threads(num)
