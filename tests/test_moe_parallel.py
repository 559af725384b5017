"""Mixture-of-Experts models under data-parallel plans equal the single-process MoE reference:
logits, every gradient (the load-balancing and z-losses included), the first optimizer step, the
loss curve and the final parameters (check_parity's rounding bounds, shoal/testing/parity.py).

The reference is the plain single process over the whole global batch: an MoE layer routes
within routing groups (one sequence each by default, `moe_group_tokens`), so capacity, dropping
and the load-balancing loss do not depend on how the plan splits the batch over data ranks,
micro-batches or pipeline micro-batches. Under dp the gradients of every expert are averaged over
the data ranks like any other parameter's.
"""

from __future__ import annotations

import dataclasses

import pytest

from shoal import rules
from shoal.models import PRESETS
from shoal.testing.parity import SMALL, case, check_parity, run_parallel

MOE = dataclasses.replace(SMALL, num_experts=4, top_k=2, ffn_dim=64)

ROUTERS = {
    "top1": dict(top_k=1, norm_topk=False),  # Switch: the weight is the gate probability
    "top2": dict(top_k=2),
    "top2_raw": dict(top_k=2, norm_topk=False),
    "prototypes2": dict(top_k=2, num_prototypes=2),
    "dropless": dict(top_k=2, capacity_factor=0.0),
    "shared": dict(top_k=2, num_shared_experts=1),
    "widenet": dict(top_k=2, share_moe=True),
}


@pytest.mark.parametrize("plan, router", [(p, r) for p in ("dp2", "fsdp2") for r in ROUTERS
                                          if not (p == "fsdp2" and r == "widenet")])
def test_moe_matches_single_process(pools, plan, router):
    c = case(plan=plan, model=dataclasses.replace(MOE, **ROUTERS[router]), steps=3)
    check_parity(pools(2).run(run_parallel, c), c)


def test_moe_zero1_with_micro_batches(pools):
    c = case(plan="fsdp2,zero=1", model=MOE, steps=3, num_micro=2)
    check_parity(pools(2).run(run_parallel, c), c)


def test_what_moe_does_not_run_with_yet_is_refused():
    from shoal.plan import Plan
    from shoal.testing.asserts import one_line_error

    assert "Mixture-of-Experts" in one_line_error(rules.validate, rules.resolve(Plan.parse("cp2"), world_size=2), MOE,
                                                  global_batch=8,
                                                  seq_len=16)
    for text in ("fsdp2", "tp2", "pp2"):
        assert "share_moe" in one_line_error(rules.validate, rules.resolve(Plan.parse(text), world_size=2),
                                             MOE.replace(share_moe=True),
                                             global_batch=8, seq_len=16)
    assert "bias" in one_line_error(rules.validate, rules.resolve(Plan.parse("tp2"), world_size=2),
                                    MOE.replace(bias=True),
                                    global_batch=8, seq_len=16)
    # fsdp6,ep2: the experts' model dim 64 over the 3 data ranks outside ep.
    assert "model dim 64" in one_line_error(rules.validate, rules.resolve(Plan.parse("fsdp6,ep2"), world_size=6),
                                            MOE.replace(num_experts=6),
                                            global_batch=12, seq_len=16)


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
EP_ROUTERS["prototypes2_raw"] = dict(top_k=2, num_prototypes=2, norm_topk=False)


@pytest.mark.parametrize("router", list(EP_ROUTERS))
def test_ep2_matches_single_process(pools, router):
    """Experts split over 2 ranks, tokens exchanged by all-to-all (uneven when dropless)."""
    c = case(plan="ep2", model=dataclasses.replace(MOE, **EP_ROUTERS[router]), steps=3)
    check_parity(pools(2).run(run_parallel, c), c)


@pytest.mark.parametrize("plan, router", [("ep4", "top2"), ("ep4", "dropless"), ("dp4,ep2", "top2"),
                                          ("dp4,ep2", "prototypes2")])
