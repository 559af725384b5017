"""Float8 training (the plan option fp8=, shoal/parallel/float8.py): which layers run in float8, its losses
against bf16's, and every parallel plan's fp8 losses, first gradient norm and gradients (GRAD_NORM_REL,
GRAD_TENSOR_REL) against fp8 in one process.

Tolerances, per step's loss (absolute), from the formats' unit roundoffs: e4m3 keeps 4 significant bits
(3 stored), U8 = 2^-4; bf16 8 (7 stored), U16 = 2^-8.
- fp8 against bf16 (the same plan): a float8 product rounds both operands (dynamic scales keep every element
  in e4m3's range, so each is off by at most U8 relative), so its output is off by at most 2 U8 relative to
  its terms' scale; a logit z is off by about that share of it. The loss of one position moves by at most
  2 max|dz| (the softmax's gradient has an l1 norm <= 2), and the loss is a mean over N positions whose rounding
  errors are independent with mean zero, so it moves by about 2 * 2 U8 * max|z| / sqrt(N) (the worst case, every
  error aligned, is sqrt(N) = 11 times that). max|z| is measured on the reference model's first batch in bf16.
  Measured differences are 15-21 times below the bound; six steps of AdamW at lr 1e-3 move the loss by under
  0.03, so the updates' own differences (gradients in float8 too; e5m2, U = 2^-3, under tensorwise) add a
  fraction of that. A difference of exactly zero would mean nothing ran in float8, which is ruled out too.
- fp8 under a parallel plan against fp8 in one process: both round the same values to float8; they differ
  where a bf16 value differs by a reduction order (at most 2 U16 relative), which moves its float8 rounding
  only where it lies within 2 U16 of a rounding midpoint (midpoints are 2 U8 apart: one value in U8 / U16 = 16),
  by 2 U8: 2 U16 per operand on average. The engines also round different values to bf16 (autocast in one
  process keeps the residual stream in fp32, FSDP2 casts the parameters): another 2 U16. So 4 U16 per operand,
  8 U16 per product instead of 2 U8 (four times tighter): 2 * 8 U16 * max|z| / sqrt(N). Measured: 2.6-8 times
  below.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from shoal import rules
from shoal.models.config import get_preset
from shoal.parallel.float8 import apply_float8, convertible, is_float8
from shoal.plan import Plan
from shoal.planner import hardware
from shoal.planner.cluster_file import parse_cluster
from shoal.planner.estimate import Workload, estimate
from shoal.testing.asserts import full_tensors
from shoal.testing.parity import SMALL, ParityCase, case, parallel_setup
from shoal.train.step import split_micro, train_step

U8, U16 = 2.0**-4, 2.0**-8
STEPS = 6
MOE = dataclasses.replace(SMALL, num_experts=4, top_k=2, ffn_dim=64)
BLOCK_LINEARS = sorted(f"layers.{i}.{m}" for i in range(SMALL.num_layers) for m in (
    "attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
    "feed_forward.w3"))

ONE = [case(plan=p, steps=STEPS) for p in ("precision=bf16", "fp8=rowwise", "fp8=tensorwise", "fp8=rowwise,compile=on")]
ONE_MOE = [case(plan=p, model=MOE, steps=STEPS) for p in ("precision=bf16", "fp8=rowwise")]
TWO = [case(plan=p, steps=STEPS) for p in (
    "dp2,precision=bf16", "dp2,fp8=rowwise", "fsdp2,precision=bf16", "fsdp2,fp8=rowwise", "fsdp2,fp8=tensorwise",
    "tp2,precision=bf16", "tp2,fp8=rowwise", "tp2,fp8=tensorwise", "fsdp2,zero=1,fp8=rowwise", "cp2,fp8=rowwise",
    "fsdp2,fp8=tensorwise,compile=on", "fsdp2,offload=on,fp8=tensorwise")] + [
    case(plan="pp2,fp8=rowwise", steps=STEPS, num_micro=4), case(plan="ep2,fp8=rowwise", model=MOE, steps=STEPS)]


def train_losses(cases: list[ParityCase]) -> list[dict]:
    """Worker: train each case with train_step; its losses, its first step's gradient norm (global, before
    clipping) and gradients (whole tensors), its float8 modules' names, their recipe's weight scaling and whether
    FSDP2 gathers them in float8."""
    out = []
    for c in cases:
        runtime, optimizer, batches = parallel_setup(c)
        grads: dict[str, torch.Tensor] = {}
        seen = lambda rt, into=grads: into.update(full_tensors(rt, grads=True))  # noqa: E731 (the first step's gradients)
        steps = [train_step(runtime, optimizer, split_micro(x, y, c.num_micro), grad_clip=c.grad_clip,
                            before_update=seen if i == 0 else None)
                 for i, (x, y) in enumerate(batches)]
        losses = [s.loss.item() for s in steps]
        float8 = {n.replace("_orig_mod.", ""): m for part in runtime.parts for n, m in part.named_modules()
                  if is_float8(m)}
        out.append({"losses": losses, "grad_norm": steps[0].grad_norm.item(), "grads": grads, "float8": sorted(float8),
                    "scaling": {m.config.cast_config_weight.scaling_granularity.value for m in float8.values()},
                    "gather": {m.config.enable_fsdp_float8_all_gather for m in float8.values()}})
    return out


def max_logit(model: object) -> float:
    """max|z| of the reference model's logits on the first batch, in bf16 (the tolerances' scale)."""
    c = case(model=model)  # type: ignore[arg-type]  # a ModelShape
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return float(c.build_model()(c.batches()[0][0]).abs().max())


def bounds(model: object) -> tuple[float, float]:
    """(fp8 against bf16, fp8 in parallel against fp8 in one process): the module docstring's bounds."""
    c = case(model=model)  # type: ignore[arg-type]  # a ModelShape
    spread = 2 * max_logit(model) / math.sqrt(c.global_batch * c.seq_len)
    return 2 * U8 * spread, 8 * U16 * spread


