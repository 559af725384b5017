"""Multi-head latent attention (shoal.models.mla) against transformers' DeepseekV3Attention and a
whole dense-only DeepseekV3ForCausalLM, weights copied through shoal.models.hf.deepseek_v3; its
config fields' refusals; its parameter count.

Tolerances (float32): both sides do the same products in a different order (two projections
against one stacked kv_a_proj_with_mqa, adjacent-pair rotation against the even/odd one, torch's
RMSNorm against transformers' formula, SDPA with an explicit scale against the same), each result
a few ulps of float32 (eps = 1.2e-7) apart. Outputs are O(0.1-1) after two or three such steps:
rtol = atol = 1e-5 (~80 eps), as tests/test_hf_families.py derives for the other families.
Gradients are sums over the batch's tokens of such products: rtol 1e-4 with atol 1e-6. The traps
move the results by more: the softmax scale's YaRN correction and the rotary layout the outputs by
~1e-2 to 1e-1; the latent norms' epsilon (1e-6, not rms_norm_eps) the gradients by ~5e-4 relative.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

from shoal.models.config import ModelConfig  # noqa: E402
from shoal.models.hf import deepseek_v3  # noqa: E402
from shoal.models.hf.common import Fields  # noqa: E402
from shoal.models.mla import LatentAttention  # noqa: E402
from shoal.models.rope import rope_rows  # noqa: E402
from shoal.models.transformer import Transformer  # noqa: E402
from shoal.testing.asserts import one_line_error  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)  # see the module docstring
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
SEQ = 24
_BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.05,
             q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
             first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
             moe_intermediate_size=16, num_nextn_predict_layers=0, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 500.0})
_YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16,
         "mscale": 1.0, "mscale_all_dim": 0.7, "beta_fast": 32.0, "beta_slow": 1.0}

CASES = {
    "low-rank-q": dict(),
    "plain-q": dict(q_lora_rank=None),
    "yarn-mscale": dict(rope_parameters=_YARN),
    "rotate-half": dict(rope_interleave=False, rope_parameters=_YARN),
}


def _hf_config(**overrides) -> transformers.DeepseekV3Config:
    cfg = transformers.DeepseekV3Config(**{**_BASE, **overrides})
    cfg._attn_implementation = "sdpa"
    return cfg


def _shoal_config(hf_cfg: transformers.DeepseekV3Config) -> ModelConfig:
    raw = hf_cfg.to_dict()
    return ModelConfig(**deepseek_v3.config_in(Fields("test", {**deepseek_v3.DEFAULTS, **raw})))


@pytest.mark.parametrize("case", CASES)
def test_latent_attention_equals_transformers(case):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_mod

    hf_cfg = _hf_config(**CASES[case])
    torch.manual_seed(0)
    theirs = hf_mod.DeepseekV3Attention(hf_cfg, layer_idx=0)
    for name, p in theirs.named_parameters():
        with torch.no_grad():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "layernorm" in name else 0.1 * torch.randn_like(p))
    cfg = _shoal_config(hf_cfg)
    ours = LatentAttention(cfg)
    ours.load_state_dict(deepseek_v3.attention_to_shoal(dict(theirs.state_dict()), cfg,
                                                        interleaved=hf_cfg.rope_interleave))
    x = torch.randn(2, SEQ, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    rotary = hf_mod.DeepseekV3RotaryEmbedding(hf_cfg)(x, torch.arange(SEQ)[None])
    want, _ = theirs(x, rotary, attention_mask=None)
    got = ours(x2, rope_rows(cfg))
    torch.testing.assert_close(got, want, **TOL)
    target = torch.randn_like(want)
    (want * target).sum().backward()
    (got * target).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, **GRAD_TOL)
    mapped = deepseek_v3.attention_to_shoal({k: p.grad for k, p in theirs.named_parameters()}, cfg,
                                            interleaved=hf_cfg.rope_interleave)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, mapped[name], **GRAD_TOL, msg=name)


@pytest.mark.parametrize("case", ["low-rank-q", "rotate-half"])
def test_dense_deepseek_v3_equals_transformers(case):
    """The whole model with every layer dense: logits, loss and every gradient."""
    hf_cfg = _hf_config(**CASES[case])
    torch.manual_seed(0)
    theirs = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    cfg = _shoal_config(hf_cfg)
    ours = Transformer(cfg).eval()
    ours.load_state_dict(deepseek_v3.state_to_shoal(dict(theirs.state_dict()), cfg,
                                                    interleaved=hf_cfg.rope_interleave))
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    want = theirs(tokens).logits
    got = ours(tokens)
    torch.testing.assert_close(got, want, **TOL)
    F.cross_entropy(want.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    F.cross_entropy(got.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    grads = deepseek_v3.state_to_shoal({k: p.grad for k, p in theirs.named_parameters()}, cfg,
                                       interleaved=hf_cfg.rope_interleave)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], **GRAD_TOL, msg=name)


def test_routed_layers_take_their_widths():
    """The shared MLP is moe_intermediate_size x n_shared_experts wide (transformers' DeepseekV3MoE builds the
    n_shared_experts as one MLP), the first_k_dense_replace dense layers intermediate_size, the experts
    moe_intermediate_size; the router sigmoid with the selection bias, groups and scale (the whole model
    against transformers: tests/test_hf_families.py)."""
    cfg = _shoal_config(_hf_config(first_k_dense_replace=1, n_shared_experts=3, n_group=2, topk_group=1,
                                   routed_scaling_factor=2.5))
    assert (cfg.num_experts, cfg.ffn_dim, cfg.dense_width, cfg.moe_first_dense) == (4, 16, 96, 1)
    assert (cfg.num_shared_experts, cfg.shared_ffn_dim) == (1, 48)
    assert (cfg.router_score, cfg.router_bias, cfg.router_groups, cfg.router_topk_groups, cfg.router_scale) == (
        "sigmoid", True, 2, 1, 2.5)
    assert [cfg.is_moe_layer(i) for i in range(2)] == [False, True]


def test_mtp_layers_are_left_out_with_a_warning():
    state = {f"model.layers.{i}.mlp.w": torch.zeros(1) for i in range(3)} | {"model.norm.weight": torch.zeros(1)}
    with pytest.warns(UserWarning, match=r"multi-token-prediction.*model\.layers\.2"):
        kept = deepseek_v3.drop_mtp_layers(state, 2)
    assert sorted(kept) == ["model.layers.0.mlp.w", "model.layers.1.mlp.w", "model.norm.weight"]


MLA = dict(num_layers=2, dim=64, num_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
           qk_nope_head_dim=12, v_head_dim=10)


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_num_params_counts_the_module(q_lora_rank):
    cfg = ModelConfig(**{**MLA, "q_lora_rank": q_lora_rank})
    assert cfg.num_params() == Transformer(cfg).num_params()


@pytest.mark.parametrize("fields, named", [
    (dict(MLA, qk_rope_head_dim=7), "qk_rope_head_dim=7"),
    (dict(MLA, v_head_dim=0), "v_head_dim=0"),
    (dict(MLA, kv_lora_rank=-1), "kv_lora_rank=-1"),
    (dict(MLA, num_kv_heads=2), "num_kv_heads=2"),
    (dict(MLA, qk_norm=True), "qk_norm=True"),
    (dict(MLA, pos_emb="learned"), "pos_emb='learned'"),
    (dict(num_layers=2, dim=64, num_heads=4, q_lora_rank=8), "q_lora_rank=8"),
    (dict(num_layers=2, dim=64, num_heads=4, mscale_all_dim=1.0), "mscale_all_dim=1.0"),
])
def test_bad_latent_fields_are_refused_in_one_line(fields, named):
    assert named in one_line_error(lambda: ModelConfig(**fields))


def test_planner_prices_latent_attention_by_hand():
    """Hand-computed for MLA's tiny shape: D 64, H 4, q rank 24, kv rank 16, R 8, N 12, V 10 (C = 20)."""
    from shoal.planner import compute, memory

    cfg = ModelConfig(**MLA)
    # 2 per weight: wq_a 64x24, wq_b 24x80, wkv_a 64x16, wkv_b 16x88, wk_rope 64x8, wo 40x64
    assert compute.attention_matmul_flops(cfg) == 2 * (1536 + 1920 + 1024 + 1408 + 512 + 2560)
    # QK^T 2 C and AV 2 V per key and head: 16 keys, 4 heads
    assert compute.attention_core_flops(cfg, 16, causal_skip=False) == 2 * 16 * 4 * (20 + 10)
    assert compute.qkv_widths(cfg) == (80, 80, 40)
    # per head: q and k concatenated (C each), wkv_b's output (N + V), the output and its copy (2 V); one lse
    assert memory.attention_kept_elements(cfg) == 4 * (2 * 20 + 12 + 2 * 10) + 4
    # each latent: its projection's output, normalised, the norm's output, 1 / RMS
    assert memory.latent_kept_elements(cfg) == (3 * 24 + 1) + (3 * 16 + 1)


