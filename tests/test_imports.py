"""The package's import structure: no import cycles, and ``__init__.py`` files only re-export.

The import graph is read with :mod:`ast` from the source, not from ``sys.modules``: every
``import`` / ``from ... import`` anywhere in a file counts, inside functions, methods and
``if TYPE_CHECKING:`` blocks included, because a function-level import that closes a cycle only
hides it until some entry point imports the modules in the other order.

Edges: ``import a.b.c`` and ``from a.b.c import x`` point at ``a.b.c`` only (not at the
``__init__`` of ``a`` or ``a.b``, which Python runs first but which must not depend back on
``a.b.c`` for this to be acyclic anyway); ``from a.b import c`` points at ``a.b.c`` when
``a/b/c.py`` (or ``a/b/c/__init__.py``) exists, else at ``a.b``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "rloo_lightning"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def _modules() -> dict[str, Path]:
    """``{dotted module name: file}`` for every ``.py`` file of the package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    """The absolute module a ``from ... import`` reads from (relative imports resolved)."""
    if node.level == 0:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of this package it imports}``."""
    modules = _modules()

    def target(name: str) -> str | None:
        # The module itself, or (for ``import pkg.mod.attr``-like oddities) its longest module prefix.
        parts = name.split(".")
        while parts:
            candidate = ".".join(parts)
            if candidate in modules:
                return candidate
            parts.pop()
        return None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(node, module, is_package)
                if source is None:
                    continue
                names = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                    for alias in node.names
                ]
            else:
                continue
            for name in names:
                if name == PACKAGE or name.startswith(PACKAGE + "."):
                    t = target(name)
                    if t is not None and t != module:
                        edges.add(t)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle ``[a, b, ..., a]`` of ``graph``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_graph_is_read():
    """The graph sees function-level imports and ``from pkg import submodule`` as module edges."""
    graph = import_graph()
    assert f"{PACKAGE}.module" in graph and f"{PACKAGE}.runtime.workers" in graph
    # from rloo_lightning.models import sharding
    assert f"{PACKAGE}.models.sharding" in graph[f"{PACKAGE}.policy_module"]
    assert f"{PACKAGE}.module" in graph[f"{PACKAGE}.verify.exactness"]  # imported inside a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"b"}}) is None


def test_no_import_cycles():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _is_simple_assignment(node: ast.stmt) -> bool:
    """``NAME = <literal>`` (``__all__ = [...]``, ``__version__ = "1.0"``)."""
    if isinstance(node, ast.Assign):
        targets, value = node.targets, node.value
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        targets, value = [node.target], node.value
    else:
        return False
    if not all(isinstance(t, ast.Name) for t in targets):
        return False
    try:
        ast.literal_eval(value)
    except ValueError:
        return False
    return True


def _is_collector_pause(node: ast.stmt) -> bool:
    """The package's one exception: its top ``__init__.py`` pauses the cyclic collector while it imports
    (``_gc.disable()``, then a ``try`` of imports only whose ``finally`` resumes it as it was)."""
    if isinstance(node, (ast.Expr, ast.Assign)):
        return ast.unparse(node) in ("_collecting = _gc.isenabled()", "_gc.disable()")
    return isinstance(node, ast.Try) and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in node.body) \
        and not node.handlers and "_gc.enable()" in ast.unparse(node.finalbody)


def test_init_files_only_re_export():
    offenders = []
    for path in sorted(ROOT.rglob("__init__.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str)
            if docstring or isinstance(node, (ast.Import, ast.ImportFrom)) or _is_simple_assignment(node):
                continue
            if path == ROOT / "__init__.py" and _is_collector_pause(node):
                continue
            offenders.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {type(node).__name__}")
    assert not offenders, (
        "__init__.py files hold only a docstring, imports, __all__ and simple assignments; move the rest "
        "into a module named by its role:\n" + "\n".join(offenders)
    )


def test_no_module_of_the_package_is_over_500_lines_and_the_step_over_450():
    """A reader meets modules of one concern each; module.py (the step) reads top to bottom."""
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long
    assert len((ROOT / "module.py").read_text().splitlines()) <= 450


@pytest.mark.slow  # a fresh interpreter: what importing the package does to the collector
def test_importing_the_package_runs_no_full_collection_and_leaves_the_collector_on():
    code = ("import gc\n"
            "before = gc.get_stats()[2]['collections']\n"
            "import rloo_lightning\n"
            "print(gc.get_stats()[2]['collections'] - before, gc.isenabled())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1")).stdout.split()
    assert out == ["0", "True"], out  # 6 full collections while torch, lightning and transformers load, unpaused


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("fails", [False, True], ids=["imports", "an-import-fails"])
def test_the_package_leaves_the_collector_as_it_found_it(monkeypatch, enabled, fails):
    """The package's ``__init__`` run again (its modules already imported), the collector on or off before it, and
    with one of its imports failing: the collector is left as it was."""
    import gc
    import importlib

    import rloo_lightning

    if fails:
        monkeypatch.setitem(sys.modules, "rloo_lightning.rollout", None)  # `from rloo_lightning.rollout import` fails
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        if fails:
            with pytest.raises(ImportError):
                importlib.reload(rloo_lightning)
        else:
            importlib.reload(rloo_lightning)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
