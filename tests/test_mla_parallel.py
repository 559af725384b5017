"""Multi-head latent attention (shoal.models.mla) under every axis equals the single-process run:
logits, every gradient, one AdamW step, several steps' losses and the final parameters
(shoal.testing.parity.check_parity, whose tolerances follow from the arithmetic: each axis changes
only the order of floating-point sums, so the parallel run is as far from the float64 truth as the
single float32 process is).

Under tp the heads split (wq_b, wkv_b by columns, wo by rows) and the down-projections, their norms
and the shared rotary key run whole on every rank; the rotary key's gradient is a partial sum over
the ranks' heads (SharedKeyParallel), which a missing reduction leaves at 1/t of its value. Under cp
the keys, rotary part included, travel the ring beside values of another width, at the YaRN-corrected
softmax scale.
"""

from __future__ import annotations

import pytest

from shoal.models import ModelConfig
from shoal.testing.parity import case, check_parity, run_parallel

MLA = ModelConfig(num_layers=2, dim=64, num_heads=4, ffn_dim=96, vocab_size=128, max_seq_len=32, rope_theta=500.0,
                  kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
                  rope_type="yarn", rope_factor=4.0, rope_original_max_len=8, mscale_all_dim=0.7)
"""A tiny DeepSeek-V3-shaped attention: low-rank queries, values narrower than query/key heads, YaRN with
the softmax-scale correction."""
PLAIN_Q = MLA.replace(q_lora_rank=0, v_head_dim=20)
"""One query projection; values as wide as the query/key heads (the ring's fused kernels)."""


@pytest.mark.parametrize("world, plan, model", [
    (2, "tp2", MLA),
    (2, "tp2,sp=off", MLA),
    (2, "tp2", PLAIN_Q),
    (2, "cp2", MLA),
    (2, "cp2", PLAIN_Q),
    (2, "cp2,cp_mode=a2a", MLA),
    (2, "fsdp2", MLA),
    (2, "pp2,mb=2", MLA),
    (4, "fsdp2,tp2", MLA),
    (4, "tp2,cp2", MLA),
    (2, "dp2,ac=selective", MLA),
], ids=["tp2", "tp2-nosp", "tp2-plain-q", "cp2", "cp2-plain-q", "cp2-a2a", "fsdp2", "pp2", "fsdp2-tp2", "tp2-cp2",
        "dp2-selective"])
def test_latent_attention_matches_single_process(pools, world, plan, model):
    c = case(plan=plan, model=model, seq_len=16, num_micro=2 if plan.startswith("pp") else 1)
    check_parity(pools(world).run(run_parallel, c), c)


EQUAL_WIDTHS = MLA.replace(v_head_dim=20, rope_type="default", rope_factor=1.0, mscale_all_dim=0.0)
"""Values as wide as the query/key heads: CPU's fused kernel takes them (values of another width go to SDPA's math
path, which keeps the scores: memory.attention_kept_elements)."""


@pytest.mark.parametrize(("plan", "world"), [("dp1", 1), ("tp2", 2), ("tp2,sp=off", 2)])
def test_latent_attention_activation_count(pools, plan, world):
    """memory.activation_elements of latent attention, recounted: what autograd saves on a rank in one forward
    of a 4-block model less a 2-block one, per block and token (the latents' 3 r + 1 on every tp rank, the heads'
    tensors split). Exact: whole elements of whole tensors."""
    from shoal import rules
    from shoal.plan import Plan
    from shoal.planner import memory

    sizes = [pools(world).run(_saved_per_token, plan, layers) for layers in (2, 4)]
    resolved = rules.resolve(Plan.parse(plan), world_size=world)
    per_block = (sizes[1][0] - sizes[0][0]) / 2
    assert per_block == memory.activation_elements(EQUAL_WIDTHS, 0, seq_len=16, tp=resolved.tp,
                                                   sp=bool(resolved.sp), ac="none", fused_attention=True)


def _saved_per_token(plan: str, num_layers: int) -> float:
    from shoal.calibration.saved import saved_activation_elements
    from shoal.testing.parity import parallel_setup

    runtime, _, batches = parallel_setup(case(plan=plan, model=EQUAL_WIDTHS.replace(num_layers=num_layers),
                                              global_batch=2, seq_len=16, steps=1))
    inputs, _ = batches[0]
    (model,) = runtime.parts
    return saved_activation_elements(model, inputs) / inputs.numel()


@pytest.mark.parametrize(("plan", "world"), [("dp1", 1), ("tp2", 2), ("tp2,sp=off", 2)])
def test_latent_attention_selective_recompute_count(pools, plan, world):
    """memory.activation_elements of latent attention under ac=selective (the weight products', the attention
    kernel's and the reductions' outputs kept), recounted as the storages a forward leaves alive, 4 blocks less
    2, per block and token (recompute.kept_activation_bytes). Exact: whole elements of whole float32 tensors."""
    from shoal import rules
    from shoal.plan import Plan
    from shoal.planner import memory

    sizes = [pools(world).run(_kept_per_token, f"{plan},ac=selective", layers) for layers in (2, 4)]
    resolved = rules.resolve(Plan.parse(f"{plan},ac=selective"), world_size=world)
    assert (sizes[1][0] - sizes[0][0]) / 2 == memory.activation_elements(
        EQUAL_WIDTHS, 0, seq_len=16, tp=resolved.tp, sp=bool(resolved.sp), ac="selective", fused_attention=True,
        on_cpu=True, element_bytes=4)


def _kept_per_token(plan: str, num_layers: int) -> float:
    from shoal.parallel.recompute import kept_activation_bytes
    from shoal.testing.parity import parallel_setup

    runtime, _, batches = parallel_setup(case(plan=plan, model=EQUAL_WIDTHS.replace(num_layers=num_layers),
                                              global_batch=2, seq_len=16, steps=1))
    inputs, _ = batches[0]
    (part,) = runtime.parts
    kept, out = kept_activation_bytes(lambda: part(inputs))  # the output held: the graph lives as long as it
    del out
    return kept / 4 / inputs.numel()  # float32 elements
