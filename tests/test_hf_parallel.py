"""The Hugging Face families' features under shoal's parallel axes: each equals the single-process
run (check_parity's tolerances, shoal/testing.py), and an axis a feature cannot take is refused in
one line. The single process itself equals transformers' model (tests/test_hf_families.py), so
these close the chain family -> one process -> plan.

The configs are what shoal.from_hf makes of each family's tiny config (tests/test_hf.py checks
that mapping); the rotary theta is small so that the scalings change many angles.
"""

from __future__ import annotations

import pytest

from shoal import rules
from shoal.models import ModelConfig
from shoal.plan import Plan
from shoal.testing import case, check_parity, run_parallel

BASE = ModelConfig(num_layers=2, dim=64, num_heads=4, num_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=32,
                   rope_theta=500.0)
FAMILIES = {
    "llama3": BASE.replace(rope_type="llama3", rope_factor=8.0, rope_original_max_len=8),
    "yarn": BASE.replace(rope_type="yarn", rope_factor=4.0, rope_original_max_len=8),
    "mistral": BASE.replace(sliding_window=4),  # sequences of 16: four windows
    "qwen2": BASE.replace(qkv_bias=True, tie_embeddings=True),
    "qwen3": BASE.replace(qk_norm=True, head_size=32),
    "mixtral": BASE.replace(num_experts=4, top_k=2, capacity_factor=0.0, aux_loss_coef=0.0, z_loss_coef=0.0),
    "qwen2_moe": BASE.replace(num_experts=4, top_k=2, capacity_factor=0.0, aux_loss_coef=0.0, z_loss_coef=0.0,
                              ffn_dim=32, qkv_bias=True, norm_topk=False, num_shared_experts=1, shared_ffn_dim=48,
                              shared_gate=True),
}


@pytest.mark.parametrize("family, plan", [
    ("qwen3", "tp2"), ("qwen2", "tp2"), ("mistral", "tp2,sp=off"), ("mixtral", "tp2"),
    ("qwen3", "fsdp2"), ("mistral", "fsdp2"), ("llama3", "fsdp2"),
    ("yarn", "cp2"), ("llama3", "cp2,cp_mode=a2a"), ("mixtral", "ep2"),
    ("qwen2_moe", "tp2"), ("qwen2_moe", "ep2"), ("qwen2_moe", "fsdp2"),
])
def test_family_under_plan_matches_single_process(pools, family, plan):
    c = case(plan=plan, model=FAMILIES[family], steps=2)
    check_parity(pools(2).run(run_parallel, c), c)


def test_sliding_window_refuses_context_parallelism():
    with pytest.raises(ValueError) as info:
        rules.resolve(Plan.parse("cp2"), world_size=2, model=FAMILIES["mistral"], seq_len=16)
    message = str(info.value)
    assert "sliding_window=4" in message and "valid: no cp" in message and "\n" not in message, message
