"""``rloo_lightning.algo`` is the pure mathematics: each of its modules imports only torch, the standard library and
other ``algo`` modules, so it reads (and is tested) without Lightning, transformers or the rest of the package.

Imports are read with :mod:`ast` from the source, every ``import`` anywhere in a file (inside functions and
``if TYPE_CHECKING:`` blocks too): a lazy import of transformers is still a dependency.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ALGO = Path(__file__).resolve().parent.parent / "rloo_lightning" / "algo"
ALLOWED_ROOTS = {"torch", "__future__"} | set(sys.stdlib_module_names)


def foreign_imports(source: str, filename: str = "<source>") -> list[str]:
    """``"file:line: import name"`` for each import of ``source`` outside torch, the standard library and
    ``rloo_lightning.algo`` (relative imports stay inside the package folder: only ``from . import`` is allowed)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1:  # ``from .kl import ...``: a sibling in algo/
                continue
            names = ["." * node.level + (node.module or "")]
        else:
            continue
        for name in names:
            if name.split(".")[0] in ALLOWED_ROOTS or name == "rloo_lightning.algo" \
                    or name.startswith("rloo_lightning.algo."):
                continue
            found.append(f"{filename}:{node.lineno}: import {name}")
    return found


def test_algo_modules_import_only_torch_the_standard_library_and_each_other():
    files = sorted(ALGO.glob("*.py"))
    assert {f.stem for f in files} >= {"advantages", "kl", "losses", "correction", "logprobs", "shaping"}
    offenders = [hit for path in files for hit in foreign_imports(path.read_text(), path.name)]
    assert not offenders, "rloo_lightning.algo is torch and the standard library only:\n" + "\n".join(offenders)


def test_a_planted_foreign_import_is_named():
    """The check itself: a transformers import anywhere (here inside a function) fails, naming file and import."""
    planted = (ALGO / "kl.py").read_text() + "\n\ndef _late():\n    import transformers\n"
    hits = foreign_imports(planted, "kl.py")
    assert len(hits) == 1 and hits[0].startswith("kl.py:") and hits[0].endswith("import transformers")
    assert foreign_imports("from rloo_lightning.rollout import Rollout", "x.py") == [
        "x.py:1: import rloo_lightning.rollout"]
    assert foreign_imports("from ..module import RLOOModule", "x.py") == ["x.py:1: import ..module"]
    assert foreign_imports("import math\nimport torch.nn\nfrom .kl import fold_kl\n"
                           "from rloo_lightning.algo.logprobs import masked_sum") == []
