"""What `shoal train`'s optimizer and schedule are made of (`[optim]` in a run config, the optimizer flags)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from shoal.planner.compute import NEWTON_SCHULZ_STEPS

OPTIMIZERS = ("adamw", "lamb", "lars", "cowclip", "muon")
MUON_ADJUST_LR = ("original", "match_rms_adamw")
MUON_GATHER = ("owner", "naive")
LR_SCALING = ("none", "linear", "sqrt")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The optimizer, its hyper-parameters and its learning-rate schedule."""

    optimizer: str = "adamw"
    """adamw, lamb (You et al. 2020), lars (You et al. 2017, over SGD with momentum) or cowclip
    (clipping of embedding-row gradients, arXiv 2204.06240, over AdamW), see shoal/optim/cowclip.py; or muon
    (Newton-Schulz-orthogonalised momentum on the hidden layers' matrices, AdamW on the rest), see
    shoal/optim/muon.py."""
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
    muon_momentum: float = 0.95
    """Muon: momentum of the hidden matrices' buffer (torch.optim.Muon's)."""
    muon_nesterov: bool = True
    """Muon: Nesterov momentum (torch.optim.Muon's)."""
    muon_ns_steps: int = NEWTON_SCHULZ_STEPS
    """Muon: Newton-Schulz iterations (torch.optim.Muon's 5; the planner prices that many)."""
    muon_adjust_lr: str = "match_rms_adamw"
    """Muon: the lr's adjustment by a matrix's shape (torch.optim.Muon's adjust_lr_fn): match_rms_adamw
    (0.2 sqrt(max(a, b)), Moonlight's: the update's RMS near AdamW's, so lr and weight decay carry over from
    AdamW) or original (sqrt(max(1, a / b)), Jordan's: wants an lr near 0.02)."""
    muon_adamw_lr: float | None = None
    """Muon: peak lr of the parameters AdamW takes (embeddings, head, norms, biases); None: lr. Follows the
    schedule and the batch scaling as lr does."""
    muon_adamw: str = ""
    """Muon: comma-separated fragments of parameter names that AdamW takes even where they are hidden
    matrices (e.g. "router" for MoE routers)."""
    muon_gather: str = "owner"
    """Muon: how sharded matrices reach Newton-Schulz: owner (each gathered to one rank, the result
    scattered back) or naive (every rank gathers every matrix; a benchmark's peer)."""
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
        self._check_muon()
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

    def _check_muon(self) -> None:
        """Muon's options: valid values, and given only with --optimizer muon."""
        if self.optimizer != "muon":
            for f in fields(self):
                if f.name.startswith("muon_") and getattr(self, f.name) != f.default:
                    raise ValueError(f"--{f.name.replace('_', '-')} {getattr(self, f.name)} has no effect with "
                                     f"--optimizer {self.optimizer}; valid: with --optimizer muon only")
        if not 0 <= self.muon_momentum < 1:
            raise ValueError(f"--muon-momentum {self.muon_momentum} is not valid; it must lie in [0, 1)")
        if not 1 <= self.muon_ns_steps < 100:
            raise ValueError(f"--muon-ns-steps {self.muon_ns_steps} is not valid; it must lie in 1..99")
        if self.muon_adjust_lr not in MUON_ADJUST_LR:
            raise ValueError(f"--muon-adjust-lr {self.muon_adjust_lr!r} is not valid; valid: "
                             f"{', '.join(MUON_ADJUST_LR)}")
        if self.muon_gather not in MUON_GATHER:
            raise ValueError(f"--muon-gather {self.muon_gather!r} is not valid; valid: {', '.join(MUON_GATHER)}")
        if self.muon_adamw_lr is not None and not self.muon_adamw_lr > 0:
            raise ValueError(f"--muon-adamw-lr {self.muon_adamw_lr} is not valid; it must be > 0")
