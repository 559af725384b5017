"""LAMB and LARS: layer-wise trust ratios, each norm a whole parameter's (or a stacked expert's) under every
sharding (shoal/optim/sharded_norms.py).

Vectors (biases, norm weights) are excluded from adaptation and weight decay by default (`adapt_vectors` in the
config), as in both papers. Each optimizer's `last_trust` holds the step's trust ratios on the device; the
trainer reads them only at its logging steps (`gather_trust`, `trust_summary`: min, median and max over every
tensor of every rank, each counted once, into metrics.jsonl).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shoal.optim.sharded_norms import (
    ShardedNorms,
    local_grad,
    local_rows,
    local_tensor,
    per_row,
    split_groups,
    sq_norms,
    trust_ratio,
)


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


def trust_summary(trust: dict[tuple[str, int], float], name: str = "trust") -> dict[str, float]:
    """min / median (the lower one, as torch's) / max of trust ratios ({} for none), as `name`_min etc.
    (an optimizer's `stat_name`: Muon's per-matrix figures are update RMS): what metrics.jsonl records at
    each logging step."""
    if not trust:
        return {}
    t = torch.tensor(sorted(trust.values()), dtype=torch.float64)
    return {f"{name}_min": float(t[0]), f"{name}_median": float(t[(len(t) - 1) // 2]), f"{name}_max": float(t[-1])}


def _select(ok: torch.Tensor | None, tensors: Sequence[torch.Tensor], new: Sequence[torch.Tensor]) -> None:
    """tensors[i] <- new[i] where `ok` (0-d bool on the device; None: always), else left as they are,
    bit for bit (torch.where picks, computing nothing on the kept values)."""
    if ok is None:
        torch._foreach_copy_(list(tensors), list(new))
        return
    for t, n in zip(tensors, new):
        t.copy_(torch.where(ok.to(t.device), n, t))


class _Layerwise(torch.optim.Optimizer):
    """What LAMB, LARS and CowClip share: groups with an `adapt` flag, the rows rule, trust ratios, and
    a step gated on the device: `step(ok=flag)` with `flag` a 0-d bool tensor updates nothing where it
    is false (weights, moments, momentum buffers and step counters keep their exact bits: each new
    value is computed beside the old one and torch.where picks; shoal.optim.gate). The step counter
    is a tensor on the parameter's device, so the bias corrections never read it on the host."""

    stat_name = "trust"
    """What `last_trust` holds, as metrics.jsonl names it (trust_summary)."""

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
            span = local_rows(param)
            keys += [(name, r) for r in range(span.start, span.stop)] if rows else [(name, -1)]
        return keys


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
    def step(self, closure: Any = None, *, ok: torch.Tensor | None = None) -> None:  # type: ignore[override]
        norms, jobs = ShardedNorms(), []
        owners: list[tuple[torch.Tensor, bool]] = []
        for group in self.param_groups:
            params = self._params(group)
            if not params:
                continue
            b1, b2 = group["betas"]
            w, g = [local_tensor(p) for p in params], [local_grad(p) for p in params]
            states = [self._state(p, ok) for p in params]
            m, v = [local_tensor(st[0]) for st in states], [local_tensor(st[1]) for st in states]
            m_new = torch._foreach_lerp(m, g, 1 - b1)
            v_new = torch._foreach_mul(v, b2)
            torch._foreach_addcmul_(v_new, g, g, 1 - b2)
            step = states[0][2]  # every parameter of a group steps together
            bc1, bc2 = 1 - b1**step, 1 - b2**step
            denom = torch._foreach_div(v_new, bc2)
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, group["eps"])
            u = torch._foreach_div(m_new, denom)
            del denom
            torch._foreach_div_(u, bc1)
            _select(ok, m, m_new)
            _select(ok, v, v_new)
            del m_new, v_new
            if group["weight_decay"]:
                torch._foreach_add_(u, w, alpha=group["weight_decay"])
            ids = None
            if group["adapt"]:
                rows = [self._rows(p) for p in params]
                ids = [(norms.add(a, split_groups(p, rows=r)), norms.add(b, split_groups(p, rows=r)))
                       for p, r, a, b in zip(params, rows, sq_norms(w, rows), sq_norms(u, rows))]
                owners += zip(params, rows)
            jobs.append((group, w, u, ids))
        self._trust_owners = owners
        reduced = norms.reduce()
        self.collectives, trusts = norms.collectives, []
        for group, w, u, ids in jobs:
            if ids is not None:
                for i, (wi, ui) in enumerate(ids):
                    trust = trust_ratio(reduced[wi], reduced[ui])
                    trusts.append(trust)
                    u[i].mul_(per_row(trust, u[i]))
            _select(ok, w, torch._foreach_add(w, u, alpha=-group["lr"]))
        self.last_trust = torch.cat(trusts) if trusts else torch.ones(0)

    def _state(self, p: torch.Tensor, ok: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq, step): the step counted on the device (float64, as the host's
        float the bias corrections were taken in), by one where `ok` holds."""
        state = self.state[p]
        device = local_tensor(p).device
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float64, device=device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif state["step"].device != device or state["step"].dtype != torch.float64:  # a checkpoint's host counter
            state["step"] = state["step"].to(device, torch.float64)
        state["step"] += 1 if ok is None else ok.to(device)
        return state["exp_avg"], state["exp_avg_sq"], state["step"]


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
    def step(self, closure: Any = None, *, ok: torch.Tensor | None = None) -> None:  # type: ignore[override]
        norms, jobs = ShardedNorms(), []
        owners: list[tuple[torch.Tensor, bool]] = []
        for group in self.param_groups:
            params = self._params(group)
            if not params:
                continue
            w, g = [local_tensor(p) for p in params], [local_grad(p) for p in params]
            ids = None
            if group["adapt"]:
                rows = [self._rows(p) for p in params]
                ids = [(norms.add(a, split_groups(p, rows=r)), norms.add(b, split_groups(p, rows=r)))
                       for p, r, a, b in zip(params, rows, sq_norms(w, rows), sq_norms(g, rows))]
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
                    local_lr = group["eta"] * trust_ratio(w_sq, den_sq)
                    local_lr = torch.where((w_sq > 0) & (g_sq > 0), local_lr, 1.0)
                    trusts.append(local_lr)
                    d[i].mul_(per_row(local_lr, d[i]))
            bufs = [local_tensor(self._buffer(p)) for p in params]
            bufs_new = torch._foreach_mul(bufs, group["momentum"])
            torch._foreach_add_(bufs_new, d, alpha=group["lr"])
            _select(ok, w, torch._foreach_sub(w, bufs_new))
            _select(ok, bufs, bufs_new)
        self.last_trust = torch.cat(trusts) if trusts else torch.ones(0)

    def _buffer(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]
