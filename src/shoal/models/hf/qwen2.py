"""Qwen2 (`model_type` qwen2): Llama with biases on the query, key and value projections (not on the
output projection nor the MLP), and Qwen's sliding-window switch (`use_sliding_window`,
`max_window_layers`, `layer_types`) that Qwen3 and Qwen2-MoE share.

Refused: what Llama refuses (shoal.models.hf.llama), and a sliding window on some layers only.
"""

from __future__ import annotations

from typing import Any

from shoal.models.config import ModelConfig
from shoal.models.hf import llama
from shoal.models.hf.common import Family, Fields

DEFAULTS: dict[str, Any] = {**llama.DEFAULTS, "max_position_embeddings": 32768, "use_sliding_window": False}


def config_in(hf: Fields) -> dict[str, Any]:
    dim, heads = llama.shape(hf)
    return llama.fields(hf, dim=dim, heads=heads, qkv_bias=True, window=sliding_window)


def sliding_window(hf: Fields) -> int:
    """The sliding window every layer uses (0: none); a window on some layers only is refused."""
    if not hf.get("use_sliding_window"):
        return 0
    layer_types = hf.get("layer_types")
    first_windowed = hf.get("max_window_layers", 28)
    if layer_types is not None:
        windowed = [t == "sliding_attention" for t in layer_types]
    else:
        windowed = [i >= first_windowed for i in range(hf.required("num_hidden_layers"))]
    if not all(windowed) and any(windowed):
        hf.refuse("a sliding window on some layers only (max_window_layers / layer_types)",
                  "use_sliding_window=false, or a window on every layer")
    if not any(windowed):
        return 0
    return llama.sliding_window(hf)


def config_out(cfg: ModelConfig) -> dict[str, Any]:
    return {**llama.base_config(cfg, FAMILY), **window_config(cfg)}


def window_config(cfg: ModelConfig) -> dict[str, Any]:
    """Qwen's window fields: a window on every layer is one from layer 0 on, and each layer's type is written
    out (transformers' Qwen2-MoE derives absent layer types otherwise: a window on even layers only)."""
    kind = "sliding_attention" if cfg.sliding_window else "full_attention"
    return dict(use_sliding_window=bool(cfg.sliding_window), sliding_window=cfg.sliding_window or None,
                max_window_layers=0, layer_types=[kind] * cfg.num_layers, attention_bias=False)


FAMILY = Family(model_type="qwen2", architecture="Qwen2ForCausalLM", defaults=DEFAULTS,
                marks=lambda cfg: cfg.qkv_bias, requires=(llama.STYLE, ("qwen2", dict(bias=False, head_size=0))),
                config_in=config_in, config_out=config_out, layout=llama.layout, buffers=llama.BUFFERS)
