"""Mixture-of-Experts models under data-parallel plans equal the single-process MoE reference:
logits, every gradient (the load-balancing and z-losses included), the first optimizer step, the
loss curve and the final parameters (check_parity's rounding bounds, shoal/testing.py).

An MoE layer routes each micro-batch on its own, and with a capacity the routing of a token
depends on the others in its micro-batch: the reference runs the same groups of rows as the
ranks do (`reference_micro`). Under dp the gradients of every expert are averaged over the data
ranks like any other parameter's.
"""

from __future__ import annotations

import dataclasses

import pytest

from shoal.models import PRESETS
from shoal.testing import SMALL, case, check_parity, run_parallel

MOE = dataclasses.replace(SMALL, num_experts=4, top_k=2, ffn_dim=64)

ROUTERS = {
    "top1": dict(top_k=1),
    "top2": dict(top_k=2),
    "prototypes2": dict(top_k=2, num_prototypes=2),
    "dropless": dict(top_k=2, capacity_factor=0.0),
    "shared": dict(top_k=2, num_shared_experts=1),
    "widenet": dict(top_k=2, share_moe=True),
}


@pytest.mark.parametrize("plan, router", [(p, r) for p in ("dp2", "fsdp2") for r in ROUTERS
                                          if not (p == "fsdp2" and r == "widenet")])
def test_moe_matches_single_process(pools, plan, router):
    c = case(plan=plan, model=dataclasses.replace(MOE, **ROUTERS[router]), steps=3, reference_micro=2)
    check_parity(pools(2).run(run_parallel, c), c)


def test_moe_zero1_with_micro_batches(pools):
    c = case(plan="fsdp2,zero=1", model=MOE, steps=3, num_micro=2, reference_micro=4)
    check_parity(pools(2).run(run_parallel, c), c)


def test_what_moe_does_not_run_with_yet_is_refused():
    from shoal.plan import Plan
    from shoal.testing import one_line_error

    for text in ("tp2", "pp2", "cp2"):
        assert "Mixture-of-Experts" in one_line_error(Plan.parse(text).resolve(2).validate, MOE, global_batch=8,
                                                      seq_len=16)
    assert "share_moe" in one_line_error(Plan.parse("fsdp2").resolve(2).validate, MOE.replace(share_moe=True),
                                         global_batch=8, seq_len=16)


def test_tiny_moe_preset_counts_its_parameters():
    from shoal.models import Transformer

    cfg = PRESETS["tiny-moe"]
    assert Transformer(cfg).num_params() == cfg.num_params()
    wide = cfg.replace(share_moe=True)
    assert Transformer(wide).num_params() == wide.num_params() < cfg.num_params()


def test_tiny_moe_through_the_trainer(tmp_path):
    """`shoal train --model tiny-moe` trains out of the box and records each MoE layer's load:
    tokens per expert, their spread, the dropped fraction and both losses, plus the heatmap."""
    import json

    from shoal import cli

    flags = ["--device", "cpu", "--model", "tiny-moe", "--global-batch", "4", "--seq-len", "32", "--steps", "6",
             "--eval-every", "3", "--eval-batches", "1", "--set", "capacity_factor=1.0"]
    assert cli.main(["train", "--out", str(tmp_path / "run"), "--nproc", "2", *flags]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 6 and records[-1]["loss"] < records[0]["loss"]
    for r in records:
        for layer in ("0", "1", "2", "3"):  # tiny-moe: every one of its 4 blocks
            lo, mean, hi = (r[f"moe/{layer}/tokens_{k}"] for k in ("min", "mean", "max"))
            assert 0 <= lo <= mean <= hi and 0 <= r[f"moe/{layer}/dropped"] <= 1
            assert r[f"moe/{layer}/aux_loss"] > 0 and r[f"moe/{layer}/z_loss"] >= 0
        assert len(r["moe_load"]) == 4 and abs(sum(r["moe_load"]) - 1) < 1e-5
    assert (tmp_path / "run" / "moe_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


EP_ROUTERS = {k: ROUTERS[k] for k in ("top1", "top2", "prototypes2", "dropless", "shared")}


@pytest.mark.parametrize("router", list(EP_ROUTERS))
def test_ep2_matches_single_process(pools, router):
    """Experts split over 2 ranks, tokens exchanged by all-to-all (uneven when dropless)."""
    c = case(plan="ep2", model=dataclasses.replace(MOE, **EP_ROUTERS[router]), steps=3, reference_micro=2)
    check_parity(pools(2).run(run_parallel, c), c)


@pytest.mark.parametrize("plan, router", [("ep4", "top2"), ("ep4", "dropless"), ("dp4,ep2", "top2"),
                                          ("dp4,ep2", "prototypes2")])
def test_ep_on_four_ranks_matches_single_process(pools, plan, router):
    """ep4: one expert per rank; dp4,ep2: two replicas of each half of the experts."""
    c = case(plan=plan, model=dataclasses.replace(MOE, **EP_ROUTERS[router]), steps=3, reference_micro=4)
    check_parity(pools(4).run(run_parallel, c), c)


# ----------------------------------------------------------------------------- checkpoints across ep degrees

# Dropless routing is per token and the z-loss a mean over tokens, so any grouping of the rows
# trains alike; the load-balancing loss is not (a product of per-group means): off here.
RESHARD = case(steps=6, model=dataclasses.replace(MOE, capacity_factor=0.0, aux_loss_coef=0.0))
SEGMENTS = [("ep2", 2, 0, 2), ("ep4", 4, 2, 3), ("single", 0, 3, 4), ("dp2", 2, 4, 5), ("dp4,ep2", 4, 5, 6)]


def test_experts_keep_their_identity_across_ep_degrees(pools, tmp_path):
    """ep2 -> ep4 -> one process -> dp2 -> dp4,ep2, each resuming the previous checkpoint (model and
    AdamW state): the loss curve is the unbroken single-process run's, and so are the final experts."""
    from shoal.testing import assert_rounding_close, assert_trained_close, references, train_segment

    ref32, ref64 = references(RESHARD)
    for plan_text, world, start, end in SEGMENTS:
        if world == 0:
            results = [train_segment(RESHARD, str(tmp_path), plan_text, start, end)]
        else:
            results = pools(world).run(train_segment, RESHARD, str(tmp_path), plan_text, start, end)
        for rank, res in enumerate(results):
            assert_rounding_close(res["losses"], ref32["losses"][start:end], ref64["losses"][start:end],
                                  what=f"{plan_text} rank {rank} losses of steps {start}..{end - 1}")
    assert set(results[0]["params"]) == set(ref64["final_params"])
    assert_trained_close(results[0]["params"], ref32, ref64)
