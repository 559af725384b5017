"""The Hugging Face families' features under shoal's parallel axes: each equals the single-process
run (check_parity's tolerances, shoal/testing/parity.py), and an axis a feature cannot take is refused in
one line. The single process itself equals transformers' model (tests/test_hf_families.py), so
these close the chain family -> one process -> plan.

The configs are shoal.testing.parity.HF_FAMILIES: what shoal.from_hf makes of each family's tiny config.
Here runs the CI's share of the family x plan matrix; `python -m bench.hf_matrix` runs all of it
and writes the table of docs/hf_matrix.md.
"""

from __future__ import annotations

import pytest

from shoal import rules
from shoal.plan import Plan
from shoal.testing.asserts import one_line_error
from shoal.testing.parity import HF_FAMILIES, HF_PLANS, case, check_parity, hf_case, run_parallel

FAMILIES = HF_FAMILIES
LLAMA = ("llama3", "yarn", "linear", "dynamic")  # one family, its rotary scalings

MATRIX = [
    ("qwen3", "tp2"), ("qwen2", "tp2"), ("mistral", "tp2"), ("mixtral", "tp2"), ("qwen2_moe", "tp2"),
    ("linear", "tp2"),
    ("gpt2", "pp2"), ("mixtral", "pp2"),
    ("qwen2", "pp2,sched=zb"), ("llama3", "pp2,sched=zb"),
    ("mistral", "fsdp2,zero=1"), ("qwen2_moe", "fsdp2,zero=1"),
    ("gpt2", "fsdp2,zero=2"), ("yarn", "fsdp2,zero=2"),
    ("qwen3", "fsdp2"), ("mistral", "fsdp2"), ("llama3", "fsdp2"), ("qwen2_moe", "fsdp2"),
    ("yarn", "cp2"), ("qwen2", "cp2"), ("dynamic", "cp2"),
    ("llama3", "cp2,cp_mode=a2a"), ("qwen3", "cp2,cp_mode=a2a"),
    ("mixtral", "ep2"), ("qwen2_moe", "ep2"),
    ("mixtral", "fsdp2,ep2"), ("qwen2_moe", "fsdp2,ep2"),
    ("gpt2", "fsdp2,tp2"), ("qwen2_moe", "fsdp2,tp2"),
    ("qwen3", "tp2,pp2"), ("llama3", "tp2,pp2"),
    ("qwen3_moe", "tp2"), ("qwen3_moe", "ep2"), ("qwen3_moe", "fsdp2"), ("qwen3_moe", "pp2"),
    ("qwen3_moe", "fsdp2,ep2"), ("qwen3_moe", "tp2,ep2"), ("qwen3_moe", "pp2,ep2"),
    ("mixtral", "tp2,ep2"), ("mixtral", "pp2,ep2"),
    ("deepseek_v3", "tp2"), ("deepseek_v3", "fsdp2"), ("deepseek_v3", "pp2"), ("deepseek_v3", "ep2"),
    ("deepseek_v3-dense", "cp2"), ("deepseek_v3-dense", "cp2,cp_mode=a2a"), ("deepseek_v3", "tp2,ep2"),
    ("deepseek_v3", "fsdp2,ep2"), ("deepseek_v3", "pp2,ep2"),
]
"""The CI's share of the family x plan matrix (bench/hf_matrix.py runs all of it, docs/hf_matrix.md):
every family under at least three plans, every plan under at least two families, each feature
where it meets an axis (a tied head under pp and tp, GPT-2's learned positions on the first stage,
q/k norms and qkv biases split over tp, a gated shared expert under fsdp,tp)."""


def test_matrix_covers_every_family_and_plan():
    family_of = {name: "llama" if name in LLAMA else name.split("-")[0] for name in FAMILIES}
    plans_of: dict[str, set[str]] = {f: set() for f in family_of.values()}
    families_of: dict[str, set[str]] = {p: set() for p in HF_PLANS}
    for name, plan in MATRIX:
        plans_of[family_of[name]].add(plan)
        families_of[plan].add(family_of[name])
    assert all(len(p) >= 3 for p in plans_of.values()), plans_of
    assert all(len(f) >= 2 for f in families_of.values()), families_of


SLOW = {("qwen3_moe", "fsdp2"), ("qwen3_moe", "pp2"), ("qwen3_moe", "fsdp2,ep2"), ("qwen3_moe", "tp2,ep2"),
        ("qwen3_moe", "pp2,ep2"), ("mixtral", "tp2,ep2"), ("mixtral", "pp2,ep2"),
        *(("deepseek_v3", p) for p in ("fsdp2", "pp2", "tp2,ep2", "fsdp2,ep2", "pp2,ep2")),
        ("deepseek_v3-dense", "cp2,cp_mode=a2a")}
"""Cells `make test` leaves out (marked slow): every axis keeps a representative cell in it."""


@pytest.mark.parametrize("family, plan", [pytest.param(*cell, marks=pytest.mark.slow) if cell in SLOW else cell
                                          for cell in MATRIX])
def test_family_under_plan_matches_single_process(pools, family, plan):
    c = hf_case(family, plan)
    check_parity(pools(HF_PLANS[plan]).run(run_parallel, c), c)


