"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) over the mesh's "tp" axis.

Attention is split by heads and the MLP by columns: the first projection of each sublayer is
column-parallel (wq/wk/wv, w1/w3: each rank holds 1/t of the output features), the second
row-parallel (wo, w2: 1/t of the input features, partial sums reduced). That costs one
all-reduce of the (B, T, D) activations per sublayer forward and one in backward.

With sequence parallelism (Korthikanti et al. 2022, on by default, `sp=off` disables it) the
residual stream, norms and dropout between the sublayers are sharded on the sequence dim: the
all-reduce becomes a reduce-scatter after the row-parallel projection and an all-gather before
the column-parallel one (the same bytes), and the activations there take 1/t of the memory.

The embedding table is split by columns (each rank holds 1/t of every row's features and
gathers the rest), or, tied to the classifier, by rows (vocabulary-parallel: a token's row lives
on one rank, the others contribute zeros to the reduction). The output classifier is
vocabulary-parallel: its logits stay sharded on the vocabulary dim (a DTensor, Shard(-1)) and
the loss is computed across shards by `shoal.parallel.loss` (DTensor's loss_parallel), never gathering them.

The plan is data: the model family's adapter (shoal.models.adapter) names a style for each
module-name pattern, this module turns the names into DTensor ParallelStyles, applied with
`parallelize_module` to the unmodified model (shoal's Transformer infers local head counts
from tensor shapes). Every parameter of a tp model ends up a DTensor on mesh["tp"] (modules
that every rank runs whole get `ReplicateParallel`), so the gradient norm, the optimizer and
the data-parallel wrappers see one kind of tensor.

No hand-written collectives are needed here: every piece (Colwise/Rowwise, SequenceParallel,
PrepareModuleInput, the vocab-parallel embedding's masked partial sum, loss_parallel) runs on
gloo, so this module writes no collective of its own. Not covered by tests: dropout > 0.
Every tp rank draws from the same generator state (same seed, same call order): that keeps the
replicated regions of sp=off consistent, but gives sequence or head shards correlated masks;
DTensor's RNG tracker, which would offset them, is CUDA-only.

Shape legend: B batch, T sequence (T/t when sequence-sharded), D model dim, V vocabulary.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from shoal.models.adapter import ModelAdapter, adapter_with
from shoal.moe.layer import MoELayer
from shoal.parallel.expert import MoETensorParallel
from shoal.plan import Plan

TPPlan = Mapping[str, ParallelStyle]


class _GlooAllToAll(logging.Filter):
    """The column-split embedding's output is re-split from features to sequence (sp on): an
    all-to-all. gloo has none, so DTensor all-gathers and keeps its chunk (the same values, t times
    the bytes, on CPU runs only) and warns on every rank; the warning says nothing a user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("CPU process group does not support alltoall")


logging.getLogger("torch.distributed.tensor._collective_utils").addFilter(_GlooAllToAll())


class ReplicateParallel(ParallelStyle):
    """Parameters become replicated DTensors; inputs and outputs stay plain local tensors.

    For the modules every tp rank runs whole on the same data (norms without sequence
    parallelism): their gradients are already identical on every rank, so nothing is
    communicated; the point is only that every parameter of the model is a DTensor on the tp
    mesh. (torch has no such style; SequenceParallel would shard the input.)
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _replicate_params, _inputs_to_replicate, _output_to_local)  # type: ignore[arg-type]  # input_fn's return: typed None, used


class ShardedPositions(ParallelStyle):
    """Learned absolute positions under sequence parallelism.

    The model asks its position table for `arange(T_local)` because it sees only its own
    sequence shard; this style offsets those ids by rank * T_local, so that rank r looks up
    positions r*T/t .. (r+1)*T/t - 1, and returns the (T/t, D) rows as a local tensor. The table
    is a replicated DTensor: each rank's gradient touches only its rows and DTensor sums them
    over tp (a Partial gradient reduced into the replicated parameter).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _replicate_params, _offset_positions, _output_to_local)  # type: ignore[arg-type]  # input_fn's return: typed None, used


class HeadShardedNorm(ParallelStyle):
    """A norm over each attention head's features (Qwen3's q/k norms) on a tp rank's own heads.

    The weight (one head's width) is a replicated DTensor; the input, (B, T, H/t, E) local
    heads, enters as a DTensor sharded on the heads dim, so that the weight's gradient, summed
    over this rank's heads only, comes out as a partial sum that is reduced over tp like the
    sequence-parallel norms' (reduce_partial_grads); the output leaves as the local heads.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _replicate_params, _heads_to_shard, _output_to_local)  # type: ignore[arg-type]  # input_fn's return: typed None, used


def _split_features(module: nn.Module, mesh: DeviceMesh, side: int, src_data_rank: int | None) -> None:
    """Each parameter of a layer with `feature_dims` (a low-rank adapted linear layer, shoal.models.lora)
    sharded on its output-feature dim (side 0: column-parallel) or input-feature dim (side 1: row-parallel),
    replicated where it has no such dim."""
    dims: dict[str, tuple[int | None, int | None]] = getattr(module, "feature_dims")  # noqa: B009 (typed as a Tensor-or-Module attribute otherwise)
    for name, param in list(module.named_parameters(recurse=False)):
        dim = dims[name][side]
        placement = Shard(dim) if dim is not None else Replicate()
        shard = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))


