"""Every Hugging Face family under every plan of issue 25 against one process: the full matrix that
tests/test_hf_parallel.py runs a share of in CI.

Each cell trains the family's tiny shoal model (shoal.testing.parity.HF_FAMILIES) for two steps under the
plan on gloo processes and reports the largest absolute difference from the single-process float32
run of the losses (every step) and of the first step's gradients, and whether check_parity (the
tests' rounding bounds) passes; or the one line in which shoal refuses the plan for that family.
Cells are saved as they finish to bench/results/hf_matrix.json, so a run in parts (--families,
--plans) fills one table.

    python -m bench.hf_matrix [--families gpt2,qwen3] [--plans tp2,pp2] [--fresh]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench.common import RESULTS  # noqa: E402
from shoal.infra.pool import WorkerPool  # noqa: E402
from shoal.testing.parity import HF_FAMILIES, HF_PLANS, check_parity, hf_case, parity_diffs, run_parallel  # noqa: E402

SAVED = RESULTS / "hf_matrix.json"


def run_cell(pools: dict[int, WorkerPool], family: str, plan: str) -> dict:
    """One family under one plan: its differences and check_parity's verdict, or why it is refused."""
    try:
        c = hf_case(family, plan)
    except ValueError as exc:
        return {"refused": str(exc)}
    world = HF_PLANS[plan]
    if world not in pools or not pools[world].alive:
        pools[world] = WorkerPool(world)
    start = time.perf_counter()
    try:
        results = pools[world].run(run_parallel, c)
    except RuntimeError as exc:  # a rank failed: the pool is gone, the next cell starts another
        return {"error": str(exc).strip().splitlines()[-1]}
    cell: dict = {**parity_diffs(results, c), "seconds": time.perf_counter() - start}
    try:
        check_parity(results, c)
        cell["parity"] = "ok"
    except AssertionError as exc:
        cell["parity"] = str(exc).splitlines()[0]
    return cell


def table(cells: dict[str, dict], families: list[str], plans: list[str]) -> str:
    """Markdown: a row per family, a column per plan; refusals as footnotes."""
    reasons: list[str] = []
    lines = ["| family | max abs gradient | " + " | ".join(f"`{p}`" for p in plans) + " |",
             "|---" * (len(plans) + 2) + "|"]
    for family in families:
        scales = [c["largest_grad"] for p in plans if "largest_grad" in (c := cells.get(f"{family}|{p}", {}))]
        row = [f"{max(scales):.1e}" if scales else ""]
        for plan in plans:
            cell = cells.get(f"{family}|{plan}")
            if cell is None:
                row.append("not run")
            elif "refused" in cell:
                if cell["refused"] not in reasons:
                    reasons.append(cell["refused"])
                row.append(f"refused [{reasons.index(cell['refused']) + 1}]")
            elif "error" in cell:
                row.append(f"ERROR: {cell['error']}")
            else:
                mark = "" if cell["parity"] == "ok" else " FAIL"
                row.append(f"{cell['loss']:.1e} / {cell['grad']:.1e}{mark}")
        lines.append(f"| {family} | " + " | ".join(row) + " |")
    lines += ["", *(f"[{i}] {reason}" for i, reason in enumerate(reasons, 1))]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(HF_FAMILIES))
    parser.add_argument("--plans", default=";".join(HF_PLANS), help="plans separated by ';'")
    parser.add_argument("--fresh", action="store_true", help="forget the cells saved by earlier runs")
    args = parser.parse_args()
    families, plans = args.families.split(","), args.plans.split(";")
    cells = {} if args.fresh or not SAVED.is_file() else json.loads(SAVED.read_text())["cells"]
    pools: dict[int, WorkerPool] = {}
    try:
        for plan in sorted(plans, key=lambda p: HF_PLANS[p]):  # one pool size at a time
            for family in families:
                key = f"{family}|{plan}"
                cells[key] = run_cell(pools, family, plan)
                print(key, cells[key], flush=True)
                RESULTS.mkdir(parents=True, exist_ok=True)
                SAVED.write_text(json.dumps({"cells": cells}, indent=1))
    finally:
        for pool in pools.values():
            pool.close()
    print("\nmax |loss - one process| / max |gradient - one process| (float32, 2 steps)\n")
    print(table(cells, list(HF_FAMILIES), list(HF_PLANS)))


if __name__ == "__main__":
    main()
