"""Mixture-of-Experts layer: routing on hand-written logits, capacity and dropping on a hand-written
routing, the router losses by hand, the dispatcher's round trip (values and gradients), every
expert compute path against a per-token loop, and the whole layer against a dense FFN.

Float32 tolerances: the expert paths and the per-token reference form the same products and
differ only in summation order (blocked GEMMs vs one row at a time), an error of a few units of
2^-24 (6e-8) times the reduction length (D or F, here <= 24) times the magnitudes involved
(order 1): rtol 1e-5 with atol 1e-6 covers it with margin. Where both sides run the same ops in
the same order the comparison is exact.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shoal.models import ModelConfig, Transformer
from shoal.models.transformer import FeedForward
from shoal.moe.dispatch import Dispatcher, RoutingGroups, capacity, group_spans, plan_dispatch
from shoal.moe.experts import Experts
from shoal.moe.layer import MoELayer
from shoal.moe.router import Router, Routing, load_balancing_loss, router_z_loss

TOL = dict(rtol=1e-5, atol=1e-6)


def identity_router(num_experts: int, **kwargs) -> Router:
    """A router whose logits are its input (gate = identity), so tests write logits directly."""
    router = Router(num_experts, num_experts, **kwargs)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(num_experts))
    return router


def softmax(row: list[float]) -> list[float]:
    exps = [math.exp(v) for v in row]
    return [v / sum(exps) for v in exps]


# ---- router

LOGITS = [[2.0, 1.0, 0.0, -1.0],
          [0.0, 3.0, 3.0, 1.0],   # a tie for first place: expert 1 before expert 2
          [0.5, 0.5, 0.5, 0.5]]   # all equal: experts 0, 1


@pytest.mark.parametrize("top_k, normalize", [(1, True), (1, False), (2, True), (2, False)])
def test_router_top_k_on_known_logits(top_k, normalize):
    routing = identity_router(4, top_k=top_k, normalize=normalize)(torch.tensor(LOGITS))
    expected_experts = [[0, 1], [1, 2], [0, 1]]
    probs = [softmax(row) for row in LOGITS]
    chosen = [[probs[n][e] for e in expected_experts[n][:top_k]] for n in range(3)]
    if normalize:
        chosen = [[p / sum(row) for p in row] for row in chosen]
    assert routing.experts_NK.tolist() == [row[:top_k] for row in expected_experts]
    assert routing.experts_NK.dtype == torch.long
    torch.testing.assert_close(routing.weights_NK, torch.tensor(chosen), **TOL)
    torch.testing.assert_close(routing.probs_NE, torch.tensor(probs), **TOL)
    assert routing.probs_NE.dtype == routing.logits_NE.dtype == torch.float32
    bf16 = identity_router(4, top_k=top_k, normalize=normalize)(torch.tensor(LOGITS, dtype=torch.bfloat16))
    assert bf16.weights_NK.dtype == torch.bfloat16 and bf16.probs_NE.dtype == torch.float32


def test_router_prototyping_one_expert_per_group_with_in_group_weights():
    torch.manual_seed(0)
    router = Router(8, 6, top_k=3, num_prototypes=3, normalize=False)  # groups {0,1}, {2,3}, {4,5}
    x_ND = torch.randn(32, 8)
    routing = router(x_ND)
    logits_NKG = (x_ND @ router.gate.weight.T).view(32, 3, 2)
    in_group_NKG = logits_NKG.softmax(dim=-1)
    assert routing.experts_NK.tolist() == (logits_NKG.argmax(-1) + torch.tensor([0, 2, 4])).tolist()
    torch.testing.assert_close(routing.weights_NK, in_group_NKG.amax(-1), **TOL)
    torch.testing.assert_close(routing.probs_NE, in_group_NKG.flatten(1), **TOL)
    # Not renormalised: the three weights are in-group probabilities, each >= 1/2 here.
    assert not torch.allclose(routing.weights_NK.sum(-1), torch.ones(32))


# Weights by hand. Top-2 of softmax([ln 6, ln 3, ln 1, 0 ...]): probs 6/10, 3/10, 1/10 for a row
# [ln 6, ln 3, 0] over 3 experts; the two chosen are 6/10 and 3/10, normalised 2/3 and 1/3.
# Prototyping, groups {0,1} and {2,3}, row [ln 3, 0 | 0, ln 4]: in-group probs [3/4, 1/4] and
# [1/5, 4/5]; winners 0 (3/4) and 3 (4/5); normalised over the two: 15/31 and 16/31. One group
# of all four: softmax [3, 1, 1, 4] / 9, winner 3 with 4/9. A single choice normalises to 1.
HAND_WEIGHTS = [
    (dict(num_experts=3, top_k=2), [math.log(6), math.log(3), 0.0], [0, 1], [0.6, 0.3], [2 / 3, 1 / 3]),
    (dict(num_experts=3, top_k=1), [math.log(6), math.log(3), 0.0], [0], [0.6], [1.0]),
    (dict(num_experts=4, top_k=2, num_prototypes=2), [math.log(3), 0.0, 0.0, math.log(4)], [0, 3], [0.75, 0.8],
     [15 / 31, 16 / 31]),
    (dict(num_experts=4, top_k=1, num_prototypes=1), [math.log(3), 0.0, 0.0, math.log(4)], [3], [4 / 9], [1.0]),
]


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("kwargs, logits, experts, raw, normalised", HAND_WEIGHTS)
def test_router_weights_normalised_over_the_k_or_not(kwargs, logits, experts, raw, normalised, normalize):
    kwargs = dict(kwargs)
    routing = identity_router(kwargs.pop("num_experts"), normalize=normalize, **kwargs)(torch.tensor([logits]))
    assert routing.experts_NK.tolist() == [experts]
    torch.testing.assert_close(routing.weights_NK, torch.tensor([normalised if normalize else raw]), **TOL)


def test_norm_topk_reaches_the_router_and_top1_with_it_warns():
    cfg = ModelConfig(num_layers=1, dim=16, num_heads=2, ffn_dim=8, num_experts=4, top_k=2)
    assert Transformer(cfg).layers["0"].feed_forward.router.normalize is True  # the default
    assert Transformer(cfg.replace(norm_topk=False)).layers["0"].feed_forward.router.normalize is False
    assert cfg.with_overrides(["norm_topk=false"]).norm_topk is False
    with pytest.warns(UserWarning, match="top_k=1 with norm_topk=true"):
        cfg.replace(top_k=1)


def test_router_prototyping_ties_go_to_the_lowest_index():
    routing = identity_router(4, top_k=2, num_prototypes=2)(torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    assert routing.experts_NK.tolist() == [[0, 2]]
    assert routing.weights_NK.tolist() == [[0.5, 0.5]]


# ---- capacity and dropping

# 8 tokens, 2 experts, top-2 (each token uses both experts, in some order), capacity 3.
FIRST = [0, 0, 0, 0, 1, 0, 0, 1]
HAND_ROUTING = Routing(experts_NK=torch.tensor([[e, 1 - e] for e in FIRST]), weights_NK=torch.ones(8, 2),
                       probs_NE=torch.full((8, 2), 0.5), logits_NE=torch.zeros(8, 2))


def test_capacity_formula():
    assert capacity(4096, 8, 2, 1.25) == 1280     # ceil(1.25 * 4096 * 2 / 8)
    assert capacity(10, 1, 1, 1.1) == 11          # not 12: float noise is rounded away
    assert capacity(10, 3, 1, 1.0) == 4           # ceil(10 / 3)
    assert capacity(10, 3, 1, 0.0) is None        # dropless
    with pytest.raises(ValueError, match="capacity_factor=-1"):
        capacity(10, 3, 1, -1)


def test_plan_keeps_first_choices_first_then_token_order():
    plan = plan_dispatch(HAND_ROUTING, 2, capacity=3)
    # Expert 0 takes first choices of tokens 0, 1, 2 and is full (3, 5, 6 and the second
    # choices of 4, 7 dropped). Expert 1 takes first choices of 4, 7, then one second choice:
    # token 0's, the earliest.
    assert plan.kept_NK.tolist() == [[True, True], [True, False], [True, False], [False, False],
                                     [True, False], [False, False], [False, False], [True, False]]
    assert plan.tokens_per_expert.tolist() == [3, 3]
    assert plan.routed_per_expert.tolist() == [8, 8]
    # Sorted rows: expert 0 (tokens 0 1 2), expert 1 (4 7 0), then the dropped in priority order:
    # first choices 3 5 6, second choices 1 2 3 4 5 6 7.
    assert plan.token_M.tolist() == [0, 1, 2, 4, 7, 0, 3, 5, 6, 1, 2, 3, 4, 5, 6, 7]
    assert plan.kept_M.tolist() == [True] * 6 + [False] * 10
    assert plan.position_NK[0].tolist() == [0, 5]


def test_plan_dropless_keeps_everything():
    plan = plan_dispatch(HAND_ROUTING, 2, capacity=None)
    assert plan.kept_NK.all()
    assert plan.tokens_per_expert.tolist() == plan.routed_per_expert.tolist() == [8, 8]
    assert plan.token_M.tolist() == [0, 1, 2, 3, 5, 6, 4, 7] + [4, 7, 0, 1, 2, 3, 5, 6]


# ---- router losses

def test_aux_and_z_loss_by_hand():
    # probs [[3/4, 1/4], [1/2, 1/2]]; top-1: both tokens to expert 0 (the second by the tie rule).
    # f = [2/2, 0/2], P = [(3/4 + 1/2) / 2, (1/4 + 1/2) / 2] = [5/8, 3/8]; aux = 2 * (1 * 5/8) = 5/4.
    # z: logsumexp = [ln(3 + 1), ln(1 + 1)] -> ((2 ln 2)^2 + (ln 2)^2) / 2 = 5/2 (ln 2)^2.
    routing = identity_router(2, top_k=1)(torch.tensor([[math.log(3), 0.0], [0.0, 0.0]]))
    assert routing.experts_NK.tolist() == [[0], [0]]
    aux = load_balancing_loss(routing.probs_NE, routing.experts_NK)
    torch.testing.assert_close(aux, torch.tensor(1.25))
    torch.testing.assert_close(router_z_loss(routing.logits_NE), torch.tensor(2.5 * math.log(2) ** 2))


def test_aux_loss_under_prototyping_averages_the_groups():
    # Groups {0,1}, {2,3}. Token 0 logits [ln3, 0 | 0, 0], token 1 [0, 0 | 0, ln3].
    # Group 0: probs [[3/4, 1/4], [1/2, 1/2]], both tokens pick 0: f = [1, 0], P = [5/8, 3/8],
    #   loss 2 * 5/8 = 5/4. Group 1: probs [[1/2, 1/2], [1/4, 3/4]], picks 2 and 3: f = [1/2, 1/2],
    #   P = [3/8, 5/8], loss 2 * (3/16 + 5/16) = 1. Mean: 9/8.
    x = torch.tensor([[math.log(3), 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, math.log(3)]])
    routing = identity_router(4, top_k=2, num_prototypes=2)(x)
    assert routing.experts_NK.tolist() == [[0, 2], [0, 3]]
    aux = load_balancing_loss(routing.probs_NE, routing.experts_NK, num_groups=2)
    torch.testing.assert_close(aux, torch.tensor(1.125))


def test_layer_keeps_losses_with_gradients_and_stats():
    # 8 tokens, 2 experts, top-1, capacity ceil(0.75 * 8 / 2) = 3; six tokens prefer expert 0.
    layer = MoELayer(2, 4, num_experts=2, top_k=1, capacity_factor=0.75)
    with torch.no_grad():
        layer.router.gate.weight.copy_(torch.eye(2))
    x = torch.tensor([[1.0, 0.0]] * 6 + [[0.0, 1.0]] * 2).view(1, 8, 2)  # one sequence: one routing group
    layer(x)
    assert layer.stats["tokens_per_expert"].tolist() == [3.0, 2.0]
    assert layer.stats["dropped_fraction"].item() == 3 / 8
    assert layer.stats["load_cv"].item() == pytest.approx(0.5)  # counts [6, 2]: mean 4, std 2
    p = 1 / (1 + math.exp(-1))  # softmax([1, 0])[0]
    torch.testing.assert_close(layer.aux_loss, torch.tensor(2 * (6 / 8 * (6 * p + 2 * (1 - p)) / 8
                                                                 + 2 / 8 * (6 * (1 - p) + 2 * p) / 8)))
    assert layer.aux_loss.dtype == layer.z_loss.dtype == torch.float32
    (layer.aux_loss + layer.z_loss).backward()
    assert layer.router.gate.weight.grad.abs().sum() > 0
    assert not any(v.requires_grad for v in layer.stats.values())


# ---- routing groups

def test_group_spans_cut_each_sequence():
    assert group_spans(16, 0) == (16,)           # 0: the whole sequence
    assert group_spans(16, 4) == (4, 4, 4, 4)
    assert group_spans(10, 4) == (4, 4, 2)       # the last span takes the remainder
    assert group_spans(3, 8) == (3,)             # a shorter sequence (sampling) is one group
    groups = RoutingGroups(num_sequences=2, spans=(4, 4, 2))
    assert groups.num_groups == 6 and groups.num_tokens == 20
    assert groups.group_of_tokens().tolist() == [0] * 4 + [1] * 4 + [2] * 2 + [3] * 4 + [4] * 4 + [5] * 2
    # ceil(1.25 * 4 * 2 / 4) = 3, ceil(1.25 * 2 * 2 / 4) = 2, per sequence
    assert groups.capacities(4, 2, 1.25).tolist() == [3, 3, 2, 3, 3, 2]
    assert groups.rows_bound(4, 2, 1.25) == 16
    assert groups.capacities(4, 2, 0.0) is None and groups.rows_bound(4, 2, 0.0) is None
    with pytest.raises(ValueError, match="group_tokens=-2 must be >= 0"):
        group_spans(8, -2)


def random_routing(num_tokens: int, num_experts: int, top_k: int, seed: int) -> Routing:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    logits[:, 0] += 1.0  # a popular expert, so that capacity bites
    probs = logits.softmax(-1)
    weights, experts = probs.topk(top_k, dim=-1)
    return Routing(experts_NK=experts, weights_NK=weights, probs_NE=probs, logits_NE=logits)


def sub_routing(routing: Routing, rows: slice) -> Routing:
    return Routing(experts_NK=routing.experts_NK[rows], weights_NK=routing.weights_NK[rows],
                   probs_NE=routing.probs_NE[rows], logits_NE=routing.logits_NE[rows])


@pytest.mark.parametrize("spans, top_k, factor", [((4, 4, 2), 2, 1.25), ((8,), 1, 0.5), ((3, 3), 2, 1.0),
                                                   ((5,), 2, 0.0)])
def test_per_group_capacity_and_dropping_equal_a_loop_over_groups(spans, top_k, factor):
    """Every group routed by itself (plan_dispatch on its tokens alone, with its own capacity) keeps
    exactly the choices the grouped plan keeps, and the layer's output is theirs."""
    E = 4
    groups = RoutingGroups(num_sequences=3, spans=spans)
    N = groups.num_tokens
    routing = random_routing(N, E, top_k, seed=len(spans) + top_k)
    plan = plan_dispatch(routing, E, groups.capacities(E, top_k, factor), groups.group_of_tokens())
    x_ND = torch.randn(N, 6)
    dispatcher = Dispatcher()
    tokens_MD, splits = dispatcher.local_pre(x_ND, plan)
    out_ND = dispatcher.local_post(tokens_MD * 2, plan, routing.weights_NK, N)  # experts: y = 2x
    kept, per_expert, first = [], torch.zeros(E, dtype=torch.long), 0
    for _ in range(groups.num_sequences):
        for size in spans:
            rows = slice(first, first + size)
            alone = plan_dispatch(sub_routing(routing, rows), E, capacity(size, E, top_k, factor))
            kept.append(alone.kept_NK)
            per_expert += alone.tokens_per_expert
            first += size
    assert torch.equal(plan.kept_NK, torch.cat(kept))
    assert torch.equal(plan.tokens_per_expert, per_expert)
    assert plan.routed_per_expert.tolist() == torch.bincount(routing.experts_NK.flatten(), minlength=E).tolist()
    assert int(plan.kept_M.sum()) == int(plan.kept_NK.sum())
    # The sorted buffer: kept rows grouped by expert, each row the token of the choice it claims to be.
    expert_M = torch.repeat_interleave(torch.arange(E), splits)
    kept_rows = plan.position_NK[plan.kept_NK]
    assert torch.equal(expert_M[kept_rows], routing.experts_NK[plan.kept_NK])
    assert torch.equal(plan.token_M[plan.position_NK], torch.arange(N)[:, None].expand(N, top_k))
    assert sorted(plan.position_NK.flatten().tolist()) == list(range(N * top_k))
    expected = 2 * x_ND * (routing.weights_NK * plan.kept_NK).sum(-1, keepdim=True)
    torch.testing.assert_close(out_ND, expected, **TOL)
    if factor:
        assert not plan.kept_NK.all()  # the case exercises dropping


