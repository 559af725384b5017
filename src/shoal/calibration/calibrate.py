"""Measure this machine for the planner: `calibrate()` returns a `Profile` (shoal.planner.profile)
of matmul rates, memory bandwidth, per-op host costs and collective times.

The cost formulas need three numbers per device (achievable matmul FLOP/s, memory bandwidth,
and how long each collective takes for a given size). On a CPU these depend on how many
processes share the cores, so each world size N is measured with N gloo processes running the
same work at once (shoal.calibration.measure): what one rank of an N-process `shoal train` run will
see. Each N is one `shoal.infra.pool.WorkerPool` (spawned, one thread per process) that measures
everything in one task, because importing torch in each process costs more than most
measurements. Collectives are fitted to `time = alpha + beta * nbytes` by least squares over
sizes from 1 KB to 16 MB. The profile is saved as JSON at `default_profile_path()`.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shoal.planner.profile import COLLECTIVES, CollectiveFit, Profile, fit_alpha_beta


def calibrate(world_sizes: Sequence[int] = (1, 2, 4), *, quick: bool = False, progress: bool = True) -> Profile:
    """Measure this machine at each world size (N processes at once, one thread each); see the module docstring.

    Collectives are measured at each N > 1. `quick` takes fewer sizes, shorter windows and fewer
    repetitions (faster, noisier). Run it on a
    quiet machine: other processes on the cores slow every figure (see Profile.load_average).
    """
    import torch
    from tqdm import tqdm

    if not world_sizes or any(n < 1 for n in world_sizes):
        raise ValueError(f"world_sizes must be positive process counts, got {tuple(world_sizes)}")
    sizes = sorted(set(world_sizes))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    raw: dict[int, dict[str, Any]] = {}
    # started, matmul, memory, dispatch, kinds, in-step, exited
    steps = sum(5 + (len(COLLECTIVES) + 1 if n > 1 else 0) for n in sizes)
    with tqdm(total=steps, desc="calibrating", unit="step", disable=not progress) as bar:
        for n in sizes:
            raw[n] = _measure_at(n, quick, bar)
            bar.update(1)
    return _profile(raw, quick=quick, torch_version=torch.__version__, load=load)


def _measure_at(world_size: int, quick: bool, bar: Any, timeout_s: float = 600.0) -> dict[str, Any]:
    """Rank 0's measurements on a fresh pool of `world_size` processes (fresh: nothing else has
    run in them), its progress on `bar`."""
    from shoal.calibration.measure import measure, settings
    from shoal.infra.pool import WorkerPool

    def step(_rank: int, name: str) -> None:
        bar.update(1)
        bar.set_postfix_str(f"N={world_size} {name}")

    pool = WorkerPool(world_size, timeout_s=timeout_s, on_report=step)
    try:
        return pool.run(measure, settings(quick, world_size))[0]
    except (RuntimeError, TimeoutError) as exc:
        raise RuntimeError(f"calibration at world size {world_size} failed: {exc}") from None
    finally:
        pool.close()


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or "unknown"


def _profile(raw: Mapping[int, Mapping[str, Any]], *, quick: bool, torch_version: str, load: float) -> Profile:
    """Assemble the workers' measurements: medians over shapes, fits over sizes, bf16 kept only if useful."""
    flops: dict[int, dict[str, float]] = {}
    for n, r in raw.items():
        medians = {dtype: statistics.median(rates.values()) for dtype, rates in r["matmul"].items() if rates}
        flops[n] = {d: v for d, v in medians.items() if d == "fp32" or v > medians["fp32"] / 4}
    return Profile(
        hostname=socket.gethostname(), torch_version=torch_version, cpu_model=_cpu_model(), load_average=load,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), quick=quick,
        matmul_flops=flops,
        matmul_by_shape={n: {d: dict(v) for d, v in r["matmul"].items() if d in flops[n]} for n, r in raw.items()},
        memory_bw={n: (r["memory"]["add"] + r["memory"]["copy"]) / 2 for n, r in raw.items()},
        memory_by_op={n: dict(r["memory"]) for n, r in raw.items()},
        collectives={n: {kind: CollectiveFit(alpha=(ab := fit_alpha_beta(pts))[0], beta=ab[1],
                                             points=tuple((int(b), float(t)) for b, t in pts))
                         for kind, pts in r["collectives"].items()}
                     for n, r in raw.items() if r["collectives"]},
        dispatch={n: float(r["dispatch"]) for n, r in raw.items() if "dispatch" in r},
        dtensor_dispatch={n: float(r["dtensor_dispatch"]) for n, r in raw.items() if "dtensor_dispatch" in r},
        training_flops={n: {k: float(v) for k, v in r["training"].items()} for n, r in raw.items() if "training" in r},
        in_step={n: {g: {k: float(v) for k, v in kinds.items()} for g, kinds in r["in_step"].items()}
                 for n, r in raw.items() if "in_step" in r},
    )