def test_deepseek_v3_attention_parameters():
    """DeepSeek-V3's attention (D 7168, 128 heads, q rank 1536, kv rank 512, R 64, N 128, V 128), by hand."""
    cfg = ModelConfig(num_layers=1, dim=7168, num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                      qk_nope_head_dim=128, v_head_dim=128, ffn_dim=18432, vocab_size=129280)
    by_hand = (7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 512 + 512 + 512 * 128 * 256 + 7168 * 64
               + 128 * 128 * 7168)
    assert cfg.latent_attention_params() == by_hand == 187_107_328


@pytest.mark.parametrize("plan", ["tp2", "tp4,sp=off", "cp2"])
def test_plans_of_a_latent_attention_model_are_priced(plan):
    """The estimate prices MLA under tp and cp (the products' shapes, the ring's keys and values of two widths)."""
    from shoal import rules
    from shoal.plan import Plan
    from shoal.planner.cluster_file import parse_cluster
    from shoal.planner.estimate import Workload, estimate

    cfg = ModelConfig(**{**MLA, "num_layers": 4, "max_seq_len": 256})
    world = Plan.parse(plan).tp * Plan.parse(plan).cp
    resolved = rules.resolve(Plan.parse(plan), world_size=world, model=cfg, global_batch=8, seq_len=128)
    result = estimate(resolved, Workload(model=cfg, global_batch=8, seq_len=128), parse_cluster(f"{world}xA100-80GB"))
    assert result.step_time_s > 0 and result.mem_per_device_bytes > 0 and result.fits


