"""One optimizer step on a parallelized model: the piece the trainer and the parity tests share.

Every rank calls `train_step` with its own slice of the global batch (split into micro-batches
for gradient accumulation). The loss is the mean over the *global* batch: each micro-batch loss
is divided by the number of micro-batches and the data-parallel wrapper averages over ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shoal.mesh import all_reduce_mean
from shoal.parallel.vocab import cross_entropy, local_value, vocab_parallel_loss
from shoal.parallel.zero import ZeroDataParallel

Batch = tuple[torch.Tensor, torch.Tensor]


@torch.no_grad()
def eval_loss(model: nn.Module, micro_batches: Sequence[Batch]) -> torch.Tensor:
    """This rank's mean loss over the micro-batches, without gradients (a CPU scalar)."""
    total = torch.zeros(())
    for inputs, targets in micro_batches:
        logits = model(inputs)
        with vocab_parallel_loss(logits):  # tp: vocab-sharded logits, as in forward_backward
            total += local_value(cross_entropy(logits, targets))
    return total / len(micro_batches)


def forward_backward(model: nn.Module, micro_batches: Sequence[Batch]) -> torch.Tensor:
    """Run forward and backward over the micro-batches; returns this rank's mean loss (detached)."""
    total = torch.zeros(())
    scaler = getattr(model, "loss_scaler", None)  # fp16 only: shoal.parallel.precision.LossScaler
    for i, (inputs, targets) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            logits = model(inputs)
            with vocab_parallel_loss(logits):  # tp: vocab-sharded logits, softmax across shards
                loss = cross_entropy(logits, targets) / len(micro_batches)
                (scaler.scale(loss) if scaler is not None else loss).backward()
        total += local_value(loss)
    return total


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    """Global gradient L2 norm (sharded gradients included), clipped to `max_norm` when given."""
    if isinstance(model, ZeroDataParallel):  # its flat gradient shards: one collective, not one per tensor
        return model.clip_grad_norm_(max_norm).detach().cpu()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm is not None and max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return norm.detach().cpu()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Batch],
    *,
    mesh: DeviceMesh,
    grad_clip: float | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> tuple[float, float]:
    """forward/backward, clip, optimizer (and scheduler) step; returns (global mean loss, grad norm)."""
    optimizer.zero_grad(set_to_none=True)
    local_loss = forward_backward(model, micro_batches)
    scaler = getattr(model, "loss_scaler", None)  # fp16: unscale, clip, skip the step on overflow
    grad_norm = clip_grad_norm(model, grad_clip if scaler is None else None)
    step_ok = True
    if scaler is not None:
        step_ok, grad_norm = scaler.unscale_and_clip_(model, grad_norm, grad_clip)
    if step_ok:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return float(all_reduce_mean(local_loss, mesh)), float(grad_norm)


def split_micro(inputs: torch.Tensor, targets: torch.Tensor, num_micro: int) -> list[Batch]:
    """Split a rank's batch along the batch dim into `num_micro` equal micro-batches."""
    if inputs.shape[0] % num_micro:
        raise ValueError(f"{inputs.shape[0]} sequences per rank do not split into {num_micro} micro-batches")
    return list(zip(inputs.chunk(num_micro), targets.chunk(num_micro)))
