"""Plan: parse and print plan strings, resolve against a world size, validate against a model and
a batch, describe in words. Pure: no process group."""

from __future__ import annotations

import pytest

from shoal import rules
from shoal.models import PRESETS
from shoal.plan import Plan
from shoal.testing.asserts import one_line_error

TINY = PRESETS["tiny"]  # 8 heads, 4 KV heads, ffn 384, vocab 256, 4 layers

# DESIGN.md's examples and how Plan prints them (options at their default value are left out).
EXAMPLES = {
    "dp2": "dp2",
    "fsdp4": "fsdp4",
    "dp2,fsdp2": "dp2,fsdp2",
    "fsdp4,zero=1": "fsdp4,zero=1",
    "dp2,tp2": "dp2,tp2",
    "pp2,mb=8,sched=1f1b": "pp2,mb=8",
    "tp2,pp2,cp2": "tp2,pp2,cp2",
    "ep4": "ep4",
    "auto": "auto",
}


@pytest.mark.parametrize("text", list(EXAMPLES))
def test_design_examples_round_trip(text):
    plan = Plan.parse(text)
    assert str(plan) == EXAMPLES[text]
    assert Plan.parse(str(plan)) == plan
    assert str(Plan.parse(str(plan))) == str(plan)


def test_parse_fields():
    plan = Plan.parse(" pp2 ,cp2,tp2,fsdp2, mb=8 ,sched=interleaved,vpp=2,cp_mode=a2a,sp=off,ac=selective,"
                      "precision=bf16,zero=2")
    assert (plan.dp, plan.pp, plan.mb, plan.sched, plan.vpp) == (None, 2, 8, "interleaved", 2)
    assert (plan.cp_mode, plan.sp, plan.ac, plan.precision, plan.zero) == ("a2a", False, "selective", "bf16", 2)
    assert Plan.parse(str(plan)) == plan
    assert Plan.parse("fsdp2,zero=2,precision=fp16") == Plan(fsdp=2, zero=2, precision="fp16")
    assert str(Plan.parse("fsdp2,precision=bf16,reduce=bf16")) == "fsdp2,precision=bf16,reduce=bf16"
    assert Plan.parse("auto") == Plan(auto=True)
    assert Plan.parse("fsdp2,tp2,sp=off,ac=full").__str__() == "fsdp2,tp2,sp=off,ac=full"


@pytest.mark.parametrize("text, world, resolved", [
    ("tp2", 8, "dp4,tp2"),
    ("dp2", 2, "dp2"),
    ("fsdp4", 8, "dp2,fsdp4"),
    ("tp2,pp2,cp2", 8, "tp2,pp2,cp2"),
    ("ep4", 4, "dp4,ep4"),
    ("dp1", 1, "dp1"),
])
def test_resolve_fills_dp(text, world, resolved):
    plan = rules.resolve(Plan.parse(text), world_size=world)
    # the CPU's defaults, said
    assert str(plan) == resolved + ",precision=fp32,compile=off" and plan.world_size == world
    names, sizes = plan.mesh_shape()
    assert names == ("pp", "dp", "fsdp", "cp", "tp")
    assert dict(zip(names, sizes)) == {a: getattr(plan, a) for a in names}


def test_compile_defaults_by_device():
    """Left out, blocks are compiled on GPUs and not on CPUs; given, the choice is kept and printed."""
    assert rules.resolve(Plan.parse("dp2"), world_size=2, device="cuda").compile is True
    assert rules.resolve(Plan.parse("dp2"), world_size=2, device="cpu").compile is False
    assert rules.resolve(Plan.parse("dp2,compile=off"), world_size=2, device="cuda").compile is False
    plan = rules.resolve(Plan.parse("fsdp2,compile=on"), world_size=2, device="cpu")
    assert plan.compile is True and str(plan) == "fsdp2,precision=fp32,compile=on"
    assert rules.resolve(Plan.parse(str(plan)), world_size=2) == plan
    assert "compile: each transformer block" in plan.describe()
    assert one_line_error(Plan.parse, "dp2,compile=yes") == "plan option compile='yes' is not valid; valid: on, off"