def close(got: list[float], want: list[float], atol: float, what: str) -> None:
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst <= atol, f"{what}: losses differ by up to {worst:.3g} > {atol:.3g}\n{got}\n{want}"


GRAD_NORM_REL = 4 * 8 * U16
"""The first step's gradient norm of fp8 under a parallel plan against fp8 in one process, relative: each
gradient element passes through about four products on its way back through a block (the two blocks' output
and input gradients), each off by at most 8 U16 relative (the module docstring's parallel bound per product),
and the norm errs by no more than its elements' largest relative error: 12.5%. A gradient summed over the 2
ranks instead of averaged errs by 100%; the losses alone would not show it (clipping and AdamW undo a constant
scale)."""

GRAD_TENSOR_REL = {"rowwise": GRAD_NORM_REL, "tensorwise": 2 * GRAD_NORM_REL}
"""Each gradient tensor against one process's, as the l2 norm of the difference relative to the tensor's norm
(a norm of the tensor's elements' errors, bounded as the global norm's above; an element's own relative error is
unbounded where its terms cancel). Under tensorwise the products of the backward also round their gradient
operand to e5m2: one more operand off by the module docstring's 4 U16 per product, twice the bound."""


def close_norm(got: dict, want: dict, what: str) -> None:
    """The first step's gradient norm within GRAD_NORM_REL and every gradient tensor within GRAD_TENSOR_REL."""
    a, b = got["grad_norm"], want["grad_norm"]
    assert abs(a - b) <= GRAD_NORM_REL * b, f"{what}: first gradient norm {a:.6g} against {b:.6g}"
    rel = GRAD_TENSOR_REL["tensorwise" if "tensorwise" in what else "rowwise"]
    assert got["grads"] and got["grads"].keys() <= want["grads"].keys(), what  # under pp: the first stage's
    for name, grad in got["grads"].items():
        ref = want["grads"][name].float()
        off = (grad.float() - ref).norm().item()
        bound = rel * ref.norm().item()
        assert off <= bound, f"{what}: gradient of {name} off by {off:.3g}, bound {bound:.3g}"


@pytest.fixture(scope="module")
def runs(pools) -> dict[str, dict]:
    """Every case's result by plan (rank 0's; the losses are global), one-process MoE cases prefixed "moe:"."""
    one = pools(1).run(train_losses, ONE + ONE_MOE)[0]
    two = pools(2).run(train_losses, TWO)[0]
    keys = [c.plan for c in ONE] + [f"moe:{c.plan}" for c in ONE_MOE] + [c.plan for c in TWO]
    return dict(zip(keys, one + two, strict=True))


def test_blocks_linears_in_float8_head_and_embedding_not(runs):
    for plan in ("fp8=rowwise", "dp2,fp8=rowwise", "fsdp2,fp8=tensorwise", "tp2,fp8=rowwise", "cp2,fp8=rowwise",
                 "fp8=rowwise,compile=on"):
        assert runs[plan]["float8"] == BLOCK_LINEARS, plan  # not `output` (the head), not the embedding
    assert runs["pp2,fp8=rowwise"]["float8"] == BLOCK_LINEARS[:7]  # rank 0: the first stage's block
    for plan in ("moe:fp8=rowwise", "ep2,fp8=rowwise"):  # the MoE layers (router and experts) stay bf16
        assert runs[plan]["float8"] == [n for n in BLOCK_LINEARS if ".attention." in n], plan
    for plan in ("precision=bf16", "dp2,precision=bf16", "tp2,precision=bf16"):
        assert runs[plan]["float8"] == [], plan


