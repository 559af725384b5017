"""shoal's data parallelism vs torch DDP written by hand the usual way, same model, world size 2.

Both run in the same ranks, alternating step by step, from the same initial weights and batch.
Goal: shoal / DDP median step time <= 1.05.

    python -m bench.dp_vs_ddp [--nproc 2] [--repeats 30] [--model tiny] [--global-batch 16] [--seq-len 128]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from bench.common import launch, measure_pair, report
from shoal import rules
from shoal.apply_plan import parallelize
from shoal.mesh import build_mesh, data_rank
from shoal.models import Transformer, get_preset
from shoal.plan import Plan
from shoal.train.step import split_micro, train_step


def _rank(model_name: str, global_batch: int, seq_len: int, repeats: int) -> dict:
    cfg = get_preset(model_name).replace(max_seq_len=max(seq_len, 32))
    plan = rules.resolve(Plan.parse(f"dp{dist.get_world_size()}"), world_size=dist.get_world_size())
    mesh = build_mesh(plan)
    index, count = data_rank(mesh)
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, cfg.vocab_size, (global_batch, seq_len + 1), generator=gen)
    local = seq[index * global_batch // count:(index + 1) * global_batch // count]
    x, y = local[:, :-1], local[:, 1:]

    torch.manual_seed(0)
    shoal_model = parallelize(Transformer(cfg), plan, mesh)
    shoal_opt = torch.optim.AdamW(shoal_model.parameters(), lr=1e-4)

    torch.manual_seed(0)
    ddp = DistributedDataParallel(Transformer(cfg))
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    def shoal_step() -> None:
        train_step(shoal_model, shoal_opt, split_micro(x, y, 1), grad_clip=1.0)

    def ddp_step() -> None:
        ddp_opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        ddp_opt.step()
        loss.item()

    return measure_pair({"shoal": shoal_step, "ddp": ddp_step}, warmup=3, repeats=repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    per_rank = launch(_rank, args.nproc, args.model, args.global_batch, args.seq_len, args.repeats)
    rows = []
    for rank, res in enumerate(per_rank):
        s, d = res["shoal"]["time_s"], res["ddp"]["time_s"]
        rows.append({"rank": rank, "shoal_ms": 1e3 * s["median"], "shoal_iqr%": 100 * s["iqr_rel"],
                     "ddp_ms": 1e3 * d["median"], "ddp_iqr%": 100 * d["iqr_rel"],
                     "ratio": s["median"] / d["median"],
                     "shoal_peak_mb": res["shoal"]["peak_mb"]["median"],
                     "ddp_peak_mb": res["ddp"]["peak_mb"]["median"]})
    report("dp_vs_ddp", rows, notes=f"world {args.nproc}, model {args.model}, global batch {args.global_batch}, "
           f"seq {args.seq_len}, {args.repeats} interleaved repeats; goal ratio <= 1.05")


if __name__ == "__main__":
    main()
