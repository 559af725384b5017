"""Bytes that shoal's tensor parallelism communicates per layer per step, counted at the
collectives, vs the analytic minimum.

Analytic minimum (Megatron-LM): per layer per step, 2 all-reduces of the (b, s, h) activations
forward (after attention's wo and the MLP's w2) and 2 backward (before wq/wk/wv and w1/w3).
Counted as ring "bus bytes" per rank (what each rank sends; nccl-tests' convention): an
all-reduce of N bytes moves 2(t-1)/t N, an all-gather or a reduce-scatter (t-1)/t N of the full
tensor. With sequence parallelism each all-reduce is an all-gather + a reduce-scatter: the same
bytes, so the minimum is the same.

Every collective is seen by a TorchDispatchMode (the functional collectives DTensor issues and
the c10d ops FSDP and the loss issue), with the size of its group. Per-layer bytes are the
difference between a 4-layer and a 2-layer model divided by 2, so the embedding, the classifier,
the loss and the gradient norm cancel out; the script also reports what they cost.

    python -m bench.tp_comm [--nproc 2] [--batch 4] [--seq-len 64] [--model tiny]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import launch, report
from shoal import rules
from shoal.apply_plan import parallelize
from shoal.mesh import build_mesh
from shoal.models import Transformer, get_preset
from shoal.plan import Plan
from shoal.train.step import split_micro, train_step

_F = torch.ops._c10d_functional
_C = torch.ops.c10d
# op -> (kind, index of the tensor whose size is "the full tensor", how to find the group)
_FUNCOL = {
    _F.all_reduce.default: ("all_reduce", 0),
    _F.all_gather_into_tensor.default: ("all_gather", 0),  # input is the shard: x group size
    _F.reduce_scatter_tensor.default: ("reduce_scatter", 0),
}
_C10D = {
    _C.allreduce_.default: "all_reduce",
    _C._allgather_base_.default: "all_gather",
    _C._reduce_scatter_base_.default: "reduce_scatter",
    _C.allgather_.default: "all_gather",
    _C.reduce_scatter_.default: "reduce_scatter",
    _C.broadcast_.default: "broadcast",
}


class CountCollectives(TorchDispatchMode):
    """Sums the bus bytes per rank of every collective on a group of more than one rank."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run; its own collectives come back through here
        kwargs = kwargs or {}
        if func in _FUNCOL:
            kind, _ = _FUNCOL[func]
            tensor = args[0]
            group = dist.distributed_c10d._resolve_process_group(args[-1])
            full = tensor.numel() * tensor.element_size() * (group.size() if kind == "all_gather" else 1)
            self._add(kind, full, group.size())
        elif func in _C10D:
            kind = _C10D[func]
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            flat = [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else [x])]
            boxed = next(a for a in args if isinstance(a, torch.ScriptObject))
            size = dist.ProcessGroup.unbox(boxed).size()
            full = sum(t.numel() * t.element_size() for t in flat)  # output list of all-gather: full
            if func is _C._reduce_scatter_base_.default:
                full = args[1].numel() * args[1].element_size()  # the input is the full tensor
            self._add(kind, full, size)
        return func(*args, **kwargs)

    def _add(self, kind: str, full_bytes: float, group_size: int) -> None:
        if group_size <= 1:
            return
        share = (group_size - 1) / group_size
        self.bytes[kind] += full_bytes * (2 * share if kind == "all_reduce" else share)
        self.calls[kind] += 1


def _count(plan_text: str, num_layers: int, model: str, batch: int, seq_len: int) -> dict[str, Any]:
    cfg = get_preset(model).replace(num_layers=num_layers, max_seq_len=max(seq_len, 32))
    plan = rules.resolve(Plan.parse(plan_text), world_size=dist.get_world_size())
    mesh = build_mesh(plan)
    torch.manual_seed(0)
    model_ = parallelize(Transformer(cfg), plan, mesh)
    opt = torch.optim.AdamW(model_.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=gen)
    micro = split_micro(seq[:, :-1], seq[:, 1:], 1)
    train_step(model_, opt, micro, grad_clip=1.0)  # warm-up: lazy state outside the count
    counter = CountCollectives()
    with counter:
        train_step(model_, opt, micro, grad_clip=1.0)
    return {"bytes": dict(counter.bytes), "calls": dict(counter.calls), "dim": cfg.dim}


def _rank(plans: list[str], model: str, batch: int, seq_len: int) -> dict[str, Any]:
    return {p: {L: _count(p, L, model, batch, seq_len) for L in (2, 4)} for p in plans}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    t = args.nproc
    plans = [f"tp{t}", f"tp{t},sp=off"]
    res = launch(_rank, t, plans, args.model, args.batch, args.seq_len)[0]
    rows = []
    for p in plans:
        two, four = res[p][2], res[p][4]
        dim = two["dim"]
        minimum = 4 * 2 * (t - 1) / t * args.batch * args.seq_len * dim * 4  # 4 all-reduces, fp32
        per_layer = {k: (four["bytes"].get(k, 0) - two["bytes"].get(k, 0)) / 2 for k in four["bytes"]}
        calls = {k: (four["calls"].get(k, 0) - two["calls"].get(k, 0)) / 2 for k in four["calls"]}
        total = sum(per_layer.values())
        rest = sum(two["bytes"].values()) - 2 * total
        rows.append({"plan": p, "per_layer_kib": total / 1024, "minimum_kib": minimum / 1024,
                     "ratio": total / minimum,
                     "per_layer_calls": ", ".join(f"{k} {v:g}" for k, v in sorted(calls.items())),
                     "outside_layers_kib": rest / 1024})
    report(f"tp_comm_w{t}", rows, notes=(
        f"world {t}, model {args.model} (dim {res[plans[0]][2]['dim']}), batch {args.batch}, seq {args.seq_len}, fp32; "
        "bus bytes per rank per training step (forward + backward + grad norm + optimizer); per layer = "
        "(4 layers - 2 layers)/2; minimum = 4 all-reduces of b*s*h; goal ratio 1.00; with sp the 2 extra "
        "all-reduces per layer are the norm weights' gradients "
        "(2 x dim floats: Partial sums over the sequence shards)"))


if __name__ == "__main__":
    main()
