"""Data parallelism over the mesh's dp axis and sharded data parallelism (ZeRO) over its fsdp axis.

Three engines, chosen by the plan:
- dp alone, fp32, no tensor parallel: torch's DistributedDataParallel on the dp sub-mesh's process
  group (bucketed gradient all-reduce overlapped with backward, the well-kept replicated path).
- zero=1/2 with an fsdp axis (and dp x fsdp hybrid), on a model without DTensor parameters and
  without offload: shoal's own small ZeRO-1/2 engine, `shoal.parallel.zero.ZeroDataParallel`
  (full parameters kept as plain tensors, float32 row shards for the optimizer, one
  reduce-scatter per bucket in backward, one all-gather per bucket after the step). Its module
  docstring says why FSDP2 was not good enough there and what was measured.
- everything else (zero=3, offload, fsdp or dp over a tensor-parallel model, replicated mixed
  precision): FSDP2 `fully_shard`, one parameter group per unit of `bucket` consecutive
  transformer blocks (one by default at zero=3) plus the root.
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

Measured figures (time and memory against DeepSpeed and FSDP2 used directly, memory against the
ZeRO formulas) are in the benchmarks (bench/zero_vs_peers.py, bench/zero_memory.py) and the
issue notes; the engine's design choices cite theirs in shoal/parallel/zero.py.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from shoal.parallel.precision import LossScaler, PrecisionPolicy
from shoal.parallel.zero import ZeroDataParallel
from shoal.plan import Plan


def apply_data_parallel(model: nn.Module, *, mesh: DeviceMesh, plan: Plan) -> nn.Module:
    """Replicate and/or shard `model` over the dp and fsdp axes; returns the model to train
    (a DDP wrapper, the same module turned into an FSDP module, or `model` at degree 1)."""
    if plan.zero not in (1, 2, 3):
        raise ValueError(f"zero={plan.zero} is not a ZeRO stage; valid: 1, 2, 3")
    precision = PrecisionPolicy.from_name(plan.precision, reduce=plan.reduce)
    has_dtensors = any(isinstance(p, DTensor) for p in model.parameters())
    dp, fsdp = mesh["dp"].size(), mesh["fsdp"].size()
    if plan.offload and fsdp == 1:
        raise ValueError(f"offload=on needs fsdp > 1 (plan {plan}); valid: add fsdpN, or offload=off")
    if dp == 1 and fsdp == 1 and precision.is_full:
        return model  # nothing to replicate (a tp-only model stays as tensor parallel left it)
    if fsdp == 1 and not has_dtensors and precision.is_full:
        return _ddp(model, mesh["dp"])
    # Replicated only (fsdp1): nothing to free after forward, so keep the gathered copy (zero=2).
    zero = plan.zero if fsdp > 1 else 2
    bucket = plan.bucket if plan.bucket is not None else (DEFAULT_BUCKET if zero < 3 else 1)
    if bucket < 1:
        raise ValueError(f"bucket={bucket} must be a whole number of blocks >= 1")
    if zero < 3 and fsdp > 1 and not has_dtensors and not plan.offload:
        engine = ZeroDataParallel(model, mesh=mesh, zero=zero, bucket=bucket, precision=precision,
                                  blocks=transformer_blocks(model))
        if precision.loss_scaling:
            engine.loss_scaler = LossScaler()  # type: ignore[assignment]  # train_step looks for it
        return engine
    return _fully_shard(model, mesh=mesh, zero=zero, precision=precision, bucket=bucket,
                        offload=_offload_policy(mesh) if plan.offload else OffloadPolicy())


def _ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """torch DDP over the dp group. Buffers (the RoPE tables) are the same on every rank by
    construction, so they are not re-broadcast before each forward; gradients live in the
    all-reduce buckets (gradient_as_bucket_view) instead of being copied into them."""
    no_buffer_sync = (  # torch 2.13 renamed the option; older releases only know the old name
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        else {"broadcast_buffers": False}
    )
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), gradient_as_bucket_view=True,
                                   **no_buffer_sync)


def _data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 runs on: 1-D fsdp (pure sharding) or 2-D (dp, fsdp) HSDP (replicate x shard)."""
    if mesh["dp"].size() == 1 and mesh["fsdp"].size() > 1:
        return mesh["fsdp"]
    return mesh["dp", "fsdp"]


DEFAULT_BUCKET = 2
"""Blocks per gather/reduce unit at zero=1/2 unless the plan says `bucket=`: see the module docstring."""


def _offload_policy(mesh: DeviceMesh) -> CPUOffloadPolicy:
    """FSDP2's CPU offload: sharded parameters, gradients and optimizer state in CPU memory, copied
    to the device per block for forward/backward; the optimizer step runs on the CPU. Pinned host
    memory speeds the copies on a GPU; on a CPU-only mesh pinning needs an accelerator (it raises
    "Cannot access accelerator device"), and the shards already live in CPU memory, so there the
    same code path runs with the host-to-device copies being no-ops."""
    return CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")


def _fully_shard(model: nn.Module, *, mesh: DeviceMesh, zero: int, precision: PrecisionPolicy,
                 bucket: int, offload: OffloadPolicy) -> nn.Module:
    data_mesh = _data_mesh(mesh)
    keep_full = zero < 3  # ZeRO-1/2 keep a block's gathered parameters from forward to backward
    kwargs = dict(mesh=data_mesh, mp_policy=precision.fsdp_policy(), offload_policy=offload)
    blocks = transformer_blocks(model)
    for unit in (blocks[i:i + bucket] for i in range(0, len(blocks), bucket)):
        # A list is one FSDP2 parameter group: gathered before the first block runs, reduced once.
        fully_shard(unit if len(unit) > 1 else unit[0], reshard_after_forward=not keep_full, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)  # the root is needed first in backward
    if precision.loss_scaling:
        model.loss_scaler = LossScaler()  # type: ignore[assignment]  # train_step looks for it
    if zero == 1:
        model.no_sync = lambda: _no_gradient_sync(model)  # type: ignore[assignment]
    return model


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate unsharded gradients without reducing them (ZeRO-1 between micro-batches)."""
    assert isinstance(model, FSDPModule)
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformer: the children of its largest ModuleList/ModuleDict
    (shoal's `layers`, Hugging Face's `model.layers` or `transformer.h`), in order."""
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > len(best):
            best = list(module.values() if isinstance(module, nn.ModuleDict) else module)
    return best
