"""Reference models: plain PyTorch, no distributed imports."""

from shoal.models.config import PRESETS, ModelConfig, get_preset
from shoal.models.transformer import Transformer

__all__ = ["PRESETS", "ModelConfig", "Transformer", "get_preset"]
