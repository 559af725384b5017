"""GPT-2 (`model_type` gpt2): LayerNorm with bias, a GELU (tanh) MLP of 4 x dim unless n_inner,
learned positions; transformers' Conv1D layers store their weights as (in, out), and c_attn holds q,
k and v side by side.

Refused: an activation other than tanh-approximated GELU, unscaled attention, attention scaled by
the inverse layer index, and reordered-and-upcast attention.
"""

from __future__ import annotations

from typing import Any

from shoal.models.config import ModelConfig
from shoal.models.hf.common import Family, Fields, HFTensor, base_fields

EMBED_KEY = "transformer.wte.weight"
"""The key that marks a state dict as transformers' GPT-2 layout."""
BARE_EMBED_KEY = "wte.weight"
"""The same key in the original release's files, written without the `transformer.` prefix."""

DEFAULTS: dict[str, Any] = dict(n_inner=None, n_positions=1024, layer_norm_epsilon=1e-5,
                                activation_function="gelu_new", tie_word_embeddings=True, scale_attn_weights=True,
                                scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # tanh-approximated GELU, as shoal's
_HOLDS = dict(norm="layernorm", activation="gelu", bias=True, qkv_bias=False, qk_norm=False, sliding_window=0,
              head_size=0, num_experts=0, num_kv_heads=None)


def config_in(hf: Fields) -> dict[str, Any]:
    dim, heads = hf.required("n_embd"), hf.required("n_head")
    if hf.get("activation_function") not in _GELU_TANH:
        hf.refuse(f"activation_function={hf.get('activation_function')!r}", ", ".join(_GELU_TANH))
    for key, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("reorder_and_upcast_attn", False)):
        if bool(hf.get(key)) != wanted:
            hf.refuse(f"{key}={hf.get(key)}", str(wanted).lower())
    fields = base_fields(hf, dim=dim, heads=heads, layers_key="n_layer")
    fields.update(
        ffn_dim=hf.get("n_inner") or 4 * dim, max_seq_len=hf.required("n_positions"),
        norm="layernorm", activation="gelu", pos_emb="learned", bias=True,
        norm_eps=float(hf.get("layer_norm_epsilon")),
    )
    return fields


def config_out(cfg: ModelConfig) -> dict[str, Any]:
    return {"architectures": [FAMILY.architecture], "model_type": "gpt2", "n_embd": cfg.dim,
            "n_layer": cfg.num_layers, "n_head": cfg.num_heads, "n_inner": cfg.ffn_dim,
            "n_positions": cfg.max_seq_len, "vocab_size": cfg.vocab_size, "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": "gelu_new", "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout, "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std, "torch_dtype": "float32"}


def layout(cfg: ModelConfig) -> list[HFTensor]:
    """transformers' GPT-2 layout: Conv1D weights stored (in, out), q/k/v fused in c_attn."""
    out = [HFTensor(EMBED_KEY, ("tok_embeddings.weight",)), HFTensor("transformer.wpe.weight",
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


def with_prefix(state: dict[str, Any]) -> dict[str, Any]:
    """A file's state under `layout`'s names: the original release's keys lack the `transformer.` prefix."""
    if EMBED_KEY in state:
        return state
    return {k if k.startswith("lm_head.") else "transformer." + k: v for k, v in state.items()}


FAMILY = Family(model_type="gpt2", architecture="GPT2LMHeadModel", defaults=DEFAULTS,
                marks=lambda cfg: cfg.pos_emb == "learned", requires=(("gpt2", _HOLDS),), config_in=config_in,
                config_out=config_out, layout=layout, buffers=(".attn.bias", ".attn.masked_bias"),
                rename=with_prefix)