def test_groups_order_priority_within_each_group():
    # Two groups of 4 tokens, 2 experts, top-1, capacity 2 each: all 8 tokens want expert 0.
    # Per group the first two tokens are kept: 0, 1 and 4, 5 (one group of 8 would keep 0 1 2 3).
    routing = Routing(experts_NK=torch.zeros(8, 1, dtype=torch.long), weights_NK=torch.ones(8, 1),
                      probs_NE=torch.full((8, 2), 0.5), logits_NE=torch.zeros(8, 2))
    groups = RoutingGroups(num_sequences=2, spans=(4,))
    plan = plan_dispatch(routing, 2, groups.capacities(2, 1, 1.0), groups.group_of_tokens())
    assert plan.kept_NK.flatten().tolist() == [True, True, False, False, True, True, False, False]
    assert plan.token_M.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert plan.tokens_per_expert.tolist() == [4, 0]


def test_aux_loss_per_group_is_the_mean_of_the_groups_losses():
    # Group 0 is test_aux_and_z_loss_by_hand's two tokens (loss 5/4); group 1: probs
    # [[1/4, 3/4], [1/2, 1/2]], top-1 picks 1 and 0: f = [1/2, 1/2], P = [3/8, 5/8], loss
    # 2 * (3/16 + 5/16) = 1. Mean 9/8; one group of all four would give f = [3/4, 1/4],
    # P = [1/2, 1/2], 2 * (3/8 + 1/8) = 1.
    logits = torch.tensor([[math.log(3), 0.0], [0.0, 0.0], [0.0, math.log(3)], [0.0, 0.0]])
    routing = identity_router(2, top_k=1)(logits)
    assert routing.experts_NK.flatten().tolist() == [0, 0, 1, 0]
    group_N = torch.tensor([0, 0, 1, 1])
    grouped = load_balancing_loss(routing.probs_NE, routing.experts_NK, group_N=group_N, num_routing_groups=2)
    torch.testing.assert_close(grouped, torch.tensor(1.125))
    torch.testing.assert_close(load_balancing_loss(routing.probs_NE, routing.experts_NK), torch.tensor(1.0))


