"""DeepSeek-V3 (`model_type` deepseek_v3): multi-head latent attention (shoal.models.mla) with
DeepSeekMoE: first_k_dense_replace dense SwiGLU layers of intermediate_size, then MoE layers of
n_routed_experts of moe_intermediate_size chosen by a sigmoid router (e_score_correction_bias added
for the choice only, group-limited to topk_group of n_group groups, the chosen scores renormalised
with transformers' + 1e-20 when norm_topk_prob, times routed_scaling_factor), beside one shared MLP
of moe_intermediate_size x n_shared_experts (transformers' DeepseekV3MoE builds the n_shared_experts
as one MLP that wide, which is shoal's single shared expert of shared_ffn_dim). transformers' loss
adds no router loss for this family, so none is mapped; shoal's seq_aux_coef and router_bias_rate
are training options the config.json does not hold.

The files hold one tensor per routed expert (`mlp.experts.E.gate_proj.weight`) and the router's
bias as `mlp.gate.e_score_correction_bias` (shoal's router buffer `bias`). The multi-token-prediction
layers a published folder holds beyond `num_hidden_layers` are left out with a warning as
transformers leaves them (`drop_mtp_layers`).

Rotary layout: `rope_interleave` true (the default, and DeepSeek's published files) rotates the
adjacent pairs (x[2i], x[2i+1]) of each head's rotary part, shoal's own layout, so the weights move
unchanged; false rotates halves (x[i], x[i + R/2]) (transformers' rotate_half), which the family
refuses (a shoal config does not record it); `attention_to_shoal(interleaved=False)` reorders one
attention's tensors for it. transformers' `kv_a_proj_with_mqa` is shoal's wkv_a (the latent's
kv_lora_rank rows) over wk_rope (the rotary key's qk_rope_head_dim rows).

Refused: attention_bias, num_key_value_heads apart from num_attention_heads, rope_interleave false,
what Llama refuses of the activation and the rotary embedding (shoal.models.hf.llama).
"""

from __future__ import annotations

import re
import warnings
from typing import TYPE_CHECKING, Any

import torch

from shoal.models.config import ModelConfig, ModelWarning
from shoal.models.hf import llama
from shoal.models.hf.common import Family, Fields, HFTensor

if TYPE_CHECKING:
    from torch import Tensor

DEFAULTS: dict[str, Any] = {**llama.DEFAULTS, "rope_interleave": True, "q_lora_rank": 1536, "kv_lora_rank": 512,
                            "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                            "first_k_dense_replace": 3, "num_nextn_predict_layers": 0,
                            "max_position_embeddings": 4096, "n_routed_experts": 256, "n_shared_experts": 1,
                            "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
                            "routed_scaling_factor": 2.5, "moe_intermediate_size": 2048}


def mla_fields(hf: Fields) -> dict[str, Any]:
    """The latent-attention fields of a DeepSeek-V2/V3 config.json (q_lora_rank null: one query projection)."""
    if hf.get("attention_bias"):
        hf.refuse("attention_bias=true (biases on the down and output projections)", "false")
    heads = hf.required("num_attention_heads")
    kv = hf.get("num_key_value_heads")
    if kv not in (None, heads):
        hf.refuse(f"num_key_value_heads={kv} with num_attention_heads={heads}", f"{heads} (latent attention "
                  "gives every head its own key and value)")
    rope = hf.within("rope_parameters", dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {}))
    mscale = rope.get("mscale_all_dim") if (rope.get("rope_type") or rope.get("type") or "default") != "default" \
        else None
    return dict(q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf.required("kv_lora_rank"),
                qk_rope_head_dim=hf.required("qk_rope_head_dim"), qk_nope_head_dim=hf.get("qk_nope_head_dim"),
                v_head_dim=hf.required("v_head_dim"), mscale_all_dim=float(mscale or 0.0))


