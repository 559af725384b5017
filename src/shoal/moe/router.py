"""Token-choice routing: which K experts each token goes to, with what weight, and the two
router losses (load balancing, z-loss) computed from the same probabilities.

Shape legend: N tokens (batch x sequence, flattened), D model dim, E experts, K choices per
token (top_k), G experts per prototype group (E / K under expert prototyping), S routing groups
(spans of tokens the capacity and the load-balancing loss are taken within).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Routing:
    """One forward's routing decision; choice k of token n is (experts_NK[n, k], weights_NK[n, k])."""

    experts_NK: torch.Tensor
    """Chosen experts (long), best first (under prototyping: one per group, in group order)."""
    weights_NK: torch.Tensor
    """Weight of each choice's output, in the input's dtype (computed in float32)."""
    probs_NE: torch.Tensor
    """Router probabilities, float32: a softmax over E, or over each group under prototyping."""
    logits_NE: torch.Tensor
    """Gate logits, float32."""


def top_choices(probs_NE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest probabilities per row; ties go to the lowest index.

    A stable descending sort keeps equal values in index order, which `torch.topk` does not
    promise, so identical inputs route identically on every backend.
    """
    values_NE, indices_NE = torch.sort(probs_NE, dim=-1, descending=True, stable=True)
    return values_NE[..., :k], indices_NE[..., :k]


class Router(nn.Module):
    """A bias-free linear gate D -> E followed by top-k selection (Shazeer et al. 2017).

    Plain (num_prototypes=0): softmax over the E experts, the top_k most probable. With
    `normalize` their weights are rescaled to sum to 1 (GShard's top-2, Mixtral); otherwise they
    are the raw probabilities (Switch's top-1, DeepSeek-V2, OLMoE). With top_k=1 and `normalize`
    the weight is always 1, so the gate learns only from the auxiliary losses.

    Expert prototyping (num_prototypes=K > 0; Yang et al. 2021, M6-T, arXiv 2105.15082): the
    experts form K contiguous groups of E/K, each with its own softmax and top-1; the K outputs
    are summed. A prototype's weight is its winner's in-group probability (M6-T), or with
    `normalize` that probability divided by the sum of the K winners' (the K choices then weigh
    1 in all, as top-K's do; normalising within a group would make every weight 1). K top-1
    choices are cheaper to balance than one top-K choice.
    """

    def __init__(self, dim: int, num_experts: int, *, top_k: int, num_prototypes: int = 0,
                 normalize: bool = True) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts={num_experts} must be >= 1")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must lie in 1..num_experts={num_experts}")
        if num_prototypes < 0:
            raise ValueError(f"num_prototypes={num_prototypes} must be >= 0 (0: plain top-k routing)")
        if num_prototypes and num_experts % num_prototypes:
            raise ValueError(f"num_experts={num_experts} is not divisible by num_prototypes={num_prototypes}")
        if num_prototypes and top_k != num_prototypes:
            raise ValueError(f"top_k={top_k} must equal num_prototypes={num_prototypes} under expert "
                             "prototyping (one choice per group)")
        self.num_experts = num_experts
        self.top_k = top_k
        self.num_prototypes = num_prototypes
        self.normalize = normalize
        self.gate = nn.Linear(dim, num_experts, bias=False)

    @property
    def num_groups(self) -> int:
        """Groups the experts are balanced and chosen within: K under prototyping, else 1."""
        return self.num_prototypes or 1

    def forward(self, x_ND: torch.Tensor) -> Routing:
        # Float32 logits and softmax whatever the activations' dtype (ST-MoE, section 3.2:
        # 16-bit routers are a source of instability), so autocast is switched off here.
        with torch.autocast(device_type=x_ND.device.type, enabled=False):
            logits_NE = F.linear(x_ND.float(), self.gate.weight.float())
        if self.num_prototypes:
            G = self.num_experts // self.num_prototypes
            probs_NKG = logits_NE.unflatten(-1, (self.num_prototypes, G)).softmax(dim=-1)
            weights_NK, local_NK = (t.squeeze(-1) for t in top_choices(probs_NKG, 1))
            offsets_K = torch.arange(self.num_prototypes, device=x_ND.device) * G
            experts_NK = local_NK + offsets_K
            probs_NE = probs_NKG.flatten(-2)
        else:
            probs_NE = logits_NE.softmax(dim=-1)
            weights_NK, experts_NK = top_choices(probs_NE, self.top_k)
        if self.normalize:  # over the K choices (the K prototypes' winners under prototyping)
            weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        return Routing(experts_NK=experts_NK, weights_NK=weights_NK.to(x_ND.dtype),
                       probs_NE=probs_NE, logits_NE=logits_NE)


def expert_counts(experts_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) long: how many choices went to each expert. A scatter-add, not `bincount`, which
    reads the largest index back to the host on CUDA."""
    flat = experts_NK.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat))


def load_balancing_loss(probs_NE: torch.Tensor, experts_NK: torch.Tensor, *, num_groups: int = 1,
                        group_N: torch.Tensor | None = None, num_routing_groups: int = 1) -> torch.Tensor:
    """Switch/GShard auxiliary loss E * sum_e f_e * P_e (Fedus et al. 2021, eq. 4), float32.

    f_e: fraction of the choices (before any are dropped) that went to expert e; P_e: mean
    router probability of e. Equals 1 when both are uniform; gradients reach P only.
    Under prototyping (num_groups = K) the loss is taken within each group of G = E/K experts,
    G * sum_{e in g} f_e P_e with f and P from the group's own top-1 and softmax, and averaged
    over the groups, so that a perfectly balanced layer scores 1 in both modes.
    With routing groups (`group_N`, each token's group in 0..num_routing_groups-1; see
    shoal.moe.dispatch.RoutingGroups) f and P are taken within each routing group and the loss is
    the mean of the groups' losses (GShard): a mean over groups, so equal shares of a batch's
    groups average to the whole batch's loss however the batch is split.
    """
    N, K = experts_NK.shape
    E = probs_NE.shape[-1]
    assert E % num_groups == 0 and K % num_groups == 0, (E, K, num_groups)
    G, choices_per_group = E // num_groups, K // num_groups
    S = num_routing_groups
    if group_N is None:
        assert S == 1, S
        group_N = torch.zeros(N, dtype=torch.long, device=experts_NK.device)
    tokens_S = torch.zeros(S, device=probs_NE.device).index_add_(0, group_N, torch.ones(N, device=probs_NE.device))
    pair_NK = group_N[:, None] * E + experts_NK
    counts_SE = expert_counts(pair_NK, S * E).view(S, E).float()
    f_SE = counts_SE / (tokens_S[:, None] * choices_per_group)
    P_SE = torch.zeros(S, E, device=probs_NE.device).index_add_(0, group_N, probs_NE.float()) / tokens_S[:, None]
    return G * (f_SE * P_SE).sum(dim=1).mean() / num_groups


def router_z_loss(logits_NE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss (Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)^2,
    float32. It keeps the gate's logits small, where the softmax is numerically stable."""
    return torch.logsumexp(logits_NE.float(), dim=-1).square().mean()
