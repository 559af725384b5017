"""The Hugging Face families shoal computes exactly, and the machinery they share: the Transformer
adapter's weight map (shoal.models.adapter, `weight_map()`), which `shoal.from_hf`, `--model hf:`,
`--init` and `shoal export --hf` ask.

Each family is one module (shoal.models.hf.llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe,
deepseek_v3, gpt2)
holding its config in and out, its weight names and layouts, and its refusals; this module finds the
family of a config.json (by `model_type`) or of a shoal config (`hf_family`), and runs the mapping
both ways. Field names and defaults follow transformers' configuration classes (5.x, which also
reads the 4.x layout: `rope_theta` and `rope_scaling` at the top level instead of `rope_parameters`);
config.json is read with plain `json` (no download, transformers not needed).

A shoal model and transformers' model of its family compute the same function with the same
matrices; `hf_layout(cfg)` lists every tensor of the Hugging Face folder with the shoal tensors it
is made of (names, the rotary rows of Llama-style query/key heads, GPT-2's fused and transposed
Conv1D tensors, experts stored one tensor each), and the conversions in both directions follow it.
A config or a shape no supported family holds is a one-line ValueError: nothing is approximated.
Plain tensors only: nothing distributed.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from shoal.models.config import ModelConfig, ModelWarning, get_preset
from shoal.models.hf import deepseek_v3, gpt2, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe
from shoal.models.hf.common import Box, Family, Fields, HFTensor, OpenKey, SliceLayout, read_box

FAMILIES: tuple[Family, ...] = (deepseek_v3.FAMILY, gpt2.FAMILY, qwen2_moe.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY,
                                qwen3.FAMILY, qwen2.FAMILY, mistral.FAMILY, llama.FAMILY)
"""Every family, in the order `hf_family` asks them whether a shoal config is theirs (the first wins)."""
BY_TYPE = {family.model_type: family for family in FAMILIES}
"""The family of a config.json's `model_type`."""
SUPPORTED = tuple(sorted(BY_TYPE))

DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")
"""Dropout rates a family's config.json may set, which shoal's build of it does not apply."""


# ----------------------------------------------------------------------------- configs


def load_model_config(name: str) -> ModelConfig:
    """What `--model` takes: a preset name or `hf:<dir or config.json>`."""
    if name.startswith("hf:"):
        return config_from_hf(name[3:])
    return get_preset(name)


