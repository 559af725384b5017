"""Reference models: parameter-count formula vs the built module, published sizes, FLOPs by hand,
causality, grouped-query attention, rotary embeddings, and `--set` overrides."""

from __future__ import annotations

import pytest
import torch

from shoal.models import PRESETS, ModelConfig, Transformer, get_preset
from shoal.models.rope import rope_tables, rotation_rows
from shoal.models.transformer import apply_rope

VARIANTS = {
    "tiny": PRESETS["tiny"],
    "tiny-gpt": PRESETS["tiny-gpt"],
    "small": PRESETS["small"],
    "tied+bias (llama-style)": PRESETS["tiny"].replace(tie_embeddings=True, bias=True),
    "gpt, no bias, untied": PRESETS["tiny-gpt"].replace(bias=False, tie_embeddings=False),
    "layernorm+swiglu+rope": PRESETS["tiny"].replace(norm="layernorm", bias=True, num_kv_heads=2),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_num_params_formula_counts_the_module(name):
    cfg = VARIANTS[name]
    model = Transformer(cfg)
    assert cfg.num_params() == model.num_params() == sum(p.numel() for p in model.parameters())
    embeddings = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)
    embeddings += cfg.max_seq_len * cfg.dim if cfg.pos_emb == "learned" else 0
    assert cfg.num_params(embedding=False) == cfg.num_params() - embeddings


@pytest.mark.parametrize("name, published, active", [
    ("gpt3-175b", 175e9, None),   # Brown et al. 2020, table 2.1
    ("gpt3-13b", 13e9, None),
    ("gpt3-1.3b", 1.3e9, None),
    ("llama3-8b", 8.03e9, None),  # Llama 3 herd paper; the released checkpoint's count
    ("llama3-70b", 70.6e9, None),
    ("llama3-405b", 405e9, None),
    ("mixtral-8x7b", 46.7e9, 12.9e9),  # Jiang et al. 2024: 46.7B total, 12.9B active per token
    ("deepseek-v3", 671e9, 37e9),  # DeepSeek-AI 2024: 671B total, 37B activated (without the MTP module)
    ("qwen3-235b-a22b", 235e9, 22e9),  # Qwen 2025: 235B total, 22B activated
])
def test_presets_match_published_sizes(name, published, active):
    """Within 2%: the published counts are rounded (37B stands for shoal's 37.55B, 1.5% off)."""
    cfg = get_preset(name)
    assert abs(cfg.num_params() / published - 1) < 0.02, cfg.num_params()
    if active is not None:
        assert abs(cfg.num_params(active=True) / active - 1) < 0.02, cfg.num_params(active=True)


def test_moe_count_by_hand():
    cfg = ModelConfig(num_layers=1, dim=4, num_heads=2, ffn_dim=8, vocab_size=10, max_seq_len=8,
                      num_experts=4, top_k=2)
    attn, expert, router, norms, final = 4 * 4 * 4, 3 * 4 * 8, 4 * 4, 2 * 4, 4
    assert cfg.num_params(embedding=False) == attn + 4 * expert + router + norms + final == 476
    assert cfg.num_params(embedding=False, active=True) == attn + 2 * expert + router + norms + final == 284
    assert cfg.num_params() == 476 + 2 * 10 * 4
    every_other = cfg.replace(num_layers=2, moe_every=2)  # layer 0 dense, layer 1 MoE
    assert every_other.num_params(embedding=False) == 2 * (attn + norms) + expert + 4 * expert + router + final


