"""An optimizer step taken only where a flag on the device allows it: a step whose loss or gradient
went non-finite changes no weight and no optimizer state, and the host never reads the flag.

`gated_step(optimizer, ok)` runs `optimizer.step()` so that where `ok` (a 0-d bool tensor) is
false every parameter and every optimizer state tensor (moments, momentum buffers, step counters)
keeps its exact bits:
- shoal's LAMB, LARS and CowClip take `ok` themselves (`step(ok=...)`): they compute the new
  moments and weights beside the old ones and select between them with torch.where, and count
  their step on the device (shoal/optim/lamb_lars.py).
- torch's fused AdamW (Adam), the trainer's on GPUs and CPUs (shoal.optim.builder.adamw_kernel), takes it
  as its `found_inf` (1.0: skip): its kernel, on CUDA and on the CPU alike, leaves weights and moments
  untouched and the step counter is added then taken back.
- Any other optimizer (a user's non-fused AdamW, SGD, ...):
  the parameters with a gradient and their state tensors are copied before the step and selected
  back after it (`torch.where`), which costs one transient copy of them. State a step creates
  lazily (the first step's moments, step 0) is selected against zeros, which the optimizers treat
  as a fresh state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def gated_step(optimizer: torch.optim.Optimizer, ok: torch.Tensor) -> None:
    """`optimizer.step()` where `ok` (0-d bool, on the device) holds; otherwise nothing changes."""
    from shoal.optim.lamb_lars import _Layerwise

    if isinstance(optimizer, _Layerwise):
        optimizer.step(ok=ok)  # type: ignore[call-overload]  # shoal's optimizers take the flag
    elif _fused(optimizer):
        optimizer.found_inf = (~ok).float()  # type: ignore[attr-defined]  # torch's Adam reads this attribute
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
    else:
        _selected_step(optimizer, ok)


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and all(
        g.get("fused") and all(p.device.type in ("cuda", "cpu") for p in g["params"]) for g in optimizer.param_groups)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _selected_step(optimizer: torch.optim.Optimizer, ok: torch.Tensor) -> None:
    """Step, then put back every tensor of a parameter with a gradient where `ok` is false."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    kept: list[tuple[torch.Tensor, torch.Tensor]] = [(_local(p), _local(p).clone()) for p in params]
    had: dict[int, dict[str, Any]] = {}
    for p in params:
        state = optimizer.state.get(p, {})
        had[id(p)] = {k: _local(v).clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
        kept += [(_local(state[k]), old) for k, old in had[id(p)].items()]
    optimizer.step()
    for p in params:  # state the step created: zeros where it must not have been
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and key not in had[id(p)]:
                kept.append((_local(value), torch.zeros_like(_local(value))))
    flags: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for now, old in kept:
            flag = flags.setdefault(now.device, ok.to(now.device, non_blocking=True))
            now.copy_(torch.where(flag, now, old))
