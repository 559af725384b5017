"""OneS distillation (shoal.experiments.ones: kd, distill; `shoal distill`): the loss against its
formula, its parity under fsdp2 and tp2 with one process, and the command's refusals.

Parity: the first step's gradients (each tensor) and every step's global gradient norm before clipping, and
every step's loss, each held by `assert_rounding_close` (shoal/testing/asserts.py), the harness's own. The
distillation loss is the same sums as the single process (log-softmaxes over the vocabulary, a mean over the
tokens, then AdamW), split over ranks and added in another order: fsdp2 averages the ranks'
gradients and losses, tp2 adds row-parallel partial sums and gathers the vocab-sharded logits
before the loss. Each such reordering is off the float64 truth by about as much as the single
float32 process is (Higham 4.2: a float32 sum of n terms in any order is off by at most
(n-1) u sum|x_i|), so each value must lie within SLACK = 8 times the float32 process's
own error of the float64 run, plus 16 float32 ulps. A gradient summed over the 2 ranks instead of averaged is
off by 100% of itself: the gradients and their norm see it, while the losses may not (clipping and AdamW undo a
constant scale); the wrong shard of the teacher's logits moves the losses as well.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shoal import rules
from shoal.apply_plan import parallelize
from shoal.experiments.ones.gather import student_config, student_weights
from shoal.experiments.ones.kd import kd_loss, pack_targets, unpack_targets
from shoal.mesh import build_mesh
from shoal.models import ModelConfig, Transformer
from shoal.plan import Plan
from shoal.testing.asserts import assert_rounding_close, assert_user_error, full_tensors
from shoal.train.step import split_micro, train_step

TEACHER = ModelConfig(num_layers=2, dim=32, num_heads=4, ffn_dim=48, vocab_size=64, max_seq_len=16,
                      num_experts=4, top_k=2)
STEPS, BATCH, SEQ, TEMPERATURE, ALPHA, MICRO = 4, 8, 16, 2.0, 0.7, 2


def test_kd_loss_is_the_formula():
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 3, 5, generator=gen), torch.randn(2, 3, 5, generator=gen)
    y = torch.randint(0, 5, (2, 3), generator=gen)
    y[0, 0] = -100  # a masked target takes no loss
    packed = pack_targets(y, t)
    assert torch.equal(unpack_targets(packed)[0], y) and torch.equal(unpack_targets(packed)[1], t)
    keep = y != -100
    p_t = F.softmax(t / TEMPERATURE, -1)
    kl = (p_t * (p_t.log() - F.log_softmax(s / TEMPERATURE, -1))).sum(-1)[keep]
    ce = F.cross_entropy(s[keep], y[keep], reduction="none")
    expected = (ALPHA * TEMPERATURE**2 * kl + (1 - ALPHA) * ce).mean()
    assert torch.allclose(kd_loss(TEMPERATURE, ALPHA)(s, packed), expected, rtol=1e-6)
    assert torch.allclose(kd_loss(1.0, 0.0)(s, packed), ce.mean(), rtol=1e-6)  # alpha 0: the data's loss
    assert float(kd_loss(3.0, 1.0)(t, packed)) == pytest.approx(0.0, abs=1e-6)  # the teacher itself: KL 0


# ----------------------------------------------------------------------------- parity


def _models(dtype: torch.dtype) -> tuple[Transformer, Transformer]:
    """A seeded MoE teacher (evaluation mode) and its svd-gathered dense student."""
    torch.manual_seed(0)
    teacher = Transformer(TEACHER).to(dtype).eval()
    student = Transformer(student_config(TEACHER)).to(dtype)
    student.load_state_dict(student_weights(teacher.state_dict(), "svd", k=4))
    return teacher, student


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, TEACHER.vocab_size, (STEPS, BATCH, SEQ + 1), generator=gen)
    return [(s[:, :-1], s[:, 1:]) for s in seq]


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, foreach=False)


def _reference(dtype: torch.dtype) -> dict[str, Any]:
    """The distillation run of one process, in `dtype`: every step's loss and gradient norm before clipping,
    the first step's gradients."""
    teacher, student = _models(dtype)
    optimizer, loss_fn = _optimizer(student.parameters()), kd_loss(TEMPERATURE, ALPHA)
    out: dict[str, Any] = {"losses": [], "grad_norms": []}
    for inputs, targets in _batches():
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            packed = pack_targets(targets, teacher(inputs)).to(dtype)
        loss = loss_fn(student(inputs), packed)
        loss.backward()
        if "grads" not in out:
            out["grads"] = full_tensors(student, grads=True)
        out["grad_norms"].append(float(torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)))
        optimizer.step()
        out["losses"].append(loss.item())
    return out


