"""`shoal data prepare`: inputs -> memory-mapped token shards, a document index and a manifest.

Layout of a prepared folder, for source k (one INPUT) and shard s (about --shard-mb of input):
  kkk-ssssss.train.bin / .eval.bin   token ids (uint16, or uint32 when the vocabulary needs it),
                                     each document followed by the tokenizer's EOS
  kkk-ssssss.train.idx / .eval.idx   int64 offsets of the documents' starts, and the end
  kkk-ssssss.train.mask / .eval.mask fine-tuning formats only: uint8, 1 where a token is a
                                     target (shoal.data.finetune), one a token of the .bin
  kkk-ssssss.json                    the shard's counts; written last: the shard is finished
  progress.json                      the settings of the preparation under way (for resuming)
  manifest.json                      written last, by rename: a folder without it is never read
A fraction --holdout of each source's documents (spread evenly through every shard) goes to
the eval split; a source that is one document (a .txt file) is split by tokens instead, its last
--holdout of tokens held out. A source left with nothing to train on (or, at holdout > 0, nothing
held out) is refused; one that holds out far more than asked is warned about. Workers tokenize
whole shards; a re-run skips the finished ones, so an interrupted preparation resumes where it
stopped. Bad input leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import re
import shutil
import sys
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shoal.data import finetune
from shoal.data.sources import Chunk, check_readable, chunks, document_place, documents

MANIFEST = "manifest.json"
PROGRESS = "progress.json"
FORMAT = "shoal-tokens"
BYTE_EOS = 0
"""The byte tokenizer has no spare id: documents end with a NUL byte, which text does not hold."""
_GOLDEN = (math.sqrt(5) - 1) / 2
_SHARD_FILE = re.compile(r"\.?\d{3}-\d{6}\.")
"""A file of a shard (kkk-ssssss.*, or its temporary .kkk-ssssss.*.tmp-pid)."""
SHARD_NAME = re.compile(r"\d{3}-\d{6}\.(train|eval)")
"""A shard split's name in a manifest: its files are NAME.bin, NAME.idx and NAME.mask."""
DTYPES = ("uint16", "uint32")
"""The token dtypes a prepared folder holds (token_dtype)."""
SKEW = 3
"""A source whose held-out share of tokens exceeds SKEW x --holdout is warned about: its documents
are too few or too uneven for the share asked (the golden-ratio spacing alone keeps a source of
many documents within one document of it)."""


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """What `shoal data prepare` reads, how it tokenizes, and where it writes."""

    inputs: list[str] = field(default_factory=list)
    tokenizer: str = "byte"
    out: str = ""
    field: str = "text"
    """The text field of jsonl records, or column of parquet / datasets tables (chat: the messages)."""
    format: str = "text"
    """text (every token a target), chat or completion (loss masks: shoal.data.finetune)."""
    workers: int = 2
    holdout: float = 0.01
    """Share of each source's documents held out for evaluation (0 <= holdout < 1)."""
    shard_mb: float = 32.0
    """Input per shard, in MB: the unit of parallel work and of resumption."""


# ----------------------------------------------------------------------------- the tokenizer

