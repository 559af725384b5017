"""Mixed precision: bf16/fp16 compute with fp32 master weights tracks the fp32 run.

Tolerance: the loss of every step within 0.1% of the fp32 reference, and the first step's gradient norm and
every gradient tensor within GRAD_NORM_ROUNDINGS roundings of the compute dtype (losses alone cannot see a
gradient scaled by a constant: AdamW and clipping undo it). bf16 rounds each value to 8
significant bits (relative error up to 2^-9 = 0.2%), but matmuls accumulate in fp32 and the loss is
a mean over 128 positions whose rounding errors mostly cancel; the fp32 master weights keep the
updates themselves exact, so the curves do not drift apart over a few steps. A difference of exactly
zero would mean nothing was cast, which the test also rules out.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shoal import rules
from shoal.parallel.precision import LossScaler, PrecisionPolicy
from shoal.plan import Plan
from shoal.testing.asserts import assert_close, full_tensors
from shoal.testing.parity import SMALL, case, parallel_setup, run_parallel, run_reference
from shoal.train.step import split_micro, train_step

CASES = [case(plan="fsdp2,precision=bf16", steps=6), case(plan="dp2,precision=bf16", steps=6),
         case(plan="fsdp2,zero=2,precision=fp16", steps=6),
         case(plan="fsdp2,zero=1,precision=bf16", steps=6, num_micro=2),
         # Gradients reduced in bf16 (half the traffic): through the ZeRO-1/2 engine and FSDP2.
         case(plan="fsdp2,zero=2,precision=bf16,reduce=bf16", steps=6), case(plan="fsdp2,reduce=bf16", steps=6),
         # What a GPU runs by default: bf16 with compiled blocks (inductor keeps fused intermediates
         # in fp32, so its rounding is no worse than eager bf16's).
         case(plan="dp2,precision=bf16,compile=on", steps=6),
         # DDP under autocast: gradients reduced in bf16 by its compression hook, and fp16 with loss scaling.
         case(plan="dp2,precision=bf16,reduce=bf16", steps=6), case(plan="dp2,precision=fp16", steps=6)]


GRAD_NORM_ROUNDINGS = 8
"""The first step's gradient norm (before clipping) against the fp32 reference's, in units of u, the unit
roundoff of the compute dtype (2^-8 for bf16, 2^-11 for fp16) or of the reduction's where that is coarser: each
gradient element passes through a few 16-bit roundings on its way back through the two blocks (the products'
inputs, weights and results, the cast back to fp32, the reduction) and the norm, a root of a weighted mean of
squares, errs by no more than its elements' largest relative error; 8 u bounds that path. Each gradient tensor
is held to the same 8 u, relative to its largest element (an element's error follows the magnitudes of the
terms summed into it, which its tensor's largest element bounds, not its own value, which may cancel to
near 0). A gradient summed instead of averaged over the 2 ranks errs by 100%."""


def assert_grads_close(got: dict[str, torch.Tensor], truth: dict[str, torch.Tensor], u: float, what: str) -> None:
    """Every gradient tensor within GRAD_NORM_ROUNDINGS * u of the reference's, relative to its largest element."""
    assert got.keys() == truth.keys(), what
    for name, ref in truth.items():
        off = (got[name].float() - ref).abs().max().item()
        bound = GRAD_NORM_ROUNDINGS * u * ref.abs().max().item()
        assert off <= bound, f"{what}: gradient of {name} off by {off:.3g}, bound {bound:.3g}"
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def train_losses(cases):
    """Worker: train each case with train_step; losses, the first step's gradient norm and gradients, and the
    dtypes the model computed in."""
    out = []
    for c in cases:
        runtime, optimizer, batches = parallel_setup(c)
        grads: dict[str, torch.Tensor] = {}
        seen = lambda rt, into=grads: into.update(full_tensors(rt, grads=True))  # noqa: E731 (the first step's gradients)
        steps = [train_step(runtime, optimizer, split_micro(x, y, c.num_micro), grad_clip=c.grad_clip,
                            before_update=seen if i == 0 else None)
                 for i, (x, y) in enumerate(batches)]
        losses = [s.loss.item() for s in steps]
        master = {p.dtype for p in runtime.parameters()}  # between steps: the sharded fp32 master weights
        with torch.no_grad():
            logits_dtype = runtime(c.batches()[0][0][:1]).dtype
        scaler = runtime.loss_scaler
        out.append({"losses": losses, "grad_norm": steps[0].grad_norm.item(), "grads": grads,
                    "logits_dtype": logits_dtype,
                    "master": master,
                    "scale": scaler.scale_value if scaler is not None else None})
    return out


