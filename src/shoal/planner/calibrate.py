"""Measure this machine for the planner: matmul rate, memory bandwidth and collective times.

The cost formulas need three numbers per device (achievable matmul FLOP/s, memory bandwidth,
and how long each collective takes for a given size). On a CPU these depend on how many
processes share the cores, so each world size N is measured with N gloo processes running
the same work at once: what one rank of an N-process `shoal train` run will see.

Each N is started once (spawn, one thread per process) and measures everything inside that
launch, because importing torch in each process costs more than most measurements.
Collectives are fitted to `time = alpha + beta * nbytes` by least squares over sizes from
1 KB to 16 MB; the planner uses that fit directly on CPU (gloo's algorithms are not NCCL's
ring, so the ring formulas over a Link would mispredict them). Back-to-back calls understate
what a step's collectives cost where processes outnumber cores: the ranks come to each call from
compute, and one the scheduler has set aside holds up the rest. So the calls a step blocks on are
also timed after a few ms of matmuls, in groups of each size that divides N (`Profile.in_step`);
that latency replaces alpha. The result is a `Profile`, saved as JSON at `default_profile_path()`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import queue as queue_mod
import socket
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.planner.hardware import DEVICES, Cluster, Link

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")
"""The collective kinds measured; `nbytes` is always the full tensor one rank holds: all_reduce's
buffer, all_gather's output, reduce_scatter's input, all_to_all's send buffer, the message of
send_recv (even ranks send to the next odd rank, all pairs at once), broadcast's tensor."""

MATMUL_SHAPES = ((128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (4096, 128, 384))
"""(M, K, N) of the timed products (M x K) @ (K x N): square sizes and one skinny, activation-shaped one."""

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
    receives from the previous). Empty in profiles from before it was measured."""
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


# ----------------------------------------------------------------------------- pure pieces


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
        memory_bytes=_ram_bytes(base.memory_bytes) // world_size,
        memory_bw=profile.memory_bw[nearest(profile.memory_bw, world_size)], intra=intra, per_node=world_size,
        op_overhead=profile.dispatch[nearest(profile.dispatch, world_size)] if profile.dispatch else base.op_overhead,
        dtensor_overhead=(profile.dtensor_dispatch[nearest(profile.dtensor_dispatch, world_size)]
                          if profile.dtensor_dispatch else base.dtensor_overhead),
        source=f"calibrated on {profile.hostname} at {profile.date}, {n} processes at once",
    )
    return Cluster(device=device, num_nodes=1, per_node=world_size, intra=intra, inter=base.inter)


def _ram_bytes(default: int) -> int:
    names = ("SC_PAGE_SIZE", "SC_PHYS_PAGES")
    return os.sysconf(names[0]) * os.sysconf(names[1]) if all(n in os.sysconf_names for n in names) else default


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


# ----------------------------------------------------------------------------- measuring (in the workers)


@dataclass(frozen=True)
class _Settings:
    seconds: float  # timed window per matmul shape and per memory op
    sizes: tuple[int, ...]  # collective sizes in bytes
    warmup: int
    reps: int
    rep_seconds: float  # a collective repetition repeats the call until it lasts about this long
    collectives: bool


def _settings(quick: bool, world_size: int) -> _Settings:
    # A small collective is short next to what a process loses when another takes its core: a
    # repetition averages back-to-back calls over a few ms, and the median over an
    # odd number of repetitions drops those another process disturbed.
    if quick:
        return _Settings(0.1, tuple(2**k for k in (10, 14, 18, 22, 24)), 1, 5, 0.003, world_size > 1)
    return _Settings(0.3, tuple(2**k for k in range(10, 25, 2)), 2, 9, 0.01, world_size > 1)


def _rate(fn: Callable[[], Any], work: float, seconds: float) -> float:
    """work/s of `fn` in a window of `seconds` (after one warm-up call); all ranks start together."""
    import torch.distributed as dist

    fn()
    dist.barrier()
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or count == 0:
        fn()
        count += 1
    return work * count / elapsed


def _median_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    values = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(values, torch.tensor([value], dtype=torch.float64))
    return statistics.median(v.item() for v in values)


def _measure_matmul(s: _Settings) -> dict[str, dict[str, float]]:
    """dtype -> shape -> FLOP/s; bf16 stops at the first shape slower than fp32/4 (a slow dtype is slow to time)."""
    import torch

    out: dict[str, dict[str, float]] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out[name] = {}
        for m, k, n in MATMUL_SHAPES:
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            c = torch.empty(m, n, dtype=dtype)
            key = f"{m}x{k}x{n}"
            # _rate calls the lambda before the next iteration rebinds a, b, c.
            out[name][key] = _median_over_ranks(_rate(lambda: torch.mm(a, b, out=c), 2.0 * m * k * n, s.seconds))  # noqa: B023
            if name == "bf16" and out[name][key] < out["fp32"][key] / 4:
                break  # the same median on every rank, so all stop together
    return out


def _measure_memory(s: _Settings) -> dict[str, float]:
    """bytes/s of an elementwise add (2 reads, 1 write) and a copy (1 read, 1 write) on 32 MB tensors."""
    import torch

    numel = 2**23
    a, b, c = torch.ones(numel), torch.ones(numel), torch.empty(numel)
    add = _rate(lambda: torch.add(a, b, out=c), 3 * 4 * numel, s.seconds)
    copy = _rate(lambda: c.copy_(a), 2 * 4 * numel, s.seconds)
    return {"add": _median_over_ranks(add), "copy": _median_over_ranks(copy)}


def _chain_step(x: Any, finish: Callable[[Any], Any], chain: int) -> Callable[[], None]:
    """One pass of a chain of `chain` tiny elementwise ops on `x`, then `finish` (which turns the result
    into a scalar) and the backward of it all: chain + 1 ops, each with its backward."""
    def step() -> None:
        y = x
        for _ in range(chain // 2):
            y = y * 1.0001 + 0.0001
        finish(y).backward()

    return step


def _chain_seconds(x: Any, finish: Callable[[Any], Any], s: _Settings, chain: int = 32) -> float:
    """Seconds per op of `_chain_step`: an op's cost beyond its arithmetic."""
    return _median_over_ranks(1.0 / _rate(_chain_step(x, finish, chain), chain + 1, s.seconds))


