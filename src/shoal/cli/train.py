"""`shoal train`: the user's flags and config file checked and resolved into the Job the workers run
(shoal.train.worker), all in the parent process before any worker starts, then the workers launched.
A mistake is a UserError (one line, exit 2, nothing written; shoal.cli prints it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from shoal import rules
from shoal.calibration.auto_plan import choose, memory_cluster
from shoal.cli.errors import RUN_FAILED, USER_ERROR, UserError, fail, warn
from shoal.cli.parser import on_off
from shoal.infra.launch import Stopped, WorkerFailed, resolve_device, under_torchrun
from shoal.models import ModelConfig, build_model
from shoal.models.lora_config import LoRAConfig
from shoal.planner.estimate import Workload
from shoal.planner.fit import memory_refusal
from shoal.rules import DEVICE_DEFAULTS

# (flag, type, help); the key in the run config is the flag without dashes, '-' -> '_'.
TRAIN_FLAGS: list[tuple[str, Any, str]] = [
    ("--model", str, "preset (tiny, tiny-gpt, small, gpt3-1.3b..gpt3-175b, llama3-8b/70b/405b, bert-large; "
     "tiny-moe, mixtral-8x7b{experiments}) or hf:<dir or config.json> [tiny]"),
    ("--plan", str, "parallel plan: dpN, fsdpN, tpN, cpN, ppN, epN and options, e.g. fsdp2,tp2,zero=1 (see README), "
     "or auto: the planner's fastest plan for this world [dp over all processes]"),
    ("--nproc", int, "local worker processes to start; ignored under torchrun [one per GPU; 2 on CPU]"),
    ("--device", str, "cuda (one GPU per process, NCCL), cpu (gloo) or auto [auto: cuda when there are GPUs]"),
    ("--steps", int, "total optimizer steps of the run [300]"),
    ("--global-batch", int, "sequences per optimizer step, whatever the plan [16]"),
    ("--micro-batch", int, "sequences per forward per data rank; accumulation = B/(data ranks*M) [B/data ranks]"),
    ("--seq-len", int, "tokens per sequence [128]"),
    ("--lr", float, "peak learning rate [3e-3]"),
    ("--min-lr", float, "floor of the cosine decay [lr/10]"),
    ("--warmup-steps", int, "linear warm-up steps [10%% of decay steps]"),
    ("--decay-steps", int, "step where the cosine reaches min-lr [--steps]"),
    ("--weight-decay", float, "AdamW weight decay on matrices [0.1]"),
    ("--grad-clip", float, "clip the gradient norm to this; 0: off [1.0]"),
    ("--optimizer", str, "adamw, lamb, lars (over momentum SGD), cowclip (embedding-row clipping over AdamW) or muon "
     "(orthogonalised momentum on hidden matrices, AdamW on the rest); each takes whole parameters under every "
     "sharding [adamw]"),
    ("--momentum", float, "LARS: SGD momentum [0.9]"),
    ("--lars-eta", float, "LARS: trust coefficient eta [1e-3]"),
    ("--adapt-vectors", on_off, "LAMB/LARS: trust ratios and weight decay on biases and norm weights too [off]"),
    ("--per-expert", on_off, "LAMB/LARS: one trust ratio per expert of a stacked MoE weight [on]"),
    ("--cowclip-ratio", float, "CowClip: r in clip = r * count * max(||w_id||, r * sqrt(d) * zeta) [1.0]"),
    ("--cowclip-zeta", float, "CowClip: zeta, the lower bound of a row's clip [1e-5]"),
    ("--embed-lr", float, "CowClip: the embedding tables' peak lr, not batch-scaled [lr]"),
    ("--embed-weight-decay", float, "CowClip: the embedding tables' L2 decay, scaled linearly with the batch [0]"),
    ("--muon-momentum", float, "Muon: momentum of the hidden matrices [0.95]"),
    ("--muon-nesterov", on_off, "Muon: Nesterov momentum [on]"),
    ("--muon-ns-steps", int, "Muon: Newton-Schulz iterations [5]"),
    ("--muon-adjust-lr", str, "Muon: match_rms_adamw (lr and weight decay as AdamW's) or original (lr ~0.02) "
     "[match_rms_adamw]"),
    ("--muon-adamw-lr", float, "Muon: peak lr of what AdamW takes (embeddings, head, norms, biases) [lr]"),
    ("--muon-adamw", str, "Muon: comma-separated parameter-name fragments AdamW takes instead, e.g. router [none]"),
    ("--muon-gather", str, "Muon: owner (each sharded matrix orthogonalised on one rank) or naive [owner]"),
    ("--lr-scaling", str, "none, linear or sqrt: scale lr (and min-lr) from --base-batch to --global-batch; "
     "explicit warm-up steps keep their number of sequences [none]"),
    ("--base-batch", int, "the global batch the lr and warm-up were set for (with --lr-scaling) [none]"),
    ("--lora", str, "train low-rank adapters on a frozen base: r=16,alpha=32,dropout=0.05,targets=q,k,v,o,gate,up,"
     "down (any keys left out take these values; dropout must be 0 under tp or cp) [off: every weight trains]"),
    ("--seed", int, "seed of weights, data order and dropout [0]"),
    ("--out", str, "run folder [runs/<timestamp>]"),
    ("--ckpt-every", int, "checkpoint every K steps, and at the end [100]"),
    ("--final-ckpt", on_off, "checkpoint at the end; off: nothing to resume from (for benchmarks) [on]"),
    ("--keep", int, "keep only the K most recent checkpoints; 0: all [0]"),
    ("--eval-every", int, "held-out loss every K steps, and at the end [50]"),
    ("--eval-batches", int, "global batches per held-out evaluation [4]"),
    ("--hang-timeout", float, "seconds a collective may wait once steps run before the run stops naming the "
     "ranks that stopped answering; 0: auto, 10x the slowest step, at least 30 [0]"),
    ("--max-restarts", int, "restart the workers this many times after a failure, from the newest good "
     "checkpoint; under torchrun use torchrun's --max-restarts [0]"),
    ("--log-every", int, "read loss and memory from the device every K steps (one sync per K) [10]"),
    ("--on-nonfinite", str, "a step whose loss or gradient is NaN/inf is never applied; stop: stop at the next log "
     "step (exit 1) naming it and the newest checkpoint; skip: skip and count such steps [stop]"),
    ("--max-bad-steps", int, "--on-nonfinite skip: stop after K non-finite steps in a row [10]"),
    ("--tf32", on_off, "fp32 matmuls on TF32 tensor cores on GPUs that have them [on]"),
    ("--memory-check", on_off, "refuse before start a plan predicted not to fit this machine's memory, naming "
     "plans that fit; --no-memory-check: off [on]"),
    ("--data", str, "a folder made by shoal data prepare, a mixture DIR_A:0.7,DIR_B:0.3 of them, a folder of .txt "
     "files, a .txt, .bin (uint16) or .npy token file [built-in corpus]"),
    ("--tokenizer", str, "byte, or a local Hugging Face tokenizer folder [byte; a prepared --data: its own]"),
    ("--doc-mask", on_off, "keep attention inside each document of a prepared --data, positions restarting at "
     "each (not with pp or cp) [off]"),
]


def add_parser(sub: Any) -> None:
    """Add `shoal train` to the command line's subcommands."""
    train = sub.add_parser("train", help="train a model", description="Train a model; with no flags, the "
                           "tiny preset on the built-in corpus on 2 local processes.")
    for flag, type_, help_ in TRAIN_FLAGS:
        help_ = help_.format(experiments=experiment_presets()) if flag == "--model" else help_
        train.add_argument(flag, type=type_, help=help_, default=argparse.SUPPRESS)
    train.add_argument("--set", action="append", metavar="KEY=VALUE", default=argparse.SUPPRESS,
                       help="override a model field (repeatable), e.g. --set num_layers=2 [the preset's values]")
    train.add_argument("--init", metavar="PATH", default=argparse.SUPPRESS,
                       help="start from pretrained weights: a Hugging Face folder of safetensors (Llama, Mistral, "
                       "Qwen2/3, Mixtral, GPT-2 names) or "
                       "a shoal export; each rank reads only its slices, any dtype cast to the run's; without "
                       "--model, the model is the folder's config.json [off: the seed's]")
    train.add_argument("--init-ignore", action="append", metavar="GLOB", default=argparse.SUPPRESS,
                       help="tensors --init may lack or hold in excess (glob over shoal or file names; repeatable "
                       "or comma-separated); missing ones start from the seed [none]")
    train.add_argument("--resume", metavar="DIR", help="continue this run folder from its newest checkpoint that "
                       "verifies [off: a new run]")
    train.add_argument("--config", metavar="FILE.toml", help="read flags from a TOML file (same keys) [none]")
    train.add_argument("--dry-run", dest="dry_run", action="store_const", const=True, default=argparse.SUPPRESS,
                       help="set up, run three steps on throwaway state, print each rank's memory beside the planner's "
                       "prediction, save nothing, exit [off]")
    train.add_argument("--no-memory-check", dest="memory_check", action="store_const", const=False,
                       default=argparse.SUPPRESS,
                       help="run even where the memory check predicts the plan won't fit [off: checked]")
    train.set_defaults(func=run)


