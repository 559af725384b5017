"""Llama (`model_type` llama): RMSNorm, RoPE (with its scalings linear, dynamic, llama3 and yarn),
SwiGLU, grouped-query attention; and the Llama-style config, layout and rotary rows that Mistral,
Qwen2, Qwen3, Mixtral and Qwen2-MoE build on.

Refused: an activation other than silu, attention_bias without mlp_bias (or the reverse), a
partial rotary factor, a RoPE type other than those above.

Rotary layout: shoal rotates interleaved pairs (x[2i], x[2i+1]) of each head (Meta's original
convention, see `apply_rope`); transformers rotates halves (x[i], x[i + E/2]) (`rotate_half`). Both
use frequency i for pair i, so reordering the rows of each query/key head (shoal row 2i -> HF row i,
shoal row 2i+1 -> HF row i + E/2) makes the two attention scores identical. Query and key biases and
Qwen3's per-head q/k norm weights move with their rows; the value and output projections are not
rotated and move unchanged (`rotated_heads`, `to_halves`, `to_pairs`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shoal.models.config import ModelConfig
from shoal.models.hf.common import Family, Fields, HFTensor, base_fields

if TYPE_CHECKING:
    from torch import Tensor

EMBED_KEY = "model.embed_tokens.weight"
"""The key that marks a state dict as transformers' Llama layout (every family here but GPT-2)."""

DEFAULTS: dict[str, Any] = dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                                hidden_act="silu", attention_bias=False, mlp_bias=False, max_position_embeddings=2048)
STYLE = ("Llama-style", dict(norm="rmsnorm", activation="swiglu", kv_lora_rank=0))
"""What every family of the Llama layout requires of a shoal config (`Family.requires`)."""
MLP = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
"""shoal's SwiGLU matrices and transformers' names for them."""
BUFFERS = ("rotary_emb.inv_freq",)
"""The rotary frequencies older files store beside the weights."""

_ROPE_KEYS = dict(factor="rope_factor", original_max_position_embeddings="rope_original_max_len",
                  low_freq_factor="rope_low_freq_factor", high_freq_factor="rope_high_freq_factor",
                  beta_fast="rope_beta_fast", beta_slow="rope_beta_slow", attention_factor="rope_attention_factor",
                  truncate="rope_truncate")


# ----------------------------------------------------------------------------- config in


def config_in(hf: Fields) -> dict[str, Any]:
    dim, heads = shape(hf)
    if hf.get("attention_bias") != hf.get("mlp_bias"):
        hf.refuse(f"attention_bias={hf.get('attention_bias')} with mlp_bias={hf.get('mlp_bias')}", "equal values")
    # transformers' Llama attends over the whole causal prefix: a sliding_window in its config.json is not read
    return fields(hf, dim=dim, heads=heads, bias=bool(hf.get("attention_bias")), window=lambda hf: 0)


def shape(hf: Fields) -> tuple[int, int]:
    """(hidden size, heads) of a Llama-style config, whose MLP must be SwiGLU."""
    dim, heads = hf.required("hidden_size"), hf.required("num_attention_heads")
    if hf.get("hidden_act") not in ("silu", "swish"):
        hf.refuse(f"hidden_act={hf.get('hidden_act')!r}", "silu (SwiGLU)")
    return dim, heads


def fields(hf: Fields, *, dim: int, heads: int, bias: bool = False, qkv_bias: bool = False, qk_norm: bool = False,
           window: Callable[[Fields], int] | None = None) -> dict[str, Any]:
    """The ModelConfig fields of a Llama-style config: RMSNorm, RoPE, SwiGLU, grouped-query attention;
    `window` reads the family's sliding window (default `sliding_window`)."""
    head_dim = hf.get("head_dim")
    out = base_fields(hf, dim=dim, heads=heads)
    kv = hf.get("num_key_value_heads") or heads
    out.update(
        num_kv_heads=None if kv == heads else kv,
        ffn_dim=hf.required("intermediate_size"),
        max_seq_len=hf.required("max_position_embeddings"),
        norm="rmsnorm", activation="swiglu", pos_emb="rope",
        bias=bias,
        head_size=head_dim if isinstance(head_dim, int) and head_dim != dim // heads else 0,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        sliding_window=(window or sliding_window)(hf),
        norm_eps=float(hf.get("rms_norm_eps")),
        **_rope(hf),
    )
    return out


