"""shoal's ZeRO stages side by side with torch FSDP2 used directly and DeepSpeed ZeRO 1/2/3.

Same model, seed, batch and fp32 AdamW in every system. Step time: all systems of a (stage, world
size) in one launch, interleaved repeat by repeat so machine drift hits all alike; median over
repeats after warm-up (the slowest rank's median), with the inter-quartile range. Memory: each
system in its own launches, so that its memory is its own: peak resident memory during a step minus
the resident memory before the model was built (after imports and process-group start-up), max
over ranks, median over --mem-launches launches (it varies by about 10 MB between launches).
Goal: shoal / peer <= 1.05 in time and <= 1.0 in memory.

FSDP2 direct: `fully_shard` per block and on the root, reshard_after_forward=True (stage 3) or
False (stage 2); it has no ZeRO-1 mode. DeepSpeed: default ZeRO settings except
stage3_param_persistence_threshold=0 (by default stage 3 leaves every parameter under 100k elements,
i.e. most of this small model, unpartitioned, which would not be ZeRO-3). DeepSpeed is a bench-only dependency
(`DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8`); without it those rows are
skipped.

    python -m bench.zero_vs_peers [--nprocs 2 4] [--stages 1 2 3] [--repeats 6] [--model small]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.common import launch, measure, measure_pair, report
from shoal import rules
from shoal.apply_plan import parallelize
from shoal.mesh import build_mesh
from shoal.models import Transformer, get_preset
from shoal.plan import Plan
from shoal.train.memory import current_mb
from shoal.train.step import split_micro, train_step


def _batch(cfg, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    seq = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


def _shoal(cfg, stage: int, x: torch.Tensor, y: torch.Tensor):
    n = dist.get_world_size()
    bucket = os.environ.get("SHOAL_BENCH_BUCKET")  # --bucket; unset: shoal's default
    plan = rules.resolve(Plan.parse(f"fsdp{n},zero={stage}" + (f",bucket={bucket}" if bucket else "")), world_size=n)
    mesh = build_mesh(plan)
    model = parallelize(Transformer(cfg), plan, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return lambda: train_step(model, optimizer, split_micro(x, y, 1), grad_clip=1.0)


def _fsdp2(cfg, stage: int, x: torch.Tensor, y: torch.Tensor):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Transformer(cfg)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=stage == 3)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss.item()

    return step


def _deepspeed(cfg, stage: int, x: torch.Tensor, y: torch.Tensor):
    import deepspeed

    model = Transformer(cfg)
    config = {"train_micro_batch_size_per_gpu": x.shape[0], "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "gradient_clipping": 1.0, "steps_per_print": 10**9}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)

    def step() -> None:
        loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        loss.item()

    return step


SYSTEMS = {"shoal": _shoal, "fsdp2": _fsdp2, "deepspeed": _deepspeed}


def _memory_rank(system: str, stage: int, model_name: str, batch: int, seq_len: int) -> float:
    """Peak RSS during a few steps minus RSS before the model was built (MiB): one system per launch."""
    cfg = get_preset(model_name).replace(max_seq_len=max(seq_len, 32))
    x, y = _batch(cfg, batch, seq_len)
    if system == "deepspeed":
        import deepspeed  # noqa: F401  (import before the baseline: its libraries are not model memory)
    baseline = current_mb()
    torch.manual_seed(0)
    step = SYSTEMS[system](cfg, stage, x, y)
    return measure(step, warmup=1, repeats=2)["peak_mb"]["max"] - baseline


def _timing_rank(systems: list[str], stage: int, model_name: str, batch: int, seq_len: int, repeats: int) -> dict:
    """Step time of every system in one launch, interleaved repeat by repeat (A B C A B C ...)."""
    cfg = get_preset(model_name).replace(max_seq_len=max(seq_len, 32))
    x, y = _batch(cfg, batch, seq_len)
    steps = {}
    for system in systems:
        torch.manual_seed(0)
        steps[system] = SYSTEMS[system](cfg, stage, x, y)
    return {k: v["time_s"] for k, v in measure_pair(steps, warmup=2, repeats=repeats).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--bucket", type=int, default=None, help="shoal's blocks per FSDP unit (plan bucket=)")
    parser.add_argument("--mem-launches", type=int, default=3, help="launches per system for memory (median)")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.bucket:  # the launched ranks inherit the environment
        os.environ["SHOAL_BENCH_BUCKET"] = str(args.bucket)
    peers = ["fsdp2"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") else [])
    rows = []
    for n in args.nprocs:
        for stage in args.stages:
            systems = ["shoal", *(p for p in peers if not (p == "fsdp2" and stage == 1))]
            times = launch(_timing_rank, n, systems, stage, args.model, args.batch, args.seq_len, args.repeats)
            results = {}
            for system in systems:
                slowest = max((t[system] for t in times), key=lambda t: t["median"])
                # Resident memory varies by +-10 MB from launch to launch (allocator state): median of several.
                memory = [max(launch(_memory_rank, n, system, stage, args.model, args.batch, args.seq_len))
                          for _ in range(args.mem_launches)]
                results[system] = {"ms": 1e3 * slowest["median"], "iqr%": 100 * slowest["iqr_rel"],
                                   "mem_mb": statistics.median(memory), "mem_range": max(memory) - min(memory)}
            for peer in peers:
                if peer not in results:
                    continue
                s, p = results["shoal"], results[peer]
                rows.append({"N": n, "stage": stage, "peer": peer, "shoal_ms": s["ms"], "shoal_iqr%": s["iqr%"],
                             "peer_ms": p["ms"], "peer_iqr%": p["iqr%"], "time_ratio": s["ms"] / p["ms"],
                             "shoal_mb": s["mem_mb"], "peer_mb": p["mem_mb"], "mem_ratio": s["mem_mb"] / p["mem_mb"],
                             "shoal_mb_range": s["mem_range"], "peer_mb_range": p["mem_range"]})
    suffix = f"_bucket{args.bucket}" if args.bucket else ""
    report("zero_vs_peers_N" + "_".join(map(str, args.nprocs)) + suffix, rows, notes=(
        f"shoal bucket={args.bucket or 'default'}; model {args.model}, {args.batch} x {args.seq_len} tokens per "
        f"rank, fp32 AdamW; time: {args.repeats} "
        "interleaved repeats after 2 warm-up, slowest rank's median; mem (own launches per system, median of "
        f"{args.mem_launches}, *_range = max - min) = peak RSS during a step minus RSS before the model was built, "
        "max over ranks; 2 shared cores, so N=4 is "
        "oversubscribed; goals: time_ratio <= 1.05, mem_ratio <= 1.0"))


if __name__ == "__main__":
    main()