def _parallel(plan_text: str) -> dict[str, Any]:
    """The same run with the student under `plan_text` on this pool's ranks, the teacher whole, each rank's rows
    in MICRO micro-batches (the runtime averages a loss function's micro-batch means)."""
    teacher, student = _models(torch.float32)
    plan = rules.resolve(Plan.parse(plan_text), world_size=dist.get_world_size())
    runtime = parallelize(student, plan, build_mesh(plan))
    optimizer, loss_fn = _optimizer(runtime.parameters()), kd_loss(TEMPERATURE, ALPHA)
    out: dict[str, Any] = {"losses": [], "grad_norms": []}
    index, count = runtime.data_rank
    rows = BATCH // count
    for inputs, targets in _batches():
        x, y = inputs[index * rows:(index + 1) * rows], targets[index * rows:(index + 1) * rows]
        with torch.no_grad():
            packed = pack_targets(y, teacher(x))
        seen = None if "grads" in out else (lambda rt: out.update(grads=full_tensors(rt, grads=True)))
        step = train_step(runtime, optimizer, split_micro(x, packed, MICRO), grad_clip=1.0, loss_fn=loss_fn,
                          before_update=seen)
        out["losses"].append(float(step.loss))
        out["grad_norms"].append(float(step.grad_norm))
    return out


@pytest.mark.parametrize("plan", ["fsdp2", "tp2"])
def test_distillation_matches_one_process(pools, plan):
    """First-step gradients, every step's gradient norm and loss: see the module's docstring."""
    ref32, ref64 = _reference(torch.float32), _reference(torch.float64)
    for rank, got in enumerate(pools(2).run(_parallel, plan)):
        for key in ("grads", "grad_norms", "losses"):
            assert_rounding_close(got[key], ref32[key], ref64[key], what=f"{plan} rank {rank} {key}")


# ----------------------------------------------------------------------------- the command


def _teacher_run(folder: Path, model: ModelConfig, *, checkpoint: bool = True) -> Path:
    """A run folder as `shoal train` leaves it (config.toml, a checkpoint), without training."""
    from shoal.train.checkpoint import save_checkpoint
    from shoal.train.config import RunConfig, to_flat
    from shoal.train.job import write_run_config

    cfg = RunConfig(model_config=model)
    folder.mkdir(parents=True)
    write_run_config(folder, cfg)
    if checkpoint:
        with torch.device("meta"):
            module = Transformer(model)
        save_checkpoint(folder, 1, runtime=parallelize(module), optimizer=None,
                        extra={"step": 1, "config": to_flat(cfg)})
    return folder


SMALL_MOE = TEACHER.replace(vocab_size=256, max_seq_len=32)


@pytest.mark.parametrize("case", ["dense", "no-checkpoint", "shape", "k"])
def test_distill_refuses_bad_input_and_writes_nothing(tmp_path, capsys, case):
    model = SMALL_MOE.replace(num_experts=0) if case == "dense" else SMALL_MOE
    teacher = _teacher_run(tmp_path / "teacher", model, checkpoint=case != "no-checkpoint")
    out = tmp_path / "student"
    argv = ["distill", "--teacher", str(teacher), "--out", str(out), "--nproc", "1"]
    extra, names = {"dense": ([], ["num_experts=0", "valid"]),
                    "no-checkpoint": ([], [str(teacher), "no complete checkpoint"]),
                    "shape": (["--set", "ffn_dim=40"], ["ffn_dim=40", "ffn_dim=48", "valid"]),
                    "k": (["--gather", "top-experts", "--gather-k", "7"], ["--gather-k 7", "1..4"])}[case]
    assert_user_error(capsys, argv + extra, *names)
    assert not out.exists()


