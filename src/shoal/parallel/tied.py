"""Tied input and output embeddings across pipeline stages, as Megatron-LM keeps them.

The first stage looks tokens up in the embedding table; the last stage's head multiplies by the
same table. Under pp they are two ranks, so each keeps a copy (shoal.parallel.pipeline keeps the
tied module on the last stage; both copies start equal: the same name gives the same initial or
pretrained values). The table's true gradient is the sum of the two uses' gradients, so after
every backward (the data engine's reduction done) `TiedGrads.sync` all-reduces the copies'
gradients between the first and the last stage of each pipeline: both then hold the true
gradient, and any optimizer moves them identically. The global gradient norm would count the
table twice: `duplicate_square` is what the last stage takes off its share.

The gradients may be sharded by the data engine (FSDP2, ZeRO-1/2) or by tp: both copies are
sharded alike (same shape, same placement, ranks at the same data and tp coordinates), so the
local shards are all-reduced as they are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shoal.mesh import shared_group


def tie_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The group of this rank's pipeline's first and last stage ranks (None: this rank holds
    neither). Collective over the whole mesh when pp > 2 (each pair is a new group)."""
    pp = mesh["pp"].size()
    if pp == 2:
        return mesh["pp"].get_group()
    names = list(mesh.mesh_dim_names or ())
    rows = mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, pp).tolist()
    mine = None
    for row in rows:  # every rank creates (or finds) every group, in the same order
        group = shared_group((row[0], row[-1]))
        if dist.get_rank() in (row[0], row[-1]):
            mine = group
    return mine


class TiedGrads:
    """The tied copies on this rank (`params`: the embedding on the first stage, the head's copy on
    the last) and the group to sum their gradients over."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, *, last: bool) -> None:
        self.params, self.group, self.last = params, group, last

    @torch.no_grad()
    def sync(self) -> None:
        """Sum the two copies' gradients (both stages then hold the whole model's gradient)."""
        for param in self.params:
            if param.grad is None:  # a stage that saw no tokens this step: add zeros
                param.grad = torch.zeros_like(param)
            grad = param.grad
            if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
                # tp: a lookup's gradient may come replicated or partial; the copies are summed shard by shard
                grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.group)

    @torch.no_grad()
    def duplicate_square(self, device: torch.device) -> torch.Tensor:
        """On the last stage, the squared norm of the copies' gradients (counted on the first stage
        already), else zero. Collective over a sharded gradient's mesh."""
        total = torch.zeros((), device=device)
        if not self.last:
            return total
        for param in self.params:
            if param.grad is not None:
                norm = torch.linalg.vector_norm(param.grad)
                total = total + (norm.full_tensor() if isinstance(norm, DTensor) else norm).to(device).square()
        return total
