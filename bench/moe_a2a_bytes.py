"""Bytes the expert-parallel all-to-all moves per token, against the analytic minimum.

The dispatcher (shoal.parallel.expert.AllToAllDispatcher) sends each kept choice as its own row: a token
whose K chosen experts live on r distinct other ranks of the ep group crosses the network once per choice
on those ranks. The minimum sends each token once per distinct other rank (and combines once per rank on
the way back): for each token, the distinct other ranks its chosen experts live on, times the hidden size,
times the element size, for dispatch and again for combine. This bench counts both from the rows the
dispatcher's own split sizes (`plan_dispatch`'s tokens_per_expert, summed per destination rank, this
rank's own left out) would send, for tokens routed by shoal's Router on random inputs, and prints the ratio.
Counting needs no processes: the sizes are what the all-to-all would be given.

    python -m bench.moe_a2a_bytes [--experts 64] [--ep 4] [--top-k 8] [--tokens 4096] [--dim 2048] [--seeds 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from shoal.moe.dispatch import plan_dispatch
from shoal.moe.router import Router


def bytes_per_token(router: Router, tokens: int, dim: int, ep: int, seed: int,
                    element_bytes: int = 2) -> tuple[float, float]:
    """(what the dispatcher sends, the minimum), bytes per token for one direction, averaged over the ep
    ranks (each routes `tokens` tokens of its own)."""
    E = router.num_experts
    local = E // ep
    sent = minimum = 0.0
    for rank in range(ep):
        g = torch.Generator().manual_seed(seed * ep + rank)
        with torch.no_grad():
            routing = router(torch.randn(tokens, router.gate.in_features, generator=g))
        plan = plan_dispatch(routing, E, None)
        rows_R = plan.tokens_per_expert.view(ep, local).sum(1)
        sent += float(rows_R.sum() - rows_R[rank])
        ranks_NK = routing.experts_NK // local
        hit_NR = torch.zeros(tokens, ep, dtype=torch.bool).scatter_(1, ranks_NK, True)
        hit_NR[:, rank] = False
        minimum += float(hit_NR.sum())
    scale = dim * element_bytes / (tokens * ep)
    return sent * scale, minimum * scale


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args(argv)
    E, ep, K = args.experts, args.ep, args.top_k
    routers = {
        "softmax top-k": dict(),
        f"sigmoid, groups = ranks ({ep}), 2 per token": dict(score="sigmoid", expert_groups=ep, topk_groups=2),
    }
    print(f"{E} experts on ep{ep} ({E // ep} per rank), top-{K}, D={args.dim}, 2-byte elements, "
          f"{args.tokens} tokens per rank; medians over {args.seeds} seeds (gate drawn per seed) [min, max]")
    print(f"{'router':44s} {'sent B/token':>14s} {'minimum B/token':>16s} {'ratio':>20s}")
    for name, options in routers.items():
        sent, least, ratios = [], [], []
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            router = Router(256, E, top_k=K, **options)
            s, m = bytes_per_token(router, args.tokens, args.dim, ep, seed)
            sent.append(s)
            least.append(m)
            ratios.append(s / m)
        print(f"{name:44s} {statistics.median(sent):14.0f} {statistics.median(least):16.0f} "
              f"{statistics.median(ratios):7.3f} [{min(ratios):.3f}, {max(ratios):.3f}]")
    print("each direction (dispatch, combine) alike; the goal is a ratio within 1.05")


if __name__ == "__main__":
    main()
