"""Large-batch optimizers: LAMB, LARS and CowClip, correct on sharded parameters.

Each needs norms of whole parameters (LAMB and LARS: the layer-wise trust ratio; CowClip: the
norm of every embedding row and of its gradient), while under ZeRO/FSDP2 and tensor parallelism
the optimizer holds DTensor shards, and a norm over a shard is silently wrong. Here every
parameter's squared norm (or, for a stacked expert weight or an embedding table, each row's) is
computed from the local shard, all of them packed into one vector per set of mesh groups they are
split over, and that vector all-reduced once per group (the packing of apex's
DistributedFusedLAMB): the number of collectives in a step depends on the mesh layout, never on
the number of parameters, and no value is read on the host. `ShardedNorms` does this; the
optimizers call it once per step (LAMB, LARS) or twice (CowClip: the row norms, then the ids'
counts over the data ranks).

Trust ratios: one per parameter tensor; a tensor of three or more dimensions (the MoE experts,
stacked as (E, ...)) gets one per leading index, i.e. per expert. Vectors (biases, norm weights)
are excluded from adaptation and weight decay by default (`adapt_vectors` in the builder), as in
both papers. Each optimizer's `last_trust` holds the step's trust ratios on the device; the
trainer reads them only at its logging steps (`gather_trust`, `trust_summary`: min, median and max
over every tensor of every rank, each counted once, into metrics.jsonl).

Updates run on the shards' local tensors with torch's foreach ops; the state tensors are DTensors
shaped like their parameters, so checkpoints reshard them as they do AdamW's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# ----------------------------------------------------------------------------- norms over shards


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (sharing its storage), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _local_grad(param: torch.Tensor) -> torch.Tensor:
    """`param.grad`'s local shard laid out as the parameter's. A tensor-parallel gradient can come
    placed otherwise (Replicate where the weight is Shard): taking the shard's part is local."""
    grad = param.grad
    assert grad is not None
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        if any(p.is_partial() for p in grad.placements):
            raise ValueError(f"a gradient placed as {grad.placements} is not reduced yet; valid: Shard or Replicate")
        param.grad = grad = grad.redistribute(param.device_mesh, param.placements)
    return _local(grad)


def split_groups(param: torch.Tensor, *, rows: bool) -> tuple[dist.ProcessGroup, ...]:
    """The process groups a local squared norm of `param` must be summed over to be the global
    one: every mesh dimension that shards it. With `rows` (one norm per leading index), a shard
    along dim 0 keeps whole rows on each rank, so only shards of the other dims count."""
    if not isinstance(param, DTensor):
        return ()
    groups = []
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_partial():
            raise ValueError(f"a parameter placed as {placement} has no norm of its own; valid: Shard or Replicate")
        dim = getattr(placement, "dim", None)  # Shard and FSDP2-over-tp's _StridedShard
        if dim is not None and not (rows and dim == 0):
            groups.append(param.device_mesh.get_group(mesh_dim))
    return tuple(groups)


class ShardedNorms:
    """Global squared norms of many (possibly sharded) tensors, with a fixed number of collectives.

    `add(local_sq, groups)` queues a vector of local squared norms (one entry for a whole tensor,
    one per row otherwise) with the groups it is split over (`split_groups`); `reduce()` packs the
    queued vectors by (groups, device), all-reduces each pack once per group, and returns every
    vector, global, in the order added. `collectives` counts the all-reduces of the last reduce().
    """

    def __init__(self) -> None:
        self._pieces: list[tuple[torch.Tensor, tuple[dist.ProcessGroup, ...]]] = []
        self.collectives = 0

    def add(self, local_sq: torch.Tensor, groups: tuple[dist.ProcessGroup, ...]) -> int:
        vec = local_sq.reshape(-1)  # half-precision norms summed in float32, others in their own dtype
        self._pieces.append((vec.float() if vec.dtype.itemsize < 4 else vec, groups))
        return len(self._pieces) - 1

    def reduce(self) -> list[torch.Tensor]:
        packs: dict[tuple[Any, ...], list[int]] = {}
        for i, (vec, groups) in enumerate(self._pieces):
            packs.setdefault((tuple(id(g) for g in groups), vec.device), []).append(i)
        out: list[torch.Tensor] = [vec for vec, _ in self._pieces]
        self.collectives = 0
        for indices in packs.values():
            groups = self._pieces[indices[0]][1]
            if not groups:
                continue
            packed = torch.cat([out[i] for i in indices])
            for group in groups:
                dist.all_reduce(packed, group=group)
                self.collectives += 1
            for i, vec in zip(indices, packed.split([out[i].numel() for i in indices])):
                out[i] = vec
        self._pieces = []
        return out


