"""MLP-Mixer and Sparse-MLP image classifiers. Plain PyTorch: no distributed imports.

A Mixer (Tolstikhin et al. 2021) cuts an image into S patches, embeds each into C channels,
and runs blocks of two residual MLPs: token mixing (along the patches, for each channel) and
channel mixing (along the channels, for each patch); then a norm, a mean over the patches and a
linear classifier. A Sparse-MLP block (Lou et al. 2021, arXiv 2109.02008) makes both MLPs
Mixture-of-Experts layers (shoal.moe.layer.MoELayer, so routers, capacity, prototyping, the auxiliary
losses and expert parallelism come with them):
- MoE_S (token mixing): the vectors routed are the channels, each of width S; re-represent
  layers first map (S, C) to (S', C') by two linear maps, one along the channels and one along
  the patches, and map back after the experts.
- MoE_C (channel mixing): the vectors routed are the patches, each of width C.
Routing groups are images: MoELayer groups the vectors of each row of its (B, T, D) input, and
both layers are given one row per image, so capacity and the load-balancing loss are taken per
image and no plan's split of the batch changes any routing.

Blocks live in the ModuleDict `layers` (the units data parallelism shards); the patch embedding
is `patch_embed`, the head `norm` + `output`, as in shoal's Transformer.

Shape legend: B images, S patches, C channels, S'/C' the re-represented patches/channels
(Sr, Cr), P pixel values per patch, K classes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shoal.experiments.mixer.config import MixerConfig
from shoal.models.init import InitSpec
from shoal.moe.layer import MoELayer


class MLP(nn.Module):
    """w2(gelu(w1 x)) with biases, over the last dim."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, hidden)
        self.w2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


def make_moe(cfg: MixerConfig, width: int, hidden: int) -> MoELayer:
    """A Mixture-of-Experts layer over vectors of `width` with experts of the MLP's math."""
    return MoELayer(width, hidden, num_experts=cfg.num_experts, top_k=cfg.top_k, normalize=cfg.norm_topk,
                    num_prototypes=cfg.num_prototypes, capacity_factor=cfg.capacity_factor, activation="gelu",
                    bias=True, num_layers=cfg.num_layers, aux_loss_coef=cfg.aux_loss_coef,
                    z_loss_coef=cfg.z_loss_coef)


class TokenMixing(nn.Module):
    """x_BSC -> the token-mixing update: an MLP along S for each channel; sparse: MoE_S over the
    re-represented (C', S') channel vectors."""

    def __init__(self, cfg: MixerConfig, sparse: bool) -> None:
        super().__init__()
        S, Sr, Cr = cfg.num_patches, cfg.routed_patches, cfg.routed_channels
        self.mlp: nn.Module = make_moe(cfg, Sr, cfg.token_ffn_dim) if sparse else MLP(S, cfg.token_ffn_dim)
        rr_c, rr_s = sparse and cfg.rr_channels > 0, sparse and cfg.rr_patches > 0
        # The re-represent layers (identity where absent): C -> C' and S -> S' before, back after.
        self.channels_in = nn.Linear(cfg.dim, Cr) if rr_c else nn.Identity()
        self.patches_in = nn.Linear(S, Sr) if rr_s else nn.Identity()
        self.patches_out = nn.Linear(Sr, S) if rr_s else nn.Identity()
        self.channels_out = nn.Linear(Cr, cfg.dim) if rr_c else nn.Identity()

    def forward(self, x_BSC: torch.Tensor) -> torch.Tensor:
        h_BCrSr = self.patches_in(self.channels_in(x_BSC).transpose(1, 2))
        h_BCrS = self.patches_out(self.mlp(h_BCrSr))
        return self.channels_out(h_BCrS.transpose(1, 2))


class MixerBlock(nn.Module):
    """x + token_mixing(norm(x)), then x + channel_mixing(norm(x)); sparse: both MoE layers."""

    def __init__(self, cfg: MixerConfig, index: int) -> None:
        super().__init__()
        sparse = cfg.is_moe_layer(index)
        self.token_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.token_mixing = TokenMixing(cfg, sparse)
        self.channel_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.channel_mixing: nn.Module = (make_moe(cfg, cfg.dim, cfg.channel_ffn_dim) if sparse
                                          else MLP(cfg.dim, cfg.channel_ffn_dim))

    def forward(self, x_BSC: torch.Tensor) -> torch.Tensor:
        x_BSC = x_BSC + self.token_mixing(self.token_norm(x_BSC))
        return x_BSC + self.channel_mixing(self.channel_norm(x_BSC))


class Mixer(nn.Module):
    """Images (B, channels, H, W) -> class logits (B, K)."""

    def __init__(self, cfg: MixerConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.dim)
        self.layers = nn.ModuleDict({str(i): MixerBlock(cfg, i) for i in range(cfg.num_layers)})
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.num_classes)
        # Each matrix's fan-in, from the full shapes at construction (a parallel plan later shards them).
        self._fan_in = {name: p.shape[-1] for name, p in self.named_parameters() if p.dim() >= 2}
        self.init_weights()

    def init_spec(self, name: str, ndim: int) -> InitSpec:
        """How parameter `name` starts (shoal.models.init): norms' weights ones, biases zeros, every
        matrix normal(0, init_std), or normal(0, 1/sqrt(fan_in)) when init_std is 0."""
        if ndim == 1 and name.endswith("norm.weight"):
            return InitSpec("ones")
        leaf = name.rsplit(".", 1)[-1]
        if ndim == 1 or (".experts." in name and leaf.startswith("b")):
            return InitSpec("zeros")
        return InitSpec("normal", self.config.init_std or 1 / math.sqrt(self._fan_in[name]))

    @torch.no_grad()
    def init_weights(self) -> None:
        """The values of `init_spec`, drawn from torch's generator (a model built on a real device)."""
        for name, param in self.named_parameters():
            spec = self.init_spec(name, param.dim())
            if spec.kind == "normal":
                nn.init.normal_(param, std=spec.std)
            else:
                nn.init.ones_(param) if spec.kind == "ones" else nn.init.zeros_(param)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def patches(self, images_BHWc: torch.Tensor) -> torch.Tensor:
        """(B, channels, H, W) -> (B, S, P): non-overlapping patches, row by row."""
        p = self.config.patch_size
        B, c, H, W = images_BHWc.shape
        x = images_BHWc.reshape(B, c, H // p, p, W // p, p).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(B, (H // p) * (W // p), p * p * c)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        expected = (cfg.channels, cfg.image_size, cfg.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(f"the Mixer takes images of shape (B, {', '.join(map(str, expected))}); "
                             f"got {tuple(images.shape)}")
        x_BSC = self.patch_embed(self.patches(images))
        for block in self.layers.values():
            x_BSC = block(x_BSC)
        return self.output(self.norm(x_BSC).mean(dim=1))
