"""`shoal.from_hf(path)`: a Hugging Face model folder as shoal's own Transformer, weights loaded.

The config maps through shoal.models.hf.config (refusing in one line what shoal does not compute
exactly), the weights through the Transformer adapter's weight map; single-file and sharded safetensors
folders (model.safetensors, or model.safetensors.index.json and its shards) both read.
Plain PyTorch: no distributed imports.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from shoal.models.adapter import TRANSFORMER
from shoal.models.hf.config import config_from_hf
from shoal.models.transformer import Transformer


def load_hf_state(folder: Path | str) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's safetensors (one file or an index and its shards)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            state.update(load_file(str(folder / shard)))
        return state
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"hf folder {str(folder)!r} holds neither model.safetensors nor model.safetensors.index.json; "
                         "valid: a folder written by save_pretrained (safetensors)")
    return load_file(str(single))


def from_hf(path: Path | str, *, dtype: torch.dtype = torch.float32) -> Transformer:
    """shoal's Transformer for the Hugging Face model folder `path`, its weights loaded, for one
    process: forward(input_ids) returns the logits transformers' own model gives, and
    `shoal.apply_plan` takes it like any model."""
    cfg = config_from_hf(path)
    model = Transformer(cfg)
    model.load_state_dict(TRANSFORMER.weight_map().hf_to_shoal(load_hf_state(path), cfg))
    return model.to(dtype)
