"""The `shoal` command line: one module per subcommand (train, distill, plan, data, sample, export), each
with `add_parser(sub)` that registers its flags and `run(args) -> int`.

Every check of the user's input runs in the parent process, before any worker starts: a mistake prints
one line `shoal: error: <message>` on stderr and exits with status 2 (shoal.cli.errors), and nothing is
written. Flags map onto the run config's keys (shoal.train.config): `--global-batch 16` is
`global_batch = 16` in a `--config` file. A subcommand imports torch only once it runs, so `shoal
--help` answers at once. Importing this package registers every experiment (shoal.experiments: its presets,
model family and task) before any flag is read.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import shoal.experiments  # noqa: F401  (registers the experiments' families before any flag is read)
from shoal.cli import data, distill, export, plan, sample, train
from shoal.cli.errors import USER_ERROR, fail, warn
from shoal.cli.parser import Parser


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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shoal")
    except PackageNotFoundError:  # run from a source tree that pip has not installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The `shoal` parser with every subcommand's flags."""
    parser = Parser(prog="shoal", description="Hybrid-parallel training of dense and Mixture-of-Experts "
                     "transformers over an unmodified PyTorch model: data, sharded data (ZeRO-1/2/3, FSDP2), tensor, "
                     "context, pipeline and expert parallelism from one --plan string, and a planner that predicts "
                     "which plan is fastest (shoal plan, --plan auto).")
    parser.add_argument("--version", action="version", version=f"shoal {_version()}")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    for command in (train, distill, plan, data, sample, export):
        command.add_parser(sub)
    return parser
