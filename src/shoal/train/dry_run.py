"""`shoal train --dry-run`: the whole set-up, then three forward, backward and optimizer steps on
state that is thrown away, and what each rank's memory held in the second and the third (its live
tensors), beside the planner's prediction.

The steps are real (gradients, optimizer state and the backward peak exist), so the figures are
measured, not modelled: bytes of the parameters, gradients and optimizer state this rank's
optimizer owns, summed from the live tensors (a DTensor counts its local shard), and the peak
resident (or, on GPUs, allocated) memory of the set-up and of the step separately, and the
step's peak of live tensor bytes (shoal.train.memory.TensorPeak), which is what the planner
predicts: on CPU the resident set also holds memory no tensor owns. Nothing is saved: no
checkpoint, no metrics.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shoal.infra import host_memory
from shoal.models.lora import LoRALinear
from shoal.train import memory

MB = 2**20


def live_bytes(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
               frozen: list[torch.nn.Parameter] = (), low_bit: int = 0) -> dict[str, float]:  # type: ignore[assignment]  # read only
    """Bytes this rank holds of `params` (the optimizer's) and of the `frozen` ones (a low-rank adapters' base:
    parameters only) plus `low_bit` bytes of a low-bit base (not parameters), their gradients and the optimizer's
    state, each storage counted once."""
    seen: set[int] = set()

    def size(t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        local = t.to_local() if isinstance(t, DTensor) else t
        key = local.untyped_storage().data_ptr()
        if key in seen or local.device.type == "meta":
            return 0
        seen.add(key)
        return local.untyped_storage().nbytes()

    state = sum(size(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {"parameters": sum(size(p) for p in [*params, *frozen]) + low_bit,
            "gradients": sum(size(p.grad) for p in params),
            "optimizer": state}


def dry_run(trainer: Any, *, baseline_mb: float = 0.0) -> dict[str, Any]:
    """Three steps of `trainer` on throwaway state, the last two measured; rank 0 prints the table and
    returns the figures.

    baseline_mb: this process's memory before the model was built (the interpreter, torch, the
    process group), which the planner leaves out: its prediction is compared with the step's
    peak above it."""
    setup_peak = memory.peak_mb()  # everything so far: the interpreter, the build, the data
    # Three steps: the first makes the optimizer state and every first-use buffer; the second, whose
    # peak memory is measured, is a step as the run's steady state has it, with that state held
    # throughout; the third counts its live tensors. torch's MemTracker, which counts them, keeps Python
    # records of every tensor and module it sees, memory a training step does not hold (and small
    # allocations among the tensors' in glibc's heap), so the second step runs without it.
    float(trainer.train_one(trainer.start).loss)
    memory.reset_peak()
    loss = float(trainer.train_one(trainer.start + 1).loss)  # waits for the step
    step_peak = memory.peak_mb()
    kept = memory.allocator_held_mb()
    with memory.TensorPeak(*trainer.runtime.parts, trainer.optimizer) as tensors:
        float(trainer.train_one(trainer.start + 2).loss)
    frozen = [p for part in trainer.runtime.parts for p in part.parameters() if not p.requires_grad]
    low_bit = sum(m.quantized.nbytes() for part in trainer.runtime.parts for m in part.modules()
                  if isinstance(m, LoRALinear) and m.quantized is not None)
    held = live_bytes(list(trainer.runtime.parameters()), trainer.optimizer, frozen=frozen, low_bit=low_bit)
    row = torch.tensor([held["parameters"] / MB, held["gradients"] / MB, held["optimizer"] / MB, baseline_mb,
                        setup_peak, step_peak, math.nan if tensors.peak_mb is None else tensors.peak_mb,
                        math.nan if kept is None else kept], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    if dist.get_rank() != 0:
        return {}
    predicted = memory_prediction(trainer)
    # torch's MemTracker is a dispatch mode, under which compiled code runs op by op: on a CPU (where it counts
    # the live tensors) a compiled step's count is the eager step's, and is compared with the eager terms.
    eager = trainer.device.type == "cpu" and bool(trainer.plan.compile)
    tracked = memory_prediction(trainer, compiled=False) if eager else None
    print(_table(trainer, [r.tolist() for r in rows], predicted, loss, eager_terms=tracked))
    ranks = [{k: None if math.isnan(v) else v for k, v in zip(_COLUMNS, r.tolist(), strict=True)} for r in rows]
    return {"dry_run": True, "loss": loss, "ranks": ranks,
            "predicted_mb": predicted}


_COLUMNS = ("parameters_mb", "gradients_mb", "optimizer_mb", "baseline_mb", "setup_peak_mb", "step_peak_mb",
            "tensor_peak_mb", "allocator_held_mb")


def memory_prediction(trainer: Any, *, compiled: bool | None = None) -> dict[str, float] | None:
    """The planner's memory terms per device for this run (MB), as the memory check priced them
    (the interpreter and libraries not included); None where the planner has no spec for the GPU, and
    for a model of another family than the text transformer's, which the planner does not price.
    `compiled`: price the blocks compiled or not, whatever the plan says (None: as it says)."""
    from shoal.calibration.auto_plan import memory_cluster
    from shoal.models import ModelConfig
    from shoal.models.lora_config import LoRAConfig
    from shoal.planner.estimate import Workload, estimate

    cluster = memory_cluster(trainer.world, trainer.device.type)
    if cluster is None or not isinstance(trainer.model_cfg, ModelConfig):  # the planner prices transformers
        return None
    lora = LoRAConfig.parse(trainer.cfg.lora) if trainer.cfg.lora is not None else None
    work = Workload(model=trainer.model_cfg, global_batch=trainer.loop.global_batch, seq_len=trainer.loop.seq_len,
                    lora=lora, optimizer=trainer.cfg.optim.optimizer)
    plan = trainer.plan if compiled is None else dataclasses.replace(trainer.plan, compile=compiled)
    e = estimate(plan, work, cluster, micro_batch=trainer.loop.micro_batch)
    return {**{k: v / MB for k, v in e.memory.items()}, "all gradients": e.gradient_bytes / MB,
            "total": e.mem_per_device_bytes / MB}


def _lora_line(trainer: Any) -> str:
    """What the planner prices differently for a LoRA run (shoal.planner.compute.step_weight_flops)."""
    from shoal.models.lora_config import LoRAConfig
    from shoal.planner.compute import step_weight_flops

    lora, cfg = LoRAConfig.parse(trainer.cfg.lora), trainer.model_cfg
    ratio = step_weight_flops(cfg, lora) / step_weight_flops(cfg)
    return (f"planner, LoRA {lora.text()}: gradients and optimizer state for the adapters alone; the step's weight "
            f"products {ratio:.3f} of a full fine-tune's (frozen weights: no weight gradient; the adapters' products "
            "beside)")


def _table(trainer: Any, rows: list[list[float]], predicted: dict[str, float] | None, loss: float, *,
           eager_terms: dict[str, float] | None = None) -> str:
    """The dry run's printout; `eager_terms`: the planner's terms with the blocks run op by op, which the live
    tensors are compared with where MemTracker counted a compiled step."""
    where = "resident" if trainer.device.type == "cpu" else "allocated"
    allocator = f"; host memory allocator: {host_memory.describe()}" if trainer.device.type == "cpu" else ""
    lines = [f"dry run: set-up and three steps of plan {trainer.plan} on {trainer.world} process(es) "
             f"(loss {loss:.4f}); nothing saved{allocator}",
             f"{'rank':>4}  {'params MB':>10}  {'grads MB':>9}  {'optim MB':>9}  {'baseline MB':>11}  "
             f"{'set-up peak MB':>14}  {'step peak MB':>12}  {'tensors MB':>10}  {'kept MB':>7}  ({where} memory, "
             "this process; tensors: the step's peak of live tensor bytes; kept: freed memory the allocator "
             "held for reuse after the step)"]
    for rank, (p, g, o, base, setup, step, live, kept) in enumerate(rows):
        lines.append(f"{rank:>4}  {p:>10.1f}  {g:>9.1f}  {o:>9.1f}  {base:>11.0f}  {setup:>14.0f}  {step:>12.0f}  "
                     f"{live:>10.0f}  {'' if math.isnan(kept) else f'{kept:.0f}':>7}")
    if predicted is None:
        lines.append("planner: no spec for this device, no prediction")
    else:
        states = {"parameters": predicted["parameters"], "gradients": predicted["all gradients"],
                  "optimizer": predicted["optimizer"]}
        peak = {k: v for k, v in predicted.items() if k not in ("total", "all gradients") and v}
        lines.append(f"planner, busiest device (MB): {', '.join(f'{k} {v:.1f}' for k, v in states.items())}; "
                     f"the step's peak: {', '.join(f'{k} {v:.1f}' for k, v in peak.items())}; total with the "
                     f"fragmentation margin{' and the step runtime' if trainer.device.type == 'cpu' else ''} "
                     f"{predicted['total']:.1f} (the interpreter and libraries not included)")
        if trainer.cfg.lora is not None:
            lines.append(_lora_line(trainer))
        total = predicted["total"]
        above = max(step - base for *_, base, _, step, _, _ in rows)
        lines.append(f"step peak above the baseline, busiest rank: {above:.0f} MB; the planner's "
                     f"{total:.0f} MB is {100 * (total - above) / above:+.0f}% off")
        live = max(r[6] for r in rows)
        terms = eager_terms or predicted
        priced = sum(v for k, v in terms.items() if k not in ("total", "all gradients"))  # no allocator margin
        if not math.isnan(live):
            how = " (counted under torch's MemTracker, which runs compiled blocks op by op: priced so)" \
                if eager_terms else ""
            lines.append(f"step peak of live tensors, busiest rank: {live:.0f} MB; the planner's terms, "
                         f"{priced:.0f} MB, are {100 * (priced - live) / live:+.0f}% off{how}")
    kept_mb = [r[7] for r in rows]
    if not any(math.isnan(k) for k in kept_mb):
        lines.append(f"freed memory the allocator kept for reuse after the step: {min(kept_mb):.0f} to "
                     f"{max(kept_mb):.0f} MB a rank (memory no tensor owns: resident on CPU, reserved on GPUs; "
                     "the planner's tensor terms leave it out)")
    return "\n".join(lines)
