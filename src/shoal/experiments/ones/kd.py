"""The knowledge-distillation loss of `shoal distill` and how the teacher's logits reach it.

The runtime calls a loss function with (model output, targets) of each micro-batch, wherever the
plan computes it (after the cp split, on the last pipeline stage, on vocab-sharded logits under
tp). So the teacher's logits travel *with the targets*: `pack_targets` appends them to each
target position (B, T) -> (B, T, 1 + V), and every layer that splits targets along batch or
sequence splits them too. `kd_loss` unpacks them.

Shape legend: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from shoal.loss import IGNORE, LossFn


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """What a distillation run adds to a training run: the teacher and the loss's knobs."""

    teacher: str
    """The teacher's run folder."""
    checkpoint: str
    """The teacher checkpoint folder the run distils from."""
    gather: str
    """How the student started (shoal.experiments.ones.gather.GATHERS)."""
    gather_k: int | None = None
    """topk: entries kept per expert matrix; svd: singular components kept per expert; top-experts:
    experts kept; None for the others."""
    temperature: float = 1.0
    """T: both distributions are softened as softmax(logits / T)."""
    alpha: float = 0.5
    """Weight of the distillation term; 1 - alpha weighs the data's cross-entropy."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"--kd-temperature {self.temperature} must be > 0")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"--kd-alpha {self.alpha} must lie in 0..1")


def pack_targets(targets_BT: torch.Tensor, teacher_BTV: torch.Tensor) -> torch.Tensor:
    """Targets and the teacher's logits as one float32 tensor (B, T, 1 + V); token ids are exact
    in float32 below 2**24."""
    return torch.cat([targets_BT.unsqueeze(-1).float(), teacher_BTV.float()], dim=-1)


def unpack_targets(packed_BTX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets_BT as int64, teacher logits_BTV) of `pack_targets`."""
    return packed_BTX[..., 0].long(), packed_BTX[..., 1:]


def kd_loss(temperature: float, alpha: float) -> LossFn:
    """The loss function of a micro-batch: over its positions whose target is not IGNORE, the mean of

        alpha * T^2 * KL(softmax(t / T) || softmax(s / T)) + (1 - alpha) * CE(s, target),

    s the student's logits, t the teacher's (Hinton et al. 2015; T^2 keeps the gradient's scale
    as T changes). Computed in float32. Under tp the student's vocab-sharded logits are gathered
    first (B*T*V floats per rank: fine for the vocabularies distilled here, a wide classifier would
    want the sharded KL instead)."""
    T = float(temperature)

    def loss(output: torch.Tensor, packed_BTX: torch.Tensor) -> torch.Tensor:
        logits = output.full_tensor() if isinstance(output, DTensor) else output
        targets_BT, teacher_BTV = unpack_targets(packed_BTX)
        s_NV, t_NV = logits.flatten(0, 1).float(), teacher_BTV.flatten(0, 1).float()
        keep_N = targets_BT.flatten() != IGNORE
        log_p_s = F.log_softmax(s_NV / T, dim=-1)
        log_p_t = F.log_softmax(t_NV / T, dim=-1)
        kl_N = (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1)
        ce_N = F.cross_entropy(s_NV, targets_BT.flatten(), ignore_index=IGNORE, reduction="none")
        per_N = alpha * T * T * kl_N + (1 - alpha) * ce_N
        return (per_N * keep_N).sum() / keep_N.sum().clamp(min=1)

    return loss
