"""CPU time of the MoE expert compute paths (shoal.moe.experts): which one "auto" should run on CPU.

Forward + backward of `Experts` (SwiGLU, float32) over N tokens routed top-K by a randomly
initialised router, dropless and with capacity factor 1.25, at E = 8 and 16. Paths:
loop (E matmuls over the split), padded (one batched matmul over an (E, C, D) buffer),
grouped (`grouped_mm`, which also runs on CPU in float32). A gather of per-token weights
(M x D x F floats) is not measured: at these sizes it is gigabytes. Paths alternate repeat by
repeat; medians over repeats, with the spread.

    python -m bench.moe_experts_cpu [--tokens 4096] [--dim 256] [--ffn-dim 512] [--threads 1]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from bench.common import measure_pair, report
from shoal.moe.dispatch import Dispatcher, capacity, plan_dispatch
from shoal.moe.experts import Experts
from shoal.moe.router import Router


def step(experts: Experts, path: str, tokens_MD: torch.Tensor, counts_E: torch.Tensor,
         cap: int | None) -> Callable[[], None]:
    def run() -> None:
        experts.path = path
        experts.zero_grad(set_to_none=True)
        x = tokens_MD.detach().requires_grad_()
        experts(x, counts_E, capacity=cap).sum().backward()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--ffn-dim", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for E in (8, 16):
        for factor in (0.0, 1.25):
            torch.manual_seed(0)
            x_ND = torch.randn(args.tokens, args.dim)
            routing = Router(args.dim, E, top_k=args.top_k)(x_ND)
            cap = capacity(args.tokens, E, args.top_k, factor)
            plan = plan_dispatch(routing, E, cap)
            tokens_MD, counts_E = Dispatcher().local_pre(x_ND, plan)
            experts = Experts(E, args.dim, args.ffn_dim)
            paths = ("loop", "padded", "grouped")
            timings = measure_pair({p: step(experts, p, tokens_MD, counts_E, cap) for p in paths},
                                   warmup=2, repeats=args.repeats)
            for p in paths:
                t = timings[p]["time_s"]
                rows.append({"E": E, "capacity_factor": factor, "path": p, "fwd_bwd_ms": t["median"] * 1e3,
                             "iqr_rel": t["iqr_rel"], "max_count": int(plan.tokens_per_expert.max())})
    report("moe_experts_cpu", rows, notes=(
        f"N={args.tokens}, D={args.dim}, F={args.ffn_dim}, K={args.top_k}, SwiGLU, float32, "
        f"{args.threads} thread(s); forward + backward of the experts only; medians of {args.repeats}"))


if __name__ == "__main__":
    main()
