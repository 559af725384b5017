"""shoal weights <-> Hugging Face `transformers` weights, by name and layout, for every family
shoal computes exactly: Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE (transformers' Llama
layout) and GPT-2.

A shoal model and transformers' model of its family compute the same function with the same
matrices, with these differences this module bridges:

- names: `layers.0.attention.wq.weight` is `model.layers.0.self_attn.q_proj.weight`, and so on;
- rotary layout: shoal rotates interleaved pairs (x[2i], x[2i+1]) of each head (Meta's original
  convention, see `apply_rope`); transformers rotates halves (x[i], x[i + E/2]) (`rotate_half`).
  Both use frequency i for pair i, so reordering the rows of each query/key head (shoal row 2i
  -> HF row i, shoal row 2i+1 -> HF row i + E/2) makes the two attention scores identical. Query
  and key biases and Qwen3's per-head q/k norm weights move with their rows. The value and output
  projections are not rotated and move unchanged;
- fused tensors: GPT-2's `c_attn` holds q, k and v side by side, and its Conv1D layers store
  weights as (in, out); shoal stacks each MoE layer's experts in one tensor per matrix, where
  Mixtral's files hold one tensor per expert (`block_sparse_moe.experts.{e}.w1`).

`hf_layout(cfg)` lists every tensor of the Hugging Face folder with the shoal tensors it is made
of; the conversions in both directions follow it. A shape no supported family holds is a one-line
ValueError. Plain tensors only: no torch.distributed here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from shoal.models.config import ModelConfig

EMBED_KEY = "model.embed_tokens.weight"
"""The key that marks a state dict as transformers' Llama layout."""
GPT2_EMBED_KEY = "transformer.wte.weight"
"""The key that marks a state dict as transformers' GPT-2 layout."""

FAMILIES = ("gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3")
_ARCHITECTURES = dict(llama="LlamaForCausalLM", mistral="MistralForCausalLM", qwen2="Qwen2ForCausalLM",
                      qwen3="Qwen3ForCausalLM", mixtral="MixtralForCausalLM", qwen2_moe="Qwen2MoeForCausalLM",
                      gpt2="GPT2LMHeadModel")


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


def is_hf_state(keys: Any) -> bool:
    """Whether a state dict's keys are in a Hugging Face layout this module reads."""
    return any(k in keys for k in (EMBED_KEY, GPT2_EMBED_KEY, "wte.weight"))


def hf_family(cfg: ModelConfig) -> str:
    """The Hugging Face model_type that holds `cfg` exactly; ValueError (one line) if none does."""
    if cfg.pos_emb == "learned":
        gpt2 = dict(norm="layernorm", activation="gelu", bias=True, qkv_bias=False, qk_norm=False, sliding_window=0,
                    head_size=0, num_experts=0, num_kv_heads=None)
        _require(cfg, gpt2, "gpt2")
        return "gpt2"
    _require(cfg, dict(norm="rmsnorm", activation="swiglu"), "Llama-style")
    if cfg.num_experts and cfg.num_shared_experts:
        qwen2_moe = dict(bias=False, qkv_bias=True, qk_norm=False, num_prototypes=0, num_shared_experts=1,
                         shared_gate=True, capacity_factor=0.0, share_moe=False, head_size=0)
        _require(cfg, qwen2_moe, "qwen2_moe")
        return "qwen2_moe"
    if cfg.num_experts:
        mixtral = dict(bias=False, qkv_bias=False, qk_norm=False, moe_every=1, num_prototypes=0, capacity_factor=0.0,
                       norm_topk=True, share_moe=False)
        _require(cfg, mixtral, "mixtral")
        return "mixtral"
    if cfg.qk_norm:
        _require(cfg, dict(bias=False, qkv_bias=False), "qwen3")
        return "qwen3"
    if cfg.qkv_bias:
        _require(cfg, dict(bias=False, head_size=0), "qwen2")
        return "qwen2"
    if cfg.sliding_window:
        _require(cfg, dict(bias=False), "mistral")
        return "mistral"
    return "llama"


def check_llama(cfg: ModelConfig) -> None:
    """ValueError (one line) unless some supported Hugging Face family holds `cfg` exactly."""
    hf_family(cfg)


def hf_layout(cfg: ModelConfig) -> list[HFTensor]:
    """Every tensor of the Hugging Face folder for `cfg`, in the file's order (lm_head only when untied)."""
    return _gpt2_layout(cfg) if hf_family(cfg) == "gpt2" else _llama_layout(cfg)


