"""Recount, from the code as it is, the op counts the cost model's host-overhead terms multiply.

`shoal.planner.costs` prices a CPU step's host time as counts of ops times the seconds one op
costs, which calibration measures (`measure._measure_dispatch`, `_measure_dtensor_dispatch`).
The counts (OPS_PER_BLOCK, RING_OPS_PER_HOP, DTENSOR_DISPATCHES, DTENSOR_DISPATCHES_PER_OP) come
from the model and the parallel code: these functions count them again, so that a test fails when
the code they were counted from changes (tests/test_planner_counts.py; the compiled block's kernel
count on a GPU is `block_ops(cfg, device="cuda", compiled=True)`).

A host op is what calibration times one of: a call from Python into the dispatcher, its backward
included. `host_ops` counts them with torch.profiler as the outermost aten and c10d events of a
piece of code (what an op calls inside it is part of its cost); an op whose every tensor result
is a view of an input (no kernel, no new memory) counts half. A DTensor dispatch is one
"PythonSubclass" event: DTensor's `__torch_dispatch__`, sharding propagation and wrapping, which
`_measure_dtensor_dispatch` times per op of its chain.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from shoal.models.config import ModelConfig

_HOST = ("aten::", "c10d::")


@functools.cache
def is_view(name: str) -> bool:
    """Whether every overload of aten op `name` ("aten::view") that returns tensors returns views
    of its inputs (schema alias annotations, no write)."""
    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None) if name.startswith("aten::") else None
    if packet is None:
        return False
    returns = [getattr(packet, o)._schema.returns for o in packet.overloads()]
    returns = [r for r in returns if r and all(str(x.type) in ("Tensor", "Tensor[]", "List[Tensor]") for x in r)]
    return bool(returns) and all(x.alias_info is not None and not x.alias_info.is_write for r in returns for x in r)


def host_ops(fn: Callable[[], Any]) -> float:
    """Host ops `fn` runs (see the module docstring): its outermost aten and c10d calls, views at half."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    total = 0.0
    for event in prof.events():
        if event.name.startswith(_HOST) and not _inside_op(event):
            total += 0.5 if is_view(event.name) else 1.0
    return total


def _inside_op(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(_HOST):
            return True
        parent = parent.cpu_parent
    return False


def dtensor_dispatches(fn: Callable[[], Any]) -> int:
    """DTensor dispatches `fn` runs (torch.profiler's "PythonSubclass" events)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(event.name == "PythonSubclass" for event in prof.events())


def block_ops(cfg: ModelConfig, *, device: str = "cpu", compiled: bool = False, dtype: torch.dtype = torch.float32,
              batch: int = 2, seq_len: int = 16) -> float:
    """Host ops of one dense block's forward (OPS_PER_BLOCK), on `device`: eager, `host_ops`;
    compiled (torch.compile of the block, as compile=on runs it), the kernels its forward launches:
    on a GPU every kernel on the device, on a CPU the compiled graph's calls (inductor's C++
    kernels, profiled, and the library kernels it calls: matmuls, attention)."""
    from shoal.models.rope import rope_rows
    from shoal.models.transformer import Block

    torch.manual_seed(0)
    index = next((i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)), 0)
    block = Block(cfg, index).to(device=device, dtype=dtype)
    x = torch.randn(batch, seq_len, cfg.dim, device=device, dtype=dtype, requires_grad=True)
    rope = tuple(t.to(device) for t in rope_rows(cfg)) if cfg.pos_emb == "rope" else None
    if not compiled:
        block(x, rope)  # warm-up: first calls initialise what later ones skip
        return host_ops(lambda: block(x, rope))
    if device == "cpu":
        import torch._inductor.config as inductor

        with inductor.patch({"cpp.enable_kernel_profile": True}):
            run = torch.compile(block)
            run(x, rope)
            return _compiled_calls(lambda: run(x, rope))
    run = torch.compile(block)
    run(x, rope)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(x, rope)
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
               for e in prof.events())


def _compiled_calls(fn: Callable[[], Any]) -> int:
    """Calls made directly by the compiled graphs `fn` runs (inductor's "## Call CompiledFxGraph" events)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.cpu_parent is not None and e.cpu_parent.name.startswith("## Call CompiledFxGraph")
               for e in prof.events())


def ring_ops_per_hop(cp_mesh: Any, *, heads: int = 2, seq_len: int = 16, head_dim: int = 4) -> float:
    """Host ops of one block's ring attention, forward and backward, per ring step (RING_OPS_PER_HOP):
    `host_ops` of shoal.parallel.context.ring_attention over the 1-D mesh `cp_mesh`, divided by its
    size. Call on every rank of the mesh."""
    from shoal.parallel.context import ContextSplit, ring_attention

    split = ContextSplit(cp_mesh)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq_len // split.cp, head_dim, requires_grad=True) for _ in range(3))
    grad = torch.ones_like(q)

    def step() -> None:
        ring_attention(q, k, v, split=split).backward(grad)

    step()
    return host_ops(step) / split.cp


def dtensor_dispatches_per_chain_op() -> float:
    """DTensor dispatches per op of calibration's DTensor chain (DTENSOR_DISPATCHES_PER_OP). Call on
    every rank of the default process group."""
    from shoal.calibration.measure import DTENSOR_CHAIN, dtensor_chain_step

    step = dtensor_chain_step()
    step()
    return dtensor_dispatches(step) / (DTENSOR_CHAIN + 1)
