"""Pipeline parallelism: the stage split, and every schedule and composition trained against the
single-process reference (logits, every gradient, the first optimizer step, the loss curve and the
final parameters).

Tolerances are check_parity's measured-rounding bounds (shoal/testing/parity.py). A pipeline computes each
stage's layers with the same kernels on the same micro-batch rows as one process; what differs is
where the micro-batch gradients are summed (in another order under split backward, and over the
data ranks' reduction), so the bounds are float32 rounding of those sums, as for dp.
"""

from __future__ import annotations

import dataclasses

import pytest

from shoal import rules
from shoal.apply_plan import parallelize
from shoal.mesh import build_mesh
from shoal.parallel.pipeline import split_layers
from shoal.plan import Plan
from shoal.testing.asserts import assert_rounding_close, one_line_error
from shoal.testing.parity import (
    SMALL,
    assert_trained_close,
    case,
    check_parity,
    references,
    run_parallel,
    train_segment,
)

DEEP = dataclasses.replace(SMALL, num_layers=8)
"""Enough layers for pp4 with two chunks per rank."""


def test_split_balances_cost_and_keeps_order():
    assert split_layers([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert split_layers([1, 1, 1, 5], 2) == [range(0, 3), range(3, 4)]  # the heavy last layer alone
    assert split_layers([4, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 5)]
    assert split_layers([1] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="at least as many layers"):
        split_layers([1, 1], 3)


def _pp_case(plan: str, model=DEEP, **kwargs):
    micro = Plan.parse(plan).micro_batches
    return case(plan=plan, model=model, num_micro=micro, steps=3, **kwargs)


@pytest.mark.parametrize("plan", ["pp2,sched=gpipe", "pp2", "pp2,sched=zb", "pp2,sched=interleaved,vpp=2",
                                  "pp2,split=6"])
def test_pp2_matches_single_process(pools, plan):
    c = _pp_case(plan)
    check_parity(pools(2).run(run_parallel, c), c)


@pytest.mark.parametrize("plan", ["pp4,sched=gpipe", "pp4,mb=8", "pp4,sched=zb", "pp4,sched=interleaved,vpp=2,mb=4"])
def test_pp4_matches_single_process(pools, plan):
    c = _pp_case(plan)
    check_parity(pools(4).run(run_parallel, c), c)


@pytest.mark.parametrize("plan", ["dp2,pp2", "fsdp2,pp2,zero=1", "fsdp2,pp2,zero=2", "fsdp2,pp2", "tp2,pp2",
                                  "cp2,pp2", "dp2,pp2,sched=zb", "fsdp2,pp2,zero=2,sched=zb", "tp2,pp2,sched=zb",
                                  "cp2,pp2,sched=zb", "tp2,pp2,sched=interleaved,vpp=2"])
def test_pp_composes_with_the_other_axes(pools, plan):
    c = _pp_case(plan, model=dataclasses.replace(SMALL, num_layers=4))
    check_parity(pools(4).run(run_parallel, c), c)


def _error(text: str, world: int, model, batch: int = 8) -> str:
    """The one-line refusal of plan `text` (at resolve, or against the model and batch)."""
    return one_line_error(lambda: rules.validate(rules.resolve(Plan.parse(text), world_size=world), model,
                                                 global_batch=batch, seq_len=16))


def test_pp_errors_are_one_line():
    assert "need as many layers" in _error("pp4,sched=interleaved,vpp=2", 4, SMALL.replace(num_layers=4))
    assert "vpp" in _error("pp2,sched=interleaved,vpp=1", 2, DEEP)
    assert "multiples of pp" in _error("pp4,sched=interleaved,vpp=2,mb=6", 4, DEEP, batch=12)
    assert "does not split" in _error("pp2,split=9", 2, DEEP)
    assert "split=" in one_line_error(Plan.parse, "pp2,split=a")


def _refused(text: str) -> str:
    try:
        plan = rules.resolve(Plan.parse(text), world_size=4)
        parallelize(case(model=dataclasses.replace(SMALL, num_layers=4)).build_model(), plan, build_mesh(plan))
    except ValueError as exc:
        return str(exc)
    return ""


def test_what_does_not_compose_yet_is_refused(pools):
    for text, words in (("fsdp2,pp2,sched=zb,zero=3", "sched=zb does not run on FSDP2"),
                        ("dp2,pp2,sched=interleaved,vpp=2", "sched=interleaved runs with pp, tp and cp only")):
        messages = pools(4).run(_refused, text)
        assert all(words in m and "\n" not in m for m in messages), messages


# ----------------------------------------------------------------------------- checkpoints across plans

RUN = case(steps=6, model=dataclasses.replace(SMALL, num_layers=4), num_micro=4)
SEGMENTS = [("pp2", 2, 0, 2), ("fsdp2", 2, 2, 3), ("single", 0, 3, 4), ("pp4,mb=4", 4, 4, 5), ("dp2,pp2", 4, 5, 6)]


def test_resume_across_pipeline_layouts(pools, tmp_path):
    """pp2 -> fsdp2 -> one process -> pp4 -> dp2,pp2, each resuming the previous checkpoint: the loss
    curve and every step's gradient norm are the unbroken single-process run's."""
    ref32, ref64 = references(RUN)
    for plan_text, world, start, end in SEGMENTS:
        if world == 0:
            results = [train_segment(RUN, str(tmp_path), plan_text, start, end, RUN.num_micro)]
        else:
            results = pools(world).run(train_segment, RUN, str(tmp_path), plan_text, start, end, RUN.num_micro)
        for rank, res in enumerate(results):
            assert_rounding_close(res["losses"], ref32["losses"][start:end], ref64["losses"][start:end],
                                  what=f"{plan_text} rank {rank} losses of steps {start}..{end - 1}")
            assert_rounding_close(res["grad_norms"], ref32["grad_norms"][start:end], ref64["grad_norms"][start:end],
                                  what=f"{plan_text} rank {rank} gradient norms of steps {start}..{end - 1}")
    final = {k: v for res in results for k, v in res["params"].items()}
    assert set(final) == set(ref64["final_params"])
    assert_trained_close(final, ref32, ref64)


def test_pp_through_the_trainer(tmp_path, capfd):
    """`shoal train --plan pp2,sched=zb` prints its split and schedule, tracks the one-process run
    (evaluation included), reports the measured bubble and draws the schedule, and resumes under dp2."""
    import json

    from shoal import cli

    flags = ["--device", "cpu", "--set", "num_layers=4", "--set", "dim=64", "--set", "ffn_dim=128", "--global-batch",
             "4", "--seq-len", "32", "--eval-every", "2", "--eval-batches", "1", "--steps", "4", "--ckpt-every", "2"]

    def records(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert cli.main(["train", "--out", str(tmp_path / "pp"), "--nproc", "2", "--plan", "pp2,sched=zb", *flags]) == 0
    out = capfd.readouterr().out
    assert "stage 0 (rank 0): layers 0-1 + embeddings; stage 1 (rank 1): layers 2-3 + norm and head" in out
    assert "r0 | F0 F1 .  B0 W0" in out and "measured bubble" in out
    assert cli.main(["train", "--out", str(tmp_path / "one"), "--nproc", "1", *flags]) == 0
    pp, one = records(tmp_path / "pp"), records(tmp_path / "one")
    # Other sums in other orders (see test_train_e2e.LOSS_REL for the bound's derivation).
    assert [r["loss"] for r in pp] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    evals = [[r["eval_loss"] for r in run if "eval_loss" in r] for run in (pp, one)]
    assert len(evals[0]) == 2 and evals[0] == pytest.approx(evals[1], rel=1e-4)
    summary = json.loads((tmp_path / "pp" / "summary.json").read_text())
    assert 0 <= summary["pipeline_bubble"] < 1 and summary["pipeline_bubble_formula"] == pytest.approx(1 / 5)
    assert (tmp_path / "pp" / "pipeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["train", "--resume", str(tmp_path / "pp"), "--steps", "6", "--plan", "dp2"]) == 0
    assert [r["step"] for r in records(tmp_path / "pp")] == [1, 2, 3, 4, 5, 6]
