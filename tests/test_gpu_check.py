"""`python -m bench.gpu_check --dry-run`: every part's CPU side runs and the report comes out whole,
within what the GPU machine returns (at most 8 files, names of letters, digits, '.', '_', '-')."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `bench` is a folder beside `src`, not an installed package

from bench.gpu_check import __main__ as gpu_check  # noqa: E402  (after the sys.path line above)
from bench.gpu_check import report  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    return out, done


def test_dry_run_runs_every_part_and_writes_the_report(dry_run):
    out, done = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((out / report.JSON_NAME).read_text())
    assert list(data["parts"]) == [p.name for p in gpu_check.PARTS]
    for name, part in data["parts"].items():
        assert part["status"] == "ok", (name, part.get("error"), part["checks"])
        assert part["checks"], name  # each part checked something on the CPU side
    assert data["runs"][0]["dry_run"] is True and data["device"] is None
    text = (out / report.MARKDOWN_NAME).read_text()
    for part in gpu_check.PARTS:
        assert f"## {part.name}: ok" in text
        assert f"budget {part.budget_s * gpu_check.DRY_RUN_SLACK} s" in done.stdout  # the budget is printed
    assert report.check_out_dir(out) == []


def test_a_second_call_adds_to_the_same_report(dry_run, tmp_path):
    out, _ = dry_run
    copy = tmp_path / "out"
    copy.mkdir()
    (copy / report.JSON_NAME).write_text((out / report.JSON_NAME).read_text())
    header = {"device": None, "started": "later", "argv": ["--parts", "train"], "dry_run": True}
    report.add_part(copy, header, "train", {"status": "ok", "checks": [], "wall_s": 1.0, "budget_s": 1})
    data = json.loads((copy / report.JSON_NAME).read_text())
    assert len(data["runs"]) == 2 and list(data["parts"]) == [p.name for p in gpu_check.PARTS]


def test_one_call_fits_the_machine_and_leaves_out_what_its_budget_cannot_hold(tmp_path):
    """The default call stays under the machine's 10 minutes a command, no part alone is longer than a call, and
    a part whose budget is over what is left is not started: reported `not run`, with the call that runs it."""
    assert gpu_check.CALL_BUDGET_S <= 9 * 60
    assert max(p.budget_s for p in gpu_check.PARTS) <= gpu_check.CALL_BUDGET_S
    assert gpu_check.parse([]).budget == gpu_check.CALL_BUDGET_S
    with pytest.raises(SystemExit):
        gpu_check.parse(["--budget", "0"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]), "OMP_NUM_THREADS": "1"}
    train = gpu_check.BY_NAME["train"].budget_s * gpu_check.DRY_RUN_SLACK  # plans' is larger than train's
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--parts", "train,plans",
                           "--budget", str(train + 60), "--out", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parts = json.loads((tmp_path / report.JSON_NAME).read_text())["parts"]
    assert parts["train"]["status"] == "ok" and parts["plans"]["status"] == "not run"
    assert f"--parts plans --out {tmp_path}" in done.stdout


def test_parts_argument():
    args = gpu_check.parse(["--parts", "ops,tests", "--dry-run"])
    assert [p.name for p in args.parts] == ["tests", "ops"]  # failure-first order, whatever the order given
    with pytest.raises(SystemExit):
        gpu_check.parse(["--parts", "tests,nope"])


def test_file_names_and_count(tmp_path):
    assert report.safe_name("cuda-profile H100,80GB=x") == "cuda-profile-H100-80GB-x"
    (tmp_path / "a,b.json").write_text("{}")
    for i in range(8):
        (tmp_path / f"f{i}.txt").write_text("")
    problems = report.check_out_dir(tmp_path)
    assert any("a,b.json" in p for p in problems) and any("9 files" in p for p in problems)
