"""Every Hugging Face family shoal computes exactly, against transformers' own model: a tiny random
model built by transformers from its config (no download) is saved, read by `shoal.from_hf`, and
both give the same logits, loss and gradients; shoal's weights exported as a Hugging Face folder
load back in `AutoModelForCausalLM` with the same logits.

Tolerances (float32, dropout off): the two models hold the same numbers and do the same
arithmetic up to the order of some float operations (rotate_half against interleaved pairs,
RMSNorm and GELU written two ways, SDPA against a masked SDPA or eager attention, the experts'
weighted sum), which moves each result by a few ulps of float32 (eps = 1.2e-7). Logits and the
loss are O(1) and pass through ~2 layers of such steps: rtol = atol = 1e-5 (~80 eps) leaves an
order of magnitude above what is measured (printed: ~1e-6 and below). Gradients are sums over the
batch's 64 tokens of products of such values, and parameters that get small gradients (norm
weights) see the rounding of the larger terms they cancel: rtol 1e-4 with atol 1e-6 on gradients
of size ~1e-2.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a dev dependency: pyproject [dev])

import shoal  # noqa: E402
from shoal import rules
from shoal.apply_plan import parallelize  # noqa: E402
from shoal.models.hf.families import shoal_to_hf  # noqa: E402
from shoal.testing.asserts import one_line_error  # noqa: E402
from shoal.train.export import export_model  # noqa: E402

LOGIT_TOL = dict(rtol=1e-5, atol=1e-5)  # see the module docstring
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
SEQ = 32
_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
              initializer_range=0.05, rope_parameters={"rope_type": "default", "rope_theta": 500.0})


def _rope(rope_type: str, **params: float) -> dict:
    """A small theta, so the rotary wavelengths span 2 pi .. ~1500 positions, across the scalings' bands."""
    return dict(rope_parameters={"rope_type": rope_type, "rope_theta": 500.0, **params})


_WINDOW = dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)  # Qwen's switch, on every layer
_QWEN2_MOE = dict(_LLAMA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, norm_topk_prob=False)
_QWEN3_MOE = dict(_LLAMA, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, intermediate_size=48,
                  head_dim=32, norm_topk_prob=True)
# DeepSeek-V3: latent attention, layer 0 dense at intermediate_size, layers 1-2 MoE of 8 experts of 16 in 4
# groups (top-2 groups, top-3 experts), two experts' width of shared MLP (one MLP of 32), scaled weights.
_DEEPSEEK_V3 = dict(_LLAMA, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8,
                    moe_intermediate_size=16, n_shared_experts=2, n_group=4, topk_group=2, num_experts_per_tok=3,
                    routed_scaling_factor=1.5, norm_topk_prob=True, num_nextn_predict_layers=0)

