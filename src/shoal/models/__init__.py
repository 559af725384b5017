"""Reference models: plain PyTorch, no distributed imports.

`Transformer` is imported on first use, so that the configs (and the planner, which reads only
them) import without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shoal.models.config import PRESETS, ModelConfig, get_preset

if TYPE_CHECKING:
    from shoal.models.transformer import Transformer

__all__ = ["PRESETS", "ModelConfig", "Transformer", "get_preset"]


def __getattr__(name: str) -> Any:
    if name == "Transformer":
        from shoal.models.transformer import Transformer

        return Transformer
    raise AttributeError(f"module 'shoal.models' has no attribute {name!r}")
