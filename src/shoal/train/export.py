"""Consolidated single-file weights (safetensors): out of a checkpoint or a live model, and back in.

A DCP checkpoint is a folder of per-rank pieces that only DCP reads; other tools (inference
servers, converters, a notebook) want one file of full tensors. `export_checkpoint` turns a
checkpoint folder into that file in one process, no process group and no model needed: it reads
DCP's metadata for the global shapes, allocates full tensors and lets DCP fill them (that is
DCP's own resharding, to a single unsharded copy). `export_model` writes the same file from a
live, possibly sharded model (every rank calls it; rank 0 writes). `import_weights` loads such a
file into a model under any plan: every rank reads the full tensors (safetensors maps the file,
nothing is copied twice) and torch's `set_model_state_dict` keeps each rank's own shard.

Names are the model's own parameter names without wrapper prefixes ("layers.0.attention.wq.weight").
Only weights travel: optimizer state stays in the checkpoint.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError  # the library's own spelling
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from shoal.parallel.zero import ZeroDataParallel

MODEL_KEY = "model"  # the top-level key shoal.train.checkpoint saves the model state under


def export_checkpoint(checkpoint: Path | str, out: Path | str, *, metadata: dict[str, str] | None = None) -> Path:
    """Write the model weights of DCP checkpoint folder `checkpoint` to one safetensors file `out`."""
    checkpoint, out = Path(checkpoint), Path(out)
    try:
        meta = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    except Exception as exc:  # missing folder, no or unreadable .metadata
        raise ValueError(f"checkpoint {checkpoint} cannot be exported: its DCP metadata is unreadable ({exc})") from None
    prefix = MODEL_KEY + "."
    weights = {
        key[len(prefix):]: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in meta.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }
    if not weights:
        raise ValueError(f"checkpoint {checkpoint} holds no '{MODEL_KEY}.*' tensors; is it a shoal checkpoint?")
    with warnings.catch_warnings():  # no process group is intended here; DCP warns about it anyway
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({MODEL_KEY: weights}, checkpoint_id=str(checkpoint), no_dist=True)
    return _write(weights, out, {"source": str(checkpoint), **(metadata or {})})


def export_model(model: nn.Module, out: Path | str, *, metadata: dict[str, str] | None = None) -> Path | None:
    """Write `model`'s full weights to one safetensors file. Collective over the default process
    group when there is one (sharded parameters are gathered); only rank 0 writes and returns the path."""
    if isinstance(model, ZeroDataParallel):  # its own state dict: sharded float32 masters
        weights = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.model_state_dict().items()}
    else:
        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return _write({k: v.detach() for k, v in weights.items()}, Path(out), metadata or {})


def import_weights(path: Path | str, *, model: nn.Module, strict: bool = True) -> None:
    """Load a safetensors file of full weights into `model` (plain, DDP, FSDP2 or tensor-parallel:
    each rank keeps its own shard). Collective when the model is sharded."""
    path = Path(path)
    try:
        weights = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise ValueError(f"weights file {path} cannot be read as safetensors: {exc}") from None
    zero = isinstance(model, ZeroDataParallel)
    expected = set(model.model_state_dict() if zero else get_model_state_dict(model))
    if strict and set(weights) != expected:
        missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise ValueError(f"weights file {path} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if zero:
        model.load_full_weights(weights)
    else:
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=strict))


def _write(weights: dict[str, torch.Tensor], out: Path, metadata: dict[str, str]) -> Path:
    """Write atomically: a temporary file renamed into place, so a crash never leaves half a file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    # Tied weights are separate copies here (safetensors refuses shared storage); clone to be sure.
    save_file({k: v.contiguous().clone() for k, v in weights.items()}, str(tmp),
              metadata={"format": "pt", **{k: str(v) for k, v in metadata.items()}})
    os.replace(tmp, out)
    return out
