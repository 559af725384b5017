"""Sparse-MLP against the dense Mixer at equal FLOPs, and top-2 / expert prototyping routers
inside Sparse-MLP, on the 8x8 digits (Lou et al. 2021, arXiv 2109.02008, at toy scale).

Every variant trains in this process, one after the other, through the trainer's own pieces at
world size 1: `parallelize(model)` (the runtime), `train_step`, the trainer's AdamW and
warm-up + cosine schedule (shoal.optim.builder defaults), the image batches of `shoal train`
(shoal.experiments.mixer.images, a pure function of seed and step) and its held-out accuracy. No launcher:
on a loaded 2-core machine a subprocess per run would cost more than the training.

Variants (the presets of shoal.experiments.mixer.config, 4 blocks, C = 64, S = 16 patches of 2x2):
- mixer: dense, channel MLP width 154, chosen so that its training FLOPs per image equal
  sparse-mlp's (9.17 MFLOP);
- sparse-mlp: blocks 2 and 4 sparse (MoE_S and MoE_C, 4 experts each, top-1, capacity 1.25,
  re-represent C 64 -> C' 32, S 16 -> S' 32);
- sparse-top2: the same with top-2 routing (weights renormalised): two experts per vector, so
  more FLOPs per image (printed in the table);
- sparse-proto: expert prototyping, 2 groups of 2 experts, top-1 in each (also two experts per vector).

Prints one table (also bench/results/sparse_mlp_experiment.json) and writes docs/sparse_mlp.png:
held-out accuracy and training loss against steps, the mean over the seeds with their range.

    python -m bench.sparse_mlp_experiment [--steps 300] [--seeds 0 1 2] [--batch 32] [--eval-every 25]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import report
from shoal.apply_plan import parallelize
from shoal.experiments.mixer import MIXER_PRESETS, MixerConfig
from shoal.experiments.mixer.images import HeldOutImages, ImageBatches, correct_and_count, load_digits, split_images
from shoal.experiments.mixer.model import Mixer
from shoal.moe.collect import records as moe_records
from shoal.optim.builder import build_optimizer
from shoal.optim.config import OptimConfig
from shoal.optim.schedule import build_scheduler
from shoal.parallel.loss import cross_entropy_sum
from shoal.runtime import Runtime
from shoal.train.step import train_step

DOCS = Path(__file__).resolve().parent.parent / "docs"
HELD_OUT = 0.2
"""Share of the 1,797 digits held out (359 images): every run of every seed is scored on them."""

VARIANTS: dict[str, MixerConfig] = {
    "mixer": MIXER_PRESETS["mixer"],
    "sparse-mlp": MIXER_PRESETS["sparse-mlp"],
    "sparse-top2": MIXER_PRESETS["sparse-mlp"].replace(top_k=2, norm_topk=True),
    "sparse-proto": MIXER_PRESETS["sparse-mlp"].replace(top_k=2, num_prototypes=2),
}


@torch.no_grad()
def held_out_accuracy(runtime: Runtime, held_out: HeldOutImages, batch: int) -> tuple[float, float]:
    """(accuracy, loss) over every held-out image, as the image task's evaluation takes them
    (shoal.experiments.mixer.task.ImageTask.evaluate)."""
    runtime.eval()
    totals = torch.zeros(3)
    for i in range(held_out.num_batches(batch)):
        images, labels = held_out.batch(i, batch)
        logits = runtime(images)
        totals += torch.stack([cross_entropy_sum(logits, labels), *correct_and_count(logits, labels)])
    runtime.train()
    loss, right, counted = totals.tolist()
    return right / counted, loss / counted


def train_one(name: str, cfg: MixerConfig, seed: int, data: tuple[Any, Any],
              args: argparse.Namespace) -> dict[str, Any]:
    """One variant and seed: the held-out accuracy every `eval_every` steps, the training loss of every step."""
    (train_x, train_y), (val_x, val_y) = data
    torch.manual_seed(seed)
    runtime = parallelize(Mixer(cfg))
    optim = OptimConfig()
    optimizer = build_optimizer(runtime, optim, global_batch=args.batch)
    scheduler = build_scheduler(optimizer, optim, args.steps, global_batch=args.batch)
    batches, held_out = ImageBatches(train_x, train_y, seed=seed), HeldOutImages(val_x, val_y)
    losses, evals, dropped, step_s = [], [], [], []
    for step in range(args.steps):
        images, labels = batches.batch(step, args.batch)
        started = time.perf_counter()
        result = train_step(runtime, optimizer, [(images, labels)], grad_clip=optim.grad_clip or None,
                            scheduler=scheduler)
        losses.append(float(result.loss))
        step_s.append(time.perf_counter() - started)
        if result.moe:
            figures = moe_records({k: v.tolist() for k, v in result.moe.items()})
            dropped.append(statistics.mean(v for k, v in figures.items() if k.endswith("/dropped")))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evals.append((step + 1, *held_out_accuracy(runtime, held_out, args.batch)))
    print(f"{name} seed {seed}: held-out accuracy {evals[-1][1]:.2%} after {args.steps} steps", flush=True)
    return {"losses": losses, "evals": evals, "dropped": statistics.mean(dropped) if dropped else 0.0,
            "images_per_s": args.batch / statistics.median(step_s[5:] or step_s)}


def row(name: str, cfg: MixerConfig, runs: list[dict[str, Any]]) -> dict[str, Any]:
    final = [r["evals"][-1][1] for r in runs]
    best = [max(e[1] for e in r["evals"]) for r in runs]
    return {
        "variant": name, "params_k": round(cfg.num_params() / 1e3, 1),
        "active_params_k": round(cfg.num_params(active=True) / 1e3, 1),
        "mflops_per_image": round(cfg.flops_per_image() / 1e6, 2),
        "final_acc_mean": round(100 * statistics.mean(final), 2),
        "final_acc_std": round(100 * statistics.stdev(final), 2) if len(final) > 1 else 0.0,
        "final_acc_by_seed": [round(100 * a, 2) for a in final],
        "best_acc_mean": round(100 * statistics.mean(best), 2),
        "final_eval_loss_mean": round(statistics.mean(r["evals"][-1][2] for r in runs), 4),
        "train_loss_last50_mean": round(statistics.mean(statistics.mean(r["losses"][-50:]) for r in runs), 4),
        "dropped_fraction": round(statistics.mean(r["dropped"] for r in runs), 4),
        "images_per_s": round(statistics.median(r["images_per_s"] for r in runs)),
    }


def plot(results: dict[str, list[dict[str, Any]]], path: Path, window: int = 20) -> Path:
    """Held-out accuracy (mean over seeds, shaded min..max) and smoothed training loss against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, loss) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, runs) in enumerate(results.items()):
        steps = [e[0] for e in runs[0]["evals"]]
        values = [[100 * r["evals"][j][1] for r in runs] for j in range(len(steps))]
        acc.plot(steps, [statistics.mean(v) for v in values], "o-", ms=3, color=f"C{i}", label=name)
        acc.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=f"C{i}", alpha=0.15)
        mean_loss = [statistics.mean(v) for v in zip(*(r["losses"] for r in runs))]
        smooth = [statistics.mean(mean_loss[max(0, j - window + 1):j + 1]) for j in range(len(mean_loss))]
        loss.plot(range(1, len(smooth) + 1), smooth, color=f"C{i}", label=name)
    acc.set(xlabel="step", ylabel="held-out accuracy (%)", title=f"digits, held-out {HELD_OUT:.0%}: mean of "
            f"{len(next(iter(results.values())))} seeds (band: min..max)")
    acc.set_ylim(bottom=max(0, acc.get_ylim()[0]))
    loss.set(xlabel="step", ylabel=f"training loss (mean over seeds, {window}-step mean)", yscale="log")
    for ax in (acc, loss):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    images, labels = load_digits()
    data = split_images(images, labels, HELD_OUT)
    started = time.perf_counter()
    results = {name: [train_one(name, VARIANTS[name], seed, data, args) for seed in args.seeds]
               for name in args.only}
    rows = [row(name, VARIANTS[name], runs) for name, runs in results.items()]
    wall = time.perf_counter() - started
    report("sparse_mlp_experiment", rows, notes=f"{args.steps} steps x {args.batch} images, seeds {args.seeds}, "
           f"held-out {HELD_OUT:.0%} of the digits; one process, one thread; {wall:.0f} s wall")
    print(f"plot: {plot(results, DOCS / 'sparse_mlp.png')}; {wall:.0f} s wall")


if __name__ == "__main__":
    main()
