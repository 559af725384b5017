"""Building on the meta device (shoal/parallel/materialize.py, shoal/models/init.py): every plan
materializes the same full initial weights as one process, bit for bit (the values are a pure
function of the seed, the parameter's name and its position, so no arithmetic differs), and the
values follow the model's init rules."""

from __future__ import annotations

import math

import pytest
import torch

from shoal import rules
from shoal.apply_plan import parallelize
from shoal.mesh import build_mesh
from shoal.models import Transformer
from shoal.models.config import ModelConfig
from shoal.models.init import InitSpec, fill_slice_
from shoal.plan import Plan
from shoal.testing.asserts import full_tensors

DENSE = ModelConfig(num_layers=2, dim=64, num_heads=8, num_kv_heads=4, ffn_dim=128, vocab_size=128, max_seq_len=64)
MOE = DENSE.replace(num_experts=4, top_k=2)
SEED = 7


def _one_process(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = Transformer(cfg)
    return full_tensors(parallelize(model, seed=SEED))


def _under(plan_text: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = Transformer(cfg)
    plan = rules.resolve(Plan.parse(plan_text), world_size=torch.distributed.get_world_size())
    runtime = parallelize(model, plan, build_mesh(plan), seed=SEED)
    assert not any(p.is_meta for p in runtime.parameters())
    return full_tensors(runtime)


def test_slices_assemble_the_whole():
    """Any cut of a parameter into slices (rows across generator blocks, columns) gives the whole
    one's values: 3000 rows of 700 values span three blocks of 1,497 rows."""
    spec, shape = InitSpec("normal", 0.02), (3000, 700)
    whole = fill_slice_(torch.empty(shape), spec, seed=1, name="w", shape=shape, offset=(0, 0))
    rows, cols = ((0, 1100), (1100, 2600), (2600, 3000)), ((0, 300), (300, 700))
    again = torch.cat([torch.cat([fill_slice_(torch.empty(r1 - r0, c1 - c0), spec, seed=1, name="w", shape=shape,
                                              offset=(r0, c0)) for c0, c1 in cols], dim=1) for r0, r1 in rows])
    assert torch.equal(again, whole)
    other = fill_slice_(torch.empty(shape), spec, seed=1, name="v", shape=shape, offset=(0, 0))
    assert not torch.equal(other, whole)  # another name, other values


def test_one_process_follows_the_init_rules():
    """Norm weights one; matrices normal(0, 0.02); residual outputs (wo, w2, experts' w2) scaled by
    1/sqrt(2L) (GPT-2). Tolerances: the sample std of n >= 4096 draws is within ~3/sqrt(2n) < 4% of
    the true one with overwhelming probability; 10% is used."""
    values = _one_process(DENSE)
    assert torch.equal(values["layers.0.attention_norm.weight"], torch.ones(64))
    std = values["layers.0.attention.wq.weight"].std().item()
    assert abs(std - 0.02) < 0.002  # 4096 draws: the sample std is within ~2% of 0.02
    out_std = values["layers.1.feed_forward.w2.weight"].std().item()
    assert abs(out_std - 0.02 / math.sqrt(4)) < 0.002
    moe = _one_process(MOE)
    assert abs(moe["layers.0.feed_forward.experts.w2"].std().item() - 0.01) < 0.001


@pytest.mark.parametrize(("plan", "world", "cfg"), [
    ("fsdp2", 2, DENSE), ("pp2", 2, DENSE), ("cp2", 2, DENSE), ("fsdp2,tp2", 4, DENSE), ("tp2,ep2", 4, MOE),
    ("fsdp2,ep2", 2, MOE),
])
def test_every_plan_starts_from_the_one_process_weights(pools, plan, world, cfg):
    reference = _one_process(cfg)
    for got in pools(world).run(_under, plan, cfg):
        if plan.startswith("pp"):
            assert set(got) < set(reference)  # a stage holds its own layers
        else:
            assert set(got) == set(reference)
        for name, value in got.items():
            assert torch.equal(value, reference[name]), f"{plan}: {name} differs"


class _UserLM(torch.nn.Module):
    """A user's own module (no init_spec): each submodule initialises itself by reset_parameters(); the head is
    tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(96, 32)
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 32))
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 96, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(self.embed(tokens))))


def _user_module(plan_text: str | None) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = _UserLM()
    if plan_text is None:
        return full_tensors(parallelize(model, seed=SEED))
    torch.manual_seed(123 + torch.distributed.get_rank())  # each rank's own random state plays no part
    plan = rules.resolve(Plan.parse(plan_text), world_size=torch.distributed.get_world_size())
    return full_tensors(parallelize(model, plan, build_mesh(plan), seed=SEED))


def test_a_users_module_starts_from_the_same_weights_under_every_plan(pools):
    """A user's module built on the meta device, reset by its modules' reset_parameters(), starts from the one
    process's weights bit for bit under dp2, fsdp2 (each rank keeps its shard of the whole module's reset)
    and fsdp2,zero=2; the values follow torch's own rules (Linear's bounds, LayerNorm's ones), the head stays
    tied, and the caller's random state is left as it was."""
    state = torch.random.get_rng_state()
    reference = _user_module(None)
    assert torch.equal(torch.random.get_rng_state(), state)
    bound = 1 / math.sqrt(32)  # nn.Linear(32, 48): kaiming_uniform_(a=sqrt(5)) draws within 1/sqrt(fan_in)
    assert reference["body.0.weight"].abs().max() <= bound and reference["body.0.weight"].std() > bound / 3
    assert torch.equal(reference["norm.weight"], torch.ones(32))
    assert reference["embed.weight"].std() > 0.5  # Embedding's N(0, 1), the first owner of the tied weight
    for plan in ("dp2", "fsdp2", "fsdp2,zero=2"):
        for got in pools(2).run(_user_module, plan):
            assert set(got) == set(reference), plan
            for name, value in got.items():
                assert torch.equal(value, reference[name]), f"{plan}: {name} differs"
