"""Data parallelism over the mesh's dp axis and sharded data parallelism (ZeRO) over its fsdp axis.

Two engines, both torch's own:
- dp alone, fp32, no tensor parallel: DistributedDataParallel on the dp sub-mesh's process
  group (bucketed gradient all-reduce overlapped with backward, the well-kept replicated path).
- everything else (an fsdp axis, dp x fsdp hybrid, dp or fsdp over a tensor-parallel model,
  mixed precision): FSDP2 `fully_shard`, one parameter group per unit of `bucket` consecutive
  transformer blocks (below) plus the root.
  Its sharded parameters are DTensors, so a stock optimizer built from `model.parameters()` keeps
  sharded state, and DCP checkpoints reshard to any other layout.

How the ZeRO stages map onto FSDP2 (one honest mapping, no private copy of FSDP):
- zero=3: parameters, gradients and optimizer state sharded; a block's full parameters exist only
  while it runs forward or backward (`reshard_after_forward=True`).
- zero=2: gradients and optimizer state sharded; a block's full parameters are gathered once per
  micro-batch and kept from its forward through its backward (`reshard_after_forward=False`),
  ZeRO-2's traffic (one all-gather + one reduce-scatter = one all-reduce's worth). Unlike
  DeepSpeed's ZeRO-2 the full copy is dropped between steps, which only lowers memory.
- zero=1: as zero=2, and the gradients are reduced once per optimizer step: across micro-batches
  they accumulate unsharded (ZeRO-1's full gradient buffer) and are reduce-scattered on the last
  one (`model.no_sync()` below, which `train_step` already uses). With one micro-batch per step
  zero=1 runs exactly as zero=2.

Units (`bucket=K`): K consecutive blocks form one FSDP2 parameter group, gathered before the
first of them runs and reduce-scattered once after the last one's backward. FSDP2's cost per unit
(hooks, copy-in/copy-out, one collective each way) is what made per-block units slower than
DeepSpeed's flat buckets at stages 1-2; a unit's transient full gradients and its reduce-scatter
buffer are its memory price. Measured on the `small` preset (8 blocks, Ψ = 6.4M, fp32 AdamW,
4 x 64 tokens per rank) at 2 ranks on 2 shared cores, 24 interleaved steps, load average 1.6-1.9
(other jobs were running; IQR 8-37%), shoal / DeepSpeed step time by K:
    stage 1: K=1 1.13, K=2 1.04, K=4 1.05      stage 2: K=1 1.16, K=2 1.06, K=4 1.04
and the peak live tensor bytes / (ZeRO formula with the sharded fp32 copy + activations)
(bench/zero_memory, stage 1 with 2 micro-batches): K=1 1.03 / 0.92, K=2 1.06 / 0.95,
K=4 1.12 / 1.00 (stage 1 / stage 2), one unit for the whole model 1.23 at stage 1. K=2 is the
largest unit inside the 10% memory goal, so it is the zero=1/2 default; zero=3 keeps K=1, since
there a unit's full parameters are what sharding saves (its time was 1.00-1.08x DeepSpeed's
already). Explicit forward/backward prefetch of the next unit measured no gain on gloo. Figures
at the default, bench/results/zero_vs_peers_N2.json (16 repeats, load 1.9-2.3, IQR 7-53%):
shoal / DeepSpeed 0.97 (stage 1), 0.94 (2), 1.00 (3); shoal / FSDP2 used directly 0.96 (2),
1.04 (3); resident memory / DeepSpeed's 0.58-0.71, / FSDP2's 1.05 (2: its per-block units) and
0.97 (3). At 4 ranks (oversubscribed, 10 repeats, load 2.4-3.9, IQR 5-28%): / DeepSpeed 1.08,
1.08, 0.93; / FSDP2 0.93 (2), 1.03 (3); memory / DeepSpeed's 0.57-0.71, / FSDP2's 0.96 (2, 3).
Peak live tensors / (formula with the fp32 copy + activations) at 4 ranks: 1.07, 1.00, 1.03.
A hand-written sharded optimizer (reduce-scatter, update the shard, all-gather) would give ZeRO-1
persistently full parameters and gradients, i.e. strictly more memory and the same traffic, at the
price of its own state-dict format that DCP could not reshard; FSDP2 already is that optimizer.

CPU offload (`offload=on`, fsdp > 1): FSDP2's CPUOffloadPolicy keeps the sharded parameters,
gradients and optimizer state in host memory and runs the optimizer step there; each block's
shard is copied to the device for its all-gather and its gradient shard copied back after the
reduce-scatter. On a CPU-only run the same path runs (pinning is off, the copies are no-ops).

Hybrid `dp2,fsdp2` is FSDP2's HSDP on the 2-D mesh ("dp", "fsdp"): shard within fsdp, replicate
across dp. Replicated dp over a tensor-parallel model (or in mixed precision) is HSDP with a
shard degree of 1, so no DDP ever sees a DTensor.
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
    precision = PrecisionPolicy.from_name(plan.precision)
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
"""Blocks per FSDP unit at zero=1/2 unless the plan says `bucket=`: see the module docstring."""


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
