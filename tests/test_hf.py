"""Hugging Face config.json -> ModelConfig: field mapping per family, and parameter counts that
equal transformers' own models built from the same tiny config (exact integers)."""

from __future__ import annotations

import json
import math
import os
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a dev dependency: pyproject [dev])

from shoal.models import ModelConfig, Transformer  # noqa: E402
from shoal.models.hf.families import config_from_hf, load_model_config  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)


def _write(tmp_path, config, name="config.json"):
    folder = tmp_path / config.model_type
    folder.mkdir()
    config.to_json_file(str(folder / name))
    return folder


def _map(folder, *expect_warnings: str) -> ModelConfig:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = config_from_hf(str(folder))
    messages = " | ".join(str(w.message) for w in caught)
    for words in expect_warnings:
        assert words in messages, messages
    if not expect_warnings:
        assert not caught, messages
    return cfg


def _hf_count(config, cls) -> int:
    return cls(config).num_parameters()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_maps_and_counts_like_transformers(tmp_path, tied):
    hf = transformers.LlamaConfig(**TINY, rms_norm_eps=1e-5, rope_theta=5e5, tie_word_embeddings=tied)
    cfg = _map(_write(tmp_path, hf))
    assert cfg == ModelConfig(num_layers=2, dim=64, num_heads=4, num_kv_heads=2, ffn_dim=96, vocab_size=100,
                              max_seq_len=64, norm="rmsnorm", activation="swiglu", pos_emb="rope", bias=False,
                              tie_embeddings=tied, rope_theta=5e5, norm_eps=1e-5, init_std=0.02)
    expected = _hf_count(hf, transformers.LlamaForCausalLM)
    assert Transformer(cfg).num_params() == expected
    assert cfg.num_params() == expected


def test_llama_with_bias_and_mha(tmp_path):
    hf = transformers.LlamaConfig(**{**TINY, "num_key_value_heads": 4}, attention_bias=True, mlp_bias=True)
    cfg = _map(_write(tmp_path, hf))
    assert cfg.num_kv_heads is None and cfg.bias
    assert Transformer(cfg).num_params() == _hf_count(hf, transformers.LlamaForCausalLM)


def test_gpt2_maps_and_counts_like_transformers(tmp_path):
    hf = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=32)
    cfg = _map(_write(tmp_path, hf), "resid_pdrop=0.1")  # GPT-2's dropouts, which shoal does not apply
    assert ((cfg.norm, cfg.activation, cfg.pos_emb, cfg.bias, cfg.tie_embeddings)
            == ("layernorm", "gelu", "learned", True, True))
    assert (cfg.dim, cfg.num_layers, cfg.num_heads, cfg.ffn_dim, cfg.max_seq_len) == (64, 2, 4, 256, 32)
    expected = _hf_count(hf, transformers.GPT2LMHeadModel)
    assert Transformer(cfg).num_params() == expected == cfg.num_params()


def test_mistral_maps_the_window(tmp_path):
    hf = transformers.MistralConfig(**TINY, sliding_window=16)
    cfg = _map(_write(tmp_path, hf))
    assert (cfg.num_kv_heads, cfg.ffn_dim, cfg.norm_eps, cfg.sliding_window) == (2, 96, 1e-6, 16)
    assert Transformer(cfg).num_params() == _hf_count(hf, transformers.MistralForCausalLM)


def test_mixtral_maps_experts_dropless_and_counts(tmp_path):
    hf = transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
    cfg = _map(_write(tmp_path, hf))
    assert (cfg.num_experts, cfg.top_k, cfg.moe_every, cfg.rope_theta) == (4, 2, 1, 1e6)
    assert (cfg.capacity_factor, cfg.norm_topk, cfg.aux_loss_coef, cfg.z_loss_coef) == (0.0, True, 0.0, 0.0)
    expected = _hf_count(hf, transformers.MixtralForCausalLM)
    assert Transformer(cfg).num_params() == expected == cfg.num_params()


