"""Peak memory per rank under shoal's ZeRO stages vs the ZeRO formulas (Rajbhandari et al. 2020).

The paper's formulas are for mixed-precision Adam (2 bytes params + 2 grads + 12 optimizer:
stage 1 4Ψ+12Ψ/N, stage 2 2Ψ+14Ψ/N, stage 3 16Ψ/N). These runs are fp32 Adam, so the formulas
used here are the fp32 adaptation, 4Ψ params + 4Ψ grads + 8Ψ Adam moments:

    stage 1: 4Ψ + 4Ψ + 8Ψ/N     stage 2: 4Ψ + 12Ψ/N     stage 3: 16Ψ/N        (bytes)

Measured: the peak of all live tensor bytes on a rank during one training step, from torch's
MemTracker (a dispatch mode that sees every tensor allocation; exact, unlike the resident set,
which the allocator and the libraries blur). That peak holds the model states *and* the
activations, so it is compared with formula + A, where A is the bytes the same forward keeps
for backward on this rank's micro-batch (measured with shoal.parallel.recompute.kept_activation_bytes).
Goal: measured / (formula + A) within 10%.

In fp32, shoal's ZeRO-1/2 engine keeps no second copy of the parameters (the optimizer's shards
are views of the full parameters' own rows), so the plain formula is the one to meet. The last
column adds the sharded fp32 copy that FSDP2-as-ZeRO-2 and DeepSpeed keep beside the full
parameters (4Ψ/N; the paper's K=12 optimizer bytes include it, the 4/4/8 adaptation does not),
for comparison with those systems and with 16-bit training, where the engine keeps it too.

ZeRO-1 runs 2 micro-batches (its gradients accumulate unsharded between reductions, which is
where ZeRO-1 and ZeRO-2 differ; with one micro-batch shoal's ZeRO-1 runs exactly as ZeRO-2).

    python -m bench.zero_memory [--nprocs 2 4] [--model small] [--batch 4] [--seq-len 64]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from bench.common import launch, report
from shoal import rules
from shoal.apply_plan import parallelize
from shoal.mesh import build_mesh
from shoal.models import Transformer, get_preset
from shoal.parallel.recompute import kept_activation_bytes
from shoal.plan import Plan
from shoal.train.step import split_micro, train_step


class TotalTracker(MemTracker):
    """MemTracker's peak of all live tensor bytes, without its per-module bookkeeping (which refuses a
    module called twice in one step, as gradient accumulation does)."""

    def _pre_fw_hook(self, *args: object) -> None: ...
    def _post_fw_hook(self, *args: object) -> None: ...
    def _pre_bw_hook(self, *args: object) -> None: ...
    def _post_bw_hook(self, *args: object) -> None: ...


def zero_formula_bytes(stage: int, psi: int, n: int) -> float:
    """Model-state bytes per rank for fp32 Adam (4Ψ params, 4Ψ grads, 8Ψ moments) at ZeRO `stage`."""
    return {1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]


def master_formula_bytes(stage: int, psi: int, n: int) -> float:
    """As zero_formula_bytes plus the sharded fp32 copy that stages 1-2 keep beside the full parameters
    (FSDP2's sharded parameter; DeepSpeed's fp32 partition): the paper's K=12 optimizer bytes, in fp32."""
    return zero_formula_bytes(stage, psi, n) + (4 * psi / n if stage < 3 else 0)


def _rank(model_name: str, stage: int, batch: int, seq_len: int, bucket: int | None = None) -> dict:
    n = dist.get_world_size()
    cfg = get_preset(model_name).replace(max_seq_len=max(seq_len, 32))
    num_micro = 2 if stage == 1 else 1
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(dist.get_rank()))
    micro = split_micro(x[:, :-1], x[:, 1:], num_micro)
    torch.manual_seed(0)
    plain = Transformer(cfg)
    psi = plain.num_params()
    act, _ = kept_activation_bytes(functools.partial(plain, micro[0][0]))
    del plain
    plan = rules.resolve(Plan.parse(f"fsdp{n},zero={stage}" + (f",bucket={bucket}" if bucket else "")), world_size=n)
    mesh = build_mesh(plan)
    torch.manual_seed(0)
    model = parallelize(Transformer(cfg), plan, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, optimizer, micro, grad_clip=1.0)  # optimizer state now exists
    tracker = TotalTracker()
    # The model parts hold the full parameters; the optimizer's shards (float32 masters in 16-bit runs).
    tracker.track_external(*model.parts, *model.parameters(), optimizer)
    with tracker:
        train_step(model, optimizer, micro, grad_clip=1.0)
    peak = max(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
    return {"psi": psi, "peak": peak, "act": act}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--bucket", type=int, default=None, help="blocks per FSDP unit (plan bucket=); default shoal's")
    args = parser.parse_args()
    mib = 2.0**20
    rows = []
    for n in args.nprocs:
        for stage in (1, 2, 3):
            per_rank = launch(_rank, n, args.model, stage, args.batch, args.seq_len, args.bucket)
            peak = max(r["peak"] for r in per_rank)
            psi, act = per_rank[0]["psi"], per_rank[0]["act"]
            formula = zero_formula_bytes(stage, psi, n)
            master = master_formula_bytes(stage, psi, n)
            rows.append({"N": n, "stage": stage, "psi_M": psi / 1e6, "measured_mib": peak / mib,
                         "formula_mib": formula / mib, "act_mib": act / mib,
                         "measured/formula": peak / formula, "measured/(formula+act)": peak / (formula + act),
                         "measured/(master_formula+act)": peak / (master + act)})
    report("zero_memory" + (f"_bucket{args.bucket}" if args.bucket else ""), rows, notes=(
        f"shoal bucket={args.bucket or 'default'}; model {args.model}, {args.batch} sequences x {args.seq_len} "
        "tokens per rank, fp32 AdamW; formula: "
        "fp32 adaptation 4Ψ params + 4Ψ grads + 8Ψ moments (stage 1: 8Ψ+8Ψ/N, 2: 4Ψ+12Ψ/N, 3: 16Ψ/N); "
        "measured = MemTracker peak of live tensor bytes on the busiest rank; act = bytes one micro-batch's "
        "forward keeps for backward; master_formula adds the sharded fp32 parameter copy of stages 1-2 (4Ψ/N); "
        "goal measured/(formula+act) within 10%"))


if __name__ == "__main__":
    main()
