"""What autograd saves for backward, counted on a real forward: the planner's activation terms, measured (the
planner's counts are recounted against these in tests/test_planner_counts.py)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def saved_activation_bytes(model: nn.Module, inputs: torch.Tensor, *, masks: bool = False) -> int:
    """Bytes autograd saves for backward in one forward of `model`, counted as `saved_activation_elements`
    counts them but by each tensor's own dtype (a float32 statistic beside 16-bit activations); `masks`: bool
    tensors (dropout's masks on a GPU) counted too."""
    return sum(nbytes for nbytes, _ in _saved_storages(model, inputs, masks=masks))


def saved_activation_elements(model: nn.Module, inputs: torch.Tensor) -> int:
    """Elements autograd saves for backward in one forward of `model`, each storage counted once
    (parameters, buffers and integer tensors such as token ids left out; a DTensor counted by this
    rank's local tensor): the planner's activation count, measured."""
    return sum(nbytes // size for nbytes, size in _saved_storages(model, inputs, masks=False))


def _saved_storages(model: nn.Module, inputs: torch.Tensor, *, masks: bool) -> list[tuple[int, int]]:
    """(bytes, element size) of each storage autograd saves in one forward of `model`, once each: floating
    tensors (and bool ones with `masks`), not the model's parameters or buffers, a DTensor by its local tensor."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    skip = {local(t).untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    sizes: dict[int, tuple[int, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        here = local(t)
        kept = here.is_floating_point() or (masks and here.dtype == torch.bool)
        if kept and here.untyped_storage().data_ptr() not in skip:
            sizes[here.untyped_storage().data_ptr()] = (here.untyped_storage().nbytes(), here.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs)
    return list(sizes.values())