def test_precision_defaults_by_device():
    """Left out, precision is the device's default: bf16 (fp32 master weights and gradient
    reduction) on GPUs, fp32 on CPUs; given, it is kept everywhere."""
    assert rules.resolve(Plan.parse("dp2"), world_size=2, device="cuda").precision == "bf16"
    assert rules.resolve(Plan.parse("dp2"), world_size=2, device="cuda").reduce == "fp32"
    assert rules.resolve(Plan.parse("dp2"), world_size=2).precision == "fp32"
    assert rules.resolve(Plan.parse("dp2,precision=fp32"), world_size=2, device="cuda").precision == "fp32"
    assert rules.resolve(Plan.parse("fsdp2,precision=fp16"), world_size=2, device="cpu").precision == "fp16"
    assert "precision: bf16" in rules.resolve(Plan.parse("fsdp2"), world_size=2, device="cuda").describe()
    assert one_line_error(rules.resolve, Plan.parse("dp2"), world_size=2,
                          device="tpu") == "device 'tpu' is not valid; valid: cpu, cuda"


def test_degrees():
    plan = rules.resolve(Plan.parse("dp2,fsdp2,tp2"), world_size=8)
    assert (plan.data_ranks, plan.world_size, plan.non_dp_product) == (4, 8, 4)
    assert Plan.parse("pp4").micro_batches == 8 and Plan.parse("pp4,mb=3").micro_batches == 3


@pytest.mark.parametrize("text, words", [
    ("", "empty plan; valid:"),
    ("dp2,,tp2", "empty item"),
    ("xp2", "unknown plan axis 'xp2' in 'xp2'; valid axes: dpN, fsdpN, tpN, ppN, cpN, epN"),
    ("dp", "plan axis 'dp' needs a degree >= 1"),
    ("tp0", "plan axis 'tp0' needs a degree >= 1"),
    ("dp2,dp4", "plan 'dp2,dp4' names 'dp' twice"),
    ("mb=2,pp2,mb=4", "names 'mb' twice"),
    ("auto,auto", "names 'auto' twice"),
    ("dp2,zero", "plan option 'zero' in 'dp2,zero' needs a value, as zero=VALUE; valid: 1, 2, 3"),
    ("dp4,ep2,auto", "plan 'dp4,ep2,auto': 'auto' has the planner choose every axis and stands alone; valid: auto by "
                     "itself"),
    ("pp2,sched=foo", "sched='foo' is not valid; valid: gpipe, 1f1b, interleaved, zb"),
    ("fsdp2,zero=4", "zero='4' is not valid; valid: 1, 2, 3"),
    ("precision=fp8", "precision='fp8' is not valid; valid: fp32, bf16, fp16"),
    ("fsdp2,reduce=int8", "reduce='int8' is not valid; valid: fp32, bf16, fp16"),
    ("ac=some", "valid: none, selective, full"),
    ("cp2,cp_mode=star", "valid: ring, a2a"),
    ("sp=yes", "valid: on, off"),
    ("pp2,mb=0", "mb='0' in 'pp2,mb=0' needs a whole number >= 1"),
    ("pp2,vpp=x", "vpp='x'"),
    ("dp2,foo=1", "unknown plan option 'foo' in 'dp2,foo=1'; valid options: mb, vpp, split, sched"),
])
def test_parse_errors_are_one_line(text, words):
    assert words in one_line_error(Plan.parse, text)


