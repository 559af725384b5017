"""Mistral (`model_type` mistral): Llama with sliding-window attention on every layer.

Refused: what Llama refuses (shoal.models.hf.llama), and a sliding window that is not a whole number.
"""

from __future__ import annotations

from typing import Any

from shoal.models.config import ModelConfig
from shoal.models.hf import llama
from shoal.models.hf.common import Family, Fields

DEFAULTS: dict[str, Any] = {**llama.DEFAULTS, "max_position_embeddings": 131072, "sliding_window": 4096}


def config_in(hf: Fields) -> dict[str, Any]:
    dim, heads = llama.shape(hf)
    return llama.fields(hf, dim=dim, heads=heads)


def config_out(cfg: ModelConfig) -> dict[str, Any]:
    return {**llama.base_config(cfg, FAMILY), **window_config(cfg)}


def window_config(cfg: ModelConfig) -> dict[str, Any]:
    """Mistral's window field: on every layer, or null."""
    return {"sliding_window": cfg.sliding_window or None}


FAMILY = Family(model_type="mistral", architecture="MistralForCausalLM", defaults=DEFAULTS,
                marks=lambda cfg: bool(cfg.sliding_window), requires=(llama.STYLE, ("mistral", dict(bias=False))),
                config_in=config_in, config_out=config_out, layout=llama.layout, buffers=llama.BUFFERS)
