"""Activation recompute (checkpointing) per transformer block: trade compute for activation memory.

- none: keep every activation backward needs.
- full: keep only each block's input; backward reruns the whole block forward first.
  Activation memory per layer drops from sbh(34 + 5as/h) to 2sbh bytes (16-bit activations;
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models").
- selective: keep the outputs of the matrix multiplies and of the attention kernel (costly to
  redo), recompute the cheap, memory-heavy ops between them: norms, rotary embedding, the SwiGLU
  / GELU activation and product, residual adds, and a math-path attention's scores, softmax
  and dropout (the 5as/h term). torch's selective checkpointing (`create_selective_checkpoint_contexts`)
  decides op by op, so the model code stays untouched.

Both wrap each block with torch's `checkpoint_wrapper` (non-reentrant checkpoint), which keeps
parameter names readable by DCP (it strips the wrapper's prefix) and composes with FSDP2 applied
afterwards. Recompute reruns the same kernels on the same inputs, so gradients are unchanged.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from shoal.parallel.data import wrap_blocks
from shoal.plan import Plan

T = TypeVar("T")


def _saved_ops() -> set[object]:
    """Ops whose outputs selective recompute keeps: matmuls, attention kernels, and tensor-parallel
    reductions (re-running those would repeat communication in backward)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    ops: set[object] = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    for n in ("reduce_scatter_tensor", "all_reduce"):
        if functional is not None and hasattr(functional, n):
            ops.add(getattr(functional, n).default)
    return ops


def _policy(saved: set[object], ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn() -> functools.partial:
    """A `context_fn` for torch.utils.checkpoint that saves matmul/attention outputs only."""
    return functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, _saved_ops()))


def apply_recompute(model: nn.Module, *, plan: Plan) -> nn.Module:
    """Wrap every transformer block of `model` for recompute as `plan.ac` asks (in place); no-op for none.
    `plan.ac` is one of none, selective and full (Plan refuses any other)."""
    if plan.ac == "none":
        return model
    kwargs: dict[str, Any] = {"context_fn": selective_context_fn()} if plan.ac == "selective" else {}
    if not wrap_blocks(model, lambda block: checkpoint_wrapper(block, preserve_rng_state=True, **kwargs)):
        raise ValueError(f"ac={plan.ac}: found no repeated blocks (ModuleList/ModuleDict) to recompute in this model")
    return model


class CreatedStorages(TorchDispatchMode):
    """While active, notes every tensor storage an op creates (not views of its inputs), a DTensor's by
    this rank's local tensor; each storage once. `live_bytes()`: the bytes of those still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.created: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view (of a weight, say) shares its input's storage: only new storages are created.
        inputs = {_local(t).untyped_storage()._cdata for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and _local(t).untyped_storage()._cdata not in inputs:
                storage = _local(t).untyped_storage()
                self.created.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        return out

    def live_bytes(self, settle_s: float = 0.05, patience_s: float = 5.0) -> int:
        """Counted once nothing more dies for `settle_s`: a gloo collective's buffers outlive its wait by a
        moment (its worker thread wakes the waiter, then drops its reference to the finished work), and longer on a
        busy machine. A storage that only garbage in a reference cycle still holds is not kept."""
        deadline = time.monotonic() + patience_s
        self._drop_dead()
        while time.monotonic() < deadline:
            time.sleep(settle_s)
            if not self._drop_dead():
                break
        return sum(size for _, size in self.created.values())

    def _drop_dead(self) -> int:
        """Forget the storages that died; how many did."""
        gc.collect()
        alive = {k: v for k, v in self.created.items() if not v[0].expired()}
        dead, self.created = len(self.created) - len(alive), alive
        return dead


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def kept_activation_bytes(forward: Callable[[], T]) -> tuple[int, T]:
    """(bytes, result) of `forward()`: bytes of the tensors it creates that are still alive when it
    returns, i.e. what autograd (and recompute's caches) keep for backward, plus the output.
    Counts each storage once."""
    with CreatedStorages() as created:
        result = forward()
    return created.live_bytes(), result
