"""How the frameworks of the published runs (bench/published_runs.py) ran the parts of a step frameworks run
differently, plugged into the cost model's extension points (shoal.planner.estimate.Framework): torchtitan's and
Megatron-LM's selective recompute (memory.RecomputePolicy), Megatron-LM's sequence-parallel layout
(memory.SequenceParallelLayout), and DeepSpeed's pipeline engine, with and without its BF16_Optimizer, and
Megatron-LM's local DDP (costs.GradientReduction). `framework` builds one from the settings a published run
records, by name; shoal's own runtime is every default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from shoal.models.config import ModelConfig
from shoal.plan import Plan
from shoal.planner import compute, memory
from shoal.planner.costs import SHOAL_GRADIENTS, GradientReduction
from shoal.planner.estimate import Framework, Workload
from shoal.rules import EngineChoice


# ----------------------------------------------------------------------------- selective recompute
def titan_saves(index: int) -> bool:
    """Whether torchtitan's per-op selective recompute keeps the output of a block's `index`-th weight product
    (counting from 1 in call order): its policy (github.com/pytorch/torchtitan, `_custom_policy` in
    torchtitan/parallelisms/parallelize_llama.py at 9dec370, and unchanged in
    torchtitan/models/llama3/parallelize_llama.py at 820504e) saves the outputs of aten.mm, the SDPA
    kernels and tensor parallelism's reduce-scatters, "except every second mm", counted afresh in each block's
    checkpointed forward; every other op is recomputed."""
    return index % 2 == 1


def titan_recomputed_matmul(cfg: ModelConfig, *, moe: bool) -> float:
    """Forward FLOPs per token of the weight products torchtitan's per-op selective recompute reruns: every second
    one of `compute.block_matmuls` (Llama's wk, wo and w3: 0.365 of an 8B block's). In an MoE block only the
    attention projections are counted (its experts are not a plain aten.mm)."""
    products = compute.block_matmuls(cfg)[:4] if moe else compute.block_matmuls(cfg)
    return sum(2.0 * d_in * d_out for i, (_, d_in, d_out, _) in enumerate(products, 1) if not titan_saves(i))


def titan_selective_elements(cfg: ModelConfig, *, tp: int, sp: bool) -> float:
    """Elements a dense block keeps per token on one tensor-parallel rank under torchtitan's per-op selective
    recompute (`titan_saves`): the checkpointed block's input; the outputs of the weight products it
    saves (Llama's wq, wv, w1 and w2: a column-parallel one's split by tp, a row-parallel one's whole, as its
    partial sum is); the attention kernel's output and log-sum-exp per head; under sequence parallelism the
    two reduce-scatters' outputs. Everything else is recomputed in backward, one block at a time."""
    kept: float = cfg.dim / (tp if sp else 1)
    for i, (_, _, d_out, column) in enumerate(compute.block_matmuls(cfg), 1):
        if titan_saves(i):
            kept += d_out / tp if column else d_out
    kept += (cfg.num_heads * cfg.head_dim + cfg.num_heads) / tp
    return kept + (2 * cfg.dim / tp if tp > 1 and sp else 0.0)


@dataclass(frozen=True)
class TorchtitanOp:
    """torchtitan's per-op selective recompute (selective_ac_option 'op'): every second weight product's output
    is rerun; an MoE block is counted as Korthikanti et al. count it. The block being rerun holds all of its
    tensors again."""

    def kept_elements(self, cfg: ModelConfig, index: int, *, tp: int, sp: bool, fused_attention: bool,
                      on_cpu: bool) -> float | None:
        return None if cfg.is_moe_layer(index) else titan_selective_elements(cfg, tp=tp, sp=sp)

    def rerun_matmul(self, cfg: ModelConfig, *, moe: bool) -> float:
        return titan_recomputed_matmul(cfg, moe=moe)

    def rerun(self, *, matmul: float, attention: float, elementwise: float, scores: float,
              fused_attention: bool) -> float:
        return compute.recomputed("selective", matmul=0.0, attention=attention, elementwise=elementwise,
                                  fused_attention=fused_attention, selective_matmul=matmul)

    def rerun_holds(self, *, whole: float, kept: float) -> float:
        return whole


