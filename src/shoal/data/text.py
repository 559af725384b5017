"""Text in, token batches out: the offline default corpus, the user's own data, tokenizers,
and a sampler that is a pure function of (seed, step).

Because batch `step` is computed from the seed and the step alone, a run that resumes at step
s sees exactly the sequences an unbroken run would have, whatever the number of processes:
each data-parallel rank takes its contiguous slice of the same global batch.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the text comes from and how it becomes tokens."""

    path: str | None = None
    """None: the built-in corpus (Python's pydoc topics, offline). Else a folder of .txt files,
    a .txt file, a pre-tokenized .bin (uint16, nanoGPT layout) or .npy token file, a folder made
    by `shoal data prepare` (recognised by its manifest), or a mixture of such folders
    "DIR_A:0.7,DIR_B:0.3" (shoal.data.dataset)."""
    tokenizer: str = "byte"
    """byte (UTF-8 bytes, 256 ids) or the path of a local Hugging Face tokenizer folder; for a
    prepared dataset, the one it was prepared with (any other is refused)."""
    val_fraction: float = 0.05
    """Share of the tokens (at the end) held out for evaluation; a prepared dataset holds out
    its own (shoal data prepare --holdout)."""
    doc_mask: bool = False
    """Keep attention inside each document of the packed sequences, positions restarting at each
    (the model's doc_eos_id, set to the prepared dataset's EOS id); prepared datasets only."""


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class Batches(Protocol):
    """A sampler whose batch `step` is a pure function of (seed, step, size): TokenBatches here,
    shoal.data.dataset.MixtureBatches for prepared datasets."""

    def batch(self, step: int, size: int, part: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids; needs no files and no training."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local folder (never downloaded)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # transformers raises several types for a bad folder
            raise ValueError(f"tokenizer {path!r} could not be loaded locally ({type(exc).__name__}); "
                             "valid: 'byte' or a folder holding tokenizer.json / tokenizer_config.json") from None
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)  # type: ignore[return-value]  # one list of ids decodes to one str

    def special_ids(self) -> dict[str, int]:
        """The begin and end token ids a Hugging Face config names (those the tokenizer has)."""
        ids = {"bos_token_id": self._tok.bos_token_id, "eos_token_id": self._tok.eos_token_id}
        return {k: int(v) for k, v in ids.items() if isinstance(v, int)}


def load_tokenizer(name: str) -> Tokenizer:
    if name == "byte":
        return ByteTokenizer()
    if not Path(name).exists():
        raise ValueError(f"tokenizer {name!r} not found; valid: 'byte' or a local Hugging Face tokenizer folder")
    return HFTokenizer(name)