def test_qwen2_keeps_the_qkv_biases(tmp_path):
    hf = transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
    cfg = _map(_write(tmp_path, hf))
    assert cfg.tie_embeddings and cfg.qkv_bias and not cfg.bias and cfg.sliding_window == 0
    expected = _hf_count(hf, transformers.Qwen2ForCausalLM)
    assert Transformer(cfg).num_params() == expected == cfg.num_params()


def test_qwen2_moe_maps_the_gated_shared_expert_and_counts(tmp_path):
    hf = transformers.Qwen2MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                     shared_expert_intermediate_size=48)
    cfg = _map(_write(tmp_path, hf))
    assert (cfg.num_experts, cfg.top_k, cfg.ffn_dim, cfg.num_shared_experts, cfg.shared_ffn_dim) == (4, 2, 32, 1, 48)
    assert cfg.shared_gate and cfg.qkv_bias and not cfg.norm_topk and cfg.capacity_factor == 0.0
    expected = _hf_count(hf, transformers.Qwen2MoeForCausalLM)
    assert Transformer(cfg).num_params() == expected == cfg.num_params()


def test_qwen3_keeps_qk_norms_and_its_head_dim(tmp_path):
    hf = transformers.Qwen3Config(**TINY, head_dim=32)
    cfg = _map(_write(tmp_path, hf))
    assert cfg.qk_norm and cfg.head_size == 32 and cfg.head_dim == 32 and not cfg.qkv_bias
    expected = _hf_count(hf, transformers.Qwen3ForCausalLM)
    assert Transformer(cfg).num_params() == expected == cfg.num_params()


def test_qwen3_moe_maps_dense_layers_widths_and_counts(tmp_path):
    """transformers 5 writes num_local_experts; the hub's Qwen3-MoE files write num_experts: both read alike, and
    the export writes the hub's key (which transformers maps back)."""
    import json

    from shoal.models.hf.families import hf_config

    hf = transformers.Qwen3MoeConfig(**{**TINY, "num_hidden_layers": 3}, num_experts=8, num_experts_per_tok=2,
                                     moe_intermediate_size=32, mlp_only_layers=[1], head_dim=32, norm_topk_prob=True)
    folder = _write(tmp_path, hf)
    cfg = _map(folder)
    assert (cfg.num_experts, cfg.top_k, cfg.ffn_dim, cfg.dense_ffn_dim, cfg.moe_dense_layers) == (8, 2, 32, 96, (1,))
    assert cfg.qk_norm and cfg.head_size == 32 and cfg.norm_topk and not cfg.num_shared_experts
    assert [cfg.is_moe_layer(i) for i in range(3)] == [True, False, True]
    expected = _hf_count(hf, transformers.Qwen3MoeForCausalLM)
    assert Transformer(cfg).num_params() == expected == cfg.num_params()
    raw = json.loads((folder / "config.json").read_text())
    raw["num_experts"] = raw.pop("num_local_experts")  # as the hub's files have it
    (folder / "config.json").write_text(json.dumps(raw))
    assert _map(folder) == cfg
    out = hf_config(cfg.replace(moe_first_dense=1, moe_dense_layers=(2,)))
    assert out["mlp_only_layers"] == [0, 2] and out["num_experts"] == 8 and out["intermediate_size"] == 96
    assert transformers.Qwen3MoeConfig(**out).num_experts == 8


@pytest.mark.parametrize("rope, fields", [
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
      "original_max_position_embeddings": 16},  # both factors off their defaults (1, 4)
     dict(rope_type="llama3", rope_factor=8.0, rope_original_max_len=16, rope_low_freq_factor=2.0,
          rope_high_freq_factor=8.0)),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16.0, "beta_slow": 2.0,
      "truncate": False},  # off the defaults (32, 1, true)
     dict(rope_type="yarn", rope_beta_fast=16.0, rope_beta_slow=2.0, rope_truncate=False)),
    ({"rope_type": "linear", "factor": 2.0}, dict(rope_type="linear", rope_factor=2.0)),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 2.0, "mscale_all_dim": 1.0},
     dict(rope_type="yarn", rope_factor=4.0, rope_attention_factor=(0.2 * math.log(4) + 1) / (0.1 * math.log(4) + 1))),
], ids=["llama3", "yarn", "linear", "yarn-4.x-layout"])
def test_rope_scaling_maps(tmp_path, rope, fields):
    raw = {**TINY, "model_type": "llama", "rope_theta": 500.0, "rope_scaling": rope}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = config_from_hf(tmp_path)
    assert cfg.rope_theta == 500.0
    for key, value in fields.items():
        assert getattr(cfg, key) == pytest.approx(value), key