@dataclass(frozen=True)
class MegatronSelective:
    """Megatron-LM's selective recompute (Korthikanti et al. 2022, section 5): everything but the attention core
    (the scores, softmax and dropout) is kept, and backward reruns the core alone, its products and the elementwise
    work on its scores (none of it with a fused kernel, which recomputes its scores in its own backward). The one
    rerun attention core is counted as kept."""

    def kept_elements(self, cfg: ModelConfig, index: int, *, tp: int, sp: bool, fused_attention: bool,
                      on_cpu: bool) -> float | None:
        return None

    def rerun_matmul(self, cfg: ModelConfig, *, moe: bool) -> float:
        return 0.0

    def rerun(self, *, matmul: float, attention: float, elementwise: float, scores: float,
              fused_attention: bool) -> float:
        return 0.0 if fused_attention else attention + scores

    def rerun_holds(self, *, whole: float, kept: float) -> float:
        return 0.0


SELECTIVE_POLICIES: dict[str, memory.RecomputePolicy] = {
    "shoal": memory.SHOAL_SELECTIVE, "torchtitan-op": TorchtitanOp(), "megatron": MegatronSelective()}
"""What `ac=selective` keeps, by the framework that runs it."""


# ----------------------------------------------------------------------------- tensor parallelism
TP_ENGINES = {"dtensor": memory.DTENSOR,
              "megatron": memory.SequenceParallelLayout(keeps_gathered_input=False, relayout_copies=False)}
"""Who runs tensor parallelism, for what sequence parallelism keeps and copies: DTensor's styles (shoal,
torchtitan), or Megatron-LM's own layers, which keep each norm's sequence shard and gather it again in backward
(Korthikanti et al. 2022, section 4.2.2) and lay the residual stream out (sequence, batch, dim), gathered on dim 0
without a copy. Both are priced the same collectives (Megatron-LM overlaps its extra all-gather with the weight
gradients)."""


# ----------------------------------------------------------------------------- data engines
def deepspeed_engine(plan: Plan, engine: EngineChoice) -> EngineChoice:
    """The data engine of a DeepSpeed pipeline-engine run of `plan` (shoal's choice for it: `engine`).

    DeepSpeed's TrainSchedule issues ReduceTiedGrads, ReduceGrads and OptimizerStep once, at the end of the batch,
    after the last micro-batch's backward (github.com/microsoft/DeepSpeed, deepspeed/runtime/pipe/schedule.py,
    TrainSchedule.steps, "Model step at the end of the batch"): a sharded plan's gradients are reduced and, at
    ZeRO-1, its updated weights gathered once a step, which is shoal's ZeRO-1 engine's traffic (kind "zero"),
    and nothing overlaps them (DeepSpeedPipe.overlaps). A replicated plan keeps its one all-reduce.
    DeepSpeed's pipeline engine runs no ZeRO stage above 1."""
    if plan.fsdp == 1:
        return engine
    if plan.zero != 1:
        raise ValueError(f"DeepSpeed's pipeline engine runs ZeRO-1 at most, got zero={plan.zero}")
    return dataclasses.replace(engine, kind="zero", zero=1)


@dataclass(frozen=True, kw_only=True)
class DeepSpeedPipe(GradientReduction):
    """DeepSpeed's pipeline engine: the gradients reduced (and at ZeRO-1 the updated weights gathered) once a step,
    after the last micro-batch's backward, beside no compute (`deepspeed_engine`)."""

    overlaps: bool = False

    def engine(self, plan: Plan, choice: EngineChoice) -> EngineChoice:
        return deepspeed_engine(plan, choice)


FP32_ACCUMULATION_BYTES = (2 + 4) + (4 + 4 + 4)
"""Bytes per parameter DeepSpeed's BF16_Optimizer moves per micro-batch adding a bf16 gradient into its fp32 buffer
(hp_grad.add_(lp.grad.to(float32)): the cast reads 2 bytes and writes 4, the add reads 4 and 4 and writes 4)."""
BF16_REDUCE_COPY_BYTES = (4 + 4) + (4 + 2) + (2 + 2) + (2 + 4) + (4 + 4)
"""Bytes per parameter DeepSpeed's allreduce_bucket moves around the all-reduce of the fp32 buffer in bf16, once a step
(deepspeed/runtime/engine.py at 56c522386): flatten, cast to bf16, scale, copy back, unflatten into the buffer."""

DEEPSPEED_BF16 = DeepSpeedPipe(reduces_whole=True, accumulation_bytes=FP32_ACCUMULATION_BYTES,
                               reduction_copy_bytes=BF16_REDUCE_COPY_BYTES, fp32_buffer=True)
