"""shoal weights <-> Hugging Face `transformers` LlamaForCausalLM weights, by name and layout.

A shoal Llama-style model and transformers' LlamaForCausalLM compute the same function with the
same matrices, with two differences this module bridges:

- names: `layers.0.attention.wq.weight` is `model.layers.0.self_attn.q_proj.weight`, and so on;
- rotary layout: shoal rotates interleaved pairs (x[2i], x[2i+1]) of each head (Meta's original
  convention, see `apply_rope`); transformers rotates halves (x[i], x[i + E/2]) (`rotate_half`).
  Both use frequency i for pair i, so reordering the rows of each query/key head (shoal row 2i
  -> HF row i, shoal row 2i+1 -> HF row i + E/2) makes the two attention scores identical. The
  value and output projections are not rotated and move unchanged.

Only plain Llama-style shapes map one to one (RoPE, RMSNorm, SwiGLU, no biases, dense); anything
else is a one-line ValueError. Plain tensors only: no torch.distributed here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from shoal.models.config import ModelConfig

EMBED_KEY = "model.embed_tokens.weight"
"""The key that marks a state dict as transformers' Llama layout."""

_SUPPORTED = "rope, rmsnorm, swiglu, bias=False, num_experts=0"


def check_llama(cfg: ModelConfig) -> None:
    """ValueError (one line) unless `cfg` is a Llama-style shape that LlamaForCausalLM can hold."""
    wanted: dict[str, Any] = dict(pos_emb="rope", norm="rmsnorm", activation="swiglu", bias=False, num_experts=0)
    for field, value in wanted.items():
        if getattr(cfg, field) != value:
            raise ValueError(f"model field {field}={getattr(cfg, field)!r} cannot be written as a Hugging Face "
                             f"Llama model; supported: Llama-style models only ({_SUPPORTED})")