def config_in(hf: Fields) -> dict[str, Any]:
    """The ModelConfig fields of a DeepSeek-V3 config.json (rope_interleave false refused: `family_config_in`)."""
    dim, heads = llama.shape(hf)
    # head_dim is not read: transformers derives it (qk_rope_head_dim); latent attention has its own widths
    plain = Fields(hf.path, hf.values)
    try:
        out = llama.fields(plain, dim=dim, heads=heads, window=lambda hf: 0)
    finally:
        hf.read.update(plain.read - {"head_dim"})
    out.update(mla_fields(hf), num_kv_heads=None, head_size=0)
    layers, first = out["num_layers"], hf.get("first_k_dense_replace")
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        hf.refuse(f"first_k_dense_replace={first!r}", "a whole number >= 0")
    experts = hf.get("n_routed_experts") or 0
    if first >= layers or not experts:  # every layer dense, of intermediate_size
        if first < layers:
            hf.refuse(f"n_routed_experts={experts!r} with first_k_dense_replace={first} < num_hidden_layers={layers}",
                      "n_routed_experts >= 1, or first_k_dense_replace >= num_hidden_layers")
        return out
    width, dense_width = hf.required("moe_intermediate_size"), hf.required("intermediate_size")
    shared = hf.get("n_shared_experts") or 0
    groups = hf.get("n_group") or 1
    out.update(num_experts=experts, top_k=hf.required("num_experts_per_tok"), capacity_factor=0.0,
               aux_loss_coef=0.0, z_loss_coef=0.0, moe_every=1, moe_first_dense=first, ffn_dim=width,
               dense_ffn_dim=0 if dense_width == width else dense_width, norm_topk=bool(hf.get("norm_topk_prob")),
               router_score="sigmoid", router_bias=True, router_scale=float(hf.get("routed_scaling_factor")),
               router_groups=groups if groups > 1 else 0,
               router_topk_groups=hf.required("topk_group") if groups > 1 else 0,
               num_shared_experts=1 if shared else 0, shared_ffn_dim=width * shared)
    return out


def family_config_in(hf: Fields) -> dict[str, Any]:
    """`config_in`, refusing rotary halves (rope_interleave false): a shoal config does not record the
    layout, so neither the loader nor the export could reorder the rows."""
    if not hf.get("rope_interleave"):
        hf.refuse("rope_interleave=false (rotary halves; DeepSeek's published files rotate pairs)", "true")
    return config_in(hf)


def config_out(cfg: ModelConfig) -> dict[str, Any]:
    _check_writable(cfg)
    out = {**llama.base_config(cfg, FAMILY), "attention_bias": False, "rope_interleave": True,
           "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
           "qk_rope_head_dim": cfg.qk_rope_head_dim, "qk_nope_head_dim": cfg.qk_nope_head_dim,
           "v_head_dim": cfg.v_head_dim, "num_nextn_predict_layers": 0,
           "first_k_dense_replace": min(cfg.moe_first_dense, cfg.num_layers) if cfg.num_experts else cfg.num_layers}
    del out["head_dim"]  # transformers derives it (qk_rope_head_dim)
    if cfg.mscale_all_dim:
        out["rope_parameters"] = out["rope_scaling"] = {**out["rope_parameters"], "mscale_all_dim": cfg.mscale_all_dim}
    if cfg.num_experts:
        out.update(n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.ffn_dim,
                   n_shared_experts=cfg.shared_ffn_dim // cfg.ffn_dim if cfg.num_shared_experts else 0,
                   norm_topk_prob=cfg.norm_topk, routed_scaling_factor=cfg.router_scale,
                   n_group=max(cfg.router_groups, 1), topk_group=cfg.router_topk_groups or 1)
    return out


_HOLDS = dict(bias=False, qkv_bias=False, qk_norm=False, sliding_window=0, num_prototypes=0, moe_every=1,
              moe_dense_layers=(), shared_gate=False, share_moe=False, aux_loss_pooled=False)
_ROUTED = dict(router_score="sigmoid", router_bias=True, capacity_factor=0.0)


