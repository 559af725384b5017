"""shoal's tensor parallelism vs torch's DTensor TP written by hand the usual way (the
torchtitan recipe: parallelize_module with Colwise/Rowwise/SequenceParallel/PrepareModuleInput,
loss_parallel, clip_grad_norm_), same model and batch, world size 2.

Both run in the same ranks, alternating step by step (bench.common.measure_pair), from the same
initial weights. Goal: shoal / DTensor median step time <= 1.05.

    python -m bench.tp_vs_dtensor [--nproc 2] [--repeats 20] [--model tiny] [--batch 8] [--seq-len 128] [--sp on|off]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from bench.common import launch, measure_pair, report
from bench.wide_classifier import tensor_peak_mb
from shoal import rules
from shoal.apply_plan import parallelize
from shoal.mesh import build_mesh
from shoal.models import Transformer, get_preset
from shoal.plan import Plan
from shoal.train.step import split_micro, train_step


def hand_written_tp(model: Transformer, tp_mesh, sp: bool) -> Transformer:
    """DTensor TP as a user writes it for a Llama-style model (torchtitan's parallelize_llama)."""
    seq = Shard(1) if sp else Replicate()
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        plan = {
            "attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None),
                                            use_local_output=False),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                               use_local_output=False),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sp:
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        parallelize_module(block, tp_mesh, plan)
    return model


def clip_mixed(model: torch.nn.Module, max_norm: float) -> None:
    """Gradient clipping for a model that mixes DTensor and plain parameters (DTensor TP without
    sequence parallelism leaves the norms plain): torch's clip_grad_norm_ fails there with "got
    mixed torch.Tensor and DTensor", so the peer computes the norm tensor by tensor."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norms = [g.norm() for g in grads]
    total = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).norm()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)


def _rank(model_name: str, batch: int, seq_len: int, repeats: int, sp: bool) -> dict:
    cfg = get_preset(model_name).replace(max_seq_len=max(seq_len, 32))
    t = dist.get_world_size()
    plan = rules.resolve(Plan.parse(f"tp{t}" + ("" if sp else ",sp=off")), world_size=t)
    mesh = build_mesh(plan)
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=gen)
    x, y = seq[:, :-1], seq[:, 1:]

    torch.manual_seed(0)
    shoal_model = parallelize(Transformer(cfg), plan, mesh)
    shoal_opt = torch.optim.AdamW(shoal_model.parameters(), lr=1e-4)

    torch.manual_seed(0)
    ref = hand_written_tp(Transformer(cfg), mesh["tp"], sp)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)

    def shoal_step() -> None:
        train_step(shoal_model, shoal_opt, split_micro(x, y, 1), grad_clip=1.0)

    def dtensor_step() -> None:
        ref_opt.zero_grad(set_to_none=True)
        logits = ref(x)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        if sp:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        else:
            clip_mixed(ref, 1.0)
        ref_opt.step()
        loss.full_tensor().item()

    res = measure_pair({"shoal": shoal_step, "dtensor": dtensor_step}, warmup=3, repeats=repeats)
    res["shoal"]["tensor_peak_mb"] = tensor_peak_mb(shoal_model, shoal_opt, shoal_step)
    res["dtensor"]["tensor_peak_mb"] = tensor_peak_mb(ref, ref_opt, dtensor_step)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--sp", choices=("on", "off"), default="on")
    args = parser.parse_args()
    sp = args.sp == "on"
    per_rank = launch(_rank, args.nproc, args.model, args.batch, args.seq_len, args.repeats, sp)
    rows = []
    for rank, res in enumerate(per_rank):
        s, d = res["shoal"]["time_s"], res["dtensor"]["time_s"]
        rows.append({"rank": rank, "sp": args.sp, "shoal_ms": 1e3 * s["median"], "shoal_iqr%": 100 * s["iqr_rel"],
                     "dtensor_ms": 1e3 * d["median"], "dtensor_iqr%": 100 * d["iqr_rel"],
                     "ratio": s["median"] / d["median"],
                     "shoal_peak_mb": res["shoal"]["tensor_peak_mb"]["total"],
                     "dtensor_peak_mb": res["dtensor"]["tensor_peak_mb"]["total"],
                     "peak_ratio": res["shoal"]["tensor_peak_mb"]["total"] / res["dtensor"]["tensor_peak_mb"]["total"],
                     "shoal_by_kind": {k: round(v, 2) for k, v in res["shoal"]["tensor_peak_mb"].items()},
                     "dtensor_by_kind": {k: round(v, 2) for k, v in res["dtensor"]["tensor_peak_mb"].items()}})
    report(f"tp_vs_dtensor_sp_{args.sp}", rows, notes=(
        f"world {args.nproc}, model {args.model}, batch {args.batch}, seq {args.seq_len}, {args.repeats} "
        "interleaved repeats; peak = MemTracker peak of live tensors in one step (MiB); goal ratio <= 1.05"))


if __name__ == "__main__":
    main()