def experiment_presets() -> str:
    """The presets of the families the experiments registered, for --model's help."""
    from shoal.models.adapter import families

    return "".join(f"; {family.adapter.family}: {', '.join(family.presets)}" for family in families()[1:])


def run(args: argparse.Namespace) -> int:
    return run_job(prepare_job(args))


def run_job(job: Any) -> int:
    """Run a prepared Job on its workers (or this torchrun rank); returns the exit status."""
    from shoal.train.preempt import STOPPED
    from shoal.train.worker import run_job as run_on_workers

    try:
        result = run_on_workers(job)
    except WorkerFailed as exc:
        return fail(str(exc), RUN_FAILED, job.run_dir)
    except Stopped as exc:  # a second signal: the workers were killed
        return _stopped(exc.signal_name, job.run_dir)
    if "error" in result:
        return fail(result["error"], USER_ERROR, job.run_dir)
    if "nonfinite" in result:
        return fail(result["nonfinite"], RUN_FAILED, job.run_dir)
    return STOPPED if "stopped" in result else 0


def _stopped(signal_name: str, run_dir: str | None) -> int:
    """Exit status after a signal to this process: STOPPED when the workers wrote their stop
    checkpoint (rank 0 has printed where), else a line naming the newest checkpoint."""
    from shoal.train.checkpoint import latest_checkpoint, read_trainer_state
    from shoal.train.preempt import STOPPED

    path = latest_checkpoint(run_dir) if run_dir is not None else None
    if path is not None and read_trainer_state(path).get("stopped_by"):
        return STOPPED
    newest = f"the newest checkpoint is {path}" if path is not None else "no checkpoint was written"
    return fail(f"stopped by {signal_name} before the workers could write a checkpoint; {newest}", STOPPED, run_dir)


