"""The seam between the trainer and the parallel layer: while a real `Trainer` runs, the trainer
sets no attribute on any object the runtime holds, and nothing of shoal's is set on the user's
modules (state the parallel layer needs lives in its own objects).

How it is checked, on every rank: `__setattr__` of every class involved is wrapped for the
duration of `Trainer.run()` (set-up is done by then; the steps, the evaluation, the checkpoint and
the pipeline's measured bubble all run inside it), and each assignment to a watched object is
recorded with the file of the code that made it. The watched objects are the runtime itself, the
objects of shoal's it holds (data engine, pipeline executor, ...), and every module of the user's
model parts. Beside that, the user's modules' own attributes (those beyond what torch's Module
keeps for every module: parameters, buffers, submodules, hook dicts, the training flag) are compared
before and after the run: same names, same objects.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import shoal

SHOAL = Path(shoal.__file__).resolve().parent
TORCH_MANAGED = frozenset(vars(nn.Module()))
"""The attributes torch's Module keeps on every module (parameters, buffers, submodules, hook dicts, ...)."""


def _own_attributes(module: nn.Module) -> dict[str, object]:
    return {k: v for k, v in vars(module).items() if k not in TORCH_MANAGED}


def _watched_run(plan: str, run_dir: str) -> dict[str, list]:
    from shoal.runtime import Runtime
    from shoal.train.config import LoopConfig, RunConfig, resolve_model
    from shoal.train.job import Job, with_model
    from shoal.train.loop import Trainer

    cfg = RunConfig(plan=plan, set=("num_layers=2", "dim=32", "ffn_dim=64"),
                    loop=LoopConfig(steps=3, global_batch=4, seq_len=16, eval_every=2, eval_batches=1, ckpt_every=2,
                                    log_every=1))
    trainer = Trainer(Job(config=with_model(cfg, resolve_model(cfg)), run_dir=run_dir), torch.device("cpu"))
    runtime = trainer.runtime
    held = [v for v in vars(runtime).values() if type(v).__module__.startswith("shoal.")]
    owned = {id(o): type(o).__name__ for o in (runtime, *held)}
    user = {id(m): m for part in runtime.parts for m in part.modules()}
    assert isinstance(runtime, Runtime) and user

    sets: list[tuple[str, str, str]] = []  # (whose, attribute, file of the code that set it)

    def wrap(cls: type) -> object:
        original = cls.__dict__.get("__setattr__")
        inherited = cls.__setattr__

        def __setattr__(self: object, name: str, value: object) -> None:
            if id(self) in owned or id(self) in user:
                whose = owned.get(id(self)) or f"user module {type(self).__name__}"
                sets.append((whose, name, sys._getframe(1).f_code.co_filename))
            inherited(self, name, value)

        type.__setattr__(cls, "__setattr__", __setattr__)
        return original

    # nn.Module's covers every module (none of these override it); frozen dataclasses refuse anyway.
    classes = {nn.Module} | {type(o) for o in (runtime, *held) if type(o).__setattr__ is object.__setattr__}
    saved = {cls: wrap(cls) for cls in classes}
    before = {i: _own_attributes(m) for i, m in user.items()}
    try:
        trainer.run()
    finally:
        for cls, original in saved.items():
            if original is None:
                type.__delattr__(cls, "__setattr__")
            else:
                type.__setattr__(cls, "__setattr__", original)
    changed = []
    for i, m in user.items():
        after = _own_attributes(m)
        if after.keys() != before[i].keys() or any(after[k] is not before[i][k] for k in after):
            changed.append((type(m).__name__, sorted(after.keys() ^ before[i].keys()),
                            sorted(k for k in after.keys() & before[i].keys() if after[k] is not before[i][k])))
    return {"sets": sets, "changed": changed, "owned": sorted(owned.values())}


def _inside(path: str, *folders: str) -> bool:
    return any(Path(path).resolve().is_relative_to(SHOAL / f) for f in folders)


@pytest.mark.parametrize("plan", ["pp2,mb=2,sched=zb", "dp2"])
def test_the_trainer_sets_nothing_on_the_runtime_or_the_users_modules(pools, tmp_path, plan):
    """pp2 with the zero-bubble schedule (its first stage's split backward keeps the embedding's
    output between the passes; its progress and timeline are the watchdog's and the chart's) and
    dp2 (DDP, no pipeline)."""
    for rank, result in enumerate(pools(2).run(_watched_run, plan, str(tmp_path / "run"))):
        assert "Runtime" in result["owned"], result["owned"]
        by_trainer = [s for s in result["sets"] if s[0] in result["owned"] and _inside(s[2], "train")]
        assert not by_trainer, f"rank {rank}: the trainer set {by_trainer}"
        on_user = [s for s in result["sets"] if s[0].startswith("user module") and _inside(s[2], ".")
                   and not _inside(s[2], "models")]  # a model's own code may keep its own state
        assert not on_user, f"rank {rank}: shoal set {on_user} on the user's modules"
        assert not result["changed"], f"rank {rank}: the user's modules' own attributes changed: {result['changed']}"