# output_router_logits=true: transformers' load-balancing loss pooled over every layer and token of a
# forward (shoal's aux_loss_pooled), weighted 0.5 so that a loss pooled per rank shows.
ROUTER_LOSS = {name: FAMILIES[name].replace(aux_loss_pooled=True, aux_loss_coef=0.5)
               for name in ("mixtral", "qwen2_moe", "qwen3_moe")}


@pytest.mark.parametrize("family, plan", [
    ("mixtral", "dp2"), ("mixtral", "ep2"), ("qwen2_moe", "tp2"), ("qwen2_moe", "fsdp2"), ("mixtral", "pp2"),
    ("qwen3_moe", "ep2"), *(pytest.param("qwen3_moe", p, marks=pytest.mark.slow)
                            for p in ("dp2", "tp2", "fsdp2", "pp2", "fsdp2,ep2", "tp2,ep2", "pp2,ep2,mb=1"))])
def test_router_loss_under_plan_matches_single_process(pools, family, plan):
    """Under pp2 (1f1b, 4 micro-batches) the reference accumulates over the same micro-batches,
    each pooling its own tokens over both stages' layers; with data ranks beside pp one micro-batch
    (shoal.rules refuses more)."""
    world = HF_PLANS.get(plan.removesuffix(",mb=1"), 2)
    resolved = rules.resolve(Plan.parse(plan), world_size=world)
    c = case(plan=plan, model=ROUTER_LOSS[family], steps=2, num_micro=resolved.micro_batches if resolved.pp > 1 else 1)
    check_parity(pools(world).run(run_parallel, c), c)


@pytest.mark.parametrize("plan", ["ep2", pytest.param("tp2,ep2", marks=pytest.mark.slow),
                                  pytest.param("pp2,ep2", marks=pytest.mark.slow)])
def test_deepseek_v3_with_a_moving_selection_bias_matches_single_process(pools, plan):
    """The family's selection bias starts at 0 (transformers' init); moved by the sign rule after the first step
    (router_bias_rate, large so that the second step's choices differ), the second step routes with it under the
    plan as in one process, and the biases themselves are compared (check_parity)."""
    c = hf_case("deepseek_v3", plan)
    c = case(plan=plan, model=c.model.replace(router_bias_rate=0.05), steps=2, num_micro=c.num_micro)
    check_parity(pools(HF_PLANS[plan]).run(run_parallel, c), c)


def test_sliding_window_without_sequence_parallelism_matches_single_process(pools):
    c = case(plan="tp2,sp=off", model=FAMILIES["mistral"], steps=2)
    check_parity(pools(2).run(run_parallel, c), c)


@pytest.mark.parametrize("family, plan, words", [
    ("mistral", "cp2", ["sliding_window=4", "valid: no cp"]),
    ("gpt2", "cp2,cp_mode=a2a", ["pos_emb='learned'", "RoPE only", "valid: a RoPE model"]),
    ("mixtral", "cp2", ["num_experts=4", "valid: dp, fsdp, tp, pp and ep"]),
    ("qwen3_moe", "cp2", ["num_experts=8", "valid: dp, fsdp, tp, pp and ep"]),
    ("deepseek_v3", "cp2", ["num_experts=8", "valid: dp, fsdp, tp, pp and ep"]),
    ("qwen2", "fsdp2,ep2", ["ep=2 needs a Mixture-of-Experts model"]),
])
def test_a_feature_an_axis_cannot_take_is_refused_in_one_line(family, plan, words):
    message = one_line_error(hf_case, family, plan)
    assert all(w in message for w in words), message


def _init_under(plan_text: str, folder: str, tokens) -> dict:
    """Worker: shoal's model of a Hugging Face folder built on meta under plan_text and filled by
    `--init`'s sliced reader (each rank reads its boxes); its logits on `tokens`."""
    import torch
    import torch.distributed as dist

    from shoal.apply_plan import parallelize
    from shoal.mesh import build_mesh
    from shoal.models import Transformer
    from shoal.models.hf.families import config_from_hf
    from shoal.models.safetensors_io import open_pretrained

    cfg = config_from_hf(folder)
    weights = open_pretrained(folder, cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    plan = rules.resolve(Plan.parse(plan_text), world_size=dist.get_world_size())
    runtime = parallelize(model, plan, build_mesh(plan), weights=weights)
    with torch.no_grad():
        logits = runtime.eval()(tokens)
    return {"logits": logits.full_tensor() if hasattr(logits, "full_tensor") else logits}


@pytest.mark.parametrize("family, plan", [("gpt2", "tp2"), ("qwen3", "tp2"), ("mixtral", "ep2"),
                                          ("qwen2_moe", "tp2"), ("qwen2", "fsdp2"), ("mistral", "fsdp2"),
                                          ("qwen3_moe", "ep2"), ("qwen3_moe", "tp2")])
def test_init_from_transformers_folder_under_plan(pools, tmp_path, family, plan):
    """`--init` of a folder transformers wrote (two shards) under a plan gives transformers' logits
    (tolerance as tests/test_hf_families.py: rtol = atol = 1e-5)."""
    import torch

    from test_hf_families import _hf_model, _tokens  # the families' tiny configs

    hf_model = _hf_model(family)
    hf_model.save_pretrained(str(tmp_path), max_shard_size="150KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    tokens = _tokens(128)
    with torch.no_grad():
        expected = hf_model(tokens).logits
    for out in pools(2).run(_init_under, plan, str(tmp_path), tokens):
        torch.testing.assert_close(out["logits"], expected, rtol=1e-5, atol=1e-5)
