"""The optimizer of `shoal train`: AdamW, LAMB, LARS or CowClip over the parameter groups a config names
(`build_optimizer`). The large-batch optimizers live in shoal/optim/lamb_lars.py and shoal/optim/cowclip.py, the
learning-rate schedule in shoal/optim/schedule.py."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shoal.mesh import reduction_groups
from shoal.optim.config import OptimConfig
from shoal.optim.schedule import scale_for_batch


def build_optimizer(source: Any, cfg: OptimConfig, *, global_batch: int | None = None,
                    embeddings: list[Any] | None = None,
                    count_groups: list[Any] | None = None) -> torch.optim.Optimizer:
    """The optimizer `cfg` names over `source`: a Runtime (what `shoal train` passes: CowClip finds
    the embedding tables in its model parts and sums id counts over its data ranks) or an iterable
    of parameters. Weight decay and trust ratios on matrices, none on vectors (norms, biases)
    unless adapt_vectors. AdamW takes torch's fused kernel where every parameter lives on a GPU or
    the CPU (see `adamw_kernel`). `global_batch`: apply the batch scaling rule (`scale_for_batch`).
    `embeddings`, `count_groups`: CowClip's tables and the groups its id counts are summed over,
    for a source that is not a Runtime (default: found in the runtime / none)."""
    from shoal.optim.cowclip import CowClip
    from shoal.optim.lamb_lars import LAMB, LARS
    from shoal.runtime import Runtime

    if cfg.optimizer == "muon":
        return build_muon(source, cfg, global_batch=global_batch)
    cfg = scale_for_batch(cfg, global_batch) if global_batch is not None else cfg
    runtime = source if isinstance(source, Runtime) else None
    params = [p for p in (runtime.parameters() if runtime is not None else source) if p.requires_grad]
    if embeddings is None:
        embeddings = _embeddings(runtime) if cfg.optimizer == "cowclip" and runtime is not None else []
    tables = {id(e[1] if isinstance(e, tuple) else e.weight) for e in embeddings}
    dense = [p for p in params if id(p) not in tables]
    vectors_adapt = cfg.adapt_vectors and cfg.optimizer in ("lamb", "lars")
    groups: list[dict[str, Any]] = [
        {"params": [p for p in dense if p.dim() >= 2], "weight_decay": cfg.weight_decay, "adapt": True},
        {"params": [p for p in dense if p.dim() < 2], "weight_decay": cfg.weight_decay if vectors_adapt else 0.0,
         "adapt": vectors_adapt},
    ]
    if cfg.optimizer == "adamw":
        for g in groups:
            del g["adapt"]
        kernel = adamw_kernel({p.device.type for p in params})
        return torch.optim.AdamW(by_layout(groups) if kernel else [g for g in groups if g["params"]], lr=cfg.lr,
                                 betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel)
    groups = [g for g in groups if g["params"]]
    if cfg.optimizer == "lars":
        return LARS(groups, lr=cfg.lr, momentum=cfg.momentum, eta=cfg.lars_eta, per_expert=cfg.per_expert)
    adam: dict[str, Any] = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, "per_expert": cfg.per_expert}
    if cfg.optimizer == "lamb":
        return LAMB(groups, **adam)
    for g in groups:  # CowClip: AdamW on the dense part
        g["adapt"] = False
    embed_lr = cfg.embed_lr if cfg.embed_lr is not None else cfg.lr
    if embeddings:
        groups.append({"params": [e[1] if isinstance(e, tuple) else e.weight for e in embeddings],
                       "weight_decay": 0.0, "adapt": False,
                       "l2": cfg.embed_weight_decay, "lr": embed_lr, "lr_scale": embed_lr / cfg.lr})
    if count_groups is None:
        count_groups = reduction_groups(runtime.mesh, ("dp", "fsdp", "cp")) if runtime and runtime.mesh else []
    return CowClip(groups, embeddings=embeddings, count_groups=count_groups, ratio=cfg.cowclip_ratio,
                              zeta=cfg.cowclip_zeta, **adam)


def build_muon(source: Any, cfg: OptimConfig, *, global_batch: int | None = None) -> torch.optim.Optimizer:
    """Muon over `source` (a Runtime, a module, or (name, parameter) pairs; bare parameters: every tensor of two
    or more dimensions counts as hidden): the hidden layers' matrices (those of the model adapter's blocks,
    stacked experts included) to Muon, the rest (embeddings, head, norms, biases, names matching
    cfg.muon_adamw) to AdamW at cfg.muon_adamw_lr, weight decay on matrices only."""
    from shoal.optim.muon import Muon

    ratio = (cfg.muon_adamw_lr if cfg.muon_adamw_lr is not None else cfg.lr) / cfg.lr  # kept by the batch scaling
    cfg = scale_for_batch(cfg, global_batch) if global_batch is not None else cfg
    named, blocks = _named(source)
    excluded = [f for f in cfg.muon_adamw.split(",") if f]
    hidden = [p.dim() >= 2 and (blocks is None or n.startswith(blocks)) and not any(f in n for f in excluded)
              for n, p in named]
    adamw = {"muon": False, "lr": cfg.lr * ratio, "lr_scale": ratio, "betas": (cfg.beta1, cfg.beta2),
             "adam_eps": cfg.eps}
    groups: list[dict[str, Any]] = [
        {"params": [p for (_, p), h in zip(named, hidden) if h], "weight_decay": cfg.weight_decay},
        {"params": [p for (_, p), h in zip(named, hidden) if not h and p.dim() >= 2], "weight_decay": cfg.weight_decay,
         **adamw},
        {"params": [p for (_, p), h in zip(named, hidden) if not h and p.dim() < 2], "weight_decay": 0.0, **adamw},
    ]
    return Muon([g for g in groups if g["params"]], lr=cfg.lr, momentum=cfg.muon_momentum,
                nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_adjust_lr,
                gather=cfg.muon_gather)


def _named(source: Any) -> tuple[list[tuple[str, nn.Parameter]], str | None]:
    """`source`'s trainable (name, parameter) pairs and the name prefix of its hidden blocks (None: unknown)."""
    from shoal.models.adapter import adapter_for
    from shoal.runtime import Runtime

    if isinstance(source, Runtime):
        named, module = list(source.named_parameters()), source.parts[0]
    elif isinstance(source, nn.Module):
        named, module = list(source.named_parameters()), source
    else:
        items = list(source)
        named = [it if isinstance(it, tuple) else (str(i), it) for i, it in enumerate(items)]
        module = None
    adapter = adapter_for(module) if module is not None else None
    return [(n, p) for n, p in named if p.requires_grad], (f"{adapter.blocks}." if adapter is not None else None)


