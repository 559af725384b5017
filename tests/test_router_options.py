"""The MoE router's options (shoal.moe.router.Router): sigmoid scores, group-limited top-k, normalised
and scaled weights, the selection bias with its sign-rule update, the sequence-wise balance loss.

References: transformers' DeepSeek-V3 router (DeepseekV3TopkRouter, which computes the same float32
formulas: its weights equal shoal's up to the order in which the K chosen weights are summed, a few
ulps); and for what transformers does not have (the bias update, the sequence-wise loss) DeepSeek-V3's
formulas (Liu et al. 2024, arXiv 2412.19437, section 2.1.2 and eq. 17-20) written out below as plain
loops, never shoal's own code.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

from shoal.models import ModelConfig  # noqa: E402
from shoal.models.transformer import Transformer  # noqa: E402
from shoal.moe.collect import MoECollector  # noqa: E402
from shoal.moe.layer import MoELayer  # noqa: E402
from shoal.moe.router import Router, limit_to_groups, sequence_balance_loss  # noqa: E402
from shoal.testing.asserts import one_line_error  # noqa: E402

EPS32 = torch.finfo(torch.float32).eps
WEIGHT_TOL = dict(rtol=4 * EPS32, atol=0.0)
"""The K chosen weights summed in another order (transformers' unsorted top-k against shoal's stable
sort), then one division and one product: a few ulps of the weight."""


def _pair(*, norm: bool = True, groups: int = 4, topk_groups: int = 2, top_k: int = 3, scale: float = 2.5,
          seed: int = 0) -> tuple[Router, torch.nn.Module]:
    """shoal's router and transformers' DeepSeek-V3 router with the same gate and a random selection bias."""
    config = transformers.DeepseekV3Config(hidden_size=16, n_routed_experts=8, n_group=groups, topk_group=topk_groups,
                                           num_experts_per_tok=top_k, routed_scaling_factor=scale,
                                           norm_topk_prob=norm)
    theirs = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    ours = Router(16, 8, top_k=top_k, normalize=norm, score="sigmoid", expert_groups=groups, topk_groups=topk_groups,
                  scale=scale, bias=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(8, 16, generator=g))
        theirs.e_score_correction_bias.copy_(0.1 * torch.randn(8, generator=g))
        ours.gate.weight.copy_(theirs.weight)
        assert ours.bias is not None
        ours.bias.copy_(theirs.e_score_correction_bias)
    return ours, theirs


def _sorted(experts_NK: torch.Tensor, weights_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = experts_NK.argsort(dim=-1)
    return experts_NK.gather(-1, order), weights_NK.gather(-1, order)


@pytest.mark.parametrize("norm, groups, topk_groups", [(True, 4, 2), (False, 4, 2), (True, 2, 1), (True, 0, 0)])
def test_router_equals_transformers_deepseek_v3(norm, groups, topk_groups):
    ours, theirs = _pair(norm=norm, groups=groups or 1, topk_groups=topk_groups or 1)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    routing = ours(x)
    _, weights, experts = theirs(x)
    got_e, got_w = _sorted(routing.experts_NK, routing.weights_NK)
    want_e, want_w = _sorted(experts, weights)
    assert torch.equal(got_e, want_e)
    torch.testing.assert_close(got_w, want_w, **WEIGHT_TOL)


def test_normalising_denominator_adds_1e_20_as_transformers_does():
    """Scores that underflow: sigmoid(-100) is a float32 denormal, so the chosen weights' sum is ~1e-43
    and transformers' 1e-20 sets the weights (~1e-24 x scale); without it each would be scale / K."""
    ours, theirs = _pair()
    with torch.no_grad():
        for router in (ours.gate.weight, theirs.weight):
            router.zero_()
    x = torch.ones(4, 16)
    with torch.no_grad():
        ours.gate.weight[:, 0] = -100.0 - 0.5 * torch.arange(8.0)
        theirs.weight.copy_(ours.gate.weight)
    routing = ours(x)
    _, weights, experts = theirs(x)
    assert weights.max() < 1e-20 and routing.weights_NK.max() < 1e-20
    torch.testing.assert_close(_sorted(routing.experts_NK, routing.weights_NK)[1], _sorted(experts, weights)[1],
                               **WEIGHT_TOL)


