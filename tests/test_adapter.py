"""The model adapters (shoal/models/adapter.py) describe their models: every pattern of a tensor-
parallel plan names modules the model holds, the blocks are the model's in order, the stage
boundary modules, MoE slots and attention seam exist; the Mixer's refuses tp, pp and cp; and the
generic parallel modules name no attribute of a family themselves."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from shoal.experiments.mixer import MIXER, MixerConfig
from shoal.experiments.mixer.model import Mixer
from shoal.models import ModelConfig, Transformer
from shoal.models.adapter import (
    FAMILY_AXES,
    TP_STYLES,
    TRANSFORMER,
    adapter_for,
    adapter_of_config,
    adapter_with,
)
from shoal.models.transformer import causal_attention
from shoal.moe.layer import MoELayer
from shoal.parallel.data import blocks_of
from shoal.parallel.pipeline import keep_stage
from shoal.parallel.tensor import _styles, tensor_plan
from shoal.testing.asserts import one_line_error

SRC = Path(__file__).resolve().parents[1] / "src" / "shoal"
BASE = ModelConfig(num_layers=3, dim=32, num_heads=4, num_kv_heads=2, ffn_dim=48, vocab_size=64, max_seq_len=16)
TRANSFORMERS = {
    "llama": BASE,
    "tied": BASE.replace(tie_embeddings=True),
    "qwen3": BASE.replace(qk_norm=True, head_size=16),
    "gpt2": BASE.replace(pos_emb="learned", norm="layernorm", activation="gelu", bias=True, tie_embeddings=True),
    "moe": BASE.replace(num_experts=4, top_k=2, moe_every=2),
}
MIXERS = {"dense": MixerConfig(num_layers=2), "sparse": MixerConfig(num_layers=2, num_experts=2, rr_channels=8)}


def _build(cfg: ModelConfig | MixerConfig) -> nn.Module:
    torch.manual_seed(0)
    return Transformer(cfg) if isinstance(cfg, ModelConfig) else Mixer(cfg)


def _matches(pattern: str, names: list[str]) -> list[str]:
    """Module names a plan pattern applies to (`*`: one name component, as parallelize_module reads it)."""
    regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
    return [n for n in names if regex.match(n)]


@pytest.mark.parametrize("name", list(TRANSFORMERS))
@pytest.mark.parametrize("stage", ["whole", "first", "last"])
def test_every_pattern_of_the_tp_plan_names_modules_of_the_model(name, stage):
    model = _build(TRANSFORMERS[name])
    if stage != "whole":
        keep_stage(model, range(0, 2) if stage == "first" else range(2, 3), first=stage == "first",
                   last=stage == "last")
    assert TRANSFORMER.tp_plan is not None
    plan = TRANSFORMER.tp_plan(model)
    names = [n for n, _ in model.named_modules()]
    for pattern, style in plan.items():
        assert style in TP_STYLES, (pattern, style)
        assert _matches(pattern, names), f"{pattern} names no module of {name} ({stage})"
    # a stage's plan names its own end only (the last stage also holds a tied table, for its head)
    tied = TRANSFORMERS[name].tie_embeddings
    assert ("output" in plan) == (stage != "first") and ("tok_embeddings" in plan) == (stage != "last" or tied)


def test_tied_embeddings_shard_by_rows_and_moe_slots_take_their_own_style():
    assert TRANSFORMER.tp_plan(_build(TRANSFORMERS["tied"]))["tok_embeddings"] == "vocab_embedding"
    assert TRANSFORMER.tp_plan(_build(TRANSFORMERS["llama"]))["tok_embeddings"] == "embedding"
    plan = tensor_plan(_build(TRANSFORMERS["moe"]), sp=True)  # block 1 is MoE (moe_every=2), 0 and 2 dense
    assert type(plan["layers.1.feed_forward"]).__name__ == "MoETensorParallel"
    assert {"layers.0.feed_forward.w1", "layers.2.feed_forward.w3"} <= set(plan)
    assert not any(k.startswith("layers.*.feed_forward") or k.startswith("layers.1.feed_forward.") for k in plan)


def test_every_style_name_has_a_style():
    assert set(_styles(True)) == set(_styles(False)) == {*TP_STYLES, "moe"}


@pytest.mark.parametrize("cfg", [*TRANSFORMERS.values(), *MIXERS.values()], ids=[*TRANSFORMERS, *MIXERS])
def test_the_blocks_are_the_models_in_order_and_the_ends_exist(cfg):
    model = _build(cfg)
    adapter = adapter_for(model)
    assert adapter is (TRANSFORMER if isinstance(cfg, ModelConfig) else MIXER)
    assert list(adapter.block_container(model)) == [str(i) for i in range(cfg.num_layers)]
    assert adapter.blocks_of(model) == list(model.layers.values()) == blocks_of(model)
    for name in (*adapter.embeddings, *adapter.head):
        assert hasattr(model, name), name
    assert any(isinstance(getattr(model, n), nn.Module) for n in adapter.embeddings)
    assert adapter.classifier in adapter.head and isinstance(getattr(model, adapter.classifier), nn.Linear)
    for block in adapter.blocks_of(model):
        for slot in adapter.moe_slots:
            block.get_submodule(slot)  # every block has the slot, MoE or dense
    moe = [b.get_submodule(s) for b in adapter.blocks_of(model) for s in adapter.moe_slots]
    num_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert sum(isinstance(m, MoELayer) for m in moe) == len(adapter.moe_slots) * num_moe


def test_a_stage_keeps_its_blocks_in_order_and_its_end():
    model = keep_stage(_build(TRANSFORMERS["tied"]), range(1, 3), first=False, last=True)
    assert list(TRANSFORMER.block_container(model)) == ["1", "2"]
    assert model.output is not None and model.tok_embeddings is not None  # tied: the last stage's copy


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_the_attention_seam_is_each_blocks_causal_core_and_rope_argument(name):
    seam = TRANSFORMER.attention
    assert seam is not None and seam.rope_arg is not None
    for block in TRANSFORMER.blocks_of(_build(TRANSFORMERS[name])):
        module = block.get_submodule(seam.module)
        assert getattr(module, seam.core) is causal_attention
        assert list(inspect.signature(module.forward).parameters)[seam.rope_arg] == "rope"


@pytest.mark.parametrize("axis", ["tp", "pp", "cp"])
def test_the_mixer_adapter_refuses_tp_pp_and_cp(axis):
    assert MIXER.tp_plan is None and MIXER.attention is None and MIXER.takes("ep") and not MIXER.takes(axis)
    message = one_line_error(adapter_with, _build(MIXERS["sparse"]), axis)
    assert message.startswith(f"{axis} is not available for the image Mixer")


def test_a_module_of_no_known_family_has_no_adapter_and_is_told_so():
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]))
    assert adapter_for(model) is None and len(blocks_of(model)) == 3  # blocks found by shape, as before
    for axis in FAMILY_AXES:
        assert "Sequential has none" in one_line_error(adapter_with, model, axis)


def test_the_adapters_import_neither_torch_nor_the_parallel_layer():
    """shoal.rules can ask an adapter which axes a family takes without torch loaded."""
    code = "import sys, shoal.models.adapter; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    mixer = [SRC / "experiments" / "mixer" / name for name in ("config.py", "model.py")]
    for source in [*(SRC / "models").glob("*.py"), *mixer]:  # nor does any model: they import nothing distributed
        for node in ast.walk(ast.parse(source.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(m.startswith(("torch.distributed", "shoal.parallel")) for m in modules), source.name


FAMILY_NAMES = {*TRANSFORMER.embeddings, *TRANSFORMER.head, *MIXER.embeddings, *TRANSFORMER.moe_slots,
                *MIXER.moe_slots, TRANSFORMER.blocks, "attention", "tie_embeddings", "q_norm", "wq"}


def _strings(tree: ast.AST) -> list[str]:
    """The string constants of a module that are not docstrings."""
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]


@pytest.mark.parametrize("path", [*sorted((SRC / "parallel").glob("*.py")), SRC / "apply_plan.py"],
                         ids=lambda p: p.name)
def test_the_parallel_layer_names_no_attribute_of_a_model_family(path):
    """What the generic modules know of a family they ask its adapter: no family's module names in
    their code (`"tok_embeddings"`, `"layers.*.attention.wq"`), no family's classes imported."""
    tree = ast.parse(path.read_text())
    for text in _strings(tree):
        named = {part for part in re.split(r"[^A-Za-z0-9_]+", text) if part} & FAMILY_NAMES
        assert not (named and re.fullmatch(r"[A-Za-z0-9_.*]+", text)), f"{path.name} names {text!r}"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("shoal.models.transformer",
                                                                "shoal.experiments.mixer.model"):
            # the plain causal kernel is a kernel (a2a attention runs it on whole sequences), not a seam
            assert [a.name for a in node.names] == ["causal_attention"], f"{path.name} imports {node.module}"


