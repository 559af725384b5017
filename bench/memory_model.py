"""The planner's memory model against `shoal train --dry-run`, plan by plan (issue 24's table).

Each row is one `shoal train --dry-run` in its own launch: its busiest rank's peak of live tensor
bytes in its third step beside the sum of the planner's terms, and its resident peak in its second
above the interpreter's baseline beside the planner's total (terms plus the fragmentation margin and, on
CPUs, the step's runtime memory, CPU_STEP_BYTES).
Goal: within 15%. A plan the memory check refuses (it would not fit this machine's free memory)
is reported with its one-line refusal instead: the check runs before any worker, so nothing is
allocated.

    python -m bench.memory_model                  # `small` and the 512M model (vocab 500,000, dim 512)
    python -m bench.memory_model --models small   # the small preset only (about 3 minutes)
    python -m bench.memory_model --models runtime # the step's memory beyond tensors (CPU_STEP_BYTES)
    python -m bench.memory_model --models small-dropout  # small at dropout 0.1
    SHOAL_ALLOCATOR=glibc python -m bench.memory_model   # the workers on glibc's malloc, not jemalloc
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

from bench.common import report
from shoal.infra import host_memory

MODELS: dict[str, list[str]] = {
    "small": ["--model", "small"],
    "512M": ["--set", "vocab_size=500000", "--set", "dim=512", "--global-batch", "4"],
    "runtime": ["--set", "num_layers=2", "--set", "dim=64", "--set", "ffn_dim=128", "--global-batch", "4",
                "--seq-len", "64"],
    "small-dropout": ["--model", "small", "--set", "dropout=0.1"],
}
"""The models of the table: the small preset at its defaults, and `tiny` with a 500,000-token vocabulary
and dim 512 (512M parameters, ~2 GB in fp32, dominated by its two tables) at global batch 4. "runtime", not in
the default set, is a model whose tensors are negligible (1-5 MB): what its resident peak holds beyond them is
the step's runtime memory, shoal.planner.peak.CPU_STEP_BYTES. "small-dropout", not in the default set either, is
`small` at dropout 0.1 (the dropouts' masks, shoal.planner.memory.dropout_kept_elements)."""

PLANS = [("dp1", 1), ("dp2", 2), ("fsdp2", 2), ("fsdp4", 4), ("tp2", 2), ("pp2", 2), ("tp4", 4)]

_LIVE = re.compile(r"step peak of live tensors, busiest rank: (\d+) MB; the planner's terms, (\d+) MB")
_RESIDENT = re.compile(r"step peak above the baseline, busiest rank: (\d+) MB; the planner's (\d+) MB")
_KEPT = re.compile(r"freed memory the allocator kept for reuse after the step: \d+ to (\d+) MB")


def dry_run(model: list[str], plan: str, nproc: int) -> dict[str, Any]:
    """One dry run's figures, or its refusal."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, "-m", "shoal", "train", *model, "--plan", plan, "--nproc", str(nproc),
                               "--dry-run", "--out", out], capture_output=True, text=True, env=env)
    text = done.stdout + done.stderr
    live, resident = _LIVE.search(text), _RESIDENT.search(text)
    if done.returncode != 0 or live is None or resident is None:
        errors = [line for line in text.splitlines() if line.startswith("shoal: error:")]
        refusal = errors[0] if errors else f"rc {done.returncode}"
        return {"refused or failed": refusal.removeprefix("shoal: error: ")[:160]}
    measured, priced = (int(g) for g in live.groups())
    above, total = (int(g) for g in resident.groups())
    kept = _KEPT.search(text)
    return {"kept MB": int(kept.group(1)) if kept else None,
            "live MB": measured, "terms MB": priced, "terms error": f"{100 * (priced - measured) / measured:+.0f}%",
            "resident MB": above, "beyond tensors MB": above - measured, "total MB": total,
            "total error": f"{100 * (total - above) / above:+.0f}%"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["small", "512M"], choices=list(MODELS))
    args = parser.parse_args()
    rows = []
    for name in args.models:
        for plan, nproc in PLANS:
            row = {"model": name, "plan": plan, **dry_run(MODELS[name], plan, nproc)}
            print(row, flush=True)
            rows.append(row)
    preloaded = host_memory.worker_env("cpu").get("LD_PRELOAD") or os.environ.get("LD_PRELOAD")  # the workers'
    allocator = os.path.basename(preloaded) if preloaded else "glibc"
    report("memory_model", rows, notes=f"allocator: {allocator}; "
           "live: the busiest rank's peak of live tensor bytes in a steady step; "
           "resident: its resident peak above the interpreter's baseline; kept: the most freed memory a rank's "
           "allocator held for reuse after the step (glibc's free chunks, jemalloc's unallocated resident pages), "
           "resident memory no tensor owns; "
           "errors are planner / measured - 1")


if __name__ == "__main__":
    main()
