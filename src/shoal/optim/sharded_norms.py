"""Norms of whole parameters under every sharding, for the large-batch optimizers (shoal/optim/lamb_lars.py,
shoal/optim/cowclip.py).

LAMB and LARS take a layer-wise trust ratio, CowClip the norm of every embedding row and of its gradient,
while under ZeRO/FSDP2 and tensor parallelism the optimizer holds DTensor shards, and a norm over a shard is
silently wrong. Here every parameter's squared norm (or, for a stacked expert weight or an embedding table,
each row's) is computed from the local shard, all of them packed into one vector per set of mesh groups they
are split over, and that vector all-reduced once per group (the packing of apex's DistributedFusedLAMB): the
number of collectives in a step depends on the mesh layout, never on the number of parameters, and no value
is read on the host. `ShardedNorms` does this; the optimizers call it once per step (LAMB, LARS) or twice
(CowClip: the row norms, then the ids' counts over the data ranks).

Trust ratios: one per parameter tensor; a tensor of three or more dimensions (the MoE experts, stacked as
(E, ...)) gets one per leading index, i.e. per expert. Updates run on the shards' local tensors with torch's
foreach ops; the state tensors are DTensors shaped like their parameters, so checkpoints reshard them as they
do AdamW's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (sharing its storage), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """`param.grad`'s local shard laid out as the parameter's. A tensor-parallel gradient can come
    placed otherwise (Replicate where the weight is Shard): taking the shard's part is local."""
    grad = param.grad
    assert grad is not None
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        if any(p.is_partial() for p in grad.placements):
            raise ValueError(f"a gradient placed as {grad.placements} is not reduced yet; valid: Shard or Replicate")
        param.grad = grad = grad.redistribute(param.device_mesh, param.placements)
    return local_tensor(grad)


def split_groups(param: torch.Tensor, *, rows: bool) -> tuple[dist.ProcessGroup, ...]:
    """The process groups a local squared norm of `param` must be summed over to be the global
    one: every mesh dimension that shards it. With `rows` (one norm per leading index), a shard
    along dim 0 keeps whole rows on each rank, so only shards of the other dims count."""
    if not isinstance(param, DTensor):
        return ()
    groups = []
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_partial():
            raise ValueError(f"a parameter placed as {placement} has no norm of its own; valid: Shard or Replicate")
        dim = getattr(placement, "dim", None)  # Shard and FSDP2-over-tp's _StridedShard
        if dim is not None and not (rows and dim == 0):
            groups.append(param.device_mesh.get_group(mesh_dim))
    return tuple(groups)


class ShardedNorms:
    """Global squared norms of many (possibly sharded) tensors, with a fixed number of collectives.

    `add(local_sq, groups)` queues a vector of local squared norms (one entry for a whole tensor,
    one per row otherwise) with the groups it is split over (`split_groups`); `reduce()` packs the
    queued vectors by (groups, device), all-reduces each pack once per group, and returns every
    vector, global, in the order added. `collectives` counts the all-reduces of the last reduce().
    """

    def __init__(self) -> None:
        self._pieces: list[tuple[torch.Tensor, tuple[dist.ProcessGroup, ...]]] = []
        self.collectives = 0

    def add(self, local_sq: torch.Tensor, groups: tuple[dist.ProcessGroup, ...]) -> int:
        vec = local_sq.reshape(-1)  # half-precision norms summed in float32, others in their own dtype
        self._pieces.append((vec.float() if vec.dtype.itemsize < 4 else vec, groups))
        return len(self._pieces) - 1

    def reduce(self) -> list[torch.Tensor]:
        packs: dict[tuple[Any, ...], list[int]] = {}
        for i, (vec, groups) in enumerate(self._pieces):
            packs.setdefault((tuple(id(g) for g in groups), vec.device), []).append(i)
        out: list[torch.Tensor] = [vec for vec, _ in self._pieces]
        self.collectives = 0
        for indices in packs.values():
            groups = self._pieces[indices[0]][1]
            if not groups:
                continue
            packed = torch.cat([out[i] for i in indices])
            for group in groups:
                dist.all_reduce(packed, group=group)
                self.collectives += 1
            for i, vec in zip(indices, packed.split([out[i].numel() for i in indices])):
                out[i] = vec
        self._pieces = []
        return out


def sq_norms(tensors: Sequence[torch.Tensor], rows: Sequence[bool]) -> list[torch.Tensor]:
    """Local squared norms: of whole tensors (torch's foreach norm) or of each leading row."""
    whole = [t for t, r in zip(tensors, rows) if not r]
    norms = iter(torch._foreach_norm(whole) if whole else [])
    return [t.flatten(1).square().sum(1) if r else next(norms).square() for t, r in zip(tensors, rows)]


def per_row(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A scalar or per-row vector shaped to broadcast over `like`."""
    return value.reshape(-1, *([1] * (like.dim() - 1))) if value.numel() > 1 or like.dim() > 1 else value.reshape(())


def trust_ratio(num_sq: torch.Tensor, den_sq: torch.Tensor) -> torch.Tensor:
    """sqrt(num_sq) / sqrt(den_sq), or 1 where either norm is zero (the papers' convention)."""
    ok = (num_sq > 0) & (den_sq > 0)
    return torch.where(ok, num_sq.sqrt() / den_sq.sqrt().clamp(min=torch.finfo(den_sq.dtype).tiny), 1.0)


def local_rows(param: torch.Tensor) -> slice:
    """The rows of the global tensor this rank's shard of `param` holds (all for a plain tensor)."""
    if not isinstance(param, DTensor):
        return slice(0, param.shape[0])
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return slice(offset[0], offset[0] + shape[0])
