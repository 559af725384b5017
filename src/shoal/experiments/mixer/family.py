"""The image Mixer as a model family: its adapter (what the parallel layer knows of its module tree) and the
plans it refuses beyond the axes that adapter takes (shoal.rules asks both). No torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.experiments.mixer.config import MixerConfig
from shoal.models.adapter import ModelAdapter
from shoal.rules import divisor_list

if TYPE_CHECKING:
    from shoal.plan import Plan
    from shoal.rules import RunFacts

MIXER = ModelAdapter(
    family="image Mixer (Sparse-MLP)",
    axes=frozenset({"ep"}),
    blocks="layers",
    embeddings=("patch_embed",),
    head=("norm", "output"),
    classifier="output",
    moe_slots=("token_mixing.mlp", "channel_mixing"),
)
"""The image Mixer and Sparse-MLP (shoal/experiments/mixer/model.py): no tensor-parallel plan for its blocks,
no pipeline stages (the head pools over all patches), and its patches are not a causal sequence
to split over cp; its MoE_S and MoE_C layers take ep."""


def plan_refusal(plan: Plan, facts: RunFacts) -> str | None:
    """Why a Mixer (dense or Sparse-MLP) cannot run a plan of the data axes (dp, fsdp at any zero stage) and ep:
    ep needs experts that ep divides, no offload, and expert widths the data ranks outside ep divide under fsdp."""
    model = facts.model
    assert isinstance(model, MixerConfig), "the rules ask a family's rule of its own shapes"
    if plan.ep == 1:
        return None
    if not model.num_experts:
        return f"ep={plan.ep} needs a Mixture-of-Experts model; this Mixer has num_experts=0"
    if plan.offload:
        return (f"offload=on with an expert-parallel Mixer is not available in this version (the experts are "
                f"sharded outside FSDP2); plan {plan}; valid: offload=off")
    if model.num_experts % plan.ep:
        experts = model.num_experts
        return f"ep={plan.ep} does not divide {experts} experts; valid: ep in {divisor_list(experts)}"
    replicas = plan.data_ranks // plan.ep  # the data ranks outside ep, which shard the experts under fsdp
    for what, width in (("MoE_S width S'", model.routed_patches), ("MoE_C width C", model.dim)):
        if plan.fsdp > 1 and width % replicas:
            return (f"fsdp={plan.fsdp} with ep={plan.ep} shards every expert's {what} = {width} over the "
                    f"{replicas} data ranks outside ep, which do not divide it; valid: (dp*fsdp)/ep in "
                    f"{divisor_list(width)}")
    return None
