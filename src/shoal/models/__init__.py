"""Reference models: plain PyTorch, no distributed imports.

`Transformer` is imported on first use, so that the configs (and the planner and shoal.rules, which
read only them) import without torch. A model family an experiment brings (shoal.experiments) is
found through the families registry (shoal.models.adapter): `preset` and `build_model` ask it."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from shoal.models.adapter import ModelShape, families, family_named, require_family
from shoal.models.config import PRESETS, ModelConfig, get_preset, parameters_text

if TYPE_CHECKING:
    from torch import nn

    from shoal.models.transformer import Transformer

__all__ = ["PRESETS", "ModelConfig", "ModelShape", "Transformer", "build_model", "get_preset", "parameters_text",
           "preset", "shape_from_dict", "shape_to_dict"]


def preset(name: str) -> ModelShape:
    """The preset called `name`, of any registered family; ValueError listing every valid name otherwise."""
    for family in families():
        if name in family.presets:
            return family.presets[name]
    names = [p for family in families() for p in family.presets]
    raise ValueError(f"unknown model {name!r}; valid: {', '.join(names)} or hf:<dir or config.json>")


def build_model(cfg: ModelShape) -> nn.Module:
    """The module of a shape: its family's module class (a Transformer for a ModelConfig)."""
    module: nn.Module = require_family(cfg).model()(cfg)
    return module


def shape_to_dict(cfg: ModelShape) -> dict[str, Any]:
    """The stored form of a shape (a run folder's [model_config]): its fields, and the `family` key of a family
    other than the transformer's (what `shape_from_dict` reads back)."""
    table = dataclasses.asdict(cfg)
    return table if isinstance(cfg, ModelConfig) else {"family": require_family(cfg).name, **table}


def shape_from_dict(table: dict[str, Any]) -> ModelShape:
    """The shape `shape_to_dict` stored (values as TOML holds them); a one-line ValueError for a bad field."""
    fields = {k: str(v) for k, v in table.items() if k != "family"}
    if "family" not in table:
        return ModelConfig().with_overrides(fields)
    shape: ModelShape = family_named(str(table["family"])).config().with_overrides(fields)
    return shape


def __getattr__(name: str) -> Any:
    if name == "Transformer":
        from shoal.models.transformer import Transformer

        return Transformer
    raise AttributeError(f"module 'shoal.models' has no attribute {name!r}")
