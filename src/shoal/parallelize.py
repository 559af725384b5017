"""parallelize(model, plan, mesh): apply the plan's parallelisms to an unmodified model and return
the runtime (shoal/runtime.py) that trains it.

The order is fixed (as in torchtitan): tensor -> context -> activation recompute -> compile ->
data/sharded data.
Each step is a no-op when its axis has degree 1.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shoal.parallel.choice import choose_engine
from shoal.parallel.compile import apply_compile
from shoal.parallel.context import apply_context_parallel
from shoal.parallel.data import TorchDataEngine, apply_data_parallel, transformer_blocks
from shoal.parallel.recompute import apply_recompute
from shoal.parallel.tensor import apply_tensor_parallel
from shoal.plan import Plan
from shoal.runtime import Runtime

# Axes and options a Plan can name that this version does not run yet.
_NOT_YET = {"pp": "pipeline", "ep": "expert"}


def check_supported(plan: Plan) -> None:
    """ValueError naming the first part of `plan` this version of shoal cannot run."""
    for axis, what in _NOT_YET.items():
        if getattr(plan, axis) > 1:
            raise ValueError(f"{axis}{getattr(plan, axis)}: {what} parallelism is not available in this version of shoal yet")
    if plan.auto:
        raise ValueError("plan 'auto' needs the planner, which is not available in this version of shoal yet")


def parallelize(model: nn.Module, plan: Plan | None = None, mesh: DeviceMesh | None = None) -> Runtime:
    """Apply `plan` to `model` on `mesh` (in place) and return the runtime that trains it.

    Without a plan and mesh: the model alone in this process (no process group needed), the same
    runtime interface at degree 1 everywhere.
    """
    if plan is None and mesh is None:
        return Runtime(TorchDataEngine(model, model), plan=None, mesh=None, choice=None)
    if plan is None or mesh is None:
        raise ValueError("parallelize needs both a plan and a mesh, or neither (one process)")
    plan = plan.resolve(mesh.size(), mesh.device_type)
    check_supported(plan)
    choice = choose_engine(plan, num_layers=len(transformer_blocks(model)))
    model = apply_tensor_parallel(model, mesh=mesh, plan=plan)
    context = apply_context_parallel(model, mesh=mesh, mode=plan.cp_mode)
    model = apply_recompute(model, plan=plan)
    model = apply_compile(model, plan=plan)
    engine = apply_data_parallel(model, mesh=mesh, plan=plan, choice=choice)
    return Runtime(engine, plan=plan, mesh=mesh, choice=choice, context=context)