def gather_trust(optimizer: torch.optim.Optimizer, named_params: Iterable[tuple[str, torch.Tensor]],
                 group: dist.ProcessGroup | None = None) -> dict[tuple[str, int], float]:
    """Every trust ratio of the optimizer's last step across the ranks of `group` (None: all), by
    (parameter name, expert row or -1), each counted once: a tensor replicated or sharded over
    several ranks has the same (global) ratio on each, while pipeline stages and expert-parallel
    ranks hold different tensors. Reads the ratios on the host and gathers them (a collective
    every rank of `group` must call): for the logging point, not the step. {} for an optimizer
    without trust ratios (AdamW, CowClip)."""
    if not isinstance(optimizer, _Layerwise):
        return {}
    names = {id(p): n for n, p in named_params}
    pairs = list(zip(optimizer.trust_keys(names), optimizer.last_trust.tolist()))
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, pairs, group=group)
        pairs = [pair for rank_pairs in gathered for pair in rank_pairs]
    return dict(pairs)


def trust_summary(trust: dict[tuple[str, int], float]) -> dict[str, float]:
    """min / median (the lower one, as torch's) / max of trust ratios ({} for none): what
    metrics.jsonl records at each logging step."""
    if not trust:
        return {}
    t = torch.tensor(sorted(trust.values()), dtype=torch.float64)
    return {"trust_min": float(t[0]), "trust_median": float(t[(len(t) - 1) // 2]), "trust_max": float(t[-1])}


def _sq_norms(tensors: Sequence[torch.Tensor], rows: Sequence[bool]) -> list[torch.Tensor]:
    """Local squared norms: of whole tensors (torch's foreach norm) or of each leading row."""
    whole = [t for t, r in zip(tensors, rows) if not r]
    norms = iter(torch._foreach_norm(whole) if whole else [])
    return [t.flatten(1).square().sum(1) if r else next(norms).square() for t, r in zip(tensors, rows)]


def _per_row(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A scalar or per-row vector shaped to broadcast over `like`."""
    return value.reshape(-1, *([1] * (like.dim() - 1))) if value.numel() > 1 or like.dim() > 1 else value.reshape(())


def _ratio(num_sq: torch.Tensor, den_sq: torch.Tensor) -> torch.Tensor:
    """sqrt(num_sq) / sqrt(den_sq), or 1 where either norm is zero (the papers' convention)."""
    ok = (num_sq > 0) & (den_sq > 0)
    return torch.where(ok, num_sq.sqrt() / den_sq.sqrt().clamp(min=torch.finfo(den_sq.dtype).tiny), 1.0)


class _Layerwise(torch.optim.Optimizer):
    """What LAMB, LARS and CowClip share: groups with an `adapt` flag, the rows rule, trust ratios."""

    def __init__(self, params: Any, defaults: dict[str, Any], *, per_expert: bool = True) -> None:
        super().__init__(params, defaults)
        self.per_expert = per_expert
        self.last_trust = torch.ones(0)
        """The last step's trust ratios (every adapted tensor's, or expert's), on the device."""
        self.collectives = 0
        """All-reduces the last step issued (fixed by the mesh layout, whatever the parameter count)."""
        self._trust_owners: list[tuple[torch.Tensor, bool]] = []  # (parameter, per row) of each piece of last_trust

    def _rows(self, p: torch.Tensor) -> bool:
        return self.per_expert and p.dim() >= 3

    def _params(self, group: dict[str, Any]) -> list[torch.Tensor]:
        return [p for p in group["params"] if p.grad is not None]

    def trust_stats(self) -> dict[str, torch.Tensor]:
        """min / median / max of the last step's trust ratios, on the device ({} before a step)."""
        t = self.last_trust
        return {} if t.numel() == 0 else {"trust_min": t.min(), "trust_median": t.median(), "trust_max": t.max()}

    def trust_keys(self, names: dict[int, str]) -> list[tuple[str, int]]:
        """What each entry of `last_trust` is the trust ratio of: (parameter name, global row) for a
        per-expert ratio, (name, -1) for a whole tensor's. `names` maps id(parameter) to its name."""
        keys: list[tuple[str, int]] = []
        for param, rows in self._trust_owners:
            name = names[id(param)]
            span = _local_rows(param)
            keys += [(name, r) for r in range(span.start, span.stop)] if rows else [(name, -1)]
        return keys


# ----------------------------------------------------------------------------- LAMB


class LAMB(_Layerwise):
    """LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning", Algorithm 2).

    m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2 (both bias-corrected), u = m / (sqrt(v) + eps)
    + wd w, then w -= lr * (||w|| / ||u||) * u, the ratio taken as 1 where either norm is 0. Groups
    with adapt=False (vectors, by default) take the plain AdamW-like step u with ratio 1.

    Gradient clipping: the trainer's global-norm clip scales every gradient before the step; the
    update direction m / sqrt(v) is nearly invariant to that scale and the trust ratio sets the
    step length, so clipping mostly matters in the first steps (it scales m against eps).
    """

    def __init__(self, params: Any, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, adapt: bool = True, per_expert: bool = True) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "adapt": adapt}, per_expert=per_expert)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        norms, jobs = ShardedNorms(), []
        owners: list[tuple[torch.Tensor, bool]] = []
        for group in self.param_groups:
            params = self._params(group)
            if not params:
                continue
            b1, b2 = group["betas"]
            w, g = [_local(p) for p in params], [_local_grad(p) for p in params]
            states = [self._state(p) for p in params]
            m, v = [_local(st[0]) for st in states], [_local(st[1]) for st in states]
            torch._foreach_lerp_(m, g, 1 - b1)
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, g, g, 1 - b2)
            step = states[0][2]  # every parameter of a group steps together
            bc1, bc2 = 1 - b1**step, 1 - b2**step
            denom = torch._foreach_div(v, bc2)
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, group["eps"])
            u = torch._foreach_div(m, denom)
            torch._foreach_div_(u, bc1)
            if group["weight_decay"]:
                torch._foreach_add_(u, w, alpha=group["weight_decay"])
            ids = None
            if group["adapt"]:
                rows = [self._rows(p) for p in params]
                ids = [(norms.add(a, split_groups(p, rows=r)), norms.add(b, split_groups(p, rows=r)))
                       for p, r, a, b in zip(params, rows, _sq_norms(w, rows), _sq_norms(u, rows))]
                owners += zip(params, rows)
            jobs.append((group, w, u, ids))
        self._trust_owners = owners
        reduced = norms.reduce()
        self.collectives, trusts = norms.collectives, []
        for group, w, u, ids in jobs:
            if ids is not None:
                for i, (wi, ui) in enumerate(ids):
                    trust = _ratio(reduced[wi], reduced[ui])
                    trusts.append(trust)
                    u[i].mul_(_per_row(trust, u[i]))
            torch._foreach_add_(w, u, alpha=-group["lr"])
        self.last_trust = torch.cat(trusts) if trusts else torch.ones(0)

    def _state(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1  # a CPU scalar, as torch's Adam keeps it: reading it syncs no device
        return state["exp_avg"], state["exp_avg_sq"], float(state["step"])


# ----------------------------------------------------------------------------- LARS


class LARS(_Layerwise):
    """LARS (You et al. 2017, "Large Batch Training of Convolutional Networks", Algorithm 1) over
    SGD with momentum.

    local_lr = eta ||w|| / (||g|| + wd ||w||) (1 where ||w|| or ||g|| is 0); v = momentum v +
    lr * local_lr * (g + wd w); w -= v. Groups with adapt=False (vectors, by default) take plain
    SGD with momentum: local_lr = 1.

    Gradient clipping: the trainer's global-norm clip runs first. ||g|| is taken after it; with no
    weight decay the local lr is proportional to 1 / ||g||, so the clip cancels out of adapted
    layers' steps and acts only on the vectors' plain SGD steps.
    """

    def __init__(self, params: Any, *, lr: float = 1.0, momentum: float = 0.9, eta: float = 1e-3,
                 weight_decay: float = 0.0, adapt: bool = True, per_expert: bool = True) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "eta": eta, "weight_decay": weight_decay,
                                  "adapt": adapt}, per_expert=per_expert)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        norms, jobs = ShardedNorms(), []
        owners: list[tuple[torch.Tensor, bool]] = []
        for group in self.param_groups:
            params = self._params(group)
            if not params:
                continue
            w, g = [_local(p) for p in params], [_local_grad(p) for p in params]
            ids = None
            if group["adapt"]:
                rows = [self._rows(p) for p in params]
                ids = [(norms.add(a, split_groups(p, rows=r)), norms.add(b, split_groups(p, rows=r)))
                       for p, r, a, b in zip(params, rows, _sq_norms(w, rows), _sq_norms(g, rows))]
                owners += zip(params, rows)
            jobs.append((group, params, w, g, ids))
        self._trust_owners = owners
        reduced = norms.reduce()
        self.collectives, trusts = norms.collectives, []
        for group, params, w, g, ids in jobs:
            wd = group["weight_decay"]
            d = torch._foreach_add(g, w, alpha=wd) if wd else [x.clone() for x in g]
            if ids is not None:
                for i, (wi, gi) in enumerate(ids):
                    w_sq, g_sq = reduced[wi], reduced[gi]
                    den_sq = (g_sq.sqrt() + wd * w_sq.sqrt()).square()
                    local_lr = group["eta"] * _ratio(w_sq, den_sq)
                    local_lr = torch.where((w_sq > 0) & (g_sq > 0), local_lr, 1.0)
                    trusts.append(local_lr)
                    d[i].mul_(_per_row(local_lr, d[i]))
            bufs = [_local(self._buffer(p)) for p in params]
            torch._foreach_mul_(bufs, group["momentum"])
            torch._foreach_add_(bufs, d, alpha=group["lr"])
            torch._foreach_sub_(w, bufs)
        self.last_trust = torch.cat(trusts) if trusts else torch.ones(0)

    def _buffer(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]


