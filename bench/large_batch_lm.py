"""Large-batch language modelling at small scale: AdamW vs LAMB vs LARS, each with its batch
scaling rule, at the same token budget and growing global batch (the survey arXiv 2111.00856).

Every run is `python -m shoal train` in its own subprocess (one process on the CPU), on the
built-in corpus (byte vocabulary), with the same seed, sequence length and number of training
tokens; only the global batch (and so the number of steps) and the optimizer change. Each
optimizer's lr is set for `--base-batch` and scaled by its rule (`--lr-scaling`): AdamW and LAMB
by sqrt(batch / base) (the survey's rule for adaptive methods, LAMB's paper), LARS linearly
(Goyal et al. 2017, as LARS's paper uses it); the warm-up (10% of the steps) keeps its share of
the run. The held-out loss is measured once, after the last step, on the same number of held-out
sequences for every batch size.

Prints one table (also written to bench/results/large_batch_lm.json) and writes the plot
docs/large_batch_lm.png. A run whose folder already holds a finished run of the same command is
read, not retrained (`--fresh` retrains).

    python -m bench.large_batch_lm [--batches 256 64 16] [--tokens 65536] [--only lamb ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS, report, train_run
from shoal.models.config import get_preset
from shoal.train.metrics import read_metrics

DOCS = Path(__file__).resolve().parent.parent / "docs"
PRESET = "tiny"
SHAPE = {"num_layers": "2", "dim": "64", "ffn_dim": "192", "num_heads": "4", "num_kv_heads": "2"}
"""The tiny preset cut to 2 layers of width 64 (0.13M parameters) to fit the machine's budget."""
# label -> (optimizer, peak lr at the base batch, scaling rule, extra flags); untuned: AdamW's default
# lr for all three, LARS's paper's eta, then LAMB again at a larger lr (its step is lr * ||w||)
OPTIMIZERS: dict[str, tuple[str, float, str, list[str]]] = {
    "adamw": ("adamw", 3e-3, "sqrt", []),
    "lamb": ("lamb", 3e-3, "sqrt", []),
    "lars": ("lars", 2.0, "linear", ["--lars-eta", "0.001", "--adapt-vectors", "on"]),
    "lamb-lr0.03": ("lamb", 3e-2, "sqrt", []),
}


def train_command(label: str, batch: int, run_dir: Path, args: argparse.Namespace) -> list[str]:
    opt, lr, rule, extra = OPTIMIZERS[label]
    steps = args.tokens // (batch * args.seq_len)
    command = [sys.executable, "-m", "shoal", "train", "--model", PRESET, "--nproc", "1", "--device", "cpu",
               "--steps", str(steps), "--seed", str(args.seed), "--global-batch", str(batch),
               "--seq-len", str(args.seq_len), "--optimizer", opt, "--lr", str(lr), "--lr-scaling", rule,
               "--base-batch", str(args.base_batch), "--weight-decay", "0.01",
               "--eval-every", "0", "--eval-batches", str(max(1, args.eval_sequences // batch)),
               "--log-every", str(max(1, steps // 8)), "--ckpt-every", str(steps), "--keep", "1",
               "--out", str(run_dir), *extra]
    for key, value in SHAPE.items():
        command += ["--set", f"{key}={value}"]
    return command


def run_one(opt: str, batch: int, args: argparse.Namespace) -> tuple[Path, float]:
    """Train one (optimizer, batch) run or find it finished; (run folder, wall seconds)."""
    run_dir = args.out / f"{opt}_b{batch}"
    return train_run(f"{opt} batch {batch}", train_command(opt, batch, run_dir, args), run_dir, fresh=args.fresh)


def row(opt: str, batch: int, records: list[dict[str, Any]], wall_s: float, args: argparse.Namespace) -> dict[str, Any]:
    _, _, rule, _ = OPTIMIZERS[opt]
    return {
        "optimizer": opt, "rule": rule, "global_batch": batch, "steps": len(records) and records[-1]["step"],
        "peak_lr": round(max(r["lr"] for r in records), 5),
        "heldout_loss": records[-1]["eval_loss"],
        "train_loss_last": records[-1]["loss"],
        "wall_s": round(wall_s, 1),
    }


def plot(rows: list[dict[str, Any]], path: Path, seq_len: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for opt in OPTIMIZERS:
        mine = [r for r in rows if r["optimizer"] == opt]
        if mine:
            ax.plot([r["global_batch"] for r in mine], [r["heldout_loss"] for r in mine], "o-",
                    label=f"{opt} ({mine[0]['rule']} lr scaling)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"global batch (sequences of {seq_len} tokens); same tokens for every run")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title("Same token budget, growing batch")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 64, 16], help="run in this order")
    parser.add_argument("--tokens", type=int, default=65536, help="training tokens of every run")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--base-batch", type=int, default=16, help="the batch the lrs are set for")
    parser.add_argument("--eval-sequences", type=int, default=256, help="held-out sequences evaluated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", choices=list(OPTIMIZERS), default=list(OPTIMIZERS))
    parser.add_argument("--out", type=Path, default=RESULTS / "large_batch_lm")
    parser.add_argument("--plot", type=Path, default=DOCS / "large_batch_lm.png")
    parser.add_argument("--fresh", action="store_true")
    args = parser.parse_args()
    cfg = get_preset(PRESET).with_overrides(SHAPE)
    print(f"model {PRESET} with {SHAPE}: {cfg.num_params() / 1e6:.2f}M parameters; {args.tokens:,} tokens a run")
    rows = []
    for batch in args.batches:
        for opt in args.only:
            run_dir, wall = run_one(opt, batch, args)
            rows.append(row(opt, batch, read_metrics(run_dir / "metrics.jsonl"), wall, args))
    rows.sort(key=lambda r: (r["optimizer"], r["global_batch"]))
    report("large_batch_lm", rows, notes=f"{args.tokens} training tokens per run, seq {args.seq_len}")
    print(f"plot: {plot(rows, args.plot, args.seq_len)}")


if __name__ == "__main__":
    main()
