"""The data pipeline's three goals, measured on this machine:

  prepare   `shoal data prepare` tokens/s against `datasets` (load_dataset("json") + Dataset.map,
            batched) with the same tokenizer (a byte-level BPE trained here on the built-in corpus,
            called through the `tokenizers` library by both) and the same number of processes,
            input jsonl -> token ids on disk. The two alternate repeat by repeat; medians and spread.
  memory    a rank's anonymous memory (RssAnon) after reading batches spread over a ~2 GB prepared
            dataset against a ~20 MB one (synthetic token shards): memory maps put the tokens in the
            page cache, so the difference should be only the reader's small tables.
  fetch     the time getting a step's batch (metrics.jsonl data_time_s) as a share of the step
            (step_time_s) in `shoal train --model tiny` on a prepared dataset.

    python -m bench.data_pipeline [prepare|memory|fetch ...] [--mb 40] [--repeats 3]

`prepare` needs the `data` extra (`pip install 'shoal[data]'`) for its peer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import report, summarize

EOS = "<|endoftext|>"


def make_tokenizer(folder: Path) -> Path:
    """A 4,096-id byte-level BPE trained on the built-in corpus, saved as a Hugging Face folder."""
    from shoal.testing.fixtures import corpus_bpe

    return corpus_bpe(folder, 4096, EOS)


def make_jsonl(path: Path, megabytes: float) -> int:
    """The built-in corpus's documents, repeated (each copy numbered, so no two lines are equal)
    until the file holds `megabytes`; returns the document count."""
    from shoal.data.text import default_corpus

    docs = [p for p in default_corpus().split("\n\n") if p.strip()]
    written, count = 0, 0
    with path.open("w") as f:
        while written < megabytes * 1e6:
            for d in docs:
                line = json.dumps({"text": f"{count} {d}"}) + "\n"
                f.write(line)
                written += len(line)
                count += 1
    return count


# ----------------------------------------------------------------------------- prepare

def _shoal_prepare(jsonl: Path, tokenizer: Path, out: Path, workers: int) -> int:
    from shoal.data.prepare import PrepareConfig, prepare

    manifest = prepare(PrepareConfig(inputs=[str(jsonl)], tokenizer=str(tokenizer), out=str(out), workers=workers,
                                     holdout=0.0, shard_mb=4.0), progress=False)
    return int(manifest["splits"]["train"]["tokens"])


def _datasets_map(jsonl: Path, tokenizer: Path, cache: Path, workers: int) -> tuple[int, float]:
    """(tokens, seconds of map alone): load the jsonl into Arrow, then a batched map of the same
    `tokenizers` call shoal makes, in `workers` processes, written to Arrow files (its cache)."""
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        return {"ids": [e.ids for e in tok.encode_batch_fast(batch["text"], add_special_tokens=False)]}

    table = datasets.load_dataset("json", data_files=str(jsonl), split="train", cache_dir=str(cache))
    start = time.perf_counter()
    mapped = table.map(encode, batched=True, batch_size=1000, num_proc=workers, remove_columns=["text"])
    seconds = time.perf_counter() - start
    lengths = mapped.map(lambda b: {"n": [len(x) + 1 for x in b["ids"]]}, batched=True, remove_columns=["ids"])
    return int(sum(lengths["n"])), seconds


def bench_prepare(args: argparse.Namespace, work: Path) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process on both sides
    tokenizer = make_tokenizer(work / "bpe")
    jsonl = work / "input.jsonl"
    docs = make_jsonl(jsonl, args.mb)
    times: dict[str, list[float]] = {"shoal": [], "datasets": [], "datasets_map_only": []}
    tokens: dict[str, int] = {}
    for r in range(args.repeats):  # alternating: machine drift hits both alike
        out = work / f"prepared-{r}"
        start = time.perf_counter()
        tokens["shoal"] = _shoal_prepare(jsonl, tokenizer, out, args.workers)
        times["shoal"].append(time.perf_counter() - start)
        start = time.perf_counter()
        tokens["datasets"], map_s = _datasets_map(jsonl, tokenizer, work / f"hf-cache-{r}", args.workers)
        times["datasets"].append(time.perf_counter() - start)
        times["datasets_map_only"].append(map_s)
        print(f"repeat {r}: shoal {times['shoal'][-1]:.1f} s, datasets {times['datasets'][-1]:.1f} s "
              f"(map {map_s:.1f} s)", flush=True)
    assert tokens["shoal"] == tokens["datasets"], tokens  # the same ids, EOS counted on both sides
    rows = []
    for name, samples in times.items():
        s = summarize(samples)
        rows.append({"run": name, "workers": args.workers, "tokens": tokens["shoal"], "median_s": s["median"],
                     "min_s": s["min"], "max_s": s["max"], "tokens_per_s": tokens["shoal"] / s["median"],
                     "shoal_speedup": s["median"] / statistics.median(times["shoal"])})
    report("data_prepare", rows, notes=f"{args.mb:.0f} MB of jsonl, {docs} documents, 4,096-id BPE; "
                                       "speedup = peer median / shoal median (>1: shoal faster)")


# ----------------------------------------------------------------------------- memory

def write_synthetic(folder: Path, megabytes: float, shard_mb: float = 256.0) -> None:
    """A prepared dataset (manifest and uint16 shards) of random tokens, no tokenizer run."""
    from shoal.data.prepare import FORMAT, MANIFEST, tokenizer_identity

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    total = int(megabytes * 1e6) // 2
    shards, done = [], 0
    while done < total:
        n = min(total - done, int(shard_mb * 1e6) // 2)
        name = f"000-{len(shards):06d}.train"
        rng.integers(1, 256, n, dtype=np.uint16).tofile(folder / f"{name}.bin")
        np.array([0, n], dtype=np.int64).tofile(folder / f"{name}.idx")
        shards.append({"name": name, "documents": 1, "tokens": n})
        done += n
    held = {"name": "000-000000.eval", "documents": 1, "tokens": 4096}
    rng.integers(1, 256, 4096, dtype=np.uint16).tofile(folder / f"{held['name']}.bin")
    np.array([0, 4096], dtype=np.int64).tofile(folder / f"{held['name']}.idx")
    source = {"input": "synthetic", "kind": "synthetic",
              "train": {"documents": len(shards), "tokens": total, "shards": shards},
              "eval": {"documents": 1, "tokens": 4096, "shards": [held]}}
    manifest = {"format": FORMAT, "version": 1, "data_format": "text", "loss_mask": False,
                "tokenizer": tokenizer_identity("byte"), "dtype": "uint16", "max_id": 255,
                "splits": {"train": source["train"] | {"shards": None}, "eval": source["eval"] | {"shards": None}},
                "sources": [source]}
    (folder / MANIFEST).write_text(json.dumps(manifest))


def _rss_anon_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def read_batches(folder: str, steps: int) -> dict[str, float]:
    """In a fresh process: RssAnon before opening, after opening and after `steps` batches of 32
    x 256 tokens drawn over the whole dataset (the steps are spread over its epoch)."""
    import torch  # noqa: F401  (imported first: its own memory is the same for both sizes)

    from shoal.data.dataset import open_prepared

    before = _rss_anon_mb()
    data = open_prepared(folder, seq_len=256, seed=0)
    opened = _rss_anon_mb()
    stride = max(1, data.num_train // (256 * 32) // steps)
    for s in range(steps):
        data.train.batch(s * stride, 32)
    return {"before_mb": before, "opened_mb": opened, "after_mb": _rss_anon_mb(), "tokens": data.num_train}


def bench_memory(args: argparse.Namespace, work: Path) -> None:
    rows = []
    for mb in (20, args.big_mb):
        folder = work / f"synthetic-{mb}"
        write_synthetic(folder, mb)
        code = ("import json; from bench.data_pipeline import read_batches; "
                f"print(json.dumps(read_batches({str(folder)!r}, 300)))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        rows.append({"dataset_mb": mb} | json.loads(done.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    small, big = rows
    growth = (big["after_mb"] - big["before_mb"]) - (small["after_mb"] - small["before_mb"])
    report("data_memory", rows, notes=f"RssAnon growth, {args.big_mb} MB dataset minus 20 MB dataset: "
                                      f"{growth:.1f} MB (goal: under 100 MB)")


# ----------------------------------------------------------------------------- fetch

def bench_fetch(args: argparse.Namespace, work: Path) -> None:
    tokenizer = work / "bpe"
    if not tokenizer.is_dir():
        make_tokenizer(tokenizer)
    jsonl = work / "fetch.jsonl"
    make_jsonl(jsonl, 8)
    from shoal.data.prepare import PrepareConfig, prepare

    prepared = work / "fetch-prepared"
    prepare(PrepareConfig(inputs=[str(jsonl)], tokenizer=str(tokenizer), out=str(prepared)), progress=False)
    rows = []
    for name, data in (("prepared", str(prepared)), ("mixture", f"{prepared}:0.5,{prepared}:0.5")):
        run = work / f"run-{name}"
        cmd = [sys.executable, "-m", "shoal", "train", "--model", "tiny", "--steps", str(args.steps), "--data", data,
               "--out", str(run), "--log-every", "1", "--eval-every", str(args.steps), "--set", "vocab_size=4096"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        records = [r for r in records if "data_time_s" in r][5:]  # after warm-up
        share = [r["data_time_s"] / r["step_time_s"] for r in records]
        rows.append({"data": name, "steps": len(records),
                     "data_time_ms": 1e3 * statistics.median(r["data_time_s"] for r in records),
                     "step_time_ms": 1e3 * statistics.median(r["step_time_s"] for r in records),
                     "share_median": statistics.median(share), "share_max": max(share)})
    report("data_fetch", rows, notes="share = data_time_s / step_time_s per step (goal: under 1%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="*", default=["prepare", "memory", "fetch"],
                        choices=["prepare", "memory", "fetch"])
    parser.add_argument("--mb", type=float, default=40.0, help="jsonl input of the prepare benchmark, MB")
    parser.add_argument("--big-mb", type=int, default=2000, help="the large synthetic dataset, MB")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shoal-data-bench-") as tmp:
        for what in args.what:
            {"prepare": bench_prepare, "memory": bench_memory, "fetch": bench_fetch}[what](args, Path(tmp))


if __name__ == "__main__":
    main()
