"""Qwen3-MoE (`model_type` qwen3_moe): Qwen3's attention (an RMSNorm over each query and key head, a
head size of its own) with fine-grained experts: dropless top-k of a softmax router (Mixtral's, with
`norm_topk_prob` choosing whether the chosen weights are renormalised), no shared expert, in every
decoder_sparse_step-th layer except those mlp_only_layers lists, whose dense MLPs are intermediate_size
wide beside the experts' moe_intermediate_size.

The files hold one tensor per expert (`mlp.experts.E.gate_proj.weight`); transformers fuses them in
memory only (`gate_up_proj`, `down_proj`), and both read and write the per-expert files.

Refused: what Llama refuses (shoal.models.hf.llama), and attention_bias. Qwen3-MoE's sliding window,
when `use_sliding_window`, is on every layer (its config has no max_window_layers).
"""

from __future__ import annotations

from typing import Any

from shoal.models.config import ModelConfig
from shoal.models.hf import llama, mixtral
from shoal.models.hf.common import Family, Fields, HFTensor

DEFAULTS: dict[str, Any] = {**llama.DEFAULTS, "max_position_embeddings": 32768, "use_sliding_window": False,
                            "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
                            "num_experts": 128, "norm_topk_prob": False, "output_router_logits": False,
                            "router_aux_loss_coef": 0.001, "mlp_only_layers": []}
_HOLDS = dict(**mixtral.ROUTER_HOLDS,
              bias=False, qkv_bias=False, qk_norm=True, num_prototypes=0, num_shared_experts=0, capacity_factor=0.0,
              share_moe=False)


def config_in(hf: Fields) -> dict[str, Any]:
    dim, heads = llama.shape(hf)
    if hf.get("attention_bias"):
        hf.refuse("attention_bias=true (biases on q, k, v and o)", "false")
    fields = llama.fields(hf, dim=dim, heads=heads, qk_norm=True, window=_window)
    fields.update(mixtral.router_in(hf))
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        hf.refuse(f"mlp_only_layers={dense!r}", "a list of layer indices")
    width, dense_width = hf.required("moe_intermediate_size"), hf.required("intermediate_size")
    # transformers 5 writes num_local_experts (its attribute for num_experts); the hub's files, num_experts
    experts = hf.required("num_local_experts" if hf.get("num_local_experts") is not None else "num_experts")
    fields.update(num_experts=experts, moe_every=hf.required("decoder_sparse_step"),
                  moe_dense_layers=tuple(sorted(set(dense))), ffn_dim=width,
                  dense_ffn_dim=0 if dense_width == width else dense_width, norm_topk=bool(hf.get("norm_topk_prob")))
    return fields


def _window(hf: Fields) -> int:
    """transformers' Qwen3-MoE windows every layer when use_sliding_window (and none otherwise)."""
    return llama.sliding_window(hf) if hf.get("use_sliding_window") else 0


def config_out(cfg: ModelConfig) -> dict[str, Any]:
    dense = sorted(set(cfg.moe_dense_layers) | set(range(min(cfg.moe_first_dense, cfg.num_layers))))
    return {**llama.base_config(cfg, FAMILY), "use_sliding_window": bool(cfg.sliding_window),
            "sliding_window": cfg.sliding_window or None, "attention_bias": False, "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.top_k, "moe_intermediate_size": cfg.ffn_dim, "norm_topk_prob": cfg.norm_topk,
            "decoder_sparse_step": cfg.moe_every, "mlp_only_layers": dense, **mixtral.router_out(cfg)}


def layout(cfg: ModelConfig) -> list[HFTensor]:
    return llama.layout(cfg, _experts)


def _experts(cfg: ModelConfig, i: int, s: str, h: str) -> list[HFTensor]:
    """An MoE layer's router and routed experts (one tensor per expert in the files); a dense SwiGLU MLP
    (of the dense layers' width) on the other layers."""
    if not cfg.is_moe_layer(i):
        return llama.dense_mlp(cfg, i, s, h)
    out = [HFTensor(h + "mlp.gate.weight", (s + "feed_forward.router.gate.weight",))]
    return out + [HFTensor(h + f"mlp.experts.{e}.{b}.weight", (s + f"feed_forward.experts.{a}",), expert=e)
                  for e in range(cfg.num_experts) for a, b in llama.MLP]


FAMILY = Family(model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", defaults=DEFAULTS,
                marks=lambda cfg: bool(cfg.num_experts and cfg.qk_norm),
                requires=(llama.STYLE, ("qwen3_moe", _HOLDS)), config_in=config_in, config_out=config_out,
                layout=layout, buffers=llama.BUFFERS)