def shoal_to_hf(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """shoal parameter names -> the family's Hugging Face names and layouts.

    With tied embeddings `lm_head.weight` is left out: transformers re-ties it on load.
    """
    layout = hf_layout(cfg)
    _check_keys(state, {p for t in layout for p in t.parts}, optional={"output.weight"}, layout="shoal")
    return {t.name: to_hf_tensor(t, [state[p] for p in t.parts], cfg) for t in layout}


def _expert_slice(entry: HFTensor, w: Tensor) -> Tensor:
    return w if entry.expert is None else w[entry.expert]


def to_hf_tensor(entry: HFTensor, parts: list[Tensor], cfg: ModelConfig) -> Tensor:
    """One Hugging Face tensor from its shoal parts (full tensors)."""
    pieces = [_to_halves(_expert_slice(entry, w), _heads(name, cfg), cfg.head_dim)
              for name, w in zip(entry.parts, parts, strict=True)]
    if entry.transpose:
        pieces = [w.t() for w in pieces]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=entry.cat_dim).contiguous()


def hf_to_shoal(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """The family's Hugging Face names -> shoal parameter names (the inverse of `shoal_to_hf`).

    With tied embeddings `output.weight` is the embedding (any `lm_head.weight` in the file is
    ignored, as transformers itself does), so the result fits shoal's state dict, which lists both.
    GPT-2 files written without the `transformer.` prefix (the original release) read alike.
    """
    layout = hf_layout(cfg)
    if hf_family(cfg) == "gpt2" and GPT2_EMBED_KEY not in state:
        state = {k if k.startswith("lm_head.") else "transformer." + k: v for k, v in state.items()}
    needed = {t.name for t in layout}
    ignored = {"lm_head.weight"} | {k for k in state if k.endswith(("rotary_emb.inv_freq", ".attn.bias",
                                                                    ".attn.masked_bias"))}  # older files' buffers
    _check_keys(state, needed, optional=ignored, layout=f"Hugging Face {hf_family(cfg)}")
    out: dict[str, Tensor] = {}
    experts: dict[str, list[Tensor]] = {}
    for t in layout:
        w = state[t.name]
        pieces = w.chunk(len(t.parts), dim=t.cat_dim) if len(t.parts) > 1 else (w,)
        for name, piece in zip(t.parts, pieces, strict=True):
            piece = _to_pairs((piece.t() if t.transpose else piece).contiguous(), _heads(name, cfg), cfg.head_dim)
            if t.expert is None:
                out[name] = piece
            else:  # expert t.expert of a stacked tensor; the layout lists them in order
                experts.setdefault(name, []).append(piece)
    out.update({name: torch.stack(pieces) for name, pieces in experts.items()})
    if cfg.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json transformers builds the family's model from (read by 4.x and 5.x alike)."""
    family = hf_family(cfg)
    if family == "gpt2":
        return {"architectures": [_ARCHITECTURES[family]], "model_type": "gpt2", "n_embd": cfg.dim,
                "n_layer": cfg.num_layers, "n_head": cfg.num_heads, "n_inner": cfg.ffn_dim,
                "n_positions": cfg.max_seq_len, "vocab_size": cfg.vocab_size, "layer_norm_epsilon": cfg.norm_eps,
                "activation_function": "gelu_new", "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
                "attn_pdrop": cfg.dropout, "tie_word_embeddings": cfg.tie_embeddings,
                "initializer_range": cfg.init_std, "torch_dtype": "float32"}
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[family]], "model_type": family,
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "num_hidden_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_dropout": cfg.dropout, "initializer_range": cfg.init_std, "torch_dtype": "float32",
    }
    if cfg.rope_type != "default":
        out["rope_parameters"] = out["rope_scaling"] = _rope_parameters(cfg)
    if family == "llama":
        out.update(attention_bias=cfg.bias, mlp_bias=cfg.bias)
    if family in ("mistral", "mixtral"):
        out["sliding_window"] = cfg.sliding_window or None
    if family in ("qwen2", "qwen3", "qwen2_moe"):  # a window on every layer: from layer 0 on
        out.update(use_sliding_window=bool(cfg.sliding_window), sliding_window=cfg.sliding_window or None,
                   max_window_layers=0, attention_bias=False)
    if family == "mixtral":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, **_router_loss(cfg))
    if family == "qwen2_moe":
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.ffn_dim,
                   shared_expert_intermediate_size=cfg.shared_ffn_dim or cfg.ffn_dim, norm_topk_prob=cfg.norm_topk,
                   decoder_sparse_step=cfg.moe_every, mlp_only_layers=[], qkv_bias=True, **_router_loss(cfg))
    return out


# Names kept for callers written when Llama was the only family.
to_hf_llama, from_hf_llama, hf_llama_config = shoal_to_hf, hf_to_shoal, hf_config


def hf_llama_names(cfg: ModelConfig) -> dict[str, str]:
    """shoal name -> Hugging Face name of every tensor a folder holds, for families whose tensors
    map one to one (not GPT-2's fused c_attn nor Mixtral's per-expert tensors: see hf_layout)."""
    layout = hf_layout(cfg)
    fused = [t.name for t in layout if len(t.parts) > 1 or t.transpose or t.expert is not None]
    if fused:
        raise ValueError(f"Hugging Face {hf_family(cfg)} tensor {fused[0]!r} is not one shoal tensor; use hf_layout")
    return {t.parts[0]: t.name for t in layout}


