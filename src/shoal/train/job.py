"""A training run as the launcher hands it to each worker (`Job`), and its run folder's name and
config file: what `shoal train`, `--resume` and `shoal sample` share."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from shoal.models import AnyConfig
from shoal.train.config import RunConfig, dump_toml, from_flat, load_toml, to_flat
from shoal.train.kd import DistillConfig

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
    distill: DistillConfig | None = None
    """`shoal distill`: the teacher and the distillation loss (shoal.train.distill); None: train."""


def with_model(cfg: RunConfig, model: AnyConfig) -> RunConfig:
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
