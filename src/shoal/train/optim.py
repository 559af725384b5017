"""AdamW with a linear warm-up then cosine decay to a floor: the optimizer of `shoal train`.

The learning rate is a pure function of the step (`lr_at`), so a resumed run recomputes it
instead of trusting a stored value, and the unit tests check it against hand-computed numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = 3e-3
    """Peak learning rate, reached at the end of the warm-up."""
    min_lr: float | None = None
    """Floor of the cosine decay; None: lr / 10."""
    warmup_steps: int | None = None
    """Linear warm-up steps; None: 10% of decay_steps."""
    decay_steps: int | None = None
    """Step at which the cosine reaches min_lr (the schedule's horizon); None: the run's --steps.
    Fix it when a run will be extended with --resume, so that the extension keeps the schedule."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on norms, biases)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this; 0: no clipping."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"--lr {self.lr} is not valid; it must be > 0")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is not valid; it must lie in 0..lr={self.lr}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps {self.warmup_steps} is not valid; it must be >= 0")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ValueError(f"--decay-steps {self.decay_steps} is not valid; it must be >= 1")
        for name in ("weight_decay", "grad_clip", "eps"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} is not valid; it must be >= 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is not valid; it must lie in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """The resolved schedule: peak, floor, warm-up length and horizon, all numbers."""

    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int

    @classmethod
    def from_config(cls, cfg: OptimConfig, total_steps: int) -> Schedule:
        decay = cfg.decay_steps if cfg.decay_steps is not None else total_steps
        warmup = cfg.warmup_steps if cfg.warmup_steps is not None else decay // 10
        return cls(lr=cfg.lr, min_lr=cfg.min_lr if cfg.min_lr is not None else cfg.lr / 10,
                   warmup_steps=min(warmup, decay), decay_steps=decay)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (0-based).

        Warm-up: lr * (step + 1) / warmup_steps, so the first step already moves. Then cosine:
        min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2, progress going 0 -> 1 from the end
        of the warm-up to decay_steps; min_lr after that.
        """
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if step >= self.decay_steps:
            return self.min_lr
        progress = (step - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps)
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine(LRScheduler):
    """Sets every parameter group's lr to `schedule.lr_at(step)`.

    Its state_dict holds only the step counters: a resumed run takes the schedule's shape
    from its config and recomputes the lr (see `restore`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Schedule) -> None:
        self.schedule = schedule
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:  # type: ignore[override]  # torch types it list[float | Tensor]
        return [self.schedule.lr_at(self.last_epoch) for _ in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, int]:
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count}

    def restore(self, state: dict[str, int]) -> None:
        """Continue from a saved state: the step counters, and every group's lr recomputed."""
        self.last_epoch, self._step_count = int(state["last_epoch"]), int(state["_step_count"])
        lr = self.schedule.lr_at(self.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._last_lr = [lr for _ in self.optimizer.param_groups]


def build_optimizer(parameters: Iterable[nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over `parameters` (a runtime's): weight decay on matrices, none on vectors (norms, biases);
    torch's fused kernel when every parameter lives on a GPU (see `adamw_kernel`)."""
    params = [p for p in parameters if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, **adamw_kernel({p.device.type for p in params}))


def adamw_kernel(device_types: set[str]) -> dict[str, bool]:
    """AdamW's implementation for parameters on these device types: fused (one kernel for every
    parameter, DTensor shards included) when all are on CUDA; otherwise torch's default, which on
    CPU (and for offloaded shards) is the per-parameter loop the CPU parity tests were derived with."""
    return {"fused": True} if device_types == {"cuda"} else {}


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> WarmupCosine:
    return WarmupCosine(optimizer, Schedule.from_config(cfg, total_steps))
