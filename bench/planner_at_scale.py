"""The planner against published large runs: predicted vs published tokens/s per device.

For every run in shoal.planner.published (model shape, cluster, plan, batch as the source gives
them), the cost model predicts the step; the table gives predicted / published per device and
the error. Nothing in the model is fitted to these runs: its constants come from data sheets and
kernel papers (shoal.planner.hardware). Writes docs/planner_at_scale.md with --write.

    python -m bench.planner_at_scale [--write] [--before OLD.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import textwrap
from dataclasses import dataclass
from pathlib import Path

from shoal import rules
from shoal.plan import Plan
from shoal.planner.estimate import Estimate, Workload, estimate
from shoal.planner.hardware import parse_cluster
from shoal.planner.published import PUBLISHED, PublishedRun

DOC = Path(__file__).resolve().parent.parent / "docs" / "planner_at_scale.md"


def predict(run: PublishedRun, *, allreduce_curves: bool = True) -> Estimate:
    """The cost model's estimate of one published run's step (`allreduce_curves=False`: with the alpha-beta ring
    for all-reduces inside a node instead of the measured curves, to show what those move)."""
    cluster = parse_cluster(run.cluster)
    if not allreduce_curves:
        cluster = dataclasses.replace(cluster, intra=dataclasses.replace(cluster.intra, allreduce_busbw=()))
    work = Workload(model=run.model, global_batch=run.global_batch, seq_len=run.seq_len,
                    fused_attention=run.fused_attention, selective_policy=run.selective_policy,
                    data_engine=run.data_engine)
    # Priced as it ran, also where shoal's runtime would refuse the layout (tests/test_planner.py names it).
    plan = rules.fill(Plan.parse(run.plan), rules.Facts(world_size=cluster.world_size, device="cuda",
                                                        model=run.model, global_batch=run.global_batch,
                                                        seq_len=run.seq_len))
    micro = run.micro_batch_size if plan.pp == 1 else None
    return estimate(plan, work, cluster, micro_batch=micro)


@dataclass(frozen=True)
class Row:
    run: PublishedRun
    predicted: float
    """Predicted tokens/s per device."""
    estimate: Estimate

    @property
    def error(self) -> float:
        return self.predicted / self.run.tokens_per_s_per_device - 1


def rows(runs: tuple[PublishedRun, ...], *, allreduce_curves: bool = True) -> list[Row]:
    out = []
    for run in runs:
        e = predict(run, allreduce_curves=allreduce_curves)
        out.append(Row(run, e.tokens_per_s / parse_cluster(run.cluster).world_size, e))
    return out


def read_ratios(path: Path) -> dict[str, float]:
    """Run name -> predicted / published from an earlier planner_at_scale.md (its last ratio column before
    the memory column), so a change to the cost model can show the error before and after, per run."""
    ratios = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and cells[0] not in ("run", "---"):
            ratios[cells[0].removesuffix(" (*)")] = float(cells[-2])
    return ratios


def table(rows: list[Row], before: dict[str, float] | None = None) -> list[str]:
    was = "predicted / published before | " if before else ""
    lines = [f"| run | devices | plan | published tok/s/dev | predicted | {was}predicted / published "
             "| memory GB (fits) |",
             "|---|---|---|---|---|---|---|" + ("---|" if before else "")]
    for r in rows:
        mark = "" if r.run.checked else " (*)"
        old = f"{before[r.run.name]:.3f} | " if before and r.run.name in before else ("- | " if before else "")
        lines.append(f"| {r.run.name}{mark} | {r.run.cluster} | `{r.run.plan}` "
                     f"| {r.run.tokens_per_s_per_device:,.1f} | "
                     f"{r.predicted:,.1f} | {old}{1 + r.error:.3f} | {r.estimate.mem_per_device_bytes / 1e9:.0f} "
                     f"({'yes' if r.estimate.fits else 'no'}) |")
    return lines


def before_summary(runs: tuple[PublishedRun, ...], before: dict[str, float]) -> list[str]:
    """The same summary lines for the ratios of the earlier page."""
    errors = [before[r.name] - 1 for r in runs if r.name in before]
    checked = [before[r.name] - 1 for r in runs if r.name in before and r.checked]
    return [summary("before: all runs", errors), summary("before: runs whose every input was checked", checked)]


GOAL_WITHIN, GOAL_MEAN = 0.20, 0.10
"""The goal: every run within 20%, mean absolute error at most 10% (on the runs whose every input was checked)."""


def summary(name: str, errors: list[float]) -> str:
    absolute = [abs(e) for e in errors]
    within15 = sum(a <= 0.15 for a in absolute)
    within20 = sum(a <= 0.20 for a in absolute)
    return (f"{name}: {len(errors)} runs, mean absolute error {100 * statistics.mean(absolute):.1f}%, median "
            f"{100 * statistics.median(absolute):.1f}%, worst {100 * max(absolute):.1f}%, mean signed "
            f"{100 * statistics.mean(errors):+.1f}%, within 15%: {within15}/{len(errors)}, "
            f"within 20%: {within20}/{len(errors)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(DOC.parent.parent)}")
    parser.add_argument("--before", type=Path, help="an earlier planner_at_scale.md: show its ratios beside "
                        "(e.g. git show REV:docs/planner_at_scale.md > before.md)")
    args = parser.parse_args()
    before = read_ratios(args.before) if args.before else None
    table_rows = rows(PUBLISHED)
    lines = table(table_rows, before)
    checked = [r.error for r in table_rows if r.run.checked]
    figures = [summary("all runs", [r.error for r in table_rows]),
               summary("runs whose every input was checked in a source", checked)]
    if before:
        figures += before_summary(PUBLISHED, before)
    print("\n".join(lines + [""] + figures))
    if args.write:
        DOC.write_text(_document(table_rows, lines, figures, before))
        print(f"wrote {DOC}")


def _named(rows: list[Row]) -> str:
    return " and ".join(f"{r.run.name} ({100 * r.error:+.0f}%)" for r in rows)


def _findings(table_rows: list[Row], before: dict[str, float] | None = None) -> str:
    """The page's prose, every figure in it computed from the rows (and from the earlier page's ratios, `before`)."""
    checked = sorted((r for r in table_rows if r.run.checked), key=lambda r: abs(r.error))
    errors = [abs(r.error) for r in checked]
    met = max(errors) <= GOAL_WITHIN and statistics.mean(errors) <= GOAL_MEAN
    optimistic = sum(r.error > 0 for r in checked)
    devices = {parse_cluster(r.run.cluster).device.name: parse_cluster(r.run.cluster).device for r in table_rows}
    efficiency = ", ".join(f"{d.matmul_efficiency * d.sustained_clock:.2f} on {name}"
                           for name, d in sorted(devices.items()))
    capped = devices.get("H100-96GB-500W")
    unfit = [r for r in table_rows if not r.estimate.fits]
    selective = [r for r in unfit if "ac=selective" in r.run.plan]
    bullets = [
        (f"The goal (every run whose inputs were all checked within {100 * GOAL_WITHIN:.0f}%, mean absolute error "
        f"<= {100 * GOAL_MEAN:.0f}%) is {'met' if met else 'not met'}. The model is optimistic on "
        f"{'every one' if optimistic == len(checked) else optimistic} of those {len(checked)} runs. It prices weight "
        f"GEMMs at the rate a well-shaped GEMM reaches, held to the clock the device sustains ({efficiency} of the "
        "data-sheet peak), times each product's shape factor (the H100's measured square GEMMs; elsewhere the tile and "
        "wave quantization of its output on the device's SMs), FlashAttention-2's published H100 rates for the run's "
        "head dimension, sequence length and mask (forward and backward apart), elementwise bytes at the memory "
        "bandwidth a streaming kernel measured, the recompute each trainer's policy reruns, tensor-parallel "
        "collectives exposed (an all-reduce inside a node at the bus bandwidth nccl-tests measured for its size) and "
        "each data-axis collective hidden behind the pass that issues it, less the slowdown overlapped collectives "
        "cause. Real steps lose more than that to kernel gaps, "
        "framework overheads no kernel measurement holds, and on torchtitan's H100s whatever a 500 W limit costs "
        "large bf16 GEMMs beyond the SM clock it leaves a GEMM-bound vision load"
        + (f" ({capped.sustained_clock:.3f} of the 700 W part's)" if capped else "") + ". The error is smallest on "
        f"{_named(checked[:2])} and largest on {_named(checked[-2:])}. MT-NLG's three runs train the 530B shape of "
        "Megatron-LM 2021's 2520-GPU row on the same A100s and the same tp8 x pp35 split, and the model prices them "
        "alike; they published 23-30% less per GPU. What separates them (DeepSpeed's pipeline engine and schedule "
        "against Megatron-LM's) is in no kernel or link constant."),
    ]
    if before:
        bullets.append(_change(table_rows, before))
    bullets += [
        f"Memory: {len(unfit)} of the {len(table_rows)} runs are predicted not to fit, yet all of them ran: "
        + "; ".join(r.run.name for r in unfit) + "."
        + (f" {len(selective)} of them run selective recompute, which the model counts as Korthikanti et al. define "
           "it (attention scores only)." if selective else "")
        + " The Llama 3 rows record no recompute (the paper does not say), so every activation is counted. No source "
          "was found here for what the other runs kept.",
        ("Still without a kernel- or link-level source here, and so left as they were: FlashAttention-2's rates by "
         "shape on the A100 (its paper gives them only as bar charts not readable here; its single efficiency stays, "
         "and no A100 row runs fused attention: Megatron-LM 2021 and 2022, MT-NLG, BLOOM and OPT ran it unfused), a "
         "bf16 GEMM's own rate under a 500 W cap (the SM clock of a vision load stands in; the one power-capping "
         "study found here measures FP64 DGEMM), NCCL's bus bandwidth against message size for all-gather, "
         "reduce-scatter and anything across nodes (the alpha-beta ring, its latency per step checked against one "
         "published point; only an all-reduce inside a node has a measured curve, taken on 8 ranks and reused for "
         "smaller groups), and the InfiniBand latency (NCCL's own tuning model has per-step network latencies, "
         "src/graph/tuning.cc, but they are a model's constants, not a measurement). The slowdown of compute beside "
         "a collective (arXiv 2507.03114) and which pass hides each data-axis collective (the engines' schedules) "
         "are sourced already; tensor-parallel and pipeline traffic is never hidden."),
        ("The GPU constants come from data sheets and published kernel- and link-level measurements (each source "
        "named beside it in shoal/planner/hardware.py and shoal/planner/kernels.py); the planner has no measured GPU "
        "calibration yet (`python -m bench.gpu_check --parts calibrate` writes one), and the published runs stay held "
        f"out from it. {_one_gpu()}"),
    ]
    return "\n".join(textwrap.fill(b, 100, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False)
                     for b in bullets)


def _checked_mae(table_rows: list[Row]) -> float:
    return 100 * statistics.mean(abs(r.error) for r in table_rows if r.run.checked)


def _change(table_rows: list[Row], before: dict[str, float]) -> str:
    """The 'before' bullet: what this change moved, each part's share recomputed by leaving it out."""
    checked = [r for r in table_rows if r.run.checked and r.run.name in before]
    old = [abs(before[r.run.name] - 1) for r in checked]
    new = [abs(r.error) for r in checked]
    moved = sorted((r for r in table_rows if r.run.name in before),
                   key=lambda r: abs(1 + r.error - before[r.run.name]), reverse=True)
    shoal_policy = rows(tuple(dataclasses.replace(r.run, selective_policy="shoal") for r in table_rows))
    no_curves = rows(tuple(r.run for r in table_rows), allreduce_curves=False)
    fit = [r for r in table_rows if r.run.selective_policy != "shoal" and r.estimate.fits]
    return (
        "Against the page before this change (the 'before' column), the checked runs' mean absolute error went from "
        f"{100 * statistics.mean(old):.1f}% to {100 * statistics.mean(new):.1f}%, the median from "
        f"{100 * statistics.median(old):.1f}% to {100 * statistics.median(new):.1f}% and the worst from "
        f"{100 * max(old):.1f}% to {100 * max(new):.1f}%. Four things changed, each read from a source before its "
        "effect was seen. (1) torchtitan's runs are priced with torchtitan's own per-op selective recompute (its "
        "`_custom_policy` keeps the outputs of matmuls, SDPA and reduce-scatters except every second matmul), not "
        "shoal's: their blocks rerun wk, wo and w3 (0.37 of an 8B block's weight FLOPs) and keep about a third of "
        f"what shoal's policy keeps, so {len(fit)} of them now fit; priced with shoal's policy the checked error "
        f"would be {_checked_mae(shoal_policy):.1f}%. (2) An all-reduce inside an A100 or H100 node is priced from a "
        "published nccl-tests curve of bus bandwidth by buffer size (Azure's AI-benchmarking-guide, 8 GPUs, 1 KiB to "
        "8 GiB): Megatron's and MT-NLG's per-micro-batch tensor-parallel all-reduces (34-105 MB) run at 130-175 GB/s, "
        f"not the 234 of a large buffer; with the alpha-beta ring instead it would be {_checked_mae(no_curves):.1f}%. "
        "(3) InfiniBand runs at the all-reduce bus bandwidth NCCL's engineers report per NIC (HDR 24 of 25 GB/s, NDR "
        "47 of 50, not 0.9 of either) and (4) the H100-80GB's and H200's memory bandwidth at a measured STREAM Triad "
        "(2.97 and 4.15 TB/s, not 3.35 and 4.8); together these moved the checked error by about a tenth of a point "
        "(the memory bandwidth only the Llama 3 rows, which are not checked, and the one-GPU prediction). The largest "
        "moves: " + "; ".join(f"{r.run.name} ({before[r.run.name]:.3f} -> {1 + r.error:.3f})" for r in moved[:3])
        + ". No constant was chosen by how it moved these rows.")


