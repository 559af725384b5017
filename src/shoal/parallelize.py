"""parallelize(model, plan, mesh): apply the plan's parallelisms to an unmodified model and return
the runtime (shoal/runtime.py) that trains it.

The order is fixed (as in torchtitan): pipeline split -> tensor -> context -> activation
recompute -> compile -> data/sharded data, the later ones applied to each stage a rank runs.
Each step is a no-op when its axis has degree 1.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.device_mesh import DeviceMesh

from shoal.parallel.choice import choose_engine
from shoal.parallel.compile import apply_compile
from shoal.parallel.context import ContextSplit, apply_context_parallel
from shoal.parallel.choice import EngineChoice
from shoal.parallel.data import TorchDataEngine, apply_data_parallel, transformer_blocks
from shoal.parallel.expert import ExpertGrads, apply_expert_parallel, ep_mesh
from shoal.parallel.pipeline import Pipeline, build_stages, merged_view
from shoal.parallel.schedules import split_backward
from shoal.parallel.recompute import apply_recompute
from shoal.parallel.tensor import apply_tensor_parallel
from shoal.plan import Plan
from shoal.runtime import Runtime

# Axes and options a Plan can name that this version does not run yet.
_NOT_YET: dict[str, str] = {}


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
    if plan.pp == 1:
        choice = choose_engine(plan, num_layers=len(transformer_blocks(model)))
        model, context = _within_stage(model, mesh, plan)
        experts = _experts(model, mesh, plan, choice)
        engine = apply_data_parallel(model, mesh=mesh, plan=plan, choice=choice)
        return Runtime(engine, plan=plan, mesh=mesh, choice=choice, context=context, experts=experts)
    stages, layers = build_stages(model, rank=mesh["pp"].get_local_rank(), num_ranks=plan.pp, vpp=plan.vpp,
                          split=plan.split)
    choice = choose_engine(plan, num_layers=max(len(transformer_blocks(m)) for m in stages.values()))
    if plan.vpp > 1 and choice.kind != "none":
        raise ValueError(f"sched=interleaved runs with pp, tp and cp only in this version (a data engine per "
                         f"chunk is not built yet); plan {plan} uses {choice.kind}; valid: sched=1f1b, gpipe or zb, "
                         f"or no dp/fsdp axis")
    if split_backward(plan.sched) and choice.kind == "fsdp2":
        raise ValueError(f"sched=zb does not run on FSDP2 in this version (its weight passes bypass FSDP2's "
                         f"gradient hooks); plan {plan} needs FSDP2 (zero=3, tp or offload with data axes); valid: "
                         f"sched=1f1b or gpipe, or zero=1/2 without tp")
    for s, stage in stages.items():
        stages[s], context = _within_stage(stage, mesh, plan)
    modules, reduce = dict(stages), None
    if len(stages) == 1:
        (s, stage), = stages.items()
        engine = apply_data_parallel(stage, mesh=mesh, plan=plan, choice=choice)
        stages[s] = engine.model
        if choice.kind == "zero":
            reduce = engine.reduce_grads  # type: ignore[attr-defined]
    else:
        view = merged_view(stages)
        engine = TorchDataEngine(view, view)
    pipeline = Pipeline(stages, plan.sched, plan.micro_batches, mesh, layers, vpp=plan.vpp, sync=engine.no_sync,
                        modules=modules, reduce=reduce)
    return Runtime(engine, plan=plan, mesh=mesh, choice=choice, context=context, pipeline=pipeline)


def _experts(model: nn.Module, mesh: DeviceMesh, plan: Plan, choice: EngineChoice) -> ExpertGrads | None:
    """ep > 1: the experts split over the ep axis; DDP told to leave their weights alone."""
    if plan.ep == 1:
        return None
    if choice.kind != "ddp":
        raise ValueError(f"ep={plan.ep} runs with replicated data parallelism in fp32 (torch DDP) in this version; "
                         f"plan {plan} needs {choice.kind}; valid: dpN,epM with precision=fp32")
    emesh = ep_mesh(mesh.size(), plan.ep, mesh.device_type)
    names = apply_expert_parallel(model, emesh)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    params = dict(model.named_parameters())
    return ExpertGrads([params[n] for n in names], emesh, plan.data_ranks)


def _within_stage(model: nn.Module, mesh: DeviceMesh, plan: Plan) -> tuple[nn.Module, ContextSplit | None]:
    """The parallelisms inside one model part, in order: tensor, context, recompute, compile."""
    model = apply_tensor_parallel(model, mesh=mesh, plan=plan)
    context = apply_context_parallel(model, mesh=mesh, mode=plan.cp_mode)
    model = apply_recompute(model, plan=plan)
    return apply_compile(model, plan=plan), context
