"""Fine-tuning data: `shoal data prepare --format chat|completion` writes loss masks beside the
tokens (targets only on the assistant's / completion's tokens), the reader turns masked targets
into IGNORE, and the loss is the mean over every target of the global batch under any plan and
micro-batch count (checked against one process on data with very uneven mask counts)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from shoal.data.dataset import open_prepared, read_manifest
from shoal.data.prepare import PrepareConfig, prepare
from shoal.data.text import default_corpus
from shoal.loss import IGNORE
from shoal.testing.asserts import assert_user_error
from shoal.testing.parity import ParityCase, check_parity, run_parallel

EOS, END = "<|endoftext|>", "<|end|>"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
"""A chat template set explicitly (the test tokenizer ships none of its own)."""


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> tuple[Path, Path]:
    """(with a chat template, without one): a 400-id byte-level BPE trained offline on the
    built-in corpus, with the template's markers as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [EOS, END, "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([default_corpus()[:100_000]], trainer)
    root = tmp_path_factory.mktemp("tok")
    plain = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    plain.save_pretrained(root / "plain")
    plain.chat_template = TEMPLATE
    plain.save_pretrained(root / "chat")
    assert (root / "chat" / "chat_template.jinja").is_file() or "chat_template" in \
        json.loads((root / "chat" / "tokenizer_config.json").read_text())
    return root / "chat", root / "plain"


CONVERSATIONS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i} + {i}?"},
                  {"role": "assistant", "content": f"It is {2 * i}."}, {"role": "user", "content": "Sure?"},
                  {"role": "assistant", "content": "Yes, quite sure."}] for i in range(40)]


def _targets_text(out: Path, tokenizer: Path) -> list[str]:
    """Per training document, the decoded text of its target tokens (EOS left out)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    manifest = read_manifest(out)
    texts = []
    for shard in manifest["sources"][0]["train"]["shards"]:
        tokens = np.fromfile(out / f"{shard['name']}.bin", dtype=manifest["dtype"])
        mask = np.fromfile(out / f"{shard['name']}.mask", dtype=np.uint8)
        offsets = np.fromfile(out / f"{shard['name']}.idx", dtype=np.int64)
        assert len(mask) == len(tokens)
        for a, b in zip(offsets[:-1], offsets[1:]):
            assert mask[b - 1] == 1  # the EOS after an answer is a target: the model learns to stop
            texts.append(tok.decode(tokens[a:b - 1][mask[a:b - 1] == 1].tolist()))
    return texts


def test_chat_masks_exactly_the_assistants_turns(tokenizers, tmp_path):
    chat, _ = tokenizers
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    out = tmp_path / "ds"
    manifest = prepare(PrepareConfig(inputs=[str(tmp_path / "c.jsonl")], tokenizer=str(chat), out=str(out),
                                     field="messages", format="chat", holdout=0.1, workers=1), progress=False)
    assert manifest["loss_mask"] and manifest["data_format"] == "chat"
    texts = _targets_text(out, chat)
    assert len(texts) == manifest["sources"][0]["train"]["documents"] > 30
    numbers = sorted(int(t.split("It is ")[1].split(".")[0]) for t in texts)
    assert all(t == f"It is {n}.{END}\nYes, quite sure.{END}\n" for t, n in
               zip(sorted(texts, key=lambda t: int(t.split("It is ")[1].split(".")[0])), numbers))


def test_completion_masks_the_completion_and_reads_as_ignored_targets(tmp_path):
    records = [{"prompt": "Q" * (1 + i % 7), "completion": "a" * (1 + i % 3)} for i in range(200)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "ds"
    prepare(PrepareConfig(inputs=[str(tmp_path / "p.jsonl")], tokenizer="byte", out=str(out),
                          format="completion", holdout=0.05, workers=1), progress=False)
    data = open_prepared(str(out), seq_len=16, seed=0)
    inputs, targets = data.train.batch(3, 8)
    assert inputs.shape == targets.shape == (8, 16)
    kept = targets[targets != IGNORE]
    # byte ids: targets are 'a' or the EOS (0) after a completion; prompts ('Q') never are
    assert set(kept.tolist()) <= {ord("a"), 0} and (targets == ord("Q")).sum() == 0
    assert (inputs == ord("Q")).any() and len(kept) > 0
    again = open_prepared(str(out), seq_len=16, seed=0).train.batch(3, 8, (1, 2))
    assert torch.equal(again[1], targets[4:])  # a rank's slice of the same masked batch


def test_chat_without_a_template_is_one_line(tokenizers, tmp_path, capsys):
    _, plain = tokenizers
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    out = tmp_path / "ds"
    base = ["data", "prepare", str(tmp_path / "c.jsonl"), "--out", str(out), "--format", "chat"]
    assert_user_error(capsys, [*base, "--tokenizer", str(plain)], "no chat template")
    assert_user_error(capsys, [*base, "--tokenizer", "byte"], "no chat template")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    assert_user_error(capsys, ["data", "prepare", str(tmp_path / "bad.jsonl"), "--out", str(out), "--format",
                               "completion", "--tokenizer", "byte"], "bad.jsonl:1", "'prompt'")
    assert not out.exists()


COUNTS = [4, 4, 3, 4, 16, 2, 1, 0]
"""Targets kept per row (the first ones): dp2's micro-batches hold 8, 7, 18 and 1 targets, cp2's
balanced halves (position chunks 0 and 3 of 4, and 1 and 2) 26 and 8: a mean of per-rank or
per-micro-batch means would weigh some targets 18x more than others (and does fail here)."""


@dataclass(frozen=True, kw_only=True)
class MaskedCase(ParityCase):
    """Random tokens whose targets are masked (IGNORE) past COUNTS[row] in every row."""

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        keep = torch.arange(self.seq_len)[None, :] < torch.tensor(COUNTS)[:, None]
        return [(x, y.masked_fill(~keep, IGNORE)) for x, y in super().batches()]


@pytest.mark.parametrize("world, plan, num_micro", [(2, "dp2", 2), (2, "cp2", 1), (2, "tp2", 2), (2, "pp2,mb=2", 2)])
def test_masked_loss_is_the_mean_over_the_global_batchs_targets(pools, world, plan, num_micro):
    """Every plan's losses, gradients and steps equal one process taking the mean over all targets
    of the global batch (check_parity's float32 rounding tolerances, shoal.testing.parity)."""
    c = MaskedCase(plan=plan, num_micro=num_micro, steps=2, global_batch=len(COUNTS))
    check_parity(pools(world).run(run_parallel, c), c)
