"""Reading prepared datasets: token shards through memory maps, sequences packed from documents,
and weighted mixtures, with batch `s` a pure function of (seed, s).

A prepared folder is recognised by its manifest (written last by `shoal data prepare`), so a
half-written folder is never read. Each source's documents (EOS-terminated) are concatenated
across its shards and cut into windows of seq_len + 1 tokens; no rank reads more than the
windows of its own slice of the batch, and nothing holds the corpus in memory.

Which source sample i comes from: samples are grouped in blocks of BLOCK; block b takes from
source k exactly floor((b+1) B C_k) - floor(b B C_k) samples (C the cumulative weights) minus
the same for k - 1, in a seeded order, so the shares match the weights to within one sample per
source at every block boundary, and the position of sample i in its source's stream is known in
closed form. A source's stream visits its windows in a pseudo-random order per epoch (a keyed
Feistel permutation: no permutation array is stored, whatever the size of the source).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shoal.data.prepare import FORMAT, MANIFEST, PROGRESS, manifest_problem
from shoal.loss import IGNORE

BLOCK = 4096
"""Samples per mixture block: the shares are exact at every block boundary."""


def is_prepared(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The manifest of a prepared dataset; ValueError in one line when it is not one, or when its shard
    files disagree with it (prepare.manifest_problem)."""
    path = Path(folder) / MANIFEST
    if not Path(folder).exists():
        raise ValueError(f"--data source {str(folder)!r} does not exist; valid: folders made by shoal data prepare, "
                         "as DIR or DIR_A:0.7,DIR_B:0.3 (items separated by commas, each weight after a colon)")
    if not path.is_file():
        raise ValueError(f"{str(folder)!r} is not a prepared dataset (no {MANIFEST}: not made by "
                         "`shoal data prepare`, or its preparation did not finish); valid: a folder shoal data "
                         "prepare finished (the same command again finishes an interrupted one)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} cannot be read ({type(exc).__name__}); valid: the manifest shoal data prepare "
                         "wrote (prepare the inputs again into a new --out)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} manifest; prepare the dataset again")
    problem = manifest_problem(Path(folder), manifest)
    if problem is not None:
        raise ValueError(f"prepared dataset {str(folder)!r}: {problem}; valid: the files as shoal data prepare wrote "
                         "them (prepare the inputs again into a new --out)")
    return manifest


def parse_mixture(spec: str) -> list[tuple[str, float]]:
    """`DIR` or `DIR_A:0.7,DIR_B:0.3` -> [(folder, weight)]; weights must be positive numbers."""
    if Path(spec).exists():
        return [(spec, 1.0)]
    out = []
    for item in spec.split(","):
        if not item.strip():  # "A:0.7," would otherwise read the working folder
            raise ValueError(f"--data {spec!r} has an empty item; valid: DIR or DIR_A:0.7,DIR_B:0.3, items separated "
                             "by single commas")
        folder, sep, weight = item.rpartition(":")
        if sep and not folder.strip():
            raise ValueError(f"--data {spec!r}: weight {weight!r} has no folder; valid: DIR_A:0.7,DIR_B:0.3")
        if not sep:
            folder, weight = item, "1"
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"--data {spec!r}: weight {weight!r} of {folder!r} is not a positive number; "
                             "valid: DIR or DIR_A:0.7,DIR_B:0.3 with weights > 0")
        out.append((folder, value))
    return out


def is_prepared_spec(spec: str | None) -> bool:
    """Whether --data names prepared datasets (one folder with a manifest, or a weighted list)."""
    if spec is None:
        return False
    if Path(spec).exists():  # a half-prepared folder too: read_manifest then refuses it
        return is_prepared(spec) or (Path(spec) / PROGRESS).is_file()
    return ":" in spec or "," in spec


# ----------------------------------------------------------------------------- permutation

