"""Hugging Face model configs -> shoal's ModelConfig, for `--model hf:<dir or config.json>`.

Reads config.json with plain `json` (no download, transformers not needed) and maps each
supported family onto the fields of shoal's Transformer that compute it exactly as transformers
does: Llama (with RoPE scaling), Mistral (sliding window), Qwen2 (q/k/v biases), Qwen3 (q/k
norms, decoupled head_dim), Mixtral (dropless top-k experts), Qwen2-MoE (a gated shared expert
beside them) and GPT-2. Field names and defaults
follow transformers' configuration classes (5.x, which also reads the 4.x layout: `rope_theta`
and `rope_scaling` at the top level instead of `rope_parameters`).

A config whose features shoal's model cannot compute exactly is refused in one line naming the
feature: nothing is approximated.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, NoReturn

from shoal.models.config import ModelConfig, ModelWarning, get_preset

# transformers' defaults for fields a config.json may leave out (shape fields are required).
_LLAMA_DEFAULTS = dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
                       attention_bias=False, mlp_bias=False, max_position_embeddings=2048)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA_DEFAULTS,
    "mistral": {**_LLAMA_DEFAULTS, "max_position_embeddings": 131072, "sliding_window": 4096},
    "mixtral": {**_LLAMA_DEFAULTS, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 131072,
                "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
                "output_router_logits": False, "sliding_window": None},
    "qwen2": {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768, "use_sliding_window": False},
    "qwen2_moe": {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768, "use_sliding_window": False,
                  "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                  "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False, "output_router_logits": False,
                  "router_aux_loss_coef": 0.001,
                  "mlp_only_layers": [], "qkv_bias": True},
    "qwen3": {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768, "use_sliding_window": False},
    "gpt2": dict(n_inner=None, n_positions=1024, layer_norm_epsilon=1e-5, activation_function="gelu_new",
                 tie_word_embeddings=True, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                 reorder_and_upcast_attn=False),
}
SUPPORTED = tuple(sorted(_DEFAULTS))
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # tanh-approximated GELU, as shoal's
_ROPE_KEYS = dict(factor="rope_factor", original_max_position_embeddings="rope_original_max_len",
                  low_freq_factor="rope_low_freq_factor", high_freq_factor="rope_high_freq_factor",
                  beta_fast="rope_beta_fast", beta_slow="rope_beta_slow", attention_factor="rope_attention_factor",
                  truncate="rope_truncate")


def load_model_config(name: str) -> ModelConfig:
    """What `--model` takes: a preset name or `hf:<dir or config.json>`."""
    if name.startswith("hf:"):
        return config_from_hf(name[3:])
    return get_preset(name)


DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")
"""Dropout rates a family's config.json may set, which shoal's build of it does not apply."""


def config_from_hf(path: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json (the file, or a folder holding one).

    One-line ValueError for a missing file, bad JSON, an unsupported model_type or a shape
    shoal cannot build.
    """
    raw = _read(Path(path))
    model_type = raw.get("model_type")
    if model_type not in _DEFAULTS:
        raise ValueError(f"hf config {str(path)!r} has model_type {model_type!r}; supported: {', '.join(SUPPORTED)}")
    hf = _Fields(str(path), {**_DEFAULTS[model_type], **raw})
    fields = _gpt2(hf) if model_type == "gpt2" else _llama(hf)
    dropped = [f"{k}={raw[k]}" for k in DROPOUT_KEYS if isinstance(raw.get(k), (int, float)) and raw[k] > 0]
    if dropped:
        warnings.warn(ModelWarning(f"hf config {str(path)!r} sets {', '.join(dropped)}: shoal builds the family "
                                   "without dropout, so it trains without it (an export writes 0)"), stacklevel=2)
    try:
        return ModelConfig(**fields)
    except ValueError as exc:
        raise ValueError(f"hf config {str(path)!r} gives an invalid shoal model: {exc}") from None


# ----------------------------------------------------------------------------- families


