"""Context parallelism: memory per rank against sequence length, the zig-zag split's load balance,
and ring against head-scatter attention.

1. Memory. For one sequence of T tokens (a 2-layer, dim-128, 8-head model, fp32), each rank's
   bytes that the training forward keeps for backward (exact tensor bytes,
   `kept_activation_bytes`) plus the largest transient of the attention (measured as the
   resident-set peak of forward+backward above the level before it, VmHWM): single process,
   cpP (ring, a2a) and tpP (sequence-parallel norms), P = 2 and 4. Then the longest T (doubling)
   whose kept bytes fit a budget per rank, and the ratio cp / tp of those lengths (the paper's
   claim: 3.0x at 64 GPUs).
2. Load balance. Each rank's share of the ring's attention arithmetic (every query-key chunk pair
   the causal mask does not hide), timed rank by rank in this process without communication:
   slowest / mean, for the zig-zag split and the plain one.
3. Modes. Step time of cp2 ring vs cp2 a2a at one length: median and range over repeats.
4. Blocks. Forward + backward of the attention arithmetic at cp=2 without communication, summed over
   the ranks, against SDPA over the same queries and keys (whole sequences) in one call: the ring's
   blocks and a2a's local work (layouts and SDPA over half the heads), fp32 and bf16, at the second
   longest length; ratios of medians, each time's median [min-max] and inter-quartile range.

    python -m bench.context_parallel [--lengths 1024,2048,4096,8192] [--budget-mib 48] [--blocks-only]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.common import launch, report, summarize
from shoal import rules
from shoal.apply_plan import parallelize
from shoal.mesh import build_mesh
from shoal.models import ModelConfig, Transformer
from shoal.parallel.context import add_grads, attend_blocks, block_grads, chunks_of, head_scatter_attention, positions
from shoal.parallel.recompute import kept_activation_bytes
from shoal.plan import Plan
from shoal.train import memory

MODEL = ModelConfig(num_layers=2, dim=128, num_heads=8, num_kv_heads=8, ffn_dim=256, vocab_size=256,
                    max_seq_len=16384)


def _one_step(plan_text: str | None, seq_len: int) -> dict[str, float]:
    """This rank: kept bytes of one forward, transient peak of forward+backward, step seconds."""
    torch.manual_seed(0)
    model = Transformer(MODEL.replace(max_seq_len=seq_len))
    if plan_text is None:
        runtime = parallelize(model)
    else:
        plan = rules.resolve(Plan.parse(plan_text), world_size=dist.get_world_size())
        runtime = parallelize(model, plan, build_mesh(plan, "cpu"))
    tokens = torch.randint(0, MODEL.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(1))
    (x, y), = runtime.local_batches([(tokens[:, :-1], tokens[:, 1:])])
    module = runtime.parts[0]
    kept, out = kept_activation_bytes(lambda: module(x))
    del out
    memory.reset_peak()
    base = memory.current_mb()
    start = time.perf_counter()
    runtime.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
    seconds = time.perf_counter() - start
    return {"kept_mib": kept / 2**20, "transient_mib": memory.peak_mb() - base, "seconds": seconds}


def _sweep(plan_text: str, lengths: list[int]) -> list[dict[str, float]]:
    rows = [_one_step(plan_text, t) for t in lengths]
    worst = torch.tensor([[r["kept_mib"], r["transient_mib"], r["seconds"]] for r in rows])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the highest rank counts
    return [{"kept_mib": float(k), "transient_mib": float(m), "seconds": float(s)} for k, m, s in worst]


def memory_table(lengths: list[int], budget: float) -> list[dict]:
    rows = []
    configs: list[tuple[str, int, str | None]] = [("single process", 1, None)]
    for p in (2, 4):
        configs += [(f"cp{p} ring", p, f"cp{p}"), (f"cp{p} a2a", p, f"cp{p},cp_mode=a2a"), (f"tp{p}", p, f"tp{p}")]
    for name, nproc, plan_text in configs:
        print(f"memory: {name} ...", flush=True)
        if plan_text is None:
            measured = [_one_step(None, t) for t in lengths]
        else:
            measured = launch(_sweep, nproc, plan_text, lengths)[0]
        fits = [t for t, m in zip(lengths, measured) if m["kept_mib"] <= budget]
        rows.append({"config": name, **{f"kept MiB @{t}": round(m["kept_mib"], 1) for t, m in zip(lengths, measured)},
                     **{f"transient MiB @{t}": round(m["transient_mib"], 1) for t, m in zip(lengths, measured)},
                     f"longest T within {budget:g} MiB": max(fits) if fits else 0})
    return rows


@torch.no_grad()  # as inside the ring's autograd function
def ring_rank(q: torch.Tensor, kv_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]], do: torch.Tensor,
              rank: int, cp: int, *, balanced: bool = True,
              causal: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """One rank's ring attention blocks, forward then backward, as the ring runs them without its sends:
    q and do this rank's (B, H, T / cp, E), kv_of(source) the key/value block rank `source` holds.
    (output, fp32 dq, {source: fp32 (dk, dv) of its block, this rank's share})."""
    scale = q.shape[-1] ** -0.5
    mine = chunks_of(rank, cp, balanced=balanced)
    sources = [(rank - step) % cp for step in range(cp)]
    out = lse = None
    for source in sources:
        theirs = chunks_of(source, cp, balanced=balanced)
        out, lse = attend_blocks(q, *kv_of(source), mine, theirs, out, lse, causal=causal, scale=scale)
    assert out is not None and lse is not None
    out = out.to(q.dtype)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grads = {}
    for source in sources:
        k, v = kv_of(source)
        theirs = chunks_of(source, cp, balanced=balanced)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        add_grads(block_grads(do, q, k, v, out, lse, mine, theirs, causal=causal, scale=scale), dq, dkv[0], dkv[1])
        grads[source] = (dkv[0], dkv[1])
    return out, dq, grads


def ring_by_rank(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, cp: int, *,
                 balanced: bool = True) -> dict[str, torch.Tensor]:
    """The ring's output and gradients for whole sequences (B, H, T, E), computed rank by rank in
    this process (each rank's blocks as `ring_rank` runs them): {"out", "dq", "dk", "dv"} in position order."""
    local = {r: positions(q.shape[2], r, cp, balanced=balanced).to(q.device) for r in range(cp)}
    got = {key: torch.zeros(q.shape, dtype=torch.float32, device=q.device) for key in ("out", "dq", "dk", "dv")}
    for rank, pos in local.items():
        out, dq, grads = ring_rank(q[:, :, pos], lambda s: (k[:, :, local[s]], v[:, :, local[s]]), do[:, :, pos],
                                   rank, cp, balanced=balanced)
        got["out"][:, :, pos] = out.float()
        got["dq"][:, :, pos] = dq
        for source, (dk, dv) in grads.items():
            got["dk"][:, :, local[source]] += dk
            got["dv"][:, :, local[source]] += dv
    return {key: t.to(q.dtype) for key, t in got.items()}


def balance(seq_len: int, cp: int, balanced: bool, repeats: int = 5) -> dict[str, float]:
    """Per-rank ring attention arithmetic (forward and backward), timed rank by rank: slowest / mean."""
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, MODEL.num_heads, seq_len // cp, MODEL.head_dim) for _ in range(4))
    times = []
    for rank in range(cp):
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            ring_rank(q, lambda s: (k, v), do, rank, cp, balanced=balanced)
            samples.append(time.perf_counter() - start)
        times.append(summarize(samples)["median"])
    mean = sum(times) / len(times)
    return {"slowest / mean": max(times) / mean, "per-rank ms": [round(1e3 * t, 1) for t in times]}


def block_compute(seq_len: int, *, cp: int = 2, heads: int, head_dim: int, dtype: torch.dtype, repeats: int,
                  batch: int = 1, device: str = "cpu",
                  clock: Callable[[], float] = time.perf_counter) -> dict[str, dict[str, float]]:
    """Forward + backward seconds of SDPA over whole sequences against the same work split cp ways
    without communication: the ring's blocks (`ring_rank`) and a2a's local work (the layout copies
    and SDPA over heads / cp, the all-to-all an identity), each summed over the cp ranks; interleaved
    repeat by repeat (SDPA, ring, a2a, ...), one warm-up round. `clock`: wall time, or
    time.thread_time (this thread's CPU time: one thread does all the work, and other processes'
    load does not count)."""
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(batch, heads, seq_len, head_dim, dtype=dtype, device=device) for _ in range(4))
    local = [positions(seq_len, r, cp).to(device) for r in range(cp)]
    parts = {r: [t[:, :, local[r]].contiguous() for t in (q, k, v, do)] for r in range(cp)}
    rank_major = torch.cat([positions(2 * cp, r, cp) for r in range(cp)]).to(device)  # ContextSplit.chunk_orders
    orders = (rank_major, torch.argsort(rank_major))

    def sdpa(rank: int) -> None:
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).backward(do)

    def ring(rank: int) -> None:
        ql, _, _, dl = parts[rank]
        ring_rank(ql, lambda s: (parts[s][1], parts[s][2]), dl, rank, cp)

    def a2a(rank: int) -> None:
        ql, kl, vl = (t.detach().requires_grad_() for t in parts[rank][:3])
        head_scatter_attention(ql, kl, vl, cp=cp, orders=orders, exchange=lambda x: x).backward(parts[rank][3])

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    samples: dict[str, list[float]] = {"sdpa": [], "ring": [], "a2a": []}
    for i in range(repeats + 1):
        for name, fn in (("sdpa", sdpa), ("ring", ring), ("a2a", a2a)):
            total = 0.0
            for rank in range(1 if name == "sdpa" else cp):
                sync()
                start = clock()
                fn(rank)
                sync()
                total += clock() - start
            if i:
                samples[name].append(total)
    return {name: summarize(s) for name, s in samples.items()}