def test_recipe_and_fsdp_float8_gather(runs):
    """The recipe named in the plan is the one that runs; FSDP2 gathers weights in float8 under tensorwise only
    (torchao offers it for tensorwise scaling), and only where FSDP2 shards (not shoal's ZeRO-1/2 engine)."""
    for plan, scaling, gather in (
            ("fp8=rowwise", "axiswise", False), ("fp8=tensorwise", "tensorwise", False),
            ("fsdp2,fp8=rowwise", "axiswise", False), ("fsdp2,fp8=tensorwise", "tensorwise", True),
            ("fsdp2,offload=on,fp8=tensorwise", "tensorwise", True),
            ("tp2,fp8=tensorwise", "tensorwise", False), ("fsdp2,zero=1,fp8=rowwise", "axiswise", False)):
        assert runs[plan]["scaling"] == {scaling}, plan
        assert runs[plan]["gather"] == {gather}, plan


@pytest.mark.parametrize("axes", ["", "dp2,", "fsdp2,", "tp2,"])
def test_fp8_tracks_bf16(runs, axes):
    loose, _ = bounds(SMALL)
    bf16 = runs[f"{axes}precision=bf16"]["losses"]
    for recipe in ("rowwise", "tensorwise"):
        plan = f"{axes}fp8={recipe}"
        if plan in runs:
            close(runs[plan]["losses"], bf16, loose, f"{plan} against {axes}precision=bf16")
            assert runs[plan]["losses"] != bf16, f"{plan}: nothing ran in float8"


def test_parallel_fp8_matches_one_process(runs):
    _, tight = bounds(SMALL)
    for plan in ("dp2,fp8=rowwise", "fsdp2,fp8=rowwise", "tp2,fp8=rowwise", "fsdp2,zero=1,fp8=rowwise",
                 "cp2,fp8=rowwise", "pp2,fp8=rowwise", "fp8=rowwise,compile=on"):
        close(runs[plan]["losses"], runs["fp8=rowwise"]["losses"], tight, f"{plan} against fp8=rowwise")
        close_norm(runs[plan], runs["fp8=rowwise"], f"{plan} against fp8=rowwise")
    for plan in ("fsdp2,fp8=tensorwise", "tp2,fp8=tensorwise", "fsdp2,fp8=tensorwise,compile=on",
                 "fsdp2,offload=on,fp8=tensorwise"):
        close(runs[plan]["losses"], runs["fp8=tensorwise"]["losses"], tight, f"{plan} against fp8=tensorwise")
        close_norm(runs[plan], runs["fp8=tensorwise"], f"{plan} against fp8=tensorwise")
    loose, tight = bounds(MOE)
    close(runs["ep2,fp8=rowwise"]["losses"], runs["moe:fp8=rowwise"]["losses"], tight, "ep2,fp8=rowwise")
    close_norm(runs["ep2,fp8=rowwise"], runs["moe:fp8=rowwise"], "ep2,fp8=rowwise")
    close(runs["moe:fp8=rowwise"]["losses"], runs["moe:precision=bf16"]["losses"], loose, "MoE fp8 against bf16")


# ----------------------------------------------------------------------------- without processes
def test_layers_whose_dims_float8_cannot_take_stay_bf16():
    """torch._scaled_mm takes dims that are multiples of 16: an FFN of 72 stays nn.Linear, attention converts."""
    torch.manual_seed(0)
    model = case(model=dataclasses.replace(SMALL, ffn_dim=72)).build_model()
    apply_float8(model, plan=Plan(fp8="rowwise"), device_type="cpu")
    float8 = sorted(n for n, m in model.named_modules() if is_float8(m))
    assert float8 == [n for n in BLOCK_LINEARS if ".attention." in n]
    assert not convertible(nn.Linear(64, 72)) and convertible(nn.Linear(64, 48))


def test_no_fp8_leaves_the_model_alone():
    model = case().build_model()
    apply_float8(model, plan=Plan(), device_type="cpu")
    assert not any(is_float8(m) for m in model.modules())