def tokenizer_identity(name: str) -> dict[str, Any]:
    """What identifies a tokenizer: its files' SHA-256, vocabulary size and EOS id."""
    if name == "byte":
        return {"name": "byte", "sha256": hashlib.sha256(b"shoal byte tokenizer").hexdigest(), "vocab_size": 256,
                "eos_id": BYTE_EOS}
    folder = Path(name)
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"tokenizer {name!r}: no tokenizer.json there; valid: 'byte' or a local Hugging Face "
                         "(fast) tokenizer folder")
    from tokenizers import Tokenizer

    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.is_file() and any(k in path.name for k in ("token", "vocab", "merges", "special")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = _eos_token(folder)
    eos_id = tok.token_to_id(eos) if eos is not None else None
    if eos_id is None:
        raise ValueError(f"tokenizer {name!r} has no EOS token (eos_token in tokenizer_config.json) to end "
                         "documents with; valid: a tokenizer with one, or 'byte'")
    return {"name": str(folder.resolve()), "sha256": digest.hexdigest(),
            "vocab_size": tok.get_vocab_size(with_added_tokens=True), "eos_id": eos_id}


def _eos_token(folder: Path) -> str | None:
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            value = json.loads((folder / file).read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            return value
    return None


def _encoder(name: str) -> Callable[[list[str]], list[list[int]]]:
    if name == "byte":
        return lambda texts: [list(t.encode("utf-8")) for t in texts]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(name) / "tokenizer.json"))
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # the same ids, without character offsets
    return lambda texts: [e.ids for e in encode(texts, add_special_tokens=False)]


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def manifest_problem(folder: Path, manifest: dict[str, Any]) -> str | None:
    """What is wrong with a prepared folder's manifest, or with the shard files it lists, in a few words;
    None when nothing is. Each file that a reader maps (a split's .bin, and .mask for fine-tuning data)
    is checked by its size against the manifest's token count, a stat each and no data read: a shard
    cut short, missing or replaced, or a manifest of other files, is found before anything trains on it."""
    try:
        files = _listed_files(manifest)
    except KeyError as exc:
        return f"{MANIFEST} is not a whole {FORMAT} manifest: it has no {exc.args[0]!r}"
    except (TypeError, AttributeError, ValueError) as exc:
        return f"{MANIFEST} is not a whole {FORMAT} manifest: {exc}"
    for name, size, what in files:
        try:
            found = (folder / name).stat().st_size
        except FileNotFoundError:
            return f"{name}, which {MANIFEST} lists, is missing"
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror})"
        if found != size:
            how = "cut short" if found < size else "longer than written"
            return f"{name} holds {found:,} bytes where {MANIFEST}'s {what} take {size:,} ({how})"
    return None


def _listed_files(manifest: dict[str, Any]) -> list[tuple[str, int, str]]:
    """(file name, size in bytes, what the size stands for) of each non-empty shard file a manifest
    lists; KeyError, TypeError or ValueError where the manifest is malformed or disagrees with itself."""
    dtype = manifest["dtype"]
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not {' or '.join(DTYPES)}")
    itemsize = np.dtype(dtype).itemsize
    files = []
    for split in ("train", "eval"):
        total = 0
        for source in manifest["sources"]:
            counts = [_count(shard) for shard in source[split]["shards"]]
            if sum(counts) != source[split]["tokens"]:
                raise ValueError(f"the {split} shards of source {source['input']!r} hold {sum(counts):,} tokens, its "
                                 f"{split} total says {source[split]['tokens']}")
            total += sum(counts)
            for shard, tokens in zip(source[split]["shards"], counts):
                if tokens:
                    files.append((f"{shard['name']}.bin", tokens * itemsize, f"{tokens:,} {dtype} tokens"))
                if tokens and manifest.get("loss_mask"):
                    files.append((f"{shard['name']}.mask", tokens, f"{tokens:,} mask bytes"))
        if total != manifest["splits"][split]["tokens"]:
            raise ValueError(f"its sources hold {total:,} {split} tokens, its {split} total says "
                             f"{manifest['splits'][split]['tokens']}")
    return files


def _count(shard: dict[str, Any]) -> int:
    """A manifest shard's token count, its name checked (a plain NNN-NNNNNN.split: no path elsewhere)."""
    name, tokens = shard["name"], shard["tokens"]
    if not (isinstance(name, str) and SHARD_NAME.fullmatch(name)):
        raise ValueError(f"shard name {name!r} is not NNN-NNNNNN.train or NNN-NNNNNN.eval")
    if not (isinstance(tokens, int) and tokens >= 0):
        raise ValueError(f"shard {name} has {tokens!r} tokens, not a count")
    return tokens


# ----------------------------------------------------------------------------- one shard (in a worker)

_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: str, eos_id: int, dtype: str, field_name: str, holdout: float, out: str,
                 fmt: str = "text") -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    encode = _encoder(tokenizer) if fmt == "text" else finetune.encoder(fmt, tokenizer)
    _WORKER.update(encode=encode, eos=eos_id, dtype=dtype, field=field_name, holdout=holdout, out=Path(out),
                   format=fmt)


def is_held_out(shard: int, index: int, holdout: float) -> bool:
    """Document `index` of a shard goes to eval: a golden-ratio sequence spreads the held-out
    documents evenly (within one of holdout x documents per shard); document 0 of shard 0 is
    always held out when holdout > 0, so every source has an eval split (a source of one document
    is split by tokens instead: split_documents)."""
    return (index * _GOLDEN + shard * math.sqrt(2)) % 1.0 < holdout if shard else (index * _GOLDEN) % 1.0 < holdout


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


