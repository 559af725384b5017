"""`shoal sample`: a trained run's newest checkpoint, loaded in one process, continues a prompt."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shoal.cli.parser import run_folder


def add_parser(sub: Any) -> None:
    """Add `shoal sample` to the command line's subcommands."""
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
    sample.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shoal.train.sample import sample

    run_folder(args.run)
    sample(Path(args.run), args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
           top_k=args.top_k, seed=args.seed, emit=lambda piece: print(piece, end="", flush=True))  # as drawn
    print(flush=True)
    return 0
