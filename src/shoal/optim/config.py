"""What `shoal train`'s optimizer and schedule are made of (`[optim]` in a run config, the optimizer flags)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

OPTIMIZERS = ("adamw", "lamb", "lars", "cowclip")
LR_SCALING = ("none", "linear", "sqrt")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The optimizer, its hyper-parameters and its learning-rate schedule."""

    optimizer: str = "adamw"
    """adamw, lamb (You et al. 2020), lars (You et al. 2017, over SGD with momentum) or cowclip
    (clipping of embedding-row gradients, arXiv 2204.06240, over AdamW); see shoal/optim/cowclip.py."""
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
