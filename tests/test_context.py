"""Context parallelism: ring attention and head-scatter attention over a split sequence equal
full attention in one process (outputs and gradients), and cp plans train like one process.

Tolerances: ring attention adds the same products as full attention, in blocks and merged with
an online softmax (a rescaling by exp(lse_old - lse_new) per block), so it differs from SDPA by
float32 rounding of sums of T terms: a few units of 2^-24 times T times the largest term. With
T <= 64 and values O(1), 1e-5 absolute bounds that with ~10x room. The a2a mode runs SDPA itself on
whole sequences, so it is exact up to the same kernel's blocking: the same bound.
Model parity uses check_parity's measured-rounding bounds (shoal/testing/parity.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shoal import rules
from shoal.mesh import build_mesh
from shoal.models.transformer import causal_attention
from shoal.parallel import context
from shoal.parallel.context import ContextSplit, a2a_attention, chunks_of, positions, ring_attention
from shoal.plan import Plan
from shoal.testing.asserts import one_line_error
from shoal.testing.parity import SMALL, case, check_parity, run_parallel

ATOL = 1e-5


def test_zigzag_positions_cover_the_sequence_once():
    for cp in (1, 2, 4):
        held = torch.cat([positions(16 * cp, r, cp) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(16 * cp))
        assert chunks_of(0, 4) == [0, 7] and chunks_of(3, 4) == [3, 4]
    # Zig-zag: every rank gets the same share of the causal triangle; a plain split does not.
    def work(cp: int, balanced: bool) -> list[int]:
        return [int(sum(p + 1 for p in positions(8 * cp, r, cp, balanced=balanced))) for r in range(cp)]
    assert len(set(work(4, True))) == 1
    assert max(work(4, False)) > 3 * min(work(4, False))


def _attention_vs_full(mode: str, causal: bool, seq_len: int, flash: bool = True) -> float:
    """On each rank: the distributed attention of this rank's slice vs full attention's rows."""
    context.CPU_FLASH = flash
    try:
        return _attention_error(mode, causal, seq_len)
    finally:
        context.CPU_FLASH = True  # the pool's processes serve later tests


def _attention_error(mode: str, causal: bool, seq_len: int) -> float:
    plan = rules.resolve(Plan.parse(f"cp{dist.get_world_size()}"), world_size=dist.get_world_size())
    split = ContextSplit(build_mesh(plan)["cp"])
    torch.manual_seed(0)
    q, k, v, dy = (torch.randn(2, 4, seq_len, 8, dtype=torch.float32) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    if causal:
        full = causal_attention(q, k, v)
    else:
        full = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    full.backward(dy)
    pos = positions(seq_len, split.rank, split.cp)
    ql, kl, vl = (t.detach()[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
    if mode == "ring":
        out = ring_attention(ql, kl, vl, split=split, causal=causal)
    else:
        out = a2a_attention(ql, kl, vl, split=split)
    out.backward(dy[:, :, pos])
    errors = [(out - full[:, :, pos]).abs().max()]
    errors += [(local.grad - whole.grad[:, :, pos]).abs().max() for local, whole in ((ql, q), (kl, k), (vl, v))]
    return float(max(errors))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode, causal, flash", [("ring", True, True), ("ring", False, True), ("ring", True, False),
                                                 ("ring", False, False), ("a2a", True, True)],
                         ids=["ring-causal", "ring-full", "ring-causal-plain", "ring-full-plain", "a2a-causal"])
@pytest.mark.parametrize("seq_len", [16, 64])
def test_attention_equals_full_attention(pools, world, mode, causal, flash, seq_len):
    """flash: blocks through torch's CPU flash kernel; plain: the formulas GPUs use here."""
    errors = pools(world).run(_attention_vs_full, mode, causal, seq_len, flash)
    assert max(errors) < ATOL, errors


@pytest.mark.parametrize("world, plan", [(2, "cp2"), (4, "cp4"), (2, "cp2,cp_mode=a2a"), (4, "dp2,cp2"),
                                         (4, "fsdp2,cp2"), (4, "cp4,cp_mode=a2a"), (4, "tp2,cp2"),
                                         (4, "tp2,cp2,sp=off"), (4, "fsdp2,cp2,zero=1"), (4, "fsdp2,cp2,zero=2")])
def test_cp_matches_single_process(pools, world, plan):
    c = case(plan=plan, model=SMALL)
    check_parity(pools(world).run(run_parallel, c), c)


def test_cp_errors_are_one_line():
    plan = rules.resolve(Plan.parse("cp4"), world_size=4)
    assert "multiple of 8" in one_line_error(rules.validate, plan, SMALL, global_batch=8, seq_len=12)
    a2a = rules.resolve(Plan.parse("cp4,cp_mode=a2a"), world_size=4)
    narrow = SMALL.replace(dim=48, num_heads=6, num_kv_heads=6)
    assert "scatters the" in one_line_error(rules.validate, a2a, narrow, global_batch=8,
                                            seq_len=16)
    rules.resolve(Plan.parse("fsdp2,cp2"), world_size=4)  # resolving asks every rule: fsdp with cp runs


def test_cp_through_the_trainer(tmp_path):
    """`shoal train --plan cp2` (the runtime slices tokens and targets, averages the loss over the
    cp ranks) tracks the one-process run, evaluation included, and resumes under dp2."""
    import json

    from shoal import cli

    flags = ["--device", "cpu", "--set", "num_layers=2", "--set", "dim=64", "--set", "ffn_dim=128", "--global-batch",
             "4", "--seq-len", "32", "--eval-every", "2", "--eval-batches", "1", "--steps", "4", "--ckpt-every", "2"]

    def records(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert cli.main(["train", "--out", str(tmp_path / "cp"), "--nproc", "2", "--plan", "cp2", *flags]) == 0
    assert cli.main(["train", "--out", str(tmp_path / "one"), "--nproc", "1", *flags]) == 0
    cp, one = records(tmp_path / "cp"), records(tmp_path / "one")
    # Other sums in other orders (see test_train_e2e.LOSS_REL for the bound's derivation).
    assert [r["loss"] for r in cp] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    evals = [[r["eval_loss"] for r in run if "eval_loss" in r] for run in (cp, one)]
    assert len(evals[0]) == 2 and evals[0] == pytest.approx(evals[1], rel=1e-4)
    assert cli.main(["train", "--resume", str(tmp_path / "cp"), "--steps", "6", "--plan", "dp2"]) == 0
    assert [r["step"] for r in records(tmp_path / "cp")] == [1, 2, 3, 4, 5, 6]
