"""The optimizer of `shoal train` (AdamW, LAMB, LARS or CowClip) and its learning-rate schedule:
a linear warm-up then cosine decay to a floor, optionally scaled with the global batch.

The learning rate is a pure function of the step (`lr_at`), so a resumed run recomputes it
instead of trusting a stored value, and the unit tests check it against hand-computed numbers.
The large-batch optimizers live in shoal/optim/large_batch.py; `build_optimizer` picks one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from shoal.mesh import reduction_groups

OPTIMIZERS = ("adamw", "lamb", "lars", "cowclip")
LR_SCALING = ("none", "linear", "sqrt")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The optimizer, its hyper-parameters and its learning-rate schedule."""

    optimizer: str = "adamw"
    """adamw, lamb (You et al. 2020), lars (You et al. 2017, over SGD with momentum) or cowclip
    (clipping of embedding-row gradients, arXiv 2204.06240, over AdamW); see shoal/optim/large_batch.py."""
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
    momentum: float = 0.9
    """LARS: SGD momentum."""
    lars_eta: float = 1e-3
    """LARS: trust coefficient eta of the local lr eta ||w|| / (||g|| + wd ||w||)."""
    adapt_vectors: bool = False
    """LAMB/LARS: give vectors (biases, norm weights) trust ratios and weight decay too; off as in
    the papers (they take the plain Adam / SGD step)."""
    per_expert: bool = True
    """LAMB/LARS: one trust ratio per leading index of a 3-D or larger tensor (each expert of a
    stacked MoE weight) rather than one for the whole tensor."""
    cowclip_ratio: float = 1.0
    """CowClip: r in clip_t = r * cnt * max(||w_id||, r * sqrt(d) * zeta)."""
    cowclip_zeta: float = 1e-5
    """CowClip: zeta, the lower bound of a row's clip threshold (per unit of r * sqrt(d))."""
    embed_lr: float | None = None
    """CowClip: peak lr of the embedding tables, kept fixed by the batch scaling rules; None: lr."""
    embed_weight_decay: float = 0.0
    """CowClip: L2 (coupled) weight decay of the embedding tables; scaled linearly with the batch."""
    lr_scaling: str = "none"
    """How lr (and min_lr) follow the global batch: none, linear (Goyal et al. 2017) or sqrt
    (Krizhevsky 2014; CowClip's dense rule), from base_batch; explicit warm-up steps keep their
    number of sequences (scaled by base_batch / global_batch)."""
    base_batch: int | None = None
    """The global batch the lr (and warm-up) were set for; needed by lr_scaling linear/sqrt."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"--{f.name.replace('_', '-')} {value} is not valid; it must be a finite number")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer {self.optimizer!r} is not valid; valid: {', '.join(OPTIMIZERS)}")
        if self.lr_scaling not in LR_SCALING:
            raise ValueError(f"--lr-scaling {self.lr_scaling!r} is not valid; valid: {', '.join(LR_SCALING)}")
        if self.lr_scaling != "none" and (self.base_batch is None or self.base_batch < 1):
            given = "none was given" if self.base_batch is None else f"got {self.base_batch}"
            raise ValueError(f"--lr-scaling {self.lr_scaling} needs --base-batch, the global batch the lr was set for "
                             f"({given}); valid: --base-batch N with N >= 1")
        if self.lr_scaling == "none" and self.base_batch is not None:
            raise ValueError(f"--base-batch {self.base_batch} has no effect without --lr-scaling; valid: --lr-scaling "
                             "linear or sqrt with it, or leave --base-batch out")
        for name in ("lars_eta", "cowclip_ratio", "cowclip_zeta", "embed_lr"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} {value} is not valid; it must be > 0")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum {self.momentum} is not valid; it must lie in [0, 1)")
        if self.embed_weight_decay < 0:
            raise ValueError(f"--embed-weight-decay {self.embed_weight_decay} is not valid; it must be >= 0")
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


def build_optimizer(source: Any, cfg: OptimConfig, *, global_batch: int | None = None,
                    embeddings: list[Any] | None = None,
                    count_groups: list[Any] | None = None) -> torch.optim.Optimizer:
    """The optimizer `cfg` names over `source`: a Runtime (what `shoal train` passes: CowClip finds
    the embedding tables in its model parts and sums id counts over its data ranks) or an iterable
    of parameters. Weight decay and trust ratios on matrices, none on vectors (norms, biases)
    unless adapt_vectors. AdamW takes torch's fused kernel when every parameter lives on a GPU
    (see `adamw_kernel`). `global_batch`: apply the batch scaling rule (`scale_for_batch`).
    `embeddings`, `count_groups`: CowClip's tables and the groups its id counts are summed over,
    for a source that is not a Runtime (default: found in the runtime / none)."""
    from shoal.optim import large_batch
    from shoal.runtime import Runtime

    cfg = scale_for_batch(cfg, global_batch) if global_batch is not None else cfg
    runtime = source if isinstance(source, Runtime) else None
    params = [p for p in (runtime.parameters() if runtime is not None else source) if p.requires_grad]
    if embeddings is None:
        embeddings = _embeddings(runtime) if cfg.optimizer == "cowclip" and runtime is not None else []
    tables = {id(e[1] if isinstance(e, tuple) else e.weight) for e in embeddings}
    dense = [p for p in params if id(p) not in tables]
    vectors_adapt = cfg.adapt_vectors and cfg.optimizer in ("lamb", "lars")
    groups: list[dict[str, Any]] = [
        {"params": [p for p in dense if p.dim() >= 2], "weight_decay": cfg.weight_decay, "adapt": True},
        {"params": [p for p in dense if p.dim() < 2], "weight_decay": cfg.weight_decay if vectors_adapt else 0.0,
         "adapt": vectors_adapt},
    ]
    if cfg.optimizer == "adamw":
        for g in groups:
            del g["adapt"]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                 eps=cfg.eps, **adamw_kernel({p.device.type for p in params}))
    groups = [g for g in groups if g["params"]]
    if cfg.optimizer == "lars":
        return large_batch.LARS(groups, lr=cfg.lr, momentum=cfg.momentum, eta=cfg.lars_eta, per_expert=cfg.per_expert)
    adam: dict[str, Any] = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, "per_expert": cfg.per_expert}
    if cfg.optimizer == "lamb":
        return large_batch.LAMB(groups, **adam)
    for g in groups:  # CowClip: AdamW on the dense part
        g["adapt"] = False
    embed_lr = cfg.embed_lr if cfg.embed_lr is not None else cfg.lr
    if embeddings:
        groups.append({"params": [e[1] if isinstance(e, tuple) else e.weight for e in embeddings],
                       "weight_decay": 0.0, "adapt": False,
                       "l2": cfg.embed_weight_decay, "lr": embed_lr, "lr_scale": embed_lr / cfg.lr})
    if count_groups is None:
        count_groups = reduction_groups(runtime.mesh, ("dp", "fsdp", "cp")) if runtime and runtime.mesh else []
    return large_batch.CowClip(groups, embeddings=embeddings, count_groups=count_groups, ratio=cfg.cowclip_ratio,
                              zeta=cfg.cowclip_zeta, **adam)


def _embeddings(runtime: Any) -> list[tuple[nn.Embedding, nn.Parameter]]:
    """The embedding tables of a runtime's model parts, each with the parameter the optimizer holds
    for its weight (matched by name: a ZeRO-1/2 engine hands the optimizer shards, not the module's
    own weight)."""
    params = dict(runtime.named_parameters())
    found: dict[str, tuple[nn.Embedding, nn.Parameter]] = {}
    for part in runtime.parts:
        for name, module in part.named_modules():
            key = f"{name}.weight" if name else "weight"
            if isinstance(module, nn.Embedding) and key in params and key not in found:
                found[key] = (module, params[key])
    return list(found.values())


def adamw_kernel(device_types: set[str]) -> dict[str, bool]:
    """AdamW's implementation for parameters on these device types: fused (one kernel for every
    parameter, DTensor shards included) when all are on CUDA; otherwise torch's default, which on
    CPU (and for offloaded shards) is the per-parameter loop the CPU parity tests compare against."""
    return {"fused": True} if device_types == {"cuda"} else {}


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int, *,
                    global_batch: int | None = None) -> WarmupCosine:
    """The warm-up + cosine schedule of `cfg` (batch-scaled for `global_batch` when given); a
    group's `lr_scale` (CowClip's embeddings) multiplies the schedule's lr for that group."""
    cfg = scale_for_batch(cfg, global_batch) if global_batch is not None else cfg
    return WarmupCosine(optimizer, Schedule.from_config(cfg, total_steps))
