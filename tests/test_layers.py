"""The layers below the parallel engine import nothing of torch.distributed, function-local imports included:
the models, the MoE layer, the plan, the rules, the planner, the data and the loss's leaf run the same in one
process as under any plan. (The import order between shoal's own packages is `make lint`'s import-linter
contracts, in pyproject.toml; those cannot name a part of an external package, so this test names it.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "shoal"
UNDISTRIBUTED = ["models", "moe", "data", "planner", "plan.py", "rules.py", "loss.py"]


def distributed_imports(path: Path) -> list[str]:
    """`file:line` of every import of torch.distributed in the file, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
            found.append(f"{path.name}:{node.lineno}")
    return found


@pytest.mark.parametrize("place", UNDISTRIBUTED)
def test_imports_nothing_distributed(place):
    files = sorted((SRC / place).rglob("*.py")) if (SRC / place).is_dir() else [SRC / place]
    assert files, place
    assert [hit for f in files for hit in distributed_imports(f)] == []


def test_the_check_sees_a_function_local_import(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from torch import distributed\n    import torch.distributed.tensor as t\n")
    assert distributed_imports(planted) == ["planted.py:2", "planted.py:3"]
