"""The fault suite: faults injected into real `shoal train` runs (2 gloo processes), each ending
in a clear message within seconds, and a resume that continues the unbroken run's exact loss curve.

Faults come from shoal/infra/faults.py (SHOAL_FAULT, off in normal runs). Each faulted run is a
fresh `python -m shoal train` process, so that signals reach a real launcher; steps are tiny, so
the start-up dominates. The unbroken reference runs once. Bit-exact resume:
same processes and threads, state restored bit for bit, batches a pure function of the step.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

STEPS = 8
FLAGS = ["--device", "cpu", "--nproc", "2", "--set", "num_layers=2", "--set", "dim=64", "--set", "ffn_dim=128",
         "--global-batch", "8", "--seq-len", "32", "--eval-every", "0", "--eval-batches", "1", "--seed", "5",
         "--ckpt-every", "2", "--log-every", "1"]
TABLE: list[dict] = []
"""Each faulted run's figures; written as JSON to $SHOAL_FAULT_TABLE when set (a report of the suite)."""
EXIT_S = 20.0
"""A faulted run must end within this after the fault (hangs: after the hang timeout)."""


class Run:
    def __init__(self, proc: subprocess.Popen, out: Path, stamp: Path, t0: float) -> None:
        self.proc, self.out, self.stamp, self.t0 = proc, out, stamp, t0

    def wait(self, timeout: float = 180) -> Run:
        self.rc = self.proc.wait(timeout=timeout)
        self.t_end = time.time()
        self.stdout = (self.out.parent / (self.out.name + ".stdout")).read_text()
        self.stderr = (self.out.parent / (self.out.name + ".stderr")).read_text()
        return self

    @property
    def exit_after_fault_s(self) -> float:
        return self.t_end - float(self.stamp.read_text())

    def error_line(self) -> str:
        lines = [line for line in self.stderr.splitlines() if line.startswith("shoal: error:")]
        assert len(lines) == 1, self.stderr[-3000:]
        return lines[0]


def start(out: Path, *flags: str, fault: str | None = None, new_session: bool = False) -> Run:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    stamp = out.parent / (out.name + ".fired")
    if fault:
        env.update(SHOAL_FAULT=fault, SHOAL_FAULT_STAMP=str(stamp))
    cmd = [sys.executable, "-m", "shoal", "train", *flags]
    if "--resume" not in flags:
        cmd += ["--out", str(out), "--steps", str(STEPS), *FLAGS]
    stdout = open(out.parent / (out.name + ".stdout"), "w")
    stderr = open(out.parent / (out.name + ".stderr"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, start_new_session=new_session)
    return Run(proc, out, stamp, time.time())


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"a step counted twice: {steps}"
    return {r["step"]: r["loss"] for r in records}


def latest_step(run_dir: Path) -> int:
    return int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])


def resume_exactly(run_dir: Path, reference: dict[int, float], fault: str, run: Run, line: str) -> None:
    """--resume finishes the run; every step's loss equals the unbroken run's, bit for bit."""
    reached = max(losses(run_dir))
    saved = latest_step(run_dir)
    # The resume is not a hang test: a run faulted with a short --hang-timeout gets the automatic one back,
    # so that a slow checkpoint write on a loaded machine does not time out the other rank's collective.
    done = start(run_dir.parent / (run_dir.name + "-resume"), "--resume", str(run_dir), "--hang-timeout", "0").wait()
    assert done.rc == 0, done.stderr[-3000:]
    assert losses(run_dir) == reference
    record(fault, run, line, lost=reached - saved, exact=True)


def record(fault: str, run: Run, line: str, *, lost: int | None, exact: bool | None) -> None:
    took = run.exit_after_fault_s if run.stamp.is_file() else None
    TABLE.append({"fault": fault, "exit_status": run.rc, "exit_after_s": took, "message": line,
                  "steps_lost": lost, "resume_exact": exact})


@pytest.fixture(scope="module", autouse=True)
def table():
    yield
    if os.environ.get("SHOAL_FAULT_TABLE"):
        Path(os.environ["SHOAL_FAULT_TABLE"]).write_text(json.dumps(TABLE, indent=1))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("faults") / "unbroken"
    run = start(out).wait()
    assert run.rc == 0, run.stderr[-3000:]
    result = losses(out)
    assert sorted(result) == list(range(1, STEPS + 1))
    return result


