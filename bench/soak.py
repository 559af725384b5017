"""Soak: many runs in a row, counting crashes, hangs and wrong losses.

Each run is a real `shoal train` in its own process tree (the launcher and its workers), as a user starts it:
- `default`: `shoal train` with no flags, `--runs` times; every one must end at the same final loss, bit for
  bit (same seed, same plan, same machine: a run that differs trained on something else);
- the other plans (`--plans`, each `--other-runs` times, a short run of each): fsdp2, tp2, pp2 and ep2 on the
  tiny MoE; each plan's runs must agree with each other bit for bit too.
With `--load`, a second `shoal train` loop runs beside them the whole time (the crashes this bench hunts
appeared under load). With `--tests N`, the multi-process test files run N times under the same load, and
every task the suite reran after a worker crash (tests/conftest.py) is counted as a crash. With
`--malloc-check`, those test runs load glibc's checking allocator (libc_malloc_debug.so.0 with MALLOC_CHECK_=3:
a corrupt heap aborts at the first check that sees it, nearer its cause); the pool workers run on glibc, so the
check covers them.

A run is a crash when its process tree ends by a signal or the launcher names a worker killed by one; a
hang when it outlives `--timeout` (killed, counted, the next run starts); wrong when it exits 0 with a final
loss other than its plan's first run's. The first lines of each crash's output (faulthandler's dump, the
launcher's report) are printed.

Goal: 0 crashes, 0 hangs and 0 wrong losses in 30 default runs and 10 runs of each other plan under load,
and in 3 runs of the multi-process test files under load.

    python -m bench.soak [--runs 30] [--other-runs 10] [--plans fsdp2,tp2,pp2,ep2] [--load] [--tests 3]
                         [--malloc-check]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import report

OTHER_PLANS: dict[str, list[str]] = {
    "fsdp2": ["--plan", "fsdp2", "--nproc", "2"],
    "tp2": ["--plan", "tp2", "--nproc", "2"],
    "pp2": ["--plan", "pp2", "--nproc", "2"],
    "ep2": ["--plan", "ep2", "--nproc", "2", "--model", "tiny-moe"],
}
"""The other plans and the flags that select them; each runs SHORT beside them."""
SHORT = ["--steps", "40", "--eval-every", "20", "--ckpt-every", "20", "--log-every", "10"]
"""A short run: long enough for checkpoints, evaluation and a few log windows."""
MULTI_PROCESS_TESTS = ("tests/test_parity_zero.py", "tests/test_parity_tp.py", "tests/test_pipeline.py",
                       "tests/test_moe_parallel.py", "tests/test_context.py", "tests/test_runtime.py")
"""Test files whose tasks run on the gloo worker pools (where the heap corruptions were seen)."""
CRASH_WORDS = re.compile(r"Fatal Python error|Segmentation fault|killed by signal|SIGSEGV|SIGABRT|SIGBUS|"
                         r"malloc\(\)|double free|corrupted", re.IGNORECASE)
MALLOC_DEBUG = "libc_malloc_debug.so.0"
"""glibc's checking allocator (glibc >= 2.34 moved MALLOC_CHECK_ into it); the loader finds it by name."""
RERUN_SECTION = "tasks rerun after a worker crashed in C"
"""The heading tests/conftest.py prints above the tasks it reran after a worker crash."""


@dataclass
class Tally:
    """Outcomes of one kind of run."""

    runs: int = 0
    crashes: int = 0
    hangs: int = 0
    wrong: int = 0
    failures: int = 0
    """Non-zero exits that are neither a signal nor a hang (a bug of another kind: counted, shown)."""
    losses: list[float] = field(default_factory=list)
    dumps: list[str] = field(default_factory=list)