def config_from_hf(path: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json (the file, or a folder holding one).

    One-line ValueError for a missing file, bad JSON, an unsupported model_type or a shape
    shoal cannot build.
    """
    raw = _read(Path(path))
    model_type = raw.get("model_type")
    if model_type not in BY_TYPE:
        raise ValueError(f"hf config {str(path)!r} has model_type {model_type!r}; supported: {', '.join(SUPPORTED)}")
    family = BY_TYPE[model_type]
    fields = family.config_in(Fields(str(path), {**family.defaults, **raw}))
    dropped = [f"{k}={raw[k]}" for k in DROPOUT_KEYS if isinstance(raw.get(k), (int, float)) and raw[k] > 0]
    if dropped:
        warnings.warn(ModelWarning(f"hf config {str(path)!r} sets {', '.join(dropped)}: shoal builds the family "
                                   "without dropout, so it trains without it (an export writes 0)"), stacklevel=2)
    try:
        return ModelConfig(**fields)
    except ValueError as exc:
        raise ValueError(f"hf config {str(path)!r} gives an invalid shoal model: {exc}") from None


def _read(path: Path) -> dict[str, Any]:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        where = f"folder {str(path)!r} holds no config.json" if path.is_dir() else f"{str(path)!r} does not exist"
        raise ValueError(f"hf config: {where}; valid: hf:<folder with config.json> or hf:<path/config.json>")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"hf config {str(file)!r} is not valid JSON ({type(exc).__name__}: {exc}); valid: the "
                         "config.json a Hugging Face model folder holds (save_pretrained writes it)") from None
    if not isinstance(raw, dict):
        raise ValueError(f"hf config {str(file)!r} holds a JSON {type(raw).__name__}, not an object; valid: the "
                         "config.json a Hugging Face model folder holds (save_pretrained writes it)")
    return raw


def family_of(cfg: ModelConfig) -> Family:
    """The family that holds `cfg` exactly; ValueError (one line) if none does."""
    family = next(f for f in FAMILIES if f.marks(cfg))
    for what, wanted in family.requires:
        for name, value in wanted.items():
            if getattr(cfg, name) != value:
                raise ValueError(f"model field {name}={getattr(cfg, name)!r} cannot be written as a Hugging Face "
                                 f"{what} model (it needs {name}={value!r}); supported families: "
                                 f"{', '.join(SUPPORTED)}")
    return family


def hf_family(cfg: ModelConfig) -> str:
    """The Hugging Face model_type that holds `cfg` exactly; ValueError (one line) if none does."""
    return family_of(cfg).model_type


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json transformers builds the family's model from (read by 4.x and 5.x alike)."""
    return family_of(cfg).config_out(cfg)


SELECTION_BIAS = deepseek_v3.ROUTER_BIAS
"""The name ending of a router's selection bias (a buffer; `ModelConfig.router_bias`) in shoal's state dict."""


def writable_config(cfg: ModelConfig, largest_bias: Callable[[], float]) -> ModelConfig:
    """The config a Hugging Face folder of `cfg`'s weights is written as; `largest_bias()` is the largest
    |selection bias| among those weights (asked only when it matters).

    A router's selection bias travels in the family whose model holds one (deepseek_v3's
    e_score_correction_bias). A family without one (mixtral, qwen2_moe, qwen3_moe) takes a model with
    router_bias on only while that bias is zero everywhere, which routes exactly as no bias does: the
    folder is written as `cfg` without it (its weights leave the biases out); a bias that training moved
    is refused in one line, never dropped."""
    if not cfg.router_bias:
        return cfg
    try:
        family_of(cfg)
        return cfg
    except ValueError:
        unbiased = cfg.replace(router_bias=False, router_bias_rate=0.0)
        family = family_of(unbiased)  # whatever else does not fit is refused by its own line
    largest = largest_bias()
    if largest != 0.0:
        raise ValueError(f"model field router_bias=True (moved by router_bias_rate={cfg.router_bias_rate}, largest "
                         f"|bias| {largest:.3g}) cannot be written as a Hugging Face {family.model_type} model, whose "
                         "router has no selection bias; valid: a deepseek_v3-family model (latent attention), or "
                         "a bias that stays zero (router_bias_rate=0)")
    return unbiased


# ----------------------------------------------------------------------------- weights


def is_hf_state(keys: Container[str]) -> bool:
    """Whether a state dict's keys are in a Hugging Face layout this module reads."""
    return any(k in keys for k in (llama.EMBED_KEY, gpt2.EMBED_KEY, gpt2.BARE_EMBED_KEY))


def hf_layout(cfg: ModelConfig) -> list[HFTensor]:
    """Every tensor of the Hugging Face folder for `cfg`, in the file's order (lm_head only when untied)."""
    return family_of(cfg).layout(cfg)


def hf_shape(entry: HFTensor, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of Hugging Face tensor `entry` made of shoal tensors of these shapes."""
    if entry.expert is not None:  # one expert's slice of a stacked tensor
        shapes = [s[1:] for s in shapes]
    shape = list(shapes[0][::-1] if entry.transpose else shapes[0])
    shape[entry.cat_dim] = sum((s[::-1] if entry.transpose else s)[entry.cat_dim] for s in shapes)
    return tuple(shape)


def shoal_to_hf(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """shoal parameter names -> the family's Hugging Face names and layouts.

    With tied embeddings `lm_head.weight` is left out: transformers re-ties it on load. The routers'
    selection biases (buffers, DeepSeek-V3's e_score_correction_bias) are written when `state` holds
    them (a state dict) and left out when it does not (gradients).
    """
    layout = hf_layout(cfg)
    buffers = {p for t in layout for p in t.parts if p.endswith(deepseek_v3.ROUTER_BIAS)}
    _check_keys(state, {p for t in layout for p in t.parts} - buffers, optional={"output.weight"} | buffers,
                layout="shoal")
    return {t.name: to_hf_tensor(t, [state[p] for p in t.parts], cfg) for t in layout
            if all(p in state for p in t.parts)}


def to_hf_tensor(entry: HFTensor, parts: list[Tensor], cfg: ModelConfig) -> Tensor:
    """One Hugging Face tensor from its shoal parts (full tensors)."""
    pieces = [llama.to_halves(w if entry.expert is None else w[entry.expert], llama.rotated_heads(name, cfg),
                              cfg.head_dim) for name, w in zip(entry.parts, parts, strict=True)]
    if entry.transpose:
        pieces = [w.t() for w in pieces]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=entry.cat_dim).contiguous()


def hf_to_shoal(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """The family's Hugging Face names -> shoal parameter names (the inverse of `shoal_to_hf`).

    With tied embeddings `output.weight` is the embedding (any `lm_head.weight` in the file is
    ignored, as transformers itself does), so the result fits shoal's state dict, which lists both.
    """
    family = family_of(cfg)
    layout = family.layout(cfg)
    if family.rename is not None:
        state = family.rename(state)
    needed = {t.name for t in layout}
    ignored = {"lm_head.weight"} | {k for k in state if k.endswith(family.buffers)}
    _check_keys(state, needed, optional=ignored, layout=f"Hugging Face {family.model_type}")
    out: dict[str, Tensor] = {}
    experts: dict[str, list[Tensor]] = {}
    for t in layout:
        w = state[t.name]
        pieces = w.split(list(t.sizes), dim=t.cat_dim) if t.sizes else (
            w.chunk(len(t.parts), dim=t.cat_dim) if len(t.parts) > 1 else (w,))
        for name, piece in zip(t.parts, pieces, strict=True):
            piece = llama.to_pairs((piece.t() if t.transpose else piece).contiguous(), llama.rotated_heads(name, cfg),
                                   cfg.head_dim)
            if t.expert is None:
                out[name] = piece
            else:  # expert t.expert of a stacked tensor; the layout lists them in order
                experts.setdefault(name, []).append(piece)
    out.update({name: torch.stack(pieces) for name, pieces in experts.items()})
    if cfg.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _check_keys(state: dict[str, Tensor], needed: set[str], *, optional: set[str], layout: str) -> None:
    missing, unexpected = sorted(needed - set(state)), sorted(set(state) - needed - optional)
    if missing or unexpected:
        raise ValueError(f"weights in {layout} layout do not fit the model config: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")


# ----------------------------------------------------------------------------- reading slices of files


def _entries_of(cfg: ModelConfig, shoal_name: str) -> list[tuple[HFTensor, int]]:
    """The file tensors holding shoal tensor `shoal_name`, each with the part index it is in them
    (several only for a stacked tensor split per expert in the file, in expert order)."""
    if shoal_name == "output.weight" and cfg.tie_embeddings:
        shoal_name = "tok_embeddings.weight"  # tied: the head is the embedding (a last stage asks by this name)
    found = [(t, t.parts.index(shoal_name)) for t in hf_layout(cfg) if shoal_name in t.parts]
    if not found:
        raise ValueError(f"the model's tensor {shoal_name} has no counterpart in a Hugging Face "
                         f"{hf_family(cfg)} file")
    return found


def _hf_sources(cfg: ModelConfig, shoal_name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    entries = _entries_of(cfg, shoal_name)
    if entries[0][0].expert is not None:
        return {t.name: shape[1:] for t, _ in entries}
    t, _ = entries[0]
    full = list(shape[::-1] if t.transpose else shape)
    full[t.cat_dim] = sum(t.sizes) if t.sizes else full[t.cat_dim] * len(t.parts)
    return {t.name: tuple(full)}


def _hf_read(cfg: ModelConfig, shoal_name: str, shape: tuple[int, ...], box: Box, open_key: OpenKey) -> Tensor:
    """The box of a shoal tensor, reading only what it needs: the experts the box covers (a stacked
    tensor split per expert in the file), this part's columns of a fused tensor (GPT-2's c_attn,
    transposed), or for q/k rows permuted within each head the whole heads the box's rows lie in."""
    entries = _entries_of(cfg, shoal_name)
    t, part = entries[0]
    if t.expert is not None:
        (e0, e1), *rest = box
        by_expert = {entry.expert: entry for entry, _ in entries}
        return torch.stack([read_box(open_key, by_expert[e].name, tuple(rest)) for e in range(e0, e1)])
    heads, hd = llama.rotated_heads(shoal_name, cfg), cfg.head_dim
    if heads:
        (r0, r1), *rest = box
        h0, h1 = r0 // hd, -(-r1 // hd)
        rows = read_box(open_key, t.name, ((h0 * hd, h1 * hd), *rest))
        return llama.to_pairs(rows, h1 - h0, hd)[r0 - h0 * hd:r1 - h0 * hd]
    if len(t.parts) == 1 and not t.transpose:
        return read_box(open_key, t.name, box)
    file_box = list(box[::-1] if t.transpose else box)
    extent = (shape[::-1] if t.transpose else shape)[t.cat_dim]
    start, stop = file_box[t.cat_dim]
    offset = sum(t.sizes[:part]) if t.sizes else part * extent
    file_box[t.cat_dim] = (offset + start, offset + stop)
    piece = read_box(open_key, t.name, tuple(file_box))
    return piece.t() if t.transpose else piece


def _hf_optional(cfg: ModelConfig, key: str) -> bool:
    """Keys a file may hold that no shoal tensor reads: the family's buffers, a tied head."""
    return key.endswith(family_of(cfg).buffers) or (cfg.tie_embeddings and key == "lm_head.weight")


HF_LLAMA = SliceLayout(name="Hugging Face Llama-layout (llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, "
                            "deepseek_v3)",
                       marker=llama.EMBED_KEY, sources=_hf_sources, read_slice=_hf_read, optional=_hf_optional,
                       check=hf_family)
HF_GPT2 = SliceLayout(name="Hugging Face GPT-2", marker=gpt2.EMBED_KEY, sources=_hf_sources, read_slice=_hf_read,
                      optional=_hf_optional, check=hf_family)

SLICE_LAYOUTS: list[SliceLayout] = [HF_LLAMA, HF_GPT2]
"""The file layouts `--init` reads besides shoal's own names, first match wins."""
