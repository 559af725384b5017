"""Activation recompute changes what is kept for backward, never the gradients.

Tolerance: exact equality. Recompute reruns the same CPU kernels on the same inputs in the same
order (dropout is 0 and the RNG state is restored anyway), so every recomputed activation, and
with it every gradient, is bit-for-bit what the first forward produced.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal import rules
from shoal.apply_plan import parallelize
from shoal.parallel.recompute import apply_recompute, kept_activation_bytes
from shoal.plan import Plan
from shoal.testing.asserts import full_tensors
from shoal.testing.parity import SMALL, case, check_parity, run_parallel


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

    plan = rules.resolve(Plan.parse(plan_text), world_size=2)
    runtime = parallelize(Transformer(SMALL), plan, build_mesh(plan))
    return [type(b).__name__ for b in runtime.parts[0].layers.values()]


def test_kept_bytes_wait_for_gloo_to_let_go_of_a_collectives_buffers(pools):
    """A gloo collective's input is still referenced for a moment after its wait returns (the worker thread drops
    the finished work after waking the waiter; about 5% of all-gathers here): kept_activation_bytes counts only
    once that settles, so an all-gather's input, dead to the caller, is never counted. Exact: whole storages."""
    assert pools(2).run(_all_gather_kept, 40) == [[64 * 32 * 4 * 2] * 40] * 2


def _all_gather_kept(repeats: int) -> list[int]:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    def forward() -> torch.Tensor:
        x = torch.ones(64, 32)  # created here and dead once gathered: not kept
        return funcol.wait_tensor(funcol.all_gather_tensor(x, 0, dist.group.WORLD))

    return [kept_activation_bytes(forward)[0] for _ in range(repeats)]


def test_kept_bytes_wait_for_another_thread_to_let_go():
    """The same without gloo's timing: a storage the forward creates and another thread lets go of only once the
    count has begun (woken by the first garbage collection's end) is not counted; the output is. Exact: whole
    storages."""
    import gc
    import threading

    held, begun = [], threading.Event()

    def on_collect(phase: str, info: dict) -> None:
        if phase == "stop" and held:
            begun.set()

    def let_go() -> None:
        begun.wait(10)
        held.clear()

    def forward() -> torch.Tensor:
        held.append(torch.ones(1000))
        threading.Thread(target=let_go).start()
        return torch.zeros(10)

    gc.callbacks.append(on_collect)
    try:
        assert kept_activation_bytes(forward)[0] == 10 * 4
    finally:
        gc.callbacks.remove(on_collect)
