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
runs per leading index). A matrix split over several mesh dims at once (fsdp over tp: W = fsdp x tp holders)
has one owner among all of them, as one split over one dim does: the group is the ranks of those dims that
share this rank's coordinates on the others (a process group made once), and the owner places each holder's
slice by its flat indices in the whole matrix (`shard_indices`: DTensor's own splits, strided ones included; a
slice that is a box of the matrix, as most are, is copied as one), so the gathered matrix is the unsharded one,
bit for bit. Any other placement (none in shoal's plans) is gathered whole on every rank, the naive way.

Shapes: a local update is this rank's shard; `full` the whole matrix (or E stacked matrices) it is a slice of.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard
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


def shard_indices(shape: Sequence[int], placements: Sequence[Placement], sizes: Sequence[int],
                  coord: Sequence[int]) -> torch.Tensor:
    """The flat (row-major) indices into a whole tensor of `shape` of the local shard that the rank at mesh
    coordinate `coord` (of a mesh of `sizes`) holds under `placements`, in the local shard's own row-major
    order: each mesh dim's Shard or _StridedShard split applied in mesh order, as distribute_tensor applies them,
    so that uneven and strided (fsdp over tp) splits come out as DTensor's."""
    index = torch.arange(int(torch.Size(shape).numel())).reshape(*shape)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard | _StridedShard):
            pieces, _ = placement._split_tensor(index, sizes[mesh_dim], with_padding=False)
            index = pieces[coord[mesh_dim]]
    return index.reshape(-1)


@dataclass(kw_only=True)
class _Layout:
    """How one whole matrix (or stack) is split over a group of W ranks, the group's members in order: the mesh
    dims that split it (`dims`) and where each member's slice lies in it (lazily: only its owner asks)."""

    shape: torch.Size
    placements: tuple[Placement, ...]
    sizes: tuple[int, ...]  # the mesh's
    coords: list[tuple[int, ...]]  # each member's mesh coordinate
    group: dist.ProcessGroup
    position: int  # this rank's among the members
    _places: dict[int, tuple[slice, ...] | torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.coords)

    def place(self, member: int) -> tuple[slice, ...] | torch.Tensor:
        """Where a member's slice lies in the whole matrix: a box (one slice per dim) of the matrix in `shape`
        when the slice is one, in the box's row-major order (a Shard of rows or columns, fsdp over tp's rows of a
        tp chunk), else its flat indices. A box is kept as its slices, not as an int64 index per element (4x a
        bfloat16 matrix's bytes), and copying it is a strided copy where scattering by indices is an index_put,
        many times slower per element on a CPU."""
        if member not in self._places:
            self._places[member] = _box(shard_indices(self.shape, self.placements, self.sizes, self.coords[member]),
                                        self.shape)
        return self._places[member]

    def numel(self, member: int) -> int:
        where = self.place(member)
        if isinstance(where, torch.Tensor):
            return int(where.numel())
        return int(torch.Size(s.stop - s.start for s in where).numel())

    def put(self, full: torch.Tensor, member: int, piece: torch.Tensor) -> None:
        """Writes a member's flat slice `piece` into the flat whole matrix `full`."""
        where = self.place(member)
        if isinstance(where, torch.Tensor):
            full[where] = piece
        else:
            box = full.view(self.shape)[where]
            box.copy_(piece.view(box.shape))

    def take(self, full: torch.Tensor, member: int) -> torch.Tensor:
        """A member's slice of the flat whole matrix `full`, flat, in its local row-major order."""
        where = self.place(member)
        return full[where] if isinstance(where, torch.Tensor) else full.view(self.shape)[where].reshape(-1)


