"""Rotary position embeddings (Su et al. 2021, RoFormer) and their long-context scalings.

`inverse_frequencies` gives the frequency of each rotated pair and the factor cos/sin are
multiplied by, for every `rope_type` Hugging Face configs use on the families shoal reads:
- default: theta^(-2i/E);
- linear: default / factor (position interpolation, Chen et al. 2023);
- dynamic: NTK-aware scaling whose base grows once a sequence passes max_seq_len; shoal's
  tables stop at max_seq_len, where it equals the default, as transformers computes it for any
  sequence up to max_position_embeddings;
- llama3: Llama 3.1's rescale (Meta 2024): long wavelengths divided by the factor, short ones
  kept, a smooth blend between;
- yarn: YaRN (Peng et al. 2023): a linear ramp over the dimensions between interpolated and
  original frequencies, and an attention factor on cos and sin.
The arithmetic follows transformers' float32 order, so the tables are the same numbers.
Plain PyTorch: no distributed imports.

Shape legend: T positions, E/2 rotated pairs per head, E features per head.
"""

from __future__ import annotations

import math

import torch

from shoal.models.config import ModelConfig


def _default(cfg: ModelConfig, base: float | None = None) -> torch.Tensor:
    dim = cfg.rope_dim
    return 1.0 / ((base or cfg.rope_theta) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def _dynamic_base(cfg: ModelConfig) -> float:
    """dynamic's base at seq_len = max_seq_len: theta times a factor that is 1 up to float64 rounding
    (kept, so the table is the same numbers as transformers')."""
    factor, dim = cfg.rope_factor, cfg.rope_dim
    return cfg.rope_theta * ((factor * cfg.max_seq_len / cfg.max_seq_len) - (factor - 1)) ** (dim / (dim - 2))


def _llama3(cfg: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_len or cfg.max_seq_len
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn(cfg: ModelConfig) -> torch.Tensor:
    dim, base, factor = cfg.rope_dim, cfg.rope_theta, cfg.rope_factor
    old_len = cfg.rope_original_max_len or cfg.max_seq_len

    def dimension_at(rotations: float) -> float:  # the dimension that turns `rotations` times in old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_at(cfg.rope_beta_fast), dimension_at(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: interpolated
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: 1 except for yarn (its attention temperature)."""
    if cfg.rope_type != "yarn":
        return 1.0
    if cfg.rope_attention_factor:
        return cfg.rope_attention_factor
    return 1.0 if cfg.rope_factor <= 1 else 0.1 * math.log(cfg.rope_factor) + 1.0


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """(E/2,) float32: the angle per position of each rotated pair."""
    if cfg.rope_type == "yarn":
        return _yarn(cfg)
    if cfg.rope_type == "dynamic":
        return _default(cfg, _dynamic_base(cfg))
    inv_freq = _default(cfg)
    if cfg.rope_type == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_type == "llama3":
        return _llama3(cfg, inv_freq)
    return inv_freq


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (max_seq_len, E/2), times the attention factor."""
    angles_TE = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inverse_frequencies(cfg))
    scale = attention_factor(cfg)
    if scale == 1.0:
        return angles_TE.cos(), angles_TE.sin()
    return angles_TE.cos() * scale, angles_TE.sin() * scale


def rotation_rows(cos_TE: torch.Tensor, sin_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables (T, E/2) as whole rows (T, E) that rotate a head's adjacent pairs (x1, x2) to
    (x1 c - x2 s, x2 c + x1 s) as x * cos_rows + (x2, x1) * sin_rows: cos repeated per pair, sin
    signed (-s, s) per pair (shoal.models.transformer.apply_rope). Built once, as the model's
    buffers, so that no forward makes (and autograd keeps) copies of its own."""
    return cos_TE.repeat_interleave(2, dim=-1), torch.stack((-sin_TE, sin_TE), dim=-1).flatten(-2)


def rope_rows(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """`cfg`'s rotation rows (T, E), cos and signed sin: what a Transformer keeps as buffers."""
    return rotation_rows(*rope_tables(cfg))