def by_layout(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`groups` split so that each holds parameters of one layout: plain tensors, or DTensors of one mesh. A fused
    (or foreach) step runs one kernel over a group's tensors, and torch refuses a call that mixes plain tensors and
    DTensors, or DTensors of two meshes (expert parallelism's experts beside the data engine's shards, tensor
    parallelism without sequence parallelism beside its plain norms). Empty groups are dropped."""
    split: list[dict[str, Any]] = []
    for group in groups:
        layouts: dict[Any, list[nn.Parameter]] = {}
        for p in group["params"]:
            layouts.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        split += [{**group, "params": members} for members in layouts.values()]
    return split


def _embeddings(runtime: Any) -> list[tuple[nn.Embedding, nn.Parameter]]:
    """The embedding tables of a runtime's model parts, each with the parameter the optimizer holds
    for its weight (matched by name: a ZeRO-1/2 engine hands the optimizer shards, not the module's
    own weight)."""
    params = dict(runtime.named_parameters())
    found: dict[str, tuple[nn.Embedding, nn.Parameter]] = {}
    for part in runtime.parts:
        for name, module in part.named_modules():
            key = f"{name}.weight" if name else "weight"
            if isinstance(module, nn.Embedding) and key in params and key not in found:
                found[key] = (module, params[key])
    return list(found.values())


def adamw_kernel(device_types: set[str]) -> dict[str, bool]:
    """AdamW's implementation for parameters on these device types: torch's fused kernel (one call for every
    parameter, DTensor shards and offloaded CPU shards included) where all are on CUDA or the CPU, which torch
    fuses on both: a step's host work is then a few calls however many parameters, and the kernel honours a
    skipped step's flag (`found_inf`, shoal.optim.gate); elsewhere torch's default."""
    return {"fused": True} if device_types <= {"cuda", "cpu"} else {}