def test_dense_layers_and_widths_by_hand():
    """Which blocks have experts (moe_every, moe_first_dense, moe_dense_layers) and the dense blocks' own width,
    in the count and in the built model."""
    cfg = ModelConfig(num_layers=6, dim=4, num_heads=2, ffn_dim=8, vocab_size=10, max_seq_len=8, num_experts=4,
                      top_k=2, moe_first_dense=1, moe_dense_layers=(4,), dense_ffn_dim=12)
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, True, True, False, True]
    assert [cfg.replace(moe_every=2).is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    attn, norms, final = 4 * 4 * 4, 2 * 4, 4
    dense, expert, router = 3 * 4 * 12, 3 * 4 * 8, 4 * 4
    assert cfg.num_params(embedding=False) == 6 * (attn + norms) + 2 * dense + 4 * (4 * expert + router) + final
    model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert model.layers["0"].feed_forward.w1.weight.shape == (12, 4)
    assert model.layers["1"].feed_forward.experts.w1.shape[1:] == (8, 4)
    assert cfg.with_overrides(["moe_dense_layers=0,4"]).moe_dense_layers == (0, 4)
    assert cfg.with_overrides(["moe_dense_layers=[2, 3]"]).moe_dense_layers == (2, 3)
    assert cfg.with_overrides(["moe_dense_layers="]).moe_dense_layers == ()


def test_flops_per_token_by_hand():
    # L=2, D=16, H=2 (E=8), F=32, V=10, SwiGLU, no bias, untied, RoPE; T=4.
    cfg = ModelConfig(num_layers=2, dim=16, num_heads=2, ffn_dim=32, vocab_size=10, max_seq_len=8)
    per_layer = 4 * 16 * 16 + 3 * 16 * 32 + 2 * 16  # attention + SwiGLU MLP + two RMSNorms = 2592
    n = 2 * per_layer + 16 + 10 * 16  # + final norm + output projection = 5360
    attention = 12 * 2 * 2 * 8 * 4  # 12 L H E T (PaLM appendix B) = 1536
    assert cfg.flops_per_token(4) == 6 * n + attention == 33696
    assert Transformer(cfg).flops_per_token(4) == 33696


@pytest.mark.parametrize("name", ["tiny", "tiny-gpt"])
def test_forward_is_causal(name):
    torch.manual_seed(0)
    model = Transformer(PRESETS[name].replace(max_seq_len=32)).eval()
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 9] = (y[:, 9] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(y)
    assert a.shape == (2, 16, 256)
    # Masked positions get exactly zero weight, so earlier positions see bit-identical inputs.
    assert torch.equal(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_gqa_equals_multi_head_with_shared_kv():
    """GQA (8 query heads, 2 KV heads) == plain multi-head attention whose K/V projections repeat
    each KV head for its group of 4 query heads."""
    gqa_cfg = PRESETS["tiny"].replace(num_kv_heads=2, max_seq_len=32)
    torch.manual_seed(0)
    gqa = Transformer(gqa_cfg).eval()
    mha = Transformer(gqa_cfg.replace(num_kv_heads=None)).eval()
    E, groups = gqa_cfg.head_dim, gqa_cfg.num_heads // gqa_cfg.kv_heads
    state = {}
    for key, value in gqa.state_dict().items():
        if key.endswith(("wk.weight", "wv.weight")):
            value = value.view(gqa_cfg.kv_heads, E, -1).repeat_interleave(groups, dim=0).flatten(0, 1)
        state[key] = value
    mha.load_state_dict(state)
    x = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        # Same arithmetic on different weight layouts: differences only from matmul blocking.
        torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-6)
    assert gqa.layers["0"].attention.wk.weight.shape == (2 * E, gqa_cfg.dim)


def test_rope_depends_on_relative_position_only():
    cfg = ModelConfig(dim=32, num_heads=2, max_seq_len=16)
    cos, sin = rotation_rows(*rope_tables(cfg))
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m: int, n: int) -> torch.Tensor:
        return (apply_rope(q, cos[m:m + 1], sin[m:m + 1]) * apply_rope(k, cos[n:n + 1], sin[n:n + 1])).sum()

    torch.testing.assert_close(score(5, 2), score(12, 9), rtol=1e-5, atol=1e-5)  # fp32 angle rounding
    torch.testing.assert_close(score(0, 0), (q * k).sum())
    assert not torch.allclose(score(5, 2), score(5, 4))


