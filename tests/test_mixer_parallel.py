"""Sparse-MLP under dp2, fsdp2 (FSDP2 at ZeRO-3, and shoal's ZeRO-2 engine), ep2 and fsdp2,ep2
equals one process: logits, every gradient (the routers' load-balancing and z-losses included),
its global norm, the first AdamW step, the loss of every step and the parameters after several
steps.

Tolerances (shoal.testing.parity.check_parity, derived from the arithmetic, not tuned): everything is
float32, and a plan computes the single process's sums split over ranks and added in another
order (the data ranks' gradient all-reduce or reduce-scatter, the experts' gradients summed over
the ep group). A float32 sum of n terms in any order is off the exact sum by at most
(n-1) u sum|x_i| (Higham 4.2), in practice a random walk of a few u, so each tensor may be off the
float64 run by 8 times the single-process float32 run's own error (measured in the test, on the
machine it runs on) plus 16 ulps of its largest value. The first AdamW step is checked against
plain AdamW applied to the rank's own gradients (bound lr (|dc| / 4c + 8u) + 4u |p|, dc the
clip coefficients' rounding difference), the final parameters within 1% of the distance training
moved them (AdamW's lr/eps amplifies rounding in near-zero gradients, so no elementwise bound
exists there).

Why one process is the reference: the Mixer routes per image (MoE_S: the C' channel vectors of an
image; MoE_C: its S patches), so capacity, dropping and the load-balancing loss depend on the image
alone, never on how a plan splits the batch.
"""

from __future__ import annotations

import pytest

from shoal.experiments.mixer import MixerConfig
from shoal.testing.parity import case, check_parity, run_parallel

SPARSE = MixerConfig(num_layers=2, dim=16, token_ffn_dim=16, channel_ffn_dim=32, num_experts=4, moe_every=1,
                     top_k=1, capacity_factor=1.0, rr_channels=8, rr_patches=8)
"""Every block sparse, 4 experts, top-1 at capacity 1.0 (some vectors dropped), re-represent on."""


@pytest.mark.parametrize("plan", ["dp2", "fsdp2", "fsdp2,zero=2", "ep2", "fsdp2,ep2"])
def test_sparse_mlp_matches_single_process(pools, plan):
    c = case(plan=plan, model=SPARSE, steps=3, global_batch=8, lr=3e-3)
    check_parity(pools(2).run(run_parallel, c), c)


@pytest.mark.parametrize("router", ["top2", "prototypes2"])
def test_sparse_mlp_routers_under_ep(pools, router):
    """The experiment's other routers: top-2 (weights renormalised) and expert prototyping (2 groups)."""
    extra = dict(top_k=2, norm_topk=True) if router == "top2" else dict(top_k=2, num_prototypes=2)
    c = case(plan="ep2", model=SPARSE.replace(**extra), steps=3, global_batch=8, lr=3e-3)
    check_parity(pools(2).run(run_parallel, c), c)


def test_dense_mixer_matches_single_process(pools):
    c = case(plan="fsdp2", model=MixerConfig(num_layers=2, dim=16, token_ffn_dim=16, channel_ffn_dim=32), steps=3,
             global_batch=8, lr=3e-3)
    check_parity(pools(2).run(run_parallel, c), c)
