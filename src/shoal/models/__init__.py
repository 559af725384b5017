"""Reference models: plain PyTorch, no distributed imports.

`Transformer` (text) and `Mixer` (images: MLP-Mixer and Sparse-MLP) are imported on first use,
so that the configs (and the planner and shoal.rules, which read only them) import without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shoal.models.config import PRESETS, ModelConfig, get_preset, parameters_text
from shoal.models.mixer_config import MIXER_PRESETS, MixerConfig

if TYPE_CHECKING:
    from torch import nn

    from shoal.models.mixer import Mixer
    from shoal.models.transformer import Transformer

__all__ = ["MIXER_PRESETS", "PRESETS", "AnyConfig", "Mixer", "MixerConfig", "ModelConfig", "Transformer",
           "build_model", "get_preset", "parameters_text", "preset"]

AnyConfig = ModelConfig | MixerConfig
"""A model shape of either family: a text transformer's or an image Mixer's."""


def preset(name: str) -> AnyConfig:
    """The preset called `name`, of either family; ValueError listing every valid name otherwise."""
    if name in MIXER_PRESETS:
        return MIXER_PRESETS[name]
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join([*PRESETS, *MIXER_PRESETS])} "
                         "or hf:<dir or config.json>")
    return PRESETS[name]


def build_model(cfg: AnyConfig) -> nn.Module:
    """The module of a shape: a Transformer, or a Mixer for an image shape."""
    if isinstance(cfg, MixerConfig):
        from shoal.models.mixer import Mixer

        return Mixer(cfg)
    from shoal.models.transformer import Transformer

    return Transformer(cfg)


def __getattr__(name: str) -> Any:
    if name == "Transformer":
        from shoal.models.transformer import Transformer

        return Transformer
    if name == "Mixer":
        from shoal.models.mixer import Mixer

        return Mixer
    raise AttributeError(f"module 'shoal.models' has no attribute {name!r}")
