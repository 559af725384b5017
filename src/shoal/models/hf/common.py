"""What every Hugging Face family module is made of: the `Family` record, the config reader with its
one-line refusals, and the description of one file tensor (`HFTensor`) and of a file layout read one
box at a time (`SliceLayout`).

Plain data and small functions: no torch at import (the tensors' type only under TYPE_CHECKING).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from shoal.models.config import ModelConfig

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class HFTensor:
    """One tensor of a Hugging Face folder: `name`, made of shoal tensors `parts` concatenated along
    `cat_dim` (of the Hugging Face tensor), each transposed first when `transpose` (Conv1D)."""

    name: str
    parts: tuple[str, ...]
    transpose: bool = False
    cat_dim: int = 0
    expert: int | None = None
    """The HF tensor is this expert's slice (dim 0) of the one stacked shoal tensor in `parts`."""
    sizes: tuple[int, ...] = ()
    """The parts' extents along `cat_dim` where they differ (DeepSeek's kv_a_proj_with_mqa: the latent's
    rows over the rotary key's); empty: equal parts."""


class Fields:
    """A config.json's fields over the family's defaults; one-line errors and refusals name the file.

    `read` records every key a family's mapping asks for (a nested object's keys as `outer.key`), so
    that the keys a mapping reads are found by running it (tests/test_config_mapping.py)."""

    def __init__(self, path: str, values: dict[str, Any], *, read: set[str] | None = None, prefix: str = "") -> None:
        self.path, self.values = path, values
        self.read: set[str] = set() if read is None else read
        self._prefix = prefix

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(self._prefix + key)
        value = self.values.get(key, default)
        return default if value is None and default is not None else value

    def within(self, key: str, values: dict[str, Any]) -> Fields:
        """The fields of a nested object (`values`, read from `key`), whose reads are recorded here as `key.name`."""
        return Fields(self.path, values, read=self.read, prefix=f"{self._prefix}{key}.")

    def required(self, key: str) -> int:
        self.read.add(self._prefix + key)
        value = self.values.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"hf config {self.path!r} needs {key!r} as a whole number >= 1; got {value!r}")
        return value

    def refuse(self, what: str, valid: str) -> NoReturn:
        raise ValueError(f"hf config {self.path!r} ({self.values.get('model_type')}) has {what}, which shoal does not "
                         f"compute exactly; valid: {valid}")


@dataclass(frozen=True, kw_only=True)
class Family:
    """One Hugging Face family (a transformers `model_type`) that shoal's Transformer computes exactly."""

    model_type: str
    """config.json's `model_type`."""
    architecture: str
    """transformers' class for causal language modelling, config.json's `architectures`."""
    defaults: Mapping[str, Any]
    """transformers' defaults for the fields a config.json may leave out (shape fields are required)."""
    marks: Callable[[ModelConfig], bool]
    """Whether a shoal config has the feature that makes it this family (asked in `families.FAMILIES`' order)."""
    requires: tuple[tuple[str, Mapping[str, Any]], ...]
    """(what, {field: value}) pairs a shoal config of this family must match, checked in order, where a
    differing field is refused in one line naming `what` (`families.family_of`)."""
    config_in: Callable[[Fields], dict[str, Any]]
    """The ModelConfig fields of a config.json (refusing in one line what shoal does not compute exactly)."""
    config_out: Callable[[ModelConfig], dict[str, Any]]
    """The config.json transformers builds the family's model from (read by 4.x and 5.x alike)."""
    layout: Callable[[ModelConfig], list[HFTensor]]
    """Every tensor of the family's folder, in the file's order (lm_head only when untied)."""
    buffers: tuple[str, ...] = ()
    """Endings of keys that files hold beside the weights (buffers no shoal tensor reads)."""
    rename: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """A file's state with its keys as `layout` names them (GPT-2's original release lacks the
    `transformer.` prefix); None: as they are."""


def base_fields(hf: Fields, *, dim: int, heads: int, layers_key: str = "num_hidden_layers") -> dict[str, Any]:
    """The ModelConfig fields every family reads alike: depth, width, heads, vocabulary, tying, init."""
    fields: dict[str, Any] = dict(
        num_layers=hf.required(layers_key), dim=dim, num_heads=heads, vocab_size=hf.required("vocab_size"),
        tie_embeddings=bool(hf.get("tie_word_embeddings")),
    )
    if isinstance(hf.get("initializer_range"), (int, float)):
        fields["init_std"] = float(hf.get("initializer_range"))
    return fields


# ----------------------------------------------------------------------------- reading slices of files

Box = tuple[tuple[int, int], ...]
"""A slice of a full tensor: (start, stop) along each dimension."""

OpenKey = Callable[[str], Any]
"""File key -> a lazy view of that tensor (safetensors' `safe_open(...).get_slice(key)`: `get_shape()`,
and indexing by a tuple of slices reads just that box)."""


@dataclass(frozen=True)
class SliceLayout:
    """How a family of weight files names and lays out shoal's tensors, read one box at a time.

    `shoal train --init` (shoal.models.safetensors_io.open_pretrained) asks the first layout in the
    weight map's `SLICE_LAYOUTS` whose `marker` key the file holds; a file matching none is read under
    shoal's own names. `sources` says which file keys (and shapes) hold a shoal tensor, which lets the
    loader check a folder against the model from its headers alone; `read_slice` returns the box of
    the shoal tensor, reading only what it needs through `open_key`. A tensor stacked in shoal but
    split per key in the file (Mixtral's per-expert weights for shoal's stacked `experts.w1`) lists
    every key in `sources` and reads the experts its box covers.
    """

    name: str
    marker: str
    """A key only this layout's files hold."""
    sources: Callable[[ModelConfig, str, tuple[int, ...]], dict[str, tuple[int, ...]]]
    """(cfg, shoal name, full shoal shape) -> {file key: the shape it must have}."""
    read_slice: Callable[[ModelConfig, str, tuple[int, ...], Box, OpenKey], Tensor]
    """(cfg, shoal name, full shoal shape, box, open_key) -> the box of the shoal tensor."""
    optional: Callable[[ModelConfig, str], bool]
    """(cfg, file key) -> whether the file may hold this key although no shoal tensor reads it."""
    check: Callable[[ModelConfig], object] = lambda cfg: None
    """ValueError (one line) when the model cannot hold this layout's weights at all."""


def read_box(open_key: OpenKey, key: str, box: Box) -> Tensor:
    """The box of file tensor `key`, reading only it."""
    view = open_key(key)
    return view[tuple(slice(a, b) for a, b in box)] if box else view[...]
