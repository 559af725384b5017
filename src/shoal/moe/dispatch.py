"""Capacity, dropping and the token dispatcher: routed tokens to their experts and back.

The dispatcher is three steps each way (Megatron-Core's MoE token dispatcher): a local
permutation, a communication step, a local un-permutation. Here the communication is the
identity; expert parallelism replaces `Dispatcher.communicate` / `communicate_back` with an
all-to-all from outside, leaving the local steps unchanged.

Capacity and dropping act within routing groups (GShard's groups, Lepikhin et al. 2020): spans
of consecutive tokens of one sequence, `RoutingGroups`. A group's routing depends on its own
tokens only, so how a global batch is split over data ranks, micro-batches or pipeline
micro-batches changes no token's fate (no group straddles two sequences, and a sequence is never
split across those).

Every sorted buffer has M = N*K rows, a static shape: first the kept choices grouped by expert
(the experts' `splits` count only these), then the dropped ones, which no expert computes and
which add nothing on the way back. Nothing here reads a device value back to the host.

Shape legend: N tokens, D model dim, E experts, K choices per token, M = N*K sorted rows,
P = the N*K choices in priority order, S routing groups.
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


def group_spans(seq_len: int, group_tokens: int) -> tuple[int, ...]:
    """The sizes of the routing groups one sequence of seq_len tokens is cut into: consecutive
    spans of group_tokens, the last one taking the remainder; 0, or group_tokens >= seq_len: the
    whole sequence is one group (a shorter sequence, as at sampling, is then one group too)."""
    if group_tokens < 0:
        raise ValueError(f"group_tokens={group_tokens} must be >= 0 (0: one group per sequence)")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    if group_tokens == 0 or group_tokens >= seq_len:
        return (seq_len,)
    full, rest = divmod(seq_len, group_tokens)
    return (group_tokens,) * full + ((rest,) if rest else ())


@dataclass(frozen=True)
class RoutingGroups:
    """num_sequences sequences, each cut into routing groups of the sizes `spans` (`group_spans`);
    tokens flattened sequence by sequence, as x_BTD.reshape(-1, D) lays them out."""

    num_sequences: int
    spans: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return self.num_sequences * len(self.spans)

    @property
    def num_tokens(self) -> int:
        return self.num_sequences * sum(self.spans)

    def group_of_tokens(self, device: torch.device | str | None = None) -> torch.Tensor:
        """(N,) long: each token's group, 0..S-1, non-decreasing."""
        spans = torch.tensor(self.spans, device=device)
        # output_size: no device-to-host read of the spans' sum on CUDA.
        in_sequence_T = torch.repeat_interleave(torch.arange(len(self.spans), device=device), spans,
                                                output_size=sum(self.spans))
        first_B = torch.arange(self.num_sequences, device=device) * len(self.spans)
        return (first_B[:, None] + in_sequence_T).reshape(-1)

    def capacities(self, num_experts: int, top_k: int, capacity_factor: float,
                   device: torch.device | str | None = None) -> torch.Tensor | None:
        """(S,) long: each group's `capacity`; None when dropless."""
        caps = self._span_capacities(num_experts, top_k, capacity_factor)
        return None if caps is None else torch.tensor(caps, device=device).repeat(self.num_sequences)

    def rows_bound(self, num_experts: int, top_k: int, capacity_factor: float) -> int | None:
        """Most kept rows one expert can get from these tokens: the sum of the groups' capacities
        (None when dropless)."""
        caps = self._span_capacities(num_experts, top_k, capacity_factor)
        return None if caps is None else self.num_sequences * sum(caps)

    def _span_capacities(self, num_experts: int, top_k: int, capacity_factor: float) -> list[int] | None:
        caps = [capacity(n, num_experts, top_k, capacity_factor) for n in self.spans]
        return None if None in caps else [c for c in caps if c is not None]


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


