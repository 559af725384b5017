"""The vocabulary tables sharded by rows over the fsdp ranks (plan option `vocab=sharded`).

Over the mesh FSDP2 shards on: fsdp (or fsdp x cp, whose ranks see other tokens of the same
sequences), replicated over dp under HSDP, where each shard's gradient is then averaged over dp.

FSDP2 gathers a unit's whole weight before it runs and reduces its whole gradient after: for the
tables of a large vocabulary (the token embedding and the classifier, V x D each) that is, on every
rank in backward, the table gathered, its unsharded (V, D) gradient and the reduce-scatter's (V, D)
input beside the shards. With 500,000 words and D = 512 each of those is 1 GB, more than the rank's
shard of the whole model. Here each table stays a `Shard(0)` DTensor over the fsdp ranks (the layout
FSDP2 gives it, so checkpoints, the optimizer and the gradient norm see nothing new) and is never
gathered: the activations travel instead, as in Megatron-LM's vocabulary-parallel embedding and
classifier, over the data ranks rather than the tensor ranks. Rank r holds rows [start_r, stop_r).

The embedding, forward: all-gather the fsdp ranks' token ids; look up those in this rank's rows
(zero for the others); reduce-scatter the (N*T, D) partial embeddings, so each rank gets its own
tokens' rows (a sum of one row and zeros: exact). Backward: all-gather the (N*T, D) gradient and
add each token's row into this rank's rows of the table's gradient.

The classifier, forward: all-gather the hidden states X (N*T, D); logits of every rank's tokens on
this rank's words, X @ W_r^T; all-to-all, so each rank receives its own tokens' logits on every word,
(T, V): what the unsharded classifier returns, so the loss, evaluation and sampling see ordinary
logits. Backward is the mirror: the logits' gradient goes back by all-to-all; W_r's gradient is
formed from every rank's tokens; the hidden states' gradient is reduce-scattered to their owners.

Each rank's loss is its share of the global one and FSDP2 averages the other gradients over the N
ranks, so a table shard's gradient, summed over every rank's tokens, is divided by N: that average.

Per micro-batch this moves 2 x N*T*D (embedding rows and their gradient), 2 x N*T*D (hidden states
and their gradient) and 2 x T*V (logits and their gradient) instead of FSDP2's 2 x V*D per table,
and holds the tables' shards instead of three gathered tables, for one more (T, V) logits buffer
while an all-to-all runs. `shoal.rules` takes it by default where a table is at least a micro-batch's
logits (D >= T), where it holds and moves less.

Small autograd functions of our own: DTensor's sharding rules over the fsdp mesh would give
vocabulary-sharded logits of every rank's tokens, not each rank's own tokens' logits, and its loss
the global mean, not the share each data rank's loss takes in shoal (shoal/runtime.py).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard


@dataclass(frozen=True)
class _Groups:
    """Where a table's rows are split (`shards`, the mesh's last dim: fsdp, or fsdp x cp) and, under
    HSDP, the replicas of each shard (`replicas`, dp: their gradients are averaged, as FSDP2's are)."""

    shards: dist.ProcessGroup
    replicas: dist.ProcessGroup | None

    @staticmethod
    def of(mesh: DeviceMesh) -> _Groups:
        return _Groups(mesh.get_group(mesh.ndim - 1), mesh.get_group(0) if mesh.ndim == 2 else None)

    def average(self, grad_w: torch.Tensor) -> torch.Tensor:
        """A table shard's gradient, summed over its shard group's tokens: averaged over every data rank."""
        grad_w.div_(dist.get_world_size(self.shards))
        if self.replicas is not None:
            dist.all_reduce(grad_w, group=self.replicas)
            grad_w.div_(dist.get_world_size(self.replicas))
        return grad_w


def shard_embedding(embedding: nn.Embedding, mesh: DeviceMesh) -> nn.Parameter:
    """Make `embedding` (a plain lookup: no padding index, max_norm or sparse gradients; on a real or
    the meta device) hold only this rank's rows of its table over `mesh` (the data mesh FSDP2 runs on:
    1-D shards, or 2-D (replicas, shards)), looking tokens up as the module docstring says. Returns the
    new parameter (for FSDP2 to leave alone)."""
    assert embedding.padding_idx is None and embedding.max_norm is None and not embedding.sparse, \
        "the sharded embedding is a plain lookup"
    start, _ = _shard_in_place(embedding, mesh)
    groups = _Groups.of(mesh)

    def forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        return _ShardedLookup.apply(ids, _local(self.weight), groups, start)

    embedding.forward = types.MethodType(forward, embedding)  # type: ignore[method-assign]
    return embedding.weight  # type: ignore[return-value]  # the Parameter _shard_in_place set


def shard_classifier(linear: nn.Linear, mesh: DeviceMesh, *, tied_to: nn.Parameter | None = None) -> nn.Parameter:
    """Make `linear` (a bias-free classifier, on a real or the meta device) hold only this rank's
    rows of its weight over `mesh` (as `shard_embedding`), computing its logits as the module docstring
    says; `tied_to`: the embedding's sharded table, which a tied classifier uses as its weight (both
    lookups' gradients add up in it). Returns the parameter (for FSDP2 to leave alone)."""
    assert linear.bias is None, "the sharded classifier takes no bias"
    if tied_to is not None:
        linear.weight = tied_to
    else:
        _shard_in_place(linear, mesh)
    groups = _Groups.of(mesh)

    def forward(self: nn.Linear, x_BTD: torch.Tensor) -> torch.Tensor:
        return _ShardedLogits.apply(x_BTD, _local(self.weight).to(x_BTD.dtype), groups, self.out_features)

    linear.forward = types.MethodType(forward, linear)
    return linear.weight


def _shard_in_place(module: nn.Embedding | nn.Linear, mesh: DeviceMesh) -> tuple[int, int]:
    """Replace `module.weight` by this rank's rows, a DTensor over `mesh` (Shard(0) on its last dim,
    replicated on the other: FSDP2's layout, also under HSDP); its (start, stop)."""
    full = module.weight
    start, stop = _rows(full.shape[0], mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1))
    local = full.detach()[start:stop].clone()
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    sharded = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
    module.weight = nn.Parameter(sharded, requires_grad=full.requires_grad)
    return start, stop


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's rows (differentiable: the gradient arrives as a Shard(0) DTensor like the weight)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _rows(vocab: int, ranks: int, rank: int) -> tuple[int, int]:
    """The rows of a (vocab, D) table rank `rank` of `ranks` holds under Shard(0): torch.chunk's split
    (ceil(vocab / ranks) rows each, the last ranks fewer or none), as DTensor and FSDP2 split."""
    size = -(-vocab // ranks)
    start = min(rank * size, vocab)
    return start, min(start + size, vocab)


# torch 2.13 renamed the flat collectives; older releases in shoal's range only have the old names.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class _ShardedLookup(torch.autograd.Function):
    """(…) token ids and this rank's (V_r, D) rows -> (…, D) embeddings of this rank's tokens."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, w_local: torch.Tensor, groups: _Groups, start: int) -> torch.Tensor:
        group = groups.shards
        ranks = dist.get_world_size(group)
        ids_T = ids.reshape(-1).contiguous()
        ids_all = ids_T.new_empty((ranks * ids_T.numel(),))
        _all_gather(ids_all, ids_T, group=group)
        local = ids_all - start
        mine = (local >= 0) & (local < w_local.shape[0])
        local = torch.where(mine, local, 0)
        rows = F.embedding(local, w_local) if w_local.shape[0] else w_local.new_zeros((local.numel(), w_local.shape[1]))
        rows.masked_fill_(~mine[:, None], 0)  # other ranks' words: zero rows (x + 0 = x, so the sum is exact)
        out = rows.new_empty((*ids.shape, w_local.shape[1]))
        _reduce_scatter(out.view(ids_T.numel(), -1), rows, group=group)
        ctx.save_for_backward(local, mine)
        ctx.groups, ctx.ranks, ctx.rows = groups, ranks, w_local.shape[0]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:
        local, mine = ctx.saved_tensors
        grad_TD = grad.reshape(-1, grad.shape[-1]).contiguous()
        grad_all = grad_TD.new_empty((ctx.ranks * grad_TD.shape[0], grad_TD.shape[1]))
        _all_gather(grad_all, grad_TD, group=ctx.groups.shards)
        grad_w = grad_all.new_zeros((ctx.rows, grad_all.shape[1]))
        grad_w.index_add_(0, local[mine], grad_all[mine])
        return None, ctx.groups.average(grad_w), None, None


class _ShardedLogits(torch.autograd.Function):
    """(…, D) hidden states and this rank's (V_r, D) rows -> (…, V) logits of this rank's tokens."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w_local: torch.Tensor, groups: _Groups, vocab: int) -> torch.Tensor:
        group = groups.shards
        ranks = dist.get_world_size(group)
        x_TD = x.reshape(-1, x.shape[-1]).contiguous()
        tokens = x_TD.shape[0]
        x_all = x_TD.new_empty((ranks * tokens, x_TD.shape[1]))
        _all_gather(x_all, x_TD, group=group)
        width = -(-vocab // ranks)  # every rank's piece padded to the widest, for one all-to-all
        logits_mine = x_all @ w_local.t()
        if w_local.shape[0] < width:  # a last rank with fewer rows: zero logits fill its piece
            logits_mine = F.pad(logits_mine, (0, width - w_local.shape[0]))
        received = torch.empty_like(logits_mine)
        dist.all_to_all_single(received, logits_mine, group=group)  # rank s gets rows s*T.. of every piece
        del logits_mine
        logits = received.new_empty((*x.shape[:-1], vocab))  # a tensor of its own, not a view (FSDP2 warns)
        logits_TV = logits.view(tokens, vocab)
        for r in range(ranks):  # rank r's piece: its words' columns
            start, stop = _rows(vocab, ranks, r)
            logits_TV[:, start:stop] = received[r * tokens:(r + 1) * tokens, :stop - start]
        ctx.save_for_backward(x_all, w_local)
        ctx.groups, ctx.ranks, ctx.tokens, ctx.width = groups, ranks, tokens, width
        ctx.x_shape = x.shape
        return logits

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x_all, w_local = ctx.saved_tensors
        ranks, tokens, width = ctx.ranks, ctx.tokens, ctx.width
        grad_TV = grad.reshape(tokens, -1)
        if grad_TV.shape[1] < ranks * width:
            grad_TV = F.pad(grad_TV, (0, ranks * width - grad_TV.shape[1]))
        send = grad_TV.view(tokens, ranks, width).transpose(0, 1).contiguous().view(ranks * tokens, width)
        del grad_TV
        grad_mine = torch.empty_like(send)
        dist.all_to_all_single(grad_mine, send, group=ctx.groups.shards)  # every rank's tokens, this rank's words
        del send
        grad_mine = grad_mine[:, :w_local.shape[0]]
        grad_w = ctx.groups.average(grad_mine.t() @ x_all)
        grad_x_all = grad_mine @ w_local
        grad_x = grad_x_all.new_empty((tokens, grad_x_all.shape[1]))
        _reduce_scatter(grad_x, grad_x_all, group=ctx.groups.shards)
        return grad_x.reshape(ctx.x_shape), grad_w, None, None
