"""DeepSeek-V3 (`model_type` deepseek_v3), draft: the multi-head latent attention part of the family.

What is here: the config fields of MLA (`mla_fields`), the attention's weight names and layouts
(`attention_tensors`, `attention_to_shoal`), the whole dense-only model (every layer dense:
first_k_dense_replace >= num_hidden_layers) as `config_in` and `state_to_shoal`, and the
multi-token-prediction layers a published folder holds beyond `num_hidden_layers`, which are left
out with a warning as transformers leaves them (`drop_mtp_layers`). The routed layers (sigmoid
router, group-limited top-k, shared experts) join when shoal's router computes them; until then a
config with any MoE layer is refused in one line. Not yet in `families.FAMILIES`.

Rotary layout: `rope_interleave` true (the default, and DeepSeek's published files) rotates the
adjacent pairs (x[2i], x[2i+1]) of each head's rotary part, shoal's own layout, so the weights move
unchanged; false rotates halves (x[i], x[i + R/2]) (transformers' rotate_half), and the rotary rows
of each query head (wq or wq_b) and of the shared rotary key (wk_rope) are reordered into pairs
(shoal.models.hf.llama.to_pairs). transformers' `kv_a_proj_with_mqa` is shoal's wkv_a (the latent's
kv_lora_rank rows) over wk_rope (the rotary key's qk_rope_head_dim rows).
"""

from __future__ import annotations

import re
import warnings
from typing import TYPE_CHECKING, Any

import torch

from shoal.models.config import ModelConfig, ModelWarning
from shoal.models.hf import llama
from shoal.models.hf.common import Fields

if TYPE_CHECKING:
    from torch import Tensor

DEFAULTS: dict[str, Any] = {**llama.DEFAULTS, "rope_interleave": True, "q_lora_rank": 1536, "kv_lora_rank": 512,
                            "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                            "first_k_dense_replace": 3, "num_nextn_predict_layers": 0,
                            "max_position_embeddings": 4096}


def mla_fields(hf: Fields) -> dict[str, Any]:
    """The latent-attention fields of a DeepSeek-V2/V3 config.json (q_lora_rank null: one query projection)."""
    if hf.get("attention_bias"):
        hf.refuse("attention_bias=true (biases on the down and output projections)", "false")
    heads = hf.required("num_attention_heads")
    kv = hf.get("num_key_value_heads")
    if kv not in (None, heads):
        hf.refuse(f"num_key_value_heads={kv} with num_attention_heads={heads}", f"{heads} (latent attention "
                  "gives every head its own key and value)")
    rope = hf.within("rope_parameters", dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {}))
    mscale = rope.get("mscale_all_dim") if (rope.get("rope_type") or rope.get("type") or "default") != "default" \
        else None
    return dict(q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf.required("kv_lora_rank"),
                qk_rope_head_dim=hf.required("qk_rope_head_dim"), qk_nope_head_dim=hf.get("qk_nope_head_dim"),
                v_head_dim=hf.required("v_head_dim"), mscale_all_dim=float(mscale or 0.0))


def config_in(hf: Fields) -> dict[str, Any]:
    """A dense-only DeepSeek-V3 config (every layer below first_k_dense_replace)."""
    dim, heads = llama.shape(hf)
    layers = hf.required("num_hidden_layers")
    if (hf.get("first_k_dense_replace") or 0) < layers and (hf.get("n_routed_experts") or 0) > 0:
        hf.refuse(f"first_k_dense_replace={hf.get('first_k_dense_replace')} < num_hidden_layers={layers} "
                  "(routed MoE layers, not yet in this draft)", f"first_k_dense_replace >= {layers}")
    out = llama.fields(hf, dim=dim, heads=heads, window=lambda hf: 0)
    out.update(mla_fields(hf), num_kv_heads=None, head_size=0)
    return out


# ----------------------------------------------------------------------------- weights

