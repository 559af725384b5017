"""Pipeline parallelism: measured bubbles against the schedules' formulas, activation memory per
stage (GPipe against 1F1B), and shoal's executor against torch.distributed.pipelining used directly.

1. Bubble. A real training step of an 8-layer model (dim 128) under ppP with each schedule, every
   action timed (`Runtime.record_timeline`); the bubble is 1 - busy / (P x makespan) over the step
   (shoal.parallel.schedules.bubble_fraction), the median over repeats, divided by the formula:
   (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for interleaved, and ZB-H1 beside 1F1B.
   With fewer cores than ranks the ranks share them: busy times stretch and the ratio says less.
2. Memory. The bytes of the tensors each stage's forwards create that are still alive after each
   forward (what autograd keeps for backward, exact), its peak over a step: GPipe keeps m
   micro-batches, 1F1B at most p - stage.
3. Peer. Step time (forward, backward, optimizer step) of shoal's pp2 1F1B against the same split
   run by torch.distributed.pipelining's PipelineStage + Schedule1F1B, interleaved repeat by
   repeat; goal shoal / torch <= 1.05.

    python -m bench.pipeline [--quick]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.common import launch, measure_pair, report, summarize
from shoal import rules
from shoal.apply_plan import parallelize
from shoal.mesh import build_mesh
from shoal.models import ModelConfig, Transformer
from shoal.parallel.pipeline import build_stages
from shoal.parallel.recompute import CreatedStorages
from shoal.parallel.schedules import bubble_fraction
from shoal.plan import Plan

MODEL = ModelConfig(num_layers=8, dim=128, num_heads=8, num_kv_heads=8, ffn_dim=512, vocab_size=256, max_seq_len=128)
SEQ, ROWS = 128, 2  # tokens per sequence, sequences per micro-batch


def _batch(num_micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, MODEL.vocab_size, (num_micro * ROWS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _runtime(plan_text: str):
    torch.manual_seed(0)
    plan = rules.resolve(Plan.parse(plan_text), world_size=dist.get_world_size(), device="cpu")
    return parallelize(Transformer(MODEL), plan, build_mesh(plan, "cpu")), plan


def _micro(plan) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _batch(plan.micro_batches)
    return list(zip(x.chunk(plan.micro_batches), y.chunk(plan.micro_batches)))


# ----------------------------------------------------------------------------- 1. bubbles


def _bubbles(plan_text: str, repeats: int) -> list[float]:
    runtime, plan = _runtime(plan_text)
    micro = _micro(plan)
    runtime.forward_backward(micro)  # warm-up (first-step shape exchange)
    runtime.record_timeline(True)
    out = []
    for _ in range(repeats):
        dist.barrier()
        runtime.forward_backward(micro)
        out.append(bubble_fraction(runtime.pipeline_timeline()))
    return out


def bubble_table(ranks: list[int], micros: list[int], repeats: int) -> list[dict]:
    rows = []
    for p in ranks:
        for m in micros:
            for sched, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)):
                if sched == "interleaved" and m % p:
                    continue
                plan = f"pp{p},mb={m},sched={sched}" + (",vpp=2" if v > 1 else "")
                measured = summarize(launch(_bubbles, p, plan, repeats)[0])
                formula = (p - 1) / (v * m + p - 1)
                rows.append({"p": p, "m": m, "sched": sched, "bubble": measured["median"],
                             "spread": measured["max"] - measured["min"], "formula": formula,
                             "ratio": measured["median"] / formula})
    return rows


# ----------------------------------------------------------------------------- 2. memory


def _activation_peak(plan_text: str) -> float:
    runtime, plan = _runtime(plan_text)
    micro = _micro(plan)
    runtime.forward_backward(micro)
    kept, peak = CreatedStorages(), [0]
    def enter(*_) -> None:
        kept.__enter__()

    def leave(*_) -> None:
        kept.__exit__(None, None, None)
        peak[0] = max(peak[0], kept.live_bytes())

    for stage in runtime.parts:
        stage.register_forward_pre_hook(enter)
        stage.register_forward_hook(leave)
    runtime.forward_backward(micro)
    return peak[0] / 2**20


def memory_table(p: int, m: int) -> list[dict]:
    rows = []
    for sched in ("gpipe", "1f1b", "zb"):
        peaks = launch(_activation_peak, p, f"pp{p},mb={m},sched={sched}")
        rows.append({"sched": sched, "p": p, "m": m, **{f"stage{r}_mib": peak for r, peak in enumerate(peaks)}})
    return rows


# ----------------------------------------------------------------------------- 3. the peer


def _peer_pair(num_micro: int, repeats: int) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    runtime, plan = _runtime(f"pp2,mb={num_micro}")
    shoal_opt = torch.optim.AdamW(runtime.parameters(), lr=1e-4)
    micro = _micro(plan)
    x, y = _batch(num_micro)

    rank = dist.get_rank()
    torch.manual_seed(0)
    stages, _ = build_stages(Transformer(MODEL), rank=rank, num_ranks=2, vpp=1)
    module = stages[rank]
    stage = PipelineStage(module, stage_index=rank, num_stages=2, device=torch.device("cpu"),
                          group=dist.group.WORLD)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    schedule = Schedule1F1B(stage, n_microbatches=num_micro, loss_fn=loss_fn)
    torch_opt = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def shoal_step() -> None:
        shoal_opt.zero_grad(set_to_none=True)
        runtime.forward_backward(micro)
        shoal_opt.step()

    def torch_step() -> None:
        torch_opt.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        torch_opt.step()

    return measure_pair({"shoal": shoal_step, "torch": torch_step}, warmup=3, repeats=repeats)


def peer_table(micros: list[int], repeats: int) -> list[dict]:
    rows = []
    for m in micros:
        result = launch(_peer_pair, 2, m, repeats)[0]
        s, t = result["shoal"]["time_s"], result["torch"]["time_s"]
        rows.append({"m": m, "shoal_ms": 1e3 * s["median"], "shoal_iqr": s["iqr_rel"], "torch_ms": 1e3 * t["median"],
                     "torch_iqr": t["iqr_rel"], "ratio": s["median"] / t["median"], "goal": "<= 1.05"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one size each, few repeats (a smoke run)")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    ranks, micros = ([2], [4]) if args.quick else ([2, 4], [4, 8, 16])
    bubbles = bubble_table(ranks, micros, repeats)
    report("pipeline_bubble", bubbles, notes="bubble: measured idle fraction of one step (median over repeats); "
           "formula (p-1)/(v*m+p-1); ratio measured/formula. zb: compare its bubble with 1f1b's at the same p, m.")
    zb = {(r["p"], r["m"]): r["bubble"] for r in bubbles if r["sched"] == "zb"}
    one = {(r["p"], r["m"]): r["bubble"] for r in bubbles if r["sched"] == "1f1b"}
    print("zb / 1f1b bubble:", {f"p{p},m{m}": round(zb[p, m] / one[p, m], 3) for p, m in zb if one[p, m]})
    report("pipeline_memory", memory_table(2 if args.quick else 4, 8),
           notes="peak bytes the stage's forwards keep alive (activations for backward), MiB, exact")
    peers = peer_table([4] if args.quick else [4, 8], repeats if args.quick else 15)
    report("pipeline_vs_torch", peers, notes="step time (fwd+bwd+AdamW) median over repeats, interleaved ABAB; "
           f"median ratio {statistics.median(r['ratio'] for r in peers):.3f}")


if __name__ == "__main__":
    main()