def prepare_job(args: argparse.Namespace) -> Any:
    """Validate everything the user gave and return the Job the workers run (ValueError if wrong)."""
    from shoal.data.text import doc_eos_id, resolve_tokenizer
    from shoal.infra import host_memory
    from shoal.train.config import from_flat, load_toml, model_of_init, resolve_model
    from shoal.train.job import Job, check_fresh_out, default_run_dir, with_model
    from shoal.train.task import task_for

    flags = {k: v for k, v in vars(args).items() if k not in ("command", "func", "config", "resume")}
    check_torchrun_flags(flags)
    if args.resume is not None and ("init" in flags or "init_ignore" in flags):
        raise UserError("--init cannot be combined with --resume: a resumed run continues from its checkpoint; "
                        "valid: --init for a new run, --resume DIR to continue one")
    guessed = None  # the warning that --init's model is a guess
    if args.resume is not None:
        cfg = resume_config(args, flags)
        run_dir: str | None = args.resume
    else:
        toml = load_toml(args.config) if args.config else {}
        cfg = from_flat(flags, from_flat(toml) if args.config else None)
        if cfg.model_config is not None and "model" in flags:  # a run's config.toml holds its resolved shape:
            cfg = dataclasses.replace(cfg, model_config=None)  # --model names another, from its preset
        elif cfg.model_config is not None and "set" in flags:  # and --set changes that shape
            cfg = dataclasses.replace(cfg, model_config=cfg.model_config.with_overrides(list(flags["set"])))
        if cfg.init is not None:  # said before any guess about its model
            from shoal.models.safetensors_io import check_exists

            check_exists(cfg.init)
        if cfg.init is not None:
            cfg = _peft_init(cfg)
        if cfg.init is not None and "model" not in flags and "model" not in toml:
            cfg = dataclasses.replace(cfg, model=model_of_init(cfg.init))
            if not cfg.model.startswith("hf:"):  # said once the weights are read: an error about them says it
                guessed = (f"--init {cfg.init} has no config.json to take the model's shape from: the model is the "
                           f"default preset {cfg.model}, whose tensors the weights must match (--model names another)")
        if cfg.init is not None:  # the run folder's config.toml records where the weights came from, from anywhere
            cfg = dataclasses.replace(cfg, init=str(Path(cfg.init).absolute()))
        cfg = dataclasses.replace(cfg, data=_absolute_paths(cfg.data))  # so that --resume works from any folder
        run_dir = cfg.out if cfg.out is not None else (None if under_torchrun() else default_run_dir())
    if args.resume is None:  # prepared data: the tokenizer is the manifest's
        cfg = dataclasses.replace(cfg, data=resolve_tokenizer(cfg.data, given="tokenizer" in flags))
    model = resolve_model(cfg)
    task = task_for(model)  # the text transformer's task, or the one its family registered
    if cfg.data.doc_mask and not isinstance(model, ModelConfig):
        raise UserError(task.message("doc_mask"))
    if cfg.data.doc_mask and args.resume is None and isinstance(model, ModelConfig):  # a resumed run has it
        model = dataclasses.replace(model, doc_eos_id=doc_eos_id(cfg.data))
    cfg = with_model(cfg, model)
    device = resolve_device(cfg.device)
    host_memory.worker_env(device)  # SHOAL_ALLOCATOR checked here, before anything starts
    prediction = None
    if args.resume is None and cfg.plan is not None and cfg.plan.strip() == "auto":
        if not isinstance(model, ModelConfig):  # the planner prices the text transformer
            raise UserError(task.message("auto_plan"))
        cfg, prediction = auto_plan(cfg, device)
    validate(cfg, device)
    if args.resume is None and cfg.init is not None:  # the files' headers only: before any worker starts
        from shoal.models.safetensors_io import WeightsMismatch, open_pretrained

        if not isinstance(model, ModelConfig):
            raise UserError(task.message("init"))
        try:
            open_pretrained(cfg.init, model, ignore=cfg.init_ignore)
        except WeightsMismatch as exc:
            if guessed is None:
                raise
            raise UserError(f"{exc} (the model is the default preset {cfg.model}: no config.json beside the "
                            "weights; --model names another)") from None
        if guessed is not None:
            warn(guessed)
    resume_from = None
    if args.resume is not None:
        resume_from = str(check_resumable(Path(args.resume), cfg.loop.steps))
    elif run_dir is not None:
        check_fresh_out(Path(run_dir))
    return Job(config=cfg, run_dir=run_dir, resume=args.resume is not None, resume_from=resume_from, device=device,
               prediction=prediction)


