"""Sharded data parallelism (ZeRO-1/2/3, hybrid dp x fsdp) equals the single-process run.

Tolerances are check_parity's (shoal/testing/parity.py): sharding changes only where sums happen (a
reduce-scatter instead of an all-reduce; per-shard Adam updates are elementwise), so the
parallel run is as far from the float64 truth as the single float32 process is.
"""

from __future__ import annotations

import pytest

from shoal import rules
from shoal.plan import Plan
from shoal.testing.parity import SMALL, case, check_parity, run_parallel

GPT_SMALL = SMALL.replace(norm="layernorm", activation="gelu", pos_emb="learned", bias=True, tie_embeddings=True)

# (world, cases): several plans per worker call, since a call costs a round trip to every rank.
GROUPS = {
    2: [case(plan="fsdp2,zero=1", num_micro=2), case(plan="fsdp2,zero=2"), case(plan="fsdp2", num_micro=2),
        # ZeRO-2 reduces every micro-batch into the gradient shard; GPT style ties the embeddings.
        case(plan="fsdp2,zero=2", num_micro=2), case(plan="fsdp2,zero=2", model=GPT_SMALL),
        case(plan="fsdp2,offload=on", num_micro=2), case(plan="fsdp2,zero=1,offload=on", num_micro=2),
        # FSDP units of several blocks (zero=1/2 default to 2, the whole SMALL model) and of one.
        case(plan="fsdp2,bucket=2", num_micro=2), case(plan="fsdp2,zero=2,bucket=1"),
        # The classifier gathered by FSDP2, and split by vocabulary and never gathered (either may be
        # the default for SMALL: shoal.rules), with gradient accumulation.
        case(plan="fsdp2,vocab=gathered"), case(plan="fsdp2,vocab=sharded", num_micro=2),
        # GPT style: one table, embedding and classifier, whose two gradients add up in its shard.
        case(plan="fsdp2,vocab=sharded", model=GPT_SMALL)],
    4: [case(plan="fsdp4,zero=1", num_micro=2), case(plan="fsdp4,zero=2"), case(plan="fsdp4"),
        # A vocabulary that 4 does not divide: rows 33, 33, 33, 31 (the all-to-all pads the last); the
        # tables sharded under HSDP (dp averages each shard's gradient) and over fsdp x cp.
        case(plan="fsdp4,vocab=sharded", model=SMALL.replace(vocab_size=130)),
        case(plan="dp2,fsdp2,vocab=sharded", num_micro=2), case(plan="fsdp2,cp2,vocab=sharded"),
        case(plan="dp2,fsdp2"), case(plan="dp2,fsdp2,zero=1", num_micro=2), case(plan="dp2,fsdp2,zero=2"),
        # ZeRO-1 over a tensor-parallel model.
        case(plan="fsdp2,tp2,zero=1", num_micro=2)],
    # All three data/tensor axes at once: HSDP over a tensor-parallel model (8 ranks).
    8: [case(plan="dp2,fsdp2,tp2"), case(plan="dp2,fsdp2,tp2,zero=1", num_micro=2)],
}


def run_cases(cases):
    """Worker: run_parallel for each case in turn (module level so the pool can pickle it)."""
    return [run_parallel(c) for c in cases]


@pytest.mark.parametrize("world", sorted(GROUPS))
def test_zero_stages_match_single_process(pools, world):
    results = pools(world).run(run_cases, GROUPS[world])
    for i, c in enumerate(GROUPS[world]):
        per_rank = [r[i] for r in results]
        try:
            check_parity(per_rank, c)
        except AssertionError as err:
            raise AssertionError(f"{c.plan} (num_micro={c.num_micro}): {err}") from None


def test_zero_stage_sets_what_is_sharded(pools):
    """zero=3 (FSDP2) frees a block's full parameters after forward; zero=1/2 (shoal's engine) keep
    them as plain tensors and shard only the float32 masters the optimizer sees."""
    assert pools(2).run(_sharded_after_forward) == [{3: (True, "fsdp2"), 2: (False, "zero"), 1: (False, "zero")}] * 2


