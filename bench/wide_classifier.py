"""The Whale case at small scale: a 100,000-class classifier over a small one-layer body,
data parallel only vs tensor parallel (vocabulary-sharded embedding and classifier, the softmax
computed across shards) at 4 processes; and sharded data parallelism with FSDP2 gathering the
tables (`vocab=gathered`, torch's FSDP2 as it is) vs keeping them split by rows over the fsdp
ranks (`vocab=sharded`, shoal/parallel/sharded_vocab.py).

Whale (arXiv 2011.09208) reports 14.8x over data parallelism at 64 GPUs for a 100k-class
classifier: with data parallelism every device holds, updates and all-reduces the whole (V, D)
classifier; with the classifier split each holds 1/t of it and the activations it sends are
(B, T, D), not (V, D). On 4 CPU processes the same effect shows at a much smaller scale.

Reported per plan (shoal's parallelize + train_step, all plans interleaved step by step in the same
ranks): median step time and spread, the model state each rank holds (parameters + gradients +
AdamW state, counted from the tensors) and the peak of live tensors during a step (torch's
MemTracker: state + activations + temporaries), each with its ratio to dp. The resident-set rise
per step is shown too but is not comparable: glibc keeps freed pages and reuses them.

    python -m bench.wide_classifier [--nproc 4] [--repeats 6] [--vocab 100000] [--dim 128]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor

from bench.common import launch, measure_pair, report
from shoal import rules
from shoal.apply_plan import parallelize
from shoal.mesh import build_mesh, data_rank
from shoal.models import ModelConfig, Transformer
from shoal.plan import Plan
from shoal.runtime import Runtime
from shoal.train.step import split_micro, train_step


def _local_mb(tensors) -> float:
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total / 2**20


def _state_mb(model: Runtime, opt: torch.optim.Optimizer) -> float:
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim > 0]
    return _local_mb(params) + _local_mb(grads) + _local_mb(states)


def tensor_peak_mb(model: Runtime | torch.nn.Module, opt: torch.optim.Optimizer, step) -> dict[str, float]:
    """Peak bytes of live tensors during one step, by kind (torch's MemTracker; exact, unlike the
    resident set, which keeps freed pages that the allocator reuses). `model`: shoal's runtime or
    a peer's plain module."""
    tracker = MemTracker()
    tracker.track_external(*(model.parts if isinstance(model, Runtime) else [model]), opt)
    with tracker:
        step()
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {str(k).rpartition(".")[2].lower(): v / 2**20 for k, v in snapshot.items()}


def _rank(cfg: ModelConfig, plans: list[str], global_batch: int, seq_len: int, repeats: int) -> dict:
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, cfg.vocab_size, (global_batch, seq_len + 1), generator=gen)
    steps, models = {}, {}
    for text in plans:
        plan = rules.resolve(Plan.parse(text), world_size=world)
        mesh = build_mesh(plan)
        index, count = data_rank(mesh)
        local = seq[index * global_batch // count:(index + 1) * global_batch // count]
        micro = split_micro(local[:, :-1], local[:, 1:], 1)
        torch.manual_seed(0)
        model = parallelize(Transformer(cfg), plan, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        models[text] = (model, opt)

        def step(model=model, opt=opt, micro=micro, mesh=mesh) -> None:
            train_step(model, opt, micro, grad_clip=1.0)

        steps[text] = step
    res = measure_pair(steps, warmup=2, repeats=repeats)
    for text, (model, opt) in models.items():
        res[text]["state_mb"] = _state_mb(model, opt)
        res[text]["tensor_peak_mb"] = tensor_peak_mb(model, opt, steps[text])
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    n = args.nproc
    cfg = ModelConfig(num_layers=1, dim=args.dim, num_heads=8, ffn_dim=2 * args.dim, vocab_size=args.vocab,
                      max_seq_len=args.seq_len)
    plans = [f"dp{n}", f"tp{n}"] + ([f"dp{n // 2},tp2"] if n >= 4 else []) + \
        [f"fsdp{n},vocab=gathered", f"fsdp{n},vocab=sharded"]
    per_rank = launch(_rank, n, cfg, plans, args.global_batch, args.seq_len, args.repeats)
    rows = []
    for plan in plans:
        times = [r[plan]["time_s"]["median"] for r in per_rank]  # a step ends with the slowest rank
        base = [r[plans[0]]["time_s"]["median"] for r in per_rank]
        state = max(r[plan]["state_mb"] for r in per_rank)
        peak = max(r[plan]["tensor_peak_mb"]["total"] for r in per_rank)
        base_peak = max(r[plans[0]]["tensor_peak_mb"]["total"] for r in per_rank)
        rows.append({"plan": plan, "step_ms": 1e3 * max(times),
                     "iqr%": 100 * max(r[plan]["time_s"]["iqr_rel"] for r in per_rank),
                     "time_vs_dp": max(times) / max(base),
                     "state_mb": state, "state_vs_dp": state / max(r[plans[0]]["state_mb"] for r in per_rank),
                     "tensor_peak_mb": peak, "peak_vs_dp": peak / base_peak,
                     "rss_rise_mb": max(r[plan]["step_peak_mb"]["median"] for r in per_rank),
                     "peak_by_kind_rank0": {k: round(v, 1) for k, v in per_rank[0][plan]["tensor_peak_mb"].items()}})
    report("wide_classifier", rows, notes=(
        f"{n} processes on {args.vocab} classes, dim {args.dim}, 1 layer, global batch {args.global_batch} x seq "
        f"{args.seq_len}, {args.repeats} interleaved repeats; state = params+grads+AdamW per rank; tensor peak = "
        "MemTracker peak of live tensors in one step (max over ranks); Whale's 14.8x was at 64 GPUs"))


if __name__ == "__main__":
    main()