def check_torchrun_flags(flags: dict[str, Any]) -> None:
    """Under torchrun, refuse the flags that torchrun's own settings replace."""
    if under_torchrun() and flags.get("max_restarts"):
        raise UserError("--max-restarts under torchrun: give torchrun --max-restarts N (and shoal --out DIR), "
                        "torchrun restarts the workers")
    if under_torchrun() and "nproc" in flags and flags["nproc"] != int(os.environ["WORLD_SIZE"]):
        raise UserError(f"--nproc {flags['nproc']} but torchrun started {os.environ['WORLD_SIZE']} processes; "
                        "leave --nproc out under torchrun")


def auto_plan(cfg: Any, device: str) -> tuple[Any, dict[str, Any]]:
    """The run config with `--plan auto` replaced by the planner's choice, and its prediction."""


    if cfg.loop.micro_batch is not None:
        raise UserError(f"--micro-batch {cfg.loop.micro_batch} with --plan auto: the planner chooses the "
                        "micro-batch with the plan; valid: leave --micro-batch out, or give a --plan")
    choice = choose(cfg.model_config, global_batch=cfg.loop.global_batch, seq_len=cfg.loop.seq_len,
                    world_size=world_size(cfg, device), device=device, optimizer=cfg.optim.optimizer)
    if os.environ.get("RANK", "0") == "0":
        print(choice.describe(), flush=True)
    e = choice.estimate
    local = cfg.loop.global_batch // e.plan.data_ranks
    micro = e.micro_batch if e.plan.pp == 1 and e.micro_batch != local else None
    cfg = dataclasses.replace(cfg, plan=choice.plan_text, loop=dataclasses.replace(cfg.loop, micro_batch=micro))
    return cfg, choice.prediction()


