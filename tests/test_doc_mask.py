"""--doc-mask on: attention stays inside each document of a packed sequence and positions restart
at each; the packed model equals each document run on its own, the plans that support it equal
one process, and the others are refused in one line (shoal.rules)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from shoal import rules
from shoal.models import PRESETS, Transformer
from shoal.models.transformer import documents
from shoal.plan import Plan
from shoal.testing.asserts import assert_user_error, one_line_error
from shoal.testing.parity import SMALL, ParityCase, check_parity, run_parallel

EOS = 3


def test_documents_give_positions_and_a_block_diagonal_causal_mask():
    tokens = torch.tensor([[5, EOS, 7, 8, EOS, 9]])
    positions, allowed = documents(tokens, EOS)
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0]]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for a, b in ((0, 2), (2, 5), (5, 6)):  # the documents' spans, EOS with the document it ends
        expected[a:b, a:b] = torch.ones(b - a, b - a).tril().bool()
    assert torch.equal(allowed[0, 0], expected)


@pytest.mark.parametrize("preset", ["llama", "gpt", "llama-window"])
def test_a_packed_sequence_equals_its_documents_run_alone(preset):
    """In float64 the packed and the separate runs differ only by the order of sums of the same
    terms (masked keys add exact zeros): a few ulps of 2^-52, far below 1e-10."""
    base = {"llama": SMALL, "llama-window": SMALL.replace(sliding_window=4),  # Mistral: the window inside each document
            "gpt": PRESETS["tiny-gpt"].replace(num_layers=2, max_seq_len=32, vocab_size=128)}[preset]
    torch.manual_seed(0)
    model = Transformer(base.replace(doc_eos_id=EOS)).double().eval()
    lengths = [5, 9, 1, 7]  # each ends with EOS but the last (a document cut by the window)
    docs = [torch.randint(4, 128, (n,)) for n in lengths]
    for d in docs[:-1]:
        d[-1] = EOS
    packed = model(torch.cat(docs)[None])[0]
    alone = torch.cat([model(d[None])[0] for d in docs])
    assert torch.allclose(packed, alone, rtol=0, atol=1e-10), (packed - alone).abs().max()
    plain = Transformer(base).double().eval()
    plain.load_state_dict(model.state_dict())
    assert not torch.allclose(plain(torch.cat(docs)[None])[0], alone, atol=1e-3)  # the mask matters


def test_plans_without_document_masks_are_refused_in_one_line():
    model = SMALL.replace(doc_eos_id=EOS)
    for text, world, words in (("cp2", 2, "ring and all-to-all"), ("pp2", 2, "hidden states")):
        plan = rules.resolve(Plan.parse(text), world_size=world)
        assert words in one_line_error(rules.validate, plan, model, global_batch=8, seq_len=16)
    for text, world in (("dp2", 2), ("tp2", 2), ("fsdp2", 2)):
        rules.validate(rules.resolve(Plan.parse(text), world_size=world), model, global_batch=8, seq_len=16)


def test_doc_mask_needs_prepared_data(capsys, tmp_path):
    assert_user_error(capsys, ["train", "--doc-mask", "on", "--device", "cpu", "--nproc", "1", "--steps", "1"],
                      "--doc-mask on", "shoal data prepare")
    missing = str(tmp_path / "none")  # a path that is not there is said to be missing, as without --doc-mask
    assert_user_error(capsys, ["train", "--doc-mask", "on", "--data", missing, "--out", str(tmp_path / "r")],
                      f"data path {missing!r} does not exist")


@dataclass(frozen=True, kw_only=True)
class DocCase(ParityCase):
    """Random tokens with an EOS every few positions (documents of 1 to 6 tokens), and the targets
    of the first rows masked as fine-tuning data would be."""

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for x, y in super().batches():
            seq = torch.cat([x, y[:, -1:]], dim=1)
            rows, cols = torch.meshgrid(torch.arange(seq.shape[0]), torch.arange(seq.shape[1]), indexing="ij")
            seq[(cols * 7 + rows * 3) % 6 == 0] = EOS
            targets = seq[:, 1:].clone()
            targets[: seq.shape[0] // 2, : seq.shape[1] // 3] = -100
            out.append((seq[:, :-1], targets))
        return out


@pytest.mark.parametrize("plan, num_micro", [("dp2", 2), ("tp2", 1)])
def test_doc_mask_plans_match_single_process(pools, plan, num_micro):
    c = DocCase(plan=plan, num_micro=num_micro, steps=2, model=SMALL.replace(doc_eos_id=EOS))
    check_parity(pools(2).run(run_parallel, c), c)
