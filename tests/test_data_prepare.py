"""Prepared datasets: `shoal data prepare` round-trips every input kind to the tokenizer's own ids
(EOS after each document), holds out documents per source, works in parallel and resumes; the
reader's batches are a pure function of (seed, step), mixtures draw the sources in their weights,
and bad input is one line, exit 2, nothing left behind. The tokenizer is trained here, offline."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shoal import cli
from shoal.data import prepare as prep
from shoal.data.dataset import MixtureBatches, TokenStream, open_prepared, parse_mixture, permute, read_manifest
from shoal.data.prepare import PrepareConfig, prepare
from shoal.data.text import DataConfig, default_corpus, open_data, resolve_tokenizer
from shoal.testing.asserts import assert_user_error, one_line_error
from shoal.testing.fixtures import corpus_bpe

EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    """A 512-id byte-level BPE trained on the built-in corpus, saved as a Hugging Face folder."""
    return corpus_bpe(tmp_path_factory.mktemp("tok") / "bpe", 512, EOS)


DOCS = [p for p in default_corpus().split("\n\n") if p.strip()][:600]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The documents as jsonl (plain and gzip) and as a folder of .txt files."""
    folder = tmp_path_factory.mktemp("in")
    lines = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS))
    (folder / "a.jsonl").write_text(lines)
    (folder / "a.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (folder / "txt").mkdir()
    for i, d in enumerate(DOCS[:50]):
        (folder / "txt" / f"{i:03d}.txt").write_text(d)
    return folder


def _documents(out: Path, source: int, split: str) -> list[list[int]]:
    """Every document of a split of a source, read back through the shards' document index."""
    manifest = read_manifest(out)
    docs = []
    for shard in manifest["sources"][source][split]["shards"]:
        tokens = np.fromfile(out / f"{shard['name']}.bin", dtype=manifest["dtype"])
        offsets = np.fromfile(out / f"{shard['name']}.idx", dtype=np.int64)
        docs += [tokens[a:b].tolist() for a, b in itertools.pairwise(offsets)]
    return docs


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != prep.MANIFEST}


