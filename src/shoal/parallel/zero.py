"""ZeRO stages 1 and 2: a small sharded optimizer on plain collectives (DeepSpeed's design, ours).

Why not FSDP2 here: FSDP2 is a ZeRO-3 engine. Run as ZeRO-1/2 it still gathers every unit's
parameters inside every forward, copies them in and out per unit, runs hooks per unit, and lets
the optimizer see parameters it re-registers per forward, which makes it slower than DeepSpeed's
ZeRO-1/2 on gloo (bench/zero_vs_peers.py measures both). ZeRO-1/2 keep the full parameters anyway, so this
module keeps them as ordinary tensors the model computes with, and shards only what the stages
shard:

- Parameters are grouped in buckets (`bucket` transformer blocks each, plus one for the rest:
  embeddings, final norm, head). Each rank owns, of every parameter, the rows FSDP2/DTensor
  `Shard(0)` would give it: in fp32 those rows of the full parameter itself (no copy, so model
  states are exactly the ZeRO formula's), in bf16/fp16 a float32 master copy of them.
  `parameters()` yields these shards as DTensors, so any stock optimizer, `clip_grad_norm`, the
  loss scaler and the parity harness work unchanged, and checkpoints have FSDP2's format: they
  reshard to and from every other layout through DCP.
- Backward: when a bucket's last gradient has been accumulated (a post-accumulate-grad hook), its
  gradients are packed rank-major (`torch._chunk_cat`, FSDP2's own packing), freed, and
  reduce-scattered asynchronously in one collective (at most two buckets in flight). Buckets are
  reduced in one fixed order on every rank, and the end of backward flushes any bucket with a
  parameter the forward left unused (its gradient counts as zero), so collectives always pair.
  With dp x fsdp (hybrid) the shard is then all-reduced across dp. zero=1 differs only in
  accumulating full gradients across micro-batches (`no_sync`) and reducing on the last one;
  zero=2 reduces every micro-batch into the gradient shard. Gradient shards the optimizer's
  zero_grad(set_to_none=True) dropped are freed at the start of the next backward.
- After the optimizer step: a step hook common to all optimizers (torch's
  `register_optimizer_step_post_hook`; it acts only on optimizers holding these shards) marks
  the full parameters stale. The next forward starts every bucket's all-gather at once and waits
  for each just before its first block runs, so later gathers overlap the first blocks' compute.
  Any optimizer works, and evaluation between steps sees the update. (The shards' version
  counters cannot tell: a DTensor's in-place foreach update leaves them as they were.)

Parameters passed in `ignore` (the experts under ep, which shoal/parallel/expert.py shards and
reduces itself) are not bucketed: the engine hands them to the optimizer as they are and counts
their gradients in the norm and the scaling.

It implements shoal.parallel.data.DataEngine, the interface the runtime uses. Its speed and memory
against DeepSpeed and FSDP2 are measured by bench/zero_vs_peers.py and bench/zero_memory.py.
Not covered: tensor-parallel models and offload=on keep FSDP2 (see shoal/parallel/data.py).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from shoal.mesh import replica_mesh
from shoal.parallel.precision import PrecisionPolicy


@dataclass(kw_only=True)
class _Slot:
    """One parameter's place in its bucket: `chunk_rows` rows per rank, at `offset` in the shard."""

    names: list[str]  # every name the parameter has (tied weights have two)
    param: nn.Parameter  # the full parameter the model computes with
    chunk_rows: int  # ceil(rows / fsdp): Shard(0)'s chunk
    row_numel: int
    offset: int  # element offset of this parameter's chunk inside one rank's shard
    shard: nn.Parameter | None = None  # this rank's float32 rows (of the parameter or the master copy), a DTensor
    grad: DTensor | None = None  # the shard's gradient, a DTensor view into the bucket's gradient shard

    @property
    def rows(self) -> int:
        return self.param.shape[0]

    def local_rows(self, rank: int) -> int:
        return max(0, min(self.rows, (rank + 1) * self.chunk_rows) - rank * self.chunk_rows)


