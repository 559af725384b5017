"""The planner's cost formulas against hand-computed values, its search against the plan validator,
and `shoal plan` on the command line. No processes, no torch collectives: all pure arithmetic."""

from __future__ import annotations

import json
import math
import sys
from fractions import Fraction
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` is a folder beside `src`, not installed

from bench import framework_models  # noqa: E402  (after the sys.path line above)
from shoal import rules  # noqa: E402
from shoal.cli import main  # noqa: E402
from shoal.cli.plan import price  # noqa: E402
from shoal.models.config import ModelConfig, get_preset  # noqa: E402
from shoal.parallel.schedules import bubble_fraction, build_schedule, peak_in_flight, simulate  # noqa: E402
from shoal.plan import Plan  # noqa: E402
from shoal.planner import compute, memory  # noqa: E402
from shoal.planner.cluster_file import parse_cluster  # noqa: E402
from shoal.planner.comm import RingNetwork, ring_time  # noqa: E402
from shoal.planner.costs import _training_gemm_time  # noqa: E402
from shoal.planner.estimate import Framework, Workload, _bubble, estimate  # noqa: E402
from shoal.planner.search import search  # noqa: E402

TINY = get_preset("tiny")  # 4 layers, dim 128, 8 heads of 16, 4 KV heads, FFN 384, SwiGLU, vocab 256


# ----------------------------------------------------------------------------- formulas
def test_zero_model_states_match_the_zero_paper():
    """Rajbhandari et al. 2020, figure 1: Psi = 7.5B, N = 64, K = 12: 120, 31.4, 16.6, 1.9 GB."""
    psi = 7.5e9
    totals = [sum(memory.model_state_bytes(psi, shards=64, stage=s, param_bytes=2, grad_bytes=2, optim_bytes=12)) / 1e9
              for s in (0, 1, 2, 3)]
    # by hand: 16 * 7.5 = 120; 4 * 7.5 + 12 * 7.5 / 64 = 31.41; 2 * 7.5 + 14 * 7.5 / 64 = 16.64; 16 * 7.5 / 64 = 1.875
    assert totals == pytest.approx([120.0, 31.40625, 16.640625, 1.875])
    with pytest.raises(ValueError, match="valid: 0, 1, 2, 3"):
        memory.model_state_bytes(psi, shards=2, stage=4, param_bytes=2, grad_bytes=2, optim_bytes=12)


def test_block_flops_by_hand():
    # attention projections: 2 * D * (2 * H * hd + 2 * kv * hd) = 2 * 128 * (256 + 128) = 98,304
    assert compute.attention_matmul_flops(TINY) == 98_304
    # SwiGLU FFN: 2 * 3 * D * F = 2 * 3 * 128 * 384 = 294,912
    assert compute.mlp_matmul_flops(TINY) == 294_912
    # attention core over 128 keys: 4 * 128 * 8 * 16 = 65,536; half of it with causal skipping
    assert compute.attention_core_flops(TINY, 128, causal_skip=False) == 65_536
    assert compute.attention_core_flops(TINY, 128, causal_skip=True) == 32_768
    # 2 FLOPs per weight: one block's forward matmuls are twice its matrix parameters
    block_params = (TINY.num_params(embedding=False) - TINY.dim) / TINY.num_layers - 2 * TINY.dim
    assert compute.attention_matmul_flops(TINY) + compute.mlp_matmul_flops(TINY) == 2 * block_params


def test_moe_block_counts_the_experts_a_token_uses():
    moe = get_preset("tiny-moe")  # 4 experts, top-2, FFN 256
    work = compute.block_work(moe, 0, seq_len=128, causal_skip=True, fused_attention=True)
    dense = compute.block_work(moe.replace(num_experts=0), 0, seq_len=128, causal_skip=True, fused_attention=True)
    # two experts' FFNs instead of one, plus the router's 2 * D * E
    assert work.matmul - dense.matmul == compute.mlp_matmul_flops(moe) + 2 * 128 * 4
    assert compute.experts_per_token(moe.replace(num_prototypes=2)) == 2


def test_dense_first_layers_of_their_own_width_are_priced_by_hand():
    """moe_first_dense and moe_dense_layers choose the dense blocks; a dense block's FFN is dense_ffn_dim wide
    (2 * 3 * D * 512 = 393,216 FLOPs per token) and the experts stay ffn_dim (256) wide."""
    from shoal.planner.costs import Costs

    cfg = get_preset("tiny-moe").replace(num_layers=6, moe_first_dense=1, moe_dense_layers=(4,), dense_ffn_dim=512)
    assert compute.mlp_matmul_flops(cfg) == 393_216 and compute.ffn_width(cfg, 0) == 512.0
    assert compute.ffn_width(cfg, 1) == 2 * 256.0 and compute.ffn_width(cfg, 4) == 512.0
    assert compute.block_index(cfg, moe=True) == 1 and compute.block_index(cfg, moe=False) == 0
    assert Costs.moe_count(type("C", (), {"cfg": cfg})(), 0, 6) == 4  # type: ignore[arg-type]
    assert Costs.moe_count(type("C", (), {"cfg": cfg})(), 3, 5) == 1  # type: ignore[arg-type]


def test_activation_elements_by_hand():
    """Per token: RMSNorms 2 x (3D + 1) = 770; q, k, v (repeated to 8 heads), o = 4*128, + 8
    log-sum-exps; SwiGLU 4F = 1536. Under sequence parallelism a norm's input, normalised input and
    statistic (2D + 1) split by tp; the product after it keeps its all-gathered input (D) whole under
    DTensor, split under Megatron-LM."""
    kw = dict(seq_len=128, fused_attention=True)
    assert memory.activation_elements(TINY, 0, tp=1, sp=False, ac="none", **kw) == 770 + 520 + 1536
    assert memory.activation_elements(TINY, 0, tp=2, sp=True, ac="none", **kw) == 2 * (257 / 2 + 128) + (520 + 1536) / 2
    assert memory.activation_elements(TINY, 0, tp=2, sp=True, ac="none", sp_layout=framework_models.layout("megatron"),
                                      **kw) == (770 + 520 + 1536) / 2
    assert memory.activation_elements(TINY, 0, tp=2, sp=False, ac="none", **kw) == 770 + (520 + 1536) / 2
    with pytest.raises(ValueError, match="valid: dtensor, megatron"):
        memory.activation_elements(TINY, 0, tp=2, sp=True, ac="none", sp_layout=framework_models.layout("deepspeed"),
                                   **kw)
    assert memory.activation_elements(TINY, 0, tp=1, sp=False, ac="full", **kw) == 128
    # unfused attention keeps the probabilities (H * T per token) unless recomputed
    unfused = dict(seq_len=128, fused_attention=False)
    assert memory.activation_elements(TINY, 0, tp=1, sp=False, ac="none", **unfused) == 2826 + 8 * 128
    # shoal's selective recompute keeps the block's input, the weight products' outputs (q, k, v: 128 + 2 * 64;
    # the two up projections 2F; the two row-parallel outputs 2D) and a fused kernel's output and log-sum-exps
    # (136); unfused attention's products are rerun
    assert memory.activation_elements(TINY, 0, tp=1, sp=False, ac="selective", **unfused) == 128 + 256 + 768 + 256
    assert memory.activation_elements(TINY, 0, tp=1, sp=False, ac="selective", **kw) == 1408 + 136


def test_dropout_kept_elements_by_hand():
    """At dropout > 0 on a GPU each hidden-state dropout keeps a one-byte mask (half an element of 2 bytes, a
    quarter of 4): 2 x D/2 = 128 more a block in bf16, split by tp only under sequence parallelism; FlashAttention
    keeps its RNG state only; unfused attention keeps the mask and the dropped probabilities beside the
    probabilities, (1 + 1/2) H T (Korthikanti et al. 2022: 5 bytes a score). Shoal's selective policy recomputes
    the masks; Megatron-LM's keeps the hidden state's. The embedding's mask, D/2, once a model."""
    drop = TINY.replace(dropout=0.1)
    kw = dict(seq_len=128, fused_attention=True)
    base = memory.activation_elements(TINY, 0, tp=1, sp=False, ac="none", **kw)
    assert memory.activation_elements(drop, 0, tp=1, sp=False, ac="none", **kw) == base + 128
    assert memory.activation_elements(drop, 0, tp=1, sp=False, ac="none", element_bytes=4, **kw) == base + 64
    for sp, masks in ((True, 64), (False, 128)):
        tp2 = memory.activation_elements(TINY, 0, tp=2, sp=sp, ac="none", **kw)
        assert memory.activation_elements(drop, 0, tp=2, sp=sp, ac="none", **kw) == tp2 + masks
    unfused = dict(seq_len=128, fused_attention=False)
    assert (memory.activation_elements(drop, 0, tp=1, sp=False, ac="none", **unfused)
            == memory.activation_elements(TINY, 0, tp=1, sp=False, ac="none", **unfused) + 128 + 1.5 * 8 * 128)
    for ac in ("selective", "full"):
        assert memory.activation_elements(drop, 0, tp=1, sp=False, ac=ac, **kw) == memory.activation_elements(
            TINY, 0, tp=1, sp=False, ac=ac, **kw)
    megatron = dict(ac="selective", policy=framework_models.policy("megatron"), **unfused)
    assert memory.activation_elements(drop, 0, tp=1, sp=False, **megatron) == memory.activation_elements(
        TINY, 0, tp=1, sp=False, **megatron) + 128
    assert memory.embedding_dropout_elements(drop, tp=1, sp=False, on_cpu=False, element_bytes=2) == 64
    assert memory.embedding_dropout_elements(TINY, tp=1, sp=False, on_cpu=False, element_bytes=2) == 0


@pytest.mark.parametrize(("kind", "expected"), [
    ("all_reduce", 2 * (3 * 1e-5 + 0.75)),  # 2(n-1) steps, 2(n-1)/n of the buffer
    ("all_gather", 3 * 1e-5 + 0.75), ("reduce_scatter", 3 * 1e-5 + 0.75), ("all_to_all", 3 * 1e-5 + 0.75),
    ("send_recv", 1e-5 + 1.0), ("broadcast", 3 * 1e-5 + 1.0),
])
def test_ring_times_by_hand(kind, expected):
    """4 ranks, 1 GB, 1 GB/s, 10 us per step."""
    assert ring_time(kind, 4, 1e9, bandwidth=1e9, latency=1e-5) == pytest.approx(expected)
    assert ring_time(kind, 1, 1e9, bandwidth=1e9, latency=1e-5) == 0


@pytest.mark.parametrize("sched, vpp", [("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16)])
def test_pipeline_formulas_match_the_schedule_tables(sched, vpp, p, m):
    """The closed forms the estimate uses against the executable schedule tables themselves:
    in-flight micro-batches exactly, and the bubble with F = 1, B = 2 (split: B = W = 1)."""
    table = build_schedule(sched, num_ranks=p, num_micro=m, vpp=vpp)
    assert memory.in_flight(sched, pp=p, micro=m, vpp=vpp) * vpp == max(peak_in_flight(table))
    timeline = simulate(table, costs={"F": Fraction(1, vpp), "B": Fraction(2 if sched != "zb" else 1, vpp),
                                      **({"W": 1} if sched == "zb" else {})})
    makespan = max(end for row in timeline for _, end, _ in row)
    plan = Plan(pp=p, mb=m, sched=sched, vpp=vpp)
    assert makespan - m * 3 == _bubble(plan, 1.0, 2.0)
    assert 0 <= bubble_fraction(timeline) < 1


# ----------------------------------------------------------------------------- the estimate
QWEN2_MOE = ModelConfig(num_layers=2, dim=64, num_heads=4, num_kv_heads=2, ffn_dim=32, vocab_size=128,
                        num_experts=4, top_k=2, capacity_factor=0.0, num_shared_experts=1, shared_ffn_dim=48,
                        shared_gate=True, norm_topk=False)
"""Qwen2-MoE's shape: routed experts 32 wide (moe_intermediate_size), the shared expert 48
(shared_expert_intermediate_size), a sigmoid gate on it."""


def test_shared_experts_count_at_their_own_width():
    """By hand, per token of one MoE block (D = 64, H = 4 of 16, 2 KV heads, SwiGLU):
    FFN width 2 x 32 (top-2 routed) + 48 (shared) = 112 (ffn_dim alone would say 3 x 32 = 96).
    FLOPs: attention 2 * 64 * (128 + 64) = 24,576; FFNs 2 * 3 * 64 * 112 = 43,008; router
    2 * 64 * 4 = 512; the shared gate 2 * 64 = 128: 68,224.
    Activations: norms 2 (3 * 64 + 1) = 386; attention 4 * 64 + 4 = 260; FFNs 4 * 112 = 448;
    tokens copied to the 3 experts and their outputs 2 * 3 * 64 = 384; the router's logits and
    probabilities 2 * 4, its top-2 weights twice and two statistics 2 * 2 + 2: 1,492.
    Parameters: the planner's per-rank count is the model's own (ModelConfig.num_params, which
    builds the shared expert at its width) less the final norm."""
    from shoal.planner.costs import Costs

    assert compute.ffn_width(QWEN2_MOE, 0) == 112
    assert compute.block_work(QWEN2_MOE, 0, seq_len=16, causal_skip=True, fused_attention=True).matmul == 68_224
    assert memory.activation_elements(QWEN2_MOE, 0, seq_len=16, tp=1, sp=False, ac="none",
                                      fused_attention=True) == 1_492
    cluster = parse_cluster("1xA100-80GB")
    plan = rules.resolve(Plan.parse("dp1"), world_size=1, device="cuda")
    cost = Costs(plan, QWEN2_MOE, cluster, RingNetwork(cluster), tokens=16, seq_len=16, fused=True)
    dense, experts = cost.params_per_rank(QWEN2_MOE.num_layers, head=True)
    assert dense + experts == QWEN2_MOE.num_params() - QWEN2_MOE.dim


def test_experts_are_counted_at_their_own_width():
    """The routed experts are ffn_dim wide whatever the dense layers' width (dense_ffn_dim, DeepSeek-V3's first
    three layers): one MoE layer of 4 experts of 3 x 64 x 8 under ep2 is 4 x 1,536 / 2 = 3,072 a rank; the
    whole count, one process, is the model's own (ModelConfig.num_params) less the final norm."""
    from shoal.planner.costs import Costs

    cfg = ModelConfig(num_layers=2, dim=64, num_heads=4, ffn_dim=8, dense_ffn_dim=96, vocab_size=128, num_experts=4,
                      top_k=2, moe_first_dense=1)
    cluster = parse_cluster("2xA100-80GB")
    for text, world in (("dp1", 1), ("ep2", 2)):
        plan = rules.resolve(Plan.parse(text), world_size=world, device="cuda", model=cfg)
        cost = Costs(plan, cfg, cluster, RingNetwork(cluster), tokens=16, seq_len=16, fused=True)
        dense, experts = cost.params_per_rank(2, head=True)
        assert experts == 4 * 3 * 64 * 8 / plan.ep
        if plan.ep == 1:
            assert dense + experts == cfg.num_params() - cfg.dim


def _distinct_ranks_by_enumeration(num_experts: int, k: int, ep: int, groups: int = 0, topk_groups: int = 0) -> float:
    """The mean number of ranks (E/ep consecutive experts each) among k distinct experts, over every choice a token
    may make with equal weight: any k experts, or any k among the experts of any topk_groups of the groups."""
    import itertools

    size = num_experts // ep
    pools = ([list(range(num_experts))] if groups <= 1 else
             [[e for g in chosen for e in range(g * num_experts // groups, (g + 1) * num_experts // groups)]
              for chosen in itertools.combinations(range(groups), topk_groups)])
    counts = [len({e // size for e in choice}) for pool in pools for choice in itertools.combinations(pool, k)]
    return sum(counts) / len(counts)


@pytest.mark.parametrize("experts, k, ep, groups, topk_groups", [(8, 2, 4, 0, 0), (8, 3, 2, 0, 0), (16, 3, 8, 0, 0),
                                                                 (16, 3, 8, 4, 2), (16, 2, 4, 4, 1)])
def test_expert_ranks_per_token_is_the_mean_over_every_choice(experts, k, ep, groups, topk_groups):
    """shoal's all-to-all sends a token once per rank holding any of its choices: the expected count equals the mean
    over every choice enumerated (each equally likely), with and without group-limited routing; by hand for E = 8,
    k = 2, ep = 4: a pair shares a rank in 4 of C(8, 2) = 28 pairs, so 2 - 4/28 = 13/7."""
    cfg = ModelConfig(num_layers=1, dim=8, num_heads=2, ffn_dim=8, vocab_size=8, num_experts=experts, top_k=k,
                      router_score="sigmoid", router_groups=groups, router_topk_groups=topk_groups)
    want = _distinct_ranks_by_enumeration(experts, k, ep, groups, topk_groups)
    assert compute.expert_ranks_per_token(cfg, ep) == pytest.approx(want, rel=1e-12)
    if (experts, k, ep) == (8, 2, 4):
        assert want == pytest.approx(13 / 7)


def test_expert_all_to_all_is_priced_per_destination_rank():
    """DeepSeek-V3 at ep64 (256 experts, 4 a rank; top-8 within 4 of 8 groups of 32 experts, 8 ranks each): by hand
    32 (1 - C(124, 8) / C(128, 8)) = 7.359 ranks a token, not 8 copies, and the ep term of a stage prices
    4 all-to-alls (dispatch and combine, forward and backward) of that many rows a token, per MoE block."""
    from shoal.planner.costs import Costs

    ds = get_preset("deepseek-v3")
    by_hand = 32 * (1 - math.comb(124, 8) / math.comb(128, 8))
    assert compute.expert_ranks_per_token(ds, 64) == pytest.approx(by_hand) == pytest.approx(7.359, abs=1e-3)
    cfg = ModelConfig(num_layers=2, dim=64, num_heads=4, ffn_dim=32, vocab_size=128, num_experts=8, top_k=2,
                      capacity_factor=0.0)
    cluster = parse_cluster("4xH100-80GB")
    plan = rules.resolve(Plan.parse("ep4"), world_size=4, device="cuda", model=cfg)
    net = RingNetwork(cluster)
    cost = Costs(plan, cfg, cluster, net, tokens=1024, seq_len=1024, fused=True)
    _, _, terms = cost.stage(0, 2, head=True)
    act = 1024 * 64 * 2  # tokens x dim x bf16 bytes
    assert terms["ep_comm"] == pytest.approx(2 * 4 * net.time("all_to_all", 4, 13 / 7 * act, stride=1))


def test_a_tied_head_under_pp_is_a_copy():
    """Under pp the last stage keeps a copy of a tied embedding for its head: it holds V x D as an
    untied head's stage does (one process holds the tied table once)."""
    from shoal.planner.costs import Costs

    cluster = parse_cluster("2xA100-80GB")
    V, D = TINY.vocab_size, TINY.dim
    counts = {}
    for text in ("pp2", "dp2"):
        plan = rules.resolve(Plan.parse(text), world_size=2, device="cuda")
        for tied in (False, True):
            cfg = TINY.replace(tie_embeddings=tied)
            cost = Costs(plan, cfg, cluster, RingNetwork(cluster), tokens=16, seq_len=16, fused=True)
            counts[text, tied] = cost.params_per_rank(2, head=True)[0]
    assert counts["pp2", True] == counts["pp2", False]
    assert counts["dp2", False] - counts["dp2", True] == V * D


def test_under_pp_the_first_stage_holds_the_embedding():
    """An embedding-dominated model under pp2: the first stage holds the (V, D) table and its blocks,
    the last the head's table and its blocks, so the busiest rank holds half the one-process
    parameters and more, never just its blocks (the first stage's table was once left out)."""

    cfg = TINY.replace(vocab_size=500_000, dim=512)
    cluster = parse_cluster("2xcpu")
    work = Workload(model=cfg, global_batch=4, seq_len=128)
    one = estimate(rules.resolve(Plan.parse("dp1"), world_size=1, device="cpu"), work, parse_cluster("1xcpu"),
                   micro_batch=4)
    pp2 = estimate(rules.resolve(Plan.parse("pp2"), world_size=2, device="cpu"), work, cluster, micro_batch=2)
    table = 4.0 * cfg.vocab_size * cfg.dim  # fp32 bytes of one (V, D) table
    assert pp2.memory["parameters"] >= table
    assert one.memory["parameters"] / 2 <= pp2.memory["parameters"] < one.memory["parameters"]


def test_activation_count_follows_the_shared_width():
    """What autograd saves in a Qwen2-MoE block grows with the shared expert's width exactly as the
    planner's count does (only the width differs between the two models, so routing's own saved
    tensors cancel): 4 elements per unit of SwiGLU width, per token."""
    import torch

    from shoal.calibration.saved import saved_activation_elements
    from shoal.models import Transformer

    def saved(cfg: ModelConfig) -> int:
        torch.manual_seed(0)
        return saved_activation_elements(Transformer(cfg), torch.randint(0, cfg.vocab_size, (2, 16)))

    wide = QWEN2_MOE.replace(shared_ffn_dim=80)
    kw = dict(seq_len=16, tp=1, sp=False, ac="none", fused_attention=True)
    per_token = (memory.activation_elements(wide, 0, **kw) - memory.activation_elements(QWEN2_MOE, 0, **kw))
    assert per_token == 4 * 32
    assert saved(wide) - saved(QWEN2_MOE) == QWEN2_MOE.num_layers * per_token * 2 * 16


def _estimate(text: str, cluster: str = "8xA100-80GB", model: ModelConfig = TINY, batch: int = 16, seq: int = 128,
              **kw):
    c = parse_cluster(cluster)
    plan = rules.resolve(Plan.parse(text), world_size=c.world_size, device="cuda")
    return estimate(plan, Workload(model=model, global_batch=batch, seq_len=seq), c, **kw)


def test_one_device_compute_by_hand():
    e = _estimate("dp1", cluster="1xA100-80GB")
    tokens = 16 * 128
    clock = 1200 / 1410  # the A100's sustained clock (hardware.py)
    rate = 271.2e12 * clock  # its measured large-GEMM rate
    # Its square-GEMM table (Azure's cuBLASLt, 1024: 119.4 .. 16384: 256.5 TFLOP/s) prices each product at the rate
    # of a square GEMM of the same work: every product here is smaller than 1024^3 (the largest, 2048 x 384 x 128,
    # is 465^3), so all run at the table's smallest, 119.4 / 256.5 of the large rate.
    slow = 256.5 / 119.4
    # A product whose operands and output take longer to move through memory (1800 GB/s, 2 bytes an element) than
    # its FLOPs at the large rate runs at the memory's pace (the roofline): K's and V's (n = 4 heads x 16 = 64),
    # 3.07x the large-GEMM time, slower than the table's 2.15x; the others are held to the table.
    ridge = rate * 2 / 1800e9  # FLOPs per element moved

    def by_hand(n: int, k: int) -> float:  # one weight's three products (the same elements and FLOPs each)
        return max(slow, ridge * (tokens * k + k * n + tokens * n) / (2 * tokens * n * k))

    assert by_hand(64, 128) == pytest.approx(3.07, abs=0.01) and by_hand(128, 128) == slow
    weights = [(128, 128), (64, 128), (64, 128), (128, 128), (384, 128), (384, 128), (128, 384)]  # Q, K, V, output,
    block = sum(2 * n * k * by_hand(n, k) for n, k in weights)  # SwiGLU's three
    per_token = 4 * block + 2 * 128 * 256 * by_hand(256, 128)  # 4 blocks and the head (vocab 256)
    assert e.time["compute_matmul"] == pytest.approx(3 * tokens * per_token / rate)
    # FlashAttention's backward recomputes the scores: 2.5 forwards' FLOPs (compute.FUSED_BACKWARD), 3.5 in all
    assert e.time["compute_attention"] == pytest.approx(3.5 * tokens * 4 * 32_768 / (179.5e12 * clock))
    assert sum(e.time.values()) == pytest.approx(e.step_time_s)
    assert e.tokens_per_s == pytest.approx(tokens / e.step_time_s)


def test_attention_backward_counts_the_fused_kernels_recompute():
    """Kept scores: one product per input's gradient per forward product (2). A fused kernel keeps no
    scores: its backward redoes QK^T, then dV, dP, dQ and dK: 5 products against the forward's 2."""
    from shoal.planner.compute import FUSED_BACKWARD, attention_backward_multiplier

    assert attention_backward_multiplier(fused_kernel=False) == 2.0
    assert attention_backward_multiplier(fused_kernel=True) == FUSED_BACKWARD == 5 / 2
    unfused = estimate(rules.resolve(Plan.parse("dp1"), world_size=1, device="cuda"),
                       Workload(model=TINY, global_batch=16, seq_len=128, framework=Framework(fused_attention=False)),
                       parse_cluster("1xA100-80GB"))
    clock = 1200 / 1410
    full_context = 4 * 128 * 8 * 16  # QK^T and AV over all 128 keys (no masked blocks skipped)
    assert unfused.time["compute_attention"] == pytest.approx(3 * 16 * 128 * 4 * full_context / (271.2e12 * clock))


def test_terms_add_up_and_sharding_saves_memory():
    model, batch, seq = get_preset("llama3-8b"), 64, 4096
    plans = {t: _estimate(t, model=model, batch=batch, seq=seq, cluster="16xH100") for t in
             ("fsdp16", "dp2,fsdp8,zero=1", "tp8,fsdp2", "pp4,fsdp4,mb=16", "cp2,fsdp8", "tp2,pp2,fsdp4,mb=8,ac=full")}
    for e in plans.values():
        assert sum(e.time.values()) == pytest.approx(e.step_time_s)
        assert sum(e.memory.values()) * memory.FRAGMENTATION == pytest.approx(e.mem_per_device_bytes)
    assert plans["fsdp16"].memory["optimizer"] < plans["dp2,fsdp8,zero=1"].memory["optimizer"]
    assert plans["tp8,fsdp2"].time["tp_comm"] > 0 and plans["fsdp16"].time["tp_comm"] == 0
    assert plans["pp4,fsdp4,mb=16"].time["pp_bubble"] > 0
    assert plans["tp2,pp2,fsdp4,mb=8,ac=full"].time["recompute"] > 0


def test_a_cpu_process_adds_the_step_runtime_to_its_tensors():
    """On CPUs the total is the tensor terms with their margin plus what a step holds beyond its tensors
    (peak.CPU_STEP_BYTES, measured by bench/memory_model.py --models runtime); a GPU's reserved memory is
    priced apart (estimate.RESERVED_BYTES), not in the total."""
    from shoal.planner.estimate import Workload, estimate
    from shoal.planner.fit import cpu_cluster
    from shoal.planner.peak import CPU_STEP_BYTES

    work = Workload(model=TINY, global_batch=16, seq_len=128)
    cpu = estimate(rules.resolve(Plan.parse("fsdp2"), world_size=2, device="cpu"), work, cpu_cluster(2, local=2,
                                                                                                     memory_bytes=2**36))
    assert cpu.mem_per_device_bytes == pytest.approx(sum(cpu.memory.values()) * memory.FRAGMENTATION + CPU_STEP_BYTES)
    assert 16 * 2**20 <= CPU_STEP_BYTES <= 32 * 2**20  # 22-31 MB measured a process (jemalloc keeping freed pages)
    gpu = _estimate("fsdp2", cluster="2xA100-80GB")
    assert gpu.mem_per_device_bytes == pytest.approx(sum(gpu.memory.values()) * memory.FRAGMENTATION)


def test_every_step_pays_its_small_collectives():
    """step_sync counts the trainer's own collectives: the stop-signal agreement over the world,
    the loss's mean over each data and cp axis, the gradient norm's reduction over each sharding
    axis and the pipeline, and tp's partial gradients without FSDP; each an 8-byte all-reduce."""
    net = RingNetwork(parse_cluster("1x8xA100-80GB"))  # one node: every group on NVLink

    def t(n: int) -> float:
        return net.time("all_reduce", n, 8.0, stride=1)

    expected = {
        "dp8": 2 * t(8),  # loss, world
        "fsdp8": 3 * t(8),  # loss, norm, world
        "tp8": 2 * t(8),  # norm, world (bf16 tp runs under FSDP2, which reduces the partial gradients)
        "tp2,fsdp4": 2 * t(4) + t(2) + t(8),  # loss and norm over fsdp, norm over tp, world
        "dp2,tp2,pp2,mb=4": t(2) * 3 + t(8),  # loss over dp, norm over tp and pp, world
    }
    for text, seconds in expected.items():
        assert _estimate(text, cluster="1x8xA100-80GB").time["step_sync"] == pytest.approx(seconds), text
    assert _estimate("dp1", cluster="1xA100-80GB").time["step_sync"] == 0.0
    # fp32 tp alone runs without a data engine: its partial gradients are one more all-reduce
    cpu = parse_cluster("4xcpu")
    plan = rules.resolve(Plan.parse("tp4"), world_size=4, device="cpu")
    e = estimate(plan, Workload(model=TINY, global_batch=16, seq_len=128), cpu)
    assert e.time["step_sync"] == pytest.approx(3 * RingNetwork(cpu).time("all_reduce", 4, 8.0, stride=1))


def test_context_parallel_ring_counts_its_hops():
    """cp4: forward passes K, V 3 times; backward passes them 3 times more and the dK, dV
    accumulator 4 times, in fp32 (shoal.parallel.context); nothing hides on a CPU."""
    c = parse_cluster("4xcpu")
    plan = rules.resolve(Plan.parse("cp4"), world_size=4, device="cpu")
    model = get_preset("tiny")
    e = estimate(plan, Workload(model=model, global_batch=16, seq_len=128), c)
    net = RingNetwork(c)
    kv = 16 * 128 / 4 * 2 * model.kv_heads * model.head_dim  # elements of K and V on one rank
    per_block = 3 * net.time("ring", 4, kv * 4, stride=1) + 7 * net.time("ring", 4, kv * 4, stride=1)
    assert e.time["cp_comm_exposed"] == pytest.approx(model.num_layers * per_block)


# ----------------------------------------------------------------------------- the search
@pytest.mark.parametrize(("cluster", "model", "batch", "seq"), [
    ("8xA100-80GB", "gpt3-1.3b", 64, 2048), ("64xH100", "llama3-8b", 256, 4096), ("16xV100", "bert-large", 256, 512),
    ("4xcpu", "tiny", 16, 128), ("8xA100-80GB", "tiny-moe", 32, 128),
])
def test_search_returns_only_valid_plans_that_fit(cluster, model, batch, seq):
    c = parse_cluster(cluster)
    work = Workload(model=get_preset(model), global_batch=batch, seq_len=seq)
    result = search(work, c)
    assert result.plans
    times = [e.step_time_s for e in result.plans]
    assert times == sorted(times)
    for e in result.plans:  # each ranked plan, as `shoal plan --plan` reads its text: the same rules accept it
        again = price(e.plan_text, work, c, None, micro_batch=e.micro_batch if e.plan.pp == 1 else None)
        assert again.plan == e.plan
        assert e.fits and e.mem_per_device_bytes <= c.device.memory_bytes
        again = estimate(e.plan, work, c, micro_batch=e.micro_batch)
        assert again.step_time_s == pytest.approx(e.step_time_s)


def test_search_prunes_on_memory():
    """175B parameters need more than 16 bytes x 175e9 / 64 = 44 GB of model states even fully
    sharded over 64 A100-40GB: nothing fits; on 512 A100-80GB some plans do."""
    work = Workload(model=get_preset("gpt3-175b").replace(tie_embeddings=False), global_batch=512, seq_len=2048)
    assert not search(work, parse_cluster("64xA100-40GB")).plans
    fits = search(work, parse_cluster("512xA100-80GB"), top=5).plans
    assert fits and all(e.plan.pp * e.plan.tp * e.plan.fsdp > 1 for e in fits)


# ----------------------------------------------------------------------------- shoal plan
def test_shoal_plan_json_has_the_documented_keys(capsys):
    assert main(["plan", "--model", "gpt3-1.3b", "--cluster", "16xA100-80GB", "--global-batch", "64",
                 "--seq-len", "2048", "--top", "3", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert len(plans) == 3
    for p in plans:
        assert {"plan", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "mem_per_device_gb",
                "breakdown"} <= p.keys()
        Plan.parse(p["plan"])
    assert plans[0]["step_time_s"] <= plans[1]["step_time_s"]
    # --plan auto asks for the search, as leaving --plan out does.
    assert main(["plan", "--model", "gpt3-1.3b", "--cluster", "16xA100-80GB", "--global-batch", "64",
                 "--seq-len", "2048", "--top", "3", "--json", "--plan", "auto"]) == 0
    assert json.loads(capsys.readouterr().out) == plans


def test_shoal_plan_prices_one_plan_and_explains(capsys):
    assert main(["plan", "--model", "llama3-8b", "--set", "num_layers=8", "--cluster", "2x8xH100", "--global-batch",
                 "32", "--seq-len", "4096", "--plan", "tp8,fsdp2", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "fsdp2,tp8" in out and "tp_comm" in out and "memory optimizer" in out


def test_shoal_plan_prints_the_train_command_of_its_first_plan(capsys):
    """The line ends with what `shoal train` needs to run the plan as priced: its micro-batch where it
    accumulates, and torchrun's shape where the cluster has several nodes."""
    assert main(["plan", "--model", "llama3-8b", "--cluster", "8xH100", "--global-batch", "64", "--seq-len", "4096",
                 "--plan", "fsdp8", "--micro-batch", "2"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("train plan 1: shoal train --nproc 8 --model llama3-8b --plan fsdp8")
    assert line.endswith("--global-batch 64 --seq-len 4096 --micro-batch 2")
    assert main(["plan", "--model", "llama3-8b", "--cluster", "2x8xH100", "--global-batch", "64", "--top", "1"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("train plan 1: torchrun --nnodes 2 --nproc-per-node 8 ... -m shoal train --model llama3-8b")


@pytest.mark.parametrize(("argv", "words"), [
    (["--cluster", "12xA100"], "12"),
    (["--cluster", "8xB300"], "B300"),
    (["--cluster", "8xA100", "--plan", "tp3"], "tp3"),
    (["--cluster", "8xA100", "--global-batch", "0"], "--global-batch 0"),
    (["--cluster", "local", "--model", "tiny"], "--calibrate"),
    (["--cluster", "2xH100", "--model", "small", "--seq-len", "4096"], "exceeds the model's max_seq_len=512"),
])
def test_shoal_plan_bad_input_is_one_line(argv, words, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SHOAL_PROFILE", str(tmp_path / "none.json"))
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and words in err and err.startswith("shoal: error:"), repr(err)


# ----------------------------------------------------------------------------- --plan auto
def _profile_file(tmp_path):
    """A hand-made calibration profile (this machine's real one is measured by `shoal plan --calibrate`)."""
    from shoal.planner.profile import COLLECTIVES, CollectiveFit, Profile, save_profile

    def line(alpha: float, beta: float) -> CollectiveFit:
        return CollectiveFit(alpha=alpha, beta=beta, points=tuple((b, alpha + beta * b) for b in (1024, 2**20)))

    profile = Profile(
        hostname="box", torch_version="2.13.0", cpu_model="Test CPU", date="2026-11-22T00:00:00+00:00", quick=True,
        load_average=0.1, matmul_flops={n: {"fp32": 90e9 / max(1, n / 2)} for n in (1, 2, 4)},
        matmul_by_shape={n: {"fp32": {"128x128x128": 90e9 / max(1, n / 2)}} for n in (1, 2, 4)},
        memory_bw={1: 30e9, 2: 20e9, 4: 10e9}, memory_by_op={n: {"add": 1e10, "copy": 1e10} for n in (1, 2, 4)},
        collectives={2: {k: line(300e-6, 1e-9) for k in COLLECTIVES}, 4: {k: line(2e-3, 2e-9) for k in COLLECTIVES}})
    return save_profile(profile, tmp_path / "profile.json")


def test_auto_picks_the_searchs_best_and_prices_the_local_processes(tmp_path, monkeypatch):
    from shoal.calibration.auto_plan import choose

    monkeypatch.setenv("SHOAL_PROFILE", str(_profile_file(tmp_path)))
    choice = choose(TINY, global_batch=16, seq_len=128, world_size=4, device="cpu")
    assert choice.cluster.world_size == 4 and choice.cluster.device.name == "cpu"
    plan = rules.resolve(Plan.parse(choice.plan_text), world_size=4, device="cpu")
    rules.validate(plan, TINY, global_batch=16, seq_len=128)
    everything = main(["plan", "--cluster", "local", "--nproc", "4", "--top", "1", "--json"])
    assert everything == 0
    assert choice.prediction()["step_time_s"] == pytest.approx(choice.estimate.step_time_s)


def test_train_plan_auto_runs_the_chosen_plan_and_keeps_the_prediction(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHOAL_PROFILE", str(_profile_file(tmp_path)))
    run = tmp_path / "run"
    assert main(["train", "--plan", "auto", "--nproc", "2", "--device", "cpu", "--steps", "3", "--log-every", "1",
                 "--eval-every", "0", "--eval-batches", "1", "--global-batch", "8", "--seq-len", "32",
                 "--set", "num_layers=2", "--out", str(run)]) == 0
    out = capsys.readouterr().out
    assert "plan auto: " in out  # printed by the launcher; the workers print the summary
    summary = json.loads((run / "summary.json").read_text())
    assert summary["predicted"]["step_time_s"] > 0 and summary["measured_over_predicted_step_time"] > 0
    chosen = rules.resolve(Plan.parse(summary["predicted"]["plan"]), world_size=2, device="cpu")
    assert str(chosen) == summary["plan"]


@pytest.mark.parametrize(("name", "spec"), [
    ("NVIDIA H100 80GB HBM3", "H100-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("Tesla V100-SXM2-16GB", "V100-32GB"), ("NVIDIA H200", "H200"),
])
def test_auto_knows_the_gpus_torch_names(name, spec):
    from shoal.calibration.auto_plan import gpu_cluster

    cluster = gpu_cluster(name, 16 * 2**30, world_size=16, per_node=8)
    assert cluster.device.name == spec and cluster.num_nodes == 2 and cluster.per_node == 8
    assert cluster.device.memory_bytes == 16 * 2**30  # what the device reports, not the spec's


def test_auto_refuses_an_unknown_gpu_in_one_line():
    from shoal.calibration.auto_plan import gpu_cluster

    with pytest.raises(ValueError, match="no spec for GPU 'Radeon'.*valid: .*H100-80GB"):
        gpu_cluster("Radeon", 2**30, world_size=1, per_node=1)


def test_every_published_run_is_a_plan_shoal_accepts():
    """The held-out published runs (bench/planner_at_scale.py) stay priceable: each names a cluster
    and a plan that parse, resolve and validate against its model; the one layout shoal's runtime
    does not run (interleaved chunks beside a data axis: torchtitan's 405B, Megatron-LM 2021's 76.1B to 529.6B,
    Megatron-Bridge's DeepSeek-V3) is priced as it ran, and the rules say why."""
    from bench.published_runs import PUBLISHED
    from shoal import rules

    assert len(PUBLISHED) >= 10
    not_run = {run.plan for run in PUBLISHED if "sched=interleaved" in run.plan}
    assert len(not_run) == 6
    for run in PUBLISHED:
        cluster = parse_cluster(run.cluster)
        facts = rules.RunFacts(world_size=cluster.world_size, device="cuda", model=run.model,
                            global_batch=run.global_batch, seq_len=run.seq_len)
        plan = rules.fill(Plan.parse(run.plan), facts)
        reason = rules.refusal(plan, facts)
        assert (reason is not None) == (run.plan in not_run), (run.plan, reason)
        assert reason is None or reason.startswith("sched=interleaved runs with pp, tp and cp only")
        work = framework_models.workload(model=run.model, global_batch=run.global_batch, seq_len=run.seq_len,
                                         fused_attention=run.fused_attention, data_engine=run.data_engine)
        assert estimate(plan, work, cluster, micro_batch=run.micro_batch_size if plan.pp == 1 else None).step_time_s > 0
        assert run.tokens_per_s_per_device > 0 and run.source.startswith("http")


def test_plan_text_keeps_options_the_device_would_not_default_to():
    """An fp32, uncompiled plan on GPUs must print both options: left out, CUDA's defaults (bf16,
    compile) would fill them in."""
    e = _estimate("fsdp8,precision=fp32,compile=off")
    assert rules.resolve(Plan.parse(e.plan_text), world_size=8, device="cuda") == e.plan
    assert "precision=fp32" in e.plan_text and "compile=off" in e.plan_text
    assert _estimate("fsdp8").plan_text == "fsdp8"


def test_sequence_parallel_copies_of_dtensor_by_hand():
    """DTensor's sequence-parallel collectives re-lay out (batch, sequence, dim) around NCCL's dim-0 gather and
    scatter: each reduce-scatter's input and each all-gather's output (but one sequence a micro-batch, a view) is
    read and written whole on the compute stream; Megatron-LM's (sequence, batch, dim) copies nothing. Without
    recompute a block runs 2 all-gathers and 2 reduce-scatters forward and as many backward."""
    cluster = parse_cluster("8xH100")
    plan = rules.resolve(Plan.parse("tp8"), world_size=8, device="cuda")
    for sequences, copied in ((2, 8), (1, 4)):  # a block's copies a micro-batch: all 8, or the 4 reduce-scatters'
        dtensor, megatron = (estimate(plan, framework_models.workload(model=TINY, global_batch=16, seq_len=128,
                                                                      tp_engine=engine),
                                      cluster, micro_batch=sequences) for engine in ("dtensor", "megatron"))
        act = sequences * 128 * TINY.dim * 2.0  # bytes of one micro-batch's gathered activation
        copies = (16 // sequences) * TINY.num_layers * copied * 2 * act / 2970e9
        assert dtensor.time["tp_comm"] - megatron.time["tp_comm"] == pytest.approx(copies)


def test_skinny_products_run_at_the_pace_of_memory():
    """The roofline: an 8B Llama's K projection under tp8 over 98,304 tokens (n = 8 heads x 128 / 8 = 128) moves
    more bytes than its FLOPs take at the H100's large-GEMM rate (2 bytes an element at 2970 GB/s), so it is priced
    at the memory's pace; the square products stay at their shape factor. Three projections (torchtitan's and
    shoal's wq, wk, wv) cost more than Megatron-LM's one fused query_key_value of the same FLOPs."""
    from shoal.planner.costs import _gemm_scale, _product_time
    from shoal.planner.hardware import DEVICES

    h100 = DEVICES["H100-80GB"]
    ridge = 794.5e12 * 2 / 2970e9
    m, n, k = 98304, 128, 4096
    memory_bound = ridge * (m * k + k * n + m * n) / (2 * m * n * k)
    assert memory_bound == pytest.approx(2.16, abs=0.01)  # 248 FLOPs an element moved against a ridge of 535
    assert _product_time(h100, m, n, k, ridge=ridge) == pytest.approx(memory_bound)
    shaped = 1 / h100.gemm_factor(m, n, k)  # the square-GEMM table alone: (m n k)^(1/3) = 3,721, nearly full rate
    assert _product_time(h100, m, n, k, ridge=0.0) == pytest.approx(shaped) and shaped < 1.1
    assert _product_time(h100, m, 4096, k, ridge=ridge) == pytest.approx(1 / h100.gemm_factor(m, 4096, k))
    model = get_preset("llama3-8b")
    separate, fused = (_gemm_scale(h100, model, m, 8, moe=False, fused_qkv=f, ridge=ridge) for f in (False, True))
    assert separate > fused > 1


def test_small_gemms_and_overlapped_collectives_on_an_h100_by_hand():
    """On an H100 the TINY model's products are small: tokens M = 16 * 128 = 2048 per micro-batch, and
    each weight's (M x k) @ (k x n) runs at the square-GEMM table's rate for size (M n k)^(1/3)
    (hardware.gemm_factor). Q/K/V: n = (4 + 2 * 2) * 32 = 256, k = 128; output: n = 128, k = 128;
    SwiGLU: two of n = 384, k = 128 and one of n = 128, k = 384. The block's matmul time is theirs,
    FLOP-weighted; its data-parallel gradient traffic hidden behind backward costs 18.9% of itself
    more (OVERLAP_SLOWDOWN), on top of what stays exposed (on a model with more than one gradient bucket)."""
    from shoal.planner.costs import OVERLAP_SLOWDOWN, _gemm_scale
    from shoal.planner.hardware import DEVICES

    h100 = DEVICES["H100-80GB"]
    gemms = [(256, 128), (128, 128), (384, 128), (384, 128), (128, 384)]
    flops = sum(2 * n * k for n, k in gemms)
    slow = sum(2 * n * k / h100.gemm_factor(2048, n, k) for n, k in gemms)
    assert _gemm_scale(h100, TINY, 2048, 1, moe=False) == pytest.approx(slow / flops)
    assert slow / flops > 1  # small products: slower than the large-GEMM rate
    from shoal.planner.estimate import DDP_BUCKET_BYTES

    # The gradient traffic's overlap needs more than one of DDP's buckets: a 24-block `small` in fp32 (no
    # autocast casts, which block the stream), 19.0M parameters in 25 MB buckets.
    model = get_preset("small").replace(num_layers=24)
    e = _estimate("dp8,precision=fp32", cluster="8xH100", model=model, batch=4096)  # enough compute to hide behind
    total = e.traffic["dp_allreduce"]
    params = e.gradient_bytes / 4
    units = math.ceil(params * 4 / DDP_BUCKET_BYTES) - 1  # reductions besides the last; those hide behind backward
    assert e.engine.startswith("ddp") and units >= 1 and e.time["compute_matmul"] > total
    hidden = total * (1 - 1 / (units + 1))
    assert e.time["dp_sync_exposed"] == pytest.approx(total - hidden + OVERLAP_SLOWDOWN * hidden)
    assert OVERLAP_SLOWDOWN == 0.189


def test_overlap_exposed_by_hand():
    """Traffic of 10 s in 5 equal pieces beside compute: the last piece (2 s) always shows; the other 8 s
    hide as far as the compute lasts (all of them beside 20 s of it, 3 s beside 3 s)."""
    from shoal.planner.costs import overlap_exposed

    assert overlap_exposed(10.0, 20.0, pieces=5) == pytest.approx((2.0, 8.0))
    assert overlap_exposed(10.0, 3.0, pieces=5) == pytest.approx((7.0, 3.0))
    assert overlap_exposed(10.0, 0.0, pieces=5) == pytest.approx((10.0, 0.0))  # a CPU: nothing hides
    assert overlap_exposed(0.0, 5.0, pieces=1) == (0.0, 0.0)


def test_data_schedule_puts_each_collective_in_its_pass():
    """FSDP2 at zero=3 gathers in forward and again in backward on every micro-batch and reduces every
    micro-batch; shoal's ZeRO-1 engine gathers once, beside the first forward, and reduces the last
    micro-batch only; DDP reduces in the last backward."""
    from shoal.planner.costs import data_schedule

    z3 = data_schedule("fsdp2", 3, micro=4)
    assert z3["fsdp_all_gather"] == {"forward": 0.5, "backward": 0.5}
    assert (z3["forward_passes"], z3["backward_passes"]) == (4, 4)
    z1 = data_schedule("zero", 1, micro=4)
    assert z1["fsdp_all_gather"] == {"forward": 1.0, "backward": 0.0}
    assert z1["fsdp_reduce_scatter"] == {"backward": 1.0}
    assert (z1["forward_passes"], z1["backward_passes"]) == (1, 1)
    assert data_schedule("zero", 2, micro=4)["backward_passes"] == 4
    ddp = data_schedule("ddp", 0, micro=4)
    assert ddp["dp_allreduce"] == {"backward": 1.0} and ddp["backward_passes"] == 1


def test_unsharded_fsdp2_reduction_hides_behind_one_backward():
    """dp4 x tp2 at bf16 runs FSDP2 over a replicated mesh (rules.choose_engine: DDP takes no tensor-parallel
    model); its all-reduce, counted once a step, hides behind the last micro-batch's backward only, however many
    micro-batches the step has."""
    from shoal.planner.costs import OVERLAP_SLOWDOWN, overlap_exposed
    from shoal.rules import choose_engine

    plan = rules.resolve(Plan.parse("dp4,tp2"), world_size=8, device="cuda")
    engine = choose_engine(plan, num_layers=TINY.num_layers)
    assert (engine.kind, plan.fsdp) == ("fsdp2", 1)
    e = _estimate("dp4,tp2", cluster="8xH100", batch=32, micro_batch=2)  # 4 micro-batches of 2 sequences
    total = e.traffic["dp_allreduce"]
    # attention's forward: its table's rates at TINY's head dim 16 and length 128 are held at head dim 64 and
    # length 512 (kernels.FA2_H100): 180 TFLOP/s forward (causal), 198 backward, for 2.5 forwards' FLOPs
    attention_forward = e.time["compute_attention"] / (1 + 2.5 * 180 / 198)
    fwd = (e.time["compute_matmul"] / 3 + attention_forward + e.time["compute_elementwise"] / 3) / 4
    bwd = sum(e.time[k] for k in ("compute_matmul", "compute_attention", "compute_elementwise", "recompute",
                                  "tp_comm", "cp_comm_exposed", "ep_comm", "pp_p2p", "host_overhead")) / 4 - fwd
    shown, hidden = overlap_exposed(total, bwd, pieces=engine.units + 1)
    assert e.time["dp_sync_exposed"] == pytest.approx(shown + OVERLAP_SLOWDOWN * hidden, rel=1e-6)


def test_gathers_hide_only_behind_forward_by_hand():
    """FSDP2 zero=3 on 8 H100s: the step's exposed data traffic is, pass by pass, the overlap of what that
    pass issues with that pass's compute (half the gathers in forward; the other half and the
    reduce-scatters in backward), the hidden part charged OVERLAP_SLOWDOWN more, plus FSDP2's copies around
    them, which the compute stream waits for."""
    from shoal.planner.costs import OVERLAP_SLOWDOWN, overlap_exposed
    from shoal.rules import choose_engine

    e = _estimate("fsdp8", cluster="8xH100", batch=64)
    plan = rules.resolve(Plan.parse("fsdp8"), world_size=8, device="cuda")
    engine = choose_engine(plan, num_layers=TINY.num_layers)
    assert (engine.kind, engine.zero) == ("fsdp2", 3)
    gathers, reduces = e.traffic["fsdp_all_gather"], e.traffic["fsdp_reduce_scatter"]
    pieces = engine.units + 1
    micro = 1
    steady = sum(v for k, v in e.time.items() if k not in ("pp_bubble", "dp_sync_exposed", "optimizer",
                                                                 "engine_overhead", "step_sync"))
    fwd = e.time["compute_matmul"] / 3 + e.time["compute_attention"] / 3.5 + e.time["compute_elementwise"] / 3
    bwd = steady / micro - fwd
    f_shown, f_hid = overlap_exposed(gathers / 2, micro * fwd, pieces=pieces)
    b_shown, b_hid = overlap_exposed(gathers / 2 + reduces, micro * bwd, pieces=pieces)
    want = f_shown + b_shown + OVERLAP_SLOWDOWN * (f_hid + b_hid) + e.traffic["fsdp_copies"]
    assert e.time["dp_sync_exposed"] == pytest.approx(want, rel=1e-6)


def test_fsdp2_copies_by_hand():
    """FSDP2 copies each gathered buffer into the parameters (read and written in bf16) and each unsharded gradient
    into the reduce-scatter input (read in bf16, written in the fp32 reduce dtype). TINY on 8 H100s at fsdp8 (zero=3,
    one micro-batch): 4 blocks of 49,152 attention, 147,456 FFN and 256 norm weights, and an untied 256 x 128
    embedding and head: 852,992 parameters, gathered twice and reduced once, at the HBM3 Triad's 2.97 TB/s."""
    from shoal.planner.costs import fsdp2_copy_bytes

    params = 4 * (49_152 + 147_456 + 256) + 2 * 256 * 128
    assert fsdp2_copy_bytes(params, param_bytes=2, grad_bytes=2, reduce_bytes=4, gathers=2, reduces=1) == (
        params * (2 * 2 * 2 + 2 + 4))
    e = _estimate("fsdp8", cluster="8xH100", batch=64)
    assert e.traffic["fsdp_copies"] == pytest.approx(params * 14 / 2970e9, rel=1e-9)
    assert "fsdp_copies" not in _estimate("dp8", cluster="8xH100", batch=64).traffic  # DDP copies nothing


def test_compiled_elementwise_by_hand():
    """A compiled block's elements moved per token, TINY (D 128, q 8 x 16 = 128, k and v 4 x 16 = 64, F 384):
    norms 2 x (read, write) D; residual adds 2 x (read 2, write 1) D; RoPE and the projections' outputs read
    and written 2 x (q + 2 kv); attention reads them (q + 2 kv) and writes D; SwiGLU reads 2 F, writes F; the
    grouped heads' K and V repeated to every query head (a copy SDPA cannot fuse): written and read again at
    q's width, 4 (q - kv). Multi-head attention (kv = q) repeats nothing."""
    kw = dict(seq_len=128, causal_skip=True, fused_attention=True, compiled=True)
    base = 2 * 2 * 128 + 2 * 3 * 128 + 3 * (128 + 2 * 64) + 128 + 3 * 384
    assert compute.block_work(TINY, 0, **kw).elementwise == base + 4 * (128 - 64)
    mha = TINY.replace(num_kv_heads=8)
    assert compute.block_work(mha, 0, **kw).elementwise == 2 * 2 * 128 + 2 * 3 * 128 + 3 * 384 + 128 + 3 * 384


def test_dropout_elements_by_hand():
    """TINY (D 128, 8 heads) at seq 64 with dropout 0.1, per token and block, in 16-bit elements (a one-byte mask
    is half of one). Hidden state, twice a block: eager, nn.Dropout reads and writes D and writes its mask, 2.5 D;
    fused into the residual add (compiled), the mask alone, 0.5 D; backward reads the gradient and the mask and
    writes the gradient either way, 2.5 D. Unfused attention's torch.nn.Dropout on the probabilities: 2.5 passes
    over the 8 x 64 scores forward and again backward. A fused kernel draws its dropout inside: nothing more. No
    dropout, no work. In fp32 elements the mask is a quarter of one."""
    cfg = TINY.replace(dropout=0.1)
    Work = compute.DropoutWork
    assert compute.dropout_elements(cfg, 64, fused_attention=True, compiled=False) == Work(640, 640, 0)
    assert compute.dropout_elements(cfg, 64, fused_attention=True, compiled=True) == Work(128, 640, 0)
    assert compute.dropout_elements(cfg, 64, fused_attention=False, compiled=True) == Work(128, 640, 2.5 * 8 * 64)
    assert compute.dropout_elements(cfg, 64, fused_attention=False, compiled=False,
                                    element_bytes=4.0) == Work(2 * 2.25 * 128, 2 * 2.25 * 128, 2.25 * 8 * 64)
    assert compute.dropout_elements(TINY, 64, fused_attention=False, compiled=True) == Work(0, 0, 0)
    kw = dict(seq_len=64, causal_skip=False, fused_attention=False, compiled=True)
    work, plain = compute.block_work(cfg, 0, **kw), compute.block_work(TINY, 0, **kw)
    assert work.elementwise == plain.elementwise  # the dropouts are counted apart: their backward is their forward's
    assert (work.dropout, work.dropout_backward) == (128 + 2.5 * 8 * 64, 640 + 2.5 * 8 * 64)
    assert (work.scores, plain.scores) == (4 * 8 * 64 + 2.5 * 8 * 64, 4 * 8 * 64)
    # the hidden state's: two norms (read, write) and two residual adds (read 2, write 1), and the dropouts' masks
    assert (work.hidden, work.hidden_backward) == (10 * 128 + 128, 20 * 128 + 640)
    # Megatron-LM's selective recompute reruns the scores' elementwise work with QK^T and AV
    assert framework_models.policy("megatron").rerun(matmul=0.0, attention=3.0, elementwise=2.0,
                                                     fused_attention=False, scores=1.5) == 4.5


def _unfused_step(cfg: ModelConfig, plan: str, cluster: str, **work: object) -> dict[str, float]:
    resolved = rules.resolve(Plan.parse(plan), world_size=parse_cluster(cluster).world_size, device="cuda")
    return estimate(resolved, framework_models.workload(model=cfg, global_batch=16, seq_len=128, fused_attention=False,
                                                        **work), parse_cluster(cluster)).time


def test_dropout_in_the_estimate():
    """The step's elementwise time grows by the dropouts' forward and backward bytes (not backward twice the
    forward, as the block's other elementwise work), at the device's memory bandwidth; full recompute reruns the
    forward's. TINY at 16 x 128 tokens, fp16 on one A100 (unfused attention, as Megatron-LM ran it)."""
    cluster = parse_cluster("1xA100-80GB")
    with_dropout = _unfused_step(TINY.replace(dropout=0.1), "ac=full,precision=fp16", "1xA100-80GB")
    without = _unfused_step(TINY, "ac=full,precision=fp16", "1xA100-80GB")
    drop = compute.dropout_elements(TINY.replace(dropout=0.1), 128, fused_attention=False, compiled=True)
    element = 16 * 128 * 2 / cluster.device.memory_bw * TINY.num_layers
    forward, backward = drop.hidden + drop.scores, drop.hidden_backward + drop.scores
    assert with_dropout["compute_elementwise"] - without["compute_elementwise"] == pytest.approx(
        (forward + backward) * element, rel=1e-9)
    assert with_dropout["recompute"] - without["recompute"] == pytest.approx(forward * element, rel=1e-9)
    # Megatron-LM's selective recompute reruns the scores' elementwise work, their dropout's too, not the rest
    kw = dict(selective_policy="megatron")
    selective = _unfused_step(TINY.replace(dropout=0.1), "ac=selective,precision=fp16", "1xA100-80GB", **kw)
    plain = _unfused_step(TINY, "ac=selective,precision=fp16", "1xA100-80GB", **kw)
    assert selective["recompute"] - plain["recompute"] == pytest.approx(drop.scores * element, rel=1e-9)


def test_tensor_parallelism_without_sp_runs_the_hidden_state_whole():
    """Without sequence parallelism every tensor-parallel rank runs the norms, the residual adds and their
    dropouts on the whole hidden state (Korthikanti et al. 2022, section 4.2.2); with it, each its sequence's
    share. So at tp2 sp=off the elementwise time exceeds sp=on's by the hidden state's other half."""
    cfg = TINY.replace(dropout=0.1)
    on, off = (_unfused_step(cfg, f"tp2,ac=full,precision=fp16{sp}", "2xA100-80GB") for sp in ("", ",sp=off"))
    work = compute.block_work(cfg, 0, seq_len=128, causal_skip=False, fused_attention=False, compiled=True)
    element = 16 * 128 * 2 / parse_cluster("2xA100-80GB").device.memory_bw * TINY.num_layers / 2
    assert off["compute_elementwise"] - on["compute_elementwise"] == pytest.approx(
        (work.hidden + work.hidden_backward) * element, rel=1e-9)


def test_scattered_pipeline_sends_a_share_and_gathers_it():
    """Megatron-LM's scatter/gather optimization (and DeepSpeed's partitioned pipeline): under tp without sp each
    rank sends the next stage 1/tp of the activation, gathered over the tensor-parallel group on arrival. Priced
    per micro-batch and direction as a send of act/tp between nodes plus an all-gather of act inside one."""
    cluster = parse_cluster("16xA100-80GB")
    plan = rules.resolve(Plan.parse("tp8,pp2,mb=4,sp=off,precision=fp16"), world_size=16, device="cuda")

    def step(scatter: bool) -> dict[str, float]:
        work = Workload(model=TINY, global_batch=4, seq_len=128, framework=Framework(pipe_scatter=scatter))
        return estimate(plan, work, cluster, micro_batch=1).time

    net, act = RingNetwork(cluster), 128 * TINY.dim * 2.0  # one sequence a micro-batch, fp16
    whole = net.time("send_recv", 2, act, stride=8)
    scattered = net.time("send_recv", 2, act / 8, stride=8) + net.time("all_gather", 8, act, stride=1)
    assert step(False)["pp_p2p"] == pytest.approx(4 * 2 * whole, rel=1e-9)
    assert step(True)["pp_p2p"] == pytest.approx(4 * 2 * scattered, rel=1e-9)
    big = 4 * 2048 * 8192 * 2.0  # a 39B-sized micro-batch: eight NICs carry an eighth each, NVLink gathers it
    assert (net.time("send_recv", 2, big / 8, stride=8) + net.time("all_gather", 8, big, stride=1)
            < 0.3 * net.time("send_recv", 2, big, stride=8))
    assert scattered > whole  # a small one: the gather's seven steps cost more than the bytes saved
    # nothing to scatter where sequence parallelism sends a shard already, or without tensor parallelism
    for text, world in (("tp8,pp2,mb=4,precision=fp16", 16), ("pp2,mb=4,precision=fp16", 2)):
        other, where = rules.resolve(Plan.parse(text), world_size=world,
                                     device="cuda"), parse_cluster(f"{world}xA100-80GB")
        sends = [estimate(other, Workload(model=TINY, global_batch=4, seq_len=128,
                                          framework=Framework(pipe_scatter=scatter)), where,
                          micro_batch=1).time["pp_p2p"] for scatter in (False, True)]
        assert sends[0] == sends[1] > 0


def test_torchtitan_selective_policy_by_hand():
    """torchtitan's per-op policy keeps every second weight product's output, counted in call order per block
    (wq wk wv wo w1 w3 w2): wk, wo and w3 are rerun; wq, wv, w1, w2, the attention kernel's output and log-sum-exp
    and the block's input are kept. TINY: D 128, 8 heads of 16, 4 KV heads (64 wide), F 384."""
    assert [name for name, *_ in compute.block_matmuls(TINY)] == ["wq", "wk", "wv", "wo", "w1", "w3", "w2"]
    titan_recomputed_matmul = framework_models.titan_recomputed_matmul
    assert titan_recomputed_matmul(TINY, moe=False) == 2 * 128 * 64 + 2 * 128 * 128 + 2 * 128 * 384
    assert titan_recomputed_matmul(TINY, moe=True) == 2 * 128 * 64 + 2 * 128 * 128  # attention only
    llama8b = get_preset("llama3-8b")  # wk 4096 x 1024, wo 4096 x 4096, w3 4096 x 14336 of 218.1M weights
    share = titan_recomputed_matmul(llama8b, moe=False) / compute.block_work(
        llama8b, 0, seq_len=1, causal_skip=True, fused_attention=True).matmul
    assert share == pytest.approx((4096 * 1024 + 4096 * 4096 + 4096 * 14336) / 218_103_808)
    kw = dict(seq_len=128, fused_attention=True, ac="selective", policy=framework_models.policy("torchtitan-op"))
    # input 128 + wq 128 + wv 64 + w1 384 + w2 128 + attention output 128 and 8 log-sum-exps
    assert memory.activation_elements(TINY, 0, tp=1, sp=False, **kw) == 128 + 128 + 64 + 384 + 128 + 136
    # tp2 with sequence parallelism: w2's partial sum stays whole; two reduce-scatter outputs of D/2
    assert memory.activation_elements(TINY, 0, tp=2, sp=True, **kw) == 64 + (128 + 64 + 384) / 2 + 128 + 68 + 128
    assert compute.recomputed("selective", matmul=5.0, attention=3.0, elementwise=2.0, fused_attention=True,
                              selective_matmul=1.5) == 3.5
    with pytest.raises(ValueError, match="valid: shoal, torchtitan-op"):
        framework_models.workload(model=TINY, global_batch=4, seq_len=128, selective_policy="every-other")


def test_torchtitan_selective_policy_in_the_estimate():
    """The estimate reruns the policy's share of the blocks' weight products (not the head's) and holds less."""
    model, cluster = get_preset("llama3-8b"), parse_cluster("8xH100")
    plan = rules.resolve(Plan.parse("fsdp8,ac=selective,precision=bf16"), world_size=8, device="cuda")
    shoal_way, titan = (estimate(plan, framework_models.workload(model=model, global_batch=16, seq_len=8192,
                                                                 selective_policy=policy),
                                 cluster) for policy in ("shoal", "torchtitan-op"))
    share = framework_models.titan_recomputed_matmul(model, moe=False) / compute.block_work(
        model, 0, seq_len=1, causal_skip=True, fused_attention=True).matmul
    tokens, device = 2 * 8192, cluster.device  # one micro-batch of 2 sequences on each rank
    head_mm = (_training_gemm_time(device, tokens, model.vocab_size, model.dim) * compute.head_flops(model) * tokens
               / device.flops("bf16"))
    blocks_mm = shoal_way.time["compute_matmul"] / 3 - head_mm
    assert titan.time["recompute"] - shoal_way.time["recompute"] == pytest.approx(share * blocks_mm, rel=1e-6)
    # it keeps every second weight product's output where shoal's policy keeps each: 31,776 elements a token and
    # block against 51,232 (framework_models.titan_selective_elements, memory.shoal_selective_elements)
    assert titan.memory["activations"] < 0.7 * shoal_way.memory["activations"]


def test_full_recompute_holds_the_rerun_blocks_scores_again():
    """Under full recompute the block being rerun in backward holds all of its tensors again, unfused attention's
    probabilities too: H x T a token (and the dropouts' masks, a byte an element, at dropout > 0), for one block
    of the micro-batch's tokens; the kept block inputs do not change."""
    model, cluster = get_preset("gpt3-1.3b").replace(dropout=0.0), parse_cluster("8xA100")
    plan = rules.resolve(Plan.parse("dp8,ac=full,precision=bf16"), world_size=8, device="cuda")
    held = {fused: estimate(plan, Workload(model=model, global_batch=8, seq_len=1024,
                                           framework=Framework(fused_attention=fused)),
                            cluster, micro_batch=1).memory["activations"] for fused in (True, False)}
    tokens = 1024  # one sequence a micro-batch on each rank
    assert held[False] - held[True] == pytest.approx(model.num_heads * 1024 * tokens * 2)
    dropped = estimate(plan, Workload(model=model.replace(dropout=0.1), global_batch=8, seq_len=1024,
                                      framework=Framework(fused_attention=False)), cluster,
                       micro_batch=1).memory["activations"]
    # the rerun block's masks (two on the hidden state, one on the scores) and the dropped probabilities; the
    # embedding's mask
    rerun = (model.dim + 1.5 * model.num_heads * 1024) * tokens * 2
    assert dropped - held[False] == pytest.approx(rerun + model.dim / 2 * tokens * 2)


def test_megatron_selective_policy_reruns_and_drops_the_attention_core_alone():
    """Korthikanti et al. 2022 (section 5): Megatron-LM's selective recompute keeps all but the attention core
    (the scores and probabilities unfused attention stores), which backward reruns."""
    megatron = framework_models.policy("megatron")
    assert megatron.rerun(matmul=0.0, attention=3.0, elementwise=2.0, fused_attention=False, scores=0.0) == 3.0
    assert megatron.rerun(matmul=0.0, attention=3.0, elementwise=2.0, fused_attention=True, scores=0.0) == 0.0
    unfused = dict(seq_len=128, fused_attention=False, tp=1, sp=False)
    none = memory.activation_elements(TINY, 0, ac="none", **unfused)
    assert memory.activation_elements(TINY, 0, ac="selective", policy=megatron, **unfused) == none - 8 * 128
    assert memory.activation_elements(TINY, 0, ac="selective", **unfused) < none - 8 * 128  # shoal keeps less


def test_selective_recompute_reruns_what_shoals_policy_does_not_keep():
    """shoal.parallel.recompute keeps matmul and fused-attention outputs and tensor-parallel reductions:
    backward reruns the elementwise ops (and unfused attention's score products), and under sequence
    parallelism the block's two all-gathers (their outputs are not kept)."""
    from shoal.planner.compute import recomputed

    assert recomputed("none", matmul=5.0, attention=3.0, elementwise=2.0, fused_attention=True) == 0.0
    assert recomputed("full", matmul=5.0, attention=3.0, elementwise=2.0, fused_attention=True) == 10.0
    assert recomputed("selective", matmul=5.0, attention=3.0, elementwise=2.0, fused_attention=True) == 2.0
    assert recomputed("selective", matmul=5.0, attention=3.0, elementwise=2.0, fused_attention=False) == 5.0
    sel, none = _estimate("tp8,ac=selective", cluster="8xH100"), _estimate("tp8", cluster="8xH100")
    per_block_elem = (none.time["compute_elementwise"] / 3 - 4 * 16 * 128 * 256 * 4 / 8 / 2970e9)
    assert sel.time["recompute"] == pytest.approx(per_block_elem)  # the blocks' elementwise work, not the head's
    net = RingNetwork(parse_cluster("8xH100"))
    act = 16 * 128 * TINY.dim * 2.0  # one micro-batch's activation, gathered
    gather = net.time("all_gather", 8, act, stride=1) + 2 * act / 2970e9  # and DTensor's copy after it
    assert sel.time["tp_comm"] - none.time["tp_comm"] == pytest.approx(TINY.num_layers * 2 * gather)


def _deepspeed_train_schedule_makespan(p: int, m: int, fwd: Fraction, bwd: Fraction) -> Fraction:
    """The time DeepSpeed's TrainSchedule (deepspeed/runtime/pipe/schedule.py) takes for m micro-batches on p stages
    of equal cost. Every stage runs 2(m + p - 1) steps; step n of stage s is the forward of micro-batch (n - s)/2
    when n - s is even, else the backward of micro-batch (n + s + 1)/2 - p (no work where that micro-batch does not
    exist). A step begins with its exchanges: a forward step with stage s - 1 (the previous micro-batch's gradient
    sent, this one's activation received), a backward step with stage s + 1. DeepSpeed's p2p sends and receives
    block (dist.send / dist.recv), so both sides of an exchange begin the step when the later of them has ended its
    previous step."""
    def work(s: int, n: int) -> tuple[int, bool]:
        return ((n - s) // 2, True) if (n - s) % 2 == 0 else ((n + s + 1) // 2 - p, False)

    ends = [Fraction(0)] * p
    for n in range(2 * (m + p - 1)):
        starts = []
        for s in range(p):
            micro, forward = work(s, n)
            previous = work(s, n - 1)[0] if n else -1
            partner = s - 1 if forward else s + 1
            exchanges = 0 <= partner < p and (0 <= micro < m or 0 <= previous < m)
            starts.append(max(ends[s], ends[partner]) if exchanges else ends[s])
        ends = [start + ((fwd if work(s, n)[1] else bwd) if 0 <= work(s, n)[0] < m else 0)
                for s, start in enumerate(starts)]
    return max(ends)


@pytest.mark.parametrize("p, m", [(2, 1), (4, 8), (8, 3), (12, 128), (35, 160)])
@pytest.mark.parametrize("fwd, bwd", [(1, 2), (1, 3), (2, 1)])
def test_deepspeeds_pipeline_schedule_takes_what_1f1b_takes(p, m, fwd, bwd):
    """The estimate prices a DeepSpeed pipeline-engine run (BLOOM, MT-NLG: p = 12 and 35) with 1F1B's bubble. Its
    TrainSchedule alternates forward and backward steps with blocking exchanges between neighbours, which might
    seem to hold every step to the longer of F and B; but each stage exchanges with one neighbour a step, so the
    stages settle out of phase and the whole batch takes 1F1B's (m + p - 1)(F + B), exactly, here with full
    recompute's B = 3F as well as B = 2F and B < F."""
    fwd_, bwd_ = Fraction(fwd), Fraction(bwd)
    makespan = _deepspeed_train_schedule_makespan(p, m, fwd_, bwd_)
    assert makespan == (m + p - 1) * (fwd_ + bwd_)
    assert makespan - m * (fwd_ + bwd_) == _bubble(Plan(pp=p, mb=m, sched="1f1b", vpp=1), fwd, bwd)


def test_a_deepspeed_pipeline_run_reduces_and_gathers_once_a_step_beside_no_compute():
    """DeepSpeed's TrainSchedule reduces gradients, and at ZeRO-1 gathers the updated weights, once a step after the
    last backward (framework_models.deepspeed_engine): shoal's FSDP2 runs fsdp2,zero=1 under tp by gathering every
    micro-batch, DeepSpeed once; and none of it hides. On 2 nodes of 8 A100s, tp2 x pp2 x fsdp4 with 8 micro-batches:
    an eighth of FSDP2's gather traffic, the same one reduce-scatter (zero=1), all of it exposed."""
    from bench.framework_models import deepspeed_engine
    from shoal.rules import choose_engine

    c = parse_cluster("16xA100-80GB")
    plan = rules.resolve(Plan.parse("fsdp4,zero=1,tp2,pp2,mb=8"), world_size=16, device="cuda")
    shoal_engine = choose_engine(plan, num_layers=TINY.num_layers)
    assert shoal_engine.kind == "fsdp2"
    engine = deepspeed_engine(plan, shoal_engine)
    assert (engine.kind, engine.zero, engine.units) == ("zero", 1, shoal_engine.units)
    replicated = rules.resolve(Plan.parse("tp2,pp2,mb=8"), world_size=16, device="cuda")
    assert deepspeed_engine(replicated, choose_engine(replicated, num_layers=4)) == choose_engine(replicated,
                                                                                                  num_layers=4)
    with pytest.raises(ValueError, match="ZeRO-1 at most"):
        deepspeed_engine(rules.resolve(Plan.parse("fsdp4,zero=2,tp2,pp2"), world_size=16, device="cuda"), shoal_engine)
    with pytest.raises(ValueError, match="data_engine"):
        framework_models.workload(model=TINY, global_batch=16, seq_len=128, data_engine="megatron")
    ds = estimate(plan, framework_models.workload(model=TINY, global_batch=64, seq_len=128,
                                                  data_engine="deepspeed-pipe"), c)
    shoal = estimate(plan, Workload(model=TINY, global_batch=64, seq_len=128), c)
    assert shoal.traffic["fsdp_all_gather"] == pytest.approx(8 * ds.traffic["fsdp_all_gather"])  # 8 micro-batches
    assert ds.traffic["fsdp_reduce_scatter"] == pytest.approx(shoal.traffic["fsdp_reduce_scatter"])  # zero=1: once
    assert ds.time["dp_sync_exposed"] == pytest.approx(sum(ds.traffic.values()))  # nothing hides


def test_deepspeed_bf16_optimizer_accumulates_in_fp32_and_all_reduces():
    """DeepSpeed's BF16_Optimizer under its pipeline engine (BLOOM's): every micro-batch adds each bf16 gradient
    into an fp32 buffer (cast: read 2, write 4; add: read 4 + 4, write 4 bytes a parameter), on the compute stream;
    at the step's end the buffer is all-reduced whole over the data ranks where ZeRO-1 reduce-scatters it (in the
    plan's reduce dtype), copied around it (flatten, cast, scale, copy back, unflatten: 32 bytes a parameter); the
    bf16 weights are gathered as before. All of it exposed. The buffer is memory too: 4 bytes a parameter."""
    from bench.framework_models import BF16_REDUCE_COPY_BYTES, FP32_ACCUMULATION_BYTES
    from shoal.planner.costs import Costs

    c = parse_cluster("16xA100-80GB")
    plan = rules.resolve(Plan.parse("fsdp4,zero=1,tp2,pp2,mb=8,precision=bf16"), world_size=16, device="cuda")
    pipe, bf16 = (estimate(plan, framework_models.workload(model=TINY, global_batch=64, seq_len=128,
                                                           data_engine=engine), c)
                  for engine in ("deepspeed-pipe", "deepspeed-bf16"))
    assert (FP32_ACCUMULATION_BYTES, BF16_REDUCE_COPY_BYTES) == (18, 32)
    grads = pipe.traffic["fsdp_reduce_scatter"]  # fp32 gradients, one reduce-scatter a step
    assert bf16.traffic["fsdp_reduce_scatter"] > 1.9 * grads  # all-reduced: both halves of the ring
    assert bf16.traffic["fsdp_all_gather"] == pytest.approx(pipe.traffic["fsdp_all_gather"])
    # the busier stage's parameters (TINY split in two: blocks 0-1 with the embedding, 2-3 with the norm and head)
    cost = Costs(plan, TINY, c, RingNetwork(c), tokens=128, seq_len=128, fused=True)
    params = max(cost.params_per_rank(2, head=False, embedding=True), cost.params_per_rank(2, head=True), key=sum)
    assert bf16.traffic["fp32_accumulation"] == pytest.approx((8 * 18 + 32) * sum(params) / c.device.memory_bw,
                                                              rel=1e-9)  # and the step's copies around the reduce
    assert "fp32_accumulation" not in pipe.traffic
    assert bf16.time["dp_sync_exposed"] == pytest.approx(sum(bf16.traffic.values()))  # nothing hides
    # its fp32 buffer holds the rank's whole gradients, unsharded, beside the bf16 ones, the whole step
    assert bf16.memory["fp32_gradients"] == pytest.approx(4 * sum(params))
    assert pipe.memory["fp32_gradients"] == 0
    assert {k: v for k, v in bf16.memory.items() if k != "fp32_gradients"} == pytest.approx(
        {k: v for k, v in pipe.memory.items() if k != "fp32_gradients"})


def test_megatron_local_ddp_all_reduces_once_after_the_last_backward():
    """Megatron-LM's own DDP of 2021 (`--DDP-impl local`, the SC21 Table 1 runs from 39.1B) all-reduces the gradients
    once, after forward_backward_func returns: the same traffic as torch's DDP, which overlaps it with the last
    backward, but all of it exposed. It replicates every state, so a sharded plan is refused."""
    c = parse_cluster("32xA100-80GB")
    plan = rules.resolve(Plan.parse("tp8,pp2,mb=8,sched=1f1b"), world_size=32, device="cuda")
    local, torch_ddp = (estimate(plan, framework_models.workload(model=TINY, global_batch=64, seq_len=128,
                                                                 data_engine=engine), c)
                        for engine in ("megatron-local", "shoal"))
    assert local.traffic == pytest.approx(torch_ddp.traffic) and local.traffic["dp_allreduce"] > 0
    assert local.time["dp_sync_exposed"] == pytest.approx(local.traffic["dp_allreduce"])
    assert torch_ddp.time["dp_sync_exposed"] < local.time["dp_sync_exposed"]
    with pytest.raises(ValueError, match="fsdp=2"):
        estimate(rules.resolve(Plan.parse("fsdp2,tp8,pp2,mb=8"), world_size=32, device="cuda"),
                 framework_models.workload(model=TINY, global_batch=64, seq_len=128, data_engine="megatron-local"), c)


def test_accumulation_under_fsdp2_adds_unsharded_gradients_only_where_the_sync_is_off():
    """shoal's FSDP2 at ZeRO-3 reduce-scatters every micro-batch, so accumulating holds nothing more than one
    micro-batch does (its dry run: tests/test_dry_run.py); torch.distributed.pipelining turns the sync off
    between micro-batches, and each rank's unsharded fp32 gradients (4 bytes a parameter) accumulate."""
    from shoal.planner.costs import GradientReduction

    cluster = parse_cluster("8xA100-80GB")
    plan = rules.resolve(Plan.parse("fsdp4,pp2,mb=8"), world_size=8, device="cuda")
    ours, torchs = (estimate(plan, Workload(model=TINY, global_batch=32, seq_len=128, framework=Framework(
                                 gradients=GradientReduction(unsharded_accumulation=off))),
                             cluster) for off in (False, True))
    stage = ours.memory["parameters"] * 4 / 2  # the stage's parameters: a shard over fsdp4, 2 bytes each in bf16
    assert torchs.memory["transient"] - ours.memory["transient"] == pytest.approx(4 * stage)


def test_fp32_gemms_run_on_tf32_tensor_cores_where_the_gpu_has_them():
    """shoal train's --tf32 (on by default) runs fp32 matmuls on TF32 tensor cores: an fp32 plan's GEMMs are
    priced at the data sheet's dense TF32 rate (494.5 of the H100's 67 TFLOP/s fp32), its attention and
    elementwise work as before; --tf32 off, a CPU, and a GPU without TF32 (V100) keep the fp32 rate."""
    plan = rules.resolve(Plan.parse("dp1,precision=fp32,compile=off"), world_size=1, device="cuda")
    cfg = get_preset("small")
    on, off = (estimate(plan, Workload(model=cfg, global_batch=8, seq_len=256, tf32=t), parse_cluster("1xH100"))
               for t in (True, False))
    assert off.time["compute_matmul"] / on.time["compute_matmul"] == pytest.approx(494.5 / 67)
    assert on.time["compute_attention"] == off.time["compute_attention"]
    assert on.time["compute_elementwise"] == off.time["compute_elementwise"]
    assert on.mfu == pytest.approx(off.mfu * off.step_time_s / on.step_time_s * 67 / 494.5)  # against TF32's peak
    for cluster in ("1xV100", "1xcpu"):
        device = "cpu" if cluster == "1xcpu" else "cuda"
        p = rules.resolve(Plan.parse("dp1,precision=fp32,compile=off"), world_size=1, device=device)
        a, b = (estimate(p, Workload(model=cfg, global_batch=8, seq_len=256, tf32=t), parse_cluster(cluster))
                for t in (True, False))
        assert a.step_time_s == b.step_time_s


@pytest.mark.parametrize("argv, words", [
    (["--top", "0"], "--top 0 is not valid; valid: a count of plans >= 1"),
    (["--top", "-1"], "--top -1 is not valid"),
    (["--calibrate", "--plan", "dp2"], "--calibrate measures this machine and prices no plan; --plan would be ignored"),
    (["--calibrate", "--model", "small", "--cluster", "8xH100"],
     "--calibrate measures this machine and prices no plan; --model small, --cluster 8xH100 would be ignored"),
    (["--quick"], "--quick shortens --calibrate"),
])
def test_plan_flags_that_would_do_nothing_are_refused(capsys, argv, words):
    """Flags shoal plan would ignore (a plan with --calibrate, --quick without it) or misread (--top below 1 kept
    all but the last) are one-line errors, before any calibration runs."""
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_one_process_mixed_precision_is_priced_as_autocast():
    """One data rank in bf16 runs under torch.autocast (rules.choose_engine): fp32 parameters (the master
    weights) plus the 16-bit casts of the products' weights kept from forward to backward, fp32 gradients,
    Adam's two fp32 moments, and the casts' traffic (costs.AUTOCAST_CAST_BYTES a parameter each micro-batch)
    waited for on the compute stream; no DTensor dispatch, no collective."""
    from shoal.planner.costs import AUTOCAST_CAST_BYTES

    mixed, full = _estimate("dp1", cluster="1xH100"), _estimate("dp1,precision=fp32", cluster="1xH100")
    assert (mixed.engine, full.engine) == ("autocast", "none")
    params = full.memory["parameters"] / 4
    looked_up = 0 if TINY.tie_embeddings else TINY.vocab_size * TINY.dim  # an embedding lookup casts nothing
    assert mixed.memory["parameters"] == pytest.approx(4 * params + 2 * (params - looked_up))
    assert mixed.memory["optimizer"] == pytest.approx(8 * params) == full.memory["optimizer"]
    bandwidth = parse_cluster("1xH100").device.memory_bw
    assert mixed.traffic["autocast_casts"] == pytest.approx(params * AUTOCAST_CAST_BYTES / bandwidth)
    assert mixed.time["dp_sync_exposed"] == pytest.approx(mixed.traffic["autocast_casts"])


def test_shoal_plan_for_deepseek_v3_on_1024_h100_names_the_batch_when_none_runs(capsys):
    """At the default batch (16 sequences) no layout reaches 1024 devices: the one line says that the global
    batch is what is short, not only that nothing runs."""
    assert main(["plan", "--model", "deepseek-v3", "--cluster", "1024xH100-80GB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "at a global batch of 16 sequences" in err, err


@pytest.mark.slow
def test_shoal_plan_answers_for_deepseek_v3_on_1024_h100(capsys):
    """`shoal plan --model deepseek-v3 --cluster 1024xH100-80GB` with a pretraining batch (1024 sequences of 4096)
    ranks plans that fit, with expert parallelism."""
    model = ["plan", "--model", "deepseek-v3", "--cluster", "1024xH100-80GB"]
    assert main([*model, "--global-batch", "1024", "--seq-len", "4096", "--top", "1", "--json"]) == 0
    (best,) = json.loads(capsys.readouterr().out)
    assert best["fits"] and best["mem_per_device_gb"] < 80 and "ep" in best["plan"], best