def _check_writable(cfg: ModelConfig) -> None:
    """One line for an MoE model transformers' DeepSeek-V3 does not compute: its router, a capacity limit,
    or shared experts other than one MLP of a whole number of experts' widths."""
    if not cfg.num_experts:
        return
    for name, value in _ROUTED.items():
        if getattr(cfg, name) != value:
            raise ValueError(f"model field {name}={getattr(cfg, name)!r} cannot be written as a Hugging Face "
                             f"deepseek_v3 model (it needs {name}={value!r})")
    width = cfg.shared_ffn_dim or cfg.ffn_dim
    if cfg.num_shared_experts > 1 or (cfg.num_shared_experts and width % cfg.ffn_dim):
        raise ValueError(f"model fields num_shared_experts={cfg.num_shared_experts}, shared_ffn_dim="
                         f"{cfg.shared_ffn_dim} cannot be written as a Hugging Face deepseek_v3 model (it needs one "
                         f"shared expert of a multiple of ffn_dim={cfg.ffn_dim})")


# ----------------------------------------------------------------------------- weights

_PLAIN = (("wkv_b", "kv_b_proj"), ("kv_a_norm", "kv_a_layernorm"), ("wo", "o_proj"))


def attention_tensors(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(shoal name, transformers name) of one attention's tensors that move as they are (under
    `attention.` and `self_attn.`); kv_a_proj_with_mqa and the query projections are `attention_to_shoal`'s."""
    pairs = [(f"{a}.weight", f"{b}.weight") for a, b in _PLAIN]
    if cfg.q_lora_rank:
        pairs += [("wq_a.weight", "q_a_proj.weight"), ("q_a_norm.weight", "q_a_layernorm.weight")]
    return pairs


def attention_to_shoal(hf: dict[str, Tensor], cfg: ModelConfig, *, interleaved: bool) -> dict[str, Tensor]:
    """One attention's tensors, transformers' names (without the `self_attn.` prefix) -> shoal's (without
    `attention.`); `interleaved`: the config's rope_interleave."""
    out = {a: hf[b] for a, b in attention_tensors(cfg)}
    q_name, q_key = ("wq_b.weight", "q_b_proj.weight") if cfg.q_lora_rank else ("wq.weight", "q_proj.weight")
    N, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q = hf[q_key]
    latent, k_rope = hf["kv_a_proj_with_mqa.weight"].split([cfg.kv_lora_rank, R])
    if not interleaved:  # halves -> adjacent pairs, in each head's rotary rows and the shared key's
        heads = q.reshape(cfg.num_heads, N + R, -1)
        rotary = llama.to_pairs(heads[:, N:].reshape(cfg.num_heads * R, -1), cfg.num_heads, R)
        q = torch.cat((heads[:, :N], rotary.reshape(cfg.num_heads, R, -1)), dim=1).reshape(q.shape)
        k_rope = llama.to_pairs(k_rope, 1, R)
    out[q_name], out["wkv_a.weight"], out["wk_rope.weight"] = q.contiguous(), latent.contiguous(), k_rope.contiguous()
    return out


def state_to_shoal(hf: dict[str, Tensor], cfg: ModelConfig, *, interleaved: bool = True) -> dict[str, Tensor]:
    """A dense-only DeepSeek-V3 state dict (transformers' names) -> shoal's Transformer's."""
    out = {"tok_embeddings.weight": hf[llama.EMBED_KEY], "norm.weight": hf["model.norm.weight"]}
    out["output.weight"] = out["tok_embeddings.weight"] if cfg.tie_embeddings else hf["lm_head.weight"]
    for i in range(cfg.num_layers):
        s, h = f"layers.{i}.", f"model.layers.{i}."
        attn = {k[len(h + "self_attn."):]: v for k, v in hf.items() if k.startswith(h + "self_attn.")}
        out.update({s + "attention." + k: v for k, v in attention_to_shoal(attn, cfg, interleaved=interleaved).items()})
        out[s + "attention_norm.weight"] = hf[h + "input_layernorm.weight"]
        out[s + "ffn_norm.weight"] = hf[h + "post_attention_layernorm.weight"]
        for a, b in llama.MLP:
            out[s + f"feed_forward.{a}.weight"] = hf[h + f"mlp.{b}.weight"]
    return out


