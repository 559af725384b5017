"""Which data-parallel engine runs a plan, with which settings: a pure function of the plan and
the model's depth. It imports no torch, so the planner costs the very choice the runtime makes.

The engines (shoal/parallel/data.py builds them):
- none: one data rank in full precision; the model is left as the other axes made it.
- ddp: torch's DistributedDataParallel (replicated, full precision, no tensor parallel).
- zero: shoal's ZeRO-1/2 engine (shoal/parallel/zero.py): fsdp > 1 at stage 1 or 2, on a model
  without tensor parallelism and without offload. Under pp it also runs replicated data
  parallelism (fsdp = 1, at ZeRO-1: gradients accumulate over the micro-batches and are
  all-reduced after the last one's backward): DDP prepares its reduction in forward, and a
  pipeline runs later forwards before earlier backwards.
- fsdp2: torch's FSDP2 `fully_shard` for everything else: ZeRO-3, offload, data parallel over a
  tensor-parallel model, and replicated mixed precision (a shard degree of 1, since DDP has no
  parameter-dtype policy).
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.plan import Plan

DEFAULT_BUCKET = {1: 2, 2: 2, 3: 1}
"""Transformer blocks per gather/reduce unit unless the plan says `bucket=`: two at ZeRO-1/2
(fewer, larger collectives; the full parameters are kept anyway), one at ZeRO-3, where a
unit's full parameters are the transient memory sharding exists to save."""


@dataclass(frozen=True, kw_only=True)
class EngineChoice:
    """The data-parallel engine of one plan and how it groups the model."""

    kind: str
    """none, ddp, zero or fsdp2 (see the module docstring)."""
    zero: int
    """The ZeRO stage it runs: 1, 2 or 3; 0 for none and ddp (nothing sharded)."""
    bucket: int
    """Transformer blocks per gather/reduce unit (0 when nothing is gathered or reduced by units)."""
    units: int
    """Gather/reduce units of blocks (the rest of the model, embeddings and head, is one more)."""

    def describe(self) -> str:
        """One line for the plan's words at start-up."""
        if self.kind == "none":
            return "one data rank, nothing to replicate or shard"
        if self.kind == "ddp":
            return "torch DDP (bucketed all-reduce overlapped with backward)"
        engine = "shoal's ZeRO-1/2 engine" if self.kind == "zero" else "torch FSDP2"
        return f"{engine} at ZeRO-{self.zero}, {self.units} unit(s) of {self.bucket} block(s) plus the rest"


def choose_engine(plan: Plan, *, num_layers: int) -> EngineChoice:
    """The engine that runs the (resolved) plan's dp and fsdp axes for a model of `num_layers` blocks."""
    assert plan.dp is not None and plan.precision is not None, "resolve the plan first"
    full_precision = plan.precision == "fp32" and plan.reduce == "fp32"
    if plan.dp == 1 and plan.fsdp == 1 and plan.cp == 1 and full_precision:
        return EngineChoice(kind="none", zero=0, bucket=0, units=0)
    if plan.pp > 1 and plan.tp == 1 and not plan.offload and (plan.fsdp == 1 or plan.zero < 3):
        zero = 1 if plan.fsdp == 1 else plan.zero
        bucket = plan.bucket if plan.bucket is not None else DEFAULT_BUCKET[zero]
        return EngineChoice(kind="zero", zero=zero, bucket=bucket, units=-(-num_layers // bucket))
    if plan.fsdp == 1 and plan.tp == 1 and full_precision:
        return EngineChoice(kind="ddp", zero=0, bucket=0, units=0)
    # Replicated only (fsdp1): nothing to free after forward, so the gathered copy is kept (zero=2).
    zero = plan.zero if plan.fsdp > 1 else 2
    bucket = plan.bucket if plan.bucket is not None else DEFAULT_BUCKET[zero]
    units = -(-num_layers // bucket)
    kind = "zero" if zero < 3 and plan.fsdp > 1 and plan.tp == 1 and not plan.offload else "fsdp2"
    return EngineChoice(kind=kind, zero=zero, bucket=bucket, units=units)