@pytest.mark.parametrize("fault, victim", [  # one in every CI run; the other places in `make test-slow`
    ("kill@forward:rank=1:step=4", 1),
    pytest.param("kill@backward:rank=0:step=4", 0, marks=pytest.mark.slow),
    pytest.param("kill@collective:rank=1:step=4", 1, marks=pytest.mark.slow),
])
def test_killed_rank(tmp_path, reference, fault, victim):
    run = start(tmp_path / "run", fault=fault).wait()
    assert run.rc == 1
    line = run.error_line()
    assert f"rank {victim} of 2 failed" in line and "SIGKILL" in line.replace("signal 9", "SIGKILL"), line
    assert run.exit_after_fault_s < EXIT_S
    assert latest_step(tmp_path / "run") == 4  # checkpoints every 2 steps
    resume_exactly(tmp_path / "run", reference, fault, run, line)


def test_crashed_rank(tmp_path, reference):
    run = start(tmp_path / "run", fault="raise@forward:rank=1:step=3").wait()
    assert run.rc == 1
    line = run.error_line()
    assert "rank 1 of 2 failed" in line and "injected fault" in line, line
    assert run.exit_after_fault_s < EXIT_S
    resume_exactly(tmp_path / "run", reference, "raise@forward:rank=1:step=3", run, line)


def test_killed_during_checkpoint_write(tmp_path, reference):
    run = start(tmp_path / "run", fault="kill@checkpoint:rank=1:step=4").wait()
    line = run.error_line()
    assert run.rc == 1 and "rank 1 of 2 failed" in line
    assert run.exit_after_fault_s < EXIT_S
    # The half-written step-4 checkpoint never became `latest`; resume takes step 2.
    assert latest_step(tmp_path / "run") == 2
    resume_exactly(tmp_path / "run", reference, "kill@checkpoint:rank=1:step=4", run, line)


def test_disk_full_during_checkpoint_write(tmp_path, reference):
    run = start(tmp_path / "run", fault="enospc@checkpoint:rank=1:step=4").wait()
    assert run.rc == 1
    line = run.error_line()
    assert "step_00000004" in line and "rank 1" in line and "No space left on device" in line, line
    assert run.exit_after_fault_s < EXIT_S
    assert latest_step(tmp_path / "run") == 2
    resume_exactly(tmp_path / "run", reference, "enospc@checkpoint:rank=1:step=4", run, line)


def test_frozen_rank_is_named(tmp_path, reference):
    run = start(tmp_path / "run", "--hang-timeout", "3", fault="stop@backward:rank=1:step=4").wait()
    assert run.rc == 1
    line = run.error_line()
    # Rank 1's last report is from within a beat (0.25 s) of its freeze: step 4, starting it
    # (zero_grad, forward) or already in the backward where it froze.
    assert re.search(r"rank\(s\) 1 stopped answering: rank 1 \(pid \d+ on .+\) last reported \d+ s ago: "
                     r"step 4, (forward|backward|optimizer)", line), line
    assert "rank 0 waited 3 s" in line
    # 3 s of collective timeout, 3 s to see which counter stopped, then the launcher's shutdown.
    assert run.exit_after_fault_s < 3 + EXIT_S
    resume_exactly(tmp_path / "run", reference, "stop@backward:rank=1:step=4 (--hang-timeout 3)", run, line)


def test_sigterm_to_one_rank_stops_with_a_checkpoint(tmp_path, reference):
    run = start(tmp_path / "run", fault="term@step:rank=1:step=4").wait()
    assert run.rc == 75, run.stderr[-3000:]
    # The signal came before step index 4 ran: that step finishes, is saved, and the run stops.
    assert "shoal: stopped by SIGTERM after step 5" in run.stdout
    assert latest_step(tmp_path / "run") == 5
    assert run.exit_after_fault_s < EXIT_S
    resume_exactly(tmp_path / "run", reference, "term@step:rank=1:step=4", run,
                   next(x for x in run.stdout.splitlines() if x.startswith("shoal: stopped")))


@pytest.mark.parametrize("how", ["SIGTERM to shoal train",
                                 pytest.param("Ctrl-C (SIGINT to the process group)", marks=pytest.mark.slow)])
def test_signal_to_the_launcher_stops_with_a_checkpoint(tmp_path, reference, how):
    out = tmp_path / "run"
    run = start(out, "--steps", "400", new_session=True)  # long enough to be stopped in the middle
    while not (out / "metrics.jsonl").is_file() or len(losses(out)) < 3:
        assert run.proc.poll() is None, "the run ended before the signal"
        time.sleep(0.1)
    sent = time.time()
    if how.startswith("SIGTERM"):
        run.proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(run.proc.pid, signal.SIGINT)
    run.wait()
    name = "SIGTERM" if how.startswith("SIGTERM") else "SIGINT"
    assert run.rc == 75, run.stderr[-3000:]
    assert f"shoal: stopped by {name} after step" in run.stdout
    assert run.t_end - sent < EXIT_S
    assert "Traceback" not in run.stderr
    stopped_at = latest_step(out)
    assert sorted(losses(out)) == list(range(1, stopped_at + 1))  # every step up to the stop, once
    run.t_end, run.stamp = run.t_end, out.parent / "sent"
    run.stamp.write_text(repr(sent))
    record(how, run, next(x for x in run.stdout.splitlines() if x.startswith("shoal: stopped")), lost=0, exact=None)


