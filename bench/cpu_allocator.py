"""Which C allocator a CPU run's workers use, and what it costs: speed and resident peak of `shoal train`
under glibc's malloc against jemalloc (shoal's choice where one is found: shoal.infra.host_memory), in one launch.

Each row is one plan of a preset (`small` unless --model says) trained for a few steps, the allocators
alternated run by run (ABAB...), the median of `--repeats` runs of each: tokens/s (shoal's summary: the
median step after the first window) and the resident peak of the busiest rank's largest step,
with their ratios to glibc's.

    glibc          glibc's malloc (SHOAL_ALLOCATOR=glibc)
    jemalloc       jemalloc preloaded, freed pages kept (shoal's choice where a libjemalloc is found:
                   host_memory.KEEP_FREED and return_large_blocks)
    jemalloc-decay jemalloc at its own defaults: freed pages returned to the kernel over 10 s
    jemalloc-bg    jemalloc at its defaults with a background thread returning freed pages (torch's CPU
                   launcher's option)
    glibc-64k      glibc with a fixed 64 KiB mmap threshold: every tensor its own mapping, unmapped when freed

    python -m bench.cpu_allocator [--model small] [--plans dp1 tp2 fsdp4] [--allocators glibc jemalloc]
                                  [--steps 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import report, summarize
from shoal.infra import host_memory

NPROC = {"dp1": 1, "dp2": 2, "fsdp2": 2, "tp2": 2, "fsdp4": 4}
ALLOCATORS = {"glibc": {"SHOAL_ALLOCATOR": "glibc"}, "jemalloc": {"SHOAL_ALLOCATOR": "jemalloc"},
              "jemalloc-bg": {"SHOAL_ALLOCATOR": "jemalloc", "MALLOC_CONF": "background_thread:true"},
              "jemalloc-decay": {"SHOAL_ALLOCATOR": "jemalloc", "MALLOC_CONF": "dirty_decay_ms:10000"},
              "glibc-64k": {"SHOAL_ALLOCATOR": "glibc", "MALLOC_MMAP_THRESHOLD_": str(64 * 2**10)}}


def run(plan: str, *, model: str, steps: int, env: dict[str, str], out: Path) -> dict[str, float]:
    """tokens/s and the largest step's resident peak (MB) of one `shoal train` run."""
    cmd = [sys.executable, "-m", "shoal", "train", "--model", model, "--plan", plan, "--nproc", str(NPROC[plan]),
           "--steps", str(steps), "--log-every", "5", "--eval-every", "0", "--ckpt-every", "0", "--out", str(out),
           "--device", "cpu"]
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF", "SHOAL_ALLOCATOR")}
    done = subprocess.run(cmd, env={**base, "OMP_NUM_THREADS": "1", **env}, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"shoal train --plan {plan} failed: {done.stderr.strip()[-600:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"tokens_per_s": summary["tokens_per_s"],
            "mem_peak_mb": max(r["mem_peak_mb"] for r in records if "mem_peak_mb" in r)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", nargs="+", default=["dp1", "tp2", "fsdp4"], choices=list(NPROC))
    parser.add_argument("--allocators", nargs="+", default=["glibc", "jemalloc"], choices=list(ALLOCATORS))
    parser.add_argument("--model", default="small", help="a preset (tiny: the default job's)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if "jemalloc" in args.allocators and host_memory.find_jemalloc() is None:
        raise SystemExit(f"no libjemalloc found ({host_memory.NOT_FOUND})")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for plan in args.plans:
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in args.allocators}
            for i in range(args.repeats):
                for name in args.allocators:
                    runs[name].append(run(plan, model=args.model, steps=args.steps, env=ALLOCATORS[name],
                                          out=Path(tmp) / f"{plan}-{name}-{i}"))
            row: dict[str, object] = {"model": args.model, "plan": plan}
            first = args.allocators[0]
            for name in args.allocators:
                speed = summarize([r["tokens_per_s"] for r in runs[name]])
                peak = summarize([r["mem_peak_mb"] for r in runs[name]])["median"]
                row[f"{name} tok/s"] = round(speed["median"], 1)
                row[f"{name} spread"] = f"{100 * speed['iqr_rel']:.1f}%"
                row[f"{name} peak MB"] = round(peak)
                if name != first:
                    row[f"{name}/{first} speed"] = round(speed["median"] / float(row[f"{first} tok/s"]), 3)  # type: ignore[arg-type]
                    row[f"{name}/{first} peak"] = round(peak / float(row[f"{first} peak MB"]), 3)  # type: ignore[arg-type]
            print(row, flush=True)
            rows.append(row)
    report("cpu_allocator", rows, notes="medians over repeats, allocators alternated run by run; peak: the "
           "resident peak of the busiest rank's largest step; spread: inter-quartile range / median")


if __name__ == "__main__":
    main()
