"""The learning-rate schedule of `shoal train`: a linear warm-up then cosine decay to a floor, optionally scaled with
the global batch. The learning rate is a pure function of the step (`Schedule.lr_at`), so a resumed run recomputes it
instead of trusting a stored value, and the unit tests check it against hand-computed numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch.optim.lr_scheduler import LRScheduler

from shoal.optim.config import OptimConfig


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
        lr = self.schedule.lr_at(self.last_epoch)
        return [lr * g.get("lr_scale", 1.0) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, int]:
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count}

    def restore(self, state: dict[str, int]) -> None:
        """Continue from a saved state: the step counters, and every group's lr recomputed."""
        self.last_epoch, self._step_count = int(state["last_epoch"]), int(state["_step_count"])
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = list(lrs)


def scale_for_batch(cfg: OptimConfig, global_batch: int) -> OptimConfig:
    """`cfg` with its batch scaling rule applied for `global_batch` (itself when lr_scaling is none).

    With k = global_batch / base_batch: lr and min_lr times k (linear) or sqrt(k) (sqrt); explicit
    warm-up steps times 1 / k, at least 1, so the warm-up spans as many sequences as at base_batch
    (Goyal et al. 2017: warm-up over a fixed number of epochs); CowClip's embedding lr unchanged
    and its embedding L2 times k (the CowClip paper's rules)."""
    if cfg.lr_scaling == "none":
        return cfg
    assert cfg.base_batch is not None  # OptimConfig checks it
    k = global_batch / cfg.base_batch
    factor = k if cfg.lr_scaling == "linear" else math.sqrt(k)
    return replace(
        cfg, lr=cfg.lr * factor, min_lr=None if cfg.min_lr is None else cfg.min_lr * factor,
        warmup_steps=None if cfg.warmup_steps is None else max(1, round(cfg.warmup_steps / k)),
        embed_lr=cfg.embed_lr if cfg.embed_lr is not None else cfg.lr, embed_weight_decay=cfg.embed_weight_decay * k,
        lr_scaling="none", base_batch=None)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int, *,
                    global_batch: int | None = None) -> WarmupCosine:
    """The warm-up + cosine schedule of `cfg` (batch-scaled for `global_batch` when given); a
    group's `lr_scale` (CowClip's embeddings) multiplies the schedule's lr for that group."""
    cfg = scale_for_batch(cfg, global_batch) if global_batch is not None else cfg
    return WarmupCosine(optimizer, Schedule.from_config(cfg, total_steps))
