"""OneS distillation (Xue et al. 2022, arXiv 2201.10890): a trained MoE run -> a dense student
run that learns from the MoE's logits.

Two halves. Before any worker starts (`student_for`, then `write_student`, one process): the teacher's
newest checkpoint is read under whatever plan wrote it (the trainer's own checkpoint loading, which
reshards), its experts are gathered into one dense FFN per layer (shoal.experiments.ones.gather), and
the student's starting weights are written to its run folder as a safetensors file that the run's
`init` reads, each rank taking its slices as for any pretrained start. Then the workers train the
student as `shoal train` trains any dense model, under any plan, with the task `DistillTask`: the
knowledge-distillation loss (shoal.experiments.ones.kd) against the teacher's logits; the teacher
runs forward only, whole, in evaluation mode, on each rank's own slice of every batch. The
student's run folder is a normal run folder (metrics.jsonl, checkpoints, plot, summary), plus
distill.json, which `shoal distill --resume` reads to continue it. `shoal distill` (shoal.cli.distill)
and `distill` here, its Python entry, run these steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from shoal.apply_plan import parallelize
from shoal.data.text import open_data
from shoal.experiments.ones.gather import check_fits, default_k, student_config, student_weights
from shoal.experiments.ones.kd import DistillConfig, kd_loss, pack_targets
from shoal.infra.launch import resolve_device
from shoal.loss import LossFn
from shoal.models import ModelConfig, ModelShape, Transformer
from shoal.moe.layer import MoELayer
from shoal.runtime import Runtime
from shoal.train.checkpoint import checkpoint_dir, good_checkpoint, load_checkpoint
from shoal.train.config import RunConfig, from_flat, resolve_model
from shoal.train.job import CONFIG_FILE, Job, check_fresh_out, default_run_dir, read_run_config
from shoal.train.preempt import STOPPED
from shoal.train.task import Task, TrainerView, task_for
from shoal.train.worker import run_job

DISTILL_FILE = "distill.json"
"""The distillation settings in a student's run folder (`--resume` reads them)."""
STUDENT_INIT = "student_init.safetensors"
"""The gathered starting weights in a student's run folder."""
USAGE_BATCHES = 4
"""Training batches the teacher routes to measure its experts' usage (top-experts gathering)."""


def load_teacher(checkpoint: str | Path, model: ModelConfig, device: torch.device | None = None) -> Runtime:
    """The teacher whole in this process (no parallelism), from a checkpoint written under any plan,
    in evaluation mode. Collective when a process group exists (DCP reads on every rank)."""
    with torch.device("meta"):
        module = Transformer(model)
    teacher = parallelize(module)
    load_checkpoint(checkpoint, runtime=teacher, optimizer=None)
    if device is not None:
        module.to(device)
    return teacher.eval()


def router_usage(teacher: Runtime, cfg: RunConfig, batches: int = USAGE_BATCHES) -> dict[str, torch.Tensor]:
    """Per MoE layer (by index), each expert's share of the token assignments the teacher's router
    kept over the first `batches` training batches of `cfg`'s data."""
    data = open_data(cfg.data, seq_len=cfg.loop.seq_len, seed=cfg.loop.seed, held_out=False)  # training batches
    layers = {name.split(".")[1]: m for name, m in teacher.parts[0].named_modules() if isinstance(m, MoELayer)}
    kept = {layer: torch.zeros(m.num_experts, dtype=torch.float64) for layer, m in layers.items()}
    with torch.no_grad():
        for step in range(batches):
            inputs, _ = data.train.batch(step, cfg.loop.global_batch)
            teacher(inputs)
            for layer, m in layers.items():
                kept[layer] += m.stats["tokens_per_expert"].double().cpu()
    return {layer: counts / counts.sum().clamp(min=1) for layer, counts in kept.items()}


def write_student_init(teacher: Runtime, cfg: RunConfig, spec: DistillConfig, out: Path) -> Path:
    """Gather the teacher's experts into the student's starting weights; write them to `out`."""
    usage = router_usage(teacher, cfg) if spec.gather == "top-experts" else None
    full = {name: tensor.detach().cpu() for name, tensor in teacher.full_weights().items()}
    weights = student_weights(full, spec.gather, k=spec.gather_k, usage=usage)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out), metadata={"format": "pt"})
    return out


