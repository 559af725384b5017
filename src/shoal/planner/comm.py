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

import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol

from shoal.planner.hardware import Cluster, Link
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


RAIL_KINDS = ("all_reduce", "all_gather", "reduce_scatter")
"""The collectives NCCL runs as rings (or trees) laid once per channel, its channels spread over every NIC of a node."""


def members_per_node(n: int, stride: int, per_node: int) -> int:
    """Ranks of an aligned group of `n` ranks spaced `stride` apart (the first at a node's first device) that share
    one node of `per_node` devices."""
    if n < 1 or stride < 1 or per_node < 1:
        raise ValueError(f"need n, stride and per_node >= 1, got {n}, {stride}, {per_node}")
    return min(n, -(-per_node // stride))


def rail_link(inter: Link, intra: Link, members: int) -> Link:
    """The network as a ring collective across nodes sees it when `members` ranks of the group sit in each node.

    NCCL lays one ring per channel and spreads its channels over the node's NICs, so each ring crosses between
    nodes once and the group's ranks in a node add up their NICs' bandwidth, up to what the NVLink inside the
    node carries: a DGX A100's 8 HDR NICs (24 GB/s each measured) give 192 GB/s of all-reduce bus bandwidth across
    nodes (S. Jeaugey's team, github.com/NVIDIA/nccl issue 812: "we measure 192GB/s AllReduce BusBW"); "you can
    add more NICs and you should get more bandwidth, up to 160GB/s which is the NVLink intra-node bandwidth" of an
    8 x A800 node (sjeaugey, nccl issue 412); "AllReduce ... will form multiple rings so that it can utilize all
    the available NICs" (nccl-tests issue 277). Measured on DGX-2 V100s with NCCL_ALGO=Ring, a 1.6 GB all-reduce
    over 8 GPUs took 363, 173 and 132 ms with 1, 2 and 4 GPUs (and NICs) in each node (nccl issue 569). So:
    `members` times the per-device link, at most the node's own link (`intra`'s achievable bandwidth); the latency
    stays the network's."""
    if members < 1:
        raise ValueError(f"members must be >= 1, got {members}")
    achievable = min(members * inter.achievable, intra.achievable)
    return dataclasses.replace(inter, bandwidth=achievable / inter.efficiency)


class Network(Protocol):
    """Prices one collective over a group of `n` ranks spaced `stride` apart in rank order."""

    def time(self, kind: str, n: int, nbytes: float, *, stride: int) -> float: ...


@dataclass(frozen=True)
class RingNetwork:
    """A cluster's links priced by the ring formulas: a group runs at its slowest link's speed; across nodes a
    GPU group's ring collectives at its ranks' NICs together (`rail_link`)."""

    cluster: Cluster
    rails: bool = True
    """False: every rank crosses nodes on its own NIC share, whatever the collective (to show what rails move)."""

    def time(self, kind: str, n: int, nbytes: float, *, stride: int) -> float:
        c = self.cluster
        link = c.link(n, stride)
        if self.rails and link is c.inter and c.device_type == "cuda" and kind in RAIL_KINDS:  # rings over every NIC
            link = rail_link(c.inter, c.intra, members_per_node(n, stride, c.per_node))
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
