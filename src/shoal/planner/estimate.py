"""One plan's predicted step time, throughput and memory per device: the cost model put together.

The engine that runs the plan's data axes is the runtime's own choice (shoal.rules.choose_engine),
so what is priced is what will run. Times are per step on the busiest rank:

- compute: each block's matrix FLOPs over the device's achievable matmul rate, its elementwise
  bytes over the memory bandwidth (shoal.planner.compute), backward twice forward (the dropouts'
  gradients once), plus the recompute;
- tensor parallel: per block 2 all-reduces forward and 2 backward, or with sequence parallelism
  an all-gather and a reduce-scatter in their place (Korthikanti et al. 2022, section 4.2.2);
- context parallel: the ring passes K and V cp-1 times forward (K, V and their gradients
  backward), each hop hidden behind the attention of the chunk before (Liu et al. 2023, "Ring
  Attention", section 3);
- expert parallel: two all-to-alls forward and two backward per MoE layer (Lepikhin et al. 2020,
  "GShard", section 3.2);
- pipeline: one point-to-point per stage boundary each way per micro-batch, and the bubble of the
  schedule (shoal.parallel.schedules): (p-1)(F+B) for GPipe and 1F1B, divided by v interleaved,
  (p-1)F for ZB-H1 (Qi et al. 2023, section 3, with B split evenly into input and weight halves);
- data axes: gradients reduced (and ZeRO-3 parameters gathered) over the data ranks, each collective
  hidden, on devices whose collectives overlap compute, only behind the pass its engine issues it in
  (shoal.planner.costs.data_schedule, overlap_exposed), then the optimizer step, which
  is memory-bound (Adam reads and writes 28 bytes per parameter, the norm for clipping 4 more); Muon adds
  Newton-Schulz on the hidden matrices and, where fsdp or tp split them, the owners' exchange
  (Costs.muon_step);
- the step's own small collectives (loss, gradient norm, stop signals), each a latency;
- the host's work: each op's dispatch (DTensor's under tensor parallelism), the data engine's per-parameter
  ops and the optimizer's. On a CPU the same cores run the ops, so it adds to the step; on a GPU the host
  queues kernels ahead of the device, so each phase (forward, backward, optimizer) takes the larger of its
  host and device time (`host_phases`): a small model's step is predicted host-bound, a large one's
  device-bound.

Memory is the busiest device's peak (shoal.planner.peak) with the fragmentation margin. The terms
of one micro-batch on a rank are priced in shoal.planner.costs; this module adds them up per step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any

from shoal.models.config import ModelConfig
from shoal.models.lora_config import LoRAConfig, adapter_elements_per_rank, quantized_base_per_rank
from shoal.plan import Plan
from shoal.planner import compute, memory, peak
from shoal.planner.comm import Network, RingNetwork
from shoal.planner.costs import (
    HOST_FORWARD_SHARE,
    SHOAL_GRADIENTS,
    STEP_HOST_OPS,
    Costs,
    GradientReduction,
    matmul_dtype,
)
from shoal.planner.hardware import Cluster
from shoal.rules import DEVICE_DEFAULTS, choose_engine, micro_batches

OPTIMIZER_BYTES = 28 + 4 * 2
"""Bytes an Adam step moves per parameter: read weight, gradient, two moments (16), write the weight
and the moments (12), and read the gradient twice for the clipping norm and the scaling (8)."""
ENGINE_OPS_PER_PARAMETER = {"fsdp2": 6, "zero": 3, "ddp": 1, "autocast": 2, "none": 0}
"""Host ops per parameter tensor per micro-batch that a data engine's hooks run: FSDP2 copies each
shard into and out of the gathered buffer in forward and again in backward; shoal's ZeRO engine
packs and unpacks gradient buckets; DDP marks each gradient ready; autocast casts each weight for
its products and its gradient back."""
OPS_PER_PARAMETER = 2
"""Host ops per parameter tensor per step outside forward and backward on a CPU: the clipping norm and the
clipping multiply (torch's foreach ops run tensor by tensor there); the fused AdamW update is one call for
all of them (shoal.optim.builder.adamw_kernel)."""
RESERVED_BYTES = 2**30
"""Device memory no tensor can use: the CUDA context, cuBLAS workspaces and NCCL buffers (~1 GiB
on current GPUs; PyTorch "Understanding CUDA memory usage" notes)."""
CPU_PROCESS_BYTES = 300 * 2**20
"""Host memory a CPU process holds before any model: Python, torch and a gloo group (every `shoal train
--dry-run` reports it as the baseline)."""


@dataclass(frozen=True, kw_only=True)
class Framework:
    """How the training framework whose step is priced runs the parts of a step frameworks run differently: the
    cost model's extension points. Every default is shoal's own runtime; the published-run validation prices other
    frameworks' runs through them (bench/framework_models.py)."""

    fused_attention: bool = True
    """Attention in one kernel that skips masked blocks and keeps no scores (FlashAttention, which PyTorch's SDPA
    runs and shoal calls); False for unfused QK^T / softmax / AV, which computes and stores the whole T x T score
    matrix."""
    fused_qkv: bool = False
    """Q, K and V projected by one weight, one product of n = (heads + 2 kv heads) x head dim a tp rank; False for
    three (shoal's wq, wk, wv), whose K and V products are skinny under grouped-query heads."""
    recompute: memory.RecomputePolicy = memory.SHOAL_SELECTIVE
    """What `ac=selective` keeps and reruns."""
    sequence_parallel: memory.SequenceParallelLayout = memory.DTENSOR
    """What sequence parallelism keeps and copies. Only the memory and the copies differ: the collectives are
    priced the same."""
    pipe_scatter: bool = False
    """Under tensor parallelism without sequence parallelism, each tensor-parallel rank sends the next pipeline
    stage its 1/tp share of the activation (and of its gradient back), all-gathered over the tensor-parallel group
    on arrival (the scatter/gather optimization, Narayanan et al. 2021, section 4.1). False: every rank sends the
    whole activation."""
    gradients: GradientReduction = SHOAL_GRADIENTS
    """What the data engine reduces and gathers, and when."""


SHOAL = Framework()


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one training step does, whatever the plan: the model and the global batch, and the framework that runs
    it."""

    model: ModelConfig
    global_batch: int
    """Sequences per optimizer step."""
    seq_len: int
    tf32: bool = True
    """fp32 matmuls on TF32 tensor cores where the GPU has them (`shoal train --tf32`, on by default): an fp32 plan's
    GEMMs priced at the device's "tf32" rate; attention, which SDPA runs in fp32 without a fused 16-bit kernel, is
    not."""
    framework: Framework = SHOAL
    lora: LoRAConfig | None = None
    """Low-rank adapters on a frozen base (shoal.models.lora): only the adapters have gradients and optimizer
    state; None: every parameter trains."""
    optimizer: str = "adamw"
    """`shoal train --optimizer`: how many fp32 moments its state holds per parameter (memory.OPTIMIZER_MOMENTS)."""

    def __post_init__(self) -> None:
        if self.optimizer not in memory.OPTIMIZER_MOMENTS:
            raise ValueError(f"optimizer {self.optimizer!r} is not valid; valid: "
                             f"{', '.join(memory.OPTIMIZER_MOMENTS)}")


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """The cost model's prediction for one plan."""

    plan: Plan
    device_type: str
    """"cpu" or "cuda": whose defaults (DEVICE_DEFAULTS) the plan was resolved with."""
    micro_batch: int
    """Sequences per micro-batch on one data rank (a pipeline's micro-batch, or one pass of
    gradient accumulation)."""
    engine: str
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    mem_per_device_bytes: float
    fits: bool
    time: dict[str, float] = field(default_factory=dict)
    """The step time's terms in seconds; they add up to step_time_s."""
    memory: dict[str, float] = field(default_factory=dict)
    """The peak memory's terms in bytes on the busiest device, before the fragmentation margin."""
    gradient_bytes: float = 0.0
    """Every gradient the busiest device holds after its backward; memory["gradients"] is what they add to
    the peak (less, where the backward's peak comes before most of them exist)."""
    traffic: dict[str, float] = field(default_factory=dict)
    """Seconds of each data-axis collective per step, hidden or not (`time` holds what is exposed)."""
    host: dict[str, float] = field(default_factory=dict)
    """The host's seconds per step by phase ("forward", "backward", "optimizer"): on a GPU each phase takes the
    larger of these and the device's time (`time["host_bound"]` is what the host adds); on a CPU they are part of
    `time`'s terms."""

    @property
    def plan_text(self) -> str:
        """The plan as `--plan` takes it, leaving out what the device's defaults fill in."""
        defaults = DEVICE_DEFAULTS[self.device_type]
        unset: dict[str, Any] = {k: None for k, v in defaults.items() if getattr(self.plan, k) == v}
        shown = dataclasses.replace(self.plan, **unset)
        return str(shown)

    def to_json(self) -> dict[str, Any]:
        """The keys `shoal plan --json` prints for one plan."""
        gb = 1e9
        return {
            "plan": self.plan_text, "micro_batch": self.micro_batch, "engine": self.engine,
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            "tflops_per_device": self.tflops_per_device, "mfu": self.mfu,
            "mem_per_device_gb": self.mem_per_device_bytes / gb, "fits": self.fits,
            "breakdown": {**{f"{k}_s": v for k, v in self.time.items()},
                          **{f"{k}_gb": v / gb for k, v in self.memory.items()},
                          **{f"traffic_{k}_s": v for k, v in self.traffic.items()}},
        }


def estimate(plan: Plan, work: Workload, cluster: Cluster, *, micro_batch: int | None = None,
             network: Network | None = None) -> Estimate:
    """Predict a resolved plan's step on `cluster` (`micro_batch`: sequences per accumulation pass
    when the plan has no pipeline; default the whole local batch)."""
    assert plan.dp is not None and plan.precision is not None, "resolve the plan first"
    cfg, S = work.model, work.seq_len
    local = work.global_batch // plan.data_ranks
    micro = micro_batches(plan, local_batch=local, micro_batch=micro_batch)
    b = local // micro  # sequences per micro-batch
    net = network or RingNetwork(cluster)
    frame, gradients = work.framework, work.framework.gradients
    engine = gradients.engine(plan, choose_engine(plan, num_layers=cfg.num_layers))
    cost = Costs(plan, cfg, cluster, net, tokens=b * S / plan.cp, seq_len=S, fused=frame.fused_attention,
                 recompute=frame.recompute, sp_layout=frame.sequence_parallel, tf32=work.tf32,
                 fused_qkv=frame.fused_qkv, pipe_scatter=frame.pipe_scatter, lora=work.lora)
    first, last = _stage_layers(cfg.num_layers, plan.pp, head_blocks=cost.head_in_blocks())
    stages = [(0, first, plan.pp == 1), (cfg.num_layers - last, cfg.num_layers, True)]
    tensors = 9 * cfg.num_layers / plan.pp + 3  # parameter tensors on a rank: 9 per block, embeddings, norm, head
    engine_host = cost.host_op * ENGINE_OPS_PER_PARAMETER[engine.kind] * tensors  # a micro-batch's engine hooks
    per_stage = [host_phases(*cost.stage(lo, hi, head=head), cost.stage_host(lo, hi, head=head) + engine_host,
                             on_cpu=cost.on_cpu) for lo, hi, head in stages]
    fwd, bwd, terms, host_fwd, host_bwd = max(per_stage, key=lambda s: s[0] + s[1])
    steady = micro * (fwd + bwd)
    bubble = _bubble(plan, fwd, bwd)
    time = {k: micro * v for k, v in terms.items()}
    time["pp_bubble"] = bubble
    if plan.pp == 1:
        params, experts = cost.params_per_rank(first, head=True)
    else:  # the busier of the first stage (its blocks and the embedding) and the last (its blocks and the head)
        params, experts = max(cost.params_per_rank(first, head=False, embedding=True),
                              cost.params_per_rank(last, head=True), key=sum)
    trainable = None if work.lora is None else \
        adapter_elements_per_rank(cfg, work.lora, tp=plan.tp, layers=max(first, last), ep=plan.ep)
    grads_exposed, sync = cost.data_sync(engine.kind, engine.zero, params, experts, micro=micro,
                                           units=_units(engine.kind, engine.units,
                                                        params if trainable is None else trainable),
                                           fwd=fwd if gradients.overlaps else 0.0,
                                           bwd=bwd if gradients.overlaps else 0.0, gradients=gradients,
                                           trainable=trainable)
    time["dp_sync_exposed"] = grads_exposed
    shards = plan.fsdp if engine.kind in ("zero", "fsdp2") else 1
    stored = params / (shards if engine.zero >= 1 else 1) + experts
    if trainable is not None:  # the optimizer steps the adapters alone
        stored = trainable / (shards if engine.zero >= 1 else 1)
    # Sharded engines and tensor parallelism hand the optimizer DTensors: each per-tensor op pays DTensor's dispatch.
    dtensors = engine.kind in ("zero", "fsdp2") or plan.tp > 1
    per_op = cost.dtensor_overhead if dtensors else cost.op_overhead
    optimizer_device = stored * OPTIMIZER_BYTES / cluster.device.memory_bw
    # A GPU's optimizer runs foreach and fused kernels: a few ops a step (STEP_HOST_OPS), not a few per tensor.
    optimizer_host = ((cost.host_dtensor if dtensors else cost.host_op) * STEP_HOST_OPS if not cost.on_cpu
                      else per_op * OPS_PER_PARAMETER * tensors)
    # the optimizer phase's host time: added on a CPU, the larger of the two on a GPU
    optimizer_wait = 0.0 if cost.on_cpu else max(0.0, optimizer_host - optimizer_device)
    time["optimizer"] = optimizer_device + (optimizer_host if cost.on_cpu else 0.0)
    if not cost.on_cpu:
        time["host_bound"] += optimizer_wait
    time["engine_overhead"] = micro * cost.op_overhead * ENGINE_OPS_PER_PARAMETER[engine.kind] * tensors
    time["step_sync"] = cost.step_sync(engine.kind)
    # Newton-Schulz on the hidden matrices and its exchange; a LoRA run's rank-r adapters are left unpriced
    if work.optimizer == "muon" and work.lora is None:
        time.update(cost.muon_step(max(first, last), shards=shards if engine.zero >= 1 else 1))
    step = (steady + bubble + grads_exposed + time["optimizer"] + time["engine_overhead"] + time["step_sync"]
            + optimizer_wait + time.get("muon_newton_schulz", 0.0) + time.get("muon_exchange", 0.0))
    quantized = (0.0, 0.0) if work.lora is None else quantized_base_per_rank(cfg, work.lora, layers=max(first, last))
    mem, gradient_bytes = peak.peak_terms(plan, cfg, cost, engine.kind, engine.zero, engine.bucket, params, experts,
                                          micro, stages, unsharded_accumulation=gradients.unsharded_accumulation,
                                          fp32_gradient_buffer=gradients.fp32_buffer, trainable=trainable,
                                          quantized=quantized, moments=memory.OPTIMIZER_MOMENTS[work.optimizer])
    on_cpu = cluster.device_type == "cpu"
    need = sum(mem.values()) * memory.FRAGMENTATION + (peak.CPU_STEP_BYTES if on_cpu else 0.0)
    usable = cluster.device.memory_bytes - (CPU_PROCESS_BYTES if on_cpu else RESERVED_BYTES)
    tokens = work.global_batch * S
    flops = _model_flops(cfg, S, work.lora) * tokens / step / plan.world_size
    peak_rate = cluster.device.peak_flops[matmul_dtype(plan, cluster, tf32=work.tf32)]
    return Estimate(plan=plan, device_type=cluster.device_type, micro_batch=b, engine=engine.kind, step_time_s=step,
                    tokens_per_s=tokens / step, tflops_per_device=flops / 1e12, mfu=flops / peak_rate,
                    mem_per_device_bytes=need, fits=need <= usable, time=time, memory=mem, traffic=sync,
                    gradient_bytes=gradient_bytes,
                    host={"forward": micro * host_fwd, "backward": micro * host_bwd, "optimizer": optimizer_host})


def host_phases(fwd: float, bwd: float, terms: dict[str, float], host: float, *, on_cpu: bool
                ) -> tuple[float, float, dict[str, float], float, float]:
    """(forward, backward, terms, host forward, host backward) of one micro-batch on a stage, given the device's
    forward and backward seconds and terms (Costs.stage) and the host's seconds for both passes (`host`, split by
    HOST_FORWARD_SHARE). On a GPU the host queues the kernels ahead of the device, so each pass lasts the longer of
    the two (a pass whose host is slower leaves the device waiting for work), and terms["host_bound"] holds what the
    host adds. On a CPU the cores run both, and Costs.stage's "host_overhead" term already adds it."""
    host_fwd, host_bwd = HOST_FORWARD_SHARE * host, (1 - HOST_FORWARD_SHARE) * host
    if on_cpu:
        return fwd, bwd, terms, host_fwd, host_bwd
    bound_fwd, bound_bwd = max(fwd, host_fwd), max(bwd, host_bwd)
    terms = {**terms, "host_bound": (bound_fwd - fwd) + (bound_bwd - bwd)}
    return bound_fwd, bound_bwd, terms, host_fwd, host_bwd


@functools.lru_cache(maxsize=256)
def _model_flops(cfg: ModelConfig, seq_len: int, lora: LoRAConfig | None = None) -> float:
    """The FLOPs per token a step is credited with (compute.model_flops_per_token); a LoRA step's weight products
    as compute.step_weight_flops counts them in place of a full fine-tune's."""
    flops = compute.model_flops_per_token(cfg, seq_len)
    if lora is not None:
        flops += compute.step_weight_flops(cfg, lora) - compute.step_weight_flops(cfg)
    return flops


@functools.lru_cache(maxsize=4096)
def _stage_layers(num_layers: int, pp: int, *, head_blocks: float) -> tuple[int, int]:
    """(blocks on the busiest non-last stage, blocks on the last stage) of the balanced split
    (the last stage also runs the head, worth `head_blocks` blocks; split_layers balances the same way)."""
    if pp == 1:
        return num_layers, num_layers
    best = (math.inf, 0, 0)
    for last in range(1, num_layers - pp + 2):
        first = -(-(num_layers - last) // (pp - 1))
        worst = max(first, last + head_blocks)
        if worst < best[0]:
            best = (worst, first, last)
    return best[1], best[2]


def _bubble(plan: Plan, fwd: float, bwd: float) -> float:
    p = plan.pp
    if p == 1:
        return 0.0
    if plan.sched == "zb":
        return (p - 1) * fwd
    if plan.sched == "interleaved":
        assert plan.vpp is not None, "estimates are of resolved plans"
        return (p - 1) * (fwd + bwd) / plan.vpp
    return (p - 1) * (fwd + bwd)


DDP_BUCKET_BYTES = 25 * 2**20
"""torch DDP's default gradient bucket (bucket_cap_mb=25)."""


def _units(kind: str, units: int, params: float) -> int:
    """Gather/reduce units besides the rest of the model: the engine's, or DDP's 25 MB buckets of the `params` that
    have gradients."""
    if kind in ("ddp", "none", "autocast"):
        return max(1, math.ceil(params * 4 / DDP_BUCKET_BYTES)) - 1
    return units
