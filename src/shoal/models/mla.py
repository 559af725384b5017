"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434; DeepSeek-V3, arXiv 2412.19437).

Queries come through a low-rank projection (wq_a, an RMSNorm, wq_b) or one projection (wq); keys
and values through a latent of rank kv_lora_rank (wkv_a, an RMSNorm, wkv_b), which gives every head
a key part without positions (qk_nope_head_dim) and a value (v_head_dim). Positions enter through a
decoupled rotary part (qk_rope_head_dim): each query head's own, and one rotary key (wk_rope) that
every head shares. A head attends with the concatenation [nope, rope] of its query and key, over
values of their own width, at softmax scale 1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times
DeepSeek's YaRN correction squared when the config sets mscale_all_dim.

transformers' DeepseekV3Attention computes the same function; its `kv_a_proj_with_mqa` is shoal's
wkv_a and wk_rope stacked (rows), so that tensor parallelism can replicate the latent while the
shared rotary key's gradient, taken on each rank's heads only, is summed over ranks
(shoal.parallel.tensor). Rotary pairs are shoal's adjacent ones (`apply_rope`), which is the layout
of DeepSeek's published weights (`rope_interleave`); shoal.models.hf.deepseek_v3 reorders the rows
of a file that rotates halves. Plain PyTorch: no distributed imports. Like `Attention`, the code
infers the local head count from tensor shapes, so a tensor-parallel rank runs it unchanged.

Shape legend: B batch, T sequence, D model dim, H heads, N nope part, R rotary part, C = N + R
query/key head, V value head, L latent rank.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from shoal.models.attention import Documents, apply_rope, causal_attention, document_attention, sliding_window_attention
from shoal.models.config import ModelConfig

LATENT_NORM_EPS = 1e-6
"""The epsilon of the two latent RMSNorms: DeepSeek's, fixed (transformers builds them with its
RMSNorm's default, not rms_norm_eps)."""


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(query/key head width), times (0.1 mscale_all_dim ln(rope_factor) + 1)^2 when rope_type
    scales and rope_factor > 1 (transformers' yarn_apply_mscale)."""
    scale = cfg.qk_head_dim ** -0.5
    if cfg.rope_type != "default" and cfg.mscale_all_dim and cfg.rope_factor > 1:
        mscale = 0.1 * cfg.mscale_all_dim * math.log(cfg.rope_factor) + 1.0
        scale = scale * mscale * mscale
    return scale


class LatentAttention(nn.Module):
    """Causal multi-head latent attention; the same forward and seams (`core`, the rotary rows) as
    shoal.models.transformer.Attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H, D, L = cfg.num_heads, cfg.dim, cfg.kv_lora_rank
        self.nope, self.rope, self.value = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk = self.nope + self.rope
        self.wq = nn.Linear(D, H * qk, bias=False) if not cfg.q_lora_rank else None
        self.wq_a = nn.Linear(D, cfg.q_lora_rank, bias=False) if cfg.q_lora_rank else None
        self.q_a_norm = nn.RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS) if cfg.q_lora_rank else None
        self.wq_b = nn.Linear(cfg.q_lora_rank, H * qk, bias=False) if cfg.q_lora_rank else None
        self.wkv_a = nn.Linear(D, L, bias=False)
        self.kv_a_norm = nn.RMSNorm(L, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(L, H * (self.nope + self.value), bias=False)
        self.wk_rope = nn.Linear(D, self.rope, bias=False)
        self.wo = nn.Linear(H * self.value, D, bias=False)
        self.scale = softmax_scale(cfg)
        self.dropout = cfg.dropout
        self.window = cfg.sliding_window
        self.core = (functools.partial(sliding_window_attention, window=cfg.sliding_window)
                     if cfg.sliding_window else causal_attention)
        """(q, k, v, dropout_p, scale=) -> attention output, (B, H, T, C) queries and keys, (B, H, T, V) values."""

    def queries(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """(B, T, H * C): every head's query, nope part then rotary part."""
        if self.wq is not None:
            return self.wq(x_BTD)
        assert self.wq_a is not None and self.q_a_norm is not None and self.wq_b is not None
        return self.wq_b(self.q_a_norm(self.wq_a(x_BTD)))

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                docs: Documents | None = None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_nope_BTHN, q_rope_BTHR = self.queries(x_BTD).view(B, T, -1, self.nope + self.rope).split(
            [self.nope, self.rope], dim=-1)
        kv_BTHF = self.wkv_b(self.kv_a_norm(self.wkv_a(x_BTD))).view(B, T, -1, self.nope + self.value)
        k_nope_BTHN, v_BTHV = kv_BTHF.split([self.nope, self.value], dim=-1)
        k_rope_BT1R = self.wk_rope(x_BTD).view(B, T, 1, self.rope)
        assert rope is not None, "latent attention takes the rotary rows"
        cos, sin = (rope[0][:T], rope[1][:T]) if docs is None else (rope[0][docs[0]], rope[1][docs[0]])
        q_rope_BTHR, k_rope_BT1R = apply_rope(q_rope_BTHR, cos, sin), apply_rope(k_rope_BT1R, cos, sin)
        H = k_nope_BTHN.shape[2]
        q_BTHC = torch.cat((q_nope_BTHN, q_rope_BTHR), dim=-1)
        k_BTHC = torch.cat((k_nope_BTHN, k_rope_BT1R.expand(B, T, H, self.rope)), dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q_BTHC, k_BTHC, v_BTHV))  # (B, H, T, C or V)
        dropout = self.dropout if self.training else 0.0
        if docs is None:
            y_BHTV = self.core(q, k, v, dropout, scale=self.scale)
        else:
            y_BHTV = document_attention(q, k, v, docs[1], dropout, self.window, scale=self.scale)
        return self.wo(y_BHTV.transpose(1, 2).reshape(B, T, -1))
