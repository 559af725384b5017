"""parallelize(model, plan, mesh): apply the plan's parallelisms to an unmodified model and return
the runtime (shoal/runtime.py) that trains it.

The order is fixed (as in torchtitan): pipeline split -> float8 conversion -> tensor -> context ->
activation recompute -> compile -> data/sharded data, the later ones applied to each stage a rank runs.
Each step is a no-op when its axis has degree 1. Whether the plan runs at all is asked of
shoal.rules first, the same question `shoal plan` and `shoal train` ask.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shoal import rules
from shoal.models.adapter import family_of_config
from shoal.models.lora import unquantized_bases
from shoal.moe.layer import MoELayer
from shoal.parallel.compile import apply_compile
from shoal.parallel.context import ContextSplit, apply_context_parallel
from shoal.parallel.data import DataEngine, TorchDataEngine, apply_data_parallel, blocks_of
from shoal.parallel.expert import ExpertGrads, apply_expert_parallel, ep_mesh
from shoal.parallel.float8 import apply_float8
from shoal.parallel.materialize import WeightSource, materialize, on_meta
from shoal.parallel.pipeline import Pipeline, build_stages, merged_view, tied_embeddings
from shoal.parallel.recompute import apply_recompute
from shoal.parallel.tensor import apply_tensor_parallel
from shoal.parallel.tied import TiedGrads, tie_group
from shoal.plan import Plan
from shoal.rules import EngineChoice, choose_engine
from shoal.runtime import Runtime


def parallelize(model: nn.Module, plan: Plan | None = None, mesh: DeviceMesh | None = None, *,
                seed: int = 0, weights: WeightSource | None = None) -> Runtime:
    """Apply `plan` to `model` on `mesh` (in place) and return the runtime that trains it.

    Without a plan and mesh: the model alone in this process (no process group needed), the same
    runtime interface at degree 1 everywhere. A model built on the meta device is materialized
    after the plan is applied, each rank allocating only its shards, with initial weights that
    are a function of `seed` and the parameter names alone (shoal/parallel/materialize.py), or
    read slice by slice from pretrained `weights` (shoal.models.safetensors_io.open_pretrained).
    """
    if weights is not None and not on_meta([model]):
        raise ValueError("pretrained weights= load while materializing: build the model on the meta device "
                         "(with torch.device('meta'): ...)")
    if plan is None and mesh is None:
        if on_meta([model]):
            materialize(model, seed=seed, device=torch.device("cpu"), weights=weights)
        return Runtime(TorchDataEngine(model, model), plan=None, mesh=None, choice=None)
    if plan is None or mesh is None:
        raise ValueError("parallelize needs both a plan and a mesh, or neither (one process)")
    config = getattr(model, "config", None)
    plan = rules.resolve(plan, world_size=mesh.size(), device=mesh.device_type,
                         model=config if family_of_config(config) is not None else None,
                         num_layers=len(blocks_of(model)))
    if plan.pp == 1:
        choice = choose_engine(plan, num_layers=len(blocks_of(model)))
        model, context = _within_stage(model, mesh, plan, choice)
        experts = _experts([model], mesh, plan)
        engine = _data_parallel(model, mesh, plan, choice, experts, seed, weights)
        return Runtime(engine, plan=plan, mesh=mesh, choice=choice, context=context, experts=experts)
    assert plan.vpp is not None, "rules.resolve chose it"
    tied = tied_embeddings(model)
    pooled = max((m.num_experts for m in model.modules() if isinstance(m, MoELayer) and m.aux_loss_pooled), default=0)
    has_experts = any(isinstance(m, MoELayer) for m in model.modules())  # on any stage: the ep mesh is collective
    stages, layers = build_stages(model, rank=mesh["pp"].get_local_rank(), num_ranks=plan.pp, vpp=plan.vpp,
                          split=plan.split)
    choice = choose_engine(plan, num_layers=max(len(blocks_of(m)) for m in stages.values()))
    for s, stage in stages.items():
        stages[s], context = _within_stage(stage, mesh, plan, choice)
    experts = _experts(list(stages.values()), mesh, plan, model_has_experts=has_experts)
    modules = dict(stages)
    if len(stages) == 1:
        (s, stage), = stages.items()
        engine = _data_parallel(stage, mesh, plan, choice, experts, seed, weights)
        stages[s] = engine.model
    else:
        for stage in stages.values():  # interleaved chunks run with no data engine
            if on_meta([stage]):
                materialize(stage, seed=seed, device=_device(mesh), weights=weights)
        view = merged_view(stages)
        engine = TorchDataEngine(view, view)
    pipeline = Pipeline(stages, plan.sched, plan.micro_batches, mesh, layers, vpp=plan.vpp, sync=engine.no_sync,
                        modules=modules, reduce=engine.reduce_grads, tied=bool(tied))
    return Runtime(engine, plan=plan, mesh=mesh, choice=choice, context=context, pipeline=pipeline, experts=experts,
                   tied=_tied(tied, engine, stages, mesh, plan.pp * plan.vpp), pooled_experts=pooled)


def _tied(modules: list[str], engine: DataEngine, stages: dict[int, nn.Module], mesh: DeviceMesh,
          num_stages: int) -> TiedGrads | None:
    """Tied embeddings split over the first and last stage: their copies on this rank, found by name
    among the engine's parameters (the data engine's shards), and the group that sums their gradients."""
    if not modules:
        return None
    group = tie_group(mesh)  # collective: every rank, before any returns
    first, last = 0 in stages, num_stages - 1 in stages
    if group is None or not (first or last):
        return None
    prefixes = tuple(f"{m}." for m in modules)
    params = [p for name, p in engine.named_parameters() if name.startswith(prefixes)]
    return TiedGrads(params, group, last=last and not first)


def _data_parallel(model: nn.Module, mesh: DeviceMesh, plan: Plan, choice: EngineChoice,
                   experts: ExpertGrads | None, seed: int, weights: WeightSource | None) -> DataEngine:
    """The data engine over `model`; a meta-built model materialized where each engine needs it:
    after FSDP2 has sharded it (each rank then allocates its shards only), before the engines
    that keep full parameters (DDP, shoal's ZeRO-1/2, none)."""
    ignore = list(experts.params) if experts is not None else []
    meta = on_meta([model])
    if meta and choice.kind == "fsdp2":
        # A low-bit LoRA base (shoal.models.quantized_base) is quantised once its values are in, which here is after
        # fully_shard: FSDP2 would shard the float weight, and torchao's NF4 tensor shards only when made before
        # fully_shard. So FSDP2 leaves these frozen weights whole on every rank (0.5 byte a weight as NF4).
        ignore += unquantized_bases(model)
    if meta and choice.kind != "fsdp2":
        materialize(model, seed=seed, device=_device(mesh), weights=weights)
    elif choice.kind == "autocast":  # FSDP2 moved a model built elsewhere to the device; autocast does not
        model.to(_device(mesh))
    engine = apply_data_parallel(model, mesh=mesh, plan=plan, choice=choice, ignore=ignore)
    if meta and choice.kind == "fsdp2":
        materialize(engine.model, seed=seed, device=_device(mesh), weights=weights)
    return engine


def _device(mesh: DeviceMesh) -> torch.device:
    """This rank's device on `mesh`."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _experts(parts: list[nn.Module], mesh: DeviceMesh, plan: Plan, *,
             model_has_experts: bool | None = None) -> ExpertGrads | None:
    """ep > 1 or tp > 1 with MoE layers in this rank's model parts: the experts split over the ep
    axis (and within each expert over tp, and over the replicas under sharded data parallelism;
    shoal/parallel/expert.py), their gradients reduced by the returned object, which the data
    engine leaves them to. `model_has_experts` (pp): whether any stage has MoE layers; then every
    rank joins the ep mesh's creation (collective over all ranks), a stage without any (dense
    first layers) too, and gets None."""
    mine = any(isinstance(m, MoELayer) for p in parts for m in p.modules())
    if (plan.ep == 1 and plan.tp == 1) or not (mine or model_has_experts):
        return None
    emesh = ep_mesh(mesh.size(), plan.ep, mesh.device_type, tp=plan.tp, pp=plan.pp)
    if not mine:
        return None
    params = []
    for part in parts:
        names = apply_expert_parallel(part, emesh, shard_replicas=plan.fsdp > 1)
        by_name = dict(part.named_parameters())
        params += [by_name[n] for n in names]
    return ExpertGrads(params, emesh, plan.data_ranks)


def _within_stage(model: nn.Module, mesh: DeviceMesh, plan: Plan,
                  choice: EngineChoice) -> tuple[nn.Module, ContextSplit | None]:
    """The parallelisms inside one model part, in order: float8, tensor, context, recompute, compile."""
    model = apply_float8(model, plan=plan, device_type=mesh.device_type,
                         fsdp_float8_gather=plan.fsdp > 1 and choice.kind == "fsdp2")
    model = apply_tensor_parallel(model, mesh=mesh, plan=plan)
    context = apply_context_parallel(model, mesh=mesh, mode=plan.cp_mode)
    model = apply_recompute(model, plan=plan)
    return apply_compile(model, plan=plan), context
