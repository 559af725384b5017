"""One optimizer step through the parallel runtime: the piece the trainer, the benchmarks and the
parity harness share.

Every rank calls `train_step` with its own slice of the global batch, split into micro-batches
for gradient accumulation. The loss is the mean over every target of the *global* batch (targets
a loss mask excludes are IGNORE): the runtime weighs each micro-batch by its share of the global
count of targets (Runtime.share) and the data-parallel engine averages over ranks.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from shoal.loss import Batch, LossFn
from shoal.runtime import Runtime


@dataclass(frozen=True)
class StepResult:
    """What one step reports. The numbers stay 0-d tensors on the device, so that a step does not
    wait for the GPU: the trainer reads them (float()) only every `log_every` steps."""

    loss: torch.Tensor
    """The global batch's mean loss (every rank has the same)."""
    grad_norm: torch.Tensor
    """The global norm of the true gradients, before clipping."""
    stepped: bool
    """False when fp16 gradients overflowed and the optimizer step was skipped."""
    moe: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per MoE layer, this rank's load figures of the step (Runtime.moe_stats); {} for dense models."""


def train_step(
    runtime: Runtime,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Batch],
    *,
    grad_clip: float | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    loss_fn: LossFn | None = None,
    before_update: Callable[[Runtime], None] | None = None,
) -> StepResult:
    """Forward and backward, gradient norm (fp16: unscaled, overflow skips the step), clipping,
    optimizer and scheduler step. `before_update(runtime)` sees the true gradients before they
    are clipped (the parity harness compares them).

    Nothing here synchronises the host with the device except under fp16, whose loss scaler must
    know whether the gradients overflowed before it decides to step (one read of the norm)."""
    optimizer.zero_grad(set_to_none=True)
    local_loss = runtime.forward_backward(micro_batches, loss_fn)
    grad_norm, finite = runtime.grad_norm()
    if before_update is not None:
        before_update(runtime)
    if finite:
        runtime.clip_grads_(grad_clip, grad_norm)
        optimizer.step()
    if scheduler is not None and finite:
        scheduler.step()
    elif scheduler is not None:  # fp16 overflow: the trainer says so, and torch's warning that no optimizer
        with warnings.catch_warnings():  # step came first would mislead
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
            scheduler.step()
    return StepResult(loss=runtime.global_mean(local_loss), grad_norm=grad_norm.detach(), stepped=finite,
                      moe=runtime.moe_stats)


def split_micro(inputs: torch.Tensor, targets: torch.Tensor, num_micro: int) -> list[Batch]:
    """Split a rank's batch along the batch dim into `num_micro` equal micro-batches."""
    if inputs.shape[0] % num_micro:
        raise ValueError(f"{inputs.shape[0]} sequences per rank do not split into {num_micro} micro-batches")
    return list(zip(inputs.chunk(num_micro), targets.chunk(num_micro)))