def to_hf_llama_tensor(shoal_name: str, w: Tensor, cfg: ModelConfig) -> Tensor:
    """One tensor in transformers' layout (q/k rows reordered for rotate_half; others as they are)."""
    return _to_halves(w, _heads(shoal_name, cfg), cfg.head_dim)


# ----------------------------------------------------------------------------- helpers


def _require(cfg: ModelConfig, wanted: dict[str, Any], family: str) -> None:
    for field, value in wanted.items():
        if getattr(cfg, field) != value:
            raise ValueError(f"model field {field}={getattr(cfg, field)!r} cannot be written as a Hugging Face "
                             f"{family} model (it needs {field}={value!r}); supported families: {', '.join(FAMILIES)}")


def _llama_layout(cfg: ModelConfig) -> list[HFTensor]:
    """transformers' Llama layout, shared by Mistral, Qwen2, Qwen3 and Mixtral."""
    out = [HFTensor(EMBED_KEY, ("tok_embeddings.weight",))]
    leaves = ["weight", "bias"] if cfg.bias else ["weight"]
    qkv_leaves = ["weight", "bias"] if cfg.bias or cfg.qkv_bias else ["weight"]
    for i in range(cfg.num_layers):
        s, h = f"layers.{i}.", f"model.layers.{i}."
        pairs = [("attention_norm.weight", "input_layernorm.weight")]
        qkv = (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"))
        pairs += [(f"attention.{a}.{leaf}", f"self_attn.{b}.{leaf}") for a, b in qkv for leaf in qkv_leaves]
        pairs += [(f"attention.wo.{leaf}", f"self_attn.o_proj.{leaf}") for leaf in leaves]
        if cfg.qk_norm:
            pairs += [("attention.q_norm.weight", "self_attn.q_norm.weight"),
                      ("attention.k_norm.weight", "self_attn.k_norm.weight")]
        pairs.append(("ffn_norm.weight", "post_attention_layernorm.weight"))
        if cfg.is_moe_layer(i) and cfg.num_shared_experts:  # Qwen2-MoE
            out += [HFTensor(h + b, (s + a,)) for a, b in pairs] + _qwen2_moe_experts(cfg, s, h)
            continue
        if cfg.is_moe_layer(i):
            out += [HFTensor(h + b, (s + a,)) for a, b in pairs]
            # The files' layout (transformers fuses the experts only in memory): one tensor per expert.
            out.append(HFTensor(h + "block_sparse_moe.gate.weight", (s + "feed_forward.router.gate.weight",)))
            out += [HFTensor(h + f"block_sparse_moe.experts.{e}.{w}.weight", (s + f"feed_forward.experts.{w}",),
                             expert=e) for e in range(cfg.num_experts) for w in ("w1", "w2", "w3")]
            continue
        pairs += [(f"feed_forward.{a}.{leaf}", f"mlp.{b}.{leaf}") for a, b in (("w1", "gate_proj"), ("w3", "up_proj"),
                                                                               ("w2", "down_proj")) for leaf in leaves]
        out += [HFTensor(h + b, (s + a,)) for a, b in pairs]
    out.append(HFTensor("model.norm.weight", ("norm.weight",)))
    if not cfg.tie_embeddings:
        out.append(HFTensor("lm_head.weight", ("output.weight",)))
    return out


def _router_loss(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' router-loss fields: on (with its weight) where shoal pools the loss as transformers does."""
    if cfg.aux_loss_pooled:
        return {"output_router_logits": True, "router_aux_loss_coef": cfg.aux_loss_coef}
    return {"output_router_logits": False}


def _qwen2_moe_experts(cfg: ModelConfig, s: str, h: str) -> list[HFTensor]:
    """One Qwen2-MoE layer's router, routed experts (one tensor per expert in the files), shared
    expert and its gate."""
    mlp = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
    out = [HFTensor(h + "mlp.gate.weight", (s + "feed_forward.router.gate.weight",))]
    out += [HFTensor(h + f"mlp.experts.{e}.{b}.weight", (s + f"feed_forward.experts.{a}",), expert=e)
            for e in range(cfg.num_experts) for a, b in mlp]
    out += [HFTensor(h + f"mlp.shared_expert.{b}.weight", (s + f"feed_forward.shared.{a}",), expert=0) for a, b in mlp]
    return out + [HFTensor(h + "mlp.shared_expert_gate.weight", (s + "feed_forward.shared_gate.weight",))]


def _gpt2_layout(cfg: ModelConfig) -> list[HFTensor]:
    """transformers' GPT-2 layout: Conv1D weights stored (in, out), q/k/v fused in c_attn."""
    out = [HFTensor(GPT2_EMBED_KEY, ("tok_embeddings.weight",)), HFTensor("transformer.wpe.weight",
                                                                          ("pos_embeddings.weight",))]
    for i in range(cfg.num_layers):
        s, h = f"layers.{i}.", f"transformer.h.{i}."
        qkv = tuple(f"{s}attention.{w}" for w in ("wq", "wk", "wv"))
        out += [HFTensor(h + f"ln_1.{leaf}", (s + f"attention_norm.{leaf}",)) for leaf in ("weight", "bias")]
        out += [HFTensor(h + "attn.c_attn.weight", tuple(q + ".weight" for q in qkv), transpose=True, cat_dim=1),
                HFTensor(h + "attn.c_attn.bias", tuple(q + ".bias" for q in qkv)),
                HFTensor(h + "attn.c_proj.weight", (s + "attention.wo.weight",), transpose=True),
                HFTensor(h + "attn.c_proj.bias", (s + "attention.wo.bias",))]
        out += [HFTensor(h + f"ln_2.{leaf}", (s + f"ffn_norm.{leaf}",)) for leaf in ("weight", "bias")]
        for a, b in (("w1", "c_fc"), ("w2", "c_proj")):
            out += [HFTensor(h + f"mlp.{b}.weight", (s + f"feed_forward.{a}.weight",), transpose=True),
                    HFTensor(h + f"mlp.{b}.bias", (s + f"feed_forward.{a}.bias",))]
    out += [HFTensor(f"transformer.ln_f.{leaf}", (f"norm.{leaf}",)) for leaf in ("weight", "bias")]
    if not cfg.tie_embeddings:
        out.append(HFTensor("lm_head.weight", ("output.weight",)))
    return out


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor}
    if cfg.rope_type in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = cfg.rope_original_max_len or cfg.max_seq_len
    if cfg.rope_type == "llama3":
        out.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    if cfg.rope_type == "yarn":
        out.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow, truncate=cfg.rope_truncate)
        if cfg.rope_attention_factor:
            out["attention_factor"] = cfg.rope_attention_factor
    return out