def test_resolve_errors():
    assert "plan tp3 needs a multiple of 3 processes" in one_line_error(rules.resolve, Plan.parse("tp3"), world_size=8)
    assert "valid: 3, 6, 9, 12" in one_line_error(rules.resolve, Plan.parse("tp3"), world_size=8)
    message = one_line_error(rules.resolve, Plan.parse("dp2,tp2"), world_size=8)
    assert "4 processes" in message and "world size is 8" in message and "leave dp out" in message
    assert "ep=4 must divide" in one_line_error(rules.resolve, Plan.parse("ep4"), world_size=2)
    assert "valid: 1, 2" in one_line_error(rules.resolve, Plan.parse("ep4"), world_size=2)
    assert "world size 0 must be >= 1" in one_line_error(rules.resolve, Plan.parse("dp1"), world_size=0)


def test_validate_against_model_and_batch():
    rules.validate(rules.resolve(Plan.parse("dp2,tp2"), world_size=4), TINY, global_batch=8, seq_len=64)
    tp3 = rules.resolve(Plan.parse("tp3"), world_size=3)
    assert one_line_error(rules.validate, tp3, TINY, global_batch=3, seq_len=64) == (
        "tp=3 does not divide 8 attention heads; valid: tp in 1, 2, 4"
    )
    kv = rules.resolve(Plan.parse("tp8"), world_size=8)
    assert "tp=8 does not divide 4 KV heads; valid: tp in 1, 2, 4" in one_line_error(rules.validate, kv, TINY,
                                                                                     global_batch=8,
                                                                                seq_len=64)
    assert "pp=8 exceeds the model's 4 layers; valid: 1..4" in one_line_error(
        rules.validate, rules.resolve(Plan.parse("pp8"), world_size=8), TINY, global_batch=16, seq_len=64)
    assert "30 tokens do not divide; valid: a sequence length that is a multiple of 8, or cp in 1, 3, 5, 15" in (
        one_line_error(rules.validate, rules.resolve(Plan.parse("cp4"), world_size=4), TINY, global_batch=4,
                       seq_len=30))
    assert ("global batch 6 is not divisible by the 4 data-parallel ranks (dp*fsdp); valid: multiples of 4"
            in one_line_error(rules.validate, rules.resolve(Plan.parse("dp2,fsdp2"), world_size=4), TINY,
                              global_batch=6, seq_len=64))
    assert "mb=3 does not divide the 8 sequences each pipeline gets per step; valid: 1, 2, 4, 8" in one_line_error(
        rules.validate, rules.resolve(Plan.parse("pp2,mb=3"), world_size=2), TINY, global_batch=8, seq_len=64)
    assert "ep=2 needs a Mixture-of-Experts model; this one has num_experts=0" in one_line_error(
        rules.validate, rules.resolve(Plan.parse("ep2"), world_size=2), TINY, global_batch=8, seq_len=64)
    moe = PRESETS["tiny-moe"]  # 4 experts
    rules.validate(rules.resolve(Plan.parse("ep4"), world_size=4), moe, global_batch=8, seq_len=64)
    assert "ep=8 does not divide 4 experts; valid: ep in 1, 2, 4" in one_line_error(
        rules.validate, rules.resolve(Plan.parse("ep8"), world_size=8), moe, global_batch=8, seq_len=64)


@pytest.mark.parametrize("text, world, words", [
    ("dp2", 2, ["data: 2 replica(s)", "1/2"]),
    ("fsdp4,zero=1", 4, ["sharded data: ZeRO-1, optimizer state sharded 4 ways"]),
    ("fsdp2", 2, ["ZeRO-3, parameters, gradients and optimizer state sharded 2 ways"]),
    ("dp2,tp2", 4, ["tensor: attention heads and MLP columns split 2 ways", "sequence-sharded", "data: 2"]),
    ("pp2,mb=8,sched=gpipe", 2, ["pipeline: layers split into 2 stages (gpipe, 8 micro-batches)"]),
    ("pp2,sched=interleaved,vpp=2", 2, ["2 virtual stages per rank"]),
    ("tp2,pp2,cp2", 8, ["pipeline", "tensor", "context: each sequence split into 2 chunks (ring attention)"]),
    ("ep4", 4, ["expert: experts split 4 ways"]),
    ("dp2,ac=full,precision=bf16", 2, ["recompute: full", "precision: bf16"]),
    ("fsdp2,precision=bf16,reduce=bf16", 2, ["precision: bf16, gradients reduced in bf16"]),
])
def test_describe_mentions_every_axis_in_use(text, world, words):
    plan = rules.resolve(Plan.parse(text), world_size=world)
    text_out = plan.describe()
    assert text_out.startswith(f"plan {plan} on {world} process(es):")
    for w in words:
        assert w in text_out, text_out
    for axis, word in (("pp", "pipeline:"), ("tp", "tensor:"), ("cp", "context:"), ("fsdp", "sharded data:"),
                       ("ep", "expert:")):
        assert (word in text_out) == (getattr(plan, axis) > 1), (axis, text_out)


