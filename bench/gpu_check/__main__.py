"""`python -m bench.gpu_check`: run the parts, each in its own process under its budget; see __init__."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gpu_check import report
from bench.gpu_check.context import REPO, Context


@dataclass(frozen=True)
class Part:
    name: str
    budget_s: int
    """Seconds the part's process may run on the GPU machine before it is stopped."""
    about: str
    run: str
    """"module:function" taking (ctx) or (ctx, device_name)."""


PARTS = [  # most likely to fail first (GPU code paths that have never run), then the long benchmarks
    Part("tests", 320, "the CUDA-only tests (tests/test_devices.py, tests/test_fast_step.py)", "parts_train:tests"),
    Part("train", 100, "`shoal train` with no flags on one GPU", "parts_train:default_train"),
    Part("plans", 360, "every one-process plan (precision, compile, recompute, offload, zero 1-3, tp1) for a few "
         "steps: loss, peak memory, and the planner's memory and tokens/s beside them (the memory check)",
         "parts_train:plans"),
    Part("moe", 60, "MoE experts: grouped matmul and padded paths against the loop (values, gradients); "
         "one layer's speed per path and bench/moe_layer.py's naive loop", "parts_kernels:moe"),
    Part("fp8", 240, "bf16 against fp8=rowwise (torchao's float8 training, installed from a carried wheel where "
         "missing) at the 1.9B shape, compiled: tokens/s and the loss after the same steps, with their goals",
         "parts_fp8:fp8"),
    Part("attention", 60, "ring and a2a attention against SDPA and torch's context_parallel at cp=1 (values, "
         "gradients); the ring's blocks at cp=2, 4 rank by rank", "parts_kernels:attention"),
    Part("engine", 60, "what a one-process bf16 run pays for its parameter cast (autocast; FSDP2 of degree 1 before) "
         "against the bare model: host time of a deep tiny model's forward and backward (bench/engine_overhead.py)",
         "parts_kernels:engine"),
    Part("ops", 90, "kernels per block under compile (profiler), beside the planner's OPS_PER_BLOCK",
         "parts_kernels:ops"),
    Part("calibrate", 170, "CUDA calibration (GEMMs and attention of training shapes, memory bandwidth) written "
         "as a cluster profile for this device kind; one-GPU predictions against measured runs",
         "calibrate_cuda:part"),
    Part("throughput-85m", 240, "bench/gpu_throughput.py at the 85M shape with its goals",
         "parts_train:throughput:85m"),
    Part("throughput-1.9b", 240, "bench/gpu_throughput.py at the 1.9B shape with its goals (both throughput parts "
         "fit one call's --budget)", "parts_train:throughput:1.9b"),
]
BY_NAME = {p.name: p for p in PARTS}
CALL_BUDGET_S = 480
"""The default --budget on a GPU: one call. The GPU machine stops a command at 10 minutes and lends a
session 15 minutes in all, its start included; the install and the interpreter's start fit in the rest."""
PART_MARGIN_S = 15
"""A part's own deadline comes this long before its budget, so that it can end and save what it has."""
DRY_RUN_SLACK = 3
"""A dry run's part may take up to its budget x this (CPU at toy sizes, on a shared 2-core CI box)."""


def _function(part: Part) -> tuple[Callable[..., Any], tuple[str, ...]]:
    module, name, *extra = part.run.split(":")
    mod = __import__(f"bench.gpu_check.{module}", fromlist=[name])
    return getattr(mod, name), tuple(extra)


def worker(name: str, result_path: Path, out: Path, dry: bool, device_name: str | None) -> None:
    """One part in this process: its checks and figures, or the error that stopped it, as JSON (saved as
    each check is made: a part stopped at its budget keeps them)."""
    budget = BY_NAME[name].budget_s * (DRY_RUN_SLACK if dry else 1)
    ctx = Context(dry=dry, out=out, save_to=result_path, deadline=time.monotonic() + budget - PART_MARGIN_S)
    fn, extra = _function(BY_NAME[name])
    status, error = "ok", None
    try:
        params = fn.__code__.co_varnames[:fn.__code__.co_argcount]
        fn(ctx, *extra, *([device_name] if "device_name" in params else []))
    except Exception:  # noqa: BLE001 -- the part's failure is its result
        status, error = "error", traceback.format_exc()
        print(error, flush=True)
    if status == "ok" and any(not c["ok"] and not c["goal"] for c in ctx.checks):
        status = "failed"
    result_path.write_text(json.dumps({"status": status, "error": error, **ctx.result()}, default=str))


def run_part(part: Part, args: argparse.Namespace, header: dict[str, Any]) -> dict[str, Any]:
    """The part in a child process (its own process group, stopped whole at the budget)."""
    budget = part.budget_s * (DRY_RUN_SLACK if args.dry_run else 1)
    with tempfile.TemporaryDirectory(prefix="gpu-check-part-") as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "bench.gpu_check", "--worker", part.name, "--result", str(result_path),
               "--out", str(args.out), *(["--dry-run"] if args.dry_run else []),
               *(["--device-name", header["device"]] if header.get("device") else [])]
        paths = (str(REPO), os.environ.get("PYTHONPATH", ""))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=budget)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the part and every process it started
            output, _ = proc.communicate()
            timed_out = True
        wall = time.perf_counter() - start
        sys.stdout.write(output)
        result = collect(result_path, timed_out=timed_out, returncode=proc.returncode, output=output, budget=budget)
    return {**result, "about": part.about, "budget_s": budget, "wall_s": wall}