def test_second_signal_exits_at_once(tmp_path):
    # One rank's handler alone: the first SIGTERM is noted, a second one a second later kills.
    code = ("import os, signal, time\n"
            "from shoal.train.preempt import StopSignals\n"
            "s = StopSignals()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(0.1)\n"
            "print(s.signum, flush=True)\n"
            "time.sleep(1.2)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(5)\n"
            "print('still running')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == [str(int(signal.SIGTERM))]
    assert done.returncode == -signal.SIGTERM


def test_max_restarts_resumes_by_itself(tmp_path, reference):
    out = tmp_path / "run"
    run = start(out, "--max-restarts", "1", fault="kill@forward:rank=1:step=5").wait()
    assert run.rc == 0, run.stderr[-3000:]
    assert losses(out) == reference  # no step counted twice (losses() checks), the exact curve
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("restart")] == [5]  # resumed from the step-4 checkpoint
    record("kill@forward:rank=1:step=5 with --max-restarts 1", run, "(finished, rc 0)", lost=1, exact=True)


def test_pipeline_failures_name_the_stage_and_micro_batch(tmp_path):
    """Under pp2 a frozen stage ends the run naming the stage and micro-batch the other one waits
    for; a killed stage ends it at once, with its last report (a beat old at most)."""
    run = start(tmp_path / "frozen", "--plan", "pp2", "--hang-timeout", "3", fault="stop@forward:rank=1:step=4").wait()
    line = run.error_line()
    assert run.rc == 1 and "rank(s) 1 stopped answering" in line, line
    whole = (tmp_path / "frozen" / "error.log").read_text() if "whole message in" in line else line
    # 1F1B on 2 stages: stage 0 runs F0, F1, then needs micro-batch 0's gradient from stage 1.
    assert "rank 0 waited 3 s in pipeline stage 0, waiting for the gradient of micro-batch 0 from " \
           "stage 1 (rank 1)" in whole, whole
    assert run.exit_after_fault_s < 3 + EXIT_S
    record("stop@forward:rank=1:step=4 under pp2 (--hang-timeout 3)", run, line, lost=None, exact=None)
    run = start(tmp_path / "killed", "--plan", "pp2", fault="kill@forward:rank=1:step=4").wait()
    line = run.error_line()
    assert run.rc == 1 and "rank 1 of 2 failed" in line and "it last reported step" in line, line
    assert run.exit_after_fault_s < EXIT_S
    record("kill@forward:rank=1:step=4 under pp2", run, line, lost=None, exact=None)


def test_watchdog_reads_no_threads_stack():
    """Where a rank is comes from what its main thread reports (Runtime.step_words, read by the beat thread): the
    watchdog's beat reads no other thread's stack. The collective the failing rank waited in is named from the
    error's own traceback."""
    import types

    from shoal.infra import watchdog
    from shoal.runtime import Runtime

    dog = watchdog.Watchdog.__new__(watchdog.Watchdog)  # its report words alone: no store, no thread
    dog.phase, dog.detail = "step", lambda: None
    runtime = types.SimpleNamespace(part="backward", where=lambda: None)
    dog.in_step = lambda: Runtime.step_words(runtime)  # type: ignore[arg-type]
    assert dog._where() == "backward"
    runtime.part, runtime.where = "forward", lambda: "pipeline stage 1, forward of micro-batch 2"
    assert dog._where() == "pipeline stage 1, forward of micro-batch 2"
    runtime.part = "optimizer"
    assert dog._where() == "optimizer"
    dog.phase, dog.detail = "evaluation", lambda: "pipeline stage 0"
    assert dog._where() == "evaluation, pipeline stage 0"

    fake: dict = {}
    exec(compile("def all_reduce():\n    raise RuntimeError('timed out')\n", "/x/torch/distributed/distributed_c10d.py",
                 "exec"), fake)
    try:
        fake["all_reduce"]()
    except RuntimeError as error:
        assert watchdog._collective(watchdog._traceback_stack(error)) == "all_reduce"
    try:
        raise RuntimeError("not a collective")
    except RuntimeError as error:
        assert watchdog._collective(watchdog._traceback_stack(error)) is None
    assert "_current_frames" not in open(watchdog.__file__).read()