def test_a_group_is_ranked_by_the_sum_of_its_two_highest_scores():
    """Group A's best expert is the highest score of all, group B's two best sum higher: B wins (ranking by
    the maximum would take A)."""
    choice = torch.tensor([[0.9, 0.1, 0.1, 0.6, 0.6, 0.6]])
    kept = limit_to_groups(choice, 2, 1)
    assert torch.equal(kept, torch.tensor([[-float("inf")] * 3 + [0.6] * 3]))


def test_the_bias_selects_and_does_not_weigh():
    router = Router(8, 4, top_k=1, normalize=False, score="sigmoid", bias=True)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert router.bias is not None
        router.bias[2] = 10.0
    routing = router(x)
    assert (routing.experts_NK == 2).all()
    torch.testing.assert_close(routing.weights_NK[:, 0], torch.sigmoid(router.gate(x))[:, 2], rtol=0, atol=0)


def _paper_sequence_loss(scores: list[list[float]], chosen: list[list[int]], seq_len: int, k: int) -> float:
    """DeepSeek-V3 eq. 17-20 as written: per sequence, f_i = N_r / (K_r T) sum_t 1(i chosen at t),
    s'_{i,t} = s_{i,t} / sum_j s_{j,t}, P_i = 1/T sum_t s'_{i,t}, L = sum_i f_i P_i; here the mean over
    the sequences."""
    n_r = len(scores[0])
    losses = []
    for start in range(0, len(scores), seq_len):
        f = [0.0] * n_r
        p = [0.0] * n_r
        for t in range(start, start + seq_len):
            for i in chosen[t]:
                f[i] += n_r / (k * seq_len)
            total = sum(scores[t])
            for i in range(n_r):
                p[i] += scores[t][i] / total / seq_len
        losses.append(sum(fi * pi for fi, pi in zip(f, p, strict=True)))
    return sum(losses) / len(losses)


def test_sequence_balance_loss_is_the_papers():
    g = torch.Generator().manual_seed(0)
    probs = torch.sigmoid(torch.randn(3 * 5, 6, generator=g))
    experts = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(15)])
    got = sequence_balance_loss(probs, experts, seq_len=5)
    want = _paper_sequence_loss(probs.tolist(), experts.tolist(), seq_len=5, k=2)
    assert abs(got.item() - want) <= 8 * EPS32 * abs(want), (got.item(), want)


def test_sigmoid_scores_enter_the_balance_loss_as_shares_of_each_token():
    """Switch's loss E sum_e f_e P_e is 1 at a uniform router whatever the score: with every sigmoid score
    equal (a zero gate: each is 0.5), each token's shares are 1/E, so the loss is sum_e f_e = 1. Raw sigmoid
    scores would give E/2 (8 here), and a loss that falls when every score shrinks, no choice moving."""
    cfg = ModelConfig(num_layers=1, dim=32, num_heads=4, ffn_dim=16, vocab_size=64, max_seq_len=16, num_experts=16,
                      top_k=4, capacity_factor=0.0, router_score="sigmoid", aux_loss_pooled=False)
    torch.manual_seed(0)
    layer = Transformer(cfg).layers["0"].feed_forward
    assert isinstance(layer, MoELayer)
    with torch.no_grad():
        layer.router.gate.weight.zero_()
    layer(torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)))
    assert layer.aux_loss is not None and abs(layer.aux_loss.item() - 1.0) <= 8 * EPS32, layer.aux_loss
    balance = layer.balance
    assert balance is not None
    torch.testing.assert_close(balance[1], torch.full((16,), 16 / 16.0), rtol=8 * EPS32, atol=0.0)  # 16 rows x 1/E


def _biased_model(rate: float = 0.01) -> Transformer:
    cfg = ModelConfig(num_layers=2, dim=32, num_heads=4, ffn_dim=16, vocab_size=64, max_seq_len=16, num_experts=8,
                      top_k=2, capacity_factor=0.0, router_score="sigmoid", router_groups=4, router_topk_groups=2,
                      router_bias=True, router_bias_rate=rate)
    torch.manual_seed(0)
    return Transformer(cfg)