def _llama(hf: _Fields) -> dict[str, Any]:
    """Llama, Mistral, Mixtral, Qwen2, Qwen3: RMSNorm, RoPE, SwiGLU, grouped-query attention."""
    model_type = hf.get("model_type")
    dim, heads = hf.required("hidden_size"), hf.required("num_attention_heads")
    if hf.get("hidden_act") not in ("silu", "swish"):
        hf.refuse(f"hidden_act={hf.get('hidden_act')!r}", "silu (SwiGLU)")
    if model_type == "llama" and hf.get("attention_bias") != hf.get("mlp_bias"):
        hf.refuse(f"attention_bias={hf.get('attention_bias')} with mlp_bias={hf.get('mlp_bias')}", "equal values")
    if model_type == "qwen3" and hf.get("attention_bias"):
        hf.refuse("attention_bias=true (biases on q, k, v and o but not the MLP)", "false")
    head_dim = hf.get("head_dim")
    fields = _common(hf, dim=dim, heads=heads)
    kv = hf.get("num_key_value_heads") or heads
    fields.update(
        num_kv_heads=None if kv == heads else kv,
        ffn_dim=hf.required("intermediate_size"),
        max_seq_len=hf.required("max_position_embeddings"),
        norm="rmsnorm", activation="swiglu", pos_emb="rope",
        bias=bool(hf.get("attention_bias")) and model_type == "llama",
        head_size=head_dim if isinstance(head_dim, int) and head_dim != dim // heads else 0,
        qkv_bias=model_type in ("qwen2", "qwen2_moe"),
        qk_norm=model_type == "qwen3",
        sliding_window=_window(hf),
        norm_eps=float(hf.get("rms_norm_eps")),
        **_rope(hf),
    )
    if model_type in ("mixtral", "qwen2_moe"):
        # output_router_logits: transformers' loss adds router_aux_loss_coef x the load-balancing loss
        # pooled over every layer (shoal's aux_loss_pooled); without it, no router loss at all.
        pooled = bool(hf.get("output_router_logits"))
        fields.update(capacity_factor=0.0, aux_loss_coef=float(hf.get("router_aux_loss_coef")) if pooled else 0.0,
                      aux_loss_pooled=pooled, z_loss_coef=0.0, top_k=hf.required("num_experts_per_tok"))
    if model_type == "mixtral":
        fields.update(num_experts=hf.required("num_local_experts"), moe_every=1, norm_topk=True)
    if model_type == "qwen2_moe":
        fields.update(_qwen2_moe(hf))
    return fields


def _qwen2_moe(hf: _Fields) -> dict[str, Any]:
    """Qwen2-MoE's experts: routed ones every decoder_sparse_step-th layer, and one shared expert
    behind a sigmoid gate."""
    if hf.get("mlp_only_layers"):
        hf.refuse(f"mlp_only_layers={hf.get('mlp_only_layers')}", "[] (MoE layers every decoder_sparse_step-th)")
    if not hf.get("qkv_bias"):
        hf.refuse("qkv_bias=false", "true")
    step, width = hf.required("decoder_sparse_step"), hf.required("moe_intermediate_size")
    if step > 1 and hf.required("intermediate_size") != width:
        hf.refuse(f"intermediate_size={hf.get('intermediate_size')} (dense layers) beside moe_intermediate_size="
                  f"{width}", "equal widths, or decoder_sparse_step=1")
    return dict(num_experts=hf.required("num_experts"), moe_every=step, ffn_dim=width,
                norm_topk=bool(hf.get("norm_topk_prob")), num_shared_experts=1, shared_gate=True,
                shared_ffn_dim=hf.required("shared_expert_intermediate_size"))


def _gpt2(hf: _Fields) -> dict[str, Any]:
    """GPT-2: LayerNorm with bias, GELU MLP of 4 x dim (unless n_inner), learned positions."""
    dim, heads = hf.required("n_embd"), hf.required("n_head")
    if hf.get("activation_function") not in _GELU_TANH:
        hf.refuse(f"activation_function={hf.get('activation_function')!r}", ", ".join(_GELU_TANH))
    for key, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("reorder_and_upcast_attn", False)):
        if bool(hf.get(key)) != wanted:
            hf.refuse(f"{key}={hf.get(key)}", str(wanted).lower())
    fields = _common(hf, dim=dim, heads=heads, layers_key="n_layer")
    fields.update(
        ffn_dim=hf.get("n_inner") or 4 * dim, max_seq_len=hf.required("n_positions"),
        norm="layernorm", activation="gelu", pos_emb="learned", bias=True,
        norm_eps=float(hf.get("layer_norm_epsilon")),
    )
    return fields


def _common(hf: _Fields, *, dim: int, heads: int, layers_key: str = "num_hidden_layers") -> dict[str, Any]:
    fields: dict[str, Any] = dict(
        num_layers=hf.required(layers_key), dim=dim, num_heads=heads, vocab_size=hf.required("vocab_size"),
        tie_embeddings=bool(hf.get("tie_word_embeddings")),
    )
    if isinstance(hf.get("initializer_range"), (int, float)):
        fields["init_std"] = float(hf.get("initializer_range"))
    return fields