@pytest.mark.parametrize("c", CASES, ids=[c.plan for c in CASES])
def test_mixed_precision_tracks_fp32(pools, c):
    results = pools(2).run(train_losses, [c])
    truth = run_reference(c)
    reference = truth["losses"]
    for rank_result in (r[0] for r in results):
        plan = rules.resolve(Plan.parse(c.plan), world_size=2)
        policy = PrecisionPolicy.from_name(plan.precision, reduce=plan.reduce)
        compute, u = policy.param_dtype, max(UNIT_ROUNDOFF[policy.param_dtype], UNIT_ROUNDOFF[policy.reduce_dtype])
        assert rank_result["logits_dtype"] == compute, c.plan
        assert rank_result["master"] == {torch.float32}, c.plan  # the optimizer updates fp32 weights
        assert_close(rank_result["grad_norm"], truth["grad_norm"], rtol=GRAD_NORM_ROUNDINGS * u, atol=0,
                     what=f"{c.plan} first gradient norm")
        assert_grads_close(rank_result["grads"], truth["grads"], u, c.plan)
        assert_close(rank_result["losses"], reference, rtol=1e-3, atol=0, what=f"{c.plan} losses")
        assert rank_result["losses"] != pytest.approx(reference, rel=1e-7), f"{c.plan}: no cast happened"
        if c.plan == "fsdp2,zero=2,precision=fp16":
            assert rank_result["scale"] == 2.0**16  # no overflow at this scale on this model


MOE = dataclasses.replace(SMALL, num_experts=4, top_k=2, ffn_dim=64)
ONE_PROCESS = [case(plan="precision=bf16", steps=6), case(plan="precision=fp16", steps=6),
               case(plan="precision=bf16", steps=6, num_micro=2), case(plan="precision=bf16", steps=6, model=MOE)]
"""One data rank in mixed precision runs under torch.autocast (shoal.rules' engine "autocast"), not FSDP2; the
MoE model's experts take their tokens in bf16 there (shoal.moe.experts), its router stays fp32."""


def test_one_process_mixed_precision_tracks_fp32(pools):
    """The same tolerances as above (every step's loss, the first step's gradient norm): autocast rounds only
    each product's inputs to 16 bits, and keeps the residual stream and the element-wise work in fp32, which
    is nearer the fp32 run than FSDP2's casts."""
    results = pools(1).run(train_losses, ONE_PROCESS)
    for c, result in zip(ONE_PROCESS, results[0], strict=True):
        compute = PrecisionPolicy.from_name(rules.resolve(Plan.parse(c.plan), world_size=1).precision).param_dtype
        assert result["logits_dtype"] == compute, c.plan  # the products ran in 16 bits
        assert result["master"] == {torch.float32}, c.plan
        truth = run_reference(c)
        reference = truth["losses"]
        assert_close(result["grad_norm"], truth["grad_norm"], rtol=GRAD_NORM_ROUNDINGS * UNIT_ROUNDOFF[compute],
                     atol=0, what=f"{c.plan} first gradient norm")
        assert_grads_close(result["grads"], truth["grads"], UNIT_ROUNDOFF[compute], c.plan)
        assert_close(result["losses"], reference, rtol=1e-3, atol=0, what=f"{c.plan} losses")
        assert result["losses"] != pytest.approx(reference, rel=1e-7), f"{c.plan}: no cast happened"
    assert results[0][1]["scale"] == 2.0**16


