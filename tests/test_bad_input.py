"""Bad input for the newest inputs: prepared datasets, mixtures, chat and completion files, --init's weights and
config.json, shoal distill's teacher, TOML config files and the newest flags, each got wrong as a user would.
Every case is refused by the command itself (cli.main, in-process) in one line `shoal: error: ...` that names
the bad value and what is valid, with exit status 2 and no traceback, and loses nothing: every file in the
case's folder (the run folder it resumes, the dataset it reads, the teacher it distils, the folder it prepares
into) has the same bytes afterwards, and nothing new is written there.

CASES is the table: a case's id, what it sets up and runs, and the words its one line must hold.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from shoal.apply_plan import parallelize
from shoal.data.prepare import PrepareConfig, prepare
from shoal.data.text import DataConfig
from shoal.models import ModelConfig, Transformer, preset
from shoal.testing.asserts import assert_user_error, file_digests
from shoal.train.checkpoint import save_checkpoint
from shoal.train.config import LoopConfig, RunConfig, to_flat
from shoal.train.job import write_run_config

SMALL = ("num_layers=2", "dim=64", "ffn_dim=128")
TRAIN = ["train", "--device", "cpu", "--nproc", "1", "--steps", "1", "--seq-len", "32", "--global-batch", "8",
         *[arg for item in SMALL for arg in ("--set", item)]]
MOE = ModelConfig(num_layers=2, dim=32, num_heads=4, ffn_dim=48, vocab_size=256, max_seq_len=32, num_experts=4,
                  top_k=2)
"""A teacher small enough to save in a blink."""
GOOD_CHAT = {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]}


@dataclass(frozen=True)
class Shared:
    """What the cases copy from (made once): a prepared dataset, a safetensors file of the small model, and a
    tokenizer folder with a chat template."""

    dataset: Path
    weights: Path
    chat_tokenizer: Path


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Shared:
    root = tmp_path_factory.mktemp("shared")
    text = root / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i} says hello to the world. " * 4}) + "\n"
                            for i in range(200)))
    prepare(PrepareConfig(inputs=[str(text)], tokenizer="byte", out=str(root / "ds"), workers=1, holdout=0.05),
            progress=False)
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = Transformer(preset("tiny").with_overrides(list(SMALL)))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "w.safetensors"))
    return Shared(dataset=root / "ds", weights=root / "w.safetensors", chat_tokenizer=_chat_tokenizer(root / "tok"))


def _chat_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer with an EOS and a chat template: all that --format chat asks of one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir()
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<eos>", "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template}))
    return folder


@dataclass
class Case:
    """Where one case sets up its files: `root` is the folder whose files must not change."""

    root: Path
    shared: Shared

    @property
    def out(self) -> Path:
        """The new run (or dataset) folder a command names: a refusal never creates it."""
        return self.root / "out"

    def dataset(self, damage: Callable[[Path], None] | None = None) -> Path:
        """A copy of the prepared dataset, damaged by `damage`."""
        folder = self.root / "ds"
        if not folder.exists():
            shutil.copytree(self.shared.dataset, folder)
        if damage is not None:
            damage(folder)
        return folder

    def train(self, *argv: str) -> list[str]:
        return [*TRAIN, "--out", str(self.out), *argv]

    def run_folder(self, data: Path) -> Path:
        """A run folder as shoal train leaves it (config.toml naming `data`, a checkpoint at step 1)."""
        cfg = RunConfig(model_config=preset("tiny").with_overrides(list(SMALL)), device="cpu", nproc=1,
                        data=DataConfig(path=str(data)), loop=LoopConfig(steps=2, seq_len=32, global_batch=8))
        return _run_folder(self.root / "run", cfg, Transformer(cfg.model_config))

    def teacher(self, *, checkpoint: str) -> Path:
        """A teacher run of an MoE model: `checkpoint` "done" (one at step 1), "writing" (only one half-written, as
        while the teacher trains towards its first) or "none"."""
        folder = self.root / "teacher"
        cfg = RunConfig(model_config=MOE, device="cpu")
        if checkpoint == "done":
            return _run_folder(folder, cfg, Transformer(MOE))
        folder.mkdir()
        write_run_config(folder, cfg)
        if checkpoint == "writing":
            partial = folder / "checkpoints" / "step_00000001.tmp-3f2a"
            partial.mkdir(parents=True)
            (partial / "__0_0.distcp").write_bytes(bytes(4096))
        return folder

    def chat(self, *lines: object, fmt: str = "chat") -> list[str]:
        """`shoal data prepare` of a jsonl file of `lines` (dicts as JSON, strings as they are)."""
        path = self.root / f"{fmt}.jsonl"
        path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
        tokenizer = str(self.shared.chat_tokenizer) if fmt == "chat" else "byte"
        return ["data", "prepare", str(path), "--out", str(self.out), "--format", fmt, "--tokenizer", tokenizer,
                "--workers", "1"]

    def toml(self, text: str) -> list[str]:
        path = self.root / "run.toml"
        path.write_text(text)
        return self.train("--config", str(path))

    def weights(self, keep: Callable[[bytes], bytes]) -> Path:
        """The small model's safetensors file, its bytes passed through `keep`."""
        path = self.root / "w.safetensors"
        path.write_bytes(keep(self.shared.weights.read_bytes()))
        return path


