"""The host's share of one whole training step: shoal's trainer against the plain loop a user writes, in
the host-bound regime (a deep, tiny model: 12 blocks of dim 64, one sequence of 16 tokens, so the
arithmetic is negligible and what is timed is Python, the dispatcher, hooks and launches).

shoal's step is `Trainer.train_one` as `shoal train` runs it: its batch fetched, forward, loss, backward,
gradient norm and clipping, AdamW step, learning-rate schedule, zero_grad, and the figures it keeps on the
device. The plain loop is the ~25 lines everyone writes on the same model, weights and batches: zero_grad,
forward (under torch.autocast in bf16), cross-entropy, backward, clip_grad_norm_, AdamW, a warm-up +
cosine LambdaLR. Like is compared with like, interleaved repeat by repeat (A B A B ...):
- eager: shoal `compile=off` against the eager loop, fp32 and bf16;
- compiled: shoal `compile=on` against `torch.compile(model)`, fp32 and bf16 (--compiled; each contender
  pays a cold compile first).
For each: median host time a step, the ratio shoal / loop (the median over repeats of the ratio of a repeat's
two adjacent steps: the host's speed drifts between two levels here, and adjacent steps share one), its
spread (the inter-quartile range of those ratios), the host ops one step dispatches
(shoal.calibration.counts.host_ops: outermost aten and c10d calls) and the compiled regions it enters.
On a CPU a step's host time is the CPU time of the thread that runs it (torch on one thread; gloo's
collectives run on gloo's own threads, so what is timed is the Python, dispatcher and hook work, not the
sums a collective does, and not the wait for the other rank); on a GPU the wall time to the end of the
step, the device synchronised. Goal: shoal / loop <= 1.05 in one process.

Under --plans with more ranks (2 local processes, gloo), shoal's trainer runs the plan and the loop is the
plain torch one a user writes for it, eager: dp2 against DistributedDataParallel, fsdp2 against FSDP2
(fully_shard on each block and the root, MixedPrecisionPolicy in bf16), tp2 against DTensor tensor
parallelism (bench.tp_vs_dtensor's hand-written plan, loss_parallel). Goal: shoal / loop <= 1.1 there.

    python -m bench.host_overhead [--repeats 30] [--compiled] [--device cpu|cuda] [--plans dp1,dp2,fsdp2,tp2]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

from bench.common import launch, report, summarize
from shoal.calibration.counts import host_ops
from shoal.infra.launch import free_port

HOST_SHAPE = ("num_layers=12", "dim=64", "num_heads=4", "num_kv_heads=2", "ffn_dim=128", "vocab_size=256")
"""The host-bound shape: deep and tiny (the `tiny` preset with these fields set)."""
SEQ_LEN, BATCH = 16, 1
LR, WEIGHT_DECAY, GRAD_CLIP, WARMUP, STEPS = 3e-3, 0.1, 1.0, 10, 10_000


def shoal_step(plan: str, device: str, precision: str, compiled: bool,
               run_dir: str) -> tuple[Callable[[], Any], Any]:
    """`Trainer.train_one` of step 0, 1, 2, ... for `plan` at this precision; (the step, the trainer)."""
    from shoal.optim.config import OptimConfig
    from shoal.train.config import LoopConfig, RunConfig, resolve_model
    from shoal.train.job import Job, with_model
    from shoal.train.loop import Trainer

    spec = f"{plan},precision={precision},compile={'on' if compiled else 'off'}"
    cfg = RunConfig(plan=spec, model="tiny", set=HOST_SHAPE, device=device,
                    loop=LoopConfig(steps=STEPS, global_batch=BATCH * dp_degree(plan), seq_len=SEQ_LEN),
                    optim=OptimConfig(lr=LR, weight_decay=WEIGHT_DECAY, grad_clip=GRAD_CLIP, warmup_steps=WARMUP))
    trainer = Trainer(Job(config=with_model(cfg, resolve_model(cfg)), run_dir=run_dir), torch.device(device))
    steps = itertools.count()
    return (lambda: trainer.train_one(next(steps))), trainer


def dp_degree(plan: str) -> int:
    """The data ranks of a plan of one axis ("dp2", "fsdp2", "tp2", "dp1")."""
    return 1 if plan.startswith("tp") else int(plan.lstrip("dpfs"))


def plain_model(plan: str, model: nn.Module, device: str, precision: str) -> nn.Module:
    """`model` parallelized as a user writes it with torch alone for `plan`, in place where torch does."""
    world = dist.get_world_size()
    if plan.startswith("dp") and world > 1:
        return DistributedDataParallel(model)
    if plan.startswith("fsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device, (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if precision == "bf16" else MixedPrecisionPolicy()
        for block in model.layers.values():  # type: ignore[union-attr]  # the Transformer's blocks
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    if plan.startswith("tp"):
        from torch.distributed.device_mesh import init_device_mesh

        from bench.tp_vs_dtensor import hand_written_tp

        return hand_written_tp(model, init_device_mesh(device, (world,)), sp=True)  # type: ignore[arg-type]
    return model


def loop_step(plan: str, trainer: Any, device: str, precision: str, compiled: bool) -> Callable[[], Any]:
    """The plain loop for `plan` on the trainer's model shape, its seed's weights and its batches."""
    from torch.distributed.tensor.parallel import loss_parallel

    from shoal.models import Transformer

    weights = [trainer.runtime.full_weights()]  # complete on rank 0
    dist.broadcast_object_list(weights, src=0)
    model: nn.Module = Transformer(trainer.model_cfg).to(device)
    model.load_state_dict(weights[0])
    model = plain_model(plan, model, device, precision)
    model = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                  **({"fused": True} if device == "cuda" else {}))

    def lr_at(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    # FSDP2 casts on its own; the rest run under autocast.
    dtype = None if plan.startswith("fsdp") else {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    sharded_loss = loss_parallel if plan.startswith("tp") else contextlib.nullcontext
    steps = itertools.count()

    def step() -> torch.Tensor:
        s = next(steps)
        inputs, targets = trainer.batches.batch(s, trainer.loop.global_batch, trainer.part)
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            logits = model(inputs)
        with sharded_loss():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        scheduler.step()
        return loss.detach()

    return step


def compiled_regions(fn: Callable[[], Any]) -> int:
    """Compiled graphs one call of `fn` enters, forward and backward (torch.profiler's regions)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name in ("Torch-Compiled Region", "CompiledFunctionBackward") or
               e.name.startswith("Torch-Compiled Region:") for e in prof.events())


