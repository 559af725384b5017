"""The Mixture-of-Experts feed-forward layer: a drop-in for the dense FFN of a transformer block.

route -> plan (capacity, dropping) -> dispatch (local-pre, communicate) -> experts ->
combine (communicate back, local-post) [+ shared experts]. Plain PyTorch: expert parallelism
replaces `MoELayer.dispatcher` from outside.

Shape legend: B batch, T sequence, N = B*T tokens, D model dim, E experts, K choices per token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.moe.dispatch import Dispatcher, RoutingGroups, group_spans, plan_dispatch
from shoal.moe.experts import Experts
from shoal.moe.router import Router, expert_counts, load_balancing_loss, router_z_loss, sequence_balance_loss


class MoELayer(nn.Module):
    """x_BTD -> y_BTD: each token through its top_k routed experts, weighted by the router, plus
    every shared expert (DeepSeekMoE, Dai et al. 2024), their sum scaled per token by
    sigmoid(shared_gate(x)) when `shared_gate` (Qwen2-MoE).

    Routing groups (GShard): each sequence of the input is cut into spans of `group_tokens` tokens
    (0: the whole sequence; the last span takes the remainder; see dispatch.group_spans). A
    routed choice beyond its expert's capacity within its group (ceil(capacity_factor * G * K / E)
    for a group of G tokens; capacity_factor 0 means dropless) contributes nothing: the block's
    residual connection carries the token on. A group depends only on its own tokens, so how the
    batch is split (data ranks, micro-batches, pipeline micro-batches) changes nothing. Evaluation
    routes as training does. A forward over a sequence shorter than `group_tokens` (or with 0, any
    sequence), as sampling runs over a growing prompt, routes the whole given sequence as one
    group, with that group's smaller capacity.
    After each forward the layer keeps, for the trainer:
      aux_loss  load-balancing loss (see router.load_balancing_loss), float32, with gradient:
                the mean over the routing groups of each group's loss;
      z_loss    router z-loss (router.router_z_loss), float32, with gradient: a mean over tokens;
      seq_loss  with seq_aux_coef: DeepSeek-V3's sequence-wise balance loss
                (router.sequence_balance_loss), float32, with gradient: a mean over sequences;
      load      the choices per expert (E,), long, before dropping: what the selection bias's
                update counts (shoal.moe.collect.MoECollector.update_bias);
      stats     detached float tensors: tokens_per_expert (E,) kept, dropped_fraction,
                load_cv (std / mean of the routed counts before dropping, over this call's tokens:
                unlike the losses, a figure of the micro-batch), aux_loss, z_loss.
    The training loss adds coefficient * aux_loss, coefficient * z_loss and coefficient * seq_loss; the layer
    does not. `router` takes the router's options (shoal.moe.router.Router: score, expert_groups, topk_groups,
    scale, bias, bias_rate).
    """

    def __init__(self, dim: int, ffn_dim: int, *, num_experts: int, top_k: int, num_prototypes: int = 0,
                 capacity_factor: float = 1.25, group_tokens: int = 0, num_shared_experts: int = 0,
                 shared_ffn_dim: int = 0, shared_gate: bool = False, activation: str = "swiglu",
                 bias: bool = False, normalize: bool = True, init_std: float = 0.02, num_layers: int = 1,
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, aux_loss_pooled: bool = False,
                 seq_aux_coef: float = 0.0, router: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.aux_loss_coef, self.z_loss_coef, self.seq_aux_coef = aux_loss_coef, z_loss_coef, seq_aux_coef
        """The weights of aux_loss, z_loss and seq_loss in the training loss (`added_loss`)."""
        self.aux_loss_pooled = aux_loss_pooled
        """The load-balancing loss is pooled over the model's MoE layers (`balance`, shoal.moe.collect)
        instead of this layer's own in `added_loss`."""
        self.balance: tuple[torch.Tensor, torch.Tensor, int] | None = None
        """The last forward's (choices per expert, summed router probabilities per expert (with
        gradient), tokens): what a loss pooled over layers adds up."""
        if capacity_factor < 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be >= 0 (0: dropless, no capacity limit)")
        if group_tokens < 0:
            raise ValueError(f"group_tokens={group_tokens} must be >= 0 (0: one routing group per sequence)")
        if num_shared_experts < 0:
            raise ValueError(f"num_shared_experts={num_shared_experts} must be >= 0")
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.group_tokens = group_tokens
        """Tokens per routing group within a sequence (0: the whole sequence)."""
        self.router = Router(dim, num_experts, top_k=top_k, num_prototypes=num_prototypes, normalize=normalize,
                             **(router or {}))
        expert_args: dict[str, Any] = dict(activation=activation, bias=bias, init_std=init_std, num_layers=num_layers)
        self.experts = Experts(num_experts, dim, ffn_dim, **expert_args)
        # Shared experts: the same Experts module with every token sent to each of them.
        self.shared = (Experts(num_shared_experts, dim, shared_ffn_dim or ffn_dim, **expert_args)
                       if num_shared_experts else None)
        self.shared_gate = nn.Linear(dim, 1, bias=False) if shared_gate and num_shared_experts else None
        self.dispatcher = Dispatcher()
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.seq_loss: torch.Tensor | None = None
        self.load: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def init_weights(self, std: float, num_layers: int) -> None:
        """Gate normal(0, std); experts as Experts.init_weights (w2 scaled by 1/sqrt(2L))."""
        nn.init.normal_(self.router.gate.weight, std=std)
        if self.shared_gate is not None:
            nn.init.normal_(self.shared_gate.weight, std=std)
        for experts in (self.experts, self.shared):
            if experts is not None:
                experts.init_weights(std, num_layers)

    def routing_groups(self, x_BTD: torch.Tensor) -> RoutingGroups:
        """The routing groups of an input: its last-but-one dim is the sequence (a 2-D input is one
        sequence), cut into spans of `group_tokens`."""
        T = x_BTD.shape[-2] if x_BTD.dim() >= 2 else 1
        return RoutingGroups(num_sequences=x_BTD.numel() // (T * x_BTD.shape[-1]),
                             spans=group_spans(T, self.group_tokens))

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        N = x_ND.shape[0]
        routing = self.router(x_ND)
        groups = self.routing_groups(x_BTD)
        group_N = groups.group_of_tokens(x_ND.device)
        E, K, cf = self.num_experts, self.top_k, self.capacity_factor
        plan = plan_dispatch(routing, E, groups.capacities(E, K, cf, x_ND.device), group_N)
        # Nothing up to the experts reads a device value on the host. On CUDA the experts sync
        # only in dropless mode without the grouped kernel (the padded buffer's size).

        tokens_MD, splits_E = self.dispatcher.local_pre(x_ND, plan, routing.weights_NK)
        tokens_MD, splits_E = self.dispatcher.communicate(tokens_MD, splits_E)
        y_MD = self.experts(tokens_MD, splits_E, capacity=self.dispatcher.rows_bound(groups.rows_bound(E, K, cf)))
        y_MD = self.dispatcher.communicate_back(y_MD, splits_E)
        y_ND = self.dispatcher.local_post(y_MD, plan, routing.weights_NK, N)

        if self.shared is not None:
            S = self.shared.num_experts
            counts_S = torch.full((S,), N, dtype=torch.long, device=x_ND.device)
            shared_ND = self.shared(x_ND.repeat(S, 1), counts_S, capacity=N).view(S, N, -1).sum(dim=0)
            if self.shared_gate is not None:
                shared_ND = torch.sigmoid(self.shared_gate(x_ND)) * shared_ND
            y_ND = y_ND + shared_ND

        # The balance losses read each token's scores as shares of 1: a softmax's are; sigmoid scores are
        # divided by their token's sum (as DeepSeek-V3's sequence-wise loss does), else shrinking every
        # score at once would lower the loss without moving a single choice.
        shares_NE = routing.probs_NE if self.router.score == "softmax" else \
            routing.probs_NE / routing.probs_NE.sum(dim=-1, keepdim=True)
        self.aux_loss = load_balancing_loss(shares_NE, routing.experts_NK, num_groups=self.router.num_groups,
                                            group_N=group_N, num_routing_groups=groups.num_groups)
        self.z_loss = router_z_loss(routing.logits_NE)
        if self.seq_aux_coef:
            self.seq_loss = sequence_balance_loss(routing.probs_NE, routing.experts_NK, sum(groups.spans))
        self.load = plan.routed_per_expert
        self.balance = (expert_counts(routing.experts_NK, E).float(), shares_NE.float().sum(0), N)
        self.stats = self._stats(plan.tokens_per_expert, plan.routed_per_expert, N)
        return y_ND.view_as(x_BTD)

    def added_loss(self) -> torch.Tensor:
        """What the last forward adds to the training loss: aux_loss_coef * aux_loss + z_loss_coef * z_loss."""
        assert self.aux_loss is not None and self.z_loss is not None, "call forward first"
        added = self.z_loss_coef * self.z_loss
        if not self.aux_loss_pooled:  # else the collector adds the pooled load-balancing loss
            added = added + self.aux_loss_coef * self.aux_loss
        if self.seq_aux_coef:
            assert self.seq_loss is not None
            added = added + self.seq_aux_coef * self.seq_loss
        return added

    @torch.no_grad()
    def _stats(self, kept_E: torch.Tensor, routed_E: torch.Tensor, num_tokens: int) -> dict[str, torch.Tensor]:
        assert self.aux_loss is not None and self.z_loss is not None
        routed = routed_E.float()
        return {
            "tokens_per_expert": kept_E.float(),
            "dropped_fraction": (num_tokens * self.top_k - kept_E.sum()).float() / (num_tokens * self.top_k),
            # Population std: the E experts are the whole population, and E=1 gives 0, not NaN.
            "load_cv": routed.std(correction=0) / routed.mean(),
            "aux_loss": self.aux_loss.detach(),
            "z_loss": self.z_loss.detach(),
        }