@pytest.mark.parametrize("prototypes", [0, 2])
def test_aux_loss_per_group_equals_a_loop_over_groups(prototypes):
    logits = torch.randn(12, 4, generator=torch.Generator().manual_seed(7))
    routing = identity_router(4, top_k=2, num_prototypes=prototypes)(logits)
    group_N = torch.tensor([0] * 5 + [1] * 5 + [2] * 2)
    loss = load_balancing_loss(routing.probs_NE, routing.experts_NK, num_groups=prototypes or 1,
                               group_N=group_N, num_routing_groups=3)
    loop = [load_balancing_loss(routing.probs_NE[group_N == s], routing.experts_NK[group_N == s],
                                num_groups=prototypes or 1) for s in range(3)]
    torch.testing.assert_close(loss, torch.stack(loop).mean(), **TOL)



@pytest.mark.parametrize("router", [{"top_k": 2}, {"top_k": 2, "num_prototypes": 2}, {"top_k": 1, "normalize": False},
                                    {"top_k": 2, "group_tokens": 3}])
def test_layer_on_a_batch_equals_the_layer_on_its_halves(router):
    """What makes the plan not matter: routing a batch at once, or its sequences in two micro-batches
    (as two data ranks or an accumulation would), keeps the same choices and gives the same output,
    the same load-balancing and z-losses (the means of the halves') and kept counts (their sums)."""
    torch.manual_seed(0)
    layer = MoELayer(8, 12, num_experts=4, capacity_factor=1.0, init_std=0.5, **router)
    x = torch.randn(4, 7, 8)
    y = layer(x)
    whole = (layer.aux_loss, layer.z_loss, layer.stats["tokens_per_expert"], layer.stats["dropped_fraction"])
    assert 0 < whole[3] < 1  # capacity bites
    halves, parts = [], []
    for part in x.chunk(2):
        halves.append(layer(part))
        parts.append((layer.aux_loss, layer.z_loss, layer.stats["tokens_per_expert"], layer.stats["dropped_fraction"]))
    # Float32 tolerance: the same per-token products; only the means' summation order differs.
    torch.testing.assert_close(y, torch.cat(halves), **TOL)
    for i in (0, 1, 3):
        torch.testing.assert_close(whole[i], (parts[0][i] + parts[1][i]) / 2, **TOL)
    assert torch.equal(whole[2], parts[0][2] + parts[1][2])