def test_transformers_4_layout_and_file_path(tmp_path):
    """A hand-written config in the older layout: rope_theta at the top level, no kv heads field."""
    raw = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 64, "rope_theta": 123.0}
    (tmp_path / "my.json").write_text(json.dumps(raw))
    cfg = config_from_hf(tmp_path / "my.json")
    assert cfg.rope_theta == 123.0 and cfg.num_kv_heads is None and cfg.norm_eps == 1e-6
    assert load_model_config(f"hf:{tmp_path / 'my.json'}") == cfg
    assert load_model_config("tiny").num_layers >= 4


def test_bad_configs_give_one_line_errors(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bert.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    (tmp_path / "nodim.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    (tmp_path / "neox.json").write_text(json.dumps({**TINY, "model_type": "gpt_neox"}))
    (tmp_path / "gelu.json").write_text(json.dumps({**TINY, "model_type": "llama", "hidden_act": "gelu"}))
    (tmp_path / "bias.json").write_text(json.dumps({**TINY, "model_type": "llama", "attention_bias": True}))
    (tmp_path / "rope.json").write_text(json.dumps({**TINY, "model_type": "llama",
                                                    "rope_parameters": {"rope_type": "longrope"}}))
    (tmp_path / "part.json").write_text(json.dumps({**TINY, "model_type": "qwen2", "use_sliding_window": True,
                                                    "max_window_layers": 1}))
    (tmp_path / "odd.json").write_text(json.dumps({**TINY, "model_type": "llama", "num_key_value_heads": 3}))
    (tmp_path / "empty").mkdir()
    cases = [
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "empty", "holds no config.json"),
        (tmp_path / "bad.json", "is not valid JSON"),
        (tmp_path / "list.json", "not an object"),
        (tmp_path / "bert.json", "model_type 'bert'; supported: deepseek_v3, gpt2, llama, mistral, mixtral, qwen2, "
                                 "qwen2_moe, qwen3"),
        (tmp_path / "neox.json", "model_type 'gpt_neox'; supported: deepseek_v3, gpt2, llama"),
        (tmp_path / "gelu.json", "hidden_act='gelu', which shoal does not compute exactly; valid: silu"),
        (tmp_path / "bias.json", "attention_bias=True with mlp_bias=False"),
        (tmp_path / "rope.json", "rope_type='longrope'"),
        (tmp_path / "part.json", "sliding window on some layers only"),
        (tmp_path / "nodim.json", "needs 'hidden_size'"),
        (tmp_path / "odd.json", "num_kv_heads=3 does not divide"),
    ]
    for path, words in cases:
        with pytest.raises(ValueError) as info:
            config_from_hf(path)
        message = str(info.value)
        assert words in message and "\n" not in message, message


def test_dropout_a_config_sets_is_said_not_silently_dropped(tmp_path):
    """GPT-2's configs set 0.1 dropouts, Llama's may set attention_dropout: shoal builds these families without
    dropout, and says so in a warning naming the fields; a config without them says nothing."""
    from shoal.models.config import ModelWarning

    hf = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=32)
    with pytest.warns(ModelWarning, match=r"sets resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1: shoal builds"):
        config_from_hf(_write(tmp_path, hf))
    (tmp_path / "quiet").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelWarning)
        config_from_hf(_write(tmp_path / "quiet", transformers.LlamaConfig(**TINY)))
