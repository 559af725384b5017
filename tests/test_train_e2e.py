"""`shoal train` end to end: real launches through the elastic launcher, compared run against run.

The runs are small (a 2-layer model, 6 steps) and shared by the tests through module fixtures:
five launches in all.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shoal import cli

SMALL = ["--device", "cpu", "--set", "num_layers=2", "--set", "dim=64", "--set", "ffn_dim=128", "--global-batch", "8",
         "--seq-len", "32", "--eval-every", "3", "--eval-batches", "2", "--seed", "3"]


LOSS_REL = 1e-4  # float32 rounding of one forward, bounded: see test_dp2_equals_single_process
GRAD_NORM_REL = 1e-3
"""The logged gradient norm (before clipping) of dp2 against the single process: the backward pass chains
about twice the forward's stages, so each gradient is off by up to ~2 x 1400 u = 1.7e-4 relative of its
terms (see test_dp2_equals_single_process), and the norm by no more than its largest element's error;
1e-3 leaves a factor ~6 for a later step's weights moved slightly differently. A gradient summed over the
2 ranks instead of averaged is off by 100%, which the losses alone would not show (clipping and AdamW
undo a constant scale)."""


def train(out: Path, *flags: str) -> list[dict]:
    assert cli.main(["train", "--out", str(out), *SMALL, *flags]) == 0
    return metrics(out)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def grad_norms(records: list[dict]) -> list[float]:
    return [r["grad_norm"] for r in records]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    out = {"dp2": root / "dp2", "single": root / "single", "part": root / "part", "part-copy": root / "part-copy"}
    train(out["dp2"], "--plan", "dp2", "--nproc", "2", "--steps", "6", "--ckpt-every", "3", "--log-every", "2")
    train(out["single"], "--nproc", "1", "--steps", "6", "--ckpt-every", "3", "--log-every", "1")
    # The same run stopped after 3 steps. --decay-steps 6 gives it the 6-step run's schedule,
    # as a 6-step run that crashed at step 3 would have had.
    train(out["part"], "--nproc", "2", "--steps", "3", "--decay-steps", "6", "--ckpt-every", "3")
    shutil.copytree(out["part"], out["part-copy"])
    return out


def test_dp2_equals_single_process(runs):
    dp2, single = metrics(runs["dp2"]), metrics(runs["single"])
    assert [r["step"] for r in dp2] == [r["step"] for r in single] == [1, 2, 3, 4, 5, 6]
    # --log-every 2: the numbers are read after steps 2, 3 (evaluation), 4 and 6; every step still
    # gets its own record, and a window's steps share its time.
    times = [r["step_time_s"] for r in dp2]
    assert times[0] == times[1] and times[3] != times[4] == times[5]
    # Not bit-exact: DDP sums the two ranks' gradients in its own order, each rank's matmuls see
    # half the batch, and the ranks run a different number of threads than the single process, so
    # sums are added in other orders. A float32 dot product of n terms is off by at most n u
    # relative (first order); the forward chains about 2 x 5 + 1 such stages of n <= 128 here,
    # so a loss may differ by up to ~1400 u = 8e-5 relative on any machine, and a parameter that
    # AdamW moved differently (a near-zero gradient) barely changes the loss, whose slope there is
    # near zero. Hence rel=1e-4; a missed step is off by percents. A wrong average is not (clipping and
    # AdamW undo a constant scale of the gradient): the logged gradient norms see it (GRAD_NORM_REL).
    assert losses(dp2) == pytest.approx(losses(single), rel=LOSS_REL)
    assert grad_norms(dp2) == pytest.approx(grad_norms(single), rel=GRAD_NORM_REL)
    assert [r["eval_loss"] for r in dp2 if "eval_loss" in r] == pytest.approx(
        [r["eval_loss"] for r in single if "eval_loss" in r], rel=LOSS_REL)
    assert losses(dp2)[-1] < losses(dp2)[0]


def test_resume_continues_the_exact_loss_curve(runs, capfd):
    unbroken = metrics(runs["dp2"])
    capfd.readouterr()
    assert cli.main(["train", "--resume", str(runs["part"]), "--steps", "6", "--ckpt-every", "1", "--keep", "2"]) == 0
    out = capfd.readouterr()
    resumed = metrics(runs["part"])
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    # Same processes, same threads, state restored bit for bit: the same floats exactly.
    assert losses(resumed) == losses(unbroken) and grad_norms(resumed) == grad_norms(unbroken)
    assert [r["lr"] for r in resumed] == [r["lr"] for r in unbroken]
    # The summary counts this invocation's 3 steps and says where the run stands; --keep 2 left
    # the two newest checkpoints, and every checkpoint, the final one too, was announced.
    summary = json.loads((runs["part"] / "summary.json").read_text())
    assert (summary["steps_run"], summary["first_step_run"], summary["steps"]) == (3, 4, 6)
    assert "done: 3 steps in" in out.out and "the run is at step 6 of 6" in out.out
    folders = sorted(p.name for p in (runs["part"] / "checkpoints").iterdir() if p.is_dir())
    assert folders == ["step_00000005", "step_00000006"]
    assert all(f"step {n}: checkpoint" in out.out for n in (4, 5, 6)), out.out


def test_resume_on_another_world_size(runs):
    unbroken = metrics(runs["dp2"])
    assert cli.main(["train", "--resume", str(runs["part-copy"]), "--steps", "6", "--nproc", "1"]) == 0
    resumed = metrics(runs["part-copy"])
    assert losses(resumed)[:3] == losses(unbroken)[:3]  # written by the first attempt
    # The checkpoint reshards from 2 ranks to 1; the rest differs from the unbroken dp2 run only
    # by the order of sums (see test_dp2_equals_single_process).
    assert losses(resumed)[3:] == pytest.approx(losses(unbroken)[3:], rel=LOSS_REL)
    assert grad_norms(resumed)[3:] == pytest.approx(grad_norms(unbroken)[3:], rel=GRAD_NORM_REL)


def test_run_folder_contents(runs):
    run = runs["dp2"]
    records = metrics(run)
    for r in records:
        assert {"step", "loss", "lr", "tokens_per_s", "step_time_s", "mem_peak_mb", "grad_norm"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["mem_peak_mb"] > 0 and r["step_time_s"] > 0
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert (run / "config.toml").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["step_00000003", "step_00000006"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["final_loss"] == records[-1]["loss"] and 0 < summary["mfu"] < 1
    assert ((summary["device"], summary["precision"], summary["plan"])
            == ("cpu", "fp32", "dp2,precision=fp32,compile=off"))
    # The memory model's prediction kept beside the measured peak (which adds the interpreter and libraries).
    assert 0 < summary["mem_predicted_mb"] < summary["mem_peak_mb"]
    assert {"parameters", "gradients", "optimizer", "activations"} <= set(summary["mem_predicted_terms_mb"])


def test_sample_prints_text(runs, capsys):
    capsys.readouterr()
    assert cli.main(["sample", "--run", str(runs["dp2"]), "--prompt", "The ", "--max-new-tokens", "16"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("The ") and len(text.rstrip("\n")) > len("The ")


def test_sample_streams_the_text_it_returns(runs):
    """shoal sample prints tokens as they are drawn: the pieces handed on add up to the whole text, the prompt
    first, one piece per drawn token at most (plus the prompt and a last flush), and the same seed draws the same."""
    from shoal.train.sample import sample

    pieces: list[str] = []
    text = sample(runs["dp2"], "The ", max_new_tokens=12, seed=3, emit=pieces.append)
    assert "".join(pieces) == text and pieces[0] == "The " and len(pieces) <= 12 + 2
    assert sample(runs["dp2"], "The ", max_new_tokens=12, seed=3) == text


def test_held_out_loss_weighs_each_batch_by_its_targets():
    """Fine-tuning masks make held-out batches' target counts uneven: the held-out loss is the mean over every
    target (batches weighted by their counts), not a mean of the batches' means; a batch with no targets adds
    nothing. Trainer.evaluate over a stand-in runtime whose batch losses are given: (9 x 1 + 1 x 3) / 4 = 3
    (a mean of means would say (9 + 1 + 0) / 3)."""
    from types import SimpleNamespace

    import torch

    from shoal.loss import IGNORE
    from shoal.train.loop import Trainer

    def targets(n: int) -> torch.Tensor:
        t = torch.full((1, 4), IGNORE)
        t[0, :n] = 1
        return t

    batches = [targets(1), targets(3), targets(0)]
    means = iter([9.0, 1.0, 0.0])  # each batch's mean over its targets (0 for none, as the runtime's share gives)
    runtime = SimpleNamespace(eval=lambda: None, train=lambda: None, global_mean=lambda t: t,
                              eval_loss=lambda micro: torch.tensor(next(means)))
    held_out = SimpleNamespace(batch=lambda i, size, part: (torch.zeros(1, 4, dtype=torch.long), batches[i]))
    trainer = SimpleNamespace(runtime=runtime, loop=SimpleNamespace(eval_batches=3, global_batch=1), part=None,
                              device=torch.device("cpu"), num_micro=1)
    assert Trainer.evaluate(trainer, held_out) == pytest.approx(3.0)
