"""The loss's contract, a leaf every layer may import: the target that takes no loss, a micro-batch, and the
type of a loss function. The functions that compute the loss under a plan live in shoal.parallel.loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    import torch

IGNORE = -100
"""A target that takes no loss (a prompt or user token of fine-tuning data, a padded image's label): torch's
ignore_index."""

Batch: TypeAlias = "tuple[torch.Tensor, torch.Tensor]"
"""One micro-batch: (inputs, targets)."""

LossFn: TypeAlias = "Callable[[torch.Tensor, torch.Tensor], torch.Tensor]"
"""(model output, targets) -> the mean loss of one micro-batch (Runtime.share weighs it)."""
