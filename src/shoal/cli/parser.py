"""The command line's argument parser: argparse without abbreviations, whose mistakes are UserErrors that name
the flags nearest a misspelled one, and the argument checks more than one subcommand shares."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from shoal.cli.errors import UserError


class Parser(argparse.ArgumentParser):
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


def on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; valid: on, off")
    return text == "on"


def run_folder(arg: str) -> Path:
    """--run's folder, checked the same way for `sample` and `export` (which needs only the checkpoints: a
    folder with them and no config.toml exports)."""
    from shoal.train.checkpoint import checkpoint_dir
    from shoal.train.job import CONFIG_FILE

    run = Path(arg)
    if not run.is_dir():
        raise UserError(f"--run {arg!r}: no such run folder")
    if not (run / CONFIG_FILE).is_file() and not checkpoint_dir(run).is_dir():
        raise UserError(f"--run {arg!r} is not a shoal run folder: it has no {CONFIG_FILE} and no checkpoints; "
                        "valid: a folder `shoal train` wrote (its --out)")
    return run
