"""Model shape as data: the fields `--set key=value` overrides, and the named presets."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any


class ModelWarning(UserWarning):
    """A model setting that runs but is likely not what the user meant: the command line shows it as
    `shoal: warning: ...`."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and style of a decoder-only transformer (Llama-style by default)."""

    num_layers: int = 4
    dim: int = 128
    num_heads: int = 8
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means num_heads (plain multi-head)."""
    ffn_dim: int = 384
    """Hidden width of the feed-forward block (per expert in MoE layers)."""
    vocab_size: int = 256
    max_seq_len: int = 256
    norm: str = "rmsnorm"
    """rmsnorm (Llama) or layernorm (GPT-2)."""
    activation: str = "swiglu"
    """swiglu (Llama, three matrices) or gelu (GPT-2, two matrices)."""
    pos_emb: str = "rope"
    """rope (rotary, Llama) or learned (absolute positions, GPT-2)."""
    bias: bool = False
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_type: str = "default"
    """How the rotary frequencies are scaled for long contexts, as Hugging Face's `rope_type`:
    default (none), linear (position interpolation), dynamic (NTK-aware; within max_seq_len it is
    the default, as transformers computes it), llama3 (Llama 3.1's banded rescale), yarn (YaRN:
    a ramp between interpolated and original frequencies, and cos/sin scaled by an attention factor).
    The rope_* fields below are its parameters (see shoal.models.rope)."""
    rope_factor: float = 1.0
    """Context extension factor (linear, dynamic, llama3, yarn)."""
    rope_original_max_len: int = 0
    """The pretraining context length the scaling is relative to (llama3, yarn); 0: max_seq_len."""
    rope_low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_len / low_freq_factor are divided by the factor."""
    rope_high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_len / high_freq_factor are kept."""
    rope_beta_fast: float = 32.0
    """yarn: rotations at which the ramp ends (dimensions kept as they are)."""
    rope_beta_slow: float = 1.0
    """yarn: rotations at which the ramp starts (dimensions fully interpolated)."""
    rope_attention_factor: float = 0.0
    """yarn: the factor cos and sin are multiplied by; 0: 0.1 ln(rope_factor) + 1 (YaRN's default)."""
    rope_truncate: bool = True
    """yarn: round the ramp's ends to whole dimensions."""
    head_size: int = 0
    """Width of each attention head; 0: dim / num_heads (Hugging Face's head_dim, which Qwen3 and
    some Mistral shapes set apart from hidden_size / num_attention_heads)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections only (Qwen2), beside the global `bias`."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE, one weight of head_size per projection (Qwen3)."""
    sliding_window: int = 0
    """Each token attends to itself and the sliding_window - 1 tokens before it (Mistral); 0: the
    whole causal prefix."""
    kv_lora_rank: int = 0
    """Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434, and V3) when > 0: keys and values
    come from a latent of this rank (wkv_a, its RMSNorm kv_a_norm, then wkv_b up to every head's
    qk_nope_head_dim key and v_head_dim value features), beside one rotary key of qk_rope_head_dim
    shared by all heads (wk_rope); 0: plain multi-head attention (wq, wk, wv). shoal.models.mla."""
    q_lora_rank: int = 0
    """MLA: the rank of the queries' low-rank projection (wq_a, its RMSNorm q_a_norm, wq_b); 0: one
    projection wq."""
    qk_rope_head_dim: int = 0
    """MLA: the rotary part of each query and key head (even, > 0 with MLA); the rotary tables span it."""
    qk_nope_head_dim: int = 0
    """MLA: the part of each query and key head without positions; a query/key head is
    qk_nope_head_dim + qk_rope_head_dim wide."""
    v_head_dim: int = 0
    """MLA: the width of each value head (> 0 with MLA), which may differ from the query/key head's."""
    mscale_all_dim: float = 0.0
    """MLA with a scaled rope_type and rope_factor > 1: the softmax scale 1/sqrt(query/key head width)
    is multiplied by (0.1 mscale_all_dim ln(rope_factor) + 1)^2 (DeepSeek's YaRN correction, as
    transformers' yarn_apply_mscale); 0: no correction."""
    norm_eps: float = 1e-5
    dropout: float = 0.0
    init_std: float = 0.02
    num_experts: int = 0
    """Experts per MoE layer; 0 makes every layer dense."""
    top_k: int = 2
    """Experts each token is routed to in MoE layers."""
    norm_topk: bool = True
    """Rescale each token's top_k routing weights (under prototyping: its num_prototypes group
    winners' in-group probabilities) to sum to 1, as GShard's top-2 and Mixtral do; false keeps
    the router's probabilities (Switch's top-1, M6-T's prototypes). On by default because top_k
    defaults to 2, where renormalising is the usual choice (and what a Mixtral config means);
    with top_k=1 it makes every weight 1 and the gate learns from the auxiliary losses alone,
    so top-1 wants norm_topk=false (a warning says so)."""
    moe_every: int = 1
    """Every moe_every-th layer is an MoE layer (when num_experts > 0), unless `moe_first_dense` or
    `moe_dense_layers` makes it dense (`is_moe_layer`)."""
    moe_first_dense: int = 0
    """The first this many layers are dense whatever moe_every says (DeepSeek's first_k_dense_replace)."""
    moe_dense_layers: tuple[int, ...] = ()
    """Layers (0-based indices) that are dense whatever moe_every says (Qwen3-MoE's mlp_only_layers); `--set`
    takes them comma-separated (`moe_dense_layers=0,3`)."""
    dense_ffn_dim: int = 0
    """Hidden width of the dense layers' feed-forward block in a model with experts (DeepSeek's and Qwen3-MoE's
    intermediate_size beside moe_intermediate_size); 0: ffn_dim."""
    router_score: str = "softmax"
    """How the router scores the experts: softmax (over the experts: Mixtral, Qwen) or sigmoid (each expert on its
    own: DeepSeek-V3); see shoal.moe.router.Router."""
    router_groups: int = 0
    """Group-limited routing (DeepSeek-V3's n_group): the experts in this many contiguous groups, a group ranked by
    the sum of its two highest scores, each token choosing among its router_topk_groups best groups; 0 or 1: off."""
    router_topk_groups: int = 0
    """The groups a token chooses its experts in (DeepSeek-V3's topk_group), with router_groups > 1."""
    router_scale: float = 1.0
    """The routing weights (after norm_topk's normalisation) times this (DeepSeek-V3's routed_scaling_factor)."""
    router_bias: bool = False
    """A per-expert bias added to the scores that choose the experts, never to the weights (DeepSeek-V3's
    e_score_correction_bias; a buffer that checkpoints hold), moved by router_bias_rate after each step."""
    router_bias_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3's gamma): after each optimizer step the bias of every expert moves
    by gamma * sign(mean load - its load), loads counted over the whole global batch; 0: the bias stays."""
    seq_aux_coef: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise balance loss (its alpha; shoal.moe.router.sequence_balance_loss)."""
    num_prototypes: int = 0
    """Expert prototyping (M6-T): the experts in this many groups, top-1 in each (then it must
    equal top_k); 0: plain top-k over all experts."""
    capacity_factor: float = 1.25
    """Tokens an expert takes per step, as a multiple of its even share (N*top_k/E); assignments
    beyond it are dropped (the residual carries the token). 0: dropless."""
    moe_group_tokens: int = 0
    """Tokens per routing group (GShard's groups), a model hyper-parameter: capacity
    (ceil(capacity_factor * G * top_k / num_experts) for a group of G tokens), dropping priority and
    the load-balancing loss are taken within each group, the loss averaged over groups. Groups are
    spans of this many consecutive tokens of one sequence, the last taking the remainder; 0: one
    group per sequence (G = the sequence length). A group never spans two sequences, so the
    routing, and the loss curve, is the same under any parallel plan and micro-batch count; a
    sequence shorter than the group (sampling, a short evaluation) is one group."""
    num_shared_experts: int = 0
    """Dense experts every token of an MoE layer passes through besides its routed ones."""
    shared_ffn_dim: int = 0
    """Hidden width of each shared expert; 0: ffn_dim (Qwen2-MoE's shared_expert_intermediate_size)."""
    shared_gate: bool = False
    """Scale the shared experts' output by sigmoid(a learned D -> 1 gate) per token (Qwen2-MoE)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (Switch/GShard) in the training loss."""
    z_loss_coef: float = 0.001
    """Weight of the router z-loss (ST-MoE) in the training loss."""
    aux_loss_pooled: bool = False
    """The load-balancing loss as transformers' Mixtral and Qwen2-MoE take it (output_router_logits):
    one loss over every MoE layer's tokens at once, E * sum_e C_e P_e with C_e the share of all
    rows' top-k choices that went to e (summing to k) and P_e its mean probability, pooled over the
    layers (shoal.moe.collect); false: each layer's own loss, summed. The pool is one forward: the
    micro-batch's tokens on every data rank (with accumulation, a mean over micro-batches, as the
    HF Trainer takes it), on every pipeline stage. Not with accumulation over several data ranks
    (--micro-batch, or a pipeline's mb > 1; shoal.rules)."""
    share_moe: bool = False
    """WideNet: every MoE layer is one shared layer (its weights), each block keeping its norms."""
    doc_eos_id: int = -1
    """Document masking (shoal train --doc-mask on sets it to the dataset's EOS id): attention stays
    inside each document of a packed sequence, a document ending with this token, and positions
    restart at each document; -1: off (attention spans the whole sequence)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_dense_layers", tuple(self.moe_dense_layers))  # a list from a config file
        _check_choice("norm", self.norm, ("rmsnorm", "layernorm"))
        _check_choice("activation", self.activation, ("swiglu", "gelu"))
        _check_choice("pos_emb", self.pos_emb, ("rope", "learned"))
        _check_choice("rope_type", self.rope_type, ROPE_TYPES)
        _check_choice("router_score", self.router_score, ("softmax", "sigmoid"))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"model field {f.name}={value} must be a finite number")
        for name in ("norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"model field {name}={getattr(self, name)} must be > 0")
        if self.init_std < 0:
            raise ValueError(f"model field init_std={self.init_std} must be >= 0")
        for name in ("num_layers", "dim", "num_heads", "ffn_dim", "vocab_size", "max_seq_len", "moe_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"model field {name}={getattr(self, name)} must be >= 1")
        if not self.head_size and self.dim % self.num_heads:
            raise ValueError(f"dim={self.dim} is not divisible by num_heads={self.num_heads}; valid: a multiple "
                             "of num_heads, or head_size set")
        if self.kv_heads < 1 or self.num_heads % self.kv_heads:
            valid = ", ".join(str(d) for d in range(1, self.num_heads + 1) if self.num_heads % d == 0)
            raise ValueError(f"num_kv_heads={self.kv_heads} does not divide num_heads={self.num_heads}; valid: "
                             f"num_kv_heads in {valid}")
        self._check_latent_attention()
        if self.pos_emb == "rope" and self.rope_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dim; got {self.rope_dim}")
        if self.num_experts < 0:
            raise ValueError(f"model field num_experts={self.num_experts} must be >= 0 (0 makes every layer dense)")
        if self.num_experts and self.moe_every > self.num_layers:
            raise ValueError(f"moe_every={self.moe_every} makes none of the {self.num_layers} layers an MoE layer; "
                             f"valid: moe_every in 1..{self.num_layers}, or num_experts=0 for a dense model")
        bad = [i for i in self.moe_dense_layers if not 0 <= i < self.num_layers]
        if bad or len(set(self.moe_dense_layers)) != len(self.moe_dense_layers):
            raise ValueError(f"moe_dense_layers={list(self.moe_dense_layers)} must be distinct layer indices in "
                             f"0..{self.num_layers - 1}")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must lie in 1..num_experts={self.num_experts}")
        if self.num_prototypes < 0 or (self.num_prototypes and (self.num_experts % self.num_prototypes
                                                                or self.top_k != self.num_prototypes)):
            raise ValueError(f"num_prototypes={self.num_prototypes} must divide num_experts={self.num_experts} "
                             f"and equal top_k={self.top_k} (top-1 in each group), or be 0 (plain top-k)")
        for name in ("capacity_factor", "aux_loss_coef", "z_loss_coef", "num_shared_experts", "moe_group_tokens",
                     "head_size", "sliding_window", "rope_original_max_len", "rope_attention_factor",
                     "shared_ffn_dim", "dense_ffn_dim", "moe_first_dense", "router_groups", "router_topk_groups",
                     "router_bias_rate", "seq_aux_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"model field {name}={getattr(self, name)} must be >= 0")
        self._check_router()
        if self.rope_type != "default" and self.rope_factor <= 0:
            raise ValueError(f"rope_factor={self.rope_factor} must be > 0 with rope_type={self.rope_type!r}")
        if self.num_experts and self.top_k == 1 and self.norm_topk:
            warnings.warn(ModelWarning("top_k=1 with norm_topk=true: every routing weight is 1, so the gate learns "
                                       "from the auxiliary losses only; set norm_topk=false for Switch-style top-1 "
                                       "routing"), stacklevel=3)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.num_heads

    def _check_latent_attention(self) -> None:
        names = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                 "mscale_all_dim")
        for name in names:
            if getattr(self, name) < 0:
                raise ValueError(f"model field {name}={getattr(self, name)} must be >= 0")
        if not self.kv_lora_rank:
            for name in names[1:]:
                if getattr(self, name):
                    raise ValueError(f"model field {name}={getattr(self, name)} is a latent-attention field; "
                                     "valid: 0, or kv_lora_rank > 0 (multi-head latent attention)")
            return
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2 or self.v_head_dim < 1:
            raise ValueError(f"latent attention needs qk_rope_head_dim even and > 0 and v_head_dim > 0; got "
                             f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}")
        clashes = {"pos_emb": self.pos_emb != "rope", "num_kv_heads": self.kv_heads != self.num_heads,
                   "bias": self.bias, "qkv_bias": self.qkv_bias, "qk_norm": self.qk_norm,
                   "head_size": bool(self.head_size)}
        for name, clash in clashes.items():
            if clash:
                raise ValueError(f"model field {name}={getattr(self, name)!r} does not go with latent attention "
                                 f"(kv_lora_rank={self.kv_lora_rank}); valid: its default, or kv_lora_rank=0")

    @property
    def latent_attention(self) -> bool:
        """Whether attention is multi-head latent attention (kv_lora_rank > 0)."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """The width of each query and key head."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.latent_attention else self.head_dim

    @property
    def value_head_dim(self) -> int:
        """The width of each value head (and of each head's attention output)."""
        return self.v_head_dim if self.latent_attention else self.head_dim

    @property
    def rope_dim(self) -> int:
        """The features of each query and key head the rotary embedding turns."""
        return self.qk_rope_head_dim if self.latent_attention else self.head_dim

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    def _check_router(self) -> None:
        if self.router_scale <= 0:
            raise ValueError(f"model field router_scale={self.router_scale} must be > 0")
        if self.router_bias_rate and not self.router_bias:
            raise ValueError(f"router_bias_rate={self.router_bias_rate} moves a bias the model lacks; valid: "
                             "router_bias=true, or router_bias_rate=0")
        E, groups = self.num_experts, self.router_groups
        if E and groups > 1 and (E % groups or E // groups < 2 or not 1 <= self.router_topk_groups <= groups
                                 or self.top_k > self.router_topk_groups * (E // groups)):
            raise ValueError(f"router_groups={groups} with router_topk_groups={self.router_topk_groups} does not fit "
                             f"num_experts={E}, top_k={self.top_k}; valid: groups of >= 2 experts dividing "
                             "num_experts, router_topk_groups in 1..router_groups holding top_k experts")
        if self.num_prototypes and (self.router_score != "softmax" or groups > 1 or self.router_bias):
            raise ValueError(f"num_prototypes={self.num_prototypes} takes the softmax router without groups or bias; "
                             "valid: num_prototypes=0, or router_score=softmax, router_groups=0, router_bias=false")

    def router_options(self) -> dict[str, Any]:
        """The MoE router's options (shoal.moe.router.Router's keywords) of these fields."""
        return dict(score=self.router_score, expert_groups=self.router_groups, topk_groups=self.router_topk_groups,
                    scale=self.router_scale, bias=self.router_bias, bias_rate=self.router_bias_rate)

    @property
    def dense_width(self) -> int:
        """Hidden width of a dense layer's feed-forward block: dense_ffn_dim, else ffn_dim."""
        return self.dense_ffn_dim or self.ffn_dim

    def is_moe_layer(self, index: int) -> bool:
        """Whether block `index` has experts: every moe_every-th (1-based) block, except the first
        moe_first_dense ones and those moe_dense_layers lists."""
        return (self.num_experts > 0 and (index + 1) % self.moe_every == 0 and index >= self.moe_first_dense
                and index not in self.moe_dense_layers)

    def num_params(self, *, embedding: bool = True, active: bool = False) -> int:
        """Parameter count from the shape. `active`: count only the top_k experts a token uses."""
        D, F, L = self.dim, self.ffn_dim, self.num_layers
        attn = D * self.num_heads * self.head_dim * 2 + D * self.kv_heads * self.head_dim * 2

        def mlp_of(width: int) -> int:
            gated = self.activation == "swiglu"
            return (3 if gated else 2) * D * width + (width * (2 if gated else 1) + D if self.bias else 0)

        mlp = mlp_of(self.dense_width)
        norms = 2 * D * (2 if self.norm == "layernorm" and self.bias else 1)
        if self.bias or self.qkv_bias:
            attn += (self.num_heads + 2 * self.kv_heads) * self.head_dim
        if self.bias:
            attn += D
        if self.qk_norm:
            norms += 2 * self.head_dim
        if self.latent_attention:
            attn = self.latent_attention_params()
        num_moe = sum(self.is_moe_layer(i) for i in range(L))
        experts = self.top_k if active else self.num_experts
        shared = self.num_shared_experts * mlp_of(self.shared_ffn_dim or F) + (D if self.shared_gate else 0)
        moe_layers = 1 if self.share_moe and num_moe and not active else num_moe  # WideNet: one set of weights
        total = (L * (attn + norms) + (L - num_moe) * mlp
                 + moe_layers * (experts * mlp_of(F) + shared + D * self.num_experts))
        total += D * (2 if self.norm == "layernorm" and self.bias else 1)  # final norm
        if embedding:
            total += self.vocab_size * D * (1 if self.tie_embeddings else 2)
            total += self.max_seq_len * D if self.pos_emb == "learned" else 0
        return total

    def latent_attention_params(self) -> int:
        """One latent attention's parameters: queries (wq, or wq_a, q_a_norm, wq_b), the latent (wkv_a,
        kv_a_norm, wkv_b), the shared rotary key (wk_rope) and the output (wo)."""
        D, H, Q, L = self.dim, self.num_heads, self.q_lora_rank, self.kv_lora_rank
        C, N, R, V = self.qk_head_dim, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        queries = D * Q + Q + Q * H * C if Q else D * H * C
        return queries + D * L + L + L * H * (N + V) + D * R + H * V * D

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N + 12 L H E T, N the active non-embedding parameters
        plus the output projection (PaLM, Chowdhery et al. 2022, appendix B); E the mean of the
        query/key and value head widths where they differ (latent attention: 6 L H (C + V) T)."""
        n = self.num_params(embedding=False, active=True) + self.vocab_size * self.dim
        return 6 * n + 6 * self.num_layers * self.num_heads * (self.qk_head_dim + self.value_head_dim) * seq_len

    def replace(self, **overrides: object) -> ModelConfig:
        return dataclasses.replace(self, **overrides)  # type: ignore[arg-type]  # replace checks the field names

    def with_overrides(self, pairs: list[str] | dict[str, str]) -> ModelConfig:
        """Apply `key=value` overrides (strings, as from `--set`), converting to each field's type."""
        items = pairs.items() if isinstance(pairs, dict) else (_split_pair(p) for p in pairs)
        types = {f.name: f.type for f in dataclasses.fields(self)}
        values: dict[str, object] = {}
        for key, raw in items:
            if key not in types:
                where = "[model_config]" if isinstance(pairs, dict) else "--set"
                raise ValueError(unknown_field(key, list(types), where))
            values[key] = _convert(key, str(raw), str(types[key]))
        return self.replace(**values)


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def unknown_field(key: str, fields: list[str], where: str, *, common: tuple[str, ...] | None = None,
                  home: str = "shoal/models/") -> str:
    """The refusal of a model field no config has: the closest names where a typo is likely, else the `common`
    ones (a transformer's by default) of the config defined in `home`."""
    import difflib

    close = difflib.get_close_matches(key, fields, n=3)
    if close:
        return f"unknown model field {key!r} in {where}; valid: {', '.join(close)}, or another field"
    named = [f for f in common or _COMMON_FIELDS if f in fields] or sorted(fields)[:10]  # all: ~1,000 characters
    return (f"unknown model field {key!r} in {where}; valid: {', '.join(named)}, or another of the {len(fields)} "
            f"fields of the model's config ({home})")


_COMMON_FIELDS = ("num_layers", "dim", "num_heads", "num_kv_heads", "ffn_dim", "vocab_size", "max_seq_len", "norm",
                  "activation", "pos_emb", "num_experts", "top_k")
"""The fields of a transformer's shape an unknown one's refusal names first."""


def _split_pair(pair: str) -> tuple[str, str]:
    key, sep, value = pair.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set takes key=value, got {pair!r}")
    return key.strip(), value.strip()


def _convert(key: str, raw: str, type_name: str) -> object:
    try:
        if "None" in type_name and raw.lower() in ("none", "null", ""):
            return None
        if type_name.startswith("bool"):
            if raw.lower() not in ("true", "false", "1", "0", "on", "off"):
                raise ValueError
            return raw.lower() in ("true", "1", "on")
        if type_name.startswith("int"):
            return int(raw)
        if type_name.startswith("float"):
            return float(raw)
        if type_name.startswith("tuple[int"):  # "0,3", or "[0, 3]" as a stored config writes it
            text = raw.strip().removeprefix("[").removeprefix("(").removesuffix("]").removesuffix(")")
            return tuple(int(v) for v in text.split(",") if v.strip())
        return raw
    except ValueError:
        raise ValueError(f"model field {key}={raw!r} is not a valid {type_name.split()[0]}") from None


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"model field {name}={value!r} is not valid; valid: {', '.join(choices)}")


_GPT: dict[str, Any] = dict(norm="layernorm", activation="gelu", pos_emb="learned", bias=True, tie_embeddings=True)
_LLAMA3: dict[str, Any] = dict(vocab_size=128256, max_seq_len=8192, rope_theta=500000.0)

PRESETS: dict[str, ModelConfig] = {
    # Small shapes that train on a laptop CPU (tests and the default demo).
    "tiny": ModelConfig(num_layers=4, dim=128, num_heads=8, num_kv_heads=4, ffn_dim=384),
    "tiny-moe": ModelConfig(num_layers=4, dim=128, num_heads=8, num_kv_heads=4, ffn_dim=256, num_experts=4, top_k=2),
    "tiny-gpt": ModelConfig(num_layers=4, dim=128, num_heads=8, ffn_dim=512, **_GPT),
    "small": ModelConfig(num_layers=8, dim=256, num_heads=8, num_kv_heads=4, ffn_dim=768, max_seq_len=512),
    # Well-known large shapes, for the planner (GPT-3: Brown et al. 2020, table 2.1).
    "gpt3-1.3b": ModelConfig(num_layers=24, dim=2048, num_heads=16, ffn_dim=8192,
                             vocab_size=50304, max_seq_len=2048, **_GPT),
    "gpt3-2.7b": ModelConfig(num_layers=32, dim=2560, num_heads=32, ffn_dim=10240,
                             vocab_size=50304, max_seq_len=2048, **_GPT),
    "gpt3-6.7b": ModelConfig(num_layers=32, dim=4096, num_heads=32, ffn_dim=16384,
                             vocab_size=50304, max_seq_len=2048, **_GPT),
    "gpt3-13b": ModelConfig(num_layers=40, dim=5120, num_heads=40, ffn_dim=20480,
                            vocab_size=50304, max_seq_len=2048, **_GPT),
    "gpt3-175b": ModelConfig(num_layers=96, dim=12288, num_heads=96, ffn_dim=49152,
                             vocab_size=50304, max_seq_len=2048, **_GPT),
    # Llama 3 (Meta 2024, "The Llama 3 Herd of Models", table 3).
    "llama3-8b": ModelConfig(num_layers=32, dim=4096, num_heads=32, num_kv_heads=8, ffn_dim=14336, **_LLAMA3),
    "llama3-70b": ModelConfig(num_layers=80, dim=8192, num_heads=64, num_kv_heads=8, ffn_dim=28672, **_LLAMA3),
    "llama3-405b": ModelConfig(num_layers=126, dim=16384, num_heads=128, num_kv_heads=8, ffn_dim=53248, **_LLAMA3),
    # BERT-Large's shape (Devlin et al. 2019) as a decoder, for planning.
    "bert-large": ModelConfig(num_layers=24, dim=1024, num_heads=16, ffn_dim=4096,
                              vocab_size=30528, max_seq_len=512, **_GPT),
    # Mixtral 8x7B (Jiang et al. 2024): 8 experts, top-2, in every layer.
    "mixtral-8x7b": ModelConfig(num_layers=32, dim=4096, num_heads=32, num_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                                max_seq_len=32768, rope_theta=1e6, num_experts=8, top_k=2),
    # DeepSeek-V3 (DeepSeek-AI 2024, arXiv 2412.19437, section 4.2; its config.json): latent attention, 3 dense
    # layers, then 256 routed experts (top-8 of 8 groups' best 4, sigmoid, bias-balanced) and one shared expert;
    # the 4K pretraining context. The multi-token-prediction module is not counted (shoal does not build it).
    "deepseek-v3": ModelConfig(num_layers=61, dim=7168, num_heads=128, ffn_dim=2048, vocab_size=129280,
                               max_seq_len=4096, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                               qk_nope_head_dim=128, v_head_dim=128, moe_first_dense=3, dense_ffn_dim=18432,
                               num_experts=256, top_k=8, capacity_factor=0.0, router_score="sigmoid",
                               router_groups=8, router_topk_groups=4, router_scale=2.5, router_bias=True,
                               router_bias_rate=1e-3, seq_aux_coef=1e-4, aux_loss_coef=0.0, z_loss_coef=0.0,
                               num_shared_experts=1, shared_ffn_dim=2048),
    # Qwen3-235B-A22B (Qwen 2025, arXiv 2505.09388, tables 1-2; its config.json): 128 experts, top-8, q/k norms.
    "qwen3-235b-a22b": ModelConfig(num_layers=94, dim=4096, num_heads=64, num_kv_heads=4, head_size=128, qk_norm=True,
                                   ffn_dim=1536, vocab_size=151936, max_seq_len=40960, rope_theta=1e6,
                                   num_experts=128, top_k=8, capacity_factor=0.0),
}


def get_preset(name: str) -> ModelConfig:
    """The preset called `name`; ValueError listing the valid names otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(PRESETS)} or hf:<dir or config.json>")
    return PRESETS[name]


def parameters_text(count: int) -> str:
    """A parameter count as people write it: 0.113M, 8.03B (three significant figures)."""
    return f"{count / 1e9:.3g}B" if count >= 999.5e6 else f"{count / 1e6:.3g}M"  # 999.6M reads 1B
