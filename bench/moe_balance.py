"""Auxiliary-loss-free balancing against a balance loss and against none, on a small
DeepSeek-style MoE (DeepSeek-V3, arXiv 2412.19437, section 2.1.2; Wang et al. 2024, arXiv 2408.15664).

The model is the `tiny` shape cut to 2 layers (dim 128) with every block an MoE of fine-grained
experts (16 experts of width 64, top-4) beside one shared expert of width 128, routed as
DeepSeek-V3 routes: a sigmoid score per expert, 4 groups of 4 experts of which each token
chooses among its 2 best, the top-4 weights normalised and scaled by 2.5. Every method trains
the same steps, seeds, data and batch by `python -m shoal train` in its own subprocess:

    aux-free   router_bias=true router_bias_rate=GAMMA (the bias moves, no balance loss)
    seqaux-A   seq_aux_coef=A (DeepSeek-V3's sequence-wise balance loss), no bias
    none       neither

The z-loss and the Switch balance loss are off in every method (aux_loss_coef=0,
z_loss_coef=0). Dropless by default (capacity_factor=0, as DeepSeek-V3 trains), so max/mean is
the load of the routed choices; `--capacity 1.25` trains with a capacity and reports the dropped
fraction instead (max/mean then counts the kept tokens only, at most the capacity).

Prints one table (median over seeds and the range; also bench/results/moe_balance.json) and
writes docs/moe_balance.png: held-out loss and max/mean load over steps per method. A run whose
folder holds a finished run of the same command is read, not retrained (`--fresh` retrains).

    python -m bench.moe_balance [--steps 48] [--seeds 0 1 2] [--jobs 1] [--only aux-free none]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import RESULTS, report, save_figure, train_run
from bench.moe_experiment import smooth
from shoal.train.metrics import read_metrics

PRESET = "tiny"
DOCS = Path(__file__).resolve().parent.parent / "docs"
MODEL = dict(num_layers="2", num_experts="16", top_k="4", ffn_dim="64", num_shared_experts="1", shared_ffn_dim="128",
             router_score="sigmoid", router_groups="4", router_topk_groups="2", router_scale="2.5",
             norm_topk="true", aux_loss_coef="0", z_loss_coef="0")
"""The DeepSeek-style MoE every method shares (`--set` overrides of the preset)."""


@dataclass(frozen=True)
class Method:
    """A balancing method: its name and its `--set` overrides beside MODEL."""

    name: str
    sets: dict[str, str]


def methods(gamma: float, coefs: list[float]) -> list[Method]:
    """Aux-free at rate gamma, the sequence-wise balance loss at each coefficient, then none."""
    out = [Method("aux-free", dict(router_bias="true", router_bias_rate=f"{gamma:g}"))]
    out += [Method(f"seqaux-{c:g}", dict(seq_aux_coef=f"{c:g}")) for c in coefs]
    return out + [Method("none", {})]


def train_command(method: Method, seed: int, run_dir: Path, args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "shoal", "train", "--model", PRESET, "--nproc", "1", "--device", "cpu",
               "--steps", str(args.steps), "--seed", str(seed), "--global-batch", str(args.global_batch),
               "--seq-len", str(args.seq_len), "--eval-every", str(args.eval_every),
               "--eval-batches", str(args.eval_batches), "--ckpt-every", str(args.steps), "--keep", "1",
               "--out", str(run_dir)]
    for key, value in {**MODEL, "capacity_factor": f"{args.capacity:g}", **method.sets}.items():
        command += ["--set", f"{key}={value}"]
    return command


def layer_mean(record: dict[str, Any], figure: str) -> float:
    """A per-layer MoE figure of one step record averaged over the MoE layers."""
    values = [v for k, v in record.items() if k.startswith("moe/") and k.endswith(f"/{figure}")]
    return statistics.fmean(values)


def max_over_mean(record: dict[str, Any]) -> float:
    """The most loaded expert's tokens over the mean expert's, averaged over the MoE layers
    (1: perfect balance; DeepSeek's MaxVio is this minus 1)."""
    layers = {k.split("/")[1] for k in record if k.startswith("moe/") and k.endswith("/tokens_max")}
    return statistics.fmean(record[f"moe/{n}/tokens_max"] / record[f"moe/{n}/tokens_mean"] for n in layers)


def run_figures(records: list[dict[str, Any]], window: int) -> dict[str, float]:
    """One run's figures: final held-out loss, max/mean over all steps and over the last `window`."""
    return {
        "heldout": [r["eval_loss"] for r in records if "eval_loss" in r][-1],
        "maxmean_all": statistics.fmean(max_over_mean(r) for r in records),
        "maxmean_end": statistics.fmean(max_over_mean(r) for r in records[-window:]),
        "load_cv_end": statistics.fmean(layer_mean(r, "load_cv") for r in records[-window:]),
        "dropped_all": statistics.fmean(layer_mean(r, "dropped") for r in records),
    }


def row(method: Method, per_seed: list[dict[str, float]]) -> dict[str, Any]:
    """The table's row of one method: each figure's median over seeds and its range."""
    out: dict[str, Any] = {"method": method.name}
    for key in per_seed[0]:
        values = [f[key] for f in per_seed]
        out[key] = statistics.median(values)
        out[f"{key}_range"] = max(values) - min(values)
    return out


def plot(runs: dict[str, list[list[dict[str, Any]]]], path: Path, window: int) -> Path:
    """Held-out loss and max/mean load ({window}-step moving mean) over steps: the median over
    seeds per method, the seeds' range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, load_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (name, seeds), colour in zip(runs.items(), ("tab:green", "tab:blue", "tab:orange", "tab:red", "tab:purple")):
        evals = [[r for r in records if "eval_loss" in r] for records in seeds]
        steps = [r["step"] for r in evals[0]]
        per_step = list(zip(*([r["eval_loss"] for r in e] for e in evals)))
        loss_ax.plot(steps, [statistics.median(v) for v in per_step], color=colour, marker="o", ms=3, label=name)
        loss_ax.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step], color=colour, alpha=0.15)
        curves = [smooth([max_over_mean(r) for r in records], window) for records in seeds]
        per_step = list(zip(*curves))
        steps = [r["step"] for r in seeds[0]]
        load_ax.plot(steps, [statistics.median(v) for v in per_step], color=colour, label=name, lw=1.2)
        load_ax.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step], color=colour, alpha=0.15)
    loss_ax.set_title("held-out loss (median over seeds, range shaded)")
    loss_ax.set_ylabel("cross-entropy (nats/token)")
    load_ax.set_title(f"max/mean expert load, mean over layers ({window}-step moving mean)")
    load_ax.axhline(1.0, color="grey", lw=0.8)
    for ax in (loss_ax, load_ax):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    evals_y = [y for line in loss_ax.get_lines() for x, y in zip(line.get_xdata(), line.get_ydata())
               if x >= steps[-1] / 4]
    if evals_y:  # the first evaluations, still near the initial loss, would flatten the rest
        margin = 0.1 * (max(evals_y) - min(evals_y)) or 0.05
        loss_ax.set_ylim(min(evals_y) - margin, max(evals_y) + margin)
    return save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=16)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--gamma", type=float, default=1e-3, help="the bias update rate of aux-free (DeepSeek-V3's)")
    parser.add_argument("--coefs", type=float, nargs="+", default=[1e-2, 1e-3],
                        help="coefficients of the sequence-wise balance loss")
    parser.add_argument("--capacity", type=float, default=0.0, help="capacity_factor of every run (0: dropless)")
    parser.add_argument("--only", nargs="+", default=None, help="run only these methods (by name)")
    parser.add_argument("--window", type=int, default=16, help="steps of the end-of-training figures and smoothing")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once (one process each)")
    parser.add_argument("--out", type=Path, default=RESULTS / "moe_balance", help="folder of the run folders")
    parser.add_argument("--plot", type=Path, default=DOCS / "moe_balance.png")
    parser.add_argument("--fresh", action="store_true", help="retrain runs already finished")
    parser.add_argument("--read-only", action="store_true",
                        help="train nothing: report the steps the run folders hold (finished or not), every run "
                             "cut to the last evaluation all of them reached")
    args = parser.parse_args()
    chosen = [m for m in methods(args.gamma, args.coefs) if args.only is None or m.name in args.only]
    if not chosen:
        valid = ", ".join(m.name for m in methods(args.gamma, args.coefs))
        parser.error(f"--only {' '.join(args.only)} names no method; valid: {valid}")

    def train(method: Method, seed: int) -> Path:
        run_dir = args.out / f"{method.name}_seed{seed}"
        return train_run(f"{method.name} seed {seed}", train_command(method, seed, run_dir, args), run_dir,
                         fresh=args.fresh)[0]

    jobs = [(m, s) for s in args.seeds for m in chosen]  # every method's first seed first
    if args.read_only:
        found = [(m, args.out / f"{m.name}_seed{s}" / "metrics.jsonl") for m, s in jobs]
        found = [(m, path) for m, path in found if path.is_file() and path.stat().st_size]
    else:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            found = [(m, folder / "metrics.jsonl") for (m, _), folder in zip(jobs, pool.map(lambda j: train(*j), jobs))]
    records = [(m, read_metrics(path)) for m, path in found]
    last_eval = min((max((r["step"] for r in rs if "eval_loss" in r), default=0) for _, rs in records), default=0)
    if not last_eval:  # every run is cut to the last evaluation all reached: equal steps
        parser.error(f"not every run in {args.out} has reached an evaluation yet")
    runs: dict[str, list[list[dict[str, Any]]]] = {}
    for method, rs in records:
        runs.setdefault(method.name, []).append([r for r in rs if r["step"] <= last_eval])
    chosen = [m for m in chosen if m.name in runs]
    rows = [row(m, [run_figures(r, args.window) for r in runs[m.name]]) for m in chosen]
    report("moe_balance", rows, notes=(
        f"preset {PRESET} + {' '.join(f'{k}={v}' for k, v in MODEL.items())}, capacity_factor={args.capacity:g}; "
        f"{last_eval} of {args.steps} steps, seeds per method {({k: len(v) for k, v in runs.items()})}, "
        f"{args.global_batch} x {args.seq_len} tokens per step; medians over seeds, _range: max - min over seeds; "
        f"heldout: at the last step ({args.eval_batches} batches); maxmean: "
        f"tokens_max / tokens_mean averaged over the MoE layers, over all steps (_all) or the last {args.window} "
        f"(_end); load_cv_end: std/mean of routed tokens per expert, last {args.window} steps"))
    print(f"wrote {plot(runs, args.plot, args.window)}")


if __name__ == "__main__":
    main()