def sliding_window(hf: Fields) -> int:
    """The sliding window every layer uses (0: none)."""
    window = hf.get("sliding_window")
    if window is None or window >= hf.required("max_position_embeddings"):
        return 0  # a window as long as the context masks nothing
    if not isinstance(window, int) or window < 1:
        hf.refuse(f"sliding_window={window!r}", "a whole number >= 1, or null")
    return window


def _rope(hf: Fields) -> dict[str, Any]:
    """rope_theta and the scaling fields, from transformers 5's `rope_parameters` or 4.x's top-level
    `rope_theta` and `rope_scaling`."""
    params = hf.get("rope_parameters")
    params = dict(params) if isinstance(params, dict) else {}
    scaling = hf.get("rope_scaling")
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    rope = hf.within("rope_parameters", params)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    out: dict[str, Any] = dict(rope_theta=float(rope.get("rope_theta") or hf.get("rope_theta")))
    partial = rope.get("partial_rotary_factor") or hf.get("partial_rotary_factor")
    if float(partial or 1.0) != 1.0:
        hf.refuse(f"partial_rotary_factor={partial}", "1.0 (rotary over whole heads)")
    if rope_type == "default":
        return out
    if rope_type not in ("linear", "dynamic", "llama3", "yarn"):
        hf.refuse(f"rope_type={rope_type!r}", "default, linear, dynamic, llama3, yarn")
    out["rope_type"] = rope_type
    out.update({name: rope.get(key) for key, name in _ROPE_KEYS.items() if rope.get(key) is not None})
    if rope_type == "yarn":
        out["rope_attention_factor"] = _yarn_attention_factor(hf, rope)
        if rope.get("factor") is None:  # the factor is the context extension itself
            out["rope_factor"] = hf.required("max_position_embeddings") / rope.get("original_max_position_embeddings")
    for key in ("beta_fast", "beta_slow"):  # transformers reads a falsy value as the default
        if not rope.get(key):
            out.pop(_ROPE_KEYS[key], None)
    for key, value in list(out.items()):
        if key in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast",
                   "rope_beta_slow", "rope_attention_factor"):
            out[key] = float(value)
    return out


def _yarn_attention_factor(hf: Fields, rope: Fields) -> float:
    """YaRN's cos/sin factor as transformers derives it when the config does not give it."""
    if rope.get("attention_factor") is not None:
        return float(rope.get("attention_factor"))
    factor = rope.get("factor") or hf.required("max_position_embeddings") / rope.get("original_max_position_embeddings")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


# ----------------------------------------------------------------------------- config out


def config_out(cfg: ModelConfig) -> dict[str, Any]:
    return {**base_config(cfg, FAMILY), "attention_bias": cfg.bias, "mlp_bias": cfg.bias}


def base_config(cfg: ModelConfig, family: Family) -> dict[str, Any]:
    """The config.json fields of a Llama-style family (its RoPE scaling included)."""
    out: dict[str, Any] = {
        "architectures": [family.architecture], "model_type": family.model_type,
        "hidden_size": cfg.dim, "intermediate_size": cfg.dense_width, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "num_hidden_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_dropout": cfg.dropout, "initializer_range": cfg.init_std, "torch_dtype": "float32",
    }
    if cfg.rope_type != "default":
        out["rope_parameters"] = out["rope_scaling"] = _rope_parameters(cfg)
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


# ----------------------------------------------------------------------------- weights

FeedForward = Callable[[ModelConfig, int, str, str], list[HFTensor]]
"""(cfg, layer index, shoal prefix, Hugging Face prefix) -> the tensors of that layer's feed-forward."""