def _partition_features(partition: Any, name: str, module: nn.Module, mesh: DeviceMesh, dim: int,
                        src_data_rank: int | None) -> None:
    """A layer with `feature_dims` splits each parameter on its `dim`-th feature dim (0 output, 1 input); a
    plain linear layer goes to torch's `partition`; a submodule without parameters is left alone."""
    if not hasattr(module, "feature_dims"):
        if any(True for _ in module.parameters(recurse=False)):
            partition(name, module, mesh)
        return
    _split_features(module, mesh, dim, src_data_rank)


class FeatureColwise(ColwiseParallel):
    """torch's ColwiseParallel; a linear layer that names its parameters' feature dims (`feature_dims`: a
    low-rank adapter's A (r, in) and B (out, r)) splits each on its output-feature dim, or replicates it."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _partition_features(super()._partition_linear_fn, name, module, device_mesh, 0, self.src_data_rank)


class FeatureRowwise(RowwiseParallel):
    """torch's RowwiseParallel; a layer with `feature_dims` splits each parameter on its input-feature dim."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _partition_features(super()._partition_linear_fn, name, module, device_mesh, 1, self.src_data_rank)


def _heads_to_shard(_module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(DTensor.from_local(x, mesh, [Shard(2)], run_check=False) if isinstance(x, torch.Tensor) else x
                 for x in inputs)


class SharedKeyParallel(ParallelStyle):
    """A projection every tp rank runs whole whose output all heads use (latent attention's rotary
    key, shoal.models.mla): each rank's heads give only their share of the output's gradient, so
    the output leaves as a local tensor whose gradient is a partial sum. The weight's gradient is
    then a partial sum reduced over tp like the sequence-parallel norms' (reduce_partial_grads),
    and the input's joins the other projections' partial sums before the sublayer's one reduction."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _replicate_params, _inputs_to_replicate, _output_partial_grad)  # type: ignore[arg-type]  # input_fn's return: typed None, used


def _output_partial_grad(_module: nn.Module, output: Any, _mesh: DeviceMesh) -> Any:
    return output.to_local(grad_placements=[Partial()]) if isinstance(output, DTensor) else output


class CheckSequenceShardable(ParallelStyle):
    """A check on the model's input (no parameters): the sequence must split evenly over tp."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        size = device_mesh.size()

        def check(_module: nn.Module, args: tuple[Any, ...]) -> None:
            length = args[0].shape[1]
            if length % size:
                raise ValueError(
                    f"sequence length {length} does not split over tp={size} with sequence parallelism; "
                    f"valid: multiples of {size}, or the plan option sp=off"
                )

        module.register_forward_pre_hook(check)
        return module


def _replicate_params(_name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    # Every rank built the same model from the same seed, so from_local needs no broadcast.
    for name, param in list(module.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            module.register_parameter(
                name, nn.Parameter(DTensor.from_local(param.data, mesh, [Replicate()], run_check=False),
                                   requires_grad=param.requires_grad)
            )


def _inputs_to_replicate(_module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
        for x in inputs
    )


def _offset_positions(_module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    positions_T = inputs[0]
    offset = mesh.get_local_rank() * positions_T.shape[0]
    return (DTensor.from_local(positions_T + offset, mesh, [Shard(0)], run_check=False),)


def _output_to_local(_module: nn.Module, output: Any, _mesh: DeviceMesh) -> Any:
    return output.to_local() if isinstance(output, DTensor) else output


# ----------------------------------------------------------------------------- the plan


def tensor_plan(model: nn.Module, *, sp: bool = True) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of `model`'s family (its adapter's, shoal.models.adapter):
    module-name pattern -> style, each MoE layer in its block's slot given `MoETensorParallel`.

    Residual stream between sublayers: sequence-sharded local tensors (B, T/t, D) with sp,
    full replicated ones without. Each attention/MLP input is a replicated DTensor, so that the
    gradients of wq, wk and wv (w1, w3) add up as partial sums before one reduction in backward.
    """
    adapter = adapter_with(model, "tp")
    assert adapter.tp_plan is not None, f"the {adapter.family} takes tp without a plan"
    styles = _styles(sp)
    plan: dict[str, ParallelStyle] = {"": CheckSequenceShardable()} if sp else {}
    for pattern, name in _with_moe_slots(adapter.tp_plan(model), model, adapter).items():
        plan[pattern] = styles[name]()
    return plan


def _styles(sp: bool) -> dict[str, Callable[[], ParallelStyle]]:
    """The ParallelStyle of each style name of shoal.models.adapter.TP_STYLES (and "moe")."""
    seq = Shard(1) if sp else Replicate()  # layout of the residual stream
    norm = SequenceParallel if sp else ReplicateParallel
    return {
        # By rows (vocabulary-parallel): the tied classifier's split, on both sides.
        "vocab_embedding": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        # By columns: DTensor's backward of a row-sharded lookup has no sharded rule and gives every
        # rank the whole (V, D) gradient (Replicate); a column shard's gradient is its own (V, D/t)
        # columns. The output is gathered (or re-split by sequence), fewer bytes than the row
        # shard's reduction.
        "embedding": lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "positions": ShardedPositions if sp else ReplicateParallel,
        "residual_norm": norm,
        "attention_input": lambda: PrepareModuleInput(
            input_layouts=(seq, None), desired_input_layouts=(Replicate(), None), use_local_output=False),
        "ffn_input": lambda: PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=False),
        "colwise": FeatureColwise,
        "rowwise": lambda: FeatureRowwise(output_layouts=seq),
        "head_norm": HeadShardedNorm,
        "replicate": ReplicateParallel,
        "shared_key": SharedKeyParallel,
        # Logits stay vocabulary-sharded DTensors: the loss reads them shard by shard.
        "vocab_head": lambda: ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
        "moe": lambda: MoETensorParallel(sp=sp),
    }


def _with_moe_slots(plan: dict[str, str], model: nn.Module, adapter: ModelAdapter) -> dict[str, str]:
    """`plan` with each block's MoE slot that holds an MoE layer given the style "moe", and the
    dense MLP's patterns for that slot kept for the other blocks only (named one by one)."""
    keys = list(adapter.block_container(model).keys())
    for slot in adapter.moe_slots:
        moe = [k for k in keys if isinstance(model.get_submodule(f"{adapter.blocks}.{k}.{slot}"), MoELayer)]
        if not moe:
            continue
        dense = [k for k in keys if k not in moe]
        prefix = f"{adapter.blocks}.*.{slot}"
        expanded: dict[str, str] = {}
        for pattern, name in plan.items():
            if pattern.startswith(prefix):
                expanded.update({pattern.replace("*", k, 1): name for k in dense})
            else:
                expanded[pattern] = name
        plan = expanded | {f"{adapter.blocks}.{k}.{slot}": "moe" for k in moe}
    return plan


def apply_tensor_parallel(model: nn.Module, *, mesh: DeviceMesh, plan: Plan,
                          tp_plan: TPPlan | None = None) -> nn.Module:
    """Shard `model` over mesh["tp"] (in place; returns it). A no-op when tp has size 1.

    `tp_plan` overrides the plan of the model's family (`tensor_plan(model)`, from its adapter).
    Parameters shared between modules (tied input/output embeddings) stay shared: both sides
    are sharded the same way (rows of the (V, D) table), and are tied again afterwards.
    """
    tp_mesh = mesh["tp"]
    if tp_mesh.size() == 1:
        return model
    assert plan.tp == tp_mesh.size(), f"plan tp={plan.tp} on a mesh whose tp axis has {tp_mesh.size()} ranks"
    shared = _shared_parameters(model)
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    parallelize_module(model, tp_mesh, dict(tp_plan or tensor_plan(model, sp=bool(plan.sp))))
    _tie_again(model, shared)
    for name in frozen:  # torch's SequenceParallel makes every parameter it replicates trainable
        model.get_parameter(name).requires_grad_(False)
    return model


def _shared_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of names (two or more) that refer to one parameter object."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _tie_again(model: nn.Module, shared: list[list[str]]) -> None:
    for first, *others in shared:
        param = model.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            old = model.get_parameter(name)
            if isinstance(param, DTensor) and isinstance(old, DTensor) and old.placements != param.placements:
                raise ValueError(f"tied parameters {first} and {name} are sharded differently "
                                 f"({param.placements} vs {old.placements}); give them one style")
            setattr(model.get_submodule(owner), attr, param)


@torch.no_grad()
def reduce_partial_grads(params: Iterable[nn.Parameter]) -> int:
    """After backward, turn the gradients DTensor left as partial sums (the replicated norm
    weights under sequence parallelism: each tp rank summed over its own tokens) into their
    parameter's placement, in one all-reduce per mesh and dtype. Returns the tensors reduced.

    DTensor reduces a Partial gradient lazily, at each use, and does not keep the result: left
    as it is, the gradient norm reduces every such tensor once and AdamW's update three times
    more (the tiny preset at tp4: 37 all-reduces per step where one does). This is the piece
    DTensor does not do for a model without a data-parallel wrapper, written here.
    """
    pending: dict[tuple[Any, ...], list[nn.Parameter]] = defaultdict(list)
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(x.is_partial() for x in g.placements):
            pending[(g.device_mesh, g.placements, g.dtype, tuple(p.placements))].append(p)  # type: ignore[attr-defined]  # p: a DTensor
    for (mesh, placements, _, target), group in pending.items():
        if mesh.ndim == 1 and placements[0] == Partial("sum") and target == (Replicate(),):
            pieces = [p.grad.to_local() for p in group]  # type: ignore[union-attr]  # grads: Partial DTensors, checked above
            flat = torch.cat([t.reshape(-1) for t in pieces])
            dist.all_reduce(flat, group=mesh.get_group())
            for p, t, piece in zip(group, pieces, flat.split([t.numel() for t in pieces])):
                p.grad = DTensor.from_local(piece.view_as(t), mesh, [Replicate()], run_check=False)
        else:  # other meshes or reductions: DTensor's own redistribution, once per tensor
            for p in group:
                p.grad = p.grad.redistribute(placements=target)  # type: ignore[union-attr]  # a Partial DTensor, checked above
    return sum(len(g) for g in pending.values())
