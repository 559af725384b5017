"""Vocabulary-parallel cross-entropy: the classifier's softmax computed across vocabulary shards.

A tensor-parallel model's output projection is column-parallel, so its logits arrive as a
DTensor sharded on the vocabulary dim (each rank holds (B, T, V/t)). Gathering them would cost
B*T*V floats per rank, the very memory a wide classifier splits to save. Instead the
log-softmax is taken across shards: the per-token maximum and sum of exponentials are
all-reduced over tp (two (B*T,) all-reduces), the target logit is read on the rank that holds
it (a masked partial sum), and the gradient softmax - one_hot is formed locally with no
communication. That is DTensor's `loss_parallel` (torch.distributed.tensor.parallel), which
works on gloo; it must be active around the loss *and* its backward.

Logits that are not sharded take a cross-entropy of our own (`_SumCrossEntropy`) instead of torch's:
torch's keeps three (N, V) tensors at its backward's peak (the saved log-softmax, the gradient
arriving at it, the gradient it hands back), which with a large vocabulary outweighs the whole rest
of a step's activations. Ours keeps only the logits (the log-softmax is taken again in backward, a
block of rows at a time) and, when the caller hands the logits over (the runtime does), writes the
gradient softmax - one_hot into their storage: one (N, V) tensor, as Megatron-LM's vocabulary-parallel
cross-entropy does with its softmax.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from shoal.loss import IGNORE


def is_vocab_sharded(logits: torch.Tensor) -> bool:
    """True for logits that are a DTensor sharded on their last (vocabulary) dim."""
    if not isinstance(logits, DTensor):
        return False
    last = logits.ndim - 1
    return any(isinstance(p, Shard) and p.dim % logits.ndim == last for p in logits.placements)


@contextlib.contextmanager
def vocab_parallel_loss(logits: torch.Tensor) -> Iterator[None]:
    """Around the loss and its backward: computes cross-entropy on vocab-sharded logits shard by
    shard (DTensor's loss_parallel); does nothing for plain logits. It keeps no reference to the logits:
    the context lasts through the backward, and the logits would outlive the loss that needs them."""
    sharded = is_vocab_sharded(logits)
    del logits
    if not sharded:
        yield
        return
    with loss_parallel():
        yield



def cross_entropy(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position whose target is not IGNORE (call inside
    `vocab_parallel_loss`).

    For vocab-sharded logits the result is a replicated DTensor (the same global mean on every
    tp rank); `local_value` turns it into a plain tensor for logging."""
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten(), ignore_index=IGNORE)


def cross_entropy_sum(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, *, consume: bool = False) -> torch.Tensor:
    """The sum of the next-token cross-entropies of the targets that are not IGNORE: the runtime
    divides it by the global batch's count of such targets (Runtime.forward_backward). A
    classifier's logits (B, V) with targets (B,) (an image classifier) take one target per row.

    consume: the caller will not read the logits again, so the backward may write the gradient
    into them (one (N, V) tensor at the peak instead of two); vocab-sharded logits ignore it."""
    logits_NV = logits_BTV if logits_BTV.dim() == 2 else logits_BTV.flatten(0, 1)
    if isinstance(logits_NV, DTensor):  # loss_parallel's (or DTensor's) own rules
        return F.cross_entropy(logits_NV.float(), targets_BT.flatten(), ignore_index=IGNORE, reduction="sum")
    logits_NV = logits_NV.float()
    owned = consume or logits_NV.dtype != logits_BTV.dtype  # a 16-bit input's fp32 copy is ours to overwrite
    return _SumCrossEntropy.apply(logits_NV, targets_BT.flatten(), owned)


ROWS_ELEMENTS = 1 << 22
"""How many logits (rows x vocabulary) one block of the log-softmax or the gradient works on at a
time: its temporaries stay 16 MB each in fp32, however large the vocabulary or the batch."""


class _SumCrossEntropy(torch.autograd.Function):
    """torch's F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum"), bit for bit: the
    same log-softmax and nll_loss kernels, forward and backward, applied to blocks of rows (each row's
    log-softmax is computed alone, so a block gives the bits the whole tensor gives), keeping only the
    logits between forward and backward and writing the gradient into them when they are `owned`."""

    @staticmethod
    def forward(ctx: Any, logits_NV: torch.Tensor, targets_N: torch.Tensor, owned: bool) -> torch.Tensor:
        valid_N = targets_N != IGNORE
        index_N1 = torch.where(valid_N, targets_N, 0)[:, None]
        picked_N1 = torch.cat([torch.log_softmax(piece, dim=-1).gather(1, index)
                               for piece, index in zip(_pieces(logits_NV), _pieces(index_N1, logits_NV))])
        # nll_loss over the picked column sums them in the order and precision it sums the full rows in
        loss = F.nll_loss(picked_N1, torch.where(valid_N, 0, IGNORE), ignore_index=IGNORE, reduction="sum")
        ctx.save_for_backward(logits_NV, index_N1, valid_N)
        ctx.owned = owned
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits_NV, index_N1, valid_N = ctx.saved_tensors
        out_NV = logits_NV if ctx.owned else torch.empty_like(logits_NV)
        picked_N1 = torch.where(valid_N, -grad, 0.0)[:, None].to(logits_NV.dtype)  # nll_loss's gradient
        for piece, into, index, value in zip(_pieces(logits_NV), _pieces(out_NV, logits_NV),
                                             _pieces(index_N1, logits_NV), _pieces(picked_N1, logits_NV)):
            log_probs = torch.log_softmax(piece, dim=-1)
            upstream = torch.zeros_like(log_probs).scatter_(1, index, value)
            # the kernel torch's autograd runs for log_softmax's backward, so the gradient's bits are torch's
            into.copy_(torch._log_softmax_backward_data(upstream, log_probs, -1, piece.dtype))
        return out_NV, None, None


def _pieces(x: torch.Tensor, like: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Row blocks (views) of `x`, as many rows each as a block of `like` (default `x`) of about
    ROWS_ELEMENTS logits has."""
    return x.split(max(1, ROWS_ELEMENTS // max(1, (x if like is None else like).shape[-1])))


def num_targets(targets_BT: torch.Tensor) -> torch.Tensor:
    """How many targets of a batch take a loss (are not IGNORE), as a 0-d int64 tensor."""
    return (targets_BT != IGNORE).sum()


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain float tensor of `loss` (a replicated DTensor's local copy), where it lives."""
    loss = loss.detach()
    if isinstance(loss, DTensor):
        loss = loss.to_local()
    return loss.float()