def test_a_short_sequence_is_one_group():
    """Sampling's growing prompt: a sequence shorter than group_tokens is routed as one group,
    with that group's capacity."""
    layer = MoELayer(2, 4, num_experts=2, top_k=1, capacity_factor=1.0, group_tokens=16)
    assert layer.routing_groups(torch.zeros(1, 5, 2)).spans == (5,)
    assert layer.routing_groups(torch.zeros(2, 40, 2)).spans == (16, 16, 8)
    with torch.no_grad():
        layer.router.gate.weight.copy_(torch.eye(2))
    layer(torch.tensor([[[1.0, 0.0]] * 5]))  # all five want expert 0: capacity ceil(5 / 2) = 3
    assert layer.stats["tokens_per_expert"].tolist() == [3.0, 0.0]


# ---- dispatcher round trip

def test_dispatch_round_trip_restores_kept_tokens_and_their_gradient():
    torch.manual_seed(0)
    x_ND = torch.randn(8, 4, requires_grad=True)
    routing = Routing(experts_NK=torch.tensor([[e] for e in FIRST]), weights_NK=torch.ones(8, 1),
                      probs_NE=torch.full((8, 2), 0.5), logits_NE=torch.zeros(8, 2))
    plan = plan_dispatch(routing, 2, capacity=3)  # expert 0 keeps tokens 0 1 2, drops 3 5 6
    kept_N1 = plan.kept_NK.float()
    dispatcher = Dispatcher()
    tokens_MD, splits = dispatcher.communicate(*dispatcher.local_pre(x_ND, plan))
    identity_experts_MD = tokens_MD  # a stand-in for the experts: returns its input
    y_MD = dispatcher.communicate_back(identity_experts_MD, splits)
    out_ND = dispatcher.local_post(y_MD, plan, routing.weights_NK, 8)
    assert torch.equal(out_ND, x_ND * kept_N1)
    g_ND = torch.randn(8, 4)
    (out_ND * g_ND).sum().backward()
    assert torch.equal(x_ND.grad, g_ND * kept_N1)