Document = tuple[list[int], list[int] | None]
"""A document's token ids and, for fine-tuning formats, its loss mask."""


def split_documents(chunk: Chunk, docs: list[Document], holdout: float) -> dict[str, list[Document]]:
    """The chunk's documents by split. A source that is one document (a .txt file, a single
    record) is split by tokens, as nanoGPT splits its text: the last `holdout` of its tokens are
    held out (ending at the document's own EOS, as the first part ends at one of its own), the rest
    trained on; held out as a whole it would leave nothing to train on."""
    if not (chunk.whole and len(docs) == 1 and holdout > 0):
        return {split: [d for j, d in enumerate(docs) if is_held_out(chunk.shard, j, holdout) == (split == "eval")]
                for split in ("train", "eval")}
    (ids, mask), = docs
    cut = int(len(ids) * (1 - holdout))
    parts = {"train": (ids[:cut], None if mask is None else mask[:cut]),
             "eval": (ids[cut:], None if mask is None else mask[cut:])}
    return {split: [part] if part[0] else [] for split, part in parts.items()}


def _work(chunk: Chunk) -> dict[str, Any]:
    w = _WORKER
    fmt = w["format"]
    encoded = w["encode"](documents(chunk, w["field"], fmt))
    docs: list[Document] = [(e, None) for e in encoded] if fmt == "text" else [(e[0], e[1]) for e in encoded]
    name = f"{chunk.source:03d}-{chunk.shard:06d}"
    record: dict[str, Any] = {"name": name, "max_id": int(w["eos"])}
    untargeted = [j for j, (_, mask) in enumerate(docs) if mask is not None and not any(mask)]
    if untargeted:  # (fine-tuning formats) documents with nothing to learn: counted for a warning
        record["untargeted"] = {"documents": len(untargeted), "first": document_place(chunk, untargeted[0])}
    for split, kept in split_documents(chunk, docs, w["holdout"]).items():
        record[split] = _write_split(w["out"] / f"{name}.{split}", kept, eos=w["eos"], dtype=w["dtype"],
                                     masked=fmt != "text")
        record["max_id"] = max(record["max_id"], record[split].pop("max_id"))
    _write_atomic(w["out"] / f"{name}.json", json.dumps(record).encode())
    return record


def _write_split(stem: Path, docs: list[Document], *, eos: int, dtype: str, masked: bool) -> dict[str, Any]:
    """One split of a shard: its tokens (each document followed by EOS), document index and, for
    fine-tuning formats, loss mask; returns its counts (and largest id)."""
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(ids) + 1 for ids, _ in docs], out=offsets[1:])
    tokens = np.full(int(offsets[-1]), eos, dtype=dtype)
    for (ids, _), start in zip(docs, offsets[:-1]):
        tokens[start: start + len(ids)] = ids
    if masked:  # the EOS after a document is a target when the token before it is
        mask_out = np.zeros(int(offsets[-1]), dtype=np.uint8)
        for (_, m), start in zip(docs, offsets[:-1]):
            assert m is not None
            mask_out[start: start + len(m)] = m
            mask_out[start + len(m)] = m[-1] if len(m) else 0
        _write_atomic(stem.with_name(stem.name + ".mask"), mask_out.tobytes())
    _write_atomic(stem.with_name(stem.name + ".bin"), tokens.tobytes())
    _write_atomic(stem.with_name(stem.name + ".idx"), offsets.tobytes())
    return {"name": stem.name, "documents": len(docs), "tokens": int(offsets[-1]),
            "max_id": int(tokens.max()) if len(tokens) else eos}


# ----------------------------------------------------------------------------- the whole preparation