def layout(cfg: ModelConfig, feed_forward: FeedForward | None = None) -> list[HFTensor]:
    """transformers' Llama layout; `feed_forward` gives each layer's MLP tensors (default: SwiGLU)."""
    out = [HFTensor(EMBED_KEY, ("tok_embeddings.weight",))]
    for i in range(cfg.num_layers):
        s, h = f"layers.{i}.", f"model.layers.{i}."
        out += _attention_and_norms(cfg, s, h) + (feed_forward or dense_mlp)(cfg, i, s, h)
    out.append(HFTensor("model.norm.weight", ("norm.weight",)))
    if not cfg.tie_embeddings:
        out.append(HFTensor("lm_head.weight", ("output.weight",)))
    return out


def _attention_and_norms(cfg: ModelConfig, s: str, h: str) -> list[HFTensor]:
    leaves = ["weight", "bias"] if cfg.bias else ["weight"]
    qkv_leaves = ["weight", "bias"] if cfg.bias or cfg.qkv_bias else ["weight"]
    pairs = [("attention_norm.weight", "input_layernorm.weight")]
    qkv = (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"))
    pairs += [(f"attention.{a}.{leaf}", f"self_attn.{b}.{leaf}") for a, b in qkv for leaf in qkv_leaves]
    pairs += [(f"attention.wo.{leaf}", f"self_attn.o_proj.{leaf}") for leaf in leaves]
    if cfg.qk_norm:  # Qwen3's per-head norms
        pairs += [("attention.q_norm.weight", "self_attn.q_norm.weight"),
                  ("attention.k_norm.weight", "self_attn.k_norm.weight")]
    pairs.append(("ffn_norm.weight", "post_attention_layernorm.weight"))
    return [HFTensor(h + b, (s + a,)) for a, b in pairs]


def dense_mlp(cfg: ModelConfig, i: int, s: str, h: str) -> list[HFTensor]:
    """A dense SwiGLU MLP (`mlp.gate_proj`, `up_proj`, `down_proj`)."""
    leaves = ["weight", "bias"] if cfg.bias else ["weight"]
    return [HFTensor(h + f"mlp.{b}.{leaf}", (s + f"feed_forward.{a}.{leaf}",)) for a, b in MLP for leaf in leaves]


def rotated_heads(shoal_name: str, cfg: ModelConfig) -> int:
    """Heads whose rows are rotated in this tensor: H for wq, K for wk (weights and biases), 1 for a
    q/k norm's weight (one head's features), 0 for everything else and for models without RoPE or with
    latent attention (shoal.models.hf.deepseek_v3: its published files rotate pairs, as shoal does)."""
    if cfg.pos_emb != "rope" or cfg.latent_attention:
        return 0
    if ".attention.wq." in shoal_name:
        return cfg.num_heads
    if ".attention.wk." in shoal_name:
        return cfg.kv_heads
    return 1 if shoal_name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")) else 0


def to_halves(w: Tensor, heads: int, head_dim: int) -> Tensor:
    """Rows of each head from interleaved pairs (2i, 2i+1) to halves (i, i + E/2)."""
    if not heads:
        return w
    _check_rows(w, heads, head_dim)
    return w.reshape(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape).contiguous()


def to_pairs(w: Tensor, heads: int, head_dim: int) -> Tensor:
    """Rows of each head from halves (i, i + E/2) to interleaved pairs (2i, 2i+1)."""
    if not heads:
        return w
    _check_rows(w, heads, head_dim)
    return w.reshape(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape).contiguous()


def _check_rows(w: Tensor, heads: int, head_dim: int) -> None:
    if w.dim() not in (1, 2) or w.shape[0] != heads * head_dim:
        raise ValueError(f"a query/key projection of shape {tuple(w.shape)} does not hold {heads} heads of "
                         f"{head_dim} rows; the weights do not fit the model config")


FAMILY = Family(model_type="llama", architecture="LlamaForCausalLM", defaults=DEFAULTS, marks=lambda cfg: True,
                requires=(STYLE,), config_in=config_in, config_out=config_out, layout=layout, buffers=BUFFERS)
