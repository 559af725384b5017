"""M6-T at small scale: dense, top-1, top-2 and expert prototyping at equal compute per token,
each under several capacity factors (Yang et al. 2021, arXiv 2105.15082).

Every variant is the `tiny` shape (4 layers, dim 128, SwiGLU) trained by `python -m shoal train`
in its own subprocess, one after the other (one process on the CPU each), with the same steps,
seed, data, global batch and sequence length. The activated FFN compute per token is that of
the dense model: top-1 routes to one expert of the dense width F, top-2 and prototyping (two
groups of E/2 experts, top-1 in each) to two experts of width F/2. Capacity factor C: an expert
keeps at most ceil(C * N * k / E) of the N tokens' choices; 0 is dropless.

Prints one table (also written to bench/results/moe_experiment[_seedN].json) and writes two plots:
the loss curves and the load spread / dropped fraction over steps. A variant whose run folder
already holds a finished run of the same command is read, not retrained (`--fresh` retrains).

    python -m bench.moe_experiment [--steps 300] [--capacity 1.0 1.25 2.0 0] [--only top2 ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import RESULTS, report, save_figure, train_run
from shoal.models.config import ModelConfig, get_preset
from shoal.train.metrics import read_metrics

PRESET = "tiny"
NUM_EXPERTS = 8
DOCS = Path(__file__).resolve().parent.parent / "docs"


@dataclass(frozen=True)
class Variant:
    """One configuration: a name, its routing family (for the plots) and its `--set` overrides."""

    name: str
    family: str
    capacity_factor: float | None  # None: dense
    sets: dict[str, str] = field(default_factory=dict)

    def config(self) -> ModelConfig:
        return get_preset(PRESET).with_overrides(self.sets)


def variants(capacities: list[float]) -> list[Variant]:
    """The dense model, then top-1, top-2 and prototyping k=2 at each capacity factor."""
    dense_ffn = get_preset(PRESET).ffn_dim
    families = {
        "top1": dict(top_k="1", norm_topk="false", ffn_dim=str(dense_ffn)),  # the gate scales the output
        "top2": dict(top_k="2", ffn_dim=str(dense_ffn // 2)),
        "proto2": dict(top_k="2", num_prototypes="2", norm_topk="false", ffn_dim=str(dense_ffn // 2)),  # M6-T
    }
    out = [Variant("dense", "dense", None)]
    for family, sets in families.items():
        for c in capacities:
            label = "dropless" if c == 0 else f"C={c:g}"
            out.append(Variant(f"{family} {label}", family, c,
                               dict(num_experts=str(NUM_EXPERTS), capacity_factor=str(c), **sets)))
    return out


def active_ffn_params(cfg: ModelConfig) -> int:
    """FFN (expert) weights one token passes through, summed over the layers; routers excluded."""
    per_ffn = (3 if cfg.activation == "swiglu" else 2) * cfg.dim * cfg.ffn_dim
    return sum(per_ffn * (cfg.top_k + cfg.num_shared_experts if cfg.is_moe_layer(i) else 1)
               for i in range(cfg.num_layers))


def train_command(variant: Variant, run_dir: Path, args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "shoal", "train", "--model", PRESET, "--nproc", "1", "--device", "cpu",
               "--steps", str(args.steps), "--seed", str(args.seed), "--global-batch", str(args.global_batch),
               "--seq-len", str(args.seq_len), "--eval-every", str(args.eval_every),
               "--eval-batches", str(args.eval_batches), "--ckpt-every", str(args.steps), "--keep", "1",
               "--out", str(run_dir)]
    for key, value in variant.sets.items():
        command += ["--set", f"{key}={value}"]
    return command


def run_variant(variant: Variant, args: argparse.Namespace) -> tuple[Path, float]:
    """Train the variant (or find its finished run); (run folder, wall seconds of the subprocess)."""
    run_dir = args.out / variant.name.replace(" ", "_").replace("=", "")
    return train_run(variant.name, train_command(variant, run_dir, args), run_dir, fresh=args.fresh)


def layer_mean(record: dict[str, Any], figure: str) -> float | None:
    """A per-layer MoE figure of one step record averaged over the layers; None for dense models."""
    values = [v for k, v in record.items() if k.startswith("moe/") and k.endswith(f"/{figure}")]
    return statistics.fmean(values) if values else None


def tail_mean(records: list[dict[str, Any]], figure: str) -> float | str:
    """A per-layer MoE figure averaged over the layers and the records; "-" for a dense model."""
    values = [v for v in (layer_mean(r, figure) for r in records) if v is not None]
    return statistics.fmean(values) if values else "-"


def row(variant: Variant, records: list[dict[str, Any]], wall_s: float, args: argparse.Namespace) -> dict[str, Any]:
    """The table's row of one finished run."""
    cfg = variant.config()
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    tail = records[-args.load_window:]
    return {
        "config": variant.name,
        "active_ffn_M": active_ffn_params(cfg) / 1e6,
        "total_params_M": cfg.num_params() / 1e6,
        "heldout_loss": evals[-1],
        "train_loss": statistics.fmean(r["loss"] for r in records[-args.loss_window:]),
        "dropped": tail_mean(tail, "dropped"),
        "load_cv": tail_mean(tail, "load_cv"),
        "wall_s": round(wall_s, 1),
        "step_ms": round(1e3 * statistics.median(r["step_time_s"] for r in records)),
    }


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(runs: list[tuple[Variant, list[dict[str, Any]]]], out_dir: Path, window: int) -> list[Path]:
    """docs/moe_experiment_loss.png (training and held-out loss) and moe_experiment_load.png
    (load CV and dropped fraction, layer means): colour = routing, line style = capacity factor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"dense": "black", "top1": "tab:blue", "top2": "tab:orange", "proto2": "tab:green"}
    styles = {None: "-", 1.0: ":", 1.25: "-", 2.0: "--", 0.0: "-."}

    def draw(ax: Any, variant: Variant, steps: list[int], values: list[float], **kw: Any) -> None:
        ax.plot(steps, values, color=colours[variant.family], ls=styles.get(variant.capacity_factor, "-"),
                label=variant.name, lw=1.2, **kw)

    fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant, records in runs:
        draw(train_ax, variant, [r["step"] for r in records], smooth([r["loss"] for r in records], window))
        evals = [r for r in records if "eval_loss" in r]
        draw(eval_ax, variant, [r["step"] for r in evals], [r["eval_loss"] for r in evals], marker="o", ms=3)
    train_ax.set_title(f"training loss ({window}-step moving mean)")
    eval_ax.set_title("held-out loss")
    for ax in (train_ax, eval_ax):
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
        _zoom(ax)
    eval_ax.legend(fontsize=7, ncol=2)
    loss_path = save_figure(fig, out_dir / "moe_experiment_loss.png")

    fig, (cv_ax, drop_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant, records in runs:
        if variant.capacity_factor is None:
            continue
        steps = [r["step"] for r in records]
        draw(cv_ax, variant, steps, smooth([layer_mean(r, "load_cv") or 0.0 for r in records], window))
        draw(drop_ax, variant, steps, smooth([layer_mean(r, "dropped") or 0.0 for r in records], window))
    cv_ax.set_title("load CV (std/mean of routed tokens per expert), mean over layers")
    drop_ax.set_title("dropped fraction of routed choices, mean over layers")
    for ax in (cv_ax, drop_ax):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    drop_ax.legend(fontsize=7, ncol=2)
    return [loss_path, save_figure(fig, out_dir / "moe_experiment_load.png")]


def _zoom(ax: Any) -> None:
    """Leave out the first sixth of the steps' losses from the y range, where the curves still
    fall from ~5.5 and would flatten the differences that matter."""
    last = max(line.get_xdata()[-1] for line in ax.get_lines())
    ys = [y for line in ax.get_lines() for x, y in zip(line.get_xdata(), line.get_ydata()) if x >= last / 6]
    if ys:
        margin = 0.05 * (max(ys) - min(ys)) or 0.05
        ax.set_ylim(min(ys) - margin, max(ys) + margin)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--capacity", type=float, nargs="+", default=[1.0, 1.25, 2.0, 0.0],
                        help="capacity factors of every MoE variant (0: dropless)")
    parser.add_argument("--only", nargs="+", default=None,
                        help="run only these families (dense, top1, top2, proto2)")
    parser.add_argument("--loss-window", type=int, default=20, help="final train loss: mean of the last N steps")
    parser.add_argument("--load-window", type=int, default=50, help="dropped / load CV: mean of the last N steps")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder of the run folders [bench/results/moe_experiment, _seedN for seed N > 0]")
    parser.add_argument("--plots", type=Path, default=DOCS, help="folder the two PNGs go to")
    parser.add_argument("--fresh", action="store_true", help="retrain runs already finished")
    args = parser.parse_args()
    name = "moe_experiment" + (f"_seed{args.seed}" if args.seed else "")
    args.out = args.out or RESULTS / name
    chosen = [v for v in variants(args.capacity) if args.only is None or v.family in args.only]
    if not chosen:
        parser.error(f"--only {' '.join(args.only)} names no family; valid: dense, top1, top2, proto2")

    rows, runs = [], []
    for variant in chosen:
        run_dir, wall = run_variant(variant, args)
        records = read_metrics(run_dir / "metrics.jsonl")
        runs.append((variant, records))
        rows.append(row(variant, records, wall, args))
    report(name, rows, notes=(
        f"preset {PRESET} (4 layers, dim 128), {NUM_EXPERTS} experts, {args.steps} steps, seed {args.seed}, "
        f"{args.global_batch} x {args.seq_len} tokens per step, 1 CPU process each; held-out loss at the last step "
        f"({args.eval_batches} batches); train loss: mean of the last {args.loss_window} steps; dropped and load_cv: "
        f"means of the last {args.load_window} steps over the MoE layers; wall_s: the whole subprocess; "
        f"step_ms: median step time (robust to other jobs on the machine)"))
    for path in plot(runs, args.plots, args.loss_window):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