def test_dispatch_round_trip_top2_sums_kept_weights():
    torch.manual_seed(0)
    x_ND = torch.randn(8, 4)
    weights_NK = torch.rand(8, 2)
    routing = Routing(experts_NK=HAND_ROUTING.experts_NK, weights_NK=weights_NK,
                      probs_NE=HAND_ROUTING.probs_NE, logits_NE=HAND_ROUTING.logits_NE)
    plan = plan_dispatch(routing, 2, capacity=3)
    dispatcher = Dispatcher()
    tokens_MD, splits = dispatcher.local_pre(x_ND, plan)
    tokens_MD[~plan.kept_M] = float("nan")  # whatever sits in dropped rows must not leak
    out_ND = dispatcher.local_post(tokens_MD, plan, weights_NK, 8)
    expected = x_ND * (weights_NK * plan.kept_NK).sum(-1, keepdim=True)
    torch.testing.assert_close(out_ND, expected, **TOL)


# ---- experts

def reference_experts(experts: Experts, x_MD: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each row through its own expert's FFN, one row at a time; rows past the groups give 0."""
    expert_of_row = [e for e, c in enumerate(counts) for _ in range(c)]
    rows = [torch.zeros_like(x_MD[m]) for m in range(len(expert_of_row), x_MD.shape[0])]
    for m, e in reversed(list(enumerate(expert_of_row))):
        def lin(v, w, b, e=e):
            return F.linear(v, w[e], None if b is None else b[e])
        x = x_MD[m]
        h = lin(x, experts.w1, experts.b1)
        h = F.gelu(h, approximate="tanh") if experts.w3 is None else F.silu(h) * lin(x, experts.w3, experts.b3)
        rows.insert(0, lin(h, experts.w2, experts.b2))
    return torch.stack(rows)


@pytest.mark.parametrize("path", ["loop", "padded", "padded+capacity", "grouped"])
@pytest.mark.parametrize("activation, bias", [("swiglu", False), ("gelu", True), ("swiglu", True)])
def test_expert_paths_match_a_per_token_loop(path, activation, bias):
    torch.manual_seed(0)
    counts = [5, 0, 3, 6]  # an idle expert, and 4 tail rows that belong to none
    experts = Experts(4, 8, 12, activation=activation, bias=bias, init_std=0.5)
    with torch.no_grad():
        for b in (experts.b1, experts.b2, experts.b3):
            if b is not None:
                b.normal_()
    experts.path = path.split("+")[0]
    x_MD = torch.randn(18, 8, requires_grad=True)
    y_MD = experts(x_MD, torch.tensor(counts), capacity=7 if "capacity" in path else None)
    g_MD = torch.randn(18, 8)
    grads = torch.autograd.grad((y_MD * g_MD).sum(), [x_MD, *experts.parameters()])
    x_ref = x_MD.detach().clone().requires_grad_()
    y_ref = reference_experts(experts, x_ref, counts)
    grads_ref = torch.autograd.grad((y_ref * g_MD).sum(), [x_ref, *experts.parameters()])
    torch.testing.assert_close(y_MD, y_ref, **TOL)
    assert torch.equal(y_MD[14:], torch.zeros(4, 8)) and torch.equal(grads[0][14:], torch.zeros(4, 8))
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, **TOL)