# ----------------------------------------------------------------------------- helpers


class _Fields:
    """The config's fields with the family defaults; one-line errors and refusals name the file."""

    def __init__(self, path: str, values: dict[str, Any]) -> None:
        self.path, self.values = path, values

    def get(self, key: str, default: Any = None) -> Any:
        value = self.values.get(key, default)
        return default if value is None and default is not None else value

    def required(self, key: str) -> int:
        value = self.values.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"hf config {self.path!r} needs {key!r} as a whole number >= 1; got {value!r}")
        return value

    def refuse(self, what: str, valid: str) -> NoReturn:
        raise ValueError(f"hf config {self.path!r} ({self.get('model_type')}) has {what}, which shoal does not "
                         f"compute exactly; valid: {valid}")


def _read(path: Path) -> dict[str, Any]:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        where = f"folder {str(path)!r} holds no config.json" if path.is_dir() else f"{str(path)!r} does not exist"
        raise ValueError(f"hf config: {where}; valid: hf:<folder with config.json> or hf:<path/config.json>")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"hf config {str(file)!r} is not valid JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"hf config {str(file)!r} holds a JSON {type(raw).__name__}, not an object")
    return raw


def _rope(hf: _Fields) -> dict[str, Any]:
    """rope_theta and the scaling fields, from transformers 5's `rope_parameters` or 4.x's top-level
    `rope_theta` and `rope_scaling`."""
    params = hf.get("rope_parameters")
    params = dict(params) if isinstance(params, dict) else {}
    scaling = hf.get("rope_scaling")
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    fields: dict[str, Any] = dict(rope_theta=float(params.get("rope_theta") or hf.get("rope_theta")))
    if float(params.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0) != 1.0:
        hf.refuse(f"partial_rotary_factor={params.get('partial_rotary_factor') or hf.get('partial_rotary_factor')}",
                  "1.0 (rotary over whole heads)")
    if rope_type == "default":
        return fields
    if rope_type not in ("linear", "dynamic", "llama3", "yarn"):
        hf.refuse(f"rope_type={rope_type!r}", "default, linear, dynamic, llama3, yarn")
    fields["rope_type"] = rope_type
    fields.update({_ROPE_KEYS[k]: v for k, v in params.items() if k in _ROPE_KEYS and v is not None})
    if rope_type == "yarn":
        fields["rope_attention_factor"] = _yarn_attention_factor(hf, params)
        if params.get("factor") is None:  # the factor is the context extension itself
            fields["rope_factor"] = hf.required("max_position_embeddings") / params["original_max_position_embeddings"]
    for key in ("beta_fast", "beta_slow"):  # transformers reads a falsy value as the default
        if not params.get(key):
            fields.pop(_ROPE_KEYS[key], None)
    for key, value in list(fields.items()):
        if key in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast",
                   "rope_beta_slow", "rope_attention_factor"):
            fields[key] = float(value)
    return fields


def _yarn_attention_factor(hf: _Fields, params: dict[str, Any]) -> float:
    """YaRN's cos/sin factor as transformers derives it when the config does not give it."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = params.get("factor") or hf.required("max_position_embeddings") / params["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


def _window(hf: _Fields) -> int:
    """The sliding window every layer uses (0: none); a window on some layers only is refused."""
    window = hf.get("sliding_window")
    if hf.get("model_type") in ("qwen2", "qwen3", "qwen2_moe"):
        if not hf.get("use_sliding_window"):
            return 0
        layer_types = hf.get("layer_types")
        first_windowed = hf.get("max_window_layers", 28)
        if layer_types is not None:
            windowed = [t == "sliding_attention" for t in layer_types]
        else:
            windowed = [i >= first_windowed for i in range(hf.required("num_hidden_layers"))]
        if not all(windowed) and any(windowed):
            hf.refuse("a sliding window on some layers only (max_window_layers / layer_types)",
                      "use_sliding_window=false, or a window on every layer")
        if not any(windowed):
            return 0
    if window is None or window >= hf.required("max_position_embeddings"):
        return 0  # a window as long as the context masks nothing
    if not isinstance(window, int) or window < 1:
        hf.refuse(f"sliding_window={window!r}", "a whole number >= 1, or null")
    return window
