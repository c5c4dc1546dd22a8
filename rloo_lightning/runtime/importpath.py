"""The working directory on ``sys.path``: a user's ``myreward.py`` next to their data is importable.

``rloo-lightning`` (an entry-point script) does not put the working directory on ``sys.path`` the
way ``python -m`` does, so ``--model.rewards.funcs '[myreward.score]'`` would fail with ``No module
named 'myreward'``. :func:`add_cwd_to_sys_path` appends it at the *end* (a user's ``datasets.py``
cannot shadow the installed ``datasets``) and warns about files in it named like a module the package
imports. It runs at the start of :func:`rloo_lightning.cli.main` (so again in every DDP rank, which
Lightning starts by re-running the command) and in every reward worker process, with the parent's
working directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["DEPENDENCIES", "add_cwd_to_sys_path", "shadowing_files"]

# Top-level modules the package imports (checked even when not imported yet).
DEPENDENCIES = frozenset({
    "torch", "lightning", "transformers", "datasets", "tokenizers", "huggingface_hub", "safetensors",
    "jsonargparse", "yaml", "numpy", "pandas", "pyarrow", "accelerate", "peft", "gguf", "tensorboard",
})


def _within(file: str | None, folder: Path) -> bool:
    if not file:
        return False
    try:
        return Path(file).resolve().is_relative_to(folder)
    except (OSError, ValueError):
        return False


def shadowing_files(cwd: str | os.PathLike) -> list[str]:
    """Files / packages in ``cwd`` named like a dependency or an imported top-level module.

    A module that was itself loaded from ``cwd`` (the package's own source tree, run from the repo)
    is no clash, unless it is a dependency (then the user's file did shadow it).
    """
    folder = Path(cwd).resolve()
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    names = {name.partition(".")[0] for name in list(sys.modules)} - {"__main__", "__mp_main__"}
    out = []
    for entry in sorted(entries):
        if entry.suffix == ".py" and entry.is_file():
            name = entry.stem
        elif entry.is_dir() and (entry / "__init__.py").is_file():
            name = entry.name
        else:
            continue
        if name not in names and name not in DEPENDENCIES:
            continue
        module = sys.modules.get(name)
        if name == "rloo_lightning" or (
            name not in DEPENDENCIES and module is not None and _within(getattr(module, "__file__", None), folder)
        ):
            continue
        out.append(entry.name)
    return out


def add_cwd_to_sys_path(cwd: str | os.PathLike | None = None, warn: bool = True) -> str:
    """Append ``cwd`` (default: the working directory) to the end of ``sys.path``; warn on stderr (one
    line per file) about files there that are named like an installed module the package uses."""
    cwd = os.path.abspath(cwd if cwd is not None else os.getcwd())
    present = {os.path.abspath(p or os.curdir) for p in sys.path}
    if cwd not in present:
        sys.path.append(cwd)
    if warn:
        for name in shadowing_files(cwd):
            module = name.removesuffix(".py")
            print(f"warning: {os.path.join(cwd, name)} has the name of the module {module!r} that rloo_lightning "
                  f"uses; an import path '{module}.…' means that module, not this file: rename it",
                  file=sys.stderr)
    return cwd