_MASK64 = (1 << 64) - 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays: a well-mixed hash of each value."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _key(*parts: int) -> int:
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = int(_mix64(np.array([(h ^ (p & _MASK64)) & _MASK64], dtype=np.uint64))[0])
    return h


@functools.lru_cache(maxsize=64)
def _round_keys(key: int) -> list[np.uint64]:
    return [np.uint64(_key(key, r)) for r in range(4)]


def permute(index: np.ndarray, n: int, key: int) -> np.ndarray:
    """A pseudo-random bijection of [0, n) chosen by `key`, applied to `index` (values in [0, n)):
    a 4-round Feistel network on the next even number of bits, cycle-walked back into range."""
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    half, mask = np.uint64(bits // 2), np.uint64((1 << (bits // 2)) - 1)
    keys = _round_keys(key)
    out = np.asarray(index, dtype=np.uint64).copy()
    todo = np.ones(out.shape, dtype=bool)
    while todo.any():
        y = out[todo]
        left, right = y >> half, y & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        out[todo] = (left << half) | right
        todo = out >= np.uint64(n)
    return out.astype(np.int64)


# ----------------------------------------------------------------------------- one source

class TokenStream:
    """One split of one source: its shards' tokens end to end, as windows of seq_len + 1."""

    def __init__(self, folder: Path, shards: list[dict[str, Any]], dtype: str, *, seq_len: int, name: str,
                 masked: bool = False) -> None:
        self.name, self.seq_len = name, seq_len
        self.arrays = [np.memmap(folder / f"{s['name']}.bin", dtype=dtype, mode="r") for s in shards if s["tokens"]]
        self.masks = [np.memmap(folder / f"{s['name']}.mask", dtype=np.uint8, mode="r")
                      for s in shards if s["tokens"]] if masked else None
        """Fine-tuning data: per shard, 1 where a token is a target (shoal.data.finetune); None: all are."""
        self.starts = np.cumsum([0] + [len(a) for a in self.arrays])
        self.num_tokens = int(self.starts[-1])
        self.num_windows = (self.num_tokens - 1) // seq_len

    def window(self, w: int) -> np.ndarray:
        """Tokens w*T .. w*T + T (inclusive), read from one or more shards."""
        return self._read(self.arrays, w)

    def window_mask(self, w: int) -> np.ndarray | None:
        """The loss mask of `window(w)` (1: a target), or None when every token is one."""
        return None if self.masks is None else self._read(self.masks, w)

    def _read(self, arrays: Sequence[np.ndarray], w: int) -> np.ndarray:
        start, stop = w * self.seq_len, w * self.seq_len + self.seq_len + 1
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts, pos = [], start
        while pos < stop:
            a, base = arrays[first], int(self.starts[first])
            take = min(stop, base + len(a)) - pos
            parts.append(np.asarray(a[pos - base: pos - base + take]))
            pos, first = pos + take, first + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


# ----------------------------------------------------------------------------- mixtures

class MixtureBatches:
    """Sequences drawn from token streams in the shares `weights`; `batch(step, size, part)` is a
    pure function of (seed, step, size), like shoal.data.text.TokenBatches, which it can replace."""

    def __init__(self, streams: list[TokenStream], weights: list[float], *, seed: int) -> None:
        total = sum(weights)
        self.streams, self.seed = streams, seed
        self.cumulative = [sum(weights[: k + 1]) / total for k in range(len(weights))]
        self.cumulative[-1] = 1.0
        self._block = functools.lru_cache(maxsize=8)(self._compute_block)

    def _before(self, block: int) -> np.ndarray:
        """Samples of each source in blocks 0 .. block-1."""
        upto = np.array([0] + [math.floor(block * BLOCK * c) for c in self.cumulative], dtype=np.int64)
        return np.diff(upto)

    def _compute_block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Source and position in that source's stream of each sample of a block."""
        start, counts = self._before(block), self._before(block + 1) - self._before(block)
        labels = np.repeat(np.arange(len(counts)), counts)
        source = labels[np.random.default_rng([self.seed, block, 0x6D6978]).permutation(BLOCK)]
        position = np.empty(BLOCK, dtype=np.int64)
        for k in range(len(counts)):
            where = np.flatnonzero(source == k)
            position[where] = start[k] + np.arange(len(where))
        return source, position

    def draws(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, position in its stream) of samples first .. first+count-1."""
        samples = np.arange(first, first + count)
        pairs = [self._block(int(s // BLOCK)) for s in samples]
        offsets = samples % BLOCK
        return (np.array([p[0][o] for p, o in zip(pairs, offsets)], dtype=np.int64),
                np.array([p[1][o] for p, o in zip(pairs, offsets)], dtype=np.int64))

    def new_epochs(self, step: int, size: int) -> list[tuple[str, int]]:
        """(source name, epoch) of each source that starts a new epoch (after its first) in global
        batch `step`: for the log."""
        sources, positions = self.draws(step * size, size)
        out = []
        for k in np.unique(sources):
            n = self.streams[int(k)].num_windows
            here = positions[sources == k]
            for epoch in np.unique(here[(here % n == 0) & (here >= n)] // n):
                out.append((self.streams[int(k)].name, int(epoch) + 1))
        return out

    def window_of(self, source: int, position: int) -> int:
        return int(self.windows(np.array([source]), np.array([position]))[0])

    def windows(self, sources: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The window each (source, position in its stream) reads: epoch e of a source visits its
        windows in the permutation keyed by (seed, source, e)."""
        out = np.empty(len(sources), dtype=np.int64)
        for k in np.unique(sources):
            n = self.streams[int(k)].num_windows
            for epoch in np.unique(positions[sources == k] // n):
                where = (sources == k) & (positions // n == epoch)
                out[where] = permute(positions[where] % n, n, _key(self.seed, int(k), int(epoch)))
        return out

    def batch(self, step: int, size: int, part: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (B, T) of this rank's slice `part` = (index, count) of global batch `step`;
        a target that a loss mask excludes (fine-tuning data) is IGNORE."""
        index, count = part
        local = size // count
        sources, positions = self.draws(step * size + index * local, local)
        picks = [(self.streams[int(k)], int(w)) for k, w in zip(sources, self.windows(sources, positions))]
        seq = torch.from_numpy(np.stack([stream.window(w) for stream, w in picks]).astype(np.int64))
        targets = seq[:, 1:]
        if any(stream.masks is not None for stream, _ in picks):
            masks = [stream.window_mask(w) for stream, w in picks]
            keep = np.stack([m[1:] if m is not None else np.ones(targets.shape[1], np.uint8) for m in masks])
            targets = targets.masked_fill(torch.from_numpy(keep == 0), IGNORE)
        return seq[:, :-1], targets


@dataclass(frozen=True)
class OpenedData:
    """What the trainer needs of its data: the two samplers and counts for its log."""

    train: Any
    held_out: Any
    """None: the data holds no held-out split and the run asked for none (open_prepared)."""
    num_train: int
    num_held_out: int
    max_id: int
    tokenizer: dict[str, Any] | None = None
    held_out_sources: dict[str, Any] | None = None
    """More than one source: each one's held-out batches alone, by short name (its folder, and
    its input's file name where a folder has several), for a held-out loss per source."""


def open_prepared(spec: str, *, seq_len: int, seed: int, require_held_out: bool = True) -> OpenedData:
    """A prepared dataset or a mixture of them, read through memory maps. `require_held_out`: the
    run evaluates, so every source must hold a held-out sequence; without it, data that holds none
    (prepared with --holdout 0) opens with `held_out` None."""
    mixture = parse_mixture(spec)
    manifests = [read_manifest(folder) for folder, _ in mixture]
    first = manifests[0]["tokenizer"]
    for (folder, _), m in zip(mixture, manifests):
        if m["tokenizer"]["sha256"] != first["sha256"]:
            raise ValueError(f"--data {spec!r}: {folder!r} was tokenized with {m['tokenizer']['name']!r}, "
                             f"{mixture[0][0]!r} with {first['name']!r}; a mixture needs one tokenizer")
    train = _streams(mixture, manifests, "train", seq_len)
    assert train is not None  # (a source with no training sequence is refused)
    held = _streams(mixture, manifests, "eval", seq_len, refuse=require_held_out)

    def weights(split: str) -> list[float]:  # a folder's sources share its weight in proportion to their tokens
        return [w * src[split]["tokens"] / m["splits"][split]["tokens"]
                for (_, w), m in zip(mixture, manifests) for src in m["sources"]]

    labels = source_labels([(folder, src["input"] if len(m["sources"]) > 1 else None)
                            for (folder, _), m in zip(mixture, manifests) for src in m["sources"]])
    per_source = {label: MixtureBatches([stream], [1.0], seed=seed) for label, stream in zip(labels, held)} \
        if held is not None and len(held) > 1 else None
    return OpenedData(train=MixtureBatches(train, weights("train"), seed=seed),
                      held_out=None if held is None else MixtureBatches(held, weights("eval"), seed=seed),
                      num_train=sum(s.num_tokens for s in train),
                      num_held_out=0 if held is None else sum(s.num_tokens for s in held),
                      max_id=max(int(m["max_id"]) for m in manifests), tokenizer=first, held_out_sources=per_source)


def _streams(mixture: list[tuple[str, float]], manifests: list[dict[str, Any]], split: str, seq_len: int, *,
             refuse: bool = True) -> list[TokenStream] | None:
    """One split's stream of every source; a source with less than one sequence is refused in one
    line (or, refuse=False, gives None: the split is left out)."""
    streams = []
    for (folder, _), m in zip(mixture, manifests):
        for src in m["sources"]:
            stream = TokenStream(Path(folder), src[split]["shards"], m["dtype"], seq_len=seq_len,
                                 name=f"{folder}:{src['input']}", masked=bool(m.get("loss_mask")))
            if stream.num_windows >= 1:
                streams.append(stream)
            elif split == "train":
                raise ValueError(f"source {src['input']!r} of {folder!r} holds {stream.num_tokens} training tokens, "
                                 f"fewer than one sequence of {seq_len + 1}; use a shorter --seq-len or more data")
            elif refuse:
                raise ValueError(f"source {src['input']!r} of {folder!r} holds {stream.num_tokens} held-out tokens "
                                 f"(< one sequence of {seq_len + 1}); valid: --eval-every 0, a shorter --seq-len, "
                                 "or a larger prepare --holdout")
            else:
                return None
    return streams


def source_labels(sources: list[tuple[str, str | None]]) -> list[str]:
    """Short, distinct names of (folder, input or None) sources for their held-out losses: the
    folder's name (and the input's file name where given), with as many parent folders as tell
    apart folders of one name (data/books, other/books), and #2, #3 for a folder given twice."""
    parts = [Path(folder).resolve().parts for folder, _ in sources]
    depth = [1] * len(sources)

    def label(i: int) -> str:
        name = sources[i][1]
        return "/".join(parts[i][-depth[i]:]) + (f"/{Path(name).name}" if name is not None else "")

    while True:
        labels = [label(i) for i in range(len(sources))]
        grow = [i for i, text in enumerate(labels) if depth[i] < len(parts[i]) - 1
                and any(other == text and parts[j] != parts[i] for j, other in enumerate(labels))]
        if not grow:
            break
        for i in grow:
            depth[i] += 1
    seen: dict[str, int] = {}
    out = []
    for text in labels:
        seen[text] = seen.get(text, 0) + 1
        out.append(text if seen[text] == 1 else f"{text}#{seen[text]}")
    return out
