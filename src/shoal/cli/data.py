"""`shoal data prepare`: the flags, mapped onto prepare.PrepareConfig."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    """The `data` subcommand and its `prepare` action."""
    data = sub.add_parser("data", help="prepare training data", description="Turn jsonl / parquet / text / saved "
                          "Hugging Face datasets into memory-mapped token shards that shoal train --data reads.")
    actions = data.add_subparsers(dest="action", parser_class=type(data), required=True, metavar="prepare")
    prep = actions.add_parser("prepare", help="tokenize inputs into a prepared dataset folder",
                              description="Tokenize each INPUT (a source) in parallel into token shards with a "
                              "document index and a manifest; holds out --holdout of each source's documents. "
                              "Running the same command again resumes an interrupted preparation.")
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help=".jsonl (.gz, .zst), .parquet, .txt, a folder of "
                      ".txt files, or a datasets folder written by save_to_disk")
    prep.add_argument("--tokenizer", required=True, help="byte, or a local Hugging Face tokenizer folder (required)")
    prep.add_argument("--out", required=True, metavar="DIR", help="the dataset folder to write (required)")
    prep.add_argument("--format", default="text", choices=("text", "chat", "completion"),
                      help="text: every token is learnt; chat: jsonl records with 'messages' (a list of "
                      "{role, content}) rendered with the tokenizer's chat template, the loss on the assistant's "
                      "tokens only; completion: jsonl records with 'prompt' and 'completion', the loss on the "
                      "completion only [text]")
    prep.add_argument("--field", default=None, help="the text field of jsonl records / table column [text]; "
                      "the messages field for --format chat [messages]")
    prep.add_argument("--workers", type=int, default=2, help="tokenizing processes [2]")
    prep.add_argument("--holdout", type=float, default=0.01, help="share of each source's documents held out "
                      "for evaluation [0.01]")
    prep.add_argument("--shard-mb", type=float, default=32.0, help="MB of input per shard [32]")
    prep.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shoal.data.prepare import MANIFEST, PrepareConfig, prepare

    field = args.field or ("messages" if args.format == "chat" else "text")
    cfg = PrepareConfig(inputs=list(args.inputs), tokenizer=args.tokenizer, out=args.out, field=field,
                        format=args.format, workers=args.workers, holdout=args.holdout, shard_mb=args.shard_mb)
    already = (Path(args.out) / MANIFEST).is_file()
    started = time.perf_counter()
    manifest = prepare(cfg)
    if already:  # the same inputs and settings (prepare refuses others)
        print(f"{args.out}: already prepared from these inputs with these settings; nothing to do", flush=True)
        return 0
    seconds = time.perf_counter() - started
    train, held = manifest["splits"]["train"], manifest["splits"]["eval"]
    tokens = train["tokens"] + held["tokens"]
    print(f"{args.out}: {len(manifest['sources'])} source(s), {train['documents']:,} documents / {train['tokens']:,} "
          f"tokens for training, {held['documents']:,} / {held['tokens']:,} held out ({manifest['dtype']}); "
          f"{tokens / max(seconds, 1e-9):,.0f} tokens/s"
          + (f"; {manifest['data_format']} data, the loss on {_target_share(args.out, manifest):.1%} of the "
             "training tokens" if manifest.get("loss_mask") else ""), flush=True)
    return 0


def _target_share(folder: str, manifest: dict[str, Any]) -> float:
    """The share of a fine-tuning set's training tokens that are targets (its loss masks' mean)."""
    import numpy as np

    ones = total = 0
    for source in manifest["sources"]:
        for shard in source["train"]["shards"]:
            if shard["tokens"]:
                mask = np.memmap(Path(folder) / f"{shard['name']}.mask", dtype=np.uint8, mode="r")
                ones, total = ones + int(mask.sum()), total + len(mask)
    return ones / max(total, 1)