def shoal_train(args: list[str], out: Path, timeout_s: float) -> tuple[str, str, float | None]:
    """One `shoal train` run: (outcome: ok|crash|hang|failed, its output's tail, final loss or None)."""
    cmd = [sys.executable, "-m", "shoal", "train", "--out", str(out), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return "hang", output[-2000:], None
    if proc.returncode < 0 or (proc.returncode != 0 and CRASH_WORDS.search(output)):
        return "crash", output[-2000:], None
    if proc.returncode != 0:
        return "failed", output[-2000:], None
    summary = out / "summary.json"
    loss = json.loads(summary.read_text())["final_loss"] if summary.exists() else None
    return "ok", "", loss


def soak_plan(name: str, flags: list[str], runs: int, timeout_s: float) -> Tally:
    """`runs` runs of one plan, each in a fresh folder, checked against the first one's final loss."""
    tally = Tally()
    for i in range(runs):
        with tempfile.TemporaryDirectory(prefix=f"soak-{name}-") as tmp:
            outcome, tail, loss = shoal_train(flags, Path(tmp) / "run", timeout_s)
        tally.runs += 1
        if outcome == "crash":
            tally.crashes += 1
            tally.dumps.append(_first_lines(tail))
        elif outcome == "hang":
            tally.hangs += 1
        elif outcome == "failed":
            tally.failures += 1
            tally.dumps.append(_first_lines(tail))
        elif loss is not None:
            tally.losses.append(loss)
            if loss != tally.losses[0]:
                tally.wrong += 1
        print(f"  {name} run {i + 1}/{runs}: {outcome}" + (f", final loss {loss!r}" if loss is not None else ""),
              flush=True)
    return tally


def soak_tests(times: int, timeout_s: float, malloc_check: bool = False) -> Tally:
    """The multi-process test files `times` times; each task conftest reran after a worker crash is a crash.
    malloc_check: under glibc's checking allocator (MALLOC_DEBUG)."""
    tally = Tally()
    checks = {"LD_PRELOAD": MALLOC_DEBUG, "MALLOC_CHECK_": "3"} if malloc_check else {}
    for i in range(times):
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MULTI_PROCESS_TESTS]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1", **checks})
            output = done.stdout + done.stderr
        except subprocess.TimeoutExpired:
            tally.runs, tally.hangs = tally.runs + 1, tally.hangs + 1
            continue
        tally.runs += 1
        reruns = _reruns(output)
        tally.crashes += len(reruns)
        tally.dumps += reruns
        if done.returncode != 0:
            tally.failures += 1
            tally.dumps.append(_first_lines(output[-2000:]))
        print(f"  tests run {i + 1}/{times}: exit {done.returncode}, {len(reruns)} task(s) rerun after a crash",
              flush=True)
    return tally


def _reruns(output: str) -> list[str]:
    """The tasks listed under conftest's rerun section."""
    if RERUN_SECTION not in output:
        return []
    section = output.split(RERUN_SECTION, 1)[1]
    return [line.strip() for line in section.splitlines() if "was killed by SIG" in line]


def _first_lines(tail: str, n: int = 12) -> str:
    lines = [line for line in tail.splitlines() if line.strip()]
    crash = next((i for i, line in enumerate(lines) if CRASH_WORDS.search(line)), max(0, len(lines) - n))
    return "\n".join(lines[crash:crash + n])


class Load:
    """A second `shoal train` loop beside the soak, restarted as each of its runs ends, until stopped."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.runs = 0

    def _loop(self) -> None:
        while not self._stop.is_set():
            with tempfile.TemporaryDirectory(prefix="soak-load-") as tmp:
                shoal_train(["--steps", "100000", "--log-every", "50", "--ckpt-every", "0"], Path(tmp) / "run",
                            timeout_s=120)  # cut every 2 minutes: a fresh start, as a loop of user runs has
            self.runs += 1

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="default `shoal train` runs")
    parser.add_argument("--other-runs", type=int, default=10, help="runs of each other plan")
    parser.add_argument("--plans", default=",".join(OTHER_PLANS), help=f"of {', '.join(OTHER_PLANS)}; '' for none")
    parser.add_argument("--load", action="store_true", help="a second shoal train loop beside the soak")
    parser.add_argument("--tests", type=int, default=0, help="runs of the multi-process test files")
    parser.add_argument("--malloc-check", action="store_true",
                        help=f"the test files' runs under glibc's checking allocator ({MALLOC_DEBUG})")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds after which a run is a hang")
    args = parser.parse_args()
    plans = [p for p in args.plans.split(",") if p]
    for plan in plans:
        if plan not in OTHER_PLANS:
            parser.error(f"--plans {plan} is not valid; valid: {', '.join(OTHER_PLANS)}")
    tallies: dict[str, Tally] = {}
    load = Load() if args.load else None
    started = time.monotonic()
    with load or contextlib.nullcontext():
        if args.runs:
            tallies["default"] = soak_plan("default", [], args.runs, args.timeout)
        for plan in plans:
            tallies[plan] = soak_plan(plan, [*OTHER_PLANS[plan], *SHORT], args.other_runs, args.timeout)
        if args.tests:
            tallies["tests"] = soak_tests(args.tests, args.timeout * 4, args.malloc_check)
    rows = [{"kind": kind, "runs": t.runs, "crashes": t.crashes, "hangs": t.hangs, "wrong_losses": t.wrong,
             "other_failures": t.failures,
             "final_losses": ", ".join(f"{loss!r} x{n}" for loss, n in Counter(t.losses).items())}
            for kind, t in tallies.items()]
    report("soak", rows, notes=f"load: {'on' if load else 'off'}"
           + ("; tests under glibc's malloc checks" if args.malloc_check else "")
           + (f" ({load.runs} load runs)" if load else "") + f"; {time.monotonic() - started:.0f} s")
    for kind, t in tallies.items():
        for dump in t.dumps:
            print(f"\n-- {kind}: first lines of a crash or failure\n{dump}")
    sys.exit(1 if any(t.crashes or t.hangs or t.wrong or t.failures for t in tallies.values()) else 0)


if __name__ == "__main__":
    main()
