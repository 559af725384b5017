"""Data parallelism over the mesh's dp axis and sharded data parallelism (ZeRO) over its fsdp axis.

The engines this module builds (which one runs a plan, and why, is `shoal.rules.choose_engine`'s
docstring, the one place that says it):
- ddp: torch's DistributedDataParallel on the dp sub-mesh's process group (bucketed gradient
  all-reduce overlapped with backward, the well-kept replicated path); in bf16 or fp16 under
  `shoal.parallel.precision.Autocast` (fp32 master weights, as for one data rank), the gradients
  reduced in 16 bits by DDP's compression hook where `reduce` asks for it.
- zero: shoal's own small ZeRO-1/2 engine, `shoal.parallel.zero.ZeroDataParallel` (full
  parameters kept as plain tensors, float32 row shards for the optimizer, one reduce-scatter per
  bucket in backward, one all-gather per bucket after the step). Its module docstring says why
  it runs there instead of FSDP2.
- autocast: one data rank in bf16 or fp16 with nothing else split: the module under torch.autocast
  (`shoal.parallel.precision.Autocast`), its fp32 parameters the master weights.
- fsdp2: FSDP2 `fully_shard`, one parameter group per unit of `bucket` consecutive transformer
  blocks (one by default at zero=3), the embeddings, the head (final norm and classifier) and the
  root.
Both sharded engines hand the optimizer DTensor shards (`Shard(0)` of every parameter), so a stock
optimizer built from `model.parameters()` keeps sharded state, the global gradient norm is right,
and DCP checkpoints have one format that reshards between every layout.

How the ZeRO stages map:
- zero=3 (FSDP2): parameters, gradients and optimizer state sharded; a block's full parameters
  exist only while it runs forward or backward (`reshard_after_forward=True`).
- zero=2 (engine): gradients and optimizer state sharded, full parameters kept; every micro-batch's
  gradients are reduce-scattered bucket by bucket as backward produces them and freed.
- zero=1 (engine): as zero=2, but across micro-batches the full gradients accumulate (ZeRO-1's full
  gradient buffer) and are reduced on the last one (`no_sync`, which `train_step` uses). With one
  micro-batch per step zero=1 runs exactly as zero=2.
Over a tensor-parallel model or with offload, zero=1/2 run on FSDP2 with
`reshard_after_forward=False` instead (gathered parameters kept from forward to backward, dropped
after the step; zero=1 reduces on the last micro-batch through `set_requires_gradient_sync`).

Units (`bucket=K`): K consecutive blocks are gathered and reduced together (an FSDP2 parameter
group, or an engine bucket): fewer, larger collectives for one unit's transient memory. Default
K=2 at zero=1/2, 1 at zero=3, where a unit's full parameters are what sharding saves.

CPU offload (`offload=on`, fsdp > 1): FSDP2's CPUOffloadPolicy keeps the sharded parameters,
gradients and optimizer state in host memory and runs the optimizer step there; each block's
shard is copied to the device for its all-gather and its gradient shard copied back after the
reduce-scatter. On a CPU-only run the same path runs (pinning is off, the copies are no-ops).

Hybrid `dp2,fsdp2` is HSDP on the 2-D mesh ("dp", "fsdp"): shard within fsdp, replicate across dp
(the engine all-reduces its gradient shards across dp; FSDP2 does the same). Replicated dp over a
tensor-parallel model (or in mixed precision) is FSDP2 with a shard degree of 1, so no DDP ever
sees a DTensor.

Each engine is handed to the runtime (shoal/runtime.py) behind one small interface, `DataEngine`:
what forward calls, what the optimizer updates, gradient-sync control, the gradient norm and
scaling, and state dicts in DCP's format. Nothing outside shoal/parallel/ asks which engine runs.

Measured figures (time and memory against DeepSpeed and FSDP2 used directly, memory against the
ZeRO formulas) come from the benchmarks (bench/zero_vs_peers.py, bench/zero_memory.py).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from collections.abc import Callable, Collection, Iterator
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from shoal.mesh import replica_mesh
from shoal.models.adapter import adapter_for
from shoal.parallel.precision import Autocast, PrecisionPolicy
from shoal.parallel.sharded_vocab import shard_classifier, shard_embedding
from shoal.parallel.zero import ZeroDataParallel
from shoal.plan import Plan
from shoal.rules import EngineChoice, choose_engine


class DataEngine(Protocol):
    """One model part replicated and/or sharded over the data axes: what the runtime talks to."""

    @property
    def model(self) -> nn.Module:
        """What forward calls (a wrapper such as DDP, or the module itself)."""
        ...

    module: nn.Module
    """The user's module, as the parallelisms left it (sharded in place, never wrapped)."""

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """What the optimizer updates (DTensor shards where sharded), under the module's own names."""
        ...

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Around every micro-batch but the last: accumulate without reducing, where the engine may."""
        ...

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients over every rank that holds a piece of them (a plain tensor)."""
        ...

    def scale_grads_(self, factor: torch.Tensor) -> None:
        """Multiply every gradient by `factor` (a scalar tensor) in place."""
        ...

    def reduce_grads(self) -> None:
        """Reduce, now, gradients that reached the parameters without autograd accumulating them,
        so that no gradient hook of the engine saw them (a zero-bubble pipeline's weight passes
        assign them); the pipeline calls it after such a schedule. A no-op where nothing can be left."""
        ...

    def model_state_dict(self) -> dict[str, Any]:
        """Clean names -> tensors (sharded ones as DTensors): DCP saves and loads these in place."""
        ...

    def optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """`optimizer`'s state keyed by parameter name, in DCP's `get_state_dict` format."""
        ...

    def load_state_dicts(self, model_sd: dict[str, Any], optim_sd: dict[str, Any] | None,
                         optimizer: torch.optim.Optimizer | None) -> None:
        """After DCP loaded into the two state dicts above: make the model and optimizer use them."""
        ...

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every weight unsharded, on the CPU (collective; complete on rank 0 at least)."""
        ...

    def load_full_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Take full tensors by name (those given); each rank keeps its own shard (collective where sharded)."""
        ...