class _Bucket:
    """Parameters reduced and gathered together; `grad` (and `master`) hold this rank's shard of them,
    `numel` elements laid out rank-major: each parameter's `chunk_rows` rows, padded."""

    def __init__(self, params: list[tuple[list[str], nn.Parameter]], shards: int, *, master: bool) -> None:
        self.slots: list[_Slot] = []
        offset = 0
        for names, param in params:
            if param.dim() == 0:
                raise ValueError(f"parameter {names[0]} is a scalar; ZeRO-1/2 shard parameters by rows")
            chunk_rows = -(-param.shape[0] // shards)
            row_numel = param[0].numel()
            self.slots.append(_Slot(names=names, param=param, chunk_rows=chunk_rows, row_numel=row_numel,
                                    offset=offset))
            offset += chunk_rows * row_numel
        self.numel = offset  # one rank's shard, padding included
        # A float32 master copy of this rank's rows when the parameters are computed in 16 bits.
        self.master = torch.zeros(offset, dtype=torch.float32, device=params[0][1].device) if master else None
        self.grad: torch.Tensor | None = None  # the reduced gradient shard, from the first reduction of a step
        self.ready = 0  # gradients accumulated in this backward
        self.pending: tuple[dist.Work | None, torch.Tensor, bool] | None = None  # reduce-scatter in flight

    def views(self, flat: torch.Tensor, slot: _Slot, rank: int) -> torch.Tensor:
        """This rank's rows of `slot` inside the shard-layout buffer `flat`."""
        rows = slot.local_rows(rank)
        return flat[slot.offset:slot.offset + rows * slot.row_numel].view(rows, *slot.param.shape[1:])


class ZeroDataParallel(nn.Module):
    """`module` trained with ZeRO stage 1 or 2 over the mesh's fsdp axis (replicated across dp)."""

    def __init__(self, module: nn.Module, *, mesh: DeviceMesh, zero: int, bucket: int,
                 precision: PrecisionPolicy, blocks: list[nn.Module], ignore: AbstractSet[int] = frozenset()) -> None:
        super().__init__()
        if zero not in (1, 2):
            raise ValueError(f"zero={zero}: this engine runs ZeRO stages 1 and 2; valid: 1, 2")
        self.module = module
        self.zero, self.precision = zero, precision
        self._fsdp, self._dp = mesh["fsdp"], mesh["dp"]
        self._shard_mesh = mesh["fsdp"] if self._dp.size() == 1 else mesh["dp", "fsdp"]
        self._placements = (Shard(0),) if self._dp.size() == 1 else (Replicate(), Shard(0))
        self._replicas = replica_mesh(mesh)  # gradients averaged over them after the reduce-scatter
        self._rank, self._shards = self._fsdp.get_local_rank(), self._fsdp.size()
        self._world = self._shards * self._replicas.size()
        self._all_to_all = dist.get_backend(self._fsdp.get_group()) in _ALL_TO_ALL_ON
        self._sync = True
        self._callback_queued = False
        self._stale = False  # the master shards changed since the full parameters were gathered
        master = precision.param_dtype != torch.float32
        # Parameters another engine shards (ep experts, by id): handed to the optimizer as they are.
        self._others = [(name, p) for name, p in module.named_parameters() if id(p) in ignore and p.requires_grad]
        block_groups, rest = _group(module, blocks, bucket, ignore)
        self.buckets = [_Bucket(group, self._shards, master=master) for _, group in block_groups]
        self._rest = _Bucket(rest, self._shards, master=master) if rest else None
        self._order = self.buckets[::-1] + ([self._rest] if self._rest else [])  # backward's order
        for (first_block, _), b in zip(block_groups, self.buckets):
            first_block.register_forward_pre_hook(lambda *_, b=b: self._land(b))
        if self._rest:
            self.buckets.append(self._rest)
        self._inflight: dict[_Bucket, tuple[torch.Tensor, torch.Tensor, dist.Work]] = {}  # gathers started
        self._next = 0  # position in _order of the next bucket to reduce in this backward
        self._init_shards()
        for b in self.buckets:
            for slot in b.slots:
                slot.param.register_post_accumulate_grad_hook(lambda _p, b=b: self._on_grad(b))
        shard_ids = {id(p) for p in self.parameters()}
        me = weakref.ref(self)

        def after_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            engine = me()
            if engine is not None and any(id(p) in shard_ids for g in optimizer.param_groups for p in g["params"]):
                engine._stale = True

        handle = register_optimizer_step_post_hook(after_step)
        weakref.finalize(self, handle.remove)

    # ------------------------------------------------------------------ the module's face

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # After a step: all buckets' all-gathers start now; a block bucket is waited for just
        # before its first block runs (a forward pre-hook), so later gathers overlap compute.
        self._launch_gathers()
        if self._rest is not None:
            self._land(self._rest)  # embeddings and head: needed first
        out = self.module(*args, **kwargs)
        self.gather()  # buckets whose blocks did not run
        return out

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's trainable shards (what an optimizer should update), under the parameters' names."""
        for b in self.buckets:
            for slot in b.slots:
                yield prefix + slot.names[0], slot.shard  # type: ignore[misc]  # shards are set in __init__
        for name, p in self._others:
            yield prefix + name, p

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """zero=1 between micro-batches: accumulate full gradients, reduce on the last micro-batch."""
        self._sync = self.zero == 2
        try:
            yield
        finally:
            self._sync = True

    @property
    def model(self) -> nn.Module:
        """What forward calls: the engine itself (it gathers stale buckets around the module's forward)."""
        return self

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global gradient L2 norm from the flat gradient shards (one sum per bucket, one
        all-reduce): what `clip_grad_norm_` computes over the DTensor shards, without a collective
        per parameter. Padding rows hold zeros."""
        grads = self._flat_grads()
        device = self.buckets[0].slots[0].param.device
        squares = torch.stack([g.pow(2).sum() for g in grads]).sum() if grads else torch.zeros((), device=device)
        dist.all_reduce(squares, group=self._fsdp.get_group())  # dp replicas hold the same shards
        others = [p.grad for _, p in self._others if p.grad is not None]
        if others:  # DTensors on another mesh: their own norm, reduced over it
            norm = torch.nn.utils.get_total_norm(others)
            squares = squares + (norm.full_tensor() if isinstance(norm, DTensor) else norm).to(device).square()
        return squares.sqrt()

    @torch.no_grad()
    def scale_grads_(self, factor: torch.Tensor) -> None:
        """Multiply the gradient shards by `factor` (the shards' DTensor grads are views of them)."""
        grads = self._flat_grads()
        if grads:
            torch._foreach_mul_(grads, factor.to(grads[0].device))
        for _, p in self._others:
            if p.grad is not None:
                p.grad.mul_(factor.to(p.device))

    def _flat_grads(self) -> list[torch.Tensor]:
        return [b.grad for b in self.buckets if b.grad is not None and b.slots[0].shard.grad is not None]  # type: ignore[union-attr]  # shards set in __init__

    # ------------------------------------------------------------------ gather (after a step)

    def gather(self) -> None:
        """All-gather the master shards into the full parameters, if they changed since the last time."""
        self._launch_gathers()
        for b in list(self._inflight):
            self._land(b)

    @torch.no_grad()
    def _launch_gathers(self) -> None:
        """Start every bucket's all-gather at once (the embeddings' first), if a step changed the shards."""
        if not self._stale:
            return
        self._stale = False
        for b in self._order[::-1]:
            dtype, device = b.slots[0].param.dtype, b.slots[0].param.device
            if b.master is not None:
                shard = b.master.to(dtype)
            else:  # fp32: the rows live in the parameters; pack them (padding rows stay zero)
                shard = torch.zeros(b.numel, dtype=dtype, device=device)
                for slot in b.slots:
                    b.views(shard, slot, self._rank).copy_(self._own_rows(slot))
            full = torch.empty(self._shards * b.numel, dtype=dtype, device=device)
            work = _all_gather(full, shard, group=self._fsdp.get_group(), async_op=True)
            self._inflight[b] = (full, shard, work)  # the input too: alive until the gather lands

    @torch.no_grad()
    def _land(self, b: _Bucket) -> None:
        """Wait for bucket `b`'s all-gather (if one is in flight) and unpack it into its parameters."""
        if b not in self._inflight:
            return
        full, _, work = self._inflight.pop(b)
        work.wait()
        full_NS = full.view(self._shards, b.numel)
        for slot in b.slots:
            chunk = full_NS[:, slot.offset:slot.offset + slot.chunk_rows * slot.row_numel]
            rows = chunk.reshape(self._shards * slot.chunk_rows, *slot.param.shape[1:])
            slot.param.copy_(rows[:slot.rows])

    # ------------------------------------------------------------------ reduce (in backward)

    def _on_grad(self, b: _Bucket) -> None:
        if not self._callback_queued:  # once per backward: flush and wait when autograd is done
            self._callback_queued = True
            self._release_cleared_grads()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if not self._sync:
            return
        b.ready += 1
        self._reduce_in_order()

    def _reduce_in_order(self, *, flush: bool = False) -> None:
        """Start the reductions of completed buckets, in one fixed order on every rank (the order
        backward completes them in: the last blocks first, embeddings and head last), so that the
        collectives pair up even when a rank leaves a parameter unused. `flush` (end of backward):
        every remaining bucket, its unreported gradients as zeros."""
        while self._next < len(self._order):
            b = self._order[self._next]
            if not flush and b.ready < len(b.slots):
                return
            self._reduce(b)
            self._next += 1

    @torch.no_grad()
    def _reduce(self, b: _Bucket) -> None:
        """Pack the bucket's gradients rank-major, free them, start their reduce-scatter."""
        for other in self.buckets:  # at most two reductions in flight: bounded transient memory
            if other.pending is not None:
                self._complete(other)
        grads = [s.param.grad if s.param.grad is not None else torch.zeros_like(s.param) for s in b.slots]
        packed = torch._chunk_cat(grads, dim=0, num_chunks=self._shards).to(self.precision.reduce_dtype)
        for s in b.slots:
            s.param.grad = None
        del grads  # the list holds the full gradients too: drop it before the collective's output is allocated
        # The first reduction of a step lands in a new gradient shard itself (when the dtypes
        # agree); later ones (zero=2 over micro-batches) in a temporary added to it.
        first = b.grad is None
        if first:
            b.grad = torch.empty(b.numel, dtype=torch.float32, device=packed.device)
        assert b.grad is not None
        group = self._fsdp.get_group()
        if self._all_to_all:  # every rank's copy of my rows, summed in _complete (see _ALL_TO_ALL_ON)
            out = torch.empty_like(packed).view(-1)
            work = dist.all_to_all_single(out, packed.view(-1), group=group, async_op=True)
        else:
            out = (b.grad if first and packed.dtype == torch.float32
                   else torch.empty(b.numel, dtype=packed.dtype, device=packed.device))
            work = _reduce_scatter(out, packed.view(-1), group=group, async_op=True)
        b.pending = (work, out, first)
        b.ready = 0

    @torch.no_grad()
    def _complete(self, b: _Bucket) -> None:
        """Wait for the bucket's reduce-scatter; average it into the gradient shard."""
        assert b.pending is not None
        work, out, first = b.pending
        b.pending = None
        work.wait()  # type: ignore[union-attr]  # async_op=True always returns a Work
        assert b.grad is not None
        if self._all_to_all:  # sum every rank's copy; the first reduction of a step straight into the shard
            parts = out.view(self._shards, b.numel)
            out = torch.sum(parts, dim=0, out=b.grad) if first and parts.dtype == b.grad.dtype else parts.sum(dim=0)
        if self._replicas.size() > 1:
            dist.all_reduce(out, group=self._replicas.get_group())
        if out is b.grad:
            b.grad.div_(self._world)
        elif first:
            b.grad.copy_(out).div_(self._world)
        else:
            b.grad.add_(out.float().div_(self._world))
        for slot in b.slots:
            if slot.grad is None:
                slot.grad = self._dtensor(b.views(b.grad, slot, self._rank), slot)
            slot.shard.grad = slot.grad  # type: ignore[union-attr]  # shards are set in __init__

    def _release_cleared_grads(self) -> None:
        """Drop gradient shards the optimizer's zero_grad(set_to_none=True) let go of, so that
        they do not sit in memory through the next backward (FSDP2 frees them the same way)."""
        for b in self.buckets:
            if b.grad is not None and all(slot.shard.grad is None for slot in b.slots):  # type: ignore[union-attr]  # shards set in __init__
                b.grad = None
                for slot in b.slots:
                    slot.grad = None

    def reduce_grads(self) -> None:
        """Reduce, now, full gradients that reached the parameters without autograd accumulating
        them (a zero-bubble pipeline's weight passes assign them, so no hook saw them): every
        bucket, in the fixed order."""
        self._release_cleared_grads()
        self._next = 0
        self._reduce_in_order(flush=True)
        self._next = 0
        for b in self.buckets:
            if b.pending is not None:
                self._complete(b)

    def _finish_backward(self) -> None:
        self._callback_queued = False
        if self._sync:
            self._reduce_in_order(flush=True)
            self._next = 0
        for b in self.buckets:
            if b.pending is not None:
                self._complete(b)

    # ------------------------------------------------------------------ shards and state dicts

    @torch.no_grad()
    def _init_shards(self) -> None:
        """This rank's rows become the shards the optimizer updates (ranks start equal: same seed
        or a loaded checkpoint): in fp32 a view of the parameter's own rows, in 16-bit training a
        float32 master copy of them, after which the full parameters are cast to the compute dtype."""
        for b in self.buckets:
            for slot in b.slots:
                local = self._own_rows(slot)
                if b.master is not None:
                    local = b.views(b.master, slot, self._rank).copy_(local)
                slot.shard = nn.Parameter(self._dtensor(local, slot))
                slot.param.data = slot.param.data.to(self.precision.param_dtype)

    def _own_rows(self, slot: _Slot) -> torch.Tensor:
        """This rank's rows of the full parameter (a view sharing its storage, outside autograd)."""
        start = self._rank * slot.chunk_rows
        return slot.param.detach()[start:start + slot.local_rows(self._rank)]

    def _dtensor(self, local: torch.Tensor, slot: _Slot) -> DTensor:
        shape = slot.param.shape
        return DTensor.from_local(local, self._shard_mesh, self._placements, run_check=False,
                                  shape=shape, stride=torch.empty(shape, device="meta").stride())

    def model_state_dict(self) -> dict[str, Any]:
        """Every name of the module's state dict: trainable parameters as their float32 sharded
        DTensors (FSDP2's format, so DCP reshards them to any layout), frozen parameters and
        persistent buffers as they are. Loading into these tensors writes the master shards."""
        by_param = {id(s.param): s.shard for b in self.buckets for s in b.slots}
        return {name: by_param.get(id(value), value).detach()
                for name, value in self.module.state_dict(keep_vars=True).items()}

    def optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """`optimizer`'s state keyed by parameter name, as DCP's `get_state_dict` gives it for an
        FSDP2 model (state tensors are the optimizer's own, so loading into them restores it)."""
        if any(p not in optimizer.state for g in optimizer.param_groups for p in g["params"]):
            _init_optimizer_state(optimizer)
        names = {id(p): name for name, p in self.named_parameters()}
        groups = optimizer.param_groups
        return {"state": {names[id(p)]: dict(optimizer.state[p]) for g in groups for p in g["params"]},
                "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                  "params": [names[id(p)] for p in g["params"]]} for g in groups]}

    def load_state_dicts(self, model_sd: dict[str, Any], optim_sd: dict[str, Any] | None,
                         optimizer: torch.optim.Optimizer | None) -> None:
        """After DCP loaded into `model_state_dict`'s and `optim_state_dict`'s tensors in place: gather
        the new weights on next use, and take the optimizer's hyperparameters too."""
        self.loaded()
        if optimizer is not None and optim_sd is not None:
            for group, saved in zip(optimizer.param_groups, optim_sd["param_groups"], strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every weight unsharded on the CPU, from the float32 masters (collective); like torch's
        full state dict with cpu_offload, only rank 0 keeps the copies (the others return {})."""
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in self.model_state_dict().items()}
        return {k: v.cpu() for k, v in full.items()} if dist.get_rank() == 0 else {}

    @torch.no_grad()
    def load_full_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Take full (unsharded) tensors by name: each rank keeps its rows of the trainable ones."""
        others = {name for name, _ in self._others}
        for name, target in self.model_state_dict().items():
            if name not in weights:
                continue
            source = weights[name]
            if name in others:  # this rank's piece by the parameter's own placements
                target.to_local().copy_(distribute_tensor(source.to(target.dtype), target.device_mesh,
                                                          target.placements, src_data_rank=None).to_local())
                continue
            if isinstance(target, DTensor):
                start = self._rank * -(-source.shape[0] // self._shards)
                source = source[start:start + target.to_local().shape[0]]
                target = target.to_local()
            target.copy_(source)
        self.loaded()

    def loaded(self) -> None:
        """After the master shards were written in place (a checkpoint): gather on next use."""
        self._stale = True


@torch.no_grad()
def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create a lazily built optimizer state (as DCP's get_state_dict does): one step with zero
    gradients and a learning rate of 0, which changes no parameter."""
    grads = {p: p.grad for g in optimizer.param_groups for p in g["params"]}
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in grads:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for p, grad in grads.items():
        p.grad = grad


# torch 2.13 renamed the flat collectives; older releases in shoal's range only have the old names.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

_ALL_TO_ALL_ON = ("gloo",)
"""Backends on which the engine reduce-scatters gradients as all_to_all_single + a local sum: gloo's
own reduce_scatter is slower for the same bytes (bench/zero_collectives.py measures both). It costs
one bucket of transient memory more (every rank's copy of my rows before the sum). gloo's
all_gather is as fast as the all-to-all alternative, so it stays. NCCL keeps its own collectives."""


_Group = list[tuple[list[str], nn.Parameter]]


def _group(module: nn.Module, blocks: list[nn.Module], per_bucket: int,
           ignore: AbstractSet[int] = frozenset()) -> tuple[list[tuple[nn.Module, _Group]], _Group]:
    """Trainable parameters (but those in `ignore`, by id) in groups of `per_bucket` blocks (with
    each group's first block), and the rest (embeddings, head)."""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if p.requires_grad and id(p) not in ignore:
            names.setdefault(id(p), []).append(name)
            params[id(p)] = p
    buckets, seen = [], set()
    for i in range(0, len(blocks), per_bucket):
        ids = [id(p) for block in blocks[i:i + per_bucket] for p in block.parameters() if id(p) in params]
        ids = [k for k in dict.fromkeys(ids) if k not in seen]
        seen.update(ids)
        if ids:
            buckets.append((blocks[i], [(names[k], params[k]) for k in ids]))
    return buckets, [(names[k], params[k]) for k in params if k not in seen]
