"""The learning-rate schedule against hand-computed values, the optimizer's groups, and the non-finite gate
over an optimizer that is not fused."""

from __future__ import annotations

import math

import pytest
import torch

from shoal.optim.builder import build_optimizer
from shoal.optim.config import OptimConfig
from shoal.optim.schedule import Schedule, build_scheduler


def test_schedule_hand_computed():
    s = Schedule(lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=14)
    # warm-up: lr * (step + 1) / 4
    assert [s.lr_at(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # cosine over steps 4..14 (10 steps): 0.1 + 0.9 * (1 + cos(pi * p)) / 2
    assert s.lr_at(4) == pytest.approx(1.0)
    assert s.lr_at(9) == pytest.approx(0.55)  # p = 0.5: halfway between lr and min_lr
    assert s.lr_at(6) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.2)))  # 0.9140576...
    assert s.lr_at(6) == pytest.approx(0.9140576474687264)
    assert s.lr_at(14) == pytest.approx(0.1)
    assert s.lr_at(100) == 0.1  # the floor after the horizon


def test_schedule_defaults():
    s = Schedule.from_config(OptimConfig(lr=3e-3), total_steps=300)
    assert (s.min_lr, s.warmup_steps, s.decay_steps) == (pytest.approx(3e-4), 30, 300)
    s = Schedule.from_config(OptimConfig(lr=1e-3, decay_steps=50, warmup_steps=0, min_lr=0.0), total_steps=10)
    assert s.lr_at(0) == pytest.approx(1e-3) and s.lr_at(25) == pytest.approx(5e-4) and s.lr_at(50) == 0.0


def test_scheduler_drives_the_optimizer_and_restores():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=14)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    opt = build_optimizer(model.parameters(), cfg)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # matrices / vectors
    sched = build_scheduler(opt, cfg, total_steps=14)
    seen = []
    for _ in range(7):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[:4] == [0.25, 0.5, 0.75, 1.0] and seen[6] == pytest.approx(0.9140576474687264)
    # A fresh optimizer + scheduler restored from the state continue with the same lr.
    opt2 = build_optimizer(model.parameters(), cfg)
    sched2 = build_scheduler(opt2, cfg, total_steps=14)
    sched2.restore(sched.state_dict())
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups] == [sched.schedule.lr_at(7)] * 2


@pytest.mark.parametrize("kwargs, match", [
    ({"lr": 0.0}, "--lr 0.0"), ({"lr": 1e-3, "min_lr": 1.0}, "--min-lr 1.0"),
    ({"warmup_steps": -1}, "--warmup-steps -1"), ({"decay_steps": 0}, "--decay-steps 0"),
    ({"lr": float("inf")}, "--lr inf is not valid; it must be a finite number"),
    ({"weight_decay": float("nan")}, "--weight-decay nan is not valid; it must be a finite number"),
])
def test_bad_optim_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimConfig(**kwargs)


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=False),
                                  lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)], ids=["adamw", "sgd"])
def test_the_gate_puts_back_weights_and_state_of_an_optimizer_that_is_not_fused(make):
    """gated_step over a torch optimizer with no found_inf (AdamW unfused, SGD with momentum): a step the flag
    refuses leaves every weight and every state tensor (moments, momentum, step count) bit for bit as it was,
    both when the state exists and when the refused step would create it (then it stays zeros); an allowed
    step changes them (the teeth)."""
    from shoal.optim.gate import gated_step

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    opt = make(layer.parameters())

    def step(ok: bool) -> None:
        layer.zero_grad()
        layer(torch.randn(5, 4)).square().sum().backward()
        gated_step(opt, torch.tensor(ok))

    def snapshot() -> list[torch.Tensor]:
        state = [v.clone() for p in layer.parameters() for v in opt.state.get(p, {}).values()
                 if isinstance(v, torch.Tensor)]
        return [p.detach().clone() for p in layer.parameters()] + state

    weights = snapshot()
    step(False)  # refused before any state exists: weights unchanged, any state created is zeros
    after = snapshot()
    assert all(torch.equal(a, b) for a, b in zip(after, weights))
    assert all(not t.any() for t in after[len(weights):])
    step(True)
    step(True)
    before = snapshot()
    step(False)
    after = snapshot()
    assert len(after) == len(before) > len(weights)  # the state is there: moments or momentum
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    step(True)
    assert not all(torch.equal(a, b) for a, b in zip(snapshot(), before))
