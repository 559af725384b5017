"""The planner against published large runs: predicted vs published tokens/s per device.

For every run in shoal.planner.published (model shape, cluster, plan, batch as the source gives
them), the cost model predicts the step; the table gives predicted / published per device and
the error. Nothing in the model is fitted to these runs: its constants come from data sheets and
kernel papers (shoal.planner.hardware). Writes docs/planner_at_scale.md with --write.

    python -m bench.planner_at_scale [--write]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from shoal import rules
from shoal.plan import Plan
from shoal.planner.estimate import Workload, estimate
from shoal.planner.hardware import parse_cluster
from shoal.planner.published import PUBLISHED, PublishedRun

DOC = Path(__file__).resolve().parent.parent / "docs" / "planner_at_scale.md"


def predict(run: PublishedRun) -> tuple[float, float, bool]:
    """(predicted tokens/s per device, predicted memory per device in GB, fits)."""
    cluster = parse_cluster(run.cluster)
    work = Workload(model=run.model, global_batch=run.global_batch, seq_len=run.seq_len,
                    fused_attention=run.fused_attention)
    # Priced as it ran, also where shoal's runtime would refuse the layout (tests/test_planner.py names it).
    plan = rules.fill(Plan.parse(run.plan), rules.Facts(world_size=cluster.world_size, device="cuda",
                                                        model=run.model, global_batch=run.global_batch,
                                                        seq_len=run.seq_len))
    micro = run.micro_batch_size if plan.pp == 1 else None
    e = estimate(plan, work, cluster, micro_batch=micro)
    return e.tokens_per_s / cluster.world_size, e.mem_per_device_bytes / 1e9, e.fits


def read_ratios(path: Path) -> dict[str, float]:
    """Run name -> predicted / published from an earlier planner_at_scale.md (its last ratio column before
    the memory column), so a change to the cost model can show the error before and after, per run."""
    ratios = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and cells[0] not in ("run", "---"):
            ratios[cells[0].removesuffix(" (*)")] = float(cells[-2])
    return ratios


def table(runs: tuple[PublishedRun, ...], before: dict[str, float] | None = None
          ) -> tuple[list[str], list[float], list[float]]:
    was = "predicted / published before | " if before else ""
    lines = [f"| run | devices | plan | published tok/s/dev | predicted | {was}predicted / published | memory GB (fits) |",
             "|---|---|---|---|---|---|---|" + ("---|" if before else "")]
    errors, checked = [], []
    for run in runs:
        predicted, mem, fits = predict(run)
        ratio = predicted / run.tokens_per_s_per_device
        errors.append(ratio - 1)
        if run.checked:
            checked.append(ratio - 1)
        mark = "" if run.checked else " (*)"
        old = f"{before[run.name]:.3f} | " if before and run.name in before else ("- | " if before else "")
        lines.append(f"| {run.name}{mark} | {run.cluster} | `{run.plan}` | {run.tokens_per_s_per_device:,.1f} | "
                     f"{predicted:,.1f} | {old}{ratio:.3f} | {mem:.0f} ({'yes' if fits else 'no'}) |")
    return lines, errors, checked


def before_summary(runs: tuple[PublishedRun, ...], before: dict[str, float]) -> list[str]:
    """The same summary lines for the ratios of the earlier page."""
    errors = [before[r.name] - 1 for r in runs if r.name in before]
    checked = [before[r.name] - 1 for r in runs if r.name in before and r.checked]
    return [summary("before: all runs", errors), summary("before: runs whose every input was checked", checked)]


def summary(name: str, errors: list[float]) -> str:
    absolute = [abs(e) for e in errors]
    within = sum(a <= 0.15 for a in absolute)
    within20 = sum(a <= 0.20 for a in absolute)
    return (f"{name}: {len(errors)} runs, mean absolute error {100 * statistics.mean(absolute):.1f}%, median "
            f"{100 * statistics.median(absolute):.1f}%, worst {100 * max(absolute):.1f}%, mean signed "
            f"{100 * statistics.mean(errors):+.1f}%, within 15%: {within}/{len(errors)}, within 20%: {within20}/{len(errors)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(DOC.parent.parent)}")
    parser.add_argument("--before", type=Path, help="an earlier planner_at_scale.md: show its ratios beside "
                        "(e.g. git show REV:docs/planner_at_scale.md > before.md)")
    args = parser.parse_args()
    before = read_ratios(args.before) if args.before else None
    lines, errors, checked = table(PUBLISHED, before)
    figures = [summary("all runs", errors), summary("runs whose every input was checked in a source", checked)]
    if before:
        figures += before_summary(PUBLISHED, before)
    print("\n".join(lines + [""] + figures))
    if args.write:
        DOC.write_text(_document(lines, figures))
        print(f"wrote {DOC}")


def _document(lines: list[str], figures: list[str]) -> str:
    sources = "\n".join(f"- {r.name}: {r.source}. {r.note}" for r in PUBLISHED)
    return f"""# The planner against published large runs

`python -m bench.planner_at_scale --write` regenerates this page. For each published run the
cost model (`shoal plan --plan PLAN`) predicts tokens/s per device from the model shape, the
cluster and the plan the source names. Its constants come from data sheets and kernel papers
(`shoal/planner/hardware.py`); none is fitted to these runs. Runs marked (*) rest on a number
the source did not state or that could not be re-checked here (see the notes below).

{chr(10).join(lines)}

{chr(10).join(f"- {f}" for f in figures)}

## What it shows

- The goal (every run within 15%, mean absolute error <= 5%) is not met. The model is optimistic
  on every run whose inputs were all checked: it predicts the step from the matmul rate a large
  square GEMM reaches (0.8 of peak), FlashAttention's published rate, elementwise bytes at full
  memory bandwidth and communication hidden behind compute wherever it can be; real steps lose
  more than that to smaller and transposed GEMMs, kernel gaps and the slowdown overlapped
  collectives cause. The error is smallest where matmuls dominate (Megatron-LM's 530B and 1T runs,
  +7-8%) and largest on the H100 runs (torchtitan's Llama 3.1 8B, +67-76%).
- Memory: torchtitan's 8B runs at 2 x 8192 tokens per micro-batch are predicted not to fit, yet
  they ran. The model counts selective recompute as Korthikanti et al. define it (attention scores
  only); torchtitan's per-op selective recompute keeps less.
- The H100 constants are data-sheet numbers. On the GPU machine shoal has measured (one H100,
  MACHINE-FACTS.md), a one-GPU step of a 1.9B llama3-8b-shaped model ran at 51-57K tokens/s where
  the model predicts 62-67K: the same direction, a smaller gap. A GPU calibration (measuring
  training-shaped GEMMs and collectives on the device, as `--calibrate` does on CPUs) is the next
  step; the published runs stay held out from it.

## Sources and notes

{sources}
"""


if __name__ == "__main__":
    main()