def test_ep_on_four_ranks_matches_single_process(pools, plan, router):
    """ep4: one expert per rank; dp4,ep2: two replicas of each half of the experts."""
    c = case(plan=plan, model=dataclasses.replace(MOE, **EP_ROUTERS[router]), steps=3)
    check_parity(pools(4).run(run_parallel, c), c)


# ----------------------------------------------------------------------------- checkpoints across ep degrees

# Capacity 1.25 and the load-balancing loss on: routing groups make every plan route alike.
RESHARD = case(steps=6, model=MOE)
SEGMENTS = [("ep2", 2, 0, 2), ("ep4", 4, 2, 3), ("single", 0, 3, 4), ("dp2", 2, 4, 5), ("dp4,ep2", 4, 5, 6)]


def test_experts_keep_their_identity_across_ep_degrees(pools, tmp_path):
    """ep2 -> ep4 -> one process -> dp2 -> dp4,ep2, each resuming the previous checkpoint (model and
    AdamW state): the loss curve is the unbroken single-process run's, and so are the final experts."""
    _resume_chain(pools, tmp_path, SEGMENTS)


# ----------------------------------------------------------------------------- ep with sharded data, ep with tp

@pytest.mark.parametrize("plan, router", [("fsdp4,ep2", r) for r in ("top1", "top2", "prototypes2", "dropless")]
                         + [("fsdp4,ep2,zero=2", "top2"), ("dp2,fsdp2,ep2", "shared"), ("fsdp4,ep4", "top2_raw"),
                            ("fsdp2,ep2", "top2"), ("fsdp2,ep2", "prototypes2")])
def test_ep_with_sharded_data_matches_single_process(pools, plan, router):
    """The dense part sharded over the 4 data ranks (FSDP2 at zero=3, shoal's engine at zero=1/2),
    each half of the experts over the 2 data ranks outside ep (all-gathered in forward, gradients
    reduce-scattered in backward)."""
    c = case(plan=plan, model=dataclasses.replace(MOE, **ROUTERS[router]), steps=3)
    check_parity(pools(4).run(run_parallel, c), c)


def test_ep_with_zero1_and_micro_batches(pools):
    c = case(plan="fsdp2,ep2,zero=1", model=MOE, steps=3, num_micro=2)
    check_parity(pools(2).run(run_parallel, c), c)


@pytest.mark.parametrize("plan, router, world", [("tp2", "top2", 2), ("tp2,sp=off", "dropless", 2),
                                                 ("tp2", "shared", 2), ("tp2,ep2", "top2", 4),
                                                 ("tp2,ep2", "prototypes2", 4), ("tp2,ep2", "top1", 4),
                                                 ("fsdp2,tp2,ep2", "dropless", 4), ("fsdp2,tp2", "top2", 4)])
def test_ep_with_tp_matches_single_process(pools, plan, router, world):
    """Each expert's FFN split over tp like the dense FFN (w1/w3 by columns, w2 by rows, outputs
    summed over tp), the experts over ep (tp2,ep2 on 4 processes is dp2,tp2,ep2); fsdp2,tp2: the
    experts also sharded over the 2 data ranks (no ep)."""
    c = case(plan=plan, model=dataclasses.replace(MOE, **ROUTERS[router]), steps=3)
    check_parity(pools(world).run(run_parallel, c), c)


def _expert_local_shapes(plan_text: str) -> dict[str, tuple[int, ...]]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from shoal.apply_plan import parallelize
    from shoal.mesh import build_mesh
    from shoal.plan import Plan

    plan = rules.resolve(Plan.parse(plan_text), world_size=dist.get_world_size())
    runtime = parallelize(case(model=MOE).build_model(), plan, build_mesh(plan))
    return {name.rpartition(".")[2]: tuple(p.to_local().shape) for name, p in runtime.named_parameters()
            if name.startswith("layers.0.feed_forward.experts.") and isinstance(p, DTensor)}