def test_loss_scaler_skips_overflowing_steps():
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    factor, overflow = scaler.unscale(torch.tensor(float("inf")))
    assert float(factor) == 0.125 and bool(overflow) and scaler.scale_value == 4.0
    factor, overflow = scaler.unscale(torch.tensor(8.0))
    assert float(factor) == 0.25 and not bool(overflow) and scaler.scale_value == 4.0
    assert float(scaler.unscale(torch.tensor(1.0))[0]) == 0.25
    assert scaler.scale_value == 8.0  # two good steps: the scale doubles (after unscaling by the old one)
    scaler.scale_value = 1.0  # at 1 the scaled gradients are the true ones: their overflow is not the scale's
    assert not bool(scaler.unscale(torch.tensor(float("nan")))[1]) and scaler.scale_value == 0.5


def _steps(scaler: LossScaler, norms: list[float]) -> list[tuple[float, bool, float]]:
    """(unscale factor, overflow, scale after) of each step whose scaled gradient norm is given."""
    out = []
    for norm in norms:
        factor, overflow = scaler.unscale(torch.tensor(norm))
        out.append((float(factor), bool(overflow), scaler.scale_value))
    return out


def test_loss_scaler_grows_after_each_full_interval():
    """The scale doubles after every `growth_interval` finite steps in a row, not before: 3 finite
    steps at interval 3 double it once, 6 twice; the counter restarts after each growth."""
    scaler = LossScaler(init_scale=4.0, growth_interval=3)
    scales = [scale for _, _, scale in _steps(scaler, [1.0] * 7)]
    assert scales == [4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 16.0]
    assert scaler.state_dict() == {"scale": 16.0, "good_steps": 7}


def test_loss_scaler_overflow_after_growth_restarts_the_count():
    """An overflow resets the count of good steps: after growth and a partial interval, an overflow
    halves the scale, and the next growth needs a whole interval of finite steps again (a count
    kept through the overflow would double the scale one step after it)."""
    scaler = LossScaler(init_scale=4.0, growth_interval=3)
    inf = float("inf")
    got = _steps(scaler, [1.0, 1.0, 1.0, 1.0, inf, 1.0, 1.0, 1.0])
    assert [scale for _, _, scale in got] == [4.0, 4.0, 8.0, 8.0, 4.0, 4.0, 4.0, 8.0]
    assert [overflow for _, overflow, _ in got] == [False] * 4 + [True] + [False] * 3
    assert got[4][0] == 1 / 8.0  # the overflowing step is unscaled by the scale it ran at
    assert scaler.state_dict()["good_steps"] == 3


def test_loss_scaler_below_one_reports_no_overflow():
    """The scale's floor: at a scale of 1 or below the scaled gradients are no larger than the true
    ones, so a non-finite norm is the gradients' own (reported as no overflow: the step counts as a
    non-finite gradient) while the scale still halves; a finite step there unscales by 1/scale."""
    scaler = LossScaler(init_scale=2.0, growth_interval=100)
    nan = float("nan")
    got = _steps(scaler, [nan, nan, nan, 1.0])
    assert got == [(0.5, True, 1.0), (1.0, False, 0.5), (2.0, False, 0.25), (4.0, False, 0.25)]


