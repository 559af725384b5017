"""Fault injection for the fault suite (tests/test_faults.py): off unless SHOAL_FAULT is set.

    SHOAL_FAULT="<action>@<point>:rank=<r>:step=<s>[:attempt=<a>]"

actions: kill (SIGKILL itself), stop (SIGSTOP itself: frozen), term (SIGTERM itself: preempted),
raise (a RuntimeError: a crash), enospc (the checkpoint write fails: disk full), nan and inf (at
forward: the model's output times NaN or inf, so the loss goes non-finite; at backward: the
gradient reaching the output times it, so the gradients go non-finite while the loss stays finite).
points: forward (inside the model's forward), backward (inside backward), collective (while
its peers wait in the gradient-norm all-reduce: it starts its part, then the fault), step (between
steps), checkpoint (after the checkpoint's files are written, before the checkpoint is complete).
`step` is the 0-based optimizer step (checkpoint: the step the checkpoint is of); `attempt` the
launcher's restart count it fires in [0], so that a restarted run does not meet it again.

With the variable unset every hook is a no-op returning at once; `arm` installs nothing.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch

ENV = "SHOAL_FAULT"
ACTIONS = ("kill", "stop", "term", "raise", "enospc", "nan", "inf")
POISONS = {"nan": float("nan"), "inf": float("inf")}
POINTS = ("forward", "backward", "collective", "step", "checkpoint")


@dataclass(frozen=True)
class Fault:
    action: str
    point: str
    rank: int
    step: int
    attempt: int = 0


def parse(text: str) -> Fault:
    head, *fields = text.split(":")
    action, _, point = head.partition("@")
    values = dict(f.split("=", 1) for f in fields)
    if action not in ACTIONS or point not in POINTS or not {"rank", "step"} <= values.keys():
        raise ValueError(f"{ENV}={text!r} is not valid; valid: <{'|'.join(ACTIONS)}>@<{'|'.join(POINTS)}>"
                         ":rank=R:step=S[:attempt=A]")
    return Fault(action, point, int(values["rank"]), int(values["step"]), int(values.get("attempt", 0)))


_FAULT: Fault | None = parse(os.environ[ENV]) if os.environ.get(ENV) else None
_STEP = -1


def at_step(step: int) -> None:
    """The loop starts optimizer step `step`; fires a `step` fault."""
    global _STEP
    _STEP = step
    point("step", step)


def point(where: str, step: int | None = None) -> None:
    """Fire the fault if this is its point, rank, step and attempt."""
    f = _FAULT
    if f is not None and f.point == where and _here(f, _STEP if step is None else step):
        fire(f)


def _here(f: Fault, step: int) -> bool:
    """This rank, this step, this launcher attempt."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return (rank, step, attempt) == (f.rank, f.step, f.attempt)


def fire(f: Fault) -> None:
    stamp = os.environ.get(ENV + "_STAMP")  # the suite measures the time from here to the run's exit
    if stamp:
        with open(stamp, "w") as out:
            out.write(repr(time.time()))
    if f.action == "raise":
        raise RuntimeError(f"injected fault: {f.action}@{f.point} at step {f.step}")
    if f.action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    os.kill(os.getpid(), {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}[f.action])


def arm(model: torch.nn.Module) -> None:
    """Hooks for the forward, backward and collective points on this rank's model (no-op when off)."""
    f = _FAULT
    if f is None:
        return
    if f.action in POISONS:
        _arm_poison(model, f)
    elif f.point == "forward":
        model.register_forward_pre_hook(lambda module, args: point("forward"))
    elif f.point == "backward":
        def grad_hook(grad: torch.Tensor) -> None:
            point("backward")

        def forward_hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(grad_hook)
        model.register_forward_hook(forward_hook)
    elif f.point == "collective":
        _arm_collective()


def _arm_poison(model: torch.nn.Module, f: Fault) -> None:
    """nan/inf at forward (the output) or backward (the output's gradient), at the fault's rank and step."""
    value = POISONS[f.action]

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t * value if _here(f, _STEP) else t

    def forward_hook(module: torch.nn.Module, args: Any, out: Any) -> Any:
        if not isinstance(out, torch.Tensor):
            return out
        if f.point == "forward":
            return poison(out)
        if out.requires_grad:
            out.register_hook(poison)
        return out

    if f.point in ("forward", "backward"):
        model.register_forward_hook(forward_hook)


def _arm_collective() -> None:
    """The victim starts its part of the next all-reduce, then meets the fault while it runs."""
    import torch.distributed as dist

    original = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        f = _FAULT
        if f is not None and _here(f, _STEP):
            kwargs.pop("async_op", None)
            original(tensor, *args, **{**kwargs, "async_op": True})
            fire(f)
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce  # test-only, installed only when SHOAL_FAULT names this point