SCALED_ROPE_OFF_DEFAULTS = {
    "llama3": ({"low_freq_factor": 2.0, "high_freq_factor": 8.0},
               {"rope_low_freq_factor": 2.0, "rope_high_freq_factor": 8.0}),
    "yarn": ({"beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
             {"rope_beta_fast": 16.0, "rope_beta_slow": 2.0, "rope_truncate": False}),
}


@pytest.mark.parametrize("rope_type", list(SCALED_ROPE_OFF_DEFAULTS))
def test_scaled_rope_off_its_defaults_equals_transformers(rope_type):
    """llama3's and yarn's inverse frequencies (and yarn's attention factor) with every field of the scaling set
    off its default equal transformers' own: the same float32 formulas, so exactly. Each field moves them
    (checked against the defaults), so one read as its default instead is caught."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from shoal.models.rope import attention_factor, inverse_frequencies

    hf_fields, fields = SCALED_ROPE_OFF_DEFAULTS[rope_type]
    # theta 500 and 1024 original positions: yarn's ramp lies inside the head's 8 frequencies, unclamped
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                     rope_parameters={"rope_type": rope_type, "rope_theta": 500.0, "factor": 4.0,
                                      "original_max_position_embeddings": 1024, **hf_fields})
    expected, factor = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    cfg = ModelConfig(dim=64, num_heads=4, num_kv_heads=2, max_seq_len=4096, rope_theta=500.0, rope_type=rope_type,
                      rope_factor=4.0, rope_original_max_len=1024, **fields)
    assert torch.equal(inverse_frequencies(cfg), expected.float())
    assert attention_factor(cfg) == pytest.approx(factor, rel=1e-12)
    for name in fields:  # each field on its own changes the frequencies
        default = ModelConfig.__dataclass_fields__[name].default
        assert not torch.equal(inverse_frequencies(cfg.replace(**{name: default})), expected.float()), name


def test_with_overrides_converts_types():
    cfg = PRESETS["tiny"].with_overrides(
        ["dim=256", "num_kv_heads=none", "bias=true", "rope_theta=1e5", "norm=layernorm", "num_layers = 6"]
    )
    assert (cfg.dim, cfg.num_kv_heads, cfg.bias, cfg.rope_theta, cfg.norm, cfg.num_layers) == (
        256, None, True, 1e5, "layernorm", 6)
    assert isinstance(cfg.rope_theta, float) and isinstance(cfg.dim, int)
    assert PRESETS["tiny"].with_overrides({"tie_embeddings": "on", "num_kv_heads": "2"}).num_kv_heads == 2
    assert PRESETS["tiny"].with_overrides([]) == PRESETS["tiny"]


@pytest.mark.parametrize("pairs, words", [
    (["dims=3"], "unknown model field 'dims' in --set; valid: dim, or another field"),
    (["zzz=3"], "unknown model field 'zzz' in --set; valid: num_layers, dim, num_heads, num_kv_heads, ffn_dim,"),
    (["dim"], "--set takes key=value, got 'dim'"),
    (["=3"], "--set takes key=value"),
    (["num_layers=abc"], "model field num_layers='abc' is not a valid int"),
    (["bias=maybe"], "model field bias='maybe' is not a valid bool"),
    (["rope_theta=fast"], "rope_theta='fast' is not a valid float"),
    (["norm=batchnorm"], "model field norm='batchnorm' is not valid; valid: rmsnorm, layernorm"),
    (["activation=relu"], "valid: swiglu, gelu"),
    (["pos_emb=alibi"], "valid: rope, learned"),
    (["dim=0"], "model field dim=0 must be >= 1"),
    (["dim=100"], "dim=100 is not divisible by num_heads=8"),
    (["num_kv_heads=3"], "num_kv_heads=3 does not divide num_heads=8; valid: num_kv_heads in 1, 2, 4, 8"),
    (["num_kv_heads=-4"], "num_kv_heads=-4 does not divide num_heads=8"),
    (["dim=8"], "rotary embeddings need an even head dim"),
    (["num_experts=-1"], "num_experts=-1 must be >= 0"),
    (["num_experts=4", "top_k=5"], "top_k=5 must lie in 1..num_experts=4"),
    (["num_experts=4", "moe_every=0"], "moe_every=0 must be >= 1"),
    (["num_experts=4", "moe_every=5"], "moe_every=5 makes none of the 4 layers an MoE layer; valid: moe_every in 1..4"),
    (["num_experts=4", "moe_dense_layers=1,9"], "moe_dense_layers=[1, 9] must be distinct layer indices in 0..3"),
    (["num_experts=4", "moe_dense_layers=1,x"], "moe_dense_layers='1,x' is not a valid tuple[int,"),
    (["dense_ffn_dim=-2"], "model field dense_ffn_dim=-2 must be >= 0"),
    (["init_std=-1"], "model field init_std=-1.0 must be >= 0"),
    (["init_std=nan"], "model field init_std=nan must be a finite number"),
    (["norm_eps=0"], "model field norm_eps=0.0 must be > 0"),
    (["rope_theta=-1"], "model field rope_theta=-1.0 must be > 0"),
])
def test_with_overrides_rejects_bad_input_in_one_line(pairs, words):
    with pytest.raises(ValueError) as info:
        PRESETS["tiny"].with_overrides(pairs)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert len(str(info.value)) <= 300, str(info.value)  # the README: most errors under 300 characters


def test_unknown_preset():
    with pytest.raises(ValueError,
                       match=r"unknown model 'tiny2'; valid: tiny, tiny-moe, .* or hf:<dir or config.json>"):
        get_preset("tiny2")


def test_parameter_counts_read_as_people_write_them():
    from shoal.models import parameters_text

    assert [parameters_text(n) for n in (113_152, 850_000, 999_999_999, 8_030_261_248, 405_853_388_800)] == [
        "0.113M", "0.85M", "1B", "8.03B", "406B"]


def test_a_model_warning_is_one_shoal_line(capsys):
    """A setting that runs but is likely a mistake (top-1 routing with normalised weights) is said in one
    `shoal: warning:` line by the command line, not as Python's warning with its source line."""
    import warnings

    from shoal import cli

    cli.show_model_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        cli.show_model_warnings()  # installed once, however often asked
        PRESETS["tiny-moe"].with_overrides(["top_k=1"])
    err = capsys.readouterr().err
    assert err.count("shoal: warning: top_k=1 with norm_topk=true") == 1 and "UserWarning" not in err