def test_grouped_path_takes_every_expert_in_one_call_per_matrix(monkeypatch):
    """Fine-grained experts (DeepSeek-V3's 256 over 4 ranks: 64 per rank, 8 chosen per token) on the grouped
    path: one grouped_mm per matrix for all 64 experts, forward and backward (the backward's products are the
    kernel's own autograd, not Python), so the hot path has no loop over experts however many there are."""
    import shoal.moe.experts as experts_module

    calls = []
    kernel = experts_module._grouped_mm
    assert kernel is not None, "torch has grouped_mm (2.8+)"

    def counted(*args, **kwargs):
        calls.append(args[1].shape)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(experts_module, "_grouped_mm", counted)
    torch.manual_seed(0)
    E, D, F_, M = 64, 16, 8, 256
    experts = Experts(E, D, F_, init_std=0.5).to(torch.bfloat16)
    experts.path = "grouped"
    counts = torch.bincount(torch.randint(0, E, (M - 8,)), minlength=E)  # 8 tail rows of no expert
    x_MD = torch.randn(M, D, dtype=torch.bfloat16, requires_grad=True)
    y_MD = experts(x_MD, counts)
    assert len(calls) == 3 and {shape[0] for shape in calls} == {E}  # w1, w3, w2: each over all 64 at once
    y_MD.float().square().sum().backward()
    assert len(calls) == 3 and x_MD.grad is not None and experts.w1.grad is not None