def test_jsonl_round_trips_to_the_tokenizers_ids_with_eos_and_holdout(bpe, corpus, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "ds"
    manifest = prepare(PrepareConfig(inputs=[str(corpus / "a.jsonl")], tokenizer=str(bpe), out=str(out),
                                     holdout=0.1, shard_mb=0.02, workers=1), progress=False)
    ref = AutoTokenizer.from_pretrained(str(bpe), local_files_only=True)
    eos = ref.convert_tokens_to_ids(EOS)
    train, held = _documents(out, 0, "train"), _documents(out, 0, "eval")
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["eos_id"] == eos
    assert len(train) + len(held) == len(DOCS) == manifest["splits"]["train"]["documents"] + len(held)
    assert sum(map(len, train)) == manifest["splits"]["train"]["tokens"]
    shards = manifest["sources"][0]["train"]["shards"]
    assert len(shards) > 3  # several shards, so the hold-out rule is exercised across shard boundaries
    # Each shard holds out within one document of 10% (golden-ratio spacing): over n shards, within n.
    assert abs(len(held) - 0.1 * len(DOCS)) <= len(shards)
    expected = [ref.encode(d, add_special_tokens=False) + [eos] for d in DOCS]
    assert sorted(map(tuple, train + held)) == sorted(map(tuple, expected))
    for split in (train, held):  # documents keep their order within a split
        rest = iter(expected)
        assert all(any(doc == e for e in rest) for doc in split)


def test_gzip_folder_and_workers_give_the_same_shards(bpe, corpus, tmp_path):
    kw = {"tokenizer": str(bpe), "holdout": 0.05, "shard_mb": 0.02}
    prepare(PrepareConfig(inputs=[str(corpus / "a.jsonl")], out=str(tmp_path / "one"), workers=1, **kw), progress=False)
    prepare(PrepareConfig(inputs=[str(corpus / "a.jsonl.gz")], out=str(tmp_path / "two"), workers=2, **kw),
            progress=False)
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    m = prepare(PrepareConfig(inputs=[str(corpus / "txt"), str(corpus / "a.jsonl")], out=str(tmp_path / "mix"),
                              **kw), progress=False)
    assert [s["kind"] for s in m["sources"]] == ["folder", "jsonl"]
    assert m["sources"][0]["train"]["documents"] + m["sources"][0]["eval"]["documents"] == 50
    assert m["sources"][0]["eval"]["documents"] >= 1  # every source holds out at least one document


def test_a_large_vocabulary_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(70_000)} | {EOS: 70_000, "[UNK]": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(tmp_path / "tok")
    (tmp_path / "in.jsonl").write_text('{"text": "w69999 w3 w65536"}\n{"text": "w1"}\n')
    m = prepare(PrepareConfig(inputs=[str(tmp_path / "in.jsonl")], tokenizer=str(tmp_path / "tok"),
                              out=str(tmp_path / "ds"), holdout=0.0, workers=1), progress=False)
    assert m["dtype"] == "uint32" and m["max_id"] == 70_000
    assert _documents(tmp_path / "ds", 0, "train") == [[69_999, 3, 65_536, 70_000], [1, 70_000]]


def test_an_interrupted_preparation_resumes_and_a_finished_one_is_skipped(bpe, corpus, tmp_path, monkeypatch):
    kw = {"inputs": [str(corpus / "a.jsonl")], "tokenizer": str(bpe), "holdout": 0.05, "shard_mb": 0.02, "workers": 1}
    prepare(PrepareConfig(out=str(tmp_path / "whole"), **kw), progress=False)
    real, calls = prep._work, []

    def interrupted(chunk):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(chunk.shard)
        return real(chunk)

    monkeypatch.setattr(prep, "_work", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(PrepareConfig(out=str(tmp_path / "cut"), **kw), progress=False)
    assert "no manifest.json" in one_line_error(read_manifest, tmp_path / "cut")  # a half-written set is never read
    assert "no manifest.json" in one_line_error(open_data, DataConfig(path=str(tmp_path / "cut")), seq_len=8, seed=0)
    calls.clear()
    monkeypatch.setattr(prep, "_work", lambda chunk: calls.append(chunk.shard) or real(chunk))
    prepare(PrepareConfig(out=str(tmp_path / "cut"), **kw), progress=False)
    assert calls[0] == 3 and _files(tmp_path / "cut") == _files(tmp_path / "whole")  # shards 0-2 were kept
    calls.clear()
    prepare(PrepareConfig(out=str(tmp_path / "cut"), **kw), progress=False)
    assert calls == []
    other = PrepareConfig(out=str(tmp_path / "cut"), **(kw | {"holdout": 0.2}))
    assert "other inputs or settings" in one_line_error(prepare, other, progress=False)


_KW = {"tokenizer": "byte", "field": "body", "holdout": 0.1, "workers": 1, "shard_mb": 1.0}
"""One shard per input, so the hold-out rule picks the same documents whatever the input kind."""


def _jsonl_reference(tmp_path) -> tuple[list[str], dict]:
    """(the texts, prepare's result) of a jsonl of 100 documents, the shards every reader must give."""
    texts = DOCS[:100]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in texts))
    return texts, prepare(PrepareConfig(inputs=[str(tmp_path / "in.jsonl")], out=str(tmp_path / "ref"), **_KW),
                          progress=False)


def _reads_as_the_jsonl(path, tmp_path, reference: dict, name: str) -> None:
    out = tmp_path / f"out-{name}"
    assert prepare(PrepareConfig(inputs=[str(path)], out=str(out), **_KW), progress=False)["splits"] == \
        reference["splits"]
    assert _files(out) == _files(tmp_path / "ref")


def test_parquet_reads_as_the_jsonl(corpus, tmp_path):
    """parquet (row groups of 17) gives the jsonl's shards; a missing column and a broken file are one-line refusals."""
    pa = pytest.importorskip("pyarrow", reason="the parquet reader needs pyarrow (the data and dev extras)")
    import pyarrow.parquet as pq

    texts, reference = _jsonl_reference(tmp_path)
    parquet = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "body": texts}), parquet, row_group_size=17)
    _reads_as_the_jsonl(parquet, tmp_path, reference, "parquet")
    bad = PrepareConfig(inputs=[str(parquet)], out=str(tmp_path / "bad"), **(_KW | {"field": "nope"}))
    assert "no column 'nope'" in one_line_error(prepare, bad, progress=False)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    cfg = PrepareConfig(inputs=[str(tmp_path / "broken.parquet")], out=str(tmp_path / "bad"), **_KW)
    assert "not a readable parquet" in one_line_error(prepare, cfg, progress=False)
    assert not (tmp_path / "bad").exists()


