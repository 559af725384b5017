"""Newton-Schulz orthogonalisation of whole matrices whose shards live on several ranks (Muon's update,
shoal/optim/muon.py), with the communication of a distributed optimizer.

Newton-Schulz needs each whole matrix, while under fsdp (ZeRO 1/2/3) and tensor parallelism every rank holds a
slice of it. The owner design (`Orthogonalizer`, mode "owner"): each matrix split over a group of W ranks is
given to one of them, round-robin over the group's matrices so that the Newton-Schulz work is spread; every
rank sends its slices of the matrices a rank owns to that rank, the owner orthogonalises the whole matrix and
sends each rank its slice of the result back. Both directions are one all-to-all per batch of matrices
(`batch_elems` bfloat16 elements of whole matrices at most), in bfloat16: Newton-Schulz casts its input to
bfloat16 first, so the owner's gathered matrix equals the unsharded one's cast bit for bit, and its result is
bfloat16 anyway. Bytes sent per matrix of n elements, summed over the ranks: 2 (n - the owner's own slice),
2 (W - 1) / W x n x 2 bytes for even slices: the least any design that orthogonalises on one rank can send.

Mode "naive" is what a loop written without this would do: every rank all-gathers every matrix (one
collective per matrix) and orthogonalises all of them. It is the benchmark's peer (bench/muon_dist.py).

What is local needs no collective: a plain tensor (dp, pp, cp: whole on every rank), a DTensor replicated, and a
stacked expert weight (E, a, b) split along its experts only (ep): each expert is one matrix (`newton_schulz`
runs per leading index). A tensor split over two mesh dims at once (fsdp over tp) is gathered whole on every
rank of its mesh (the naive way, through DTensor) and each rank keeps its slice.

Shapes: u_N is a local (sharded) update, full_N the whole matrix (or E stacked matrices) it is a slice of.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.optim._muon import _zeropower_via_newtonschulz

MODES = ("owner", "naive")


def newton_schulz(full: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation (its own function: bfloat16, its scaling, its transposes) of a
    matrix, or of each matrix of a stack (..., a, b) on its own."""
    if full.dim() == 2:
        return _zeropower_via_newtonschulz(full, coefficients, steps, eps)
    flat = full.reshape(-1, *full.shape[-2:])
    return torch.stack([_zeropower_via_newtonschulz(m, coefficients, steps, eps) for m in flat]).reshape(full.shape)


