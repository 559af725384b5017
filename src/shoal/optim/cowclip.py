"""CowClip (Zheng et al. 2022, arXiv 2204.06240): adaptive column-wise clipping of embedding rows over LAMB's
update, for huge-batch CTR training; row norms and id counts taken whole under every sharding."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shoal.optim.lamb_lars import LAMB
from shoal.optim.sharded_norms import ShardedNorms, local_grad, local_rows, local_tensor, split_groups


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
            counts = torch.zeros(module.num_embeddings, device=local_tensor(weight).device)
            self._tables.append((weight, counts))
            self._hooks.append(module.register_forward_pre_hook(self._counter(module, counts)))

    @staticmethod
    def _counter(module: nn.Module, counts: torch.Tensor) -> Any:
        def count(_module: nn.Module, args: tuple[Any, ...]) -> None:
            if module.training and torch.is_grad_enabled():
                ids = local_tensor(args[0]).reshape(-1).to(counts.device)
                counts.index_add_(0, ids, torch.ones_like(ids, dtype=counts.dtype))
        return count

    @torch.no_grad()
    def step(self, closure: Any = None, *, ok: torch.Tensor | None = None) -> None:  # type: ignore[override]
        """Clip the embedding rows' gradients, then LAMB's step gated by `ok` (the clipping changes only
        gradients; the counts restart from zero after every step, taken or not)."""
        tables = [(w, c) for w, c in self._tables if w.grad is not None]
        if tables:
            self._clip(tables)
        super().step(ok=ok)
        for _, counts in self._tables:
            counts.zero_()

    def _clip(self, tables: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        counts = torch.cat([c for _, c in tables])  # one vector for every table: one all-reduce per group
        for count_group in self.count_groups:
            dist.all_reduce(counts, group=count_group)
        norms = ShardedNorms()
        ids = [(norms.add(local_tensor(w).square().sum(1), split_groups(w, rows=True)),
                norms.add(local_grad(w).square().sum(1), split_groups(w, rows=True))) for w, _ in tables]
        reduced = norms.reduce()
        self.embed_collectives = norms.collectives + len(self.count_groups)
        start, seen, cut = 0, counts.new_zeros(()), counts.new_zeros(())
        for (w, c), (wi, gi) in zip(tables, ids):
            cnt = counts[start:start + c.numel()][local_rows(w)]
            start += c.numel()
            w_norm, g_norm = reduced[wi].sqrt(), reduced[gi].sqrt()
            clip_t = self.ratio * cnt * torch.clamp(w_norm, min=self.ratio * math.sqrt(w.shape[1]) * self.zeta)
            clipped = (cnt > 0) & (g_norm > clip_t)
            factor = torch.where(clipped, clip_t / g_norm.clamp(min=1e-30), 1.0)
            seen, cut = seen + (cnt > 0).sum(), cut + clipped.sum()
            local_grad(w).mul_(factor.unsqueeze(1))
        self.clipped_fraction = cut / seen.clamp(min=1)
        for group in self.param_groups:  # L2 (coupled) weight decay on the tables
            if group.get("l2"):
                for p in self._params(group):
                    local_grad(p).add_(local_tensor(p), alpha=group["l2"])

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
