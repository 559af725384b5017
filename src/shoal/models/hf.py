"""Hugging Face model configs -> shoal's ModelConfig, for `--model hf:<dir or config.json>`.

Reads config.json with plain `json` (no download, transformers not needed) and maps the fields
of the Llama family (Llama, Mistral, Mixtral, Qwen2), GPT-2 and GPT-NeoX onto shoal's fields.
Field names and defaults follow transformers' configuration classes (5.x, which also reads the
4.x layout: `rope_theta` at the top level instead of inside `rope_parameters`).

Where shoal's transformer cannot express a feature exactly, the shape is kept (so parameter
count, FLOPs and memory plans stay right) and a warning names what differs: sliding-window
attention, RoPE scaling, Qwen2's query/key/value-only biases, GPT-NeoX's parallel residual and
partial rotary embeddings.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from shoal.models.config import ModelConfig, get_preset

# transformers' defaults for fields a config.json may leave out (shape fields are required).
_LLAMA_DEFAULTS = dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
                       attention_bias=False, mlp_bias=False, max_position_embeddings=2048)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA_DEFAULTS,
    "mistral": {**_LLAMA_DEFAULTS, "max_position_embeddings": 131072, "sliding_window": 4096},
    "mixtral": {**_LLAMA_DEFAULTS, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 131072,
                "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2": {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768},
    "gpt2": dict(n_inner=None, n_positions=1024, layer_norm_epsilon=1e-5, activation_function="gelu_new",
                 tie_word_embeddings=True),
    "gpt_neox": dict(max_position_embeddings=2048, layer_norm_eps=1e-5, rope_theta=10000.0, hidden_act="gelu",
                     tie_word_embeddings=False, use_parallel_residual=True, attention_bias=True,
                     partial_rotary_factor=0.25),
}
SUPPORTED = tuple(sorted(_DEFAULTS))
_GELUS = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python", "gelu_accurate")


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
    if model_type not in _DEFAULTS:
        raise ValueError(f"hf config {str(path)!r} has model_type {model_type!r}; supported: {', '.join(SUPPORTED)}")
    hf = _Fields(str(path), {**_DEFAULTS[model_type], **_rope_fields(raw), **raw})
    fields = _gpt2(hf) if model_type == "gpt2" else _gpt_neox(hf) if model_type == "gpt_neox" else _llama(hf)
    try:
        return ModelConfig(**fields)
    except ValueError as exc:
        raise ValueError(f"hf config {str(path)!r} gives an invalid shoal model: {exc}") from None


# ----------------------------------------------------------------------------- families


def _llama(hf: _Fields) -> dict[str, Any]:
    """Llama, Mistral, Mixtral, Qwen2: RMSNorm, RoPE, SwiGLU, grouped-query attention."""
    dim, heads = hf.required("hidden_size"), hf.required("num_attention_heads")
    _check_head_dim(hf, dim, heads)
    if hf.get("hidden_act") not in ("silu", "swish"):
        hf.warn(f"hidden_act={hf.get('hidden_act')!r} is used as SiLU (shoal's gated MLP is SwiGLU)")
    if hf.get("attention_bias") != hf.get("mlp_bias"):
        hf.warn("attention_bias and mlp_bias differ; shoal uses one `bias` switch (attention_bias)")
    bias = bool(hf.get("attention_bias"))
    if hf.get("model_type") == "qwen2":
        hf.warn("Qwen2's query/key/value biases are left out (shoal's bias switch covers every linear layer)")
        bias = False
    _warn_window(hf)
    if isinstance(hf.get("rope_scaling"), dict) or hf.get("rope_type", "default") != "default":
        hf.warn(f"RoPE scaling {hf.get('rope_type') or hf.get('rope_scaling')!r} is not applied (plain RoPE)")
    fields = _common(hf, dim=dim, heads=heads)
    kv = hf.get("num_key_value_heads") or heads
    fields.update(
        num_kv_heads=None if kv == heads else kv,
        ffn_dim=hf.required("intermediate_size"),
        max_seq_len=hf.required("max_position_embeddings"),
        norm="rmsnorm", activation="swiglu", pos_emb="rope", bias=bias,
        rope_theta=float(hf.get("rope_theta")), norm_eps=float(hf.get("rms_norm_eps")),
    )
    if hf.get("model_type") == "mixtral":
        fields.update(num_experts=hf.required("num_local_experts"), top_k=hf.required("num_experts_per_tok"),
                      moe_every=1)
    return fields


def _gpt2(hf: _Fields) -> dict[str, Any]:
    """GPT-2: LayerNorm with bias, GELU MLP of 4 x dim (unless n_inner), learned positions."""
    dim, heads = hf.required("n_embd"), hf.required("n_head")
    _check_activation(hf, "activation_function")
    fields = _common(hf, dim=dim, heads=heads, layers_key="n_layer")
    fields.update(
        ffn_dim=hf.get("n_inner") or 4 * dim, max_seq_len=hf.required("n_positions"),
        norm="layernorm", activation="gelu", pos_emb="learned", bias=True,
        norm_eps=float(hf.get("layer_norm_epsilon")),
    )
    return fields


def _gpt_neox(hf: _Fields) -> dict[str, Any]:
    """GPT-NeoX (Pythia): LayerNorm, GELU MLP, RoPE; parallel residual and partial rotary warned."""
    dim, heads = hf.required("hidden_size"), hf.required("num_attention_heads")
    _check_activation(hf, "hidden_act")
    if hf.get("use_parallel_residual"):
        hf.warn("use_parallel_residual is not modelled: shoal's blocks apply attention then MLP in sequence")
    if float(hf.get("partial_rotary_factor")) != 1.0:
        hf.warn(f"rotary on {hf.get('partial_rotary_factor')} of each head is not modelled: shoal rotates whole heads")
    if not hf.get("attention_bias"):
        hf.warn("attention_bias=false is not modelled: GPT-NeoX's MLP and norms keep biases, so shoal uses bias=True")
    fields = _common(hf, dim=dim, heads=heads)
    fields.update(
        ffn_dim=hf.required("intermediate_size"), max_seq_len=hf.required("max_position_embeddings"),
        norm="layernorm", activation="gelu", pos_emb="rope", bias=True,
        rope_theta=float(hf.get("rope_theta")), norm_eps=float(hf.get("layer_norm_eps")),
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
    """The config's fields with the family defaults; one-line errors and warnings name the file."""

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

    def warn(self, what: str) -> None:
        warnings.warn(f"hf config {self.path!r}: {what}", stacklevel=4)


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


