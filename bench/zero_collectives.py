"""The collectives behind ZeRO-1/2 on this backend: which way of moving shards is fastest.

shoal's ZeRO-1/2 engine (shoal/parallel/zero.py) reduce-scatters gradients and all-gathers
parameters once per bucket. On gloo it reduce-scatters through all_to_all_single and a local sum,
because gloo's own reduce_scatter is slower for the same bytes; this benchmark is the evidence,
and tells whether that still holds on another machine or torch release (the all-to-all form of
the all-gather is here too: it did not beat gloo's all_gather, so the engine keeps that). Every rank moves a tensor
of --numel float32 elements (default: the `small` preset's Ψ = 6.43M, 25.7 MB); medians over
repeats, each after a barrier; the all_reduce row is the cost of the same bytes under DDP.

    python -m bench.zero_collectives [--nprocs 2 4] [--numel 6430000] [--repeats 12]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from bench.common import launch, report, summarize


def _rank(numel: int, repeats: int) -> dict[str, dict[str, float]]:
    n = dist.get_world_size()
    numel -= numel % n
    full, shard = torch.randn(numel), torch.randn(numel // n)
    out, recv = torch.empty(numel), torch.empty(numel)
    ways = {
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(shard, full),
        "all_to_all_single + sum": lambda: (dist.all_to_all_single(recv, full), recv.view(n, -1).sum(0)),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, shard),
        "all_to_all_single (gather)": lambda: dist.all_to_all_single(out, shard.repeat(n)),
        "all_reduce": lambda: dist.all_reduce(full),
    }
    result = {}
    for name, fn in ways.items():
        samples = []
        for i in range(repeats + 2):
            dist.barrier()
            start = time.perf_counter()
            fn()
            if i >= 2:  # two warm-up calls
                samples.append(time.perf_counter() - start)
        result[name] = summarize(samples)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--numel", type=int, default=6_430_000)
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    rows = []
    for n in args.nprocs:
        per_rank = launch(_rank, n, args.numel, args.repeats)
        for name in per_rank[0]:
            slowest = max((r[name] for r in per_rank), key=lambda s: s["median"])
            rows.append({"N": n, "collective": name, "ms": 1e3 * slowest["median"], "iqr%": 100 * slowest["iqr_rel"]})
    report("zero_collectives", rows, notes=(
        f"{args.numel} float32 per rank ({4 * args.numel / 1e6:.1f} MB), {args.repeats} repeats after 2 warm-up, "
        "slowest rank's median; backend gloo; reduce_scatter / all_gather rows vs their all_to_all_single rows "
        "decide shoal.parallel.zero._ALL_TO_ALL_ON"))


if __name__ == "__main__":
    main()
