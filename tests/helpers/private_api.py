"""The private names of other libraries that a source file uses, for ``tests/test_framework.py``: the package
reaches them only through ``rloo_lightning/runtime/framework.py``."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

__all__ = ["OWN_PRIVATE_NAMES", "private_uses", "seam_names"]

OWN_PRIVATE_NAMES = {
    # this package's own private names, reached on an object other than self
    "_serve", "_import_object",  # its own modules' helpers
    "_given_args",  # set on an engine by its own engine_spec
    "_rloo_asleep",  # set on vLLM's LLM by its own child process
}
PUBLIC_UNDERSCORED = {"os._exit"}  # documented public APIs that start with an underscore


def seam_names(seam: Path) -> set[str]:
    """The private names the seam wraps: what it reaches after a dot, imports, or names in a string."""
    names = set()
    tokens = list(tokenize.generate_tokens(io.StringIO(seam.read_text()).readline))
    for i, tok in enumerate(tokens):
        text = tok.string.strip("\"'") if tok.type == tokenize.STRING else tok.string
        if not text.startswith("_") or text.startswith("__") or not text.isidentifier():
            continue
        after_dot = tok.type == tokenize.NAME and i and tokens[i - 1].string == "."
        if after_dot or tok.type == tokenize.STRING or (tok.type == tokenize.NAME and tokens[i - 1].string == "import"):
            names.add(text)
    return names


def private_uses(path: Path, root: Path, seam_names: set[str]) -> list[str]:
    """``file:line: what`` for each private name of another library used in ``path``: a private module or name
    imported, an attribute reached on an object other than ``self`` / ``cls`` (or through ``getattr`` and its
    kind), or a name the seam wraps reached on ``self`` where the file does not define it (a subclass of a framework
    class reading its base's internals). Strings and comments aside."""
    source = path.read_text()
    where = f"{path.relative_to(root)}"
    tree = ast.parse(source, str(path))
    found: list[tuple[int, str]] = []

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__") and name not in OWN_PRIVATE_NAMES

    import_lines: set[int] = set()
    defined: set[str] = set()  # what this file defines: its own methods and self attributes
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            import_lines.update(range(node.lineno, node.end_lineno + 1))
            module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
            if isinstance(node, ast.ImportFrom) and (node.level or module.split(".")[0] == "rloo_lightning"):
                continue  # this package's own modules
            names = [alias.name for alias in node.names]
            dotted = [part for name in [module, *names] for part in name.split(".")]
            if any(private(part) for part in dotted):
                what = f"from {module} import {', '.join(names)}" if module else f"import {', '.join(names)}"
                found.append((node.lineno, what))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)

    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)]
    for i, tok in enumerate(tokens):
        line = tok.start[0]
        if line in import_lines:
            continue
        if tok.type == tokenize.NAME and i >= 2 and tokens[i - 1].string == "." and private(tok.string):
            receiver = tokens[i - 2].string
            if f"{receiver}.{tok.string}" in PUBLIC_UNDERSCORED or receiver == "rloo_lightning":
                continue
            if receiver not in ("self", "cls") or (tok.string in seam_names and tok.string not in defined):
                found.append((line, f"{receiver}.{tok.string}"))
        elif tok.type == tokenize.STRING and i >= 4 and tokens[i - 1].string == "," and tokens[i - 3].string == "(" \
                and tokens[i - 4].string in ("getattr", "hasattr", "setattr", "delattr"):
            name, receiver = tok.string.strip("\"'"), tokens[i - 2].string
            if private(name) and (receiver not in ("self", "cls") or (name in seam_names and name not in defined)):
                found.append((line, f"{tokens[i - 4].string}({receiver}, {tok.string})"))
    return [f"{where}:{line}: {what}" for line, what in sorted(found)]
