"""Tensor parallelism (with and without sequence parallelism, alone and under data parallelism)
equals the single-process run: logits, every gradient, parameters after one AdamW step, the loss
over several steps and the final parameters.

Tolerances are check_parity's (shoal/testing/parity.py): tensor parallelism changes only the order of
floating-point sums (a row-parallel matmul adds t partial sums of D/t terms, the softmax's sum of
exponentials is added shard by shard), so the parallel run is as far from the float64 truth as
the single float32 process is, like data parallelism's all-reduce.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shoal import rules
from shoal.models import PRESETS, ModelConfig
from shoal.plan import Plan
from shoal.testing.parity import SMALL, case, check_parity, parallel_setup, run_parallel
from shoal.train.step import split_micro

GPT = PRESETS["tiny-gpt"].replace(num_layers=2, max_seq_len=32)
# The Whale case at small scale: a 100,000-class classifier over a one-layer body.
WIDE = ModelConfig(num_layers=1, dim=32, num_heads=4, ffn_dim=64, vocab_size=100_000, max_seq_len=16)


@pytest.mark.parametrize(
    "world, plan, model",
    [
        (2, "tp2", SMALL),
        (2, "tp2,sp=off", SMALL),
        (4, "tp4", SMALL),
        (4, "tp4,sp=off", SMALL),
        (4, "dp2,tp2", SMALL),
        (4, "dp2,tp2,sp=off", SMALL),
        (4, "fsdp2,tp2", SMALL),
        (2, "tp2", GPT),
        (2, "tp2,sp=off", GPT),
    ],
    ids=["tp2", "tp2-nosp", "tp4", "tp4-nosp", "dp2-tp2", "dp2-tp2-nosp", "fsdp2-tp2", "gpt-tp2", "gpt-tp2-nosp"],
)
def test_tp_matches_single_process(pools, world, plan, model):
    c = case(plan=plan, model=model)
    check_parity(pools(world).run(run_parallel, c), c)


def test_tp_gradient_accumulation(pools):
    c = case(plan="tp2", num_micro=2)
    check_parity(pools(2).run(run_parallel, c), c)


def test_wide_classifier_tp(pools):
    """100k classes, vocabulary-parallel embedding and loss: the logits are never gathered."""
    c = case(plan="tp2", model=WIDE, steps=3, global_batch=4, seq_len=8)
    check_parity(pools(2).run(run_parallel, c), c)


def test_tp_partial_gradients_reduced_once(pools):
    """Under sequence parallelism the norm weights' gradients come out of backward as partial sums;
    the runtime reduces them in one all-reduce, so that the gradient norm reduces only the norm
    itself and the optimizer step communicates nothing (DTensor alone would all-reduce each such
    gradient at every use). The values are the parity tests' concern (tp2 above)."""
    norm_weights = 2 * SMALL.num_layers + 1
    assert pools(2).run(_collectives_per_phase) == [(norm_weights, 1, 0)] * 2


def _collectives_per_phase() -> tuple[int, int, int]:
    """(tensors reduced after backward, all-reduces in the gradient norm, collectives in the optimizer step)."""
    from torch.distributed.tensor import DTensor
    from torch.profiler import ProfilerActivity, profile

    from shoal.parallel.tensor import reduce_partial_grads

    runtime, optimizer, batches = parallel_setup(case(plan="tp2"))
    runtime.forward_backward(split_micro(*batches[0], 1))
    partial = [n for n, p in runtime.named_parameters()
               if isinstance(p.grad, DTensor) and any(x.is_partial() for x in p.grad.placements)]
    assert not partial, partial

    def collectives(fn: Any) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        return sum(e.count for e in prof.key_averages() if e.key.startswith("c10d::"))

    norms = collectives(runtime.grad_norm)
    stepped = collectives(optimizer.step)
    # A second backward leaves partial sums again; reducing them counts the norm weights.
    optimizer.zero_grad(set_to_none=True)
    runtime._engine.model(batches[0][0]).full_tensor().float().pow(2).mean().backward()
    reduced = reduce_partial_grads(runtime.parameters())
    return reduced, norms, stepped


