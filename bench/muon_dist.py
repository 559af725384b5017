"""Muon's optimizer step under sharding: the owner design (each matrix orthogonalised on one rank) against the
naive one (every rank gathers every matrix and orthogonalises all of them), and against AdamW.

Each rank builds the model under the plan (default: the `small` preset under fsdp2 and tp2 on 2 gloo processes
and fsdp2,tp2 on 4, one thread each), runs one forward and backward, then times optimizer.step() alone for
three optimizers over the same shards, interleaved repeat by repeat (A B C A B C ...): Muon with gather=owner,
Muon with gather=naive, and torch's fused AdamW (the trainer's). It prints the slowest rank's median and spread
of each, the ratios owner / naive and Muon / AdamW, and the owner design's bytes and collectives per step
against its minimum (2 (n - the owner's slice) bfloat16 elements per matrix of n, summed over the ranks). Then
it times whole training steps with Muon (owner) and AdamW in turn, and the optimizer.step() call within each:
the optimizer's share of the step. It writes docs/muon_dist.md.

    python -m bench.muon_dist [--model small] [--plans fsdp2 tp2 fsdp2,tp2] [--nproc N] [--repeats 10]

Each plan runs on the processes its degrees multiply to (at least 2; fsdp2,tp2: 4), or on --nproc.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.common import environment, launch, report, summarize

DOC = Path(__file__).resolve().parent.parent / "docs" / "muon_dist.md"


def _rank(model_name: str, plan_text: str, repeats: int, batch: int, seq_len: int) -> dict[str, Any]:
    from shoal import rules
    from shoal.apply_plan import parallelize
    from shoal.mesh import build_mesh
    from shoal.models import build_model
    from shoal.models.config import PRESETS
    from shoal.optim.builder import build_optimizer
    from shoal.optim.config import OptimConfig
    from shoal.plan import Plan
    from shoal.train.step import split_micro

    plan = rules.resolve(Plan.parse(plan_text), world_size=dist.get_world_size())
    torch.manual_seed(0)
    cfg = PRESETS[model_name]
    runtime = parallelize(build_model(cfg), plan, build_mesh(plan))
    index, count = runtime.data_rank
    tokens = torch.randint(0, cfg.vocab_size, (batch // count, seq_len + 1), generator=torch.Generator().manual_seed(1))
    runtime.forward_backward(split_micro(tokens[:, :-1], tokens[:, 1:], 1))
    optimizers = {
        "muon owner": build_optimizer(runtime, OptimConfig(optimizer="muon", muon_gather="owner")),
        "muon naive": build_optimizer(runtime, OptimConfig(optimizer="muon", muon_gather="naive")),
        "adamw": build_optimizer(runtime, OptimConfig(optimizer="adamw")),
    }
    samples: dict[str, list[float]] = {k: [] for k in optimizers}
    for i in range(repeats + 2):  # two warm-up rounds
        for name, opt in optimizers.items():
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            if i >= 2:
                samples[name].append(time.perf_counter() - start)
    whole, spent = _step_shares(runtime, {k: optimizers[k] for k in ("muon owner", "adamw")},
                                split_micro(tokens[:, :-1], tokens[:, 1:], 1), repeats)
    counts = {}
    for name in ("muon owner", "muon naive"):
        orth = optimizers[name].orthogonalize  # type: ignore[attr-defined]
        counts[name] = {"bytes": orth.bytes_sent, "min": orth.min_bytes, "collectives": orth.collectives}
    matrices = sum(1 for g in optimizers["muon owner"].param_groups if g["muon"] for _ in g["params"])
    return {"samples": samples, "counts": counts, "matrices": matrices, "whole": whole, "spent": spent}


def _step_shares(runtime: Any, optimizers: dict[str, torch.optim.Optimizer], batch: Any,
                 repeats: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Whole training steps (shoal.train.step.train_step: forward, backward, gradient norm, clipping, the gated
    optimizer step) with each optimizer in turn, round by round after a barrier: each step's seconds and those
    of its optimizer.step() call within it."""
    from shoal.train.step import train_step

    whole: dict[str, list[float]] = {k: [] for k in optimizers}
    spent: dict[str, list[float]] = {k: [] for k in optimizers}
    inside: list[float] = []
    for opt in optimizers.values():
        step = opt.step

        def timed(*args: Any, _step: Any = step, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _step(*args, **kwargs)
            finally:
                inside.append(time.perf_counter() - start)

        opt.step = timed  # type: ignore[method-assign]
    for i in range(repeats + 2):  # two warm-up rounds
        for name, opt in optimizers.items():
            dist.barrier()
            inside.clear()
            start = time.perf_counter()
            train_step(runtime, opt, batch, grad_clip=1.0)
            if i >= 2:
                whole[name].append(time.perf_counter() - start)
                spent[name].append(sum(inside))
    return whole, spent


def _doc(rows: list[dict[str, Any]], args: argparse.Namespace, env: dict[str, Any]) -> str:
    lines = [
        "# Muon's optimizer step under sharding",
        "",
        f"Regenerated by `python -m bench.muon_dist --model {args.model} --plans {' '.join(args.plans)}"
        f"{'' if args.nproc is None else f' --nproc {args.nproc}'} --repeats {args.repeats}` (torch "
        f"{env['torch']}, {env['cores']} cores, gloo, one thread per rank, each plan on the processes its degrees "
        f"multiply to unless --nproc says; load average {args.load[0]:.1f} before the run, {args.load[1]:.1f} "
        "after: on a busy machine the two "
        "ranks' shares of Newton-Schulz do not run side by side, and the owner design's gain shrinks). What it "
        "measures: bench/muon_dist.py's docstring; the design: shoal/optim/orthogonalize.py.",
        "",
        "Step times: per round (each optimizer once, in turn, after a barrier), the slowest rank's.",
        "",
        "| plan | optimizer | step ms (median) | spread (IQR / median) | min..max ms |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['plan']} | {r['optimizer']} | {r['ms']:.1f} | {r['iqr%']:.0f}% | "
                     f"{r['min_ms']:.1f}..{r['max_ms']:.1f} |")
    lines += ["", "Ratios: the median over rounds of the two optimizers' times in the same round (its spread: "
              "IQR / median).", "",
              "| plan | owner / naive | Muon (owner) / AdamW | Muon (naive) / AdamW | bytes sent / minimum (owner, "
              "naive) | collectives per step (owner, naive) | matrices |", "|---|---|---|---|---|---|---|"]
    for plan in args.plans:
        by = {r["optimizer"]: r for r in rows if r["plan"] == plan}
        o, n = by["muon owner"], by["muon naive"]

        def ratio(r: dict[str, Any], peer: str) -> str:
            return f"{r[f'/{peer} median']:.2f} ({r[f'/{peer} iqr%']:.0f}%)"

        lines.append(f"| {plan} | {ratio(o, 'muon naive')} | {ratio(o, 'adamw')} | {ratio(n, 'adamw')} | "
                     f"{o['bytes_ratio']:.3f}, {n['bytes_ratio']:.3f} | {o['collectives']:g}, {n['collectives']:g} | "
                     f"{o['matrices']} |")
    lines += ["", "A ratio whose distance from 1 is below the spreads is noise. Bytes are bfloat16 elements "
              "times 2, summed over the ranks; the minimum is the owner design's: each matrix's other slices "
              "to its owner and the results back.", ""]
    return "\n".join(lines)


def _share_rows(plan: str, per_rank: list[dict[str, Any]], repeats: int) -> list[dict[str, Any]]:
    """Per optimizer: the whole step's and its optimizer.step()'s medians and spreads, the share of the one in the
    other, and the whole step against AdamW's in the same round; each round's figures its slowest rank's."""
    rows = []
    picked: dict[str, list[tuple[float, float]]] = {}
    for name in per_rank[0]["whole"]:
        slowest = [max(range(len(per_rank)), key=lambda k: per_rank[k]["whole"][name][i]) for i in range(repeats)]
        picked[name] = [(per_rank[k]["whole"][name][i], per_rank[k]["spent"][name][i]) for i, k in enumerate(slowest)]
    for name, pairs in picked.items():
        step, opt = summarize([w for w, _ in pairs]), summarize([o for _, o in pairs])
        share = summarize([o / w for w, o in pairs])
        versus = summarize([w / peer for (w, _), (peer, _) in zip(pairs, picked["adamw"])])
        rows.append({"plan": plan, "optimizer": name, "step_ms": 1e3 * step["median"],
                     "step_iqr%": 100 * step["iqr_rel"], "opt_ms": 1e3 * opt["median"],
                     "opt_iqr%": 100 * opt["iqr_rel"], "share": share["median"], "share_iqr%": 100 * share["iqr_rel"],
                     "share_min": share["min"], "share_max": share["max"], "/adamw step": versus["median"],
                     "/adamw step iqr%": 100 * versus["iqr_rel"]})
    return rows


def _share_doc(shares: list[dict[str, Any]]) -> str:
    lines = ["## The optimizer's share of a training step", "",
             "Whole training steps (shoal.train.step.train_step: forward, backward, gradient norm, clipping and the "
             "optimizer step) with Muon (owner design) and AdamW in turn, round by round; a round's figures are "
             "its slowest rank's: the step, its optimizer.step() call, and the share of the one in the other "
             "(median over rounds, IQR / median, min..max).", "",
             "| plan | optimizer | step ms (spread) | optimizer.step ms (spread) | optimizer share of the step "
             "(spread, min..max) | step / AdamW's step (spread) |", "|---|---|---|---|---|---|"]
    for r in shares:
        lines.append(f"| {r['plan']} | {r['optimizer']} | {r['step_ms']:.1f} ({r['step_iqr%']:.0f}%) | "
                     f"{r['opt_ms']:.1f} ({r['opt_iqr%']:.0f}%) | {r['share']:.1%} ({r['share_iqr%']:.0f}%, "
                     f"{r['share_min']:.1%}..{r['share_max']:.1%}) | {r['/adamw step']:.2f} "
                     f"({r['/adamw step iqr%']:.0f}%) |")
    return "\n".join(lines + [""])


def _priced(model_name: str, plan_text: str, world: int, batch: int, seq_len: int) -> dict[str, Any]:
    """The planner's optimizer seconds for Muon (the AdamW-like elementwise update, Newton-Schulz and the owners'
    exchange) and for AdamW on this plan, on this machine's calibrated profile (`shoal plan --calibrate`) where it
    has one, else on the planner's placeholder CPU."""
    import dataclasses

    from shoal import rules
    from shoal.models.config import PRESETS
    from shoal.plan import Plan
    from shoal.planner.cluster_file import parse_cluster
    from shoal.planner.comm import CalibratedNetwork
    from shoal.planner.estimate import Workload, estimate
    from shoal.planner.profile import load_profile, local_cluster

    cfg = PRESETS[model_name]
    profile = load_profile()
    cluster = local_cluster(profile, world) if profile else parse_cluster(f"{world}xcpu")
    network = CalibratedNetwork(profile, world) if profile else None
    work = Workload(model=cfg, global_batch=batch, seq_len=seq_len)
    plan = rules.resolve(Plan.parse(plan_text), world_size=world, model=cfg, global_batch=batch, seq_len=seq_len)
    out: dict[str, Any] = {"cluster": "calibrated" if profile else "placeholder"}
    for name in ("muon", "adamw"):
        time = estimate(plan, dataclasses.replace(work, optimizer=name), cluster, network=network).time
        out[name] = time["optimizer"] + time.get("muon_newton_schulz", 0.0) + time.get("muon_exchange", 0.0)
    return out


def _priced_doc(rows: list[dict[str, Any]], priced: dict[str, dict[str, Any]]) -> str:
    lines = ["## The planner's price beside the measurement", "",
             "`shoal plan --optimizer muon` prices Newton-Schulz on the matrices each rank owns and the owners' "
             "exchange (shoal.planner.costs.Costs.muon_step) on top of the elementwise update it prices for AdamW. "
             "Its optimizer seconds for this plan and batch against the measured optimizer.step (the first table's "
             "medians):", "",
             "| plan | profile | Muon priced ms | Muon measured ms | AdamW priced ms | AdamW measured ms | "
             "Muon / AdamW priced | measured |", "|---|---|---|---|---|---|---|---|"]
    for plan, p in priced.items():
        by = {r["optimizer"]: r["ms"] for r in rows if r["plan"] == plan}
        lines.append(f"| {plan} | {p['cluster']} | {1e3 * p['muon']:.1f} | {by['muon owner']:.1f} | "
                     f"{1e3 * p['adamw']:.2f} | {by['adamw']:.1f} | {p['muon'] / p['adamw']:.1f} | "
                     f"{by['muon owner'] / by['adamw']:.1f} |")
    lines += ["", "The price counts Newton-Schulz's products at the profile's matmul rate for their shapes, the "
              "exchange at its all-to-all rate and the rest as AdamW's elementwise update. It leaves out what a "
              "profile of the measured step (torch.profiler) shows beside those: the per-op dispatch of the "
              "products (three calls per matrix and iteration), Muon's two fp32 momentum lerps and its "
              "bfloat16 casts, which weigh more than AdamW's one fused kernel, and the wait of the rank whose owned "
              "matrices finish first."]
    return "\n".join(lines + [""])


def _world(plan_text: str) -> int:
    """The processes a plan's degrees multiply to, at least 2 (dp takes up the rest)."""
    from shoal.plan import Plan

    plan = Plan.parse(plan_text)
    return max(2, (plan.dp or 1) * plan.fsdp * plan.tp * plan.pp * plan.cp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--plans", nargs="+", default=["fsdp2", "tp2", "fsdp2,tp2"])
    parser.add_argument("--nproc", type=int, default=None, help="processes for every plan [its degrees' product]")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--no-doc", action="store_true", help="print only; leave docs/muon_dist.md as it is")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    shares: list[dict[str, Any]] = []
    before = os.getloadavg()[0]
    priced: dict[str, dict[str, Any]] = {}
    for plan in args.plans:
        world = args.nproc or _world(plan)
        priced[plan] = _priced(args.model, plan, world, args.batch, args.seq_len)
        per_rank = launch(_rank, world, args.model, plan, args.repeats, args.batch, args.seq_len)
        least = sum(r["counts"]["muon owner"]["min"] for r in per_rank)  # the owner design's minimum
        # a round's time is its slowest rank's (the step ends when every rank has its weights)
        rounds = {name: [max(r["samples"][name][i] for r in per_rank) for i in range(args.repeats)]
                  for name in per_rank[0]["samples"]}
        for name, times in rounds.items():
            slowest = summarize(times)
            paired = {f"/{peer}": summarize([a / b for a, b in zip(times, rounds[peer])])
                      for peer in ("muon naive", "adamw") if peer != name}
            row = {"plan": plan, "optimizer": name, "ms": 1e3 * slowest["median"], "iqr%": 100 * slowest["iqr_rel"],
                   "min_ms": 1e3 * slowest["min"], "max_ms": 1e3 * slowest["max"], "matrices": per_rank[0]["matrices"],
                   **{f"{k} median": v["median"] for k, v in paired.items()},
                   **{f"{k} iqr%": 100 * v["iqr_rel"] for k, v in paired.items()}}
            if name in per_rank[0]["counts"]:
                sent = sum(r["counts"][name]["bytes"] for r in per_rank)
                row.update(bytes_ratio=sent / least if least else float("nan"),
                           collectives=statistics.median(r["counts"][name]["collectives"] for r in per_rank),
                           mb_sent=sent / 1e6)
            rows.append(row)
        shares += _share_rows(plan, per_rank, args.repeats)
    report("muon_dist", rows, notes="a round's time is its slowest rank's; /peer: the median over rounds of this "
           "optimizer's time over the peer's in the same round; bytes_ratio: the owner design's minimum = 1")
    report("muon_dist_share", shares, notes="whole training steps (train_step) with each optimizer in turn; a "
           "round's figures are its slowest rank's; share: optimizer.step over the whole step, per round")
    args.load = (before, os.getloadavg()[0])
    if not args.no_doc:
        DOC.write_text(_doc(rows, args, environment()) + _share_doc(shares) + "\n" + _priced_doc(rows, priced))
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
