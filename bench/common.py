"""Shared pieces of the benchmarks: time a step, measure its peak memory, launch ranks, report.

Benchmarks compare shoal with a peer *in the same process tree*: both run inside one launch,
alternating repeat by repeat (ABAB...), so machine drift hits both alike. Timings are medians
over repeats after warm-up; the spread is reported beside them, and a ratio whose difference
from 1 is smaller than the spread is noise.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shoal.infra.launch import launch as shoal_launch
from shoal.infra.world import use_threads
from shoal.train.memory import current_mb, peak_mb, reset_peak

RESULTS = Path(__file__).resolve().parent / "results"


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, min, max and the inter-quartile range relative to the median."""
    ordered = sorted(samples)
    q = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    median = statistics.median(ordered)
    return {"median": median, "min": ordered[0], "max": ordered[-1],
            "iqr_rel": (q[2] - q[0]) / median if median else 0.0, "n": len(ordered)}


def time_step(step_fn: Callable[[], Any]) -> tuple[float, float]:
    """(seconds, peak MiB above the memory in use before the step) of one call."""
    reset_peak()
    before = current_mb()
    start = time.perf_counter()
    step_fn()
    elapsed = time.perf_counter() - start
    return elapsed, peak_mb() - before


def measure(step_fn: Callable[[], Any], *, warmup: int = 3, repeats: int = 10) -> dict[str, Any]:
    """Time `step_fn` `repeats` times after `warmup` calls; medians and spread of time and memory."""
    for _ in range(warmup):
        step_fn()
    times, peaks, absolute = [], [], []
    for _ in range(repeats):
        t, m = time_step(step_fn)
        times.append(t)
        peaks.append(m)
        absolute.append(peak_mb())
    return {"time_s": summarize(times), "step_peak_mb": summarize(peaks), "peak_mb": summarize(absolute)}


def measure_pair(fns: dict[str, Callable[[], Any]], *, warmup: int = 3, repeats: int = 10) -> dict[str, Any]:
    """Like `measure` for several step functions, interleaved repeat by repeat (A B A B ...)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, dict[str, list[float]]] = {k: {"t": [], "m": [], "a": []} for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if dist.is_initialized():
                dist.barrier()
            t, m = time_step(fn)
            samples[name]["t"].append(t)
            samples[name]["m"].append(m)
            samples[name]["a"].append(peak_mb())
    return {name: {"time_s": summarize(s["t"]), "step_peak_mb": summarize(s["m"]), "peak_mb": summarize(s["a"])}
            for name, s in samples.items()}


def _entry(call: tuple[Callable[..., Any], tuple[Any, ...]]) -> Any:
    """One rank of `launch`: one thread, a gloo process group for the call's length."""
    fn, args = call
    use_threads(1)
    dist.init_process_group("gloo")
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable[..., Any], nproc: int, *args: Any) -> list[Any]:
    """Run fn(*args) on `nproc` local ranks (gloo, one thread each) through shoal's launcher
    (shoal.infra.launch: torch's elastic launcher, what `shoal train` runs); the per-rank results
    in rank order. A failed rank raises shoal.infra.launch.WorkerFailed naming it."""
    results = shoal_launch(_entry, (fn, args), nproc=nproc)
    return [results[r] for r in range(nproc)]


def environment() -> dict[str, Any]:
    return {"torch": torch.__version__, "python": platform.python_version(), "cores": os.cpu_count(),
            "machine": platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def report(name: str, rows: list[dict[str, Any]], *, notes: str = "") -> Path:
    """Print `rows` as a table and write them (with the environment) to bench/results/<name>.json."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    cells = [[_fmt(row.get(k, "")) for k in keys] for row in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print(f"\n== {name}")
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)))
    if notes:
        print(notes)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"name": name, "env": environment(), "rows": rows, "notes": notes,
                                "argv": sys.argv}, indent=2))
    return path


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


RUN_RECORD = "bench_run.json"
"""The command and wall time of a finished `shoal train` run, beside the run's own files."""
PARTIAL_RECORD = "bench_partial.json"
"""The command and wall time so far of a started `shoal train` run (train_run's `resume`)."""


def train_run(name: str, command: list[str], run_dir: Path, *, fresh: bool,
              keep_checkpoints: bool = False, resume: list[str] | None = None) -> tuple[Path, float]:
    """Run `command` (a `shoal train` writing into `run_dir`), or find it finished by the same
    command (the interpreter's path may differ); (run folder, wall seconds). Checkpoints are
    removed afterwards unless `keep_checkpoints` (a teacher to distil from): an experiment reads
    metrics.jsonl, and they are the largest files. `resume`: the command that continues an
    interrupted run of `command` from its checkpoints (its `--resume run_dir --steps N`), run
    instead when `run_dir` holds an unfinished run of it; the wall time is then the sum of both."""
    record_path, partial_path = run_dir / RUN_RECORD, run_dir / PARTIAL_RECORD
    if not fresh and record_path.is_file():
        record = json.loads(record_path.read_text())
        if record["command"][1:] == command[1:]:
            print(f"{name}: finished run found in {run_dir}", flush=True)
            return run_dir, record["wall_s"]
    earlier, run = 0.0, command
    if not fresh and resume is not None and partial_path.is_file() and (run_dir / "checkpoints").is_dir():
        partial = json.loads(partial_path.read_text())
        if partial["command"][1:] == command[1:]:
            earlier, run = float(partial["wall_s"]), resume
            print(f"{name}: resuming the interrupted run in {run_dir}", flush=True)
    if run is command:
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
    print(f"{name}: training ({' '.join(run[1:])})", flush=True)
    start = time.perf_counter()
    partial_path.write_text(json.dumps({"command": command, "wall_s": earlier}))
    with subprocess.Popen(run, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        try:
            output = proc.communicate()[0]
        finally:  # interrupted: record the time spent, for the resumed run's wall time
            partial_path.write_text(json.dumps({"command": command, "wall_s": earlier + time.perf_counter() - start}))
    done = subprocess.CompletedProcess(run, proc.returncode, output)
    wall = earlier + time.perf_counter() - start
    if done.returncode:
        sys.exit(f"{name}: shoal train failed ({done.returncode}):\n{done.stdout[-3000:]}")
    if not keep_checkpoints:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    record_path.write_text(json.dumps({"command": command, "wall_s": wall}))
    print(f"{name}: {wall:.0f} s", flush=True)
    return run_dir, wall


def save_figure(fig: Any, path: Path) -> Path:
    """`fig` laid out and written to `path` (its folder made), at the docs' resolution."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path
