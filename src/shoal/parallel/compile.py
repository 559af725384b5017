"""torch.compile of the model (the plan option `compile=on`, the default on GPUs), by the unit
shoal.rules.compile_unit names.

Under a plan that splits anything, each block is compiled on its own, as torchtitan does: every block
runs the same code, so one compiled graph serves them all (parameters are graph inputs), a cold
compile costs one block's worth, and the data-parallel engines applied afterwards keep their
hooks on the block *outside* the compiled code (FSDP2 gathers and reduces per block in eager
Python, DDP and the ZeRO engine hook the gradients), so compile composes with every engine.
In one process nothing hooks a block, and the whole model is one compiled graph (nn.Module.compile,
in place: names unchanged), as in the plain compiled loop: a forward and a backward each launch one
compiled region instead of one per block, which is what a small model's host time is made of.

Order in `parallelize`: tensor parallel -> recompute -> compile -> data parallel. Compiling a
recompute-wrapped block lets inductor apply the selective policy at compile time: the ops it
recomputes are fused into the backward kernels instead of being re-dispatched one by one.

Compiled kernels fuse element-wise ops, so results differ from eager in rounding only (the
parity tests bound this against a float64 reference like every other path). Graph breaks are
allowed (fullgraph=False): a user's model with a Python-side branch still runs, just less fused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from shoal import rules
from shoal.parallel.data import wrap_blocks
from shoal.plan import Plan


def apply_compile(model: nn.Module, *, plan: Plan) -> nn.Module:
    """Compile `model` when `plan.compile` (in place), whole or block by block (see the module docstring);
    no-op otherwise. A compiled block's parameter names gain `_orig_mod.`, which `clean_name` and DCP's state
    dicts strip."""
    if not plan.compile:
        return model
    if rules.compile_unit(plan) == "model":
        model.compile()
        return model
    blocks = wrap_blocks(model, torch.compile)  # type: ignore[arg-type]  # overloaded; a Module in, a Module out
    if not blocks:
        raise ValueError("compile=on: found no repeated blocks (ModuleList/ModuleDict) to compile in this model; "
                         "valid: compile=off")
    for block in blocks:
        block.register_forward_pre_hook(_wait_async_inputs)
    return model


def _wait_async_inputs(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Hand a compiled block plain tensors. Tensor parallelism's vocab-parallel embedding returns
    an AsyncCollectiveTensor (its reduce-scatter still in flight); compiled with that as an input,
    the block's backward returns a plain gradient where DTensor's redistribute expects its own
    kind (torch 2.13: "'Tensor' object has no attribute '_local_tensor'"). A clone waits for the
    collective and yields an ordinary autograd-tracked tensor, at the cost of one activation copy
    per forward for the first block only."""
    return tuple(a.clone() if isinstance(a, AsyncCollectiveTensor) else a for a in args)