def _rope_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 nests rope_theta (and the scaling type) in `rope_parameters`."""
    params = raw.get("rope_parameters")
    if not isinstance(params, dict):
        return {}
    keys = ("rope_theta", "rope_type", "partial_rotary_factor")
    return {k: params[k] for k in keys if params.get(k) is not None}


def _check_head_dim(hf: _Fields, dim: int, heads: int) -> None:
    head_dim = hf.get("head_dim")
    if head_dim is not None and dim % heads == 0 and head_dim != dim // heads:
        raise ValueError(
            f"hf config {hf.path!r} has head_dim={head_dim} but hidden_size/num_attention_heads = {dim // heads}; "
            "shoal's attention uses hidden_size/num_attention_heads"
        )


def _check_activation(hf: _Fields, key: str) -> None:
    if hf.get(key) not in _GELUS:
        hf.warn(f"{key}={hf.get(key)!r} is used as GELU (tanh approximation)")


def _warn_window(hf: _Fields) -> None:
    window = hf.get("sliding_window")
    uses = hf.get("use_sliding_window", hf.get("model_type") != "qwen2")
    if uses and isinstance(window, int) and window < hf.get("max_position_embeddings", 0):
        hf.warn(f"sliding_window={window} is not modelled: shoal attends over the whole sequence")