def test_fp16_overflow_skips_the_step_through_the_runtime():
    """An fp16 step whose scaled gradients overflow leaves the weights as they were and halves the
    scale; the next step unscales, so the true gradients and their norm come out."""
    from shoal.parallel.data import TorchDataEngine
    from shoal.runtime import Runtime

    model = torch.nn.Linear(2, 1)
    runtime = Runtime(TorchDataEngine(model, model), plan=rules.resolve(Plan.parse("dp1,precision=fp16"),
                                                                        world_size=1), mesh=None,
                      choice=None)
    optimizer = torch.optim.SGD(runtime.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    batch = [(torch.ones(1, 2), torch.zeros(1, 1))]
    mse = torch.nn.functional.mse_loss
    runtime.loss_scaler.scale_value = 2.0**126  # times the loss overflows float32
    result = train_step(runtime, optimizer, batch, loss_fn=lambda out, y: mse(out, y) * 2.0 ** 20)
    assert not result.applied and result.overflow and runtime.loss_scaler.scale_value == 2.0**125
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    runtime.loss_scaler.scale_value = 1024.0
    seen = {}
    result = train_step(runtime, optimizer, batch, loss_fn=mse,
                        before_update=lambda rt: seen.update(g=[p.grad.clone() for p in rt.parameters()]))
    out = before[0].sum() + before[1]  # w . (1, 1) + b; d(out^2)/dw = 2 out, d/db = 2 out
    assert result.applied and torch.allclose(seen["g"][0], 2 * out.expand(1, 2), rtol=1e-6)
    assert float(result.grad_norm) == pytest.approx(float(2 * out.abs() * 3 ** 0.5), rel=1e-6)


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
    from shoal.train.job import Job
    from shoal.train.loop import Trainer

    cfg = RunConfig(plan="fsdp2,precision=fp16", set=("num_layers=1", "dim=32", "ffn_dim=64"),
                    loop=LoopConfig(steps=1, global_batch=4, seq_len=16, eval_batches=1))
    cfg = dataclasses.replace(cfg, model_config=resolve_model(cfg))
    trainer = Trainer(Job(config=cfg, run_dir=run_dir), torch.device("cpu"))
    trainer.runtime.loss_scaler.scale_value = 1024.0  # as if earlier overflows had halved it
    trainer.run()  # one good step, then the final checkpoint
    resumed = Trainer(Job(config=cfg, run_dir=run_dir, resume=True), torch.device("cpu"))
    scaler = resumed.runtime.loss_scaler.state_dict()
    return scaler["scale"], scaler["good_steps"]


def test_parity_harness_unscales_fp16_gradients(pools):
    """The trainer's step shows `before_update` the true (unscaled) fp16 gradients. Tolerance: fp16
    keeps 11 significant bits (unit roundoff u = 2^-11); a gradient accumulates fp16 products in
    fp32 through a few roundings of the activations, so 8 u of the largest gradient; losses as
    above (0.1%). A gradient left scaled by 2^16 would be off by 65535 times itself."""
    c = case(plan="fsdp2,zero=2,precision=fp16")
    reference = run_reference(c)
    largest = max(g.abs().max().item() for g in reference["grads"].values())
    for result in pools(2).run(run_parallel, c):
        assert_close(result["grads"], reference["grads"], rtol=0, atol=8 * 2.0**-11 * largest, what="fp16 grads")
        assert_close(result["losses"], reference["losses"], rtol=1e-3, atol=0, what="fp16 losses")


@pytest.mark.parametrize(("plan", "world", "words"), [
    ("precision=bf16", 1, "bf16 compute, fp32 master weights"),
    ("fsdp2,precision=bf16", 2, "bf16 compute, fp32 master weights, gradients reduced in fp32"),
    ("tp2,precision=fp16", 2, "fp16 compute, fp32 master weights"),
    ("fp32", 1, "fp32"),
])
def test_the_summary_names_a_reduction_only_where_gradients_are_reduced(plan, world, words):
    """One data rank reduces no gradient (autocast's one process, tp alone): the run's summary does not say it."""
    from shoal.train.loop import _precision_words

    text = plan if plan != "fp32" else "precision=fp32"
    assert _precision_words(rules.resolve(Plan.parse(text), world_size=world, device="cpu")) == words


def test_the_trainer_says_which_fp16_steps_overflowed(tmp_path, capfd):
    """fp16's first steps overflow at the initial loss scale of 2**16 on the image Mixer: metrics.jsonl marks each
    skipped step (exactly those whose gradient norm is not finite: null), as loss-scale overflows that stop
    nothing, the progress bar says so, the summary counts
    them, and torch's warning about a scheduler stepping before its optimizer (true of a skipped first step, and
    misleading) is not printed."""
    import json

    from shoal import cli

    out = tmp_path / "run"
    assert cli.main(["train", "--model", "sparse-mlp", "--plan", "precision=fp16", "--nproc", "1", "--steps", "4",
                     "--log-every", "2", "--eval-every", "0", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in records if r.get("skipped")]
    assert skipped and skipped == [r["step"] for r in records if r["grad_norm"] is None]  # strict JSON: null
    assert skipped == [r["step"] for r in records if r.get("loss_scale_overflow")]  # the scale's, not counted
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == summary["loss_scale_overflows"] == len(skipped)
    assert summary["nonfinite_steps"] == []
    said = "".join(capfd.readouterr())
    assert "skipped, the fp16 gradients overflowed" in said and f"{len(skipped)} step(s) skipped" in said
    assert "lr_scheduler.step()" not in said
