"""shoal: hybrid-parallel training of dense and Mixture-of-Experts transformers.

`shoal.from_hf(path)` is imported on first use, so `import shoal` stays light (no torch)."""

from __future__ import annotations

from typing import Any

__all__ = ["from_hf"]


def __getattr__(name: str) -> Any:
    if name == "from_hf":
        from shoal.models.hf.model import from_hf

        return from_hf
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")
