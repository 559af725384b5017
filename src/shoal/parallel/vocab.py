"""Vocabulary-parallel cross-entropy: the classifier's softmax computed across vocabulary shards.

A tensor-parallel model's output projection is column-parallel, so its logits arrive as a
DTensor sharded on the vocabulary dim (each rank holds (B, T, V/t)). Gathering them would cost
B*T*V floats per rank, the very memory a wide classifier splits to save. Instead the
log-softmax is taken across shards: the per-token maximum and sum of exponentials are
all-reduced over tp (two (B*T,) all-reduces), the target logit is read on the rank that holds
it (a masked partial sum), and the gradient softmax - one_hot is formed locally with no
communication. That is DTensor's `loss_parallel` (torch.distributed.tensor.parallel), which
works on gloo; it must be active around the loss *and* its backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel


def is_vocab_sharded(logits: torch.Tensor) -> bool:
    """True for logits that are a DTensor sharded on their last (vocabulary) dim."""
    if not isinstance(logits, DTensor):
        return False
    last = logits.ndim - 1
    return any(isinstance(p, Shard) and p.dim % logits.ndim == last for p in logits.placements)


@contextlib.contextmanager
def vocab_parallel_loss(logits: torch.Tensor) -> Iterator[None]:
    """Around the loss and its backward: computes cross-entropy on vocab-sharded logits shard by
    shard (DTensor's loss_parallel); does nothing for plain logits."""
    if not is_vocab_sharded(logits):
        yield
        return
    with loss_parallel():
        yield


IGNORE = -100
"""A target that takes no loss (a prompt or user token of fine-tuning data): torch's ignore_index."""


def cross_entropy(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position whose target is not IGNORE (call inside
    `vocab_parallel_loss`).

    For vocab-sharded logits the result is a replicated DTensor (the same global mean on every
    tp rank); `local_value` turns it into a plain tensor for logging."""
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten(), ignore_index=IGNORE)


def cross_entropy_sum(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """The sum of the next-token cross-entropies of the targets that are not IGNORE: the runtime
    divides it by the global batch's count of such targets (Runtime.forward_backward). A
    classifier's logits (B, V) with targets (B,) (an image Mixer) take one target per row."""
    logits_NV = logits_BTV if logits_BTV.dim() == 2 else logits_BTV.flatten(0, 1)
    return F.cross_entropy(logits_NV.float(), targets_BT.flatten(), ignore_index=IGNORE, reduction="sum")


def num_targets(targets_BT: torch.Tensor) -> torch.Tensor:
    """How many targets of a batch take a loss (are not IGNORE), as a 0-d int64 tensor."""
    return (targets_BT != IGNORE).sum()


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain float tensor of `loss` (a replicated DTensor's local copy), where it lives."""
    loss = loss.detach()
    if isinstance(loss, DTensor):
        loss = loss.to_local()
    return loss.float()
