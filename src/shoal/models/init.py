"""Initial weights as a function of the run's seed and each parameter's name alone.

Every value of a parameter is drawn from a generator seeded by (seed, parameter name, block of
rows): the rows along the first dimension are cut into blocks of about a million values, and
block b's values come from its own generator. A rank that holds a slice of a parameter (a shard
of any plan) draws only the blocks its rows lie in and keeps its slice of them, so every plan
starts from the same full weights as one process, and no rank ever holds the whole model.
Pure torch: the caller says which slice (shoal/parallel/materialize.py does, for shards).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

BLOCK_VALUES = 2**20
"""Values per generator block (at least one row): small enough that a rank's transient is
small, large enough that the generator's set-up is negligible."""


@dataclass(frozen=True)
class InitSpec:
    """How one parameter starts: normal(0, std), ones or zeros."""

    kind: str
    std: float = 0.0


def block_seed(seed: int, name: str, block: int) -> int:
    """A 63-bit generator seed for block `block` of parameter `name`, stable across processes and runs."""
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@torch.no_grad()
def fill_slice_(out: torch.Tensor, spec: InitSpec, *, seed: int, name: str, shape: Sequence[int],
                offset: Sequence[int]) -> torch.Tensor:
    """Fill `out` with the slice of parameter `name` (full shape `shape`) that starts at `offset`
    and has out's shape."""
    if spec.kind == "ones":
        return out.fill_(1.0)
    if spec.kind == "zeros":
        return out.zero_()
    assert spec.kind == "normal", spec.kind
    if out.numel() == 0:
        return out
    rows = shape[0] if shape else 1
    row_values = math.prod(shape[1:]) if len(shape) > 1 else 1
    per_block = max(1, BLOCK_VALUES // max(1, row_values))
    lo, hi = (offset[0], offset[0] + out.shape[0]) if shape else (0, 1)
    inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], out.shape[1:], strict=True))
    for block in range(lo // per_block, (hi - 1) // per_block + 1):
        first = block * per_block
        count = min(rows, first + per_block) - first
        gen = torch.Generator().manual_seed(block_seed(seed, name, block))
        values = torch.randn((count, *shape[1:]), generator=gen, dtype=torch.float32).mul_(spec.std)
        a, b = max(lo, first), min(hi, first + count)
        piece = values[(slice(a - first, b - first), *inner)] if shape else values.reshape(())
        if shape:
            out[a - lo:b - lo].copy_(piece)
        else:
            out.copy_(piece)
    return out