def _sharded_after_forward():
    import torch
    from torch.distributed.tensor import DTensor

    from shoal.apply_plan import parallelize
    from shoal.mesh import build_mesh
    from shoal.plan import Plan

    out = {}
    for zero in (3, 2, 1):
        plan = rules.resolve(Plan.parse(f"fsdp2,zero={zero}"), world_size=2)
        c = case(plan=str(plan))
        runtime = parallelize(c.build_model(), plan, build_mesh(plan))
        assert all(isinstance(p, DTensor) for p in runtime.parameters())  # what an optimizer updates
        runtime(c.batches()[0][0][:2]).sum()  # forward only, graph kept
        block = runtime.parts[0].layers["0"]
        out[zero] = (isinstance(block.attention.wq.weight, DTensor), runtime.choice.kind)
        del runtime
        torch.distributed.barrier()
    return out


def test_bucket_groups_blocks_into_units(pools):
    """bucket=K: K consecutive blocks share one all-gather/reduce-scatter: an FSDP2 parameter group
    at zero=3, a bucket of the ZeRO-1/2 engine (which adds one for embeddings and head)."""
    plans = ["fsdp2,zero=2", "fsdp2,zero=2,bucket=1", "fsdp2", "fsdp2,bucket=3"]
    assert pools(2).run(_units, plans) == [[2, 3, 2, 1]] * 2


def _units(plans):
    from shoal.apply_plan import parallelize
    from shoal.mesh import build_mesh
    from shoal.models import Transformer

    out = []
    for text in plans:
        plan = rules.resolve(Plan.parse(text), world_size=2)
        runtime = parallelize(Transformer(SMALL), plan, build_mesh(plan))
        if plan.zero < 3:  # the engine's own buckets
            out.append(len(runtime._engine.buckets))
        else:
            out.append(len({id(m._get_fsdp_state()) for m in runtime.parts[0].layers.values()}))  # one state per unit
    return out


def test_offload_and_bucket_need_fsdp():
    assert str(Plan.parse("fsdp2,zero=2,bucket=4,offload=on")) == "fsdp2,zero=2,bucket=4,offload=on"
    words = rules.resolve(Plan.parse("fsdp2,bucket=4,offload=on"), world_size=2).describe()
    assert "CPU memory" in words and "4 block(s) per gather/reduce unit" in words
    for text, message in (("dp2,offload=on", "offload=on acts on the fsdp axis"),
                          ("dp2,bucket=2", "bucket=2 acts on the fsdp axis")):
        with pytest.raises(ValueError, match=message):
            Plan.parse(text)
    with pytest.raises(ValueError, match="bucket='0'.*needs a whole number"):
        Plan.parse("fsdp2,bucket=0")


def test_sharded_vocab_tables_are_never_gathered(pools):
    """vocab=sharded: while the embedding and the classifier run, each holds only this rank's rows of its
    table (a Shard(0) DTensor), and its gradient is that shard; vocab=gathered: FSDP2 hands them the
    whole tables."""
    shard, whole = ("DTensor", (64, 64), (64, 64)), ("Parameter", (128, 64), (64, 64))
    assert pools(2).run(_tables_while_they_run) == [{"sharded": [shard, shard], "gathered": [whole, whole]}] * 2


def _tables_while_they_run():
    import torch
    from torch.distributed.tensor import DTensor

    from shoal.apply_plan import parallelize
    from shoal.mesh import build_mesh

    out = {}
    for vocab in ("sharded", "gathered"):
        plan = rules.resolve(Plan.parse(f"fsdp2,vocab={vocab}"), world_size=2)
        c = case(plan=str(plan))
        runtime = parallelize(c.build_model(), plan, build_mesh(plan))
        model = runtime.parts[0]
        seen: dict = {}
        for name in ("tok_embeddings", "output"):
            getattr(model, name).register_forward_pre_hook(lambda m, args, name=name, seen=seen:
                                                           seen.update({name: m.weight}))
        runtime(c.batches()[0][0][:2]).sum().backward()
        out[vocab] = []
        for name in ("tok_embeddings", "output"):
            weight = seen[name]
            local = weight.to_local() if isinstance(weight, DTensor) else weight
            grad = getattr(model, name).weight.grad
            out[vocab].append((type(weight).__name__, tuple(local.shape), tuple(grad.to_local().shape)))
        del runtime, model, seen, weight, local, grad
        torch.distributed.barrier()
    return out
