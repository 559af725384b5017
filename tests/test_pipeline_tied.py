"""Tied input and output embeddings under pipeline parallelism: a copy of the table on the first
and the last stage, their gradients all-reduced (Megatron-LM's way), trained against one process.

Tolerances are check_parity's measured-rounding bounds (shoal/testing/parity.py): the table's gradient is
the sum of the embedding's and the head's contributions, added on the last step's all-reduce in
another order than one process's autograd accumulation, which is float32 rounding of one more sum;
the gradient norm subtracts the last stage's copy once (rounding of the same size). Each check
names the max difference it saw when it fails.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shoal import rules
from shoal.plan import Plan
from shoal.testing.asserts import assert_rounding_close
from shoal.testing.parity import (
    SMALL,
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


def _export_under(plan_text: str, folder: str, out: str) -> None:
    """Worker: shoal's model of a Hugging Face folder, read by `--init`'s sliced reader under
    plan_text, exported live as a Hugging Face folder and as a shoal file."""
    from shoal.apply_plan import parallelize
    from shoal.mesh import build_mesh
    from shoal.models import Transformer
    from shoal.models.hf.families import config_from_hf
    from shoal.models.safetensors_io import open_pretrained
    from shoal.train.export import export_model

    cfg = config_from_hf(folder)
    with torch.device("meta"):
        model = Transformer(cfg)
    plan = rules.resolve(Plan.parse(plan_text), world_size=torch.distributed.get_world_size())
    runtime = parallelize(model, plan, build_mesh(plan), weights=open_pretrained(folder, cfg))
    export_model(runtime, f"{out}/hf", hf=True)
    export_model(runtime, f"{out}/shoal.safetensors")


def test_gpt2_from_transformers_exported_under_pp2(pools, tmp_path):
    """transformers' GPT-2 read under pp2 (the head's copy on the last stage) and exported: the
    folder holds the table once (no lm_head.weight), transformers loads it with its own weights
    bit for bit, so equal logits; the shoal file holds it once too, under the embedding's name."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from test_hf_families import _hf_model, _tokens

    hf_model = _hf_model("gpt2")
    hf_model.save_pretrained(str(tmp_path / "in"))
    pools(2).run(_export_under, "pp2", str(tmp_path / "in"), str(tmp_path))
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert "lm_head.weight" not in stored and "transformer.wte.weight" in stored
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    for name, value in hf_model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    tokens = _tokens(128)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, hf_model(tokens).logits)
    shoal_file = load_file(str(tmp_path / "shoal.safetensors"))
    assert "tok_embeddings.weight" in shoal_file and "output.weight" not in shoal_file


@pytest.mark.parametrize("plan", ["dp2,pp2", "fsdp2,pp2", "tp2,pp2",
                                  pytest.param("fsdp2,pp2,zero=2,sched=zb", marks=_SLOW),
                                  pytest.param("tp2,pp2,sched=zb", marks=_SLOW), pytest.param("cp2,pp2", marks=_SLOW),
                                  pytest.param("fsdp2,pp2,zero=1", marks=_SLOW),
                                  pytest.param("tp2,pp2,sched=interleaved,vpp=2", marks=_SLOW)])
def test_tied_pp_composes_with_the_other_axes(pools, plan):
    """The copies' gradients sharded by FSDP2 or ZeRO, replicated over dp, or split by vocabulary rows
    under tp (the first stage's copy shards as the last stage's): summed shard by shard."""
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
    one-process checkpoint) and resumes in one process on the unbroken loss curve and gradient norms."""
    from shoal.train.checkpoint import latest_checkpoint

    ref32, ref64 = references(RUN)
    results = pools(2).run(train_segment, RUN, str(tmp_path), "pp2,mb=2", 0, 2, 2)
    pp_keys, pieces = _stored(latest_checkpoint(tmp_path))
    assert pieces == 1 and "model.output.weight" not in pp_keys  # the head is the table
    single = train_segment(RUN, str(tmp_path), "single", 2, 4, 2)
    assert _stored(latest_checkpoint(tmp_path))[0] == pp_keys
    for what, res, (start, end) in (("pp2", results[0], (0, 2)), ("single", single, (2, 4))):
        assert_rounding_close(res["losses"], ref32["losses"][start:end], ref64["losses"][start:end],
                              what=f"{what} losses of steps {start}..{end - 1}")
        assert_rounding_close(res["grad_norms"], ref32["grad_norms"][start:end], ref64["grad_norms"][start:end],
                              what=f"{what} gradient norms of steps {start}..{end - 1}")
    assert_trained_close(single["params"], ref32, ref64)


def _names_on_meta(plan_text: str) -> list[str]:
    """Worker: the trainable names of the tied model built on the meta device under plan_text."""
    from shoal.apply_plan import parallelize
    from shoal.mesh import build_mesh
    from shoal.models import Transformer

    with torch.device("meta"):
        model = Transformer(TIED)
    if plan_text == "single":
        return [n for n, _ in parallelize(model).named_parameters()]
    plan = rules.resolve(Plan.parse(plan_text), world_size=torch.distributed.get_world_size())
    return [n for n, _ in parallelize(model, plan, build_mesh(plan)).named_parameters()]


def test_materializing_keeps_the_tie(pools):
    """Built on the meta device (as --init does), the head stays the embedding: one parameter, no
    `output.weight` to train apart (to_empty alone gives each name its own tensor)."""
    assert "output.weight" not in _names_on_meta("single")
    for plan_text in ("fsdp2", "pp2", "fsdp2,zero=2"):
        for names in pools(2).run(_names_on_meta, plan_text):
            assert "output.weight" not in names, plan_text
