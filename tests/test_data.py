"""Data: the sampler is a pure function of (seed, step), ranks' slices tile the global batch, a
resumed run sees the unbroken sequence, the corpus and token files load, tokenizers work offline."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from shoal.data.text import (
    ByteTokenizer,
    DataConfig,
    TokenBatches,
    default_corpus,
    load_tokenizer,
    load_tokens,
    split_tokens,
)
from shoal.testing.asserts import one_line_error

SEQ = 16
NUM_WINDOWS = 40
# Token value = position in the corpus, so a row tells which window it came from.
TOKENS = np.arange(NUM_WINDOWS * SEQ + 1, dtype=np.int64)


def _window_ids(inputs: torch.Tensor) -> list[int]:
    return [int(row[0]) // SEQ for row in inputs]


def test_batches_are_deterministic_and_differ_across_seeds():
    a, b, c = (TokenBatches(TOKENS, seq_len=SEQ, seed=s) for s in (0, 0, 1))
    x, y = a.batch(3, 8)
    assert x.shape == y.shape == (8, SEQ) and x.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])  # targets are the inputs shifted by one token
    assert torch.equal(x, b.batch(3, 8)[0]) and torch.equal(y, b.batch(3, 8)[1])
    assert not torch.equal(x, c.batch(3, 8)[0])
    assert not torch.equal(x, a.batch(4, 8)[0])


@pytest.mark.parametrize("count", [2, 4])
def test_rank_slices_tile_the_global_batch(count):
    data = TokenBatches(TOKENS, seq_len=SEQ, seed=0)
    for step in (0, 7):
        whole = data.batch(step, 8)
        parts = [data.batch(step, 8, (i, count)) for i in range(count)]
        assert all(p[0].shape == (8 // count, SEQ) for p in parts)
        assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
        assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])


@pytest.mark.parametrize("batch", [8, 6], ids=["divides-epoch", "straddles-epoch"])
def test_resume_continues_the_unbroken_stream(batch):
    unbroken = TokenBatches(TOKENS, seq_len=SEQ, seed=3)
    stream = [unbroken.batch(step, batch)[0] for step in range(14)]
    resumed = TokenBatches(TOKENS, seq_len=SEQ, seed=3)  # a new process after the checkpoint at step 5
    for step in range(5, 14):
        assert torch.equal(resumed.batch(step, batch)[0], stream[step])
    seen = [w for x in stream for w in _window_ids(x)]
    # Every epoch (40 consecutive samples of the stream) visits every window exactly once.
    assert sorted(seen[:NUM_WINDOWS]) == list(range(NUM_WINDOWS))
    assert sorted(seen[NUM_WINDOWS:2 * NUM_WINDOWS]) == list(range(NUM_WINDOWS))
    assert seen[:NUM_WINDOWS] != seen[NUM_WINDOWS:2 * NUM_WINDOWS]  # a fresh order each epoch


def test_default_corpus_is_real_text():
    text = default_corpus()
    assert len(text) > 400_000
    words = text.split()
    assert sum(w.lower() == "the" for w in words) > 1000  # English prose, not random tokens
    tokens = load_tokens(DataConfig(), ByteTokenizer())
    assert len(tokens) == len(text.encode("utf-8")) and tokens.dtype == np.uint16
    train, val = split_tokens(tokens, 0.05, 256)
    assert len(train) + len(val) == len(tokens) and len(val) == int(len(tokens) * 0.05)


def test_user_files_load(tmp_path):
    byte = ByteTokenizer()
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("second")
    (folder / "a.txt").write_text("first")
    (folder / "sub" / "c.txt").write_text("third")
    (folder / "skip.json").write_text("{}")
    got = load_tokens(DataConfig(path=str(folder)), byte)
    assert byte.decode(list(got)) == "first\n\nsecond\n\nthird"  # sorted paths, .txt only

    (tmp_path / "one.txt").write_text("héllo")
    assert byte.decode(list(load_tokens(DataConfig(path=str(tmp_path / "one.txt")), byte))) == "héllo"

    ids = np.arange(1000, dtype=np.uint16) * 37
    ids.tofile(tmp_path / "tokens.bin")
    from_bin = load_tokens(DataConfig(path=str(tmp_path / "tokens.bin")), byte)
    assert isinstance(from_bin, np.memmap) and np.array_equal(from_bin, ids)

    np.save(tmp_path / "tokens.npy", ids.astype(np.int32))
    from_npy = load_tokens(DataConfig(path=str(tmp_path / "tokens.npy")), byte)
    assert np.array_equal(from_npy, ids) and from_npy.dtype == np.int32
    x, y = TokenBatches(from_npy, seq_len=8, seed=0).batch(0, 4)  # memory-mapped tokens batch too
    assert x.shape == (4, 8) and torch.equal(y[:, :-1], x[:, 1:])


def test_bad_data_gives_one_line_errors(tmp_path):
    byte = ByteTokenizer()

    def load(name: str) -> str:
        return one_line_error(load_tokens, DataConfig(path=str(tmp_path / name)), byte)

    (tmp_path / "empty").mkdir()
    np.save(tmp_path / "float.npy", np.zeros(10, dtype=np.float32))
    np.save(tmp_path / "matrix.npy", np.zeros((2, 3), dtype=np.int32))
    (tmp_path / "garbage.npy").write_bytes(b"not an npy file at all")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    (tmp_path / "data.csv").write_text("1,2,3")
    assert "does not exist; valid: a folder of .txt files" in load("missing")
    assert "holds no .txt files" in load("empty")
    assert "must hold a 1-D integer array; got float32 (10,)" in load("float.npy")
    assert "must hold a 1-D integer array; got int32 (2, 3)" in load("matrix.npy")
    assert "garbage.npy" in load("garbage.npy") and "cannot be read" in load("garbage.npy")
    assert "odd.bin" in load("odd.bin") and "cannot be read" in load("odd.bin")
    assert "unknown type; valid: a folder, .txt, .bin (uint16) or .npy" in load("data.csv")
    assert "fewer than one sequence of 17" in one_line_error(TokenBatches, np.arange(10), seq_len=16, seed=0)
    assert "too few for a training and a held-out split" in one_line_error(split_tokens, np.arange(30), 0.1, 16)
    assert "tokenizer 'no/such/tok' not found; valid: 'byte'" in one_line_error(load_tokenizer, "no/such/tok")
    assert "could not be loaded locally" in one_line_error(load_tokenizer, str(tmp_path / "empty"))


def test_local_hugging_face_tokenizer(tmp_path):
    """Train a tiny byte-level BPE offline, save it as a transformers tokenizer folder, load it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator([default_corpus()[:100_000]], trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(str(tmp_path / "tok"))

    tok = load_tokenizer(str(tmp_path / "tok"))
    assert tok.vocab_size == 512
    text = "The built-in functions are always available. Ünïcode too."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8"))  # merges learned: fewer tokens than bytes
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(text)
    tokens = load_tokens(DataConfig(path=str(tmp_path / "docs")), tok)
    assert tokens.tolist() == ids and tokens.dtype == np.uint16