def test_bias_update_is_the_sign_rule_over_the_steps_calls():
    """Two training forwards (micro-batches), then the update: b_i += gamma sign(mean load - load_i), the
    loads counted here by a plain loop over each call's chosen experts."""
    model = _biased_model(rate=0.01)
    collector = MoECollector(model)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    chosen: dict[int, list[list[int]]] = {id(m): [] for m in layers}
    for m in layers:
        m.router.register_forward_hook(lambda mod, _a, out, m=m: chosen[id(m)].extend(out.experts_NK.tolist()))
    with torch.no_grad():
        for m in layers:
            assert m.router.bias is not None
            m.router.bias.copy_(0.01 * torch.randn(8, generator=torch.Generator().manual_seed(1)))
    before = {id(m): m.router.bias.tolist() for m in layers if m.router.bias is not None}
    for seed in (0, 1):
        model(torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed)))
    with torch.no_grad():
        model.eval()(torch.randint(0, 64, (2, 16)))  # evaluation does not count
    model.train()
    collector.update_bias()
    for m in layers:
        load = [0] * 8
        for experts in chosen[id(m)][:64]:  # the two training calls' 2 x 32 tokens
            for e in experts:
                load[e] += 1
        mean = sum(load) / 8
        signs = [(mean > n) - (mean < n) for n in load]
        assert any(signs)
        want = torch.tensor(before[id(m)]) + torch.tensor([0.01 * s for s in signs])  # the bias's float32
        assert m.router.bias is not None
        assert torch.equal(m.router.bias, want), (load, m.router.bias, want)


def test_router_options_refuse_bad_values_in_one_line():
    base = dict(num_experts=8, top_k=2)
    for over, words in [(dict(router_score="relu"), "router_score='relu' is not valid; valid: softmax, sigmoid"),
                        (dict(router_groups=3, router_topk_groups=1), "router_groups=3 with router_topk_groups=1"),
                        (dict(router_groups=4, router_topk_groups=5), "valid: groups of >= 2 experts"),
                        (dict(router_bias_rate=0.1), "router_bias_rate=0.1 moves a bias the model lacks"),
                        (dict(router_scale=0.0), "router_scale=0.0 must be > 0"),
                        (dict(num_prototypes=2, router_score="sigmoid"), "num_prototypes=2 takes the softmax")]:
        message = one_line_error(ModelConfig, **base, **over)
        assert words in message, message


# ----------------------------------------------------------------------------- under every plan

_BIASED = ModelConfig(num_layers=2, dim=64, num_heads=4, num_kv_heads=2, ffn_dim=32, vocab_size=128, max_seq_len=32,
                      num_experts=8, top_k=2, capacity_factor=0.0, aux_loss_coef=0.0, z_loss_coef=0.0,
                      router_score="sigmoid", router_groups=4, router_topk_groups=2, router_scale=2.0,
                      router_bias=True, router_bias_rate=0.01, seq_aux_coef=0.01)
"""A DeepSeek-V3-style router: sigmoid scores, 4 groups of 2 experts, 2 groups per token, scaled weights, the
selection bias moved by gamma = 0.01 after each step, the sequence-wise loss."""
STEPS = 4
TP_BOUND = 2 * 0.01 * STEPS
"""Under tp the router's input is summed in another order (the row-parallel products' reduction), so a token
whose two best choice scores lie within that rounding can choose the other expert; each step then moves an
entry by a different multiple of gamma in {-gamma, 0, gamma}: at most 2 gamma per step apart."""


@pytest.mark.parametrize("plan, world", [("dp2", 2), ("ep2", 2), ("pp2", 2),
                                         pytest.param("fsdp2", 2, marks=pytest.mark.slow),
                                         pytest.param("fsdp2,ep2", 2, marks=pytest.mark.slow),
                                         pytest.param("pp2,ep2", 4, marks=pytest.mark.slow),
                                         pytest.param("tp2", 2, marks=pytest.mark.slow)])