def collect(result_path: Path, *, timed_out: bool, returncode: int | None, output: str,
            budget: float) -> dict[str, Any]:
    """A part's result: what it wrote on ending, or, stopped or crashed, the checks it saved so far and why it has
    no more."""
    saved = json.loads(result_path.read_text()) if result_path.exists() else {"checks": []}
    if saved.get("status") not in (None, "partial") and not timed_out:
        return saved
    why = f"stopped at its budget of {budget:g} s" if timed_out else f"exit status {returncode}"
    return {**saved, "status": "timeout" if timed_out else "error", "error": f"{why}\n{output[-3000:]}"}


def device_header(dry: bool) -> dict[str, Any]:
    import torch

    device = None
    if not dry:
        if not torch.cuda.is_available():
            sys.exit("gpu_check: CUDA is not available; `--dry-run` runs the CPU side of every part")
        device = torch.cuda.get_device_name(0)
    return {"device": device, "torch": torch.__version__, "dry_run": dry, "argv": sys.argv[1:],
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    parser.add_argument("--parts", default=",".join(BY_NAME), help=f"comma list of: {', '.join(BY_NAME)} [all]")
    parser.add_argument("--out", type=Path, default=Path("gpu-check-out"), help="report folder [gpu-check-out]")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: the CPU side of every part at toy sizes")
    parser.add_argument("--budget", type=float, help=f"seconds this call may take: a part starts only while its "
                        f"budget fits in what is left [{CALL_BUDGET_S} on a GPU; no limit with --dry-run]")
    parser.add_argument("--list", action="store_true", help="list the parts and their budgets, and stop")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--device-name", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out = args.out.resolve()  # the parts run from the repository root
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        parser.error(f"--parts {','.join(unknown) or '(empty)'} is not valid; valid: {', '.join(BY_NAME)}")
    args.parts = [p for p in PARTS if p.name in names]  # always in the failure-first order
    if args.budget is not None and not args.budget > 0:
        parser.error(f"--budget {args.budget:g} is not valid; valid: seconds > 0")
    if args.budget is None:
        args.budget = math.inf if args.dry_run else CALL_BUDGET_S
    return args


def print_parts(parts: list[Part], budget: float) -> None:
    print(f"{'part':<16} {'budget s':>8}  what")
    for p in parts:
        print(f"{p.name:<16} {p.budget_s:>8}  {p.about}")
    limit = "no limit" if math.isinf(budget) else f"{budget:g} s"
    print(f"total budget {sum(p.budget_s for p in parts)} s; this call's --budget: {limit}. The parts run in this "
          "order, each only while its budget fits in what is left of the call's; the call ends by printing the "
          "one that runs the rest.")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args.worker, args.result, args.out, args.dry_run, args.device_name)
        return 0
    print_parts(args.parts, args.budget)
    if args.list:
        return 0
    deadline = time.monotonic() + args.budget
    header = device_header(args.dry_run)
    print(f"device: {header['device'] or 'none (dry run: CPU side at toy sizes)'}; torch {header['torch']}; "
          f"report: {args.out / report.MARKDOWN_NAME}", flush=True)
    failed, left_out = 0, []
    for part in args.parts:
        budget = part.budget_s * (DRY_RUN_SLACK if args.dry_run else 1)
        left = deadline - time.monotonic()
        if budget > left:  # it could be stopped half-way: left for the next call, whole
            left_out.append(part.name)
            print(f"\n== {part.name}: not run: its budget of {budget} s is over the {max(left, 0):.0f} s left of "
                  f"--budget {args.budget:g}", flush=True)
            report.add_part(args.out, header, part.name, {"status": "not run", "about": part.about, "checks": [],
                                                          "budget_s": budget, "wall_s": 0.0})
            continue
        print(f"\n== {part.name} (budget {budget} s): {part.about}", flush=True)
        result = run_part(part, args, header)
        report.add_part(args.out, header, part.name, result)
        failed += result["status"] != "ok"
        print(f"== {part.name}: {result['status']} in {result['wall_s']:.1f} s", flush=True)
    problems = report.check_out_dir(args.out)
    for problem in problems:
        print(f"warning: {problem}")
    ran = len(args.parts) - len(left_out)
    print(f"\nreport: {args.out / report.MARKDOWN_NAME} and {report.JSON_NAME}; {failed} of {ran} parts run not ok")
    if left_out:
        print(f"not run within --budget {args.budget:g}: {', '.join(left_out)}; the next call: python3 -m "
              f"bench.gpu_check --parts {','.join(left_out)} --out {args.out}")
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main())
