"""Qwen3 (`model_type` qwen3): Llama with an RMSNorm over each query and key head, a head size of its
own (`head_dim`), and Qwen's sliding-window switch (shoal.models.hf.qwen2).

Refused: what Qwen2 refuses, and attention_bias (biases on q, k, v and o but not the MLP).
"""

from __future__ import annotations

from typing import Any

from shoal.models.config import ModelConfig
from shoal.models.hf import llama, qwen2
from shoal.models.hf.common import Family, Fields

DEFAULTS: dict[str, Any] = {**llama.DEFAULTS, "max_position_embeddings": 32768, "use_sliding_window": False}


def config_in(hf: Fields) -> dict[str, Any]:
    dim, heads = llama.shape(hf)
    if hf.get("attention_bias"):
        hf.refuse("attention_bias=true (biases on q, k, v and o but not the MLP)", "false")
    return llama.fields(hf, dim=dim, heads=heads, qk_norm=True, window=qwen2.sliding_window)


def config_out(cfg: ModelConfig) -> dict[str, Any]:
    return {**llama.base_config(cfg, FAMILY), **qwen2.window_config(cfg)}


FAMILY = Family(model_type="qwen3", architecture="Qwen3ForCausalLM", defaults=DEFAULTS,
                marks=lambda cfg: cfg.qk_norm, requires=(llama.STYLE, ("qwen3", dict(bias=False, qkv_bias=False))),
                config_in=config_in, config_out=config_out, layout=llama.layout, buffers=llama.BUFFERS)
