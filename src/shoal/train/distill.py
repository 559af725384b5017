"""OneS distillation (Xue et al. 2022, arXiv 2201.10890): a trained MoE run -> a dense student
run that learns from the MoE's logits.

Two halves. Before any worker starts (`prepare_student`, one process): the teacher's newest
checkpoint is read under whatever plan wrote it (the trainer's own checkpoint loading, which
reshards), its experts are gathered into one dense FFN per layer (shoal.moe.gather), and the
student's starting weights are written to its run folder as a safetensors file that the run's
`init` reads, each rank taking its slices as for any pretrained start. Then the workers
(`DistillTrainer`) train the student as `shoal train` trains any dense model, under any plan,
with the knowledge-distillation loss (shoal.train.kd) against the teacher's logits; the teacher
runs forward only, whole, in evaluation mode, on each rank's own slice of every batch. The
student's run folder is a normal run folder (metrics.jsonl, checkpoints, plot, summary), plus
distill.json, which `shoal distill --resume` reads to continue it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from shoal.apply_plan import parallelize
from shoal.data.text import open_data
from shoal.models import ModelConfig, Transformer
from shoal.models.mixer_config import MixerConfig
from shoal.moe.gather import student_weights
from shoal.moe.layer import MoELayer
from shoal.runtime import Runtime
from shoal.train.checkpoint import load_checkpoint
from shoal.train.config import RunConfig, from_flat, resolve_model
from shoal.train.job import Job
from shoal.train.kd import DistillConfig, kd_loss, pack_targets
from shoal.train.loop import Trainer

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


def teacher_config(teacher_dir: Path) -> tuple[RunConfig, ModelConfig]:
    """The teacher run's config and its model shape (ValueError if it is no run folder)."""
    from shoal.train.job import read_run_config

    if not teacher_dir.is_dir():
        raise ValueError(f"--teacher {str(teacher_dir)!r}: no such run folder")
    cfg = read_run_config(teacher_dir)
    return cfg, _text_model(resolve_model(cfg), teacher_dir)


def _text_model(model: ModelConfig | MixerConfig, teacher_dir: Path) -> ModelConfig:
    if isinstance(model, MixerConfig):
        raise ValueError(f"--teacher {str(teacher_dir)!r} trained an image Mixer; valid: a run of an MoE "
                         "transformer (OneS distils its experts into a dense language model)")
    return model


def student_run_config(teacher_cfg: RunConfig, student: ModelConfig, flags: dict[str, Any]) -> RunConfig:
    """The student's run config: the teacher's data and sequence length unless the flags say
    otherwise, the trainer's defaults for the rest, the gathered weights as `init`."""
    base = RunConfig(model=f"dense student of {teacher_cfg.model}", data=teacher_cfg.data,
                     loop=dataclasses.replace(RunConfig().loop, seq_len=teacher_cfg.loop.seq_len))
    cfg = from_flat(flags, base)
    return dataclasses.replace(cfg, model_config=student, set=())


def distill(teacher: str | Path, *, out: str | Path, gather: str = "svd", gather_k: int | None = None,
            kd_temperature: float = 1.0, kd_alpha: float = 0.5, student_set: Sequence[str] = (),
            **train_flags: Any) -> int:
    """`shoal distill` from Python: the same checks, run folder and workers; returns the exit
    status (2 with one printed line for a mistake). `train_flags` are `shoal train`'s flags by
    their config keys (steps=100, plan="fsdp2", nproc=2, global_batch=8)."""
    from shoal import cli

    argv = ["distill", "--teacher", str(teacher), "--out", str(out), "--gather", gather,
            "--kd-temperature", str(kd_temperature), "--kd-alpha", str(kd_alpha)]
    argv += ["--gather-k", str(gather_k)] if gather_k is not None else []
    for pair in student_set:
        argv += ["--set", pair]
    for key, value in train_flags.items():
        argv += [f"--{key.replace('_', '-')}", "on" if value is True else "off" if value is False else str(value)]
    return cli.main(argv)


class DistillTrainer(Trainer):
    """A Trainer whose loss is the distillation loss against a teacher that runs beside it."""

    command = "distill"

    def __init__(self, job: Job, device: torch.device) -> None:
        assert job.distill is not None
        if dist.is_initialized():  # under torchrun rank 0 wrote the student's start as it joined: wait for it
            dist.barrier()
        super().__init__(job, device)
        self.spec = job.distill
        checkpoint = Path(self.spec.checkpoint)
        teacher_cfg = _text_model(resolve_model(from_flat(json.loads((checkpoint / "trainer_state.json")
                                                                     .read_text())["config"])), checkpoint)
        self.teacher = load_teacher(self.spec.checkpoint, teacher_cfg, device)
        self.teacher_model = teacher_cfg
        self.loss_fn = kd_loss(self.spec.temperature, self.spec.alpha)

    def step_targets(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The targets with the teacher's logits packed in, computed micro-batch by micro-batch."""
        with torch.no_grad():
            logits = torch.cat([self.teacher(x) for x in inputs.chunk(self.num_micro)])
        return pack_targets(targets, logits)

    def _describe(self) -> str:
        t = self.teacher_model
        gathered = "random initialisation (--gather none)" if self.spec.gather == "none" else \
            f"its experts gathered by {self.spec.gather}" + (f" (k={self.spec.gather_k})" if self.spec.gather_k else "")
        return (super()._describe() + f"\nteacher: {self.spec.checkpoint} ({t.num_params() / 1e6:.2f}M parameters, "
                f"{t.num_experts} experts, top-{t.top_k}), whole on every rank; student from {gathered}; "
                f"loss {self.spec.alpha:g} x T^2 KL + {1 - self.spec.alpha:g} x CE at T={self.spec.temperature:g}")
