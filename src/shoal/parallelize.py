"""parallelize(model, plan, mesh): apply the plan's parallelisms to an unmodified model.

The order is fixed (as in torchtitan): tensor -> activation recompute -> data/sharded data.
Each step is a no-op when its axis has degree 1.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shoal.parallel.data import apply_data_parallel
from shoal.parallel.recompute import apply_recompute
from shoal.parallel.tensor import apply_tensor_parallel
from shoal.plan import Plan

# Axes and options a Plan can name that this version does not run yet.
_NOT_YET = {"pp": "pipeline", "cp": "context", "ep": "expert"}


def check_supported(plan: Plan) -> None:
    """ValueError naming the first part of `plan` this version of shoal cannot run."""
    for axis, what in _NOT_YET.items():
        if getattr(plan, axis) > 1:
            raise ValueError(f"{axis}{getattr(plan, axis)}: {what} parallelism is not available in this version of shoal yet")
    if plan.auto:
        raise ValueError("plan 'auto' needs the planner, which is not available in this version of shoal yet")


def parallelize(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> nn.Module:
    """Apply `plan` to `model` on `mesh`; returns the model to train (possibly a wrapper)."""
    check_supported(plan)
    model = apply_tensor_parallel(model, mesh=mesh, plan=plan)
    model = apply_recompute(model, plan=plan)
    return apply_data_parallel(model, mesh=mesh, plan=plan)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any wrapper parallelize added."""
    return getattr(model, "module", model)
