"""Block-quantised fp8 weights (DeepSeek-V3's published files): float8_e4m3fn weights in blocks of
`weight_block_size` (128 x 128), each block's float32 multiplier in `<key>_scale_inv` of shape
ceil(out / 128) x ceil(in / 128); a weight's value is its fp8 number times its block's multiplier
(DeepSeek's `weight_dequant`, transformers' fine-grained fp8). `--init` and `load_hf_state` turn them
into float32 before the cast to the run's dtype; an fp8 tensor without its multipliers is refused in
one line, never read as numbers. Plain PyTorch: no distributed imports.

Shape legend: O output rows, I input columns, b0 x b1 the block.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}
"""The safetensors fp8 dtypes read as block-quantised weights."""
SCALE_SUFFIX = "_scale_inv"
"""A quantised weight `k`'s multipliers are the tensor `k + SCALE_SUFFIX`."""
DEEPSEEK_BLOCK = (128, 128)
"""The block when no config.json says otherwise (DeepSeek-V3's)."""
Block = tuple[int, int]


def block_size(path: Path, where: str) -> Block:
    """The weight_block_size of the config.json beside the weights at `path` (a folder, or a file in one);
    DEEPSEEK_BLOCK where there is none; a one-line ValueError (beginning with `where`) for a
    quantization_config shoal does not read."""
    folder = path if path.is_dir() else path.parent
    file = folder / "config.json"
    if not file.is_file():
        return DEEPSEEK_BLOCK
    try:
        quant = json.loads(file.read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return DEEPSEEK_BLOCK  # the config's own reader words a bad config.json
    if quant is None:
        return DEEPSEEK_BLOCK
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method != "fp8" or not (isinstance(block, list) and len(block) == 2
                               and all(isinstance(b, int) and b >= 1 for b in block)):
        raise ValueError(f"{where}: config.json's quantization_config {json.dumps(quant)} is not one shoal "
                         "reads; valid: quant_method fp8 with weight_block_size [rows, columns] (DeepSeek-V3's)")
    return block[0], block[1]


def check_scales(where: str, key: str, shape: tuple[int, ...], scale: tuple[str, tuple[int, ...]] | None,
                 block: Block) -> None:
    """One-line ValueError (beginning with `where`) unless fp8 weight `key` of `shape` has float32 block
    multipliers (`scale`: their safetensors dtype and shape) of the shape `block` gives."""
    if scale is None:
        raise ValueError(f"{where}: tensor {key} is fp8 without its block multipliers {key}{SCALE_SUFFIX}; "
                         "valid: DeepSeek-V3's block-quantised files (each fp8 weight beside its float32 "
                         "weight_scale_inv), or weights in float32, bfloat16 or float16")
    want = tuple(math.ceil(n / b) for n, b in zip(shape, block, strict=False))
    if len(shape) != 2 or scale[0] != "F32" or tuple(scale[1]) != want:
        raise ValueError(f"{where}: {key}{SCALE_SUFFIX} is {scale[0]} {tuple(scale[1])} for a weight of shape "
                         f"{tuple(shape)}; valid: float32 of shape {want} ({block[0]} x {block[1]} blocks of a "
                         "2-D weight)")


def dequantize(w_OI: torch.Tensor, scale: torch.Tensor, block: Block, offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """float32 values of fp8 rows and columns `w_OI` of a weight starting at `offset`, given the multipliers
    `scale` of the blocks they lie in (the first block row/column holding row/column `offset`)."""
    (b0, b1), (r0, c0) = block, offset
    s = scale.float().repeat_interleave(b0, dim=0).repeat_interleave(b1, dim=1)
    rows, cols = r0 - (r0 // b0) * b0, c0 - (c0 // b1) * b1
    return w_OI.float() * s[rows:rows + w_OI.shape[0], cols:cols + w_OI.shape[1]]


class DequantizedView:
    """A lazy view of an fp8 weight (safetensors' `get_slice`) whose boxes read as float32 values: each read
    takes the fp8 box and the multipliers of the blocks it covers."""

    def __init__(self, weight: Any, scale: Any, block: Block) -> None:
        self._weight, self._scale, self._block = weight, scale, block

    def get_shape(self) -> list[int]:
        return list(self._weight.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        shape = self.get_shape()
        spans = [(0, n) for n in shape] if index is Ellipsis else [
            (s.start or 0, shape[d] if s.stop is None else s.stop) for d, s in enumerate(index)]
        spans += [(0, n) for n in shape[len(spans):]]
        (r0, r1), (c0, c1) = spans
        (b0, b1) = self._block
        scale = self._scale[r0 // b0:-(-r1 // b0), c0 // b1:-(-c1 // b1)]
        return dequantize(self._weight[r0:r1, c0:c1], scale, self._block, (r0, c0))


def dequantize_state(state: dict[str, torch.Tensor], block: Block, where: str) -> dict[str, torch.Tensor]:
    """`state` with every fp8 weight as float32 values and the multipliers dropped; a one-line ValueError for
    fp8 without them."""
    out = {k: v for k, v in state.items() if not k.endswith(SCALE_SUFFIX) or k[:-len(SCALE_SUFFIX)] not in state}
    for key, w in state.items():
        if w.dtype in FP8_DTYPES.values():
            scale = state.get(key + SCALE_SUFFIX)
            check_scales(where, key, tuple(w.shape),
                         None if scale is None else ("F32" if scale.dtype == torch.float32 else str(scale.dtype),
                                                     tuple(scale.shape)), block)
            assert scale is not None
            out[key] = dequantize(w, scale, block)
    return out