def _one_gpu() -> str:
    """The prediction for bench/gpu_throughput.py's 1.9B shape on one H100, which that bench measures."""
    from bench.gpu_throughput import SHAPES, SHOAL_PLANS

    shape = SHAPES["1.9b"]
    cluster = parse_cluster("1xH100-80GB")
    work = Workload(model=shape.model(), global_batch=shape.batch, seq_len=shape.seq_len)
    predicted = {name: estimate(Plan.parse(text).resolve(1, "cuda"), work, cluster).tokens_per_s
                 for name, text in SHOAL_PLANS.items()}
    return (f"For the step `python bench/gpu_throughput.py --shapes 1.9b` measures on one H100 (llama3-8b cut to "
            f"{shape.model().num_layers} layers, {shape.batch} x {shape.seq_len} tokens), it predicts "
            + ", ".join(f"{v / 1e3:.0f}K tokens/s for `{SHOAL_PLANS[k]}`" for k, v in predicted.items()) + ".")


def _document(table_rows: list[Row], lines: list[str], figures: list[str], before: dict[str, float] | None) -> str:
    sources = "\n".join(f"- {r.name}: {r.source}. {r.note}" for r in PUBLISHED)
    return f"""# The planner against published large runs

`python -m bench.planner_at_scale --write` regenerates this page. For each published run the
cost model (`shoal plan --plan PLAN`) predicts tokens/s per device from the model shape, the
cluster and the plan the source names. Its constants come from data sheets and kernel- and
link-level measurements (`shoal/planner/hardware.py`, `shoal/planner/kernels.py`); none is
fitted to these runs. Runs marked (*) rest on a number
the source did not state or that could not be re-checked here (see the notes below).

{chr(10).join(lines)}

{chr(10).join(f"- {f}" for f in figures)}

## What it shows

{_findings(table_rows, before)}

## Sources and notes

{sources}
"""


if __name__ == "__main__":
    main()