def test_bias_and_training_under_plan_equal_one_process(pools, plan, world):
    """The loads of the whole global batch move the bias (every data, expert and pipeline rank, every
    micro-batch: pp2 runs 4), so the biases after every step equal one process's bit for bit (within
    TP_BOUND under tp); the run as a whole passes check_parity."""
    from shoal import rules
    from shoal.plan import Plan
    from shoal.testing.parity import case, check_parity, references, run_parallel

    resolved = rules.resolve(Plan.parse(plan), world_size=world)
    c = case(plan=plan, model=_BIASED, steps=STEPS, num_micro=resolved.micro_batches if resolved.pp > 1 else 1)
    results = pools(world).run(run_parallel, c)
    check_parity(results, c)
    want = references(c)[0]["router_bias"]
    assert want and all(b.abs().max() > 0 for b in want.values())
    got: dict[str, torch.Tensor] = {}
    for result in results:
        for name, bias in result["router_bias"].items():
            assert name not in got or torch.equal(got[name], bias), f"{name} differs between ranks"
            got[name] = bias
    assert set(got) == set(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    print(f"{plan}: max |bias - one process's| {worst:.3g}")
    for name in want:
        if plan.startswith("tp"):
            assert (got[name] - want[name]).abs().max() <= TP_BOUND, name
        else:
            assert torch.equal(got[name], want[name]), (name, got[name], want[name])


RESHARD_SEGMENTS = [("fsdp2,ep2", 0, 2), ("pp2,mb=2", 2, 3), ("single", 3, 4), ("tp2", 4, 5)]
"""A biased run's checkpoints across plans (plan, first step, end step; two processes but "single"): written
under fsdp x ep, resumed under a pipeline, in one process, then under tp, which comes last because its bias
may differ (TP_BOUND) and the steps after it would then route differently."""


@pytest.mark.slow
def test_a_trained_bias_reshards_across_plans(pools, tmp_path):
    """The selection bias, a buffer of every checkpoint, resumes under another plan: after every segment each
    rank's biases equal the unbroken one-process run's bit for bit (within 2 gamma per tp step under tp), and
    the losses, gradient norms and final weights are that run's, as tests/test_reshard.py holds them."""
    from shoal.testing.asserts import assert_rounding_close
    from shoal.testing.parity import assert_trained_close, case, references, train_segment

    c = case(model=_BIASED, steps=RESHARD_SEGMENTS[-1][2], num_micro=2)
    ref32, ref64 = references(c)
    for plan_text, start, end in RESHARD_SEGMENTS:
        if plan_text == "single":
            results = [train_segment(c, str(tmp_path), plan_text, start, end, c.num_micro)]
        else:
            results = pools(2).run(train_segment, c, str(tmp_path), plan_text, start, end, c.num_micro)
        want = ref32["step_router_bias"][end - 1]
        assert want and any(b.abs().max() > 0 for b in want.values())  # training moved them
        bound = 2 * _BIASED.router_bias_rate * (end - start) if plan_text.startswith("tp") else 0.0
        held: set[str] = set()
        for rank, res in enumerate(results):
            what = f"{plan_text} rank {rank} steps {start}..{end - 1}"
            for name, bias in res["router_bias"].items():
                held.add(name)
                worst = (bias - want[name]).abs().max().item()
                assert worst <= bound if bound else torch.equal(bias, want[name]), (what, name, bias, want[name])
            assert_rounding_close(res["losses"], ref32["losses"][start:end], ref64["losses"][start:end],
                                  what=f"{what} losses")
            assert_rounding_close(res["grad_norms"], ref32["grad_norms"][start:end], ref64["grad_norms"][start:end],
                                  what=f"{what} gradient norms")
        assert held == set(want), plan_text  # every layer's bias on some rank (a pipeline stage holds its own)
    assert_trained_close(results[0]["params"], ref32, ref64)


def test_biased_router_through_the_trainer_records_and_resumes(tmp_path):
    """`shoal train` with a moving selection bias: metrics.jsonl holds each layer's bias and the per-expert
    bias averaged over layers (moe_bias, beside moe_load), the heatmap has its second panel, and a run resumed
    from its step-2 checkpoint (the bias a buffer of the checkpoint) has the losses of the unbroken run."""
    import json

    from shoal import cli

    flags = ["--device", "cpu", "--model", "tiny-moe", "--global-batch", "4", "--seq-len", "32", "--eval-every", "0",
             "--set", "router_score=sigmoid", "--set", "router_bias=true", "--set", "router_bias_rate=0.01",
             "--set", "capacity_factor=0", "--nproc", "2", "--ckpt-every", "2", "--decay-steps", "4"]

    def losses(run: str) -> list[dict]:
        return [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    assert cli.main(["train", "--out", str(tmp_path / "whole"), "--steps", "4", *flags]) == 0
    assert cli.main(["train", "--out", str(tmp_path / "half"), "--steps", "2", *flags]) == 0
    assert cli.main(["train", "--resume", str(tmp_path / "half"), "--steps", "4", *flags]) == 0
    whole, resumed = losses("whole"), losses("half")
    assert [r["loss"] for r in whole] == [r["loss"] for r in resumed][-4:]
    assert whole[0]["moe_bias"] == [0.0] * 4 and any(whole[-1]["moe_bias"])
    assert all(len(r["moe/0/bias"]) == 4 for r in whole)
    assert resumed[-1]["moe/3/bias"] == whole[-1]["moe/3/bias"]
