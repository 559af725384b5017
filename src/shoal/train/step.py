"""One optimizer step through the parallel runtime: the piece the trainer, the benchmarks and the
parity harness share.

Every rank calls `train_step` with its own slice of the global batch, split into micro-batches
for gradient accumulation. The loss is the mean over every target of the *global* batch (targets
a loss mask excludes are IGNORE): the runtime weighs each micro-batch by its share of the global
count of targets (Runtime.share) and the data-parallel engine averages over ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from shoal.loss import Batch, LossFn
from shoal.optim.gate import gated_step
from shoal.runtime import Runtime


@dataclass(frozen=True)
class StepResult:
    """What one step reports. The numbers stay 0-d tensors on the device, so that a step does not
    wait for the GPU: the trainer reads them (float()) only every `log_every` steps."""

    loss: torch.Tensor
    """The global batch's mean loss (every rank has the same)."""
    grad_norm: torch.Tensor
    """The global norm of the true gradients, before clipping."""
    applied: torch.Tensor
    """0-d bool: the update was applied (loss and gradient norm finite). Where false, no weight and no
    optimizer state changed (shoal.optim.gate)."""
    overflow: torch.Tensor
    """0-d bool: fp16's scaled gradients overflowed while the loss was finite and the scale above 1: the
    loss scale's warm-up, skipped and not counted as a non-finite step (shoal.parallel.precision)."""
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
    """Forward and backward, gradient norm (fp16: unscaled), clipping, optimizer step (and the MoE routers'
    selection biases: Runtime.update_router_bias) and scheduler step.
    `before_update(runtime)` sees the true gradients before they are clipped (the parity harness
    compares them).

    The update is gated on the device: where the global loss or the global gradient norm is not
    finite (both are the same on every rank, so the check needs no collective) the optimizer step
    changes nothing (shoal.optim.gate). The schedule advances either way: it follows the step index.
    Nothing here synchronises the host with the device, fp16 included."""
    optimizer.zero_grad(set_to_none=True)
    local_loss = runtime.forward_backward(micro_batches, loss_fn)
    loss = runtime.global_mean(local_loss)
    grad_norm, overflow = runtime.grad_norm()
    if before_update is not None:
        before_update(runtime)
    runtime.enter("optimizer")
    loss_ok = torch.isfinite(loss.to(grad_norm.device))
    applied = loss_ok & torch.isfinite(grad_norm)
    runtime.clip_grads_(grad_clip, grad_norm)
    gated_step(optimizer, applied)
    runtime.update_router_bias(applied)
    if scheduler is not None:
        scheduler.step()
    overflow = overflow & loss_ok if overflow is not None else torch.zeros_like(applied)
    return StepResult(loss=loss, grad_norm=grad_norm.detach(), applied=applied, overflow=overflow,
                      moe=runtime.moe_stats)


def split_micro(inputs: torch.Tensor, targets: torch.Tensor, num_micro: int) -> list[Batch]:
    """Split a rank's batch along the batch dim into `num_micro` equal micro-batches."""
    if inputs.shape[0] % num_micro:
        raise ValueError(f"{inputs.shape[0]} sequences per rank do not split into {num_micro} micro-batches")
    return list(zip(inputs.chunk(num_micro), targets.chunk(num_micro)))
