"""One rank's set-up for training: the plan resolved and checked, the model built and
parallelized, its pretrained weights, and where a resumed or restarted run continues from.
`shoal.train.loop.Trainer` is made of these pieces and of its task's data (shoal.train.task)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from shoal import rules
from shoal.apply_plan import parallelize
from shoal.infra import faults
from shoal.infra.world import broadcast_from_rank0
from shoal.mesh import build_mesh
from shoal.models import ModelConfig, ModelShape, build_model
from shoal.models.lora import BaseWeights, apply_lora
from shoal.models.lora_config import LoRAConfig, check_plan
from shoal.models.safetensors_io import Pretrained, content_digest, open_pretrained
from shoal.optim.schedule import WarmupCosine
from shoal.plan import Plan
from shoal.runtime import Runtime
from shoal.train.checkpoint import latest_checkpoint, load_checkpoint, newest_good_checkpoint, read_trainer_state
from shoal.train.config import RunConfig, parse_plan
from shoal.train.task import task_for


def restart_count() -> int:
    """How many times the launcher (`--max-restarts`, torchrun's too) has restarted this run's workers."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def set_matmul_precision(device: torch.device, *, tf32: bool) -> None:
    """On GPUs: float32 matmuls on TF32 tensor cores ("high") or in full float32 ("highest").
    CPUs keep torch's default, so that CPU runs stay exact against their references."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if tf32 else "highest")


def resolve_plan(cfg: RunConfig, model: ModelShape, world: int, device: torch.device) -> tuple[Plan, list[str]]:
    """The config's plan for this world size and device, checked against the model and the batch
    (shoal.rules), and the notes on the options it chose where the plan left them out."""
    return rules.resolve_noting(parse_plan(cfg.plan), rules.RunFacts(
        world_size=world, device=device.type, model=model, global_batch=cfg.loop.global_batch,
        seq_len=cfg.loop.seq_len, micro_batch=cfg.loop.micro_batch))


def build_runtime(model_cfg: ModelShape, plan: Plan, device: torch.device, *, seed: int,
                  weights: Pretrained | None = None, lora: str | None = None,
                  adapters: dict[str, torch.Tensor] | None = None) -> Runtime:
    """The model parallelized by `plan`: built on the meta device (shapes only), each rank then
    allocating and initialising its own shards, the same full weights under every plan (the
    seed's, or pretrained `weights`, each rank reading its slices). With `lora` (settings as
    --lora takes them) the base is frozen and low-rank adapters train (shoal.models.lora), from
    `adapters` (full tensors by name: a peft folder's, shoal.train.peft_io) when given."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = build_model(model_cfg)
    source: Pretrained | BaseWeights | None = weights
    if lora is not None:
        settings = LoRAConfig.parse(lora)
        check_plan(settings, tp=plan.tp, cp=plan.cp)
        apply_lora(model, settings, seed=seed)
        source = BaseWeights(weights, adapters) if weights is not None or adapters else None
    faults.arm(model)  # test-only hooks; nothing unless SHOAL_FAULT is set
    try:
        return parallelize(model, plan, build_mesh(plan, device.type), seed=seed, weights=source)
    finally:
        if weights is not None:
            weights.close()


def pretrained_weights(cfg: RunConfig, model_cfg: ModelShape, checkpoint: Path | None) -> Pretrained | None:
    """The run's --init weights (headers checked), unless it continues from a checkpoint that holds every weight
    (a LoRA run's holds its adapters only: the frozen base is read from --init again)."""
    if cfg.init is None or (checkpoint is not None and cfg.lora is None):
        return None
    if not isinstance(model_cfg, ModelConfig):
        raise ValueError(task_for(model_cfg).message("init"))
    return open_pretrained(cfg.init, model_cfg, ignore=cfg.init_ignore)


def lora_base(cfg: RunConfig, seed: int) -> dict[str, Any] | None:
    """What a LoRA run's frozen base is, as its checkpoints record it: --init's path and the sha256 of its
    files' bytes, or the seed its weights are drawn from; None for a run that trains every weight."""
    if cfg.lora is None:
        return None
    if cfg.init is None:
        return {"seed": seed}
    return {"init": cfg.init, "sha256": content_digest(cfg.init)}


def adapted_model(model_cfg: ModelConfig, lora: str, base: dict[str, Any] | None) -> torch.nn.Module:
    """One process's model of a LoRA run, for reading its checkpoints (shoal sample, shoal export --hf): the
    frozen base rebuilt from its source as `lora_base` recorded it (--init's files, their content hash checked,
    or the seed), with adapters at their initial values, which a checkpoint then replaces."""
    base = base or {"seed": 0}
    if "init" in base and content_digest(base["init"]) != base["sha256"]:
        raise ValueError(f"the base --init {base['init']} has changed since the run (its sha256 is not "
                         f"{base['sha256'][:12]}); valid: the base the run trained on, unchanged")
    seed = int(base.get("seed", 0))
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = build_model(model_cfg)
    apply_lora(model, LoRAConfig.parse(lora), seed=seed)
    weights = BaseWeights(open_pretrained(base["init"], model_cfg)) if "init" in base else None
    parallelize(model, seed=seed, weights=weights)  # one process: materialized with the base's values
    return model


def check_same_base(path: Path, base: dict[str, Any] | None) -> None:
    """A one-line ValueError where checkpoint `path` holds adapters trained on another base than `base`."""
    saved = read_trainer_state(path).get("lora_base")
    if saved == base:
        return

    def said(ref: dict[str, Any] | None) -> str:
        if ref is None:
            return "none (every weight trained)"
        return f"--init {ref['init']} (sha256 {ref['sha256'][:12]})" if "init" in ref else f"the seed {ref['seed']}'s"

    raise ValueError(f"checkpoint {path.name} holds low-rank adapters of the base {said(saved)}, and the base is now "
                     f"{said(base)}; valid: the base the run started from, unchanged")


def checkpoint_to_continue(run_dir: Path, *, restart: int, resume: bool, resume_from: str | None,
                           rank: int) -> Path | None:
    """Where this run continues from: after a restart, the newest checkpoint that verifies (if
    any); on --resume, the one the launcher chose or the latest; otherwise None (a fresh start)."""
    if restart:
        return broadcast_from_rank0(newest_good_checkpoint(run_dir)[0] if rank == 0 else None)
    if not resume:
        return None
    path = Path(resume_from) if resume_from else latest_checkpoint(run_dir)
    if path is None:
        raise ValueError(f"run folder {str(run_dir)!r} holds no checkpoint to resume from")
    return path


def restore(path: Path, runtime: Runtime, optimizer: torch.optim.Optimizer, scheduler: WarmupCosine) -> int:
    """Load the checkpoint at `path` into the runtime, optimizer, scheduler and fp16's loss scale
    (the scale it had reached); returns the step it was saved after."""
    state = load_checkpoint(path, runtime=runtime, optimizer=optimizer)
    scheduler.restore(state["scheduler"])
    scaler = runtime.loss_scaler
    if scaler is not None and "loss_scaler" in state:
        scaler.load_state_dict(state["loss_scaler"])
    return int(state["step"])
