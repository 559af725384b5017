"""`shoal train --dry-run`: set-up and one real step on throwaway state, each rank's memory beside
the planner's prediction, nothing saved."""

from __future__ import annotations

import re

from shoal import cli


def test_dry_run_prints_each_rank_beside_the_prediction_and_saves_nothing(tmp_path, capfd):
    out = tmp_path / "run"
    argv = ["train", "--dry-run", "--nproc", "2", "--plan", "fsdp2", "--device", "cpu", "--set", "num_layers=2",
            "--global-batch", "4", "--seq-len", "32", "--out", str(out)]
    assert cli.main(argv) == 0
    text = capfd.readouterr().out
    assert "dry run: set-up and one step of plan fsdp2" in text and "nothing saved" in text
    rows = [line.split() for line in text.splitlines() if re.match(r"\s+[01]\s+\d", line)]
    assert [r[0] for r in rows] == ["0", "1"]
    predicted = dict(re.findall(r"(parameters|gradients|optimizer) ([\d.]+)", text.split("planner, busiest")[1]))
    for row in rows:  # fp32 ZeRO-3 over 2 ranks: the live shards are the formula's bytes (to the 0.1 MB printed)
        params, grads, optim = map(float, row[1:4])
        assert abs(params - float(predicted["parameters"])) <= 0.1
        assert abs(grads - float(predicted["gradients"])) <= 0.1
        assert abs(optim - float(predicted["optimizer"])) <= 0.1
        baseline, setup, step = map(float, row[4:7])
        assert 0 < baseline <= setup and 0 < step
    assert re.search(r"step peak above the baseline, busiest rank: \d+ MB; the planner's \d+ MB is [+-]\d+% off", text)
    assert not (out / "checkpoints").exists()