def _absolute_paths(data: Any) -> Any:
    """The data config with --data's folders or files and a tokenizer folder made absolute (a mixture's each,
    its weights kept); a path that does not exist is left as given, to be refused in the user's own words."""
    tokenizer = data.tokenizer if data.tokenizer == "byte" else _absolute(data.tokenizer)
    return dataclasses.replace(data, path=_absolute(data.path), tokenizer=tokenizer)


def _absolute(spec: str | None) -> str | None:
    """A path, or a mixture's folders (DIR_A:0.7,DIR_B:0.3), made absolute where they exist."""
    from shoal.data.dataset import parse_mixture

    if spec is None or Path(spec).exists():
        return spec if spec is None else str(Path(spec).absolute())
    try:
        items = parse_mixture(spec)
    except ValueError:
        return spec
    if not all(Path(folder).exists() for folder, _ in items):
        return spec
    return ",".join(f"{Path(folder).absolute()}:{weight!r}" for folder, weight in items)


def world_size(cfg: Any, device: str) -> int:
    """The run's number of processes: torchrun's world, --nproc, or one per GPU (2 on CPU)."""
    from shoal.train.worker import world_size as processes

    return processes(cfg, device)


def resume_config(args: argparse.Namespace, flags: dict[str, Any]) -> Any:
    """The run folder's config with the flags a resumed run may change."""
    from shoal.train.config import RESUMABLE, from_flat, to_flat
    from shoal.train.job import read_run_config

    folder = Path(args.resume)
    if not folder.is_dir():
        raise UserError(f"--resume {args.resume!r}: no such run folder")
    if args.config:
        raise UserError("--config cannot be combined with --resume: the run folder's config.toml is the config")
    base = read_run_config(folder)
    stored = to_flat(base)
    if "out" in flags:
        if Path(flags["out"]).resolve() != folder.resolve():
            raise UserError(f"--out {flags['out']!r} cannot change when resuming: a resumed run writes on in its own "
                            f"folder {args.resume!r}; valid: leave --out out")
        flags = {k: v for k, v in flags.items() if k != "out"}
    for key, value in flags.items():
        given = list(value) if isinstance(value, tuple) else value
        if key not in RESUMABLE and _same_path(key, stored.get(key)) != _same_path(key, given):
            valid = ", ".join("--" + k.replace("_", "-") for k in RESUMABLE)
            raise UserError(f"--{key.replace('_', '-')} cannot change when resuming {args.resume!r} (it was "
                            f"{_as_typed(stored.get(key))}); flags a resumed run may change: {valid}")
    cfg = from_flat(flags, base)
    _say_a_precision_change(folder, base, cfg)
    return cfg


def _say_a_precision_change(folder: Path, stored: Any, resumed: Any) -> None:
    """A resumed run whose --plan (or device) changes its precision goes on from the same weights at another one: a
    warning, not a refusal (the flag is the user's choice), since the loss curve then moves beyond rounding."""
    from shoal.train.config import parse_plan

    try:
        device = resolve_device(resumed.device)
        before, after = (parse_plan(c.plan).precision or DEVICE_DEFAULTS[device if c.device == "auto" else c.device]
                         ["precision"] for c in (stored, resumed))
    except (ValueError, KeyError):  # prepare_job says what is wrong with the plan or the device
        return
    if before != after:
        warn(f"--resume {folder}: the run trained in {before} and goes on in {after} (its weights and optimizer state "
             f"carry over; the loss curve moves beyond rounding); valid for {before} throughout: --plan with "
             f"precision={before}")


def _same_path(key: str, value: Any) -> Any:
    """A path flag's value in the form config.toml keeps (absolute), so that the same folder compares equal."""
    if key in ("data", "tokenizer", "init") and isinstance(value, str) and value != "byte":
        return _absolute(value)
    return value


