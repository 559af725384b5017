"""`shoal distill`: a trained MoE run distilled into a dense student (OneS, arXiv 2201.10890: the experiment
shoal.experiments.ones), its command line on top of `shoal train`'s (shoal.cli.train): the student is a normal
run, trained by the same workers.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from shoal.cli.errors import UserError
from shoal.cli.train import (
    TRAIN_FLAGS,
    auto_plan,
    check_resumable,
    check_torchrun_flags,
    resume_config,
    run_job,
    validate,
)


def add_parser(sub: Any) -> None:
    """Add `shoal distill` to the command line's subcommands."""
    distill = sub.add_parser("distill", help="distil a trained MoE run into a dense student (OneS)",
                             description="OneS (arXiv 2201.10890): gather each MoE layer's experts of a trained "
                             "run into one dense FFN, then train that dense student by knowledge distillation from "
                             "the MoE's logits, under any dense plan. The student's run folder is a normal run folder.")
    distill.add_argument("--teacher", metavar="RUN_DIR", default=argparse.SUPPRESS,
                         help="the trained MoE run folder (its newest checkpoint "
                         "that verifies, written under any plan) (required for a new run)")
    distill.add_argument("--gather", default=argparse.SUPPRESS,
                         help="how the dense FFN starts from the experts: sum, mean, "
                         "topk (each expert's K largest-magnitude entries, summed), svd (each expert's top-r "
                         "singular components, summed), top-experts (the k experts the router uses most, averaged) "
                         "or none (random initialisation) [svd]")
    distill.add_argument("--gather-k", type=int, metavar="K", default=argparse.SUPPRESS,
                         help="topk: entries kept per expert matrix "
                         "[ceil(ffn_dim x dim / num_experts)]; svd: singular components kept per expert "
                         "[min(ffn_dim, dim) // num_experts]; top-experts: experts kept [the teacher's top_k]")
    distill.add_argument("--kd-temperature", type=float, default=argparse.SUPPRESS, metavar="T",
                         help="softmax temperature of the distillation term [1.0]")
    distill.add_argument("--kd-alpha", type=float, default=argparse.SUPPRESS, metavar="A",
                         help="loss = A x T^2 KL(teacher || student) + (1 - A) x cross-entropy on the data [0.5]")
    distill.add_argument("--set", action="append", metavar="KEY=VALUE", default=argparse.SUPPRESS,
                         help="change a field of the student (the teacher's shape with one dense FFN of the "
                         "experts' width per MoE layer); gathering refuses a shape it cannot fill [the default]")
    distill.add_argument("--resume", metavar="DIR", help="continue a student's run folder [off: a new run]")
    for flag, type_, help_ in TRAIN_FLAGS:
        if flag not in ("--model",):
            distill.add_argument(flag, type=type_, help=help_, default=argparse.SUPPRESS)
    distill.set_defaults(func=run)


_DISTILL_ONLY = ("teacher", "gather", "gather_k", "kd_temperature", "kd_alpha", "set")


def run(args: argparse.Namespace) -> int:
    return run_job(prepare_distill(args))


def prepare_distill(args: argparse.Namespace) -> Any:
    """Validate a `shoal distill` command, then write the student's starting weights and settings
    into its run folder; returns the Job the workers run (ValueError, nothing written, if wrong).
    Under torchrun every rank validates and rank 0 alone writes (the workers wait for it: see
    DistillTask.prepare); the run folder must then be named (--out), as the ranks share it."""
    from shoal.experiments.ones.distill import DistillTask, student_for, write_student
    from shoal.infra.launch import resolve_device, under_torchrun
    from shoal.train.job import Job, check_fresh_out

    flags = {k: v for k, v in vars(args).items() if k not in ("command", "func", "resume", *_DISTILL_ONLY)}
    check_torchrun_flags(flags)
    given = {k: v for k, v in vars(args).items() if k in _DISTILL_ONLY}  # the flags default to absent
    if args.resume is not None:
        return _resume_distill(args, given, flags)
    args = argparse.Namespace(**{**_DISTILL_DEFAULTS, **vars(args)})
    if args.teacher is None:
        raise UserError("--teacher RUN_DIR is required: the trained MoE run to distil (or --resume DIR)")
    if under_torchrun() and flags.get("out") is None:
        raise UserError("shoal distill under torchrun needs --out DIR: every rank must name the same run folder")
    student = student_for(args.teacher, gather=args.gather, gather_k=args.gather_k, temperature=args.kd_temperature,
                          alpha=args.kd_alpha, student_set=getattr(args, "set", []), flags=flags)
    cfg, run_dir = student.config, student.run_dir
    device = resolve_device(cfg.device)
    if cfg.plan is not None and cfg.plan.strip() == "auto":
        cfg, _ = auto_plan(cfg, device)
    validate(cfg, device)
    check_fresh_out(run_dir)
    if os.environ.get("RANK", "0") == "0":
        write_student(run_dir, cfg, student.spec, student.teacher)  # everything checked: the first write
    return Job(config=cfg, run_dir=str(run_dir), device=device, task=DistillTask(student.spec))


def _resume_distill(args: argparse.Namespace, given: dict[str, Any], flags: dict[str, Any]) -> Any:
    from shoal.experiments.ones.distill import DistillTask, read_distill_config
    from shoal.infra.launch import resolve_device
    from shoal.train.job import Job

    folder = Path(args.resume)
    if not folder.is_dir():
        raise UserError(f"--resume {args.resume!r}: no such run folder")
    spec = read_distill_config(folder)
    stored = {"teacher": spec.teacher, "gather": spec.gather, "gather_k": spec.gather_k,
              "kd_temperature": spec.temperature, "kd_alpha": spec.alpha}
    for key, value in given.items():
        same = (Path(value).resolve() == Path(spec.teacher).resolve() if key == "teacher"
                else key in stored and value == stored[key])  # --set: the student's shape is the checkpoint's
        if not same:
            was = f" (it was {stored[key]!r})" if key in stored else ""
            raise UserError(f"--{key.replace('_', '-')} cannot change when resuming {args.resume!r}{was}; its "
                            f"distill.json holds the teacher and the loss; valid: leave it out")
    cfg = resume_config(argparse.Namespace(resume=args.resume, config=None), flags)
    device = resolve_device(cfg.device)
    validate(cfg, device)
    resume_from = str(check_resumable(folder, cfg.loop.steps))
    return Job(config=cfg, run_dir=args.resume, resume=True, resume_from=resume_from, device=device,
               task=DistillTask(spec))


_DISTILL_DEFAULTS: dict[str, Any] = {"teacher": None, "gather": "svd", "gather_k": None, "kd_temperature": 1.0,
                                     "kd_alpha": 0.5}