# ----------------------------------------------------------------------------- CowClip


class CowClip(LAMB):
    """CowClip (Zheng et al. 2022, "CowClip: Reducing CTR Prediction Model Training Time from 12
    hours to 10 minutes on 1 GPU", arXiv 2204.06240): adaptive column-wise clipping of embedding
    gradients, over Adam for the other parameters.

    For every row `id` of an embedding table of width d, with `cnt` the id's occurrences in the
    global batch (summed over the data ranks):
        clip_t = r * cnt * max(||w_id||, r * sqrt(d) * zeta),   g_id <- g_id * clip_t / max(||g_id||, clip_t)
    (the authors' code, bytedance/LargeBatchCTR). Rows absent from the batch are not clipped (in a
    CTR model their gradient is zero; with a tied output head it is the head's). Then the table
    takes an Adam step with L2 weight decay (g += wd w) at its own group's lr: the paper keeps the
    embedding lr fixed as the batch grows and scales the L2 linearly (see `shoal.optim.builder`'s
    scaling helpers). The other groups take AdamW steps (LAMB's step with adapt=False).

    Gradient clipping: the trainer's global-norm clip runs first over every gradient; CowClip then
    clips embedding rows. The paper uses no global clip: set grad_clip 0 to follow it.

    Counts: a forward pre-hook on each embedding module adds its ids to a count vector while the
    module trains with gradients enabled; the step sums the counts over `count_groups` (the ranks
    that see other tokens) in one all-reduce per group and starts the next step from zero.
    """

    def __init__(self, params: Any, *, embeddings: Iterable[nn.Embedding | tuple[nn.Embedding, torch.Tensor]],
                 count_groups: Sequence[dist.ProcessGroup] = (), ratio: float = 1.0, zeta: float = 1e-5,
                 **kwargs: Any) -> None:
        kwargs.setdefault("adapt", False)
        super().__init__(params, **kwargs)
        self.ratio, self.zeta, self.count_groups = ratio, zeta, tuple(count_groups)
        self.clipped_fraction = torch.zeros(())
        """Of the table rows in the last step's batch (this rank's shards), the fraction clipped; on the device."""
        self._tables: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._hooks = []
        for entry in embeddings:  # a module, or (module, the parameter the optimizer holds for its weight)
            module, weight = entry if isinstance(entry, tuple) else (entry, entry.weight)
            counts = torch.zeros(module.num_embeddings, device=_local(weight).device)
            self._tables.append((weight, counts))
            self._hooks.append(module.register_forward_pre_hook(self._counter(module, counts)))

    @staticmethod
    def _counter(module: nn.Module, counts: torch.Tensor) -> Any:
        def count(_module: nn.Module, args: tuple[Any, ...]) -> None:
            if module.training and torch.is_grad_enabled():
                ids = _local(args[0]).reshape(-1).to(counts.device)
                counts.index_add_(0, ids, torch.ones_like(ids, dtype=counts.dtype))
        return count

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        tables = [(w, c) for w, c in self._tables if w.grad is not None]
        if tables:
            self._clip(tables)
        super().step()
        for _, counts in self._tables:
            counts.zero_()

    def _clip(self, tables: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        counts = torch.cat([c for _, c in tables])  # one vector for every table: one all-reduce per group
        for count_group in self.count_groups:
            dist.all_reduce(counts, group=count_group)
        norms = ShardedNorms()
        ids = [(norms.add(_local(w).square().sum(1), split_groups(w, rows=True)),
                norms.add(_local_grad(w).square().sum(1), split_groups(w, rows=True))) for w, _ in tables]
        reduced = norms.reduce()
        self.embed_collectives = norms.collectives + len(self.count_groups)
        start, seen, cut = 0, counts.new_zeros(()), counts.new_zeros(())
        for (w, c), (wi, gi) in zip(tables, ids):
            cnt = counts[start:start + c.numel()][_local_rows(w)]
            start += c.numel()
            w_norm, g_norm = reduced[wi].sqrt(), reduced[gi].sqrt()
            clip_t = self.ratio * cnt * torch.clamp(w_norm, min=self.ratio * math.sqrt(w.shape[1]) * self.zeta)
            clipped = (cnt > 0) & (g_norm > clip_t)
            factor = torch.where(clipped, clip_t / g_norm.clamp(min=1e-30), 1.0)
            seen, cut = seen + (cnt > 0).sum(), cut + clipped.sum()
            _local_grad(w).mul_(factor.unsqueeze(1))
        self.clipped_fraction = cut / seen.clamp(min=1)
        for group in self.param_groups:  # L2 (coupled) weight decay on the tables
            if group.get("l2"):
                for p in self._params(group):
                    _local_grad(p).add_(_local(p), alpha=group["l2"])

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()


def _local_rows(param: torch.Tensor) -> slice:
    """The rows of the global tensor this rank's shard of `param` holds (all for a plain tensor)."""
    if not isinstance(param, DTensor):
        return slice(0, param.shape[0])
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return slice(offset[0], offset[0] + shape[0])
