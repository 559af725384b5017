"""Context parallelism: memory per rank against sequence length, the zig-zag split's load balance,
and ring against head-scatter attention.

1. Memory. For one sequence of T tokens (a 2-layer, dim-128, 8-head model, fp32), each rank's
   bytes that the training forward keeps for backward (exact tensor bytes,
   `kept_activation_bytes`) plus the largest transient of the attention (measured as the
   resident-set peak of forward+backward above the level before it, VmHWM): single process,
   cpP (ring, a2a) and tpP (sequence-parallel norms), P = 2 and 4. Then the longest T (doubling)
   whose kept bytes fit a budget per rank, and the ratio cp / tp of those lengths (the paper's
   claim: 3.0x at 64 GPUs).
2. Load balance. Each rank's share of the ring's attention arithmetic (every query-key chunk pair
   the causal mask does not hide), timed rank by rank in this process without communication:
   slowest / mean, for the zig-zag split and the plain one.
3. Modes. Step time of cp2 ring vs cp2 a2a at one length: median and range over repeats.

    python -m bench.context_parallel [--lengths 1024,2048,4096,8192] [--budget-mib 48]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from bench.common import launch, report, summarize
from shoal import rules
from shoal.apply_plan import parallelize
from shoal.mesh import build_mesh
from shoal.models import ModelConfig, Transformer
from shoal.parallel.context import attend_blocks, chunks_of
from shoal.parallel.recompute import kept_activation_bytes
from shoal.plan import Plan
from shoal.train import memory

MODEL = ModelConfig(num_layers=2, dim=128, num_heads=8, num_kv_heads=8, ffn_dim=256, vocab_size=256,
                    max_seq_len=16384)


def _one_step(plan_text: str | None, seq_len: int) -> dict[str, float]:
    """This rank: kept bytes of one forward, transient peak of forward+backward, step seconds."""
    torch.manual_seed(0)
    model = Transformer(MODEL.replace(max_seq_len=seq_len))
    if plan_text is None:
        runtime = parallelize(model)
    else:
        plan = rules.resolve(Plan.parse(plan_text), world_size=dist.get_world_size())
        runtime = parallelize(model, plan, build_mesh(plan, "cpu"))
    tokens = torch.randint(0, MODEL.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(1))
    (x, y), = runtime.local_batches([(tokens[:, :-1], tokens[:, 1:])])
    module = runtime.parts[0]
    kept, out = kept_activation_bytes(lambda: module(x))
    del out
    memory.reset_peak()
    base = memory.current_mb()
    start = time.perf_counter()
    runtime.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
    seconds = time.perf_counter() - start
    return {"kept_mib": kept / 2**20, "transient_mib": memory.peak_mb() - base, "seconds": seconds}


def _sweep(plan_text: str, lengths: list[int]) -> list[dict[str, float]]:
    rows = [_one_step(plan_text, t) for t in lengths]
    worst = torch.tensor([[r["kept_mib"], r["transient_mib"], r["seconds"]] for r in rows])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the highest rank counts
    return [{"kept_mib": float(k), "transient_mib": float(m), "seconds": float(s)} for k, m, s in worst]


def memory_table(lengths: list[int], budget: float) -> list[dict]:
    rows = []
    configs: list[tuple[str, int, str | None]] = [("single process", 1, None)]
    for p in (2, 4):
        configs += [(f"cp{p} ring", p, f"cp{p}"), (f"cp{p} a2a", p, f"cp{p},cp_mode=a2a"), (f"tp{p}", p, f"tp{p}")]
    for name, nproc, plan_text in configs:
        print(f"memory: {name} ...", flush=True)
        if plan_text is None:
            measured = [_one_step(None, t) for t in lengths]
        else:
            measured = launch(_sweep, nproc, plan_text, lengths)[0]
        fits = [t for t, m in zip(lengths, measured) if m["kept_mib"] <= budget]
        rows.append({"config": name, **{f"kept MiB @{t}": round(m["kept_mib"], 1) for t, m in zip(lengths, measured)},
                     **{f"transient MiB @{t}": round(m["transient_mib"], 1) for t, m in zip(lengths, measured)},
                     f"longest T within {budget:g} MiB": max(fits) if fits else 0})
    return rows


def balance(seq_len: int, cp: int, balanced: bool, repeats: int = 5) -> dict[str, float]:
    """Per-rank ring attention arithmetic, timed rank by rank: slowest / mean."""
    torch.manual_seed(0)
    local = seq_len // cp
    n = len(chunks_of(0, cp, balanced=balanced))
    q, k, v = (torch.randn(1, MODEL.num_heads, local, MODEL.head_dim) for _ in range(3))
    times = []
    for rank in range(cp):
        mine = chunks_of(rank, cp, balanced=balanced)
        samples = []
        for _ in range(repeats):
            qs, ks, vs = (list(t.chunk(n, dim=2)) for t in (q, k, v))  # the rank's chunks, as the ring holds them
            out = [torch.zeros_like(c) for c in qs]
            lse = [torch.full(c.shape[:-1], -torch.inf) for c in qs]
            start = time.perf_counter()
            for step in range(cp):
                theirs = chunks_of((rank - step) % cp, cp, balanced=balanced)
                attend_blocks(qs, ks, vs, mine, theirs, out, lse, causal=True, scale=MODEL.head_dim ** -0.5)
            samples.append(time.perf_counter() - start)
        times.append(summarize(samples)["median"])
    mean = sum(times) / len(times)
    return {"slowest / mean": max(times) / mean, "per-rank ms": [round(1e3 * t, 1) for t in times]}


def _mode_times(seq_len: int, repeats: int) -> dict[str, dict[str, float]]:
    out = {}
    for mode in ("ring", "a2a"):
        samples = []
        for _ in range(repeats + 1):
            dist.barrier()
            samples.append(_one_step(f"cp{dist.get_world_size()},cp_mode={mode}", seq_len)["seconds"])
        out[mode] = summarize(samples[1:])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--budget-mib", type=float, default=48.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    lengths = [int(t) for t in args.lengths.split(",")]

    rows = memory_table(lengths, args.budget_mib)
    longest = {r["config"]: r[f"longest T within {args.budget_mib:g} MiB"] for r in rows}
    for p in (2, 4):
        if longest.get(f"tp{p}"):
            ratio = longest[f'cp{p} ring'] / longest[f'tp{p}']
            print(f"longest sequence within budget, cp{p} ring / tp{p}: {ratio:.2f}")
    for cp in (2, 4):
        for balanced in (True, False):
            b = balance(lengths[-1], cp, balanced, repeats=args.repeats)
            rows.append({"config": f"load balance cp{cp} {'zig-zag' if balanced else 'plain'} at T={lengths[-1]}", **b})
    modes = launch(_mode_times, 2, lengths[-2], args.repeats)[0]
    rows.append({"config": f"cp2 step time at T={lengths[-2]}: ring / a2a (median)",
                 "ratio": modes["ring"]["median"] / modes["a2a"]["median"],
                 **{f"{m} s [min-max]": f"{modes[m]['median']:.3f} [{modes[m]['min']:.3f}-{modes[m]['max']:.3f}]"
                    for m in ("ring", "a2a")}})
    report("context_parallel", rows, notes="kept bytes are exact; transient is the resident-set peak above the "
           "level before the step (machine-dependent); the highest rank counts")


if __name__ == "__main__":
    main()