def to_hf_llama(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """shoal parameter names -> LlamaForCausalLM names, with q/k rows reordered for rotate_half.

    With tied embeddings `lm_head.weight` is left out: transformers re-ties it on load.
    """
    check_llama(cfg)
    needed = {s for s, _ in _name_pairs(cfg)}
    _check_keys(state, needed, optional={"output.weight"}, layout="shoal")
    out: dict[str, Tensor] = {}
    for shoal_name, hf_name in _name_pairs(cfg):
        out[hf_name] = _to_halves(state[shoal_name], _heads(shoal_name, cfg), cfg.head_dim)
    return out


def from_hf_llama(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """LlamaForCausalLM names -> shoal parameter names (the inverse of `to_hf_llama`).

    With tied embeddings `output.weight` is the embedding (any `lm_head.weight` in the file is
    ignored, as transformers itself does), so the result fits shoal's state dict, which lists both.
    """
    check_llama(cfg)
    needed = {h for _, h in _name_pairs(cfg)}
    ignored = {"lm_head.weight"} | {k for k in state if k.endswith("rotary_emb.inv_freq")}  # older files
    _check_keys(state, needed, optional=ignored, layout="Hugging Face Llama")
    out: dict[str, Tensor] = {}
    for shoal_name, hf_name in _name_pairs(cfg):
        out[shoal_name] = _to_pairs(state[hf_name], _heads(shoal_name, cfg), cfg.head_dim)
    if cfg.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def hf_llama_names(cfg: ModelConfig) -> dict[str, str]:
    """shoal name -> LlamaForCausalLM name of every tensor a Hugging Face folder holds (lm_head
    only when untied), in the file's order."""
    check_llama(cfg)
    return dict(_name_pairs(cfg))


def to_hf_llama_tensor(shoal_name: str, w: Tensor, cfg: ModelConfig) -> Tensor:
    """One tensor in transformers' layout (q/k rows reordered for rotate_half; others as they are)."""
    return _to_halves(w, _heads(shoal_name, cfg), cfg.head_dim)


def hf_llama_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json of LlamaForCausalLM for `cfg` (read by transformers 4.x and 5.x alike)."""
    check_llama(cfg)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "torch_dtype": "float32",
    }


# ----------------------------------------------------------------------------- helpers


def _name_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(shoal name, HF name) for every tensor; lm_head only when untied."""
    pairs = [("tok_embeddings.weight", EMBED_KEY)]
    per_layer = [
        ("attention_norm", "input_layernorm"),
        ("attention.wq", "self_attn.q_proj"), ("attention.wk", "self_attn.k_proj"),
        ("attention.wv", "self_attn.v_proj"), ("attention.wo", "self_attn.o_proj"),
        ("ffn_norm", "post_attention_layernorm"),
        ("feed_forward.w1", "mlp.gate_proj"), ("feed_forward.w3", "mlp.up_proj"), ("feed_forward.w2", "mlp.down_proj"),
    ]
    for i in range(cfg.num_layers):
        pairs += [(f"layers.{i}.{s}.weight", f"model.layers.{i}.{h}.weight") for s, h in per_layer]
    pairs.append(("norm.weight", "model.norm.weight"))
    if not cfg.tie_embeddings:
        pairs.append(("output.weight", "lm_head.weight"))
    return pairs


def _heads(shoal_name: str, cfg: ModelConfig) -> int:
    """Heads whose rows are rotated in this tensor: H for wq, K for wk, 0 for everything else."""
    if shoal_name.endswith("attention.wq.weight"):
        return cfg.num_heads
    return cfg.kv_heads if shoal_name.endswith("attention.wk.weight") else 0


def _to_halves(w: Tensor, heads: int, head_dim: int) -> Tensor:
    """Rows of each head from interleaved pairs (2i, 2i+1) to halves (i, i + E/2)."""
    if not heads:
        return w
    _check_rows(w, heads, head_dim)
    return w.reshape(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape).contiguous()


def _to_pairs(w: Tensor, heads: int, head_dim: int) -> Tensor:
    """Rows of each head from halves (i, i + E/2) to interleaved pairs (2i, 2i+1)."""
    if not heads:
        return w
    _check_rows(w, heads, head_dim)
    return w.reshape(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape).contiguous()


def _check_rows(w: Tensor, heads: int, head_dim: int) -> None:
    if w.dim() != 2 or w.shape[0] != heads * head_dim:
        raise ValueError(f"a query/key projection of shape {tuple(w.shape)} does not hold {heads} heads of "
                         f"{head_dim} rows; the weights do not fit the model config")


def _check_keys(state: dict[str, Tensor], needed: set[str], *, optional: set[str], layout: str) -> None:
    missing, unexpected = sorted(needed - set(state)), sorted(set(state) - needed - optional)
    if missing or unexpected:
        raise ValueError(f"weights in {layout} layout do not fit the model config: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")


# ----------------------------------------------------------------------------- reading slices of files

Box = tuple[tuple[int, int], ...]
"""A slice of a full tensor: (start, stop) along each dimension."""

OpenKey = Callable[[str], Any]
"""File key -> a lazy view of that tensor (safetensors' `safe_open(...).get_slice(key)`: `get_shape()`,
and indexing by a tuple of slices reads just that box)."""


@dataclass(frozen=True)
class SliceLayout:
    """How a family of weight files names and lays out shoal's tensors, read one box at a time.

    `shoal train --init` (shoal/train/pretrained.py) asks the first layout in `SLICE_LAYOUTS` whose
    `marker` key the file holds; a file matching none is read under shoal's own names. A family
    plugs in by adding a layout: `sources` says which file keys (and shapes) hold a shoal tensor,
    which lets the loader check a folder against the model from its headers alone; `read_slice`
    returns the box of the shoal tensor, reading only what it needs through `open_key`. A tensor
    stacked in shoal but split per key in the file (Mixtral's per-expert weights for shoal's
    stacked `experts.w1`) lists every key in `sources` and reads the experts its box covers.
    """

    name: str
    marker: str
    """A key only this family's files hold."""
    sources: Callable[[ModelConfig, str, tuple[int, ...]], dict[str, tuple[int, ...]]]
    """(cfg, shoal name, full shoal shape) -> {file key: the shape it must have}."""
    read_slice: Callable[[ModelConfig, str, tuple[int, ...], Box, OpenKey], Tensor]
    """(cfg, shoal name, full shoal shape, box, open_key) -> the box of the shoal tensor."""
    optional: Callable[[ModelConfig, str], bool]
    """(cfg, file key) -> whether the file may hold this key although no shoal tensor reads it."""
    check: Callable[[ModelConfig], None] = lambda cfg: None
    """ValueError (one line) when the model cannot hold this family's weights at all."""


def read_box(open_key: OpenKey, key: str, box: Box) -> Tensor:
    """The box of file tensor `key`, reading only it."""
    view = open_key(key)
    return view[tuple(slice(a, b) for a, b in box)] if box else view[...]


def _hf_llama_key(cfg: ModelConfig, shoal_name: str) -> str:
    if shoal_name == "output.weight" and cfg.tie_embeddings:
        return EMBED_KEY  # tied: the head is the embedding (a pipeline's last stage asks for it by this name)
    key = hf_llama_names(cfg).get(shoal_name)
    if key is None:
        raise ValueError(f"the model's tensor {shoal_name} has no counterpart in a Hugging Face Llama file")
    return key


def _hf_llama_sources(cfg: ModelConfig, shoal_name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    return {_hf_llama_key(cfg, shoal_name): shape}


def _hf_llama_read(cfg: ModelConfig, shoal_name: str, shape: tuple[int, ...], box: Box, open_key: OpenKey) -> Tensor:
    """q/k rows are permuted within each head: read the whole heads the box's rows lie in, put
    their rows in shoal's order, keep the box's rows."""
    key, heads, hd = _hf_llama_key(cfg, shoal_name), _heads(shoal_name, cfg), cfg.head_dim
    if not heads:
        return read_box(open_key, key, box)
    (r0, r1), *rest = box
    h0, h1 = r0 // hd, -(-r1 // hd)
    rows = read_box(open_key, key, ((h0 * hd, h1 * hd), *rest))
    return _to_pairs(rows, h1 - h0, hd)[r0 - h0 * hd:r1 - h0 * hd]


HF_LLAMA = SliceLayout(
    name="Hugging Face Llama", marker=EMBED_KEY, sources=_hf_llama_sources, read_slice=_hf_llama_read,
    optional=lambda cfg, key: key.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and key == "lm_head.weight"),
    check=check_llama)

SLICE_LAYOUTS: list[SliceLayout] = [HF_LLAMA]
"""The file families `--init` reads besides shoal's own names, first match wins."""
