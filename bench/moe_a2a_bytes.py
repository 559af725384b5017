"""Bytes the expert-parallel all-to-all moves per token, against the analytic minimum.

The minimum sends each token once per distinct other rank its kept choices live on (and combines once per
rank on the way back): for each token, the distinct other ranks of its chosen experts, times the hidden
size, times the element size, for dispatch and again for combine. Two dispatchers are counted, for tokens
routed by shoal's Router on random inputs:
- one row per choice (what an all-to-all of the expert-sorted rows sends: `plan_dispatch`'s
  tokens_per_expert summed per destination rank, this rank's own left out), counted without processes;
- shoal's AllToAllDispatcher (shoal.parallel.expert), one row per token and destination rank, run on
  `ep` gloo processes: the rows it sent to other ranks and, in the dispatch direction, each choice's two
  int64 indices and float32 weight (`last_sent`; the combine sends rows only).

    python -m bench.moe_a2a_bytes [--experts 64] [--ep 4] [--top-k 8] [--tokens 4096] [--dim 2048] [--seeds 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from shoal.infra.pool import WorkerPool
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


def _measured(router_state: dict[str, torch.Tensor], options: dict, experts: int, top_k: int, tokens: int,
              seed: int, dim: int) -> tuple[float, int]:
    """Worker (ep ranks): one MoE layer's forward under shoal's expert parallelism on this rank's `tokens`
    tokens; (bytes the dispatch sent to other ranks, the minimum), per value of a row (D x 2 bytes)."""
    import torch.distributed as dist

    from shoal.moe.layer import MoELayer
    from shoal.parallel.expert import apply_expert_parallel, ep_mesh

    ep, rank = dist.get_world_size(), dist.get_rank()
    layer = MoELayer(256, 64, num_experts=experts, top_k=top_k, capacity_factor=0.0, router=options)
    layer.router.load_state_dict(router_state)
    apply_expert_parallel(layer, ep_mesh(ep, ep, "cpu"))
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(seed * ep + rank))
    with torch.no_grad():
        layer(x)
        routing = layer.router(x)
    ranks_NK = routing.experts_NK // (experts // ep)
    hit_NR = torch.zeros(tokens, ep, dtype=torch.bool).scatter_(1, ranks_NK, True)
    hit_NR[:, rank] = False
    rows, choices = layer.dispatcher.last_sent  # type: ignore[attr-defined]
    return rows + choices * (8 + 8 + 4) / (2 * dim), int(hit_NR.sum())


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
    print(f"{'router':44s} {'dispatcher':14s} {'sent B/token':>13s} {'minimum B/token':>16s} {'ratio':>22s}")
    pool = WorkerPool(ep)
    try:
        for name, options in routers.items():
            rows: dict[str, list[tuple[float, float]]] = {"per choice": [], "shoal (per rank)": []}
            for seed in range(args.seeds):
                torch.manual_seed(seed)
                router = Router(256, E, top_k=K, **options)
                rows["per choice"].append(bytes_per_token(router, args.tokens, args.dim, ep, seed))
                got = pool.run(_measured, router.state_dict(), options, E, K, args.tokens, seed, args.dim)
                scale = args.dim * 2 / (args.tokens * ep)
                rows["shoal (per rank)"].append((sum(s for s, _ in got) * scale, sum(m for _, m in got) * scale))
            for dispatcher, pairs in rows.items():
                ratios = [s / m for s, m in pairs]
                print(f"{name:44s} {dispatcher:14s} {statistics.median(s for s, _ in pairs):13.0f} "
                      f"{statistics.median(m for _, m in pairs):16.0f} {statistics.median(ratios):9.3f} "
                      f"[{min(ratios):.3f}, {max(ratios):.3f}]")
    finally:
        pool.close()
    print("dispatch direction (shoal's indices and weights included); the combine sends the rows alone, for shoal "
          "the minimum exactly; the goal is a ratio within 1.05")


if __name__ == "__main__":
    main()
