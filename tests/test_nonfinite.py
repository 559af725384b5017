"""Runs that never train on garbage: a step whose loss or gradient goes non-finite changes no weight and
no optimizer state (gated on the device, no host read), the run stops (or skips and counts) with one
line, no checkpoint holds a non-finite state, and metrics.jsonl / summary.json are strict JSON.

Equality here is bit for bit (the bytes of every tensor): a skipped step must leave nothing moved, and
torch.where picks the old values without computing on them, so no tolerance applies.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shoal.testing.parity import SMALL, case, parallel_setup
from shoal.train.step import split_micro, train_step

OPTIMIZERS = ("adamw", "lamb", "lars", "cowclip")
MOE = SMALL.replace(num_experts=4, top_k=2, ffn_dim=64, capacity_factor=0.0)
PLANS = {"dp2": SMALL, "fsdp2": SMALL, "tp2": SMALL, "pp2,mb=2": SMALL.replace(num_layers=4), "ep2": MOE}
PRECISIONS = ("fp32", "bf16", "fp16")


def _bits(t: torch.Tensor) -> torch.Tensor:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.detach().reshape(-1).contiguous().view(torch.uint8).clone()


def _snapshot(runtime: Any, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every weight and every optimizer state tensor of this rank, as bytes."""
    out = {}
    for name, p in runtime.named_parameters():
        out[name] = _bits(p)
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"{name}/{key}"] = _bits(value)
    return out


def _differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


class Poison:
    """Forward hooks on the runtime's model parts: at `kind` "loss" every part's output times NaN (the loss
    goes NaN), at "grad" the gradient reaching each output times inf (the loss stays finite)."""

    def __init__(self, runtime: Any) -> None:
        self.kind: str | None = None
        for part in runtime.parts:
            part.register_forward_hook(self._hook)

    def _hook(self, module: Any, args: Any, out: Any) -> Any:
        if not isinstance(out, torch.Tensor) or self.kind is None:
            return out
        if self.kind == "loss":
            return out * float("nan")
        if out.requires_grad:
            out.register_hook(lambda g: g * float("inf"))
        return out


def bad_steps_change_nothing(plan: str, model: Any, precision: str) -> dict[str, Any]:
    """On this rank, for each optimizer: a good step, a NaN-loss step, an inf-gradient step, a good step.
    Returns per optimizer what the bad steps changed (must be nothing), whether the good one changed
    something (the teeth), and the step flags."""
    from shoal.optim.builder import build_optimizer
    from shoal.optim.config import OptimConfig

    out: dict[str, Any] = {}
    for name in OPTIMIZERS:
        runtime, _, batches = parallel_setup(case(plan=f"{plan},precision={precision}", model=model, steps=4))
        optimizer = build_optimizer(runtime, OptimConfig(optimizer=name, lr=1e-2, lars_eta=1e-1))
        poison = Poison(runtime)
        micro = 2 if "pp" in plan else 1
        flags, changed = [], {}
        for step, kind in enumerate((None, "loss", "grad", None)):
            poison.kind = kind
            before = _snapshot(runtime, optimizer)
            result = train_step(runtime, optimizer, split_micro(*batches[step], micro), grad_clip=1.0)
            flags.append((bool(result.applied), bool(result.overflow)))
            changed[kind or f"good{step}"] = _differs(before, _snapshot(runtime, optimizer))
        out[name] = {"flags": flags, "changed": changed}
    return out


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("plan", list(PLANS))
def test_a_bad_step_leaves_every_weight_and_state_bit_identical(pools, plan, precision):
    results = pools(2).run(bad_steps_change_nothing, plan, PLANS[plan], precision)
    for rank, result in enumerate(results):
        for name, r in result.items():
            where = f"{plan} {precision} {name} rank {rank}"
            assert r["changed"]["loss"] == [], where
            assert r["changed"]["grad"] == [], where
            assert r["changed"]["good3"], f"{where}: a good step after the bad ones changed nothing"
            # fp16: inf gradients with a finite loss are the loss scale's overflow (skipped, not counted)
            assert r["flags"] == [(True, False), (False, False), (False, precision == "fp16"), (True, False)], where