def _box(indices: torch.Tensor, shape: torch.Size) -> tuple[slice, ...] | torch.Tensor:
    """The box (one slice per dim of `shape`) whose elements, in row-major order, are `indices`; else `indices`."""
    if indices.numel() == 0:
        return indices
    strides = torch.empty(shape, device="meta").stride()
    coords = (indices[:, None] // torch.tensor(strides)) % torch.tensor(list(shape))
    lows, highs = coords.amin(0).tolist(), (coords.amax(0) + 1).tolist()
    flat = torch.zeros((), dtype=torch.long)
    for lo, hi, stride in zip(lows, highs, strides):  # the box's flat indices, row-major
        flat = flat[..., None] + torch.arange(lo, hi) * stride
    if flat.numel() != indices.numel() or not torch.equal(flat.reshape(-1), indices):
        return indices
    return tuple(slice(lo, hi) for lo, hi in zip(lows, highs))


@dataclass(kw_only=True)
class _Split:
    """One matrix (or stack) whose update is orthogonalised by one owner among the ranks holding its slices."""

    index: int  # position in the caller's list
    local: torch.Tensor  # this rank's slice, bfloat16, flat
    local_shape: torch.Size
    layout: _Layout


def _route(param: torch.Tensor) -> tuple[int, ...] | str:
    """Where `param`'s update is orthogonalised: "local" (whole on this rank: a plain tensor, a replicated
    DTensor, experts split along their stack only), the mesh dims that split it where each does so by a Shard or
    _StridedShard (the owner design: one owner among the ranks of those dims), or "everywhere" (any other
    placement: gathered on every rank)."""
    if not isinstance(param, DTensor):
        return "local"
    split = [(m, p) for m, p in enumerate(param.placements) if not isinstance(p, Replicate)]
    if all(param.dim() >= 3 and getattr(p, "dim", None) == 0 for _, p in split):
        return "local"
    if all(isinstance(p, Shard | _StridedShard) for _, p in split):
        return tuple(m for m, _ in split)
    return "everywhere"


class _Layouts:
    """Each split parameter's _Layout, kept: its group is the mesh's own for one split dim; for several, one process
    group over the ranks of those dims that share this rank's coordinates on the others, made once by its members
    alone (members in the order of their global ranks, which is their order in the group)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[object, ...], tuple[dist.ProcessGroup, list[tuple[int, ...]]]] = {}
        self._layouts: dict[tuple[object, ...], _Layout] = {}

    def __call__(self, param: DTensor, dims: tuple[int, ...]) -> _Layout:
        mesh = param.device_mesh
        where = (tuple(mesh.mesh.reshape(-1).tolist()), tuple(mesh.mesh.shape), dims)
        key = (*where, tuple(param.shape), tuple(param.placements))
        if key not in self._layouts:
            if where not in self._groups:
                self._groups[where] = self._group(mesh, dims)
            group, members = self._groups[where]
            here = mesh.get_coordinate()
            assert here is not None
            self._layouts[key] = _Layout(shape=param.shape, placements=tuple(param.placements),
                                         sizes=tuple(mesh.mesh.shape), coords=members, group=group,
                                         position=members.index(tuple(here)))
        return self._layouts[key]

    @staticmethod
    def _group(mesh: DeviceMesh, dims: tuple[int, ...]) -> tuple[dist.ProcessGroup, list[tuple[int, ...]]]:
        here = mesh.get_coordinate()
        assert here is not None
        members = [tuple(here)]
        for m in dims:  # every coordinate along the split dims, the others this rank's
            members = [c[:m] + (k,) + c[m + 1:] for c in members for k in range(mesh.size(m))]
        members.sort(key=lambda c: int(mesh.mesh[c].item()))
        if len(dims) == 1:
            return mesh.get_group(dims[0]), members
        ranks = [int(mesh.mesh[c].item()) for c in members]
        return dist.new_group(ranks, use_local_synchronization=True), members


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
        self.layouts = _Layouts()
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
            entry = _Split(index=i, local=u.bfloat16().reshape(-1), local_shape=u.shape,
                           layout=self.layouts(param, route))
            assert u.numel() == entry.layout.numel(entry.layout.position), (tuple(u.shape), route)
            by_group.setdefault(id(entry.layout.group), []).append(entry)
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
        layouts = [e.layout for e in batch]
        size, me, group = layouts[0].size, layouts[0].position, layouts[0].group
        owner = [(start + j) % size for j in range(len(batch))]  # round-robin over the group's ranks
        mine = [j for j in range(len(batch)) if owner[j] == me]
        # slices to their owners: to rank r, this rank's slices of r's matrices, in order
        send = [[batch[j].local for j in range(len(batch)) if owner[j] == r] for r in range(size)]
        received = self._all_to_all(send, [[layouts[j].numel(r) for j in mine] for r in range(size)], group, me)
        results: dict[int, torch.Tensor] = {}
        for k, j in enumerate(mine):
            full = received[0][k].new_empty(layouts[j].shape.numel())
            for r in range(size):
                layouts[j].put(full, r, received[r][k])
            results[j] = self.ns(full.reshape(layouts[j].shape)).reshape(-1)
            self.min_bytes += 2 * 2 * (full.numel() - layouts[j].numel(me))
        del received
        # results back: to rank r, its slices of this rank's matrices, in order
        back = [[layouts[j].take(results[j], r) for j in mine] for r in range(size)]
        del results
        returned = self._all_to_all(back, [[layouts[j].numel(me) for j in range(len(batch)) if owner[j] == r]
                                           for r in range(size)], group, me)
        taken = [0] * size
        out = []
        for j, entry in enumerate(batch):
            out.append(returned[owner[j]][taken[owner[j]]].reshape(entry.local_shape))
            taken[owner[j]] += 1
        return out

    def _all_to_all(self, send: list[list[torch.Tensor]], recv: list[list[int]], group: dist.ProcessGroup,
                    me: int) -> list[list[torch.Tensor]]:
        """One all_to_all_single of flat bfloat16 pieces (send[r], to rank r of `group`, in one buffer); the
        pieces received (recv[r]: their sizes, from rank r), views of one buffer."""
        flat = torch.cat([t for pieces in send for t in pieces] or [torch.empty(0, dtype=torch.bfloat16)])
        out = flat.new_empty(sum(map(sum, recv)))
        dist.all_to_all_single(out, flat, output_split_sizes=[sum(n) for n in recv],
                               input_split_sizes=[sum(t.numel() for t in pieces) for pieces in send], group=group)
        self.collectives += 1
        self.bytes_sent += 2 * sum(t.numel() for r, pieces in enumerate(send) if r != me for t in pieces)
        return [list(chunk.split(sizes)) for chunk, sizes in zip(out.split([sum(n) for n in recv]), recv)]


def _batches(entries: list[_Split], limit: int) -> list[list[_Split]]:
    """`entries` in order, cut into batches of at most `limit` whole-matrix elements (one matrix over it alone)."""
    batches: list[list[_Split]] = [[]]
    total = 0
    for entry in entries:
        n = entry.layout.shape.numel()
        if batches[-1] and total + n > limit:
            batches.append([])
            total = 0
        batches[-1].append(entry)
        total += n
    return batches