def default_corpus() -> str:
    """About 465K characters of English prose that ship with every Python: the pydoc topics."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def load_tokens(cfg: DataConfig, tokenizer: Tokenizer) -> np.ndarray:
    """The whole corpus as a 1-D array of token ids (memory-mapped for token files)."""
    if cfg.path is None:
        return _encode(default_corpus(), tokenizer)
    path = Path(cfg.path)
    if not path.exists():
        raise _no_such_data(cfg.path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise ValueError(f"data folder {cfg.path!r} holds no .txt files")
        return _encode("\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files), tokenizer)
    if path.suffix in (".bin", ".npy"):
        try:  # numpy's own errors (odd byte count, empty file, not an .npy) do not name the file
            tokens = (np.memmap(path, dtype=np.uint16, mode="r") if path.suffix == ".bin"
                      else np.load(path, mmap_mode="r"))
        except (ValueError, OSError, EOFError) as exc:
            raise ValueError(f"token file {cfg.path!r} cannot be read ({' '.join(str(exc).split())[:120]}); "
                             "valid: a .bin of uint16 tokens or an .npy 1-D integer array") from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"token file {cfg.path!r} must hold a 1-D integer array; "
                             f"got {tokens.dtype} {tokens.shape}")
        return tokens
    if path.suffix in (".txt", ".md", ""):
        return _encode(path.read_text(encoding="utf-8", errors="replace"), tokenizer)
    raise ValueError(f"data file {cfg.path!r} has an unknown type; valid: a folder, .txt, .bin (uint16) or .npy")


def _encode(text: str, tokenizer: Tokenizer) -> np.ndarray:
    ids = tokenizer.encode(text)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.int32
    return np.asarray(ids, dtype=dtype)


class TokenBatches:
    """Non-overlapping windows of seq_len + 1 tokens, visited in a seeded random order per epoch.

    `global_batch(step, size)` is a pure function of (seed, step, size): that is what makes
    resume exact and lets any number of ranks agree on the batch without talking.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, seed: int) -> None:
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"the data holds {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}; "
                             "use a shorter --seq-len or more data")

    # B019: the cache holds at most four (dataset, epoch) keys, so it keeps at most four datasets alive.
    @functools.lru_cache(maxsize=4)  # noqa: B019
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def windows(self, first: int, count: int) -> np.ndarray:
        """Window indices of samples first .. first+count-1 of the endless shuffled stream."""
        samples = np.arange(first, first + count)
        return np.array([self._order(int(s // self.num_windows))[s % self.num_windows] for s in samples])

    def batch(self, step: int, size: int, part: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (B, T) of this rank's slice `part` = (index, count) of global batch `step`."""
        index, count = part
        local = size // count
        rows = [self._window(w) for w in self.windows(step * size + index * local, local)]
        seq = torch.from_numpy(np.stack(rows).astype(np.int64))
        return seq[:, :-1], seq[:, 1:]

    def _window(self, w: int) -> np.ndarray:
        start = int(w) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1])


def split_tokens(tokens: np.ndarray, val_fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and held-out tokens: the last val_fraction of the corpus (at least one sequence)."""
    num_val = max(int(len(tokens) * val_fraction), seq_len + 1)
    if len(tokens) - num_val < seq_len + 1:
        raise ValueError(f"the data holds {len(tokens)} tokens: too few for a training and a held-out split "
                         f"at --seq-len {seq_len}")
    return tokens[:-num_val], tokens[-num_val:]


def open_data(cfg: DataConfig, *, seq_len: int, seed: int, max_id: bool = False, held_out: bool = True) -> Any:
    """The training and held-out samplers (shoal.data.dataset.OpenedData): prepared datasets and
    mixtures through memory maps, every other input through load_tokens. `max_id`: also find the
    largest token id (a scan of the tokens for inputs without a manifest). `held_out` False: the run
    evaluates only where the data has a held-out split (--eval-every 0), so prepared data without one
    (--holdout 0) opens with none."""
    from shoal.data.dataset import OpenedData, is_prepared_spec, open_prepared

    if is_prepared_spec(cfg.path):
        assert cfg.path is not None
        opened = open_prepared(cfg.path, seq_len=seq_len, seed=seed, require_held_out=held_out)
        _check_tokenizer(cfg.tokenizer, opened.tokenizer, cfg.path)
        return opened
    tokens = load_tokens(cfg, load_tokenizer(cfg.tokenizer))
    train, kept = split_tokens(tokens, cfg.val_fraction, seq_len)
    top = (int(tokens.max()) if len(tokens) else 0) if max_id else -1
    return OpenedData(train=TokenBatches(train, seq_len=seq_len, seed=seed),
                      held_out=TokenBatches(kept, seq_len=seq_len, seed=seed),
                      num_train=len(train), num_held_out=len(kept), max_id=top)


def resolve_tokenizer(cfg: DataConfig, *, given: bool) -> DataConfig:
    """For prepared data the tokenizer is the manifest's: taken when --tokenizer was not given,
    checked when it was (ValueError in one line if it differs)."""
    from shoal.data.dataset import is_prepared_spec, parse_mixture, read_manifest

    if not is_prepared_spec(cfg.path):
        return cfg
    assert cfg.path is not None
    folder = parse_mixture(cfg.path)[0][0]
    stored = read_manifest(folder)["tokenizer"]
    if given:
        _check_tokenizer(cfg.tokenizer, stored, cfg.path)
        return cfg
    return dataclasses.replace(cfg, tokenizer=stored["name"])


def _check_tokenizer(name: str, stored: dict[str, Any] | None, data: str) -> None:
    from shoal.data.prepare import tokenizer_identity

    if stored is not None and tokenizer_identity(name)["sha256"] != stored["sha256"]:
        raise ValueError(f"--tokenizer {name!r} is not the tokenizer --data {data!r} was prepared with "
                         f"({stored['name']!r}); leave --tokenizer out to use that one")


def _no_such_data(path: str) -> ValueError:
    return ValueError(f"data path {path!r} does not exist; valid: a folder of .txt files, a .txt, .bin or .npy file, "
                      "a folder `shoal data prepare` made, or a mixture of them (DIR_A:0.7,DIR_B:0.3)")


def doc_eos_id(cfg: DataConfig) -> int:
    """The token id that ends documents, for --doc-mask on: the prepared dataset's EOS (ValueError
    in one line for other data, whose documents are not marked)."""
    from shoal.data.dataset import is_prepared_spec, parse_mixture, read_manifest

    if cfg.path is not None and ":" not in cfg.path and not Path(cfg.path).exists():  # one source, not there
        raise _no_such_data(cfg.path)
    if not is_prepared_spec(cfg.path):
        raise ValueError(f"--doc-mask on needs data made by shoal data prepare (documents ended by EOS); "
                         f"--data {cfg.path or 'the built-in corpus'!r} is not; valid: a prepared --data, or "
                         "--doc-mask off")
    assert cfg.path is not None
    return int(read_manifest(parse_mixture(cfg.path)[0][0])["tokenizer"]["eos_id"])