"""DeepSpeed's BF16_Optimizer under its pipeline engine (deepspeed/runtime/bf16_optimizer.py and pipe/engine.py at
56c522386, "bf16+pipeline parallelism", the branch BLOOM trained on; BLOOM's tr11 README: "The new BF16_Optimizer
accumulates grads in fp32. It doesn't shard the static fp32 buffer"): every micro-batch's backward adds each bf16
gradient into an fp32 buffer on the compute stream (update_hp_grads), and at the step's end _bf16_reduce_grads
all-reduces that whole buffer over the data ranks (buffered_allreduce_fallback) where a ZeRO-1 engine would
reduce-scatter it, in the plan's `reduce` dtype (engine.py allreduce_bucket casts to communication_data_type, bf16
by default at ZeRO stage 0 with bf16), copying around it; each rank then updates its shard and all-gathers the bf16
weights (its own ZeRO-1). The buffer holds the rank's whole gradients, unsharded (fp32_groups_gradients_flat,
zeros_like the flat bf16 group), and the pipeline engine keeps the 16-bit ones too
(update_hp_grads(clear_lp_grads=False))."""


@dataclass(frozen=True, kw_only=True)
class MegatronLocal(GradientReduction):
    """Megatron-LM's own DistributedDataParallel (`--DDP-impl local`), whose train_step all-reduces the gradients
    once, after forward_backward_func returns (megatron/training.py and megatron/model/distributed.py,
    allreduce_gradients, at github.com/NVIDIA/Megatron-LM aed2f75e20): no overlap. It replicates every state.
    `--DDP-impl torch` is torch's DDP, which shoal's engine prices."""

    overlaps: bool = False

    def engine(self, plan: Plan, choice: EngineChoice) -> EngineChoice:
        if plan.fsdp > 1:
            raise ValueError(f"Megatron-LM's local DDP replicates every state, got fsdp={plan.fsdp}")
        return choice


DATA_ENGINES: dict[str, GradientReduction] = {
    "shoal": SHOAL_GRADIENTS, "deepspeed-pipe": DeepSpeedPipe(), "deepspeed-bf16": DEEPSPEED_BF16,
    "megatron-local": MegatronLocal()}
"""Who runs the data axes: shoal's own engine for the plan (shoal.rules.choose_engine), DeepSpeed's pipeline engine
(Megatron-DeepSpeed's runs), that engine with its BF16_Optimizer (bf16 at ZeRO stage 0: BLOOM's), or Megatron-LM's
local DDP."""


# ----------------------------------------------------------------------------- by name
T = TypeVar("T")


def _lookup(kind: str, table: Mapping[str, T], name: str) -> T:
    if name not in table:
        raise ValueError(f"{kind} {name!r} is not valid; valid: {', '.join(table)}")
    return table[name]


def policy(name: str) -> memory.RecomputePolicy:
    """The selective recompute policy `name` (SELECTIVE_POLICIES); a ValueError naming the valid ones."""
    return _lookup("selective_policy", SELECTIVE_POLICIES, name)


def layout(name: str) -> memory.SequenceParallelLayout:
    """The sequence-parallel layout of the tensor-parallel engine `name` (TP_ENGINES)."""
    return _lookup("tp_engine", TP_ENGINES, name)


def engine(name: str) -> GradientReduction:
    """The gradient-reduction model of the data engine `name` (DATA_ENGINES)."""
    return _lookup("data_engine", DATA_ENGINES, name)


def framework(*, fused_attention: bool = True, selective_policy: str = "shoal", data_engine: str = "shoal",
              unsharded_accumulation: bool = False, tp_engine: str = "dtensor", fused_qkv: bool = False,
              pipe_scatter: bool = False) -> Framework:
    """The Framework of a run recorded with these settings (the fields of bench/published_runs.py's PublishedRun).
    `unsharded_accumulation`: FSDP2 stages under torch.distributed.pipelining (torchtitan's pipelines), whose
    PipelineStage turns gradient sync off for every backward but a stage's last (stage.py,
    backward_maybe_with_nosync)."""
    gradients = engine(data_engine)
    if unsharded_accumulation:
        gradients = dataclasses.replace(gradients, unsharded_accumulation=True)
    return Framework(fused_attention=fused_attention, fused_qkv=fused_qkv, recompute=policy(selective_policy),
                     sequence_parallel=layout(tp_engine), pipe_scatter=pipe_scatter, gradients=gradients)


def workload(*, model: ModelConfig, global_batch: int, seq_len: int, **settings: Any) -> Workload:
    """A Workload run by `framework(**settings)`."""
    return Workload(model=model, global_batch=global_batch, seq_len=seq_len, framework=framework(**settings))
