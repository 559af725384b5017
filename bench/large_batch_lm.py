"""Large-batch language modelling at small scale: AdamW vs LAMB vs LARS vs Muon, each with its batch
scaling rule, at the same token budget and growing global batch (the survey arXiv 2111.00856).

Every run is `python -m shoal train` in its own subprocess (one process on the CPU), on the
built-in corpus (byte vocabulary), with the same seed, sequence length and number of training
tokens; only the global batch (and so the number of steps) and the optimizer change. Each
optimizer's lr is set for `--base-batch` and scaled by its rule (`--lr-scaling`): AdamW, LAMB and Muon
by sqrt(batch / base) (the survey's rule for adaptive methods, LAMB's paper), LARS linearly
(Goyal et al. 2017, as LARS's paper uses it); the warm-up (10% of the steps) keeps its share of
the run. The held-out loss is measured once, after the last step, on the same number of held-out
sequences for every batch size.

Prints one table (also written to bench/results/<name>.json), records its rows in docs/<name>.json beside
every run of the sweep recorded before (`merged`), and plots them all in docs/<name>.png. A run whose folder
already holds a finished run of the same command is read, not retrained (`--fresh` retrains).

    python -m bench.large_batch_lm [--batches 256 64 16] [--tokens 65536] [--only lamb ...]
    python -m bench.large_batch_lm --model small --batches 1024 256 64 16 --tokens 1048576 \
        --seq-len 64 --micro-batch 64 --eval-sequences 1024 --only adamw lamb-lr0.03 lars --name large_batch_small
    python -m bench.large_batch_lm --model small --batches 1024 256 --tokens 1048576 --seq-len 64 --micro-batch 64 \
        --eval-sequences 1024 --only muon-lr1e-2 muon-lr3e-2 --name large_batch_small
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS, report, train_run
from shoal.models.config import get_preset
from shoal.train.metrics import read_metrics

DOCS = Path(__file__).resolve().parent.parent / "docs"
MODELS: dict[str, tuple[str, dict[str, str]]] = {
    "tiny-2x64": ("tiny", {"num_layers": "2", "dim": "64", "ffn_dim": "192", "num_heads": "4", "num_kv_heads": "2"}),
    "small": ("small", {}),
}
"""--model: a preset and its --set overrides; tiny-2x64 is the tiny preset cut to 2 layers of width 64
(0.13M parameters), the first, smoke-scale run; small is the preset the issue names."""
# label -> (optimizer, peak lr at the base batch, scaling rule, extra flags); untuned: AdamW's default
# lr for all three, LARS's paper's eta, then LAMB again at a larger lr (its step is lr * ||w||)
OPTIMIZERS: dict[str, tuple[str, float, str, list[str]]] = {
    "adamw": ("adamw", 3e-3, "sqrt", []),
    "lamb": ("lamb", 3e-3, "sqrt", []),
    "lars": ("lars", 2.0, "linear", ["--lars-eta", "0.001", "--adapt-vectors", "on"]),
    "lamb-lr0.03": ("lamb", 3e-2, "sqrt", []),
    # Muon adjusts its lr to AdamW's update RMS (match_rms_adamw): AdamW's lr first, then a grid around it
    "muon": ("muon", 3e-3, "sqrt", []),
    "muon-lr3e-4": ("muon", 3e-4, "sqrt", []),
    "muon-lr1e-3": ("muon", 1e-3, "sqrt", []),
    "muon-lr1e-2": ("muon", 1e-2, "sqrt", []),
    "muon-lr3e-2": ("muon", 3e-2, "sqrt", []),
}
LR_GRID = ("muon-lr3e-4", "muon-lr1e-3", "muon-lr1e-2", "muon-lr3e-2")
"""Labels run only when named (--only): Muon's lr grid, at two batch sizes."""


def train_command(label: str, batch: int, run_dir: Path, args: argparse.Namespace) -> list[str]:
    opt, lr, rule, extra = OPTIMIZERS[label]
    steps = args.tokens // (batch * args.seq_len)
    preset, shape = MODELS[args.model]
    command = [sys.executable, "-m", "shoal", "train", "--model", preset, "--nproc", "1", "--device", "cpu",
               "--steps", str(steps), "--seed", str(args.seed), "--global-batch", str(batch),
               "--seq-len", str(args.seq_len), "--optimizer", opt, "--lr", str(lr), "--lr-scaling", rule,
               "--base-batch", str(args.base_batch), "--weight-decay", "0.01",
               "--eval-every", "0", "--eval-batches", str(max(1, args.eval_sequences // batch)),
               "--log-every", str(max(1, steps // 8)), "--ckpt-every", str(steps), "--keep", "1",
               "--out", str(run_dir), *extra]
    if args.micro_batch and batch > args.micro_batch:
        command += ["--micro-batch", str(args.micro_batch)]  # accumulation: the same step, less memory
    for key, value in shape.items():
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
        # the median of the logged step times (each a mean over its log interval): the step's cost without
        # start-up and evaluation, comparable between runs only on an equally loaded machine
        "step_s_median": round(statistics.median(r["step_time_s"] for r in records if "step_time_s" in r), 4),
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
    parser.add_argument("--only", nargs="+", choices=list(OPTIMIZERS),
                        default=[k for k in OPTIMIZERS if k not in LR_GRID])
    parser.add_argument("--model", choices=list(MODELS), default="tiny-2x64")
    parser.add_argument("--micro-batch", type=int, default=0, help="sequences per forward (0: the whole batch)")
    parser.add_argument("--name", default="large_batch_lm", help="results/<name>.json, runs in results/<name>/")
    parser.add_argument("--plot", type=Path, default=None, help="default docs/<name>.png")
    parser.add_argument("--fresh", action="store_true")
    args = parser.parse_args()
    args.out = RESULTS / args.name
    preset, shape = MODELS[args.model]
    cfg = get_preset(preset).with_overrides(shape)
    print(f"model {args.model}: {cfg.num_params() / 1e6:.2f}M parameters; {args.tokens:,} tokens a run")
    rows = []
    for batch in args.batches:
        for opt in args.only:
            run_dir, wall = run_one(opt, batch, args)
            rows.append(row(opt, batch, read_metrics(run_dir / "metrics.jsonl"), wall, args))
    report(args.name, rows, notes=f"model {args.model}, {args.tokens} training tokens per run, seq {args.seq_len}")
    rows = merged(DOCS / f"{args.name}.json", rows)
    print(f"plot of every recorded run: {plot(rows, args.plot or DOCS / f'{args.name}.png', args.seq_len)}")


def merged(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows recorded in `path` (docs/<name>.json: every run of this sweep so far, over sessions and machines,
    whose run folders bench/results may no longer hold), this invocation's replacing those of the same optimizer
    and batch; written back and returned, sorted."""
    recorded = json.loads(path.read_text())["rows"] if path.exists() else []
    key = lambda r: (r["optimizer"], r["global_batch"])  # noqa: E731
    fresh = {key(r) for r in rows}
    out = sorted([r for r in recorded if key(r) not in fresh] + rows, key=key)
    path.write_text(json.dumps({"rows": out}, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
