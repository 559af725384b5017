"""A decoder-only transformer, Llama-style by default (RMSNorm, RoPE, SwiGLU, GQA), GPT-2-style
by switches (LayerNorm, GELU, learned positions). Plain PyTorch: no distributed imports.

Parallelism is applied from outside by module name (`layers.0.attention.wq`, ...), so the
code below infers head counts from tensor shapes (`view(B, T, -1, head_dim)`): a tensor-parallel
rank that holds 1/t of the heads runs the same code unchanged.

Shape legend: B batch, T sequence, D model dim, H heads, K key/value heads, E head dim,
F feed-forward dim, V vocabulary.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from shoal.models.attention import (
    Documents,
    apply_rope,
    causal_attention,
    document_attention,
    documents,
    sliding_window_attention,
)
from shoal.models.config import ModelConfig
from shoal.models.init import InitSpec
from shoal.models.mla import LatentAttention
from shoal.models.rope import rope_rows
from shoal.moe.layer import MoELayer


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, bias=cfg.bias)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.use_rope = cfg.pos_emb == "rope"
        qkv_bias = cfg.bias or cfg.qkv_bias
        self.wq = nn.Linear(cfg.dim, cfg.num_heads * cfg.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.dim, bias=cfg.bias)
        # Qwen3: each query/key head normalised (over its E features) before the rotation.
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.dropout = cfg.dropout
        self.window = cfg.sliding_window
        self.core = (functools.partial(sliding_window_attention, window=cfg.sliding_window)
                     if cfg.sliding_window else causal_attention)
        """(q, k, v, dropout_p) -> attention output, all (B, H, T, E), heads already repeated."""

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                docs: Documents | None = None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BTHE = self.wq(x_BTD).view(B, T, -1, self.head_dim)
        k_BTKE = self.wk(x_BTD).view(B, T, -1, self.head_dim)
        v_BTKE = self.wv(x_BTD).view(B, T, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q_BTHE, k_BTKE = self.q_norm(q_BTHE), self.k_norm(k_BTKE)
        if self.use_rope and rope is not None:
            cos, sin = (rope[0][:T], rope[1][:T]) if docs is None else (rope[0][docs[0]], rope[1][docs[0]])
            q_BTHE, k_BTKE = apply_rope(q_BTHE, cos, sin), apply_rope(k_BTKE, cos, sin)
        groups = q_BTHE.shape[2] // k_BTKE.shape[2]
        if groups > 1:
            k_BTKE = k_BTKE.repeat_interleave(groups, dim=2)
            v_BTKE = v_BTKE.repeat_interleave(groups, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q_BTHE, k_BTKE, v_BTKE))  # (B, H, T, E)
        dropout = self.dropout if self.training else 0.0
        if docs is None:
            y_BHTE = self.core(q, k, v, dropout)
        else:
            y_BHTE = document_attention(q, k, v, docs[1], dropout, self.window)
        return self.wo(y_BHTE.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU (w2(silu(w1 x) * w3 x), Shazeer 2020) or GELU MLP (w2(gelu(w1 x)))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        width = cfg.dense_width
        self.w1 = nn.Linear(cfg.dim, width, bias=cfg.bias)
        self.w2 = nn.Linear(width, cfg.dim, bias=cfg.bias)
        self.w3 = nn.Linear(cfg.dim, width, bias=cfg.bias) if cfg.activation == "swiglu" else None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x_BTD), approximate="tanh"))
        return self.w2(F.silu(self.w1(x_BTD)) * self.w3(x_BTD))


def make_ffn(cfg: ModelConfig, index: int) -> nn.Module:
    """The feed-forward slot of block `index`: dense, or a Mixture-of-Experts layer."""
    if cfg.is_moe_layer(index):
        return MoELayer(cfg.dim, cfg.ffn_dim, num_experts=cfg.num_experts, top_k=cfg.top_k, normalize=cfg.norm_topk,
                        num_prototypes=cfg.num_prototypes, capacity_factor=cfg.capacity_factor,
                        group_tokens=cfg.moe_group_tokens,
                        num_shared_experts=cfg.num_shared_experts, shared_ffn_dim=cfg.shared_ffn_dim,
                        shared_gate=cfg.shared_gate, activation=cfg.activation, bias=cfg.bias,
                        init_std=cfg.init_std, num_layers=cfg.num_layers, aux_loss_coef=cfg.aux_loss_coef,
                        z_loss_coef=cfg.z_loss_coef, aux_loss_pooled=cfg.aux_loss_pooled,
                        seq_aux_coef=cfg.seq_aux_coef, router=cfg.router_options())
    return FeedForward(cfg)


class Block(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.attention_norm = make_norm(cfg)
        self.attention = LatentAttention(cfg) if cfg.latent_attention else Attention(cfg)
        self.ffn_norm = make_norm(cfg)
        self.feed_forward = make_ffn(cfg, index)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                docs: Documents | None = None) -> torch.Tensor:
        # docs by keyword, and only when set: tensor parallelism's input hooks see the positional inputs
        h_BTD = self.attention(self.attention_norm(x_BTD), rope, **({} if docs is None else {"docs": docs}))
        x_BTD = x_BTD + self.dropout(h_BTD)
        return x_BTD + self.dropout(self.feed_forward(self.ffn_norm(x_BTD)))


class Transformer(nn.Module):
    """Token ids (B, T) -> logits (B, T, V).

    `layers` is a ModuleDict keyed "0".."L-1" so that a pipeline split can keep a subset by
    name; a stage given hidden states (floats) instead of token ids skips the embeddings (a
    stage that lacks `tok_embeddings` always gets them; the last stage keeps a tied one for its
    head), and one that lacks `output` returns them.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings: nn.Module | None = (
            nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.pos_emb == "learned" else None
        )
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.num_layers)})
        if cfg.share_moe:  # WideNet (Xue et al. 2021): one MoE layer's weights in every MoE block
            moe_blocks = [b for b in self.layers.values() if isinstance(b.feed_forward, MoELayer)]
            for block in moe_blocks[1:]:
                block.feed_forward = moe_blocks[0].feed_forward
        self.norm: nn.Module | None = make_norm(cfg)
        self.output: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if cfg.pos_emb == "rope":  # rotation rows (T, E): shoal.models.rope.rotation_rows
            cos, sin = rope_rows(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) weights; residual output projections scaled by 1/sqrt(2L) (GPT-2)."""
        std = self.config.init_std
        for name, param in self.named_parameters():
            if param.dim() == 1:
                nn.init.ones_(param) if name.endswith("norm.weight") else nn.init.zeros_(param)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(param, std=std / math.sqrt(2 * self.config.num_layers))
            else:
                nn.init.normal_(param, std=std)
        for module in self.modules():
            if isinstance(module, MoELayer):  # stacked expert weights: their own rule, same scales
                module.init_weights(std, self.config.num_layers)

    def init_spec(self, name: str, ndim: int) -> InitSpec:
        """How parameter `name` (of `ndim` dims) starts, by the rules of `init_weights`, for
        building on the meta device and materializing each rank's slice (shoal.models.init)."""
        std = self.config.init_std
        leaf = name.rsplit(".", 1)[-1]
        stacked = ".experts." in name or ".shared." in name  # MoE experts' stacked (E, ...) weights
        if ndim == 1:
            return InitSpec("ones") if name.endswith("norm.weight") else InitSpec("zeros")
        if stacked and leaf.startswith("b"):
            return InitSpec("zeros")
        if name.endswith(("wo.weight", "w2.weight")) or (stacked and leaf == "w2"):
            return InitSpec("normal", std / math.sqrt(2 * self.config.num_layers))
        return InitSpec("normal", std)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the buffers that are not parameters (the rotary tables), on their device:
        after building on the meta device they hold no values."""
        if hasattr(self, "rope_cos"):
            cos, sin = rope_rows(self.config)
            self.get_buffer("rope_cos").copy_(cos)
            self.get_buffer("rope_sin").copy_(sin)

    def num_params(self) -> int:
        """Parameters this module holds (a pipeline stage counts its own; shared ones once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the whole model (see ModelConfig.flops_per_token)."""
        return self.config.flops_per_token(seq_len)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """With `doc_eos_id` set (--doc-mask on) each document of a packed sequence is its own:
        attention stays inside it and positions restart at its first token. Only a model that
        sees the token ids can find the documents (shoal.rules refuses pp and cp with it)."""
        embed = self.tok_embeddings is not None and not tokens_BT.is_floating_point()  # else hidden states
        docs = documents(tokens_BT, self.config.doc_eos_id) if self.config.doc_eos_id >= 0 and embed else None
        h_BTD = self.tok_embeddings(tokens_BT) if embed else tokens_BT  # type: ignore[misc]  # embed: not None
        if self.pos_embeddings is not None:
            positions = docs[0] if docs is not None else torch.arange(h_BTD.shape[1], device=h_BTD.device)
            h_BTD = h_BTD + self.pos_embeddings(positions)
        h_BTD = self.dropout(h_BTD)
        rope = (self.rope_cos, self.rope_sin) if hasattr(self, "rope_cos") else None
        for layer in self.layers.values():
            h_BTD = layer(h_BTD, rope) if docs is None else layer(h_BTD, rope, docs=docs)
        if self.norm is not None:
            h_BTD = self.norm(h_BTD)
        return self.output(h_BTD) if self.output is not None else h_BTD