def apply_data_parallel(model: nn.Module, *, mesh: DeviceMesh, plan: Plan, choice: EngineChoice | None = None,
                        ignore: Collection[nn.Parameter] = ()) -> DataEngine:
    """Replicate and/or shard `model` over the dp and fsdp axes with the engine `choice` names
    (None: `choose_engine(plan, ...)`, the choice the planner costs). Parameters in `ignore`
    (ep-sharded experts, shoal/parallel/expert.py) are left as they are: the engine neither
    reduces their gradients nor shards them, but hands them to the optimizer, the gradient norm
    and the state dicts like the others."""
    precision = PrecisionPolicy.from_name(plan.precision or "fp32", reduce=plan.reduce)
    blocks = blocks_of(model)
    choice = choice or choose_engine(plan, num_layers=len(blocks))
    if choice.kind == "none":
        return TorchDataEngine(model, model)  # a tp-only model stays as tensor parallel left it
    if choice.kind == "autocast":
        return TorchDataEngine(Autocast(model, dtype=precision.param_dtype, device_type=mesh.device_type), model)
    ignored = {id(p) for p in ignore}
    if choice.kind == "ddp":
        names = [name for name, p in model.named_parameters() if id(p) in ignored]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
        ddp = _ddp(model, replica_mesh(mesh), reduce_dtype=precision.reduce_dtype)
        if precision.param_dtype == torch.float32:
            return TorchDataEngine(ddp, model)
        return TorchDataEngine(Autocast(ddp, dtype=precision.param_dtype, device_type=mesh.device_type), model)
    if choice.kind == "zero":
        return ZeroDataParallel(model, mesh=mesh, zero=choice.zero, bucket=choice.bucket, precision=precision,
                                blocks=blocks, ignore=ignored)
    offload = _offload_policy(mesh) if plan.offload else OffloadPolicy()
    if plan.vocab == "sharded":  # the tables' rows stay split over fsdp, beside FSDP2 (sharded_vocab.py)
        embedding, classifier = _vocab_tables(model)
        tables, tied = _data_mesh(mesh), classifier.weight is embedding.weight
        table = shard_embedding(embedding, tables)
        ignored |= {id(table), id(shard_classifier(classifier, tables, tied_to=table if tied else None))}
    _fully_shard(model, blocks, mesh=mesh, choice=choice, precision=precision, offload=offload,
                 ignored={p for p in model.parameters() if id(p) in ignored})
    return TorchDataEngine(model, model, gradient_sync_toggle=choice.zero == 1)


