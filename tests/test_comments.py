"""tools/check-comments: a date in a comment or docstring fails the check; citations and code strings do not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "check-comments"

CLEAN = '''"""A module that cites its sources: 1F1B (Narayanan et al. 2021, arXiv 2104.04473)."""

STAMP = "2026-11-27"  # a date in a value is data, not a note
"""The format of a run's stamp: YYYY-MM-DD."""


def f() -> str:
    """Returns the stamp; bench/engine_overhead.py measures what it costs."""
    return "on 2026-11-27"  # a string the code returns
'''

DATED = {
    "# measured on 2026-11-27: 54 against 37 ms\n": 1,
    'def f() -> None:\n    """Faster since the November 2026 run."""\n': 2,
    'X = 1\n"""Chosen in 2026-11, see the logs."""\n': 2,
    '"""Module.\n\nSeen on 11/27/2026 in a core dump.\n"""\n': 3,
    "def g() -> None:\n    pass  # Nov. 2026: rewritten\n": 2,
}


def _run(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *map(str, paths)], capture_output=True, text=True)


def test_a_clean_file_passes(tmp_path):
    path = tmp_path / "clean.py"
    path.write_text(CLEAN)
    done = _run(path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == ""


def test_each_planted_date_fails_naming_its_line(tmp_path):
    for i, (text, line) in enumerate(DATED.items()):
        path = tmp_path / f"dated_{i}.py"
        path.write_text(text)
        done = _run(path)
        assert done.returncode == 1, text
        assert done.stdout.startswith(f"{path}:{line}: "), (text, done.stdout)
        assert len(done.stdout.splitlines()) == 1, done.stdout


def test_a_folder_is_searched_for_python_files(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "clean.py").write_text(CLEAN)
    (tmp_path / "pkg" / "dated.py").write_text("x = 1  # since 2026-11-27\n")
    (tmp_path / "pkg" / "notes.txt").write_text("2026-11-27\n")
    done = _run(tmp_path / "pkg")
    assert done.returncode == 1
    assert done.stdout.splitlines() == [f"{tmp_path / 'pkg' / 'dated.py'}:1: # since 2026-11-27"]