@pytest.mark.parametrize("plan, expected", [
    ("fsdp4,ep2", {"w1": (2, 64, 32), "w3": (2, 64, 32), "w2": (2, 32, 64)}),  # E/ep, F, D/replicas
    ("tp2,ep2", {"w1": (2, 32, 64), "w3": (2, 32, 64), "w2": (2, 64, 32)}),    # E/ep, F/tp, D
    ("fsdp2,tp2", {"w1": (4, 32, 32), "w3": (4, 32, 32), "w2": (4, 32, 32)}),  # E, F/tp, D/replicas
])
def test_each_rank_holds_its_piece_of_the_experts(pools, plan, expected):
    """MOE: E=4, F=64, D=64."""
    assert pools(4).run(_expert_local_shapes, plan) == [expected] * 4


LAYOUTS = [("fsdp4,ep2", 4, 0, 2), ("tp2,ep2", 4, 2, 3), ("fsdp2,ep2,zero=2", 2, 3, 4), ("single", 0, 4, 5),
           ("fsdp2,tp2,ep2", 4, 5, 6)]


def test_experts_keep_their_identity_across_sharded_and_tp_layouts(pools, tmp_path):
    """fsdp4,ep2 -> tp2,ep2 -> fsdp2,ep2,zero=2 -> one process -> fsdp2,tp2,ep2, each resuming the
    previous checkpoint: the unbroken single-process run's losses and final experts."""
    _resume_chain(pools, tmp_path, LAYOUTS)


# ----------------------------------------------------------------------------- transformers' pooled router loss

# output_router_logits=true in a Mixtral / Qwen2-MoE config: dropless, one load-balancing loss pooled
# over every layer and token of a forward. The weight is large so that statistics left per rank
# (each rank pooling its own tokens) show far above the tolerance in the routers' gradients.
POOLED = MOE.replace(capacity_factor=0.0, aux_loss_pooled=True, aux_loss_coef=0.5)


@pytest.mark.parametrize("plan, world, micro", [
    ("dp2", 2, 1), ("fsdp2", 2, 1), ("fsdp2,zero=1", 2, 1), ("ep2", 2, 1), ("tp2", 2, 1), ("tp2", 2, 2),
    ("dp2,tp2", 4, 1), ("fsdp2,ep2,tp2", 4, 1),
])
def test_pooled_router_loss_matches_single_process(pools, plan, world, micro):
    """Each rank pools its tokens' expert counts with the other data ranks' (one all-reduce) and
    differentiates its own router probabilities against them (shoal.moe.collect.pooled_loss): the
    one-process loss over the whole forward, and its gradients. tp ranks route the same tokens: no
    pooling over tp. With accumulation (tp2, 2 micro-batches) each micro-batch pools its own tokens,
    as the one-process reference does."""
    c = case(plan=plan, model=POOLED, steps=3, num_micro=micro)
    check_parity(pools(world).run(run_parallel, c), c)


# Under pp each stage's layers pool with the other stages' (shoal.moe.collect.micro_batch): every
# stage sums a micro-batch's counts with the others' (one all-reduce, started after its forward of
# it), and its backward differentiates its own layers' probabilities against them. Four layers: two
# per stage, so that a stage also pools within itself. Over data ranks only one micro-batch per step
# (mb=1): with more, a micro-batch would pool one of every rank's (shoal.rules refuses it).
POOLED_PP = POOLED.replace(num_layers=4)


