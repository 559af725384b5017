"""What each rank of a calibration measures (shoal.calibration.calibrate runs `measure` on N
processes at once): matmul and training-kernel rates, memory bandwidth, the host cost of an
eager op and of a DTensor op, and collective times, back to back and as a step meets them.

On a CPU these figures depend on how many processes share the cores, so every rank runs the same
work at the same time, starting together at barriers; each figure is the median over ranks, or
for collectives the slowest rank's. Back-to-back calls understate what a step's collectives cost
where processes outnumber cores: the ranks come to each call from compute, and one the scheduler
has set aside holds up the rest. So the calls a step blocks on are also timed after a few ms of
matmuls, in groups of each size that divides N (`Profile.in_step`).
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor

from shoal.infra.pool import report
from shoal.mesh import shared_mesh
from shoal.planner.profile import COLLECTIVES, IN_STEP_KINDS

MATMUL_SHAPES = ((128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (4096, 128, 384))
"""(M, K, N) of the timed products (M x K) @ (K x N): square sizes and one skinny, activation-shaped one."""


@dataclass(frozen=True)
class Settings:
    """How long and how often each figure is measured (`settings` gives the full and quick modes)."""

    seconds: float  # timed window per matmul shape and per memory op
    sizes: tuple[int, ...]  # collective sizes in bytes
    warmup: int
    reps: int
    rep_seconds: float  # a collective repetition repeats the call until it lasts about this long
    collectives: bool


def settings(quick: bool, world_size: int) -> Settings:
    # A small collective is short next to what a process loses when another takes its core: a
    # repetition averages back-to-back calls over a few ms, and the median over an
    # odd number of repetitions drops those another process disturbed.
    if quick:
        return Settings(0.1, tuple(2**k for k in (10, 14, 18, 22, 24)), 1, 5, 0.003, world_size > 1)
    return Settings(0.3, tuple(2**k for k in range(10, 25, 2)), 2, 9, 0.01, world_size > 1)


def _rate(fn: Callable[[], Any], work: float, seconds: float, *, start: Callable[[], Any] = dist.barrier,
          sync: Callable[[], Any] = lambda: None) -> float:
    """work/s of `fn` in a window of `seconds`, after one warm-up call and `start` (by default a barrier: all ranks
    start together); `sync` waits for the device after each call."""
    fn()
    sync()
    start()
    count, begin = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - begin) < seconds or count == 0:
        fn()
        sync()
        count += 1
    return work * count / elapsed


def matmul_flops(m: int, k: int, n: int, *, seconds: float, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", start: Callable[[], Any] = lambda: None) -> float:
    """FLOP/s of (m x k) @ (k x n) products of random `dtype` matrices on `device`, run back to back for about
    `seconds` after a warm-up product and `start` (a barrier where ranks time together); on a GPU each product is
    waited for before the clock is read."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    c = torch.empty(m, n, dtype=dtype, device=device)
    on_gpu = c.device.type == "cuda"
    return _rate(lambda: torch.mm(a, b, out=c), 2.0 * m * k * n, seconds, start=start,
                 sync=(lambda: torch.cuda.synchronize(c.device)) if on_gpu else (lambda: None))


def _median_over_ranks(value: float) -> float:
    values = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(values, torch.tensor([value], dtype=torch.float64))
    return statistics.median(v.item() for v in values)


def _measure_matmul(s: Settings) -> dict[str, dict[str, float]]:
    """dtype -> shape -> FLOP/s; bf16 stops at the first shape slower than fp32/4 (a slow dtype is slow to time)."""
    out: dict[str, dict[str, float]] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out[name] = {}
        for m, k, n in MATMUL_SHAPES:
            key = f"{m}x{k}x{n}"
            out[name][key] = _median_over_ranks(matmul_flops(m, k, n, dtype=dtype, seconds=s.seconds,
                                                             start=dist.barrier))
            if name == "bf16" and out[name][key] < out["fp32"][key] / 4:
                break  # the same median on every rank, so all stop together
    return out