@pytest.mark.parametrize("name", sorted(TRANSFORMERS))
def test_the_weight_map_is_the_adapters_and_names_every_parameter_once(name):
    """The Transformer adapter's weight map lists every parameter of the model under exactly one
    Hugging Face tensor (a stacked expert tensor under one per expert), and the round trip through
    it is the identity; the Mixer, which has no Hugging Face layout, says so in one line."""
    cfg = TRANSFORMERS[name]
    if name == "moe":
        cfg = cfg.replace(moe_every=1, capacity_factor=0.0)  # Mixtral's layout: an MoE FFN in every block
    if name == "gpt2":
        cfg = cfg.replace(num_kv_heads=None)  # GPT-2 has no grouped-query attention
    model = _build(cfg)
    weight_map = adapter_of_config(cfg).weight_map()
    assert adapter_of_config(cfg) is adapter_for(model) is TRANSFORMER
    parts = [p for entry in weight_map.hf_layout(cfg) for p in dict.fromkeys(entry.parts)]
    expected = {k for k in model.state_dict() if not (cfg.tie_embeddings and k == "output.weight")}
    assert set(parts) == expected
    state = model.state_dict()
    back = weight_map.hf_to_shoal(weight_map.shoal_to_hf(state, cfg), cfg)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert adapter_of_config(MIXERS["sparse"]) is MIXER
    message = one_line_error(MIXER.weight_map)
    assert message.startswith("the image Mixer (Sparse-MLP) has no Hugging Face weight layout")