def test_layout_after_tp(pools):
    """Every parameter is a DTensor on the tp mesh, tied embeddings stay one (vocab-sharded)
    parameter, the logits stay vocab-sharded, and the residual stream is sequence-sharded."""
    assert pools(2).run(_layout, GPT) == [True, True]


def _layout(model_cfg: ModelConfig) -> bool:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from shoal.mesh import build_mesh
    from shoal.parallel.tensor import apply_tensor_parallel

    plan = rules.resolve(Plan.parse("tp2"), world_size=dist.get_world_size())
    torch.manual_seed(0)
    from shoal.models import Transformer

    model = apply_tensor_parallel(Transformer(model_cfg), mesh=build_mesh(plan), plan=plan)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.placements == (Shard(0),)
    seen = {}
    model.layers["0"].register_forward_pre_hook(lambda _m, args: seen.update(h=args[0].shape))
    logits = model(torch.zeros(2, 8, dtype=torch.long))
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
    assert logits.to_local().shape == (2, 8, model_cfg.vocab_size // 2)
    assert seen["h"] == (2, 4, model_cfg.dim)  # sequence-sharded between sublayers
    with pytest.raises(ValueError, match="sequence length 7 does not split over tp=2"):
        model(torch.zeros(2, 7, dtype=torch.long))
    return True


@pytest.mark.parametrize(
    "plan, cfg, message",
    [
        ("tp3", SMALL, "tp=3 does not divide 8 attention heads; valid: tp in 1, 2, 4"),
        ("tp8", SMALL, "tp=8 does not divide 4 KV heads; valid: tp in 1, 2, 4"),
        ("tp4", SMALL.replace(ffn_dim=130), "tp=4 does not divide 130 FFN hidden size; valid: tp in 1, 2"),
        ("tp4", SMALL.replace(vocab_size=130), "tp=4 does not divide 130 vocabulary size; valid: tp in 1, 2"),
        ("tp2", SMALL,
         "tp=2 with sequence parallelism does not divide the sequence length 15; valid: tp in 1, 3, 5, 15"),
    ],
)
def test_tp_degree_errors(plan, cfg, message):
    p = rules.resolve(Plan.parse(plan), world_size=Plan.parse(plan).tp)
    with pytest.raises(ValueError, match=message.split(";")[0]):
        rules.validate(p, cfg, global_batch=8, seq_len=15 if "sequence" in message else 16)


def test_tp_error_for_a_model_passed_directly():
    """parallelize asks shoal.rules with the model's own config before touching the mesh."""
    from types import SimpleNamespace

    from shoal.apply_plan import parallelize
    from shoal.models import Transformer

    mesh = SimpleNamespace(size=lambda: 3, device_type="cpu")  # refused before any collective
    with pytest.raises(ValueError, match="tp=3 does not divide 8 attention heads; valid: tp in 1, 2, 4"):
        parallelize(Transformer(SMALL), Plan.parse("tp3"), mesh)  # type: ignore[arg-type]  # a stand-in mesh


def test_gloo_s_all_to_all_fallback_warning_is_filtered():
    """The column-split embedding's re-split from features to sequence is an all-to-all, which gloo lacks:
    DTensor gathers and chunks instead and warns on every rank. shoal.parallel.tensor filters that one
    message of that logger, no other."""
    import logging

    import shoal.parallel.tensor  # noqa: F401  (installs the filter)

    logger = logging.getLogger("torch.distributed.tensor._collective_utils")

    def record(message: str) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 0, message, (), None)

    fallback = record("CPU process group does not support alltoall yet, falling back with allgather + chunk!")
    assert not all(f.filter(fallback) for f in logger.filters)
    assert all(f.filter(record("something else went wrong")) for f in logger.filters)
