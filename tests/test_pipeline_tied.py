"""Tied input and output embeddings under pipeline parallelism: a copy of the table on the first
and the last stage, their gradients all-reduced (Megatron-LM's way), trained against one process.

Tolerances are check_parity's measured-rounding bounds (shoal/testing.py): the table's gradient is
the sum of the embedding's and the head's contributions, added on the last step's all-reduce in
another order than one process's autograd accumulation, which is float32 rounding of one more sum;
the gradient norm subtracts the last stage's copy once (rounding of the same size). Each check
names the max difference it saw when it fails.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shoal.plan import Plan
from shoal.testing import (
    SMALL,
    assert_rounding_close,
    assert_trained_close,
    case,
    check_parity,
    references,
    run_parallel,
    train_segment,
)

TIED = dataclasses.replace(SMALL, num_layers=4, tie_embeddings=True)
"""shoal's Llama-style model with the head tied to the embedding (Llama 3.2 1B/3B, Qwen2.5 0.5B-3B)."""
GPT = dataclasses.replace(TIED, norm="layernorm", activation="gelu", pos_emb="learned", bias=True, ffn_dim=256,
                          num_kv_heads=8)
"""GPT-2's structure (learned positions, only on the first stage; biases; tied head)."""


def _pp_case(plan: str, model=TIED, **kwargs):
    return case(plan=plan, model=model, num_micro=Plan.parse(plan).micro_batches, steps=3, **kwargs)


_SLOW = pytest.mark.slow  # the same sums in other schedules' orders: the sweep, not every CI run


@pytest.mark.parametrize("plan", ["pp2", "pp2,sched=zb", pytest.param("pp2,sched=gpipe", marks=_SLOW),
                                  pytest.param("pp2,sched=interleaved,vpp=2", marks=_SLOW)])
def test_tied_pp2_matches_single_process(pools, plan):
    """Logits, every gradient (the tied table's on both stages), the gradient norm, the first AdamW
    step and three steps' losses and parameters equal one process's."""
    c = _pp_case(plan)
    results = pools(2).run(run_parallel, c)
    check_parity(results, c)
    first, last = results  # both stages hold the table, with the whole model's gradient
    assert "tok_embeddings.weight" in first["grads"] and "tok_embeddings.weight" in last["grads"]
    assert torch.equal(first["final_params"]["tok_embeddings.weight"], last["final_params"]["tok_embeddings.weight"])


def test_tied_gpt_structure_pp2(pools):
    c = _pp_case("pp2,sched=zb", model=GPT)
    check_parity(pools(2).run(run_parallel, c), c)


@pytest.mark.parametrize("plan", ["dp2,pp2", "fsdp2,pp2", pytest.param("fsdp2,pp2,zero=2,sched=zb", marks=_SLOW)])
def test_tied_pp_composes_with_data_axes(pools, plan):
    """The copies' gradients sharded by FSDP2 or ZeRO, or replicated over dp: summed shard by shard."""
    c = _pp_case(plan)
    check_parity(pools(4).run(run_parallel, c), c)


@_SLOW
def test_tied_pp4_pairs_first_and_last(pools):
    """pp4: the first and last stages are ranks 0 and 3; the middle ones hold no copy."""
    c = _pp_case("pp4,mb=4", model=dataclasses.replace(TIED, num_layers=4))
    check_parity(pools(4).run(run_parallel, c), c)


RUN = case(steps=4, model=TIED, num_micro=2)


def _stored(path) -> tuple[set[str], int]:
    """A checkpoint's model keys, and how many stored pieces hold the embedding table."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata()
    keys = {k for k in meta.state_dict_metadata if k.startswith("model.")}
    return keys, sum(1 for index in meta.storage_data if index.fqn == "model.tok_embeddings.weight")


def test_tied_checkpoint_from_pp2_resumes_in_one_process(pools, tmp_path):
    """Saved under pp2, the checkpoint holds the table once (one stored piece, the keys of a
    one-process checkpoint) and resumes in one process on the unbroken loss curve."""
    from shoal.train.checkpoint import latest_checkpoint

    ref32, ref64 = references(RUN)
    results = pools(2).run(train_segment, RUN, str(tmp_path), "pp2,mb=2", 0, 2, 2)
    pp_keys, pieces = _stored(latest_checkpoint(tmp_path))
    assert pieces == 1
    single = train_segment(RUN, str(tmp_path), "single", 2, 4, 2)
    assert _stored(latest_checkpoint(tmp_path))[0] == pp_keys
    for what, res, (start, end) in (("pp2", results[0], (0, 2)), ("single", single, (2, 4))):
        assert_rounding_close(res["losses"], ref32["losses"][start:end], ref64["losses"][start:end],
                              what=f"{what} losses of steps {start}..{end - 1}")
    assert_trained_close(single["params"], ref32, ref64)
