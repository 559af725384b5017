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
# output_router_logits=true: transformers' load-balancing loss pooled over every layer and token of a
# forward (shoal's aux_loss_pooled), weighted 0.5 so that a loss pooled per rank shows.
for _name in ("mixtral", "qwen2_moe"):
    FAMILIES[f"{_name}_router_loss"] = FAMILIES[_name].replace(aux_loss_pooled=True, aux_loss_coef=0.5)


@pytest.mark.parametrize("family, plan", [
    ("qwen3", "tp2"), ("qwen2", "tp2"), ("mistral", "tp2,sp=off"), ("mixtral", "tp2"),
    ("qwen3", "fsdp2"), ("mistral", "fsdp2"), ("llama3", "fsdp2"),
    ("yarn", "cp2"), ("llama3", "cp2,cp_mode=a2a"), ("mixtral", "ep2"),
    ("qwen2_moe", "tp2"), ("qwen2_moe", "ep2"), ("qwen2_moe", "fsdp2"),
    ("mixtral_router_loss", "dp2"), ("mixtral_router_loss", "ep2"), ("qwen2_moe_router_loss", "tp2"),
    ("qwen2_moe_router_loss", "fsdp2"),
])
def test_family_under_plan_matches_single_process(pools, family, plan):
    c = case(plan=plan, model=FAMILIES[family], steps=2)
    check_parity(pools(2).run(run_parallel, c), c)


def test_sliding_window_refuses_context_parallelism():
    with pytest.raises(ValueError) as info:
        rules.resolve(Plan.parse("cp2"), world_size=2, model=FAMILIES["mistral"], seq_len=16)
    message = str(info.value)
    assert "sliding_window=4" in message and "valid: no cp" in message and "\n" not in message, message


def _init_under(plan_text: str, folder: str, tokens) -> dict:
    """Worker: shoal's model of a Hugging Face folder built on meta under plan_text and filled by
    `--init`'s sliced reader (each rank reads its boxes); its logits on `tokens`."""
    import torch
    import torch.distributed as dist

    from shoal.models import Transformer
    from shoal.models.hf import config_from_hf
    from shoal.parallelize import parallelize
    from shoal.testing import cached_mesh
    from shoal.train.pretrained import open_pretrained

    cfg = config_from_hf(folder)
    weights = open_pretrained(folder, cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    plan = Plan.parse(plan_text).resolve(dist.get_world_size())
    runtime = parallelize(model, plan, cached_mesh(plan), weights=weights)
    with torch.no_grad():
        logits = runtime.eval()(tokens)
    return {"logits": logits.full_tensor() if hasattr(logits, "full_tensor") else logits}


@pytest.mark.parametrize("family, plan", [("gpt2", "tp2"), ("qwen3", "tp2"), ("mixtral", "ep2"),
                                          ("qwen2_moe", "tp2"), ("qwen2", "fsdp2")])
def test_init_from_transformers_folder_under_plan(pools, tmp_path, family, plan):
    """`--init` of a folder transformers wrote (two shards) under a plan gives transformers' logits
    (tolerance as tests/test_hf_families.py: rtol = atol = 1e-5)."""
    import torch

    from test_hf_families import _hf_model, _tokens  # the families' tiny configs

    hf_model = _hf_model(family)
    hf_model.save_pretrained(str(tmp_path), max_shard_size="150KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    tokens = _tokens(128)
    with torch.no_grad():
        expected = hf_model(tokens).logits
    for out in pools(2).run(_init_under, plan, str(tmp_path), tokens):
        torch.testing.assert_close(out["logits"], expected, rtol=1e-5, atol=1e-5)
