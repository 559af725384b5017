"""`shoal export`: a checkpoint's weights, whatever plan wrote them, as one safetensors file or a Hugging Face
folder."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from shoal.cli.errors import UserError
from shoal.cli.parser import run_folder


def add_parser(sub: Any) -> None:
    """Add `shoal export` to the command line's subcommands."""
    export = sub.add_parser("export", help="write a checkpoint's weights as one safetensors file or a "
                            "Hugging Face folder", description="Gather a checkpoint's weights (whatever plan wrote "
                            "it) into one safetensors file under shoal's names, or with --hf a folder that "
                            "transformers loads (AutoModelForCausalLM), with the run's tokenizer files.")
    export.add_argument("--run", required=True, metavar="DIR", help="the run folder (required)")
    export.add_argument("--step", type=int, metavar="N", help="the checkpoint of step N [the latest]")
    export.add_argument("--out", metavar="PATH",
                        help="the .safetensors file, or the folder with --hf (required but with --lora-adapter; must "
                        "not exist unless --force)")
    export.add_argument("--lora-adapter", metavar="DIR", help="write a LoRA run's adapters as a peft adapter folder "
                        "(adapter_config.json, adapter_model.safetensors) that peft's PeftModel.from_pretrained loads "
                        "onto the base model [off]")
    export.add_argument("--hf", action="store_true", help="write a folder transformers loads (model.safetensors + "
                        "config.json in the model's family, and the run's tokenizer files when it had a Hugging Face "
                        "tokenizer) [off]")
    export.add_argument("--force", action="store_true",
                        help="replace --out (or the --lora-adapter folder) if it exists [off]")
    export.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shoal.train.checkpoint import MANIFEST, checkpoint_dir, good_checkpoint, read_trainer_state
    from shoal.train.export import export_checkpoint

    if (args.out is None) == (args.lora_adapter is None):
        raise UserError("shoal export writes one thing: give --out PATH (the weights) or --lora-adapter DIR (a LoRA "
                        "run's adapters for peft), not both and not neither")
    run = run_folder(args.run)
    if args.lora_adapter is not None:
        return _lora_adapter(args, run)
    _outside_run(Path(args.out), run, checkpoint_dir(run), args)
    if Path(args.out).exists() and not args.force:
        raise UserError(f"--out {args.out!r} already exists; valid: a new path, or --force to replace it")
    if args.step is None:
        path = good_checkpoint(run)
    else:
        path = checkpoint_dir(run) / f"step_{args.step:08d}"
        if not (path / MANIFEST).is_file():
            steps = sorted(int(p.name[5:]) for p in checkpoint_dir(run).glob("step_*") if (p / MANIFEST).is_file())
            raise UserError(f"--step {args.step}: {args.run!r} has no complete checkpoint of that step; "
                            f"valid: {', '.join(map(str, steps)) or 'none'}")
    read_trainer_state(path, checksums=True)
    target = Path(args.out)
    if (target.is_dir() or args.out.endswith(("/", os.sep))) and not args.hf:  # "out/" names a folder
        raise UserError(f"--out {args.out!r} is a folder; valid: a file path (one safetensors file), or --hf to "
                        "write a Hugging Face folder")
    if args.hf and read_trainer_state(path).get("config", {}).get("lora") is not None:
        from shoal.train.peft_io import export_merged  # a LoRA run: the adapters merged into the base

        def write(source: Path, out: Any, hf: bool) -> Path:
            return export_merged(source, out)
    else:
        def write(source: Path, out: Any, hf: bool) -> Path:
            return export_checkpoint(source, out, hf=hf)
    if target.is_dir():  # --force: the new folder replaces the old whole, never merged into it
        out = _replace_folder(target, lambda staging: write(path, staging, hf=True))
    else:
        out = write(path, args.out, hf=args.hf)
    print(f"wrote {out} ({'Hugging Face folder' if args.hf else 'safetensors'}, from {path})", flush=True)
    return 0


def _lora_adapter(args: argparse.Namespace, run: Path) -> int:
    """`--lora-adapter DIR`: the latest good checkpoint's adapters as a peft adapter folder."""
    from shoal.train.checkpoint import checkpoint_dir, good_checkpoint, read_trainer_state
    from shoal.train.peft_io import export_lora_adapter

    target = Path(args.lora_adapter)
    _outside_run(target, run, checkpoint_dir(run), argparse.Namespace(**{**vars(args), "out": args.lora_adapter}))
    if target.exists() and not (args.force and target.is_dir()):
        raise UserError(f"--lora-adapter {args.lora_adapter!r} already exists; valid: a new folder, or --force to "
                        "replace a folder")
    path = good_checkpoint(run) if args.step is None else checkpoint_dir(run) / f"step_{args.step:08d}"
    read_trainer_state(path, checksums=True)
    if target.exists():  # --force: the new folder replaces the old whole, never merged into it
        out = _replace_folder(target, lambda staging: export_lora_adapter(path, staging))
    else:
        out = export_lora_adapter(path, target)
    print(f"wrote {out} (peft adapter folder, from {path})", flush=True)
    return 0


def _outside_run(target: Path, run: Path, checkpoints: Path, args: argparse.Namespace) -> None:
    """Refuse an --out that would replace the run's own files: the run folder or a folder holding it, anything
    already in the run folder (its config, summary, checkpoints; --force would overwrite it), or a new path
    among its checkpoints. A new file or folder elsewhere in the run folder is fine."""
    out, home = target.resolve(), run.resolve()
    if out == home or out in home.parents:
        raise UserError(f"--out {args.out!r} holds the run folder {args.run!r}; valid: a path outside it")
    if home in out.parents and (out.exists() or out == checkpoints.resolve() or checkpoints.resolve() in out.parents):
        raise UserError(f"--out {args.out!r} would replace part of the run folder {args.run!r}; valid: a path "
                        "outside it, or a new one in it outside its checkpoints")


def _replace_folder(target: Path, write: Any) -> Path:
    """Write a folder beside `target` (write(staging)), then put it in target's place: the old folder is
    removed only once the new one is whole, so a failed export leaves it as it was."""
    import shutil

    staging = target.with_name(f".{target.name}.new-{os.getpid()}")
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    try:
        write(staging)
        os.replace(target, old)
        try:
            os.replace(staging, target)
        except OSError:
            os.replace(old, target)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return target
