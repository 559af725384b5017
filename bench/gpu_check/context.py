"""What a part sees: where it runs (CUDA, or the CPU in a dry run), and where it records its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    def check(self, name: str, ok: bool, detail: str = "", *, goal: bool = False) -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail, "goal": goal})
        print(f"  [{'ok' if ok else ('goal not met' if goal else 'FAILED')}] {name}: {detail}", flush=True)
        return bool(ok)

    def result(self) -> dict[str, Any]:
        return {"checks": self.checks, "figures": self.figures, "tables": self.tables}


def run_command(cmd: list[str], *, timeout_s: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """(exit status, the output's last 4,000 characters) of a command run from the repository root."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=full_env, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return 124, (text + f"\n(no result after {timeout_s:.0f} s)")[-4000:]
    return done.returncode, (done.stdout + done.stderr)[-4000:]


def shoal_command(*args: str) -> list[str]:
    """`shoal ...` as installed (the GPU machine runs it directly), else through this Python."""
    return [sys.executable, "-m", "shoal", *args]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