def prepare(cfg: PrepareConfig, *, progress: bool = True) -> dict[str, Any]:
    """Prepare (or finish preparing) `cfg.out`; returns the manifest. ValueError in one line for bad
    input, leaving nothing behind that this run wrote."""
    if not cfg.inputs:
        raise ValueError("no INPUT given; valid: jsonl, parquet, .txt files or folders, saved datasets folders")
    if not 0 <= cfg.holdout < 1:
        raise ValueError(f"--holdout {cfg.holdout} is not valid; valid: 0 <= holdout < 1")
    if cfg.workers < 1:
        raise ValueError(f"--workers {cfg.workers} is not valid; valid: 1 or more")
    if not cfg.shard_mb > 0:
        raise ValueError(f"--shard-mb {cfg.shard_mb} is not valid; valid: more than 0")
    tok = tokenizer_identity(cfg.tokenizer)
    paths = [Path(p) for p in cfg.inputs]
    kinds = [check_readable(p) for p in paths]
    finetune.check_format(cfg.format, cfg.tokenizer, kinds)
    out = Path(cfg.out)
    settings = {"inputs": [_input_identity(p) for p in paths], "kinds": kinds, "tokenizer": tok,
                "field": cfg.field, "holdout": cfg.holdout, "shard_mb": cfg.shard_mb}
    if cfg.format != "text":  # a text preparation's settings hold no format: its progress and manifest stay valid
        settings["format"] = cfg.format
    done = _existing(out, settings)
    if done is not None:
        return done
    created = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)
    out.mkdir(parents=True, exist_ok=True)
    before = set(os.listdir(out))
    try:
        _write_atomic(out / PROGRESS, json.dumps(settings, indent=1).encode())
        records = _run(cfg, tok, paths, progress)
        manifest = _manifest(cfg, tok, paths, kinds, records)
        _write_atomic(out / MANIFEST, json.dumps(manifest, indent=1).encode())
        (out / PROGRESS).unlink()
    except ValueError:
        _remove_preparation(out, created=created, before=before)
        raise
    for message in _warnings(cfg, manifest, records):
        print(f"shoal: warning: {message}", file=sys.stderr, flush=True)
    return manifest


def _remove_preparation(out: Path, *, created: Path | None, before: set[str]) -> None:
    """After bad input: remove what this run wrote (`created`: the first folder of --out's path it
    made) and, when it resumed an interrupted preparation of the same inputs, that one's shards and
    progress too (these inputs cannot finish it)."""
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
        return
    resumed = PROGRESS in before
    for name in os.listdir(out):
        if name not in before or (resumed and (name == PROGRESS or _SHARD_FILE.match(name))):
            (out / name).unlink(missing_ok=True)