def write_student(run_dir: Path, cfg: RunConfig, spec: DistillConfig, teacher: ModelConfig) -> None:
    """Create the student's run folder with its settings (distill.json) and, unless it starts from
    its seed, its gathered starting weights at `cfg.init`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.init is not None:
        write_student_init(load_teacher(spec.checkpoint, teacher), cfg, spec, Path(cfg.init))
    (run_dir / DISTILL_FILE).write_text(json.dumps(dataclasses.asdict(spec), indent=2) + "\n")


def read_distill_config(run_dir: str | Path) -> DistillConfig:
    """The distillation settings of a student's run folder."""
    path = Path(run_dir) / DISTILL_FILE
    if not path.is_file():
        raise ValueError(f"{str(run_dir)!r} is not a shoal distill run folder: it has no {DISTILL_FILE}")
    return DistillConfig(**json.loads(path.read_text()))


TEACHER_VALID = "the --out folder of a shoal train run of an MoE model, once it has written a checkpoint"
"""What --teacher takes, for its refusals."""


def teacher_config(teacher_dir: Path) -> tuple[RunConfig, ModelConfig]:
    """The teacher run's config and its model shape (ValueError if it is no run folder of a transformer)."""
    if not teacher_dir.is_dir():
        what = "is a file, not a run folder" if teacher_dir.exists() else "no such run folder"
        raise ValueError(f"--teacher {str(teacher_dir)!r}: {what}; valid: {TEACHER_VALID}")
    if not (teacher_dir / CONFIG_FILE).is_file():
        raise ValueError(f"--teacher {str(teacher_dir)!r} is not a shoal run folder: it has no {CONFIG_FILE}; valid: "
                         f"{TEACHER_VALID}")
    cfg = read_run_config(teacher_dir)
    return cfg, _text_model(resolve_model(cfg), teacher_dir)


def teacher_checkpoint(teacher_dir: Path) -> Path:
    """The teacher run's newest checkpoint that verifies; a one-line ValueError when it holds none, saying
    whether one is still being written (a teacher that is still training before its first checkpoint)."""
    try:
        return good_checkpoint(teacher_dir)
    except ValueError as exc:
        writing = any(".tmp-" in p.name for p in checkpoint_dir(teacher_dir).glob("step_*"))
        still = " (a checkpoint is still being written: the run is training, or stopped while saving)" \
            if writing else ""
        raise ValueError(f"--teacher: {exc}{still}; valid: {TEACHER_VALID}") from None


def _text_model(model: ModelShape, teacher_dir: Path) -> ModelConfig:
    if not isinstance(model, ModelConfig):
        raise ValueError(f"--teacher {str(teacher_dir)!r} trained {task_for(model).noun}; valid: a run of an MoE "
                         "transformer (OneS distils its experts into a dense language model)")
    return model


def student_run_config(teacher_cfg: RunConfig, student: ModelConfig, flags: dict[str, Any]) -> RunConfig:
    """The student's run config: the teacher's data and sequence length unless the flags say
    otherwise, the trainer's defaults for the rest, the gathered weights as `init`."""
    base = RunConfig(model=f"dense student of {teacher_cfg.model}", data=teacher_cfg.data,
                     loop=dataclasses.replace(RunConfig().loop, seq_len=teacher_cfg.loop.seq_len))
    cfg = from_flat(flags, base)
    return dataclasses.replace(cfg, model_config=student, set=())


@dataclass(frozen=True, kw_only=True)
class Student:
    """A distillation as it is checked before anything is written: the student's run, its settings, its teacher."""

    config: RunConfig
    """The student's run config (`init`: its gathered start in its run folder, unless --gather none)."""
    run_dir: Path
    spec: DistillConfig
    teacher: ModelConfig
    """The teacher's shape."""