def test_experts_init_scales_the_output_projection():
    torch.manual_seed(0)
    experts = Experts(4, 64, 128, init_std=0.02, num_layers=8)
    assert experts.w1.std().item() == pytest.approx(0.02, rel=0.05)
    assert experts.w2.std().item() == pytest.approx(0.02 / 4, rel=0.05)


# ---- the layer

@pytest.mark.parametrize("path", ["loop", "padded", "grouped"])
def test_one_expert_layer_equals_the_dense_ffn(path):
    torch.manual_seed(0)
    cfg = ModelConfig(dim=16, num_heads=2, ffn_dim=24)
    dense = FeedForward(cfg)
    layer = MoELayer(16, 24, num_experts=1, top_k=1, capacity_factor=0)
    layer.experts.path = path
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(layer.experts, name)[0].copy_(getattr(dense, name).weight)
    x = torch.randn(2, 5, 16, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape
    x_ref = x.detach().clone().requires_grad_()
    y_ref = dense(x_ref) * 1.0  # the routing weight after normalisation
    torch.testing.assert_close(y, y_ref, **TOL)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)


def test_shared_experts_add_to_the_routed_output():
    torch.manual_seed(0)
    layer = MoELayer(8, 12, num_experts=4, top_k=2, num_shared_experts=2, init_std=0.5)
    x = torch.randn(2, 6, 8)
    y = layer(x)
    shared, layer.shared = layer.shared, None
    routed = layer(x)
    x_ND = x.view(12, 8)
    by_hand = reference_experts(shared, x_ND, [12, 0]) + reference_experts(shared, x_ND, [0, 12])
    torch.testing.assert_close(y, routed + by_hand.view_as(x), **TOL)


