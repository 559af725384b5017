"""The `shoal` command line: `shoal train`, `shoal plan`, `shoal sample`, `shoal export`, `shoal data` and
`shoal distill`.

Every check of the user's input runs here (`shoal train`'s in shoal.train_command), in the parent
process, before any worker starts:
a mistake prints one line `shoal: error: <message>` on stderr and exits with status 2, and
nothing is written. Flags map onto the run config's keys (config.py): `--global-batch 16` is
`global_batch = 16` in a `--config` file.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

USER_ERROR = 2
RUN_FAILED = 1


class UserError(ValueError):
    """A mistake in the user's input: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No abbreviations: `--step 5` must not quietly mean `--steps 5`.
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def error(self, message: str) -> NoReturn:  # argparse would print usage and exit itself
        raise UserError(message)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """argparse's, with the flags nearest a misspelled one named (`--step` -> `--steps`), also where
        argparse would first complain of a required flag the misspelling was meant to be (`--ru` for `--run`)."""
        argv = list(sys.argv[1:] if args is None else args)
        try:
            parsed, extras = self.parse_known_args(argv, namespace)
        except UserError as exc:
            command, _ = self._command(argv)
            known = {s for a in command._actions for s in a.option_strings}
            unknown = [a for a in argv if a.startswith("--") and a.split("=")[0] not in known]
            if str(exc).startswith("the following arguments are required") and unknown:
                raise UserError(self._unrecognized(argv, unknown)) from None
            raise
        if extras:
            raise UserError(self._unrecognized(argv, extras))
        return parsed

    def _command(self, argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
        """The (sub)command's parser that holds the flags (`shoal data prepare`'s own), and its words."""
        parser: argparse.ArgumentParser = self
        words = ["shoal"]
        for word in argv:
            subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            if subs and word in subs[0].choices:
                parser = subs[0].choices[word]
                words.append(word)
        return parser, words

    def _unrecognized(self, argv: list[str], extras: list[str]) -> str:
        import difflib

        parser, words = self._command(argv)
        flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
        unknown = [e for e in extras if e.startswith("-")] or extras
        near = [m for e in unknown for m in difflib.get_close_matches(e.split("=")[0], flags, n=2, cutoff=0.7)]
        near += [f for e in unknown for f in flags if len(e) > 3 and f.startswith(e.split("=")[0])]  # a flag cut short
        where = " ".join(words) + " --help"
        hint = f"valid: {', '.join(dict.fromkeys(near))}, or see {where}" if near else f"valid: the flags {where} lists"
        return f"unrecognized argument(s) {' '.join(extras)}; {hint}"


def show_model_warnings() -> None:
    """A model setting's warning (shoal.models.config.ModelWarning) as one `shoal: warning:` line, not Python's
    two-line warning with its source; every other warning as Python shows it."""
    import warnings

    from shoal.models.config import ModelWarning

    default = warnings.showwarning

    def show(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        if issubclass(category, ModelWarning):
            warn(str(message))
        else:
            default(message, category, filename, lineno, file, line)

    if getattr(warnings.showwarning, "__name__", "") != "show":
        warnings.showwarning = show


def main(argv: Sequence[str] | None = None) -> int:
    """Run a `shoal` command; returns the exit status."""
    show_model_warnings()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return USER_ERROR
        return int(args.func(args))
    except ValueError as exc:  # UserError and every one-line ValueError of the library
        return fail(str(exc), USER_ERROR)
    except KeyboardInterrupt:
        return fail("interrupted", 130)


MAX_ERROR = 400
"""Characters of an error line (a hang's diagnosis names the silent rank and where the waiting
one was); a longer message is cut there, and written whole to the run folder's error.log when
there is a run folder."""


def fail(message: str, status: int, run_dir: str | Path | None = None) -> int:
    """Print `shoal: error: <message>` on one line (under torchrun, on rank 0 only); returns `status`."""
    if os.environ.get("RANK", "0") != "0":
        return status
    message = " ".join(message.split())
    if len(message) > MAX_ERROR and run_dir is not None and Path(run_dir).is_dir():
        log = Path(run_dir) / "error.log"
        with open(log, "a", encoding="utf-8") as f:
            f.write(message + "\n")
        message = message[:MAX_ERROR].rsplit(" ", 1)[0] + f" ... (whole message in {log})"
    print(f"shoal: error: {message}", file=sys.stderr, flush=True)
    return status


def warn(message: str) -> None:
    """Print `shoal: warning: <message>` on one line (under torchrun, on rank 0 only)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"shoal: warning: {' '.join(message.split())}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the parser

def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; valid: on, off")
    return text == "on"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shoal")
    except PackageNotFoundError:  # run from a source tree that pip has not installed
        return "unknown"


# (flag, type, help); the key in the run config is the flag without dashes, '-' -> '_'.
TRAIN_FLAGS: list[tuple[str, Any, str]] = [
    ("--model", str, "preset (tiny, tiny-gpt, small, gpt3-1.3b..gpt3-175b, llama3-8b/70b/405b, bert-large; "
     "tiny-moe, mixtral-8x7b; the image models mixer, sparse-mlp) or hf:<dir or config.json> [tiny]"),
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
    ("--optimizer", str, "adamw, lamb, lars (over momentum SGD) or cowclip (embedding-row clipping over AdamW); "
     "each takes whole-parameter norms under every sharding [adamw]"),
    ("--momentum", float, "LARS: SGD momentum [0.9]"),
    ("--lars-eta", float, "LARS: trust coefficient eta [1e-3]"),
    ("--adapt-vectors", _on_off, "LAMB/LARS: trust ratios and weight decay on biases and norm weights too [off]"),
    ("--per-expert", _on_off, "LAMB/LARS: one trust ratio per expert of a stacked MoE weight [on]"),
    ("--cowclip-ratio", float, "CowClip: r in clip = r * count * max(||w_id||, r * sqrt(d) * zeta) [1.0]"),
    ("--cowclip-zeta", float, "CowClip: zeta, the lower bound of a row's clip [1e-5]"),
    ("--embed-lr", float, "CowClip: the embedding tables' peak lr, not batch-scaled [lr]"),
    ("--embed-weight-decay", float, "CowClip: the embedding tables' L2 decay, scaled linearly with the batch [0]"),
    ("--lr-scaling", str, "none, linear or sqrt: scale lr (and min-lr) from --base-batch to --global-batch; "
     "explicit warm-up steps keep their number of sequences [none]"),
    ("--base-batch", int, "the global batch the lr and warm-up were set for (with --lr-scaling) [none]"),
    ("--seed", int, "seed of weights, data order and dropout [0]"),
    ("--out", str, "run folder [runs/<timestamp>]"),
    ("--ckpt-every", int, "checkpoint every K steps, and at the end [100]"),
    ("--keep", int, "keep only the K most recent checkpoints; 0: all [0]"),
    ("--eval-every", int, "held-out loss every K steps, and at the end [50]"),
    ("--eval-batches", int, "global batches per held-out evaluation [4]"),
    ("--hang-timeout", float, "seconds a collective may wait once steps run before the run stops naming the "
     "ranks that stopped answering; 0: auto, 10x the slowest step, at least 30 [0]"),
    ("--max-restarts", int, "restart the workers this many times after a failure, from the newest good "
     "checkpoint; under torchrun use torchrun's --max-restarts [0]"),
    ("--log-every", int, "read loss and memory from the device every K steps (one sync per K) [10]"),
    ("--tf32", _on_off, "fp32 matmuls on TF32 tensor cores on GPUs that have them [on]"),
    ("--memory-check", _on_off, "refuse before start a plan predicted not to fit this machine's memory, naming "
     "plans that fit; --no-memory-check: off [on]"),
    ("--data", str, "a folder made by shoal data prepare, a mixture DIR_A:0.7,DIR_B:0.3 of them, a folder of .txt "
     "files, a .txt, .bin (uint16) or .npy token file [built-in corpus]"),
    ("--tokenizer", str, "byte, or a local Hugging Face tokenizer folder [byte; a prepared --data: its own]"),
    ("--doc-mask", _on_off, "keep attention inside each document of a prepared --data, positions restarting at "
     "each (not with pp or cp) [off]"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shoal", description="Hybrid-parallel training of dense and Mixture-of-Experts "
                     "transformers over an unmodified PyTorch model: data, sharded data (ZeRO-1/2/3, FSDP2), tensor, "
                     "context, pipeline and expert parallelism from one --plan string, and a planner that predicts "
                     "which plan is fastest (shoal plan, --plan auto).")
    parser.add_argument("--version", action="version", version=f"shoal {_version()}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    train = sub.add_parser("train", help="train a model", description="Train a model; with no flags, the "
                           "tiny preset on the built-in corpus on 2 local processes.")
    for flag, type_, help_ in TRAIN_FLAGS:
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
    from shoal.train_command import run as train_run

    train.set_defaults(func=train_run)

    from shoal.distill_command import add_parser as add_distill_parser

    add_distill_parser(sub)
    from shoal.plan_command import add_parser as add_plan_parser

    add_plan_parser(sub)
    from shoal.data.command import add_parser as add_data_parser

    add_data_parser(sub)

    sample = sub.add_parser("sample", help="generate text from a trained run",
                            description="Load a run's latest checkpoint in one process (any plan it was trained "
                            "with) and print the prompt followed by sampled tokens.")
    sample.add_argument("--run", required=True, metavar="DIR", help="the run folder (required)")
    sample.add_argument("--prompt", default="", help="text to continue [empty: start from nothing]")
    sample.add_argument("--max-new-tokens", type=int, default=200, metavar="N", help="tokens to generate [200]")
    sample.add_argument("--temperature", type=float, default=0.8, metavar="T",
                        help="divide the logits by T; lower is more predictable [0.8]")
    sample.add_argument("--top-k", type=int, default=40, metavar="K",
                        help="sample among the K likeliest tokens; 0: all [40]")
    sample.add_argument("--seed", type=int, default=0, help="seed of the sampler [0]")
    sample.set_defaults(func=_sample)

    export = sub.add_parser("export", help="write a checkpoint's weights as one safetensors file or a "
                            "Hugging Face folder", description="Gather a checkpoint's weights (whatever plan wrote "
                            "it) into one safetensors file under shoal's names, or with --hf a folder that "
                            "transformers loads (AutoModelForCausalLM), with the run's tokenizer files.")
    export.add_argument("--run", required=True, metavar="DIR", help="the run folder (required)")
    export.add_argument("--step", type=int, metavar="N", help="the checkpoint of step N [the latest]")
    export.add_argument("--out", required=True, metavar="PATH",
                        help="the .safetensors file, or the folder with --hf (required; must not exist unless --force)")
    export.add_argument("--hf", action="store_true", help="write a folder transformers loads (model.safetensors + "
                        "config.json in the model's family, and the run's tokenizer files when it had a Hugging Face "
                        "tokenizer) [off]")
    export.add_argument("--force", action="store_true", help="replace --out if it exists [off]")
    export.set_defaults(func=_export)
    return parser


# ----------------------------------------------------------------------------- shoal sample


def _run_folder(arg: str) -> Path:
    """--run's folder, checked the same way for `sample` and `export` (which needs only the checkpoints: a
    folder with them and no config.toml exports)."""
    from shoal.train.checkpoint import checkpoint_dir
    from shoal.train.runs import CONFIG_FILE

    run = Path(arg)
    if not run.is_dir():
        raise UserError(f"--run {arg!r}: no such run folder")
    if not (run / CONFIG_FILE).is_file() and not checkpoint_dir(run).is_dir():
        raise UserError(f"--run {arg!r} is not a shoal run folder: it has no {CONFIG_FILE} and no checkpoints; "
                        "valid: a folder `shoal train` wrote (its --out)")
    return run


def _sample(args: argparse.Namespace) -> int:
    from shoal.train.sample import sample

    _run_folder(args.run)
    sample(Path(args.run), args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
           top_k=args.top_k, seed=args.seed, emit=lambda piece: print(piece, end="", flush=True))  # as drawn
    print(flush=True)
    return 0


# ----------------------------------------------------------------------------- shoal export


def _export(args: argparse.Namespace) -> int:
    from shoal.train.checkpoint import MANIFEST, checkpoint_dir, good_checkpoint, read_trainer_state
    from shoal.train.export import export_checkpoint

    run = _run_folder(args.run)
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
    if target.is_dir():  # --force: the new folder replaces the old whole, never merged into it
        out = _replace_folder(target, lambda staging: export_checkpoint(path, staging, hf=True))
    else:
        out = export_checkpoint(path, args.out, hf=args.hf)
    print(f"wrote {out} ({'Hugging Face folder' if args.hf else 'safetensors'}, from {path})", flush=True)
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
