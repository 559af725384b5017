"""Qwen2-MoE (`model_type` qwen2_moe): Qwen2 whose MLPs every decoder_sparse_step-th layer are a
Mixture of Experts (dropless top-k, as Mixtral's router) with one shared expert beside them behind a
sigmoid gate.

Refused: what Qwen2 refuses (shoal.models.hf.qwen2), mlp_only_layers, qkv_bias=false, and dense
layers of another width than the experts'.
"""

from __future__ import annotations

from typing import Any

from shoal.models.config import ModelConfig
from shoal.models.hf import llama, mixtral, qwen2
from shoal.models.hf.common import Family, Fields, HFTensor

DEFAULTS: dict[str, Any] = {**llama.DEFAULTS, "max_position_embeddings": 32768, "use_sliding_window": False,
                            "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
                            "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
                            "norm_topk_prob": False, "output_router_logits": False, "router_aux_loss_coef": 0.001,
                            "mlp_only_layers": [], "qkv_bias": True}
_HOLDS = dict(**mixtral.ROUTER_HOLDS,
              bias=False, qkv_bias=True, qk_norm=False, num_prototypes=0, num_shared_experts=1, shared_gate=True,
              capacity_factor=0.0, share_moe=False, head_size=0,
              moe_first_dense=0, moe_dense_layers=(), dense_ffn_dim=0)


def config_in(hf: Fields) -> dict[str, Any]:
    dim, heads = llama.shape(hf)
    fields = llama.fields(hf, dim=dim, heads=heads, qkv_bias=True, window=qwen2.sliding_window)
    fields.update(mixtral.router_in(hf))
    if hf.get("mlp_only_layers"):
        hf.refuse(f"mlp_only_layers={hf.get('mlp_only_layers')}", "[] (MoE layers every decoder_sparse_step-th)")
    if not hf.get("qkv_bias"):
        hf.refuse("qkv_bias=false", "true")
    step, width = hf.required("decoder_sparse_step"), hf.required("moe_intermediate_size")
    if step > 1 and hf.required("intermediate_size") != width:
        hf.refuse(f"intermediate_size={hf.get('intermediate_size')} (dense layers) beside moe_intermediate_size="
                  f"{width}", "equal widths, or decoder_sparse_step=1")
    fields.update(num_experts=hf.required("num_experts"), moe_every=step, ffn_dim=width,
                  norm_topk=bool(hf.get("norm_topk_prob")), num_shared_experts=1, shared_gate=True,
                  shared_ffn_dim=hf.required("shared_expert_intermediate_size"))
    return fields


def config_out(cfg: ModelConfig) -> dict[str, Any]:
    return {**llama.base_config(cfg, FAMILY), **qwen2.window_config(cfg), "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.top_k, "moe_intermediate_size": cfg.ffn_dim,
            "shared_expert_intermediate_size": cfg.shared_ffn_dim or cfg.ffn_dim, "norm_topk_prob": cfg.norm_topk,
            "decoder_sparse_step": cfg.moe_every, "mlp_only_layers": [], "qkv_bias": True,
            **mixtral.router_out(cfg)}


def layout(cfg: ModelConfig) -> list[HFTensor]:
    return llama.layout(cfg, _experts)


def _experts(cfg: ModelConfig, i: int, s: str, h: str) -> list[HFTensor]:
    """An MoE layer's router, routed experts (one tensor per expert in the files), shared expert and its
    gate; a dense SwiGLU MLP on the other layers."""
    if not cfg.is_moe_layer(i):
        return llama.dense_mlp(cfg, i, s, h)
    out = [HFTensor(h + "mlp.gate.weight", (s + "feed_forward.router.gate.weight",))]
    out += [HFTensor(h + f"mlp.experts.{e}.{b}.weight", (s + f"feed_forward.experts.{a}",), expert=e)
            for e in range(cfg.num_experts) for a, b in llama.MLP]
    out += [HFTensor(h + f"mlp.shared_expert.{b}.weight", (s + f"feed_forward.shared.{a}",), expert=0)
            for a, b in llama.MLP]
    return out + [HFTensor(h + "mlp.shared_expert_gate.weight", (s + "feed_forward.shared_gate.weight",))]


FAMILY = Family(model_type="qwen2_moe", architecture="Qwen2MoeForCausalLM", defaults=DEFAULTS,
                marks=lambda cfg: bool(cfg.num_experts and cfg.num_shared_experts),
                requires=(llama.STYLE, ("qwen2_moe", _HOLDS)), config_in=config_in, config_out=config_out,
                layout=layout, buffers=llama.BUFFERS)