@pytest.mark.parametrize("case", ["no-out", "nproc"])
def test_distill_under_torchrun_refuses_what_torchrun_decides(tmp_path, capsys, monkeypatch, case):
    teacher = _teacher_run(tmp_path / "teacher", SMALL_MOE)
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)  # this process as torchrun's rank 0 of 2 (no process group yet)
    out = tmp_path / "student"
    extra, names = {"no-out": ([], ["--out DIR", "torchrun"]),
                    "nproc": (["--out", str(out), "--nproc", "3"], ["--nproc 3", "2 processes"])}[case]
    assert_user_error(capsys, ["distill", "--teacher", str(teacher), *extra], *names)
    assert not out.exists()


@pytest.mark.slow  # one torchrun launch of 2 workers: about 20 s on a loaded 2-core machine
def test_distill_runs_under_torchrun(tmp_path):
    """torchrun's ranks each validate, rank 0 alone gathers and writes the student's start, the
    workers wait for it (DistillTask.prepare) and train under fsdp2."""
    import os
    import subprocess
    import sys

    teacher = _teacher_run(tmp_path / "teacher", SMALL_MOE)
    out = tmp_path / "student"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "shoal",
                           "distill", "--teacher", str(teacher), "--out", str(out), "--gather", "topk", "--plan",
                           "fsdp2", "--steps", "2", "--global-batch", "4", "--seq-len", "16", "--eval-every", "2",
                           "--eval-batches", "1", "--log-every", "1"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads((out / "distill.json").read_text())["gather"] == "topk"
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


@pytest.mark.slow  # two launches of a worker: about a minute on a loaded 2-core machine
def test_distill_writes_a_resumable_run_folder(tmp_path):
    """End to end on one process, from the Python function: gathered start, KD steps, a normal run
    folder, then `shoal distill --resume` and `export`."""
    from shoal import cli
    from shoal.experiments.ones.distill import distill
    from shoal.train.export import export_checkpoint

    teacher = _teacher_run(tmp_path / "teacher", SMALL_MOE)
    out = tmp_path / "student"
    common = ["--nproc", "1", "--global-batch", "4", "--seq-len", "16", "--eval-every", "2", "--eval-batches", "1",
              "--log-every", "1"]
    assert distill(teacher, out=out, gather="mean", steps=2, nproc=1, global_batch=4, seq_len=16, eval_every=2,
                   eval_batches=1, log_every=1) == 0  # the Python function: `shoal distill` with these flags
    for name in ("metrics.jsonl", "summary.json", "config.toml", "distill.json", "student_init.safetensors"):
        assert (out / name).is_file(), name
    assert json.loads((out / "distill.json").read_text())["gather"] == "mean"
    assert cli.main(["distill", "--resume", str(out), "--steps", "3", *common]) == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    exported = export_checkpoint(out / "checkpoints" / "step_00000003", tmp_path / "student.safetensors")
    from safetensors.torch import load_file

    weights = load_file(str(exported))
    assert "layers.0.feed_forward.w1.weight" in weights and not any("experts" in k for k in weights)


def test_distill_resume_takes_its_own_settings_again_and_refuses_others(tmp_path, capsys):
    """`shoal distill --resume` with the run's own --teacher or --gather (as a user retyping the first command
    does) gets past the check; another value is refused in one line naming the stored one."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    student = tmp_path / "student"
    student.mkdir()
    (student / "distill.json").write_text(json.dumps({"teacher": str(teacher), "checkpoint": str(teacher / "c"),
                                                      "gather": "topk", "gather_k": 3}))
    base = ["distill", "--resume", str(student)]
    assert_user_error(capsys, [*base, "--teacher", str(tmp_path)], "--teacher cannot change",
                      f"(it was {str(teacher)!r})")
    assert_user_error(capsys, [*base, "--gather", "svd"], "--gather cannot change", "(it was 'topk')")
    assert_user_error(capsys, [*base, "--kd-alpha", "0.9"], "--kd-alpha cannot change", "(it was 0.5)")
    assert_user_error(capsys, [*base, "--set", "dim=8"], "--set cannot change")
    # The run's own settings pass this check and stop at the next: the folder has no config.toml.
    line = assert_user_error(capsys, [*base, "--teacher", str(teacher / "."), "--gather", "topk", "--gather-k", "3"])
    assert "cannot change" not in line, line