def chunk_sizes(n: int, parts: int) -> list[int]:
    """How DTensor's Shard (torch.chunk) splits n rows over `parts` ranks: ceil(n / parts) each, the last
    ones shorter or empty."""
    size = -(-n // parts)
    return [max(0, min(n, (i + 1) * size) - i * size) for i in range(parts)]


@dataclass(kw_only=True)
class _Split:
    """One matrix (or stack) split along `dim` over `group` (W ranks, this rank at `coord`)."""

    index: int  # position in the caller's list
    local: torch.Tensor  # this rank's slice, bfloat16
    shape: torch.Size  # the whole tensor's
    dim: int
    group: dist.ProcessGroup
    size: int
    coord: int

    def slice_shape(self, coord: int) -> list[int]:
        shape = list(self.shape)
        shape[self.dim] = chunk_sizes(self.shape[self.dim], self.size)[coord]
        return shape

    def slice_numel(self, coord: int) -> int:
        return int(torch.Size(self.slice_shape(coord)).numel())


def _route(param: torch.Tensor) -> tuple[int, int] | str:
    """Where `param`'s update is orthogonalised: "local" (whole on this rank: a plain tensor, a replicated
    DTensor, experts split along their stack only), (mesh dim, tensor dim) for a DTensor split over exactly one
    mesh dim by a plain Shard (the owner design), or "everywhere" (any other split: gathered on every rank)."""
    if not isinstance(param, DTensor):
        return "local"
    split = [(m, p) for m, p in enumerate(param.placements) if not isinstance(p, Replicate)]
    if all(param.dim() >= 3 and getattr(p, "dim", None) == 0 for _, p in split):
        return "local"
    if len(split) == 1 and type(split[0][1]) is Shard:
        placement = split[0][1]
        assert isinstance(placement, Shard)
        return split[0][0], placement.dim
    return "everywhere"


class Orthogonalizer:
    """Orthogonalises a list of (parameter, local update) pairs, each update shaped as its parameter's local
    shard; returns bfloat16 local results in the same order. Counts what it sent in its last call: `bytes_sent`
    (this rank's bytes, to other ranks), `min_bytes` (this rank's share of the owner design's minimum:
    for each of its owned matrices, what the other ranks' slices and the results sent back to them weigh)
    and `collectives`."""

    def __init__(self, *, coefficients: tuple[float, float, float], steps: int, eps: float,
                 mode: str = "owner", batch_elems: int = 1 << 24) -> None:
        if mode not in MODES:
            raise ValueError(f"Muon gather mode {mode!r} is not valid; valid: {', '.join(MODES)}")
        self.ns: Callable[[torch.Tensor], torch.Tensor] = lambda m: newton_schulz(m, coefficients, steps, eps)
        self.mode = mode
        self.batch_elems = batch_elems
        self.bytes_sent = self.min_bytes = self.collectives = 0

    def __call__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        self.bytes_sent = self.min_bytes = self.collectives = 0
        out: list[torch.Tensor | None] = [None] * len(pairs)
        by_group: dict[int, list[_Split]] = {}
        for i, (param, u) in enumerate(pairs):
            route = _route(param)
            if route == "local":
                out[i] = self.ns(u)
                continue
            assert isinstance(param, DTensor)
            if route == "everywhere" or self.mode == "naive":
                out[i] = self._gathered_everywhere(param, u)
                continue
            assert isinstance(route, tuple)
            mesh_dim, dim = route
            mesh = param.device_mesh
            entry = _Split(index=i, local=u.bfloat16(), shape=param.shape, dim=dim, group=mesh.get_group(mesh_dim),
                           size=mesh.size(mesh_dim), coord=mesh.get_local_rank(mesh_dim))
            assert list(u.shape) == entry.slice_shape(entry.coord), (tuple(u.shape), entry.slice_shape(entry.coord))
            by_group.setdefault(id(entry.group), []).append(entry)
        for entries in by_group.values():
            start = 0
            for batch in _batches(entries, self.batch_elems):
                for entry, result in zip(batch, self._owner_batch(batch, start)):
                    out[entry.index] = result
                start += len(batch)
        assert all(o is not None for o in out)
        return out  # type: ignore[return-value]

    def _gathered_everywhere(self, param: DTensor, u: torch.Tensor) -> torch.Tensor:
        """The naive way: the whole matrix gathered on every rank (one all-gather per split mesh dim),
        orthogonalised there, and this rank's slice kept."""
        whole = DTensor.from_local(u.bfloat16(), param.device_mesh, param.placements, run_check=False,
                                   shape=param.shape, stride=param.stride())
        full = whole.full_tensor()
        holders = [param.device_mesh.size(m) for m, p in enumerate(param.placements) if not isinstance(p, Replicate)]
        self.collectives += len(holders)
        self.bytes_sent += u.numel() * 2 * (int(torch.tensor(holders).prod()) - 1) if holders else 0
        result = self.ns(full)
        return distribute_tensor(result, param.device_mesh, param.placements, src_data_rank=None).to_local()

    def _owner_batch(self, batch: list[_Split], start: int) -> list[torch.Tensor]:
        """One batch of matrices split over the same group, the first the group's `start`-th: slices to their
        owners (one all-to-all), the owners' Newton-Schulz, slices of the results back (one all-to-all)."""
        first = batch[0]
        size, coord, group = first.size, first.coord, first.group
        owner = [(start + j) % size for j in range(len(batch))]  # round-robin over the group's ranks
        mine = [j for j in range(len(batch)) if owner[j] == coord]
        # slices to their owners: to rank r, this rank's slices of r's matrices, in order
        send = [torch.cat([batch[j].local.reshape(-1) for j in range(len(batch)) if owner[j] == r] or
                          [first.local.new_empty(0)]) for r in range(size)]
        recv_sizes = [sum(batch[j].slice_numel(r) for j in mine) for r in range(size)]
        received = self._all_to_all(send, recv_sizes, group, coord)
        offsets = [0] * size
        results: dict[int, torch.Tensor] = {}
        for j in mine:
            pieces = []
            for r in range(size):
                n = batch[j].slice_numel(r)
                pieces.append(received[r][offsets[r]:offsets[r] + n].reshape(batch[j].slice_shape(r)))
                offsets[r] += n
            results[j] = self.ns(torch.cat(pieces, dim=batch[j].dim))
            whole = batch[j].shape.numel()
            self.min_bytes += 2 * 2 * (whole - batch[j].slice_numel(coord))
        # results back: to rank r, its slices of this rank's matrices, in order
        back = [torch.cat([results[j].split(chunk_sizes(batch[j].shape[batch[j].dim], size), dim=batch[j].dim)[r]
                           .reshape(-1) for j in mine] or [first.local.new_empty(0)]) for r in range(size)]
        back_sizes = [sum(batch[j].slice_numel(coord) for j in range(len(batch)) if owner[j] == r) for r in range(size)]
        returned = self._all_to_all(back, back_sizes, group, coord)
        offsets = [0] * size
        out = []
        for j, entry in enumerate(batch):
            n, r = entry.slice_numel(coord), owner[j]
            out.append(returned[r][offsets[r]:offsets[r] + n].reshape(entry.slice_shape(coord)))
            offsets[r] += n
        return out

    def _all_to_all(self, send: list[torch.Tensor], recv_sizes: list[int], group: dist.ProcessGroup,
                    coord: int) -> list[torch.Tensor]:
        """One all_to_all_single of bfloat16 pieces (send[r] to rank r of `group`); the pieces received."""
        flat = torch.cat(send)
        out = flat.new_empty(sum(recv_sizes))
        dist.all_to_all_single(out, flat, output_split_sizes=recv_sizes,
                               input_split_sizes=[s.numel() for s in send], group=group)
        self.collectives += 1
        self.bytes_sent += 2 * sum(s.numel() for r, s in enumerate(send) if r != coord)
        return list(out.split(recv_sizes))


def _batches(entries: list[_Split], limit: int) -> list[list[_Split]]:
    """`entries` in order, cut into batches of at most `limit` whole-matrix elements (one matrix over it alone)."""
    batches: list[list[_Split]] = [[]]
    total = 0
    for entry in entries:
        n = entry.shape.numel()
        if batches[-1] and total + n > limit:
            batches.append([])
            total = 0
        batches[-1].append(entry)
        total += n
    return batches
