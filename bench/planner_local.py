"""The planner against this machine: predicted vs measured step time of real `shoal train` runs.

Each plan of the default model (the `tiny` preset, global batch 16 x 128 tokens) trains for a
few dozen steps at 4 processes through the command line; its median step time (summary.json)
is compared with `shoal plan --plan PLAN`'s prediction from this machine's calibration profile.
Reports the rank correlation (Spearman), the median absolute error, and whether the plan
`--plan auto` picks is within 10% of the fastest measured. Runs are repeated `--repeats` times,
interleaved plan by plan, and the median taken.

    python -m bench.planner_local [--nproc 4] [--steps 40] [--repeats 2] [--calibrate]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shoal.cli.plan import price, resolve_cluster, workload
from shoal.planner.search import search

PLANS = ("dp4", "fsdp4", "fsdp4,zero=1", "fsdp4,zero=2", "dp2,fsdp2", "dp2,tp2", "tp4", "dp2,cp2", "cp4",
         "dp2,pp2", "pp4,mb=8", "tp2,pp2", "dp4,ac=full", "fsdp2,tp2")
"""Every axis and engine the runtime has at 4 processes: DDP, FSDP2 ZeRO-3, the ZeRO-1/2 engine,
HSDP, tensor, context, pipeline, and recompute."""


def measure(plan: str, *, nproc: int, steps: int, micro_batch: int | None, out: Path) -> float:
    """Median seconds per step of a `shoal train` run (after the first read window)."""
    folder = out / f"run{len(list(out.iterdir()))}"
    cmd = [sys.executable, "-m", "shoal", "train", "--plan", plan, "--nproc", str(nproc), "--steps", str(steps),
           "--log-every", "5", "--eval-every", "0", "--eval-batches", "1", "--ckpt-every", "0", "--out", str(folder),
           "--device", "cpu"]
    if micro_batch is not None:
        cmd += ["--micro-batch", str(micro_batch)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for attempt in (1, 2):
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode == 0:
            break
        # Said, not hidden: a failed run is printed with its last words, and retried once.
        print(f"shoal train --plan {plan} failed (attempt {attempt}): {done.stderr.strip()[-600:]}", flush=True)
        if attempt == 2:
            raise SystemExit(1)
        folder = out / f"run{len(list(out.iterdir()))}"
        cmd[cmd.index("--out") + 1] = str(folder)
    summary = json.loads((folder / "summary.json").read_text())
    return 16 * 128 / summary["tokens_per_s"]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (no ties expected in timings)."""
    def ranks(v: list[float]) -> list[int]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0] * len(v)
        for i, j in enumerate(order):
            r[j] = i
        return r
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--calibrate", action="store_true", help="measure the profile first (full mode)")
    args = parser.parse_args()
    if args.calibrate:
        from shoal.calibration.calibrate import calibrate
        from shoal.planner.profile import save_profile

        print(f"profile: {save_profile(calibrate(world_sizes=sorted({1, 2, args.nproc})))}")
    work = workload("tiny", [], global_batch=16, seq_len=128)
    cluster, network = resolve_cluster("local", args.nproc)
    best = search(work, cluster, network=network, top=1).plans[0]
    auto = (best.plan_text, best.micro_batch if best.plan.pp == 1 and best.micro_batch != 16 // best.plan.data_ranks
            else None)
    runs = [(p, None) for p in PLANS] + ([auto] if auto[0] not in PLANS or auto[1] else [])
    predicted = {r: price(r[0], work, cluster, network, micro_batch=r[1]).step_time_s for r in runs}
    samples: dict[tuple[str, int | None], list[float]] = {r: [] for r in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for r in runs:
                samples[r].append(measure(r[0], nproc=args.nproc, steps=args.steps, micro_batch=r[1], out=Path(tmp)))
                print(f"repeat {repeat + 1}: {r[0]}{'' if r[1] is None else f' micro-batch {r[1]}'}: "
                      f"{samples[r][-1] * 1e3:.1f} ms (predicted {predicted[r] * 1e3:.1f})", flush=True)
    measured = {r: statistics.median(v) for r, v in samples.items()}
    print(f"\n{'plan':<26} {'predicted ms':>12} {'measured ms':>12} {'spread':>8} {'error':>8}")
    for r in runs:
        spread = (max(samples[r]) - min(samples[r])) / measured[r]
        label = r[0] + ("" if r[1] is None else f" mbs={r[1]}") + (" (auto)" if r == auto else "")
        print(f"{label:<26} {predicted[r] * 1e3:>12.1f} {measured[r] * 1e3:>12.1f} {spread:>8.1%} "
              f"{predicted[r] / measured[r] - 1:>+8.1%}")
    keys = list(runs)
    rho = spearman([predicted[k] for k in keys], [measured[k] for k in keys])
    errors = [abs(predicted[k] / measured[k] - 1) for k in keys]
    fastest = min(measured.values())
    print(f"\n{len(keys)} plans at {args.nproc} processes: Spearman {rho:.3f} (goal >= 0.9); median absolute error "
          f"{statistics.median(errors):.1%} (goal <= 10%); mean {statistics.mean(errors):.1%}; worst {max(errors):.1%}")
    print(f"auto picks {auto[0]}{'' if auto[1] is None else f' (micro-batch {auto[1]})'}: measured "
          f"{measured[auto] * 1e3:.1f} ms, {measured[auto] / fastest:.3f}x the fastest measured "
          f"({min(measured, key=measured.get)[0]}, {fastest * 1e3:.1f} ms; goal <= 1.10x)")


if __name__ == "__main__":
    main()
