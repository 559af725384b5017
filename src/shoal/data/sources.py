"""The inputs of `shoal data prepare`, cut into shards of documents.

A source is one INPUT argument: a jsonl file (plain, .gz, or .zst with the `zstandard`
package), a parquet file (with `pyarrow`), a folder of .txt files (one document per file), a
Hugging Face `datasets` folder written by `save_to_disk` (with `datasets`), or one .txt file.
Each is cut, deterministically, into shards of about `shard_bytes` of input: the unit of work of
one worker process and of resumption. JSON is parsed in the workers, so a bad line is reported
there with its file and line number.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXTRA = "pip install 'shoal[data]'"


@dataclass(frozen=True)
class Chunk:
    """One shard's worth of one source: raw jsonl lines, text file paths, or texts."""

    source: int
    shard: int
    kind: str  # "jsonl-range" (start, end byte) | "jsonl" (lines) | "files" | "texts"
    path: str
    first_line: int
    items: list[Any]
    whole: bool = False
    """The chunk is its source's only shard: prepare splits a single document by tokens."""


def kind_of(path: Path) -> str:
    """The kind of an input, or ValueError naming what is valid."""
    if not path.exists():
        raise ValueError(f"input {str(path)!r} does not exist")
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
            return "hf"
        return "folder"
    name = path.name.lower()
    for ext in (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst"):
        if name.endswith(ext):
            return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".txt", ".md")):
        return "txt"
    raise ValueError(f"input {str(path)!r} has an unknown type; valid: .jsonl (.gz, .zst), .parquet, .txt, a folder "
                     "of .txt files, or a Hugging Face datasets folder (save_to_disk)")


def check_readable(path: Path) -> str:
    """The kind, after checking that the package a kind needs is installed (one line if not)."""
    kind = kind_of(path)
    needs = {"parquet": "pyarrow", "hf": "datasets"}.get(kind)
    if path.name.lower().endswith(".zst"):
        needs = "zstandard"
    if needs is not None:
        try:
            __import__(needs)
        except ImportError:
            raise ValueError(f"input {str(path)!r} needs the {needs!r} package, which is not installed; "
                             f"install it ({EXTRA})") from None
    if kind not in ("folder", "hf") and path.stat().st_size == 0:
        raise ValueError(f"input {str(path)!r} is empty (0 bytes); valid: a file that holds text")
    if kind == "folder":
        _text_files(path)
    return kind


def _text_files(folder: Path) -> list[Path]:
    """A folder's .txt files that hold something, sorted; an empty one is skipped (it would be a
    document of EOS alone), a broken link refused (its text would go missing unnoticed)."""
    files = []
    for p in sorted(folder.rglob("*.txt")):
        if p.is_symlink() and not p.exists():
            raise ValueError(f"input folder {str(folder)!r}: {str(p)!r} is a broken link (to {str(p.readlink())!r}); "
                             "valid: fix the link or remove it")
        if p.is_file() and p.stat().st_size > 0:
            files.append(p)
    if not files:
        raise ValueError(f"input folder {str(folder)!r} holds no .txt files with text")
    return files


@contextmanager
def _decompressing(path: Path) -> Iterator[None]:
    """ValueError naming the file for a compressed input that is truncated or not what its name says."""
    errors: tuple[type[BaseException], ...] = (EOFError, gzip.BadGzipFile, zlib.error)
    if path.name.lower().endswith(".zst"):
        import zstandard

        errors += (zstandard.ZstdError,)
    try:
        yield
    except errors as exc:
        what = "it ends early: truncated?" if isinstance(exc, EOFError) else f"not {path.suffix} data: {exc}"
        raise ValueError(f"input {str(path)!r} cannot be decompressed ({what}); valid: a whole {path.suffix} "
                         "file") from None


def _open_binary(path: Path) -> Any:
    with _decompressing(path):
        return _open(path)


def _open(path: Path) -> Any:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"))
    return open(path, "rb")


def chunks(source: int, path: Path, field: str, shard_bytes: int) -> Iterator[Chunk]:
    """The shards of one source, in order, each about `shard_bytes` of input; a source's only shard
    is marked `whole`."""
    pending = None
    for chunk in _chunks(source, path, field, shard_bytes):
        if pending is not None:
            yield pending
        pending = chunk
    if pending is not None:
        yield dataclasses.replace(pending, whole=pending.shard == 0)


def _chunks(source: int, path: Path, field: str, shard_bytes: int) -> Iterator[Chunk]:
    kind = check_readable(path)
    if kind == "jsonl":
        yield from _jsonl_chunks(source, path, shard_bytes)
    elif kind in ("folder", "txt"):
        files = _text_files(path) if kind == "folder" else [path]
        batch: list[str] = []
        size, shard = 0, 0
        for p in files:
            batch.append(str(p))
            size += p.stat().st_size
            if size >= shard_bytes:
                yield Chunk(source, shard, "files", str(path), 0, batch)
                batch, size, shard = [], 0, shard + 1
        if batch:
            yield Chunk(source, shard, "files", str(path), 0, batch)
    else:
        yield from _table_chunks(source, path, kind, field, shard_bytes)


