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


def test_a_part_stopped_at_its_budget_keeps_the_checks_it_saved(tmp_path):
    """Each check is saved as it is made: a part stopped (or crashed) half-way reports those, marked timeout or
    error with the reason; a part that ended reports what it wrote."""
    from bench.gpu_check.context import Context

    path = tmp_path / "result.json"
    ctx = Context(dry=True, out=tmp_path, save_to=path)
    ctx.check("first test", True, "passed")
    stopped = gpu_check.collect(path, timed_out=True, returncode=-9, output="last words", budget=240)
    assert stopped["status"] == "timeout" and [c["name"] for c in stopped["checks"]] == ["first test"]
    assert stopped["error"].startswith("stopped at its budget of 240 s") and "last words" in stopped["error"]
    crashed = gpu_check.collect(path, timed_out=False, returncode=1, output="", budget=240)
    assert crashed["status"] == "error" and len(crashed["checks"]) == 1
    path.write_text(json.dumps({"status": "ok", "checks": [], "error": None}))
    assert gpu_check.collect(path, timed_out=False, returncode=0, output="", budget=240)["status"] == "ok"
    assert gpu_check.collect(tmp_path / "none.json", timed_out=True, returncode=-9, output="",
                             budget=240)["checks"] == []


def test_a_streamed_command_is_stopped_at_its_deadline_with_the_lines_it_printed():
    import time

    from bench.gpu_check.context import stream_command

    seen: list[str] = []
    cmd = [sys.executable, "-c", "import time; print('tests/a.py::t PASSED', flush=True); time.sleep(60)"]
    start = time.monotonic()
    status, text = stream_command(cmd, deadline=start + 3, on_line=seen.append)
    assert status == 124 and time.monotonic() - start < 30
    assert seen == ["tests/a.py::t PASSED"] and "stopped at the part's deadline" in text
    status, _ = stream_command([sys.executable, "-c", "raise SystemExit(3)"], deadline=time.monotonic() + 60,
                               on_line=seen.append)
    assert status == 3


def test_the_tests_part_reads_each_outcome_of_pytest_verbose():
    from bench.gpu_check.parts_train import TEST_OUTCOME

    line = "tests/test_devices.py::test_cuda_step[bf16-on] PASSED                    [ 50%]"
    assert TEST_OUTCOME.match(line).groups() == ("tests/test_devices.py::test_cuda_step[bf16-on]", "PASSED")
    assert TEST_OUTCOME.match("tests/test_fast_step.py::test_resume_gpu FAILED").group(2) == "FAILED"
    assert TEST_OUTCOME.match("FAILED tests/test_fast_step.py::test_resume_gpu - Timeout") is None
