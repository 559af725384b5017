"""A training run as the launcher hands it to each worker (`Job`), and its run folder's name and
config file: what `shoal train`, `--resume` and `shoal sample` share, and whether a new run may take a folder."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from shoal.models import ModelShape
from shoal.train.checkpoint import latest_checkpoint
from shoal.train.config import RunConfig, dump_toml, from_flat, load_toml, to_flat
from shoal.train.task import Task

CONFIG_FILE = "config.toml"


@dataclass(frozen=True, kw_only=True)
class Job:
    """What every worker is given: a validated config with its model shape resolved."""

    config: RunConfig
    """The run config; `config.model_config` is set."""
    run_dir: str | None
    """The run folder; None: rank 0 names one runs/<timestamp> and tells the others."""
    resume: bool = False
    """Continue the run folder from its latest checkpoint."""
    resume_from: str | None = None
    """The checkpoint to continue from, when the launcher chose it (it skips corrupt ones)."""
    device: str = "cpu"
    """"cpu" (gloo) or "cuda" (one GPU per process, NCCL), as the CLI resolved `config.device`."""
    prediction: dict[str, Any] | None = None
    """The planner's prediction for the plan `--plan auto` chose; summary.json keeps it beside the
    measurement."""
    task: Task | None = None
    """The run's task (shoal.train.task), when it is not its model's own (a distillation, which changes the
    loss); pickled by reference to its class, so a worker imports the module that defines it. None: the
    model's task (`task_for`)."""


def with_model(cfg: RunConfig, model: ModelShape) -> RunConfig:
    """`cfg` with its model shape resolved (what a `Job` needs)."""
    return dataclasses.replace(cfg, model_config=model)


def default_run_dir() -> str:
    """runs/<UTC timestamp>, with a suffix if that folder exists."""
    base = Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    path, k = base, 1
    while path.exists():
        path, k = base.with_name(f"{base.name}-{k}"), k + 1
    return str(path)


def write_run_config(run_dir: Path, cfg: RunConfig) -> None:
    """Keep the resolved config in the run folder, reusable with --config elsewhere (no output folder)."""
    flat = {k: v for k, v in to_flat(cfg).items() if k != "out"}
    (run_dir / CONFIG_FILE).write_text(dump_toml(flat))


def read_run_config(run_dir: str | Path) -> RunConfig:
    """The config a run folder was trained with (its config.toml)."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{str(run_dir)!r} is not a shoal run folder: it has no {CONFIG_FILE}")
    return from_flat(load_toml(path))


def check_fresh_out(folder: Path) -> None:
    """A new run's folder holds no trained run (a one-line ValueError naming --resume otherwise)."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {str(folder)!r} is a file, not a folder")
    if folder.is_dir() and latest_checkpoint(folder) is not None:
        raise ValueError(f"--out {str(folder)!r} already holds a trained run; continue it with --resume "
                         f"{folder} or choose another --out")
