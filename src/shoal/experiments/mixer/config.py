"""The shape of an MLP-Mixer image classifier, dense or Sparse-MLP, as data: the fields `--set
key=value` overrides, the `mixer` and `sparse-mlp` presets, and the parameter and FLOP counts.
No torch: the command line and shoal.rules read it before any worker starts.

Sparse-MLP (Lou et al. 2021, arXiv 2109.02008) turns a Mixer block's two MLPs into
Mixture-of-Experts layers: the token-mixing MLP (which mixes along the patch dimension, one
"token" per channel) becomes MoE_S, the channel-mixing MLP (along the channel dimension, one
token per patch) becomes MoE_C. Before MoE_S, "re-represent" linear layers map the C channels to
C' (fewer vectors to route) and the S patches to S' (each expert's width), and after it map back.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

from shoal.models.config import ModelWarning, _convert, _split_pair, unknown_field


@dataclass(frozen=True, kw_only=True)
class MixerConfig:
    """An MLP-Mixer (Tolstikhin et al. 2021) on square images; with num_experts > 0 every
    moe_every-th block is a Sparse-MLP block (both MLPs Mixture-of-Experts layers)."""

    image_size: int = 8
    """Height and width of the input images, in pixels."""
    channels: int = 1
    """Colour channels of the input images."""
    patch_size: int = 2
    """Side of the square patches; it must divide image_size."""
    num_classes: int = 10
    num_layers: int = 4
    dim: int = 64
    """C: the channels each patch is embedded into."""
    token_ffn_dim: int = 32
    """Hidden width of the token-mixing MLP (per expert in MoE_S)."""
    channel_ffn_dim: int = 128
    """Hidden width of the channel-mixing MLP (per expert in MoE_C)."""
    num_experts: int = 0
    """Experts of each MoE layer (MoE_S and MoE_C alike); 0: a dense Mixer."""
    moe_every: int = 1
    """Every moe_every-th block is sparse (when num_experts > 0): blocks moe_every-1, 2*moe_every-1, ..."""
    top_k: int = 1
    """Experts each routed vector goes to (Sparse-MLP routes top-1, as Switch does)."""
    norm_topk: bool = False
    """Rescale the top_k weights to sum to 1 (see ModelConfig.norm_topk); off for top-1."""
    num_prototypes: int = 0
    """Expert prototyping (M6-T): this many groups of experts, top-1 in each (must equal top_k)."""
    capacity_factor: float = 1.25
    """Vectors an expert takes per image as a multiple of its even share; 0: dropless."""
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    rr_channels: int = 0
    """Re-represent: MoE_S routes this many channel vectors per image (a linear C -> C' before the
    experts, C' -> C after); 0: no such layers (C' = C)."""
    rr_patches: int = 0
    """Re-represent: the width of the vectors MoE_S routes (a linear S -> S' before, S' -> S
    after); 0: no such layers (S' = S)."""
    norm_eps: float = 1e-6
    init_std: float = 0.0
    """Standard deviation of the normal initial weights; 0: 1/sqrt(fan_in) for each matrix."""

    def __post_init__(self) -> None:
        for name in ("image_size", "channels", "patch_size", "num_classes", "num_layers", "dim", "token_ffn_dim",
                     "channel_ffn_dim", "moe_every", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"model field {name}={getattr(self, name)} must be >= 1")
        for name in ("num_experts", "num_prototypes", "capacity_factor", "aux_loss_coef", "z_loss_coef",
                     "rr_channels", "rr_patches", "init_std"):
            if getattr(self, name) < 0:
                raise ValueError(f"model field {name}={getattr(self, name)} must be >= 0")
        if self.image_size % self.patch_size:
            valid = ", ".join(str(p) for p in range(1, self.image_size + 1) if self.image_size % p == 0)
            raise ValueError(f"patch_size={self.patch_size} does not divide image_size={self.image_size}; "
                             f"valid: {valid}")
        if self.num_experts and self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} must lie in 1..num_experts={self.num_experts}")
        if self.num_prototypes and (self.num_experts % self.num_prototypes or self.top_k != self.num_prototypes):
            raise ValueError(f"num_prototypes={self.num_prototypes} must divide num_experts={self.num_experts} "
                             f"and equal top_k={self.top_k} (top-1 in each group), or be 0 (plain top-k)")
        if self.num_experts and self.top_k == 1 and self.norm_topk:
            warnings.warn(ModelWarning("top_k=1 with norm_topk=true: every routing weight is 1; set "
                                       "norm_topk=false"), stacklevel=3)

    # ------------------------------------------------------------------ derived shapes
    @property
    def num_patches(self) -> int:
        """S: patches per image."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def patch_dim(self) -> int:
        """Pixel values of one patch (its embedding's input width)."""
        return self.patch_size**2 * self.channels

    @property
    def routed_channels(self) -> int:
        """C': the channel vectors MoE_S routes per image."""
        return self.rr_channels or self.dim

    @property
    def routed_patches(self) -> int:
        """S': the width of each vector MoE_S routes."""
        return self.rr_patches or self.num_patches

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts > 0 and (index + 1) % self.moe_every == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    # ------------------------------------------------------------------ counts
    def num_params(self, *, active: bool = False) -> int:
        """Parameters from the shape (the module counts the same; a test checks). `active`: only
        the top_k experts a vector uses."""
        C, S = self.dim, self.num_patches
        Cr, Sr = self.routed_channels, self.routed_patches

        def mlp(width: int, hidden: int) -> int:
            return 2 * width * hidden + hidden + width

        def moe(width: int, hidden: int) -> int:
            experts = self.top_k if active else self.num_experts
            return experts * mlp(width, hidden) + width * self.num_experts  # experts and the gate

        norms = 2 * 2 * C
        rr = (2 * C * Cr + Cr + C if self.rr_channels else 0) + (2 * S * Sr + Sr + S if self.rr_patches else 0)
        dense_block = norms + mlp(S, self.token_ffn_dim) + mlp(C, self.channel_ffn_dim)
        sparse_block = norms + rr + moe(Sr, self.token_ffn_dim) + moe(C, self.channel_ffn_dim)
        sparse = self.num_moe_layers
        body = (self.num_layers - sparse) * dense_block + sparse * sparse_block
        return self.patch_dim * C + C + body + 2 * C + C * self.num_classes + self.num_classes

    def flops_per_image(self) -> float:
        """Training FLOPs of one image: 6 x (multiply-adds of the forward's matrix products), each
        routed vector through top_k experts, plus the routers and re-represent layers (elementwise
        work, norms and softmax left out, as in 6N)."""
        C, S = self.dim, self.num_patches
        Cr, Sr, E, K = self.routed_channels, self.routed_patches, self.num_experts, self.top_k
        token_dense = C * 2 * S * self.token_ffn_dim
        channel_dense = S * 2 * C * self.channel_ffn_dim
        rr = (2 * S * C * Cr if self.rr_channels else 0) + (2 * Cr * S * Sr if self.rr_patches else 0)
        token_sparse = Cr * (K * 2 * Sr * self.token_ffn_dim + Sr * E) + rr
        channel_sparse = S * (K * 2 * C * self.channel_ffn_dim + C * E)
        sparse = self.num_moe_layers
        body = (self.num_layers - sparse) * (token_dense + channel_dense) + sparse * (token_sparse + channel_sparse)
        return 6.0 * (S * self.patch_dim * C + body + C * self.num_classes)

    # ------------------------------------------------------------------ overrides
    def replace(self, **overrides: object) -> MixerConfig:
        return dataclasses.replace(self, **overrides)  # type: ignore[arg-type]  # replace checks the field names

    def with_overrides(self, pairs: list[str] | dict[str, str]) -> MixerConfig:
        """Apply `key=value` overrides (strings, as from `--set`), converting to each field's type."""
        items = pairs.items() if isinstance(pairs, dict) else (_split_pair(p) for p in pairs)
        types = {f.name: f.type for f in dataclasses.fields(self)}
        values: dict[str, object] = {}
        for key, raw in items:
            if key not in types:
                where = "[model_config]" if isinstance(pairs, dict) else "--set"
                raise ValueError(unknown_field(key, list(types), f"{where} for a Mixer", common=COMMON_FIELDS,
                                               home="shoal/experiments/mixer/config.py"))
            values[key] = _convert(key, str(raw), str(types[key]))
        return self.replace(**values)


COMMON_FIELDS = ("num_layers", "dim", "num_experts", "top_k", "patch_size", "image_size", "num_classes")
"""The fields an unknown one's refusal names first."""

MIXER_PRESETS: dict[str, MixerConfig] = {
    # 8x8 digits in 2x2 patches: S = 16 patches of C = 64 channels, 4 blocks.
    # channel_ffn_dim 154: the training FLOPs per image of `sparse-mlp` (top-1) exactly (9.17M).
    "mixer": MixerConfig(channel_ffn_dim=154),
    # Sparse-MLP: blocks 2 and 4 sparse, 4 experts per MoE layer, top-1; MoE_S routes C' = 32
    # channel vectors of S' = 32 re-represented patches per image.
    "sparse-mlp": MixerConfig(num_experts=4, moe_every=2, top_k=1, rr_channels=32, rr_patches=32),
}
