"""Collective times from an alpha-beta model, and the network a cost estimate prices them on.

A collective over n ranks moving a buffer of `nbytes` costs alpha per message step plus its bytes
on the wire over the link's achievable bandwidth. Ring algorithms (what NCCL uses for large
buffers) move (n-1)/n of the buffer per rank for all-gather, reduce-scatter and all-to-all and
twice that for all-reduce, in n-1 (all-reduce: 2(n-1)) steps (Thakur, Rabenseifner and Gropp
2005, "Optimization of Collective Communication Operations in MPICH", section 4; the same factors
are nccl-tests' "bus bandwidth", NVIDIA nccl-tests doc/PERFORMANCE.md).

`nbytes` is always the whole logical buffer: all-reduce's tensor, all-gather's output,
reduce-scatter's input, all-to-all's input on one rank, a point-to-point message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from shoal.planner.hardware import Cluster
from shoal.planner.profile import Profile, collective_time

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast", "ring")
""""ring" is one hop of context parallelism's ring: every rank sends a message to the next and receives
one from the previous at once (a point-to-point message's time on each link)."""


def ring_time(kind: str, n: int, nbytes: float, *, bandwidth: float, latency: float) -> float:
    """Seconds for one collective of `kind` over `n` ranks (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"collective {kind!r} is not valid; valid: {', '.join(KINDS)}")
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind in ("send_recv", "ring"):
        return latency + nbytes / bandwidth
    if kind == "broadcast":  # pipelined along a ring: the buffer crosses each link once
        return (n - 1) * latency + nbytes / bandwidth
    factor = 2.0 if kind == "all_reduce" else 1.0
    return factor * ((n - 1) * latency + (n - 1) / n * nbytes / bandwidth)


def allreduce_curve_time(curve: tuple[tuple[int, float], ...], n: int, nbytes: float) -> float:
    """Seconds of an all-reduce of `nbytes` over `n` ranks from a measured bus bandwidth by buffer size (Link.
    allreduce_busbw: busbw = algbw * 2(n-1)/n, so time = 2(n-1)/n * nbytes / busbw): the bus bandwidth linear in
    log2 of the size between measured sizes; below the smallest, the smallest's time (a smaller buffer is no
    faster: latency-bound); beyond the largest, the largest's bandwidth."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor = 2.0 * (n - 1) / n
    (first, first_rate), (last, last_rate) = curve[0], curve[-1]
    if nbytes <= first:
        return factor * first / first_rate
    if nbytes >= last:
        return factor * nbytes / last_rate
    for (s0, r0), (s1, r1) in zip(curve, curve[1:]):
        if nbytes <= s1:
            t = (math.log2(nbytes) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
            return factor * nbytes / (r0 + t * (r1 - r0))
    raise AssertionError("unreachable: nbytes lies within the curve")


class Network(Protocol):
    """Prices one collective over a group of `n` ranks spaced `stride` apart in rank order."""

    def time(self, kind: str, n: int, nbytes: float, *, stride: int) -> float: ...


@dataclass(frozen=True)
class RingNetwork:
    """A cluster's links priced by the ring formulas: a group runs at its slowest link's speed."""

    cluster: Cluster

    def time(self, kind: str, n: int, nbytes: float, *, stride: int) -> float:
        link = self.cluster.link(n, stride)
        if kind == "all_reduce" and link.allreduce_busbw:
            return allreduce_curve_time(link.allreduce_busbw, n, nbytes)
        return ring_time(kind, n, nbytes, bandwidth=link.achievable, latency=link.latency)


@dataclass(frozen=True)
class CalibratedNetwork:
    """This machine's collectives as `shoal plan --calibrate` measured them (gloo's algorithms are not
    NCCL's rings, so the measured fit is used directly). A group inside a larger run is priced at the
    run's world size, since on a shared CPU every process of the run competes for the same cores,
    with the in-step latency of a group of its own size (Profile.in_step)."""

    profile: Profile
    world_size: int

    def time(self, kind: str, n: int, nbytes: float, *, stride: int) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        return collective_time(self.profile, kind, max(n, self.world_size), nbytes, group=n)
