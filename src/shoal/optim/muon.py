"""Muon (Jordan et al. 2024; "Muon is Scalable for LLM Training", arXiv 2502.16982): momentum orthogonalised by
a Newton-Schulz iteration for the hidden layers' matrices, AdamW for the rest, in one optimizer, under every
sharding.

The Muon step is torch.optim.Muon's, operation for operation (its momentum lerp, Nesterov mix, Newton-Schulz
function in bfloat16 and learning-rate adjustment), so that on whole 2-D tensors in one process it gives
torch's update bit for bit. A stacked expert weight (E, a, b) is E matrices, each orthogonalised on its own and
its lr adjusted by (a, b). Newton-Schulz needs whole matrices: shoal/optim/orthogonalize.py gathers each
sharded one to one owning rank and scatters the result back. The AdamW groups take torch's fused AdamW kernel
on the local shards (the trainer's AdamW, the same bits).

A step is gated on the device as LAMB's and LARS's are (`step(ok=flag)`, shoal.optim.gate): momentum buffers and
weights keep their bits where the flag is false; the AdamW groups pass it as the kernel's found_inf. State
tensors are DTensors shaped as their parameters, so checkpoints reshard them as they do AdamW's.
`last_trust` holds, per Muon matrix (per expert), the RMS of the step's update (the adjusted lr times the RMS of
the orthogonalised momentum), gathered for metrics.jsonl as `update_rms_min/median/max`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr
from torch.optim.adam import adam as adam_step

from shoal.optim.lamb_lars import _Layerwise, _select
from shoal.optim.orthogonalize import MODES, Orthogonalizer
from shoal.optim.sharded_norms import ShardedNorms, local_grad, local_tensor, split_groups

ADJUST_LR = ("original", "match_rms_adamw")


class Muon(_Layerwise):
    """Muon over groups with `muon=True` (tensors of two or more dimensions), AdamW over groups with
    `muon=False` (each group its own lr, betas, eps and weight decay).

    Muon: buf = lerp(buf, g, 1 - momentum); u = lerp(g, buf, momentum) (Nesterov) or buf; O = NS(u) in bfloat16;
    w = w (1 - lr wd) - adjust(lr, shape) O. `gather`: "owner" (one owning rank per sharded matrix) or "naive"
    (every rank gathers every matrix: the benchmark's peer).
    """

    stat_name = "update_rms"

    def __init__(self, params: Any, *, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
                 eps: float = EPS, ns_steps: int = 5, adjust_lr_fn: str | None = None,
                 betas: tuple[float, float] = (0.9, 0.95), adam_eps: float = 1e-8, gather: str = "owner",
                 batch_elems: int = 1 << 24) -> None:
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR:
            raise ValueError(f"Muon adjust_lr_fn {adjust_lr_fn!r} is not valid; valid: {', '.join(ADJUST_LR)}")
        if gather not in MODES:
            raise ValueError(f"Muon gather {gather!r} is not valid; valid: {', '.join(MODES)}")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                                  "adjust_lr_fn": adjust_lr_fn, "betas": betas, "adam_eps": adam_eps, "muon": True})
        for group in self.param_groups:
            flat = [p for p in group["params"] if group["muon"] and p.dim() < 2]
            if flat:
                raise ValueError(f"Muon takes tensors of 2 or more dimensions; got one of shape "
                                 f"{tuple(flat[0].shape)}; valid: put vectors in a group with muon=False (AdamW)")
        self.orthogonalize = Orthogonalizer(coefficients=ns_coefficients, steps=ns_steps, eps=eps, mode=gather,
                                            batch_elems=batch_elems)

    def _rows(self, p: torch.Tensor) -> bool:
        return p.dim() >= 3  # each expert's own update RMS

    @torch.no_grad()
    def step(self, closure: Any = None, *, ok: torch.Tensor | None = None) -> None:  # type: ignore[override]
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        jobs: list[tuple[dict[str, Any], list[torch.Tensor]]] = []
        for group in self.param_groups:
            params = self._params(group)
            if not params:
                continue
            if not group["muon"]:
                self._adamw(group, params, ok)
                continue
            mu = group["momentum"]
            grads = [local_grad(p) for p in params]
            bufs = [local_tensor(self._buffer(p)) for p in params]
            bufs_new = [b.lerp(g, 1 - mu) for b, g in zip(bufs, grads)]
            pairs += zip(params, [g.lerp(b, mu) for g, b in zip(grads, bufs_new)] if group["nesterov"] else bufs_new)
            _select(ok, bufs, bufs_new)
            jobs.append((group, params))
        ortho = iter(self.orthogonalize(pairs))
        norms, owners, ids = ShardedNorms(), [], []
        for group, params in jobs:
            lr, wd = group["lr"], group["weight_decay"]
            w = [local_tensor(p) for p in params]
            o = [next(ortho) for _ in params]
            adjusted = [_adjust_lr(lr, group["adjust_lr_fn"], p.shape[-2:]) for p in params]
            if ok is None:
                for wi, oi, a in zip(w, o, adjusted):
                    wi.mul_(1 - lr * wd).add_(oi, alpha=-a)
            else:
                _select(ok, w, [wi.mul(1 - lr * wd).add_(oi, alpha=-a) for wi, oi, a in zip(w, o, adjusted)])
            for p, oi, a in zip(params, o, adjusted):
                rows = self._rows(p)
                sq = oi.float().flatten(1).square().sum(1) if rows else oi.float().square().sum()
                ids.append((norms.add(sq, split_groups(p, rows=rows)), a, p.shape[-2] * p.shape[-1]))
                owners.append((p, rows))
        self._trust_owners = owners
        reduced = norms.reduce()
        self.collectives = norms.collectives
        rms = [a * (reduced[i] / n).sqrt() for i, a, n in ids]
        self.last_trust = torch.cat([r.reshape(-1) for r in rms]) if rms else torch.ones(0)

    def _buffer(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    def _adamw(self, group: dict[str, Any], params: list[torch.Tensor], ok: torch.Tensor | None) -> None:
        """torch's fused AdamW on the local shards (the flag as its found_inf: 1 skips the step)."""
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32, device=local_tensor(p).device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif state["step"].device != local_tensor(p).device:  # a checkpoint's host counter
                state["step"] = state["step"].to(local_tensor(p).device, torch.float32)
        b1, b2 = group["betas"]
        found_inf = None if ok is None else (~ok).float().to(local_tensor(params[0]).device)
        adam_step(
            [local_tensor(p) for p in params], [local_grad(p) for p in params],
            [local_tensor(self.state[p]["exp_avg"]) for p in params],
            [local_tensor(self.state[p]["exp_avg_sq"]) for p in params], [],
            [self.state[p]["step"] for p in params], fused=True, found_inf=found_inf, decoupled_weight_decay=True,
            amsgrad=False, beta1=b1, beta2=b2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["adam_eps"], maximize=False)
