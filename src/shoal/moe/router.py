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


NORM_EPS = 1e-20
"""Added to the sum of a token's chosen weights before dividing by it, as transformers' DeepSeek-V3 does: it
keeps a sum of sigmoid scores that underflows to 0 from giving 0/0. A softmax's top-k sum is at least K/E,
where adding 1e-20 rounds back to the same float32 (Mixtral's and Qwen's division, bit for bit)."""

SCORES = ("softmax", "sigmoid")


class Router(nn.Module):
    """A bias-free linear gate D -> E followed by top-k selection (Shazeer et al. 2017).

    Plain (num_prototypes=0): scores over the E experts, a softmax (`score`="softmax") or each
    expert's sigmoid (DeepSeek-V3), the top_k highest. With `normalize` their weights are rescaled
    to sum to 1 (GShard's top-2, Mixtral; the sum plus NORM_EPS); otherwise they are the raw scores
    (Switch's top-1, DeepSeek-V2, OLMoE). With top_k=1 and `normalize` the weight is always 1, so the
    gate learns only from the auxiliary losses. The weights are then multiplied by `scale`
    (DeepSeek-V3's routed_scaling_factor).

    Selection only (DeepSeek-V3, Liu et al. 2024, section 2.1.2): with `bias` a buffer b (E,) is added to
    the scores that choose the experts, never to the weights (auxiliary-loss-free balancing: the
    trainer moves b after each step, shoal.moe.collect.MoECollector.update_bias). Group-limited routing
    (`expert_groups` = n_group > 1): the experts form n_group contiguous groups, each ranked by the sum
    of its two highest choice scores, and a token chooses its top_k among the `topk_groups` best
    groups only (the other groups' experts cannot be chosen, however negative the biased scores).

    Expert prototyping (num_prototypes=K > 0; Yang et al. 2021, M6-T, arXiv 2105.15082): the
    experts form K contiguous groups of E/K, each with its own softmax and top-1; the K outputs
    are summed. A prototype's weight is its winner's in-group probability (M6-T), or with
    `normalize` that probability divided by the sum of the K winners' (the K choices then weigh
    1 in all, as top-K's do; normalising within a group would make every weight 1). K top-1
    choices are cheaper to balance than one top-K choice.
    """

    def __init__(self, dim: int, num_experts: int, *, top_k: int, num_prototypes: int = 0,
                 normalize: bool = True, score: str = "softmax", expert_groups: int = 0, topk_groups: int = 0,
                 scale: float = 1.0, bias: bool = False, bias_rate: float = 0.0) -> None:
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
        if score not in SCORES:
            raise ValueError(f"router score={score!r} is not valid; valid: {', '.join(SCORES)}")
        if expert_groups > 1 and (num_experts % expert_groups or num_experts // expert_groups < 2
                                  or not 1 <= topk_groups <= expert_groups
                                  or top_k > topk_groups * (num_experts // expert_groups)):
            raise ValueError(f"expert_groups={expert_groups} with topk_groups={topk_groups} does not fit "
                             f"num_experts={num_experts}, top_k={top_k}; valid: groups of >= 2 experts dividing "
                             "num_experts, 1 <= topk_groups <= expert_groups, top_k within the chosen groups")
        if num_prototypes and (score != "softmax" or expert_groups > 1 or bias):
            raise ValueError("expert prototyping takes the softmax router without groups or a selection bias; "
                             "valid: num_prototypes=0, or score='softmax', expert_groups=0 and bias=False")
        self.num_experts = num_experts
        self.top_k = top_k
        self.num_prototypes = num_prototypes
        self.normalize = normalize
        self.score = score
        self.expert_groups = expert_groups if expert_groups > 1 else 0
        self.topk_groups = topk_groups
        self.scale = scale
        self.bias_rate = bias_rate
        """The sign rule's step gamma (MoECollector.update_bias); 0 keeps the bias as it is."""
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.bias: torch.Tensor | None
        self.register_buffer("bias", torch.zeros(num_experts) if bias else None)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """A selection bias starts at 0 (after building on the meta device it holds no values)."""
        if self.bias is not None:
            self.bias.zero_()

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
            probs_NE = logits_NE.softmax(dim=-1) if self.score == "softmax" else logits_NE.sigmoid()
            if self.bias is None and not self.expert_groups:
                weights_NK, experts_NK = top_choices(probs_NE, self.top_k)
            else:
                choice_NE = probs_NE.detach() if self.bias is None else probs_NE.detach() + self.bias.float()
                if self.expert_groups:
                    choice_NE = limit_to_groups(choice_NE, self.expert_groups, self.topk_groups)
                experts_NK = top_choices(choice_NE, self.top_k)[1]
                weights_NK = probs_NE.gather(-1, experts_NK)
        if self.normalize:  # over the K choices (the K prototypes' winners under prototyping)
            weights_NK = weights_NK / (weights_NK.sum(dim=-1, keepdim=True) + NORM_EPS)
        if self.scale != 1.0:
            weights_NK = weights_NK * self.scale
        return Routing(experts_NK=experts_NK, weights_NK=weights_NK.to(x_ND.dtype),
                       probs_NE=probs_NE, logits_NE=logits_NE)


def limit_to_groups(choice_NE: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """`choice_NE` with every expert outside each token's `topk_groups` best groups set to -inf: the
    experts in `num_groups` contiguous groups, a group ranked by the sum of its two highest scores
    (DeepSeek-V3's group-limited routing; ties between groups go to the lower index)."""
    N, E = choice_NE.shape
    scores_NGS = choice_NE.view(N, num_groups, E // num_groups)
    group_NG = top_choices(scores_NGS, 2)[0].sum(dim=-1)
    kept_NG = torch.zeros_like(group_NG, dtype=torch.bool).scatter_(1, top_choices(group_NG, topk_groups)[1], True)
    return scores_NGS.masked_fill(~kept_NG[..., None], float("-inf")).view(N, E)


def sequence_balance_loss(probs_NE: torch.Tensor, experts_NK: torch.Tensor, seq_len: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (Liu et al. 2024, eq. 17-20), float32, the mean over
    the sequences: within each sequence of T = `seq_len` consecutive tokens, sum_e f_e P_e with f_e =
    E / (K T) x the choices of e, P_e = the mean over the tokens of e's score divided by the token's
    sum of scores. 1 when both are uniform; gradients reach P only."""
    N, K = experts_NK.shape
    E = probs_NE.shape[-1]
    B = N // seq_len
    counts_BE = torch.zeros(B, E, device=probs_NE.device).scatter_add_(
        1, experts_NK.reshape(B, seq_len * K), torch.ones(B, seq_len * K, device=probs_NE.device))
    f_BE = counts_BE * (E / (K * seq_len))
    share_NE = probs_NE.float() / probs_NE.float().sum(dim=-1, keepdim=True)
    P_BE = share_NE.view(B, seq_len, E).mean(dim=1)
    return (f_BE * P_BE).sum(dim=1).mean()


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
