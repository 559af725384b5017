"""The planner's measured view of this machine: a `Profile` (what `shoal plan --calibrate`
measured), its JSON file, and the lookups the cost model makes in it (a collective's time, the
`Cluster` of a local run). Pure Python: the planner imports it without torch.

Collectives are fitted to `time = alpha + beta * nbytes` (`fit_alpha_beta`); the planner uses
that fit directly on CPU (gloo's algorithms are not NCCL's ring, so the ring formulas over a
Link would mispredict them), with the in-step latency of a group (`Profile.in_step`) in place of
alpha for the calls a step blocks on. shoal.calibration.calibrate measures a profile.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from shoal.planner.hardware import DEVICES, Cluster, Link, host_memory_bytes

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")
"""The collective kinds measured; `nbytes` is always the full tensor one rank holds: all_reduce's
buffer, all_gather's output, reduce_scatter's input, all_to_all's send buffer, the message of
send_recv (even ranks send to the next odd rank, all pairs at once), broadcast's tensor."""

IN_STEP_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "ring")
"""The calls a step blocks on. A pipeline's sends are not among them: they are posted ahead and waited
for late (its waiting is the bubble)."""

PROFILE_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class CollectiveFit:
    """One collective at one world size: `time = alpha + beta * nbytes` and the points it was fitted to."""

    alpha: float
    """Seconds: the time of an empty message (latency and synchronisation)."""
    beta: float
    """Seconds per byte of the tensor one rank holds (1 / beta is the effective bandwidth)."""
    points: tuple[tuple[int, float], ...]
    """(nbytes, seconds per call), by size: the median over repetitions of the slowest rank's
    mean over back-to-back calls, so a reader can check the fit."""

    def time(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes


@dataclass(frozen=True, kw_only=True)
class Profile:
    """What `calibrate` measured on one machine; every per-N figure is per process with N running at once."""

    hostname: str
    torch_version: str
    cpu_model: str
    date: str
    """When it was measured, ISO 8601 in UTC."""
    quick: bool
    """True for the quick mode (fewer sizes and repetitions: noisier)."""
    load_average: float
    """The 1-minute load average as it started: near the core count, other work shared the cores
    and every figure below is pessimistic."""
    matmul_flops: Mapping[int, Mapping[str, float]]
    """N -> dtype ("fp32", "bf16" when it beats a quarter of fp32) -> median FLOP/s over the shapes."""
    matmul_by_shape: Mapping[int, Mapping[str, Mapping[str, float]]]
    """N -> dtype -> "MxKxN" -> FLOP/s, the numbers behind the median."""
    memory_bw: Mapping[int, float]
    """N -> bytes/s: the mean of a large elementwise add and copy."""
    memory_by_op: Mapping[int, Mapping[str, float]]
    """N -> "add" / "copy" -> bytes/s."""
    collectives: Mapping[int, Mapping[str, CollectiveFit]]
    """N -> kind (see COLLECTIVES) -> fit; only for N > 1."""
    training_flops: Mapping[int, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    """N -> "linear" / "attention" -> FLOP/s of a linear layer's forward and backward through
    autograd and of causal attention's (fp32): the rates a training step's kernels reach."""
    dtensor_dispatch: Mapping[int, float] = dataclasses.field(default_factory=dict)
    """N -> the same for an op on a DTensor (tensor parallelism's ops): sharding propagation and
    wrapping on top of the op."""
    in_step: Mapping[int, Mapping[str, Mapping[str, float]]] = dataclasses.field(default_factory=dict)
    """N -> group size g (a string, JSON's keys) -> kind -> seconds a small collective over groups of g
    ranks takes when the ranks come to it from compute, as in a training step, with all N processes
    running (N/g groups at once). Measured: a few ms of matmuls then the call, less the matmuls
    alone. Where processes outnumber cores, a rank the scheduler has set aside holds up the others:
    far more than back-to-back calls show. "ring" is cp's exchange (each rank sends to the next and
    receives from the previous). Empty in a profile that does not hold it."""
    dispatch: Mapping[int, float] = dataclasses.field(default_factory=dict)
    """N -> seconds of host time per eager op on a tiny tensor, its backward included: what an op
    costs beyond its arithmetic (dispatch, autograd bookkeeping), which small models pay per op."""

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["format"] = PROFILE_FORMAT
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """The inverse of `to_json`; ValueError, KeyError, TypeError or AttributeError on anything else."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.pop("format", None) != PROFILE_FORMAT:
            raise ValueError(f"not a profile of format {PROFILE_FORMAT}")
        data.setdefault("dispatch", {})
        data.setdefault("dtensor_dispatch", {})
        data.setdefault("training_flops", {})
        data.setdefault("in_step", {})
        for key in ("matmul_flops", "matmul_by_shape", "memory_bw", "memory_by_op", "collectives", "dispatch",
                    "dtensor_dispatch", "training_flops", "in_step"):
            data[key] = {int(n): v for n, v in data[key].items()}  # JSON keys are strings
        data["collectives"] = {
            n: {kind: CollectiveFit(alpha=float(f["alpha"]), beta=float(f["beta"]),
                                    points=tuple((int(b), float(t)) for b, t in f["points"]))
                for kind, f in fits.items()}
            for n, fits in data["collectives"].items()}
        return cls(**data)


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(alpha, beta) minimising sum(((alpha + beta * b - t) / t) ** 2) over the (bytes, seconds) points.

    Relative residuals (weights 1/t^2), because the sizes span four decades and timing noise is
    proportional to the time: a plain fit would let the 16 MB points' noise swamp the latency.
    Neither may be negative: if one would be, it is set to 0 and the other refitted alone.
    """
    if len({b for b, _ in points}) < 2:
        raise ValueError(f"fit_alpha_beta needs points at two or more sizes, got {list(points)}")
    w = [1.0 / t**2 for _, t in points]
    s = sum(w)
    sx = sum(wi * b for wi, (b, _) in zip(w, points))
    sxx = sum(wi * b * b for wi, (b, _) in zip(w, points))
    st = sum(wi * t for wi, (_, t) in zip(w, points))
    sxt = sum(wi * b * t for wi, (b, t) in zip(w, points))
    beta = (s * sxt - sx * st) / (s * sxx - sx * sx)
    alpha = (st - beta * sx) / s
    if alpha < 0:
        return 0.0, sxt / sxx
    if beta < 0:
        return st / s, 0.0
    return alpha, beta


def nearest(measured: Iterable[int], world_size: int) -> int:
    """The measured world size closest to `world_size`; on a tie the larger (the slower, more cautious guess)."""
    options = sorted(measured)
    if not options:
        raise ValueError("the profile has no measurements to choose from; rerun `shoal plan --calibrate`")
    return min(options, key=lambda m: (abs(m - world_size), -m))


def collective_time(profile: Profile, kind: str, world_size: int, nbytes: float, *, group: int | None = None) -> float:
    """Seconds for one `kind` collective over a `nbytes` tensor (see COLLECTIVES) on `world_size` ranks,
    in groups of `group` ranks (default: all of them). The bytes cost what they cost with every
    process running; the fixed cost is the in-step latency of a group of that size where the
    profile has it (Profile.in_step), else back-to-back calls' alpha.

    0 at world size 1; a world size not measured uses the nearest measured one.
    """
    if kind not in (*COLLECTIVES, "ring"):
        raise ValueError(f"unknown collective {kind!r}; valid: {', '.join(COLLECTIVES)}, ring")
    if world_size <= 1:
        return 0.0
    measured = "send_recv" if kind == "ring" else kind  # a ring hop moves a point-to-point message
    n = nearest((m for m, fits in profile.collectives.items() if measured in fits), world_size)
    fit = profile.collectives[n][measured]
    groups = profile.in_step.get(n, {})
    latency = fit.alpha
    if groups and kind in IN_STEP_KINDS:  # a step's collectives come from compute
        latency = groups[str(nearest((int(size) for size in groups), group or world_size))].get(kind, fit.alpha)
    return latency + fit.beta * nbytes


def local_cluster(profile: Profile, world_size: int) -> Cluster:
    """A one-node `Cluster` of `world_size` "cpu" processes carrying the numbers measured at that size.

    Peak FLOP/s are the measured matmul rates (so matmul_efficiency is 1), memory bandwidth the
    measured one, memory the machine's RAM shared by the processes, and the intra-node Link is
    point-to-point send_recv (latency alpha, bandwidth 1/beta). A world size that was not measured
    takes the nearest measured one (ties: the larger); that misses the change in core sharing
    between measured sizes, so measure the sizes you plan for. World size 1 has no collectives
    of its own: its link comes from the nearest N > 1.
    """
    base = DEVICES["cpu"]
    n = nearest(profile.matmul_flops, world_size)
    intra = base.intra
    with_p2p = [m for m, fits in profile.collectives.items() if "send_recv" in fits]
    if with_p2p:
        fit = profile.collectives[nearest(with_p2p, max(world_size, 2))]["send_recv"]
        intra = Link(bandwidth=1.0 / fit.beta if fit.beta > 0 else float("inf"), efficiency=1.0,
                     latency=fit.alpha, name="gloo send/recv (calibrated)")
    peak = dict(profile.matmul_flops[n])
    attention_efficiency = None
    if profile.training_flops:  # what training's kernels reach, rather than a bare product's
        train = profile.training_flops[nearest(profile.training_flops, world_size)]
        peak["fp32"] = train["linear"]
        attention_efficiency = min(1.0, train["attention"] / train["linear"])
    device = dataclasses.replace(
        base, peak_flops=peak, matmul_efficiency=1.0, attention_efficiency=attention_efficiency,
        memory_bytes=host_memory_bytes() // world_size,
        memory_bw=profile.memory_bw[nearest(profile.memory_bw, world_size)], intra=intra, per_node=world_size,
        op_overhead=profile.dispatch[nearest(profile.dispatch, world_size)] if profile.dispatch else base.op_overhead,
        dtensor_overhead=(profile.dtensor_dispatch[nearest(profile.dtensor_dispatch, world_size)]
                          if profile.dtensor_dispatch else base.dtensor_overhead),
        source=f"calibrated on {profile.hostname} at {profile.date}, {n} processes at once",
    )
    return Cluster(device=device, num_nodes=1, per_node=world_size, intra=intra, inter=base.inter)


# ----------------------------------------------------------------------------- files


def default_profile_path() -> Path:
    """$SHOAL_PROFILE if set, else ~/.cache/shoal/profile.json."""
    env = os.environ.get("SHOAL_PROFILE")
    return Path(env) if env else Path.home() / ".cache" / "shoal" / "profile.json"


def save_profile(profile: Profile, path: Path | str | None = None) -> Path:
    """Write `profile` as JSON, atomically: a reader sees the old file or the new one, never half of one."""
    path = Path(path) if path is not None else default_profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(profile.to_json())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_profile(path: Path | str | None = None) -> Profile | None:
    """The saved profile, or None if there is none; ValueError (one line) if the file is not one."""
    path = Path(path) if path is not None else default_profile_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return Profile.from_json(text)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        why = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{path} is not a readable calibration profile ({why}); "
                         "rerun `shoal plan --calibrate` to measure this machine again") from None