def _measure_dispatch(s: _Settings) -> float:
    """Seconds per forward op, its backward included, on an 8-element tensor."""
    import torch

    return _chain_seconds(torch.randn(8, requires_grad=True), lambda y: y.sum(), s)


TRAIN_SHAPES = ((512, 128, 384), (2048, 128, 384), (2048, 512, 512), (512, 1024, 1024))
"""(tokens, in, out) of the timed linear layers, forward and backward: activation-shaped products."""
ATTENTION_SHAPES = ((4, 8, 128, 16), (2, 8, 512, 64))
"""(batch, heads, sequence, head dim) of the timed causal attention, forward and backward."""


def _measure_training_kernels(s: _Settings) -> dict[str, float]:
    """FLOP/s of what a training step runs, as it runs them: a linear layer's forward and both
    backward products through autograd (6 T K N FLOPs, allocation included), and causal SDPA's
    forward and backward (3 x 2 x 2 B H T^2 E / 2 FLOPs: the causal half of QK^T and AV, backward
    twice the forward). Median over shapes."""
    import torch
    import torch.nn.functional as F

    linear = []
    for t, k, n in TRAIN_SHAPES:
        x = torch.randn(t, k, requires_grad=True)
        w = torch.randn(n, k, requires_grad=True)
        g = torch.randn(t, n)
        # _rate calls each lambda before the next iteration rebinds its tensors.
        linear.append(_rate(lambda: F.linear(x, w).backward(g), 6.0 * t * k * n, s.seconds))  # noqa: B023
    attention = []
    for b, h, t, e in ATTENTION_SHAPES:
        query, key, value = (torch.randn(b, h, t, e, requires_grad=True) for _ in range(3))
        g = torch.randn(b, h, t, e)
        attention.append(_rate(lambda: F.scaled_dot_product_attention(query, key, value, is_causal=True).backward(g),  # noqa: B023
                               3 * 2 * 2 * b * h * t * t * e / 2, s.seconds))
    return {"linear": _median_over_ranks(statistics.median(linear)),
            "attention": _median_over_ranks(statistics.median(attention))}