def host_reads_with_a_bad_step(plan: str, optimizer_name: str) -> list[str]:
    """The host reads (tests/test_fast_step.py's detector) of a NaN-loss step after a good one."""
    from shoal.optim.builder import build_optimizer
    from shoal.optim.config import OptimConfig
    from test_fast_step import HostReads

    runtime, _, batches = parallel_setup(case(plan=plan))
    optimizer = build_optimizer(runtime, OptimConfig(optimizer=optimizer_name))
    poison = Poison(runtime)
    train_step(runtime, optimizer, split_micro(*batches[0], 1), grad_clip=1.0)
    poison.kind = "loss"
    with HostReads() as mode:
        train_step(runtime, optimizer, split_micro(*batches[1], 1), grad_clip=1.0)
    return mode.reads


@pytest.mark.parametrize("plan,optimizer", [("dp2,precision=fp16", "adamw"), ("fsdp2,precision=fp16", "lamb"),
                                            ("dp2", "lars"), ("fsdp2", "cowclip")])
def test_the_gate_never_reads_the_device(pools, plan, optimizer):
    sys.path.insert(0, str(Path(__file__).parent))
    assert pools(2).run(_with_tests_path, host_reads_with_a_bad_step, plan, optimizer) == [[], []]


def _with_tests_path(fn: Any, *args: Any) -> Any:
    sys.path.insert(0, str(Path(__file__).parent))
    return fn(*args)


# ---------------------------------------------------------------- the command line

TINY = ["--device", "cpu", "--set", "num_layers=1", "--set", "dim=32", "--set", "ffn_dim=64", "--global-batch", "4",
        "--seq-len", "16", "--eval-every", "0", "--eval-batches", "1", "--log-every", "1", "--nproc", "1"]


