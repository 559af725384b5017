"""compile=on (torch.compile per transformer block, or of the whole model in one process) equals the
single-process eager reference, under every data-parallel engine, tensor parallelism and selective recompute.

The tolerance is the harness's: a compiled kernel fuses element-wise ops and so rounds
differently from eager, but each result must stay within SLACK x the eager float32 run's own
error against the float64 reference (see shoal.testing.asserts). A cold compile is slow on a CPU, so
the cases share the compiled graphs inside each worker pool's processes.
"""

from __future__ import annotations

import pytest

from shoal.testing.parity import case, check_parity, run_parallel


@pytest.mark.parametrize(
    "plan",
    ["dp2,compile=on", "fsdp2,compile=on", "fsdp2,zero=1,compile=on", "tp2,compile=on",
     "dp2,ac=selective,compile=on"],
    ids=["ddp", "fsdp2", "zero1-engine", "tp2", "selective-recompute"],
)
def test_compiled_blocks_match_single_process(pools, plan):
    c = case(plan=plan)
    check_parity(pools(2).run(run_parallel, c), c)


def test_compiled_blocks_keep_clean_names_and_share_one_graph():
    """Names stay the user's (the optimizer, checkpoints and exports never see `_orig_mod`, so a
    run saved with compile=on resumes with compile=off and back), and the blocks share one
    compiled graph: the second block is not a recompile."""
    import torch
    import torch._dynamo

    from shoal import rules
    from shoal.models import Transformer
    from shoal.parallel.compile import apply_compile
    from shoal.plan import Plan
    from shoal.testing.parity import SMALL

    torch._dynamo.reset()
    model = apply_compile(Transformer(SMALL), plan=rules.resolve(Plan.parse("dp2,compile=on"), world_size=2))
    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    model(torch.randint(0, SMALL.vocab_size, (2, 8))).sum().backward()
    assert all(type(b).__name__ == "OptimizedModule" for b in model.layers.values())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames_before == 1
    from shoal.apply_plan import parallelize

    runtime, plain = parallelize(model), Transformer(SMALL)
    assert [n for n, _ in runtime.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert set(runtime.state_dict()["model"]) == set(runtime.full_weights()) == set(plain.state_dict())


def test_one_process_compiles_the_whole_model_as_one_graph():
    """In one process no engine hooks a block, so the whole model is one compiled graph, as in the plain compiled
    loop: the dense model compiles without a graph break, no block is wrapped, and the names stay the user's."""
    import torch
    import torch._dynamo

    from shoal import rules
    from shoal.models import Transformer
    from shoal.parallel.compile import apply_compile
    from shoal.plan import Plan
    from shoal.testing.parity import SMALL

    torch._dynamo.reset()
    model = apply_compile(Transformer(SMALL), plan=rules.resolve(Plan.parse("dp1,compile=on"), world_size=1))
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    model(torch.randint(0, SMALL.vocab_size, (2, 8))).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 1
    assert not any(type(b).__name__ == "OptimizedModule" for b in model.layers.values())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in Transformer(SMALL).named_parameters()]


def test_whole_model_compile_matches_single_process(pools):
    c = case(plan="dp1,compile=on")
    check_parity(pools(1).run(run_parallel, c), c)