def _measure_dtensor_dispatch(s: _Settings) -> float:
    """The same on a DTensor sharded over every rank (no communication): what tensor
    parallelism's DTensor ops cost beyond a plain op's (sharding propagation, wrapping)."""
    return _median_over_ranks(1.0 / _rate(dtensor_chain_step(), DTENSOR_CHAIN + 1, s.seconds))


DTENSOR_CHAIN = 16
"""Elementwise ops in the DTensor chain (then its sum: DTENSOR_CHAIN + 1 ops, each with its backward)."""


def dtensor_chain_step() -> Callable[[], None]:
    """One pass of the chain `_measure_dtensor_dispatch` times, on a DTensor sharded over every rank
    of the default group (shoal.planner.counts counts the dispatches it runs)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = distribute_tensor(torch.randn(8 * dist.get_world_size()), mesh, [Shard(0)]).requires_grad_()
    return _chain_step(x, lambda y: y.to_local().sum(), DTENSOR_CHAIN)


def _collective(kind: str, nbytes: int, group: Any = None) -> Callable[[], Any]:
    """A call of `kind` over an fp32 tensor of about `nbytes` (rounded to a multiple of the group's
    size) in `group` (None: the world)."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = max(world, nbytes // 4 // world * world)
    full, part = torch.zeros(numel), torch.zeros(numel // world)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if kind == "all_gather":
        return lambda: dist.all_gather_single(full, part, group=group)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(part, full, group=group)
    if kind == "all_to_all":
        recv = torch.zeros(numel)
        return lambda: dist.all_to_all_single(recv, full)
    if kind == "broadcast":
        return lambda: dist.broadcast(full, src=0)
    if kind == "ring":  # context parallelism's hop: send to the next rank, receive from the previous
        ahead, behind = ((rank + step) % world if group is None else dist.get_global_rank(group, (rank + step) % world)
                         for step in (1, -1))
        recv = torch.zeros(numel)
        return lambda: [w.wait() for w in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, full, ahead, group), dist.P2POp(dist.irecv, recv, behind, group)])]
    assert kind == "send_recv", kind
    if rank % 2 == 0 and rank + 1 < world:
        return lambda: dist.send(full, dst=rank + 1)
    if rank % 2 == 1:
        return lambda: dist.recv(full, src=rank - 1)
    return lambda: None  # the odd one out of an odd world size


def _measure_collective(kind: str, s: _Settings) -> list[tuple[int, float]]:
    """(nbytes, seconds per call) by size: the median over repetitions of the slowest rank's mean
    over back-to-back calls. Every repetition starts at a barrier; the repetitions of the sizes
    are interleaved, so that a burst of other load spoils one repetition of several sizes (which
    the median drops) rather than every repetition of one size."""
    import torch
    import torch.distributed as dist

    fns = [_collective(kind, nbytes) for nbytes in s.sizes]
    once = torch.zeros(len(fns), dtype=torch.float64)
    for j, fn in enumerate(fns):
        start = time.perf_counter()
        for _ in range(s.warmup):
            fn()
        once[j] = (time.perf_counter() - start) / s.warmup
    dist.all_reduce(once, op=dist.ReduceOp.MAX)  # every rank must make the same number of calls
    calls = [max(1, min(32, int(s.rep_seconds / t))) for t in once.tolist()]
    times = torch.zeros(len(fns), s.reps, dtype=torch.float64)
    for i in range(s.reps):
        for j, fn in enumerate(fns):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls[j]):
                fn()
            times[j, i] = (time.perf_counter() - start) / calls[j]
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return [(nbytes, statistics.median(row)) for nbytes, row in zip(s.sizes, times.tolist())]


IN_STEP_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "ring")
"""The calls a step blocks on. A pipeline's sends are not among them: they are posted ahead and waited
for late (its waiting is the bubble)."""
IN_STEP_COMPUTE_S = 0.003
"""Seconds of matmuls before each timed call: of the order of what a small model's block computes
between two of its collectives on a CPU, so that the ranks come to the call as in a training step."""