def test_saved_dataset_reads_as_the_jsonl(corpus, tmp_path):
    """A `datasets` folder (save_to_disk) gives the jsonl's shards; a missing column is a one-line refusal."""
    datasets = pytest.importorskip("datasets", reason="the saved-dataset reader needs datasets (the data and dev "
                                   "extras)")
    texts, reference = _jsonl_reference(tmp_path)
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(saved))
    _reads_as_the_jsonl(saved, tmp_path, reference, "saved")
    bad = PrepareConfig(inputs=[str(saved)], out=str(tmp_path / "bad"), **(_KW | {"field": "nope"}))
    assert "no column 'nope'" in one_line_error(prepare, bad, progress=False)
    assert not (tmp_path / "bad").exists()


def test_zstd_jsonl_reads_as_the_jsonl(corpus, tmp_path):
    zstandard = pytest.importorskip("zstandard", reason="the .zst reader needs zstandard (the data and dev extras)")
    _, reference = _jsonl_reference(tmp_path)
    zst = tmp_path / "in.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress((tmp_path / "in.jsonl").read_bytes()))
    _reads_as_the_jsonl(zst, tmp_path, reference, "zst")


@pytest.mark.parametrize("package, name, content", [("pyarrow", "t.parquet", b"PAR1 not really"),
                                                    ("datasets", "saved", None), ("zstandard", "in.jsonl.zst", b"")])