def _jsonl_chunks(source: int, path: Path, shard_bytes: int) -> Iterator[Chunk]:
    """A plain file is cut by byte ranges that the workers read themselves; the shard ends with
    the line holding its last byte, as for compressed files, whose lines are read here."""
    if not path.name.lower().endswith((".gz", ".zst")):
        size, start, shard = path.stat().st_size, 0, 0
        with open(path, "rb") as f:
            while start < size:
                f.seek(start + shard_bytes - 1)
                f.readline()
                end = min(f.tell(), size)
                yield Chunk(source, shard, "jsonl-range", str(path), 0, [start, end])
                start, shard = end, shard + 1
        return
    lines: list[bytes] = []
    size, shard, first = 0, 0, 1
    with _open_binary(path) as raw, _decompressing(path):
        for number, line in enumerate(io.BufferedReader(raw) if not isinstance(raw, io.BufferedIOBase) else raw, 1):
            lines.append(line)
            size += len(line)
            if size >= shard_bytes:
                yield Chunk(source, shard, "jsonl", str(path), first, lines)
                lines, size, shard, first = [], 0, shard + 1, number + 1
    if lines:
        yield Chunk(source, shard, "jsonl", str(path), first, lines)


def _table_chunks(source: int, path: Path, kind: str, field: str, shard_bytes: int) -> Iterator[Chunk]:
    """Parquet and saved HF datasets: the text column, read a record batch at a time."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            table_file = pq.ParquetFile(path)
        except Exception as exc:  # pyarrow raises its own error types for a file that is not parquet
            raise ValueError(f"input {str(path)!r} is not a readable parquet file ({type(exc).__name__})") from None
        if field not in table_file.schema_arrow.names:
            raise ValueError(f"input {str(path)!r} has no column {field!r}; columns: "
                             f"{', '.join(table_file.schema_arrow.names)} (choose one with --field)")
        batches = (b.column(0).to_pylist() for b in table_file.iter_batches(columns=[field], batch_size=1024))
    else:
        import datasets

        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            raise ValueError(f"input {str(path)!r} is a DatasetDict ({', '.join(data)}); give one split's folder")
        if field not in data.column_names:
            raise ValueError(f"input {str(path)!r} has no column {field!r}; columns: {', '.join(data.column_names)} "
                             "(choose one with --field)")
        batches = (data[i: i + 1024][field] for i in range(0, len(data), 1024))
    texts: list[str] = []
    size, shard, row = 0, 0, 0
    for values in batches:
        for value in values:
            row += 1
            if not isinstance(value, str):
                raise ValueError(f"{path}: row {row}: column {field!r} holds {type(value).__name__}, not text")
            texts.append(value)
            size += len(value)
            if size >= shard_bytes:
                yield Chunk(source, shard, "texts", str(path), row - len(texts) + 1, texts)
                texts, size, shard = [], 0, shard + 1
    if texts:
        yield Chunk(source, shard, "texts", str(path), row - len(texts) + 1, texts)


def documents(chunk: Chunk, field: str, fmt: str = "text") -> list[Any]:
    """The chunk's documents: text, or for fine-tuning formats (shoal.data.finetune) a record's
    messages or (prompt, completion); ValueError naming the file and line of a bad one."""
    from shoal.data.finetune import COMPLETION_FIELDS, validate

    if chunk.kind == "texts":
        return chunk.items
    if chunk.kind == "files":
        return [Path(p).read_text(encoding="utf-8", errors="replace") for p in chunk.items]
    lines, first = _lines(chunk), chunk.first_line
    fields = COMPLETION_FIELDS if fmt == "completion" else (field,)
    out = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            where = _line(chunk, first, index)
            raise ValueError(f"{where}: not a JSON line ({getattr(exc, 'msg', exc)}); valid: one JSON "
                             "object per line") from None
        missing = [f for f in fields if not isinstance(record, dict) or f not in record]
        if missing:
            has = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            hint = "" if fmt == "completion" else "; choose one with --field"
            raise ValueError(f"{_line(chunk, first, index)}: no field {missing[0]!r} (has: {has}){hint}")
        values = [record[f] for f in fields]
        def place(index: int = index) -> str:
            line = _line(chunk, first, index)
            return f"{line}: field {field!r}" if fmt != "completion" else line

        out.append(validate(fmt, values if fmt == "completion" else values[0], place))
    return out


def _lines(chunk: Chunk) -> list[bytes]:
    """A jsonl chunk's lines (a byte range is read here, in the worker)."""
    if chunk.kind != "jsonl-range":
        return chunk.items
    start, end = chunk.items
    with open(chunk.path, "rb") as f:
        f.seek(start)
        return f.read(end - start).split(b"\n")


def document_place(chunk: Chunk, index: int) -> str:
    """`file:line` of a jsonl chunk's document `index` (blank lines hold none), for a warning about it."""
    lines = _lines(chunk)
    return _line(chunk, chunk.first_line, [i for i, line in enumerate(lines) if line.strip()][index])


def _line(chunk: Chunk, first: int, index: int) -> str:
    """`file:line` of line `index` of a chunk; a byte range counts the lines before it (errors only)."""
    if chunk.kind == "jsonl-range":
        with open(chunk.path, "rb") as f:
            first = f.read(chunk.items[0]).count(b"\n") + 1
    return f"{chunk.path}:{first + index}"