def _heads(shoal_name: str, cfg: ModelConfig) -> int:
    """Heads whose rows are rotated in this tensor: H for wq, K for wk (weights and biases), 1 for a
    q/k norm's weight (one head's features), 0 for everything else and for models without RoPE."""
    if cfg.pos_emb != "rope":
        return 0
    if ".attention.wq." in shoal_name:
        return cfg.num_heads
    if ".attention.wk." in shoal_name:
        return cfg.kv_heads
    return 1 if shoal_name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")) else 0


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
    if w.dim() not in (1, 2) or w.shape[0] != heads * head_dim:
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

    `shoal train --init` (shoal/models/hf/pretrained.py) asks the first layout in `SLICE_LAYOUTS` whose
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
    full[t.cat_dim] *= len(t.parts)
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
    heads, hd = _heads(shoal_name, cfg), cfg.head_dim
    if heads:
        (r0, r1), *rest = box
        h0, h1 = r0 // hd, -(-r1 // hd)
        rows = read_box(open_key, t.name, ((h0 * hd, h1 * hd), *rest))
        return _to_pairs(rows, h1 - h0, hd)[r0 - h0 * hd:r1 - h0 * hd]
    if len(t.parts) == 1 and not t.transpose:
        return read_box(open_key, t.name, box)
    file_box = list(box[::-1] if t.transpose else box)
    extent = (shape[::-1] if t.transpose else shape)[t.cat_dim]
    start, stop = file_box[t.cat_dim]
    file_box[t.cat_dim] = (part * extent + start, part * extent + stop)
    piece = read_box(open_key, t.name, tuple(file_box))
    return piece.t() if t.transpose else piece


def _hf_optional(cfg: ModelConfig, key: str) -> bool:
    """Keys a file may hold that no shoal tensor reads: older files' buffers, a tied head."""
    return key.endswith(("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")) or (
        cfg.tie_embeddings and key == "lm_head.weight")


HF_LLAMA = SliceLayout(name="Hugging Face Llama-layout (llama, mistral, qwen2, qwen3, mixtral, qwen2_moe)",
                       marker=EMBED_KEY, sources=_hf_sources, read_slice=_hf_read, optional=_hf_optional,
                       check=check_llama)
HF_GPT2 = SliceLayout(name="Hugging Face GPT-2", marker=GPT2_EMBED_KEY, sources=_hf_sources, read_slice=_hf_read,
                      optional=_hf_optional, check=check_llama)

SLICE_LAYOUTS: list[SliceLayout] = [HF_LLAMA, HF_GPT2]
"""The file families `--init` reads besides shoal's own names, first match wins."""
