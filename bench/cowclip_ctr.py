"""CowClip at small scale: a CTR-style model trained at batch 1K to 64K, with and without CowClip
(Zheng et al. 2022, arXiv 2204.06240).

The model (shoal.experiments.cowclip.ctr) is what a user would write: one embedding table per categorical
field, the fields' vectors concatenated into a small MLP, one logit; it is handed to `shoal.parallelize` with
a `dpN` plan and trained through `shoal.train.step.train_step` with a binary cross-entropy loss, like any
user's model (`--plan dp` or `--plan fsdp`: replicated or sharded data parallelism over all the processes).
The data is synthetic with a planted signal: every (field, id) has a true weight, two fields interact through
true latent vectors, ids are Zipf-distributed (a few ids are frequent, most are rare, as in click logs), and
the label is drawn from sigmoid(true logit). The AUC of the true logit on the test set is the ceiling any
model can reach.

Three recipes at each batch, all trained for the same number of epochs from the same start, with
the learning rates set at `--base-batch`:
- adam-sqrt: Adam on everything, every lr scaled by sqrt(batch / base) (the usual rule for Adam);
- cowclip-rules: CowClip's scaling rules without its clipping (embedding lr fixed, dense lr
  sqrt-scaled, embedding L2 scaled linearly; clipping ratio so large that no row is clipped);
- cowclip: the same rules with CowClip's adaptive column-wise clipping (ratio r, zeta).

Prints one table (also written to bench/results/cowclip_ctr.json) and writes docs/cowclip_ctr.png.

    python -m bench.cowclip_ctr [--nproc 2] [--plan dp|fsdp] [--batches 1024 4096 16384 65536] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench.common import launch, report
from shoal.experiments.cowclip.ctr import CTRModel, auc, click_data

DOCS = Path(__file__).resolve().parent.parent / "docs"
RECIPES = ("adam-sqrt", "cowclip-rules", "cowclip")


def optim_config(recipe: str, args: argparse.Namespace) -> Any:
    from shoal.optim.config import OptimConfig

    common = dict(lr=args.lr, weight_decay=0.0, beta1=0.9, beta2=0.999, eps=1e-8, grad_clip=0.0,
                  base_batch=args.base_batch, min_lr=args.lr / 10, warmup_steps=args.warmup_steps)
    if recipe == "adam-sqrt":
        return OptimConfig(optimizer="adamw", lr_scaling="sqrt", **common)
    ratio = args.cowclip_ratio if recipe == "cowclip" else 1e9  # 1e9: no row is ever clipped
    return OptimConfig(optimizer="cowclip", lr_scaling="sqrt", embed_lr=args.lr, embed_weight_decay=args.l2,
                       cowclip_ratio=ratio, cowclip_zeta=args.cowclip_zeta, **common)


def train(recipe: str, batch: int, data: tuple[torch.Tensor, ...], args: argparse.Namespace) -> dict[str, Any]:
    """One recipe at one global batch on this rank (every rank calls it); the test AUC and loss."""
    from shoal.apply_plan import parallelize
    from shoal.mesh import build_mesh
    from shoal.optim.builder import build_optimizer
    from shoal.optim.schedule import build_scheduler
    from shoal.plan import Plan
    from shoal.train.step import train_step

    train_ids, train_labels, test_ids, test_labels = data
    torch.manual_seed(args.seed)
    model = CTRModel(args.fields, args.vocab, args.dim, tuple(args.hidden))
    plan = Plan.parse(f"{args.plan}{dist.get_world_size()}")
    runtime = parallelize(model, plan, build_mesh(plan, "cpu"))
    steps_per_epoch = args.samples // batch
    steps = steps_per_epoch * args.epochs
    cfg = optim_config(recipe, args)
    optimizer = build_optimizer(runtime, cfg, global_batch=batch)
    scheduler = build_scheduler(optimizer, cfg, steps, global_batch=batch)
    index, count = runtime.data_rank
    rows = batch // count
    bce = nn.functional.binary_cross_entropy_with_logits

    def summed(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # CowClip's threshold r * cnt * ||w_id|| compares an id's gradient, the sum of its cnt
        # occurrences', with its weight: the loss is a sum over the batch (Adam's steps do not
        # depend on the loss's scale, so the recipes without clipping are unchanged by it)
        return bce(logits, labels, reduction="sum")
    start, clipped = time.perf_counter(), torch.zeros(())
    orders = [torch.randperm(args.samples, generator=torch.Generator().manual_seed(args.seed + 1 + e))
              for e in range(args.epochs)]  # the same shuffles for every recipe and batch
    for s in range(steps):
        epoch, k = divmod(s, steps_per_epoch)
        mine = orders[epoch][k * batch:(k + 1) * batch][index * rows:(index + 1) * rows]
        train_step(runtime, optimizer, [(train_ids[mine], train_labels[mine])], grad_clip=None,
                   scheduler=scheduler, loss_fn=summed)
        clipped = clipped + getattr(optimizer, "clipped_fraction", 0.0)
    seconds = time.perf_counter() - start
    runtime.eval()
    with torch.no_grad():
        scores = torch.cat([runtime(chunk) for chunk in test_ids.split(65536)])
    return {"recipe": recipe, "global_batch": batch, "steps": steps,
            "peak_lr_dense": round(scheduler.schedule.lr, 6), "test_auc": auc(scores, test_labels),
            "test_logloss": float(bce(scores, test_labels)),
            "rows_clipped": float(clipped) / steps if recipe != "adam-sqrt" else "-", "train_s": round(seconds, 1)}


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (batch, recipe) on this rank, data made once per process (the same on every rank)."""
    *data, best = click_data(fields=args.fields, vocab=args.vocab, samples=args.samples,
                             test_samples=args.test_samples, zipf=args.zipf, seed=args.seed)
    out = []
    for batch in args.batches:
        for recipe in args.recipes:
            result = train(recipe, batch, tuple(data), args) | {"true_logit_auc": best}
            if dist.get_rank() == 0:
                print(f"batch {batch} {recipe}: AUC {result['test_auc']:.4f} (ceiling {best:.4f}) "
                      f"in {result['train_s']} s", flush=True)
            out.append(result)
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for recipe in RECIPES:
        mine = [r for r in rows if r["recipe"] == recipe]
        if mine:
            ax.plot([r["global_batch"] for r in mine], [r["test_auc"] for r in mine], "o-", label=recipe)
    ax.axhline(rows[0]["true_logit_auc"], color="grey", ls="--", lw=1, label="true logit (ceiling)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch (samples)")
    ax.set_ylabel("test AUC")
    ax.set_title("CTR model, same epochs, growing batch")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--plan", choices=("dp", "fsdp"), default="dp", help="data parallelism over --nproc processes")
    parser.add_argument("--batches", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--samples", type=int, default=2**19)
    parser.add_argument("--test-samples", type=int, default=2**16)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--fields", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=10000, help="ids per field")
    parser.add_argument("--zipf", type=float, default=1.1, help="exponent of the ids' Zipf law")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 32])
    parser.add_argument("--lr", type=float, default=1e-3, help="peak lr at the base batch (and CowClip's embedding lr)")
    parser.add_argument("--l2", type=float, default=1e-5, help="CowClip's embedding L2 at the base batch")
    parser.add_argument("--warmup-steps", type=int, default=32, help="at the base batch; scaled by the rule")
    parser.add_argument("--base-batch", type=int, default=1024)
    parser.add_argument("--cowclip-ratio", type=float, default=1.0)
    parser.add_argument("--cowclip-zeta", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=DOCS / "cowclip_ctr.png")
    parser.add_argument("--name", default="cowclip_ctr", help="of the results file")
    args = parser.parse_args()
    rows = launch(run_all, args.nproc, args)[0]
    rows.sort(key=lambda r: (RECIPES.index(r["recipe"]), r["global_batch"]))
    report(args.name, rows,
           notes=f"{args.samples} train samples, {args.epochs} epoch(s), {args.plan}{args.nproc}, seed {args.seed}")
    if not math.isnan(rows[0]["test_auc"]):
        print(f"plot: {plot(rows, args.plot)}")


if __name__ == "__main__":
    main()