def _run_folder(folder: Path, cfg: RunConfig, module: torch.nn.Module) -> Path:
    folder.mkdir(parents=True)
    write_run_config(folder, cfg)
    save_checkpoint(folder, 1, runtime=parallelize(module), optimizer=None, extra={"step": 1, "config": to_flat(cfg)})
    return folder


# ----------------------------------------------------------------------------- ways to damage a prepared dataset

SHARD = "000-000000.train.bin"


def _truncate(folder: Path) -> None:
    data = (folder / SHARD).read_bytes()
    (folder / SHARD).write_bytes(data[: len(data) // 2])


def _edit_manifest(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        manifest = json.loads((folder / "manifest.json").read_text())
        edit(manifest)
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return damage


def _more_tokens(manifest: dict) -> None:
    manifest["sources"][0]["train"]["shards"][0]["tokens"] += 100


def _half_prepared(folder: Path) -> None:
    (folder / "manifest.json").rename(folder / "progress.json")


def _resume_on_damaged_data(c: Case) -> list[str]:
    run = c.run_folder(c.dataset())
    _truncate(c.root / "ds")  # the data the run trained on, cut short since
    return ["train", "--resume", str(run), "--steps", "2"]


def _prepare_again_over_damage(c: Case) -> list[str]:
    """The same `shoal data prepare` command again, over its own output whose shard was since cut short."""
    source = json.loads((c.shared.dataset / "manifest.json").read_text())["config"]
    c.dataset(_truncate)
    return ["data", "prepare", *source["inputs"], "--out", str(c.root / "ds"), "--tokenizer", "byte", "--workers",
            "1", "--holdout", str(source["holdout"])]


def _mixture(weights: str) -> Callable[[Case], list[str]]:
    """--data of the dataset and a second item, `weights` with {ds} for the dataset's folder."""
    return lambda c: c.train("--data", weights.format(ds=c.dataset()))


# ----------------------------------------------------------------------------- the table

class Row(NamedTuple):
    id: str
    argv: Callable[[Case], list[str]]
    words: tuple[str, ...]


CASES = [
    # shoal data prepare's output, read by shoal train --data
    Row("shard cut short", lambda c: c.train("--data", str(c.dataset(_truncate))),
        (SHARD, "holds 28,505 bytes", "manifest.json's 28,505 uint16 tokens take 57,010", "cut short",
         "valid: the files as shoal data prepare wrote them")),
    Row("shard cut to whole tokens", lambda c: c.train("--data", str(c.dataset(
        lambda f: (f / SHARD).write_bytes((f / SHARD).read_bytes()[:1000])))),  # read as 500 tokens before
        (SHARD, "holds 1,000 bytes", "take 57,010", "cut short")),
    Row("shard missing", lambda c: c.train("--data", str(c.dataset(lambda f: (f / SHARD).unlink()))),
        (SHARD, "which manifest.json lists, is missing", "valid:")),
    Row("manifest counts other tokens", lambda c: c.train("--data", str(c.dataset(_edit_manifest(_more_tokens)))),
        ("manifest.json is not a whole shoal-tokens manifest", "hold 28,605 tokens", "total says 28505", "valid:")),
    Row("manifest of another dtype", lambda c: c.train("--data", str(c.dataset(_edit_manifest(
        lambda m: m.update(dtype="uint32")))), "--set", "vocab_size=256"),
        (SHARD, "28,505 uint32 tokens take 114,020", "valid:")),
    Row("manifest without sources", lambda c: c.train("--data", str(c.dataset(_edit_manifest(
        lambda m: m.pop("sources"))))), ("it has no 'sources'", "valid:")),
    Row("manifest not JSON", lambda c: c.train("--data", str(c.dataset(
        lambda f: (f / "manifest.json").write_text('{"format": ')))), ("manifest.json cannot be read", "valid:")),
    Row("preparation unfinished", lambda c: c.train("--data", str(c.dataset(_half_prepared))),
        ("is not a prepared dataset", "did not finish", "valid:", "the same command again finishes")),
    Row("resume on data cut short since", _resume_on_damaged_data, (SHARD, "cut short")),
    Row("prepare again over a damaged output", _prepare_again_over_damage,
        ("holds this preparation, but", SHARD, "cut short", "valid: remove the folder")),
    # mixtures
    Row("mixture source missing", _mixture("{ds}:0.7,/no/such/set:0.3"),
        ("--data source '/no/such/set' does not exist", "valid:", "DIR_A:0.7,DIR_B:0.3")),
    Row("mixture weight negative", _mixture("{ds}:0.7,{ds}:-0.3"),
        ("weight '-0.3'", "not a positive number", "valid:", "weights > 0")),
    Row("mixture weight zero", _mixture("{ds}:1,{ds}:0"), ("weight '0'", "not a positive number")),
    Row("mixture weight malformed", _mixture("{ds}:0.7,{ds}:3O%"), ("weight '3O%'", "not a positive number")),
    Row("mixture weight nan", _mixture("{ds}:0.7,{ds}:nan"), ("weight 'nan'", "not a positive number")),
    Row("mixture separated by ;", _mixture("{ds}:0.7;{ds}:0.3"),
        ("does not exist", "items separated by commas, each weight after a colon")),
    Row("mixture item not prepared", lambda c: c.train("--data", f"{c.dataset()}:0.5,{c.root}:0.5"),
        ("is not a prepared dataset", "no manifest.json", "valid:")),
    # chat and completion files (shoal data prepare --format)
    Row("chat line not JSON", lambda c: c.chat(GOOD_CHAT, GOOD_CHAT, '{"messages": [{"role": "user"'),
        ("chat.jsonl:3: not a JSON line", "valid: one JSON object per line")),
    Row("chat message without content", lambda c: c.chat(GOOD_CHAT, {"messages": [{"role": "user"}]}),
        ("chat.jsonl:2", "message 0 has no 'content'", "valid: {\"role\": str, \"content\": str}")),
    Row("chat role unknown", lambda c: c.chat(GOOD_CHAT, {"messages": [{"role": "bot", "content": "x"}]}),
        ("chat.jsonl:2", "role 'bot'", "valid: system, user, assistant, tool")),
    Row("chat messages not a list", lambda c: c.chat({"messages": "hello"}),
        ("chat.jsonl:1", "must be a non-empty list")),
    Row("completion not text", lambda c: c.chat({"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": 3},
                                                fmt="completion"),
        ("completion.jsonl:2", "'completion' holds int, not text", 'valid: {"prompt": str, "completion": str}')),
    # --init
    Row("init file cut short", lambda c: c.train("--init", str(c.weights(lambda b: b[: len(b) // 2]))),
        ("w.safetensors is cut short", "valid: the whole file")),
    Row("init cut inside its header", lambda c: c.train("--init", str(c.weights(lambda b: b[:40]))),
        ("w.safetensors is not a safetensors file", "valid: a .safetensors file")),
    Row("init config.json not JSON", lambda c: c.train("--init", str(_hf_folder(c, "{not json"))),
        ("config.json' is not valid JSON", "line 1", "valid: the config.json")),
    Row("init config.json not an object", lambda c: c.train("--init", str(_hf_folder(c, "[1, 2]"))),
        ("config.json' holds a JSON list, not an object", "valid:")),
    # shoal distill's teacher
    Row("teacher missing", lambda c: ["distill", "--teacher", str(c.root / "nope"), "--out", str(c.out)],
        ("--teacher", "nope': no such run folder", "valid: the --out folder of a shoal train run")),
    Row("teacher still writing its first checkpoint",
        lambda c: ["distill", "--teacher", str(c.teacher(checkpoint="writing")), "--out", str(c.out)],
        ("--teacher", "holds no complete checkpoint", "still being written", "valid:")),
    Row("teacher without checkpoints", lambda c: ["distill", "--teacher", str(c.teacher(checkpoint="none")), "--out",
                                                  str(c.out)], ("holds no complete checkpoint", "valid:")),
    Row("teacher a file", lambda c: ["distill", "--teacher", str(c.teacher(checkpoint="none") / "config.toml"),
                                     "--out", str(c.out)], ("is a file, not a run folder", "valid:")),
    Row("teacher not a run folder", lambda c: ["distill", "--teacher", str(c.dataset()), "--out", str(c.out)],
        ("is not a shoal run folder", "no config.toml", "valid:")),
    Row("student over the teacher", lambda c: ["distill", "--teacher", str(t := c.teacher(checkpoint="done")),
                                               "--out", str(t), "--nproc", "1", "--seq-len", "32"],
        ("already holds a trained run", "--resume")),
    # TOML config files
    Row("toml wrong type", lambda c: c.toml('steps = "ten"\n'), ("steps = 'ten'", "a whole number")),
    Row("toml number as text", lambda c: c.toml('lr = "fast"\n'), ("lr = 'fast'", "a number")),
    Row("toml unknown key", lambda c: c.toml("setps = 3\n"), ("'setps'", "valid: steps, set")),
    Row("toml syntax", lambda c: c.toml("steps = 3\nlr =\n"), ("run.toml", "not valid TOML", "line 2")),
    Row("toml a table for a flag", lambda c: c.toml("[loop]\nsteps = 3\n"), ("'loop'", "valid:")),
    # the newest flags
    Row("final-ckpt", lambda c: c.train("--final-ckpt", "maybe"), ("'maybe'", "valid: on, off")),
    Row("lr-scaling without base batch", lambda c: c.train("--lr-scaling", "sqrt"),
        ("--lr-scaling sqrt needs --base-batch", "valid:")),
    Row("optimizer typo", lambda c: c.train("--optimizer", "adamx"), ("'adamx'", "valid: adamw, lamb, lars")),
    Row("plan option typo", lambda c: c.train("--plan", "dp1,cp_mode=rign"), ("rign",)),
]


def _hf_folder(c: Case, config: str) -> Path:
    folder = c.root / "hf"
    folder.mkdir()
    shutil.copy(c.shared.weights, folder / "model.safetensors")
    (folder / "config.json").write_text(config)
    return folder


@pytest.mark.parametrize("row", CASES, ids=[row.id for row in CASES])
def test_bad_input_is_one_line_and_loses_nothing(row, shared, tmp_path, capsys):
    case = Case(root=tmp_path / "case", shared=shared)
    case.root.mkdir()
    argv = row.argv(case)
    before = file_digests(case.root)
    line = assert_user_error(capsys, argv, *row.words)
    assert "Traceback" not in line
    assert file_digests(case.root) == before  # nothing changed, removed or added
