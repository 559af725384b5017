"""The planner's price of a Muon step (shoal.planner.costs.Costs.muon_step), recounted from what runs.

Newton-Schulz's FLOPs are counted by torch's FlopCounterMode on torch's own iteration; the matrices the planner
orthogonalises are the ones shoal's Muon builder hands to Muon, on dense, MoE (shared experts and their gate,
dense-first layers) and latent-attention models. Both are whole counts, compared exactly.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.optim._muon import DEFAULT_NS_STEPS, _zeropower_via_newtonschulz
from torch.utils.flop_counter import FlopCounterMode

from shoal import rules
from shoal.models import PRESETS, build_model
from shoal.models.config import ModelConfig
from shoal.optim.builder import build_optimizer
from shoal.optim.config import OptimConfig
from shoal.plan import Plan
from shoal.planner import compute
from shoal.planner.cluster_file import parse_cluster
from shoal.planner.estimate import Workload, estimate


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (24, 24), (1, 40)])
def test_newton_schulz_flops_as_torch_counts_them(shape):
    """compute.newton_schulz_flops against FlopCounterMode on torch.optim.Muon's iteration, tall, wide, square
    and a single row (a shared expert's gate)."""
    with FlopCounterMode(display=False) as counter:
        _zeropower_via_newtonschulz(torch.randn(*shape), (3.4445, -4.7750, 2.0315), DEFAULT_NS_STEPS, 1e-7)
    assert compute.newton_schulz_flops(*shape) == counter.get_total_flops()
    assert compute.NEWTON_SCHULZ_STEPS == DEFAULT_NS_STEPS == OptimConfig().muon_ns_steps


MODELS = {
    "dense": PRESETS["tiny"],
    "moe-shared-dense-first": PRESETS["tiny"].replace(num_layers=3, num_experts=4, top_k=2, ffn_dim=48,
                                                      num_shared_experts=2, shared_gate=True, moe_first_dense=1,
                                                      dense_ffn_dim=80),
    "latent": ModelConfig(num_layers=2, dim=64, num_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                          qk_nope_head_dim=12, v_head_dim=10),
    "latent-plain-q": ModelConfig(num_layers=2, dim=64, num_heads=4, kv_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=12, v_head_dim=10),
}


def _matrices(shape: torch.Size) -> Counter:
    """The (short side, long side) of each matrix Newton-Schulz sees in a parameter: one, or one per expert."""
    *stack, a, b = shape
    return Counter({(min(a, b), max(a, b)): int(torch.Size(stack).numel())})


@pytest.mark.parametrize("name", list(MODELS))
def test_hidden_matrices_are_the_muon_group(name):
    cfg = MODELS[name]
    optimizer = build_optimizer(build_model(cfg), OptimConfig(optimizer="muon"))
    built: Counter = Counter()
    for p in optimizer.param_groups[0]["params"]:
        built += _matrices(p.shape)
    priced: Counter = Counter()
    for index in range(cfg.num_layers):
        for rows, cols, count, _ in compute.hidden_matrices(cfg, index):
            priced[(min(rows, cols), max(rows, cols))] += count
    assert priced == built


def _muon_terms(plan: str, world: int, optimizer: str = "muon") -> dict[str, float]:
    work = Workload(model=PRESETS["small"], global_batch=16, seq_len=256, optimizer=optimizer)
    cluster = parse_cluster(f"{world}xcpu")
    resolved = rules.resolve(Plan.parse(plan), world_size=world, model=work.model, global_batch=16, seq_len=256)
    est = estimate(resolved, work, cluster)
    return {k: v for k, v in est.time.items() if k.startswith("muon_")}


def test_owners_share_the_iterations_and_exchange_the_slices():
    """Replicas (dp2) each orthogonalise every matrix and exchange nothing; fsdp2's and tp2's owners each run half
    the iterations and exchange their slices; AdamW prices no Muon term."""
    replicated, sharded, split = _muon_terms("dp2", 2), _muon_terms("fsdp2", 2), _muon_terms("tp2", 2)
    assert replicated["muon_exchange"] == 0.0 and sharded["muon_exchange"] > 0.0 and split["muon_exchange"] > 0.0
    assert sharded["muon_newton_schulz"] == pytest.approx(replicated["muon_newton_schulz"] / 2, rel=1e-12)
    assert split["muon_newton_schulz"] == pytest.approx(replicated["muon_newton_schulz"] / 2, rel=1e-12)
    assert _muon_terms("dp2", 2, "adamw") == {}