class _ExpectedNormReduction(logging.Filter):
    """The global gradient norm of a model whose parameters are DTensors on a 2-D or 3-D mesh
    (dp x tp, fsdp x tp) is reduced by DTensor over each mesh dimension in turn, and DTensor warns
    about it on every rank, naming mesh dimensions (such as "fsdp") the plan may not even use.
    It is one small reduction per step, by design: the warning says nothing to a user."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith("While redistributing from") or "_NormPartial" not in message


logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_ExpectedNormReduction())


class TorchDataEngine:
    """torch's own engines (none, DDP, FSDP2) behind `DataEngine`: DCP's state-dict API handles
    every one of them, with names free of wrapper prefixes."""

    def __init__(self, model: nn.Module, module: nn.Module, *, gradient_sync_toggle: bool = False) -> None:
        self.model, self.module = model, module
        self._toggle = gradient_sync_toggle  # FSDP2 at ZeRO-1: reduce on the last micro-batch only
        # DCP names parameters through DDP and FSDP2 as the module does, but not through a wrapper of ours.
        self._named = module if isinstance(model, Autocast) else model
        self._trained: list[nn.Parameter] | None = None  # what _grads reads, found at its first call

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for name, param in self.module.named_parameters():
            if param.requires_grad:
                yield clean_name(name), param

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        ddp = self.model.module if isinstance(self.model, Autocast) else self.model
        if isinstance(ddp, DistributedDataParallel):
            return ddp.no_sync()
        if self._toggle:
            return _no_gradient_sync(self.model)
        return contextlib.nullcontext()

    def _grads(self) -> list[torch.Tensor]:
        """The gradients of the trainable parameters. The parameters are looked up once, at the first
        step's call: from then on they are the objects the optimizer updates too, and walking the module
        tree twice a step (the norm, the clipping) would cost a deep model's step a share of its host time."""
        if self._trained is None:
            self._trained = [p for _, p in self.named_parameters()]
        return [p.grad for p in self._trained if p.grad is not None]

    def grad_norm(self) -> torch.Tensor:
        grads = self._grads()
        if not grads:  # nothing trainable here: zero, where the parameters live
            return torch.zeros((), device=next(self.module.parameters(), torch.zeros(())).device)
        # Plain gradients and DTensor gradients by mesh (the data engine's beside ep-sharded experts'):
        # a norm over DTensors reduces over their mesh, and different meshes do not mix in one call.
        groups = _by_mesh(grads)
        norms = []
        for group in groups:
            norm = torch.nn.utils.get_total_norm(group)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        return torch.stack([n.to(norms[0].device) for n in norms]).pow(2).sum().sqrt() if len(norms) > 1 else norms[0]

    def scale_grads_(self, factor: torch.Tensor) -> None:
        grads = self._grads()
        for group in _by_mesh(grads):  # what clip_grads_with_norm_ does, plain and each mesh's DTensors apart
            torch._foreach_mul_(group, factor.to(grads[0].device))

    def reduce_grads(self) -> None:
        # Nothing is left: "none" and "autocast" reduce nothing, DDP never runs under pp, and a zero-bubble
        # schedule on FSDP2 is refused (shoal.rules).
        pass

    def model_state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self._named)

    def optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return get_optimizer_state_dict(self._named, optimizer)

    def load_state_dicts(self, model_sd: dict[str, Any], optim_sd: dict[str, Any] | None,
                         optimizer: torch.optim.Optimizer | None) -> None:
        set_state_dict(self._named, optimizer if optimizer is not None else (),
                       model_state_dict=model_sd, optim_state_dict=optim_sd or {})

    def full_weights(self) -> dict[str, torch.Tensor]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return cast(dict[str, torch.Tensor], get_model_state_dict(self._named, options=options))  # a model's: tensors

    def load_full_weights(self, weights: dict[str, torch.Tensor]) -> None:
        # strict=False: the runtime checked the names; a partial dict leaves the rest as it is.
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self._named, cast(dict[str, Any], weights), options=options)  # dict is invariant


