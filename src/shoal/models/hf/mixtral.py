"""Mixtral (`model_type` mixtral): Mistral whose every MLP is a Mixture of Experts, dropless top-k with
the chosen weights renormalised; the router's load-balancing loss pooled over all layers as
transformers adds it (with `output_router_logits`).

Refused: what Mistral refuses (shoal.models.hf.mistral). Written from shoal: an MoE layer in every
block, no capacity limit, renormalised top-k, no shared experts.
"""

from __future__ import annotations

from typing import Any

from shoal.models.config import ModelConfig
from shoal.models.hf import llama, mistral
from shoal.models.hf.common import Family, Fields, HFTensor

DEFAULTS: dict[str, Any] = {**llama.DEFAULTS, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                            "max_position_embeddings": 131072, "num_local_experts": 8, "num_experts_per_tok": 2,
                            "router_aux_loss_coef": 0.001, "output_router_logits": False, "sliding_window": None}
ROUTER_HOLDS = dict(router_score="softmax", router_groups=0, router_scale=1.0, router_bias=False)
"""The router options transformers' softmax families (Mixtral, Qwen2-MoE, Qwen3-MoE) do not have."""
_HOLDS = dict(**ROUTER_HOLDS,
              bias=False, qkv_bias=False, qk_norm=False, moe_every=1, num_prototypes=0, capacity_factor=0.0,
              norm_topk=True, share_moe=False,
              moe_first_dense=0, moe_dense_layers=(), dense_ffn_dim=0)


def config_in(hf: Fields) -> dict[str, Any]:
    dim, heads = llama.shape(hf)
    fields = llama.fields(hf, dim=dim, heads=heads)
    fields.update(router_in(hf))
    fields.update(num_experts=hf.required("num_local_experts"), moe_every=1, norm_topk=True)
    return fields


def router_in(hf: Fields) -> dict[str, Any]:
    """The router of transformers' dropless MoE families (Mixtral, Qwen2-MoE): top-k of
    num_experts_per_tok, no capacity limit, no z-loss. With output_router_logits, transformers' loss
    adds router_aux_loss_coef x the load-balancing loss pooled over every layer (shoal's
    aux_loss_pooled); without it, no router loss at all."""
    pooled = bool(hf.get("output_router_logits"))
    return dict(capacity_factor=0.0, aux_loss_coef=float(hf.get("router_aux_loss_coef")) if pooled else 0.0,
                aux_loss_pooled=pooled, z_loss_coef=0.0, top_k=hf.required("num_experts_per_tok"))


def config_out(cfg: ModelConfig) -> dict[str, Any]:
    return {**llama.base_config(cfg, FAMILY), **mistral.window_config(cfg), "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.top_k, **router_out(cfg)}


def router_out(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' router-loss fields: on (with its weight) where shoal pools the loss as transformers does."""
    if cfg.aux_loss_pooled:
        return {"output_router_logits": True, "router_aux_loss_coef": cfg.aux_loss_coef}
    return {"output_router_logits": False}


def layout(cfg: ModelConfig) -> list[HFTensor]:
    return llama.layout(cfg, _experts)


def _experts(cfg: ModelConfig, i: int, s: str, h: str) -> list[HFTensor]:
    """The router and one tensor per expert: the files' layout (transformers fuses the experts only in memory)."""
    if not cfg.is_moe_layer(i):
        return llama.dense_mlp(cfg, i, s, h)
    out = [HFTensor(h + "block_sparse_moe.gate.weight", (s + "feed_forward.router.gate.weight",))]
    return out + [HFTensor(h + f"block_sparse_moe.experts.{e}.{w}.weight", (s + f"feed_forward.experts.{w}",),
                           expert=e) for e in range(cfg.num_experts) for w in ("w1", "w2", "w3")]


FAMILY = Family(model_type="mixtral", architecture="MixtralForCausalLM", defaults=DEFAULTS,
                marks=lambda cfg: bool(cfg.num_experts), requires=(llama.STYLE, ("mixtral", _HOLDS)),
                config_in=config_in, config_out=config_out, layout=layout, buffers=llama.BUFFERS)