def test_gpu_below_compute_capability_8_9_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"^fp8=rowwise needs .* compute capability >= 8\.9; NVIDIA A100-SXM4-80GB "
                                         r"has 8\.0; valid: leave fp8 out"):
        apply_float8(case().build_model(), plan=Plan(fp8="rowwise"), device_type="cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    apply_float8(case().build_model(), plan=Plan(fp8="rowwise"), device_type="cpu")


def test_missing_torchao_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as if not installed
    with pytest.raises(ValueError, match=r"^fp8=tensorwise trains through torchao's float8 training, which is not "
                                         r"installed .*; valid: pip install 'shoal\[fp8\]', or leave fp8 out$"):
        apply_float8(case().build_model(), plan=Plan(fp8="tensorwise"), device_type="cpu")


def test_plan_grammar_and_rules():
    plan = Plan.parse("fsdp2,fp8=tensorwise")
    assert str(plan) == "fsdp2,fp8=tensorwise" and Plan.parse(str(plan)) == plan
    resolved = rules.resolve(plan, world_size=2, device="cpu")
    assert resolved.precision == "bf16"  # fp8 takes bf16 around it, on a CPU too
    assert "float8 (tensorwise scaling)" in resolved.describe()
    assert rules.resolve(Plan.parse("fp8=rowwise,precision=bf16"), world_size=1).precision == "bf16"
    for precision in ("fp32", "fp16"):
        with pytest.raises(ValueError, match=rf"^fp8=rowwise with precision={precision}: .*; valid: precision=bf16, "
                                             "or leave precision out$"):
            rules.resolve(Plan.parse(f"fp8=rowwise,precision={precision}"), world_size=1)
    with pytest.raises(ValueError, match=r"^plan option fp8='e4m3' is not valid; valid: rowwise, tensorwise$"):
        Plan.parse("fp8=e4m3")


# ----------------------------------------------------------------------------- the planner
def _priced(text: str, cluster: str, model: str = "llama3-8b") -> dict[str, float]:
    c = parse_cluster(cluster)
    plan = rules.resolve(Plan.parse(text), world_size=c.world_size, device=c.device_type)
    e = estimate(plan, Workload(model=get_preset(model), global_batch=8, seq_len=8192), c)
    return e.time | {"step": e.step_time_s}


def test_planner_prices_fp8_block_matmuls_from_the_published_speedup():
    """On an H100 the dense blocks' products run FP8_BLOCK_SPEEDUP times faster (the head, attention and the rest
    unchanged), so the step reproduces the end-to-end speedups that figure was derived from (torchao's Llama3-8B on
    8 H100s: 1.2503x tensorwise, 1.1005x rowwise) within the rounding of its two-digit constants."""
    bf16 = _priced("fsdp8,ac=selective", "8xH100-80GB")
    for recipe, measured in (("tensorwise", 1.2503), ("rowwise", 1.1005)):
        fp8 = _priced(f"fsdp8,ac=selective,fp8={recipe}", "8xH100-80GB")
        assert fp8["compute_matmul"] < bf16["compute_matmul"]
        assert fp8["compute_attention"] == bf16["compute_attention"]
        assert bf16["step"] / fp8["step"] == pytest.approx(measured, rel=0.01), recipe
    head = hardware.get_device("H100-80GB")
    assert head.fp8_flops("tensorwise") == pytest.approx(head.flops("bf16") * 1.64)
    assert head.fp8_flops("tensorwise") < head.peak_flops["fp8"]  # the data sheet's dense peak bounds it


def test_planner_prices_fp8_as_bf16_where_no_float8_rate():
    """A CPU emulates float8 (no faster than bf16) and an A100 has no float8 tensor cores: unchanged."""
    for cluster in ("2xcpu", "8xA100-80GB"):
        for model in ("tiny", "llama3-8b"):
            bf16 = _priced("fsdp2,precision=bf16" if "cpu" in cluster else "fsdp8", cluster, model)
            fp8 = _priced("fsdp2,fp8=rowwise" if "cpu" in cluster else "fsdp8,fp8=rowwise", cluster, model)
            assert fp8 == bf16, (cluster, model)


# ----------------------------------------------------------------------------- the GPU check's install step
def test_gpu_check_installs_the_carried_torchao_wheel_without_deps(monkeypatch, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` is a folder beside `src`
    from bench.gpu_check import parts_fp8
    from bench.gpu_check.context import Context

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    monkeypatch.setattr(parts_fp8, "REPO", tmp_path)
    ctx = Context(dry=True, out=tmp_path)
    assert not parts_fp8.ensure_torchao(ctx)
    assert "no wheel in" in ctx.checks[-1]["detail"] and ".whl" in ctx.checks[-1]["detail"]
    (tmp_path / ".whl").mkdir()
    wheel = tmp_path / ".whl" / "torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    ran = []
    monkeypatch.setattr(parts_fp8, "run_command", lambda cmd, **kw: ran.append(cmd) or (0, "installed"))
    parts_fp8.ensure_torchao(ctx)
    assert ran == [[sys.executable, "-m", "pip", "install", "--no-deps", str(wheel)]]
