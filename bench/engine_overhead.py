"""What a one-process bf16 run pays for its data engine: the host time of one forward and backward of a
deep, tiny model (12 blocks, dim 128, 8 tokens: the arithmetic is negligible, the per-op and per-unit
overhead is what is timed), by how its parameters reach 16-bit.

Why: on the H200 (docs/gpu_check/H200_2026-11-27/) the 85M shape trained faster in fp32 (355K tokens/s)
than in bf16 (290K, compile off), where bf16's matrix products run at twice fp32's (TF32) rate: one-process
bf16 then ran FSDP2 with a shard degree of 1 for its MixedPrecisionPolicy, which puts hooks, a gathered copy
and a reduction around every unit, and this bench measured its host time at 1.46x autocast's on that machine.
shoal now runs one-process mixed precision under torch.autocast (shoal.rules, engine "autocast").
Contenders, interleaved repeat by repeat (bench.common.measure_pair):
- plain fp32: the bare model (shoal's fp32 dp1);
- autocast bf16: the bare model under torch.autocast (what a plain training loop does);
- fsdp2 fp32: FSDP2 of degree 1 per block and root, nothing cast (FSDP2's own overhead);
- fsdp2 bf16: the same with bf16 parameters and fp32 reduction (shoal's one-process bf16 until 2026-11-27);
- shoal dp1 bf16: shoal's runtime for `dp1,precision=bf16,compile=off`, called as the trainer calls it.
Ratios are against plain fp32; beside them the host ops each runs (shoal.calibration.counts.host_ops, the unit of
the planner's host time: outermost aten and c10d calls, views at half), the host's work on any device.
`python -m bench.engine_overhead [--device cuda]`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bench.common import measure_pair, report
from shoal import rules
from shoal.calibration.counts import host_ops
from shoal.infra.launch import free_port

LAYERS, TOKENS = 12, 8


def contenders(device: str) -> dict[str, Callable[[], Any]]:
    """One forward and backward per contender, on `device`, in this process (a process group of one)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from shoal.apply_plan import parallelize
    from shoal.mesh import build_mesh
    from shoal.models import PRESETS, Transformer
    from shoal.parallel.data import blocks_of
    from shoal.plan import Plan

    cfg = PRESETS["tiny"].replace(num_layers=LAYERS, max_seq_len=16)
    tokens = torch.randint(0, cfg.vocab_size, (1, TOKENS), device=device)
    torch.manual_seed(0)
    plain = Transformer(cfg).to(device)
    mesh = init_device_mesh(device, (1,))

    def fsdp2(policy: MixedPrecisionPolicy) -> torch.nn.Module:
        sharded = Transformer(cfg).to(device)
        for block in blocks_of(sharded):
            fully_shard(block, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        return fully_shard(sharded, mesh=mesh, reshard_after_forward=False, mp_policy=policy)

    plan = rules.resolve(Plan.parse("dp1,precision=bf16,compile=off"), world_size=1, device=device)
    shoal_bf16 = parallelize(Transformer(cfg).to(device), plan, build_mesh(plan, device))

    def step(model: Callable[[torch.Tensor], torch.Tensor], autocast: bool = False) -> Callable[[], Any]:
        def run() -> None:
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                out = model(tokens)
            out.float().sum().backward()
            if device == "cuda":
                torch.cuda.synchronize()
        return run

    return {"plain fp32": step(plain), "autocast bf16": step(plain, autocast=True),
            "fsdp2 fp32": step(fsdp2(MixedPrecisionPolicy())),
            "fsdp2 bf16": step(fsdp2(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))),
            "shoal dp1 bf16": step(shoal_bf16)}


def run(device: str, repeats: int) -> list[dict[str, Any]]:
    if not dist.is_initialized():
        port = free_port()
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=1)
    fns = contenders(device)
    results = measure_pair(fns, warmup=5, repeats=repeats)
    base = results["plain fp32"]["time_s"]["median"]
    return [{"contender": name, "ms": r["time_s"]["median"] * 1e3, "iqr_rel": r["time_s"]["iqr_rel"],
             "vs plain fp32": r["time_s"]["median"] / base, "host ops": host_ops(fns[name])}
            for name, r in results.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = run(args.device, args.repeats)
    report(f"engine_overhead_{args.device}", rows, notes=f"{LAYERS} blocks of dim 128, {TOKENS} tokens: host time "
           "of one forward and backward; medians over interleaved repeats, iqr_rel the spread")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
