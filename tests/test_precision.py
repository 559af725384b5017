"""Mixed precision: bf16/fp16 compute with fp32 master weights tracks the fp32 run.

Tolerance: the loss of every step within 0.1% of the fp32 reference (measured: 3e-5 for bf16, 1e-5
for fp16). bf16 rounds each value to 8 significant bits (relative error up to 2^-9 = 0.2%), but
matmuls accumulate in fp32 and the loss is a mean over 128 positions whose rounding errors mostly
cancel; the fp32 master weights keep the updates themselves exact, so the curves do not drift
apart over a few steps. A difference of exactly zero would mean nothing was cast, which the test
also rules out.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shoal.mesh import data_rank
from shoal.parallel.precision import LossScaler, PrecisionPolicy
from shoal.parallelize import parallelize
from shoal.plan import Plan
from shoal.testing import assert_close, cached_mesh, case, run_parallel, run_reference
from shoal.train.step import split_micro, train_step

CASES = [case(plan="fsdp2,precision=bf16", steps=6), case(plan="dp2,precision=bf16", steps=6),
         case(plan="fsdp2,zero=2,precision=fp16", steps=6), case(plan="fsdp2,zero=1,precision=bf16", steps=6, num_micro=2),
         # Gradients reduced in bf16 (half the traffic): through the ZeRO-1/2 engine and FSDP2.
         case(plan="fsdp2,zero=2,precision=bf16,reduce=bf16", steps=6), case(plan="fsdp2,reduce=bf16", steps=6)]


def train_losses(cases):
    """Worker: train each case with train_step; losses, and the dtypes the model computed in."""
    out = []
    for c in cases:
        plan = Plan.parse(c.plan).resolve(dist.get_world_size())
        mesh = cached_mesh(plan)
        model = parallelize(c.build_model(), plan, mesh)
        optimizer = c.optimizer(model)
        index, count = data_rank(mesh)
        rows = c.global_batch // count
        losses = []
        for x, y in c.batches():
            micro = split_micro(x[index * rows:(index + 1) * rows], y[index * rows:(index + 1) * rows], c.num_micro)
            losses.append(train_step(model, optimizer, micro, mesh=mesh, grad_clip=c.grad_clip)[0])
        master = {p.dtype for p in model.parameters()}  # between steps: the sharded fp32 master weights
        with torch.no_grad():
            logits_dtype = model(c.batches()[0][0][:1]).dtype
        out.append({"losses": losses, "logits_dtype": logits_dtype, "master": master,
                    "scale": getattr(getattr(model, "loss_scaler", None), "scale_value", None)})
    return out


def test_mixed_precision_tracks_fp32(pools):
    results = pools(2).run(train_losses, CASES)
    for i, c in enumerate(CASES):
        reference = run_reference(c)["losses"]
        for rank_result in (r[i] for r in results):
            compute = PrecisionPolicy.from_name(Plan.parse(c.plan).precision).param_dtype
            assert rank_result["logits_dtype"] == compute, c.plan
            assert rank_result["master"] == {torch.float32}, c.plan  # the optimizer updates fp32 weights
            assert_close(rank_result["losses"], reference, rtol=1e-3, atol=0, what=f"{c.plan} losses")
            assert rank_result["losses"] != pytest.approx(reference, rel=1e-7), f"{c.plan}: no cast happened"
    assert results[0][2]["scale"] == 2.0**16  # fp16: no overflow at this scale on this model


def test_loss_scaler_skips_overflowing_steps():
    model = torch.nn.Linear(2, 2)
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    model(torch.ones(1, 2)).sum().mul(scaler.scale_value).backward()
    ok, norm = scaler.unscale_and_clip_(model, torch.tensor(float("inf")), 1.0)
    assert not ok and scaler.scale_value == 4.0
    model.zero_grad()
    model(torch.ones(1, 2)).sum().mul(scaler.scale_value).backward()  # bias gradient 1 x scale 4
    ok, norm = scaler.unscale_and_clip_(model, torch.tensor(8.0), None)
    assert ok and float(norm) == 2.0 and model.bias.grad.tolist() == [1.0, 1.0]
    scaler.unscale_and_clip_(model, torch.tensor(1.0), None)
    assert scaler.scale_value == 8.0  # two good steps: the scale doubles


def test_bad_precision_is_rejected():
    with pytest.raises(ValueError, match="valid: fp32, bf16, fp16"):
        PrecisionPolicy.from_name("fp8")


def test_loss_scale_survives_resume(pools, tmp_path):
    """fp16: the scale a run reached is saved with its checkpoint and restored on resume
    (a fresh 2^16 would overflow again, skipping steps the unbroken run took)."""
    assert pools(2).run(_save_and_resume_scale, str(tmp_path / "run")) == [(1024.0, 1)] * 2


def _save_and_resume_scale(run_dir):
    import dataclasses

    from shoal.train.config import LoopConfig, RunConfig, resolve_model
    from shoal.train.loop import Job, Trainer

    cfg = RunConfig(plan="fsdp2,precision=fp16", set=("num_layers=1", "dim=32", "ffn_dim=64"),
                    loop=LoopConfig(steps=1, global_batch=4, seq_len=16, eval_batches=1))
    cfg = dataclasses.replace(cfg, model_config=resolve_model(cfg))
    trainer = Trainer(Job(config=cfg, run_dir=run_dir), torch.device("cpu"))
    trainer.model.loss_scaler.scale_value = 1024.0  # as if earlier overflows had halved it
    trainer.run()  # one good step, then the final checkpoint
    resumed = Trainer(Job(config=cfg, run_dir=run_dir, resume=True), torch.device("cpu"))
    scaler = resumed.model.loss_scaler.state_dict()
    return scaler["scale"], scaler["good_steps"]


def test_parity_harness_unscales_fp16_gradients(pools):
    """run_parallel's hand-stepped first step reports true (unscaled) fp16 gradients. Tolerance:
    fp16 compute rounds to 11 significant bits (2^-11 = 5e-4 relative); measured max difference
    5e-5 against a largest gradient of 0.06, so atol 2e-4; losses as above (0.1%)."""
    c = case(plan="fsdp2,zero=2,precision=fp16")
    reference = run_reference(c)
    for result in pools(2).run(run_parallel, c):
        assert_close(result["grads"], reference["grads"], rtol=0, atol=2e-4, what="fp16 grads")
        assert_close(result["losses"], reference["losses"], rtol=1e-3, atol=0, what="fp16 losses")
