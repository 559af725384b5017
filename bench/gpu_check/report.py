"""The report: one JSON file that each finished part is added to, and its markdown rendering.

The JSON is the record (`{"device": ..., "runs": [...], "parts": {name: result}}`); the markdown
is rewritten from it after every part, so both always hold everything that finished. A part run
again replaces its earlier entry. File names stay within letters, digits, '.', '_' and '-': the GPU
machine returns nothing else.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

JSON_NAME = "gpu_check.json"
MARKDOWN_NAME = "gpu_check.md"
MAX_FILES = 8
"""Files the GPU machine returns from --out at most."""
_SAFE = re.compile(r"[A-Za-z0-9._-]+")


def safe_name(text: str) -> str:
    """`text` with every character the GPU machine's file transfer refuses replaced by '-'."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")
    if not name:
        raise ValueError(f"no usable file name in {text!r}; valid: letters, digits, '.', '_' and '-'")
    return name


def check_out_dir(out: Path) -> list[str]:
    """Problems with the files under `out` as the GPU machine would return them (empty: none)."""
    files = [p for p in out.rglob("*") if p.is_file()]
    problems = [f"{p.name}: name outside [A-Za-z0-9._-]" for p in files if not _SAFE.fullmatch(p.name)]
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files under {out}; at most {MAX_FILES} come back")
    return problems


def load(out: Path) -> dict[str, Any]:
    path = out / JSON_NAME
    if path.exists():
        return json.loads(path.read_text())
    return {"device": None, "runs": [], "parts": {}}


def add_part(out: Path, header: dict[str, Any], name: str, result: dict[str, Any]) -> None:
    """Add (or replace) one part's result and rewrite both files."""
    report = load(out)
    report["device"] = header.get("device") or report.get("device")
    if not report["runs"] or report["runs"][-1] != header:
        report["runs"].append(header)
    report["parts"][name] = result
    write(out, report)


def write(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / JSON_NAME).write_text(json.dumps(report, indent=1, default=str))
    (out / MARKDOWN_NAME).write_text(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    """The report for a reader: device and runs, one line per part, then each part's checks and figures."""
    lines = ["# GPU check", "", f"device: {report.get('device') or 'none (dry run)'}", ""]
    for run in report.get("runs", []):
        lines.append(f"- run {run.get('started')}: `{' '.join(run.get('argv', []))}` torch {run.get('torch')}"
                     + (" (dry run)" if run.get("dry_run") else ""))
    lines += ["", "| part | status | wall s | budget s | checks passed |", "|---|---|---|---|---|"]
    for name, part in report.get("parts", {}).items():
        checks = part.get("checks", [])
        passed = sum(1 for c in checks if c.get("ok"))
        lines.append(f"| {name} | {part.get('status')} | {part.get('wall_s', 0):.1f} | {part.get('budget_s')} | "
                     f"{passed}/{len(checks)} |")
    for name, part in report.get("parts", {}).items():
        lines += ["", f"## {name}: {part.get('status')}", "", part.get("about", "")]
        if part.get("error"):
            lines += ["", "```", str(part["error"])[-2000:], "```"]
        for c in part.get("checks", []):
            mark = "ok" if c.get("ok") else ("goal not met" if c.get("goal") else "FAILED")
            lines.append(f"- [{mark}] {c.get('name')}: {c.get('detail', '')}")
        for title, rows in part.get("tables", {}).items():
            lines += ["", f"{title}:", "", *_table(rows)]
        if part.get("figures"):
            lines += ["", "```json", json.dumps(part["figures"], indent=1, default=str)[:6000], "```"]
    return "\n".join(lines) + "\n"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["(none)"]
    keys = list(dict.fromkeys(k for row in rows for k in row))
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        out.append("| " + " | ".join(_fmt(row.get(k, "")) for k in keys) + " |")
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "/")
