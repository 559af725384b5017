"""Data parallelism over the mesh's dp axis (and, with the fsdp axis, sharded data parallelism).

dp alone uses torch's DistributedDataParallel on the dp sub-mesh's process group: bucketed
gradient all-reduce overlapped with backward, the well-kept path for replicated training.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from shoal.plan import Plan


def apply_data_parallel(model: nn.Module, *, mesh: DeviceMesh, plan: Plan) -> nn.Module:
    """Replicate `model` over the dp axis; returns the wrapped model (the same one at degree 1)."""
    if plan.fsdp > 1:
        raise ValueError(f"fsdp={plan.fsdp}: sharded data parallelism is not available in this version of shoal yet")
    dp = mesh["dp"]
    if dp.size() == 1:
        return model
    if plan.tp > 1:
        raise ValueError("dp combined with tp is not available in this version of shoal yet")
    return DistributedDataParallel(model, process_group=dp.get_group(), broadcast_buffers=False)