def test_plan_built_in_python_is_checked_too():
    """A Plan made directly (not parsed) gets the same one-line errors, not a crash later."""
    assert "zero=4 is not valid; valid: 1, 2, 3" in one_line_error(Plan, fsdp=2, zero=4)
    assert "bucket=0 needs a whole number >= 1" in one_line_error(Plan, fsdp=2, bucket=0)
    assert "tp=0 needs a degree >= 1" in one_line_error(Plan, tp=0)
    assert "precision='fp8' is not valid" in one_line_error(Plan, precision="fp8")


OPTION_VALUES = {"zero": ("1", "3"), "bucket": ("2",), "offload": ("on", "off"), "mb": ("4",),
                 "sched": ("gpipe", "1f1b"), "vpp": ("2",), "cp_mode": ("a2a", "ring"), "sp": ("off", "on"),
                 "ac": ("full",), "precision": ("bf16",),
                 "reduce": ("bf16",), "compile": ("on",), "split": ("2", "1/3")}


def test_every_option_against_every_axis_combination():
    """An option that acts on one axis is refused, with a line naming that axis, whenever the plan
    lacks it, even at its default value (`fsdp2,sched=1f1b` would silently do nothing); every
    other combination parses and keeps the value. 13 options x 16 axis sets."""
    import itertools

    from shoal.plan import NEEDS_AXIS

    assert set(OPTION_VALUES) == {"zero", "bucket", "offload", "mb", "sched", "vpp", "cp_mode", "sp", "ac",
                                  "precision", "reduce", "compile", "split"}  # every option of the grammar
    checked = 0
    for n in range(5):
        for axes in itertools.combinations(("fsdp2", "tp2", "pp2", "cp2"), n):
            for key, values in OPTION_VALUES.items():
                for value in values:
                    text = ",".join([*axes, f"{key}={value}"])
                    needs = NEEDS_AXIS.get(key)
                    if needs is not None and f"{needs}2" not in axes:
                        error = one_line_error(Plan.parse, text)
                        assert f"acts on the {needs} axis" in error and f"add {needs}N" in error, (text, error)
                    else:
                        got = getattr(Plan.parse(text), key)
                        got = "/".join(map(str, got)) if key == "split" else got
                        assert str(got).lower() in (value, str(value == "on").lower()), text
                    checked += 1
    assert checked == 16 * sum(len(v) for v in OPTION_VALUES.values())


def test_options_built_in_python_follow_the_same_rule():
    assert "acts on the fsdp axis" in one_line_error(Plan, dp=2, zero=2)
    assert "acts on the pp axis" in one_line_error(Plan, fsdp=2, mb=4)
    assert Plan(fsdp=2, zero=1).zero == 1 and Plan(dp=2).zero is None  # left out: chosen by shoal.rules
    assert rules.resolve(Plan(dp=2), world_size=2).zero == 3 and Plan(dp=2,
                                                                      zero=3).zero == 3  # the usual value needs no axis
    assert "reduce=bf16" in one_line_error(rules.resolve, Plan.parse("tp2,reduce=bf16"), world_size=2)