def test_a_latent_attention_model_exports_as_deepseek_v3_or_is_refused_in_one_line():
    """Latent attention is DeepSeek-V3's family; an MoE router transformers' DeepSeek-V3 lacks (softmax, no
    selection bias), or several shared experts, cannot be written as it."""
    from shoal.models.hf.families import hf_config, hf_family

    assert hf_family(ModelConfig(**MLA)) == "deepseek_v3"
    moe = ModelConfig(**MLA).replace(num_experts=4, top_k=2, capacity_factor=0.0, router_score="sigmoid",
                                     router_bias=True)
    assert hf_config(moe)["n_routed_experts"] == 4
    assert "router_score='softmax'" in one_line_error(hf_config, moe.replace(router_score="softmax"))
    assert "num_shared_experts=2" in one_line_error(hf_config, moe.replace(num_shared_experts=2))
    assert "capacity_factor=1.25" in one_line_error(hf_config, moe.replace(capacity_factor=1.25))


def test_document_masks_keep_latent_attention_inside_each_document():
    """With --doc-mask each document of a packed sequence is its own: its logits equal the model's on that
    document alone (positions restarting, the YaRN-corrected softmax scale on the masked kernel too).
    Tolerance: the same products, masked kernel against causal SDPA: 1e-5 as above."""
    cfg = ModelConfig(**{**MLA, "rope_type": "yarn", "rope_factor": 4.0, "rope_original_max_len": 8,
                         "mscale_all_dim": 0.7, "doc_eos_id": 0})
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    first, second = torch.randint(1, 256, (1, 9)), torch.randint(1, 256, (1, 7))
    first[0, -1] = 0  # the first document ends with the EOS id
    alone = Transformer(cfg.replace(doc_eos_id=-1)).eval()  # the same weights without document masks
    alone.load_state_dict(model.state_dict())
    packed = model(torch.cat((first, second), dim=1))
    torch.testing.assert_close(packed[:, :9], alone(first), **TOL)
    torch.testing.assert_close(packed[:, 9:], alone(second), **TOL)