def student_for(teacher: str | Path, *, gather: str = "svd", gather_k: int | None = None, temperature: float = 1.0,
                alpha: float = 0.5, student_set: Sequence[str] = (), flags: dict[str, Any] | None = None) -> Student:
    """The student of the MoE run in folder `teacher`, checked (a one-line ValueError; nothing written): its
    shape (the teacher's, each MoE layer one dense FFN, then `student_set`), the gathering and the loss, and its
    run config from `shoal train`'s `flags` by their config keys (out="runs/s", steps=100, plan="fsdp2")."""
    teacher_run, teacher_model = teacher_config(Path(teacher))
    student = student_config(teacher_model, student_set)
    check_fits(teacher_model, student, gather, gather_k)
    checkpoint = teacher_checkpoint(Path(teacher))
    k = gather_k if gather_k is not None else default_k(gather, teacher_model)
    spec = DistillConfig(teacher=str(teacher), checkpoint=str(checkpoint), gather=gather, gather_k=k,
                         temperature=temperature, alpha=alpha)
    cfg = student_run_config(teacher_run, student, flags or {})
    run_dir = Path(cfg.out if cfg.out is not None else default_run_dir())
    if gather != "none":
        cfg = dataclasses.replace(cfg, init=str(run_dir / STUDENT_INIT))
    return Student(config=cfg, run_dir=run_dir, spec=spec, teacher=teacher_model)


def distill(teacher: str | Path, *, out: str | Path, gather: str = "svd", gather_k: int | None = None,
            kd_temperature: float = 1.0, kd_alpha: float = 0.5, student_set: Sequence[str] = (),
            **train_flags: Any) -> int:
    """`shoal distill` from Python: the student checked and written, then trained on its workers (as `shoal
    train` starts them: shoal.train.worker.run_job). `train_flags` are `shoal train`'s flags by their config keys
    (steps=100, plan="fsdp2", nproc=2, global_batch=8). Returns 0, or shoal.train.preempt.STOPPED when a signal
    stopped the run after a checkpoint; a mistake is a one-line ValueError (found before anything is written,
    or by the workers)."""
    student = student_for(teacher, gather=gather, gather_k=gather_k, temperature=kd_temperature, alpha=kd_alpha,
                          student_set=student_set, flags={**train_flags, "out": str(out)})
    device = resolve_device(student.config.device)
    check_fresh_out(student.run_dir)
    if os.environ.get("RANK", "0") == "0":  # under torchrun: rank 0 writes, the workers wait for it (prepare)
        write_student(student.run_dir, student.config, student.spec, student.teacher)
    job = Job(config=student.config, run_dir=str(student.run_dir), device=device, task=DistillTask(student.spec))
    result = run_job(job)
    if "error" in result:
        raise ValueError(result["error"])
    return STOPPED if "stopped" in result else 0


class DistillTask(Task):
    """The text task of a dense student: the distillation loss against a teacher that runs beside it, on each
    rank, whole. Carried by the student's Job (the student is a plain ModelConfig, whose own task is text)."""

    command = "distill"

    def __init__(self, spec: DistillConfig) -> None:
        self.spec = spec
        self.teacher: Runtime | None = None
        """The teacher on this rank's device, once the trainer is built (`attach`); a Job carries none."""
        self.teacher_model: ModelConfig | None = None
        """The teacher's shape, read from its checkpoint (`attach`)."""

    def prepare(self) -> None:
        if dist.is_initialized():  # under torchrun rank 0 wrote the student's start as it joined: wait for it
            dist.barrier()

    def attach(self, trainer: TrainerView) -> None:
        checkpoint = Path(self.spec.checkpoint)
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        self.teacher_model = _text_model(resolve_model(from_flat(state["config"])), checkpoint)
        self.teacher = load_teacher(self.spec.checkpoint, self.teacher_model, trainer.device)

    def loss_fn(self) -> LossFn | None:
        return kd_loss(self.spec.temperature, self.spec.alpha)

    def step_targets(self, trainer: TrainerView, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The targets with the teacher's logits packed in, computed micro-batch by micro-batch."""
        assert self.teacher is not None, "attach loads the teacher before the first step"
        with torch.no_grad():
            logits = torch.cat([self.teacher(x) for x in inputs.chunk(trainer.num_micro)])
        return pack_targets(targets, logits)

    def notes(self, trainer: TrainerView) -> list[str]:
        t, spec = self.teacher_model, self.spec
        assert t is not None, "attach reads the teacher's shape"
        gathered = "random initialisation (--gather none)" if spec.gather == "none" else \
            f"its experts gathered by {spec.gather}" + (f" (k={spec.gather_k})" if spec.gather_k else "")
        return [f"teacher: {spec.checkpoint} ({t.num_params() / 1e6:.2f}M parameters, {t.num_experts} experts, "
                f"top-{t.top_k}), whole on every rank; student from {gathered}; loss {spec.alpha:g} x T^2 KL + "
                f"{1 - spec.alpha:g} x CE at T={spec.temperature:g}"]