ROUTER_BIAS = "feed_forward.router.bias"
"""The router's selection bias (a buffer), e_score_correction_bias in the files."""


def layout(cfg: ModelConfig) -> list[HFTensor]:
    """transformers' DeepSeek-V3 files: the Llama layout with latent attention and DeepSeekMoE."""
    out = [HFTensor(llama.EMBED_KEY, ("tok_embeddings.weight",))]
    for i in range(cfg.num_layers):
        s, h = f"layers.{i}.", f"model.layers.{i}."
        out.append(HFTensor(h + "input_layernorm.weight", (s + "attention_norm.weight",)))
        out += _attention(cfg, s + "attention.", h + "self_attn.")
        out.append(HFTensor(h + "post_attention_layernorm.weight", (s + "ffn_norm.weight",)))
        out += _experts(cfg, i, s, h) if cfg.is_moe_layer(i) else llama.dense_mlp(cfg, i, s, h)
    out.append(HFTensor("model.norm.weight", ("norm.weight",)))
    if not cfg.tie_embeddings:
        out.append(HFTensor("lm_head.weight", ("output.weight",)))
    return out


def _attention(cfg: ModelConfig, s: str, h: str) -> list[HFTensor]:
    pairs = attention_tensors(cfg) + [("wq_b.weight", "q_b_proj.weight") if cfg.q_lora_rank
                                      else ("wq.weight", "q_proj.weight")]
    out = [HFTensor(h + b, (s + a,)) for a, b in pairs]
    return out + [HFTensor(h + "kv_a_proj_with_mqa.weight", (s + "wkv_a.weight", s + "wk_rope.weight"),
                           sizes=(cfg.kv_lora_rank, cfg.qk_rope_head_dim))]


def _experts(cfg: ModelConfig, i: int, s: str, h: str) -> list[HFTensor]:
    """An MoE layer's router (weight and selection bias), routed experts (one tensor per expert in the
    files) and shared MLP."""
    out = [HFTensor(h + "mlp.gate.weight", (s + "feed_forward.router.gate.weight",)),
           HFTensor(h + "mlp.gate.e_score_correction_bias", (s + ROUTER_BIAS,))]
    out += [HFTensor(h + f"mlp.experts.{e}.{b}.weight", (s + f"feed_forward.experts.{a}",), expert=e)
            for e in range(cfg.num_experts) for a, b in llama.MLP]
    if cfg.num_shared_experts:
        out += [HFTensor(h + f"mlp.shared_experts.{b}.weight", (s + f"feed_forward.shared.{a}",), expert=0)
                for a, b in llama.MLP]
    return out


def drop_mtp_layers(hf: dict[str, Tensor], num_layers: int, path: str = "the folder") -> dict[str, Tensor]:
    """`hf` without the multi-token-prediction layers (model.layers.{num_layers} and above), which transformers
    does not load either; a one-line warning when there are any."""
    pattern = re.compile(r"model\.layers\.(\d+)\.")
    kept = {k: v for k, v in hf.items() if not ((m := pattern.match(k)) and int(m.group(1)) >= num_layers)}
    if len(kept) < len(hf):
        warnings.warn(ModelWarning(f"{path} holds {len(hf) - len(kept)} tensors of multi-token-prediction layers "
                                   f"(model.layers.{num_layers} and above); shoal does not train them and leaves "
                                   "them out, as transformers does"), stacklevel=2)
    return kept


FAMILY = Family(model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM", defaults=DEFAULTS,
                marks=lambda cfg: cfg.latent_attention,
                requires=(("latent-attention", dict(norm="rmsnorm", activation="swiglu", pos_emb="rope")),
                          ("deepseek_v3", _HOLDS)),
                config_in=family_config_in, config_out=config_out, layout=layout, buffers=llama.BUFFERS)
