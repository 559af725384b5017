"""Float8 training of the transformer blocks' linear layers (the plan option `fp8=rowwise|tensorwise`), by
torchao's float8 training (`torchao.float8`): each `nn.Linear` inside a block becomes torchao's `Float8Linear`,
whose three matmuls (output, input gradient, weight gradient) cast their operands to float8 with dynamic
scales and accumulate in higher precision; the weights stay the run's master weights. Everything else
(embedding, norms, attention's softmax, the head, MoE routers and experts) runs in bf16, as the plan's
precision says (`rules` requires bf16 beside fp8).

Recipes (torchao's names, `Float8LinearConfig.from_recipe_name`): `rowwise`, the default, scales each row of
each operand (e4m3 everywhere, power-of-two scales): more accurate; `tensorwise` scales each tensor as a whole
(e4m3 forward, e5m2 gradients): the one whose weights FSDP2 can gather in float8 (torchao's
`enable_fsdp_float8_all_gather`, on here when the fsdp axis shards through FSDP2).

Tensor parallel runs DTensor's own Colwise/RowwiseParallel styles over the Float8Linear modules (their weights
DTensors, the float8 casts and scales computed on them), so the activations travel in bf16. torchao's float8
styles (`Float8ColwiseParallel`, `Float8RowwiseParallel`, tensorwise only) would send them in float8, but gloo
carries no float8 dtype, so no CPU test could check them; they are not used.

Which layers: a block's linear layers outside its MoE layers whose both dims are multiples of 16 (what the
float8 matmul `torch._scaled_mm` requires of its operands; torchtitan skips the others with the same filter).

Order in `parallelize`: float8 conversion first, before tensor parallel, recompute, compile and the data
engine, as torchtitan converts before it parallelizes: the styles and FSDP2 see `Float8Linear` modules.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from shoal.moe.layer import MoELayer
from shoal.parallel.data import blocks_of
from shoal.plan import Plan

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig

MIN_CAPABILITY = (8, 9)
"""The CUDA compute capability of the first GPUs with float8 tensor cores (Ada Lovelace, Hopper)."""


def float8_config(recipe: str, *, fsdp_float8_gather: bool = False) -> Float8LinearConfig:
    """torchao's config of `recipe`, gathering weights in float8 under FSDP2 where asked and the recipe allows
    (tensorwise scaling only)."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_float8_gather and recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def convertible(module: nn.Module) -> bool:
    """A linear layer whose dims `torch._scaled_mm` takes (both multiples of 16)."""
    return type(module) is nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: nn.Module, *, plan: Plan, device_type: str, fsdp_float8_gather: bool = False) -> nn.Module:
    """Convert the blocks' linear layers of `model` to torchao's Float8Linear under `plan.fp8` (in place; returns
    it); a no-op without fp8. ValueError (one line) on a CUDA GPU without float8 matmuls or without torchao."""
    if plan.fp8 is None:
        return model
    _check_device(plan.fp8, device_type)
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as err:
        raise ValueError(f"fp8={plan.fp8} trains through torchao's float8 training, which is not installed "
                         f"({err}); valid: pip install 'shoal[fp8]', or leave fp8 out") from None
    config = float8_config(plan.fp8, fsdp_float8_gather=fsdp_float8_gather)
    if plan.fp8 == "rowwise" and plan.compile:
        # Compiled rowwise training can reach NaN losses unless inductor rounds low-precision intermediates as
        # eager does (pytorch issue 150859; torchtitan sets the same for its rowwise recipe).
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
    for block in blocks_of(model):
        skipped = {id(m) for moe in block.modules() if isinstance(moe, MoELayer) for m in moe.modules()}
        convert_to_float8_training(block, config=config, module_filter_fn=lambda m, _name, skipped=skipped:
                                   convertible(m) and id(m) not in skipped)
    return model


def _check_device(recipe: str, device_type: str) -> None:
    if device_type != "cuda":
        return  # torch's CPU build runs the float8 matmuls (emulated), so CPU runs test the same path
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        have, need = ".".join(map(str, capability)), ".".join(map(str, MIN_CAPABILITY))
        raise ValueError(f"fp8={recipe} needs a GPU with float8 tensor cores, compute capability >= {need}; "
                         f"{torch.cuda.get_device_name()} has {have}; valid: leave fp8 out (bf16) on this GPU")


def is_float8(module: nn.Module) -> bool:
    """True for torchao's Float8Linear (False where torchao is not installed)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return False
    return isinstance(module, Float8Linear)