_PLAIN = (("wkv_b", "kv_b_proj"), ("kv_a_norm", "kv_a_layernorm"), ("wo", "o_proj"))


def attention_tensors(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(shoal name, transformers name) of one attention's tensors that move as they are (under
    `attention.` and `self_attn.`); kv_a_proj_with_mqa and the query projections are `attention_to_shoal`'s."""
    pairs = [(f"{a}.weight", f"{b}.weight") for a, b in _PLAIN]
    if cfg.q_lora_rank:
        pairs += [("wq_a.weight", "q_a_proj.weight"), ("q_a_norm.weight", "q_a_layernorm.weight")]
    return pairs


def attention_to_shoal(hf: dict[str, Tensor], cfg: ModelConfig, *, interleaved: bool) -> dict[str, Tensor]:
    """One attention's tensors, transformers' names (without the `self_attn.` prefix) -> shoal's (without
    `attention.`); `interleaved`: the config's rope_interleave."""
    out = {a: hf[b] for a, b in attention_tensors(cfg)}
    q_name, q_key = ("wq_b.weight", "q_b_proj.weight") if cfg.q_lora_rank else ("wq.weight", "q_proj.weight")
    N, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q = hf[q_key]
    latent, k_rope = hf["kv_a_proj_with_mqa.weight"].split([cfg.kv_lora_rank, R])
    if not interleaved:  # halves -> adjacent pairs, in each head's rotary rows and the shared key's
        heads = q.reshape(cfg.num_heads, N + R, -1)
        rotary = llama.to_pairs(heads[:, N:].reshape(cfg.num_heads * R, -1), cfg.num_heads, R)
        q = torch.cat((heads[:, :N], rotary.reshape(cfg.num_heads, R, -1)), dim=1).reshape(q.shape)
        k_rope = llama.to_pairs(k_rope, 1, R)
    out[q_name], out["wkv_a.weight"], out["wk_rope.weight"] = q.contiguous(), latent.contiguous(), k_rope.contiguous()
    return out


def state_to_shoal(hf: dict[str, Tensor], cfg: ModelConfig, *, interleaved: bool = True) -> dict[str, Tensor]:
    """A dense-only DeepSeek-V3 state dict (transformers' names) -> shoal's Transformer's."""
    out = {"tok_embeddings.weight": hf[llama.EMBED_KEY], "norm.weight": hf["model.norm.weight"]}
    out["output.weight"] = out["tok_embeddings.weight"] if cfg.tie_embeddings else hf["lm_head.weight"]
    for i in range(cfg.num_layers):
        s, h = f"layers.{i}.", f"model.layers.{i}."
        attn = {k[len(h + "self_attn."):]: v for k, v in hf.items() if k.startswith(h + "self_attn.")}
        out.update({s + "attention." + k: v for k, v in attention_to_shoal(attn, cfg, interleaved=interleaved).items()})
        out[s + "attention_norm.weight"] = hf[h + "input_layernorm.weight"]
        out[s + "ffn_norm.weight"] = hf[h + "post_attention_layernorm.weight"]
        for a, b in llama.MLP:
            out[s + f"feed_forward.{a}.weight"] = hf[h + f"mlp.{b}.weight"]
    return out


def drop_mtp_layers(hf: dict[str, Tensor], num_layers: int, path: str = "the folder") -> dict[str, Tensor]:
    """`hf` without the multi-token-prediction layers (model.layers.{num_layers} and above), which transformers
    does not load either; a one-line warning when there are any."""
    pattern = re.compile(r"model\.layers\.(\d+)\.")
    kept = {k: v for k, v in hf.items() if not ((m := pattern.match(k)) and int(m.group(1)) >= num_layers)}
    if len(kept) < len(hf):
        warnings.warn(ModelWarning(f"{path} holds {len(hf) - len(kept)} tensors of multi-token-prediction layers "
                                   f"(model.layers.{num_layers} and above); shoal does not train them and leaves "
                                   "them out, as transformers does"), stacklevel=2)
    return kept
