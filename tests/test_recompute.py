"""Activation recompute changes what is kept for backward, never the gradients.

Tolerance: exact equality. Recompute reruns the same CPU kernels on the same inputs in the same
order (dropout is 0 and the RNG state is restored anyway), so every recomputed activation, and
with it every gradient, is bit-for-bit what the first forward produced.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.parallel.recompute import apply_recompute, kept_activation_bytes
from shoal.parallelize import parallelize
from shoal.plan import Plan
from shoal.testing import SMALL, case, check_parity, full_tensors, run_parallel


def _grads_and_saved_bytes(ac: str, cfg=SMALL) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
    torch.manual_seed(0)
    from shoal.models import Transformer

    model = apply_recompute(Transformer(cfg), plan=Plan.parse(f"dp1,ac={ac}"))
    x = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(1))
    saved, logits = kept_activation_bytes(lambda: model(x[:, :-1]))
    loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    return full_tensors(parallelize(model), grads=True), loss.detach(), saved  # the runtime's clean names


@pytest.mark.parametrize("cfg_name", ["llama", "gpt"])
def test_recompute_gives_identical_gradients_and_saves_less(cfg_name):
    from shoal.models import PRESETS

    cfg = SMALL if cfg_name == "llama" else PRESETS["tiny-gpt"].replace(num_layers=2, max_seq_len=64)
    grads, loss, saved = {}, {}, {}
    for ac in ("none", "selective", "full"):
        grads[ac], loss[ac], saved[ac] = _grads_and_saved_bytes(ac, cfg)
    for ac in ("selective", "full"):
        assert torch.equal(loss[ac], loss["none"])
        for name, g in grads["none"].items():
            assert torch.equal(grads[ac][name], g), f"ac={ac}: gradient of {name} differs"
    # Bytes kept from forward to backward (recompute saves again, briefly, block by block in backward).
    assert saved["full"] < saved["selective"] < saved["none"], saved


def test_bad_recompute_mode_is_rejected():
    with pytest.raises(ValueError, match="valid: none, selective, full"):
        Plan.parse("dp1,ac=some")


def run_cases(cases):
    return [run_parallel(c) for c in cases]


def test_recompute_with_sharding_matches_single_process(pools):
    """ac=full under ZeRO-3 (FSDP2) and ZeRO-1 (shoal's engine: its gather hooks sit on checkpointed
    blocks), ac=selective under dp (DDP): all train exactly like the reference."""
    cases = [case(plan="fsdp2,ac=full"), case(plan="fsdp2,zero=1,ac=full", num_micro=2),
             case(plan="dp2,ac=selective", num_micro=2)]
    results = pools(2).run(run_cases, cases)
    for i, c in enumerate(cases):
        check_parity([r[i] for r in results], c)


def test_recompute_applies_through_parallelize(pools):
    assert pools(2).run(_wrapped_blocks, "dp2,ac=full") == [["CheckpointWrapper"] * SMALL.num_layers] * 2


def _wrapped_blocks(plan_text):
    from shoal.mesh import build_mesh
    from shoal.models import Transformer

    plan = Plan.parse(plan_text).resolve(2)
    runtime = parallelize(Transformer(SMALL), plan, build_mesh(plan))
    return [type(b).__name__ for b in runtime.parts[0].layers.values()]
