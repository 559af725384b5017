"""What a run records (rank 0 only): metrics.jsonl, TensorBoard events, loss.png, the summary.

metrics.jsonl holds one JSON object per optimizer step: step, loss, lr, tokens_per_s,
step_time_s, data_time_s (the host's time getting the step's batch), mem_peak_mb, grad_norm, and
eval_loss on evaluation steps (with eval_loss_by_source, {source: loss}, for a mixture). Another task
(shoal.train.task) counts its own samples (images_per_s instead of tokens_per_s) and may record more
beside eval_loss (eval_accuracy: the plot and the summary show it). A resumed run first
drops the lines after its checkpoint (they belong to the lost tail of the earlier attempt), so
the file always reads as one unbroken run.

metrics.jsonl and summary.json are strict JSON (written with allow_nan=False): a value that is not
finite (a NaN or infinite loss or gradient norm) is written as null, and the record's `nonfinite`
lists the keys that held one (shoal.train.nonfinite.strict). A step whose update was not applied
has `skipped: true`; an fp16 loss-scale overflow also `loss_scale_overflow: true`; a loss spike
`loss_spike: true` with the `loss_spike_threshold` it rose above (docs/runs.md).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import torch

from shoal.calibration.measure import matmul_flops
from shoal.planner.hardware import gpu_device
from shoal.train.nonfinite import strict

METRICS = "metrics.jsonl"
PLOT = "loss.png"
MOE_PLOT = "moe_load.png"
TB_DIR = "tb"
SUMMARY = "summary.json"


class MetricsWriter:
    """Appends step records to the run folder's metrics.jsonl and TensorBoard events."""

    def __init__(self, run_dir: Path, *, start_step: int, sample: str = "token") -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: rank 0 only

        self.run_dir, self.sample = run_dir, sample
        self.path = run_dir / METRICS
        self.records = [r for r in read_metrics(self.path) if r["step"] <= start_step]
        self.path.write_text("".join(dumps(r) + "\n" for r in self.records))
        self._file = self.path.open("a")
        # purge_step drops events the earlier attempt wrote after the checkpoint we resume from.
        self._tb = SummaryWriter(str(run_dir / TB_DIR), purge_step=start_step + 1 if start_step else None)

    def log(self, record: dict[str, Any]) -> None:
        record = strict(record)
        self.records.append(record)
        self._file.write(dumps(record) + "\n")
        self._file.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                tag = {"eval_loss": "eval/loss", "eval_accuracy": "eval/accuracy"}.get(key, f"train/{key}")
                self._tb.add_scalar(tag, value, record["step"])

    def plot(self) -> Path:
        """Write loss.png: training loss per step, held-out loss where measured; for an MoE model
        also moe_load.png, each expert's share of the kept tokens per step."""
        if any("moe_load" in r for r in self.records):
            plot_expert_load(self.records, self.run_dir / MOE_PLOT)
        return plot_losses(self.records, self.run_dir / PLOT, sample=self.sample)

    def close(self) -> None:
        self._file.close()
        self._tb.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl ([] when there is none)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(records: list[dict[str, Any]], path: Path, *, sample: str = "token") -> Path:
    """Training loss per step and held-out loss where measured (nats per `sample`), beside the held-out accuracy
    where an evaluation measured one."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    accuracy = [r for r in records if "eval_accuracy" in r]
    fig, axes = plt.subplots(1, 2 if accuracy else 1, figsize=(11 if accuracy else 7, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot([r["step"] for r in records], [_num(r["loss"]) for r in records], label="train loss", lw=1)
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out loss")
    for source in dict.fromkeys(k for r in evals for k in r.get("eval_loss_by_source", {})):
        points = [(r["step"], r["eval_loss_by_source"][source]) for r in evals
                  if source in r.get("eval_loss_by_source", {})]
        ax.plot(*zip(*points), ".--", lw=0.8, label=f"held-out: {source}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"cross-entropy (nats/{sample})")
    ax.grid(alpha=0.3)
    ax.legend()
    if accuracy:  # a classifier: the held-out accuracy beside the losses
        acc = axes[0][1]
        acc.plot([r["step"] for r in accuracy], [100 * r["eval_accuracy"] for r in accuracy], "o-", color="C2")
        acc.set_xlabel("step")
        acc.set_ylabel("held-out accuracy (%)")
        acc.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _num(value: float | None) -> float:
    """A value metrics.jsonl may hold as null (non-finite), as a float to plot (NaN: a gap)."""
    return float("nan") if value is None else value


def dumps(value: Any, **kwargs: Any) -> str:
    """Strict JSON: a non-finite float raises (the writers pass everything through `strict` first)."""
    return json.dumps(value, allow_nan=False, **kwargs)


def plot_expert_load(records: list[dict[str, Any]], path: Path) -> Path:
    """A heatmap: experts (rows) by steps (columns), each expert's share of the kept tokens
    (averaged over the MoE layers); an even load is 1/E everywhere. With selection biases, a second
    heatmap of each expert's bias (averaged over the layers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if "moe_load" in r]
    load = torch.tensor([r["moe_load"] for r in rows]).T  # (E, steps)
    biased = [r for r in rows if "moe_bias" in r]
    height = 1.5 + 0.25 * load.shape[0]
    fig, axes = plt.subplots(2 if biased else 1, 1, figsize=(7, height * (2 if biased else 1)), squeeze=False)
    extent = (rows[0]["step"] - 0.5, rows[-1]["step"] + 0.5, load.shape[0] - 0.5, -0.5)
    panels = [(load, f"share of kept tokens per expert (even: {1 / load.shape[0]:.3f})", "viridis", extent)]
    if biased:  # the selection bias (auxiliary-loss-free balancing), averaged over the layers
        bias = torch.tensor([r["moe_bias"] for r in biased]).T
        panels.append((bias, "selection bias per expert", "coolwarm",
                       (biased[0]["step"] - 0.5, biased[-1]["step"] + 0.5, bias.shape[0] - 0.5, -0.5)))
    for ax, (values, title, cmap, box) in zip(axes[:, 0], panels, strict=True):
        image = ax.imshow(values, aspect="auto", cmap=cmap, interpolation="nearest", extent=box)
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
        ax.set_title(title)
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def peak_flops(device: torch.device, world_size: int) -> tuple[float, str]:
    """Peak FLOP/s of the whole job and where the number comes from.

    CUDA: the data sheet's dense 16-bit peak (shoal.planner.hardware.DEVICES) when the GPU has a spec, else
    measured. CPU: a short fp32 matmul timing on this process's threads (shoal.calibration.measure.matmul_flops),
    times the world size (each rank has its own cores).
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = gpu_device(name)
        if spec is not None:
            peak = spec.peak_flops.get("bf16") or spec.peak_flops["fp16"]
            return peak * world_size, f"{name} data sheet, bf16 dense"
    measured = matmul_flops(512, 512, 512, device=device, seconds=0.2)
    return measured * world_size, f"measured: fp32 matmul on {device.type}"


def summarize(records: list[dict[str, Any]], *, flops_per_sample: float, peak: tuple[float, str],
              wall_s: float, warmup: int = 1, start: int = 0, total: int | None = None,
              rate_key: str = "tokens_per_s", final: tuple[str, ...] = ()) -> dict[str, Any]:
    """The end-of-run summary: final losses, the median of the throughput `rate_key` (tokens/s, images/s), MFU
    estimate, peak memory, and the last value of each held-out metric in `final` (final_<name>, None if never
    measured). `flops_per_sample`: training FLOPs per sample the throughput counts (token, image).

    `records` cover the whole run; this invocation ran the steps after `start` (a resumed run)
    and its throughput and memory are taken from those alone, leaving out the first `warmup`
    (the first read window, which pays for compilation and lazy initialisation) when later
    ones exist."""
    ran = [r for r in records if r["step"] > start]
    if not ran:
        return {"steps": records[-1]["step"] if records else 0, "steps_run": 0, "wall_s": round(wall_s, 1)}
    rate = statistics.median(r[rate_key] for r in ran[warmup:] or ran)
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    finals = {name: [r[name] for r in records if name in r] for name in final}
    return {
        "steps": records[-1]["step"],
        "steps_run": len(ran),
        "first_step_run": ran[0]["step"],
        "total_steps": total if total is not None else records[-1]["step"],
        "final_loss": records[-1]["loss"],
        "final_eval_loss": evals[-1] if evals else None,
        "first_loss": records[0]["loss"],
        rate_key: rate,
        **{f"final_{name}": values[-1] if values else None for name, values in finals.items()},
        "mfu": flops_per_sample * rate / peak[0],
        "peak_flops": peak[0],
        "peak_flops_source": peak[1],
        "mem_peak_mb": max(r["mem_peak_mb"] for r in ran),
        "wall_s": round(wall_s, 1),
    }


def format_summary(summary: dict[str, Any]) -> str:
    if not summary.get("steps_run"):
        return "no steps were run"
    resumed = summary["first_step_run"] > 1
    rate = next(key for key in summary if key.endswith("_per_s"))  # the throughput: tokens_per_s, images_per_s
    lines = [
        f"done: {summary['steps_run']} steps in {summary['wall_s']:.0f} s"
        + (f" (steps {summary['first_step_run']}-{summary['steps']}; the run is at step {summary['steps']} of "
           f"{summary['total_steps']})" if resumed else "")
        + (f", plan {summary['plan']} on {summary['world_size']} {summary['device']} process(es)"
           if "plan" in summary else ""),
        *([f"  precision {summary['precision']}"] if "precision" in summary else []),
        *([f"  {summary['skipped_steps']} step(s) skipped: {len(summary.get('nonfinite_steps', []))} non-finite, "
           f"{summary.get('loss_scale_overflows', 0)} fp16 loss-scale overflow(s)"]
          if summary.get("skipped_steps") else []),
        *([f"  loss spikes at step(s) {', '.join(map(str, summary['loss_spikes'][:10]))}"]
          if summary.get("loss_spikes") else []),
        f"  loss {_num(summary['first_loss']):.3f} -> {_num(summary['final_loss']):.3f}"
        + (f" (held-out {summary['final_eval_loss']:.3f})" if summary["final_eval_loss"] is not None else ""),
        *([f"  held-out accuracy {summary['final_eval_accuracy']:.2%}"]
          if summary.get("final_eval_accuracy") is not None else []),
        f"  throughput {summary[rate]:,.0f} {rate.removesuffix('_per_s')}/s (median over steps)",
        f"  model FLOPs utilisation {100 * summary['mfu']:.1f}% of {summary['peak_flops'] / 1e9:,.1f} GFLOP/s "
        f"({summary['peak_flops_source']})",
        f"  peak memory {summary['mem_peak_mb']:,.0f} MiB per process (highest rank)",
    ]
    if "predicted" in summary:
        p = summary["predicted"]
        lines.append(f"  planner: predicted {p['step_time_s']:.4g} s per step and {p['mem_per_device_gb']:.3g} GB per "
                     f"device; measured {summary['step_time_s']:.4g} s "
                     f"({summary['measured_over_predicted_step_time']:.2f}"
                     "x the prediction)")
    return "\n".join(lines)


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    (run_dir / SUMMARY).write_text(dumps(strict(summary), indent=1) + "\n")
