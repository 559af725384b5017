"""Low-rank adapters (Hu et al. 2021, LoRA) as a transformation of a model, applied before any parallelism.

`apply_lora(model, lora)` replaces each target projection of shoal's Transformer (an `nn.Linear` (out, in))
by a `LoRALinear` under the same name: the same `weight` and `bias`, frozen, and two trainable parameters
`lora_A` (r, in) and `lora_B` (out, r) beside them, in torch's (out, in) layout as peft's; an MoE slot's experts
by a `LoRAExperts`, the same pair per expert stacked like its weights. Every other parameter is frozen. The
model stays an ordinary module of ordinary parameters: every engine shards, reduces and checkpoints it by the
parameters' `requires_grad`, and tensor parallelism splits each parameter along its feature dims
(`LoRALinear.feature_dims`; the experts' in shoal.parallel.expert): a column-parallel layer's B on dim 0, a
row-parallel layer's A on dim 1, so that the split layer's output equals the whole one's.

Plain PyTorch: no distributed imports. Settings and counts: shoal.models.lora_config.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from shoal.models.config import ModelConfig
from shoal.models.init import InitSpec, fill_slice_
from shoal.models.lora_config import LoRAConfig, block_targets, check_model, check_quantizable, expert_matrices
from shoal.models.quantized_base import QuantizedWeight, low_bit_linear
from shoal.moe.experts import WEIGHT_NAMES, Experts, Linear, Weights

ADAPTER_PARAMS = ("lora_A", "lora_B")
"""The leaf names of an adapter's parameters."""


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is an adapter's (what a LoRA run trains and checkpoints): a linear layer's `lora_A`,
    `lora_B`, or an experts' matrix's (`w1_lora_A`, ...)."""
    return name.rsplit(".", 1)[-1].endswith(ADAPTER_PARAMS)


class LoRALinear(nn.Linear):
    """A frozen linear layer plus a low-rank update: W x + b + scale * B A drop(x).

    Shape legend: r the adapter's rank; `in` and `out` the layer's features."""

    feature_dims: ClassVar[dict[str, tuple[int | None, int | None]]] = {
        "weight": (0, 1), "bias": (0, None), "lora_A": (None, 1), "lora_B": (0, None)}
    """Parameter -> (its output-feature dim, its input-feature dim), None where it has none: what tensor
    parallelism splits (a column-parallel layer its output features, a row-parallel one its input features);
    a parameter without the split dim is replicated."""

    def __init__(self, base: nn.Linear, lora: LoRAConfig) -> None:
        nn.Module.__init__(self)  # the base's weight and bias are kept, not allocated again
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        kwargs: dict[str, Any] = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(lora.r, self.in_features, **kwargs))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, lora.r, **kwargs))
        self.scale = lora.scale
        self.lora_dropout: nn.Module = nn.Dropout(lora.dropout) if lora.dropout > 0 else nn.Identity()
        self.base = lora.base
        self.quantized: QuantizedWeight | None = None
        """The frozen weight in low-bit form (`base` nf4 or int8), once quantised; `weight` is then gone."""

    def quantize_base_(self) -> None:
        """Store the frozen weight as `base` (nf4, int8) in place of its float parameter, once it holds its
        values; nothing for base none, a meta weight or one already quantised."""
        weight = self._parameters.get("weight")
        if self.base == "none" or weight is None or weight.is_meta:
            return
        self.quantized = QuantizedWeight(weight.detach(), self.base)
        del self.weight  # the float weight is freed: the layer computes with the quantised one's dequantisation

    init_buffers = quantize_base_
    """Called by shoal.parallel.materialize once a meta-built model's parameters hold their values."""

    def base_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The frozen weight (out, in) the layer computes with: `weight`, or the quantised one dequantised."""
        if self.quantized is None:
            return self.weight if dtype is None else self.weight.to(dtype)
        return self.quantized.dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        if self.quantized is None:
            return F.linear(x, self.weight, self.bias) + update * self.scale
        return low_bit_linear(x, self.quantized, self.bias) + update * self.scale

    def extra_repr(self) -> str:
        base = f", base={self.base}" if self.base != "none" else ""
        return f"{super().extra_repr()}, r={self.lora_A.shape[0]}, scale={self.scale:g}{base}"


class LoRAExperts(Experts):
    """Frozen Mixture-of-Experts experts plus a low-rank update per expert on each adapted matrix m (w1, w2, w3):
    `{m}_lora_A` (E, r, in) and `{m}_lora_B` (E, out, r), stacked like the weights (expert e's A and B are row e),
    so that expert parallelism splits them by expert and tensor parallelism by the matrix's features as it splits
    the weights (shoal.parallel.expert). Expert e computes m_e x + scale B_e A_e x; peft's adapter of a 3-D
    expert parameter (its ParamWrapper) is the same per-expert pair (shoal.train.peft_io)."""

    def __init__(self, base: Experts, lora: LoRAConfig, matrices: tuple[str, ...]) -> None:
        nn.Module.__init__(self)  # the base's weights are kept, not allocated again
        self.num_experts, self.path = base.num_experts, base.path
        for name in WEIGHT_NAMES:
            self.register_parameter(name, getattr(base, name))
        self.matrices = matrices
        """The adapted matrices, of w1, w2, w3."""
        E = base.num_experts
        for m in matrices:
            _, out_features, in_features = getattr(base, m).shape
            kwargs: dict[str, Any] = {"device": base.w1.device, "dtype": base.w1.dtype}
            self.register_parameter(f"{m}_lora_A", nn.Parameter(torch.empty(E, lora.r, in_features, **kwargs)))
            self.register_parameter(f"{m}_lora_B", nn.Parameter(torch.empty(E, out_features, lora.r, **kwargs)))
        self.scale = lora.scale

    def _weights(self) -> Weights:
        weights = super()._weights()
        for m in self.matrices:
            weights[f"{m}_lora_A"], weights[f"{m}_lora_B"] = getattr(self, f"{m}_lora_A"), getattr(self, f"{m}_lora_B")
        return weights

    def _project(self, linear: Linear, x: torch.Tensor, weights: Weights, matrix: str) -> torch.Tensor:
        y = super()._project(linear, x, weights, matrix)
        a = weights.get(f"{matrix}_lora_A")
        if a is None:
            return y
        return y + linear(linear(x, a, None), weights[f"{matrix}_lora_B"], None) * self.scale

    def choose_path(self, tokens_MD: torch.Tensor) -> str:
        path = super().choose_path(tokens_MD)  # the grouped kernel also wants the rank's rows 16-byte aligned
        rank = self.adapter_pairs()[0][1].shape[1]
        return "padded" if path == "grouped" and rank % 8 else path

    def adapter_pairs(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """(matrix, A (E, r, in), B (E, out, r)) of each adapted matrix."""
        return [(m, getattr(self, f"{m}_lora_A"), getattr(self, f"{m}_lora_B")) for m in self.matrices]

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, adapted={','.join(self.matrices)}, scale={self.scale:g}"


def init_specs(model: nn.Module, lora: LoRAConfig) -> dict[str, InitSpec]:
    """Each adapter parameter's initial values: A as peft's kaiming-uniform's variance (normal, std
    1 / sqrt(3 in)), B zeros (the adapted model starts equal to the base) unless `init_b_std`."""
    b = InitSpec("normal", lora.init_b_std) if lora.init_b_std else InitSpec("zeros")
    specs = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            specs[f"{name}.lora_A"] = InitSpec("normal", 1.0 / math.sqrt(3 * module.in_features))
            specs[f"{name}.lora_B"] = b
        elif isinstance(module, LoRAExperts):
            for m, a, _ in module.adapter_pairs():
                specs[f"{name}.{m}_lora_A"] = InitSpec("normal", 1.0 / math.sqrt(3 * a.shape[-1]))
                specs[f"{name}.{m}_lora_B"] = b
    return specs


class _WithAdapters:
    """A model's `init_spec` (name, ndim) -> InitSpec, extended by the adapters' (for the meta-device build)."""

    def __init__(self, base: Callable[[str, int], InitSpec], specs: dict[str, InitSpec]) -> None:
        self.base, self.specs = base, specs

    def __call__(self, name: str, ndim: int) -> InitSpec:
        spec = self.specs.get(name)
        return spec if spec is not None else self.base(name, ndim)


def apply_lora(model: nn.Module, lora: LoRAConfig, *, seed: int = 0) -> nn.Module:
    """Give `model` (shoal's Transformer, any of its families) adapters on `lora.targets` and freeze the rest
    (in place; returns it). On the meta device the adapters stay shapes (materialized with the model, from its
    `init_spec`, which then knows them); on a real device they are filled here, with the same values: a
    function of `seed` and each parameter's name. A one-line ValueError for a model the targets do not fit."""
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig) or not hasattr(model, "layers"):
        raise ValueError(f"--lora adapts shoal's Transformer (a preset or an hf: model); {type(model).__name__} "
                         "is not one")
    check_model(lora, cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    paths = block_targets(cfg, lora)
    matrices = tuple(sorted(set(expert_matrices(cfg, lora).values())))
    for block in model.layers.values():  # type: ignore[operator]  # a ModuleDict
        for path in paths.values():
            owner_path, _, leaf = path.rpartition(".")
            owner = block.get_submodule(owner_path)
            base = getattr(owner, leaf, None)
            if isinstance(base, nn.Linear):  # an MoE slot holds no dense projections: its experts are below
                check_quantizable(path, tuple(base.weight.shape), lora.base)
                setattr(owner, leaf, LoRALinear(base, lora))
        ffn = block.get_submodule("feed_forward")
        for slot in ("experts", "shared"):  # an MoE slot's routed and shared experts
            experts = getattr(ffn, slot, None)
            if matrices and isinstance(experts, Experts):
                setattr(ffn, slot, LoRAExperts(experts, lora, matrices))
    specs = init_specs(model, lora)
    setattr(model, "init_spec", _WithAdapters(getattr(model, "init_spec"), specs))  # noqa: B009,B010 (the model's own method, extended)
    for name, param in model.named_parameters():
        if is_adapter(name):
            if not param.is_meta:
                with torch.no_grad():
                    values = torch.empty(param.shape, dtype=torch.float32)
                    fill_slice_(values, specs[name], seed=seed, name=name, shape=param.shape, offset=(0,) * param.dim())
                    param.copy_(values)
    for module in model.modules():  # a real-device base is quantised now; a meta one once materialized
        if isinstance(module, LoRALinear):
            module.quantize_base_()
    return model


def unquantized_bases(model: nn.Module) -> list[nn.Parameter]:
    """The float weights of layers that store their base in low-bit form and have not quantised it yet (a model
    on the meta device): what sharded data parallelism must leave whole (shoal.apply_plan)."""
    return [m.get_parameter("weight") for m in model.modules() if isinstance(m, LoRALinear) and m.base != "none"
            and m.quantized is None]


def trainable_share(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters) of `model`."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


class BaseWeights:
    """Pretrained weights (shoal.parallel.materialize.WeightSource) of the base model (None: the seed's), and the
    adapters' from `adapters` (full tensors by name: a peft folder's) or else from their own initial values."""

    def __init__(self, weights: Any, adapters: dict[str, torch.Tensor] | None = None) -> None:
        self.weights, self.adapters = weights, adapters or {}

    def read(self, name: str, shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> torch.Tensor | None:
        if is_adapter(name):
            full = self.adapters.get(name)
            if full is None:
                return None
            if tuple(full.shape) != tuple(shape):
                raise ValueError(f"adapter {name} has shape {tuple(full.shape)}, the model's is {tuple(shape)}; "
                                 "valid: an adapter of this base with the run's rank")
            return full[tuple(slice(a, b) for a, b in box)]
        return None if self.weights is None else self.weights.read(name, shape, box)


@torch.no_grad()
def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s weights with every adapter merged into its layer (W + scale B A), under the base model's names
    (no adapter tensors): what a model without adapters loads to compute the adapted model's outputs."""
    state = {k: v.detach() for k, v in model.state_dict().items() if not is_adapter(k)}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            delta = (module.lora_B.double() @ module.lora_A.double()) * module.scale
            weight = module.base_weight()
            state[f"{name}.weight"] = (weight.double() + delta).to(weight.dtype)
        elif isinstance(module, LoRAExperts):
            for m, a, b in module.adapter_pairs():
                weight = getattr(module, m)
                delta = torch.bmm(b.double(), a.double()) * module.scale  # (E, out, in)
                state[f"{name}.{m}"] = (weight.double() + delta).to(weight.dtype)
    return state