def test_layer_slots_into_the_transformer_and_counts_like_the_config():
    cfg = ModelConfig(num_layers=2, dim=32, num_heads=4, ffn_dim=48, vocab_size=64, max_seq_len=16)
    model = Transformer(cfg)
    for block in model.layers.values():
        block.feed_forward = MoELayer(32, 48, num_experts=4, top_k=2)
    assert model.num_params() == cfg.replace(num_experts=4, top_k=2).num_params()
    model(torch.randint(0, 64, (2, 16))).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_experts=4, top_k=5), "top_k=5 must lie in 1..num_experts=4"),
    (dict(num_experts=6, top_k=4, num_prototypes=4), "num_experts=6 is not divisible by num_prototypes=4"),
    (dict(num_experts=8, top_k=2, num_prototypes=4), "top_k=2 must equal num_prototypes=4"),
    (dict(num_experts=4, top_k=2, capacity_factor=-0.5), "capacity_factor=-0.5 must be >= 0"),
    (dict(num_experts=4, top_k=2, activation="relu"), "activation='relu'; valid: 'swiglu', 'gelu'"),
    ({"num_experts": 4, "top_k": 2, "group_tokens": -1}, "group_tokens=-1 must be >= 0"),
])
def test_user_mistakes_are_one_line_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")) as info:
        MoELayer(8, 16, **kwargs)
    assert "\n" not in str(info.value)


def test_moe_package_has_no_distributed_imports():
    package = Path(__import__("shoal.moe", fromlist=["_"]).__file__).parent
    for source in package.glob("*.py"):
        assert "torch.distributed" not in source.read_text(), source.name
