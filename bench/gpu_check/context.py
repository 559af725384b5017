"""What a part sees: where it runs (CUDA, or the CPU in a dry run), and where it records its results."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Context:
    """One part's run. `dry`: no CUDA; run the CPU side at toy sizes. Results are collected in
    `checks` (pass/fail; `goal=True` marks a performance goal rather than a correctness check),
    `figures` (anything measured) and `tables` (rows for the markdown)."""

    dry: bool
    out: Path
    checks: list[dict[str, Any]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    save_to: Path | None = None
    """Where each check is saved as it is made, so that a part stopped at its budget keeps what it found."""
    deadline: float = math.inf
    """time.monotonic() at which the part is stopped: a part of many runs starts one only while it fits."""

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        if self.save_to is not None:
            self.save_to.write_text(json.dumps({"status": "partial", "error": None, **self.result()}, default=str))

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    def check(self, name: str, ok: bool, detail: str = "", *, goal: bool = False) -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail, "goal": goal})
        print(f"  [{'ok' if ok else ('goal not met' if goal else 'FAILED')}] {name}: {detail}", flush=True)
        self.save()
        return bool(ok)

    def result(self) -> dict[str, Any]:
        return {"checks": self.checks, "figures": self.figures, "tables": self.tables}


def offline_env() -> dict[str, str]:
    """This process's environment with Hugging Face's libraries kept offline (the GPU machine reaches nothing)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run_command(cmd: list[str], *, timeout_s: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """(exit status, the output's last 4,000 characters) of a command run from the repository root."""
    full_env = {**offline_env(), **(env or {})}
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=full_env, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return 124, (text + f"\n(no result after {timeout_s:.0f} s)")[-4000:]
    return done.returncode, (done.stdout + done.stderr)[-4000:]


def stream_command(cmd: list[str], *, deadline: float, on_line: Callable[[str], None]) -> tuple[int, str]:
    """(exit status, the output's last 4,000 characters) of a command run from the repository root, each line
    printed and handed to `on_line` as it comes; the command and its children are stopped at `deadline`
    (time.monotonic()), exit status 124."""
    full_env = {**offline_env(), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    stopped = threading.Event()

    def stop() -> None:
        stopped.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(max(deadline - time.monotonic(), 0.0), stop)
    timer.start()
    tail: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            tail = (tail + [line])[-200:]
            on_line(line.rstrip("\n"))
        proc.wait()
    finally:
        timer.cancel()
    text = "".join(tail) + ("\n(stopped at the part's deadline)" if stopped.is_set() else "")
    return (124 if stopped.is_set() else proc.returncode), text[-4000:]


def shoal_command(*args: str) -> list[str]:
    """`shoal ...` as installed (the GPU machine runs it directly), else through this Python."""
    return [sys.executable, "-m", "shoal", *args]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
