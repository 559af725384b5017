"""Mixed-precision policies: which dtype parameters are computed in, which dtype gradients are
reduced in, and whether the loss is scaled.

- fp32 (default; the right choice on CPU): everything in float32.
- bf16: parameters cast to bfloat16 for forward/backward, float32 master weights (the sharded
  parameters the optimizer updates) and float32 gradient reduction. bf16 has float32's exponent
  range, so no loss scaling is needed.
- fp16: as bf16 with float16 compute, plus dynamic loss scaling (`LossScaler`): float16's small
  range underflows small gradients unless the loss is multiplied up before backward.

Who casts: FSDP2's `MixedPrecisionPolicy` where FSDP2 runs (data.py applies it), and torch.autocast
(`Autocast`) where no engine shards: one data rank with nothing else split, and DDP. FSDP2 of shard
degree 1 would cast them at a higher host time per step than autocast (bench/engine_overhead.py and
bench/host_overhead.py measure both; docs/measurements.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """The dtypes of one training run."""

    param_dtype: torch.dtype = torch.float32
    """Dtype of the parameters during forward and backward (the master copy stays float32)."""
    reduce_dtype: torch.dtype = torch.float32
    """Dtype gradients are reduced (all-reduced / reduce-scattered) in."""
    loss_scaling: bool = False
    """Multiply the loss before backward and divide the gradients after (fp16)."""

    @classmethod
    def from_name(cls, name: str, *, reduce: str = "fp32") -> PrecisionPolicy:
        """The policy for a plan's `precision=` value; `reduce` chooses the gradient-reduction dtype."""
        for what, value in (("precision", name), ("reduce precision", reduce)):
            if value not in _DTYPES:
                raise ValueError(f"{what} {value!r} is not valid; valid: {', '.join(_DTYPES)}")
        return cls(param_dtype=_DTYPES[name], reduce_dtype=_DTYPES[reduce], loss_scaling=name == "fp16")

    @property
    def is_full(self) -> bool:
        """True when nothing is cast (plain float32 training)."""
        return self.param_dtype == torch.float32 and self.reduce_dtype == torch.float32

    def fsdp_policy(self) -> MixedPrecisionPolicy:
        """FSDP2's policy: cast parameters (and floating inputs) to param_dtype, reduce in reduce_dtype."""
        if self.is_full:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)


class Autocast(nn.Module):
    """`module`'s forward under torch.autocast at `dtype`: its float32 parameters stay the master
    weights the optimizer updates, each product casts them (once per forward: autocast caches the
    casts) and its gradients come back in float32. Element-wise work between products stays in the
    inputs' dtype, so the residual stream stays float32 (nearer the fp32 run than FSDP2's bf16
    copies). Wraps rather than patches the module; its state dicts are taken from `module`, whose
    names carry no wrapper prefix (TorchDataEngine)."""

    def __init__(self, module: nn.Module, *, dtype: torch.dtype, device_type: str) -> None:
        super().__init__()
        self.module, self.dtype, self.device_type = module, dtype, device_type

    def forward(self, *args: object, **kwargs: object) -> object:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al. 2018, "Mixed Precision Training"), kept on
    the device: the scale and the count of good steps are 0-d tensors, so a step never reads them on
    the host (the trainer reads them at its logging and checkpoint steps).

    `scale(loss)` before backward; after it, `unscale(norm of the scaled gradients)` returns the
    factor to multiply the gradients by (1/scale) and whether the scaled gradients overflowed while
    the scale was above 1, and updates the scale: halved after a non-finite norm, doubled after
    `growth_interval` finite ones in a row. The check uses the *global* gradient norm the step
    computes anyway (every rank agrees on it), so it needs no collective of its own.

    An overflow with the scale at 1 or below is not the scale's doing (the scaled gradients are no
    larger than the true ones): it is reported as no overflow, and the step counts as a non-finite
    gradient (shoal.train.step).
    """

    def __init__(self, *, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.growth_interval = growth_interval
        self._scale = torch.tensor(init_scale, dtype=torch.float32)
        self._good = torch.tensor(0, dtype=torch.int64)

    def _on(self, device: torch.device) -> torch.Tensor:
        """The scale tensor, moved once to where the step computes (the loss's device)."""
        if self._scale.device != device:
            self._scale, self._good = self._scale.to(device), self._good.to(device)
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        scale = self._on(loss.device)
        if isinstance(loss, DTensor):  # tp: a replicated loss; the scale joins it as a replicated DTensor
            scale = DTensor.from_local(scale, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim,
                                       run_check=False)
        return loss * scale

    def unscale(self, scaled_grad_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(1/scale, overflow): the factor that unscales the gradients and a 0-d bool, true when the
        scaled norm is non-finite while the scale is above 1; then updates the scale. On the device."""
        scale = self._on(scaled_grad_norm.device)
        finite = torch.isfinite(scaled_grad_norm)
        factor, overflow = scale.reciprocal(), ~finite & (scale > 1)
        good = torch.where(finite, self._good + 1, 0)
        grown = torch.where(good % self.growth_interval == 0, scale * 2, scale)
        self._scale.copy_(torch.where(finite, grown, scale / 2))
        self._good.copy_(good)
        return factor, overflow

    @property
    def scale_value(self) -> float:
        """The scale, read on the host (a synchronisation: for checkpoints, logs and tests)."""
        return float(self._scale)

    @scale_value.setter
    def scale_value(self, value: float) -> None:
        self._scale.fill_(value)

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale_value, "good_steps": int(self._good)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._scale.fill_(float(state["scale"]))
        self._good.fill_(int(state["good_steps"]))
