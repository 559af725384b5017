"""What the MoE layers of a model add to a step: their losses and their load figures.

A forward hook on every MoE layer notes each call (a WideNet layer is called once per block, and
each call counts). The runtime adds `take_loss()` to each micro-batch's training loss and reads
`take_stats()` once per step for the metrics: per layer, the tokens each expert kept (min, mean,
max over experts, summed over the step's micro-batches), the coefficient of variation of the
routed counts, the dropped fraction and the two losses (means over calls), and each expert's
share of the kept tokens (the load heatmap's column for this step).

Auxiliary-loss-free balancing (a router with a selection bias and a rate, shoal.moe.router.Router): the
collector adds up each such layer's expert loads over the training calls of a step, and `update_bias`
moves the biases once per optimizer step, with the loads summed over every rank that sees other tokens
(one all-reduce of all layers' loads at once, on the device: no host synchronisation). Every rank then
holds the loads of the whole global batch (each pipeline stage for its own layers, which every
micro-batch passes), so every plan moves the biases as one process does.

A load-balancing loss pooled over layers (`aux_loss_pooled`, transformers' Mixtral and Qwen2-MoE)
pools one forward's tokens: a micro-batch's, on every rank that sees other tokens of it (with
accumulation the runtime takes the mean of the micro-batches' losses, as the HF Trainer does). Where
ranks split the tokens, the runtime hands the collector a sum over those ranks (`pool_over`). Where
pipeline stages split the layers, it hands it a sum over the stages that it starts once a rank's
forwards of a micro-batch are done and that backward waits for (`pool_over_stages`, `micro_batch`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from shoal.moe.layer import MoELayer

Total = Callable[[torch.Tensor], torch.Tensor]
"""A tensor summed over the ranks that see other tokens of the batch (no autograd): set by the
runtime, since this package imports nothing distributed."""
Started = Callable[[torch.Tensor], Callable[[], torch.Tensor]]
"""Starts summing a tensor over the pipeline's stages and data ranks (no autograd) and returns the
wait that gives the sum: set by the runtime."""
Balance = tuple[torch.Tensor, torch.Tensor, int]
"""An MoE layer's `balance`: (choices per expert, summed router probabilities per expert, rows)."""

FIGURES = ("tokens_min", "tokens_mean", "tokens_max", "load_cv", "dropped", "aux_loss", "z_loss")
"""The per-layer figures of `take_stats`, in order."""