def _by_mesh(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Gradients in groups that one foreach or norm call can take: plain tensors, then DTensors by mesh."""
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    return list(groups.values())


def _ddp(model: nn.Module, replicas: DeviceMesh, *, reduce_dtype: torch.dtype) -> nn.Module:
    """torch DDP over the replica group (dp, or dp x cp). Buffers (the RoPE tables) are the same
    on every rank by construction, so they are not re-broadcast before each forward; gradients
    live in the all-reduce buckets (gradient_as_bucket_view) instead of being copied into them.
    A 16-bit `reduce_dtype` all-reduces each bucket in it (`_reduce_in`)."""
    no_buffer_sync: dict[str, Any] = (  # torch 2.13 renamed the option; older releases only know the old name
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        else {"broadcast_buffers": False}
    )
    ddp = DistributedDataParallel(model, process_group=replicas.get_group(), gradient_as_bucket_view=True,
                                  **no_buffer_sync)
    if reduce_dtype != torch.float32:
        ddp.register_comm_hook(replicas.get_group(), _reduce_in(reduce_dtype))
    return ddp


def _reduce_in(dtype: torch.dtype) -> Callable[..., torch.futures.Future[torch.Tensor]]:
    """A DDP communication hook that averages each gradient bucket in `dtype`: divided by the world size, cast,
    all-reduced, cast back into the fp32 bucket. torch's own (default_hooks.bf16_compress_hook) does this but
    refuses any backend other than NCCL or XCCL, and shoal's CPU runs are on gloo."""

    def hook(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fp32 = bucket.buffer()
        sent = fp32.div(group.size()).to(dtype)
        future = dist.all_reduce(sent, group=group, async_op=True).get_future()

        def back(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            return fp32.copy_(done.value()[0])

        return future.then(back)

    # DDP checks the hook's annotations as objects; this module's are strings (postponed evaluation).
    hook.__annotations__ = {"group": dist.ProcessGroup, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
    return hook


def _data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 runs on: 1-D fsdp (pure sharding, or one rank: bf16 on a single GPU) or 2-D
    (dp, fsdp) HSDP (replicate x shard). Under cp the shards spread over fsdp x cp (as torchtitan's
    dp_shard_cp): cp ranks hold the same weights and see other tokens, so they shard like data
    ranks and their gradients are averaged with the others'."""
    if mesh["cp"].size() == 1:
        return mesh["fsdp"] if mesh["dp"].size() == 1 else mesh["dp", "fsdp"]
    shard = mesh["fsdp", "cp"]._flatten("fsdp_cp")  # private in torch 2.13, as torchtitan uses it
    if mesh["dp"].size() == 1:
        return shard
    with warnings.catch_warnings():
        # torch 2.13 warns that slicing a flattened axis from the root mesh "will be deprecated"
        # and offers no replacement yet for a 2-D (replicate, flattened shard) mesh.
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        return mesh["dp", "fsdp_cp"]


def _offload_policy(mesh: DeviceMesh) -> CPUOffloadPolicy:
    """FSDP2's CPU offload: sharded parameters, gradients and optimizer state in CPU memory, copied
    to the device per block for forward/backward; the optimizer step runs on the CPU. Pinned host
    memory speeds the copies on a GPU; on a CPU-only mesh pinning needs an accelerator (it raises
    "Cannot access accelerator device"), and the shards already live in CPU memory, so there the
    same code path runs with the host-to-device copies being no-ops."""
    return CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")


def _fully_shard(model: nn.Module, blocks: list[nn.Module], *, mesh: DeviceMesh, choice: EngineChoice,
                 precision: PrecisionPolicy, offload: OffloadPolicy, ignored: set[nn.Parameter]) -> None:
    kwargs: dict[str, Any] = dict(mesh=_data_mesh(mesh), mp_policy=precision.fsdp_policy(), offload_policy=offload,
                                  ignored_params=ignored or None)
    keep_full = choice.zero < 3  # ZeRO-1/2 keep a block's gathered parameters from forward to backward
    step = choice.bucket
    for unit in (blocks[i:i + step] for i in range(0, len(blocks), step)):
        # A list is one FSDP2 parameter group: gathered before the first block runs, reduced once.
        fully_shard(unit if len(unit) > 1 else unit[0], reshard_after_forward=not keep_full, **kwargs)
    if "tp" in (mesh.mesh_dim_names or ()) and mesh["tp"].size() > 1:
        # Tensor parallelism's embedding hands on DTensor.to_local()'s view, which FSDP2 warns about at every
        # run's first forward: an in-place op on it would skip the unit's pre-backward hook. shoal's model adds
        # to the embedding's output out of place only (Transformer.forward), so the hazard cannot occur here.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor")
    for unit, needed_first in _end_units(model):
        if all(p in ignored for m in unit for p in m.parameters()):
            continue  # its tables are sharded by rows beside FSDP2 (vocab=sharded)
        fully_shard(unit, reshard_after_forward=not (keep_full or needed_first), **kwargs)
        if not (keep_full or needed_first) and all(isinstance(m, nn.Embedding) for m in unit):
            # A lookup's backward needs the indices, not the table: gathering it again would hold one
            # more (V, D) table beside its gradient and the reduce-scatter's input.
            cast(FSDPModule, unit[0]).set_unshard_in_backward(False)  # the unit's modules share one state
    fully_shard(model, reshard_after_forward=False, **kwargs)  # the root is needed first in backward


def _end_units(model: nn.Module) -> list[tuple[list[nn.Module], bool]]:
    """The embeddings and the head (final norm and classifier) as units of their own, each with
    whether backward needs it first. In the root they would stay gathered, with both tables' full
    gradients, for the whole step: for a large vocabulary they are most of the model. Tied
    tables are one parameter and stay in the root (a parameter belongs to one unit). The model's
    adapter names them; a model of no known family has none."""
    adapter = adapter_for(model)
    if adapter is None:
        return []

    def present(names: tuple[str, ...]) -> list[nn.Module]:
        return [m for m in (getattr(model, n, None) for n in names) if isinstance(m, nn.Module)]

    embeddings, head = present(adapter.embeddings), present(adapter.head)
    tied = {id(p) for m in embeddings for p in m.parameters()} & {id(p) for m in head for p in m.parameters()}
    if tied:
        return []
    units = [(embeddings, False), (head, True)]
    return [(unit, first) for unit, first in units if any(True for m in unit for _ in m.parameters())]


def _vocab_tables(model: nn.Module) -> tuple[nn.Embedding, nn.Linear]:
    """The model's token embedding (a plain nn.Embedding) and classifier (a bias-free nn.Linear, its own
    table or the embedding's), as its adapter names them; one-line ValueError otherwise."""
    adapter = adapter_for(model)
    embedding = getattr(model, adapter.embeddings[0], None) if adapter is not None and adapter.embeddings else None
    linear = getattr(model, adapter.classifier, None) if adapter is not None and adapter.classifier else None
    plain = (isinstance(embedding, nn.Embedding) and embedding.padding_idx is None and embedding.max_norm is None
             and not embedding.sparse)
    if not plain or not isinstance(linear, nn.Linear) or linear.bias is not None:
        raise ValueError(f"vocab=sharded needs a plain nn.Embedding and a bias-free nn.Linear classifier; "
                         f"{type(model).__name__} has {type(embedding).__name__} and {type(linear).__name__}; "
                         "valid: vocab=gathered")
    return embedding, linear


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate unsharded gradients without reducing them (ZeRO-1 between micro-batches)."""
    assert isinstance(model, FSDPModule)
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of `model`, in order: those its family's adapter names (shoal's
    Transformer: `layers`), or for a model of no known family the children of its
    largest ModuleList/ModuleDict (Hugging Face's `model.layers` or `transformer.h`)."""
    adapter = adapter_for(model)
    if adapter is not None:
        return adapter.blocks_of(model)
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > len(best):
            best = list(module.values() if isinstance(module, nn.ModuleDict) else module)
    return best


def wrap_blocks(model: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> list[nn.Module]:
    """Replace every transformer block of `model` by `wrap(block)` in its parent (in place);
    returns the new blocks. Recompute and compile wrap blocks this way, before data parallelism."""
    blocks = {id(b) for b in blocks_of(model)}
    wrapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in blocks:
                wrapped.append(wrap(child))
                parent.register_module(name, wrapped[-1])
    return wrapped


# Prefixes that wrappers inside the user's module put into parameter names (recompute, FSDP1, torch.compile).
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter name as the user's module spells it, without wrapper prefixes."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