def _input_identity(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _existing(out: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest when `out` already holds this very preparation; None to (re)start it; ValueError
    when `out` holds something else."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file, not a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return None
    for name in (MANIFEST, PROGRESS):
        path = out / name
        if path.is_file():
            try:
                stored = json.loads(path.read_text())
                same = stored.get("settings", stored) == settings
            except (OSError, ValueError, AttributeError) as exc:
                raise ValueError(f"--out {str(out)!r}: its {name} cannot be read ({type(exc).__name__}); valid: a new "
                                 "or empty folder") from None
            problem = manifest_problem(out, stored) if same and name == MANIFEST else None
            if problem is not None:  # the same command again would say "nothing to do"
                raise ValueError(f"--out {str(out)!r} holds this preparation, but {problem}; valid: remove the folder, "
                                 "then the same command prepares it again")
            if same:
                return stored if name == MANIFEST else None
            raise ValueError(f"--out {str(out)!r} holds a {'prepared' if name == MANIFEST else 'half-prepared'} "
                             "dataset of other inputs or settings; valid: a new or empty folder, or the same command")
    raise ValueError(f"--out {str(out)!r} is not empty and holds no shoal dataset; valid: a new or empty folder")


def _bounded(cfg: PrepareConfig, tok: dict[str, Any], tasks: Iterator[Chunk]) -> Iterator[dict[str, Any]]:
    """Each task's record, in order; at most 2 x workers shards in flight (inputs are never held whole)."""
    init = (tok["name"], tok["eos_id"], token_dtype(tok["vocab_size"]), cfg.field, cfg.holdout, cfg.out, cfg.format)
    if cfg.workers == 1:
        _init_worker(*init)
        yield from map(_work, tasks)
        return
    with multiprocessing.get_context("fork").Pool(cfg.workers, _init_worker, init) as pool:
        pending: deque[Any] = deque()
        for task in tasks:
            pending.append(pool.apply_async(_work, (task,)))
            if len(pending) >= 2 * cfg.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _run(cfg: PrepareConfig, tok: dict[str, Any], paths: list[Path], progress: bool) -> list[dict[str, Any]]:
    from tqdm import tqdm

    out = Path(cfg.out)
    shard_bytes = int(cfg.shard_mb * 1e6)
    finished: list[dict[str, Any]] = []

    def todo() -> Iterator[Chunk]:
        for source, path in enumerate(paths):
            for chunk in chunks(source, path, cfg.field, shard_bytes):
                marker = out / f"{chunk.source:03d}-{chunk.shard:06d}.json"
                if marker.is_file():
                    finished.append(json.loads(marker.read_text()) | {"source": chunk.source})
                else:
                    yield chunk

    records: list[dict[str, Any]] = []
    with tqdm(desc="tokenizing", unit="tok", unit_scale=True, disable=None if progress else True) as bar:
        for record in _bounded(cfg, tok, todo()):
            record["source"] = int(record["name"][:3])
            records.append(record)
            bar.update(record["train"]["tokens"] + record["eval"]["tokens"])
    return sorted(finished + records, key=lambda r: r["name"])


def _manifest(cfg: PrepareConfig, tok: dict[str, Any], paths: list[Path], kinds: list[str],
              records: list[dict[str, Any]]) -> dict[str, Any]:
    sources = []
    for k, (path, kind) in enumerate(zip(paths, kinds)):
        mine = [r for r in records if r["source"] == k]
        entry: dict[str, Any] = {"input": str(path), "kind": kind}
        for split in ("train", "eval"):
            entry[split] = {"documents": sum(r[split]["documents"] for r in mine),
                            "tokens": sum(r[split]["tokens"] for r in mine),
                            "shards": [r[split] for r in mine]}
        _check_splits(entry, cfg.holdout)
        sources.append(entry)
    splits = {s: {"documents": sum(e[s]["documents"] for e in sources), "tokens": sum(e[s]["tokens"] for e in sources)}
              for s in ("train", "eval")}
    settings = json.loads(Path(cfg.out, PROGRESS).read_text())
    return {"format": FORMAT, "version": 1, "data_format": cfg.format, "loss_mask": cfg.format != "text",
            "tokenizer": tok, "dtype": token_dtype(tok["vocab_size"]),
            "max_id": max([r["max_id"] for r in records], default=0), "splits": splits, "sources": sources,
            "config": asdict(cfg), "settings": settings}


def _check_splits(source: dict[str, Any], holdout: float) -> None:
    """ValueError in one line when a source has no documents, nothing to train on, or (holdout > 0)
    nothing held out: training would refuse it, after the whole preparation."""
    path = source["input"]
    if source["train"]["documents"] + source["eval"]["documents"] == 0:
        raise ValueError(f"input {path!r} holds no documents")
    if source["train"]["tokens"] == 0:
        raise ValueError(f"input {path!r} leaves 0 tokens to train on ({source['eval']['documents']} document(s) "
                         f"held out at --holdout {holdout}); valid: more documents, or a smaller --holdout")
    if holdout > 0 and source["eval"]["tokens"] == 0:
        raise ValueError(f"input {path!r} holds out 0 tokens at --holdout {holdout}; valid: more documents or "
                         "a larger --holdout, or --holdout 0 (then train with --eval-every 0)")


def _warnings(cfg: PrepareConfig, manifest: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    """What the user should know about a finished preparation, one line each: a source that holds
    out far more than --holdout of its tokens, and fine-tuning documents with no target."""
    out = []
    for source in manifest["sources"]:
        train, held = source["train"], source["eval"]
        share = held["tokens"] / (train["tokens"] + held["tokens"])
        if cfg.holdout > 0 and share > SKEW * cfg.holdout:
            out.append(f"input {source['input']!r} holds out {share:.1%} of its tokens ({held['documents']} of its "
                       f"{train['documents'] + held['documents']} documents) for --holdout {cfg.holdout}: give it "
                       "more documents, or join them into one .txt file, which is split by tokens")
    untargeted = [r["untargeted"] for r in records if "untargeted" in r]
    if untargeted:
        what = "conversations hold no assistant turn" if cfg.format == "chat" else "records have an empty completion"
        out.append(f"{sum(u['documents'] for u in untargeted):,} {what}, so they add no training targets "
                   f"(the first: {untargeted[0]['first']})")
    return out