class MoECollector:
    """The MoE layers of `model` (none: everything here is empty)."""

    def __init__(self, model: nn.Module) -> None:
        self.names: dict[int, str] = {}
        for name, module in model.named_modules():  # a shared (WideNet) layer once, by its first name
            if isinstance(module, MoELayer):
                self.names[id(module)] = _short(name)
                module.register_forward_hook(self._called)
        self._losses: list[torch.Tensor] = []
        self._pooled: list[tuple[MoELayer, Balance]] = []  # see pooled_loss
        self._calls: dict[str, list[dict[str, torch.Tensor]]] = {}
        self._attach: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._pool: tuple[Total, int] | None = None
        self._stages: tuple[Started, int] | None = None  # see pool_over_stages
        self._open: dict[int, _Counts] = {}  # micro-batch -> its counts, until its sum starts
        self._micro: _Counts | None = None  # the counts of the forward under way (micro_batch)
        self._biased: list[MoELayer] = []  # layers whose router moves its selection bias, each once
        for module in model.modules():
            if isinstance(module, MoELayer) and module.router.bias is not None and module.router.bias_rate:
                if all(module is not m for m in self._biased):
                    self._biased.append(module)
        self._loads: dict[int, torch.Tensor] = {}  # id(layer) -> its loads over this step's training calls

    def __bool__(self) -> bool:
        return bool(self.names)

    @contextlib.contextmanager
    def attached(self, transform: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
        """Within: each layer's added loss, through `transform` (the micro-batch's share, a loss
        scale), rides on the layer's output instead of waiting for `take_loss`: backward through the
        output also differentiates it (`attach_loss`). For a pipeline, whose stages start backward
        from their outputs, never from one loss (Megatron-Core's MoEAuxLossAutoScaler)."""
        self._attach, self._open = transform, {}
        try:
            yield
        finally:
            self._attach, self._open = None, {}

    def pool_over(self, total: Total, ranks: int) -> None:
        """Pool the load-balancing loss over the `ranks` ranks that see other tokens of each forward
        (data ranks: they average their gradients); `total` sums a tensor over them. See pooled_loss."""
        self._pool = (total, ranks)

    def pool_over_stages(self, start: Started, num_experts: int) -> None:
        """Under pp: pool the load-balancing loss of a micro-batch over the layers of every stage
        (and the data ranks of `pool_over`). `start` begins summing a tensor over those ranks; every
        rank calls it once per micro-batch, in micro-batch order (`micro_batch`), with the counts of
        its own `num_experts`-expert layers (zeros where it has none)."""
        self._stages = (start, num_experts)

    @contextlib.contextmanager
    def micro_batch(self, micro: int, *, last: bool) -> Iterator[None]:
        """Within (under `attached` and `pool_over_stages`): a stage's forward of micro-batch
        `micro`; its MoE layers' counts are that micro-batch's. `last`: this rank's last forward of
        it, after which the sum over the stages starts (without waiting: backward waits for it).

        Why the sum is there in time: a micro-batch's backward on any stage follows the last stage's
        forward of it, which follows every stage's forward of it; and every stage runs its forwards
        in micro-batch order, so every rank starts the sums in the same order."""
        assert self._stages is not None, "pool_over_stages first"
        counts = self._open.setdefault(micro, _Counts())
        self._micro = counts
        try:
            yield
        finally:
            self._micro = None
        if last:
            start, num_experts = self._stages
            counts.start(start, num_experts)
            del self._open[micro]

    def _called(self, module: nn.Module, _args: Any, out: Any) -> Any:
        assert isinstance(module, MoELayer)
        if torch._C._current_graph_task_id() != -1:
            return None  # recomputed inside backward (activation checkpointing): counted in forward
        if module.training:
            self._calls.setdefault(self.names[id(module)], []).append(module.stats)
            if module.load is not None and module.router.bias is not None and module.router.bias_rate:
                load = self._loads.get(id(module))
                self._loads[id(module)] = module.load if load is None else load + module.load
        if not torch.is_grad_enabled():
            return None
        if self._attach is not None:
            out = attach_loss(out, self._attach(module.added_loss()))
            if module.aux_loss_pooled and module.balance is not None:
                out = self._pool_later(out, module, module.balance)
            return out
        self._losses.append(module.added_loss())
        if module.aux_loss_pooled and module.balance is not None:
            self._pooled.append((module, module.balance))
        return None

    def _pool_later(self, out: torch.Tensor, module: MoELayer, balance: Balance) -> torch.Tensor:
        """`out`, such that backward through it also differentiates `attached`'s transform of the
        pooled loss w.r.t. this call's router probabilities, once its micro-batch's counts are summed
        over the stages. d/dP_e of the pooled loss (pooled_loss) is coef * E * C_e / rows**2, with C
        and rows over every layer of every stage and data rank; times the data ranks, whose
        gradients the engines average. The transform (a micro-batch's share, a loss scale) is
        linear: its factor is its value at 1."""
        assert self._stages is not None and self._micro is not None, \
            "a pipeline pools the load-balancing loss per micro-batch (Runtime.forward_backward)"
        assert self._attach is not None
        counts_E, probs_E, rows = balance
        self._micro.add(counts_E, rows)
        ranks = self._pool[1] if self._pool is not None else 1
        one = torch.ones((), dtype=torch.float64, device=probs_E.device)
        weight = self._attach(one) * (ranks * module.aux_loss_coef * module.num_experts)
        return _PoolLater.apply(out, probs_E, self._micro, weight)

    def take_loss(self) -> torch.Tensor | None:
        """The sum of the added losses of the calls since the last take (None without any), with
        the load-balancing loss pooled over those calls' layers where the layers pool it."""
        losses, self._losses = self._losses, []
        pooled, self._pooled = self._pooled, []
        if pooled:
            losses.append(pooled_loss(pooled, self._pool))
        return torch.stack(losses).sum() if losses else None

    @torch.no_grad()
    def update_bias(self, total: Total | None = None, applied: torch.Tensor | None = None) -> None:
        """After an optimizer step: each biased router's bias b_e += gamma * sign(mean load - load_e)
        (DeepSeek-V3, Liu et al. 2024, section 2.1.2), the loads counted over the training calls since
        the last update and, with `total` (the runtime's sum over the ranks that see other tokens), over
        every such rank: one all-reduce of every layer's loads. `applied` (a 0-d bool on the device): the
        step changed the weights; where it did not, nor do the biases. The counts are whole numbers held
        exactly in float64, and the sign is taken of sum(load) - E load_e, so every plan moves the biases
        alike, bit for bit."""
        if not self._biased:
            return
        loads = [self._loads.pop(id(m), None) for m in self._biased]
        device = next(load.device for load in [*loads, self._biased[0].router.bias] if load is not None)
        self._loads = {}
        packed = torch.cat([(load if load is not None else torch.zeros(m.num_experts, device=device)).double()
                            for m, load in zip(self._biased, loads, strict=True)])
        if total is not None:
            packed = total(packed)
        for layer, load_E in zip(self._biased, packed.split([m.num_experts for m in self._biased]), strict=True):
            bias = layer.router.bias
            assert bias is not None
            step_E = layer.router.bias_rate * torch.sign(load_E.sum() - layer.num_experts * load_E)
            if applied is not None:
                step_E = step_E * applied.to(step_E.device)
            bias.add_(step_E.to(bias.dtype).to(bias.device))

    def take_stats(self) -> dict[str, torch.Tensor]:
        """Per layer, the FIGURES of the training calls since the last take, as one float tensor
        (then each expert's share of the kept tokens), on the device; {} without any. A layer with a
        selection bias adds `<layer>/bias`: the bias its router chose with in those calls."""
        calls, self._calls = self._calls, {}
        out = {f"{self.names[id(m)]}/bias": m.router.bias.detach().float().clone() for m in self._biased
               if m.router.bias is not None and self.names[id(m)] in calls}
        for name, stats in calls.items():
            kept = torch.stack([s["tokens_per_expert"] for s in stats]).sum(0)
            # Called only within this iteration, on this layer's stats.
            mean = lambda key: torch.stack([s[key] for s in stats]).float().mean()  # noqa: E731, B023
            figures = torch.stack([kept.min(), kept.mean(), kept.max(), mean("load_cv"), mean("dropped_fraction"),
                                   mean("aux_loss"), mean("z_loss")])
            out[name] = torch.cat([figures, kept / kept.sum().clamp(min=1)])
        return out


def pooled_loss(calls: list[tuple[MoELayer, Balance]],
                pool: tuple[Total, int] | None = None) -> torch.Tensor:
    """aux_loss_coef * E * sum_e C_e P_e over the calls' layers at once, as transformers' Mixtral
    and Qwen2-MoE take it (`load_balancing_loss_func`): C_e the choices of expert e over all layers'
    rows (tokens) divided by the rows, P_e the summed router probabilities of e divided by the rows.
    Gradients reach P only, as in the per-layer loss.

    `pool` = (total, R): the forward's tokens are split over R ranks that average their gradients.
    The choices and rows are summed over them (one small all-reduce, no autograd: C is a count);
    each rank returns R * coef * E * sum_e C_e P_e^mine, P^mine its own summed probabilities over
    the global rows. The R ranks' values sum to R times the one-process loss, and d/dP of the loss
    is coef * E * C_e / rows, a global figure: the ranks' averaged gradients are one process's."""
    layer = calls[0][0]
    rows = sum(n for _, (_, _, n) in calls)
    counts_E = torch.stack([c for _, (c, _, _) in calls]).sum(0)
    probs_E = torch.stack([p for _, (_, p, _) in calls]).sum(0)
    if pool is None:  # one data rank: the one-process sums, bit for bit (tests/test_hf_families.py)
        counts_E, probs_E = counts_E / rows, probs_E / rows
        return layer.aux_loss_coef * layer.num_experts * (counts_E * probs_E).sum()
    total, ranks = pool
    packed = torch.cat([counts_E.double(), torch.full((1,), rows, dtype=torch.float64, device=counts_E.device)])
    packed = total(packed)
    global_rows = packed[-1].to(probs_E.dtype)
    counts_E, probs_E = packed[:-1].to(counts_E.dtype) / global_rows, probs_E / global_rows
    return ranks * layer.aux_loss_coef * layer.num_experts * (counts_E * probs_E).sum()


def _short(name: str) -> str:
    """layers.3.feed_forward -> 3 (shoal's model); other models keep their module name."""
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[2] == "feed_forward":
        return parts[1]
    return name


def records(stats: dict[str, list[float]]) -> dict[str, Any]:
    """metrics.jsonl fields of one step's `take_stats` (read to the host): moe/<layer>/<figure>,
    and moe_load, each expert's share of the kept tokens averaged over the layers; with selection
    biases moe/<layer>/bias (per expert) and moe_bias, each expert's bias averaged over the layers."""
    out: dict[str, Any] = {}
    shares = []
    biases = []
    for layer, values in stats.items():
        if layer.endswith("/bias"):
            out[f"moe/{layer}"] = list(values)
            biases.append(values)
            continue
        out.update({f"moe/{layer}/{key}": value for key, value in zip(FIGURES, values)})
        shares.append(values[len(FIGURES):])
    if shares:
        out["moe_load"] = [sum(col) / len(shares) for col in zip(*shares)]
    if biases:
        out["moe_bias"] = [sum(col) / len(biases) for col in zip(*biases)]
    return out


class _AttachLoss(torch.autograd.Function):
    """Forward: `y` unchanged. Backward: `y`'s gradient passed on, and 1 for `loss`."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        # No saved tensors: activation checkpointing recomputes the layer without this node.
        ctx.loss = (loss.shape, loss.dtype, loss.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.loss
        return grad, torch.ones(shape, dtype=dtype, device=device)


def attach_loss(y: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """`y`, such that any backward through it also differentiates the scalar `loss` (as if it were
    added to the final loss)."""
    return _AttachLoss.apply(y, loss)


class _Counts:
    """One micro-batch's expert choices and rows on this rank's stages, then (`start`) their sum
    over every stage and data rank, which the first backward that needs it waits for."""

    def __init__(self) -> None:
        self.counts_E: torch.Tensor | None = None
        self.rows = 0
        self._wait: Callable[[], torch.Tensor] | None = None
        self._total: torch.Tensor | None = None

    def add(self, counts_E: torch.Tensor, rows: int) -> None:
        assert self._wait is None, "a micro-batch's counts after its sum started"
        counts = counts_E.detach().double()
        self.counts_E = counts if self.counts_E is None else self.counts_E + counts
        self.rows += rows

    def start(self, start: Started, num_experts: int) -> None:
        counts_E = self.counts_E if self.counts_E is not None else torch.zeros(num_experts, dtype=torch.float64)
        rows = torch.full((1,), self.rows, dtype=torch.float64, device=counts_E.device)
        self._wait = start(torch.cat([counts_E, rows]))

    def total(self) -> torch.Tensor:
        """(choices per expert, rows) over every stage and data rank, float64; waits the first time."""
        if self._total is None:
            assert self._wait is not None, "backward of a micro-batch whose forwards have not all run"
            self._total, self._wait = self._wait(), None
        return self._total


class _PoolLater(torch.autograd.Function):
    """Forward: `y` unchanged. Backward: `y`'s gradient passed on, and weight * C_e / rows**2 for
    the summed router probabilities `probs_E`, with (C, rows) the micro-batch's pooled counts."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, probs_E: torch.Tensor, counts: _Counts,
                weight: torch.Tensor) -> torch.Tensor:
        ctx.counts, ctx.weight, ctx.dtype = counts, weight, probs_E.dtype  # no saved tensors: recompute-safe
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        total = ctx.counts.total().to(ctx.weight.device)
        counts_E, rows = total[:-1], total[-1]
        return grad, (ctx.weight * counts_E / (rows * rows)).to(ctx.dtype), None, None