@pytest.mark.parametrize("plan, world, micro", [
    ("pp2,mb=4", 2, 4), ("pp2,mb=4,sched=zb", 2, 4), ("dp2,pp2,mb=1", 4, 1),
    ("pp2,sched=interleaved,vpp=2,mb=2", 2, 2),  # a rank's last forward of a micro-batch: its second chunk's
    ("pp2,mb=2,ac=full", 2, 2),  # recomputed blocks: the losses' autograd nodes save no tensors
])
def test_pooled_router_loss_in_a_pipeline_matches_single_process(pools, plan, world, micro):
    """The one-process loss curve, gradients and steps (check_parity's rounding bounds: the pooled
    gradient coef * E * C_e / rows**2 is computed from the same integer counts, summed exactly, and
    rounded to float32 once, a few ulps from one process's; the backward through it is the same)."""
    c = case(plan=plan, model=POOLED_PP, steps=3, num_micro=micro)
    check_parity(pools(world).run(run_parallel, c), c)


def test_pooled_router_loss_needs_every_stages_counts(monkeypatch):
    """The pipeline test above would catch stages that pooled only their own layers' counts: a
    one-process run whose plainly written loss (shoal.testing.parity.pooled_router_loss) pools each
    stage's layers apart has a first-stage router gradient far outside check_parity's bound (the
    single-process float32 error x SLACK + FLOOR_ULPS ulps) around the truth."""
    import shoal.testing.parity as parity
    from shoal.parallel.pipeline import block_costs, split_layers
    from shoal.testing.asserts import FLOOR_ULPS, SLACK, U32
    from shoal.testing.parity import references, run_reference

    c = case(plan="pp2,mb=4", model=POOLED_PP, steps=3, num_micro=4)  # the pipeline test's: its references
    ref32, ref64 = references(c)
    stages = split_layers(block_costs(c.build_model()), 2)
    assert stages[0] == range(0, 2), stages
    whole = parity.pooled_router_loss

    def per_stage(logits, coef, top_k):  # one micro-batch's layers' logits, in layer order
        assert len(logits) == POOLED_PP.num_layers
        return sum(whole(logits[layers.start:layers.stop], coef, top_k) for layers in stages)

    monkeypatch.setattr(parity, "pooled_router_loss", per_stage)
    apart = run_reference(c)["grads"]
    name = "layers.0.feed_forward.router.gate.weight"
    truth, single = ref64["grads"][name], (ref32["grads"][name] - ref64["grads"][name]).abs().max().item()
    bound = SLACK * single + FLOOR_ULPS * U32 * truth.abs().max().item()
    off = (apart[name].double() - truth).abs().max().item()
    print(f"first-stage router gradient with stage-local counts: {off:.3g} off; bound {bound:.3g}")
    assert off > 100 * bound, (off, bound)


# ----------------------------------------------------------------------------- MoE in a pipeline

@pytest.mark.parametrize("plan, router, world, micro", [
    ("pp2,mb=4", "top2", 2, 4), ("pp2,mb=2,sched=gpipe", "prototypes2", 2, 2), ("pp2,mb=4,sched=zb", "top1", 2, 4),
    ("dp2,pp2,mb=2", "top2", 4, 2), ("pp2,ep2,mb=2", "top2", 4, 2), ("pp2,ep2,mb=2", "prototypes2", 4, 2),
    ("fsdp2,pp2,ep2,mb=2", "dropless", 4, 2),
    ("tp2,pp2,mb=2", "shared", 4, 2),
])
def test_moe_in_a_pipeline_matches_single_process(pools, plan, router, world, micro):
    """Stages start backward from their outputs, not from one loss: each MoE layer's losses ride
    on its output (MoECollector.attached) and are differentiated with the stage's backward."""
    c = case(plan=plan, model=dataclasses.replace(MOE, **ROUTERS[router]), steps=3, num_micro=micro)
    check_parity(pools(world).run(run_parallel, c), c)


def test_moe_interleaved_pipeline_matches_single_process(pools):
    c = case(plan="pp2,sched=interleaved,vpp=2,mb=2", model=MOE.replace(num_layers=4), steps=3, num_micro=2)
    check_parity(pools(2).run(run_parallel, c), c)


