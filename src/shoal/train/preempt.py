"""Graceful preemption: SIGTERM or SIGINT finishes the current step, writes a checkpoint, and stops.

Slurm and Kubernetes send SIGTERM before they take a machine back; Ctrl-C sends SIGINT. Either
reaches one rank or all of them (the launcher forwards what it gets): each rank only notes it,
and after every step the ranks agree on it with one all-reduce of a CPU integer (gloo, also
beside NCCL: the GPU is not waited for), so that all of them stop after the same step. A second
signal, more than REPEAT_S after the first, ends the process at once with the signal's default
action. (One Ctrl-C reaches a worker twice, from the terminal and forwarded by the launcher,
within milliseconds: that is still the first.)
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_S = 1.0
STOPPED = 75
"""Exit status of a run stopped by a signal after its checkpoint (EX_TEMPFAIL: try again later,
with --resume): neither success (0) nor a failure (1) nor a user's mistake (2)."""


class StopSignals:
    """Notes SIGTERM/SIGINT in this process; `agreed()` tells every rank whether any got one."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._at = 0.0
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._at = signum, now
        elif now - self._at > REPEAT_S:  # asked twice: stop now, as the signal would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def agreed(self) -> str | None:
        """The signal's name on every rank if any rank got one ("SIGTERM"), else None. Collective."""
        flag = torch.tensor([self.signum or 0], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return signal.Signals(int(flag)).name if int(flag) else None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]  # as signal.signal returned it (kept as object)