def _as_typed(value: Any) -> str:
    """A stored config value as a user types it: on/off, a list's items, 'unset'."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "unset"
    if isinstance(value, list):
        return " ".join(map(str, value)) if value else "none"
    return repr(value)


def validate(cfg: Any, device: str) -> None:
    """Model, plan, batch and data against each other, for the world the run will have on `device`: the model
    builds, its task's checks (shoal.train.task), the plan runs it (shoal.rules), and a text transformer's plan
    fits this machine's memory as the planner prices it."""
    import torch

    from shoal.train.config import parse_plan
    from shoal.train.task import task_for

    model, loop = cfg.model_config, cfg.loop
    world = world_size(cfg, device)
    if device == "cuda" and not under_torchrun() and world > torch.cuda.device_count():
        raise UserError(f"--nproc {world} exceeds the {torch.cuda.device_count()} GPU(s) of this machine (one "
                        f"process per GPU); valid: 1..{torch.cuda.device_count()}, or --device cpu")
    task = task_for(model)
    with torch.device("meta"):  # builds no weights: catches what the model itself refuses
        build_model(model)
    task.check_model(cfg, model)
    plan = rules.resolve(parse_plan(cfg.plan), world_size=world, device=device, model=model,
                         global_batch=loop.global_batch, seq_len=task.sequence_length(loop),
                         micro_batch=loop.micro_batch)
    if cfg.lora is not None:
        _check_lora(cfg.lora, model, plan)
    if isinstance(model, ModelConfig):  # the planner prices the text transformer
        _check_memory(cfg, plan, device)
    task.check_data(cfg, model)


def _peft_init(cfg: Any) -> Any:
    """--init of a peft adapter folder: the run trains those adapters (their settings, unless --lora gives
    others) on the base the folder names, which becomes --init."""
    from shoal.train.peft_io import is_peft_folder, read_peft_config

    if not is_peft_folder(cfg.init):
        return cfg
    lora, base = read_peft_config(cfg.init)
    return dataclasses.replace(cfg, init=base, lora_init=str(Path(cfg.init).absolute()),
                               lora=cfg.lora if cfg.lora is not None else lora.text())


def _check_lora(text: str, model: Any, plan: Any) -> None:
    """--lora's adapters against the model (shoal's Transformer, targets it has) and the plan (no dropout
    under tp or cp), one line each."""
    from shoal.models.lora_config import check_model, check_plan

    if not isinstance(model, ModelConfig):
        raise UserError(f"--lora adapts shoal's Transformer (a preset or an hf: model); {type(model).__name__} "
                        "is another family's shape")
    lora = LoRAConfig.parse(text)
    check_model(lora, model)
    check_plan(lora, tp=plan.tp, cp=plan.cp)


def _check_memory(cfg: Any, plan: Any, device: str) -> None:
    """Refuse (one line) a plan the planner predicts won't fit this machine (shoal.planner.fit)."""
    if not cfg.memory_check:
        warn("--no-memory-check: the plan is not priced against this machine's memory before it starts")
        return
    cluster = memory_cluster(plan.world_size, device)
    if cluster is None:  # a GPU the planner has no spec for: nothing to price it with
        warn("this GPU has no planner spec: the plan's memory is not checked before start")
        return
    lora = LoRAConfig.parse(cfg.lora) if cfg.lora is not None else None
    work = Workload(model=cfg.model_config, global_batch=cfg.loop.global_batch, seq_len=cfg.loop.seq_len,
                    tf32=cfg.tf32, lora=lora, optimizer=cfg.optim.optimizer)
    reason = memory_refusal(plan, work, cluster, micro_batch=cfg.loop.micro_batch)
    if reason is not None:
        raise UserError(reason + " (--no-memory-check runs it anyway)")


def check_resumable(folder: Path, steps: int) -> Path:
    """The checkpoint to resume `folder` from. A corrupt newest checkpoint is skipped with a
    warning naming it and the one used instead, automatically: a preempted job restarted by a
    scheduler has nobody to answer a question, and losing the steps since the previous
    checkpoint beats not training. Under torchrun every rank decides alone, from file sizes only
    (re-reading the whole checkpoint on every rank costs too much); DCP's own errors remain."""
    from shoal.train.checkpoint import TRAINER_STATE, good_checkpoint, latest_checkpoint, read_trainer_state

    if under_torchrun():
        path = latest_checkpoint(folder)
        if path is None:
            raise UserError(f"--resume {str(folder)!r}: the run folder holds no complete checkpoint to resume from")
        state = read_trainer_state(path)  # sizes and the trainer state's checksum
    else:
        path = good_checkpoint(folder)  # every file's checksum
        state = read_trainer_state(path)
    try:
        done = int(state["step"])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"checkpoint {path} is not a shoal train checkpoint: its {TRAINER_STATE} has no step") from None
    if done >= steps:
        raise UserError(f"--steps {steps}: the run in {str(folder)!r} is already at step {done}; "
                        f"give a larger --steps to continue it")
    return path