def block_rows(seq_len: int, repeats: int, clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    """`block_compute` at cp=2 in fp32 and bf16, at the bench model's head shape and at head dim 64."""
    rows = []
    for heads, head_dim in ((MODEL.num_heads, MODEL.head_dim), (8, 64)):
        for dtype in (torch.float32, torch.bfloat16):
            print(f"blocks: H={heads} E={head_dim} {dtype} ...", flush=True)
            t = block_compute(seq_len, heads=heads, head_dim=head_dim, dtype=dtype, repeats=repeats, clock=clock)
            row: dict = {"config": f"cp2 blocks / SDPA, T={seq_len} H={heads} E={head_dim} {str(dtype)[6:]}"}
            for name in ("ring", "a2a"):
                row[f"{name} / sdpa"] = t[name]["median"] / t["sdpa"]["median"]
            for name in ("sdpa", "ring", "a2a"):
                m = t[name]
                row[f"{name} ms [min-max] iqr"] = (f"{1e3 * m['median']:.1f} [{1e3 * m['min']:.1f}-"
                                                   f"{1e3 * m['max']:.1f}] {100 * m['iqr_rel']:.0f}%")
            rows.append(row)
    return rows


def _mode_times(seq_len: int, repeats: int) -> dict[str, dict[str, float]]:
    out = {}
    for mode in ("ring", "a2a"):
        samples = []
        for _ in range(repeats + 1):
            dist.barrier()
            samples.append(_one_step(f"cp{dist.get_world_size()},cp_mode={mode}", seq_len)["seconds"])
        out[mode] = summarize(samples[1:])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--budget-mib", type=float, default=48.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks-only", action="store_true", help="only part 4 (one process, a few minutes)")
    parser.add_argument("--cpu-clock", action="store_true",
                        help="part 4 timed in this thread's CPU time rather than wall time (a loaded machine)")
    args = parser.parse_args()
    lengths = [int(t) for t in args.lengths.split(",")]
    torch.set_num_threads(1)  # as every rank of the launched parts runs
    clock = time.thread_time if args.cpu_clock else time.perf_counter
    if args.blocks_only:
        report("context_parallel_blocks", block_rows(lengths[-2], args.repeats, clock),
               notes=f"sums over the cp ranks of each rank's time ({'thread CPU' if args.cpu_clock else 'wall'}), "
                     "one thread; ratio of medians")
        return

    rows = memory_table(lengths, args.budget_mib)
    longest = {r["config"]: r[f"longest T within {args.budget_mib:g} MiB"] for r in rows}
    for p in (2, 4):
        if longest.get(f"tp{p}"):
            ratio = longest[f'cp{p} ring'] / longest[f'tp{p}']
            print(f"longest sequence within budget, cp{p} ring / tp{p}: {ratio:.2f}")
    for cp in (2, 4):
        for balanced in (True, False):
            b = balance(lengths[-1], cp, balanced, repeats=args.repeats)
            rows.append({"config": f"load balance cp{cp} {'zig-zag' if balanced else 'plain'} at T={lengths[-1]}", **b})
    modes = launch(_mode_times, 2, lengths[-2], args.repeats)[0]
    rows.append({"config": f"cp2 step time at T={lengths[-2]}: ring / a2a (median)",
                 "ratio": modes["ring"]["median"] / modes["a2a"]["median"],
                 **{f"{m} s [min-max]": f"{modes[m]['median']:.3f} [{modes[m]['min']:.3f}-{modes[m]['max']:.3f}]"
                    for m in ("ring", "a2a")}})
    rows += block_rows(lengths[-2], args.repeats, clock)
    report("context_parallel", rows, notes="kept bytes are exact; transient is the resident-set peak above the "
           "level before the step (machine-dependent); the highest rank counts")


if __name__ == "__main__":
    main()