def _measure_in_step(s: _Settings) -> dict[str, dict[str, float]]:
    """Group size -> kind -> seconds a 4 KB collective adds after IN_STEP_COMPUTE_S of compute (see
    Profile.in_step), for groups of every size from 2 to the world that divides it: the median over
    repetitions of the slowest rank's (compute + call) less its compute alone."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    a = torch.randn(128, 128)
    t0 = time.perf_counter()
    for _ in range(20):
        torch.mm(a, a)
    count = torch.tensor([max(1, round(IN_STEP_COMPUTE_S / ((time.perf_counter() - t0) / 20)))], dtype=torch.float64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)  # the same compute on every rank
    chunk = int(count.item())

    def compute() -> None:
        for _ in range(chunk):
            torch.mm(a, a)

    out: dict[str, dict[str, float]] = {}
    for size in (g for g in range(2, world + 1) if world % g == 0):
        group = None if size == world else dist.new_subgroups(group_size=size)[0]
        calls = {kind: _collective(kind, 4096, group) for kind in IN_STEP_KINDS}
        extra = torch.zeros(len(calls), s.reps, dtype=torch.float64)
        for i in range(s.reps):
            for j, fn in enumerate(calls.values()):
                timed = []
                for with_call in (False, True):
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(8):
                        compute()
                        if with_call:
                            fn()
                    timed.append((time.perf_counter() - start) / 8)
                extra[j, i] = max(0.0, timed[1] - timed[0])
        dist.all_reduce(extra, op=dist.ReduceOp.MAX)
        out[str(size)] = {kind: statistics.median(row) for kind, row in zip(calls, extra.tolist())}
    return out


def _worker(rank: int, world_size: int, store_path: str, s: _Settings, results: Any) -> None:
    """One rank: join the gloo group, measure everything, rank 0 reports each step and the result."""
    try:
        import warnings

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        warnings.filterwarnings("ignore", category=UserWarning)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size),
                                rank=rank, world_size=world_size)
        say = (lambda step: results.put(("step", step))) if rank == 0 else (lambda step: None)
        say("started")
        out: dict[str, Any] = {"matmul": _measure_matmul(s)}
        say("matmul")
        out["memory"] = _measure_memory(s)
        say("memory")
        out["training"] = _measure_training_kernels(s)
        out["dispatch"] = _measure_dispatch(s)
        out["dtensor_dispatch"] = _measure_dtensor_dispatch(s)
        say("dispatch")
        out["collectives"] = {}
        for kind in COLLECTIVES if s.collectives else ():
            out["collectives"][kind] = _measure_collective(kind, s)
            say(kind)
        if s.collectives:
            out["in_step"] = _measure_in_step(s)
            say("in-step latency")
        if rank == 0:
            results.put(("done", out))
        dist.destroy_process_group()
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


def _launch(world_size: int, s: _Settings, bar: Any, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run `_worker` on `world_size` fresh processes; rank 0's measurements.

    The processes meet through a FileStore in a temporary folder rather than a TCP port, so two
    calibrations (or a test run beside one) cannot race for the same port.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="shoal-calibrate-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, store, s, results), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline, ok = time.monotonic() + timeout_s, False
        try:
            while True:
                try:
                    msg = results.get(timeout=1.0)
                except queue_mod.Empty:
                    dead = [f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(procs) if p.exitcode]
                    if dead or time.monotonic() > deadline:
                        why = dead[0] if dead else f"no result in {timeout_s:.0f} s"
                        raise RuntimeError(f"calibration at world size {world_size} failed: {why}") from None
                    continue
                if msg[0] == "error":
                    raise RuntimeError(f"calibration at world size {world_size} failed on rank {msg[1]}:\n{msg[2]}")
                if msg[0] == "done":
                    ok = True
                    return msg[1]
                bar.update(1)
                bar.set_postfix_str(f"N={world_size} {msg[1]}")
        finally:
            for p in procs:
                p.join(timeout=10 if ok else 0)
                if p.is_alive():
                    p.kill()
                    p.join()


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or "unknown"


def calibrate(world_sizes: Sequence[int] = (1, 2, 4), *, quick: bool = False, progress: bool = True) -> Profile:
    """Measure this machine at each world size (N processes at once, one thread each); see the module docstring.

    Collectives are measured at each N > 1. `quick` takes fewer sizes, shorter windows and fewer
    repetitions (under a minute here, noisier); the full run takes a few minutes. Run it on a
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
            raw[n] = _launch(n, _settings(quick, n), bar)
            bar.update(1)
    return _profile(raw, quick=quick, torch_version=torch.__version__, load=load)


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
