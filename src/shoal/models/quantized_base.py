"""A frozen weight stored in low-bit form (QLoRA, Dettmers et al. 2023), through torchao, and dequantised in forward.

- nf4: torchao's NF4Tensor, QLoRA's 4-bit NormalFloat: blocks of NF4_BLOCK consecutive weights (in the flattened
  (out, in) order) share one absmax scale; the scales are themselves quantised to int8 in blocks of up to
  NF4_SCALER_BLOCK ("double quantisation"), less their mean. 0.5 byte per weight plus the scales.
- int8: torchao's affine quantisation, symmetric, one float32 scale per output row (int8 weight-only's
  granularity). 1 byte per weight plus a scale and zero point per row.

Quantising is deterministic: the same float weight gives the same bytes, so a resumed run that reads its base
again and quantises it holds the base it trained on. Plain PyTorch (no distributed imports).
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.models.lora_config import BASES, NF4_BLOCK, nf4_scaler_block


class QuantizedWeight:
    """One frozen (out, in) weight in low-bit form; `dequantize(dtype)` is the float weight the layer computes
    with. Not a parameter: no engine shards, reduces or checkpoints it."""

    def __init__(self, weight: torch.Tensor, base: str) -> None:
        self.base, self.shape = base, tuple(weight.shape)
        self.dtype = weight.dtype
        w = weight.detach()
        if base == "nf4":
            from torchao.quantization import to_nf4

            self.nf4: Any = to_nf4(w.contiguous(), NF4_BLOCK, nf4_scaler_block(w.numel()))
        elif base == "int8":
            from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

            self.block = (1, self.shape[1])  # one scale per output row
            self.scale, self.zero_point = choose_qparams_affine(
                w, MappingType.SYMMETRIC, self.block, torch.int8, eps=torch.finfo(torch.float32).eps,
                scale_dtype=torch.float32, zero_point_dtype=torch.int8)
            self.codes = quantize_affine(w, self.block, self.scale, self.zero_point, torch.int8)
        else:
            raise ValueError(f"--lora base={base} is not valid; valid: {', '.join(BASES)}")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight (out, in), in `dtype` (default: the quantised weight's own)."""
        if self.base == "nf4":
            w = self.nf4.get_original_weight()
        else:
            from torchao.quantization.quant_primitives import dequantize_affine

            w = dequantize_affine(self.codes, self.block, self.scale, self.zero_point, torch.int8,
                                  output_dtype=self.dtype)
        return w.to(dtype or self.dtype)

    def nbytes(self) -> int:
        """Bytes this weight holds: codes and scales."""
        q = self.nf4 if self.base == "nf4" else None
        parts = ([q.quantized_data, q.quantized_scalers, q.quantization_factor, q.scaler_mean] if q is not None
                 else [self.codes, self.scale, self.zero_point])
        return sum(t.numel() * t.element_size() for t in parts)

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.base}, {self.shape})"


class _LowBitLinear(torch.autograd.Function):
    """x W^T + b with W dequantised in forward and again in backward: autograd keeps the low-bit weight between
    them, not its float copy (QLoRA's memory: torchao's linear_nf4 does the same for NF4)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, weight: QuantizedWeight) -> torch.Tensor:
        ctx.weight = weight
        return torch.nn.functional.linear(x, weight.dequantize(x.dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return grad @ ctx.weight.dequantize(grad.dtype), None, None


def low_bit_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight dequantised, bias) for a frozen weight and bias (no gradient reaches either)."""
    assert bias is None or not bias.requires_grad, "a low-bit layer's bias is frozen with its weight"
    out: torch.Tensor = _LowBitLinear.apply(x, bias, weight)
    return out