FAMILIES = {
    # Every field the mapping reads is off its default in some case (tests/test_config_mapping.py walks them).
    "llama": (transformers.LlamaConfig, dict(_LLAMA, tie_word_embeddings=True, head_dim=32, hidden_act="swish",
                                             attention_bias=True, mlp_bias=True)),
    "llama3": (transformers.LlamaConfig, dict(_LLAMA, **_rope("llama3", factor=8.0, low_freq_factor=2.0,
                                                              high_freq_factor=8.0,
                                                              original_max_position_embeddings=16))),
    "linear": (transformers.LlamaConfig, dict(_LLAMA, **_rope("linear", factor=4.0))),
    # dynamic: within max_position_embeddings transformers' dynamic rope is the default one for any factor, and
    # shoal's tables stop there; this case fills the whole table (SEQ = max_position_embeddings).
    "dynamic": (transformers.LlamaConfig, dict(_LLAMA, max_position_embeddings=32, **_rope("dynamic", factor=2.0))),
    "yarn": (transformers.LlamaConfig, dict(_LLAMA, **_rope("yarn", factor=4.0, original_max_position_embeddings=16,
                                                            beta_fast=2.0, beta_slow=0.5, truncate=False,
                                                            attention_factor=1.2))),
    "yarn-mscale": (transformers.LlamaConfig, dict(_LLAMA, **_rope("yarn", factor=4.0, mscale=2.0, mscale_all_dim=1.0,
                                                                   original_max_position_embeddings=16))),
    "mistral": (transformers.MistralConfig, dict(_LLAMA, sliding_window=8)),  # SEQ = 4 windows
    "mistral-tied": (transformers.MistralConfig, dict(_LLAMA, sliding_window=8, tie_word_embeddings=True, head_dim=32,
                                                      hidden_act="swish")),
    "qwen2": (transformers.Qwen2Config, dict(_LLAMA, tie_word_embeddings=True)),
    "qwen2-window": (transformers.Qwen2Config, dict(_LLAMA, **_WINDOW, hidden_act="swish")),
    "qwen3": (transformers.Qwen3Config, dict(_LLAMA, head_dim=32)),  # 4 heads of 32 on a 64-wide model
    "qwen3-window": (transformers.Qwen3Config, dict(_LLAMA, **_WINDOW, head_dim=8, tie_word_embeddings=True,
                                                    hidden_act="swish")),
    "mixtral": (transformers.MixtralConfig, dict(_LLAMA, num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-window": (transformers.MixtralConfig, dict(_LLAMA, num_local_experts=4, num_experts_per_tok=3,
                                                        rms_norm_eps=1e-6, sliding_window=8, head_dim=32,
                                                        tie_word_embeddings=True, hidden_act="swish")),
    "qwen2_moe": (transformers.Qwen2MoeConfig, _QWEN2_MOE),
    "qwen2_moe-norm": (transformers.Qwen2MoeConfig, dict(_QWEN2_MOE, norm_topk_prob=True, decoder_sparse_step=2,
                                                         intermediate_size=32)),
    "qwen2_moe-window": (transformers.Qwen2MoeConfig, dict(_QWEN2_MOE, **_WINDOW, tie_word_embeddings=True,
                                                           layer_types=["sliding_attention"] * 2,
                                                           num_experts_per_tok=3, hidden_act="swish")),
    # Qwen3-MoE: 8 fine-grained experts; layer 0 dense (mlp_only_layers) at its own width, layer 1 MoE.
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(_QWEN3_MOE, mlp_only_layers=[0])),
    # Layer 1 dense by decoder_sparse_step=2 at the experts' width; raw top-k weights, windowed, tied.
    "qwen3_moe-step": (transformers.Qwen3MoeConfig, dict(_QWEN3_MOE, decoder_sparse_step=2, norm_topk_prob=False,
                                                         intermediate_size=32, num_hidden_layers=3, head_dim=8,
                                                         use_sliding_window=True, sliding_window=8,
                                                         tie_word_embeddings=True, hidden_act="swish")),
    "deepseek_v3": (transformers.DeepseekV3Config, _DEEPSEEK_V3),
    # One query projection, raw top-k scores, no groups, one shared expert, yarn with mscale_all_dim, tied.
    "deepseek_v3-plain": (transformers.DeepseekV3Config, dict(
        _DEEPSEEK_V3, q_lora_rank=None, norm_topk_prob=False, n_group=1, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=2, intermediate_size=32, tie_word_embeddings=True, hidden_act="swish",
        **_rope("yarn", factor=2.0, original_max_position_embeddings=16, beta_fast=2.0, beta_slow=0.5,
                truncate=False, attention_factor=1.2, mscale_all_dim=0.8))),
    "deepseek_v3-llama3": (transformers.DeepseekV3Config, dict(
        _DEEPSEEK_V3, **_rope("llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=8.0,
                              original_max_position_embeddings=16))),
    "gpt2": (transformers.GPT2Config, dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt2-untied": (transformers.GPT2Config, dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=48,
                                                  n_inner=128, layer_norm_epsilon=1e-6, tie_word_embeddings=False,
                                                  initializer_range=0.05, activation_function="gelu_pytorch_tanh",
                                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
}
LOAD_REFUSED = {
    "qwen2-head_dim": (transformers.Qwen2Config, dict(_LLAMA, head_dim=32)),
    "qwen2_moe-head_dim": (transformers.Qwen2MoeConfig, dict(_QWEN2_MOE, head_dim=32)),
}
"""Configs shoal reads but refuses to load in one line: Qwen2 and Qwen2-MoE with a head size apart from
hidden_size / num_attention_heads (shoal.models.hf.qwen2 holds head_size 0)."""
ROUTER_LOSS = {f"{name}-router": (FAMILIES[name][0], dict(FAMILIES[name][1], output_router_logits=True,
                                                          router_aux_loss_coef=0.5))
               for name in ("mixtral", "qwen2_moe", "qwen3_moe")}
