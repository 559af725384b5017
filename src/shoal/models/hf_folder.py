"""`shoal.from_hf(path)`: a Hugging Face model folder as shoal's own Transformer, weights loaded.

The config maps through its family's module (shoal.models.hf.families, refusing in one line what
shoal does not compute exactly), the weights through the Transformer adapter's weight map; single-file
and sharded safetensors folders (model.safetensors, or model.safetensors.index.json and its shards)
both read. Plain PyTorch: no distributed imports.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shoal.models.adapter import TRANSFORMER
from shoal.models.hf.families import config_from_hf
from shoal.models.safetensors_io import load_hf_state
from shoal.models.transformer import Transformer


def from_hf(path: Path | str, *, dtype: torch.dtype = torch.float32) -> Transformer:
    """shoal's Transformer for the Hugging Face model folder `path`, its weights loaded, for one
    process: forward(input_ids) returns the logits transformers' own model gives, and
    `shoal.parallelize` takes it like any model."""
    cfg = config_from_hf(path)
    model = Transformer(cfg)
    model.load_state_dict(TRANSFORMER.weight_map().hf_to_shoal(load_hf_state(path), cfg))
    return model.to(dtype)
