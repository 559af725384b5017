"""What the command line tells the user when something is wrong: the exit codes, `UserError`, and the one-line
`fail` and `warn` messages. A leaf: every command imports it; it imports nothing of shoal."""

from __future__ import annotations

import os
import sys
from pathlib import Path

USER_ERROR = 2
RUN_FAILED = 1


class UserError(ValueError):
    """A mistake in the user's input: reported in one line, exit status 2."""


MAX_ERROR = 400
"""Characters of an error line (a hang's diagnosis names the silent rank and where the waiting
one was); a longer message is cut there, and written whole to the run folder's error.log when
there is a run folder."""


def fail(message: str, status: int, run_dir: str | Path | None = None) -> int:
    """Print `shoal: error: <message>` on one line (under torchrun, on rank 0 only); returns `status`."""
    if os.environ.get("RANK", "0") != "0":
        return status
    message = " ".join(message.split())
    if len(message) > MAX_ERROR and run_dir is not None and Path(run_dir).is_dir():
        log = Path(run_dir) / "error.log"
        with open(log, "a", encoding="utf-8") as f:
            f.write(message + "\n")
        message = message[:MAX_ERROR].rsplit(" ", 1)[0] + f" ... (whole message in {log})"
    print(f"shoal: error: {message}", file=sys.stderr, flush=True)
    return status


def warn(message: str) -> None:
    """Print `shoal: warning: <message>` on one line (under torchrun, on rank 0 only)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"shoal: warning: {' '.join(message.split())}", file=sys.stderr, flush=True)
