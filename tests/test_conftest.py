"""The test scheduler's cost table (``FILE_COST_S`` in ``conftest.py``) names test files that exist: a file renamed
or split would otherwise fall back to "light" silently, and run last."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_file_the_cost_table_names_exists():
    tree = ast.parse((TESTS / "conftest.py").read_text())
    table = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "FILE_COST_S" for t in node.targets))
    names = ast.literal_eval(table)
    missing = sorted(name for name in names if not (TESTS / name).is_file())
    assert not missing, f"conftest.FILE_COST_S names test files that do not exist: {missing}"