def interleaved(fns: dict[str, Callable[[], Any]], device: str, *, warmup: int, repeats: int) -> dict[str, Any]:
    """Each step function's host time per call (see the module docstring), interleaved repeat by repeat;
    `summarize`d per name."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    clock = time.perf_counter if device == "cuda" else time.thread_time
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            samples[name].append(clock() - start)
    out: dict[str, Any] = {name: summarize(s) for name, s in samples.items()}
    out["ratio"] = summarize([a / b for a, b in zip(samples["shoal"], samples["loop"])])
    return out


def run(plan: str, device: str, repeats: int, compiled: bool) -> list[dict[str, Any]]:
    """Every row of `plan` on this rank (one rank: its own process group of one)."""
    if not dist.is_initialized():  # the trainer runs in a process group, of one here
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if device == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    rows = []
    for precision in ("fp32", "bf16"):
        with tempfile.TemporaryDirectory() as run_dir:
            ours, trainer = shoal_step(plan, device, precision, compiled, run_dir)
            theirs = loop_step(plan, trainer, device, precision, compiled)
            fns = {"shoal": ours, "loop": theirs}
            results = interleaved(fns, device, warmup=5, repeats=repeats)
            ops = {name: host_ops(fn) for name, fn in fns.items()}
            regions = {name: compiled_regions(fn) for name, fn in fns.items()}
        shoal_t, loop_t = results["shoal"], results["loop"]
        rows.append({"plan": plan, "mode": "compiled" if compiled else "eager", "precision": precision,
                     "shoal_ms": shoal_t["median"] * 1e3, "loop_ms": loop_t["median"] * 1e3,
                     "ratio": results["ratio"]["median"], "spread": results["ratio"]["iqr_rel"],
                     "shoal_ops": ops["shoal"], "loop_ops": ops["loop"],
                     "shoal_regions": regions["shoal"], "loop_regions": regions["loop"]})
    return rows


def run_plan(plan: str, device: str, repeats: int, compiled: bool) -> list[dict[str, Any]]:
    """`run` in this process for one rank, or on the plan's local ranks through bench.common.launch
    (rank 0's rows: the ranks step in lock-step through their collectives)."""
    world = dp_degree(plan) if not plan.startswith("tp") else int(plan[2:])
    if world == 1:
        return run(plan, device, repeats, compiled)
    return launch(run, world, plan, device, repeats, compiled)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--compiled", action="store_true", help="compare compiled steps (a cold compile each)")
    parser.add_argument("--plans", default="dp1", help="comma-separated: dp1, dp2, fsdp2, tp2 (2 local ranks each)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for plan in args.plans.split(","):
        rows += run_plan(plan, args.device, args.repeats, compiled=False)
        if args.compiled:
            rows += run_plan(plan, args.device, args.repeats, compiled=True)
    report("host_overhead", rows, notes="ratio: the median of shoal / loop over adjacent steps (goal <= 1.05 in "
           "one process, <= 1.1 on more); "
           "spread: those ratios' inter-quartile range over their median; ops: host ops one step dispatches; "
           "regions: compiled graphs it enters")


if __name__ == "__main__":
    main()
