"""Data parallelism equals the single-process run with the global batch held fixed."""

from __future__ import annotations

import pytest

from shoal.testing.parity import case, check_parity, run_parallel


@pytest.mark.parametrize(
    "world, plan, num_micro",
    [(2, "dp2", 1), (4, "dp4", 1), (2, "dp2", 2)],
    ids=["dp2", "dp4", "dp2-accum2"],
)
def test_dp_matches_single_process(pools, world, plan, num_micro):
    c = case(plan=plan, num_micro=num_micro)
    check_parity(pools(world).run(run_parallel, c), c)


def test_dp_gpt_style(pools):
    from shoal.models import PRESETS

    c = case(plan="dp2", model=PRESETS["tiny-gpt"].replace(num_layers=2, max_seq_len=32))
    check_parity(pools(2).run(run_parallel, c), c)


def test_rank_failure_names_the_rank(pools):
    pool = pools(2)
    with pytest.raises(RuntimeError, match="rank 1 of 2"):
        pool.run(_fail_on_rank_1)
    assert pools(2).run(_rank) == [0, 1]  # a fresh pool replaces the broken one


def _fail_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom")
    return dist.get_rank()


def _rank():
    import torch.distributed as dist

    return dist.get_rank()


def test_the_harness_catches_real_defects(pools):
    """check_parity passes the true dp2 results and fails each of these defects: a gradient off by
    0.1% (a wrong average is off by 50%), a gradient norm taken over half the gradients (one
    shard's), a first step that moved one entry by an extra lr/10, and one final tensor with half
    its rows left where they started (a shard never updated)."""
    import copy

    import pytest

    from shoal.testing.parity import references

    c = case(plan="dp2")
    good = pools(2).run(run_parallel, c)
    check_parity(good, c)
    ref32, _ = references(c)
    name = "layers.0.attention.wq.weight"

    def broken(edit):
        results = copy.deepcopy(good)
        for r in results:
            edit(r)
        with pytest.raises(AssertionError):
            check_parity(results, c)

    broken(lambda r: r["grads"][name].mul_(1.001))
    broken(lambda r: r.update(grad_norm=r["grad_norm"] * 0.5 ** 0.5))
    broken(lambda r: r["params"][name][0, 0].add_(c.lr / 10))
    rows = ref32["init_params"][name].shape[0] // 2
    broken(lambda r: r["final_params"][name][:rows].copy_(ref32["init_params"][name][:rows]))
