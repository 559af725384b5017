"""Capacity, dropping and the token dispatcher: routed tokens to their experts and back.

The dispatcher is three steps each way (Megatron-Core's MoE token dispatcher): a local
permutation, a communication step, a local un-permutation. Here the communication is the
identity; expert parallelism replaces `Dispatcher.communicate` / `communicate_back` with an
all-to-all from outside, leaving the local steps unchanged.

Every sorted buffer has M = N*K rows, a static shape: first the kept choices grouped by expert
(the experts' `splits` count only these), then the dropped ones, which no expert computes and
which add nothing on the way back. Nothing here reads a device value back to the host.

Shape legend: N tokens, D model dim, E experts, K choices per token, M = N*K sorted rows,
P = the N*K choices in priority order (index k * N + n).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shoal.moe.router import Routing, expert_counts


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int | None:
    """Most choices one expert accepts: ceil(capacity_factor * N * K / E) (GShard, Lepikhin et
    al. 2020); None when capacity_factor is 0 (dropless: every choice is kept)."""
    if capacity_factor < 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be >= 0 (0: dropless, no capacity limit)")
    if capacity_factor == 0:
        return None
    # Round first so that float noise does not cost a slot: 1.1 * 10 is 11.000000000000002.
    return math.ceil(round(capacity_factor * num_tokens * top_k / num_experts, 6))


@dataclass(frozen=True)
class DispatchPlan:
    """Which choices are kept and where each one sits in the expert-sorted buffer."""

    tokens_per_expert: torch.Tensor
    """(E,) long: kept choices per expert, the split sizes of the sorted buffer."""
    routed_per_expert: torch.Tensor
    """(E,) long: choices per expert before dropping."""
    kept_NK: torch.Tensor
    """(N, K) bool: the choice fits within its expert's capacity."""
    position_NK: torch.Tensor
    """(N, K) long: the row of each choice in the sorted buffer."""
    token_M: torch.Tensor
    """(M,) long: the token each sorted row comes from (a permutation of the N*K choices)."""
    kept_M: torch.Tensor
    """(M,) bool: the row is a kept choice (the first sum(tokens_per_expert) rows)."""


def plan_dispatch(routing: Routing, num_experts: int, capacity: int | None) -> DispatchPlan:
    """Decide, for every choice, whether it is kept and its row in the expert-sorted buffer.

    Priority: every token's first choice before any second choice, then token order (GShard,
    Switch), so under pressure an expert drops late tokens' secondary choices first. Within an
    expert, kept rows stay in priority order; dropped rows follow all kept ones, also in order.
    """
    experts_NK = routing.experts_NK
    N, K = experts_NK.shape
    device = experts_NK.device
    # Priority order: choice rank first, then token.
    expert_P = experts_NK.t().reshape(-1)
    routed_E = expert_counts(experts_NK, num_experts)
    # Slot of each choice within its expert = choices of that expert ahead of it in priority.
    by_expert_P = torch.argsort(expert_P, stable=True)
    first_row_E = torch.cumsum(routed_E, 0) - routed_E
    rank_sorted_P = torch.arange(N * K, device=device) - first_row_E[expert_P[by_expert_P]]
    slot_P = torch.empty_like(rank_sorted_P).scatter_(0, by_expert_P, rank_sorted_P)
    if capacity is None:
        kept_P = torch.ones_like(expert_P, dtype=torch.bool)
        kept_E = routed_E
    else:
        kept_P = slot_P < capacity
        kept_E = routed_E.clamp(max=capacity)
    # Kept: after the kept rows of lower experts; dropped: after every kept row, in priority order.
    kept_first_row_E = torch.cumsum(kept_E, 0) - kept_E
    dropped_rank_P = torch.cumsum(~kept_P, 0) - 1
    num_kept = kept_E.sum()
    position_P = torch.where(kept_P, kept_first_row_E[expert_P] + slot_P, num_kept + dropped_rank_P)
    token_P = torch.arange(N, device=device).repeat(K)
    token_M = torch.empty_like(token_P).scatter_(0, position_P, token_P)
    kept_M = torch.arange(N * K, device=device) < num_kept
    return DispatchPlan(tokens_per_expert=kept_E, routed_per_expert=routed_E,
                        kept_NK=kept_P.view(K, N).t(), position_NK=position_P.view(K, N).t(),
                        token_M=token_M, kept_M=kept_M)


class Dispatcher:
    """Moves routed tokens to their experts and the results back, in explicit steps:

        tokens, splits = local_pre(x, plan)        # gather into expert-sorted order
        tokens, splits = communicate(tokens, splits) # identity; all-to-all under expert parallelism
        y = experts(tokens, splits)
        y = communicate_back(y, splits)            # identity; the reverse all-to-all
        out = local_post(y, plan, weights, N)      # weighted sum back onto the tokens

    A subclass that overrides the two communication steps sees only tensors and split sizes.
    """

    def local_pre(self, x_ND: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens_MD, splits_E): each choice's token, grouped by expert; splits count the kept rows."""
        return x_ND.index_select(0, plan.token_M), plan.tokens_per_expert

    def communicate(self, tokens_MD: torch.Tensor, splits_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Send each expert's rows to the rank that holds it; here every expert is local."""
        return tokens_MD, splits_E

    def communicate_back(self, y_MD: torch.Tensor, splits_E: torch.Tensor) -> torch.Tensor:
        """Return each row's expert output to the rank its token came from."""
        return y_MD

    def local_post(self, y_MD: torch.Tensor, plan: DispatchPlan, weights_NK: torch.Tensor,
                   num_tokens: int) -> torch.Tensor:
        """y_ND: the sum over a token's kept choices of weight * expert output; dropped add 0."""
        N, K = plan.position_NK.shape
        assert N == num_tokens and y_MD.shape[0] == N * K, (num_tokens, plan.position_NK.shape, y_MD.shape)
        # Gather back by position (a permutation), then sum the K choices: no scatter-add, so
        # the result does not depend on the order atomics land in.
        # `where`, not a multiply by the mask: a dropped row may hold anything, NaN included,
        # and must reach neither the output nor the weights' gradient.
        y_NKD = torch.where(plan.kept_NK.unsqueeze(-1), y_MD[plan.position_NK], 0)
        return (y_NKD * weights_NK.to(y_MD.dtype).unsqueeze(-1)).sum(dim=1)