def _measure_memory(s: Settings) -> dict[str, float]:
    """bytes/s of an elementwise add (2 reads, 1 write) and a copy (1 read, 1 write) on 32 MB tensors."""
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


def _chain_seconds(x: Any, finish: Callable[[Any], Any], s: Settings, chain: int = 32) -> float:
    """Seconds per op of `_chain_step`: an op's cost beyond its arithmetic."""
    return _median_over_ranks(1.0 / _rate(_chain_step(x, finish, chain), chain + 1, s.seconds))


def _measure_dispatch(s: Settings) -> float:
    """Seconds per forward op, its backward included, on an 8-element tensor."""
    return _chain_seconds(torch.randn(8, requires_grad=True), lambda y: y.sum(), s)


TRAIN_SHAPES = ((512, 128, 384), (2048, 128, 384), (2048, 512, 512), (512, 1024, 1024))
"""(tokens, in, out) of the timed linear layers, forward and backward: activation-shaped products."""
ATTENTION_SHAPES = ((4, 8, 128, 16), (2, 8, 512, 64))
"""(batch, heads, sequence, head dim) of the timed causal attention, forward and backward."""


def _measure_training_kernels(s: Settings) -> dict[str, float]:
    """FLOP/s of what a training step runs, as it runs them: a linear layer's forward and both
    backward products through autograd (6 T K N FLOPs, allocation included), and causal SDPA's
    forward and backward (3 x 2 x 2 B H T^2 E / 2 FLOPs: the causal half of QK^T and AV, backward
    twice the forward). Median over shapes."""
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


def _measure_dtensor_dispatch(s: Settings) -> float:
    """The same on a DTensor sharded over every rank (no communication): what tensor
    parallelism's DTensor ops cost beyond a plain op's (sharding propagation, wrapping)."""
    return _median_over_ranks(1.0 / _rate(dtensor_chain_step(), DTENSOR_CHAIN + 1, s.seconds))


DTENSOR_CHAIN = 16
"""Elementwise ops in the DTensor chain (then its sum: DTENSOR_CHAIN + 1 ops, each with its backward)."""


def dtensor_chain_step() -> Callable[[], None]:
    """One pass of the chain `_measure_dtensor_dispatch` times, on a DTensor sharded over every rank
    of the default group (shoal.calibration.counts counts the dispatches it runs)."""
    mesh = shared_mesh("cpu", (dist.get_world_size(),), ("world",))  # one mesh (and its groups) per process
    x = distribute_tensor(torch.randn(8 * dist.get_world_size()), mesh, [Shard(0)]).requires_grad_()
    return _chain_step(x, lambda y: y.to_local().sum(), DTENSOR_CHAIN)


def _collective(kind: str, nbytes: int, group: Any = None) -> Callable[[], Any]:
    """A call of `kind` over an fp32 tensor of about `nbytes` (rounded to a multiple of the group's
    size) in `group` (None: the world)."""
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


def _measure_collective(kind: str, s: Settings) -> list[tuple[int, float]]:
    """(nbytes, seconds per call) by size: the median over repetitions of the slowest rank's mean
    over back-to-back calls. Every repetition starts at a barrier; the repetitions of the sizes
    are interleaved, so that a burst of other load spoils one repetition of several sizes (which
    the median drops) rather than every repetition of one size."""
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


IN_STEP_COMPUTE_S = 0.003
"""Seconds of matmuls before each timed call: of the order of what a small model's block computes
between two of its collectives on a CPU, so that the ranks come to the call as in a training step."""


def _measure_in_step(s: Settings) -> dict[str, dict[str, float]]:
    """Group size -> kind -> seconds a 4 KB collective adds after IN_STEP_COMPUTE_S of compute (see
    Profile.in_step), for groups of every size from 2 to the world that divides it: the median over
    repetitions of the slowest rank's (compute + call) less its compute alone."""
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


def measure(s: Settings) -> dict[str, Any]:
    """Everything, on this rank of a pool (every rank at once); rank 0 reports each part as it is done."""
    warnings.filterwarnings("ignore", category=UserWarning)
    say = report if dist.get_rank() == 0 else (lambda step: None)
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
    return out