"""output_router_logits=true: transformers' loss adds router_aux_loss_coef x its pooled load-balancing loss."""


def _hf_model(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    config_cls, fields = FAMILIES[name]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**fields), dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases, so a swapped or dropped one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.empty_like(p).uniform_(-0.5, 0.5))
        for name, b in model.named_buffers():  # DeepSeek-V3's selection bias, a buffer: comparable to the scores
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)
    return model.eval()


def _file_layout(name: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory names -> its files' (the MoE families fuse their experts in memory only)."""
    if name not in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"):
        return state
    prefix, (gate, up, down) = (("block_sparse_moe", ("w1", "w3", "w2")) if name == "mixtral"
                                else ("mlp", ("gate_proj", "up_proj", "down_proj")))
    out = {}
    for k, v in state.items():
        layer = k.rsplit(".mlp.", 1)[0]
        if k.endswith("mlp.gate.weight"):
            out[f"{layer}.{prefix}.gate.weight"] = v
        elif k.endswith("mlp.experts.gate_up_proj"):
            for e, (w_gate, w_up) in enumerate(zip(*v.chunk(2, dim=1), strict=True)):
                out[f"{layer}.{prefix}.experts.{e}.{gate}.weight"] = w_gate
                out[f"{layer}.{prefix}.experts.{e}.{up}.weight"] = w_up
        elif k.endswith("mlp.experts.down_proj"):
            for e, w_down in enumerate(v):
                out[f"{layer}.{prefix}.experts.{e}.{down}.weight"] = w_down
        else:
            out[k] = v
    return out


def _tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers' model, its saved folder, shoal's model read from that folder)."""
    hf_model = _hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(str(folder))
    return request.param, hf_model, folder, shoal.from_hf(folder).eval()


def test_logits_loss_and_gradients_equal_transformers(family):
    name, hf_model, _, model = family
    tokens = _tokens(model.config.vocab_size)
    hf_out = hf_model(tokens, labels=tokens)
    logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    print(f"{name}: max |logit diff| {(logits - hf_out.logits).abs().max():.3g}, "
          f"|loss diff| {(loss - hf_out.loss).abs():.3g}")
    torch.testing.assert_close(logits, hf_out.logits, **LOGIT_TOL)
    torch.testing.assert_close(loss, hf_out.loss, **LOGIT_TOL)
    hf_model.zero_grad()
    model.zero_grad()
    hf_out.loss.backward()
    loss.backward()
    grads = shoal_to_hf({k: p.grad for k, p in model.named_parameters(remove_duplicate=False)}, model.config)
    hf_grads = _file_layout(name.split("-")[0], {k: p.grad for k, p in hf_model.named_parameters()})
    assert set(grads) <= set(hf_grads) and set(hf_grads) - set(grads) <= {"lm_head.weight"}
    worst = max((grads[k] - hf_grads[k]).abs().max().item() for k in grads)
    print(f"{name}: max |grad diff| {worst:.3g}")
    for k in grads:
        torch.testing.assert_close(grads[k], hf_grads[k], **GRAD_TOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("name, off", [("llama3", dict(rope_type="default")), ("linear", dict(rope_type="default")),
                                       ("yarn", dict(rope_type="default")), ("mistral", dict(sliding_window=0)),
                                       ("qwen2", dict(qkv_bias=False)), ("qwen3", dict(qk_norm=False)),
                                       ("qwen2_moe", dict(shared_gate=False)), ("qwen3_moe", dict(norm_topk=False)),
                                       ("deepseek_v3", dict(router_bias=False)),
                                       ("deepseek_v3", dict(router_groups=0, router_topk_groups=0)),
                                       ("deepseek_v3", dict(router_scale=1.0))])
def test_each_feature_changes_the_logits(name, off, tmp_path):
    """The checks above are not vacuous: the same weights without the family's feature differ from
    transformers by far more than the tolerance."""
    hf_model = _hf_model(name)
    hf_model.save_pretrained(str(tmp_path))
    model = shoal.from_hf(tmp_path)
    plain = type(model)(model.config.replace(**off))
    plain.load_state_dict(model.state_dict(), strict=False)  # the feature's own tensors (biases, norms) left out
    tokens = _tokens(model.config.vocab_size)
    with torch.no_grad():
        assert (plain.eval()(tokens) - hf_model(tokens).logits).abs().max() > 1e-3


@pytest.mark.parametrize("name", list(LOAD_REFUSED))
def test_a_head_size_qwen2_does_not_hold_is_refused_in_one_line(name, tmp_path):
    config_cls, fields = LOAD_REFUSED[name]
    transformers.AutoModelForCausalLM.from_config(config_cls(**fields)).save_pretrained(str(tmp_path))
    message = one_line_error(shoal.from_hf, tmp_path)
    assert "head_size=32" in message and "head_size=0" in message, message


def test_export_loads_in_transformers_with_equal_logits(family, tmp_path):
    name, _, _, model = family
    out = export_model(parallelize(model), tmp_path / "export", hf=True)
    assert out is not None
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = _tokens(model.config.vocab_size, seed=1)
    with torch.no_grad():
        expected, got = model(tokens), reloaded(tokens).logits
    print(f"{name}: export max |logit diff| {(got - expected).abs().max():.3g}")
    torch.testing.assert_close(got, expected, **LOGIT_TOL)


def test_gpt2_files_of_the_original_release_read_alike(tmp_path):
    """GPT-2's first files name tensors without the `transformer.` prefix and hold the causal-mask
    buffers (`attn.bias`): both read as the current layout does."""
    from shoal.models.hf.families import hf_to_shoal

    hf_model = _hf_model("gpt2")
    hf_model.save_pretrained(str(tmp_path))
    model = shoal.from_hf(tmp_path)
    state = {k.removeprefix("transformer."): v for k, v in hf_model.state_dict().items()}
    state["h.0.attn.bias"] = torch.ones(1, 1, SEQ, SEQ)
    got = hf_to_shoal(state, model.config)
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_router_loss_with_output_router_logits_equals_transformers(name, tmp_path):
    """output_router_logits=true: transformers' loss is the cross-entropy plus router_aux_loss_coef x
    its load-balancing loss pooled over every layer; shoal's one-process training loss (the
    cross-entropy plus what the MoE collector adds) equals it, and so do the routers' gradients
    (LOGIT_TOL / GRAD_TOL, as above: the same float32 sums in another order). The weight is large
    (0.5) so that a loss left out or taken per layer shows far above the tolerance."""
    from shoal.moe.collect import MoECollector

    config_cls, fields = ROUTER_LOSS[f"{name}-router"]
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config_cls(**fields), dtype=torch.float32)
    hf_model.save_pretrained(str(tmp_path))
    model = shoal.from_hf(tmp_path)
    assert model.config.aux_loss_pooled and model.config.aux_loss_coef == 0.5
    tokens = _tokens(model.config.vocab_size)
    hf_out = hf_model(tokens, labels=tokens)
    collector = MoECollector(model)
    logits = model(tokens)
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    added = collector.take_loss()
    assert added is not None
    print(f"{name}: |aux diff| {(added / 0.5 - hf_out.aux_loss).abs():.3g}, "
          f"|loss diff| {(ce + added - hf_out.loss).abs():.3g}")
    torch.testing.assert_close(added / 0.5, hf_out.aux_loss, **LOGIT_TOL)
    torch.testing.assert_close(ce + added, hf_out.loss, **LOGIT_TOL)
    (ce + added).backward()
    hf_out.loss.backward()
    grads = shoal_to_hf({k: p.grad for k, p in model.named_parameters()}, model.config)
    hf_grads = _file_layout(name, {k: p.grad for k, p in hf_model.named_parameters()})
    routers = [k for k in grads if k.endswith("gate.weight") and "shared_expert" not in k]
    assert routers
    for k in routers:
        torch.testing.assert_close(grads[k], hf_grads[k], **GRAD_TOL, msg=lambda m, k=k: f"{k}: {m}")


def test_pooled_router_loss_is_refused_where_it_would_be_split():
    """The pooled loss runs wherever each forward's tokens can be pooled over the ranks that see
    them, pipeline stages included (tests/test_moe_parallel.py checks it against one process):
    refused with accumulation over several data ranks, by --micro-batch or by a pipeline's
    micro-batches (a forward pools every rank's micro-batch, which no one-process run pools), in
    one line naming the way out."""
    from shoal import rules
    from shoal.models import ModelConfig
    from shoal.plan import Plan
    from shoal.testing.asserts import one_line_error

    cfg = ModelConfig(num_layers=2, dim=64, num_heads=4, vocab_size=128, num_experts=4, top_k=2,
                      capacity_factor=0.0, aux_loss_pooled=True)
    rules.resolve(Plan.parse("pp2"), world_size=2, model=cfg, global_batch=8)  # stages pool their counts
    rules.resolve(Plan.parse("pp2,sched=zb"), world_size=2, model=cfg, global_batch=8)
    rules.resolve(Plan.parse("dp2,pp2,mb=1"), world_size=4, model=cfg, global_batch=8)  # one pass per step
    for plan, world in (("dp2,pp2", 4), ("fsdp2,pp2,mb=2", 4)):
        message = one_line_error(rules.resolve, Plan.parse(plan), world_size=world, model=cfg, global_batch=8)
        assert "aux_loss_pooled" in message and "micro-batches on 2 data ranks" in message, message
        assert "valid: mb=1" in message, message
    for plan, world in (("dp2", 2), ("fsdp2", 2), ("ep2", 2), ("dp2,tp2", 4)):
        message = one_line_error(rules.resolve, Plan.parse(plan), world_size=world, model=cfg, global_batch=8,
                                 micro_batch=2)
        assert "--micro-batch 2 on 2 data ranks" in message and "valid: no --micro-batch" in message, message
        rules.resolve(Plan.parse(plan), world_size=world, model=cfg, global_batch=8)  # no accumulation: runs
        rules.resolve(Plan.parse(plan), world_size=world, model=cfg, global_batch=8, micro_batch=4)  # one pass
    for plan, world in (("dp1", 1), ("tp2", 2)):  # one data rank: accumulation runs too
        rules.resolve(Plan.parse(plan), world_size=world, model=cfg, global_batch=8, micro_batch=2)


def test_shoal_plan_prices_a_pooled_router_loss_in_a_pipeline(capsys):
    """`shoal plan` asks the same rules: it prices pp2 (1f1b and zb) for a pooled router loss, and
    its search ranks pipeline plans for it."""
    import json

    from shoal.cli import main

    model = ["--model", "tiny-moe", "--set", "aux_loss_pooled=true", "--set", "capacity_factor=0"]
    for plan in ("pp2", "pp2,sched=zb"):
        assert main(["plan", *model, "--cluster", "2xH100", "--plan", plan]) == 0
        assert "pp2,mb=4" in capsys.readouterr().out
    assert main(["plan", *model, "--cluster", "8xH100", "--top", "200", "--json"]) == 0
    assert any("pp" in p["plan"] for p in json.loads(capsys.readouterr().out))


def test_a_pipeline_says_its_micro_batches_pool_the_router_loss():
    """pp's micro-batches each pool a pooled load-balancing loss (as one process with --micro-batch does, the
    HF Trainer's accumulation): the start-up text says so, with the --micro-batch that reproduces the curve;
    mb=1, a dense model, or a per-layer router loss say nothing."""
    from types import SimpleNamespace

    from shoal.models.config import get_preset
    from shoal.plan import Plan
    from shoal.train.loop import Trainer

    pooled = get_preset("tiny-moe").replace(aux_loss_pooled=True, capacity_factor=0.0)

    def note(plan: str, cfg) -> list[str]:
        return Trainer._pooling_note(SimpleNamespace(plan=rules.resolve(Plan.parse(plan), world_size=2),
                                                     model_cfg=cfg, local_batch=8))

    (line,) = note("pp2,mb=4", pooled)
    assert "pools each of the pipeline's 4 micro-batches" in line and "--micro-batch 2" in line
    assert note("pp2,mb=1", pooled) == [] and note("dp2", pooled) == []
    assert note("pp2,mb=4", get_preset("tiny-moe")) == [] and note("pp2,mb=4", get_preset("tiny")) == []