def _shoal(*args: str, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SHOAL_FAULT", None)
    if fault:
        env["SHOAL_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "shoal", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def _strict_records(run: Path) -> list[dict[str, Any]]:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} in strict JSON")

    json.loads((run / "summary.json").read_text(), parse_constant=refuse)
    return [json.loads(line, parse_constant=refuse) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("shoal: error:")]


def test_a_diverging_run_stops_with_one_line_and_a_finite_latest(tmp_path):
    run = tmp_path / "run"
    done = _shoal("train", *TINY, "--steps", "12", "--lr", "1e25", "--grad-clip", "0", "--ckpt-every", "1",
                  "--out", str(run))
    assert done.returncode == 1, done.stderr[-2000:]
    [line] = _error_lines(done.stderr)
    records = _strict_records(run)
    bad = next(r for r in records if r.get("skipped"))
    assert line.startswith(f"shoal: error: step {bad['step']}: ") or f"after step {bad['step'] - 1}:" in line, line
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert f"newest checkpoint {run / 'checkpoints' / latest};" in line, line
    assert f"shoal train --resume {run} --lr 1e+24" in line
    assert bad["nonfinite"] and all(bad[k] is None for k in bad["nonfinite"])
    assert records[-1]["step"] == bad["step"]  # stopped at the bad step's read
    assert int(latest.rsplit("_", 1)[1]) < bad["step"]  # latest names a checkpoint from before it
    _assert_checkpoint_finite(run / "checkpoints" / latest)
    # the command the line gives is accepted (a resumed run may change --lr): the step-1 weights of lr 5e24
    # diverge again, and the new stop line's hint is a tenth of the new lr
    resumed = _shoal("train", "--resume", str(run), "--lr", "1e-3")
    [again] = _error_lines(resumed.stderr)
    assert resumed.returncode == 1 and again.endswith(f"--resume {run} --lr 0.0001"), again


def _assert_checkpoint_finite(path: Path) -> None:
    """Every tensor the checkpoint holds is finite (DCP's own converter to one torch.save file)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(path.parent / "whole.pt"))
    state = torch.load(path.parent / "whole.pt", weights_only=True)
    tensors = [v for v in _flatten(state) if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors)


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flatten(v)]
    if isinstance(value, list | tuple):
        return [x for v in value for x in _flatten(v)]
    return [value]


def _finished(run: Path, *flags: str, fault: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A `shoal train` of TINY with `flags` and `fault` that ends normally: its records and summary."""
    done = _shoal("train", *TINY, *flags, "--out", str(run), fault=fault)
    assert done.returncode == 0, done.stderr[-2000:]
    return _strict_records(run), json.loads((run / "summary.json").read_text())


def test_skip_mode_counts_and_goes_on_then_stops_after_k_in_a_row(tmp_path):
    records, summary = _finished(tmp_path / "once", "--steps", "5", "--on-nonfinite", "skip",
                                 fault="nan@forward:rank=0:step=2")
    assert [r["step"] for r in records if r.get("skipped")] == [3]
    assert records[2]["loss"] is None and records[2]["nonfinite"] == ["grad_norm", "loss"]
    assert summary["nonfinite_steps"] == [3] and summary["skipped_steps"] == 1

    always = tmp_path / "always"
    done = _shoal("train", *TINY, "--steps", "20", "--lr", "1e25", "--grad-clip", "0", "--on-nonfinite", "skip",
                  "--max-bad-steps", "3", "--out", str(always))
    assert done.returncode == 1, done.stderr[-2000:]
    [line] = _error_lines(done.stderr)
    records = _strict_records(always)
    bad = [r["step"] for r in records if r.get("skipped")]
    assert len(bad) == 3 and bad == list(range(bad[0], bad[0] + 3)) and records[-1]["step"] == bad[-1]
    assert f"step {bad[-1]}:" in line and "3 bad steps in a row" in line, line


def test_fp16_loss_scale_overflows_are_skipped_and_not_counted(tmp_path):
    """An inf gradient with a finite loss under fp16 (scale 2^16 > 1) is the scale's overflow: the stop
    policy lets it pass, the scale halves, the run ends normally."""
    records, summary = _finished(tmp_path / "run", "--steps", "4", "--plan", "precision=fp16",
                                 fault="inf@backward:rank=0:step=1")
    assert [r["step"] for r in records if r.get("loss_scale_overflow")] == [2]
    assert summary["loss_scale_overflows"] == 1 and summary["nonfinite_steps"] == []


def test_distill_stops_on_a_non_finite_step(tmp_path):
    from test_distill import SMALL_MOE, _teacher_run

    teacher = _teacher_run(tmp_path / "teacher", SMALL_MOE)
    out = tmp_path / "student"
    done = _shoal("distill", "--teacher", str(teacher), "--out", str(out), "--gather", "mean", "--steps", "4",
                  "--nproc", "1", "--global-batch", "4", "--seq-len", "16", "--eval-every", "0", "--eval-batches",
                  "1", "--log-every", "2", "--ckpt-every", "2", fault="nan@forward:rank=0:step=2")
    assert done.returncode == 1, done.stderr[-2000:]
    [line] = _error_lines(done.stderr)
    assert line.startswith("shoal: error: step 3: the loss went non-finite") and f"distill --resume {out}" in line
    assert [r["step"] for r in _strict_records(out) if r.get("skipped")] == [3]


# ---------------------------------------------------------------- the pieces


def test_strict_records_and_loss_spikes():
    from shoal.train.nonfinite import SPIKE_MIN_HISTORY, Guard, strict

    record = strict({"step": 1, "loss": math.nan, "grad_norm": math.inf, "lr": 1e-3, "moe": {"a": [1.0, math.nan]}})
    assert record == {"step": 1, "loss": None, "grad_norm": None, "lr": 1e-3, "moe": {"a": [1.0, None]},
                      "nonfinite": ["grad_norm", "loss", "moe"]}
    guard = Guard()
    rng = torch.Generator().manual_seed(0)
    losses = (3.0 + 0.01 * torch.randn(SPIKE_MIN_HISTORY + 5, generator=rng)).tolist() + [3.5, 3.0]
    records = [{"step": i + 1, "loss": x, "grad_norm": 1.0, "_applied": True, "_overflow": False}
               for i, x in enumerate(losses)]
    assert guard.check(records) is None
    assert guard.spikes == [SPIKE_MIN_HISTORY + 6]  # 3.5 against a median of 3 and a MAD near 0.007


def test_bad_flags_are_refused():
    from shoal.train.config import LoopConfig

    with pytest.raises(ValueError, match="--on-nonfinite 'never' is not valid; valid: stop, skip"):
        LoopConfig(on_nonfinite="never")
    with pytest.raises(ValueError, match="--max-bad-steps 0 is not valid"):
        LoopConfig(max_bad_steps=0)