def test_an_input_whose_package_is_missing_is_refused_naming_it(corpus, tmp_path, monkeypatch, package, name,
                                                                content):
    """Where the reader's package is not installed the input is refused in one line naming it (the package
    hidden from import here, installed or not)."""
    for module in [m for m in sys.modules if m == package or m.startswith(f"{package}.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, package, None)  # `import package` raises ImportError
    path = tmp_path / name
    if content is None:
        path.mkdir()
        (path / "dataset_info.json").write_text("{}")
    else:
        path.write_bytes(content)
    message = one_line_error(prepare, PrepareConfig(inputs=[str(path)], out=str(tmp_path / "out"), **_KW),
                             progress=False)
    assert repr(package) in message, message
    assert package == "zstandard" or "shoal[data]" in message, message



# ----------------------------------------------------------------------------- reading


def test_permute_is_a_bijection_that_depends_on_its_key():
    for n in (1, 2, 7, 100, 1000):
        assert sorted(permute(np.arange(n), n, key=5).tolist()) == list(range(n))
    assert permute(np.arange(1000), 1000, 1).tolist() != permute(np.arange(1000), 1000, 2).tolist()


def _letters(tmp_path: Path, spec: dict[str, int]) -> dict[str, Path]:
    """One byte-tokenized dataset per letter, each document that letter repeated, so a row names its source."""
    out = {}
    for letter, docs in spec.items():
        (tmp_path / f"{letter}.jsonl").write_text("".join(json.dumps({"text": letter * (20 + i % 7)}) + "\n"
                                                          for i in range(docs)))
        out[letter] = tmp_path / letter
        prepare(PrepareConfig(inputs=[str(tmp_path / f"{letter}.jsonl")], tokenizer="byte", out=str(out[letter]),
                              holdout=0.1, workers=1), progress=False)
    return out


def test_the_mixture_draws_sources_in_their_weights_as_a_pure_function_of_seed_and_step(tmp_path):
    sets = _letters(tmp_path, {"a": 300, "b": 60})
    spec = f"{sets['a']}:0.7,{sets['b']}:0.3"
    one, two = (open_prepared(spec, seq_len=16, seed=3).train for _ in range(2))
    steps, size = 512, 16  # 8192 samples: two blocks of 4096, where the shares are exact to one sample
    counts = {"a": 0, "b": 0}
    for step in range(steps):
        x, y = one.batch(step, size)
        assert torch.equal(y[:, :-1], x[:, 1:])
        for row in x:
            letters = {chr(int(t)) for t in row if t != prep.BYTE_EOS}
            assert len(letters) == 1  # a sequence never mixes sources
            counts[letters.pop()] += 1
    assert abs(counts["a"] - 0.7 * steps * size) <= 1 and counts["a"] + counts["b"] == steps * size
    for step in (0, 77, 511):  # another instance (a resumed run), and rank slices of the same batch
        assert torch.equal(one.batch(step, size)[0], two.batch(step, size)[0])
        parts = [two.batch(step, size, (i, 4))[0] for i in range(4)]
        assert torch.equal(torch.cat(parts), one.batch(step, size)[0])
    assert not torch.equal(open_prepared(spec, seq_len=16, seed=4).train.batch(0, size)[0], one.batch(0, size)[0])


def test_a_source_visits_every_window_once_per_epoch_in_a_new_order(tmp_path):
    stream_set = _letters(tmp_path, {"c": 40})["c"]
    data = open_prepared(str(stream_set), seq_len=8, seed=0).train
    stream = data.streams[0]
    n = stream.num_windows
    epochs = [[data.window_of(0, e * n + i) for i in range(n)] for e in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(n)) and epochs[0] != epochs[1]
    tokens = np.concatenate([np.asarray(a) for a in stream.arrays])
    for w in (0, n // 2, n - 1):  # windows across shard boundaries read the concatenation
        assert stream.window(w).tolist() == tokens[w * 8: w * 8 + 9].tolist()
    starts = {step: data.new_epochs(step, 8) for step in range(3 * n // 8)}  # the log's "starts epoch e"
    assert {s: e for s, e in starts.items() if e} == {n // 8: [(stream.name, 2)], 2 * n // 8: [(stream.name, 3)]}


def test_a_mixture_with_one_weight_matches_the_folder_alone(tmp_path):
    folder = _letters(tmp_path, {"d": 50})["d"]
    alone, weighted = open_prepared(str(folder), seq_len=8, seed=1), open_prepared(f"{folder}:2", seq_len=8, seed=1)
    assert torch.equal(alone.train.batch(5, 8)[0], weighted.train.batch(5, 8)[0])
    assert isinstance(alone.train, MixtureBatches) and isinstance(alone.train.streams[0], TokenStream)


# ----------------------------------------------------------------------------- bad input


def test_bad_input_is_one_line_and_leaves_nothing(capsys, tmp_path):
    good = "".join(json.dumps({"text": "x" * 50}) + "\n" for _ in range(30))
    (tmp_path / "bad.jsonl").write_text(good + "{not json\n")
    (tmp_path / "nofield.jsonl").write_text(good + json.dumps({"body": "y"}) + "\n")
    (tmp_path / "empty.jsonl").write_text("\n")
    out = tmp_path / "out"
    base = ["data", "prepare", "--tokenizer", "byte", "--out", str(out), "--shard-mb", "0.0005"]
    assert_user_error(capsys, [*base, str(tmp_path / "bad.jsonl")], "bad.jsonl:31", "not a JSON line")
    assert not out.exists()
    assert_user_error(capsys, [*base, str(tmp_path / "nofield.jsonl")], "nofield.jsonl:31", "'text'", "body")
    assert_user_error(capsys, [*base, str(tmp_path / "empty.jsonl")], "empty.jsonl", "no documents")
    assert_user_error(capsys, [*base, str(tmp_path / "missing.jsonl")], "missing.jsonl", "does not exist")
    line = assert_user_error(capsys, [*base, "--workers", "0", str(tmp_path / "bad.jsonl")], "--workers 0", "1 or more")
    assert "--shard-mb" not in line
    assert_user_error(capsys, [*base, "--shard-mb", "0", str(tmp_path / "bad.jsonl")], "--shard-mb 0.0", "more than 0")
    assert_user_error(capsys, ["data", "prepare", "--workerz", "2"], "--workerz", "valid: --workers")  # not --tokenizer
    assert_user_error(capsys, ["data"], "required: prepare")
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_user_error(capsys, [*base, str(tmp_path / "bad.jsonl")], "not empty")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_training_data_errors(bpe, tmp_path):
    folder = _letters(tmp_path, {"e": 30})["e"]
    for weight in ("0", "-1", "x", "nan"):
        assert repr(weight) in one_line_error(parse_mixture, f"{folder}:0.5,{folder}:{weight}")
    assert "fewer than one sequence" in one_line_error(open_prepared, str(folder), seq_len=4096, seed=0)
    cfg = DataConfig(path=str(folder), tokenizer=str(bpe))
    assert "was prepared with" in one_line_error(resolve_tokenizer, cfg, given=True)
    assert "was prepared with" in one_line_error(open_data, cfg, seq_len=8, seed=0)
    assert resolve_tokenizer(DataConfig(path=str(folder)), given=False).tokenizer == "byte"
    other = tmp_path / "bpe-set"
    (tmp_path / "f.jsonl").write_text(json.dumps({"text": "hello world " * 20}) + "\n")
    prepare(PrepareConfig(inputs=[str(tmp_path / "f.jsonl")], tokenizer=str(bpe), out=str(other), holdout=0.0,
                          workers=1), progress=False)
    assert "one tokenizer" in one_line_error(open_prepared, f"{folder}:1,{other}:1", seq_len=4, seed=0)
    assert "held-out" in one_line_error(open_prepared, str(other), seq_len=4, seed=0)  # holdout 0: nothing held out


def test_train_reads_a_prepared_dataset_with_its_tokenizer(bpe, corpus, tmp_path, capsys):
    ds = tmp_path / "ds"
    assert cli.main(["data", "prepare", str(corpus / "a.jsonl"), "--tokenizer", str(bpe), "--out", str(ds),
                     "--holdout", "0.1", "--workers", "2"]) == 0
    small = ["--device", "cpu", "--nproc", "1", "--set", "num_layers=1", "--set", "dim=32", "--set", "ffn_dim=64",
             "--global-batch", "4", "--seq-len", "32", "--steps", "2", "--eval-every", "2", "--ckpt-every", "2"]
    assert_user_error(capsys, ["train", "--data", str(ds), "--tokenizer", "byte", *small], "'byte'", "prepared with")
    assert_user_error(capsys, ["train", "--data", str(ds), *small], "vocab_size=512")
    run = tmp_path / "run"
    assert cli.main(["train", "--data", str(ds), "--set", "vocab_size=512", "--out", str(run), *small]) == 0
    assert f'tokenizer = "{bpe}"' in (run / "config.toml").read_text()  # the manifest's, so shoal sample decodes
    assert len((run / "metrics.jsonl").read_text().splitlines()) >= 2
    assert os.path.isfile(ds / prep.MANIFEST)
    _export_carries_the_tokenizer(run, bpe, tmp_path / "hf")


def _export_carries_the_tokenizer(run: Path, bpe: Path, out: Path) -> None:
    """`shoal export --hf` of a run on prepared data copies the manifest's tokenizer files along:
    transformers reads the folder as a model (its logits equal shoal's for the exported weights, which
    are copies: float32 rounding of the same kernels, tests/test_hf_families.py's tolerance) and as a
    tokenizer (the same ids as the run's)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import shoal
    from shoal.train.export import tokenizer_files

    assert cli.main(["export", "--run", str(run), "--hf", "--out", str(out)]) == 0
    assert tokenizer_files("byte") == [] and tokenizer_files(None) == []
    with pytest.raises(ValueError, match="none of the files"):  # moved since the run: refused before writing
        tokenizer_files(str(out / "gone"))
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    # config.json names the tokenizer's end (and begin) of text, which transformers' generate stops at
    source = AutoTokenizer.from_pretrained(str(bpe))
    config = json.loads((out / "config.json").read_text())
    assert config.get("eos_token_id") == source.eos_token_id and source.eos_token_id is not None
    assert config.get("bos_token_id") == source.bos_token_id
    text = DOCS[0][:200]
    ids = AutoTokenizer.from_pretrained(str(out)).encode(text, add_special_tokens=False)
    assert ids == AutoTokenizer.from_pretrained(str(bpe)).encode(text, add_special_tokens=False)
    tokens = torch.tensor([ids[:32]])
    with torch.no_grad():
        expected = shoal.from_hf(out).eval()(tokens)
        got = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()(tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_run_on_a_mixture_resumes_with_the_unbroken_losses(bpe, corpus, tmp_path):
    """Batch s is a function of (seed, s) for a mixture too, with loss masks (a completion set) and
    --doc-mask on: stopping at step 2 and resuming on two processes under dp2 gives the unbroken
    one-process run's losses (to the order of sums: test_train_e2e.LOSS_REL's bound); held-out
    losses are reported per source and the batch fetch time per step."""
    kw = {"tokenizer": str(bpe), "holdout": 0.1, "workers": 1}
    pairs = "".join(json.dumps({"prompt": d[: len(d) // 3], "completion": d[len(d) // 3:]}) + "\n" for d in DOCS)
    (tmp_path / "pc.jsonl").write_text(pairs)
    prepare(PrepareConfig(inputs=[str(tmp_path / "pc.jsonl")], out=str(tmp_path / "a"), format="completion", **kw),
            progress=False)
    prepare(PrepareConfig(inputs=[str(corpus / "txt")], out=str(tmp_path / "b"), **kw), progress=False)
    small = ["--data", f"{tmp_path / 'a'}:0.6,{tmp_path / 'b'}:0.4", "--set", "vocab_size=512", "--device", "cpu",
             "--set", "num_layers=1", "--set", "dim=32", "--set", "ffn_dim=64", "--global-batch", "4",
             "--seq-len", "32", "--eval-every", "2", "--ckpt-every", "2", "--log-every", "1", "--doc-mask", "on",
             "--decay-steps", "4", "--warmup-steps", "1"]  # the same schedule for the part run
    assert cli.main(["train", "--out", str(tmp_path / "whole"), "--steps", "4", "--nproc", "1", *small]) == 0
    assert cli.main(["train", "--out", str(tmp_path / "part"), "--steps", "2", "--nproc", "1", *small]) == 0
    assert cli.main(["train", "--resume", str(tmp_path / "part"), "--steps", "4", "--nproc", "2", "--plan", "dp2"]) == 0

    def records(run: Path) -> list[dict]:
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    whole, part = records(tmp_path / "whole"), records(tmp_path / "part")
    assert [r["step"] for r in part] == [1, 2, 3, 4]
    assert [r["loss"] for r in part] == pytest.approx([r["loss"] for r in whole], rel=1e-4)
    assert "doc_eos_id" in (tmp_path / "part" / "config.toml").read_text()
    evals = [r for r in whole if "eval_loss" in r]
    assert len(evals) == 2 and all(set(r["eval_loss_by_source"]) == {"a", "b"} for r in evals)
    assert all(0 < r["data_time_s"] < r["step_time_s"] for r in whole)


def test_prepare_help_names_every_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["data", "prepare", "--help"])
    text = capsys.readouterr().out
    entries = [e for e in text.split("options:")[1].split("\n  -") if e.strip().startswith("-")]
    assert len(entries) == 7
    assert all("[" in e or "(required" in e for e in entries), entries


# ----------------------------------------------------------------------------- a new user's inputs


def test_a_single_text_is_split_by_tokens_not_held_out_whole(tmp_path):
    """A .txt given on its own (or a one-record jsonl) is one document: its last --holdout of
    tokens are held out and the rest trained on, the two parts disjoint and together the text."""
    text = DOCS[0] * 20
    (tmp_path / "novel.txt").write_text(text)
    (tmp_path / "other.txt").write_text(text[::-1])
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": text}) + "\n")
    out = tmp_path / "ds"
    m = prepare(PrepareConfig(inputs=[str(tmp_path / n) for n in ("novel.txt", "other.txt", "one.jsonl")],
                              tokenizer="byte", out=str(out), holdout=0.1, workers=1), progress=False)
    ids = list(text.encode())
    cut = int(len(ids) * 0.9)  # nanoGPT's split: the first 90% to train
    for k, source in enumerate(m["sources"]):
        assert source["train"]["documents"] == source["eval"]["documents"] == 1
        train, held = _documents(out, k, "train"), _documents(out, k, "eval")
        expected = ids[::-1] if k == 1 else ids
        assert train == [expected[:cut] + [prep.BYTE_EOS]] and held == [expected[cut:] + [prep.BYTE_EOS]]
    assert open_prepared(str(out), seq_len=64, seed=0).num_train == 3 * (cut + 1)


def test_a_source_left_with_nothing_to_train_on_is_refused_and_removed(capsys, tmp_path):
    (tmp_path / "two").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "two" / name).write_text(DOCS[1])
    out = tmp_path / "new" / "ds"
    base = ["data", "prepare", "--tokenizer", "byte", "--out", str(out), str(tmp_path / "two")]
    # The golden-ratio rule holds out documents 0 and 1 of a shard at holdout > 0.618.
    assert_user_error(capsys, [*base, "--holdout", "0.7"], "'" + str(tmp_path / "two") + "'", "0 tokens to train on",
                      "--holdout")
    assert not (tmp_path / "new").exists()  # nor the parent folder it made
    entry = {"input": "x.jsonl", "train": {"documents": 3, "tokens": 9}, "eval": {"documents": 0, "tokens": 0}}
    assert "holds out 0 tokens" in one_line_error(prep._check_splits, entry, 0.01)
    prep._check_splits(entry, 0.0)  # nothing held out is what --holdout 0 asks for


def test_a_source_holding_out_far_more_than_asked_is_warned_about(capsys, tmp_path):
    (tmp_path / "two").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "two" / name).write_text(DOCS[1])
    capsys.readouterr()
    prepare(PrepareConfig(inputs=[str(tmp_path / "two")], tokenizer="byte", out=str(tmp_path / "ds"), holdout=0.01,
                          workers=1), progress=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shoal: warning: ") and "holds out 50.0%" in err[0], err
    assert str(tmp_path / "two") in err[0] and "split by tokens" in err[0]
    lines = "".join(json.dumps({"text": d}) + "\n" for d in DOCS)
    (tmp_path / "many.jsonl").write_text(lines)
    prepare(PrepareConfig(inputs=[str(tmp_path / "many.jsonl")], tokenizer="byte", out=str(tmp_path / "many"),
                          holdout=0.01, workers=1), progress=False)
    assert capsys.readouterr().err == ""


def test_a_broken_compressed_input_is_one_line_and_leaves_nothing(capsys, tmp_path):
    import random

    rng = random.Random(0)  # text that does not compress to a few bytes, so a cut file is truncated mid-stream
    data = gzip.compress("".join(json.dumps({"text": "".join(rng.choices("abcdefgh ", k=200))}) + "\n"
                                 for _ in range(500)).encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    (tmp_path / "plain.jsonl.gz").write_text(json.dumps({"text": "not compressed"}) + "\n")
    corrupt = bytearray(data)
    corrupt[len(data) // 2: len(data) // 2 + 64] = b"\xff" * 64  # an invalid deflate block: zlib.error
    (tmp_path / "corrupt.jsonl.gz").write_bytes(bytes(corrupt))
    out = tmp_path / "out"
    for name in ("cut.jsonl.gz", "plain.jsonl.gz", "corrupt.jsonl.gz"):
        assert_user_error(capsys, ["data", "prepare", str(tmp_path / name), "--tokenizer", "byte", "--out", str(out),
                                   "--shard-mb", "0.01"], name, "cannot be decompressed")
        assert not out.exists()


def test_an_interrupted_preparation_that_meets_bad_input_leaves_nothing(monkeypatch, tmp_path):
    good = "".join(json.dumps({"text": "x" * 50}) + "\n" for _ in range(30))
    (tmp_path / "bad.jsonl").write_text(good + "{not json\n")
    cfg = PrepareConfig(inputs=[str(tmp_path / "bad.jsonl")], tokenizer="byte", out=str(tmp_path / "out"),
                        shard_mb=0.0005, workers=1)
    real = prep._work
    monkeypatch.setattr(prep, "_work", lambda chunk: real(chunk) if chunk.shard < 2 else (_ for _ in ()).throw(
        KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, progress=False)
    assert (tmp_path / "out" / prep.PROGRESS).is_file()  # kept to resume
    monkeypatch.setattr(prep, "_work", real)
    assert "bad.jsonl:31" in one_line_error(prepare, cfg, progress=False)
    assert list((tmp_path / "out").iterdir()) == []  # the resumed preparation's shards and progress too


def test_empty_inputs_are_refused_and_empty_files_in_a_folder_skipped(capsys, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "a.txt").write_text("")
    (tmp_path / "some").mkdir()
    (tmp_path / "some" / "a.txt").write_text("")
    (tmp_path / "some" / "b.txt").write_text("text")
    out = tmp_path / "out"
    base = ["data", "prepare", "--tokenizer", "byte", "--out", str(out)]
    assert_user_error(capsys, [*base, str(tmp_path / "empty.txt")], "empty.txt", "is empty")
    assert_user_error(capsys, [*base, str(tmp_path / "none")], "'" + str(tmp_path / "none") + "'", "no .txt files")
    assert not out.exists()
    m = prepare(PrepareConfig(inputs=[str(tmp_path / "some")], tokenizer="byte", out=str(out), holdout=0.0,
                              workers=1), progress=False)
    assert _documents(out, 0, "train") == [[*b"text", prep.BYTE_EOS]] and m["splits"]["eval"]["documents"] == 0
    (tmp_path / "some" / "c.txt").symlink_to(tmp_path / "gone.txt")
    assert_user_error(capsys, [*base.copy()[:-1], str(tmp_path / "out2"), str(tmp_path / "some")], "c.txt",
                      "broken link")
    assert not (tmp_path / "out2").exists()


def test_chat_messages_are_checked_one_by_one_and_untargeted_ones_counted(bpe, capsys, tmp_path):
    from shoal.data.finetune import validate

    def where() -> str:
        return "c.jsonl:7"

    user, helper = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
    assert validate("chat", [user, helper], where) == [user, helper]
    message = one_line_error(validate, "chat", [user, {"role": "usr", "content": "x"}], where)
    assert all(s in message for s in ("c.jsonl:7", "message 1", "'usr'", "system, user, assistant, tool")), message
    message = one_line_error(validate, "chat", [user, helper, {"role": "user"}], where)
    assert all(s in message for s in ("c.jsonl:7", "message 2", "'content'")), message
    assert "message 0" in one_line_error(validate, "chat", [{"content": "x"}], where)
    assert "message 1 is str" in one_line_error(validate, "chat", [user, "hi"], where)

    chat = tmp_path / "chat"
    shutil.copytree(bpe, chat)
    (chat / "chat_template.jinja").write_text("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                                              "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    records = [[user, helper]] * 5 + [[user]] * 3 + [[user, helper]]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": r}) + "\n" for r in records))
    capsys.readouterr()
    prepare(PrepareConfig(inputs=[str(tmp_path / "c.jsonl")], tokenizer=str(chat), out=str(tmp_path / "ds"),
                          field="messages", format="chat", holdout=0.0, workers=1, shard_mb=0.0001), progress=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shoal: warning: 3 conversations"), err
    assert "no assistant turn" in err[0] and "c.jsonl:6" in err[0]  # the first one, several shards in


def test_data_without_held_out_tokens_trains_when_nothing_is_evaluated(tmp_path):
    (tmp_path / "f.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:20]))
    prepare(PrepareConfig(inputs=[str(tmp_path / "f.jsonl")], tokenizer="byte", out=str(tmp_path / "h0"),
                          holdout=0.0, workers=1), progress=False)
    message = one_line_error(open_prepared, str(tmp_path / "h0"), seq_len=16, seed=0)
    assert "0 held-out tokens" in message and "--eval-every 0" in message
    opened = open_prepared(str(tmp_path / "h0"), seq_len=16, seed=0, require_held_out=False)
    assert opened.held_out is None and opened.held_out_sources is None and opened.num_held_out == 0
    assert opened.train.batch(0, 4)[0].shape == (4, 16)
    held = _letters(tmp_path, {"g": 30})["g"]  # data that has a held-out split keeps it
    assert open_prepared(str(held), seq_len=8, seed=0, require_held_out=False).held_out is not None
    # through shoal train: --eval-every 0 trains on it (no held-out loss), the default is refused in one line
    from shoal import cli

    flags = ["train", "--data", str(tmp_path / "h0"), "--device", "cpu", "--nproc", "1", "--steps", "2",
             "--seq-len", "16", "--global-batch", "2", "--set", "num_layers=1", "--set", "dim=32", "--set",
             "ffn_dim=64"]
    assert cli.main([*flags, "--out", str(tmp_path / "r0"), "--eval-every", "0"]) == 0
    records = [json.loads(line) for line in (tmp_path / "r0" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and not any("eval_loss" in r for r in records)
    assert cli.main([*flags, "--out", str(tmp_path / "r1")]) == 2


def test_sources_of_folders_with_one_name_keep_their_held_out_losses_apart(tmp_path):
    folders = []
    for parent, letter in (("data", "h"), ("other", "i")):
        (tmp_path / parent).mkdir()
        folders.append(_letters(tmp_path / parent, {letter: 40})[letter].rename(tmp_path / parent / "books"))
    opened = open_prepared(f"{folders[0]}:0.5,{folders[1]}:0.5", seq_len=8, seed=0)
    assert opened.held_out_sources is not None and set(opened.held_out_sources) == {"data/books", "other/books"}
    twice = open_prepared(f"{folders[0]}:0.5,{folders[0]}:0.5", seq_len=8, seed=0)
    assert twice.held_out_sources is not None and set(twice.held_out_sources) == {"books", "books#2"}
