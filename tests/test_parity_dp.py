"""Data parallelism equals the single-process run with the global batch held fixed."""

from __future__ import annotations

import pytest

from shoal.testing import case, check_parity, run_parallel, run_reference


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