def plan_dispatch(routing: Routing, num_experts: int, capacity: int | torch.Tensor | None,
                  group_N: torch.Tensor | None = None) -> DispatchPlan:
    """Decide, for every choice, whether it is kept and its row in the expert-sorted buffer.

    `group_N` (N,) long gives each token's routing group (non-decreasing; None: all tokens form
    one group); `capacity` is the most choices an expert accepts from one group: an int for every
    group, an (S,) tensor per group, or None (dropless).
    Priority within a group: every token's first choice before any second choice, then token
    order (GShard, Switch), so under pressure an expert drops late tokens' secondary choices
    first. Within an expert, kept rows follow priority order (group by group); dropped rows follow
    all kept ones, also in priority order.
    """
    experts_NK = routing.experts_NK
    N, K = experts_NK.shape
    device = experts_NK.device
    if group_N is None:
        group_N = torch.zeros(N, dtype=torch.long, device=device)
    # Priority order: group, then choice rank, then token. Choices are listed rank-major (k * N + n),
    # tokens ascending; a stable sort by (group, rank) puts them in priority order.
    order_P = torch.argsort(group_N.repeat(K) * K + torch.arange(K, device=device).repeat_interleave(N), stable=True)
    expert_P = experts_NK.t().reshape(-1)[order_P]
    group_P = group_N.repeat(K)[order_P]
    routed_E = expert_counts(experts_NK, num_experts)
    # Slot of each choice within its (group, expert) = that pair's choices ahead of it in priority.
    pair_P = group_P * num_experts + expert_P
    by_pair_P = torch.argsort(pair_P, stable=True)
    pair_sorted_P = pair_P[by_pair_P]
    first_of_pair_P = torch.searchsorted(pair_sorted_P, pair_sorted_P)  # first row of the same pair
    rank_sorted_P = torch.arange(N * K, device=device) - first_of_pair_P
    slot_P = torch.empty_like(rank_sorted_P).scatter_(0, by_pair_P, rank_sorted_P)
    if capacity is None:
        kept_P = torch.ones_like(expert_P, dtype=torch.bool)
    else:
        cap_P = capacity[group_P] if isinstance(capacity, torch.Tensor) else capacity
        kept_P = slot_P < cap_P
    kept_E = torch.zeros_like(routed_E).index_add_(0, expert_P, kept_P.long())
    # Kept: by expert, then priority (a stable sort by expert of the priority order); a kept
    # row's place is the number of kept rows before it in that order. Dropped: after every kept
    # row, in priority order.
    by_expert_P = torch.argsort(expert_P, stable=True)
    kept_row_P = torch.empty_like(by_expert_P).scatter_(0, by_expert_P, torch.cumsum(kept_P[by_expert_P], 0) - 1)
    num_kept = kept_E.sum()
    position_P = torch.where(kept_P, kept_row_P, num_kept + torch.cumsum(~kept_P, 0) - 1)
    token_P = torch.arange(N, device=device).repeat(K)[order_P]
    token_M = torch.empty_like(token_P).scatter_(0, position_P, token_P)
    kept_M = torch.arange(N * K, device=device) < num_kept
    # Back from priority order to the (N, K) layout of the routing.
    kept_C = torch.empty_like(kept_P).scatter_(0, order_P, kept_P)
    position_C = torch.empty_like(position_P).scatter_(0, order_P, position_P)
    return DispatchPlan(tokens_per_expert=kept_E, routed_per_expert=routed_E,
                        kept_NK=kept_C.view(K, N).t(), position_NK=position_C.view(K, N).t(),
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

    def local_pre(self, x_ND: torch.Tensor, plan: DispatchPlan,
                  weights_NK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens_MD, splits_E): each choice's token, grouped by expert; splits count the kept rows.
        `weights_NK` (the routing weights) is for a subclass that weighs the outputs where the experts are."""
        return x_ND.index_select(0, plan.token_M), plan.tokens_per_expert

    def communicate(self, tokens_MD: torch.Tensor, splits_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Send each expert's rows to the rank that holds it; here every expert is local."""
        return tokens_MD, splits_E

    def communicate_back(self, y_MD: torch.Tensor, splits_E: torch.Tensor) -> torch.Tensor:
        """Return each row's expert output to the rank its token came from."""
        return y_MD

    def rows_bound(self, local_bound: int | None) -> int | None:
        """Most rows one expert receives after `communicate`, when each sender keeps at most
        `local_bound` rows per expert (None: no bound, dropless)."""
        return local_bound

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