def _resume_chain(pools, tmp_path, segments):
    """Train RESHARD through `segments` (plan, world (0: this process), first step, end step), each
    resuming the previous checkpoint: every segment's losses and gradient norms and the final weights must be
    the unbroken single-process run's."""
    from shoal.testing.asserts import assert_rounding_close
    from shoal.testing.parity import assert_trained_close, references, train_segment

    ref32, ref64 = references(RESHARD)
    for plan_text, world, start, end in segments:
        if world == 0:
            results = [train_segment(RESHARD, str(tmp_path), plan_text, start, end)]
        else:
            results = pools(world).run(train_segment, RESHARD, str(tmp_path), plan_text, start, end)
        for rank, res in enumerate(results):
            assert_rounding_close(res["losses"], ref32["losses"][start:end], ref64["losses"][start:end],
                                  what=f"{plan_text} rank {rank} losses of steps {start}..{end - 1}")
            assert_rounding_close(res["grad_norms"], ref32["grad_norms"][start:end], ref64["grad_norms"][start:end],
                                  what=f"{plan_text} rank {rank} gradient norms of steps {start}..{end - 1}")
    assert set(results[0]["params"]) == set(ref64["final_params"])
    assert_trained_close(results[0]["params"], ref32, ref64)


# ----------------------------------------------------------------------------- the command line, end to end

CLI_RUNS = {"one process": ["--nproc", "1"], "ep2": ["--nproc", "2", "--plan", "ep2"],
            "dp2": ["--nproc", "2", "--plan", "dp2"], "accumulation": ["--nproc", "1", "--micro-batch", "1"]}
CLI_RTOL = 2e-5
"""Relative difference allowed between two plans' losses. The plans compute the same sums in
another order (across ranks, micro-batches); float32 rounds each to 2^-24 ~ 6e-8 relative, and the
longest sum behind a loss (a mean over the batch's tokens, or a dot product over the vocabulary or
the model dim: at most 256 terms here) can gather ~256 of those: 1.5e-5. Later steps start from
weights that differ by such roundings (AdamW's per-entry normalisation can move one weight with a
near-zero gradient further, but a loss averages over all of them), so their losses differ by the
same order. A plan that routed differently (per micro-batch, as before routing groups) is off by
~1e-3 at these shapes."""


@pytest.mark.parametrize("router, runs", [
    (["--set", "top_k=2"], list(CLI_RUNS)),
    # kept short: CLI runs are slow
    pytest.param(["--set", "num_prototypes=2", "--set", "norm_topk=false"], ["one process", "ep2"],
                 marks=pytest.mark.slow),  # the prototype router's parity runs in-process above
    # transformers' pooled router loss, dropless; without accumulation (which changes its pools)
    pytest.param(["--set", "aux_loss_pooled=true", "--set", "aux_loss_coef=0.5", "--set", "capacity_factor=0"],
                 ["one process", "ep2", "dp2"], marks=pytest.mark.slow),  # in-process parity above
], ids=["top2", "prototypes2", "pooled"])
def test_tiny_moe_losses_do_not_depend_on_the_plan(tmp_path, router, runs):
    """`shoal train --model tiny-moe` (capacity 1.25) under ep2, dp2 and with micro-batch accumulation
    writes the losses of one process into metrics.jsonl."""
    import json

    from shoal import cli

    flags = ["--device", "cpu", "--model", "tiny-moe", "--global-batch", "4", "--seq-len", "32", "--steps", "3",
             "--eval-every", "100", "--ckpt-every", "100", "--log-every", "1", *router]
    losses = {}
    for name in runs:
        out = tmp_path / name.replace(" ", "_")
        assert cli.main(["train", "--out", str(out), *flags, *CLI_RUNS[name]]) == 0
        losses[name] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    single = losses.pop("one process")
    assert len(single) == 3
    for name, curve in losses.items():
        assert curve == pytest.approx(single, rel=CLI_RTOL), f"{name}: {curve} against one process's {single}"
